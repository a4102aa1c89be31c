#!/usr/bin/env python
"""Run the dschat pipeline: step 1 (SFT), step 2 (reward model), step 3 (PPO).

    python train.py                                   # every built step on the embedded default
    python train.py --step 1 --deployment-type single_node --num-gpus 2 --actor-zero-stage 3
    python train.py --step 1 --actor-model facebook/opt-1.3b --data-path Dahoas/rm-static -- --lora_dim 128
    python train.py --estimate-memory --step 3 --actor-model facebook/opt-13b --deployment-type single_node
    python train.py --deployment-type multi_node --hostfile hosts        # DeepSpeed launcher (pdsh, ...)
    python train.py --deployment-type multi_node --launcher torchrun --nnodes 2 --node-rank 0 \
        --master-addr node0 --master-port 29500 --num-gpus 8             # one such command per node

This script only orchestrates: it builds each step's command line (``training/stepN_*/main.py``),
launches it (one process, or the DeepSpeed launcher), streams its output to the console and to
``OUTPUT_DIR/stepN/training.log``, and stops at the first failing step. Everything after ``--`` is
passed verbatim to every step. A preset (``configs/presets``, chosen by ``--preset`` or implied by
``--actor-model``) supplies per-step flags that any flag given here overrides. ZeRO stage, offload and
gradient checkpointing not set by any flag are picked to fit the devices (``dschat.planning``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from dschat.config import check_zero_stage  # noqa: E402
from dschat.utils.errors import UserError, run_cli  # noqa: E402
from dschat.utils.run import check_output_dir  # noqa: E402


@dataclass(frozen=True)
class Step:
    number: int
    name: str
    entry: Path
    built: bool
    key: str = ""  # its output directory under --output-dir and its preset section (default stepN)

    @property
    def dir_name(self) -> str:
        return self.key or f"step{self.number}"


DEPLOYMENTS = ("single_gpu", "single_node", "multi_node")
LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm", "torchrun")

STEPS = {
    1: Step(1, "supervised fine-tuning", ROOT / "training/step1_supervised_finetuning/main.py", True),
    2: Step(2, "reward model", ROOT / "training/step2_reward_model_finetuning/main.py", True),
    3: Step(3, "RLHF (PPO)", ROOT / "training/step3_rlhf_finetuning/main.py", True),
}
# --algorithm dpo: step 2 optimises the step-1 policy on the pairs directly; no reward model, no step 3.
DPO_STEP = Step(2, "DPO", ROOT / "training/step2_dpo_finetuning/main.py", True, "step2_dpo")
ALGORITHMS = ("ppo", "dpo")


def step_of(n: int, args: argparse.Namespace) -> Step:
    return DPO_STEP if n == 2 and getattr(args, "algorithm", "ppo") == "dpo" else STEPS[n]


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message} (see train.py --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = Parser(
        prog="train.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--step", type=int, nargs="+", choices=sorted(STEPS), help="steps to run (default: all built steps)"
    )
    p.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default="ppo",
        help="ppo: step 2 trains a reward model and step 3 runs PPO against it; dpo: step 2 optimises the "
        "step-1 policy on the preference pairs directly (DPO, output in OUTPUT_DIR/step2_dpo), no step 3",
    )
    p.add_argument(
        "--deployment-type",
        choices=DEPLOYMENTS,
        help="single_gpu: one process; single_node: one per device on this machine (DeepSpeed launcher); "
        "multi_node: several machines (--hostfile, or --launcher torchrun). Default: the preset's, else single_gpu",
    )
    p.add_argument("--actor-model", help="step-1 starting model: HF name, local path or builtin:NAME")
    p.add_argument("--reward-model", help="step-2 starting model (default: same as --actor-model)")
    p.add_argument("--actor-zero-stage", type=int, help="ZeRO stage of step 1 (and the actor in step 3)")
    p.add_argument("--reward-zero-stage", type=int, help="ZeRO stage of step 2 (and the critic in step 3)")
    p.add_argument("--data-path", nargs="+", help="data sources for every step (default: builtin)")
    p.add_argument(
        "--num-gpus", type=int, help="processes per node (single_node/multi_node); CPU processes without GPUs"
    )
    p.add_argument("--hostfile", help="DeepSpeed hostfile (multi_node): lines 'host slots=N'")
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        help="multi_node: DeepSpeed's pdsh (default; passwordless ssh), openmpi, mvapich, mpich, impi or slurm "
        "backends with --hostfile, or torchrun: one train.py per node with --nnodes/--node-rank/--master-addr",
    )
    p.add_argument("--launcher-args", help="extra arguments for the DeepSpeed launcher backend (one string)")
    p.add_argument("--master-addr", help="address of node 0 (torchrun; optional for the DeepSpeed launcher)")
    p.add_argument(
        "--master-port", type=int, help="rendezvous port (default: a free one; torchrun: required)"
    )
    p.add_argument("--nnodes", type=int, help="number of nodes (torchrun)")
    p.add_argument("--node-rank", type=int, help="this node's rank, 0 .. nnodes-1 (torchrun)")
    p.add_argument(
        "--node-local-storage",
        action="store_true",
        help="no shared filesystem: each node keeps its own checkpoints, exported models and summaries",
    )
    p.add_argument(
        "--dist-timeout", type=float, help="seconds a collective may wait for a silent rank (default 1800)"
    )
    p.add_argument(
        "--output-dir", default="output", help="root of the outputs: DIR/step1, DIR/step2, DIR/step3"
    )
    p.add_argument(
        "--preset",
        help="YAML preset under configs/presets (name or path), or 'none'; default: the preset of "
        "--actor-model and the deployment type if there is one, smollm2-135m (SmolLM2-135M-Instruct) without "
        "--actor-model; builtin-tiny is the 3M-parameter model built in code (tests, smoke runs)",
    )
    p.add_argument(
        "--estimate-memory",
        action="store_true",
        help="print estimated peak memory per device and per node for every ZeRO stage / offload / "
        "gradient checkpointing choice of the steps, and the choice train.py would make; run nothing",
    )
    p.add_argument("--device-memory", type=float, help="plan for GPUs of this many GiB (default: detected)")
    p.add_argument(
        "--cpu-memory", type=float, help="plan for this many GiB of RAM per node (default: detected)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the resolved preset, plan and commands; run nothing"
    )
    p.add_argument("--overwrite", action="store_true", help="replace finished runs in the output directories")
    p.add_argument("--resume", action="store_true", help="resume each step from its latest checkpoint")
    return p.parse_args(argv), extra


def visible_devices() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU"
    return os.cpu_count() or 1, "CPU core"


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """``[(host, slots)]`` of a DeepSpeed hostfile (``host slots=N`` per line, ``#`` comments)."""
    hosts = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if not m:
            raise UserError(f"--hostfile {path} line {i}: expected 'hostname slots=N', got {line!r}")
        hosts.append((m[1], int(m[2])))
    if not hosts:
        raise UserError(f"--hostfile {path}: no hosts")
    return hosts


def launcher(args: argparse.Namespace) -> list[str]:
    """The command prefix that starts one step's processes."""
    multi_only = [("--launcher", args.launcher), ("--launcher-args", args.launcher_args), ("--nnodes", args.nnodes),
                  ("--node-rank", args.node_rank)]  # fmt: skip
    if args.deployment_type != "multi_node":
        if args.hostfile:
            raise UserError("--hostfile needs --deployment-type multi_node")
        for flag, value in multi_only:
            if value is not None:
                raise UserError(f"{flag} needs --deployment-type multi_node")
    if args.deployment_type == "single_gpu":
        if args.num_gpus not in (None, 1):
            raise UserError(
                "--num-gpus needs --deployment-type single_node or multi_node (single_gpu is one process)"
            )
        return [sys.executable]
    if args.num_gpus is not None and args.num_gpus < 1:
        raise UserError(f"--num-gpus {args.num_gpus}: must be at least 1")
    from dschat.utils.dist import free_port

    if args.deployment_type == "multi_node" and args.launcher == "torchrun":
        return torchrun(args)
    port = str(args.master_port or free_port())
    runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", port]
    if args.master_addr:
        runner += ["--master_addr", args.master_addr]
    if args.deployment_type == "single_node":
        have, kind = visible_devices()
        n = args.num_gpus or have
        if n > have:
            raise UserError(f"--num-gpus {n}: this machine has only {have} {kind}{'s' if have != 1 else ''}")
        return [*runner, "--num_gpus", str(n)]
    if args.nnodes is not None or args.node_rank is not None:
        raise UserError(
            "--nnodes and --node-rank need --launcher torchrun (the DeepSpeed launcher reads --hostfile)"
        )
    if not args.hostfile:
        raise UserError(
            "--deployment-type multi_node needs --hostfile FILE (lines 'host slots=N'), "
            "or --launcher torchrun with --nnodes, --node-rank, --master-addr and --master-port"
        )
    if not Path(args.hostfile).is_file():
        raise UserError(f"--hostfile {args.hostfile}: file not found")
    read_hostfile(args.hostfile)
    cmd = [*runner, "--hostfile", args.hostfile, "--launcher", args.launcher or "pdsh"]
    if args.launcher_args:
        cmd += ["--launcher_args", args.launcher_args]
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
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank {args.node_rank} must be in 0 .. --nnodes - 1 ({args.nnodes - 1})")
    have, kind = visible_devices()
    n = args.num_gpus or have
    if n > have:
        raise UserError(f"--num-gpus {n}: this machine has only {have} {kind}{'s' if have != 1 else ''}")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nnodes), "--nproc_per_node", str(n),
            "--node_rank", str(args.node_rank), "--master_addr", args.master_addr, "--master_port",
            str(args.master_port), "--max_restarts", "0"]  # fmt: skip


