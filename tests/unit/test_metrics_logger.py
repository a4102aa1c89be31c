"""dschat.utils.metrics.MetricsLogger: what metrics.jsonl holds after a resume."""

from __future__ import annotations

import json

from dschat.utils.metrics import MetricsLogger


def test_a_resume_drops_the_rows_logged_after_its_checkpoint(tmp_path):
    """An interrupted run logged steps 1-5 (and died writing a sixth row); resumed from the checkpoint of
    step 3 it logs 4 and 5 again: each step is in the file once, in order."""
    rows = [{"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "spl')
    m = MetricsLogger(str(tmp_path), config={}, append=True, keep_through=3)
    for s in (4, 5):
        m.log({"loss": 2.0}, step=s, split="train")
    m.close()
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert got[:3] == rows[:3] and [r["loss"] for r in got[3:]] == [2.0, 2.0]


def test_a_fresh_run_starts_an_empty_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "split": "train"}\n')
    m = MetricsLogger(str(tmp_path), config={}, keep_through=0)
    m.log({"loss": 3.0}, step=1, split="train")
    m.close()
    assert [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3.0]


def test_a_resume_drops_tensorboards_points_logged_after_its_checkpoint(tmp_path):
    """TensorBoard kept the interrupted run's steps 5-6 beside the resumed run's: (5, 5.0), (6, 6.0), then
    (5, 105.0), (6, 106.0). Resumed from the checkpoint of step 4, its points after step 4 are purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(str(tmp_path), config={}, enable_tensorboard=True)
    for s in range(1, 7):
        m.log({"loss": float(s)}, step=s, split="train")
    m.close()
    m = MetricsLogger(str(tmp_path), config={}, enable_tensorboard=True, append=True, keep_through=4)
    for s in range(5, 9):
        m.log({"loss": 100.0 + s}, step=s, split="train")
    m.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert got == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]


def test_steps_sharing_one_tensorboard_path_write_apart(tmp_path):
    """train.py passes `-- --enable_tensorboard --tensorboard_path tb` to every step: all three wrote into one
    directory, steps 1 and 2 both as train/loss, and a resumed step's purge hid the others' points. Each step
    writes under its own name there (DeepSpeed-Chat names each step's job), a run TensorBoard lists apart."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for step, loss in (("step1", 1.0), ("step2", 2.0)):
        m = MetricsLogger(str(tmp_path / "out" / step), config={}, enable_tensorboard=True,
                          tensorboard_path=str(tmp_path / "tb"))  # fmt: skip
        m.log({"loss": loss}, step=1, split="train")
        m.close()
    for step, loss in (("step1", 1.0), ("step2", 2.0)):
        events = EventAccumulator(str(tmp_path / "tb" / step))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, loss)]
