"""Shared test settings: offline, a private cache, and helpers to run the real entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEP1 = ROOT / "training" / "step1_supervised_finetuning" / "main.py"
SHARED_DATA = ROOT.parent / "shared" / "data"

# No test may reach a hub; everything is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per usable core (:func:`dschat.utils.dist.cpu_cores`, the affinity). xdist's
    own count is the host's physical cores (psutil), which is more than a container has and fewer than a
    hyper-threaded VM's vCPUs."""
    from dschat.utils.dist import cpu_cores

    return cpu_cores()


def pytest_configure(config) -> None:
    """Under xdist each worker's in-process torch gets its share of the cores, split as ranks on one node
    split them (two workers on two cores would each start two threads), and so do the processes it starts.

    The suite starts some 150 Python processes on the project's modules. Where PYTHONDONTWRITEBYTECODE is
    set (CI images and sandboxes often set it) none of them caches its bytecode and each compiles the
    project again (0.35 s); compiled once here, before the workers start, they all read it (the .pyc files
    land in the checkout's __pycache__ directories, ignored by git, even where the variable was set)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        import compileall

        for package in ("dschat", "training", "inference"):
            compileall.compile_dir(ROOT / package, quiet=1)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        from dschat.utils.dist import threads_per_rank

        torch.set_num_threads(threads_per_rank(workers))
        # ... and so do the runs they start: a run takes every core by default, and two workers' runs at
        # once oversubscribe the cores (two concurrent PPO runs of the easy-reward test: 35-37 s with two
        # threads each, 15-17 s with one). Each rank of a multi-rank run takes the worker's share.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(workers)))


def pytest_collection_modifyitems(config, items) -> None:
    """The modules that hold ``slow`` tests first, in their own order. Under xdist's ``loadscope`` each
    module runs on one worker, so the long ones start early and the many quick unit tests fill the
    gaps at the end; a long module scheduled last would run alone while the other cores idle."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def dschat_cache(tmp_path_factory):
    """One cache (built-in models, tokenized data) per test session, outside the user's home."""
    path = os.environ.get("DSCHAT_TEST_CACHE") or str(tmp_path_factory.mktemp("dschat-cache"))
    os.environ["DSCHAT_CACHE"] = path
    return Path(path)


