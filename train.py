#!/usr/bin/env python
"""Run the dschat pipeline: step 1 (SFT), step 2 (reward model), step 3 (PPO).

    python train.py                                   # every built step on the embedded default
    python train.py --step 1 --deployment-type single_node --num-gpus 2 --actor-zero-stage 3
    python train.py --step 1 --actor-model facebook/opt-1.3b --data-path Dahoas/rm-static -- --lora_dim 128

This script only orchestrates: it builds each step's command line (``training/stepN_*/main.py``),
launches it (one process, or the DeepSpeed launcher), streams its output to the console and to
``OUTPUT_DIR/stepN/training.log``, and stops at the first failing step. Everything after ``--`` is
passed verbatim to every step.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from dschat.utils.errors import UserError, run_cli  # noqa: E402
from dschat.utils.run import check_output_dir  # noqa: E402


@dataclass(frozen=True)
class Step:
    number: int
    name: str
    entry: Path
    built: bool


STEPS = {
    1: Step(1, "supervised fine-tuning", ROOT / "training/step1_supervised_finetuning/main.py", True),
    2: Step(2, "reward model", ROOT / "training/step2_reward_model_finetuning/main.py", True),
    3: Step(3, "RLHF (PPO)", ROOT / "training/step3_rlhf_finetuning/main.py", True),
}


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
        "--deployment-type", choices=("single_gpu", "single_node", "multi_node"), default="single_gpu"
    )
    p.add_argument("--actor-model", help="step-1 starting model: HF name, local path or builtin:NAME")
    p.add_argument("--reward-model", help="step-2 starting model (default: same as --actor-model)")
    p.add_argument("--actor-zero-stage", type=int, help="ZeRO stage of step 1 (and the actor in step 3)")
    p.add_argument("--reward-zero-stage", type=int, help="ZeRO stage of step 2 (and the critic in step 3)")
    p.add_argument("--data-path", nargs="+", help="data sources for every step (default: builtin)")
    p.add_argument(
        "--num-gpus", type=int, help="processes per node (single_node/multi_node); CPU processes without GPUs"
    )
    p.add_argument("--hostfile", help="DeepSpeed hostfile (multi_node)")
    p.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    p.add_argument(
        "--output-dir", default="output", help="root of the outputs: DIR/step1, DIR/step2, DIR/step3"
    )
    p.add_argument(
        "--preset",
        help="YAML preset under configs/presets (name or path); default: builtin-tiny "
        "when no --actor-model is given",
    )
    p.add_argument("--overwrite", action="store_true", help="replace finished runs in the output directories")
    p.add_argument("--resume", action="store_true", help="resume each step from its latest checkpoint")
    return p.parse_args(argv), extra


def visible_devices() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU"
    return os.cpu_count() or 1, "CPU core"


def launcher(args: argparse.Namespace) -> list[str]:
    """The command prefix that starts one step's processes."""
    if args.deployment_type == "single_gpu":
        if args.num_gpus not in (None, 1):
            raise UserError(
                "--num-gpus needs --deployment-type single_node or multi_node (single_gpu is one process)"
            )
        if args.hostfile:
            raise UserError("--hostfile needs --deployment-type multi_node")
        return [sys.executable]
    from dschat.utils.dist import free_port

    port = str(args.master_port or free_port())
    runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", port]
    if args.deployment_type == "single_node":
        if args.hostfile:
            raise UserError("--hostfile needs --deployment-type multi_node")
        have, kind = visible_devices()
        n = args.num_gpus or have
        if n < 1:
            raise UserError(f"--num-gpus {n}: must be at least 1")
        if n > have:
            raise UserError(f"--num-gpus {n}: this machine has only {have} {kind}{'s' if have != 1 else ''}")
        return [*runner, "--num_gpus", str(n)]
    if not args.hostfile:
        raise UserError("--deployment-type multi_node needs --hostfile FILE (lines 'host slots=N')")
    if not Path(args.hostfile).is_file():
        raise UserError(f"--hostfile {args.hostfile}: file not found")
    cmd = [*runner, "--hostfile", args.hostfile]
    if args.num_gpus:
        cmd += ["--num_gpus", str(args.num_gpus)]
    return cmd


PRESETS = ROOT / "configs" / "presets"


def load_preset(args: argparse.Namespace) -> dict:
    """The preset's per-step flags: ``{"model": ..., "step1": {"--flag": value}, ...}`` (empty if none)."""
    import yaml

    name = args.preset or (None if args.actor_model else "builtin-tiny")
    if name is None:
        return {}
    path = Path(name) if name.endswith((".yaml", ".yml")) else PRESETS / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise UserError(f"--preset {name}: no such preset (known: {known})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: malformed YAML ({str(exc).splitlines()[0]})") from None
    for key, flags in data.items():
        if key.startswith("step") and not isinstance(flags, dict):
            raise UserError(f"{path}: '{key}' must map flags to values")
    return data


def preset_flags(preset: dict, step: int) -> list[str]:
    out: list[str] = []
    for flag, value in (preset.get(f"step{step}") or {}).items():
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return out


