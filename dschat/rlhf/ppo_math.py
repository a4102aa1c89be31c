"""PPO maths for RLHF on token sequences. Pure torch: no deepspeed, tested on hand-computed tensors.

Conventions (T = prompt + response length, positions t = 0..T-2 are *actions*):
``logprobs[:, t]`` is log pi(token t+1 | tokens <= t); ``values[:, t]`` is the critic's value of the
state after token t; ``action_mask[:, t]`` is 1 where token t+1 is a response token (up to and
including the first EOS, never padding).

Masked positions may hold anything, including -inf or nan (a prompt token's log-prob under a policy
that has moved far, padding): every function here selects with ``torch.where`` before a value can
reach ``exp`` or a sum, because ``0 * inf`` is nan and would poison the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dschat.generation.stops import through_first_stop


def action_mask_from(sequences: torch.Tensor, prompt_len: int, stop_ids: Sequence[int]) -> torch.Tensor:
    """(B, T) prompt (left-padded to ``prompt_len``) + generated tokens -> action mask (B, T-1).

    A generated token counts until and including the first stop token (``stop_ids``: the EOS, and a chat
    template's end of turn where that differs); whatever generate wrote after it (padding, which may
    equal a stop id) does not. Before it every token was sampled, even one that happens to be the pad
    token. Prompt positions never count.
    """
    valid = through_first_stop(sequences[:, prompt_len:], stop_ids)
    mask = torch.zeros(
        sequences.shape[0], sequences.shape[1] - 1, dtype=torch.float32, device=sequences.device
    )
    mask[:, prompt_len - 1 :] = valid.float()
    return mask


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x * mask`` that stays finite where the mask is 0 whatever ``x`` holds there (same shape)."""
    return torch.where(mask != 0, x, torch.zeros_like(x)) * mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is nonzero (weighted by it); 0 over an empty mask."""
    if dim is None:
        return masked(x, mask).sum() / mask.sum().clamp_min(1.0)
    return masked(x, mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    all_reduce: Callable[[list[float]], list[float]] | None = None,
) -> torch.Tensor:
    """(x - mean) / std over the masked entries (mean kept if ``shift_mean`` is False); 0 outside.

    ``all_reduce`` sums a list of numbers over ranks (``dist.all_reduce_sum``): the mean and std are then
    those of every rank's entries together, so two ranks whiten as one rank holding all the rows would
    (OpenRLHF); without it, of these entries alone."""
    reduce = all_reduce or (lambda v: v)
    n, total = reduce([float(mask.sum()), float(masked(x, mask).double().sum())])
    mean = total / max(n, 1.0)
    (sq,) = reduce([float(masked((x - mean) ** 2, mask).double().sum())])
    var = sq / max(n, 1.0)
    out = (x - mean) / math.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return masked(out, mask)


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """(B, T-1) -> (B,) index of each row's last action (its final response token)."""
    t = action_mask.shape[1]
    positions = torch.arange(t, device=action_mask.device).expand_as(action_mask)
    return (positions * (action_mask > 0)).max(dim=1).values


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi: (B, T-1), 0 outside the mask.

    With ``d = log pi - log pi_ref`` (Schulman 2020, "Approximating KL divergence"): ``k1 = d`` (unbiased,
    negative on some tokens), ``k2 = d^2 / 2`` (biased, never negative; as a loss its gradient is that of
    the KL itself), ``k3 = exp(-d) - 1 + d`` (unbiased and never negative: GRPO's KL loss). ``d`` is
    clamped to +-20 inside ``exp`` only, so one runaway token cannot overflow the batch to inf.
    """
    d = masked(logprobs - ref_logprobs, action_mask)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return masked(0.5 * d * d, action_mask)
    if estimator == "k3":
        return masked(torch.exp(-d.clamp(-20.0, 20.0)) - 1.0 + d, action_mask)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def clip_scores(score: torch.Tensor, clip_reward_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) reward-model scores -> (the scores clamped to +-``clip_reward_value`` in fp32 (B,), which of
    them the clamp changed (B,) bool).

    A pairwise-trained reward model's offset is arbitrary (its loss sees only differences), so a fixed
    clip can flatten much of what it says: on the default job's reward model (2026-11-27) 63% of the
    step-1 model's sampled answers scored beyond +-5, right answers at +2 on average and wrong ones at
    -9. Step 3 logs the clipped share so that a clip which eats the signal shows on the curves.
    """
    s = score.float()
    return s.clamp(-clip_reward_value, clip_reward_value), s.abs() > clip_reward_value


def kl_shaped_rewards(
    terminal: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``-kl_coef * k(logp, ref_logp)`` plus the sequence's reward on its last action.

    terminal: (B,) the sequence-level reward as step 3 shaped it (the score clipped by :func:`clip_scores`,
    less any truncation penalty, or its group-relative form); the others (B, T-1); ``k`` is
    :func:`kl_estimate`'s ``estimator`` (k1 = ``logp - ref_logp``, DeepSpeed-Chat's). Returns (rewards
    (B, T-1), per-token KL estimate (B, T-1)), both zero outside the action mask.
    """
    kl = kl_estimate(logprobs, ref_logprobs, action_mask, estimator)
    rewards = -kl_coef * kl  # a new tensor: the in-place add below leaves the inputs alone
    last = last_action_index(action_mask)
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += terminal.float()
    return masked(rewards, action_mask), kl


def gae(
    rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action positions (B, T-1).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, where the value and
    advantage after a row's last action are 0 (the episode ends there). Returns (advantages, returns =
    advantages + values), both zero outside the mask.
    """
    values = masked(values, action_mask)
    rewards = masked(rewards, action_mask)
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    last_gae = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    for i in reversed(range(t)):
        m = action_mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        last_gae = delta + gamma * lam * last_gae
        last_gae = last_gae * m  # outside the response nothing flows
        adv[:, i] = last_gae
        next_value = torch.where(m > 0, values[:, i], next_value * 0)
    returns = masked(adv + values, action_mask)
    return masked(adv, action_mask), returns


def group_relative_scores(scores: torch.Tensor, group_size: int, method: str) -> torch.Tensor:
    """Scores of ``group_size`` responses per prompt, minus a per-prompt baseline: (B*K,) -> (B*K,).

    Rows are grouped consecutively (prompt 0's K responses, then prompt 1's ...). ``rloo``
    (REINFORCE leave-one-out, Ahmadian et al. 2024): ``s_i - mean_{j != i} s_j``. ``group_norm``
    (GRPO, Shao et al. 2024): ``(s_i - mean_j s_j) / (std_j s_j + 1e-6)`` with the unbiased std.
    ``dr_grpo`` (Dr. GRPO, Liu et al. 2025): ``s_i - mean_j s_j``, the group mean without the division
    by the std, which would weight prompts that are almost always solved (or failed) the most.
    A prompt whose responses all score alike gets zero: it carries no signal about which is better.
    """
    if group_size < 2:
        raise ValueError(f"a per-prompt baseline needs at least 2 responses per prompt, got {group_size}")
    if scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not split into groups of {group_size}")
    # In float64 a group of equal float32 scores has exactly its score as mean and 0 as std; in float32 the
    # mean's rounding left about 1e-7, which group_norm's division by a std of the same size turned into
    # advantages of up to 0.5 with one sign for the whole group.
    s = scores.double().view(-1, group_size)
    if method == "rloo":
        baseline = (s.sum(dim=1, keepdim=True) - s) / (group_size - 1)
        out = s - baseline
    elif method == "group_norm":
        out = (s - s.mean(dim=1, keepdim=True)) / (s.std(dim=1, keepdim=True) + 1e-6)
    elif method == "dr_grpo":
        out = s - s.mean(dim=1, keepdim=True)
    else:
        raise ValueError(f"unknown group baseline {method!r}; known: rloo, group_norm, dr_grpo")
    return out.view(-1).float()


def share_scores_of_identical_answers(
    scores: torch.Tensor, sequences: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(B*K,) scores of K answers per prompt (consecutive rows) and their (B*K, L) token ids -> (B*K,): the
    rows of a group whose token ids are equal all get their mean score.

    The reward is a function of the text, so equal answers have one score; a 16-bit reward model can still
    score them a rounding step apart (another row, another padding), and ``group_norm`` divides by the
    group's std, which turns that step into advantages of full size and random sign."""
    if group_size < 2:
        return scores
    s = scores.double().view(-1, group_size)
    ids = sequences.view(s.shape[0], group_size, -1)
    same = (ids[:, :, None, :] == ids[:, None, :, :]).all(-1).double()  # (B, K, K): row i equals row j
    # the same row of ``same`` for equal answers, so the same sum: their shared score is bit-identical
    return ((same @ s.unsqueeze(-1)).squeeze(-1) / same.sum(-1)).view(-1).to(scores.dtype)


def uniform_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B*K,) scores in consecutive groups of K -> (B*K,) bool: True for every row of a group whose
    scores are all equal (within 1e-6). DAPO (Yu et al. 2025) drops these groups: a group baseline gives
    them zero advantage, so they only dilute the loss's mean and cost an update's compute."""
    s = scores.float().view(-1, group_size)
    same = (s.max(dim=1).values - s.min(dim=1).values) <= 1e-6
    return same.repeat_interleave(group_size)


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over the actions of each row: (B, T-1) -> (B, T-1).

    The critic-free estimators use it as the advantage: with the score on the last action and the
    KL penalty on every action, ``G_t`` is the (baseline-subtracted) score plus the KL still to come.
    """
    rewards = masked(rewards, action_mask)
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for i in reversed(range(rewards.shape[1])):
        running = (rewards[:, i] + gamma * running) * action_mask[:, i]
        out[:, i] = running
    return out


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def aggregate(
    x: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    norm_len: int = 0,
    all_reduce: Callable[[list[float]], list[float]] | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (B, T-1) over the masked entries to a scalar.

    ``token_mean``: every token of the batch weighs the same (DAPO; long answers weigh more).
    ``seq_mean_token_mean``: mean over each sequence's tokens, then over the sequences (the original
    GRPO; a token of a short answer weighs more, which favours long wrong answers over short ones).
    ``seq_mean_token_sum_norm``: each sequence's token sum divided by the constant ``norm_len`` (the
    answer budget), then the mean over sequences (Dr. GRPO: no length bias either way).
    Rows without any action (masked out) count in none of them.

    ``all_reduce`` sums a list of numbers over ranks (``dist.all_reduce_sum``): the denominator (tokens or
    rows) is then every rank's together, and the result is this rank's share scaled by the rank count,
    so that the mean DeepSpeed takes of the ranks' gradients is the gradient of the whole batch's loss
    (2 ranks == 1 rank holding all rows, as veRL normalises; a per-rank mean weighs a token by how few
    others share its rank, and a rank whose rows all left the update would halve the step).
    """
    if mode == "token_mean":
        num, den = masked(x, mask).sum(), mask.sum()
    elif mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        rows = (mask.sum(dim=1) > 0).float()
        den = rows.sum()
        if mode == "seq_mean_token_mean":
            num = (masked_mean(x, mask, dim=1) * rows).sum()
        else:
            if norm_len < 1:
                raise ValueError(
                    f"seq_mean_token_sum_norm needs the answer budget norm_len >= 1, got {norm_len}"
                )
            num = masked(x, mask).sum() / norm_len
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(LOSS_AGGREGATIONS)}")
    if all_reduce is None:
        return num / den.clamp_min(1.0)
    total, ranks = all_reduce([float(den), 1.0])
    return num * ranks / max(total, 1.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cliprange: float,
    *,
    cliprange_high: float | None = None,
    agg: str = "token_mean",
    norm_len: int = 0,
    all_reduce: Callable[[list[float]], list[float]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate ``max(-A r, -A clip(r, 1-eps, 1+eps_high))`` over actions, reduced by
    :func:`aggregate` (``agg``, over ranks with ``all_reduce``); r = exp(logp - logp_old), ``eps_high`` =
    ``cliprange_high`` or ``cliprange``.

    A larger ``eps_high`` (DAPO's clip-higher) lets a token with a positive advantage and a low
    probability grow further before the clip stops it, which keeps entropy from collapsing.
    All inputs (B, T-1). The log-ratio is zeroed outside the mask *before* ``exp``: a masked slot with
    log-probs -120 (old) and -20 (new) would give r = inf and, times a zero mask, a nan loss (and a nan
    gradient through ``exp`` even if the product were selected away afterwards).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = masked(logprobs - old_logprobs, action_mask)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + high)
    loss = aggregate(torch.max(loss1, loss2), action_mask, agg, norm_len, all_reduce)
    with torch.no_grad():
        # token means over every rank's actions, as the loss (a rank whose rows all left the update logged
        # zeros that the mean over ranks then counted); this rank's share scaled by the rank count, as
        # :func:`aggregate`, so the mean of the ranks' values is the whole batch's
        scale = 1.0 / action_mask.sum().clamp_min(1.0)
        if all_reduce is not None:
            total, ranks = all_reduce([float(action_mask.sum()), 1.0])
            scale = ranks / max(total, 1.0)
        stats = {
            "clip_fraction": masked((loss2 > loss1).float(), action_mask).sum() * scale,
            # k3 estimator of KL(old || new): (r - 1) - log r, non-negative and low-variance
            "approx_kl": masked(ratio - 1.0 - log_ratio, action_mask).sum() * scale,
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    cliprange_value: float,
    all_reduce: Callable[[list[float]], list[float]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * mean(max((V - R)^2, (V_clip - R)^2))``, V_clip = V_old + clip(V - V_old):
    a mean over the actions of every rank with ``all_reduce`` (:func:`aggregate`'s ``token_mean``)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    l1 = (values - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * aggregate(torch.max(l1, l2), action_mask, "token_mean", all_reduce=all_reduce)
    with torch.no_grad():
        stats = {"value_clip_fraction": masked_mean((l2 > l1).float(), action_mask)}
    return loss, stats


def ppo_optimizer_steps(
    rounds: int,
    *,
    rows_per_round: int,
    generation_batches: int,
    micro_batch: int,
    ppo_epochs: int,
    freezing_actor_steps: int = 0,
) -> tuple[int, int]:
    """(actor, critic) optimizer steps of ``rounds`` generation rounds of step 3: the length of their
    learning-rate schedules.

    The loop it counts: after every ``generation_batches``-th round (G, 2G, ...; a last incomplete
    group is never trained on) come ``ppo_epochs`` passes over the ``G * rows_per_round`` rows
    collected, in minibatches of ``micro_batch`` (the last one may be short), one optimizer step each.
    The critic steps on every minibatch; the actor only after round ``freezing_actor_steps``.
    """
    per_update = ppo_epochs * math.ceil(generation_batches * rows_per_round / micro_batch)
    update_rounds = range(generation_batches, rounds + 1, generation_batches)
    actor_rounds = sum(1 for r in update_rounds if r > freezing_actor_steps)
    return actor_rounds * per_update, len(update_rounds) * per_update


class FixedKLController:
    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.value = d["value"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019): scale the coefficient by ``1 + clip(KL/target - 1, -0.2, 0.2) * n/horizon``.

    ``n`` rows past one horizon compound per horizon, ``(1 + err)^(n // horizon)`` times the linear step for
    the rest, as ``n/horizon`` rounds of one horizon each would: the linear step alone crosses zero once
    ``n > 5 * horizon`` (a negative coefficient rewards drifting from the reference)."""

    def __init__(self, kl_coef: float, target: float, horizon: int) -> None:
        super().__init__(kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = max(min(current_kl / self.target - 1.0, 0.2), -0.2)
        whole, rest = divmod(n_steps, self.horizon)
        self.value *= (1.0 + error) ** whole * (1.0 + error * rest / self.horizon)
