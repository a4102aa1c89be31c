"""dschat.policy_pairs: which sampled answers become on-policy rejected responses."""

from __future__ import annotations

import pytest
import torch

from dschat.policy_pairs import advantage_correlation, best_worst_pairs, selection_metrics, wrong_answer_pairs
from dschat.tasks import make_prompt


def test_wrong_answers_become_pairs_with_the_right_answer_as_chosen():
    sort, rev, other = make_prompt("Sort: plum apple cat"), make_prompt("Reverse: abc"), make_prompt("Hello")
    prompts = [sort, sort, sort, sort, rev, rev, rev, other]
    answers = [
        " apple cat plum",  # right: no pair
        " apple plum cat",  # wrong: a pair
        " apple plum cat\n\nHuman: more",  # the same wrong answer once cleaned: not repeated
        "   ",  # empty: no pair (nothing to rank)
        " cba",  # right
        " cbb",  # wrong
        " abc",  # wrong
        " anything",  # no task knows this prompt: no verifier, no pair
    ]
    pairs = wrong_answer_pairs(prompts, answers)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        (sort, " apple cat plum", " apple plum cat"),
        (rev, " cba", " cbb"),
        (rev, " cba", " abc"),
    ]
    assert all(p.source == "policy" for p in pairs)
    # a chat template's answers (no stop strings): the invented turn is part of the third answer, which is
    # then another wrong answer
    chat = wrong_answer_pairs(prompts[:3], answers[:3], stops=())
    assert [p.rejected for p in chat] == [" apple plum cat", " apple plum cat\n\nHuman: more"]


def test_the_same_wrong_answer_to_different_prompts_is_kept():
    a, b = make_prompt("Reverse: abc"), make_prompt("Reverse: abd")
    pairs = wrong_answer_pairs([a, b], [" xyz", " xyz"])
    assert [p.prompt for p in pairs] == [a, b]


