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
import difflib
import importlib
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from dschat.config import check_zero_stage  # noqa: E402
from dschat.inputs import DATA, MODEL, check_inputs  # noqa: E402
from dschat.launch.launcher import (  # noqa: E402
    DEPLOYMENTS,
    LAUNCHERS,
    check_deployment_flags,
    launcher,
    launcher_env,
    processes,
)
from dschat.launch.presets import (  # noqa: E402
    load_preset,
)
from dschat.launch.steps import (  # noqa: E402
    ALGORITHMS,
    DPO_STEP,
    STEPS,
    Step,
    check_conflicts,
    describe_preset,
    policy_start_model,
    reward_start_model,
    step_args,
    step_of,
    steps_of,
)
from dschat.launch.supervise import run_step, step_log  # noqa: E402
from dschat.utils.errors import UserError, run_cli  # noqa: E402
from dschat.utils.run import changed_inputs, check_output_dir, finished, trained_config  # noqa: E402


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)  # flags only as spelt (see dschat.config.ArgumentParser)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse keeps the last of a repeated flag ('--step 1 --step 2' ran step 2 alone): a flag of
        train.py given twice is an error, the values belong in one (``--step 1 2``)."""
        seen: set[str] = set()
        for arg in args or []:
            name = arg.split("=", 1)[0]
            action = self._option_string_actions.get(name)
            # a value flag, not a switch: a switch given twice changes nothing
            if action is not None and name.startswith("--") and action.nargs != 0:
                if name in seen:
                    self.error(f"{name} given twice; give it once (with all its values, e.g. --step 1 2)")
                seen.add(name)
        return super().parse_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        print(f"error: {message}{self._hint(message)} (see train.py --help)", file=sys.stderr)
        sys.exit(2)

    def _hint(self, message: str) -> str:
        """The fix for the usual slip: a flag spelt the steps' way (``--output_dir``), a typo of one of
        train.py's flags, or a step's own flag given before ``--``."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        flag = next((a for a in message[len(prefix) :].split() if a.startswith("--")), None)
        if flag is None:
            return ""
        name = flag.split("=", 1)[0]
        dashed = name.replace("_", "-").lower()
        if dashed in self._option_string_actions:
            return f"; train.py spells it {dashed}"
        close = difflib.get_close_matches(
            dashed, [o for o in self._option_string_actions if o.startswith("--")], 1, 0.85
        )
        if close:  # a typo of train.py's own flag
            return f"; did you mean {close[0]}?"
        if name in ("--model_name_or_path", "--actor_model_name_or_path"):  # chained from step to step
            return "; train.py takes step 1's model as --actor-model (and step 2's as --reward-model)"
        if name == "--critic_model_name_or_path":
            return "; train.py takes the reward model as --reward-model"
        return f"; a step's own flags go after --: train.py -- {name} ..."


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
        "--master-port",
        type=int,
        help="rendezvous port (default: a free one, found again for each step; torchrun: required)",
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


@dataclass
class StepLine:
    """One step's command line, built once (the preset's and train.py's flags, then the user's after
    ``--``) and parsed once by the step's own parser: a bad flag stops the run before any step starts."""

    step: Step
    base: list[str]  # the preset's and train.py's flags
    user: list[str]  # the user's, after --: last, so that they win
    groups: tuple  # the step's option groups, parsed from argv

    @classmethod
    def of(cls, n: int, args: argparse.Namespace, extra: list[str], preset: dict) -> StepLine:
        step, base = step_of(n, args), step_args(n, args, [], preset)
        if n == 3:
            base = without_a_critic(step, base, extra)
        user = list(extra) if n == 1 else without_step1_only(n, extra)
        return cls(step, base, user, parse_step(step, [*base, *user]))

    @property
    def argv(self) -> list[str]:
        return [*self.base, *self.user]

    def command(self, planned: list[str]) -> list[str]:
        """The step's argv with the memory plan's flags (only flags no one set) before the user's."""
        return [*self.base, *planned, *self.user]


