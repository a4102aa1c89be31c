#!/usr/bin/env python
"""Reward-model quality and speed, printed as JSON.

    python bench/bench_reward_model.py builtin     # the main job's steps 1 + 2 (its preset) on built-in tasks
    python bench/bench_reward_model.py hh          # step 1 on shared SFT data, step 2 on HH-RLHF pairs
    python bench/bench_reward_model.py builtin --from output   # read a finished run's step2/summary.json
    python bench/bench_reward_model.py hh --output_dir runs/hh   # keep the run (checkpoints, metrics)
    python bench/bench_reward_model.py hh --model HuggingFaceTB/SmolLM2-135M-Instruct   # a pretrained body

Targets: held-out pairwise accuracy >= 0.95 on the built-in tasks. On HH-RLHF test pairs, for a
pretrained model (no SFT step: the reward model starts from the model itself, top ``--trainable_layers``
layers trained, batches grouped by length, prompts in the model's chat template) at least 0.68 and at
least 0.55 on the pairs whose chosen answer is the shorter one, in at most 60 minutes; for the built-in
byte model (step 1 on the shared SFT dialogues first) above the "longer response wins" baseline (0.598).
Accuracy is reported separately for pairs whose chosen answer is the shorter and the longer one, so a
length-only model shows itself. Also training and scoring samples/s and the wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HH = ROOT.parent / "shared" / "data"


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(json.dumps({"error": proc.stderr.strip().splitlines()[-3:], "cmd": cmd}))
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=("builtin", "hh"))
    p.add_argument("--from", dest="src", help="an existing output directory (holding step2/)")
    p.add_argument("--output_dir", help="run into this new directory and keep it (default: a temporary one)")
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument(
        "--max_seq_len", type=int, default=0, help="default: 768 for builtin models, 320 otherwise"
    )
    p.add_argument("--trainable_layers", type=int, default=8, help="pretrained models: top layers trained")
    p.add_argument(
        "--learning_rate", type=float, default=5e-5, help="pretrained models: step-2 learning rate"
    )
    p.add_argument("--epochs", type=int, default=1, help="pretrained models: passes over the HH pairs")
    p.add_argument("--ranking_loss", default="last_token", choices=("last_token", "divergence"))
    p.add_argument(
        "--length_expert", action="store_true", help="debias against answer length (step 2's --length_expert)"
    )
    args = p.parse_args()
    if args.suite == "builtin":  # the main job's own steps 1-2: its preset sets the model and the training
        given = [f"--{k}" for k in ("model", "max_seq_len", "trainable_layers", "learning_rate", "epochs",
                                     "ranking_loss", "length_expert") if getattr(args, k) != p.get_default(k)]  # fmt: skip
        if given:
            p.error(f"{', '.join(given)}: the builtin suite runs the main job's preset (train.py --step 1 2); "
                    "these apply to the hh suite")  # fmt: skip
    t0 = time.perf_counter()
    pretrained = not args.model.startswith("builtin:")
    args.max_seq_len = args.max_seq_len or (320 if pretrained else 768)
    if args.length_expert and not pretrained:
        p.error("--length_expert applies to a pretrained --model")
    if args.src and args.output_dir:
        p.error("--from reads a finished run and --output_dir starts one: give one of them")
    if args.output_dir and Path(args.output_dir).exists():
        p.error(f"--output_dir {args.output_dir} exists: the benchmark never writes over a run")
    if args.src and not (Path(args.src) / "step2" / "summary.json").is_file():
        p.error(f"--from {args.src}: no step2/summary.json there (not a finished step-2 run)")
    # A temporary directory (removed when the process ends) unless the run is kept or read.
    tmp = None if args.src or args.output_dir else tempfile.TemporaryDirectory()
    out = Path(args.src or args.output_dir or tmp.name)
    if not args.src and args.suite == "builtin":
        run([sys.executable, str(ROOT / "train.py"), "--step", "1", "2", "--output-dir", str(out)])
    elif not args.src:
        if not (HH / "hh_rlhf" / "train.jsonl").exists():
            print(json.dumps({"skipped": f"{HH} not present"}))
            return
        out.mkdir(parents=True, exist_ok=True)
        common = ["--max_seq_len", str(args.max_seq_len), "--data_output_path", str(out / "cache")]
        start = args.model
        if not pretrained:  # a byte model built in code first learns the dialogues' language
            run([sys.executable, str(ROOT / "training/step1_supervised_finetuning/main.py"), "--output_dir",
                 str(out / "step1"), "--model_name_or_path", args.model, "--data_path", str(HH / "sft" / "train.jsonl"),
                 "--data_split", "1,0,0", "--per_device_train_batch_size", "8", "--eval_generation_samples", "0",
                 *common])  # fmt: skip
            start = str(out / "step1")
        rm_flags = (["--trainable_layers", str(args.trainable_layers), "--group_by_length", "--learning_rate",
                     str(args.learning_rate), "--num_train_epochs", str(args.epochs), "--log_interval", "20",
                     "--ranking_loss", args.ranking_loss, *(["--length_expert"] if args.length_expert else [])]
                    if pretrained else [])  # fmt: skip
        # Train on all of hh_rlhf/train.jsonl, evaluate on hh_rlhf/test.jsonl (a directory with both files).
        pairs = out / "hh"
        pairs.mkdir()
        (pairs / "train.jsonl").symlink_to(HH / "hh_rlhf" / "train.jsonl")
        (pairs / "test.jsonl").symlink_to(HH / "hh_rlhf" / "test.jsonl")
        run([sys.executable, str(ROOT / "training/step2_reward_model_finetuning/main.py"), "--output_dir", str(out / "step2"),
             "--model_name_or_path", start, "--data_path", str(pairs), "--data_split", "0,1,0",
             "--per_device_train_batch_size", "8", "--max_eval_samples", "0", "--eval_interval", "0", *common,
             *rm_flags])  # fmt: skip
    s = json.loads((out / "step2" / "summary.json").read_text())
    # what the run was (the builtin suite's preset, or a run read with --from), not this script's flags
    ran = json.loads((out / "step2" / "dschat_config.json").read_text())
    step1 = out / "step1" / "dschat_config.json"
    base = (
        json.loads(step1.read_text())["model_name_or_path"] if step1.is_file() else ran["model_name_or_path"]
    )
    pretrained = not str(base).startswith("builtin:")  # the run's model (with --from, not --model's default)
    if args.suite == "builtin":
        met = s["eval_accuracy_end"] >= 0.95
        target = {"accuracy": 0.95}
    elif pretrained:
        target = {"accuracy": 0.68, "accuracy_chosen_shorter": 0.55, "wall_minutes": 60}
        met = (s["eval_accuracy_end"] >= 0.68 and (s.get("eval_accuracy_chosen_shorter") or 0) >= 0.55
               and (time.perf_counter() - t0 if not args.src else s.get("process_wall_seconds", s["wall_seconds"]))
               <= 3600)  # fmt: skip
    else:
        target = {"accuracy_above": max(0.598, s["eval_longer_response_baseline"])}
        met = s["eval_accuracy_end"] > target["accuracy_above"]
    print(json.dumps({
        "benchmark": f"reward_model_{args.suite}",
        "model": base,
        "ranking_loss": ran["ranking_loss"],
        "learning_rate": ran["learning_rate"],
        "length_expert_coef": s.get("length_expert_coef"),
        "length_expert_train_accuracy": s.get("length_expert_train_accuracy"),
        "steps": s["steps"],
        "eval_accuracy_start": s["eval_accuracy_start"],
        "eval_accuracy_end": s["eval_accuracy_end"],
        "eval_accuracy_chosen_longer": s.get("eval_accuracy_chosen_longer"),
        "eval_accuracy_chosen_shorter": s.get("eval_accuracy_chosen_shorter"),
        "longer_response_baseline": s["eval_longer_response_baseline"],
        "eval_chosen_mean": s["eval_chosen_mean"],
        "eval_rejected_mean": s["eval_rejected_mean"],
        "train_samples_per_sec": s["train_samples_per_sec"],
        "scoring_samples_per_sec": s["scoring_samples_per_sec"],
        "train_tokens_per_sec": s.get("train_tokens_per_sec"),
        "padding_fraction": s.get("padding_fraction"),
        "step2_wall_seconds": s.get("process_wall_seconds", s["wall_seconds"]),  # with data, model and mining
        # the whole benchmark (step 1 too where it ran one); a run read with --from: not timed here
        "wall_seconds": None if args.src else time.perf_counter() - t0,
        "target": target,
        "target_met": met,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
