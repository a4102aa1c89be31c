"""Step-2 pieces: last-token pooling, the pairwise loss, the length expert, pair/prompt collation, ranking
metrics."""

from __future__ import annotations

import math

import pytest
import torch

from dschat.data.collate import PairCollator, PromptCollator, pair_example
from dschat.losses import (
    divergence_pairwise_loss,
    fit_length_expert,
    gather_last,
    last_token_index,
    length_expert_logits,
    length_log_ratio,
    pairwise_loss,
)
from dschat.ranking import ranking_metrics, ranking_sums
from dschat.utils.errors import UserError

# ---------------------------------------------------------------- last_token_index / gather_last


@pytest.mark.parametrize(
    "mask, expected",
    [
        ([[1, 1, 1, 0, 0]], [2]),  # right padding
        ([[0, 0, 1, 1, 1]], [4]),  # left padding
        ([[1, 1, 1, 1, 1]], [4]),  # no padding
        ([[0, 1, 1, 0, 0]], [2]),  # left and right padding
        ([[1, 0, 0, 0, 0]], [0]),  # one token
        ([[0, 0, 0, 0, 0]], [0]),  # no real token -> 0
        ([[1, 1, 0], [0, 1, 1], [1, 1, 1]], [1, 2, 2]),
    ],
)
def test_last_token_index(mask, expected):
    assert last_token_index(torch.tensor(mask)).tolist() == expected


def test_last_token_index_bool_and_float_masks():
    assert last_token_index(torch.tensor([[True, True, False]])).tolist() == [1]
    assert last_token_index(torch.tensor([[0.0, 1.0, 1.0]])).tolist() == [2]


def test_gather_last_pad_equals_eos_uses_the_mask():
    # pad == eos == 2: row 0 really ends with an EOS at index 2 followed by padding 2s; a pad-id based
    # rule would pick index 1 (before the first 2) or index 4 (last token). The mask says index 2.
    ids = torch.tensor([[5, 6, 2, 2, 2], [2, 2, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [1.1, 1.2, 1.3, 1.4, 1.5]])
    assert last_token_index(mask).tolist() == [2, 4]
    assert torch.equal(gather_last(values, mask), torch.tensor([0.3, 1.5]))
    assert ids.shape == values.shape


def test_gather_last_right_and_left_padding():
    values = torch.arange(12, dtype=torch.float32).view(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    # row 0 index 1 -> 1; row 1 index 3 -> 7; row 2 index 3 -> 11
    assert gather_last(values, mask).tolist() == [1.0, 7.0, 11.0]


# ---------------------------------------------------------------- pairwise loss


def test_pairwise_loss_hand_values():
    # -log sigmoid(d) = log(1 + e^-d): d = 1 -> 0.3132617, d = 0 -> ln2 = 0.6931472; mean 0.5032044
    loss = pairwise_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert math.isclose(float(loss), (math.log1p(math.exp(-1.0)) + math.log(2.0)) / 2, abs_tol=1e-6)
    assert math.isclose(float(loss), 0.5032044, abs_tol=1e-6)


def test_pairwise_loss_with_margin():
    # margin 0.5: d - m = 0.5 and -0.5 -> log(1 + e^-0.5) = 0.4740770, log(1 + e^0.5) = 0.9740770
    loss = pairwise_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]), margin=0.5)
    assert math.isclose(float(loss), (0.4740770 + 0.9740770) / 2, abs_tol=1e-6)


def test_pairwise_loss_with_offset():
    # chosen 1, rejected 0, the expert's log-odds -1: -log sigmoid(1 - 0 - 1) = log 2; the margin adds in
    assert math.isclose(float(pairwise_loss(torch.tensor([1.0]), torch.tensor([0.0]), offset=torch.tensor([-1.0]))),
                        math.log(2), rel_tol=1e-6)  # fmt: skip
    got = pairwise_loss(torch.tensor([1.0]), torch.tensor([0.0]), margin=0.5, offset=torch.tensor([-0.5]))
    assert math.isclose(float(got), math.log(2), rel_tol=1e-6)


