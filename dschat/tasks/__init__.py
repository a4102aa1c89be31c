"""Built-in verifiable tasks: the embedded default data set.

Each task generates questions deterministically from a seed, knows the right answer, produces
plausible wrong answers (the ``rejected`` side of a preference pair) and verifies a model's reply, so
every step can measure true accuracy and not only a learned reward.

Prompts use the Human/Assistant dialogue form of the HH-RLHF data::

    "\\n\\nHuman: What is 347 + 85?\\n\\nAssistant:"   ->   " 432"
"""

from __future__ import annotations

import random
import re
import string
import zlib
from dataclasses import dataclass
from typing import Protocol

from dschat.data.prompt_format import TURN_STOPS, cut_reply, is_dialogue, make_prompt, parse_dialogue


class Task(Protocol):
    name: str
    pattern: re.Pattern[str]

    def question(self, rng: random.Random) -> str: ...
    def problem(self, match: re.Match[str]) -> str: ...
    def answer(self, match: re.Match[str]) -> str: ...
    def wrong_answers(self, match: re.Match[str], rng: random.Random) -> list[str]: ...


class Addition:
    """Add a one-digit number to a number below 1000, in either order; wrong answers are off by one or
    ten, forget the carry, or repeat the last digit (too long, so length alone never tells them apart).
    """

    name = "add"
    pattern = re.compile(r"^What is (\d+) \+ (\d+)\?$")

    def question(self, rng: random.Random) -> str:
        a, b = rng.randrange(1000), rng.randrange(10)
        if rng.random() < 0.5:
            a, b = b, a
        return f"What is {a} + {b}?"

    def problem(self, match: re.Match[str]) -> str:
        return " + ".join(sorted((match[1], match[2]), key=int))  # 3 + 85 and 85 + 3 are one sum

    def answer(self, match: re.Match[str]) -> str:
        return str(int(match[1]) + int(match[2]))

    def wrong_answers(self, match: re.Match[str], rng: random.Random) -> list[str]:
        a, b = int(match[1]), int(match[2])
        right = a + b
        no_carry = int("".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:03d}", f"{b:03d}")))
        near = [right + d for d in (1, -1, 10, -10, 100) if right + d >= 0]
        out = [str(v) for v in [no_carry, *near] if v != right]
        out.append(str(right) + str(right)[-1])
        rng.shuffle(out)
        return out


WORDS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum", "cat", "dog", "fox", "owl"]


def word_slips(right: list[str], rng: random.Random) -> list[str]:
    """The slips a small model makes when it copies words: one word written twice in a row, and one word
    from the middle left out (the other wrong answers drop only the last). A reward model that had not
    seen these scored "owl mango mango dog" above the right "owl mango dog" and PPO learnt to repeat
    words (measured on the step-1 SmolLM2's samples, 2026-11-25)."""
    i = rng.randrange(len(right))
    doubled = [*right[: i + 1], right[i], *right[i + 1 :]]
    j = rng.randrange(1, len(right) - 1) if len(right) > 2 else 0
    dropped = right[:j] + right[j + 1 :]
    return [" ".join(doubled), " ".join(dropped)]


class SortWords:
    """Sort 3-4 words alphabetically; wrong answers swap a neighbouring pair, keep the input order, drop a
    word, add one, double one or leave one out of the middle (shorter and longer wrong answers, so length
    alone never tells them apart) or replace one with a word that is not in the question (sorted, so
    order alone does not tell them apart either: a reward model trained without these was exploited by
    PPO answers made of late-alphabet words)."""

    name = "sort"
    pattern = re.compile(r"^Sort: ([a-z ]+)$")

    def question(self, rng: random.Random) -> str:
        return "Sort: " + " ".join(rng.sample(WORDS, rng.randint(3, 4)))

    def problem(self, match: re.Match[str]) -> str:
        return self.answer(match)  # every order of the same words is one problem

    def answer(self, match: re.Match[str]) -> str:
        return " ".join(sorted(match[1].split()))

    def wrong_answers(self, match: re.Match[str], rng: random.Random) -> list[str]:
        words = sorted(match[1].split())
        out = []
        for i in range(len(words) - 1):
            w = list(words)
            w[i], w[i + 1] = w[i + 1], w[i]
            out.append(" ".join(w))
        out.append(match[1])
        out.append(" ".join(words[:-1]))
        extra = [w for w in WORDS if w not in words]
        out.append(" ".join(sorted([*words, rng.choice(extra)])))
        replaced = list(words)
        replaced[rng.randrange(len(words))] = rng.choice(extra)
        out.append(" ".join(sorted(replaced)))
        out.extend(word_slips(words, rng))
        right = " ".join(words)
        out = [o for o in dict.fromkeys(out) if o != right]
        rng.shuffle(out)
        return out


