"""Loss pieces: language modelling, reward ranking, DPO (pure torch: no deepspeed, tested on exact tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from dschat.data.collate import IGNORE_INDEX


def _tempered_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log-softmax of logits (B, T, V) at positions 0..T-2, divided by ``temperature`` first:
    (B, T-1, V). One fused log-softmax kernel over the whole tensor: faster on CPU than the same
    maths in chunks of separate passes (measured on the PPO benchmark)."""
    x = logits[:, :-1].float()
    if temperature != 1.0:
        x = x / temperature
    return F.log_softmax(x, dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits (B, T, V), tokens (B, T) -> ``(logp, entropy)``: the log-prob (B, T-1) of tokens[:, 1:]
    under softmax(logits[:, :-1] / temperature), in float32 and differentiable, and with ``entropy``
    that distribution's entropy (B, T-1) (a statistic: no gradient) from the same log-softmax.

    ``temperature`` is the sampling temperature: the rollouts were drawn from the tempered distribution,
    so the policy PPO evaluates (old, new and reference log-probs, the KL) must be that one too.
    """
    logp = _tempered_log_softmax(logits, temperature)
    picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked, None
    return picked, _entropy(logp)


def picked_token_logprobs(
    logits: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits (G, N, V) of packed rows -> ``(logp, entropy)`` (R, A): the log-prob of ``tokens[r, a]``
    under softmax(logits[rows[r], positions[r, a]] / temperature), float32 and differentiable, and with
    ``entropy`` that distribution's entropy (no gradient). ``rows`` (R,), ``positions`` and ``tokens``
    (R, A). Several rows may read one position (the K answers' first tokens, all predicted from their
    shared prompt's last token): the (R, A, V) distributions are never materialised."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    logp = F.log_softmax(x, dim=-1)  # (G, N, V)
    r = rows.unsqueeze(1).expand_as(positions)
    picked = logp[r, positions, tokens]
    return picked, (_entropy(logp)[r, positions] if entropy else None)


@torch.no_grad()
def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """(..., V) log-probs -> (...) entropy ``-sum p log p``, from log-probs clamped at -87 (exp(-87) is
    fp32's smallest normal number, about 1.6e-38). An entry below it, -inf included (a token the tempered
    policy cannot draw), adds less than 1e-35 instead of 0 * -inf = nan, and torch's CPU exp of such
    values takes a path about 10x slower (log-probs at a low sampling temperature are mostly far below
    it: 16 x 64 x 4096 at temperature 1e-4, 32 ms against 14). Three passes over the (..., V) tensor
    where masking the -inf entries took five: 177 ms against 255 on (16, 36, 49152) fp32, 2 cores."""
    lp = logp.detach().clamp_min(-87.0)
    return -(lp.exp() * lp).sum(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (B, T-1) of the tempered next-token distribution at positions 0..T-2 of logits (B, T, V)."""
    return _entropy(_tempered_log_softmax(logits, temperature))


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token negative log-likelihood per sample.

    logits: (B, T, V), labels: (B, T) with ``IGNORE_INDEX`` where no loss is taken. Position t
    predicts label t+1. Returns ``(nll_sum (B,), n_tokens (B,))`` in float32, so callers can average
    per token over any set of samples (a micro-batch, all ranks, a whole eval set).
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE_INDEX
    # ignore_index, not ``nll * mask``: a position without a target may hold a -inf logit (a banned
    # token), and 0 * inf is NaN in the loss and in its gradient
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view_as(shift_labels)
    return nll.sum(dim=1), mask.sum(dim=1).float()


class _LinearCrossEntropy(torch.autograd.Function):
    """``sum_n -log softmax(hidden_n @ weight.T)[labels_n]`` whose gradients are computed chunk by chunk
    during the forward, so the (N, V) logits never exist in full (see :func:`linear_cross_entropy`)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # a frozen head needs no grad_w
        ctx.weight_dtype = weight.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h, y = hidden[s : s + chunk], labels[s : s + chunk]
            logits = (h @ weight.t()).float()  # (c, V): the head in the model's dtype, softmax in fp32
            picked = logits.gather(1, y[:, None]).squeeze(1)  # (c,)
            top = logits.amax(dim=-1)  # (c,)
            # softmax in place of the logits (no second (c, V) buffer): exp(logits - top) / its sum
            z = logits.sub_(top[:, None]).exp_().sum(dim=-1)  # (c,)
            total += (top + z.log() - picked).sum()
            g = logits.div_(z[:, None])
            g[torch.arange(y.shape[0], device=y.device), y] -= 1.0  # d nll / d logits = softmax - one-hot
            g = g.to(hidden.dtype)  # what autograd would pass back through a (c, V) head output of this dtype
            if need_h:
                grad_h[s : s + chunk] = g @ weight
            if need_w:
                grad_w += g.t() @ h  # (V, H) accumulated in fp32 across chunks
        ctx.grads = (grad_h, grad_w)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        # () the loss's gradient (1 / tokens / accumulation): scaled in fp32, then rounded once
        scale = grad_out.float()
        return (None if grad_h is None else (grad_h.float() * scale).to(grad_h.dtype),
                None if grad_w is None else (grad_w * scale).to(ctx.weight_dtype), None, None)  # fmt: skip


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_elements: int = 1 << 23
) -> torch.Tensor:
    """Summed next-token NLL of an LM head without materialising its logits: ``hidden (N, H)`` of the
    target positions only, the head's ``weight (V, H)``, ``labels (N,)`` (no ignored entries). Returns
    ``sum_n -log softmax(hidden_n @ weight.T)[labels_n]`` in float32; the same value and gradients as
    ``F.cross_entropy(hidden @ weight.T, labels, reduction="sum")`` with the logits upcast to fp32.

    Rows go through in chunks of ``chunk_elements / V`` (32 MB of fp32 logits at a time), and each
    chunk's gradients are formed at once, so neither the (N, V) fp32 logits nor their gradient are
    kept for the backward (400 MB for a batch of 8 x 256 tokens at SmolLM2's 49152 words).
    """
    if hidden.shape[0] == 0:
        return (hidden.sum() * 0.0 + weight.sum() * 0.0).float()
    chunk = max(1, chunk_elements // weight.shape[0])
    if not torch.is_grad_enabled():  # evaluation: no gradients to form along the way
        hidden, weight = hidden.detach(), weight.detach()
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk)


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


def pairwise_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """Bradley-Terry ranking loss ``mean(-log sigmoid(r_chosen - r_rejected + offset - margin))``.

    chosen, rejected, offset: (B,). ``offset`` is a fixed expert's log-odds that the chosen answer wins
    (product of experts: the reward model is trained only on what that expert does not explain, and is
    used without it), e.g. :func:`length_expert_logits`.
    """
    diff = chosen.float() - rejected.float() - margin
    if offset is not None:
        diff = diff + offset.float()
    return -F.logsigmoid(diff).mean()


def length_log_ratio(response_len: torch.Tensor) -> torch.Tensor:
    """(2B,) response lengths in tokens, chosen rows first -> (B,) ``log len_chosen - log len_rejected``."""
    b = response_len.shape[0] // 2
    n = response_len.float().clamp_min(1.0)
    return n[:b].log() - n[b:].log()


def fit_length_expert(log_ratio: torch.Tensor, l2: float = 1e-4, iters: int = 50) -> float:
    """The length-only expert: ``w`` maximising ``sum log sigmoid(w x) - l2 w^2 / 2`` over the training
    pairs' ``x = log len_chosen - log len_rejected`` (N,), that is ``P(chosen wins) = sigmoid(w x)``.

    Newton's method on a strictly concave one-dimensional objective (the small ``l2`` keeps ``w`` finite
    when every chosen answer is the longer one). ``w > 0``: the annotators preferred longer answers.
    """
    x = log_ratio.double()
    w = torch.zeros((), dtype=torch.float64)
    for _ in range(iters):
        p = torch.sigmoid(w * x)
        grad = (x * (1 - p)).sum() - l2 * w
        hess = -(x * x * p * (1 - p)).sum() - l2
        step = grad / hess
        w = w - step
        if step.abs() < 1e-10:
            break
    return float(w)


def length_expert_logits(w: float, response_len: torch.Tensor) -> torch.Tensor:
    """(2B,) response lengths -> (B,) the length expert's log-odds ``w x`` that the chosen answer wins."""
    return w * length_log_ratio(response_len)


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


DPO_LOSSES = ("sigmoid", "ipo")


@dataclass
class DPOLoss:
    loss: torch.Tensor  # () mean over pairs
    losses: torch.Tensor  # (B,) per pair
    # (B,) implicit reward beta * (log pi - log ref) of the chosen answer (IPO: per token)
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor  # (B,) the same of the rejected answer


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> DPOLoss:
    """Direct preference optimisation on sequence log-probs (B,) of the responses under the policy and
    the frozen reference.

    With ``h = (log pi_c - log ref_c) - (log pi_r - log ref_r)``:
    ``sigmoid`` (DPO): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, where ``eps =
    label_smoothing`` > 0 is conservative DPO (a share of the labels assumed flipped);
    ``ipo``: ``(h - 1 / (2 beta))^2`` on log-probs averaged over each response's tokens
    (``chosen_tokens``, ``rejected_tokens`` (B,)), which bounds the margin instead of pushing it to
    infinity. Implicit rewards are ``beta * (log pi - log ref)`` of the whole response (``sigmoid``) or
    per token (``ipo``, as its loss compares them), so that they rank a pair as the loss does.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type {loss_type!r}: one of {DPO_LOSSES}")
    pc, pr, rc, rr = (x.float() for x in (policy_chosen, policy_rejected, ref_chosen, ref_rejected))
    chosen_rewards = beta * (pc - rc).detach()
    rejected_rewards = beta * (pr - rr).detach()
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("ipo averages log-probs over tokens: give chosen_tokens and rejected_tokens")
        nc, nr = chosen_tokens.float().clamp_min(1), rejected_tokens.float().clamp_min(1)
        h = (pc - rc) / nc - (pr - rr) / nr
        loss = (h - 1 / (2 * beta)) ** 2
        chosen_rewards, rejected_rewards = chosen_rewards / nc, rejected_rewards / nr
    else:
        h = (pc - rc) - (pr - rr)
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return DPOLoss(loss.mean(), loss.detach(), chosen_rewards, rejected_rewards)
