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


def divergence_pairwise_loss(
    values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, margin: float = 0.0
) -> torch.Tensor:
    """Ranking loss over every position from where the two answers part to the end of the longer one
    (DeepSpeed-Chat's reward loss): more signal per pair than the last token alone, and the head learns
    a running score (what PPO's critic starts from).

    values, input_ids, attention_mask: (2B, T), rows 0..B-1 chosen and B..2B-1 rejected, right-padded.
    At position t a sequence that has already ended contributes its final score (value at its last
    real token), so the last positions compare the two final scores. Returns the mean over pairs of
    ``mean_t -log sigmoid(v_chosen(t) - v_rejected(t) - margin)`` in float32.
    """
    b = values.shape[0] // 2
    t = values.shape[1]
    vc, vr = values[:b].float(), values[b:].float()
    lc, lr = attention_mask[:b].sum(1), attention_mask[b:].sum(1)  # (B,)
    pos = torch.arange(t, device=values.device).expand(b, t)
    shared = pos < torch.minimum(lc, lr).unsqueeze(1)
    differ = (input_ids[:b] != input_ids[b:]) & shared
    # First differing position; where one answer extends the other, where the shorter one ends.
    start = torch.where(differ.any(1), differ.long().argmax(1), torch.minimum(lc, lr))
    end = torch.maximum(lc, lr)
    start = torch.minimum(start, end - 1)
    gc = vc.gather(1, torch.minimum(pos, (lc - 1).unsqueeze(1)))
    gr = vr.gather(1, torch.minimum(pos, (lr - 1).unsqueeze(1)))
    span = (pos >= start.unsqueeze(1)) & (pos < end.unsqueeze(1))
    per_token = -F.logsigmoid(gc - gr - margin) * span
    return (per_token.sum(1) / span.sum(1)).mean()
