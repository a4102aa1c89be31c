"""dschat.rlhf.experience: slicing and concatenating rollouts of different lengths."""

from __future__ import annotations

from dataclasses import fields

import torch

from dschat.losses import token_logprobs
from dschat.rlhf.experience import Experience

PER_ACTION = ("action_mask", "logprobs", "ref_logprobs", "values", "rewards", "advantages", "returns")


def make(b: int, t: int, prompt_len: int = 2, base: float = 0.0) -> Experience:
    """B rows of T tokens; every per-action tensor is distinct and nonzero so padding shows up."""
    seq = (torch.arange(b * t).view(b, t) + 10 + int(base)).long()
    per_action = {
        name: torch.arange(b * (t - 1), dtype=torch.float32).view(b, t - 1) + 1 + base + 100 * k
        for k, name in enumerate(PER_ACTION)
    }
    per_action["action_mask"] = torch.ones(b, t - 1)
    return Experience(
        sequences=seq,
        attention_mask=torch.ones(b, t, dtype=torch.long),
        scores=torch.arange(b, dtype=torch.float32) + base,
        prompt_len=prompt_len,
        **per_action,
    )


def test_len():
    assert len(make(3, 5)) == 3


def test_slice_shapes_and_values():
    e = make(4, 5)
    s = e.slice(1, 3)
    assert len(s) == 2
    assert s.prompt_len == e.prompt_len
    for f in fields(Experience):
        v = getattr(s, f.name)
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, getattr(e, f.name)[1:3]), f.name
    assert s.sequences.shape == (2, 5)
    assert s.logprobs.shape == (2, 4)
    assert s.scores.tolist() == [1.0, 2.0]
    # rows 1..2 of a 4x5 arange starting at 10: [15..19], [20..24]
    assert s.sequences.tolist() == [[15, 16, 17, 18, 19], [20, 21, 22, 23, 24]]


def test_slice_past_the_end_is_clamped():
    s = make(3, 4).slice(2, 10)
    assert len(s) == 1
    assert s.values.shape == (1, 3)


def test_cat_pads_to_the_longest():
    a = make(2, 3, base=0.0)  # T = 3: 2 actions
    b = make(1, 5, base=1000.0)  # T = 5: 4 actions
    out = Experience.cat([a, b], pad_id=7)
    assert len(out) == 3
    assert out.prompt_len == 2
    assert out.sequences.shape == (3, 5)
    # a's rows right-padded with pad_id 7; b's row unchanged
    assert out.sequences.tolist() == [
        [10, 11, 12, 7, 7],
        [13, 14, 15, 7, 7],
        [1010, 1011, 1012, 1013, 1014],
    ]
    assert out.sequences.dtype == torch.long
    assert out.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    for name in PER_ACTION:
        v = getattr(out, name)
        assert v.shape == (3, 4), name
        assert v.dtype == torch.float32
        # padded with 0 (never pad_id)
        assert torch.equal(v[:2, :2], getattr(a, name)), name
        assert torch.all(v[:2, 2:] == 0), name
        assert torch.equal(v[2:], getattr(b, name)), name
    # per-action values of a: logprobs = arange + 1 + 100 -> [[101, 102], [103, 104]]
    assert out.logprobs[:2].tolist() == [[101.0, 102.0, 0.0, 0.0], [103.0, 104.0, 0.0, 0.0]]
    assert out.action_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert out.scores.tolist() == [0.0, 1.0, 1000.0]


def test_cat_order_longest_first():
    out = Experience.cat([make(1, 4, base=50.0), make(1, 3)], pad_id=0)
    assert out.sequences.tolist() == [[60, 61, 62, 63], [10, 11, 12, 0]]
    assert out.rewards.tolist() == [[451.0, 452.0, 453.0], [401.0, 402.0, 0.0]]


def test_cat_equal_lengths_is_plain_concatenation():
    a, b = make(2, 4), make(3, 4, base=5.0)
    out = Experience.cat([a, b], pad_id=99)
    assert torch.equal(out.sequences, torch.cat([a.sequences, b.sequences]))
    assert torch.equal(out.advantages, torch.cat([a.advantages, b.advantages]))
    assert not (out.sequences == 99).any()


def test_cat_then_slice_recovers_a_part():
    a, b = make(2, 3), make(2, 5, base=1.0)
    s = Experience.cat([a, b], pad_id=0).slice(2, 4)
    assert torch.equal(s.sequences, b.sequences)
    assert torch.equal(s.returns, b.returns)


def test_cat_left_pads_narrower_prompt_blocks():
    # a: prompt_len 2, T 4 (3 actions); b: prompt_len 4, T 5 (4 actions). Result: prompt_len 4, T 6:
    # a's rows move right by 2 (left padding), b's get one column of right padding.
    a, b = make(1, 4, prompt_len=2), make(1, 5, prompt_len=4, base=1000.0)
    a.attention_mask[0, 0] = 0  # a's own left padding stays where it was, relative to its tokens
    a.action_mask[0, 0] = 0  # prompt positions are no actions
    out = Experience.cat([a, b], pad_id=7)
    assert out.prompt_len == 4
    assert out.sequences.tolist() == [[7, 7, 10, 11, 12, 13], [1010, 1011, 1012, 1013, 1014, 7]]
    assert out.attention_mask.tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    # action t predicts token t+1: a's actions 0..2 are now 2..4
    assert out.action_mask.tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 0]]
    assert out.logprobs.tolist() == [[0, 0, 101, 102, 103], [1101, 1102, 1103, 1104, 0]]
    for name in PER_ACTION:
        assert torch.equal(getattr(out, name)[0, 2:], getattr(a, name)[0]), name
        assert torch.equal(getattr(out, name)[1, :4], getattr(b, name)[0]), name
    assert out.scores.tolist() == [0.0, 1000.0]
    # and the other order
    assert Experience.cat([b, a], pad_id=7).sequences.tolist() == out.sequences.flip(0).tolist()


