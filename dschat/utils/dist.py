"""Rank and world helpers over torch.distributed (no deepspeed import, usable before init).

torch is imported inside the functions that need it: ``train.py`` and its launcher take the host's cores,
ports and MPI variables from here, and an orchestrator that only starts the steps should not spend two
seconds importing torch at every start (each step imports it in its own process)."""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING

from dschat.utils.errors import UserError

if TYPE_CHECKING:
    import torch


def is_initialized() -> bool:
    if "torch" not in sys.modules:  # no process group can exist before torch is loaded
        return False
    import torch.distributed as torch_dist

    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    if not is_initialized():
        return int(os.environ.get("RANK", "0"))
    import torch.distributed as torch_dist

    return torch_dist.get_rank()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    if not is_initialized():
        return int(os.environ.get("WORLD_SIZE", "1"))
    import torch.distributed as torch_dist

    return torch_dist.get_world_size()


def is_main() -> bool:
    return rank() == 0


_NODE_LOCAL_STORAGE = False


def set_node_local_storage(enabled: bool) -> None:
    """Set once per process from ``--node_local_storage`` (by ``step_setup.begin_outputs``)."""
    global _NODE_LOCAL_STORAGE
    _NODE_LOCAL_STORAGE = enabled


def node_local_storage() -> bool:
    return _NODE_LOCAL_STORAGE


def is_node_writer() -> bool:
    """The rank that writes shared files (checkpoint directories, exported models, summaries): rank 0,
    or with node-local storage each node's local rank 0 (every node has its own output directory)."""
    return local_rank() == 0 if _NODE_LOCAL_STORAGE else is_main()


def barrier() -> None:
    if not is_initialized():
        return
    import torch
    import torch.distributed as torch_dist

    if torch_dist.get_backend() == "nccl":
        # NCCL needs a device for the barrier; unnamed, torch guesses it from the rank and prints two
        # warnings (a single-rank group is not bound to a device at init: DeepSpeed leaves it unbound)
        torch_dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        torch_dist.barrier()


def _all_reduce(values: list[float], op: str) -> list[float]:
    """``op``: the name of a ``torch.distributed.ReduceOp`` (looked up only where there are ranks)."""
    if not is_initialized() or world_size() == 1:
        return list(values)
    import torch
    import torch.distributed as torch_dist

    t = torch.tensor(values, dtype=torch.float64, device=default_device())
    torch_dist.all_reduce(t, op=getattr(torch_dist.ReduceOp, op))
    return t.tolist()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few Python floats over all ranks (returns them unchanged on one process)."""
    return _all_reduce(values, "SUM")


def all_reduce_max(values: list[float]) -> list[float]:
    """The largest of each of a few Python floats over all ranks (unchanged on one process)."""
    return _all_reduce(values, "MAX")


def gather_lists(items: list) -> list:
    """Every rank's ``items`` (picklable), concatenated in rank order, on every rank (unchanged on one
    process). Collective."""
    if not is_initialized() or world_size() == 1:
        return list(items)
    import torch.distributed as torch_dist

    gathered: list[list] = [[] for _ in range(world_size())]
    torch_dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def seed_per_rank(seed: int) -> None:
    """Seed torch's global RNG with ``seed + rank``: what each rank samples from then on (PPO's rollouts) is
    its own draw, not a copy of its peers' (one seed on every rank gives row i of every rank the same
    uniforms, correlating the samples the gradient averages). Called once the models are built, whose
    initial weights must agree across ranks."""
    import torch

    torch.manual_seed(seed + rank())


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank: a decision every rank then takes together. Collective."""
    return all_reduce_max([float(flag)])[0] > 0


