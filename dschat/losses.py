"""Language-modelling loss pieces (pure torch: no deepspeed, tested on exact tensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dschat.data.collate import IGNORE_INDEX


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token negative log-likelihood per sample.

    logits: (B, T, V), labels: (B, T) with ``IGNORE_INDEX`` where no loss is taken. Position t
    predicts label t+1. Returns ``(nll_sum (B,), n_tokens (B,))`` in float32, so callers can average
    per token over any set of samples (a micro-batch, all ranks, a whole eval set).
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE_INDEX
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.clamp_min(0).reshape(-1),
        reduction="none",
    ).view_as(shift_labels)
    nll = nll * mask
    return nll.sum(dim=1), mask.sum(dim=1).float()


def mean_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean NLL over the batch's target tokens, number of target tokens)."""
    nll, n = token_nll(logits, labels)
    total = n.sum()
    return nll.sum() / total.clamp_min(1.0), total


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, for left or right padding.

    attention_mask: (B, T) of 0/1. Uses the mask, never the pad token id, so models whose pad token
    equals their BOS or EOS token are scored at the right place. Rows without any real token give 0.
    """
    t = attention_mask.shape[1]
    positions = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    return (positions * (attention_mask > 0)).max(dim=1).values


def gather_last(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values: (B, T) per-token scores -> (B,) the score at each row's last real token."""
    idx = last_token_index(attention_mask)
    return values.gather(1, idx.unsqueeze(1)).squeeze(1)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Bradley-Terry ranking loss ``mean(-log sigmoid(r_chosen - r_rejected - margin))``; chosen, rejected: (B,)."""
    return -F.logsigmoid(chosen.float() - rejected.float() - margin).mean()
