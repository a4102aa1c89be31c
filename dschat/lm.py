"""Loaders and evaluation for causal-LM training (step 1, and the PTX loss of step 3)."""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

from dschat.data.sampler import ResumableDistributedSampler
from dschat.losses import token_nll
from dschat.utils import dist


def train_loader(
    examples: list,
    *,
    batch_size: int,
    seed: int,
    collate,
    accumulation: int = 1,
    lengths: list[int] | None = None,
) -> DataLoader:
    """Shuffled, rank-sharded, resumable loader over ``examples`` (any step's tokenized examples); with
    ``lengths`` (one per example), batches of similar length."""
    sampler = ResumableDistributedSampler(
        len(examples), batch_size=batch_size, rank=dist.rank(), world=dist.world_size(), seed=seed,
        accumulation=accumulation, lengths=lengths,
    )  # fmt: skip
    # A private generator: creating a DataLoader iterator draws a seed, and drawing it from the global
    # RNG would shift the sampling RNG of step 3 between an uninterrupted and a resumed run.
    return DataLoader(
        examples, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def eval_batches(examples: list, *, batch_size: int, collate) -> list[tuple[dict, torch.Tensor]]:
    """This rank's eval batches and a 0/1 weight per sample.

    Every rank gets the same number of batches (ZeRO-3 forwards are collective): the index list is
    padded to a multiple of ``world * batch_size`` with repeats whose weight is 0.
    """
    world, r = dist.world_size(), dist.rank()
    n = len(examples)
    chunk = world * batch_size
    total = max(chunk, math.ceil(n / chunk) * chunk)
    idx = [(i % n, 1.0 if i < n else 0.0) for i in range(total)]
    mine = idx[r::world]
    out = []
    for s in range(0, len(mine), batch_size):
        part = mine[s : s + batch_size]
        out.append((collate([examples[i] for i, _ in part]), torch.tensor([w for _, w in part])))
    return out


@torch.no_grad()
def evaluate_perplexity(engine, batches: list[tuple[dict, torch.Tensor]]) -> dict[str, float]:
    """Token-weighted mean NLL over the whole eval set (all ranks) and its exponential."""
    was_training = engine.module.training
    engine.eval()
    device = engine.device
    nll_sum, tokens = 0.0, 0.0
    for batch, weight in batches:
        logits = engine(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
        ).logits
        nll, n = token_nll(logits, batch["labels"].to(device))
        w = weight.to(nll.device)
        nll_sum += float((nll * w).sum())
        tokens += float((n * w).sum())
    nll_sum, tokens = dist.all_reduce_sum([nll_sum, tokens])
    if was_training:
        engine.train()
    loss = nll_sum / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}