def processes(args: argparse.Namespace) -> tuple[int, int]:
    """``(processes per node, nodes)`` of the deployment, for memory planning (no checks against this
    machine: one may plan for a cluster from a laptop)."""
    if args.deployment_type == "single_gpu":
        return 1, 1
    if args.deployment_type == "single_node":
        return args.num_gpus or visible_devices()[0], 1
    if args.hostfile and Path(args.hostfile).is_file():
        hosts = read_hostfile(args.hostfile)
        return args.num_gpus or hosts[0][1], len(hosts)
    if args.nnodes:
        return args.num_gpus or visible_devices()[0], args.nnodes
    raise UserError("--deployment-type multi_node: say how many nodes with --hostfile FILE or --nnodes N")


PRESETS = ROOT / "configs" / "presets"
DEFAULT_PRESET = (
    "smollm2-135m"  # the main job: a real pretrained chat model (builtin-tiny: tests, smoke runs)
)


PRESET_KEYS = {"model", "reward_model", "deployment_type", "step1", "step2", "step3", "step2_dpo"}


def read_preset(path: Path) -> dict:
    """A preset file: ``model``, ``reward_model``, ``deployment_type`` and ``stepN: {"--flag": value}``."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: malformed YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of {', '.join(sorted(PRESET_KEYS))}")
    for key, value in data.items():
        if key not in PRESET_KEYS:
            raise UserError(f"{path}: unknown key '{key}' (known: {', '.join(sorted(PRESET_KEYS))})")
        if key.startswith("step"):
            if not isinstance(value, dict) or not all(str(f).startswith("--") for f in value):
                raise UserError(f"{path}: '{key}' must map step flags (--name) to values")
        elif key == "deployment_type" and value not in DEPLOYMENTS:
            raise UserError(f"{path}: deployment_type must be one of {', '.join(DEPLOYMENTS)}, got {value!r}")
    return data


def preset_for_model(model: str, deployment: str | None) -> tuple[Path | None, str]:
    """The preset whose ``model`` is ``model`` (case-insensitive), preferring ``deployment``, else the
    smallest deployment type among that model's presets."""
    matches = []
    for path in sorted(PRESETS.glob("*.yaml")):
        data = read_preset(path)
        if str(data.get("model", "")).lower() == model.lower():
            matches.append((path, data.get("deployment_type")))
    if not matches:
        return None, ""
    exact = [p for p, d in matches if d == deployment]
    if exact:
        return exact[0], f"implied by --actor-model {model} and --deployment-type {deployment}"
    matches.sort(key=lambda m: DEPLOYMENTS.index(m[1]) if m[1] in DEPLOYMENTS else len(DEPLOYMENTS))
    return matches[0][0], f"implied by --actor-model {model}"


