"""DPO maths and collation on exact tensors (no deepspeed)."""

from __future__ import annotations

import math

import pytest
import torch

from dschat.data.collate import IGNORE_INDEX, PreferenceLMCollator, pair_example
from dschat.losses import dpo_loss, token_nll
from dschat.models.attention import FAST_ATTENTION, use_fast_attention

# log pi_c = -10, log pi_r = -12, log ref_c = log ref_r = -11: h = (1) - (-1) = 2
PC, PR, RC, RR = (torch.tensor([v]) for v in (-10.0, -12.0, -11.0, -11.0))


def test_sigmoid_loss_and_rewards_by_hand():
    out = dpo_loss(PC, PR, RC, RR, beta=0.1)
    # beta h = 0.2: -log sigmoid(0.2) = log(1 + e^-0.2) = 0.5981389
    assert math.isclose(float(out.loss), math.log1p(math.exp(-0.2)), abs_tol=1e-6)
    assert math.isclose(float(out.loss), 0.5981389, abs_tol=1e-6)
    assert torch.allclose(out.chosen_rewards, torch.tensor([0.1]))  # 0.1 * (-10 + 11)
    assert torch.allclose(out.rejected_rewards, torch.tensor([-0.1]))  # 0.1 * (-12 + 11)


def test_policy_equal_to_reference_gives_log2():
    out = dpo_loss(PC, PR, PC, PR, beta=0.5)
    assert math.isclose(float(out.loss), math.log(2.0), abs_tol=1e-6)
    assert float(out.chosen_rewards) == 0.0 and float(out.rejected_rewards) == 0.0


def test_label_smoothing_conservative_dpo():
    out = dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.1)
    # 0.9 * log(1 + e^-0.2) + 0.1 * log(1 + e^0.2) = 0.9 * 0.5981389 + 0.1 * 0.7981389 = 0.6181389
    assert math.isclose(float(out.loss), 0.6181389, abs_tol=1e-6)


def test_ipo_on_token_averaged_logprobs():
    out = dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="ipo", chosen_tokens=torch.tensor([2]),
                   rejected_tokens=torch.tensor([4]))  # fmt: skip
    # h = (-10 + 11) / 2 - (-12 + 11) / 4 = 0.5 + 0.25 = 0.75; target 1 / (2 * 0.1) = 5: (0.75 - 5)^2 = 18.0625
    assert math.isclose(float(out.loss), 18.0625, abs_tol=1e-5)
    with pytest.raises(ValueError):
        dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="ipo")


def test_ipo_rewards_rank_as_its_loss_does():
    """IPO compares log-ratios per token; its implicit rewards (accuracy, margins) were the whole
    answers' log-ratios, which can rank a pair the other way. Chosen: +1 over 10 tokens (0.1 a token);
    rejected: +5 over 100 tokens (0.05 a token): IPO prefers the chosen answer, and so do its rewards."""
    out = dpo_loss(torch.tensor([-9.0]), torch.tensor([-95.0]), torch.tensor([-10.0]), torch.tensor([-100.0]),
                   beta=0.5, loss_type="ipo", chosen_tokens=torch.tensor([10]), rejected_tokens=torch.tensor([100]))  # fmt: skip
    assert out.chosen_rewards.tolist() == pytest.approx(
        [0.05]
    ) and out.rejected_rewards.tolist() == pytest.approx([0.025])


def test_gradient_raises_chosen_lowers_rejected():
    pc, pr = PC.clone().requires_grad_(), PR.clone().requires_grad_()
    dpo_loss(pc, pr, RC, RR, beta=0.1).loss.backward()
    assert float(pc.grad) < 0 < float(pr.grad)  # descent raises log pi_c and lowers log pi_r


