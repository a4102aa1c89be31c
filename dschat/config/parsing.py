"""From option groups to a parser and back: one parser per step, one validated dataclass per group."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from dschat.config.fields import T, flag_name
from dschat.utils.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line instead of usage + message, and takes flags only as
    spelt: argparse's default accepts any unambiguous prefix (``--zero 0`` for ``--zero_stage 0``), which
    train.py's planner, its conflict checks and ``--resume``'s comparison, all matching flags by name,
    would not see."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def add_group(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    title: str | None = None,
    defaults: dict[str, Any] | None = None,
    shared: frozenset[str] = frozenset(),
) -> None:
    """Add every field of dataclass ``cls`` as ``--{prefix}{name}``.

    ``defaults`` overrides a field's default for one step (step 2's output directory, say) while the
    option itself, its type, help and validation stay defined once. Fields in ``shared`` keep their
    unprefixed name and are added once even when the group is added under several prefixes (step 3's
    ``--dtype`` serves actor and critic).
    """
    group = parser.add_argument_group(title or f"{cls.__name__} {prefix}".strip())
    defaults = defaults or {}
    unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"defaults for unknown fields of {cls.__name__}: {sorted(unknown)}")
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        default = defaults.get(f.name, default)
        flag = flag_name(f.name, prefix, shared)
        if flag in parser._option_string_actions:
            continue
        if isinstance(default, bool):
            # every switch can be set either way (a preset's ``false`` becomes --no_X); --no_X is listed
            # in the help only where it is the one that changes something
            dest = flag[2:]
            group.add_argument(flag, action="store_true", dest=dest, default=default,
                               help=meta["help"] + (" (default: on)" if default else ""))  # fmt: skip
            group.add_argument(f"--no_{dest}", action="store_false", dest=dest,
                               help=f"turn off {flag}" if default else argparse.SUPPRESS)  # fmt: skip
            continue
        kind = meta.get("type") or (type(default) if default is not None else str)
        # a help text that says its default in words keeps them (an empty or None value says nothing)
        said = "(default" in meta["help"] or default in (None, "")
        kwargs: dict[str, Any] = {
            "default": default,
            "help": meta["help"] + ("" if said else f" (default: {default})"),
        }
        if isinstance(default, list) or meta.get("nargs"):
            kwargs["nargs"] = meta.get("nargs") or "+"
            kind = meta.get("type") or str
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        group.add_argument(flag, type=kind, **kwargs)


GroupSpec = type | tuple  # a dataclass, or (dataclass, prefix, shared field names)


def parse_groups(
    prog: str,
    description: str,
    groups: tuple[GroupSpec, ...],
    argv: list[str] | None = None,
    defaults: dict[type | tuple[type, str], dict[str, Any]] | None = None,
) -> tuple:
    """One parser from option groups; returns one validated dataclass instance per group.

    A group is a dataclass, or ``(dataclass, prefix, shared)`` to add it under a prefix (step 3 adds
    :class:`ModelArgs` as ``actor_`` and ``critic_``) with some fields left unprefixed and shared.
    ``defaults`` are keyed by the dataclass (every prefix) or by ``(dataclass, prefix)`` (one of them,
    e.g. the actor's learning rate), the latter winning.
    """
    specs = [(g, "", frozenset()) if isinstance(g, type) else (g[0], g[1], frozenset(g[2])) for g in groups]
    parser = ArgumentParser(prog=prog, description=description)
    defaults = defaults or {}
    for cls, prefix, shared in specs:
        own = {**defaults.get(cls, {}), **defaults.get((cls, prefix), {})}
        add_group(parser, cls, prefix=prefix, defaults=own, shared=shared)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    ns = parser.parse_args(argv)
    return tuple(from_namespace(cls, ns, prefix, shared) for cls, prefix, shared in specs)


def from_namespace(
    cls: type[T], ns: argparse.Namespace, prefix: str = "", shared: frozenset[str] = frozenset()
) -> T:
    values = {
        f.name: getattr(ns, flag_name(f.name, prefix, shared).removeprefix("--"))
        for f in dataclasses.fields(cls)
    }
    obj = cls(**values)
    if hasattr(obj, "validate"):
        obj.validate(prefix, shared)
    return obj


def to_dict(*groups: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for g in groups:
        out.update(dataclasses.asdict(g))
    return out


def check_resume(specs: tuple[GroupSpec, ...], groups: tuple, output_dir: str, resume: bool) -> None:
    """On ``--resume``, every option that changes what the run computes must have the interrupted run's
    value (its ``dschat_config.json``): a changed seed, length or learning rate would continue another run
    from this one's checkpoint (a cosine schedule of another length, a DPO table of other pairs). Options
    marked ``resumable`` (memory, speed, logging: a smaller micro-batch with more accumulation after an
    out-of-memory stop) may change. One line naming every changed flag. Nothing to compare where the run
    saved no configuration. Step 3's prefixed groups are compared with their section (``actor``, ``critic``)."""
    if not resume:
        return
    path = Path(output_dir) / "dschat_config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    changed: dict[str, str] = {}
    for spec, group in zip(specs, groups, strict=True):
        _, prefix, shared = (spec, "", ()) if isinstance(spec, type) else spec
        section = saved.get(prefix.rstrip("_"), {}) if prefix else saved
        # what only step 1 reads (DataArgs.STEP1_ONLY): a later step's run started before those were refused
        # there saved them, read by nothing
        unread = getattr(type(group), "STEP1_ONLY", ()) if saved.get("step") not in (None, 1) else ()
        for f in dataclasses.fields(group):
            if f.metadata.get("resumable") or f.name not in section or f.name in unread:
                continue
            now = json.loads(json.dumps(getattr(group, f.name), default=str))
            if now != section[f.name]:
                changed.setdefault(flag_name(f.name, prefix, frozenset(shared)),
                                   f"{json.dumps(section[f.name])} -> {json.dumps(now)}")  # fmt: skip
    if changed:
        raise UserError(
            f"--resume: {', '.join(f'{k} {v}' for k, v in changed.items())} differ(s) from the interrupted run "
            f"({path}); resume with its values, or start over with --overwrite"
        )
