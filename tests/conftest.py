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


def cpu_ranks_env(ranks: int = 2) -> dict[str, str]:
    """Environment for a test that starts ``ranks`` processes on this machine: CPU ranks (gloo) unless
    there is a GPU for each. The multi-rank tests compare against one CPU rank; on a one-GPU machine
    two ranks would share a device, which train.py refuses and a bare launcher fails on."""
    import torch

    return {"CUDA_VISIBLE_DEVICES": ""} if 0 < torch.cuda.device_count() < ranks else {}


def shared_data(*parts: str) -> Path:
    """A file under ../shared/data, or skip the test where the shared data is absent."""
    p = SHARED_DATA.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"shared data {p} not present")
    return p
