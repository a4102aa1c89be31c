"""Shared fixtures of the unit tests: a clean single-process environment and the builtin tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if (
    str(ROOT) not in sys.path
):  # plain `pytest` (not `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    """No launcher variables and no hub mirror leak in from the calling shell."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "DSCHAT_HUB_MIRROR"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="session")
def tokenizer():
    """The builtin byte-level tokenizer (shared: tests must not mutate it)."""
    from dschat.models.builtin import build_tokenizer

    return build_tokenizer()
