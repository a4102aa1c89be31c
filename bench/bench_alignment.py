#!/usr/bin/env python
"""Does alignment make the real model better, by a measure a reward model cannot fake? JSON.

    python bench/bench_alignment.py verifiable                    # steps 1 + 2 of the main job, then step 3 twice
    python bench/bench_alignment.py verifiable --from output      # steps 1 + 2 of a finished main job
    python bench/bench_alignment.py verifiable --from output --stabilisers   # + one RL run per stabiliser
    python bench/bench_alignment.py hh                            # reward model A, judge B, PPO against A
    python bench/bench_alignment.py hh --reward_models runs/a runs/b   # with A and B already trained

``verifiable``: SmolLM2-135M-Instruct on the main job's built-in tasks (sort, reverse_words), whose
answers a verifier checks. Step 3 runs twice from the same step-1 model with the preset's settings:
``ppo_rm`` against the learned step-2 reward model (the main job's step 3), and ``rl_verifier`` with the
verifier itself as the reward (``--reward_fn dschat.tasks:verifier_reward``, the RLVR setting). Both
report the verifier's true accuracy of greedy answers on the same held-out prompts before (the step-1
model) and after, per task, and the KL to the step-1 model. ``--stabilisers`` adds one verifier run per
stabiliser on top of ``rl_verifier`` (Dr. GRPO, DAPO's uniform-group filter, clip-higher and overlong
penalty, sequence-level loss aggregation, GRPO's k3 KL loss), each with its true accuracy, KL, entropy,
answer length and wall time, so that each flag's effect is a number. Targets: PPO against the reward
model +10 points over step 1, the verifier as the reward +15.

``hh``: human preferences, where no verifier knows the truth. ``../shared/data/hh_rlhf/train.jsonl`` is
split into two disjoint halves by conversation (hh_judge.py); reward model A is trained on one, judge B on the
other, both from SmolLM2-135M-Instruct (top layers, grouped batches, chat template). PPO (RLOO) starts
from SmolLM2-135M-Instruct itself (already instruction-tuned: its step 1) on the prompts of A's half,
against A only, with B logged beside it (``--judge_reward_model``). Then both models answer held-out
HH prompts greedily: the mean score of A and of B for each, the win rate of step 3 over step 1 under B
(ties half), the answers' mean length (tokens), how many answers were cut off at ``--max_new_tokens``
and B's win rate where neither answer was (B marks an unfinished answer down, so a policy that only
learns to finish within the budget wins where step 1 ran out), and the KL. ``--temperature`` sets the PPO
run's sampling temperature (the tempered policy it optimises), and the sampled answers are judged at it. Targets: win rate under B at least 0.60 with
the length ratio at most 1.2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hh_judge import HH, JUDGE_PROMPTS, MAX_NEW_TOKENS, MODEL, hh_halves, judge_held_out, trained_half_problem

from dschat.config.rlhf import PPOArgs  # hh_judge put the project root on sys.path
from dschat.launch import presets
from dschat.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
PPO_FIELDS = {f.name: f for f in dataclasses.fields(PPOArgs)}
PRESET = "smollm2-135m"
VERIFIER = ["--reward_fn", "dschat.tasks:verifier_reward"]
# Switches of the preset's step 3 that act on a reward model's scores (none takes a value)
REWARD_MODEL_ONLY = {"--normalize_reward"}
# One RL-with-verifier run per stabiliser, each on top of rl_verifier's settings.
STABILISERS = {
    "dr_grpo": ["--advantage_estimator", "dr_grpo"],
    "group_norm": ["--advantage_estimator", "group_norm"],
    "filter_uniform_groups": ["--filter_uniform_groups"],
    "seq_mean_token_mean": ["--loss_agg", "seq_mean_token_mean"],
    "seq_mean_token_sum_norm": ["--loss_agg", "seq_mean_token_sum_norm"],
    "clip_higher": ["--cliprange_high", "0.28"],
    "kl_loss_k3": ["--kl_in", "loss", "--kl_estimator", "k3"],
    "truncation_penalty": ["--truncation_penalty", "1.0"],
}


def run(cmd: list[str]) -> None:
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        print(json.dumps({"error": proc.stderr.strip().splitlines()[-3:], "cmd": cmd}))
        sys.exit(1)


def step3(out: Path, jobdir: Path, flags: list[str], extra: list[str]) -> dict:
    """One step-3 run from ``jobdir``'s step 1 (and step 2 as the reward model) into ``out``: its summary."""
    run([str(ROOT / "training/step3_rlhf_finetuning/main.py"), "--output_dir", str(out),
         "--actor_model_name_or_path", str(jobdir / "step1"), "--critic_model_name_or_path", str(jobdir / "step2"),
         *flags, *extra])  # fmt: skip
    s = json.loads((out / "summary.json").read_text())
    return {
        "true_accuracy_start": s.get("true_accuracy_start"),
        "true_accuracy_end": s.get("true_accuracy_end"),
        "true_accuracy_by_task_end": {
            k.split("/", 1)[1][: -len("_end")]: v for k, v in s.items() if k.startswith("true_accuracy/")
        },
        "true_accuracy_sampled_end": s.get("true_accuracy_sampled_end"),
        "kl_end": s.get("kl_end"),
        "entropy_start": s.get("entropy_start"),
        "entropy_end": s.get("entropy_end"),
        "response_length_end": s.get("response_length_end"),
        "truncated_fraction_end": s.get("truncated_fraction_end"),
        "clipped_score_fraction_start": s.get("clipped_score_fraction_start"),
        "rounds": s.get("steps"),
        "wall_seconds": s.get("wall_seconds"),
    }