class ReverseLetters:
    """Reverse a string of 3-5 letters; wrong answers are the input itself, a near-miss reversal, one
    letter short, one letter too many, or one letter changed."""

    name = "reverse"
    pattern = re.compile(r"^Reverse: ([a-z]+)$")

    def question(self, rng: random.Random) -> str:
        return "Reverse: " + "".join(rng.choices(string.ascii_lowercase[:8], k=rng.randint(3, 5)))

    def problem(self, match: re.Match[str]) -> str:
        return match[1]

    def answer(self, match: re.Match[str]) -> str:
        return match[1][::-1]

    def wrong_answers(self, match: re.Match[str], rng: random.Random) -> list[str]:
        s, right = match[1], match[1][::-1]
        out = [s]
        for i in range(len(right) - 1):
            w = list(right)
            w[i], w[i + 1] = w[i + 1], w[i]
            out.append("".join(w))
        out.append(right[:-1])
        out.append(right + right[-1])
        i = rng.randrange(len(right))
        other = rng.choice([c for c in string.ascii_lowercase[:8] if c != right[i]])
        out.append(right[:i] + other + right[i + 1 :])
        out = [o for o in dict.fromkeys(out) if o != right]
        rng.shuffle(out)
        return out


class ReverseWords:
    """Reverse the order of 3-5 words (a task for BPE models, where a word is a token or two and letters
    are not); wrong answers keep the input order, swap a neighbouring pair, drop a word, add one, double
    one, leave one out of the middle, or replace one with a word that is not in the question."""

    name = "reverse_words"
    pattern = re.compile(r"^Reverse the order of the words: ([a-z ]+)$")

    def question(self, rng: random.Random) -> str:
        return "Reverse the order of the words: " + " ".join(rng.sample(WORDS, rng.randint(3, 5)))

    def problem(self, match: re.Match[str]) -> str:
        return match[1]

    def answer(self, match: re.Match[str]) -> str:
        return " ".join(match[1].split()[::-1])

    def wrong_answers(self, match: re.Match[str], rng: random.Random) -> list[str]:
        words = match[1].split()
        right = words[::-1]
        out = [" ".join(words)]
        for i in range(len(right) - 1):
            w = list(right)
            w[i], w[i + 1] = w[i + 1], w[i]
            out.append(" ".join(w))
        out.append(" ".join(right[:-1]))
        extra = [w for w in WORDS if w not in words]
        out.append(" ".join([*right, rng.choice(extra)]))
        replaced = list(right)
        replaced[rng.randrange(len(right))] = rng.choice(extra)
        out.append(" ".join(replaced))
        out.extend(word_slips(right, rng))
        out = [o for o in dict.fromkeys(out) if o != " ".join(right)]
        rng.shuffle(out)
        return out


TASKS_VERSION = 10  # part of the data-cache key: bump when generation changes

TASKS: dict[str, Task] = {t.name: t for t in (Addition(), SortWords(), ReverseLetters(), ReverseWords())}
# ``builtin`` without a task list. Addition stays available (``builtin:add``) but is not a default: the tiny
# default model does not learn it within step 1's budget (0% true accuracy even for 1-digit + 3-digit sums,
# measured), so it would only add pairs that no step of the default job can get right.
DEFAULT_TASKS: tuple[str, ...] = ("sort", "reverse")


@dataclass(frozen=True)
class TaskExample:
    task: str
    prompt: str  # "\n\nHuman: <question>\n\nAssistant:"
    chosen: str  # " <right answer>"
    rejected: str  # " <plausible wrong answer>"


def last_question(prompt: str) -> str:
    """The last human turn of a Human/Assistant dialogue prompt (turns as :func:`parse_dialogue` finds
    them, so "Human:" inside a turn's text is text); a prompt that is not a dialogue is the question."""
    if not is_dialogue(prompt):
        return prompt.strip()
    # without text before the first turn (an instruction or passage): the question is the turn's own
    return next(
        m["content"] for m in reversed(parse_dialogue(prompt, keep_preamble=False)) if m["role"] == "user"
    )


def resolve_tasks(names: list[str] | None) -> list[Task]:
    if not names:
        return [TASKS[n] for n in DEFAULT_TASKS]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise KeyError(f"unknown built-in task {unknown[0]!r}; known: {', '.join(TASKS)}")
    return [TASKS[n] for n in names]


