"""dschat.trainer: what a checkpoint's TrainState holds between log rows."""

from __future__ import annotations

import pytest

from dschat.trainer import MetricWindow, TrainState, with_unlogged


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
