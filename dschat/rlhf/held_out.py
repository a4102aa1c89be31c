"""Step 3's held-out evaluation: what the policy does on prompts it never trains on, measured by
something other than the loss it optimises (the verifier's truth, the judge).

Greedy answers get the reward model's score, the judge's score and (prompts of built-in tasks) the
verifier's true accuracy; answers sampled as in training get true accuracy too
(``true_accuracy_sampled``: the policy PPO optimises, not only its mode).

Each evaluation after the first is also compared with the first (:func:`hacking_signs`): where the
held-out reward has risen while a measure PPO does not optimise (true accuracy, the judge's score) has
fallen by more than twice its sampling noise, the policy is pleasing its reward model rather than
improving, and the run says so in a warning and in its summary (``reward_hacking_signs``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dschat import tasks
from dschat.data.collate import pad_right
from dschat.data.prompt_format import PromptFormat
from dschat.generation.sampling import SamplingConfig
from dschat.generation.texts import generate_text_replies, greedy_and_sampled_texts
from dschat.tasks.accuracy import rank_slice, true_accuracy_columns, verifier_accuracy
from dschat.utils import dist

LOG = logging.getLogger("dschat")


@dataclass
class HeldOutEval:
    """``evaluate(step) -> {"held_out_reward", "held_out_judge_score", "true_accuracy", ...}``, logged to
    the eval split of ``metrics``. Collective: every rank answers its slice of ``prompts``."""

    actor: Any  # the actor's engine
    generator: Any  # PlainGenerator or HybridGenerator over the actor
    reward: Any  # reward source
    judge: Any  # a second reward source, or None
    tokenizer: Any
    fmt: PromptFormat
    prompts: list[str]
    sampling: SamplingConfig  # the training rollouts' distribution (max_new_tokens is the answer budget)
    zero3: bool  # ZeRO-3 ranks generate in lockstep
    seed: int
    metrics: Any  # MetricsLogger
    timer: Any  # Stopwatch: the time goes to "eval"
    # rows per generate and per score call: at most the rollouts' (prompts x samples per round), so
    # evaluating holds no larger KV cache, logits or reward-model batch than a training round does (it
    # generated 32 rows per call whatever the round's size, and scored a rank's whole slice in one pass)
    batch_rows: int = 32
    # the run's first evaluation, which later ones are compared with (set once it is known: a resumed run's
    # comes from its checkpoint), and the signs of reward hacking found so far (kept in the checkpoint)
    start: dict[str, float] | None = None
    signs: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, step: int) -> dict[str, float]:
        out = self.evaluate(step)
        if self.start is not None and out:
            truth_prompts = sum(tasks.task_of(p) is not None for p in self.prompts)
            for sign in hacking_signs(self.start, out, truth_prompts, len(self.prompts)):
                LOG.warning("possible reward hacking at step %d: the held-out reward rose %.3f -> %.3f while %s fell "
                            "%.3f -> %.3f, more than twice its noise (%.3f): the policy may be pleasing its reward "
                            "model rather than improving", step, self.start["held_out_reward"], out["held_out_reward"],
                            sign["measure"], sign["start"], sign["now"], sign["noise"])  # fmt: skip
                self.signs.append({"step": step, **sign})
        return out

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if not self.prompts:
            return out
        with self.timer("eval"):
            actor, tok, fmt = self.actor, self.tokenizer, self.fmt
            mine, weights = rank_slice(self.prompts)  # this rank's slice of the held-out prompts
            kw = dict(device=actor.device, synced_gpus=self.zero3, fmt=fmt, batch_size=self.batch_rows)
            # the hybrid engine's fast path, or the plain generator
            with self.generator.generation_mode() as gen:
                if any(tasks.task_of(p) for p in self.prompts):  # truth known: sampled answers too
                    # The same seed at every evaluation (start and end compare like with like), in a forked
                    # RNG so that evaluating never changes the training run's samples. A prompt's greedy
                    # and sampled answers share its prefill.
                    with torch.random.fork_rng(devices=[actor.device] if actor.device.type == "cuda" else []):
                        torch.manual_seed(self.seed + 1 + dist.rank())
                        answers, sampled = greedy_and_sampled_texts(actor.module, tok, mine, self.sampling,
                                                                    generator=gen, **kw)  # fmt: skip
                    acc = verifier_accuracy(mine, answers, weights, fmt.stop_strings)
                    drawn = verifier_accuracy(mine, sampled, weights, fmt.stop_strings)
                    out.update({**true_accuracy_columns(acc), **true_accuracy_columns(drawn, "_sampled")})
                else:
                    answers = generate_text_replies(actor.module, tok, mine, max_new_tokens=self.sampling.max_new_tokens,
                                                    generator=gen, **kw).texts  # fmt: skip
            out.update(self.scores(mine, answers, weights))
        self.metrics.log(out, step=step, split="eval")
        LOG.info("eval at step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
        return out

    def scores(self, prompts: list[str], answers: list[str], weights: list[float]) -> dict[str, float]:
        """Mean reward (and judge score) of the answers over all ranks (weight 0: a padding repeat).
        Prompt + answer are tokenized as step 2 trained the reward model (no end token)."""
        rows = [p + a for p, a in zip(self.fmt.encode_prompts(prompts), self.fmt.encode_responses(answers))]
        scores, judged = torch.zeros(len(rows)), torch.zeros(len(rows))
        # every rank's slice is equally long (rank_slice): the calls are as many on every rank (ZeRO-3's
        # forwards are collective)
        for s in range(0, len(rows), self.batch_rows):
            cut = slice(s, s + self.batch_rows)
            enc = {
                k: v.to(self.actor.device)
                for k, v in pad_right(rows[cut], self.tokenizer.pad_token_id).items()
            }
            args = (prompts[cut], answers[cut], enc["input_ids"], enc["attention_mask"])
            scores[cut] = self.reward.score(*args).float().cpu()
            if self.judge is not None:
                judged[cut] = self.judge.score(*args).float().cpu()
        w = torch.tensor(weights)
        total, judge_total, judge_squares, n = dist.all_reduce_sum(
            [
                float((scores * w).sum()),
                float((judged * w).sum()),
                float((judged**2 * w).sum()),
                float(w.sum()),
            ]
        )
        out = {"held_out_reward": total / n}
        if self.judge is not None:
            out["held_out_judge_score"] = judge_total / n
            # the answers' spread, for the noise of the mean (hacking_signs)
            out["held_out_judge_score_std"] = math.sqrt(max(judge_squares / n - (judge_total / n) ** 2, 0.0))
        return out


TRUTH_MEASURES = ("true_accuracy", "true_accuracy_sampled")


def hacking_signs(
    start: dict[str, float], now: dict[str, float], truth_prompts: int, judge_prompts: int
) -> list[dict[str, float | str]]:
    """The measures PPO does not optimise that fell, from evaluation ``start`` to ``now``, by more than
    twice their noise while the held-out reward rose: ``[{"measure", "start", "now", "noise"}]`` (empty
    where the reward did not rise).

    The noise is one standard error of the difference of two independent means: for an accuracy over
    ``truth_prompts`` prompts, ``sqrt(2 p (1 - p) / n)`` at the pooled ``p``; for the judge's mean score over
    ``judge_prompts`` prompts, ``sqrt((s0^2 + s1^2) / n)`` from the two evaluations' standard deviations."""
    if not now.get("held_out_reward", 0.0) > start.get("held_out_reward", math.inf):
        return []
    signs: list[dict[str, float | str]] = []
    candidates = [(k, truth_prompts, None) for k in TRUTH_MEASURES]
    candidates.append(("held_out_judge_score", judge_prompts, "held_out_judge_score_std"))
    for key, n, std in candidates:
        if key not in start or key not in now or n <= 0:
            continue
        if std is None:
            p = (start[key] + now[key]) / 2
            noise = math.sqrt(2 * p * (1 - p) / n)
        else:
            noise = math.sqrt((start.get(std, 0.0) ** 2 + now.get(std, 0.0) ** 2) / n)
        if start[key] - now[key] > 2 * noise:
            signs.append({"measure": key, "start": start[key], "now": now[key], "noise": noise})
    return signs
