"""Loaders and evaluation for causal-LM training (step 1, and the PTX loss of step 3)."""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

from dschat.data.collate import IGNORE_INDEX
from dschat.data.sampler import ResumableDistributedSampler
from dschat.losses import linear_cross_entropy, mean_token_nll, token_nll
from dschat.utils import dist


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether the Hugging Face model inside ``model`` (a DeepSpeed engine, a peft wrapper or the model
    itself) takes keyword ``name`` in its forward."""
    import inspect

    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    try:
        return name in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def target_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (B, K, V), labels (B, K))``: the LM head applied only to the last K positions, those
    that predict a target token in some row (position t predicts label t+1), and the labels aligned with
    them, so :func:`dschat.losses.token_nll` gives the same loss as on the full sequence.

    A response is the end of each row, while prompts (a chat template's system message included) are
    most of the tokens: the 49152-way head of a model like SmolLM2 then runs on a fraction of them, and
    the (B, T, V) fp32 logits are never materialised. Models without ``logits_to_keep`` get full logits.
    """
    t = labels.shape[1]
    targets = labels != IGNORE_INDEX
    rows = targets.any(dim=1)
    first = int(targets.float().argmax(dim=1)[rows].min()) if bool(rows.any()) else t - 1
    k = min(t - first + 1, t)
    extra = {"logits_to_keep": k} if k < t and accepts(model, "logits_to_keep") else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits
    return logits[:, -k:], labels[:, -k:]


# Architectures whose logits are exactly ``get_output_embeddings()(body(...).last_hidden_state)``: no
# soft-capping, logit scaling or bias (Gemma 2, Cohere, Granite and others scale their logits), so the
# fused loss below may apply the head's weight itself.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2", "opt", "gpt_neox", "phi3"})


def plain_body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``(body, lm_head)`` of the causal LM inside ``model`` (a DeepSpeed engine, a peft wrapper or the
    model itself) when its logits are a plain linear head over the body's last hidden state and that
    head's weight is whole on this rank; ``None`` otherwise: another architecture, a LoRA-wrapped head,
    or ZeRO-3 (which partitions the weight and gathers it only inside the head's own forward)."""
    inner = getattr(model, "module", model)
    hf = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    if getattr(getattr(hf, "config", None), "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = hf.get_output_embeddings()
    body = getattr(hf, hf.base_model_prefix, None)
    if (
        type(head) is not torch.nn.Linear
        or head.bias is not None
        or body is None
        or hasattr(head.weight, "ds_id")
    ):
        return None
    return body, head


def sft_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean next-token NLL over the target tokens (), their number ())`` of a right-padded batch
    (input_ids, attention_mask, labels: (B, T); position t predicts label t+1).

    Where :func:`plain_body_and_head` finds the head, it runs only on the target positions and through
    :func:`dschat.losses.linear_cross_entropy`, so neither the padding nor the prompt tokens pass
    the head and no (B, T, V) logits are made; elsewhere :func:`target_logits` (same value)."""
    parts = plain_body_and_head(model)
    if parts is None:
        logits, kept = target_logits(model, input_ids, attention_mask, labels)
        return mean_token_nll(logits, kept)
    body, head = parts
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX  # (B, T-1)
    n = keep.sum().float()
    nll = linear_cross_entropy(hidden[:, :-1][keep], head.weight, targets[keep])
    return nll / n.clamp_min(1.0), n


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
        logits, labels = target_logits(
            engine,
            batch["input_ids"].to(device),
            batch["attention_mask"].to(device),
            batch["labels"].to(device),
        )
        nll, n = token_nll(logits, labels)
        w = weight.to(nll.device)
        nll_sum += float((nll * w).sum())
        tokens += float((n * w).sum())
    nll_sum, tokens = dist.all_reduce_sum([nll_sum, tokens])
    if was_training:
        engine.train()
    loss = nll_sum / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}
