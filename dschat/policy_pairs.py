"""On-policy pairs for step 2: the policy's own answers, labelled by a verifier or by a reward model.

A reward model trained only on synthetic wrong answers ranks those well and can still be fooled by the
mistakes the PPO actor actually makes (measured on the built-in tasks: held-out accuracy 0.98, yet PPO
raised its score while true accuracy fell). InstructGPT's reward model was trained on comparisons of
its SFT model's own samples; here a verifier plays the labeller. For every built-in prompt, sample
answers from the policy (the step-1 model), and pair each wrong one (rejected) with the right answer
(chosen). Prompts no built-in task recognises are skipped: there is no verifier to label them.

    pairs, stats, samples = mine_policy_negatives(model, tokenizer, prompts, samples_per_prompt=4, ...)

Where no verifier knows the truth (human preferences), a reward model labels instead
(``--policy_negatives_reward_model``, for DPO): of each prompt's K sampled answers, the one it scores
highest becomes chosen and the one it scores lowest rejected. This is online (iterative) DPO as in RLHF
Workflow, TRL's online DPO and OpenRLHF's iterative DPO: offline pairs written by another model pull the
policy towards text it would never write, measured here as a DPO policy that a judge liked less than
SmolLM2 itself (win rate 0.42).

    pairs, stats = mine_scored_pairs(model, tokenizer, prompts, reward_model, samples_per_prompt=4, ...)

The sampled answers themselves (``PolicySamples``) also say, before any PPO, whether a reward model can
improve the policy at all: :func:`selection_accuracy` lets it pick the best of each prompt's K answers. If
its pick is right no more often than a random sample, PPO against it can raise its score but not the
truth (reward hacking, foreseen).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dschat import tasks
from dschat.config import DataArgs, PolicyPairsArgs
from dschat.data.prompt_format import TURN_STOPS, PromptFormat, cut_reply, prompt_format
from dschat.data.schema import Sample
from dschat.generation.decoding import Replies
from dschat.generation.sampling import SamplingConfig
from dschat.generation.texts import generate_text_replies
from dschat.losses import gather_last
from dschat.rlhf.ppo_math import group_relative_scores
from dschat.scoring import score_texts, score_with
from dschat.tasks.accuracy import rank_slice
from dschat.utils import dist
from dschat.utils.errors import UserError
from dschat.utils.io import atomic_write_text
from dschat.utils.metrics import mean_std

LOG = logging.getLogger("dschat")


@dataclass
class PolicySamples:
    """One rank's share of K sampled answers per prompt, grouped by prompt.

    ``prompts[i]`` was answered by ``answers[i * k : (i + 1) * k]`` (cleaned, " " + answer, as the reward
    model is trained on them); ``right`` is the verifier's label of each answer. ``weight[i]`` is 0 for
    the repeats that give every rank the same number of prompts (collective ZeRO-3 forward passes).
    """

    prompts: list[str]  # (P,)
    answers: list[str]  # (P * k,)
    right: list[bool]  # (P * k,)
    weight: list[float]  # (P,)
    k: int

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if not (len(self.answers) == len(self.right) == n * self.k and len(self.weight) == n):
            raise ValueError(
                f"PolicySamples: {n} prompts x k={self.k} need {n * self.k} answers and labels and {n} "
                f"weights, got {len(self.answers)}, {len(self.right)}, {len(self.weight)}"
            )


def selection_metrics(scores: torch.Tensor, right: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    """Weighted sums for :func:`selection_accuracy` from scores and labels (P, K) and weights (P,):
    the scorer's pick right (``best``), a random pick right (``sampled``: the mean over K), any right
    (``any``: pass@K, an oracle's pick), and the weight (``n``). Ties go to the first answer, which is as
    good as a random pick: a scorer that cannot tell the answers apart scores like ``sampled``, not better
    (pairwise ranking instead counts a tie as wrong)."""
    right = right.float()
    picked = right.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)
    w = weight.float()
    out = {
        "best": float((picked * w).sum()),
        "sampled": float((right.mean(dim=1) * w).sum()),
        "any": float((right.amax(dim=1) * w).sum()),
        "n": float(w.sum()),
        # every answer's score, weighted by its prompt's weight: the policy's score distribution
        "score_sum": float((scores.float() * w.unsqueeze(1)).sum()),
        "score_sq": float((scores.float() ** 2 * w.unsqueeze(1)).sum()),
    }
    k = scores.shape[1]
    if k > 1:  # the sums of advantage_correlation, per answer, weighted by its prompt's weight
        x = group_relative_scores(scores.flatten(), k, "rloo")
        y = group_relative_scores(right.flatten(), k, "rloo")
        wr = w.repeat_interleave(k)
        out.update({"adv_n": float(wr.sum()), "adv_x": float((wr * x).sum()), "adv_y": float((wr * y).sum()),
                    "adv_xx": float((wr * x * x).sum()), "adv_yy": float((wr * y * y).sum()),
                    "adv_xy": float((wr * x * y).sum())})  # fmt: skip
    return out


def advantage_correlation(sums: dict[str, float]) -> float:
    """Pearson correlation between the RLOO advantages (each answer's score minus the mean of its prompt's
    other answers) that a scorer gives and those the verifier gives, from :func:`selection_metrics`' sums
    (summed over ranks). RL with a group baseline moves the policy along the scorer's advantages: where
    they agree with the verifier's only weakly, it learns the scorer's mistakes as fast as the task. On
    384 sampled answers (4 for each of 96 prompts) of the default job's step-1 model, scores clipped to
    +-5 as step 3 clips them (2026-11-25): 0.60 for a reward model that PPO hacked, 0.73 for one that
    step 3 improves on.
    0.0 when either side does not vary (no signal)."""
    n = sums["adv_n"]
    cov = n * sums["adv_xy"] - sums["adv_x"] * sums["adv_y"]
    var_x = n * sums["adv_xx"] - sums["adv_x"] ** 2
    var_y = n * sums["adv_yy"] - sums["adv_y"] ** 2
    # Relative to the raw second moment: cancellation can leave a tiny positive variance where every
    # advantage is equal, and dividing by it would turn rounding error into a correlation.
    if var_x <= 1e-12 * max(n * sums["adv_xx"], 1.0) or var_y <= 1e-12 * max(n * sums["adv_yy"], 1.0):
        return 0.0
    return cov / (var_x * var_y) ** 0.5


def wrong_answer_pairs(
    prompts: list[str], answers: list[str], stops: tuple[str, ...] = TURN_STOPS
) -> list[Sample]:
    """(prompt, sampled answer) -> a pair for each distinct wrong, non-empty answer: chosen = the right
    answer, rejected = the sampled one, both in the built-in data's form (" " + answer). ``stops``: the
    answers' prompt format's stop strings (:func:`dschat.tasks.clean_response`)."""
    out, seen = [], set()
    for p, a in zip(prompts, answers):
        right = tasks.reference_answer(p)
        answer = tasks.clean_response(a, stops)
        if right is None or not answer or answer == right or (p, answer) in seen:
            continue
        seen.add((p, answer))
        out.append(Sample(prompt=p, chosen=" " + right, rejected=" " + answer, source="policy"))
    return out


def sample_replies(model: torch.nn.Module, tokenizer, rows: list[str], *, max_new_tokens: int, temperature: float,
                   device, seed: int, batch_size: int, fmt: PromptFormat | None) -> Replies:  # fmt: skip
    """One sampled answer per row (rows repeat a prompt K times), seeded per rank (``seed + rank``) without
    touching the caller's random state: the same answers on every rerun with the same ranks."""
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed + dist.rank())
        return generate_text_replies(
            model, tokenizer, rows, device=device, batch_size=batch_size,
            sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature), fmt=fmt,
        )  # fmt: skip