def load_preset(args: argparse.Namespace) -> dict:
    """The preset (``{"model": ..., "step1": {"--flag": value}, ...}``, empty if none) and ``_name``,
    ``_why`` for the report. Explicit ``--preset``, else the one of ``--actor-model``, else
    :data:`DEFAULT_PRESET`."""
    if args.preset == "none":
        return {}
    if args.preset:
        name = args.preset
        path = Path(name) if name.endswith((".yaml", ".yml")) else PRESETS / f"{name}.yaml"
        why = "--preset"
    elif args.actor_model:
        path, why = preset_for_model(args.actor_model, args.deployment_type)
        if path is None:
            return {}
        name = path.stem
    else:
        name, path, why = (
            DEFAULT_PRESET,
            PRESETS / f"{DEFAULT_PRESET}.yaml",
            "the default without --actor-model",
        )
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise UserError(f"--preset {name}: no such preset (known: {known})")
    return {**read_preset(path), "_name": path.stem, "_why": why}


def describe_preset(preset: dict, args: argparse.Namespace) -> str:
    """One line: the preset, why it applies, and every value it sets (after command-line overrides)."""
    head = [f"deployment {args.deployment_type}"]
    head += [f"model {args.actor_model or preset['model']}"] if preset.get("model") else []
    head += (
        [f"reward model {args.reward_model or preset['reward_model']}"] if preset.get("reward_model") else []
    )
    keys = [step_of(n, args).dir_name for n in steps_of(args)]
    steps = [f"{k} {' '.join(preset_flags(preset, k, args.output_dir))}" for k in keys if preset.get(k)]
    return f"==> preset {preset['_name']} ({preset['_why']}): " + "; ".join(head + steps)