def test_length_log_ratio_and_expert_logits():
    lens = torch.tensor([4, 1, 2, 1])  # chosen 4, 1; rejected 2, 1
    assert torch.allclose(length_log_ratio(lens), torch.tensor([math.log(2), 0.0]))
    assert torch.allclose(length_expert_logits(0.5, lens), torch.tensor([0.5 * math.log(2), 0.0]))
    # an empty response counts as one token (no log 0)
    assert torch.isfinite(length_log_ratio(torch.tensor([0, 3]))).all()


def test_fit_length_expert_hand_values():
    # x = 1, 1, -1 (chosen longer twice, shorter once): d/dw [2 log s(w) + log s(-w)] = 2 (1 - s) - s = 0
    # -> sigmoid(w) = 2/3, w = log 2
    assert math.isclose(fit_length_expert(torch.tensor([1.0, 1.0, -1.0]), l2=0.0), math.log(2), rel_tol=1e-9)
    # symmetric data: no length preference
    assert abs(fit_length_expert(torch.tensor([0.7, -0.7]), l2=0.0)) < 1e-12
    # chosen always the shorter: w < 0; always the longer: without l2 no maximum, with it a finite w > 0
    assert fit_length_expert(torch.tensor([-1.0, -2.0, 0.5])) < 0
    w = fit_length_expert(torch.tensor([1.0, 2.0]), l2=1e-2)
    assert 0 < w < 100 and math.isfinite(w)


def test_length_expert_takes_length_out_of_the_reward():
    # Responses have a length feature and a content feature; annotators prefer both. A linear reward
    # trained plainly learns to pay for length; trained beside the fitted length expert (product of
    # experts) it pays much less for length (not nothing: the expert, fitted without the content, sees
    # an attenuated length preference), still learns content, and ranks the pairs whose chosen answer
    # is the shorter one better (measured here: plain 0.73, debiased 0.84).
    g = torch.Generator().manual_seed(0)
    n = 4000
    feats = torch.randn(2, n, 2, generator=g)  # (side, pair, [log length, content])
    true = torch.tensor([1.5, 2.0])
    p_first = torch.sigmoid((feats[0] - feats[1]) @ true)
    first_wins = torch.rand(n, generator=g) < p_first
    chosen = torch.where(first_wins[:, None], feats[0], feats[1])
    rejected = torch.where(first_wins[:, None], feats[1], feats[0])
    x = chosen[:, 0] - rejected[:, 0]  # the log length ratio
    w = fit_length_expert(x)
    assert 0.5 < w < 1.5  # the marginal length preference, attenuated by the content it does not see

    def train(offset):
        theta = torch.zeros(2, requires_grad=True)
        opt = torch.optim.LBFGS([theta], max_iter=100, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = pairwise_loss(chosen @ theta, rejected @ theta, offset=offset)
            loss.backward()
            return loss

        opt.step(closure)
        return theta.detach()

    plain = train(None)
    debiased = train(w * x)
    assert plain[0] > 1.2 and debiased[0] < 0.6 * plain[0]  # pays much less for length
    assert debiased[1] > 1.5  # still learns what the answer says
    shorter = x < 0

    def acc(theta):
        return float(((chosen @ theta > rejected @ theta)[shorter]).float().mean())

    assert acc(debiased) > acc(plain) + 0.05


def test_pairwise_loss_is_float32_and_stable():
    loss = pairwise_loss(torch.tensor([-100.0], dtype=torch.bfloat16), torch.tensor([100.0]))
    # d = -200: log(1 + e^200) = 200 (no overflow to inf)
    assert loss.dtype == torch.float32
    assert math.isclose(float(loss), 200.0, rel_tol=1e-6)


def _two_pairs():
    """Pair 1: answers part at t=1, chosen 3 tokens, rejected 2. Pair 2: rejected extends chosen by one token."""
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0], [5, 8, 0, 0], [5, 6, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    values = torch.tensor(
        [[0.1, 1.0, 2.0, 9.0], [0.0, 0.5, 9.0, 9.0], [0.3, 0.0, 9.0, 9.0], [0.0, 0.0, -1.0, 9.0]]
    )
    return values, ids, mask


def test_divergence_loss_hand_values():
    values, ids, mask = _two_pairs()
    # Pair 1: t = 1: 1.0 - 0.0 = 1; t = 2: chosen 2.0, rejected has ended -> its last score 0.0: 2.
    pair1 = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(-2.0))) / 2  # 0.2200948
    # Pair 2: only t = 2 (where the rejected one goes on): chosen's last score 0.5 vs -1.0: 1.5.
    pair2 = math.log1p(math.exp(-1.5))  # 0.2014133
    loss = divergence_pairwise_loss(values, ids, mask)
    assert math.isclose(float(loss), (pair1 + pair2) / 2, abs_tol=1e-6)
    assert math.isclose(float(loss), (0.2200948 + 0.2014133) / 2, abs_tol=1e-6)
    one = divergence_pairwise_loss(values[[0, 2]], ids[[0, 2]], mask[[0, 2]])
    assert math.isclose(float(one), pair1, abs_tol=1e-6)  # the other pair's padding changes nothing


