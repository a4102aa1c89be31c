#!/usr/bin/env python
"""Throughput of each step against DeepSpeed-Chat on the same workload, printed as one JSON object.

    python bench/bench_throughput.py                      # ours alone: SFT/RM real tokens/s, PPO samples/s
    DSCHAT_GIT_DIR=<DeepSpeedExamples git dir> python bench/bench_throughput.py --peers ours dschat
    python bench/bench_throughput.py --size 100m --peers ours dschat --stages sft rm

Runs the side-by-side harness in ``../shared/peers-bench`` (``run_peers.sh``: the same tiny Llama, the
same HH-RLHF rows, DeepSpeed-Chat's hyper-parameters passed to ours as flags, bf16, ZeRO-0, one process;
its README documents the workload) and reads its ``results.jsonl``. ``--size 6m`` is the harness's
6.3M-parameter Llama (hidden 256, 4 layers, 512 SFT samples and 256 pairs at 256 tokens, micro-batch 8;
PPO 4 rounds x 16 prompts x 64 new tokens); ``--size 100m`` the shape of ``builtin:llama-100m`` (hidden
768, 12 layers) on a quarter of the rows. Throughput counts real (non-padding) tokens over the
training loop (samples/s for PPO: generation, experience and updates). With DeepSpeed-Chat in the run
each stage reports ``ratio`` = ours / DeepSpeed-Chat, mean over ``--repeats`` (ratios count only
within one run: the machines are noisy). Targets (issue 17): SFT and RM at least 1.3x, PPO at least 2x.
DeepSpeed-Chat needs the harness's venv (``--venv``, see its README); ours runs on this interpreter.
Prints ``{"skipped": ...}`` where the harness or the HH data is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT.parent / "shared" / "peers-bench"
HH = ROOT.parent / "shared" / "data" / "hh_rlhf" / "train.jsonl"
SIZES = {
    "6m": {"HIDDEN": "256", "LAYERS": "4", "HEADS": "4", "FFN": "1024", "N_SFT": "512", "N_RM": "256",
           "PPO_ITERS": "4", "PPO_BATCH": "16"},
    "100m": {"HIDDEN": "768", "LAYERS": "12", "HEADS": "12", "FFN": "2560", "N_SFT": "128", "N_RM": "64",
             "PPO_ITERS": "2", "PPO_BATCH": "16"},
}  # fmt: skip
TARGETS = {"sft": 1.3, "rm": 1.3, "ppo": 2.0}


def throughput(record: dict) -> float | None:
    """Real tokens/s for SFT and RM, samples/s for PPO."""
    return record.get("samples_per_s") if record["stage"] == "ppo" else record.get("tokens_per_s")


def summarize(records: list[dict], peers: list[str]) -> dict:
    """Per stage: each framework's throughput per repetition, their mean, and ours over DeepSpeed-Chat."""
    out: dict[str, dict] = {}
    for stage in ("sft", "rm", "ppo"):
        row: dict[str, object] = {}
        for fw in peers:
            # a run the harness flagged (ours kept fewer rows than the workload: another workload; its
            # loop time not found) is no measurement of this workload: it stays out of the ratio
            runs = [r for r in records if r["framework"] == fw and r["stage"] == stage
                    and not r.get("hybrid_engine") and r.get("status") == "ok" and not r.get("warning")]  # fmt: skip
            values = [v for v in map(throughput, runs) if v]
            if values:
                row[fw] = {"per_repeat": [round(v, 2) for v in values], "mean": round(mean(values), 2)}
        if "ours" in row and "dschat" in row:
            ratio = row["ours"]["mean"] / row["dschat"]["mean"]
            row.update(ratio=round(ratio, 3), target=TARGETS[stage], target_met=ratio >= TARGETS[stage])
        if row:
            row["unit"] = "samples/s" if stage == "ppo" else "real tokens/s"
            out[stage] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="6m")
    p.add_argument("--peers", nargs="+", choices=("ours", "dschat"), default=["ours"])
    p.add_argument("--stages", nargs="+", choices=("sft", "rm", "ppo"), default=["sft", "rm", "ppo"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--venv", default="/tmp/venv-peers", help="the harness's venv (DeepSpeed-Chat runs on it)")
    p.add_argument("--work", help="keep the harness's runs here (default: a temporary directory)")
    args = p.parse_args()
    if not (HARNESS / "run_peers.sh").is_file() or not HH.is_file():
        print(json.dumps({"skipped": f"{HARNESS} or {HH} not present"}))
        return
    if "dschat" in args.peers and not os.environ.get("DSCHAT_GIT_DIR"):
        p.error("--peers dschat needs DSCHAT_GIT_DIR (a git directory of microsoft/DeepSpeedExamples)")
    tmp = None if args.work else tempfile.TemporaryDirectory()
    work = Path(args.work or tmp.name)
    env = {**os.environ, **SIZES[args.size], "ARCH": "llama", "VOCAB": "4096", "SEQ_LEN": "256", "MICRO_BS": "8",
           "PPO_NEW_TOKENS": "64", "REPEATS": str(args.repeats), "EXTRAS": "", "PEERS": " ".join(args.peers),
           "STAGES": " ".join(args.stages), "WORK": str(work), "VENV": args.venv, "OURS_PYTHON": sys.executable,
           "OURS_ROOT": str(ROOT)}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(HARNESS / "run_peers.sh")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    results = sorted(work.glob("runs/*/results.jsonl"))
    if proc.returncode != 0 or not results:
        print(json.dumps({"error": (proc.stdout + proc.stderr).strip().splitlines()[-5:]}))
        sys.exit(1)
    records = [json.loads(line) for line in results[-1].read_text().splitlines() if line.strip()]
    print(json.dumps({"benchmark": "throughput_vs_deepspeed_chat", "size": args.size, "repeats": args.repeats,
                      "stages": summarize(records, args.peers),
                      "failed": [f"{r['framework']} {r['stage']}: {r.get('error', r['status'])}" for r in records
                                 if r.get("status") != "ok"],
                      "left_out": [f"{r['framework']} {r['stage']}: {r['warning']}" for r in records
                                   if r.get("status") == "ok" and r.get("warning")]}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
