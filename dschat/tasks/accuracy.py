"""True accuracy on the built-in tasks: answers generated on every rank, checked by the tasks'
verifiers, counts summed over ranks."""

from __future__ import annotations

from collections import defaultdict

import torch

from dschat import tasks
from dschat.data.prompt_format import TURN_STOPS, PromptFormat, prompt_format
from dschat.generation.sampling import SamplingConfig
from dschat.generation.texts import generate_text_replies
from dschat.utils import dist


def rank_slice(prompts: list[str]) -> tuple[list[str], list[float]]:
    """This rank's share of ``prompts`` and their weights: every rank gets the same number (ZeRO-3
    generation is collective), the last ranks padded with repeats of weight 0 (cycling through
    ``prompts``: with fewer prompts than ranks, some ranks hold only repeats)."""
    world, rank = dist.world_size(), dist.rank()
    per = -(-len(prompts) // world)
    padded = [prompts[i % len(prompts)] for i in range(per * world)] if prompts else []
    mine = padded[rank * per : (rank + 1) * per]
    return mine, [1.0 if rank * per + i < len(prompts) else 0.0 for i in range(len(mine))]


def verifier_accuracy(
    prompts: list[str], answers: list[str], weights: list[float], stops: tuple[str, ...] = TURN_STOPS
) -> dict[str, float] | None:
    """Verifier accuracy of each rank's (prompt, answer) pairs, summed over ranks (call on every rank):
    ``accuracy`` and ``accuracy/<task>``, over the prompts a built-in task recognises (None if none does).
    ``stops``: the answers' prompt format's stop strings (:func:`dschat.tasks.clean_response`)."""
    right: dict[str, float] = defaultdict(float)
    total: dict[str, float] = defaultdict(float)
    for p, a, w in zip(prompts, answers, weights, strict=True):
        name = tasks.task_of(p)
        if name is not None:
            total[name] += w
            right[name] += w * float(bool(tasks.verify(p, a, stops)))
    names = sorted(tasks.TASKS)
    flat = dist.all_reduce_sum([right[n] for n in names] + [total[n] for n in names])
    r, t = flat[: len(names)], flat[len(names) :]
    if not sum(t):
        return None
    result = {"accuracy": sum(r) / sum(t)}
    for n, rn, tn in zip(names, r, t):
        if tn:
            result[f"accuracy/{n}"] = rn / tn
    return result


def true_accuracy_columns(acc: dict[str, float] | None, drawn: str = "") -> dict[str, float]:
    """A :func:`verifier_accuracy` result (``accuracy``, ``accuracy/<task>``) as an evaluation row logs it:
    ``true_accuracy``, ``true_accuracy/<task>`` (``drawn="_sampled"``: ``true_accuracy_sampled...``), the
    names of every step (DPO's own ``accuracy`` is the implicit reward's)."""
    return {f"true_{k.replace('accuracy', 'accuracy' + drawn, 1)}": v for k, v in (acc or {}).items()}


def task_accuracy(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    device,
    synced_gpus: bool = False,
    max_new_tokens: int = 32,
    generator=None,
    sampling: SamplingConfig | None = None,
    fmt: PromptFormat | None = None,
) -> dict[str, float] | None:
    """Verifier accuracy of greedy answers (sampled ones with ``sampling``) over the prompts a built-in
    task recognises (None if none does).

    Each rank answers its own slice; counts are summed over ranks. Returns ``accuracy`` and
    ``accuracy/<task>`` keys.
    """
    known = [p for p in prompts if tasks.task_of(p)]
    if not known:
        return None
    mine, weights = rank_slice(known)
    fmt = fmt or prompt_format(tokenizer)
    answers = generate_text_replies(
        model,
        tokenizer,
        mine,
        device=device,
        synced_gpus=synced_gpus,
        max_new_tokens=max_new_tokens,
        generator=generator,
        sampling=sampling,
        fmt=fmt,
    ).texts
    return verifier_accuracy(mine, answers, weights, fmt.stop_strings)


def answers_cut_by_budget(
    tokenizer, prompts: list[str], max_new_tokens: int, fmt: PromptFormat | None = None
) -> tuple[int, int]:
    """How many built-in prompts' right answers (plus the end token) do not fit in ``max_new_tokens`` new
    tokens, and the longest such answer in tokens: ``(count, longest)``. A budget that cuts right answers
    caps true accuracy and punishes right answers during PPO, so the steps warn about it."""
    fmt = fmt or prompt_format(tokenizer)
    answers = [" " + a for a in (tasks.reference_answer(p) for p in prompts) if a is not None]
    lengths = [len(ids) + 1 for ids in fmt.encode_responses(answers)]
    cut = [n for n in lengths if n > max_new_tokens]
    return len(cut), max(lengths, default=0)