def without_a_critic(step: Step, base: list[str], user: list[str]) -> list[str]:
    """Step 3's preset flags less the critic's where the user's (after --) pick a critic-free estimator:
    the preset's critic settings (builtin-tiny's --critic_learning_rate, --freezing_actor_steps) would be
    refused as read by nothing, and the user's choice wins over the preset's. The user's own critic flags
    still are refused."""
    from dschat.planning import given

    estimator = given([*base, *user], "--advantage_estimator")
    if estimator in (None, "gae"):
        return base
    kept, dropped = drop_flags(base, importlib.import_module(step.module).critic_only_flags())
    if dropped:
        print(f"==> step 3: --advantage_estimator {estimator} trains no critic: the preset's "
              f"{' '.join(dropped)} left out", flush=True)  # fmt: skip
    return kept


def drop_flags(argv: list[str], names: frozenset[str] | set[str]) -> tuple[list[str], list[str]]:
    """``argv`` (a step's flags, no positionals) split into (kept, dropped): the flags in ``names``, or
    their ``--no_`` forms, with their values (the words up to the next option; a negative number is a
    value) are dropped."""

    def is_value(word: str) -> bool:
        return not word.startswith("-") or bool(re.fullmatch(r"-[0-9.]+(e[-+]?[0-9]+)?", word))

    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(argv):
        j = i + 1
        if "=" not in argv[i]:
            while j < len(argv) and is_value(argv[j]):
                j += 1
        flag = argv[i].split("=", 1)[0]
        name = "--" + flag.removeprefix("--no_") if flag.startswith("--no_") else flag
        (dropped if name in names else kept).extend(argv[i:j])
        i = j
    return kept, dropped


def without_step1_only(n: int, user: list[str]) -> list[str]:
    """The user's flags (after --) for step ``n`` > 1, less those only step 1 reads
    (:attr:`dschat.config.DataArgs.STEP1_ONLY`): they reach step 1 alone, where a later step would refuse
    them as read by nothing."""
    from dschat.config import DataArgs

    kept, dropped = drop_flags(user, {f"--{f}" for f in DataArgs.STEP1_ONLY})
    if dropped:
        print(f"==> step {n}: {' '.join(dropped)} read by step 1 only: left out here", flush=True)
    return kept


def reads_step_2(line: StepLine) -> bool:
    """Whether step 3's command line holds a model read from step 2's output: a critic or a reward model
    (a verifier as the whole reward with a critic-free estimator holds neither)."""
    from dschat.rlhf.models import RLHFOptions, held_model_specs

    return bool({"critic", "reward"} & set(held_model_specs(RLHFOptions(*line.groups))))


def parse_step(step: Step, argv: list[str]) -> tuple:
    """The step's option groups parsed from ``argv`` by the step's own parser (its ``GROUPS`` and
    ``STEP_DEFAULTS``), without running the step: a bad flag stops here, before any step starts."""
    from dschat import config as C

    module = importlib.import_module(step.module)  # the step registry: recipes are modules
    groups = C.parse_groups(
        step.entry.parent.name, "", module.GROUPS, argv, getattr(module, "STEP_DEFAULTS", None)
    )
    if hasattr(module, "check_groups"):  # a step's rules across its groups (step 3's)
        module.check_groups(groups)
    return groups


def planning_models(
    n: int, args: argparse.Namespace, extra: list[str], preset: dict, argv: list[str]
) -> dict[str, str]:
    """For models this run writes in an earlier step (not there yet), the model that step starts from:
    it has the same shape. ``argv``: step ``n``'s command line."""
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
        if not written(given(argv, "--actor_model_name_or_path") or ""):
            models["actor"] = step1_start
        if not written(given(argv, "--critic_model_name_or_path") or ""):
            models["critic"] = step2_start
    return models


def trains_critic(line: StepLine) -> bool:
    """Whether the step trains a critic beside its model (step 3 with gae): the plan's critic flags."""
    from dschat.rlhf.models import RLHFOptions

    return line.step.number == 3 and RLHFOptions(*line.groups).use_critic