def best_worst_pairs(
    prompts: list[str],
    answers: list[str],
    scores: list[float],
    cut_off: list[bool],
    k: int,
    min_margin: float,
) -> tuple[list[Sample], list[float]]:
    """Each prompt's K scored answers -> at most one pair: chosen = the highest-scored answer that ended
    (not cut off), rejected = the lowest-scored of all; kept where the two texts differ and the chosen
    one scores more, by at least ``min_margin``. Returns the pairs and their score margins.

    prompts (P,); answers, scores, cut_off (P * k,), grouped by prompt. A cut-off answer never becomes
    chosen: DPO's chosen side ends with the end-of-turn token, so it would teach ending mid-sentence (and
    a longer budget would have written more). Empty answers are left out. Copies of one text (once
    stripped) are one answer scored by their mean (copies differ only by batch rounding), and a text is
    cut off if any copy is. Ties go to the first answer.
    """
    if not (len(answers) == len(scores) == len(cut_off) == len(prompts) * k):
        raise ValueError(f"{len(prompts)} prompts x k={k} need {len(prompts) * k} answers, scores and flags")
    out, margins = [], []
    for i, prompt in enumerate(prompts):
        copies: dict[str, list[int]] = {}  # text -> its answers' indices, first seen first
        for j in range(i * k, (i + 1) * k):
            if answers[j].strip():
                copies.setdefault(answers[j].strip(), []).append(j)
        score = {js[0]: sum(scores[j] for j in js) / len(js) for js in copies.values()}
        ended = [js[0] for js in copies.values() if not any(cut_off[j] for j in js)]
        if not ended:
            continue
        best = max(ended, key=lambda j: (score[j], -j))
        worst = min(score, key=lambda j: (score[j], j))
        margin = score[best] - score[worst]
        # a tie says nothing about which is better (only that one was cut off): no pair
        if answers[best].strip() == answers[worst].strip() or margin <= 0 or margin < min_margin:
            continue
        out.append(Sample(prompt=prompt, chosen=answers[best], rejected=answers[worst], source="policy"))
        margins.append(margin)
    return out, margins


