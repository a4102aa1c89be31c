"""Atomic file and directory writes: a reader sees the old content or the new one, never half of it; and
where dschat keeps what it builds once (the model and data caches)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dschat.utils.errors import UserError


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file owner-only (0600); give it the mode a plain open() would (0666 less the
        # umask), so that outputs are readable by whoever may read the directory
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # the rename itself: without it a power loss can bring the old file back


def is_text(message: str) -> bool:
    """Whether ``message`` is text: bytes that are not UTF-8 arrive as surrogate escapes (Python reads argv,
    and chat.py its stdin, with ``surrogateescape``), which no tokenizer takes."""
    try:
        message.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# What a filesystem answers where it cannot fsync a directory (some network and FUSE mounts) or open one to
# read: durability is then best effort, as SQLite and git take it, not a crash of every write.
NO_DIR_FSYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EPERM})


def _fsync(path: str | os.PathLike, tolerated: frozenset[int] = frozenset()) -> None:
    """Flush one file's or directory's data to the disk; the errors ``tolerated`` mean it cannot be done there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in tolerated:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in tolerated:
            raise
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it, a new file) to the disk, where the filesystem can."""
    _fsync(path, NO_DIR_FSYNC)


def fsync_tree(path: str | os.PathLike) -> None:
    """Flush every file under ``path`` and then every directory, deepest first, to the disk: what another
    writer (DeepSpeed's checkpoint shards, ``torch.save``) wrote without ``fsync``."""
    walked = list(os.walk(path))
    for dirpath, _, files in walked:
        for name in files:
            _fsync(os.path.join(dirpath, name))
    for dirpath, _, _ in reversed(walked):
        fsync_dir(dirpath)


def usual_mode(path: str | os.PathLike) -> None:
    """Give a written file the mode a plain ``open()`` would (0666 less the umask): safetensors writes its
    files owner-only (0600), so an export or a shared model cache was unreadable to a job of another user."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_save_tensors(
    path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """A dict of tensors as a safetensors file (with string ``metadata`` in its header), written atomically."""
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# Stands in a model directory while an export moves its files in one by one (the directory holds a run's
# own files too, so it cannot be swapped whole): a directory with it is half old, half new, and the loaders
# refuse it (dschat.models.loading.read_config_json).
INCOMPLETE_EXPORT = ".export-in-progress"


def replace_dir(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> None:
    """Move a fully written ``tmp_dir`` to ``final_dir``, replacing an older ``final_dir``.

    ``os.replace`` cannot swap non-empty directories atomically, so the old one is first renamed aside
    and deleted only once the new one is in place: at every instant one complete copy exists on disk.
    The rename reaches the disk before this returns (the files must have: :func:`fsync_tree`), so a file
    written next (a checkpoint's ``latest``) never names a directory a power loss can take back.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    old = final_dir.with_name(f".{final_dir.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def cache_root() -> Path:
    """``$DSCHAT_CACHE``, else ``~/.cache/dschat``: the model cache (``models/``) and the tokenized-data
    cache (``data/``) live under it."""
    return Path(os.environ.get("DSCHAT_CACHE", Path.home() / ".cache" / "dschat"))


def read_data_text(path: str | os.PathLike) -> str:
    """A data file's UTF-8 text without a leading byte-order mark (Windows editors write one)."""
    return Path(path).read_text(encoding="utf-8-sig")


def read_user_text(path: str | os.PathLike, label: str, encoding: str = "utf-8") -> str:
    """A file a user names (a hostfile, a preset, a prompts file) as text; text that is not UTF-8 is one
    line naming ``label`` (``--hostfile FILE``), not a traceback."""
    try:
        return Path(path).read_text(encoding=encoding)
    except UnicodeDecodeError as exc:
        raise UserError(f"{label}: not UTF-8 text (byte {exc.start})") from None


def data_lines(text: str) -> list[str]:
    """The lines of a JSONL or text file: split at "\\n" only (with a trailing "\\r" removed), never at the
    other breaks ``str.splitlines`` takes (U+2028, U+0085, form feed), which JSON strings may hold raw."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]
