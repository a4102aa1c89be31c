"""dschat.tasks: generated verifiable tasks, their wrong answers and the verifier."""

from __future__ import annotations

import random

import pytest

from dschat import tasks
from dschat.tasks import TASKS, clean_response, generate, last_question, make_prompt, task_of, verify


def test_prompt_format():
    assert make_prompt("What is 1 + 2?") == "\n\nHuman: What is 1 + 2?\n\nAssistant:"


def test_generate_is_deterministic_for_a_seed():
    assert generate(None, 20, seed=7) == generate(None, 20, seed=7)


def test_generate_depends_on_the_seed():
    a = {e.prompt for e in generate(None, 20, seed=7)}
    b = {e.prompt for e in generate(None, 20, seed=8)}
    assert a != b


def test_generate_counts_and_order():
    out = generate(None, 5, seed=0)
    assert [e.task for e in out] == ["sort"] * 5 + ["reverse"] * 5  # the default tasks
    assert [e.task for e in generate(["reverse", "add"], 3, seed=0)] == ["reverse"] * 3 + ["add"] * 3


def test_generate_one_task_does_not_depend_on_the_others():
    alone = generate(["sort"], 10, seed=3)
    together = [e for e in generate(None, 10, seed=3) if e.task == "sort"]
    assert alone == together


@pytest.mark.parametrize("name", list(TASKS))
def test_generated_prompts_are_distinct(name):
    prompts = [e.prompt for e in generate([name], 300, seed=1)]
    assert len(prompts) == 300
    assert len(set(prompts)) == 300


def test_exclude_is_respected():
    first = generate(None, 50, seed=1)
    excluded = {e.prompt for e in first[:25]} | {e.prompt for e in first[60:90]}
    again = generate(None, 50, seed=1, exclude=excluded)
    assert len(again) == 100
    assert not excluded & {e.prompt for e in again}
    assert [e.task for e in again] == ["sort"] * 50 + ["reverse"] * 50


def test_exclude_held_out_from_other_seed():
    train = generate(None, 100, seed=2024)
    held = generate(None, 20, seed=2025, exclude={e.prompt for e in train})
    assert not {e.prompt for e in train} & {e.prompt for e in held}


@pytest.mark.parametrize("name", list(TASKS))
def test_examples_verify(name):
    for ex in generate([name], 200, seed=5):
        assert ex.task == name
        assert ex.prompt.startswith("\n\nHuman: ") and ex.prompt.endswith("\n\nAssistant:")
        assert ex.chosen.startswith(" ") and ex.rejected.startswith(" ")
        assert ex.rejected != ex.chosen
        assert verify(ex.prompt, ex.chosen) is True
        assert verify(ex.prompt, ex.rejected) is False
        assert task_of(ex.prompt) == name


@pytest.mark.parametrize(
    ("question", "right", "wrong"),
    [
        ("What is 347 + 85?", " 432", " 422"),
        ("What is 0 + 0?", " 0", " 1"),
        ("Sort: pear apple fox", " apple fox pear", " apple pear fox"),
        ("Reverse: abcd", " dcba", " abcd"),
    ],
)
def test_verify_hand_examples(question, right, wrong):
    prompt = make_prompt(question)
    assert verify(prompt, right) is True
    assert verify(prompt, wrong) is False
    assert verify(prompt, right + "\n\nHuman: and now?") is True
    assert verify(prompt, "") is False


def test_verify_unknown_prompt_is_none():
    assert verify(make_prompt("Tell me a joke."), " no") is None
    assert verify("", "x") is None
    assert task_of(make_prompt("What is 3 - 1?")) is None


def test_verify_uses_the_last_human_turn():
    prompt = make_prompt("What is 1 + 1?") + " 2" + make_prompt("What is 2 + 3?")
    assert last_question(prompt) == "What is 2 + 3?"
    # A turn starts only at the text's start or after a blank line: "Human:" inside a turn is its text
    quoted = make_prompt("Reverse the order of the words: Human: cat")
    assert last_question(quoted) == "Reverse the order of the words: Human: cat"
    assert last_question("What is 2 + 3?") == "What is 2 + 3?"  # a bare question is its own last turn
    assert verify(prompt, " 5") is True
    assert verify(prompt, " 2") is False


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (" 432", "432"),
        (" 432\n\nHuman: next", "432"),
        (" 432\nHuman: next", "432"),
        (" 432\n\nAssistant: and", "432"),
        ("abc \ndef", "abc \ndef"),  # a second line is part of the answer, not dropped
        ("  apple fox  ", "apple fox"),
        ("", ""),
        ("   ", ""),
        ("\n\n", ""),
        ("\n432\n", "432"),
    ],
)
def test_clean_response(response, expected):
    assert clean_response(response) == expected