@torch.no_grad()
def mine_scored_pairs(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    reward_model: torch.nn.Module,
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    device,
    seed: int,
    min_margin: float = 0.0,
    batch_size: int = 64,
    fmt: PromptFormat | None = None,
    max_len: int | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    """Sample ``samples_per_prompt`` answers per prompt (any prompt: no verifier is needed), score them
    with ``reward_model`` (a ``ScalarHeadModel`` reading the policy's tokenizer) and keep
    :func:`best_worst_pairs`. Every rank returns the same pairs in the same order.

    Returns (pairs, stats: prompts, answers, the fraction cut off, pairs, the mean score of all answers
    and the mean margin and the chosen and rejected answers' mean length in characters over the pairs).
    """
    fmt = fmt or prompt_format(tokenizer)
    mine, weight = rank_slice(prompts)
    mine = [p for p, w in zip(mine, weight) if w]  # nothing here is collective: repeats are not needed
    # similar lengths share a batch: left padding to a long HH prompt costs every row in the batch
    mine.sort(key=len)
    k = samples_per_prompt
    repeated = [p for p in mine for _ in range(k)]
    replies = sample_replies(model, tokenizer, repeated, max_new_tokens=max_new_tokens, temperature=temperature,
                             device=device, seed=seed, batch_size=batch_size, fmt=fmt)  # fmt: skip
    # An answer that goes on to invent the next turn ("\n\nHuman: ...", the Human/Assistant format) ends
    # there: cut, and counted as ended. Answers as the data holds them: " " + text after "Assistant:".
    stops = fmt.stop_strings
    cut_off = [c and not any(s in t for s in stops) for c, t in zip(replies.cut_off, replies.texts)]
    answers = [" " + cut_reply(t, stops).strip() for t in replies.texts]
    # scored as DPO will read them: prompts longer than max_len keep their end
    scores = score_texts(reward_model, tokenizer, repeated, answers, batch_size=max(1, batch_size // 4),
                         device=device, fmt=fmt, max_len=max_len).tolist() if repeated else []  # fmt: skip
    pairs, margins = best_worst_pairs(mine, answers, scores, cut_off, k, min_margin)
    sums = [float(len(mine)), float(len(answers)), float(sum(cut_off)), float(sum(scores)),
            float(len(pairs)), float(sum(margins)), float(sum(len(p.chosen) for p in pairs)),
            float(sum(len(p.rejected) for p in pairs))]  # fmt: skip
    pairs, sums = dist.gather_lists(pairs), dist.all_reduce_sum(sums)
    n_prompts, n_answers, n_cut, score_sum, n_pairs, margin_sum, chosen_len, rejected_len = sums
    stats = {
        "prompts": n_prompts,
        "answers": n_answers,
        "cut_off_fraction": n_cut / max(n_answers, 1.0),
        "mean_score": score_sum / max(n_answers, 1.0),
        "pairs": n_pairs,
        "mean_margin": margin_sum / max(n_pairs, 1.0),
        "chosen_chars": chosen_len / max(n_pairs, 1.0),
        "rejected_chars": rejected_len / max(n_pairs, 1.0),
    }
    return pairs, stats


@torch.no_grad()
def mine_policy_negatives(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    device,
    seed: int,
    batch_size: int = 64,
    fmt: PromptFormat | None = None,
) -> tuple[list[Sample], dict[str, float], PolicySamples]:
    """Sample ``samples_per_prompt`` answers per built-in prompt and keep the wrong ones as pairs.

    ``model`` is a plain (not DeepSpeed) causal LM; each rank answers its share of the prompts and the
    pairs are gathered, so every rank returns the same list in the same order. Returns (pairs, stats:
    prompts, answers, wrong answers, pairs, sampled accuracy, pass@K; this rank's samples).
    """
    known = [p for p in prompts if tasks.reference_answer(p) is not None]
    mine, weight = rank_slice(known)
    repeated = [p for p in mine for _ in range(samples_per_prompt)]
    fmt = fmt or prompt_format(tokenizer)
    answers = sample_replies(model, tokenizer, repeated, max_new_tokens=max_new_tokens, temperature=temperature,
                             device=device, seed=seed, batch_size=batch_size, fmt=fmt).texts  # fmt: skip
    k, stops = samples_per_prompt, fmt.stop_strings
    ok = [bool(tasks.verify(p, a, stops)) for p, a in zip(repeated, answers)]
    samples = PolicySamples(mine, [" " + tasks.clean_response(a, stops) for a in answers], ok, weight, k)
    counted = [i for i in range(len(repeated)) if weight[i // k]]
    pairs = wrong_answer_pairs([repeated[i] for i in counted], [answers[i] for i in counted], stops)
    right = sum(ok[i] for i in counted)
    solved = sum(w * any(ok[i * k : (i + 1) * k]) for i, w in enumerate(weight))
    pairs = dist.gather_lists(pairs)
    n_answers, n_right, n_solved = dist.all_reduce_sum([float(len(counted)), float(right), float(solved)])
    stats = {
        "prompts": float(len(known)),
        "answers": n_answers,
        "wrong_answers": n_answers - n_right,
        "pairs": float(len(pairs)),
        "sampled_accuracy": n_right / max(n_answers, 1.0),
        "pass_at_k": n_solved / max(float(len(known)), 1.0),
    }
    return pairs, stats, samples


@torch.no_grad()
def selection_accuracy(score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokenizer,
                       samples: PolicySamples, *, batch_size: int, max_len: int,
                       device: str | torch.device, fmt: PromptFormat | None = None) -> dict[str, float]:  # fmt: skip
    """How often a scorer's favourite among each prompt's K answers is right, over all ranks, beside a
    random pick's (``sampled_accuracy``) and an oracle's (``pass_at_k``); with K > 1 also how well its
    RLOO advantages agree with the verifier's (``advantage_correlation``).

    ``score_fn(input_ids, attention_mask) -> (B,)`` scores at the last real token (every rank calls it
    equally often); rows are tokenized as in :func:`dschat.scoring.score_with`.
    """
    prompts = [p for p in samples.prompts for _ in range(samples.k)]
    scores = score_with(score_fn, tokenizer, prompts, samples.answers, batch_size=batch_size, device=device,
                        max_len=max_len, fmt=fmt).view(-1, samples.k)  # fmt: skip
    sums = selection_metrics(
        scores, torch.tensor(samples.right).view(-1, samples.k), torch.tensor(samples.weight)
    )
    keys = sorted(sums)
    total = dict(zip(keys, dist.all_reduce_sum([sums[key] for key in keys])))
    n = max(total["n"], 1.0)
    score_mean, score_std = mean_std(total["score_sum"], total["score_sq"], total["n"] * samples.k)
    out = {
        "best_of_k_accuracy": total["best"] / n,
        "sampled_accuracy": total["sampled"] / n,
        "pass_at_k": total["any"] / n,
        "score_mean": score_mean,  # over every answer: the policy's score distribution
        "score_std": score_std,
        "answers": total["n"] * samples.k,
    }
    if "adv_n" in total:
        out["advantage_correlation"] = advantage_correlation(total)
    return out


@torch.no_grad()
def evaluate_selection(
    engine,
    tokenizer,
    samples: PolicySamples,
    *,
    batch_size: int,
    max_len: int,
    fmt: PromptFormat | None = None,
) -> dict[str, float]:
    """:func:`selection_accuracy` of a reward engine (values (B, T), scored at the last real token), in
    eval mode and restored afterwards."""
    was_training = engine.module.training
    engine.eval()
    try:
        return selection_accuracy(lambda ids, mask: gather_last(engine(ids, mask), mask), tokenizer, samples,
                                  batch_size=batch_size, max_len=max_len, device=engine.device, fmt=fmt)  # fmt: skip
    finally:
        if was_training:
            engine.train()


@dataclass
class MinedPairs:
    """A step's on-policy pairs (``--policy_negatives_from``), mined before training."""

    train: list[dict]  # tokenized pairs (``pair_example``) to add to the training set
    eval: list[dict]  # tokenized held-out pairs: the policy's own mistakes on held-out prompts
    pairs: dict[str, list[Sample]] = field(default_factory=dict)  # "train"/"eval" -> the pairs as text
    stats: dict[str, dict] = field(default_factory=dict)  # "train"/"eval" -> mine_policy_negatives' stats
    eval_samples: PolicySamples | None = None  # the held-out prompts' K answers (None: no built-in prompts)

    def training_set(self, data_train: list[dict], only: bool) -> list[dict]:
        """The step's training pairs: the data's and these (``only``: these alone, the data giving prompts)."""
        if only and not self.train:
            why = (
                "every answer was cut off, tied or below --policy_negatives_min_margin: raise "
                "--policy_negatives_max_new_tokens or lower the margin"
                if "cut_off_fraction" in self.stats.get("train", {})
                else "the data has no built-in task prompts, or the policy answered every one of them right"
            )
            raise UserError(
                f"--policy_negatives_only: the policy's answers gave no pairs to train on ({why})"
            )
        return list(self.train) if only else data_train + self.train

    def write(self, output_dir: str) -> None:
        """``policy_negatives_{train,eval}.jsonl`` in the run, for a person to read and for rw_eval.py --file."""
        if not dist.is_main():
            return
        for split, pairs in self.pairs.items():
            rows = [
                json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}) for p in pairs
            ]
            atomic_write_text(
                Path(output_dir) / f"policy_negatives_{split}.jsonl", "".join(r + "\n" for r in rows)
            )


def mine_step_pairs(
    pp: PolicyPairsArgs,
    *,
    data_args: DataArgs,
    phase: int,
    tokenizer,
    fmt: PromptFormat,
    seed: int,
    dtype: str,
    trust_remote_code: bool = False,
) -> MinedPairs | None:
    """The on-policy pairs of step ``phase`` per ``pp`` (None without ``--policy_negatives_from``): the
    policy answers this step's built-in prompts (at most ``policy_negatives_max_prompts`` of the training
    ones, a random subset) and every wrong answer becomes a rejected response next to the right one."""
    if not pp.policy_negatives_from:
        return None
    from dschat.data.pipeline import gather_samples, tokenize_pairs
    from dschat.models.loading import inference_dtype, load_causal_lm, resolve

    t0 = time.perf_counter()
    path = resolve(pp.policy_negatives_from, "--policy_negatives_from")
    device = dist.default_device()
    # sampled in the training dtype (bf16 samples about 1.5x faster than fp32 on CPU)
    policy = load_causal_lm(path, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                            dtype=inference_dtype(dtype, str(device)), flag="--policy_negatives_from").to(device)  # fmt: skip
    train_s, eval_s = gather_samples(data_args, phase)  # this step's prompts, as text
    train_prompts, cap = [s.prompt for s in train_s], pp.policy_negatives_max_prompts
    if 0 < cap < len(train_prompts):  # a random subset, not a prefix: sources (tasks) come in order
        train_prompts = random.Random(f"policy-negatives:{seed}").sample(train_prompts, cap)
    out = MinedPairs([], [])
    if pp.policy_negatives_reward_model:
        _mine_with_reward_model(out, pp, policy, tokenizer, train_prompts, device=device, seed=seed, fmt=fmt,
                                dtype=dtype, max_len=data_args.max_seq_len, trust_remote_code=trust_remote_code)  # fmt: skip
        del policy
        st = out.stats["train"]
        LOG.info("on-policy pairs from %s labelled by %s: %d pairs from %d prompts x %d answers (%.0f%% cut off at "
                 "%d tokens; mean margin %.3f; chosen %.0f / rejected %.0f characters), %.1f s", path,
                 pp.policy_negatives_reward_model, st["pairs"], st["prompts"], pp.policy_negatives_per_prompt,
                 100 * st["cut_off_fraction"], pp.policy_negatives_max_new_tokens, st["mean_margin"],
                 st["chosen_chars"], st["rejected_chars"], time.perf_counter() - t0)  # fmt: skip
        return out
    for split, texts in {"train": train_prompts, "eval": [s.prompt for s in eval_s]}.items():
        pairs, out.stats[split], samples = mine_policy_negatives(
            policy, tokenizer, texts, samples_per_prompt=pp.policy_negatives_per_prompt,
            max_new_tokens=pp.policy_negatives_max_new_tokens, temperature=pp.policy_negatives_temperature,
            device=device, seed=seed + (split == "eval"), fmt=fmt,
        )  # fmt: skip
        out.pairs[split] = pairs
        examples, _ = tokenize_pairs(pairs, fmt, data_args.max_seq_len)
        setattr(out, split, examples)
        if split == "eval" and out.stats[split]["prompts"]:
            out.eval_samples = samples
    del policy
    held_out = out.stats["eval"]
    LOG.info("on-policy pairs from %s: %d train / %d eval (the policy's sampled accuracy %.3f; on held-out "
             "prompts %.3f, one of %d right %.3f), %.1f s", path, out.stats["train"]["pairs"], held_out["pairs"],
             out.stats["train"]["sampled_accuracy"], held_out["sampled_accuracy"], pp.policy_negatives_per_prompt,
             held_out["pass_at_k"], time.perf_counter() - t0)  # fmt: skip
    if not out.stats["train"]["prompts"]:
        LOG.warning(
            "--policy_negatives_from: no built-in task prompts in this step's data; no pairs were added"
        )
    return out


def _mine_with_reward_model(out: MinedPairs, pp: PolicyPairsArgs, policy, tokenizer, prompts: list[str], *, device,
                            seed: int, fmt: PromptFormat, dtype: str, max_len: int,
                            trust_remote_code: bool) -> None:  # fmt: skip
    """``out.train``: :func:`mine_scored_pairs` of ``prompts`` (the step's training prompts) labelled by
    ``--policy_negatives_reward_model``. Held-out prompts are not mined: their pairs would measure only
    agreement with this reward model, at the cost of sampling and scoring them all."""
    from dschat.data.pipeline import tokenize_pairs
    from dschat.models.loading import inference_dtype, resolve
    from dschat.models.reward import load_reward_model

    flag = "--policy_negatives_reward_model"
    rm_path = resolve(pp.policy_negatives_reward_model, flag)
    reward_model = load_reward_model(rm_path, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
                                     require_trained_head=True, flag=flag)  # fmt: skip
    reward_model = reward_model.to(device=device, dtype=inference_dtype(dtype, str(device)))
    pairs, out.stats["train"] = mine_scored_pairs(
        policy, tokenizer, prompts, reward_model, samples_per_prompt=pp.policy_negatives_per_prompt,
        max_new_tokens=pp.policy_negatives_max_new_tokens, temperature=pp.policy_negatives_temperature,
        device=device, seed=seed, min_margin=pp.policy_negatives_min_margin, fmt=fmt, max_len=max_len,
    )  # fmt: skip
    out.pairs["train"] = pairs
    out.train, _ = tokenize_pairs(pairs, fmt, max_len)
