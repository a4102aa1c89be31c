"""dschat.utils.io: atomic writes of files and directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dschat.utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text, replace_dir


def test_atomic_write_text_creates_parents(tmp_path):
    p = tmp_path / "a" / "b" / "f.txt"
    atomic_write_text(p, "héllo\nwörld\r\n😀")
    assert p.read_bytes() == "héllo\nwörld\r\n😀".encode()
    assert os.listdir(p.parent) == ["f.txt"]


def test_atomic_write_text_replaces(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old, longer content")
    atomic_write_text(str(p), "new")
    assert p.read_text() == "new"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_atomic_write_text_failure_keeps_old_content(tmp_path):
    p = tmp_path / "f.txt"
    atomic_write_text(p, "old")
    with pytest.raises(TypeError):  # fails inside the write: the temporary file is removed
        atomic_write_bytes(p, 123)  # type: ignore[arg-type]
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_atomic_write_json(tmp_path):
    p = tmp_path / "x.json"
    atomic_write_json(p, {"b": 1, "a": [1, 2], "p": tmp_path / "q"})
    assert p.read_text() == f'{{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1,\n  "p": "{tmp_path / "q"}"\n}}\n'


def test_replace_dir_into_new_place(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "w.bin").write_text("new")
    replace_dir(tmp, tmp_path / "final")
    assert not tmp.exists()
    assert (tmp_path / "final" / "w.bin").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_replace_dir_replaces_old_content(tmp_path):
    final = tmp_path / "final"
    (final / "sub").mkdir(parents=True)
    (final / "old.bin").write_text("old")
    (final / "sub" / "x").write_text("old")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "new.bin").write_text("new")
    replace_dir(str(tmp), str(final))
    assert sorted(os.listdir(final)) == ["new.bin"]
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_replace_dir_clears_a_stale_old_copy(tmp_path):
    stale = tmp_path / ".final.old"
    stale.mkdir()
    (stale / "junk").write_text("x")
    final = tmp_path / "final"
    final.mkdir()
    (final / "v1").write_text("1")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "v2").write_text("2")
    replace_dir(tmp, final)
    assert sorted(os.listdir(final)) == ["v2"]
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_atomic_save_tensors_round_trip(tmp_path):
    import torch
    from safetensors.torch import load_file

    from dschat.utils.io import atomic_save_tensors

    p = tmp_path / "t.safetensors"
    atomic_save_tensors(p, {"x": torch.arange(6.0).view(3, 2).t()})  # a non-contiguous view is fine
    assert load_file(str(p))["x"].tolist() == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    assert os.listdir(tmp_path) == ["t.safetensors"]


def test_atomic_writes_get_the_mode_a_plain_open_would(tmp_path):
    """mkstemp makes owner-only files; an output (a report, a summary) must be readable as any file the
    user writes: 0666 less the umask."""
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "report.md", "x")
        plain = tmp_path / "plain.md"
        plain.write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "report.md").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o644


def test_a_checkpoint_is_on_disk_before_latest_names_it(tmp_path, monkeypatch):
    """A power loss after ``latest`` moved must not leave it naming torn files: every file of the new
    checkpoint (DeepSpeed's shards are plain writes, never flushed) and the directory's rename reach the
    disk before ``latest`` is replaced, and ``latest``'s own rename after it."""
    from dschat.engine.checkpoint import save_checkpoint

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))  # fmt: skip
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b)))
    root = tmp_path / "checkpoints"

    class Engine:  # what save_checkpoint asks of an engine: DeepSpeed writes its shards without fsync
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            (Path(save_dir) / tag).mkdir(parents=True)
            (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"weights")

    save_checkpoint(Engine(), root, 4, {})
    assert (root / "latest").read_text() == "step4\n"
    shard = str(root / ".tmp-step4" / "mp_rank_00_model_states.pt")
    latest = next(i for i, e in enumerate(events) if e == ("replace", str(root / "latest")))
    moved = events.index(("replace", str(root / "step4")))
    assert events.index(("fsync", shard)) < moved  # the files, before the directory is renamed
    # the rename itself (the parent directory's entry) before latest, and latest's after its replace
    assert any(e == ("fsync", str(root)) for e in events[moved:latest])
    assert ("fsync", str(root)) in events[latest:]


def test_a_filesystem_that_cannot_fsync_a_directory_still_takes_atomic_writes(tmp_path, monkeypatch):
    """Some network and FUSE filesystems refuse fsync on a directory (EINVAL) or opening one to read
    (EACCES): every atomic write (a run's config at start, its summary at the end) then crashed the run.
    Durability is best effort there, as SQLite and git do."""
    import errno

    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_write_text(tmp_path / "a.txt", "hello")
    assert (tmp_path / "a.txt").read_text() == "hello"
    src = tmp_path / "tmp"
    src.mkdir()
    (src / "f").write_text("x")
    from dschat.utils.io import fsync_tree

    fsync_tree(src)
    replace_dir(src, tmp_path / "final")
    assert (tmp_path / "final" / "f").read_text() == "x"