def verifier_run(flags: list[str], rl: list[str], stabiliser: str | None = None) -> list[str]:
    """Step 3's flags for a run with the verifier as the reward: the preset's ``flags`` without the options
    of a reward model's scores (the verifier replaces it: ``--normalize_reward`` would be refused), then
    the verifier, ``rl`` and the ``stabiliser``'s flags."""
    kept = [f for f in flags if f not in REWARD_MODEL_ONLY]
    return [*kept, *VERIFIER, *rl, *(STABILISERS[stabiliser] if stabiliser else [])]


def verifiable(args: argparse.Namespace, out: Path) -> dict:
    t0 = time.perf_counter()
    preset = presets.read_preset(presets.PRESETS / f"{PRESET}.yaml")
    jobdir = Path(args.src) if args.src else out / "job"
    if not args.src:
        run([str(ROOT / "train.py"), "--step", "1", "2", "--output-dir", str(jobdir)])
    flags = presets.preset_flags(preset, 3, str(jobdir))
    rl = ["--actor_learning_rate", str(args.rl_learning_rate), "--max_steps", str(args.rl_rounds)]
    runs = {"ppo_rm": step3(out / "ppo_rm", jobdir, flags, [])}
    runs["rl_verifier"] = step3(out / "rl_verifier", jobdir, verifier_run(flags, rl), [])
    if args.stabilisers:
        for name in args.only or STABILISERS:
            runs[f"rl_verifier+{name}"] = step3(out / f"rl_{name}", jobdir, verifier_run(flags, rl, name), [])
    ppo, rlv = runs["ppo_rm"], runs["rl_verifier"]
    return {
        "true_accuracy_step1": ppo["true_accuracy_start"],
        "true_accuracy_ppo_rm": ppo["true_accuracy_end"],
        "true_accuracy_rl_verifier": rlv["true_accuracy_end"],
        "kl_ppo_rm": ppo["kl_end"],
        "kl_rl_verifier": rlv["kl_end"],
        "gain_ppo_rm": ppo["true_accuracy_end"] - ppo["true_accuracy_start"],
        "gain_rl_verifier": rlv["true_accuracy_end"] - rlv["true_accuracy_start"],
        "target": {"gain_ppo_rm": 0.10, "gain_rl_verifier": 0.15},
        "runs": runs,
        "steps_1_2_trained_here": not args.src,
        "wall_seconds": time.perf_counter() - t0,
    }


def hh_ppo_run(args: argparse.Namespace, ppo: Path, rm_a: Path, rm_b: Path, prompts: Path) -> list[str]:
    """Step 3's flags for the HH run: RLOO from SmolLM2 on the prompts of half a, against reward model A,
    judge B logged beside it."""
    return ["--output_dir", str(ppo), "--actor_model_name_or_path", MODEL, "--critic_model_name_or_path", str(rm_a),
            "--judge_reward_model", str(rm_b), "--data_path", str(prompts), "--data_split", "0,0,1",
            "--actor_trainable_layers", "8", "--advantage_estimator", "rloo", "--n_samples_per_prompt", "4",
            "--per_device_generation_batch_size", "8", "--per_device_training_batch_size", "32",
            "--max_prompt_seq_len", "256", "--max_answer_seq_len", str(args.max_new_tokens), "--actor_learning_rate",
            str(args.ppo_learning_rate), "--kl_coef", str(args.kl_coef), "--max_steps", str(args.ppo_rounds),
            "--eval_prompts", "32", "--eval_interval", "10", "--log_interval", "1",
            "--truncation_penalty", str(args.truncation_penalty), "--temperature", str(args.temperature),
            "--kl_in", args.kl_in, "--kl_estimator", args.kl_estimator, "--seed", str(args.seed)]  # fmt: skip