def test_preference_lm_collator_labels_responses_and_end():
    feats = [pair_example([1, 2], [3, 4], [5]), pair_example([6], [7], [8, 8, 8])]
    for i, f in enumerate(feats):
        f["index"] = 10 + i
    out = PreferenceLMCollator(pad_id=0, end_id=9)(feats)
    x = IGNORE_INDEX
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 9], [6, 7, 9, 0, 0], [1, 2, 5, 9, 0], [6, 8, 8, 8, 9]]
    assert out["labels"].tolist() == [[x, x, 3, 4, 9], [x, 7, 9, x, x], [x, x, 5, 9, x], [x, 8, 8, 8, 9]]
    assert out["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]
    assert out["index"].tolist() == [10, 11]
    # token_nll on these labels sums over the response and end tokens only: 3, 2, 2, 4 of them
    _, n = token_nll(torch.zeros(4, 5, 10), out["labels"])
    assert n.tolist() == [3.0, 2.0, 2.0, 4.0]


def _micro_llama_and_three_pairs():
    """The built-in micro Llama (fp32, eval) and three indexed pairs: chosen longer, longer, shorter."""
    from transformers import AutoModelForCausalLM

    from dschat.models.loading import resolve

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve("builtin:micro-llama"), dtype=torch.float32).eval()
    examples = [pair_example([5, 6, 7], [8, 9], [10]), pair_example([5], [11, 12, 13, 14], [15, 16]),
                pair_example([7, 7], [20], [21, 22, 23])]  # fmt: skip
    for i, ex in enumerate(examples):
        ex["index"] = i
    return model, examples


def test_reference_table_is_padding_free_and_marks_unread_rows(tmp_path):
    # A real micro Llama: each pair scored in a padded batch of three equals it scored alone, and the sum
    # over response tokens equals a hand loop over log_softmax; rows outside `only` are NaN.
    from dschat.dpo import reference_table

    model, examples = _micro_llama_and_three_pairs()
    collate = PreferenceLMCollator(pad_id=0, end_id=2)
    table = reference_table(model, examples, batch_size=3, collate=collate, device="cpu", only={0, 2})
    assert torch.isnan(table[1]).all() and not torch.isnan(table[[0, 2]]).any()

    def by_hand(prompt: list[int], response: list[int]) -> float:
        ids = torch.tensor([prompt + response + [2]])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        return sum(float(logp[t - 1, ids[0, t]]) for t in range(len(prompt), ids.shape[1]))

    for i in (0, 2):
        ex, p = examples[i], examples[i]["prompt_len"]
        assert float(table[i, 0]) == pytest.approx(by_hand(ex["chosen"][:p], ex["chosen"][p:]), abs=1e-4)
        assert float(table[i, 1]) == pytest.approx(by_hand(ex["rejected"][:p], ex["rejected"][p:]), abs=1e-4)


def test_held_out_evaluation_splits_accuracy_by_answer_length():
    # Implicit rewards set by hand through the reference table: beta * d on the chosen answer, 0 on the
    # rejected. Pair 0: chosen longer, d = +1 (right); pair 1: chosen longer, d = -1 (wrong); pair 2:
    # chosen shorter, d = +1 (right). As the reward model's evaluation, split by which answer is longer.
    from dschat.config import DPOArgs
    from dschat.dpo import evaluate_pairs, reference_table
    from dschat.lm import eval_batches

    model, examples = _micro_llama_and_three_pairs()
    collate = PreferenceLMCollator(pad_id=0, end_id=2, share_prompt=True)
    ref = reference_table(model, examples, batch_size=3, collate=collate, device="cpu")
    d = torch.tensor([1.0, -1.0, 1.0])
    ref[:, 0] -= d
    batches = eval_batches(examples, batch_size=2, collate=collate)  # two batches, one padded by a repeat
    m = evaluate_pairs(model, batches, ref, DPOArgs(beta=0.5), "cpu")
    assert m["pairs"] == 3
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["accuracy_chosen_longer"] == pytest.approx(1 / 2) and m["accuracy_chosen_shorter"] == 1.0
    assert m["longer_response_baseline"] == pytest.approx(2 / 3)
    assert m["margin"] == pytest.approx(0.5 * 1 / 3, abs=1e-5)
    assert m["chosen_reward"] == pytest.approx(0.5 * 1 / 3, abs=1e-5) and m[
        "rejected_reward"
    ] == pytest.approx(0, abs=1e-5)


