#!/usr/bin/env python
"""What makes a 100M-class model trainable on a few CPU cores: each speed lever of steps 1 and 2 measured
on the real entry points, printed as one JSON object.

    python bench/bench_levers.py                                   # SmolLM2-135M-Instruct, HH data
    python bench/bench_levers.py --model builtin:llama-100m --steps 4 --levers full_bf16 top8_bf16

Every lever is one run of ``training/step1_supervised_finetuning/main.py`` or
``training/step2_reward_model_finetuning/main.py`` (``deepspeed.initialize``, the real data pipeline and
chat template) for ``--steps`` optimizer steps on HH-RLHF dialogues (``../shared/data``; the built-in
tasks where it is absent), read back from its ``summary.json`` and ``metrics.jsonl``:

* ``full_fp32``, ``full_bf16``, ``full_bf16_ckpt``: every weight trains, batches in random order
  (``--no_group_by_length``, as every lever below but the ``_grouped`` ones) (fp32; bf16; bf16 with gradient
  checkpointing, what full fine-tuning needs for memory at longer lengths);
* ``top8_bf16``: ``--trainable_layers 8``, the body below frozen, so backward stops there;
* ``top8_bf16_grouped``: the same with ``--group_by_length`` (padding nearly gone);
* ``lora_all_bf16``: LoRA r=16 in every layer with the base frozen (backward still runs through every
  layer); ``lora_top8_bf16``: LoRA only in the top 8 layers (backward stops there too);
* ``rm_top8_bf16`` (step 2): a reward model that never computes the 49152-way LM head, top 8 layers;
  ``rm_top8_bf16_grouped``; ``rm_top8_bf16_grouped_shared``: each pair packed into one row, so its shared
  prompt is computed once (``--share_prompt``).

Throughput counts real (non-padding) tokens of the samples, a shared prompt twice as in two unpacked
rows (``computed_tokens_per_sec``: those the model ran); ``padding_fraction`` is the share of padded
positions. Throughputs are the steady windows' tokens over their seconds (the first step left out). MFU is
the model FLOPs per computed real token (forward through every layer and the head it uses, backward through
what it must: weight and input gradients of trainable layers, input gradients of frozen layers above a
trainable one, the LM head's input gradient; step 1's head runs on the answer tokens alone, the share
``target_fraction`` of its log) times tokens/s, over the bf16 (or fp32) matmul peak
measured at the start of this run. Attention-score FLOPs (under 7% at 256 tokens) are not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from mfu import flops_per_token, matmul_peak, model_shape, steady_rates  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
STEP1 = ROOT / "training" / "step1_supervised_finetuning" / "main.py"
STEP2 = ROOT / "training" / "step2_reward_model_finetuning" / "main.py"

# Batches padded to their own longest sample, as before --group_by_length became the default: the
# baseline that the grouped levers are measured against.
UNGROUPED = ["--no_group_by_length"]
# name -> (step, extra flags, what trains: "all" | int K top layers | ("lora", K or 0 = every layer))
LEVERS: dict[str, tuple[int, list[str], object]] = {
    "full_fp32": (1, [*UNGROUPED, "--dtype", "fp32"], "all"),
    "full_bf16": (1, [*UNGROUPED, "--dtype", "bf16"], "all"),
    "full_bf16_ckpt": (1, [*UNGROUPED, "--dtype", "bf16", "--gradient_checkpointing"], "all"),
    "top8_bf16": (1, [*UNGROUPED, "--dtype", "bf16", "--trainable_layers", "8"], 8),
    "top8_bf16_grouped": (1, ["--dtype", "bf16", "--trainable_layers", "8", "--group_by_length"], 8),
    "top8_fp32_grouped": (1, ["--dtype", "fp32", "--trainable_layers", "8", "--group_by_length"], 8),
    "lora_all_bf16": (1, [*UNGROUPED, "--dtype", "bf16", "--lora_dim", "16", "--only_optimize_lora"], ("lora", 0)),
    "lora_top8_bf16": (1, [*UNGROUPED, "--dtype", "bf16", "--lora_dim", "16", "--only_optimize_lora", "--trainable_layers", "8"],
                       ("lora", 8)),
    "rm_top8_bf16": (2, [*UNGROUPED, "--no_share_prompt", "--dtype", "bf16", "--trainable_layers", "8"], 8),
    "rm_top8_bf16_grouped": (2, ["--no_share_prompt", "--dtype", "bf16", "--trainable_layers", "8", "--group_by_length"], 8),
    "rm_top8_bf16_grouped_shared": (2, ["--share_prompt", "--dtype", "bf16", "--trainable_layers", "8", "--group_by_length"], 8),
    "rm_top8_fp32_grouped_shared": (2, ["--share_prompt", "--dtype", "fp32", "--trainable_layers", "8", "--group_by_length"], 8),
}  # fmt: skip


# each step's levers against that step's plain run: step 2's tokens are preference pairs, not SFT rows, so
# a step-2 lever measured against step 1's baseline compared two workloads
BASELINES = {1: "full_bf16", 2: "rm_top8_bf16"}


def add_speedups(results: list[dict]) -> None:
    """``speedup``: real tokens/s over the same step's baseline lever (:data:`BASELINES`), where it ran."""
    base = {r["step"]: r["real_tokens_per_sec"] for r in results
            if "real_tokens_per_sec" in r and BASELINES.get(r["step"]) == r["lever"]}  # fmt: skip
    for r in results:
        if "real_tokens_per_sec" in r and r["step"] in base:
            r["speedup"] = r["real_tokens_per_sec"] / base[r["step"]]
            r["speedup_over"] = BASELINES[r["step"]]


