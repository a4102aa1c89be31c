"""dschat.policy_pairs: which sampled answers become on-policy rejected responses."""

from __future__ import annotations

from dschat.policy_pairs import wrong_answer_pairs
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