def preset_flags(preset: dict, step: int | str, output_dir: str | None = None) -> list[str]:
    """The preset's flags of one step (its number, or its section name such as ``step2_dpo``);
    ``{output_dir}`` in a value becomes the run's --output-dir (so a preset can point one step at
    another's output, e.g. ``{output_dir}/step1``)."""
    out: list[str] = []
    for flag, value in (preset.get(step if isinstance(step, str) else f"step{step}") or {}).items():
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    if output_dir is not None:
        out = [v.replace("{output_dir}", output_dir) for v in out]
    return out


def step_args(
    step: int, args: argparse.Namespace, extra: list[str], preset: dict | None = None, planned: list[str] = ()
) -> list[str]:
    """The step's command line: the preset's flags, then train.py's own, the memory plan's (``planned``:
    only flags no one else set), then the user's after ``--`` (argparse keeps the last value, so the
    user's flags override the preset's)."""
    spec = step_of(step, args)
    out_dir = str(Path(args.output_dir) / spec.dir_name)
    a = ["--output_dir", out_dir]
    if spec is DPO_STEP:
        a += ["--model_name_or_path", policy_start_model(args, preset)]
        if args.actor_zero_stage is not None:
            a += ["--zero_stage", str(args.actor_zero_stage)]
    elif step == 1:
        model = args.actor_model or (preset or {}).get("model")
        if model:
            a += ["--model_name_or_path", model]
        if args.actor_zero_stage is not None:
            a += ["--zero_stage", str(args.actor_zero_stage)]
    elif step == 2:
        a += ["--model_name_or_path", reward_start_model(args, preset)]
        if args.reward_zero_stage is not None:
            a += ["--zero_stage", str(args.reward_zero_stage)]
    elif step == 3:
        a += ["--actor_model_name_or_path", str(Path(args.output_dir) / "step1"),
              "--critic_model_name_or_path", args.reward_model if args.reward_model and 2 not in steps_of(args)
              else str(Path(args.output_dir) / "step2")]  # fmt: skip
        if args.actor_zero_stage is not None:
            a += ["--actor_zero_stage", str(args.actor_zero_stage)]
        if args.reward_zero_stage is not None:
            a += ["--critic_zero_stage", str(args.reward_zero_stage)]
    if args.data_path:
        a += ["--data_path", *args.data_path]
    if args.overwrite:
        a.append("--overwrite")
    if args.resume:
        a.append("--resume")
    if args.node_local_storage:
        a.append("--node_local_storage")
    return preset_flags(preset or {}, spec.dir_name, args.output_dir) + a + list(planned) + extra


