"""Metrics shipped as Hugging Face ``evaluate`` modules and loaded by path, so they work offline
(``evaluate.load("name")`` would fetch the module's code from the hub).

Each metric lives in ``dschat/evaluation/<name>/<name>.py``: the one home of its maths.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent


@cache
def load(name: str):
    """The shipped ``evaluate`` module ``name`` (e.g. ``"win_rate"``), loaded once per process."""
    import evaluate

    path = HERE / name
    if not (path / f"{name}.py").is_file():
        known = ", ".join(sorted(p.name for p in HERE.iterdir() if (p / f"{p.name}.py").is_file()))
        raise ValueError(f"no shipped metric {name!r} (known: {known})")
    return evaluate.load(str(path))