def data_flags(step: int, max_seq_len: int) -> list[str]:
    sft, pairs = SHARED / "sft" / "train.jsonl", SHARED / "hh_rlhf" / "train.jsonl"
    source = sft if step == 1 else pairs
    data = str(source) if source.exists() else "builtin"
    return ["--data_path", data, "--data_split", "1,1,1" if data == "builtin" else "1,0,0" if step == 1 else "0,1,0",
            "--max_seq_len", str(max_seq_len)]  # fmt: skip


def run(model: str, lever: str, steps: int, batch: int, max_seq_len: int) -> dict:
    step, extra, _ = LEVERS[lever]
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, str(STEP1 if step == 1 else STEP2), "--model_name_or_path", model, "--output_dir", out,
            "--max_steps", str(steps), "--per_device_train_batch_size", str(batch), "--eval_interval", "0",
            "--save_steps", "0", "--max_eval_samples", "16", "--log_interval", "1",
            *(["--eval_generation_samples", "0"] if step == 1 else []), *data_flags(step, max_seq_len), *extra,
        ]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"lever": lever, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        summary = json.loads((Path(out) / "summary.json").read_text())
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"lever": lever, "step": step, "dtype": summary["dtype"], "steps": summary["steps"],
            **steady_rates([r for r in rows if r["split"] == "train"]),
            "wall_seconds": time.perf_counter() - t0, "padding_fraction": summary.get("padding_fraction")}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max_seq_len", type=int, default=256)
    args = p.parse_args()
    peaks = {"bf16": matmul_peak(torch.bfloat16), "fp32": matmul_peak(torch.float32)}
    shape = model_shape(args.model)
    results = []
    for lever in args.levers:
        r = run(args.model, lever, args.steps, args.batch, args.max_seq_len)
        if "real_tokens_per_sec" in r:
            f = flops_per_token(shape, r["step"], LEVERS[lever][2], r.get("target_fraction", 1.0))
            r["model_gflops_per_token"] = f / 1e9
            r["mfu"] = f * r["computed_tokens_per_sec"] / peaks[r["dtype"]]
        results.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    add_speedups(results)
    print(json.dumps({
        "benchmark": "speed_levers",
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads",
        "measured_matmul_peak_tflops": {k: v / 1e12 for k, v in peaks.items()},
        "micro_batch": args.batch, "max_seq_len": args.max_seq_len, "steps": args.steps,
        "results": results,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
