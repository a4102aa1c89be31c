"""The model cache: directories that are built once per machine and then only read (built-in models,
GGUF conversions), under ``$DSCHAT_CACHE/models`` (default ``~/.cache/dschat/models``).

Every entry is built by exactly one process while the others wait on a file lock, written to a
temporary directory, marked complete, and renamed into place. An entry without the completion mark (a
build that crashed, or a cache written by an older dschat) is rebuilt, never used. The lock is a file
lock rather than a collective so that it also serialises ranks before ``torch.distributed`` starts and
separate jobs sharing one cache; the writer does not depend on the process's rank (transformers'
``save_pretrained`` writes nothing on a rank other than 0 once ``torch.distributed`` is initialised).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dschat.utils.errors import UserError
from dschat.utils.io import cache_root, fsync_dir, fsync_tree, usual_mode

LOG = logging.getLogger("dschat")
COMPLETE = ".dschat-complete"  # written last into an entry: its presence means the entry is whole
# Bumped when entries written by an older dschat must not be used. 2: tied weights are stored under
# the embedding's name (format 1 stored them under the LM head's, and reward models lost them).
FORMAT = 2


def models_dir() -> Path:
    return cache_root() / "models"


def is_complete(entry: Path) -> bool:
    """The entry is whole and written in the current :data:`FORMAT`."""
    try:
        mark = json.loads((entry / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("format") == FORMAT


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if needed), held for the ``with`` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_once(entry: Path, build: Callable[[Path], dict | None]) -> Path:
    """``entry``, built by ``build(tmp_dir)`` unless a complete copy exists; returns ``entry``.

    ``build`` writes the whole entry into ``tmp_dir`` (an empty directory) and may return a dict that
    is stored in the completion mark (what was built from what). If it raises, nothing is left behind.
    """
    if is_complete(entry):
        return entry
    lock = entry.with_name(f".{entry.name}.lock")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
    except OSError as exc:
        raise UserError(f"model cache {entry.parent}: cannot write there ({exc.strerror or exc}); set DSCHAT_CACHE "
                        "to a writable directory") from None  # fmt: skip
    with file_lock(lock):
        if is_complete(entry):  # another process built it while this one waited
            return entry
        if entry.exists():
            LOG.warning("model cache: %s is incomplete or written by an older dschat; rebuilding it", entry)
            shutil.rmtree(entry)
        # Builds of this entry that died (a killed process) left their temporary copies; none is running
        # while this process holds the lock, so every one is stale.
        for stale in entry.parent.glob(f".{glob.escape(entry.name)}.*.tmp"):  # a GGUF stem may hold '['
            shutil.rmtree(stale, ignore_errors=True)
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        tmp.mkdir()
        try:
            info = build(tmp) or {}
            mark = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "format": FORMAT, **info}
            (tmp / COMPLETE).write_text(json.dumps(mark, indent=2, sort_keys=True, default=str) + "\n")
            fsync_tree(tmp)  # on the disk before the rename makes it complete (a power loss: no torn entry)
            os.replace(tmp, entry)
            fsync_dir(entry.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return entry


def unique_state_dict(model) -> dict:
    """``model``'s state dict with every shared tensor kept once, under its first name.

    The first name is the module that owns the tensor (``model.embed_tokens.weight`` before the tied
    ``lm_head.weight``), as in transformers' own checkpoints: every head class finds it there. Kept
    under the output head's name, a model without that head (a reward model or critic) would find no
    embedding in the file and start from random ones.
    """
    seen: set[tuple] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.contiguous()
    return out


def write_model_dir(model, tokenizer, path: Path) -> None:
    """Config, generation config, safetensors weights (tied weights stored once, see
    :func:`unique_state_dict`) and tokenizer of ``model`` in ``path``, on whichever rank calls it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(path)
    save_file(unique_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    usual_mode(path / "model.safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
