"""What every step does around its loop: output directory rules, resolved config, summary, timing."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from dschat.utils import dist
from dschat.utils.errors import UserError
from dschat.utils.io import atomic_write_json

LOG = logging.getLogger("dschat")
# When this process began its dschat work (the first import of this module, before data, models and
# on-policy pair mining): a summary's process_wall_seconds counts from here, its wall_seconds from the
# step's stopwatch (after set-up)
PROCESS_START = time.perf_counter()
SUMMARY = "summary.json"
RESOLVED_CONFIG = "dschat_config.json"
STEP3_MODEL_DIRS = ("actor", "critic", "actor_ema")  # step 3 saves its models in these, its config above


def trained_config(model_path: str | Path) -> dict[str, Any]:
    """The resolved options the dschat step that made ``model_path`` saved with it (its
    ``dschat_config.json``, in the model's directory or, for step 3's ``actor/`` and ``critic/``, the step
    directory above); ``{}`` for any other model (a hub name, a plain checkpoint) or an unreadable file.
    Inference reads from it what must match training: the prompt format, a reward model's length limit."""
    p = Path(model_path)
    # only step 3's model folders: any other parent (the working directory, for a bare relative name or
    # builtin:NAME) may be an unrelated run's
    above = [p.parent / RESOLVED_CONFIG] if p.name in STEP3_MODEL_DIRS else []
    for candidate in (p / RESOLVED_CONFIG, *above):
        try:
            cfg = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        return cfg if isinstance(cfg, dict) else {}
    return {}


def finished(path: str | Path) -> bool:
    """Whether the run in ``path`` finished: a step writes its summary last."""
    return (Path(path) / SUMMARY).exists()


def check_output_dir(path: str, *, overwrite: bool, resume: bool, flag: str = "--output_dir") -> None:
    """Refuse to silently replace a finished run or clobber an unfinished one's checkpoints."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a directory")
    if not p.exists():
        check_parent_dir(p, flag, path)
    ckpt = p / "checkpoints" / "latest"
    if finished(p) and not overwrite:
        raise UserError(f"{flag} {path}: holds a finished run ({SUMMARY}); pass --overwrite to replace it")
    if resume and not ckpt.exists():
        raise UserError(f"--resume: no checkpoint to resume from in {p / 'checkpoints'}")
    if not resume and not overwrite and ckpt.exists():
        raise UserError(
            f"{flag} {path}: holds checkpoints of an unfinished run; pass --resume to continue it or --overwrite to start over"
        )


def check_parent_dir(p: Path, flag: str, shown: str) -> None:
    """``p`` (not there yet) can be made: its nearest existing ancestor is a directory this process can
    write in (an output directory under a file failed deep in start-up with a traceback)."""
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {shown}: {parent} exists and is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{flag} {shown}: cannot write in {parent}")
            return


def output_stem(prefix: str, suffixes: tuple[str, ...]) -> str:
    """``results/cmp.md`` -> ``results/cmp`` for suffixes ``(".md", ".jsonl")``: the prefix the files share."""
    for suffix in suffixes:
        prefix = prefix.removesuffix(suffix)
    return prefix


def check_output_prefix(
    prefix: str, suffixes: tuple[str, ...], flag: str = "--output", overwrite: bool = False
) -> None:
    """A prefix of output files (``PREFIX.md``, ``PREFIX.jsonl`` for ``suffixes`` ``(".md", ".jsonl")``),
    checked before any work: it must name a file in a directory that exists or can be made (and written
    in), not a directory itself, and an earlier output is replaced only with ``overwrite``."""
    p = Path(prefix)
    stem = output_stem(prefix, suffixes)
    if prefix.endswith(("/", os.sep)) or p.is_dir() or not Path(stem).name or stem.endswith(("/", os.sep)):
        raise UserError(f"{flag} {prefix}: names a directory; give a file prefix such as {p / 'results'}")
    check_parent_dir(p, flag, prefix)
    earlier = [f"{stem}{s}" for s in suffixes if Path(f"{stem}{s}").exists()]
    if earlier and not overwrite:
        raise UserError(
            f"{flag} {prefix}: {earlier[0]} exists (an earlier report); pass --overwrite to replace it"
        )


def clear_previous_run(path: str, model_dirs: tuple[str, ...] = ()) -> None:
    """For --overwrite: first drop the 'finished' marker, then the old checkpoints and metrics, the
    step's model directories ``model_dirs`` (step 3's: a new run without a critic or an EMA left the old
    ones beside its own config, which then described them) and the default TensorBoard directory (it
    showed the old points beside the new). W&B's local folder stays: offline, it is the old run's only
    copy, and W&B draws from its server, not from it."""
    if not dist.is_node_writer():
        return
    p = Path(path)
    (p / SUMMARY).unlink(missing_ok=True)
    for d in ("checkpoints", *model_dirs, "tensorboard"):
        shutil.rmtree(p / d, ignore_errors=True)
    (p / "metrics.jsonl").unlink(missing_ok=True)
    if not os.environ.get("DSCHAT_LOG_CAPTURED"):  # train.py already truncated the log it is writing
        (p / "training.log").unlink(missing_ok=True)


def _sharded(config: dict[str, Any]) -> bool:
    """Whether any engine of a run's resolved config partitions its state (ZeRO stage 1-3)."""
    stages = [config.get("zero_stage")] + [config.get(k, {}).get("zero_stage") for k in ("actor", "critic")]
    return any(isinstance(z, int) and z > 0 for z in stages)


