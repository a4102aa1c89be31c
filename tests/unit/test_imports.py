"""The pure modules must not pull in deepspeed (checked in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE = [
    "dschat.losses",
    "dschat.data.collate",
    "dschat.data.split",
    "dschat.tasks",
    "dschat.engine.ds_config",
    "dschat.memory",
    "dschat.planning",
    "dschat.rlhf.fast_decode",
    "dschat.models.inference_copy",
]


def test_pure_modules_do_not_import_deepspeed():
    code = (
        "import importlib, sys\n"
        f"for name in {PURE!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'deepspeed' not in sys.modules, name\n"
        "print('ok')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
