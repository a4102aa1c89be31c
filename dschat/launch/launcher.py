"""The command prefix that starts one step's processes: one process, the DeepSpeed launcher on one
node or on a hostfile's nodes (pdsh, OpenMPI, ..., SLURM), or torchrun per node; and the process
count of a deployment for memory planning."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from dschat.utils.dist import cpu_cores, threads_per_rank
from dschat.utils.errors import UserError
from dschat.utils.io import read_user_text

DEPLOYMENTS = ("single_gpu", "single_node", "multi_node")
LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm", "torchrun")


# DeepSpeed launcher backends that take the processes per node from the hostfile's slots and refuse
# --num_gpus (their runners raise "does not support limiting num nodes/gpus")
NO_NUM_GPUS = ("openmpi", "mvapich", "mpich", "impi")


def visible_devices() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU"
    return cpu_cores(), "CPU core"


def visible_gpu_ids() -> list[str] | None:
    """The ids in ``CUDA_VISIBLE_DEVICES`` when it is set and names GPUs, else None."""
    ids = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return ids or None


def single_node_devices(n: int) -> list[str]:
    """The DeepSpeed launcher's device flags for ``n`` processes on this node. Given ``--num_gpus`` it
    drops ``CUDA_VISIBLE_DEVICES`` and uses GPUs 0 .. n-1, which may be someone else's: where the
    variable is set, its first ``n`` ids go to ``--include`` instead (all of them: no flag, and the
    launcher turns the variable into ``--include`` itself)."""
    import torch

    ids = visible_gpu_ids() if torch.cuda.is_available() else None
    if ids is None:
        return ["--num_gpus", str(n)]
    if not all(x.isdigit() for x in ids):
        raise UserError(
            f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}: the DeepSpeed launcher takes GPU "
            "indices (0,1,...), not UUIDs or MIG names; give indices, or use --launcher torchrun"
        )
    return [] if n == len(ids) else ["--include", "localhost:" + ",".join(ids[:n])]


MAX_PROCESSES_PER_NODE = 4096  # beyond any machine's GPUs or cores: a typo, not a plan


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """``[(host, slots)]`` of a DeepSpeed hostfile (``host slots=N`` per line, ``#`` comments)."""
    hosts = []
    for i, line in enumerate(read_user_text(path, f"--hostfile {path}").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)  # DeepSpeed's own pattern: no spaces around '='
        if not m:
            raise UserError(f"--hostfile {path} line {i}: expected 'hostname slots=N', got {line!r}")
        if any(host == m[1] for host, _ in hosts):
            raise UserError(f"--hostfile {path} line {i}: host {m[1]} is listed twice")
        if not 1 <= int(m[2]) <= MAX_PROCESSES_PER_NODE:
            raise UserError(
                f"--hostfile {path} line {i}: slots must be in 1 .. {MAX_PROCESSES_PER_NODE}, got {m[2]}"
            )
        hosts.append((m[1], int(m[2])))
    if not hosts:
        raise UserError(f"--hostfile {path}: no hosts")
    return hosts


def check_deployment_flags(args: argparse.Namespace) -> None:
    """The launch flags' own consistency, whatever machine runs train.py: checked before any memory plan
    (``--estimate-memory`` plans for a cluster from a laptop, and printed '-4 CPU processes' for
    ``--num-gpus -4``) and again by :func:`launcher`."""
    multi_only = [("--launcher", args.launcher), ("--launcher-args", args.launcher_args), ("--nnodes", args.nnodes),
                  ("--node-rank", args.node_rank)]  # fmt: skip
    if args.deployment_type != "multi_node":
        if args.hostfile:
            raise UserError("--hostfile needs --deployment-type multi_node")
        for flag, value in multi_only:
            if value is not None:
                raise UserError(f"{flag} needs --deployment-type multi_node")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UserError(f"--master-port {args.master_port}: must be a port number in 1 .. 65535")
    if args.deployment_type == "single_gpu" and args.num_gpus not in (None, 1):
        raise UserError(
            "--num-gpus needs --deployment-type single_node or multi_node (single_gpu is one process)"
        )
    if args.num_gpus is not None and not 1 <= args.num_gpus <= MAX_PROCESSES_PER_NODE:
        raise UserError(f"--num-gpus {args.num_gpus}: must be in 1 .. {MAX_PROCESSES_PER_NODE}")
    if args.nnodes is not None and args.nnodes < 1:
        raise UserError(f"--nnodes {args.nnodes}: must be at least 1")
    if args.deployment_type == "multi_node" and args.launcher != "torchrun":
        # --estimate-memory plans a cluster of --nnodes nodes with any launcher (the README's example)
        if (
            args.nnodes is not None and not getattr(args, "estimate_memory", False)
        ) or args.node_rank is not None:
            raise UserError(
                "--nnodes and --node-rank need --launcher torchrun (the DeepSpeed launcher reads --hostfile)"
            )
        if args.hostfile:
            if Path(args.hostfile).is_dir():
                raise UserError(f"--hostfile {args.hostfile}: is a directory, not a hostfile")
            if not Path(args.hostfile).is_file():
                raise UserError(f"--hostfile {args.hostfile}: file not found")
            read_hostfile(args.hostfile)
    if args.nnodes is not None and args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank {args.node_rank} must be in 0 .. --nnodes - 1 ({args.nnodes - 1})")


def launcher(args: argparse.Namespace) -> list[str]:
    """The command prefix that starts one step's processes."""
    check_deployment_flags(args)
    if args.deployment_type == "single_gpu":
        for flag, value in (("--master-addr", args.master_addr), ("--master-port", args.master_port)):
            if value is not None:  # one process has no rendezvous: the flag would be dropped silently
                raise UserError(f"{flag} needs --deployment-type single_node or multi_node")
        return [sys.executable]
    from dschat.utils.dist import free_port

    if args.deployment_type == "multi_node" and args.launcher == "torchrun":
        return torchrun(args)
    port = str(args.master_port or free_port())
    runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", port]
    if args.master_addr and args.deployment_type == "single_node":
        # the runner rendezvous on this machine (127.0.0.1) whatever it is given: the flag would be dropped
        raise UserError(
            "--master-addr needs --deployment-type multi_node (single_node rendezvous on this machine)"
        )
    if args.master_addr:
        runner += ["--master_addr", args.master_addr]
    if args.deployment_type == "single_node":
        have, kind = visible_devices()
        n = args.num_gpus or have
        if n > have:
            raise UserError(f"--num-gpus {n}: this machine has only {have} {kind}{'s' if have != 1 else ''}")
        # An explicit hostfile that is no file: given none, the runner reads /job/hostfile where one exists
        # (DLTS clusters, some images) and would spread a single_node run over the hosts listed there.
        return [*runner, "--hostfile", os.devnull, *single_node_devices(n)]
    if not args.hostfile:
        raise UserError(
            "--deployment-type multi_node needs --hostfile FILE (lines 'host slots=N'), "
            "or --launcher torchrun with --nnodes, --node-rank, --master-addr and --master-port"
        )
    hosts = read_hostfile(args.hostfile)
    backend = args.launcher or "pdsh"
    if args.num_gpus and backend in NO_NUM_GPUS:
        raise UserError(
            f"--num-gpus with --launcher {backend}: that launcher starts one process per slot of --hostfile "
            f"(set slots=N there)"
        )
    short = [(host, slots) for host, slots in hosts if args.num_gpus and slots < args.num_gpus]
    if short:  # DeepSpeed's runner would start ranks on devices those hosts do not have
        host, slots = short[0]
        raise UserError(
            f"--num-gpus {args.num_gpus}: host {host} has {slots} slots in --hostfile {args.hostfile}"
        )
    # --force_multi: a hostfile of one (remote) host still launches there, not on this machine
    cmd = [*runner, "--hostfile", args.hostfile, "--launcher", backend, "--force_multi"]
    launcher_args = args.launcher_args or ""
    if backend != "pdsh":
        # only pdsh needs ssh; the runner would otherwise ssh to the first host to check and to find
        # the master's address (MPICH and Intel MPI use it; the others rediscover it through MPI)
        cmd += ["--no_ssh_check"]
        if not args.master_addr:
            cmd += ["--master_addr", hosts[0][0]]
    if backend == "slurm" and "kill-on-bad-exit" not in launcher_args:
        # srun's default leaves the other ranks waiting in a collective when one dies
        launcher_args = f"{launcher_args} --kill-on-bad-exit=1".strip()
    if launcher_args:  # one word: the runner's argparse reads a separate "--kill-on-bad-exit=1" as an option
        cmd += [f"--launcher_args={launcher_args}"]
    if args.num_gpus:
        cmd += ["--num_gpus", str(args.num_gpus)]
    return cmd


def torchrun(args: argparse.Namespace) -> list[str]:
    """``torch.distributed.run`` on this node: the rendezvous alternative for clusters without
    passwordless ssh (SLURM's srun, Kubernetes): the same command on every node, each with its --node-rank."""
    missing = [f for f, v in (("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                              ("--master-addr", args.master_addr), ("--master-port", args.master_port)) if v is None]  # fmt: skip
    if missing:
        raise UserError(
            f"--launcher torchrun needs {', '.join(missing)} (the same on every node but --node-rank)"
        )
    if args.hostfile:
        raise UserError(
            "--hostfile is for the DeepSpeed launcher; --launcher torchrun uses --nnodes and --master-addr"
        )
    if args.launcher_args:
        raise UserError(
            "--launcher-args is for the DeepSpeed launcher's backends (pdsh, MPI, SLURM); torchrun takes none"
        )
    have, kind = visible_devices()
    n = args.num_gpus or have
    if n > have:
        raise UserError(f"--num-gpus {n}: this machine has only {have} {kind}{'s' if have != 1 else ''}")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nnodes), "--nproc_per_node", str(n),
            "--node_rank", str(args.node_rank), "--master_addr", args.master_addr, "--master_port",
            str(args.master_port), "--max_restarts", "0"]  # fmt: skip


def launcher_env(args: argparse.Namespace) -> dict[str, str]:
    """Variables the step's launcher needs beside train.py's environment, for CPU ranks (no GPU visible
    here) only.

    ``DS_ACCELERATOR=cpu``: DeepSpeed's launcher, starting ranks with its CPU accelerator, sets
    ``CUDA_VISIBLE_DEVICES=0,1,...`` for them, which on a machine whose GPUs were hidden from train.py
    (``CUDA_VISIBLE_DEVICES=``) shows them again: every rank then takes GPU ``LOCAL_RANK``, and rank 1 of
    a one-GPU machine fails ("invalid device ordinal"). With the variable the ranks hide them again
    (dschat/__init__.py); one node's ranks only (``single_node``).

    ``OMP_NUM_THREADS``: torchrun sets 1 for every rank when there are several per node and the variable
    is unset, which on CPU leaves each rank one core however many it has; the cores are split among the
    ranks instead (the DeepSpeed launcher sets nothing, and the ranks split the cores themselves:
    engine.core)."""
    have, kind = visible_devices()
    if kind != "CPU core":
        return {}
    # this node's ranks only: other nodes decide for themselves (an MPI launcher passes the whole
    # environment on, and a head node without a GPU may start ranks on nodes with them)
    env = {"DS_ACCELERATOR": "cpu"} if args.deployment_type != "multi_node" else {}
    if args.deployment_type != "multi_node" or args.launcher != "torchrun" or "OMP_NUM_THREADS" in os.environ:
        return env
    ranks = args.num_gpus or have
    return {**env, "OMP_NUM_THREADS": str(threads_per_rank(ranks, cores=have))} if ranks > 1 else env


def processes(args: argparse.Namespace) -> tuple[int, int]:
    """``(processes per node, nodes)`` of the deployment, for memory planning (no checks against this
    machine: one may plan for a cluster from a laptop)."""
    if args.deployment_type == "single_gpu":
        return 1, 1
    if args.deployment_type == "single_node":
        return args.num_gpus or visible_devices()[0], 1
    if args.hostfile and Path(args.hostfile).is_file():
        hosts = read_hostfile(args.hostfile)
        # hosts with unequal slots: planned as if each had the fewest (fewer devices share the states,
        # so each device's estimate is above its need, never below)
        return args.num_gpus or min(slots for _, slots in hosts), len(hosts)
    if args.nnodes:
        return args.num_gpus or visible_devices()[0], args.nnodes
    raise UserError("--deployment-type multi_node: say how many nodes with --hostfile FILE or --nnodes N")


# Variables a step reads from its environment: the DeepSpeed runner passes to other nodes (pdsh, and
# the MPI launchers' remote ranks) only names with its own prefixes and those in a .deepspeed_env file.
FORWARDED_PREFIXES = ("DSCHAT_", "HF_", "TRANSFORMERS_", "TORCH_")


def deepspeed_env_lines(env: dict[str, str], home: Path, cwd: Path) -> list[str]:
    """``KEY=VALUE`` lines for the runner's env file: the user's own ``.deepspeed_env`` (the name in
    ``DS_ENV_FILE``, looked up in ``home`` and ``cwd`` as the runner does) first, then every variable of
    ``env`` with a prefix in ``FORWARDED_PREFIXES`` (without ``DS_ENV_FILE`` pointing here, train.py's
    ``--dist-timeout``, its log capture and the user's cache and hub settings never reached the ranks)."""
    name = env.get("DS_ENV_FILE", ".deepspeed_env")
    lines: list[str] = []
    for base in dict.fromkeys((home, cwd)):
        path = base / name
        if path.is_file():
            lines += [x for x in path.read_text().splitlines() if "=" in x]
    # the runner reads one variable per line: a value holding a newline cannot travel
    lines += [
        f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(FORWARDED_PREFIXES) and "\n" not in v
    ]
    return lines
