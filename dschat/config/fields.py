"""The building blocks of the option groups: the field constructor, shared constants and checks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, TypeVar

from dschat.utils.errors import UserError

T = TypeVar("T")

DTYPES = ("auto", "fp32", "fp16", "bf16")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")
DEFAULT_MODEL = "builtin:tiny-llama"


def opt(
    default: Any,
    help: str,
    *,
    type: Any = None,
    choices: tuple | None = None,
    nargs: str | None = None,
    input: str | None = None,
    resumable: bool = False,
):
    """A dataclass field that is also a command-line option. ``input="model" | "data"``: it names a model
    or data sources, checked before any slow start-up (:mod:`dschat.inputs`). ``resumable``: it changes
    how fast, in how much memory or where a run computes and reports, not what it computes, so a resumed
    run may give another value (the others must be the interrupted run's: :func:`check_resume`)."""
    meta = {
        "help": help,
        "type": type,
        "choices": choices,
        "nargs": nargs,
        "input": input,
        "resumable": resumable,
    }
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def share_prompt_opt(what: str):
    """``--share_prompt``, one definition for the steps that score several continuations of one prompt
    (step 2's pairs, step 3's answers per prompt); ``what`` names them in the help."""
    return opt(
        True,
        f"compute each prompt once for its {what}: one packed row, prompt + continuations, each continuation "
        "masked from the others and continuing the prompt's positions, so the values are those of separate rows "
        "(checked at start-up; a model that does not honour the mask or the positions falls back to separate "
        "rows with a warning)",
    )


ZERO_STAGES = (0, 1, 2, 3)


def refuse_without_mode(group: Any, mode: str, on: bool, prefix: str = "", exempt: tuple[str, ...] = (),
                        needs: str = "", only: tuple[str, ...] | None = None) -> None:  # fmt: skip
    """An option of ``group`` that only a mode reads (every field but ``mode`` and ``exempt``, or the fields
    ``only``), given (not its default) while the mode is off, is an error, not accepted and unused:
    ``--{prefix}NAME needs --{prefix}{mode}{needs}``."""
    if on:
        return
    for f in dataclasses.fields(group):
        if only is not None and f.name not in only:
            continue
        if f.name != mode and f.name not in exempt and getattr(group, f.name) != f.default:
            raise UserError(f"--{prefix}{f.name} needs --{prefix}{mode}{needs}")


def check_zero_stage(flag: str, value: int) -> None:
    """One clear line for a ZeRO stage outside 0-3 (``flag`` as the user wrote it, e.g. ``--zero_stage``)."""
    if value not in ZERO_STAGES:
        raise UserError(f"{flag} must be 0, 1, 2 or 3, got {value}")


def parse_data_split(text: str, flag: str = "--data_split") -> list[float]:
    """``"2,4,4"`` -> ``[0.2, 0.4, 0.4]``; exactly three non-negative numbers with a positive sum."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected three comma-separated numbers such as 2,4,4") from None
    if len(parts) != 3 or any(not math.isfinite(p) or p < 0 for p in parts) or sum(parts) <= 0:
        raise UserError(
            f"{flag} {text!r}: expected three non-negative numbers with a positive sum, such as 2,4,4"
        )
    total = sum(parts)
    return [p / total for p in parts]


def flag_name(name: str, prefix: str = "", shared: frozenset[str] | tuple[str, ...] = ()) -> str:
    """The flag of field ``name`` in a group added under ``prefix``: unprefixed where it is ``shared``
    (step 3's one ``--offload`` for actor and critic)."""
    return f"--{name}" if name in shared else f"--{prefix}{name}"
