#!/usr/bin/env python
"""The memory estimator (dschat/memory.py) against measured peak memory of real step-1 runs on this machine.

    python bench/bench_memory.py                                   # micro, tiny and llama-100m, one process
    python bench/bench_memory.py --models builtin:tiny-llama --max-steps 30

Each model trains for ``--max-steps`` steps in one process (``training/step1_supervised_finetuning``,
ZeRO-0, default dtype); the run's ``summary.json`` holds its peak RSS (``ru_maxrss``) or, on a GPU, the
peak of torch's allocator. The estimate uses the same micro-batch and, as sequence length, the longest
training sample (batches are padded to their own longest sample; ``--max_seq_len`` is only the bound,
also reported). ``builtin:micro-llama`` has 0.14M parameters: its peak is the fixed runtime overhead that
dschat/memory.py assumes (``CPU_RUNTIME_BYTES``), so its error is small by construction. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def longest_sample(model: str, max_eval: int) -> int:
    """Tokens in the longest phase-1 training sample of the built-in data for ``model``'s tokenizer."""
    from dschat.config import DataArgs
    from dschat.data.pipeline import prepare_sft_data
    from dschat.models.loading import load_tokenizer, resolve

    data = prepare_sft_data(DataArgs(max_eval_samples=max_eval), load_tokenizer(resolve(model)), phase=1)
    return max(len(x["input_ids"]) for x in data.train)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", nargs="+", default=["builtin:micro-llama", "builtin:tiny-llama", "builtin:llama-100m"]
    )
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()

    import torch

    from dschat import memory as M
    from dschat.engine.core import resolve_dtype
    from dschat.models import shapes as S

    on_gpu = torch.cuda.is_available()
    dtype = resolve_dtype("auto")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for model in args.models:
            out = Path(tmp) / model.replace(":", "-").replace("/", "-")
            cmd = [sys.executable, str(ROOT / "training/step1_supervised_finetuning/main.py"), "--output_dir", str(out),
                   "--model_name_or_path", model, "--max_steps", str(args.max_steps), "--per_device_train_batch_size",
                   str(args.batch_size), "--eval_interval", "0", "--max_eval_samples", "64",
                   "--eval_generation_samples", "0", "--save_steps", "0"]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"{model}: step 1 failed (exit code {proc.returncode})")
            s = json.loads((out / "summary.json").read_text())
            measured = s["peak_gpu_reserved_bytes"] + M.GPU_RUNTIME_BYTES if on_gpu else s["peak_rss_bytes"]
            seq = longest_sample(model, 64)
            shape = S.shape_from_config(S.load_model_config(model)[0])
            hw = M.Hardware(1, 1, on_gpu, None, None)
            choice = M.Choice(0, False, False)
            est = M.estimate_train(
                M.TrainWorkload(shape, args.batch_size, seq, M.dtype_bytes(dtype)), choice, hw
            )
            bound = M.estimate_train(
                M.TrainWorkload(shape, args.batch_size, 512, M.dtype_bytes(dtype)), choice, hw
            )
            rows.append({
                "model": model,
                "parameters": s["parameters"],
                "dtype": dtype,
                "micro_batch": args.batch_size,
                "longest_sample_tokens": seq,
                "measured_peak_gib": measured / M.GIB,
                "estimate_gib": est.device / M.GIB,
                "estimate_parts_gib": {k: v / M.GIB for k, v in est.parts.items()},
                "error_pct": 100 * (est.device - measured) / measured,
                "estimate_at_max_seq_len_512_gib": bound.device / M.GIB,
            })  # fmt: skip
    print(json.dumps({"benchmark": "memory estimate vs measured peak (step 1, ZeRO-0, one process)",
                      "measured": "peak GPU reserved + runtime" if on_gpu else "peak RSS of the step process",
                      "runs": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