def hh(args: argparse.Namespace, out: Path) -> dict:
    t0 = time.perf_counter()
    data = hh_halves(out)
    if args.reward_models:
        rm_a, rm_b = map(Path, args.reward_models)
    else:
        rm_a, rm_b = out / "rm_a", out / "rm_b"
        for rm, half in ((rm_a, data["a"]), (rm_b, data["b"])):
            run([str(ROOT / "training/step2_reward_model_finetuning/main.py"), "--output_dir", str(rm),
                 "--model_name_or_path", MODEL, "--data_path", str(half), "--data_split", "0,1,0", "--max_seq_len", "256",
                 "--per_device_train_batch_size", "8", "--trainable_layers", "8", "--group_by_length", "--learning_rate",
                 str(args.rm_learning_rate), "--max_eval_samples", "0", "--eval_interval", "0", "--log_interval", "20"])  # fmt: skip
    rm_acc = {name: (json.loads((rm / "summary.json").read_text()) if (rm / "summary.json").is_file() else {})
              .get("eval_accuracy_end") for name, rm in (("a", rm_a), ("b", rm_b))}  # fmt: skip
    ppo = out / "ppo"
    run([str(ROOT / "training/step3_rlhf_finetuning/main.py"), *hh_ppo_run(args, ppo, rm_a, rm_b, data["a"])])
    s3 = json.loads((ppo / "summary.json").read_text())
    judged = judge_held_out(out, ppo / "actor", {"a": rm_a, "b": rm_b}, judge="b", prompts=args.judge_prompts,
                            max_new_tokens=args.max_new_tokens, tag="step3", temperature=args.temperature)  # fmt: skip
    untouched = {}
    # every hh default was chosen by the win rate on the first --judge_prompts rows: these are new to it
    if args.untouched_prompts:
        t1 = time.perf_counter()
        untouched = judge_held_out(out / "untouched", ppo / "actor", {"a": rm_a, "b": rm_b}, judge="b",
                                   prompts=args.untouched_prompts, first=args.judge_prompts,
                                   max_new_tokens=args.max_new_tokens, tag="step3", sampled=False)  # fmt: skip
        untouched.update(first_row=args.judge_prompts, seconds=time.perf_counter() - t1)
    return {
        **judged,
        **({"untouched_prompts": untouched} if untouched else {}),
        "reward_model_accuracy": rm_acc,
        "kl": s3.get("kl_end"),
        "score_a_train_start": s3.get("score_start"),
        "score_a_train_end": s3.get("score_end"),
        "score_b_train_start": s3.get("judge_score_start"),
        "score_b_train_end": s3.get("judge_score_end"),
        "ppo_rounds": s3.get("steps"),
        "truncation_penalty": args.truncation_penalty,
        "kl_coef": args.kl_coef,
        "kl_in": args.kl_in,
        "kl_estimator": args.kl_estimator,
        "temperature": args.temperature,
        "seed": args.seed,
        "ppo_wall_seconds": s3.get("wall_seconds"),
        "target": {"judge_win_rate": 0.60, "length_ratio_at_most": 1.2},
        "target_met": judged["judge_win_rate"] >= 0.60 and judged["length_ratio"] <= 1.2,
        "wall_seconds": time.perf_counter() - t0,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=("verifiable", "hh"))
    p.add_argument("--from", dest="src", help="a finished main job (holding step1/ and step2/) to start from")
    p.add_argument("--output_dir", help="keep the runs here (a new directory; default: a temporary one)")
    p.add_argument(
        "--rl_learning_rate", type=float, default=1e-4, help="actor learning rate of the verifier runs"
    )
    p.add_argument(  # 80 rounds: +11.5 points (2026-11-23); 120: +15.0, still rising at round 100 (2026-11-25)
        "--rl_rounds", type=int, default=120, help="generation rounds of the verifier runs"
    )
    p.add_argument("--stabilisers", action="store_true", help="one verifier run per stabiliser")
    p.add_argument("--only", nargs="+", choices=sorted(STABILISERS), help="with --stabilisers: only these")
    p.add_argument(
        "--reward_models",
        nargs=2,
        metavar=("A", "B"),
        help="hh: reward model A and judge B, already trained on the halves a and b (a kept run's rm_a, rm_b)",
    )
    p.add_argument("--rm_learning_rate", type=float, default=5e-5, help="hh: reward models' learning rate")
    # hh's defaults are the settings that met the judge target (README, "Human preferences", measured 2026-11-28 at 60 rounds):
    # lr 2e-6 barely moved the answers; at 1e-4 without a truncation penalty the policy learned to stop
    # early and mid-sentence; stopping at round 30, near where B's held-out score had peaked, judged worse.
    p.add_argument("--ppo_learning_rate", type=float, default=1e-4, help="hh: actor learning rate")
    p.add_argument("--kl_coef", type=float, default=0.05, help="hh: KL coefficient")
    for name in ("kl_in", "kl_estimator"):  # step 3's own options: its choices, default and help
        f = PPO_FIELDS[name]
        p.add_argument(
            f"--{name}", choices=f.metadata["choices"], default=f.default, help=f"hh: {f.metadata['help']}"
        )
    p.add_argument(  # 60: 0.622 greedy (2026-11-28); 30: 0.543 (2026-11-29); one seed each
        "--ppo_rounds", type=int, default=60, help="hh: generation rounds (8 prompts x 4 answers)"
    )
    p.add_argument("--max_new_tokens", type=int, default=MAX_NEW_TOKENS, help="hh: longest answer")
    p.add_argument(
        "--truncation_penalty",
        type=float,
        default=0.3,
        help="hh: subtracted from A's score of a training answer cut off at --max_new_tokens",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="hh: the PPO run's sampling temperature (its rollouts and the tempered policy it optimises)",
    )
    p.add_argument(
        "--seed", type=int, default=1234, help="hh: the PPO run's seed (a replicate takes another)"
    )
    # a win rate on 100 prompts has a standard error of 0.05: too coarse for a 0.60 target
    p.add_argument(
        "--untouched_prompts",
        type=int,
        default=0,
        help="hh: also judge (greedy) this many HH test prompts after the --judge_prompts rows, on which no "
        "default was chosen (200: rows 300-499); reported under untouched_prompts, with its own seconds",
    )
    p.add_argument(
        "--judge_prompts",
        type=int,
        default=3 * JUDGE_PROMPTS,
        help="hh: held-out prompts answered and judged",
    )
    return p