def run_cmd(
    args: list[str],
    *,
    timeout: int = 600,
    env: dict | None = None,
    cwd: Path = ROOT,
    input_text: str | None = None,
) -> subprocess.CompletedProcess:
    """Run a command with the project's interpreter; output captured as text; ``input_text`` on stdin."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if env and "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):
        # a test's PYTHONPATH adds the project; packages installed on the path stay reachable
        full_env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], os.environ["PYTHONPATH"]))
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
        input=input_text,
    )


_ENTRY_MODULES: dict[Path, object] = {}


class _ProcessGroupStarted(BaseException):
    """Raised in place of starting torch.distributed inside :func:`run_main_in_process` (a BaseException,
    so that no ``except Exception`` on the way turns it into something else)."""


# What a plain ``python script.py`` shows of warnings (Python's default filters): pytest's own filters
# would hide some, or show deprecations a user never sees.
_CLI_WARNING_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)


def run_main_in_process(
    script: Path, args: list[str], *, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` for a run that must stop at a bad input before its process group starts,
    without a new process: the script's ``main(argv)`` under :func:`dschat.utils.errors.run_cli`, as its
    ``__main__`` runs it, from the project root, its output and Python warnings captured, its exit status
    returned. A subprocess spends 3-6 s importing torch, which this worker has already paid.

    Starting the process group (``dschat.engine.core.init_distributed``) fails the test: such a bad input
    was found after slow start-up work, and a case that is found later by design belongs in a subprocess
    (:func:`run_cmd`), which also keeps DeepSpeed's process-wide state out of this worker. The environment,
    working directory, warning filters, the console logger, torch's thread count and random state are
    restored afterwards. Text that C++ code writes straight to file descriptor 2 is not captured: the
    e2e tests run the real processes."""
    import contextlib
    import importlib.util
    import io
    import logging
    import traceback
    import warnings

    import torch

    from dschat.engine import core as engine_core
    from dschat.utils.errors import run_cli

    script = Path(script).resolve()
    if script not in _ENTRY_MODULES:
        spec = importlib.util.spec_from_file_location(f"_entry_{script.parent.name}_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        _ENTRY_MODULES[script] = module
    main = _ENTRY_MODULES[script].main

    def refuse_to_start(*_, **__):
        raise _ProcessGroupStarted

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_threads, saved_rng = torch.get_num_threads(), torch.random.get_rng_state()
    loggers = [logging.getLogger(), logging.getLogger("dschat")]
    saved_handlers = [(lg, list(lg.handlers), lg.propagate, lg.level) for lg in loggers]
    saved_init = engine_core.init_distributed
    os.environ.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    os.chdir(ROOT)  # where run_cmd starts its processes
    engine_core.init_distributed = refuse_to_start
    stdout, stderr = io.StringIO(), io.StringIO()
    started = False
    try:
        with (
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
            warnings.catch_warnings(),
        ):
            warnings.resetwarnings()
            for action, category, module in reversed(_CLI_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            warnings.showwarning = warnings._showwarning_orig  # to sys.stderr, not pytest's record
            try:
                run_cli(lambda: main(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except _ProcessGroupStarted:
                started = True
            except BaseException:  # a bug: the traceback a process would print, exit status 1
                traceback.print_exc()
                code = 1
    finally:
        engine_core.init_distributed = saved_init
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)
        torch.random.set_rng_state(saved_rng)
        for lg, handlers, propagate, level in saved_handlers:
            for h in lg.handlers:
                if h not in handlers:
                    h.close()
            lg.handlers[:] = handlers
            lg.propagate, lg.level = propagate, level
    assert not started, (
        f"{script.name} {args}: reached its process group without an error (slow start-up first)"
    )
    return subprocess.CompletedProcess(
        [sys.executable, str(script), *args], code, stdout.getvalue(), stderr.getvalue()
    )


def run_entry(
    script: Path, args: list[str], *, env: dict | None = None, timeout: int = 600, in_process: bool = False
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS``: a new process (:func:`run_cmd`), or ``in_process`` for a run that must stop at
    a bad input before its process group (:func:`run_main_in_process`)."""
    if in_process:
        return run_main_in_process(script, args, env=env)
    return run_cmd([str(script), *args], env=env, timeout=timeout)


def cpu_ranks_env(ranks: int = 2) -> dict[str, str]:
    """Environment for a test that starts ``ranks`` processes on this machine: CPU ranks (gloo) unless
    there is a GPU for each. The multi-rank tests compare against one CPU rank; on a one-GPU machine
    two ranks would share a device, which train.py refuses and a bare launcher fails on. DS_ACCELERATOR=cpu
    keeps them hidden from ranks that DeepSpeed's launcher starts (it shows them again: dschat/__init__.py)."""
    import torch

    hidden = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    return hidden if 0 < torch.cuda.device_count() < ranks else {}


def build_deepspeed_shared_memory_op() -> None:
    """JIT-build (or load, once built) DeepSpeed's shared-memory collective op, which every CPU rank loads
    as its process group starts: the first run after a new virtualenv compiles it, about a minute on 2
    cores, and a test that times a run must not time that. No-op where the ranks are GPUs (NCCL)."""
    import torch

    if torch.cuda.device_count() >= 2:
        return
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    from dschat.engine.core import clear_stale_build_lock

    clear_stale_build_lock(ShareMemCommBuilder.NAME)
    ShareMemCommBuilder().load(verbose=False)


def shared_data(*parts: str) -> Path:
    """A file under ../shared/data, or skip the test where the shared data is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared data {p} not present")
    return p