def test_divergence_loss_margin_and_last_token_case():
    values, ids, mask = _two_pairs()
    loss = divergence_pairwise_loss(values[[0, 2]], ids[[0, 2]], mask[[0, 2]], margin=0.5)
    assert math.isclose(float(loss), (0.4740770 + 0.2014133) / 2, abs_tol=1e-6)
    # Answers of one length that differ only in the last token: the last-token loss exactly.
    ids2 = torch.tensor([[1, 2, 3], [1, 2, 4]])
    values2 = torch.tensor([[5.0, 6.0, 2.0], [-5.0, 7.0, 1.0]])
    mask2 = torch.ones_like(ids2)
    got = divergence_pairwise_loss(values2, ids2, mask2)
    assert math.isclose(
        float(got), float(pairwise_loss(torch.tensor([2.0]), torch.tensor([1.0]))), abs_tol=1e-6
    )


# ---------------------------------------------------------------- collation


def test_pair_example_appends_no_eos():
    prompt, chosen, rejected = [1, 2], [3, 4, 5], [6]
    ex = pair_example(prompt, chosen, rejected)
    assert ex == {"chosen": [1, 2, 3, 4, 5], "rejected": [1, 2, 6], "prompt_len": 2}
    ex["chosen"].append(9)
    assert prompt == [1, 2] and chosen == [3, 4, 5]


def test_pair_collator_chosen_first_right_padded():
    feats = [pair_example([1, 2], [3, 4, 5], [6]), pair_example([7], [8], [9, 9])]
    out = PairCollator(pad_id=99)(feats)
    assert set(out) == {"input_ids", "attention_mask", "response_len"}
    # response lengths (prompt excluded): chosen 3, 1; rejected 1, 2
    assert out["response_len"].tolist() == [3, 1, 1, 2]
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; width = longest = 5
    assert out["input_ids"].tolist() == [
        [1, 2, 3, 4, 5],
        [7, 8, 99, 99, 99],
        [1, 2, 6, 99, 99],
        [7, 9, 9, 99, 99],
    ]
    assert out["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
    ]
    assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long


def test_pair_collator_then_gather_last_scores_last_response_token():
    out = PairCollator(pad_id=0)([pair_example([1], [2, 3], [4])])
    values = out["input_ids"].float() * 10  # score = 10 * token id
    # chosen [1, 2, 3] -> last token 3 -> 30; rejected [1, 4, pad] -> last real token 4 -> 40
    assert gather_last(values, out["attention_mask"]).tolist() == [30.0, 40.0]


