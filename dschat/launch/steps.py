"""The steps of the pipeline and each step's command line: the registry of recipes
(``training/stepN_*/main.py``), which steps a run takes, the flags train.py passes to each (after the
preset's, before the user's), and the models each step starts from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from dschat.launch.presets import preset_flags
from dschat.utils.errors import UserError
from dschat.utils.run import finished

ROOT = Path(__file__).resolve().parents[2]  # the project: training/ and configs/ live here


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

    @property
    def module(self) -> str:
        """The recipe as a module (``training`` is a namespace package under the project root)."""
        return f"training.{self.entry.parent.name}.main"


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


def step_args(step: int, args: argparse.Namespace, extra: list[str], preset: dict | None = None) -> list[str]:
    """The step's command line: the preset's flags, then train.py's own, then the user's after ``--``
    (argparse keeps the last value, so the user's flags override the preset's). train.py's ``StepLine``
    puts the memory plan's flags (only flags no one else set) before the user's."""
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
    return preset_flags(preset or {}, spec.dir_name, args.output_dir) + a + extra


# train.py flag -> the step flag it sets, per step (a different value for the same step flag after -- is a conflict)
ALIASES = {
    "actor_zero_stage": {1: "--zero_stage", 3: "--actor_zero_stage"},
    "reward_zero_stage": {2: "--zero_stage", 3: "--critic_zero_stage"},
    "actor_model": {1: "--model_name_or_path"},
}


# The model flags train.py chains from the earlier steps' outputs (and its own --actor-model / --reward-model),
# as (step, algorithm, flag, what it names, what train.py sets it to): given after -- (which reaches every
# step), they would silently replace the chain
CHAINED_MODELS = (
    (2, "ppo", "--model_name_or_path", "step 2's model", "step 1's output, or --reward-model"),
    (2, "dpo", "--model_name_or_path", "DPO's policy", "step 1's output"),
    (3, "ppo", "--actor_model_name_or_path", "step 3's model", "step 1's output"),
    (3, "ppo", "--critic_model_name_or_path", "step 3's critic", "step 2's output, or --reward-model"),
)


def check_chained_models(args: argparse.Namespace, extra: list[str], steps: list[int]) -> None:
    """A model flag after ``--`` that train.py sets itself for a later step is an error: ``--`` reaches
    every step, so ``-- --model_name_or_path X`` would also replace step 2's start (step 1's output)."""
    from dschat.planning import given

    algorithm = getattr(args, "algorithm", "ppo")
    for n, alg, flag, name, chained in CHAINED_MODELS:
        if alg == algorithm and n in steps and given(extra, flag) is not None:
            raise UserError(f"{flag} after -- would replace {name}, which train.py sets ({chained}); give the "
                            "model of step 1 with --actor-model and of step 2 with --reward-model")  # fmt: skip


def check_conflicts(args: argparse.Namespace, extra: list[str], steps: list[int]) -> None:
    """A train.py flag and the step flag it sets, given after ``--`` with another value, is an error; so
    is a model flag after ``--`` that train.py chains from an earlier step (:func:`check_chained_models`)."""
    from dschat.planning import given

    check_chained_models(args, extra, steps)
    for name in ("overwrite", "resume", "node_local_storage"):  # train.py's own switches, set per step by it
        if any(a.split("=", 1)[0] == f"--no_{name}" for a in extra):
            raise UserError(f"--no_{name} after -- would undo train.py's --{name.replace('_', '-')} in every step; "
                            f"give or leave out train.py's --{name.replace('_', '-')} instead")  # fmt: skip
    if given(extra, "--output_dir") is not None:  # every step would write into the one directory
        raise UserError("--output_dir after -- would send every step to one directory: give train.py "
                        "--output-dir (each step writes its own OUTPUT_DIR/stepN)")  # fmt: skip
    if args.data_path and given(extra, "--data_path") is not None:
        raise UserError(
            f"conflicting flags: --data-path {' '.join(args.data_path)} and --data_path after --; give one"
        )

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
    if finished(step1) or 1 in (args.step or [1]):
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
    if finished(step1) or 1 in (args.step or [1]):
        return str(step1)
    from dschat.config import DEFAULT_MODEL

    return args.actor_model or (preset or {}).get("model") or DEFAULT_MODEL


# ---------------------------------------------------------------------------------------------- memory planning
