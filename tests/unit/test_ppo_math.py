"""dschat.rlhf.ppo_math: PPO maths on tiny tensors with hand-computed expected values."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dschat.generation.stops import truncated_rows
from dschat.losses import token_entropy, token_logprobs
from dschat.rlhf.ppo_math import (
    AdaptiveKLController,
    FixedKLController,
    action_mask_from,
    aggregate,
    clip_scores,
    discounted_returns,
    gae,
    group_relative_scores,
    kl_estimate,
    kl_shaped_rewards,
    last_action_index,
    masked_mean,
    masked_whiten,
    policy_loss,
    ppo_optimizer_steps,
    share_scores_of_identical_answers,
    uniform_groups,
    value_loss,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def close(x, values, atol=1e-6):
    return torch.allclose(x.float(), t(values), atol=atol, rtol=0)


# ---------------------------------------------------------------- log-probs and entropy


def tiny_logits():
    # B=1, T=3, V=3.
    # position 0: [0, ln2, ln3] -> probs [1, 2, 3] / 6 -> log-probs [-ln6, -ln3, -ln2]
    # position 1: [0, 0, 0]     -> uniform, log-probs all -ln3
    # position 2: never used (it would predict a token after the sequence)
    return t([[[0.0, LN2, LN3], [0.0, 0.0, 0.0], [100.0, 0.0, -100.0]]])


def test_token_logprobs_hand_values():
    # tokens[1] = 2 under position 0: ln(3/6) = -ln2; tokens[2] = 0 under position 1: -ln3
    lp = token_logprobs(tiny_logits(), torch.tensor([[1, 2, 0]]))[0]
    assert lp.shape == (1, 2)
    assert lp.dtype == torch.float32
    assert close(lp, [[-LN2, -LN3]])


def test_token_logprobs_other_tokens_and_first_token_is_ignored():
    # tokens[1] = 0 under position 0: -ln6; tokens[2] = 1 under position 1: -ln3; tokens[0] is no target
    for first in (0, 1, 2):
        lp = token_logprobs(tiny_logits(), torch.tensor([[first, 0, 1]]))[0]
        assert close(lp, [[-math.log(6.0), -LN3]])


def test_token_logprobs_ignores_the_last_position():
    logits = tiny_logits()
    logits[0, 2] = t([-5.0, 7.0, 1.0])
    assert close(token_logprobs(logits, torch.tensor([[1, 2, 0]]))[0], [[-LN2, -LN3]])


def test_token_logprobs_bf16_logits_are_upcast():
    lp = token_logprobs(tiny_logits().bfloat16(), torch.tensor([[1, 2, 0]]))[0]
    assert lp.dtype == torch.float32
    assert close(lp, [[-LN2, -LN3]], atol=2e-2)


def test_token_entropy_hand_values():
    # position 0: H = -(1/6 ln 1/6 + 2/6 ln 2/6 + 3/6 ln 3/6) = ln6/6 + ln3/3 + ln2/2
    # position 1: uniform over 3 -> ln3
    h = token_entropy(tiny_logits())
    assert h.shape == (1, 2)
    assert close(h, [[math.log(6.0) / 6 + LN3 / 3 + LN2 / 2, LN3]])


def test_logprobs_and_entropy_at_temperature_one_half():
    # logits / 0.5 at position 0: [0, 2 ln2, 2 ln3] -> probs [1, 4, 9] / 14; position 1 stays uniform
    tokens = torch.tensor([[1, 2, 0]])
    lp = token_logprobs(tiny_logits(), tokens, temperature=0.5)[0]
    assert close(lp, [[math.log(9 / 14), -LN3]])
    p = t([1.0, 4.0, 9.0]) / 14
    h = token_entropy(tiny_logits(), temperature=0.5)
    assert close(h, [[float(-(p * p.log()).sum()), LN3]])
    # the default temperature is 1 (the raw logits)
    assert torch.equal(
        token_logprobs(tiny_logits(), tokens, temperature=1.0)[0], token_logprobs(tiny_logits(), tokens)[0]
    )


# ---------------------------------------------------------------- action mask

EOS, PAD = 2, 0


def test_action_mask_eos_in_the_middle():
    # prompt_len 3 (left-padded), response [7, EOS, PAD, PAD]. Mask has T-1 = 6 entries; entry t is
    # token t+1: entries 0, 1 are prompt tokens 1, 2 -> 0; entries 2..5 are response tokens 7, EOS, PAD, PAD
    seq = torch.tensor([[PAD, 5, 6, 7, EOS, PAD, PAD]])
    mask = action_mask_from(seq, prompt_len=3, stop_ids=[EOS])
    assert mask.shape == (1, 6)
    assert mask.dtype == torch.float32
    assert torch.equal(mask, t([[0, 0, 1, 1, 0, 0]]))


def test_action_mask_batch_of_cases():
    seq = torch.tensor(
        [
            [PAD, 5, 6, 7, EOS, PAD, PAD],  # EOS second: [1, 1, 0, 0]
            [5, 6, 7, 8, 9, 10, 11],  # no EOS: all response tokens count
            [PAD, PAD, 5, EOS, PAD, PAD, PAD],  # immediate EOS: exactly one 1
            [5, 6, 7, 7, EOS, 9, EOS],  # junk after the first EOS does not count
            [5, 6, 7, 8, 9, 10, EOS],  # EOS as the very last token counts
        ]
    )
    mask = action_mask_from(seq, prompt_len=3, stop_ids=[EOS])
    expected = t(
        [
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 1],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)
    assert mask[2].sum() == 1


def test_action_mask_pad_equals_eos():
    # pad_id == eos_id == 2: the first 2 in the response is the EOS (counts), later 2s are padding
    seq = torch.tensor(
        [
            [2, 5, 6, 7, 8, 2, 2],  # [1, 1, 1, 0]
            [2, 2, 5, 2, 2, 2, 2],  # immediate EOS: [1, 0, 0, 0]
            [5, 6, 7, 8, 9, 10, 11],  # no EOS: [1, 1, 1, 1]
        ]
    )
    mask = action_mask_from(seq, prompt_len=3, stop_ids=[2])
    assert torch.equal(mask, t([[0, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]]))


def test_action_mask_and_truncation_end_at_whichever_stop_token_comes_first():
    # a chat template's end of turn (END) beside the EOS: either ends the answer
    END = 9
    seq = torch.tensor(
        [
            [5, 6, 7, 8, END, EOS, PAD],  # END first: [1, 1, 0, 0]
            [5, 6, 7, EOS, END, PAD, PAD],  # EOS first: [1, 0, 0, 0]
            [5, 6, 7, 8, 8, 8, 8],  # neither: all count, truncated
            [5, 6, 7, 8, 8, 8, END],  # END as the last token: all count, not truncated
        ]
    )
    mask = action_mask_from(seq, prompt_len=3, stop_ids=[END, EOS])
    assert torch.equal(
        mask, t([[0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    )
    assert truncated_rows(seq, prompt_len=3, stop_ids=[END, EOS]).tolist() == [False, False, True, False]
    # with the EOS alone, END is an ordinary token and the first row runs on to its EOS
    assert action_mask_from(seq, prompt_len=3, stop_ids=[EOS])[0].tolist() == [0, 0, 1, 1, 1, 0]


def test_action_mask_prompt_tokens_never_count():
    # prompt tokens equal to EOS/PAD or not: the prompt block never enters the mask
    seq = torch.tensor([[EOS, PAD, EOS, 7, 8]])
    mask = action_mask_from(seq, prompt_len=3, stop_ids=[EOS])
    assert torch.equal(mask, t([[0, 0, 1, 1]]))


def test_action_mask_sampled_pad_token_before_eos_counts():
    # The docstring: "A generated token counts until and including the first EOS". generate writes
    # padding only after a row's EOS, so a PAD id before the first EOS was sampled by the policy (the
    # builtin tokenizer's <pad> = 0 is an ordinary logit). Response [7, PAD, 8, EOS] -> [1, 1, 1, 1].
    seq = torch.tensor([[5, 6, 7, 7, PAD, 8, EOS]])
    mask = action_mask_from(seq, prompt_len=3, stop_ids=[EOS])
    assert torch.equal(mask, t([[0, 0, 1, 1, 1, 1]]))


def test_last_action_index():
    mask = t([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]])
    assert last_action_index(mask).tolist() == [3, 5, 2]


# ---------------------------------------------------------------- KL-shaped rewards


def test_kl_shaped_rewards_hand_values():
    mask = t([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    # row 0: kl = logp - ref on the mask = [0, 0.5, -1.0, 0, 0]; -0.1 * kl = [0, -0.05, 0.1, 0, 0];
    #        the sequence's reward 5 added at the last action (index 3)
    # row 1: kl = [0, -1.0, -2.0, 0, 0]; -0.1 * kl = [0, 0.1, 0.2, 0, 0]; reward -5 at index 2
    # row 2: logp == ref -> kl 0; reward 3 at index 4
    logp = t([[9.0, -1.0, -2.0, -0.5, 9.0], [3.0, -2.0, -3.0, 4.0, 4.0], [1.0, 1.0, -1.0, -1.0, -1.0]])
    ref = t([[-9.0, -1.5, -1.0, -0.5, -9.0], [1.0, -1.0, -1.0, 0.0, 0.0], [5.0, 5.0, -1.0, -1.0, -1.0]])
    rewards, kl = kl_shaped_rewards(t([5.0, -5.0, 3.0]), logp, ref, mask, kl_coef=0.1)
    assert close(
        rewards,
        [[0, -0.05, 0.1, 5.0, 0], [0, 0.1, 0.2 - 5.0, 0, 0], [0, 0, 0, 0, 3.0]],
    )
    assert close(kl, [[0, 0.5, -1.0, 0, 0], [0, -1.0, -2.0, 0, 0], [0, 0, 0, 0, 0]])
    assert torch.all(rewards[mask == 0] == 0)
    assert torch.all(kl[mask == 0] == 0)


def test_kl_shaped_rewards_does_not_modify_inputs():
    logp, ref = t([[0.0, -1.0, -2.0]]), t([[0.0, -1.5, -1.0]])
    mask = t([[0, 1, 1]])
    before = logp.clone(), ref.clone(), mask.clone()
    kl_shaped_rewards(t([1.0]), logp, ref, mask, 0.1)
    assert torch.equal(logp, before[0]) and torch.equal(ref, before[1]) and torch.equal(mask, before[2])


# ---------------------------------------------------------------- GAE


def gae_row():
    # one prompt position (masked, with junk reward/value), then 3 actions
    rewards = t([[7.0, 0.5, -1.0, 2.0]])
    values = t([[100.0, 1.0, 2.0, 3.0]])
    mask = t([[0, 1, 1, 1]])
    return rewards, values, mask


def test_gae_gamma1_lam095():
    # gamma = 1, lam = 0.95, V after the last action = 0:
    # t=3: delta = 2 + 0 - 3 = -1;            A3 = -1
    # t=2: delta = -1 + 3 - 2 = 0;            A2 = 0 + 0.95 * -1 = -0.95
    # t=1: delta = 0.5 + 2 - 1 = 1.5;         A1 = 1.5 + 0.95 * -0.95 = 1.5 - 0.9025 = 0.5975
    # returns = A + V = [0, 1.5975, 1.05, 2.0]
    adv, ret = gae(*gae_row(), gamma=1.0, lam=0.95)
    assert close(adv, [[0.0, 0.5975, -0.95, -1.0]])
    assert close(ret, [[0.0, 1.5975, 1.05, 2.0]])


def test_gae_gamma09_lam1_is_discounted_return_minus_value():
    # gamma = 0.9, lam = 1:
    # t=3: delta = 2 + 0 - 3 = -1;                A3 = -1
    # t=2: delta = -1 + 0.9*3 - 2 = -0.3;         A2 = -0.3 + 0.9 * -1 = -1.2
    # t=1: delta = 0.5 + 0.9*2 - 1 = 1.3;         A1 = 1.3 + 0.9 * -1.2 = 0.22
    # (check: discounted returns R3 = 2, R2 = -1 + 0.9*2 = 0.8, R1 = 0.5 + 0.9*0.8 = 1.22; A = R - V)
    adv, ret = gae(*gae_row(), gamma=0.9, lam=1.0)
    assert close(adv, [[0.0, 0.22, -1.2, -1.0]])
    assert close(ret, [[0.0, 1.22, 0.8, 2.0]])


def test_gae_padding_after_the_last_action_changes_nothing():
    rewards, values, mask = gae_row()
    # same row with two padding positions (junk rewards and values) after the last action
    rewards_p = torch.cat([rewards, t([[9.0, -9.0]])], dim=1)
    values_p = torch.cat([values, t([[50.0, 60.0]])], dim=1)
    mask_p = torch.cat([mask, t([[0, 0]])], dim=1)
    for gamma, lam in ((1.0, 0.95), (0.9, 1.0), (0.5, 0.5)):
        adv, ret = gae(rewards, values, mask, gamma, lam)
        adv_p, ret_p = gae(rewards_p, values_p, mask_p, gamma, lam)
        assert torch.allclose(adv_p[:, :4], adv, atol=1e-6)
        assert torch.allclose(ret_p[:, :4], ret, atol=1e-6)
        assert torch.all(adv_p[:, 4:] == 0) and torch.all(ret_p[:, 4:] == 0)


# ---------------------------------------------------------------- critic-free estimators (rloo, group_norm)


def test_rloo_hand_values():
    # two prompts x 3 responses; baseline of each = mean of the other two in its group
    # group 1: [1, -1, 1] -> 1 - 0 = 1, -1 - 1 = -2, 1 - 0 = 1
    # group 2: [2, 4, 0]  -> 2 - 2 = 0, 4 - 1 = 3, 0 - 3 = -3
    out = group_relative_scores(t([1.0, -1.0, 1.0, 2.0, 4.0, 0.0]), 3, "rloo")
    assert close(out, [1.0, -2.0, 1.0, 0.0, 3.0, -3.0])


def test_group_norm_hand_values():
    # group [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]; group [5, 5, 5]: all alike -> 0
    # group [0, 4]: mean 2, unbiased std sqrt(8) -> [-2, 2] / sqrt(8)
    out = group_relative_scores(t([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3, "group_norm")
    assert close(out, [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0], atol=1e-5)
    out = group_relative_scores(t([0.0, 4.0]), 2, "group_norm")
    assert close(out, [-2 / math.sqrt(8), 2 / math.sqrt(8)], atol=1e-5)


def test_identical_answers_share_their_mean_score_within_their_own_group_only():
    # group 0: answers A, B, A scored 1, 5, 2 -> the two A's get (1 + 2) / 2 = 1.5, B keeps 5
    # group 1: answer A again (another prompt's group: not pooled with group 0) and C: scores kept
    ids = torch.tensor([[7, 1, 2], [7, 3, 4], [7, 1, 2], [8, 1, 2], [8, 5, 6], [9, 9, 9]])
    out = share_scores_of_identical_answers(t([1.0, 5.0, 2.0, 4.0, 0.5, 3.0]), ids, 3)
    assert out.tolist() == [1.5, 5.0, 1.5, 4.0, 0.5, 3.0]
    # one answer per prompt (GAE without groups): nothing to share
    assert share_scores_of_identical_answers(t([1.0, 2.0]), ids[:2], 1).tolist() == [1.0, 2.0]
    # three equal answers: one bit-identical score, so the group is uniform and group_norm gives 0
    three = share_scores_of_identical_answers(t([0.1, 0.3, 0.7]), torch.tensor([[1, 2]] * 3), 3)
    assert three[0] == three[1] == three[2] and abs(float(three[0]) - 1.1 / 3) < 1e-6
    assert group_relative_scores(three, 3, "group_norm").abs().max() == 0.0


def test_group_baselines_reject_bad_groups():
    with pytest.raises(ValueError, match="at least 2"):
        group_relative_scores(t([1.0, 2.0]), 1, "rloo")
    with pytest.raises(ValueError, match="groups of 2"):
        group_relative_scores(t([1.0, 2.0, 3.0]), 2, "rloo")
    with pytest.raises(ValueError, match="unknown"):
        group_relative_scores(t([1.0, 2.0]), 2, "mean")


def test_discounted_returns_hand_values():
    # one row, actions at positions 1..3 (position 0 is the prompt, position 4 padding)
    # gamma 1:   G3 = 2, G2 = -1 + 2 = 1, G1 = 0.5 + 1 = 1.5
    # gamma 0.5: G3 = 2, G2 = -1 + 1 = 0,  G1 = 0.5 + 0 = 0.5
    rewards = t([[7.0, 0.5, -1.0, 2.0, 9.0]])
    mask = t([[0.0, 1.0, 1.0, 1.0, 0.0]])
    assert close(discounted_returns(rewards, mask, 1.0), [[0.0, 1.5, 1.0, 2.0, 0.0]])
    assert close(discounted_returns(rewards, mask, 0.5), [[0.0, 0.5, 0.0, 2.0, 0.0]])


def test_gae_rows_are_independent_and_masked_positions_are_zero():
    rewards, values, mask = gae_row()
    # row 1: a single action at index 2 (reward 4, value 1): A = 4 - 1 = 3, return 4
    rewards2 = torch.cat([rewards, t([[5.0, 5.0, 4.0, 5.0]])])
    values2 = torch.cat([values, t([[5.0, 5.0, 1.0, 5.0]])])
    mask2 = torch.cat([mask, t([[0, 0, 1, 0]])])
    adv, ret = gae(rewards2, values2, mask2, gamma=1.0, lam=0.95)
    assert close(adv, [[0.0, 0.5975, -0.95, -1.0], [0, 0, 3.0, 0]])
    assert close(ret, [[0.0, 1.5975, 1.05, 2.0], [0, 0, 4.0, 0]])
    assert torch.all(adv[mask2 == 0] == 0) and torch.all(ret[mask2 == 0] == 0)


# ---------------------------------------------------------------- policy loss


def policy_case():
    # cliprange 0.2; r = exp(logp - old); the last position is masked out (huge A and r)
    #   a) A=+1, r=1.5: -A r = -1.5, -A clip(r) = -1.2 -> max -1.2 (clipped)
    #   b) A=+1, r=0.5: -0.5 vs -0.8                  -> -0.5 (not clipped)
    #   c) A=-2, r=1.5:  3.0 vs  2.4                  ->  3.0 (not clipped)
    #   d) A=-2, r=0.5:  1.0 vs  1.6                  ->  1.6 (clipped)
    #   e) A=+3, r=1.1: -3.3 vs -3.3 (inside)          -> -3.3 (not clipped)
    ratios = [1.5, 0.5, 1.5, 0.5, 1.1, 5.0]
    old = t([[-1.0, -2.0, -0.5, -3.0, -1.5, -0.1]])
    logp = old + torch.log(t([ratios]))
    adv = t([[1.0, 1.0, -2.0, -2.0, 3.0, 100.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    return logp, old, adv, mask


def test_policy_loss_hand_values():
    logp, old, adv, mask = policy_case()
    loss, stats = policy_loss(logp, old, adv, mask, cliprange=0.2)
    # (-1.2 - 0.5 + 3.0 + 1.6 - 3.3) / 5 = -0.4 / 5 = -0.08
    assert math.isclose(float(loss), -0.08, abs_tol=1e-6)
    # clipped: a and d -> 2/5
    assert math.isclose(float(stats["clip_fraction"]), 0.4, abs_tol=1e-6)
    # k3 = r - 1 - ln r: 2(0.5 - ln1.5) + 2(-0.5 + ln2) + (0.1 - ln1.1) = 2 ln(4/3) + 0.1 - ln1.1
    k3 = (2 * math.log(4 / 3) + 0.1 - math.log(1.1)) / 5
    assert math.isclose(float(stats["approx_kl"]), k3, abs_tol=1e-6)


def test_policy_loss_gradient_is_zero_where_clipped_and_masked():
    logp, old, adv, mask = policy_case()
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, cliprange=0.2)
    loss.backward()
    # d(-A r)/d logp = -A r, over 5 masked entries: b) -0.5/5 = -0.1, c) 3/5 = 0.6, e) -3.3/5 = -0.66;
    # a) and d) are clipped (constant), the masked position gets nothing
    assert close(logp.grad, [[0.0, -0.1, 0.6, 0.0, -0.66, 0.0]], atol=1e-5)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    # r = 1 everywhere: loss = -mean(A) over the mask = -(1 + 2 - 6)/3 = 1; no clipping, k3 = 0
    old = t([[-1.0, -2.0, -3.0, -4.0]])
    adv = t([[1.0, 2.0, -6.0, 50.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = policy_loss(old.clone(), old, adv, mask, cliprange=0.2)
    assert math.isclose(float(loss), 1.0, abs_tol=1e-6)
    assert float(stats["clip_fraction"]) == 0.0
    assert float(stats["approx_kl"]) == 0.0


def test_policy_loss_ignores_extreme_log_probs_at_masked_slots():
    # policy_case's masked slot (index 5) now holds old -120, new -20: r = e^100 overflows fp32 to inf,
    # and inf * 0 would make the loss, approx-KL and gradient nan. Masked before exp: nothing changes.
    logp, old, adv, mask = policy_case()
    logp_x, old_x = logp.clone(), old.clone()
    logp_x[0, 5], old_x[0, 5] = -20.0, -120.0
    logp_x.requires_grad_(True)
    loss, stats = policy_loss(logp_x, old_x, adv, mask, cliprange=0.2)
    assert math.isclose(float(loss.detach()), -0.08, abs_tol=1e-6)  # test_policy_loss_hand_values
    assert math.isclose(float(stats["clip_fraction"]), 0.4, abs_tol=1e-6)
    assert math.isclose(
        float(stats["approx_kl"]), (2 * math.log(4 / 3) + 0.1 - math.log(1.1)) / 5, abs_tol=1e-6
    )
    loss.backward()
    assert close(logp_x.grad, [[0.0, -0.1, 0.6, 0.0, -0.66, 0.0]], atol=1e-5)


def test_masked_slots_holding_inf_or_nan_change_no_reward_advantage_or_loss():
    # A masked slot may hold -inf (a log-prob under a policy that has moved far) or nan: the rewards,
    # GAE, reward-to-go, whitening and value loss must equal those of the same row with a harmless value.
    mask = t([[0, 1, 1, 1, 0]])
    logp, ref = t([[0.0, -1.0, -2.0, -0.5, 0.0]]), t([[0.0, -1.5, -1.0, -0.5, 0.0]])
    values, returns = t([[0.0, 1.0, 2.0, 3.0, 0.0]]), t([[0.0, 1.5, 1.0, 2.0, 0.0]])
    for junk in (float("-inf"), float("inf"), float("nan")):
        bad = {k: v.clone() for k, v in dict(logp=logp, ref=ref, values=values, returns=returns).items()}
        for v in bad.values():
            v[0, 0] = v[0, 4] = junk
        rewards, kl = kl_shaped_rewards(t([1.0]), logp, ref, mask, 0.1)
        rewards_x, kl_x = kl_shaped_rewards(t([1.0]), bad["logp"], bad["ref"], mask, 0.1)
        assert torch.equal(rewards_x, rewards) and torch.equal(kl_x, kl), junk
        rewards_junk = rewards.clone()
        rewards_junk[0, 0] = rewards_junk[0, 4] = junk
        adv, ret = gae(rewards, values, mask, 1.0, 0.95)
        adv_x, ret_x = gae(rewards_junk, bad["values"], mask, 1.0, 0.95)
        assert torch.equal(adv_x, adv) and torch.equal(ret_x, ret), junk
        assert torch.equal(
            discounted_returns(rewards_junk, mask, 0.9), discounted_returns(rewards, mask, 0.9)
        )
        assert torch.equal(masked_whiten(bad["values"], mask), masked_whiten(values, mask)), junk
        assert float(masked_mean(bad["values"], mask)) == 2.0
        loss, _ = value_loss(bad["values"], values, bad["returns"], mask, 0.2)
        assert float(loss) == float(value_loss(values, values, returns, mask, 0.2)[0]), junk


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_values():
    # cliprange_value 0.2; V_clip = V_old + clip(V - V_old, -0.2, 0.2)
    #   a) old 1, new 1.5, R 2: V_clip 1.2; (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64 -> 0.64 (clip counts)
    #   b) old 1, new 1.5, R 0: V_clip 1.2; 2.25 vs 1.44                        -> 2.25
    #   c) old 1, new 1.1, R 3: inside the clip; (1.1-3)^2 = 3.61 both          -> 3.61
    #   d) masked: old 0, new 10, R -10
    # loss = 0.5 * (0.64 + 2.25 + 3.61) / 3 = 0.5 * 6.5 / 3 = 1.0833...
    old = t([[1.0, 1.0, 1.0, 0.0]])
    new = t([[1.5, 1.5, 1.1, 10.0]])
    ret = t([[2.0, 0.0, 3.0, -10.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = value_loss(new, old, ret, mask, cliprange_value=0.2)
    assert math.isclose(float(loss), 0.5 * 6.5 / 3, abs_tol=1e-5)
    assert math.isclose(float(stats["value_clip_fraction"]), 1 / 3, abs_tol=1e-6)


def test_value_loss_unclipped_is_half_mse():
    # V = V_old: no clipping, loss = 0.5 * mean((V - R)^2) = 0.5 * (1 + 4) / 2 = 1.25
    v = t([[0.0, 1.0, 2.0]])
    ret = t([[1.0, 3.0, 7.0]])
    mask = t([[1, 1, 0]])
    loss, stats = value_loss(v, v.clone(), ret, mask, cliprange_value=0.2)
    assert math.isclose(float(loss), 1.25, abs_tol=1e-6)
    assert float(stats["value_clip_fraction"]) == 0.0


# ---------------------------------------------------------------- masked mean / whiten


def test_masked_mean():
    x = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = t([[1, 0, 1, 0], [0, 0, 0, 0]])
    # all: (1 + 3) / 2 = 2
    assert float(masked_mean(x, mask)) == 2.0
    # per row: row 0 -> 2, row 1 has no entries -> 0 (denominator clamped to 1)
    assert torch.equal(masked_mean(x, mask, dim=1), t([2.0, 0.0]))
    # empty mask overall -> 0, not nan
    assert float(masked_mean(x, torch.zeros_like(mask))) == 0.0


def test_masked_whiten_hand_values():
    # masked entries [1, 2, 3, 6]: mean 3, variance (4 + 1 + 0 + 9) / 4 = 3.5
    x = t([[1.0, 2.0, 3.0, 100.0, 6.0]])
    mask = t([[1, 1, 1, 0, 1]])
    s = math.sqrt(3.5)
    out = masked_whiten(x, mask)
    assert close(out, [[-2 / s, -1 / s, 0.0, 0.0, 3 / s]])
    assert abs(float(masked_mean(out, mask))) < 1e-6
    assert math.isclose(float(masked_mean(out**2, mask)), 1.0, abs_tol=1e-6)
    assert float(out[0, 3]) == 0.0


def test_masked_whiten_keep_mean():
    x = t([[1.0, 2.0, 3.0, 100.0, 6.0]])
    mask = t([[1, 1, 1, 0, 1]])
    s = math.sqrt(3.5)
    out = masked_whiten(x, mask, shift_mean=False)
    # (x - 3) / s + 3 on the mask, 0 outside
    assert close(out, [[3 - 2 / s, 3 - 1 / s, 3.0, 0.0, 3 + 3 / s]])


# ---------------------------------------------------------------- optimizer steps (schedule length)


def simulate_step3(rounds, gen_bs, n, g, mb, epochs, freezing, scheduler_type="linear"):
    """Drive two real schedules through step 3's loop (experience each round; every G rounds, PPO epochs
    over the collected rows in minibatches; the actor only after the frozen rounds): (lr of each actor
    update, lr of each critic update, lr of both after the run)."""
    from dschat.engine.core import make_scheduler

    actor_steps, critic_steps = ppo_optimizer_steps(rounds, rows_per_round=gen_bs * n, generation_batches=g,
                                                    micro_batch=mb, ppo_epochs=epochs, freezing_actor_steps=freezing)  # fmt: skip
    opts = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0) for _ in range(2)]
    scheds = [
        make_scheduler(o, scheduler_type, 0, steps) for o, steps in zip(opts, (actor_steps, critic_steps))
    ]
    used: tuple[list[float], list[float]] = ([], [])
    buffer = 0
    for step in range(1, rounds + 1):
        buffer += gen_bs * n
        if buffer == g * gen_bs * n:
            for _ in range(epochs):
                for _ in range(0, buffer, mb):
                    for k, on in enumerate((step > freezing, True)):
                        if on:
                            used[k].append(opts[k].param_groups[0]["lr"])
                            opts[k].step()
                            scheds[k].step()
            buffer = 0
    return (actor_steps, critic_steps), used, [o.param_groups[0]["lr"] for o in opts]


@pytest.mark.parametrize(
    ("rounds", "gen_bs", "n", "g", "mb", "epochs", "freezing"),
    [
        (8, 4, 1, 3, 6, 1, 0),  # the issue's example: gen_bs 4, G 3, micro-batch 6 (a last round unused)
        (8, 6, 1, 2, 4, 1, 0),  # the issue's: gen_bs 6, G 2, micro-batch 4 (decayed to 0, then climbed)
        (6, 16, 1, 1, 16, 1, 0),  # the defaults
        (6, 8, 4, 1, 16, 2, 0),  # rloo: 32 rows per round, two minibatches, two PPO epochs
        (10, 4, 1, 2, 2, 2, 3),  # frozen actor for three rounds: one update round without the actor
        (5, 4, 1, 1, 4, 1, 5),  # frozen for the whole run: no actor step
        (7, 3, 2, 2, 4, 3, 2),  # 12 rows per update, minibatches of 4
    ],
)
def test_schedules_end_exactly_at_the_last_update(rounds, gen_bs, n, g, mb, epochs, freezing):
    (actor_steps, critic_steps), (actor_lrs, critic_lrs), after = simulate_step3(
        rounds, gen_bs, n, g, mb, epochs, freezing
    )
    # the counted lengths are the real numbers of optimizer steps
    assert (len(actor_lrs), len(critic_lrs)) == (actor_steps, critic_steps)
    for lrs, steps in ((actor_lrs, actor_steps), (critic_lrs, critic_steps)):
        # linear decay from 1 over exactly those steps: step k runs at 1 - k/N, the last at 1/N, never rising
        assert lrs == pytest.approx([1 - k / steps for k in range(steps)], abs=1e-12)
        assert all(b <= a for a, b in itertools.pairwise(lrs))
    assert after == [0.0 if actor_steps else 1.0, 0.0]


def test_schedule_counts_of_the_issue():
    # gen_bs 4, G 3, micro-batch 6: 2 updates per 3 rounds (8 rounds: 2 update rounds, the 8th round unused)
    steps = ppo_optimizer_steps(8, rows_per_round=4, generation_batches=3, micro_batch=6, ppo_epochs=1)
    assert steps == (4, 4)
    # gen_bs 6, G 2, micro-batch 4: 3 updates per 2 rounds
    steps = ppo_optimizer_steps(8, rows_per_round=6, generation_batches=2, micro_batch=4, ppo_epochs=1)
    assert steps == (12, 12)
    # update rounds 2, 4, .., 10 of 2 epochs x 4 minibatches; the actor skips round 2 (frozen for 3 rounds)
    kw = dict(rows_per_round=4, generation_batches=2, micro_batch=2, ppo_epochs=2)
    assert ppo_optimizer_steps(10, freezing_actor_steps=3, **kw) == (32, 40)
    # a cosine schedule over these lengths ends at 0 after the last update and never climbs back
    _, (actor_lrs, _), after = simulate_step3(8, 6, 1, 2, 4, 1, 0, "cosine")
    assert len(actor_lrs) == 12 and actor_lrs[-1] > 0
    assert all(b <= a for a, b in itertools.pairwise(actor_lrs))
    assert after == [0.0, 0.0]


# ---------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_hand_values():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # kl 9: error = 9/6 - 1 = 0.5 -> clipped 0.2; value = 0.1 * (1 + 0.2 * 256/10000) = 0.1 * 1.00512
    ctl.update(9.0, 256)
    assert math.isclose(ctl.value, 0.100512, rel_tol=1e-12)
    # kl 3: error = -0.5 -> -0.2; value *= 1 - 0.2 * 1000/10000 = 0.98 -> 0.09850176
    ctl.update(3.0, 1000)
    assert math.isclose(ctl.value, 0.09850176, rel_tol=1e-12)
    # kl 6.6: error = 0.1 (inside the clip); value *= 1 + 0.1 * 5000/10000 = 1.05 -> 0.103426848
    ctl.update(6.6, 5000)
    assert math.isclose(ctl.value, 0.103426848, rel_tol=1e-12)
    # kl at the target: no change; a non-finite KL is skipped
    ctl.update(6.0, 5000)
    ctl.update(float("nan"), 5000)
    ctl.update(float("inf"), 5000)
    assert math.isclose(ctl.value, 0.103426848, rel_tol=1e-12)


def test_adaptive_kl_controller_stays_positive_past_one_horizon():
    # The linear step 1 + err * n/horizon crossed zero once n > 5 * horizon (err -0.2): 0.1 * (1 - 0.2 * 6)
    # = -0.02, a negative KL coefficient that rewards drifting from the reference. Past one horizon the
    # step compounds per horizon: 0.1 * 0.8^6 = 0.0262144; 0.1 * 1.2^2 * (1 + 0.2 * 5/10) = 0.1584.
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10)
    ctl.update(0.0, 60)
    assert math.isclose(ctl.value, 0.0262144, rel_tol=1e-12)
    up = AdaptiveKLController(0.1, target=6.0, horizon=10)
    up.update(100.0, 25)
    assert math.isclose(up.value, 0.1584, rel_tol=1e-12)
    # up to one horizon it is the linear step as before: 0.1 * (1 - 0.2 * 10/10) = 0.08
    edge = AdaptiveKLController(0.1, target=6.0, horizon=10)
    edge.update(0.0, 10)
    assert math.isclose(edge.value, 0.08, rel_tol=1e-12)


def test_fixed_kl_controller_never_changes():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 100.0, -3.0, float("nan")):
        ctl.update(kl, 1000)
    assert ctl.value == 0.05


@pytest.mark.parametrize(
    "make", [lambda: FixedKLController(0.2), lambda: AdaptiveKLController(0.2, target=1.0, horizon=10)]
)
def test_kl_controller_state_dict_round_trip(make):
    a = make()
    a.update(5.0, 3)  # adaptive: 0.2 * (1 + 0.2 * 3/10) = 0.212
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.value == a.value
    assert a.state_dict() == {"value": a.value}


# ---------------------------------------------------------------- RLVR stabilisers (DAPO, Dr. GRPO, GRPO's KL loss)


def test_kl_estimators_hand_values():
    # d = logp - ref = [0.5, -1, (masked: -inf)]
    # k1 = d; k2 = d^2 / 2 = [0.125, 0.5]; k3 = e^-d - 1 + d = [e^-0.5 - 0.5, e - 2]
    logp = t([[-1.0, -2.0, float("-inf")]])
    ref = t([[-1.5, -1.0, -0.5]])
    mask = t([[1, 1, 0]])
    assert close(kl_estimate(logp, ref, mask, "k1"), [[0.5, -1.0, 0.0]])
    assert close(kl_estimate(logp, ref, mask, "k2"), [[0.125, 0.5, 0.0]])
    assert close(kl_estimate(logp, ref, mask, "k3"), [[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, mask, "k4")


def test_k1_and_k3_are_unbiased_and_k2_is_not():
    # Over a whole categorical distribution the expectations are exact:
    # E_pi[k1] = E_pi[k3] = KL(pi || ref) (E_pi[ref/pi] = 1), E_pi[k2] = E_pi[d^2]/2 != KL here.
    pi, ref = t([0.7, 0.2, 0.1]), t([0.2, 0.3, 0.5])
    kl = float((pi * (pi / ref).log()).sum())
    lp, lr, ones = pi.log()[None], ref.log()[None], torch.ones(1, 3)
    for est in ("k1", "k3"):
        assert math.isclose(float((pi * kl_estimate(lp, lr, ones, est)[0]).sum()), kl, rel_tol=1e-5), est
    assert not math.isclose(float((pi * kl_estimate(lp, lr, ones, "k2")[0]).sum()), kl, rel_tol=1e-2)


def test_kl_shaped_rewards_with_k3():
    # d = [0.5, -1] on the two actions: reward = -0.1 * k3 (+ score 2 on the last action)
    logp, ref, mask = t([[0.0, -1.0, -2.0]]), t([[0.0, -1.5, -1.0]]), t([[0, 1, 1]])
    rewards, kl = kl_shaped_rewards(t([2.0]), logp, ref, mask, kl_coef=0.1, estimator="k3")
    k3 = [0.0, math.exp(-0.5) - 0.5, math.e - 2.0]
    assert close(kl, [k3], atol=1e-6)
    assert close(rewards, [[0.0, -0.1 * k3[1], -0.1 * k3[2] + 2.0]], atol=1e-6)


def test_dr_grpo_is_the_group_mean_without_std():
    # [1, -1, 1]: mean 1/3 -> [2/3, -4/3, 2/3]; [2, 4, 0]: mean 2 -> [0, 2, -2] (group_norm would divide by 2)
    out = group_relative_scores(t([1.0, -1.0, 1.0, 2.0, 4.0, 0.0]), 3, "dr_grpo")
    assert close(out, [2 / 3, -4 / 3, 2 / 3, 0.0, 2.0, -2.0], atol=1e-6)


def test_uniform_groups_marks_every_row_of_an_all_equal_group():
    out = uniform_groups(t([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 5.0, 5.0, 5.0]), 3)
    assert out.tolist() == [True] * 3 + [False] * 3 + [True] * 3


def test_clip_scores_clamps_and_marks_what_the_clamp_changed():
    # an uncentred reward model: right answers near +2, wrong ones near -9 (the default job's, 2026-11-27)
    clipped, was = clip_scores(t([2.0, -9.0, 5.0, -5.0, 7.5], dtype=torch.bfloat16), 5.0)
    assert clipped.dtype == torch.float32 and close(clipped, [2.0, -5.0, 5.0, -5.0, 5.0])
    assert was.tolist() == [False, True, False, False, True]  # exactly +-5 is kept, not clipped


def test_truncated_rows_are_those_without_eos_in_the_response():
    # prompt_len 2, EOS = 2: row 0 ends; row 1 runs out of budget; row 2 has EOS only in its prompt
    seqs = torch.tensor([[7, 7, 5, 2, 0], [7, 7, 5, 6, 8], [7, 2, 5, 6, 8]])
    assert truncated_rows(seqs, prompt_len=2, stop_ids=[2]).tolist() == [False, True, True]


def aggregation_case():
    # row 0: actions 1, 2, 3 (a masked 9); row 1: one action 4; row 2: no action at all (a dropped group)
    x = t([[1.0, 2.0, 3.0, 9.0], [4.0, 0.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    return x, mask


def test_loss_aggregations_hand_values():
    x, mask = aggregation_case()
    assert math.isclose(float(aggregate(x, mask, "token_mean")), (1 + 2 + 3 + 4) / 4)  # 2.5
    assert math.isclose(float(aggregate(x, mask, "seq_mean_token_mean")), (2.0 + 4.0) / 2)  # 3
    # each row's sum over the budget 4, then the mean over the 2 rows with actions: (6/4 + 4/4) / 2
    assert math.isclose(float(aggregate(x, mask, "seq_mean_token_sum_norm", norm_len=4)), 1.25)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(x, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(x, mask, "sum")


def test_policy_loss_clip_higher_hand_values():
    # policy_case with eps_high 0.6: a) A=+1, r=1.5 is now inside [0.8, 1.6] -> -1.5 (not clipped);
    # d) A=-2, r=0.5 is still clipped below -> 1.6. (-1.5 - 0.5 + 3.0 + 1.6 - 3.3) / 5 = -0.14
    logp, old, adv, mask = policy_case()
    loss, stats = policy_loss(logp, old, adv, mask, cliprange=0.2, cliprange_high=0.6)
    assert math.isclose(float(loss), -0.14, abs_tol=1e-6)
    assert math.isclose(float(stats["clip_fraction"]), 0.2, abs_tol=1e-6)
    # the same eps on both sides is the symmetric loss
    sym, _ = policy_loss(logp, old, adv, mask, cliprange=0.2, cliprange_high=0.2)
    assert math.isclose(float(sym), -0.08, abs_tol=1e-6)


def test_policy_loss_sequence_aggregation_hand_values():
    # policy_case's five per-token losses [-1.2, -0.5, 3.0, 1.6, -3.3] (sum -0.4) as row 0, and a row 1 with
    # one action (A = 2, r = 1 -> -2): token mean (-0.4 - 2) / 6 = -0.4; per sequence (-0.08 - 2) / 2 = -1.04;
    # Dr. GRPO with budget 6: (-0.4 / 6 - 2 / 6) / 2 = -0.2
    logp, old, adv, mask = policy_case()
    logp = torch.cat([logp, t([[-1.0] * 6])])
    old = torch.cat([old, t([[-1.0] * 6])])
    adv = torch.cat([adv, t([[2.0] + [0.0] * 5])])
    mask = torch.cat([mask, t([[1] + [0] * 5])])
    for agg, want in (
        ("token_mean", -0.4),
        ("seq_mean_token_mean", -1.04),
        ("seq_mean_token_sum_norm", -0.2),
    ):
        loss, _ = policy_loss(logp, old, adv, mask, cliprange=0.2, agg=agg, norm_len=6)
        assert math.isclose(float(loss), want, abs_tol=1e-6), agg


def test_token_entropy_a_distribution_with_impossible_tokens_is_finite():
    """A -inf logit (a token masked out) contributes 0 to the entropy, not nan: [0, 0, -inf] -> ln 2."""
    logits = torch.tensor([[[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]])
    assert close(token_entropy(logits), [[LN2]])


@pytest.mark.parametrize("method", ["group_norm", "rloo", "dr_grpo"])
@pytest.mark.parametrize("k", [3, 5, 8])
@pytest.mark.parametrize("x", [1.7, 2.9, -4.115225791931152])
def test_a_group_of_equal_scores_gets_exactly_zero(method, k, x):
    """Equal scores carry no signal. In float32 group_norm gave every answer of such a group the same
    advantage, -0.104 for three scores of 1.7 (the mean's rounding over a std of the same size)."""
    out = group_relative_scores(torch.full((k,), x), k, method)
    assert torch.equal(out, torch.zeros(k)) and out.dtype == torch.float32


def test_masked_whiten_over_two_ranks_equals_one_rank_holding_all_rows():
    """Each rank's rows are whitened with the statistics of all ranks (their sums all-reduced): rank 0's
    mean is 2 and rank 1's 13 alone, 8.5 together."""
    x = t([[1.0, 2.0, 3.0], [10.0, 13.0, 16.0]])
    mask = t([[1, 1, 1], [1, 1, 1]])
    whole = masked_whiten(x, mask)
    halves = [(x[i : i + 1], mask[i : i + 1]) for i in (0, 1)]
    calls: list[list[list[float]]] = [[], []]  # each rank's statistics, call by call

    def sums(rank):  # what dist.all_reduce_sum returns on ``rank``: its numbers plus the other rank's
        def reduce(values):
            calls[rank].append(values)
            xo, mo = halves[1 - rank]
            if len(calls[rank]) == 1:
                other = [float(mo.sum()), float(xo.sum())]
            else:
                mean = (float(x.sum())) / 6
                other = [float(((xo - mean) ** 2).sum())]
            return [a + b for a, b in zip(values, other)]

        return reduce

    for rank, (xr, mr) in enumerate(halves):
        assert close(masked_whiten(xr, mr, all_reduce=sums(rank)), whole[rank : rank + 1].tolist())
    assert not close(masked_whiten(*halves[0]), whole[0:1].tolist())  # alone: its own mean and std


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregate_over_two_ranks_equals_one_rank_holding_all_rows(mode):
    """Each rank divided by its own tokens (or rows) and DeepSpeed averaged the ranks, so a token weighed
    by how few others shared its rank: rank 0 with long answers, rank 1 with short ones (one of its rows
    filtered out entirely) trained unlike one rank holding all rows. With the denominator summed over
    ranks, the mean of the ranks' losses is the whole batch's."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    mask = torch.tensor([[1.0] * 6, [1.0] * 5 + [0.0], [1.0, 1.0, 0, 0, 0, 0], [0.0] * 6])
    whole = aggregate(x, mask, mode, norm_len=6)
    sent: list[list[float]] = []

    def record(v: list[float]) -> list[float]:
        sent.append(v)
        return v

    for half in (slice(0, 2), slice(2, 4)):
        aggregate(x[half], mask[half], mode, norm_len=6, all_reduce=record)
    total = [a + b for a, b in zip(*sent, strict=True)]  # what the all-reduce returns on both ranks
    halves = [
        aggregate(x[h], mask[h], mode, norm_len=6, all_reduce=lambda v: total)
        for h in (slice(0, 2), slice(2, 4))
    ]
    assert torch.allclose((halves[0] + halves[1]) / 2, whole, atol=1e-6)
    per_rank = [aggregate(x[h], mask[h], mode, norm_len=6) for h in (slice(0, 2), slice(2, 4))]
    assert not torch.allclose((per_rank[0] + per_rank[1]) / 2, whole, atol=1e-3)  # what it was before


def test_policy_loss_stats_over_two_ranks_equal_one_rank_holding_all_rows():
    """clip_fraction and approx_kl were each rank's own token mean, averaged over ranks: a rank whose rows
    all left the update (--filter_uniform_groups) logged zeros that halved them. With the token count
    summed over ranks, the mean of the ranks' values is the whole batch's."""
    torch.manual_seed(2)
    logp, old, adv = torch.randn(4, 5) * 0.3, torch.randn(4, 5) * 0.3, torch.randn(4, 5)
    mask = torch.tensor(
        [[1.0] * 5, [1.0] * 3 + [0.0] * 2, [0.0] * 5, [0.0] * 5]
    )  # rank 1: every row filtered
    _, whole = policy_loss(logp, old, adv, mask, 0.2)
    assert float(whole["clip_fraction"]) > 0 and float(whole["approx_kl"]) > 0
    sent: list[list[float]] = []

    def record(v: list[float]) -> list[float]:
        sent.append(v)
        return v

    halves = (slice(0, 2), slice(2, 4))
    for h in halves:
        policy_loss(logp[h], old[h], adv[h], mask[h], 0.2, all_reduce=record)
    # each rank calls the all-reduce twice (the loss's denominator, then the stats'): the same sums
    total = [[a + b for a, b in zip(sent[i], sent[i + 2], strict=True)] for i in (0, 1)]
    ranks = []
    for h in halves:
        calls = iter(total)
        reduce = lambda v, calls=calls: next(calls)  # noqa: E731
        ranks.append(policy_loss(logp[h], old[h], adv[h], mask[h], 0.2, all_reduce=reduce)[1])
    for key in ("clip_fraction", "approx_kl"):
        assert math.isclose(float(ranks[0][key] + ranks[1][key]) / 2, float(whole[key]), rel_tol=1e-6)
        alone = [policy_loss(logp[h], old[h], adv[h], mask[h], 0.2)[1][key] for h in halves]
        assert not math.isclose(float(alone[0] + alone[1]) / 2, float(whole[key]), rel_tol=1e-3)  # before