def main() -> None:
    p = parser()
    args = p.parse_args()
    # an option of the other suite would be accepted and unused (a "replicate" with --seed that is none)
    only_hh = [a for a in p._actions if (a.help or "").startswith("hh:")]
    only_verifiable = [a for a in p._actions if a.dest in ("src", "stabilisers", "only")]
    unused = only_hh if args.suite == "verifiable" else only_verifiable
    given = [a.option_strings[0] for a in unused if getattr(args, a.dest) != a.default]
    if given:
        p.error(f"{', '.join(given)}: not an option of the {args.suite} suite")
    if args.suite == "hh":  # step 3's own checks on the PPO flags, before the reward models train
        try:
            PPOArgs(kl_coef=args.kl_coef, kl_in=args.kl_in, kl_estimator=args.kl_estimator,
                    temperature=args.temperature, truncation_penalty=args.truncation_penalty).validate()  # fmt: skip
        except UserError as e:
            p.error(str(e))
    if args.suite == "hh" and not (HH / "train.jsonl").is_file():
        print(json.dumps({"skipped": f"{HH} not present"}))
        return
    if args.suite == "hh":
        rows = len((HH / "test.jsonl").read_text().splitlines())
        if args.judge_prompts + args.untouched_prompts > rows:
            p.error(f"--judge_prompts {args.judge_prompts} + --untouched_prompts {args.untouched_prompts}: more "
                    f"than the {rows} HH test prompts")  # fmt: skip
    for rm, half in zip(args.reward_models or (), "ab", strict=False):  # A on half a, judge B on half b
        if problem := trained_half_problem(rm, half):
            p.error(f"--reward_models {rm}: {problem}")
    if args.output_dir and Path(args.output_dir).exists():
        p.error(f"--output_dir {args.output_dir} exists: the benchmark never writes over a run")
    if args.src and not all((Path(args.src) / s / "summary.json").is_file() for s in ("step1", "step2")):
        p.error(
            f"--from {args.src}: no finished step1/ and step2/ there (run python train.py --step 1 2 first)"
        )
    if args.only and not args.stabilisers:
        p.error("--only picks among --stabilisers: give --stabilisers too")
    tmp = None if args.output_dir else tempfile.TemporaryDirectory()
    out = Path(args.output_dir or tmp.name)
    out.mkdir(parents=True, exist_ok=True)
    result = verifiable(args, out) if args.suite == "verifiable" else hh(args, out)
    print(json.dumps({"benchmark": f"alignment_{args.suite}", "model": MODEL, **result}, indent=2))


if __name__ == "__main__":
    main()