# train.py flag -> the step flag it sets, per step (a different value for the same step flag after -- is a conflict)
ALIASES = {
    "actor_zero_stage": {1: "--zero_stage", 3: "--actor_zero_stage"},
    "reward_zero_stage": {2: "--zero_stage", 3: "--critic_zero_stage"},
    "actor_model": {1: "--model_name_or_path"},
}


def check_conflicts(args: argparse.Namespace, extra: list[str], steps: list[int]) -> None:
    """A train.py flag and the step flag it sets, given after ``--`` with another value, is an error."""
    from dschat.planning import given

    for name, per_step in ALIASES.items():
        value = getattr(args, name)
        if value is None:
            continue
        if name == "actor_zero_stage" and args.algorithm == "dpo":  # DPO's step 2 trains the actor
            per_step = {**per_step, 2: "--zero_stage"}
        for n, flag in per_step.items():
            other = given(extra, flag)
            if n in steps and other is not None and other != str(value):
                raise UserError(f"conflicting flags: --{name.replace('_', '-')} {value} and {flag} {other} "
                                f"after -- (step {n}); give one")  # fmt: skip


def steps_of(args: argparse.Namespace) -> list[int]:
    if args.step:
        return sorted(set(args.step))
    return [1, 2] if getattr(args, "algorithm", "ppo") == "dpo" else [n for n, s in STEPS.items() if s.built]


def policy_start_model(args: argparse.Namespace, preset: dict | None = None) -> str:
    """DPO starts from this run's step-1 model (when step 1 runs or has run), else from --actor-model,
    the preset's model or the embedded default."""
    step1 = Path(args.output_dir) / "step1"
    if (step1 / "summary.json").exists() or 1 in (args.step or [1]):
        return str(step1)
    from dschat.config import DEFAULT_MODEL

    return args.actor_model or (preset or {}).get("model") or DEFAULT_MODEL


def reward_start_model(args: argparse.Namespace, preset: dict | None = None) -> str:
    """Step 2 starts from --reward-model, else the preset's reward model (DeepSpeed-Chat trains OPT-350m
    rewards for every OPT actor), else from this run's step-1 model (it already knows the prompt format
    and the tasks), else from --actor-model or the embedded default."""
    if args.reward_model or (preset or {}).get("reward_model"):
        return args.reward_model or preset["reward_model"]
    step1 = Path(args.output_dir) / "step1"
    if (step1 / "summary.json").exists() or 1 in (args.step or [1]):
        return str(step1)
    from dschat.config import DEFAULT_MODEL

    return args.actor_model or (preset or {}).get("model") or DEFAULT_MODEL


class RankWatch:
    """Which rank failed first, for the error line of a failed step.

    The DeepSpeed launcher logs ``process PID spawned with command: [... '--local_rank=R' ...]`` per
    rank and stops every rank when one exits non-zero, but does not say which one did: a thread polls
    those processes and remembers the first to end. torchrun's own failure report names the rank
    (``Root Cause ... rank : R``) and is read from the output.
    """

    SPAWN = re.compile(rb"process (\d+) spawned with command: \[.*?'--local_rank=(\d+)'")
    ROOT_CAUSE = re.compile(
        rb"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S
    )

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}  # pid -> local rank
        self.together: list[tuple[int, int]] = []  # every (rank, pid) seen ended in the first such poll
        self.tail = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def feed(self, chunk: bytes) -> None:
        self.tail = (self.tail + chunk)[-65536:]
        for m in self.SPAWN.finditer(chunk):
            self.pids[int(m[1])] = int(m[2])

    @property
    def first(self) -> tuple[int, int] | None:
        """(rank, pid) of the first rank seen ended (the lowest, if several were seen in the same poll)."""
        return self.together[0] if self.together else None

    def _poll(self) -> None:
        import psutil

        while self.first is None and not self._stop.wait(0.02):
            ended = []
            for pid, rank in list(self.pids.items()):
                try:
                    gone = psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
                except psutil.NoSuchProcess:
                    gone = True
                if gone:
                    ended.append((rank, pid))
            # Ranks seen ended in the same poll are not ordered (a rank's crash makes its peers' collectives
            # fail within milliseconds): name them all rather than guess, lowest rank first.
            self.together = sorted(ended)

    def report(self) -> str:
        self._stop.set()
        m = self.ROOT_CAUSE.search(self.tail)
        if m:
            return f"torchrun on this node reports rank {int(m[1])} failed first (exit code {int(m[2])})"
        if len(self.together) > 1:
            names = ", ".join(f"{r} (pid {p})" for r, p in self.together)
            return (
                f"ranks {names} ended within 20 ms of each other; the launcher then stopped the other ranks"
            )
        if self.first is not None:
            return f"rank {self.first[0]} (pid {self.first[1]}) ended first; the launcher then stopped the other ranks"
        return ""


