"""Inputs named on a command line, checked before any slow start-up, one line each naming the flag: a
model or data path that can only be local and is not there, an unknown built-in model or task, a data
source that is neither a file, ``builtin[:TASK]`` nor a registered dataset, a ``module:function`` that
names no module.

The option groups mark such fields (``opt(..., input="model" | "data" | "function")``);
:func:`check_inputs` walks them. Light (no torch): ``train.py`` checks every step's data before the first
step starts, and each step checks its models, data and functions before its process group starts (a model
that an earlier step of the same job writes is not there yet when ``train.py`` starts, so ``train.py``
leaves models to the step; a function's own module may import torch, so it leaves functions too).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dschat.config.fields import flag_name
from dschat.utils.errors import UserError

MODEL, DATA, FUNCTION = "model", "data", "function"


def check_model(spec: str, flag: str, *, hub_available: bool = True) -> None:
    """A model spec that can only be a local path (absolute, ``./``, ``../``, ``~``, or more parts than a
    hub id's ``namespace/name``) must exist, and a ``builtin:NAME`` must be known. A hub id must be in the
    Hugging Face cache or downloadable (:func:`dschat.models.hub.check_hub_name`; not with
    ``hub_available=False``: a dry run or a memory estimate loads no model); one with an offline copy
    (:data:`dschat.models.gguf.OFFLINE_COPIES`) falls back to it."""
    from dschat.models import builtin, gguf, hub

    if builtin.is_builtin(spec):
        builtin.check_known(spec, flag)
        return
    if os.path.exists(os.path.expanduser(spec)):
        return
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1 or spec.endswith(".gguf"):
        raise UserError(f"{flag} {spec}: no such local file or directory")
    if hub_available and spec not in gguf.OFFLINE_COPIES:
        hub.check_hub_name(spec, flag)


def check_data(spec: str, flag: str) -> None:
    """A data source must be a local file or directory that exists and reads (:func:`check_local`: every
    line parses and has its fields), ``builtin`` or ``builtin:TASK,...`` with known tasks, or a registered
    dataset. Whether a dataset can be loaded is for the step's data preparation to find: a hit in dschat's
    tokenized-data cache needs no download and no datasets cache."""
    from dschat import tasks
    from dschat.data.sources import builtin_task_names, check_local, source_kind

    kind = source_kind(spec, flag)
    if kind == "builtin":
        try:
            tasks.resolve_tasks(builtin_task_names(spec))
        except KeyError as exc:
            raise UserError(f"{flag} {spec}: {exc.args[0]}") from None
    elif kind == "local":
        check_local(spec)


def _cannot_import(flag: str, spec: str, exc: Exception) -> UserError:
    """The one line for a ``module:function`` that does not import, from the check and from the loader."""
    return UserError(f"{flag} {spec}: cannot import ({type(exc).__name__}: {exc})")


def import_function(spec: str, flag: str) -> Callable:
    """``module:function`` imported and called back later (``--reward_fn``): the module must import and
    the name must be a callable in it. The one loader (the step's check before its process group only
    finds the module: :func:`check_function`)."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise _cannot_import(flag, spec, exc) from None
    if not callable(fn):
        raise UserError(f"{flag} {spec}: {type(fn).__name__} is not callable")
    return fn


def check_function(spec: str, flag: str) -> None:
    """The module of a ``module:function`` must be there. Found, not imported: the step imports it
    (:func:`import_function`) after its rank has its device and its seed, in case the module does GPU or
    random work on import."""
    module = spec.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as exc:  # a missing parent package, an empty name
        raise _cannot_import(flag, spec, exc) from None
    if not found:  # what importing it would raise
        raise _cannot_import(flag, spec, ModuleNotFoundError(f"No module named {module!r}"))


CHECKS = {MODEL: check_model, DATA: check_data, FUNCTION: check_function}


def check_output_apart(
    output_dir: str, models: Iterable[tuple[str, str]], flag: str = "--output_dir"
) -> None:
    """No model a run reads (``(spec, flag)`` pairs) may be its output directory or lie inside it: the run
    writes its weights, config and tokenizer there (and ``--overwrite`` clears it), so it would destroy the
    model it reads. Hub ids and built-in names are not local paths and pass."""
    out = Path(output_dir).expanduser().resolve()
    for spec, model_flag in models:
        p = Path(spec).expanduser()
        if not spec or not p.exists():
            continue
        p = p.resolve()
        if p == out or out in p.parents:
            where = "is" if p == out else "lies inside"
            raise UserError(f"{model_flag} {spec}: {where} {flag} {output_dir}, which this run writes over; "
                            f"choose another {flag}")  # fmt: skip


def check_inputs(
    specs: Iterable,
    groups: Iterable[Any],
    kinds: tuple[str, ...] = (MODEL, DATA),
    *,
    hub_available: bool = True,
) -> None:
    """Check every marked field of ``groups`` (parsed from ``specs``, a step's ``GROUPS``: a dataclass, or
    ``(dataclass, prefix, shared)``) whose kind is in ``kinds``, naming the flag as the user wrote it; the
    models, where a group holds the run's ``output_dir``, against it (:func:`check_output_apart`).
    ``hub_available``: whether a hub model must be cached or downloadable (:func:`check_model`)."""
    models: list[tuple[str, str]] = []
    output_dir = None
    for spec, group in zip(specs, groups, strict=True):
        _, prefix, shared = (spec, "", ()) if isinstance(spec, type) else spec
        output_dir = getattr(group, "output_dir", output_dir)
        for f in dataclasses.fields(group):
            kind = f.metadata.get("input")
            value = getattr(group, f.name)
            if kind not in kinds or not value:
                continue
            flag = flag_name(f.name, prefix, frozenset(shared))
            for item in value if isinstance(value, list) else [value]:
                if kind == MODEL:
                    check_model(item, flag, hub_available=hub_available)
                    models.append((item, flag))
                else:
                    CHECKS[kind](item, flag)
    if output_dir:  # a step's own models (train.py's pass has no output directory among the groups)
        check_output_apart(output_dir, models)
