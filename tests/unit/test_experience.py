"""dschat.rlhf.experience: slicing and concatenating rollouts of different lengths."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

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


def test_cat_rejects_different_prompt_len():
    with pytest.raises(ValueError, match="prompt_len"):
        Experience.cat([make(1, 4, prompt_len=2), make(1, 4, prompt_len=3)], pad_id=0)