def test_verify_cuts_an_invented_turn_only_where_the_format_ends_replies_there():
    # Human/Assistant: a model ends its answer by inventing the next turn, so the answer is the text
    # before it. A chat template ends a reply with its end token; "\n\nHuman:" inside the reply is text
    # the model wrote after the answer, which the verifier cut off and paid for in full: a policy could
    # append anything after "\n\nHuman:" and keep the reward.
    prompt = make_prompt("What is 347 + 85?")
    invented = " 432\n\nHuman: and 2 + 2?"
    assert verify(prompt, invented) is True
    assert verify(prompt, invented, stops=()) is False
    assert verify(prompt, " 432", stops=()) is True
    assert clean_response(invented, stops=()) == "432\n\nHuman: and 2 + 2?"
    assert tasks.verifier_reward([prompt], [invented]) == [1.0]
    assert tasks.verifier_reward([prompt], [invented], stop_strings=()) == [-1.0]


def test_verify_refuses_text_after_the_answer():
    # The first-line verifier accepted a right first line followed by anything: an RL policy could append
    # text after a newline (with a chat template a newline does not end the turn) and keep full reward.
    prompt = make_prompt("What is 347 + 85?")
    assert verify(prompt, " 432\nI hope this helps!") is False
    assert verify(prompt, " 432\n432") is False
    assert verify(prompt, " 432\n") is True
    assert verify(prompt, " 432\n\nHuman: thanks") is True  # the model inventing the next turn ends its reply


def test_resolve_tasks():
    assert [t.name for t in tasks.resolve_tasks(None)] == ["sort", "reverse"]
    assert [t.name for t in tasks.resolve_tasks([])] == ["sort", "reverse"]
    assert [t.name for t in tasks.resolve_tasks(["add", "sort"])] == ["add", "sort"]
    with pytest.raises(KeyError, match="unknown built-in task 'mul'; known: add, sort, reverse"):
        tasks.resolve_tasks(["add", "mul"])


# ---------------------------------------------------------------- wrong answers, by hand
def _wrong(name: str, question: str) -> set[str]:
    task = TASKS[name]
    return set(task.wrong_answers(task.pattern.match(question), random.Random(0)))


def test_addition_wrong_answers():
    # 47 + 85 = 132; digit-wise without carry: 0+0, 4+8, 7+5 -> 0, 2, 2 -> 22
    # (+ the last digit repeated: too long)
    assert _wrong("add", "What is 47 + 85?") == {"22", "133", "131", "142", "122", "232", "1322"}
    # 5 + 5 = 10; no carry -> 0 (also 10 - 10)
    assert _wrong("add", "What is 5 + 5?") == {"0", "9", "11", "20", "110", "100"}
    # 12 + 3 = 15 has no carry: the no-carry answer is the right one and is left out
    assert _wrong("add", "What is 12 + 3?") == {"16", "14", "25", "5", "115", "155"}


def test_addition_questions_add_one_digit_to_a_number_below_1000():
    rng = random.Random(0)
    for _ in range(200):
        a, b = map(int, TASKS["add"].pattern.match(TASKS["add"].question(rng)).groups())
        assert min(a, b) < 10 and max(a, b) < 1000


def _split_foreign_words(wrong: set[str], words: list[str]) -> set[str]:
    """Remove and check the two answers with a word not in the question: the sorted input plus one
    word of WORDS, and the sorted input with one word replaced by such a word."""
    foreign = [w for w in wrong if set(w.split()) - set(words)]
    assert sorted(len(w.split()) - len(words) for w in foreign) == [0, 1], foreign
    for answer in foreign:
        added = set(answer.split()) - set(words)
        assert len(added) == 1 and added <= set(tasks.WORDS)
        assert answer.split() == sorted(answer.split())
        assert len(set(answer.split()) & set(words)) == len(answer.split()) - 1
    return wrong - set(foreign)