def test_held_out_loss_is_the_training_objective_with_its_sft_term():
    """With --sft_coef the train loss is DPO + sft_coef x the chosen NLL per token; the held-out "loss" left
    the SFT term out, so the two curves measured different things. Held out: the mean DPO loss over the
    pairs plus sft_coef x the chosen NLL over all held-out chosen tokens; the DPO part is logged apart
    (``preference_loss``)."""
    from dschat.config import DPOArgs
    from dschat.dpo import evaluate_pairs, reference_table, response_logps
    from dschat.lm import eval_batches

    model, examples = _micro_llama_and_three_pairs()
    collate = PreferenceLMCollator(pad_id=0, end_id=2, share_prompt=True)
    ref = reference_table(model, examples, batch_size=3, collate=collate, device="cpu")
    batches = eval_batches(examples, batch_size=2, collate=collate)  # one pair repeated to fill a batch
    plain = evaluate_pairs(model, batches, ref, DPOArgs(beta=0.5), "cpu")
    m = evaluate_pairs(model, batches, ref, DPOArgs(beta=0.5, sft_coef=2.0), "cpu")
    lp = response_logps(model, collate(examples), "cpu")  # the three pairs once each
    nll = float(-lp.chosen.sum() / lp.chosen_tokens.sum())
    assert plain["loss"] == pytest.approx(math.log(2), rel=1e-5)  # the policy is its own reference
    assert m["preference_loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert m["loss"] == pytest.approx(math.log(2) + 2.0 * nll, rel=1e-5)


# ---------------------------------------------------------------- packed pairs (--share_prompt)


def test_packed_preference_targets_by_hand():
    # pair 0: prompt [1, 2], chosen [3, 4], rejected [5]; pair 1: prompt [6], chosen [7], rejected [8, 8, 8];
    # end token 9 after every answer
    feats = [
        dict(pair_example([1, 2], [3, 4], [5]), index=0),
        dict(pair_example([6], [7], [8, 8, 8]), index=1),
    ]
    out = PreferenceLMCollator(pad_id=0, end_id=9, share_prompt=True)(feats)
    assert out["packed_input_ids"].tolist() == [[1, 2, 3, 4, 9, 5, 9], [6, 7, 9, 8, 8, 8, 9]]
    assert out["packed_position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3], [0, 1, 2, 1, 2, 3, 4]]
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; targets are the answer and its end token
    assert out["target_group"].tolist() == [0, 1, 0, 1]
    assert out["target_tokens"].tolist() == [[3, 4, 9, 0], [7, 9, 0, 0], [5, 9, 0, 0], [8, 8, 8, 9]]
    # each target is predicted from the token before it: the first from the prompt's last token (1 in row
    # 0, 0 in row 1), never from the other answer; past an answer, the prompt's last token (masked)
    assert out["target_source"].tolist() == [[1, 2, 3, 1], [0, 1, 0, 0], [1, 5, 1, 1], [0, 3, 4, 5]]
    assert out["target_valid"].int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    # the unpacked rows are still there, unchanged
    plain = PreferenceLMCollator(pad_id=0, end_id=9)(feats)
    assert all(torch.equal(out[k], plain[k]) for k in plain)


def test_pairs_without_a_prompt_are_not_packed():
    feats = [dict(pair_example([], [3, 4], [5]), index=0)]
    out = PreferenceLMCollator(pad_id=0, end_id=9, share_prompt=True)(feats)
    assert "packed_input_ids" not in out


def _tiny_lm(arch: str, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0}  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **shapes)).eval()
    model.config._attn_implementation = "sdpa" if attn == FAST_ATTENTION else attn
    return use_fast_attention(model) if attn == FAST_ATTENTION else model


