"""Import rules: the pure modules do not pull in deepspeed (checked in a fresh interpreter), and the
library never imports the programs built on it (training/, inference/, train.py)."""

from __future__ import annotations

import ast
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
    "dschat.rlhf.ppo_math",
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


def imported_top_levels(source: str) -> set[str]:
    """The top-level package of every absolute import in ``source`` (``import a.b`` and ``from a.b import c``)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_imported_top_levels_sees_nested_and_from_imports():
    src = "import os.path\ndef f():\n    from training.step1 import main\n    import inference.chat\nfrom . import x\n"
    assert imported_top_levels(src) == {"os", "training", "inference"}


def test_library_never_imports_its_programs():
    # Dependencies point one way: training/, inference/ and train.py use dschat/, never the reverse
    # (also inside functions, where a lazy import would hide the cycle until run time).
    programs = {"training", "inference", "train", "bench"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_top_levels(path.read_text()) & programs)
        for path in sorted((ROOT / "dschat").rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
