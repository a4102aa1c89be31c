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