def _pairs(share: bool):
    g = torch.Generator().manual_seed(3)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 64, (n,), generator=g).tolist()

    feats = [pair_example(ids(5), ids(4), ids(7)), pair_example(ids(9), ids(2), ids(3)), pair_example(ids(1), ids(3), ids(3))]  # fmt: skip
    return PreferenceLMCollator(pad_id=0, end_id=63, share_prompt=share)(
        [dict(f, index=i) for i, f in enumerate(feats)]
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["sdpa", FAST_ATTENTION, "eager"])
def test_packed_pairs_give_the_unpacked_logprobs(arch, attn):
    from dschat.dpo import response_logps

    model = _tiny_lm(arch, attn)
    with torch.no_grad():
        packed = response_logps(model, _pairs(True), "cpu")
        plain = response_logps(model, _pairs(False), "cpu")
    for field in ("chosen", "rejected", "chosen_tokens", "rejected_tokens", "chosen_nll_mean"):
        assert torch.allclose(getattr(packed, field), getattr(plain, field), atol=1e-5), field
    assert plain.chosen_tokens.tolist() == [5, 3, 4]  # the answer and its end token
    # and the gradients: the same loss through either layout gives the same parameter gradients
    grads = []
    for share in (True, False):
        model.zero_grad()
        lp = response_logps(model, _pairs(share), "cpu")
        (lp.chosen - lp.rejected).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_settle_keeps_packing_where_it_holds_and_falls_back_where_not(monkeypatch, caplog):
    import dschat.lm as lm_module
    from dschat.dpo import settle_share_prompt
    from dschat.lm import eval_batches

    feats = [
        dict(pair_example([1, 2, 3], [4, 5], [6]), index=0),
        dict(pair_example([7], [8], [9, 9]), index=1),
    ]
    model = _tiny_lm("llama", "sdpa")
    collate = PreferenceLMCollator(pad_id=0, end_id=63, share_prompt=True)
    evals = eval_batches(feats, batch_size=2, collate=collate)
    settle_share_prompt(model, collate, feats, [evals], "cpu")
    assert collate.share_prompt and "packed_input_ids" in evals[0][0]
    # a model that applies plain causal attention: the rejected answer sees the chosen one
    monkeypatch.setattr(lm_module, "shared_prompt_mask", lambda seg: torch.ones(seg.shape[1], seg.shape[1]).bool().tril().expand(seg.shape[0], 1, -1, -1))  # fmt: skip
    with caplog.at_level("WARNING", logger="dschat"):
        settle_share_prompt(model, collate, feats, [evals], "cpu")
    assert (
        not collate.share_prompt
        and "packed_input_ids" not in evals[0][0]
        and "target_source" not in evals[0][0]
    )
    assert "differ from separate rows" in caplog.text
    assert "packed_input_ids" not in collate(feats)


def test_settle_checks_pairs_with_a_prompt_even_when_the_first_has_none(monkeypatch, caplog):
    # a batch packs only when every pair has a prompt: checking train[:2] blindly would skip the check
    import dschat.lm as lm_module
    from dschat.dpo import settle_share_prompt

    feats = [
        dict(pair_example([], [4, 5], [6]), index=0),
        dict(pair_example([1, 2, 3], [4, 5], [6]), index=1),
        dict(pair_example([7], [8], [9, 9]), index=2),
    ]
    model = _tiny_lm("llama", "sdpa")
    collate = PreferenceLMCollator(pad_id=0, end_id=63, share_prompt=True)
    monkeypatch.setattr(lm_module, "shared_prompt_mask", lambda seg: torch.ones(seg.shape[1], seg.shape[1]).bool().tril().expand(seg.shape[0], 1, -1, -1))  # fmt: skip
    with caplog.at_level("WARNING", logger="dschat"):
        settle_share_prompt(model, collate, feats, [], "cpu")
    assert not collate.share_prompt and "differ from separate rows" in caplog.text


