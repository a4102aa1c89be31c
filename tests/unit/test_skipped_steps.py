"""dschat.engine.core.SkippedSteps: the rules over DeepSpeed's two counters (``global_steps``, which counts
every optimizer step taken or skipped, and ``skipped_steps``). A plain object stands in for the engine's
counters; the real engine skipping on NaN gradients is tests/integration/test_step1.py's."""

from __future__ import annotations

import logging

import pytest

from dschat.engine.core import SkippedSteps
from dschat.utils.errors import UserError


class Counters:
    def __init__(self, fp16: bool = False, steps: int = 0, skipped: int = 0) -> None:
        self.global_steps, self.skipped_steps, self.fp16 = steps, skipped, fp16

    def fp16_enabled(self) -> bool:
        return self.fp16

    def step(self, skip: bool, boundary: bool = True) -> None:
        if boundary:
            self.global_steps += 1
            self.skipped_steps += skip


def test_a_taken_step_resets_the_run_of_skips_and_only_a_run_of_limit_stops():
    e = Counters()
    w = SkippedSteps(e, "actor", limit=3)
    for skip in (True, True, False, True, True):  # never 3 in a row
        w.mark()
        e.step(skip)
        assert w.check() is skip
    assert (w.count, w.in_a_row) == (4, 2)
    e.step(True)
    with pytest.raises(UserError, match=r"optimizer step 6: the actor's last 3 updates were all skipped"):
        w.check()


def test_calls_between_accumulation_boundaries_neither_count_nor_reset():
    e = Counters()
    w = SkippedSteps(e, "model", limit=2)
    e.step(True)
    w.check()
    for _ in range(3):  # micro-steps: DeepSpeed's step() returns without a step
        e.step(False, boundary=False)
        w.check()
    e.step(True)
    with pytest.raises(UserError, match="last 2 updates"):
        w.check()


def test_fp16_skips_are_the_loss_scale_search_and_never_stop_the_run(caplog):
    e = Counters(fp16=True)
    w = SkippedSteps(e, "model", limit=2)
    with caplog.at_level(logging.WARNING, logger="dschat"):
        for _ in range(5):
            e.step(True)
            w.check()
    assert w.count == 5 and not caplog.records


def test_a_resumed_engine_counts_on_from_its_checkpoint_and_warns_on_new_skips_only(caplog):
    e = Counters(steps=40, skipped=3)  # restored by DeepSpeed's load_checkpoint
    w = SkippedSteps(e, "critic", limit=8)
    with caplog.at_level(logging.WARNING, logger="dschat"):
        e.step(False)
        w.check()
        assert not caplog.records
        e.step(True)
        w.check()
    assert w.count == 4 and w.in_a_row == 1
    assert "optimizer step 42: DeepSpeed skipped the critic's update" in caplog.text
    assert "4 skipped so far" in caplog.text


def test_counters_a_checkpoint_brings_back_after_the_watch_began_are_not_new_skips(caplog):
    """Step 3 builds its trainer (and the watches) before --resume loads the engines' checkpoints, which
    restore both counters: 400 steps, 8 of them skipped long ago. The next step, taken, is no skip."""
    e = Counters()
    w = SkippedSteps(e, "actor", limit=8)
    e.global_steps, e.skipped_steps = 400, 8  # deepspeed's load_checkpoint
    with caplog.at_level(logging.WARNING, logger="dschat"):
        w.mark()
        e.step(False)
        assert w.check() is False
    assert not caplog.records and w.in_a_row == 0 and w.count == 8