def cpu_cores() -> int:
    """Cores this process may run on (a container's or cpuset's share, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(ranks: int, cores: int | None = None) -> int:
    """Threads for each of ``ranks`` CPU processes on one machine sharing ``cores`` (default: this process's
    :func:`cpu_cores`): an even split, at least one. Oversubscribed OpenMP pools spin and run many times
    slower, so ranks on one node split the cores rather than each taking them all."""
    return max(1, (cpu_cores() if cores is None else cores) // max(1, ranks))


def cpu_neighbours(
    threads: int, registry: str | None = None, *, register: bool = True
) -> list[tuple[int, int]]:
    """Register this process as a CPU job running ``threads`` threads, and return the other jobs' live
    processes on this machine as ``(pid, threads)``: what :func:`threads_per_rank` cannot see.

    Two runs that each take every core oversubscribe them and run many times slower (about 40x, measured
    with two on 2 cores). The registry is a per-user directory of ``<pid>`` files holding ``job threads``
    (default: ``dschat-cpu-<uid>`` in the temporary directory); a process's file goes when it exits, and a
    dead process's is removed by the next reader. Ranks of one job (one rendezvous address) do not count
    each other: the launcher split the cores between them. ``register=False`` only looks (a short-lived or
    interactive tool, which would otherwise stay registered while it waits)."""
    import atexit
    import tempfile
    from pathlib import Path

    # per machine too: a temporary directory shared between nodes would mix their processes
    root = Path(registry or Path(tempfile.gettempdir()) / f"dschat-cpu-{os.getuid()}-{socket.gethostname()}")
    root.mkdir(parents=True, exist_ok=True)
    me = os.getpid()
    job = (
        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}" if world_size() > 1 else f"pid{me}"
    )
    others = []
    for entry in root.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            their_job, their_threads, started = entry.read_text().split()
            os.kill(int(entry.name), 0)  # raises when the process is gone
            if started != process_start(int(entry.name)):  # a killed run's pid, reused by another process
                raise ProcessLookupError
        except ProcessLookupError:
            entry.unlink(missing_ok=True)
            continue
        except (OSError, ValueError):  # being written, removed meanwhile, another user's process: skip
            continue
        if their_job != job:
            others.append((int(entry.name), int(their_threads)))
    if not register:
        return sorted(others)
    from dschat.utils.io import atomic_write_text  # readers never see half a file

    mine = root / str(me)
    atomic_write_text(mine, f"{job} {threads} {process_start(me)}")
    atexit.register(mine.unlink, missing_ok=True)
    return sorted(others)


def process_start(pid: int) -> str:
    """When process ``pid`` started (Linux: its start time in clock ticks since boot, /proc/PID/stat);
    "0" where that cannot be read. A pid with another start time is another process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22, counted after the command's ")"
    except (OSError, IndexError):
        return "0"


def shared_cpu_warning(
    local_ranks: int = 1, registry: str | None = None, *, register: bool = True
) -> str | None:
    """For a process running on CPU, one of ``local_ranks`` of its run on this machine: the warning to give
    (on each node's local rank 0, else None) when other dschat runs' threads and this run's together exceed
    the cores, each run's thread pool taking the cores as its own. ``register``: :func:`cpu_neighbours`."""
    import torch

    if launched_by_mpi():  # its ranks learn their rendezvous only later: they would count each other
        return None
    threads = torch.get_num_threads()
    try:
        others = cpu_neighbours(threads, registry, register=register)
    except OSError:  # no writable temporary directory: nothing to compare with
        return None
    cores, theirs = cpu_cores(), sum(t for _, t in others)
    if not others or theirs + local_ranks * threads <= cores or local_rank() != 0:
        return None
    pids = ", ".join(str(pid) for pid, _ in others)
    return (
        f"another dschat run shares this machine's {cores} CPU cores (pid {pids}: {theirs} threads, this run "
        f"{local_ranks} x {threads}): oversubscribed thread pools run many times slower (about 40x measured "
        "with two runs on 2 cores); let it finish first, or give each run its share with OMP_NUM_THREADS"
    )


def note_shared_cpu(device: str) -> None:
    """The inference tools' check, on stderr (their stdout may be JSON or a piped reply): a model about to
    run on a CPU that another dschat run keeps busy. They look without registering (chat.py idles between
    turns)."""
    msg = shared_cpu_warning(register=False) if device == "cpu" else None
    if msg:
        print(f"warning: {msg}", file=sys.stderr, flush=True)


def default_device() -> torch.device:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (rank, world size) variables that MPI-style launchers give each process instead of RANK: OpenMPI,
# MVAPICH, MPICH / Intel MPI (PMI), a srun step. Under them DeepSpeed finds each rank through MPI, which it
# skips when RANK is already set. Per-process variables only: SLURM_NTASKS, say, is also set in the
# shell of an allocation, where a plain `python train.py` is one process.
_MPI_RANKS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
)


def launched_by_mpi() -> str | None:
    """``NAME=size`` when an MPI-style launcher started this process as one of several ranks, else None."""
    for rank_var, size_var in _MPI_RANKS:
        size = os.environ.get(size_var, "")
        if rank_var in os.environ and size.isdigit() and int(size) > 1:
            return f"{size_var}={size}"
    return None


def ensure_single_process_env() -> None:
    """Fill in the rendezvous variables for a plain ``python main.py`` run (no launcher set them).

    Not under an MPI-style launcher (``--launcher openmpi``, ``mvapich``, ``slurm``): filling them
    in there made every process rank 0 of a world of one, N separate runs in one output directory."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    size = launched_by_mpi()
    if size:
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            raise UserError(
                f"started by an MPI launcher ({size}) that sets no RANK: DeepSpeed finds the ranks through "
                "mpi4py, which is not installed (pip install mpi4py)"
            )
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