def test_a_saved_reference_table_is_reused_only_for_its_own_pairs(tmp_path):
    # On resume, on-policy pairs are sampled again: as many pairs with other tokens must not reuse the
    # table (its rows would be other answers' log-probs).
    from dschat.dpo import pairs_fingerprint, read_table, save_table, table_matches

    pairs = [pair_example([1, 2], [3], [4, 5]), pair_example([6], [7, 8], [9])]
    other = [pair_example([1, 2], [3], [4, 6]), pair_example([6], [7, 8], [9])]  # one token differs
    shifted = [
        pair_example([1], [2, 3], [2, 4, 5]),
        pair_example([6], [7, 8], [9]),
    ]  # same ids, other prompt_len
    path = tmp_path / "reference_logps.safetensors"
    assert not table_matches(path, pairs_fingerprint(pairs))  # no table yet
    table = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    save_table(path, table, pairs_fingerprint(pairs))
    assert table_matches(path, pairs_fingerprint(pairs)) and torch.equal(read_table(path), table)
    assert not table_matches(path, pairs_fingerprint(other))
    assert not table_matches(path, pairs_fingerprint(shifted))
    assert not table_matches(path, pairs_fingerprint(pairs[::-1]))  # rows in another order


def test_dpo_rows_with_their_end_token_fit_max_seq_len():
    """The pairs were cut to --max_seq_len for prompt + answer, then the collator appended the end token:
    rows one token too wide (an index past the positions of a model with learned ones)."""
    from dschat.config import DataArgs
    from dschat.data.collate import PreferenceLMCollator
    from dschat.data.pipeline import tokenize_pairs
    from dschat.data.prompt_format import prompt_format
    from dschat.data.schema import Sample
    from dschat.dpo import pair_data_args
    from dschat.models.builtin import build_tokenizer

    tok = build_tokenizer()
    fmt = prompt_format(tok, "off")
    args = pair_data_args(DataArgs(max_seq_len=40), fmt)  # room for the turn's own tokens and a few x
    (p,), stats = tokenize_pairs([Sample("\n\nHuman: " + "x" * 40 + "\n\nAssistant:", " abc", " abd")], fmt,
                                 args.max_seq_len)  # fmt: skip
    p["index"] = 0
    assert stats["prompt_truncated"] == 1
    assert PreferenceLMCollator(tok.pad_token_id, fmt.end_id)([p])["input_ids"].shape[1] == 40


def test_no_eval_examples_give_no_batches():
    """Step 2 asks batches of its on-policy held-out pairs, which may be none (a policy right on every
    held-out prompt, or data without built-in tasks): that crashed with ZeroDivisionError after sampling."""
    from dschat.lm import eval_batches

    assert eval_batches([], batch_size=4, collate=lambda rows: rows) == []


def test_a_separate_reference_that_mis_scores_packed_pairs_gets_separate_rows(monkeypatch, caplog):
    """--ref_model_name_or_path: the policy's packing check says nothing of another model; the reference's
    table was computed from packed rows unchecked. Its own check decides, and the policy keeps packing."""
    import dschat.lm as lm_module
    from dschat.dpo import reference_collate

    feats = [
        dict(pair_example([1, 2, 3], [4, 5], [6]), index=0),
        dict(pair_example([7], [8], [9, 9]), index=1),
    ]
    reference = _tiny_lm("llama", "sdpa")
    collate = PreferenceLMCollator(pad_id=0, end_id=63, share_prompt=True)
    assert reference_collate(reference, collate, feats, "cpu") is collate  # packing holds: the same collator
    monkeypatch.setattr(lm_module, "shared_prompt_mask", lambda seg: torch.ones(seg.shape[1], seg.shape[1]).bool().tril().expand(seg.shape[0], 1, -1, -1))  # fmt: skip
    with caplog.at_level("WARNING", logger="dschat"):
        ref_collate = reference_collate(reference, collate, feats, "cpu")
    assert not ref_collate.share_prompt and "packed_input_ids" not in ref_collate(feats)
    assert collate.share_prompt  # the policy's own collator is left as it was
    assert "the reference model" in caplog.text


