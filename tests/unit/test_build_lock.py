"""A JIT build of a DeepSpeed C++ op whose process was killed leaves torch's build lock, and every later
build waits on it for ever, without a word: the next run with --offload hung at its optimizer."""

from __future__ import annotations

import logging
import os
import time

import pytest

from dschat.engine.core import clear_stale_build_lock


@pytest.mark.parametrize(
    ("age_minutes", "held_open", "removed"),
    [(30, False, True), (1, False, False), (30, True, False)],
    ids=["dead", "fresh", "old-but-building"],
)
def test_only_a_dead_builds_lock_is_removed(tmp_path, monkeypatch, caplog, age_minutes, held_open, removed):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    then = time.time() - age_minutes * 60
    os.utime(lock, (then, then))
    fd = os.open(lock, os.O_RDONLY) if held_open else None  # as torch's builder holds it while compiling
    try:
        with caplog.at_level(logging.WARNING, logger="dschat"):
            clear_stale_build_lock("cpu_adam")
    finally:
        if fd is not None:
            os.close(fd)
    assert lock.exists() != removed
    assert ("never finished" in caplog.text) == removed
    clear_stale_build_lock("an_op_never_built")  # no lock: nothing to do