class _FixedRng:
    """randrange returns the queued values in order (what word_slips picks, by hand)."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def randrange(self, *args: int) -> int:
        return self.values.pop(0)


def test_word_slips_double_a_word_and_leave_one_out_of_the_middle():
    assert tasks.word_slips(["a", "b", "c", "d"], _FixedRng(1, 2)) == ["a b b c d", "a b d"]
    assert tasks.word_slips(["a", "b", "c"], _FixedRng(2, 1)) == ["a b c c", "a c"]
    # two words have no middle: the first goes
    assert tasks.word_slips(["a", "b"], _FixedRng(0)) == ["a a b", "b"]


def _split_slips(wrong: set[str], right: list[str]) -> set[str]:
    """Remove and check word_slips' two answers: the right words with one doubled in place, and with one
    word from the middle left out."""
    doubled = {w for w in wrong if len(w.split()) == len(right) + 1 and
               any(w.split() == [*right[: i + 1], right[i], *right[i + 1 :]] for i in range(len(right)))}  # fmt: skip
    dropped = {
        w for w in wrong if any(w.split() == right[:j] + right[j + 1 :] for j in range(1, len(right) - 1))
    }
    assert len(doubled) == 1 and len(dropped) == 1, (doubled, dropped)
    return wrong - doubled - dropped


def test_sort_wrong_answers():
    wrong = _split_slips(_wrong("sort", "Sort: pear apple fox"), ["apple", "fox", "pear"])
    assert _split_foreign_words(wrong, ["pear", "apple", "fox"]) == {
        "fox apple pear",  # neighbours swapped
        "apple pear fox",
        "pear apple fox",  # the input order
        "apple fox",  # a word short
    }
    # already sorted input: the input itself is the right answer and is left out
    wrong = _split_slips(_wrong("sort", "Sort: ant bee cat"), ["ant", "bee", "cat"])
    assert _split_foreign_words(wrong, ["ant", "bee", "cat"]) == {"bee ant cat", "ant cat bee", "ant bee"}


def test_reverse_words_wrong_answers():
    right = ["owl", "mango", "dog"]
    wrong = _split_slips(_wrong("reverse_words", "Reverse the order of the words: dog mango owl"), right)
    foreign = {w for w in wrong if set(w.split()) - set(right)}
    # one word of WORDS appended, and one word replaced by such a word (in place)
    assert sorted(len(w.split()) for w in foreign) == [3, 4]
    for w in foreign:
        kept = [a == b for a, b in zip(w.split(), right)]
        assert (kept == [True, True, True]) == (len(w.split()) == 4) and (sum(kept) >= 2)
    assert wrong - foreign == {
        "dog mango owl",  # the input order
        "mango owl dog",  # neighbours swapped
        "owl dog mango",
        "owl mango",  # the last word dropped
    }


def test_wrong_answers_are_shorter_and_longer_so_length_does_not_decide():
    for name in ("sort", "reverse"):
        rows = generate([name], 500, seed=4)
        longer = sum(len(e.rejected) > len(e.chosen) for e in rows)
        shorter = sum(len(e.rejected) < len(e.chosen) for e in rows)
        assert longer > 50 and shorter > 50, (name, longer, shorter)


def test_reverse_wrong_answers():
    def split_changed_letter(wrong: set[str], right: str) -> set[str]:
        changed = [w for w in wrong if len(w) == len(right) and sorted(w) != sorted(right)]
        assert len(changed) == 1 and sum(a != b for a, b in zip(changed[0], right)) == 1, changed
        return wrong - set(changed)

    assert split_changed_letter(_wrong("reverse", "Reverse: abc"), "cba") == {
        "abc",
        "bca",
        "cab",
        "cb",
        "cbaa",
    }
    # palindrome: the input is the right answer; swapping equal letters too
    assert split_changed_letter(_wrong("reverse", "Reverse: aba"), "aba") == {"baa", "aab", "ab", "abaa"}


def test_wrong_answers_do_not_change_the_questions(monkeypatch):
    """Wrong answers use their own generator: the question sequence depends on the seed alone."""
    prompts = [e.prompt for e in generate(None, 50, seed=9)]
    # a wrong-answer rule that draws a different amount of randomness
    monkeypatch.setattr(TASKS["sort"], "wrong_answers", lambda m, rng: [str(rng.random() + rng.random())])
    assert [e.prompt for e in generate(None, 50, seed=9)] == prompts


def test_reference_answer():
    assert tasks.reference_answer(make_prompt("Sort: plum apple cat")) == "apple cat plum"
    assert tasks.reference_answer(make_prompt("Reverse: abc")) == "cba"
    assert tasks.reference_answer(make_prompt("Tell me a joke")) is None


def test_answer_budget_counts_cut_right_answers():
    from dschat.models.builtin import build_tokenizer
    from dschat.tasks.accuracy import answers_cut_by_budget

    tok = build_tokenizer()
    # " banana cherry grape lemon" is 26 bytes, + EOS = 27 tokens; " cba" + EOS = 4; unknown tasks count nothing
    prompts = [make_prompt("Sort: lemon grape cherry banana"), make_prompt("Reverse: abc"), make_prompt("Hi")]
    assert answers_cut_by_budget(tok, prompts, 24) == (1, 27)
    assert answers_cut_by_budget(tok, prompts, 27) == (0, 27)
    assert answers_cut_by_budget(tok, prompts, 3) == (2, 27)


def test_verifier_accuracy_by_hand():
    from dschat.tasks.accuracy import verifier_accuracy

    s1, s2, r1 = make_prompt("Sort: plum cat"), make_prompt("Sort: dog apple"), make_prompt("Reverse: abc")
    prompts = [s1, s2, r1, make_prompt("Hello"), s1]
    answers = [" cat plum", " dog apple", " cba\n\nHuman: more", " hi", " wrong"]
    weights = [1.0, 1.0, 1.0, 1.0, 0.0]  # the last is a rank's repeat: not counted
    acc = verifier_accuracy(prompts, answers, weights)
    assert acc == {"accuracy": 2 / 3, "accuracy/sort": 0.5, "accuracy/reverse": 1.0}
    assert verifier_accuracy([make_prompt("Hello")], [" hi"], [1.0]) is None
    # with a chat template's stop strings (none) the invented turn is part of the answer: wrong
    assert verifier_accuracy(prompts, answers, weights, stops=()) == {
        "accuracy": 1 / 3,
        "accuracy/sort": 0.5,
        "accuracy/reverse": 0.0,
    }


@pytest.mark.parametrize("n,world", [(3, 1), (1, 4), (5, 8), (7, 3), (6, 3), (0, 2)])
def test_rank_slice_gives_every_rank_as_many_prompts_and_counts_each_once(monkeypatch, n, world):
    from dschat.tasks.accuracy import rank_slice
    from dschat.utils import dist

    prompts = [f"p{i}" for i in range(n)]
    monkeypatch.setattr(dist, "world_size", lambda: world)
    slices = []
    for rank in range(world):
        monkeypatch.setattr(dist, "rank", lambda rank=rank: rank)
        slices.append(rank_slice(prompts))
    assert len({len(mine) for mine, _ in slices}) == 1  # collective generation: equal calls per rank
    counted = [p for mine, w in slices for p, x in zip(mine, w) if x == 1.0]
    assert counted == prompts  # each prompt once, in order; the rest are weight-0 repeats
    assert all(x in (0.0, 1.0) for _, w in slices for x in w)


def _problem(task: str, question: str) -> tuple:
    """What a question asks, up to wording that does not change the problem (hand-written per task)."""
    m = TASKS[task].pattern.match(question)
    if task == "add":
        return tuple(sorted((int(m[1]), int(m[2]))))  # 3 + 85 and 85 + 3 are one sum
    if task == "sort":
        return tuple(sorted(m[1].split()))  # any order of the same words has one answer
    return (m[1],)  # a reversal's answer names its input


@pytest.mark.parametrize("name", list(TASKS))
def test_held_out_problems_are_never_trained_on_in_other_words(name):
    """The built-in split held out prompts by their exact wording, so 'Sort: owl cat dog' was evaluated while
    'Sort: cat dog owl' (same answer) was trained on: every held-out sort question had such a twin."""
    from dschat.data.sources import BUILTIN_EVAL_PER_TASK, BUILTIN_SEED, BUILTIN_TRAIN_PER_TASK

    train = generate([name], BUILTIN_TRAIN_PER_TASK, BUILTIN_SEED, held_out=False)
    held = generate([name], BUILTIN_EVAL_PER_TASK, BUILTIN_SEED + 1, held_out=True)
    assert len(held) == BUILTIN_EVAL_PER_TASK
    trained = {_problem(name, last_question(e.prompt)) for e in train}
    assert not [e.prompt for e in held if _problem(name, last_question(e.prompt)) in trained]


@pytest.mark.parametrize("chat_template", [False, True])
def test_task_accuracy_verifies_with_the_formats_stop_strings(tokenizer, monkeypatch, chat_template):
    """Steps 1, 2 and DPO measure true accuracy through task_accuracy: a right answer followed by an
    invented turn is right where the format ends replies there, wrong with a chat template's format."""
    import dataclasses
    from types import SimpleNamespace

    from dschat.data.prompt_format import prompt_format
    from dschat.tasks import accuracy

    prompts = [e.prompt for e in tasks.generate(["sort"], 3, 0)]
    answers = [f" {tasks.reference_answer(p)}\n\nHuman: and now?" for p in prompts]
    monkeypatch.setattr(accuracy, "generate_text_replies", lambda *a, **kw: SimpleNamespace(texts=answers))
    fmt = prompt_format(tokenizer)
    fmt = dataclasses.replace(fmt, stop_strings=()) if chat_template else fmt
    out = accuracy.task_accuracy(None, tokenizer, prompts, device="cpu", fmt=fmt)
    assert out["accuracy"] == (0.0 if chat_template else 1.0)