def step_args(step: int, args: argparse.Namespace, extra: list[str], preset: dict | None = None) -> list[str]:
    out_dir = str(Path(args.output_dir) / f"step{step}")
    a = ["--output_dir", out_dir]
    if step == 1:
        model = args.actor_model or (preset or {}).get("model")
        if model:
            a += ["--model_name_or_path", model]
        if args.actor_zero_stage is not None:
            a += ["--zero_stage", str(args.actor_zero_stage)]
    if step == 2:
        a += ["--model_name_or_path", reward_start_model(args)]
        if args.reward_zero_stage is not None:
            a += ["--zero_stage", str(args.reward_zero_stage)]
    if step == 3:
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
    # preset values first, so that the user's own flags (after --) win: argparse keeps the last value
    return a + preset_flags(preset or {}, step) + extra


def steps_of(args: argparse.Namespace) -> list[int]:
    return sorted(set(args.step)) if args.step else [n for n, s in STEPS.items() if s.built]


def reward_start_model(args: argparse.Namespace) -> str:
    """Step 2 starts from --reward-model, else from this run's step-1 model (it already knows the prompt
    format and the tasks), else from --actor-model or the embedded default."""
    if args.reward_model:
        return args.reward_model
    step1 = Path(args.output_dir) / "step1"
    if (step1 / "summary.json").exists() or 1 in (args.step or [1]):
        return str(step1)
    return args.actor_model or "builtin:tiny-llama"  # the builtin-tiny preset's model


def run_step(step: Step, cmd: list[str], log_path: Path, append: bool) -> int:
    """Run ``cmd``, copying its output byte for byte to the console and ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DSCHAT_LOG_CAPTURED": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab" if append else "wb") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            while chunk := os.read(proc.stdout.fileno(), 65536):
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
                log.write(chunk)
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    steps = steps_of(args)
    for n in steps:
        if not STEPS[n].built:
            raise UserError(
                f"--step {n}: step {n} ({STEPS[n].name}) is not built yet in this version of dschat"
            )
    for flag, value in (
        ("--actor-zero-stage", args.actor_zero_stage),
        ("--reward-zero-stage", args.reward_zero_stage),
    ):
        if value is not None and value not in (0, 1, 2, 3):
            raise UserError(f"{flag} must be 0, 1, 2 or 3, got {value}")
    prefix = launcher(args)
    preset = load_preset(args)
    if preset:
        print(f"==> preset {args.preset or 'builtin-tiny'}: " + "; ".join(
            f"{k} {' '.join(preset_flags(preset, int(k[4:])))}" for k in preset if k.startswith("step")), flush=True)  # fmt: skip
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
        check_output_dir(str(Path(args.output_dir) / f"step{n}"), overwrite=args.overwrite, resume=args.resume,
                         flag="--output-dir")  # fmt: skip
    for n in steps:
        step = STEPS[n]
        cmd = [*prefix, str(step.entry), *step_args(n, args, extra, preset)]
        out_dir = Path(args.output_dir) / f"step{n}"
        print(f"==> step {n} ({step.name}): {shlex.join(cmd)}", flush=True)
        code = run_step(step, cmd, out_dir / "training.log", append=args.resume)
        if code != 0:
            print(
                f"error: step {n} ({step.name}) failed with exit code {code}; log: {out_dir / 'training.log'}",
                file=sys.stderr,
            )
            return code if 0 < code < 128 else 1
        print(f"==> step {n} done: {out_dir}", flush=True)
    if not getattr(args, "dry_run", False):
        for line in next_commands(args, steps, preset):
            print(line, flush=True)
    return 0


def next_commands(args: argparse.Namespace, steps: list[int], preset: dict | None = None) -> list[str]:
    """After a finished job: the commands that chat with its result and compare it with its start."""
    out = Path(args.output_dir)
    if 3 in steps:
        result, start = out / "step3" / "actor", str(out / "step1")
    elif 1 in steps:
        result, start = out / "step1", args.actor_model or (preset or {}).get("model") or "builtin:tiny-llama"
    else:
        return []  # step 2 alone made a reward model: nothing to talk to
    if (out / "step2" / "summary.json").exists():
        reward = str(out / "step2")
    else:
        reward = args.reward_model if 3 in steps else None

    def script(name: str) -> str:
        rel = os.path.relpath(ROOT / "inference" / name)
        return str(ROOT / "inference" / name) if rel.startswith("..") else rel

    compare = ["python", script("prompt_eval.py"), "--model_name_or_path_baseline", start,
               "--model_name_or_path_finetune", str(result), *(["--reward_model", reward] if reward else []),
               "--output", str(out / f"prompt_eval_step{3 if 3 in steps else 1}")]  # fmt: skip
    return [
        f"==> talk to the result: {shlex.join(['python', script('chat.py'), '--path', str(result)])}",
        f"==> compare it with its starting model: {shlex.join(compare)}",
    ]


if __name__ == "__main__":
    run_cli(main)
