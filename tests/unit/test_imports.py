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
    "dschat.generation.kv_decode",
    "dschat.rlhf.ppo_math",
    "dschat.generation.inference_copy",
    "dschat.generation.sampling",
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


def test_the_ppo_maths_loads_no_model_or_generator_code():
    """``ppo_math`` is pure maths: besides torch it may load only the stop-token helpers. It once reached
    the decoder, the training helpers and the data pipeline through ``generation.plain``."""
    code = (
        "import sys, dschat.rlhf.ppo_math\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('dschat.'))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    allowed = {"dschat.rlhf", "dschat.rlhf.ppo_math", "dschat.generation", "dschat.generation.stops"}
    assert set(proc.stdout.split()) <= allowed, set(proc.stdout.split()) - allowed


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


def dschat_modules(path: Path) -> set[str]:
    """The dschat modules that the module at ``path`` imports (``dschat.a.b``, also inside functions;
    ``from dschat.a import b`` names the submodule ``b`` where there is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.startswith("dschat.") and module_file(m) is not None}


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted((ROOT / "dschat").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        graph[name] = dschat_modules(path) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``[]``."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return []


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_library_modules_import_each_other_without_cycles():
    # A cycle works only while one side imports lazily, and breaks on the first top-level import.
    assert find_cycle(module_graph()) == []


def test_generation_needs_no_engine_rlhf_or_tasks():
    # The ZeRO-3 gathering is passed into the hybrid engine, so generation stays below the engine.
    imported = set().union(
        *(deps for mod, deps in module_graph().items() if mod.startswith("dschat.generation"))
    )
    assert {m for m in imported if m.split(".")[1] in {"engine", "rlhf", "tasks"}} == set()
