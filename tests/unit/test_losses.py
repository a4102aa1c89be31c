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


def test_linear_cross_entropy_hand_value():
    """One hidden state [1, 0] and a head whose rows give logits [ln 3, 0]: -log 3/4 for label 0 and
    -log 1/4 for label 1, summed; the gradient of the head is (softmax - one-hot) x hidden."""
    from dschat.losses import linear_cross_entropy

    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]], requires_grad=True)
    weight = torch.tensor([[LN3, 5.0], [0.0, 7.0]], requires_grad=True)  # the second input column is unused
    loss = linear_cross_entropy(hidden, weight, torch.tensor([0, 1]))
    assert math.isclose(float(loss.detach()), -math.log(0.75) - math.log(0.25), rel_tol=1e-6)
    loss.backward()
    # rows: softmax [3/4, 1/4] minus one-hot(0) = [-1/4, 1/4]; minus one-hot(1) = [3/4, -3/4]; summed x [1, 0]
    assert close(weight.grad, [[0.5, 0.0], [-0.5, 0.0]])
    # d/dh = (softmax - one-hot) @ W: [-1/4, 1/4] @ W and [3/4, -3/4] @ W
    assert close(hidden.grad, [[-LN3 / 4, 0.5], [3 * LN3 / 4, -1.5]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_full_logits_in_chunks(dtype):
    """Chunked (3 rows at a time, a remainder of 1) == cross-entropy on the whole fp32-upcast logits,
    value and both gradients, under a non-unit outer gradient (a mean over tokens)."""
    from dschat.losses import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(10, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(20, 8, dtype=dtype, requires_grad=True)
    y = torch.randint(0, 20, (10,))
    (linear_cross_entropy(h, w, y, chunk_elements=60) / 10).backward()
    got = (h.grad.float(), w.grad.float())
    h.grad = w.grad = None
    (torch.nn.functional.cross_entropy((h @ w.t()).float(), y, reduction="sum") / 10).backward()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got[0], h.grad.float(), **tol)
    torch.testing.assert_close(got[1], w.grad.float(), **tol)
    with torch.no_grad():  # evaluation: the same value, no gradients formed
        assert math.isclose(
            float(linear_cross_entropy(h, w, y)),
            float(torch.nn.functional.cross_entropy((h @ w.t()).float(), y, reduction="sum")),
            rel_tol=1e-5,
        )


@pytest.mark.parametrize("tie", [False, True])
def test_sft_loss_fused_head_equals_the_models_own_logits(tie):
    """sft_loss through the fused head == mean NLL of the model's own logits, and the same gradients on
    every parameter (the head, tied or not, and the body), for right padding and prompts of different
    lengths; an architecture outside the list falls back to the model's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dschat import lm

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tie))  # fmt: skip
    ids = torch.randint(3, 50, (3, 9))
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    labels = ids.clone()
    for row, start in enumerate((5, 3, 6)):
        labels[row, :start] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    assert lm.plain_head(model) is not None
    calls = []  # the model's own forward runs (a DeepSpeed engine's bookkeeping lives there)
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    fused, n = lm.sft_loss(model, ids, mask, labels)
    hook.remove()
    assert calls == [1] and type(model.lm_head) is torch.nn.Linear  # the head is back
    fused.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    full, n_full = mean_token_nll(model(input_ids=ids, attention_mask=mask).logits, labels)
    full.backward()
    assert float(n) == float(n_full) == 9 - 5 + 9 - 3 + 7 - 6
    torch.testing.assert_close(fused, full, rtol=1e-6, atol=1e-6)
    for k, p in model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-5, atol=1e-6, msg=k)
    model.config.model_type = "gemma2"  # soft-capped logits: the fused head would be wrong there
    assert lm.plain_head(model) is None
    assert torch.allclose(lm.sft_loss(model, ids, mask, labels)[0], full)


def test_picked_token_logprobs_by_hand():
    """Two packed rows; three rollouts read positions of them, two of them the same position (the shared
    prompt's last token) with different targets. Uniform logits over 4 tokens give log(1/4); a logit of
    log(3) on token 2 gives 3/(3+3) = 1/2 for token 2 and 1/6 for the others."""
    from dschat.losses import picked_token_logprobs

    logits = torch.zeros(2, 3, 4)
    logits[0, 1, 2] = math.log(3.0)
    rows = torch.tensor([0, 0, 1])
    positions = torch.tensor([[1, 0], [1, 2], [0, 2]])
    tokens = torch.tensor([[2, 1], [0, 3], [3, 3]])
    logp, ent = picked_token_logprobs(logits, rows, positions, tokens, entropy=True)
    q = math.log(0.25)
    want = torch.tensor([[math.log(0.5), q], [math.log(1 / 6), q], [q, q]])
    torch.testing.assert_close(logp, want, atol=1e-6, rtol=0)
    h_uniform, h_peaked = math.log(4.0), -(0.5 * math.log(0.5) + 3 * (1 / 6) * math.log(1 / 6))
    want_h = torch.tensor([[h_peaked, h_uniform], [h_peaked, h_uniform], [h_uniform, h_uniform]])
    torch.testing.assert_close(ent, want_h, atol=1e-6, rtol=0)
    # temperature 2 halves the logits: token 2 at position (0, 1) gets sqrt(3) / (sqrt(3) + 3)
    logp2, _ = picked_token_logprobs(logits, rows, positions, tokens, temperature=2.0)
    assert float(logp2[0, 0]) == pytest.approx(math.log(3**0.5 / (3**0.5 + 3)), abs=1e-6)


def test_minus_inf_logit_at_an_ignored_position_stays_finite():
    # A position without a target whose logit for token 0 is -inf (a banned token, a masked vocabulary)
    # adds nothing, and sends no NaN gradient back: 0 * inf would be NaN in both.
    logits = torch.tensor([[[float("-inf"), 0.0], [0.0, 0.0], [0.0, 0.0]]], requires_grad=True)
    nll, n = token_nll(logits, torch.tensor([[M, M, 1]]))
    assert close(nll, [math.log(2)]) and close(n, [1.0])
    nll.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[0, 0], torch.zeros(2))