def recognise(prompt: str) -> tuple[Task, re.Match[str]] | None:
    """The built-in task whose question a prompt's last human turn asks, with its match; None if none does."""
    q = last_question(prompt)
    return next(((t, m) for t in TASKS.values() if (m := t.pattern.match(q))), None)


def problem_key(prompt: str) -> str:
    """``task:problem`` for a built-in question, where rewordings with one answer ("Sort: owl cat dog" and
    "Sort: cat dog owl") share a key; the prompt itself for anything else."""
    found = recognise(prompt)
    return prompt if found is None else f"{found[0].name}:{found[0].problem(found[1])}"


def is_held_out(prompt: str) -> bool:
    """A fixed tenth of every task's problems, by hash: never trained on in any wording, always evaluated.

    Deciding by the problem (not by sampling order) keeps train and eval disjoint even for tasks whose
    whole space is small enough to be enumerated (3 or 4 of 12 words: 715 word sets). Deciding by the
    exact prompt, as before TASKS_VERSION 10, evaluated every held-out sort question on a word set that
    training had seen in another order.
    """
    return zlib.crc32(problem_key(prompt).encode()) % 10 == 0


def generate(
    names: list[str] | None,
    n_per_task: int,
    seed: int,
    exclude: set[str] | None = None,
    held_out: bool | None = None,
) -> list[TaskExample]:
    """Up to ``n_per_task`` distinct examples per task, deterministic in ``seed``, none whose prompt is in
    ``exclude``; with ``held_out`` True/False only prompts on that side of :func:`is_held_out`."""
    out: list[TaskExample] = []
    for task in resolve_tasks(names):
        rng = random.Random(f"{task.name}:{seed}")
        seen = set(exclude or ())
        attempts = last_new = made = 0
        # Stop early once new questions have become rare: the task's space is (nearly) exhausted.
        while made < n_per_task and attempts - last_new < 5000:
            attempts += 1
            q = task.question(rng)
            prompt = make_prompt(q)
            if prompt in seen or (held_out is not None and is_held_out(prompt) != held_out):
                continue
            seen.add(prompt)
            last_new = attempts
            m = task.pattern.match(q)
            # Wrong answers draw from their own generator, so changing them never changes the questions.
            wrong = task.wrong_answers(m, random.Random(f"{task.name}:{seed}:{q}"))
            out.append(TaskExample(task.name, prompt, " " + task.answer(m), " " + wrong[0]))
            made += 1
    return out


def clean_response(response: str, stops: tuple[str, ...] = TURN_STOPS) -> str:
    """The answer a generated reply gives: the whole reply up to the first of ``stops``, without
    surrounding whitespace. ``stops``: where the prompt format ends a reply in text
    (:attr:`~dschat.data.prompt_format.PromptFormat.stop_strings`): the Human/Assistant format's invented
    next turn ("\n\nHuman: ...", the default), none for a chat template, whose end token ends the reply
    (text after the answer is then part of it, as a user reads it). Lines after the first are part of the
    answer too: a verifier that read only the first line paid full reward for a right line followed by
    anything, which an RL policy can learn (with a chat template a newline does not end the turn)."""
    return cut_reply(response, stops).strip()


def reference_answer(prompt: str) -> str | None:
    """The right answer (without the leading space) if a built-in task recognises the prompt."""
    found = recognise(prompt)
    return None if found is None else found[0].answer(found[1])


def verify(prompt: str, response: str, stops: tuple[str, ...] = TURN_STOPS) -> bool | None:
    """True/False if a built-in task recognises the prompt, None if no task does. ``stops``: the prompt
    format's stop strings (:func:`clean_response`)."""
    right = reference_answer(prompt)
    return None if right is None else clean_response(response, stops) == right


def task_of(prompt: str) -> str | None:
    found = recognise(prompt)
    return None if found is None else found[0].name


def verifier_reward(
    prompts: list[str], responses: list[str], stop_strings: tuple[str, ...] = TURN_STOPS
) -> list[float]:
    """A rule-based reward for ``--reward_fn dschat.tasks:verifier_reward``: +1 right, -1 wrong, 0 unknown
    task. Step 3 passes the actor's prompt format's ``stop_strings`` (:func:`clean_response`)."""
    out = []
    for p, r in zip(prompts, responses):
        ok = verify(p, r, stop_strings)
        out.append(0.0 if ok is None else (1.0 if ok else -1.0))
    return out