def input_runs(*paths: str | Path | None) -> dict[str, str]:
    """The finished dschat steps among ``paths`` (the models a step starts from: step 1's output for DPO and
    step 3, step 2's for step 3's critic) with a digest of each one's ``summary.json``, which every run of a
    step writes anew: recorded in a step's ``dschat_config.json`` as ``input_runs``."""
    out = {}
    for p in paths:
        summary = Path(p) / SUMMARY if p else None
        if summary is not None and summary.is_file():  # absolute: a resume may start from another directory
            out[str(Path(p).resolve())] = hashlib.sha256(summary.read_bytes()).hexdigest()[:16]
    return out


def changed_inputs(saved: dict[str, Any]) -> list[str]:
    """The recorded ``input_runs`` of a step's saved configuration that were trained again since (their
    summary is another); an input no longer there (a moved output directory) is not compared."""
    stale = []
    for path, digest in (saved.get("input_runs") or {}).items():
        now = input_runs(path).get(str(Path(path).resolve()))
        if now is not None and now != digest:
            stale.append(path)
    return stale


def check_resumed_environment(output_dir: str, config: dict[str, Any]) -> None:
    """On ``--resume``, what the interrupted run resolved from its environment must hold again: the dtype
    ``--dtype auto`` picked (another host without bf16 instructions picks fp32: the optimizer state does
    not load, or the run goes on in another precision) and, where ZeRO partitions the state, the number of
    ranks (DeepSpeed refuses it with a traceback deep in the load). One line; checked before the new
    configuration replaces the saved one."""
    try:
        saved = json.loads((Path(output_dir) / RESOLVED_CONFIG).read_text())
    except (OSError, ValueError):
        return
    if stale := changed_inputs(saved):  # its checkpoint continues a run of the earlier model
        raise UserError(f"--resume: {stale[0]} was trained again since this run started from it, so its checkpoint "
                        "belongs to the earlier one: start over with --overwrite")  # fmt: skip
    if saved.get("resolved_dtype") not in (None, config.get("resolved_dtype")):
        raise UserError(f"--resume: the interrupted run trained in {saved['resolved_dtype']}, this one resolves "
                        f"--dtype {config.get('dtype', 'auto')} to {config.get('resolved_dtype')}: resume with "
                        f"--dtype {saved['resolved_dtype']}")  # fmt: skip
    if _sharded(saved) and saved.get("world_size") not in (None, config.get("world_size")):
        raise UserError(f"--resume: the interrupted run's ZeRO state is split over {saved['world_size']} ranks, this "
                        f"run has {config.get('world_size')}: ZeRO stages 1-3 resume on as many ranks (stage 0 "
                        "on any number)")  # fmt: skip


def save_resolved_config(output_dir: str, config: dict[str, Any], resume: bool = False) -> None:
    """Log the run's resolved options and write them beside its outputs; on ``resume`` first
    :func:`check_resumed_environment` against the interrupted run's."""
    if resume:
        check_resumed_environment(output_dir, config)
    text = json.dumps(config, indent=2, sort_keys=True, default=str)
    LOG.info("resolved configuration:\n%s", text)
    if dist.is_node_writer():
        atomic_write_json(Path(output_dir) / RESOLVED_CONFIG, config)


def write_summary(output_dir: str, summary: dict[str, Any]) -> None:
    """Written last and atomically: its presence is what marks a run as finished. Rank 0's peak memory
    (:func:`peak_memory`) and the whole process's time (``process_wall_seconds``: data preparation, model
    loading and pair mining too, which the step's ``wall_seconds`` leaves out) are added to every summary.
    With node-local storage every node writes one."""
    if dist.is_node_writer():
        whole = {"process_wall_seconds": time.perf_counter() - PROCESS_START}  # set-up and mining included
        atomic_write_json(Path(output_dir) / SUMMARY, {**summary, **whole, **peak_memory()})


def peak_memory() -> dict[str, int]:
    """This process's peak resident set size (``peak_rss_bytes``, Linux ``ru_maxrss``) and, on a GPU,
    the peak of torch's allocator (``peak_gpu_allocated_bytes``) and of its reserved pool."""
    import resource
    import sys

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_gpu_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        out["peak_gpu_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    return out


class Stopwatch:
    """Accumulates seconds spent in named phases (``with sw("train"): ...``)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._start = time.perf_counter()

    def __call__(self, name: str):
        sw = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                sw.totals[name] = sw.totals.get(name, 0.0) + time.perf_counter() - self.t

        return _Ctx()

    def wall(self) -> float:
        return time.perf_counter() - self._start
