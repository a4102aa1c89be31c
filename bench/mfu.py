"""What the throughput benchmarks share: the device's measured matmul peak, a model's FLOPs per token
of a training step, and steady-state rates from a step's log (``bench_levers``, ``bench_step1``)."""

from __future__ import annotations

import itertools
import time

import torch


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """Best observed FLOP/s of an n x n matmul in ``dtype`` on this device."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        n = 8192
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    best = float("inf")
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if dev == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def model_shape(model: str) -> dict[str, int]:
    """Layers, parameters per decoder layer and the LM head's size, from the model's config."""
    from dschat.models.shapes import load_model_config, shape_from_config

    s = shape_from_config(load_model_config(model, "--model")[0])
    kv = s.num_kv_heads * s.head_dim
    attn = s.hidden_size * (s.num_heads * s.head_dim) * 2 + s.hidden_size * kv * 2
    mlp = s.hidden_size * s.intermediate_size * (3 if s.gated_mlp else 2)
    return {"layers": s.num_layers, "per_layer": attn + mlp, "head": s.vocab_size * s.hidden_size,
            "hidden": s.hidden_size}  # fmt: skip


def flops_per_token(shape: dict[str, int], step: int, trains: object, target_fraction: float = 1.0) -> float:
    """Model FLOPs per token of one training step (see the module docstring), without recomputation.
    ``target_fraction``: step 1's share of tokens that are answer tokens, the only rows its fused loss
    runs the LM head on."""
    n_layers, per_layer = shape["layers"], shape["per_layer"]
    # the reward model's head is hidden x 1 on every token; step 1's the vocabulary, on the targets alone
    head = shape["head"] * target_fraction if step == 1 else shape["hidden"]
    forward = 2 * (n_layers * per_layer + head)
    if trains == "all":
        return forward + 4 * n_layers * per_layer + 2 * head  # (the tied head's weight gradient aside)
    if isinstance(trains, tuple):  # LoRA: input gradients through every layer LoRA sits in or above
        k = trains[1] or n_layers
        return forward + 2 * k * per_layer + 2 * head
    return forward + 4 * int(trains) * per_layer + 2 * head  # weight + input gradients of the top K


def steady_rates(train: list[dict]) -> dict[str, float]:
    """Real and computed tokens/s over the logged windows after the first (which warms allocators and
    kernels): their tokens over their seconds, not the mean of per-window rates (windows differ in size),
    and step 1's token-weighted ``target_fraction``. Each row's window: its cumulative ``tokens`` less
    the previous row's, over ``tokens_per_sec``."""
    tokens = [b["tokens"] - a["tokens"] for a, b in itertools.pairwise(train)]
    steady = train[1:]
    if not steady:  # one window: it is all there is
        tokens, steady = [train[0]["tokens"]], train
    seconds = [n / max(r["tokens_per_sec"], 1e-9) for n, r in zip(tokens, steady, strict=True)]
    computed = sum(
        r.get("computed_tokens_per_sec", r["tokens_per_sec"]) * s
        for r, s in zip(steady, seconds, strict=True)
    )
    out = {
        "real_tokens_per_sec": sum(tokens) / sum(seconds),
        "computed_tokens_per_sec": computed / sum(seconds),
    }
    if all("target_fraction" in r for r in steady):
        out["target_fraction"] = sum(
            r["target_fraction"] * n for r, n in zip(steady, tokens, strict=True)
        ) / sum(tokens)
    return out