def test_the_sft_term_is_a_mean_over_the_optimizer_steps_chosen_tokens():
    """--sft_coef's term was the chosen NLL per token of each micro-batch, so the objective depended on how
    a global batch was split into ranks and accumulation (a per-token mean of each part, then averaged).
    With the step's chosen-token count (divided by the parts, which DeepSpeed averages) the parts' mean is
    the whole batch's loss. Two pairs: chosen NLL 20 over 10 tokens and 1 over 1 token."""
    from dschat.config import DPOArgs
    from dschat.dpo import ResponseLogps, chosen_targets, pair_loss

    hp = DPOArgs(beta=0.1, sft_coef=1.0)
    chosen, rejected = torch.tensor([-20.0, -1.0]), torch.tensor([-30.0, -3.0])
    ntok_c, ntok_r = torch.tensor([10.0, 1.0]), torch.tensor([12.0, 2.0])
    ref = torch.tensor([[-21.0, -29.0], [-1.5, -2.0]])

    def part(rows: slice) -> ResponseLogps:
        return ResponseLogps(chosen[rows], rejected[rows], ntok_c[rows], ntok_r[rows])

    whole, out = pair_loss(part(slice(0, 2)), ref, hp)
    # DPO term: mean over the pairs; SFT term: (20 + 1) / 11 tokens
    assert math.isclose(float(whole), float(out.loss) + 21 / 11, rel_tol=1e-6)
    halves = [pair_loss(part(slice(i, i + 1)), ref[i : i + 1], hp, sft_tokens=11 / 2)[0] for i in (0, 1)]
    assert math.isclose(float(sum(halves) / 2), float(whole), rel_tol=1e-6)
    # the count a micro-batch adds to the step's: its chosen rows' target tokens (the first half of the rows)
    x = IGNORE_INDEX
    labels = torch.tensor([[x, 5, 6, 9], [x, x, 7, 9], [x, 8, 9, x], [x, 8, 8, 9]])
    assert chosen_targets({"labels": labels}) == 5
    assert chosen_targets({"target_valid": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])}) == 3


def test_a_minus_infinite_log_prob_at_a_padded_target_slot_is_not_a_nan(monkeypatch):
    """Packed pairs read a padded target slot as token 0; a model that gives it -inf (a masked vocabulary
    entry) made ``logp * valid`` NaN (-inf x 0) and the step's loss and gradient with it. The slots a pair
    does not have are left out, not multiplied by zero (as token_nll does with ignore_index)."""
    from dschat import dpo

    logp = torch.tensor(
        [[-1.0, -2.0], [-0.5, float("-inf")]], requires_grad=True
    )  # (2B, A); row 1 has 1 target
    monkeypatch.setattr(dpo, "packed_token_logprobs", lambda *a, **k: (logp, None))
    batch = {"target_valid": torch.tensor([[1, 1], [1, 0]]), "packed_input_ids": torch.zeros(1, 3, dtype=torch.long),
             "packed_segments": torch.zeros(1, 3), "packed_position_ids": torch.zeros(1, 3), "target_group": None,
             "target_source": None, "target_tokens": None}  # fmt: skip
    out = dpo.response_logps(None, batch, "cpu")
    assert out.chosen.tolist() == [-3.0] and out.rejected.tolist() == [-0.5]
    (out.chosen + out.rejected).sum().backward()
    assert torch.isfinite(logp.grad).all()