def test_selection_metrics_by_hand():
    # 3 prompts x 3 answers. Prompt 0: the scorer prefers its right answer; prompt 1: a wrong one over
    # the right one; prompt 2: no answer is right. The last prompt is a rank's repeat (weight 0).
    scores = torch.tensor([[0.1, 2.0, -1.0], [3.0, 1.0, 0.5], [0.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
    right = torch.tensor([[0, 1, 0], [0, 1, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    weight = torch.tensor([1.0, 1.0, 1.0, 0.0])
    m = selection_metrics(scores, right, weight)
    assert {k: m[k] for k in ("best", "sampled", "any", "n", "score_sum", "score_sq")} == {
        "best": 1.0, "sampled": pytest.approx(1 / 3 + 2 / 3), "any": 2.0, "n": 3.0,
        "score_sum": pytest.approx(1.1 + 4.5 + 0.0),  # every answer of the weighted prompts
        "score_sq": pytest.approx(0.01 + 4 + 1 + 9 + 1 + 0.25),
    }  # fmt: skip


def test_advantage_correlation_by_hand():
    # 2 prompts x 2 answers: the RLOO advantage with K = 2 is s_i - s_j.
    # Prompt 0: scores (1, 3), right (0, 1) -> score advantages (-2, 2), verifier's (-1, 1).
    # Prompt 1: scores (2, 0), both right -> (2, -2) and (0, 0): the scorer's preference here is noise.
    # Pearson over the 4 rows (both means 0): sum xy = 4, sum x^2 = 16, sum y^2 = 2 -> 4 / sqrt(32).
    # A third prompt with weight 0 (a rank's repeat) must not count.
    scores = torch.tensor([[1.0, 3.0], [2.0, 0.0], [5.0, -5.0]])
    right = torch.tensor([[0, 1], [1, 1], [0, 1]], dtype=torch.bool)
    m = selection_metrics(scores, right, torch.tensor([1.0, 1.0, 0.0]))
    assert advantage_correlation(m) == pytest.approx(1 / 2**0.5)
    # a scorer that agrees with the verifier everywhere it can: 1; one that cannot vary: 0 (no signal)
    assert advantage_correlation(selection_metrics(right.float(), right, torch.ones(3))) == pytest.approx(1.0)
    assert advantage_correlation(selection_metrics(torch.zeros(3, 2), right, torch.ones(3))) == 0.0


def test_selection_metrics_ties_go_to_the_first_answer():
    # A scorer that scores everything alike must not look like a good picker.
    m = selection_metrics(torch.zeros(2, 2), torch.tensor([[0, 1], [0, 1]]), torch.ones(2))
    assert m["best"] == 0.0 and m["any"] == 2.0


def test_selection_accuracy_lets_a_real_reward_model_pick(tmp_path):
    # The reward model scores +8 for a text ending in 9 and -8 for one ending in 8 (the byte tokenizer's
    # real forward pass, scored at the last response token). For the first prompt it must pick " 579"
    # wherever it sits among the answers; the second prompt's answers are all wrong.
    from dschat.models.loading import load_tokenizer
    from dschat.models.reward import load_reward_model
    from dschat.policy_pairs import PolicySamples, selection_accuracy
    from tests.tiny_chat_models import sign_reward_model

    path = str(sign_reward_model(tmp_path / "rm"))
    tokenizer = load_tokenizer(path)
    rm = load_reward_model(path, tokenizer=tokenizer).eval()
    a, b = make_prompt("What is 500 + 79?"), make_prompt("What is 500 + 78?")
    samples = PolicySamples(  # 2 prompts x 3 answers: a transposed grouping would not pass
        prompts=[a, b],
        answers=[" 578", " 579", " 578", " 578", " 578", " 579"],
        right=[False, True, False, False, False, False],
        weight=[1.0, 1.0],
        k=3,
    )
    m = selection_accuracy(rm.score, tokenizer, samples, batch_size=2, max_len=64, device="cpu")
    # RLOO advantages (K = 3, scores +-8): prompt a (-8, 16, -8) against the verifier's (-1/2, 1, -1/2),
    # prompt b (-8, -8, 16) against (0, 0, 0): sum xy = 24, sum x^2 = 768, sum y^2 = 3/2 -> 1 / sqrt(2)
    # the six scores (-8, 8, -8, -8, -8, 8): mean -8/3, mean square 64, std sqrt(64 - 64/9)
    assert m == {"best_of_k_accuracy": 0.5, "sampled_accuracy": pytest.approx(1 / 6), "pass_at_k": 0.5,
                 "advantage_correlation": pytest.approx(1 / 2**0.5, abs=1e-3), "answers": 6.0,
                 "score_mean": pytest.approx(-8 / 3, abs=1e-2), "score_std": pytest.approx((64 - 64 / 9) ** 0.5, abs=1e-2)}  # fmt: skip
    moved = PolicySamples([a, b], [" 579", " 578", " 578", " 578", " 578", " 579"],
                          [True, False, False, False, False, False], [1.0, 1.0], 3)  # fmt: skip
    # the same answers elsewhere in their groups, scored in other batches: sums differ in the last digits
    assert selection_accuracy(
        rm.score, tokenizer, moved, batch_size=4, max_len=64, device="cpu"
    ) == pytest.approx(m, rel=1e-4)
    with pytest.raises(ValueError, match="2 prompts x k=3 need 6 answers"):
        PolicySamples([a, b], [" 579"] * 5, [True] * 5, [1.0, 1.0], 3)


def test_mine_policy_negatives_keeps_each_prompts_answers_together(tmp_path):
    # A policy that answers every prompt " 579": right for one prompt, wrong (one pair) for the other.
    from dschat.models.loading import load_for_generation
    from dschat.policy_pairs import mine_policy_negatives
    from tests.tiny_chat_models import chain_model

    model, tokenizer = load_for_generation(str(chain_model(tmp_path / "p", " 579")))
    a, b = make_prompt("What is 500 + 79?"), make_prompt("What is 500 + 78?")
    pairs, stats, samples = mine_policy_negatives(
        model, tokenizer, [a, make_prompt("Hello"), b], samples_per_prompt=3, max_new_tokens=8,
        temperature=1.0, device="cpu", seed=0,
    )  # fmt: skip
    assert samples.prompts == [a, b] and samples.k == 3 and samples.weight == [1.0, 1.0]
    assert samples.answers == [" 579"] * 6 and samples.right == [True] * 3 + [False] * 3
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [(b, " 578", " 579")]
    assert stats == {"prompts": 2.0, "answers": 6.0, "wrong_answers": 3.0, "pairs": 1.0,
                     "sampled_accuracy": 0.5, "pass_at_k": 0.5}  # fmt: skip


def test_best_worst_pairs_by_hand():
    # 4 prompts x 3 answers (scores, cut off?):
    # p0: A 1.0, B 3.0 cut off, C -2.0 -> chosen A (B's 3.0 is cut off), rejected C, margin 3.0
    # p1: all three cut off -> no pair (no chosen side can end)
    # p2: " x" 0.5, " x " 0.5 (the same text once stripped), "  " (empty) -> no pair
    # p3: D 2.0, E 1.5, F 1.8 -> chosen D, rejected E, margin 0.5: under a min margin of 1.0, dropped
    prompts = ["p0", "p1", "p2", "p3"]
    answers = [" A", " B", " C", " G", " H", " I", " x", " x ", "  ", " D", " E", " F"]
    scores = [1.0, 3.0, -2.0, 0.0, 1.0, 2.0, 0.5, 0.5, 9.0, 2.0, 1.5, 1.8]
    cut = [False, True, False, True, True, True, False, False, False, False, False, False]
    pairs, margins = best_worst_pairs(prompts, answers, scores, cut, 3, 0.0)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("p0", " A", " C"), ("p3", " D", " E")]
    assert margins == [3.0, 0.5] and all(p.source == "policy" for p in pairs)
    pairs, margins = best_worst_pairs(prompts, answers, scores, cut, 3, 1.0)
    assert [p.prompt for p in pairs] == ["p0"] and margins == [3.0]
    # a tie says nothing about which answer is better, even where one was cut off: no pair
    assert best_worst_pairs(["t"], [" a", " b"], [1.0, 1.0], [True, False], 2, 0.0) == ([], [])
    # the lowest-scored answer may itself be cut off: it is still a fine rejected side
    pairs, _ = best_worst_pairs(["q"], [" a", " b"], [1.0, -1.0], [False, True], 2, 0.0)
    assert [(p.chosen, p.rejected) for p in pairs] == [(" a", " b")]
    with pytest.raises(ValueError, match="2 prompts x k=3 need 6"):
        best_worst_pairs(["a", "b"], [" x"] * 5, [0.0] * 5, [False] * 5, 3, 0.0)


def test_best_worst_pairs_score_one_text_once():
    """Copies of one answer text are one answer (their scores differ only by batch rounding, or by
    nothing): it was best by one copy and worst by the other, and the prompt gave no pair although
    another text scored between them. Now each text takes its copies' mean score."""
    answers, cut = [" A", " A ", " B"], [False] * 3
    pairs, margins = best_worst_pairs(["p"], answers, [0.50, 0.30, 0.45], cut, 3, 0.0)
    assert [(p.chosen, p.rejected) for p in pairs] == [(" B", " A")] and margins == pytest.approx([0.05])
    pairs, margins = best_worst_pairs(["p"], answers, [0.50, 0.46, 0.45], cut, 3, 0.0)
    assert [(p.chosen, p.rejected) for p in pairs] == [(" A", " B")] and margins == pytest.approx([0.03])


def test_text_replies_say_which_answers_ran_out_of_tokens(tmp_path):
    # A model that answers " 579" then EOS: cut off with a budget of 2 new tokens, ended with 8; one that
    # cycles ":579:579..." never ends.
    from dschat.generation.texts import generate_text_replies
    from dschat.models.loading import load_for_generation
    from tests.tiny_chat_models import chain_model

    q = [make_prompt("What is 500 + 79?"), make_prompt("Hello")]
    model, tokenizer = load_for_generation(str(chain_model(tmp_path / "eos", " 579")))
    assert generate_text_replies(model, tokenizer, q, max_new_tokens=8) == ([" 579", " 579"], [False, False])
    assert generate_text_replies(model, tokenizer, q, max_new_tokens=2) == ([" 5", " 5"], [True, True])
    model, tokenizer = load_for_generation(str(chain_model(tmp_path / "cycle", " 579", end="cycle")))
    texts, cut_off = generate_text_replies(model, tokenizer, q, max_new_tokens=8)
    assert texts == [" 579: 57"] * 2 and cut_off == [True, True]


def test_mine_scored_pairs_prefers_what_the_reward_model_prefers(tmp_path):
    # At temperature 12 the chain model answers " 579" (ended) or random bytes (mostly cut off); the
    # reward model scores +8 for a text ending in 9. Every pair's chosen answer scores at least its
    # rejected one's and differs from it, the chosen side is always an ended " 579", and the stats count
    # what was sampled.
    from dschat.models.loading import load_for_generation, load_tokenizer
    from dschat.models.reward import load_reward_model
    from dschat.policy_pairs import mine_scored_pairs
    from dschat.scoring import score_texts
    from tests.tiny_chat_models import chain_model, sign_reward_model

    model, tokenizer = load_for_generation(str(chain_model(tmp_path / "p", " 579")))
    rm_path = str(sign_reward_model(tmp_path / "rm"))
    rm = load_reward_model(rm_path, tokenizer=load_tokenizer(rm_path)).eval()
    prompts = [make_prompt(f"Question {i}") for i in range(6)]
    kw = dict(samples_per_prompt=4, max_new_tokens=6, temperature=12.0, device="cpu", seed=0)
    pairs, stats = mine_scored_pairs(model, tokenizer, prompts, rm, **kw)
    assert stats["prompts"] == 6 and stats["answers"] == 24 and 0 < stats["pairs"] == len(pairs) <= 6
    assert 0.0 < stats["cut_off_fraction"] < 1.0
    chosen = score_texts(rm, tokenizer, [p.prompt for p in pairs], [p.chosen for p in pairs]).tolist()
    rejected = score_texts(rm, tokenizer, [p.prompt for p in pairs], [p.rejected for p in pairs]).tolist()
    margins = [c - r for c, r in zip(chosen, rejected)]
    assert all(m >= 0 for m in margins) and all(p.chosen != p.rejected for p in pairs)
    assert {p.chosen for p in pairs} == {" 579"}
    assert stats["mean_margin"] == pytest.approx(sum(margins) / len(margins), abs=1e-3)
    # a margin no pair reaches keeps none
    assert mine_scored_pairs(model, tokenizer, prompts, rm, min_margin=100.0, **kw)[0] == []


def test_an_answer_that_invents_the_next_turn_ended_there(tmp_path, monkeypatch):
    # Human/Assistant format: " 9\n\nHuman: ..." ran out of tokens while writing a turn of its own; cut at
    # the stop string it is an ended " 9", the reward model's favourite (+8), and becomes chosen.
    import dschat.policy_pairs as pp
    from dschat.generation.decoding import Replies
    from dschat.models.loading import load_tokenizer
    from dschat.models.reward import load_reward_model
    from tests.tiny_chat_models import sign_reward_model

    rm_path = str(sign_reward_model(tmp_path / "rm"))
    tokenizer = load_tokenizer(rm_path)
    rm = load_reward_model(rm_path, tokenizer=tokenizer).eval()
    replies = Replies([" 9\n\nHuman: and then", " 8"], [True, False])
    monkeypatch.setattr(pp, "generate_text_replies", lambda *a, **k: replies)
    pairs, stats = pp.mine_scored_pairs(None, tokenizer, [make_prompt("Q")], rm, samples_per_prompt=2,
                                        max_new_tokens=4, temperature=1.0, device="cpu", seed=0)  # fmt: skip
    assert [(p.chosen, p.rejected) for p in pairs] == [(" 9", " 8")]
    assert stats["cut_off_fraction"] == 0.0 and stats["mean_margin"] == pytest.approx(16.0, abs=0.1)
