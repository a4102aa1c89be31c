"""TensorBoard and Weights & Biases (offline) logging from a real step-1 run: both hold what
metrics.jsonl holds."""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import FAST, assert_ok, step1


def test_tensorboard_and_offline_wandb(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = step1(out, *FAST, "--max_steps", "3", "--log_interval", "1", "--enable_tensorboard", "--enable_wandb",
                 env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})  # fmt: skip
    assert_ok(proc)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]

    # TensorBoard: every train scalar at every step, with the value written to metrics.jsonl
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train]
    assert {"train/lr", "eval/loss"} <= set(events.Tags()["scalars"])

    # W&B offline: the run's record file (protobuf records; history values are JSON text in it) holds
    # every logged train loss and the run's options as its config
    (record,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    assert all(json.dumps(r["loss"]).encode() in data for r in train)
    assert b"train/loss" in data and b"learning_rate" in data and b"max_steps" in data


def test_a_resumed_run_logs_to_the_wandb_run_it_started(tmp_path):
    """The W&B run id is kept in the checkpoint: the resumed process's offline run has the interrupted
    one's id (W&B then merges them into one run; it used to open a second run)."""
    out = tmp_path / "run"
    flags = [*FAST, "--max_steps", "4", "--save_steps", "2", "--log_interval", "1", "--enable_wandb"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = step1(out, *flags, env={**env, "DSCHAT_TEST_EXIT_AFTER_SAVE": "2"})
    assert proc.returncode == 17, proc.stderr[-2000:]
    first = {p.name.rsplit("-", 1)[1] for p in (out / "wandb").glob("offline-run-*")}
    assert len(first) == 1
    assert_ok(step1(out, *flags, "--resume", env=env))
    ids = {p.name.rsplit("-", 1)[1] for p in (out / "wandb").glob("offline-run-*")}
    assert ids == first