def test_prompt_collator_left_pads():
    out = PromptCollator(pad_id=99)([[1, 2, 3], [4], [5, 6]])
    assert out["input_ids"].tolist() == [[1, 2, 3], [99, 99, 4], [99, 5, 6]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert out["input_ids"].dtype == torch.long


def test_prompt_collator_equal_lengths_no_padding():
    out = PromptCollator(pad_id=0)([[1, 2], [3, 4]])
    assert out["input_ids"].tolist() == [[1, 2], [3, 4]]
    assert out["attention_mask"].tolist() == [[1, 1], [1, 1]]


# ---------------------------------------------------------------- ranking


def toy_pairs():
    #      chosen rejected  len_c len_r  weight
    # p0:   2.0    1.0        5     3     1     right,  chosen longer
    # p1:   0.5    0.5        2     4     1     tie -> wrong, chosen shorter
    # p2:   3.0   -1.0        3     6     2     right,  chosen shorter
    # p3:  -4.0    4.0        9     1     0     wrong,  chosen longer, but weight 0: ignored
    chosen = torch.tensor([2.0, 0.5, 3.0, -4.0])
    rejected = torch.tensor([1.0, 0.5, -1.0, 4.0])
    len_c = torch.tensor([5, 2, 3, 9])
    len_r = torch.tensor([3, 4, 6, 1])
    weight = torch.tensor([1.0, 1.0, 2.0, 0.0])
    return chosen, rejected, len_c, len_r, weight


def test_ranking_sums_hand_values():
    s = ranking_sums(*toy_pairs())
    assert s == pytest.approx(
        {
            "n": 4.0,  # 1 + 1 + 2 + 0
            "right": 3.0,  # p0 (1) + p2 (2)
            "chosen": 8.5,  # 2 + 0.5 + 2*3 + 0
            "rejected": -0.5,  # 1 + 0.5 + 2*(-1) + 0
            "chosen_sq": 22.25,  # 4 + 0.25 + 2*9 + 0
            "rejected_sq": 3.25,  # 1 + 0.25 + 2*1 + 0
            "n_chosen_longer": 1.0,  # p0
            "right_chosen_longer": 1.0,
            "n_chosen_shorter": 3.0,  # p1 (1) + p2 (2)
            "right_chosen_shorter": 2.0,  # p2
            "longer_wins": 1.0,  # p0
        }
    )


def test_ranking_metrics_hand_values():
    m = ranking_metrics(ranking_sums(*toy_pairs()))
    assert m == pytest.approx(
        {
            "accuracy": 0.75,  # 3 / 4
            "chosen_mean": 2.125,  # 8.5 / 4
            "rejected_mean": -0.125,  # -0.5 / 4
            "margin": 2.25,  # 9 / 4
            "score_mean": 1.0,  # (8.5 - 0.5) / 8, both sides of every pair
            "score_std": 2.1875**0.5,  # (22.25 + 3.25) / 8 - 1.0**2
            "longer_response_baseline": 0.25,  # 1 / 4
            "pairs": 4.0,
            "accuracy_chosen_longer": 1.0,  # 1 / 1
            "accuracy_chosen_shorter": 2 / 3,  # 2 / 3
        }
    )


def test_ranking_ties_count_as_wrong():
    x = torch.tensor([1.0, 1.0])
    lens = torch.tensor([3, 3])
    m = ranking_metrics(ranking_sums(x, x.clone(), lens, lens, torch.ones(2)))
    assert m["accuracy"] == 0.0
    assert m["margin"] == 0.0
    # equal lengths: neither split exists, and the longer-response baseline never wins
    assert "accuracy_chosen_longer" not in m and "accuracy_chosen_shorter" not in m
    assert m["longer_response_baseline"] == 0.0


def test_ranking_sums_add_up_over_batches():
    c, r, lc, lr, w = toy_pairs()
    a = ranking_sums(c[:2], r[:2], lc[:2], lr[:2], w[:2])
    b = ranking_sums(c[2:], r[2:], lc[2:], lr[2:], w[2:])
    total = {k: a[k] + b[k] for k in a}
    assert ranking_metrics(total) == pytest.approx(ranking_metrics(ranking_sums(c, r, lc, lr, w)))


def test_ranking_metrics_empty():
    c = torch.tensor([1.0])
    m = ranking_metrics(ranking_sums(c, c, torch.tensor([1]), torch.tensor([2]), torch.zeros(1)))
    assert m["pairs"] == 0.0
    assert m["accuracy"] == 0.0
    assert "accuracy_chosen_shorter" not in m


# ---------------------------------------------------------------- score normalisation (--normalize_reward)


def test_mean_std_from_weighted_sums():
    from dschat.utils.metrics import mean_std

    # values 1, 3 (weight 1 each) and 5 (weight 2): sum 14, sum of squares 60, weight 4
    assert mean_std(14.0, 60.0, 4.0) == pytest.approx((3.5, (15.0 - 12.25) ** 0.5))
    assert mean_std(0.0, 0.0, 0.0) == (0.0, 0.0)  # nothing measured
    assert mean_std(3.0, 3.0 - 1e-9, 3.0)[1] == 0.0  # rounding never gives a negative variance


def test_score_normalization_prefers_the_policys_own_answers():
    from dschat.models.reward import ScoreNormalization

    ev = {"score_mean": 1.0, "score_std": 2.0, "pairs": 100.0}
    both = {**ev, "policy_score_mean": -3.5, "policy_score_std": 8.0, "policy_answers": 640.0}
    assert ScoreNormalization.from_eval(both) == ScoreNormalization(-3.5, 8.0, "policy_samples", 640.0)
    assert ScoreNormalization.from_eval(ev) == ScoreNormalization(1.0, 2.0, "eval_pairs", 200.0)
    # a policy whose answers all scored alike has no spread to divide by: the pairs' is used
    flat = {**both, "policy_score_std": 0.0}
    assert ScoreNormalization.from_eval(flat).source == "eval_pairs"
    assert ScoreNormalization.from_eval({"score_mean": 0.0, "score_std": 0.0, "pairs": 4.0}) is None


def test_score_normalization_applies_and_round_trips_through_config_json(tmp_path):
    from transformers import LlamaConfig

    from dschat.models.reward import ScoreNormalization

    norm = ScoreNormalization(mean=-3.5, std=8.0, source="policy_samples", n=640.0)
    scores = torch.tensor([-3.5, 4.5, -11.5], dtype=torch.bfloat16)
    assert norm.apply(scores).tolist() == [0.0, 1.0, -1.0] and norm.apply(scores).dtype == torch.float32
    config = LlamaConfig(num_labels=1)
    norm.to_config(config)
    config.save_pretrained(tmp_path)
    assert ScoreNormalization.read(str(tmp_path), "--critic_model_name_or_path") == norm
    # a config loaded from that directory still carries them until cleared (a step-2 output trained again)
    loaded = LlamaConfig.from_pretrained(tmp_path)
    ScoreNormalization.clear(loaded)
    ScoreNormalization.clear(loaded)  # nothing left to clear: no error
    loaded.save_pretrained(tmp_path / "again")
    with pytest.raises(UserError, match="--normalize_reward needs the score mean and std"):
        ScoreNormalization.read(str(tmp_path / "again"), "--critic_model_name_or_path")
    # a reward model saved before step 2 measured its scores: one line naming the flag and the directory
    LlamaConfig(num_labels=1).save_pretrained(tmp_path / "old")
    with pytest.raises(
        UserError, match=f"--critic_model_name_or_path {tmp_path / 'old'}: --normalize_reward"
    ):
        ScoreNormalization.read(str(tmp_path / "old"), "--critic_model_name_or_path")


def test_reward_model_source_standardises_its_scores():
    from dschat.models.reward import ScoreNormalization
    from dschat.rlhf.rewards import RewardModelSource

    def engine(ids, mask):  # per-token values (B, T): the token ids themselves
        return ids.float()

    ids = torch.tensor([[1, 7, 9], [1, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # last real tokens: 9 and 5
    assert RewardModelSource(engine).score([], [], ids, mask).tolist() == [9.0, 5.0]
    norm = ScoreNormalization(mean=5.0, std=2.0, source="eval_pairs", n=2.0)
    assert RewardModelSource(engine, norm).score([], [], ids, mask).tolist() == [2.0, 0.0]


def test_a_16_bit_reward_models_scores_are_not_rounded_to_16_bits(tmp_path):
    """The head reads bf16 hidden states and bf16 weights and computes in fp32: bf16 scores (8 bits of
    mantissa, steps of 2**-7 at 1) tied 3 of 500 HH test pairs that fp32 told apart, each counted wrong."""
    from transformers import LlamaForCausalLM

    from dschat.models.builtin import build_config
    from dschat.models.reward import load_reward_model

    torch.manual_seed(0)
    LlamaForCausalLM(build_config("micro-llama", vocab_size=300)).save_pretrained(tmp_path)
    rm = load_reward_model(str(tmp_path)).to(torch.bfloat16).eval()
    torch.nn.init.normal_(rm.hf_model.score.weight, std=1.0)  # scores of order 10: bf16 steps of 2**-4
    ids = torch.randint(3, 300, (4, 12))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hidden = rm.hidden(ids, mask)  # (4, 12, H) bf16
        exact = (hidden.float() @ rm.hf_model.score.weight.float().T).squeeze(-1)  # (4, 12)
        values = rm(ids, mask)
    assert values.dtype == torch.float32
    assert torch.allclose(values, exact, rtol=1e-6, atol=1e-6)
    assert (exact.bfloat16().float() - exact).abs().max() > 1e-3  # what the bf16 head returned
    assert torch.equal(rm.score(ids, mask), values[:, -1])
