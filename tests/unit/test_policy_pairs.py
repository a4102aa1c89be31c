"""dschat.policy_pairs: which sampled answers become on-policy rejected responses."""

from __future__ import annotations

import pytest
import torch

from dschat.policy_pairs import selection_metrics, wrong_answer_pairs
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
    assert m == {"best": 1.0, "sampled": pytest.approx(1 / 3 + 2 / 3), "any": 2.0, "n": 3.0}


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
    samples = PolicySamples(
        prompts=[a, a, b],
        answers=[" 578", " 579", " 578", " 579", " 578", " 578", " 579", " 577", " 579"],
        right=[False, True, False, True, False, False, False, False, False],
        weight=[1.0, 1.0, 1.0],
        k=3,
    )
    m = selection_accuracy(rm.score, tokenizer, samples, batch_size=2, max_len=64, device="cpu")
    assert m == {"best_of_k_accuracy": pytest.approx(2 / 3), "sampled_accuracy": pytest.approx(2 / 9),
                 "pass_at_k": pytest.approx(2 / 3)}  # fmt: skip
    flipped = PolicySamples(**{**samples.__dict__, "answers": [" 579", " 578", " 578"] * 3})
    flipped.right = [True, False, False, True, False, False, False, False, False]
    assert selection_accuracy(rm.score, tokenizer, flipped, batch_size=4, max_len=64, device="cpu")[
        "best_of_k_accuracy"
    ] == pytest.approx(2 / 3)