def rollout(model, prompts: list[list[int]], responses: list[list[int]], seed: int) -> Experience:
    """An Experience of left-padded ``prompts`` (padded to the longest) and ``responses`` (right-padded
    with EOS = 2), with the model's log-probs and values and random advantages."""
    from dschat.generation.kv_decode import position_ids_from_mask
    from dschat.rlhf import ppo_math as M

    p, r = max(map(len, prompts)), max(map(len, responses))
    seq = torch.tensor([[0] * (p - len(x)) + x + y + [2] * (r - len(y)) for x, y in zip(prompts, responses)])
    prompt_mask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts])
    action_mask = M.action_mask_from(seq, p, stop_ids=[2])
    attention_mask = torch.cat([prompt_mask, action_mask[:, p - 1 :].long()], dim=1)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask)).logits  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    lp = token_logprobs(logits, seq)[0]
    per_action = {k: torch.randn(lp.shape, generator=g) * action_mask for k in PER_ACTION[2:]}
    return Experience(
        sequences=seq, attention_mask=attention_mask, action_mask=action_mask,
        logprobs=(lp + 0.1 * torch.randn(lp.shape, generator=g)) * action_mask, **per_action,
        scores=torch.randn(len(seq), generator=g), prompt_len=p,
    )  # fmt: skip


def test_cat_of_different_prompt_widths_keeps_every_log_prob_and_loss():
    """G = 2 rounds whose prompt blocks differ in width (3 and 6) and responses in length: the model's
    log-probs on the concatenation equal those on each part, and so do the policy and value losses."""
    from transformers import LlamaForCausalLM

    from dschat.generation.kv_decode import position_ids_from_mask
    from dschat.models.builtin import build_config
    from dschat.rlhf import ppo_math as M

    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config("micro-llama", vocab_size=64)).eval()
    a = rollout(model, [[5, 9, 11], [7, 3]], [[4, 4, 2], [8, 2]], seed=1)
    b = rollout(model, [[6, 6, 7, 8, 9, 10], [12, 13, 14]], [[20, 21, 22, 23, 2], [30, 2]], seed=2)
    assert (a.prompt_len, b.prompt_len) == (3, 6)
    both = Experience.cat([a, b], pad_id=0)

    def new_logprobs(e: Experience) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=e.sequences, attention_mask=e.attention_mask,
                           position_ids=position_ids_from_mask(e.attention_mask)).logits  # fmt: skip
        return token_logprobs(logits, e.sequences)[0]

    def losses(e: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy and value loss summed over the actions (masked mean x number of actions)."""
        n = e.action_mask.sum()
        pg, _ = M.policy_loss(new_logprobs(e), e.logprobs, e.advantages, e.action_mask, 0.2)
        v, _ = M.value_loss(e.values + 0.3, e.values, e.returns, e.action_mask, 0.2)
        return pg * n, v * n

    lp = new_logprobs(both) * both.action_mask
    for rows, part in ((slice(0, 2), a), (slice(2, 4), b)):
        left = both.prompt_len - part.prompt_len
        mine = new_logprobs(part) * part.action_mask
        assert torch.allclose(lp[rows, left : left + mine.shape[1]], mine, atol=1e-5)
        assert torch.count_nonzero(lp[rows]) == torch.count_nonzero(mine)
    got = losses(both)
    want = [x + y for x, y in zip(losses(a), losses(b))]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5), (g, w)


def test_several_rounds_are_whitened_together_not_round_by_round():
    """--whiten_advantages with --generation_batches 2 whitened each round on its own, so a round of small
    advantages weighed as much as one of large ones; the update's batch is whitened over both rounds'
    training rows (hand values: advantages 1, 3 in round one and 10, 30 in round two)."""
    from dataclasses import replace

    from dschat.rlhf.ppo import update_batch

    def with_adv(e: Experience, adv: list[float]) -> Experience:
        a = torch.zeros_like(e.advantages)
        a[:, 0] = torch.tensor(adv)
        m = torch.zeros_like(e.action_mask)
        m[:, 0] = 1
        return replace(e, advantages=a, action_mask=m)

    one, two = with_adv(make(2, 4), [1.0, 3.0]), with_adv(make(2, 4, base=50.0), [10.0, 30.0])
    batch = update_batch([one, two], pad_id=0, whiten_advantages=True)
    mean = (1 + 3 + 10 + 30) / 4
    std = (sum((x - mean) ** 2 for x in (1, 3, 10, 30)) / 4) ** 0.5
    want = torch.tensor([(x - mean) / std for x in (1.0, 3.0, 10.0, 30.0)])
    assert torch.allclose(batch.advantages[:, 0], want, atol=1e-5)
    assert float(batch.advantages[:, 1:].abs().sum()) == 0.0  # outside the training rows' actions
    raw = update_batch([one, two], pad_id=0, whiten_advantages=False)
    assert torch.equal(raw.advantages[:, 0], torch.tensor([1.0, 3.0, 10.0, 30.0]))
