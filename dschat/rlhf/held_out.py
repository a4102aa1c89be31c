"""Step 3's held-out evaluation: what the policy does on prompts it never trains on, measured by
something other than the loss it optimises (the verifier's truth, the judge).

Greedy answers get the reward model's score, the judge's score and (prompts of built-in tasks) the
verifier's true accuracy; answers sampled as in training get true accuracy too
(``true_accuracy_sampled``: the policy PPO optimises, not only its mode).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
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

    @torch.no_grad()
    def __call__(self, step: int) -> dict[str, float]:
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
        total, judge_total, n = dist.all_reduce_sum(
            [float((scores * w).sum()), float((judged * w).sum()), float(w.sum())]
        )
        out = {"held_out_reward": total / n}
        if self.judge is not None:
            out["held_out_judge_score"] = judge_total / n
        return out