def run_step(
    step: Step, cmd: list[str], log_path: Path, append: bool, env: dict | None = None
) -> tuple[int, str]:
    """Run ``cmd``, copying its output byte for byte to the console and ``log_path``; returns the exit
    code and, on failure, which rank failed first (if known)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DSCHAT_LOG_CAPTURED": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    watch = RankWatch()
    with open(log_path, "ab" if append else "wb") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        # the user's working directory: relative --output-dir and data paths mean the same to every step
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd()
        )
        try:
            while chunk := os.read(proc.stdout.fileno(), 65536):
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
                log.write(chunk)
                watch.feed(chunk)
            code = proc.wait()
            return code, watch.report() if code else ""
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise


# ---------------------------------------------------------------------------------------------- memory planning
def parse_step(step: Step, argv: list[str]) -> tuple:
    """The step's option groups parsed from ``argv`` by the step's own parser (its ``GROUPS`` and
    ``STEP_DEFAULTS``), without running the step: a bad flag stops here, before any step starts."""
    from dschat import config as C

    name = f"_dschat_{step.dir_name}_main"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, step.entry)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    module = sys.modules[name]
    return C.parse_groups(
        step.entry.parent.name, "", module.GROUPS, argv, getattr(module, "STEP_DEFAULTS", None)
    )


def planning_models(n: int, args: argparse.Namespace, extra: list[str], preset: dict) -> dict[str, str]:
    """For models this run writes in an earlier step (not there yet), the model that step starts from:
    it has the same shape."""
    from dschat.config import DEFAULT_MODEL
    from dschat.planning import given

    def written(path: str) -> bool:
        return (Path(path) / "config.json").is_file()

    out = Path(args.output_dir)
    step1_start = given(step_args(1, args, extra, preset), "--model_name_or_path") or DEFAULT_MODEL
    step2_start = reward_start_model(args, preset)
    if step2_start == str(out / "step1") and not written(step2_start):
        step2_start = step1_start
    models = {}
    if step_of(n, args) is DPO_STEP:  # DPO trains the policy from step 1's start
        if not written(policy_start_model(args, preset)):
            models["model"] = step1_start
    elif n == 2 and not written(reward_start_model(args, preset)):
        models["model"] = step2_start
    if n == 3:
        argv = step_args(3, args, extra, preset)
        if not written(given(argv, "--actor_model_name_or_path") or ""):
            models["actor"] = step1_start
        if not written(given(argv, "--critic_model_name_or_path") or ""):
            models["critic"] = step2_start
    return models


def resumed_choice(n: int, args: argparse.Namespace):
    """On --resume, the choice the interrupted run made (its dschat_config.json), so it resumes alike."""
    import json

    from dschat.memory import Choice

    try:
        cfg = json.loads((Path(args.output_dir) / f"step{n}" / "dschat_config.json").read_text())
        if n == 3:
            return Choice(cfg["actor_zero_stage"], cfg["offload"], cfg["actor"]["gradient_checkpointing"])
        return Choice(cfg["zero_stage"], cfg["offload"], cfg["gradient_checkpointing"])
    except (OSError, ValueError, KeyError):
        return None


def memory_plan(
    n: int, args: argparse.Namespace, extra: list[str], preset: dict, argv: list[str]
) -> list[str]:
    """Print the step's memory plan; return the flags that apply its choice (those not set explicitly).

    ``--estimate-memory``: the full table, and errors (a model config not available offline) are errors.
    A run: one line; a plan that cannot be made is reported and the step's own defaults apply."""
    from dschat import planning as P

    full = args.estimate_memory
    groups = parse_step(step_of(n, args), argv)
    dpo = step_of(n, args) is DPO_STEP
    try:
        gpn, nodes = processes(args)
        hw = P.detect_hardware(gpn, nodes, args.device_memory, args.cpu_memory)
        flags = {"model": "--actor-model" if n == 1 or dpo else "--reward-model", "actor": "--actor-model",
                 "critic": "--reward-model"}  # fmt: skip
        plan = P.make_plan(n, groups, argv, hw, planning_models(n, args, extra, preset), flags)
    except UserError as exc:
        if full:
            raise
        print(f"==> memory plan, step {n}: skipped ({exc}); the step's own defaults apply", flush=True)
        return []
    if full:
        print(P.format_plan(plan, full=True), flush=True)
        return []
    if args.resume and (saved := resumed_choice(n, args)) is not None:
        flags = P.choice_flags(n, saved, argv)
        print(f"==> memory plan, step {n}: resuming with the interrupted run's {saved.describe()}"
              + (f" (adds {' '.join(flags)})" if flags else ""), flush=True)  # fmt: skip
        return flags
    chosen = plan.chosen
    unit = "GPU" if hw.on_gpu else "process"
    flags = P.choice_flags(n, chosen.choice, argv)
    if len(plan.fixed) == 3 or (plan.fixed.get("zero_stage") == 0 and "gradient_checkpointing" in plan.fixed):
        how = "set by your flags"
    else:
        how = "picked" + (f" (adds {' '.join(flags)})" if flags else "")
    print(f"==> memory plan, step {n}: {chosen.choice.describe()}, {how}: {plan.reason}; estimate "
          f"{' + '.join(f'{k} {P.M.gib(v)}' for k, v in chosen.parts.items())} GiB per {unit}", flush=True)  # fmt: skip
    if chosen.fits(hw) is False:
        print(f"warning: step {n} may run out of memory: {plan.reason}", file=sys.stderr, flush=True)
    return flags


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    # The steps' own --resume / --overwrite after -- are train.py's: they reach every step either way, and
    # the output-directory checks, the memory plan and the log here must know about them too.
    for name in ("resume", "overwrite"):
        if f"--{name}" in extra:
            setattr(args, name, True)
            extra = [a for a in extra if a != f"--{name}"]
    steps = steps_of(args)
    if args.algorithm == "dpo":
        check_dpo(args, steps)
    for n in steps:
        if not STEPS[n].built:
            raise UserError(
                f"--step {n}: step {n} ({STEPS[n].name}) is not built yet in this version of dschat"
            )
    for flag, value in (
        ("--actor-zero-stage", args.actor_zero_stage),
        ("--reward-zero-stage", args.reward_zero_stage),
    ):
        if value is not None:
            check_zero_stage(flag, value)
    for flag, value in (("--device-memory", args.device_memory), ("--cpu-memory", args.cpu_memory),
                        ("--dist-timeout", args.dist_timeout)):  # fmt: skip
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be > 0, got {value}")
    preset = load_preset(args)
    args.deployment_type = args.deployment_type or preset.get("deployment_type") or "single_gpu"
    check_conflicts(args, extra, steps)
    if preset:
        print(describe_preset(preset, args), flush=True)
    if args.estimate_memory:
        for n in steps:
            memory_plan(n, args, extra, preset, step_args(n, args, extra, preset))
        return 0
    prefix = launcher(args)
    for n in steps:
        for needed in (1, 2) if n == 3 else ():
            if (
                needed not in steps
                and not (Path(args.output_dir) / f"step{needed}" / "summary.json").exists()
            ):
                if needed == 2 and args.reward_model:
                    continue
                raise UserError(
                    f"--step 3 needs a finished step {needed} in {Path(args.output_dir) / f'step{needed}'} "
                    f"(run --step {needed} first, or add it: --step 1 2 3)"
                )
        check_output_dir(str(Path(args.output_dir) / step_of(n, args).dir_name), overwrite=args.overwrite, resume=args.resume,
                         flag="--output-dir")  # fmt: skip
        parse_step(step_of(n, args), step_args(n, args, extra, preset))  # every step's flags, before any runs
    env = {"DSCHAT_DIST_TIMEOUT": str(args.dist_timeout)} if args.dist_timeout else {}
    # With torchrun every node runs this script: node 0 writes training.log, the others their own file.
    node = f".node{args.node_rank}" if args.launcher == "torchrun" and args.node_rank else ""
    for n in steps:
        step = step_of(n, args)
        argv_n = step_args(n, args, extra, preset)
        planned = memory_plan(n, args, extra, preset, argv_n)
        cmd = [*prefix, str(step.entry), *step_args(n, args, extra, preset, planned)]
        out_dir = Path(args.output_dir) / step.dir_name
        print(f"==> step {n} ({step.name}): {shlex.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        log = out_dir / f"training{node}.log"
        code, failed = run_step(step, cmd, log, append=args.resume, env=env)
        if code != 0:
            print(
                f"error: step {n} ({step.name}) failed with exit code {code}"
                + (f": {failed}" if failed else "") + f"; log: {log}",
                file=sys.stderr,
            )  # fmt: skip
            return code if 0 < code < 128 else 1
        print(f"==> step {n} done: {out_dir}", flush=True)
    if not getattr(args, "dry_run", False):
        for line in next_commands(args, steps, preset):
            print(line, flush=True)
    return 0


def check_dpo(args: argparse.Namespace, steps: list[int]) -> None:
    """--algorithm dpo has no reward model and no step 3: flags about them conflict with it."""
    if 3 in steps:
        raise UserError(
            "--step 3 with --algorithm dpo: DPO trains the policy in step 2 and has no step 3 (use --step 1 2)"
        )
    for flag, value in (
        ("--reward-model", args.reward_model),
        ("--reward-zero-stage", args.reward_zero_stage),
    ):
        if value is not None:
            raise UserError(
                f"{flag} with --algorithm dpo: DPO trains no reward model (use --actor-zero-stage)"
            )


def next_commands(args: argparse.Namespace, steps: list[int], preset: dict | None = None) -> list[str]:
    """After a finished job: the commands that chat with its result and compare it with its start."""
    out = Path(args.output_dir)
    if args.algorithm == "dpo" and 2 in steps:
        result, start = out / DPO_STEP.dir_name, policy_start_model(args, preset)
    elif 3 in steps:
        result, start = out / "step3" / "actor", str(out / "step1")
    elif 1 in steps:
        from dschat.config import DEFAULT_MODEL

        result, start = out / "step1", args.actor_model or (preset or {}).get("model") or DEFAULT_MODEL
    else:
        return []  # step 2 alone made a reward model: nothing to talk to
    if args.algorithm == "dpo":
        reward = None  # no reward model in a DPO run
    elif (out / "step2" / "summary.json").exists():
        reward = str(out / "step2")
    else:
        reward = args.reward_model if 3 in steps else None

    def script(name: str) -> str:
        rel = os.path.relpath(ROOT / "inference" / name)
        return str(ROOT / "inference" / name) if rel.startswith("..") else rel

    # the run's own built-in tasks (a preset's --data_path builtin:sort,reverse_words), if it used some
    data = args.data_path or [
        str(v) for v in str((preset or {}).get("step1", {}).get("--data_path", "")).split()
    ]
    names = [t for d in data if d.startswith("builtin:") for t in d.split(":", 1)[1].split(",")]
    compare = ["python", script("prompt_eval.py"), "--model_name_or_path_baseline", start,
               "--model_name_or_path_finetune", str(result), *(["--reward_model", reward] if reward else []),
               *(["--tasks", ",".join(names)] if names else []),
               "--output", str(out / f"prompt_eval_{result.relative_to(out).parts[0]}")]  # fmt: skip
    return [
        f"==> talk to the result: {shlex.join(['python', script('chat.py'), '--path', str(result)])}",
        f"==> compare it with its starting model: {shlex.join(compare)}",
    ]


if __name__ == "__main__":
    run_cli(main)
