"""Loaders and evaluation for causal-LM training (step 1, and the PTX loss of step 3)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from dschat.data.collate import IGNORE_INDEX
from dschat.data.packing import custom_mask, shared_prompt_mask
from dschat.data.sampler import ResumableDistributedSampler
from dschat.losses import linear_cross_entropy, mean_token_nll, picked_token_logprobs, token_nll
from dschat.models.attention import causal_only
from dschat.models.layers import accepts, unwrap
from dschat.utils import dist


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
    logits = model(input_ids=input_ids, attention_mask=causal_only(attention_mask), **extra).logits
    return logits[:, -k:], labels[:, -k:]


def packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    segments: torch.Tensor,
    position_ids: torch.Tensor,
    group: torch.Tensor,
    source: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(R, A)`` of ``tokens (R, A)`` from packed rows (:mod:`dschat.data.packing`: a prompt
    and its continuations, ``input_ids``, ``segments``, ``position_ids`` (G, L)): token ``[r, a]`` is
    predicted at position ``source[r, a]`` of packed row ``group[r]``; with ``entropy`` also the entropy
    there (no gradient). Both are meaningless where the caller's validity mask is False.

    The causal LM runs each prompt once for all its continuations, under the shared-prompt mask in the
    form its attention implementation takes, and its LM head only from the earliest predicting position
    on (``logits_to_keep``). ``model``: a causal LM, a peft wrapper or the DeepSpeed engine around one.
    """
    module = unwrap(model)
    dev = input_ids.device
    width = input_ids.shape[1]
    keep = width - int(source.min())
    mask = custom_mask(shared_prompt_mask(segments), getattr(module.config, "_attn_implementation", None),
                       next(module.parameters()).dtype)  # fmt: skip
    extra = {"logits_to_keep": keep} if accepts(model, "logits_to_keep") else {}
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, **extra).logits
    offset = width - logits.shape[1]
    return picked_token_logprobs(logits, group.to(dev), source.to(dev) - offset, tokens.to(dev), temperature,
                                 entropy=entropy)  # fmt: skip


def logprob_packing_tolerance(dtype: torch.dtype) -> float:
    """The largest mean |log-prob difference| per token between packed and separate rows that is rounding,
    not a packing fault. Measured on SmolLM2 in bf16 (8 sampled answers to 2 task prompts): rounding 0.03
    nats, an ignored mask 1.28, positions counted through the packed row 0.55; fp32 rounding ~1e-6."""
    return 1e-4 if dtype == torch.float32 else 0.15


def within_rounding(diff: float, dtype: torch.dtype) -> tuple[bool, float]:
    """Whether a log-prob difference measured on this rank (a shortcut such as packing against the plain
    pass) is rounding (:func:`logprob_packing_tolerance`) on every rank, and the largest difference. Each
    rank measures its own rows; deciding on the largest keeps or drops the shortcut on all ranks together
    (a rank computing otherwise than its peers would break "2 ranks == 1 rank"). Collective."""
    # NaN (nothing comparable, or a broken pass) fails, and must not be lost in the reduction
    worst = dist.all_reduce_max([diff if math.isfinite(diff) else math.inf])[0]
    return worst <= logprob_packing_tolerance(dtype), worst


# Architectures whose logits are exactly ``get_output_embeddings()(body(...).last_hidden_state)``: no
# soft-capping, logit scaling or bias (Gemma 2, Cohere, Granite and others scale their logits), so the
# fused loss below may stand in for the head.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2", "opt", "gpt_neox", "phi3"})


def plain_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``(hf_model, lm_head)`` of the causal LM inside ``model`` (a DeepSpeed engine, a peft wrapper or
    the model itself) when its logits are a plain linear head over the body's last hidden state and that
    head's weight is whole on this rank, in fp32 or bf16; ``None`` otherwise: another architecture, a
    LoRA-wrapped head, ZeRO-3 (which partitions the weight and gathers it only inside the head's own
    forward), or fp16 (whose loss scaling the head's gradients, formed in the forward, would escape)."""
    inner = unwrap(model)
    hf = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    if getattr(getattr(hf, "config", None), "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = hf.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or hasattr(head.weight, "ds_id"):
        return None
    if head.weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return hf, head


class _FusedLossHead(torch.nn.Module):
    """Stands in for the LM head inside the model's own forward: from the hidden states (B, T, H) it
    returns the summed next-token NLL of the target positions of ``labels`` (B, T) (a () tensor in
    place of the logits), through :func:`dschat.losses.linear_cross_entropy`."""

    def __init__(self, head: torch.nn.Linear, labels: torch.Tensor) -> None:
        super().__init__()
        object.__setattr__(self, "head", head)  # not a child: the module tree keeps its one head
        self.labels = labels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        targets = self.labels[:, 1:]
        keep = targets != IGNORE_INDEX  # (B, T-1)
        return linear_cross_entropy(hidden[:, :-1][keep], self.head.weight, targets[keep])


@contextlib.contextmanager
def fused_loss_head(hf: torch.nn.Module, head: torch.nn.Linear, labels: torch.Tensor) -> Iterator[None]:
    """Inside the block, ``hf``'s forward returns the summed NLL of ``labels`` as its ``logits``."""
    hf.set_output_embeddings(_FusedLossHead(head, labels))
    try:
        yield
    finally:
        hf.set_output_embeddings(head)


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """The target tokens of labels (B, T), each predicted from the position before it: a count ()."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def sft_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean next-token NLL over the target tokens (), their number ())`` of a batch (input_ids,
    attention_mask, labels: (B, T); position t predicts label t+1); ``attention_mask`` None: right
    padding, or none (:func:`dschat.models.attention.causal_only`, decided by the caller on the host).

    Where :func:`plain_head` finds the head, the model's forward (the DeepSpeed engine's, with its
    backward bookkeeping) runs with :class:`_FusedLossHead` in the head's place: the head sees only the
    target positions, through :func:`dschat.losses.linear_cross_entropy`, so neither padding nor prompt
    tokens pass it and no (B, T, V) logits are made. Elsewhere :func:`target_logits` (the same value)."""
    found = plain_head(model)
    if found is None:
        logits, kept = target_logits(model, input_ids, attention_mask, labels)
        return mean_token_nll(logits, kept)
    n = target_count(labels).float()
    with fused_loss_head(*found, labels):
        nll = model(input_ids=input_ids, attention_mask=causal_only(attention_mask), use_cache=False).logits
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
    padded to a multiple of ``world * batch_size`` with repeats whose weight is 0. No examples (on every
    rank: they are the same list everywhere), no batches.
    """
    world, r = dist.world_size(), dist.rank()
    n = len(examples)
    if n == 0:
        return []
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
