#!/usr/bin/env python
"""Step-1 throughput with 1 and 2 (or more) processes on this machine, through train.py: scaling efficiency.

    python bench/bench_scaling.py                       # builtin:tiny-llama, 1 vs 2 processes, 60 steps
    python bench/bench_scaling.py --processes 1 2 4 --max-steps 100 --model builtin:small-llama

Each run is ``train.py --step 1`` with ``--deployment-type single_gpu`` (1 process) or ``single_node
--num-gpus N`` (the DeepSpeed launcher; on CPU, N gloo processes that split the cores) at the same
per-device micro-batch (weak scaling: the global batch grows with N). Throughput is the run's own
``train_tokens_per_sec`` (real, non-padding tokens per second over all ranks, training time only).
Prints JSON: per process count tokens/s, wall seconds, and ``speedup`` and ``scaling_efficiency``
(tokens/s with N / (N x tokens/s with 1)) against one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(n: int, args: argparse.Namespace, out: Path) -> dict:
    deploy = (
        ["--deployment-type", "single_gpu"]
        if n == 1
        else ["--deployment-type", "single_node", "--num-gpus", str(n)]
    )
    cmd = [sys.executable, str(ROOT / "train.py"), "--step", "1", "--actor-model", args.model, "--preset", "none",
           *deploy, "--output-dir", str(out), "--overwrite", "--", "--max_steps", str(args.max_steps),
           "--per_device_train_batch_size", str(args.batch_size), "--zero_stage", str(args.zero_stage),
           "--eval_interval", "0", "--max_eval_samples", "64", "--eval_generation_samples", "0",
           "--save_steps", "0", "--log_interval", "10", "--dtype", args.dtype]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"run with {n} process(es) failed (exit code {proc.returncode})")
    s = json.loads((out / "step1" / "summary.json").read_text())
    return {
        "processes": n,
        "tokens_per_sec": s["train_tokens_per_sec"],
        "train_seconds": s["train_seconds"],
        "wall_seconds": wall,
        "steps": s["steps"],
        "global_batch": args.batch_size * n,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="per-device micro-batch")
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    if 1 not in args.processes:
        args.processes = [1, *args.processes]
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        runs = [run(n, args, Path(tmp) / f"n{n}") for n in sorted(set(args.processes))]
    base = runs[0]["tokens_per_sec"]
    for r in runs:
        r["speedup"] = r["tokens_per_sec"] / base
        r["scaling_efficiency"] = r["tokens_per_sec"] / (r["processes"] * base)
    print(json.dumps({
        "benchmark": "step-1 throughput vs processes (train.py single_gpu / single_node)",
        "model": args.model,
        "cpu_cores": os.cpu_count(),
        "device": "cuda" if _cuda() else "cpu",
        "per_device_batch": args.batch_size,
        "zero_stage": args.zero_stage,
        "runs": runs,
    }, indent=2))  # fmt: skip


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
