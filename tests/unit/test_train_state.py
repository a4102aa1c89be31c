"""dschat.trainer: what a checkpoint's TrainState holds between log rows."""

from __future__ import annotations

import pytest

from dschat.config import RunArgs
from dschat.trainer import MetricWindow, TrainState, checkpoint_due, with_unlogged


def test_a_checkpoint_between_log_rows_saves_the_tokens_and_seconds_since_the_last_row():
    """The state takes in tokens and time at log rows only; a checkpoint between rows used to save
    without the window since the last row, so a resumed run's throughput and token count lost it."""
    state = TrainState(tokens=100.0, positions=120.0, train_seconds=10.0)
    window = MetricWindow()
    window.add(tokens=5, positions=8, seconds=3.0, loss=0.5, micro=1)
    window.add(tokens=7, positions=8, seconds=1.0, loss=0.25, micro=1)
    saved = with_unlogged(state, window, world=2)  # seconds summed over 2 ranks count once
    assert (saved.tokens, saved.positions, saved.train_seconds) == (112.0, 136.0, 12.0)
    assert (state.tokens, state.positions, state.train_seconds) == (100.0, 120.0, 10.0)  # not the live one
    w = window.reduce()  # the next log row still sees its whole window
    assert w["tokens"] == 12 and w["loss"] == pytest.approx(0.75) and w["micro"] == 2


def _saves(save_steps: int, every: int, total: int) -> list[int]:
    """The steps at which a loop that can save only at every ``every``-th step saves."""
    run = RunArgs(save_steps=save_steps)
    return [s for s in range(every, total + 1, every) if checkpoint_due(run, s, total, since=s - every)]


def test_a_loop_that_saves_only_every_g_steps_still_saves_about_every_save_steps():
    """Step 3 with --generation_batches G can save only after every G-th round (its buffer is empty only
    there); it used to save only where a multiple of --save_steps was one of those rounds, so G=3 with
    --save_steps 50 over 100 rounds saved nothing, and a crash lost the whole run."""
    assert _saves(50, 3, 100) == [51]  # 99 is before the next due step (100), and 100 is the end
    assert _saves(50, 3, 400) == [51, 102, 150, 201, 252, 300, 351]
    assert _saves(4, 2, 12) == [4, 8]  # where they coincide, exactly the due steps
    assert _saves(50, 1, 160) == [50, 100, 150]  # one round per update: every --save_steps
    assert _saves(0, 3, 100) == []  # --save_steps 0: never


def test_checkpoint_due_every_save_steps_but_not_at_the_end():
    run = RunArgs(save_steps=5)
    assert [s for s in range(1, 21) if checkpoint_due(run, s, 20)] == [5, 10, 15]


def test_every_step_names_its_true_accuracy_per_task_alike_at_start_and_end():
    """Steps 1 and DPO wrote true_accuracy_sort_end and step 3 true_accuracy/sort_end, and none wrote a
    task's start: summaries of one job could not be read with one key. One name, step 3's (the metrics'),
    at start and at end."""
    from dschat.trainer import accuracy_summary

    start, end = {"accuracy": 0.5, "accuracy/sort": 0.25}, {"accuracy": 0.75, "accuracy/sort": 0.5}
    assert accuracy_summary(start, end) == {
        "true_accuracy_start": 0.5, "true_accuracy/sort_start": 0.25,
        "true_accuracy_end": 0.75, "true_accuracy/sort_end": 0.5,
    }  # fmt: skip
    assert accuracy_summary(None, end) == {}
