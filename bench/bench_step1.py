#!/usr/bin/env python
"""Step-1 throughput and model-FLOPs utilisation (MFU), printed as JSON.

    python bench/bench_step1.py                       # default model and the ~100M Llama, CPU or GPU
    python bench/bench_step1.py --models builtin:tiny-llama --steps 30

Each configuration runs the real step-1 entry (``deepspeed.initialize``, real data pipeline) for
``--steps`` optimizer steps and reads its ``summary.json``. Throughput counts real (non-padding)
tokens. MFU = model FLOPs per token (``mfu.flops_per_token``, as bench_levers counts them: forward and
backward through every layer, the LM head on the answer tokens alone) x tokens/s / peak (it was
6 x parameters, which counted the embedding and the head on every token: +16-20% for SmolLM2), where the
peak is the matmul rate measured here in the training dtype (about 180 GFLOP/s fp32 and 750 GFLOP/s bf16 on the 2-core CPU machines; 744-777
TFLOP/s bf16 measured on the lent H100s, against its 990 dense on paper). Each result also carries the
evaluation loss before and after and ``learned`` (it fell by at least 1%): a throughput counts only for
a run that learned.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from mfu import flops_per_token, matmul_peak, model_shape, steady_rates  # noqa: E402

from dschat.engine.core import resolve_dtype  # noqa: E402

SHARED_SFT = ROOT.parent / "shared" / "data" / "sft" / "train.jsonl"


def learning(summary: dict) -> dict:
    """The run's evaluation loss before and after, and ``learned``: whether it fell by at least 1%.
    A throughput is a speed-up only for a run that learned: a lever that breaks the gradients (as
    torch.compile did on an H100, 2026-11-27: 1.75x the tokens/s, the loss unchanged) is no gain.
    ``None`` where the run evaluated nothing."""
    start, end = summary.get("eval_loss_start"), summary.get("eval_loss_end")
    learned = None if start is None or end is None else bool(end < 0.99 * start)
    return {"eval_loss_start": start, "eval_loss_end": end, "learned": learned}


def run_one(
    model: str, steps: int, batch: int, accum: int, data: str, max_seq_len: int, extra: list[str]
) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, str(ROOT / "training/step1_supervised_finetuning/main.py"),
            "--model_name_or_path", model, "--output_dir", out, "--data_path", data,
            "--max_steps", str(steps), "--per_device_train_batch_size", str(batch),
            "--gradient_accumulation_steps", str(accum), "--max_seq_len", str(max_seq_len),
            # as many epochs as --steps needs: a small data set (HH rows at 512 bytes keep 178 of 570) must
            # not end the run after a few warm-up steps, which is what an MFU of a few % measured before
            "--num_train_epochs", "1000",
            "--eval_interval", "0", "--save_steps", "0", "--max_eval_samples", "32",
            "--eval_generation_samples", "0", "--log_interval", str(max(steps // 5, 1)), *extra,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return {
                "model": model,
                "error": proc.stderr.strip().splitlines()[-1:] if proc.stderr else proc.returncode,
            }
        summary = json.loads((Path(out) / "summary.json").read_text())
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return result(model, summary, rows, model_shape(model))


def result(model: str, summary: dict, rows: list[dict], shape: dict[str, int]) -> dict:
    """One model's line: steady real tokens/s (the windows after the first, their tokens over their
    seconds) and the model FLOPs per token that bench_levers counts for full fine-tuning (the fused loss
    runs the LM head on the answer tokens alone, the log's ``target_fraction``)."""
    rates = steady_rates([r for r in rows if r["split"] == "train"])
    flops = flops_per_token(shape, 1, "all", rates.get("target_fraction", 1.0))
    return {
        "model": model,
        "parameters": summary["parameters"],
        "dtype": summary["dtype"],
        "steps": summary["steps"],
        "tokens_per_sec_steady": rates["real_tokens_per_sec"],
        "tokens_per_sec_whole_run": summary["train_tokens_per_sec"],
        "target_fraction": rates.get("target_fraction"),
        "model_gflops_per_token": flops / 1e9,
        "model_tflops_per_sec": flops * rates["computed_tokens_per_sec"] / 1e12,
        **learning(summary),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["builtin:tiny-llama", "builtin:llama-100m"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--data", default=str(SHARED_SFT) if SHARED_SFT.exists() else "builtin")
    p.add_argument("--dtype", default="auto")
    args, extra = p.parse_known_args()
    if args.steps < 1:  # 0 would mean "all epochs" to step 1, and the benchmark asks for 1000 of them
        p.error(f"--steps {args.steps}: must be at least 1")
    # its MFU counts a backward through every layer
    frozen = [
        a for a in extra if a.split("=")[0] in ("--trainable_layers", "--lora_dim", "--only_optimize_lora")
    ]
    if frozen:
        p.error(f"{frozen[0]}: this benchmark's MFU counts the backward of every layer; measure frozen layers "
                "and LoRA with bench/bench_levers.py, which counts the FLOPs they run")  # fmt: skip
    dtype = resolve_dtype(args.dtype)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    peak = matmul_peak(torch_dtype)
    results = []
    for m in args.models:
        r = run_one(
            m, args.steps, args.batch, args.accum, args.data, args.max_seq_len, ["--dtype", dtype, *extra]
        )
        if "model_tflops_per_sec" in r:
            r["mfu"] = r["model_tflops_per_sec"] * 1e12 / peak
        results.append(r)
    print(json.dumps({
        "benchmark": "step1_sft_throughput",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()} threads",
        "dtype": dtype,
        "measured_matmul_peak_tflops": peak / 1e12,
        "data": args.data,
        "micro_batch": args.batch,
        "gradient_accumulation_steps": args.accum,
        "results": results,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