def resumed_flags(n: int, args: argparse.Namespace, argv: list[str], critic: bool = True) -> list[str] | None:
    """On --resume, the flags that place the step's models as the interrupted run did (its
    dschat_config.json, :func:`dschat.planning.resumed_flags`); None where it saved none."""
    import json

    from dschat import planning as P

    try:
        cfg = json.loads(
            (Path(args.output_dir) / step_of(n, args).dir_name / "dschat_config.json").read_text()
        )
        return P.resumed_flags(n, cfg, argv, critic)
    except (OSError, ValueError, KeyError):
        return None


def memory_plan(line: StepLine, args: argparse.Namespace, extra: list[str], preset: dict) -> list[str]:
    """Print the step's memory plan; return the flags that apply its choice (those not set explicitly).

    ``--estimate-memory``: the full table, and errors (a model config not available offline) are errors.
    A run: one line; a plan that cannot be made is reported and the step's own defaults apply."""
    from dschat import planning as P

    full, n, argv = args.estimate_memory, line.step.number, line.argv
    dpo = line.step is DPO_STEP
    # a resumed step places its models as the interrupted run did, whether or not a plan can be made now
    critic = trains_critic(line)
    if not full and args.resume and (flags := resumed_flags(n, args, argv, critic)) is not None:
        print(f"==> memory plan, step {n}: resuming with the interrupted run's ZeRO stage, offload and "
              "checkpointing" + (f" (adds {' '.join(flags)})" if flags else ""), flush=True)  # fmt: skip
        return flags
    try:
        gpn, nodes = processes(args)
        hw = P.detect_hardware(gpn, nodes, args.device_memory, args.cpu_memory)
        flags = {"model": "--actor-model" if n == 1 or dpo else "--reward-model", "actor": "--actor-model",
                 "critic": "--reward-model"}  # fmt: skip
        plan = P.make_plan(n, line.groups, argv, hw, planning_models(n, args, extra, preset, argv), flags)
    except UserError as exc:
        if full:
            raise
        print(f"==> memory plan, step {n}: skipped ({exc}); the step's own defaults apply", flush=True)
        return []
    if full:
        print(P.format_plan(plan, full=True), flush=True)
        return []
    chosen = plan.chosen
    unit = "GPU" if hw.on_gpu else "process"
    flags = P.choice_flags(n, chosen.choice, argv, critic)
    if "zero_stage" in plan.fixed and (
        len(plan.fixed) == 3 or (plan.fixed["zero_stage"] == 0 and "gradient_checkpointing" in plan.fixed)
    ):
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
    check_flags_reach_a_step(args, steps)
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
        if value is not None and not (0 < value < math.inf):  # NaN fails too
            raise UserError(f"{flag} must be a finite number > 0, got {value}")
    preset = load_preset(args)
    if args.algorithm == "dpo" and 2 in steps and preset and DPO_STEP.dir_name not in preset:
        # its step 1 would train on the preset's data with its LoRA, and DPO on the step defaults
        raise UserError(f"--algorithm dpo: the preset {preset['_name']} ({preset['_why']}) has no {DPO_STEP.dir_name} "
                        "section, so DPO would run on the step's defaults (built-in data, no LoRA); add one to a "
                        "preset file (--preset FILE.yaml), or run --step 1 first and then --step 2 --algorithm dpo --preset none with "
                        "DPO's flags after -- (flags after -- go to every step the command runs)")  # fmt: skip
    args.deployment_type = args.deployment_type or preset.get("deployment_type") or "single_gpu"
    check_conflicts(args, extra, steps)
    check_deployment_flags(args)  # before any plan: --estimate-memory plans with them
    check_actor_model_is_read(args, steps)
    check_models(args)
    check_reward_reads_the_actors_tokens(args, steps, extra)
    if preset:
        print(describe_preset(preset, args), flush=True)
    if args.estimate_memory:
        for n in steps:
            memory_plan(StepLine.of(n, args, extra, preset), args, extra, preset)
        return 0
    launcher(args)  # every launch flag checked before any step starts
    actions = resume_actions(args, steps)
    lines: dict[int, StepLine] = {}
    per_step: dict[int, argparse.Namespace] = {}
    for n in steps:
        if actions.get(n) == KEEP:
            continue
        # --resume reaches only the step that holds a checkpoint; the steps after it start afresh
        resume = (
            actions.get(n) == RESUME if actions else args.resume
        )  # with --overwrite too: the step refuses
        per_step[n] = step_ns = argparse.Namespace(**{**vars(args), "resume": resume})
        lines[n] = StepLine.of(n, step_ns, extra, preset)  # every step's flags, before any runs
        for needed in (1, 2) if n == 3 else ():
            if needed not in steps and not finished(Path(args.output_dir) / f"step{needed}"):
                if needed == 2 and (args.reward_model or not reads_step_2(lines[n])):
                    continue
                raise UserError(
                    f"--step 3 needs a finished step {needed} in {Path(args.output_dir) / f'step{needed}'} "
                    f"(run --step {needed} first, or add it: --step 1 2 3)"
                )
        check_output_dir(str(Path(args.output_dir) / step_of(n, args).dir_name), overwrite=args.overwrite,
                         resume=step_ns.resume, flag="--output-dir")  # fmt: skip
        # its data too; its models also where no earlier step of this job writes them (the first step's
        # must be there now: a preset's {output_dir}/step1 with --step 2 alone failed in the step itself).
        # Step 3's chained models were checked above, as far as it holds them (a critic-free run has none)
        kinds = (DATA, MODEL) if n == steps[0] and n != 3 else (DATA,)
        check_inputs(
            importlib.import_module(lines[n].step.module).GROUPS,
            lines[n].groups,
            kinds=kinds,
            hub_available=not args.dry_run,
        )  # a dry run loads no model: a cluster's plan on a laptop
    env = launcher_env(args)
    if args.dist_timeout:
        env["DSCHAT_DIST_TIMEOUT"] = str(args.dist_timeout)
    # With torchrun every node runs this script: node 0 writes training.log, the others their own file.
    node = f".node{args.node_rank}" if args.launcher == "torchrun" and args.node_rank else ""
    remote = args.deployment_type == "multi_node" and args.launcher != "torchrun"  # the DeepSpeed runner
    for n in steps:
        if actions.get(n) == KEEP:
            print(f"==> step {n} ({step_of(n, args).name}): finished, kept (--resume)", flush=True)
    for n, line in lines.items():
        step, step_ns = line.step, per_step[n]
        # the launcher again for each step: a port found free now (one found before step 1 may be taken by
        # the time step 3 starts, an hour later)
        cmd = [*launcher(args), str(step.entry), *line.command(memory_plan(line, step_ns, extra, preset))]
        out_dir = Path(args.output_dir) / step.dir_name
        print(f"==> step {n} ({step.name}): {shlex.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        log = out_dir / f"training{node}.log"
        code, failed = run_step(cmd, log, append=step_ns.resume, env=env, remote=remote)
        if code != 0:
            print(
                f"error: step {n} ({step.name}) failed with exit code {code}"
                + (f": {failed}" if failed else "") + f"; log: {step_log(log)}",
                file=sys.stderr,
            )  # fmt: skip
            return code if 0 < code < 128 else 1
        if not node and not finished(out_dir):
            # Some launchers report success for a failed rank (the MPICH helper exits 0 whatever its
            # child did; the DeepSpeed runner turns a rank killed by a signal into 0): the summary a
            # finished step writes last is the proof, and step 3 must not start on a missing step 1.
            print(
                f"error: step {n} ({step.name}) exited 0 but wrote no {out_dir / 'summary.json'} (a rank "
                f"failed without the launcher saying so); log: {log}",
                file=sys.stderr,
            )
            return 1
        print(f"==> step {n} done: {out_dir}", flush=True)
    if not getattr(args, "dry_run", False):
        for line in next_commands(args, steps, preset):
            print(line, flush=True)
    return 0


KEEP, RESUME, START = "keep", "resume", "start"


def resume_actions(args: argparse.Namespace, steps: list[int]) -> dict[int, str]:
    """With ``--resume``, what each step of the job does: a finished step is kept (not run again), the step
    holding checkpoints continues from its latest one, the steps after it start afresh. So ``train.py
    --resume`` continues a three-step job that stopped anywhere. Empty without ``--resume``.

    Refused: nothing to resume (no step finished or checkpointed: a mistyped ``--output-dir``?), and a
    finished or checkpointed step after one that runs again (its inputs would change under it)."""
    if (
        not args.resume or args.overwrite
    ):  # with both, each step's own parser refuses the pair (main passes both)
        return {}
    out = Path(args.output_dir)
    actions = {}
    for n in steps:
        d = out / step_of(n, args).dir_name
        actions[n] = KEEP if finished(d) else RESUME if (d / "checkpoints" / "latest").exists() else START
    if all(a == START for a in actions.values()):
        raise UserError(f"--resume: nothing to resume in {out} (no step of this job finished or saved a "
                        "checkpoint there)")  # fmt: skip
    for n in steps:  # a kept step built from a step that was trained again since (an interrupted --overwrite)
        if actions[n] == KEEP and (stale := changed_inputs(trained_config(out / step_of(n, args).dir_name))):
            raise UserError(f"--resume: step {n} is finished, but {stale[0]}, which it was built from, was trained "
                            f"again since: run it again (--step {n} --overwrite)")  # fmt: skip
    runs = [n for n in steps if actions[n] != KEEP]
    if runs and (later := [n for n in steps if n > runs[0] and actions[n] != START]):
        what = "is finished" if actions[later[0]] == KEEP else "has checkpoints"
        raise UserError(
            f"--resume: step {later[0]} {what} but step {runs[0]} before it is not finished, so step {later[0]} "
            f"would not match it; pass --overwrite to run the job again, or --step {later[0]} alone"
        )
    return actions


def check_models(args: argparse.Namespace) -> None:
    """A starting model given as a local path that is not there, or a data source that is not one: one
    line now, not a failed step later. Hub models must be cached or downloadable, but for a dry run or a
    memory estimate, which load nothing (a cluster's plan made on a laptop without a network)."""
    from dschat.inputs import check_data, check_model

    hub = not (args.dry_run or args.estimate_memory)

    for flag, value in (("--actor-model", args.actor_model), ("--reward-model", args.reward_model),
                        ("--output-dir", args.output_dir)):  # fmt: skip
        if value is not None and not value.strip():  # '' was ignored (a model) or meant ./step1 (the output)
            raise UserError(f"{flag} is empty")
    for flag, value in (("--actor-model", args.actor_model), ("--reward-model", args.reward_model)):
        if value:
            check_model(value, flag, hub_available=hub)
    for spec in args.data_path or ():
        check_data(spec, "--data-path")


def check_reward_reads_the_actors_tokens(
    args: argparse.Namespace, steps: list[int], extra: list[str]
) -> None:
    """Step 3 scores the actor's token ids with the model step 2 trains from --reward-model: a reward model
    of another vocabulary was refused only when step 3 started, after steps 1 and 2 had run. Checked up
    front where both are given (a preset pairs its own); not for --dry-run or --estimate-memory, which
    read no model."""
    if args.algorithm != "ppo" or 3 not in steps or not (args.actor_model and args.reward_model):
        return
    if args.dry_run or args.estimate_memory or "--trust_remote_code" in extra:  # the steps load those
        return
    from dschat.models.loading import check_same_tokenizer, load_tokenizer, resolve

    actor = load_tokenizer(resolve(args.actor_model, "--actor-model"), flag="--actor-model")
    check_same_tokenizer(resolve(args.reward_model, "--reward-model"), "--reward-model", actor, owner="actor",
                         owner_path=args.actor_model)  # fmt: skip


# train.py flags read by some steps only (PPO; --algorithm dpo: check_dpo), as (flag, attribute, steps)
STEP_FLAGS = (
    ("--reward-model", "reward_model", {2, 3}),  # step 2's start; step 3's critic when step 2 does not run
    ("--reward-zero-stage", "reward_zero_stage", {2, 3}),
    ("--actor-zero-stage", "actor_zero_stage", {1, 3}),
)


def check_flags_reach_a_step(args: argparse.Namespace, steps: list[int]) -> None:
    """A train.py flag that no step of this job reads is an error, not a silent no-op."""
    if args.algorithm != "ppo":
        return
    for flag, name, readers in STEP_FLAGS:
        if getattr(args, name) is not None and not readers & set(steps):
            which = " and ".join(str(n) for n in sorted(readers))
            raise UserError(f"{flag} is read by steps {which}, and this job runs --step "
                            f"{' '.join(map(str, steps))}: drop it, or run a step that reads it")  # fmt: skip


def check_actor_model_is_read(args: argparse.Namespace, steps: list[int]) -> None:
    """--actor-model names step 1's start. Without step 1 in the job, where a finished step 1 is there,
    the later steps chain from its output (step 3's actor, DPO's policy, step 2's reward model) and the
    flag was accepted and ignored. Without a finished step 1 a step 2 starts from it, and the memory
    estimate of a later step plans with it."""
    step1 = Path(args.output_dir) / "step1"
    if not args.actor_model or 1 in steps or not finished(step1):
        return
    raise UserError(f"--actor-model {args.actor_model}: the steps of this job (--step {' '.join(map(str, steps))}) "
                    f"start from {step1}, a finished step 1, not from it; it names step 1's starting model: add "
                    "--step 1 (with --overwrite), or drop it (to pick a preset by name: --preset)")  # fmt: skip


def check_dpo(args: argparse.Namespace, steps: list[int]) -> None:
    """--algorithm dpo has no reward model and no step 3: flags about them conflict with it."""
    if 3 in steps:
        raise UserError(
            "--step 3 with --algorithm dpo: DPO trains the policy in step 2 and has no step 3 (use --step 1 2)"
        )
    for flag, value, instead in (
        ("--reward-model", args.reward_model, "its policy starts from step 1's output, or --actor-model"),
        ("--reward-zero-stage", args.reward_zero_stage, "its policy's stage is --actor-zero-stage"),
    ):
        if value is not None:
            raise UserError(f"{flag} with --algorithm dpo: DPO trains no reward model ({instead})")


def next_commands(args: argparse.Namespace, steps: list[int], preset: dict | None = None) -> list[str]:
    """After a finished job: the commands that chat with its result and compare it with its start."""
    out = Path(args.output_dir)
    if args.algorithm == "dpo" and 2 in steps:
        result, start = out / DPO_STEP.dir_name, policy_start_model(args, preset)
    elif 3 in steps:
        result, start = out / "step3" / "actor", str(out / "step1")
    elif 1 in steps:
        from dschat.config import DEFAULT_MODEL

        # the model step 1 recorded starting from (a '-- --model_name_or_path' reaches it past the preset)
        result = out / "step1"
        start = (trained_config(result).get("model_name_or_path") or args.actor_model
                 or (preset or {}).get("model") or DEFAULT_MODEL)  # fmt: skip
    else:
        return []  # step 2 alone made a reward model: nothing to talk to
    # what the finished result recorded wins: the reward model step 3 trained against (not a stale step2/
    # beside it) and the data it trained on
    recorded = trained_config(result)
    if args.algorithm == "dpo":
        reward = None  # no reward model in a DPO run
    elif recorded.get("resolved_reward_path"):
        reward = str(recorded["resolved_reward_path"])
    elif finished(out / "step2"):
        reward = str(out / "step2")
    else:
        reward = args.reward_model if 3 in steps else None

    def script(name: str) -> str:
        rel = os.path.relpath(ROOT / "inference" / name)
        return str(ROOT / "inference" / name) if rel.startswith("..") else rel

    # the run's own built-in tasks (a preset's --data_path builtin:sort,reverse_words, or the steps' default
    # "builtin": the default tasks), if it used some
    from dschat.compare import run_tasks
    from dschat.config import DataArgs

    in_preset = (preset or {}).get("step1", {}).get("--data_path") or []  # a YAML list or one string
    data = (
        recorded.get("data_path")
        or args.data_path
        or ([str(v) for v in in_preset] if isinstance(in_preset, list) else str(in_preset).split())
        or DataArgs().data_path
    )
    names = run_tasks(data) or []
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
