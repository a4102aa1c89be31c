"""TensorBoard and Weights & Biases (offline) logging from a real step-1 run."""

from __future__ import annotations

from tests.integration.helpers import FAST, assert_ok, step1


def test_tensorboard_and_offline_wandb(tmp_path):
    out = tmp_path / "run"
    proc = step1(out, *FAST, "--max_steps", "3", "--log_interval", "1", "--enable_tensorboard", "--enable_wandb",
                 env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})  # fmt: skip
    assert_ok(proc)
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    offline_runs = list((out / "wandb").glob("offline-run-*"))
    assert offline_runs, list(out.iterdir())
