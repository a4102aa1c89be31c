"""dschat.losses: next-token NLL on tiny hand-computed logits."""

from __future__ import annotations

import math

import pytest
import torch

from dschat.data.collate import IGNORE_INDEX
from dschat.losses import mean_token_nll, token_nll

M = -100
LN3 = math.log(3.0)


def logits_a():
    # vocab of 2. softmax([ln 3, 0]) = [3/4, 1/4]; softmax([0, 0]) = [1/2, 1/2]; last position never used
    return torch.tensor([[[LN3, 0.0], [0.0, 0.0], [100.0, -100.0]]])


def close(t, values):
    return torch.allclose(t, torch.tensor(values, dtype=torch.float32), atol=1e-6, rtol=0)


def test_shift_by_one():
    # position 0 predicts label[1] = 0: -ln(3/4); position 1 predicts label[2] = 1: -ln(1/2)
    nll, n = token_nll(logits_a(), torch.tensor([[1, 0, 1]]))
    assert close(nll, [math.log(4 / 3) + math.log(2)])
    assert close(n, [2.0])


def test_first_label_is_never_a_target():
    nll_a, _ = token_nll(logits_a(), torch.tensor([[0, 0, 1]]))
    nll_b, _ = token_nll(logits_a(), torch.tensor([[M, 0, 1]]))
    assert torch.equal(nll_a, nll_b)


def test_other_labels():
    # label[1] = 1 under [3/4, 1/4]: ln 4; label[2] = 0 under [1/2, 1/2]: ln 2
    nll, n = token_nll(logits_a(), torch.tensor([[M, 1, 0]]))
    assert close(nll, [math.log(4) + math.log(2)])
    assert close(n, [2.0])


def test_ignore_index_is_skipped():
    nll, n = token_nll(logits_a(), torch.tensor([[M, M, 1]]))
    assert close(nll, [math.log(2)])
    assert close(n, [1.0])


def test_all_ignored():
    nll, n = token_nll(logits_a(), torch.tensor([[M, M, M]]))
    assert close(nll, [0.0]) and close(n, [0.0])
    mean, total = mean_token_nll(logits_a(), torch.tensor([[M, M, M]]))
    assert mean.item() == 0.0 and total.item() == 0.0


def test_per_sample_and_batch_mean():
    logits = torch.cat([logits_a(), logits_a()])
    labels = torch.tensor([[M, 0, 1], [M, M, 1]])
    nll, n = token_nll(logits, labels)
    assert nll.shape == (2,) and n.shape == (2,)
    assert close(nll, [math.log(8 / 3), math.log(2)])
    assert close(n, [2.0, 1.0])
    mean, total = mean_token_nll(logits, labels)
    assert math.isclose(mean.item(), math.log(16 / 3) / 3, abs_tol=1e-6)
    assert total.item() == 3.0


def test_output_is_float32():
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        nll, n = token_nll(logits_a().to(dtype), torch.tensor([[M, 0, 1]]))
        assert nll.dtype == torch.float32 and n.dtype == torch.float32


def test_gradient_reaches_only_used_positions():
    logits = logits_a().requires_grad_(True)
    nll, _ = token_nll(logits, torch.tensor([[M, M, 1]]))
    nll.sum().backward()
    # d(-log softmax(z)[1]) / dz = softmax(z) - onehot(1) = [1/2, -1/2] at position 1; nothing elsewhere
    assert torch.allclose(logits.grad, torch.tensor([[[0.0, 0.0], [0.5, -0.5], [0.0, 0.0]]]))


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_target_logits_give_the_full_sequence_loss(train_on_prompt):
    """The LM head on the last positions only (those predicting a target) gives the same loss, for right
    padding, rows of different prompt lengths and a prompt-included loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dschat.lm import target_logits

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()  # fmt: skip
    ids = torch.randint(3, 50, (3, 9))
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0  # right padding
    labels = ids.clone()
    if not train_on_prompt:
        for row, start in enumerate((5, 3, 6)):  # prompts of 5, 3 and 6 tokens
            labels[row, :start] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    full, n_full = mean_token_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
    logits, kept = target_logits(model, ids, mask, labels)
    part, n_part = mean_token_nll(logits, kept)
    assert logits.shape[1] == (9 if train_on_prompt else 9 - 3 + 1)  # from the earliest target's predictor
    assert float(n_part) == float(n_full)
    torch.testing.assert_close(part, full, rtol=1e-6, atol=1e-6)
