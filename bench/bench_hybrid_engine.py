#!/usr/bin/env python
"""Generation throughput of the hybrid engine against plain ``generate``, printed as JSON.

    python bench/bench_hybrid_engine.py                                    # the full run (a few minutes)
    python bench/bench_hybrid_engine.py --models builtin:tiny-llama --new_tokens 8 --ranks 1   # a quick check

For 1 and 2 ranks (each launched with ``torch.distributed.run``, gloo on CPU) and each model, an actor
is built as step 3 builds it (ZeRO-3, AdamW, the training dtype) and generates ``--prompts`` built-in
task prompts per rank x ``--new_tokens`` sampled tokens (EOS forbidden until the last token, so every
variant produces exactly that many):

- ``plain_zero3``: Hugging Face ``generate`` on the ZeRO-3 module (``synced_gpus``), as without the flag;
- ``hybrid``: :class:`HybridGenerator` (switch into generation mode + generate, timed together);
- ``unwrapped``: ``generate`` on a plain copy of the same weights (no DeepSpeed), on every rank;
- ``hybrid_tpN`` (N > 1 ranks): the same with ``--inference_tp_size N`` (keys ``tpN_*``).

Tokens/s count every rank's tokens over the slowest rank's time; each variant runs once untimed, then
the best of ``--repeats`` timed rounds is kept. Also reported: the switch time and the peak bytes of
full training parameters held while gathering, all at once and with ``--tp_gather_partition_size 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["builtin:tiny-llama", "builtin:small-llama"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--prompts", type=int, default=8, help="prompts per rank")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: output file of a worker
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- worker
def timed(fn) -> float:
    """Seconds of ``fn()`` on the slowest rank (ranks start together)."""
    import torch
    import torch.distributed as tdist

    from dschat.utils import dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    # on the process group's device: NCCL reduces CUDA tensors only (a CPU tensor failed on the H100)
    x = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=dist.default_device())
    tdist.all_reduce(x, op=tdist.ReduceOp.MAX)
    return float(x)


def best(fn, repeats: int) -> float:
    fn()  # untimed: one-time costs (buffers, first kernels, the inference copy's first fill)
    return min(timed(fn) for _ in range(repeats))


def bench_model(model_name: str, args: argparse.Namespace, dtype: str) -> dict:
    import torch

    from dschat import tasks
    from dschat.engine import core
    from dschat.engine.core import gather_zero3
    from dschat.engine.ds_config import train_ds_config
    from dschat.generation.hybrid import HybridGenerator
    from dschat.generation.plain import PlainGenerator
    from dschat.generation.sampling import SamplingConfig
    from dschat.models.loading import load_causal_lm, load_tokenizer, resolve
    from dschat.utils import dist

    world, rank = dist.world_size(), dist.rank()
    # generate's draw, as the unwrapped baseline below: the generators are compared, not the draws
    s = SamplingConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True,
                       draw="multinomial")  # fmt: skip
    path = resolve(model_name)
    tok = load_tokenizer(path, padding_side="left")
    examples = tasks.generate(None, n_per_task=args.prompts * world, seed=0)
    prompts = [e.prompt for e in examples[rank::world]][: args.prompts]  # built-in tasks, mixed lengths
    enc = tok(prompts, return_tensors="pt", padding=True).to(dist.default_device())
    ids, mask = enc["input_ids"], enc["attention_mask"]
    cfg = train_ds_config(zero_stage=3, dtype=dtype, micro_batch_size=args.prompts, gradient_accumulation_steps=1,
                          world_size=world)  # fmt: skip
    with core.zero3_loading(cfg):
        model = load_causal_lm(path, tokenizer=tok)
    engine = core.initialize_engine(
        model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), ds_config=cfg
    )
    engine.train()
    tokens = world * args.prompts * args.new_tokens
    row: dict = {"model": model_name, "ranks": world, "dtype": dtype, "prompt_batch": list(ids.shape),
                 "new_tokens": args.new_tokens, "draw": s.draw, "parameters": sum(p.ds_numel for p in engine.module.parameters())}  # fmt: skip

    def run(gen) -> None:
        with gen.generation_mode() as g:
            out = g.generate(ids, mask)
        assert out.shape[1] == ids.shape[1] + args.new_tokens

    def tps(gen) -> float:
        return tokens / best(lambda: run(gen), args.repeats)

    row["plain_zero3_tokens_per_sec"] = tps(PlainGenerator(engine, tok, s, zero3=True))
    variants = [("", {}), ("chunked_", {"gather_layers": 1})]
    if world > 1:  # tensor-parallel inference over every rank, named by its degree
        variants.append((f"tp{world}_", {"tp_size": world}))
    for key, kw in variants:
        gen = HybridGenerator(engine, tok, s, zero3=True, gather=gather_zero3, measure_logprobs=False, **kw)
        row[f"{key}hybrid_tokens_per_sec"] = tps(gen)
        st = gen.stats()
        row[f"{key}switch_seconds"] = st["hybrid_switch_seconds"] / st["hybrid_switches"]
        row[f"{key}gather_peak_mb"] = st["hybrid_gather_peak_mb"]
        row[f"{key}inference_copy_mb"] = st["hybrid_inference_copy_mb"]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    plain_model = load_causal_lm(path, tokenizer=tok, dtype=torch_dtype).to(ids.device).eval()

    @torch.no_grad()
    def unwrapped() -> None:
        plain_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, use_cache=True)  # fmt: skip

    row["unwrapped_tokens_per_sec"] = tokens / best(unwrapped, args.repeats)
    row["hybrid_vs_plain_zero3"] = row["hybrid_tokens_per_sec"] / row["plain_zero3_tokens_per_sec"]
    row["hybrid_vs_unwrapped"] = row["hybrid_tokens_per_sec"] / row["unwrapped_tokens_per_sec"]
    row["unwrapped_vs_plain_zero3"] = row["unwrapped_tokens_per_sec"] / row["plain_zero3_tokens_per_sec"]
    return row


def worker(args: argparse.Namespace) -> None:
    from dschat.engine import core
    from dschat.utils import dist

    core.init_distributed()
    dtype = core.resolve_dtype(args.dtype)
    rows = [bench_model(m, args, dtype) for m in args.models]
    if dist.rank() == 0:
        Path(args.worker).write_text(json.dumps(rows))


# ---------------------------------------------------------------------------------------------- driver
EXCEPTION = re.compile(r"^(?:\[rank(\d+)\]:\s*)?[\w.]*(?:Error|Exception|Interrupt)\b(?::|$)")


def failure_lines(stderr: str, keep: int = 12) -> list[str]:
    """Why a worker failed, from torchrun's stderr: the failing rank's last exception line (with the lines
    that continue its message) and the traceback lines above it. torchrun ends its stderr with a banner
    (rank, exit code, "To enable traceback see ...") that names no cause; its "Root Cause" block names the
    rank that failed first, whose exception is preferred to its peers' knock-on errors."""
    from dschat.launch.supervise import RankWatch  # torchrun's "Root Cause" block, read as train.py reads it

    lines = stderr.strip().splitlines()
    root = RankWatch.ROOT_CAUSE.search(stderr.encode())
    found = [
        (i, m[1]) for i, x in enumerate(lines) if (m := EXCEPTION.match(x)) and "ChildFailedError" not in x
    ]
    if root:
        found = [f for f in found if f[1] == root[1].decode()] or found
    if not found:
        return lines[-keep:]
    i, rank = found[-1]
    end = i + 1
    prefix = f"[rank{rank}]:" if rank is not None else None
    # a multi-line message (CUDA and NCCL errors put their detail on the next lines), up to another traceback
    while prefix and end < len(lines) and lines[end].startswith(prefix):
        rest = lines[end][len(prefix) :].strip()
        if EXCEPTION.match(lines[end]) or rest.startswith("Traceback") or not rest:
            break
        end += 1
    return lines[max(0, end - keep) : end]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    from dschat.utils.dist import free_port, threads_per_rank

    load = os.getloadavg()
    results, errors = [], []
    for ranks in args.ranks:
        if 0 < torch.cuda.device_count() < ranks:  # ranks would share a GPU: not a configuration to time
            errors.append({"ranks": ranks, "error": [f"skipped: {ranks} ranks need {ranks} GPUs, this machine has "
                                                     f"{torch.cuda.device_count()}"]})  # fmt: skip
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                   str(free_port()), str(Path(__file__).resolve()), "--worker", str(out), "--models", *args.models,
                   "--prompts", str(args.prompts), "--new_tokens", str(args.new_tokens), "--repeats",
                   str(args.repeats), "--dtype", args.dtype]  # fmt: skip
            env = {
                **os.environ,
                # the project first, the caller's path kept (packages installed with --target live there)
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": str(threads_per_rank(ranks)),
            }
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0 or not out.exists():
                errors.append({"ranks": ranks, "error": failure_lines(proc.stderr)})
                continue
            results.extend(json.loads(out.read_text()))
    targets = {}
    for r in results:
        key = f"{r['model']}/{r['ranks']}r"
        targets[f"{key}: hybrid >= unwrapped"] = r["hybrid_vs_unwrapped"] >= 1.0
        if r["ranks"] == 2:
            need = 5.0 if "small-llama" in r["model"] else 3.0
            targets[f"{key}: hybrid >= {need:g}x plain ZeRO-3"] = r["hybrid_vs_plain_zero3"] >= need
    report = {"cpu_count": os.cpu_count(), "load_average_before": load, "load_average_after": os.getloadavg(),
              "results": results, "targets": targets, "errors": errors}  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
