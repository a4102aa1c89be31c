"""dschat.rlhf.held_out: step 3's evaluation needs no more memory than a training round: it generates and
scores in calls of the rollouts' rows, never all of a rank's held-out prompts (or 32 rows) at once."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dschat.data.prompt_format import prompt_format
from dschat.generation.plain import PlainGenerator
from dschat.generation.sampling import SamplingConfig
from dschat.rlhf.held_out import HeldOutEval
from tests.unit.test_ppo_trainer import Engine, micro_llama


class CountingGenerator(PlainGenerator):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.rows: list[int] = []

    def generate(self, input_ids, attention_mask, sampling=None, greedy_rows=None):
        self.rows.append(input_ids.shape[0])
        return super().generate(input_ids, attention_mask, sampling, greedy_rows)


class CountingReward:
    reads_packed = False

    def __init__(self) -> None:
        self.rows: list[int] = []

    def score(self, prompts, responses, sequences, attention_mask, packed=None) -> torch.Tensor:
        assert len(prompts) == len(responses) == sequences.shape[0]
        self.rows.append(sequences.shape[0])
        return torch.ones(sequences.shape[0])


class Log:
    def log(self, *a, **kw) -> None:
        pass


@pytest.mark.parametrize("task_prompts", [False, True])  # truth known: greedy and sampled rows together
def test_evaluation_generates_and_scores_in_calls_of_the_rollouts_rows(tokenizer, task_prompts):
    from dschat import tasks

    if task_prompts:
        prompts = [e.prompt for e in tasks.generate(["sort"], 10, 0, held_out=True)][:10]
    else:
        prompts = [f"Say {i}" for i in range(10)]
    engine = Engine(micro_llama(len(tokenizer)))
    sampling = SamplingConfig(max_new_tokens=3)
    gen = CountingGenerator(engine, tokenizer, sampling, zero3=False)
    reward = CountingReward()
    evaluate = HeldOutEval(engine, gen, reward, None, tokenizer, prompt_format(tokenizer), prompts, sampling,
                           zero3=False, seed=0, metrics=Log(), timer=lambda name: contextlib.nullcontext(),
                           batch_rows=4)  # fmt: skip
    out = evaluate(0)
    assert out["held_out_reward"] == 1.0
    rows = 20 if task_prompts else 10  # a greedy and a sampled answer per prompt where the truth is known
    assert sum(gen.rows) == rows and max(gen.rows) == 4
    assert sum(reward.rows) == 10 and max(reward.rows) == 4


@pytest.mark.parametrize("chat_template", [False, True])
def test_true_accuracy_cuts_answers_where_the_actors_format_ends_them(tokenizer, monkeypatch, chat_template):
    """A right answer followed by an invented turn: right in the Human/Assistant format (the model ends
    its answer by inventing the next turn), wrong where a chat template's end token ends the reply (it
    was counted right there too)."""
    import dataclasses

    from dschat import tasks
    from dschat.rlhf import held_out

    prompts = [e.prompt for e in tasks.generate(["sort"], 4, 0, held_out=True)][:4]
    answers = [f" {tasks.reference_answer(p)}\n\nHuman: and now?" for p in prompts]
    monkeypatch.setattr(held_out, "greedy_and_sampled_texts", lambda *a, **kw: (answers, answers))
    fmt = prompt_format(tokenizer)
    fmt = dataclasses.replace(fmt, stop_strings=()) if chat_template else fmt
    engine = Engine(micro_llama(len(tokenizer)))
    sampling = SamplingConfig(max_new_tokens=3)
    gen = PlainGenerator(engine, tokenizer, sampling, zero3=False)
    evaluate = HeldOutEval(engine, gen, CountingReward(), None, tokenizer, fmt, prompts, sampling, zero3=False,
                           seed=0, metrics=Log(), timer=lambda name: contextlib.nullcontext())  # fmt: skip
    out = evaluate(0)
    expected = 0.0 if chat_template else 1.0
    assert out["true_accuracy"] == out["true_accuracy_sampled"] == expected


def test_hacking_signs_by_hand():
    from dschat.rlhf.held_out import hacking_signs

    start = {
        "held_out_reward": 0.1,
        "true_accuracy": 0.8,
        "held_out_judge_score": 1.0,
        "held_out_judge_score_std": 0.5,
    }
    # accuracy 0.8 -> 0.6 on 200 prompts: pooled p 0.7, noise sqrt(2 * 0.7 * 0.3 / 200) = 0.0458, a fall of
    # 0.2 > 0.0917; the judge 1.0 -> 0.8 (std 0.5 both times) on 100 prompts: noise sqrt(0.5 / 100) = 0.0707
    now = {
        "held_out_reward": 0.5,
        "true_accuracy": 0.6,
        "held_out_judge_score": 0.8,
        "held_out_judge_score_std": 0.5,
    }
    signs = hacking_signs(start, now, truth_prompts=200, judge_prompts=100)
    assert [s["measure"] for s in signs] == ["true_accuracy", "held_out_judge_score"]
    assert signs[0]["noise"] == pytest.approx(0.045826, abs=1e-6)
    assert signs[1]["noise"] == pytest.approx(0.070711, abs=1e-6)
    # within twice the noise: 0.8 -> 0.72 (2 x 0.0427 = 0.0854 > 0.08), the judge 1.0 -> 0.86 (0.141 > 0.14)
    within = {**now, "true_accuracy": 0.72, "held_out_judge_score": 0.86}
    assert hacking_signs(start, within, truth_prompts=200, judge_prompts=100) == []
    # the reward did not rise: a falling truth is then not the reward model's doing
    assert hacking_signs(start, {**now, "held_out_reward": 0.1}, truth_prompts=200, judge_prompts=100) == []
    assert hacking_signs({"held_out_reward": 0.1}, now, truth_prompts=200, judge_prompts=100) == []


def test_an_evaluation_warns_when_reward_rises_and_truth_falls(tokenizer, monkeypatch, caplog):
    """The run's first evaluation had every answer right and a reward of 0; now every answer is wrong and
    the reward is 1: a warning naming the step, and the signs kept (the summary's reward_hacking_signs)."""
    import logging

    from dschat import tasks
    from dschat.rlhf import held_out

    prompts = [e.prompt for e in tasks.generate(["sort"], 8, 0, held_out=True)][:8]
    wrong = [" not the answer" for _ in prompts]
    monkeypatch.setattr(held_out, "greedy_and_sampled_texts", lambda *a, **kw: (wrong, wrong))
    engine = Engine(micro_llama(len(tokenizer)))
    sampling = SamplingConfig(max_new_tokens=3)
    gen = PlainGenerator(engine, tokenizer, sampling, zero3=False)
    evaluate = HeldOutEval(engine, gen, CountingReward(), None, tokenizer, prompt_format(tokenizer), prompts,
                           sampling, zero3=False, seed=0, metrics=Log(), timer=lambda name: contextlib.nullcontext())  # fmt: skip
    assert evaluate(0)["true_accuracy"] == 0.0 and evaluate.signs == []  # no start yet: nothing to compare
    evaluate.start = {"held_out_reward": 0.0, "true_accuracy": 1.0, "true_accuracy_sampled": 1.0}
    with caplog.at_level(logging.WARNING, logger="dschat"):
        evaluate(7)
    assert [(s["step"], s["measure"]) for s in evaluate.signs] == [
        (7, "true_accuracy"),
        (7, "true_accuracy_sampled"),
    ]
    assert "possible reward hacking at step 7" in caplog.text
