"""Plain Hugging Face generation helpers and true-accuracy measurement on built-in tasks."""

from __future__ import annotations

from collections import defaultdict

import torch

from dschat import tasks
from dschat.data.prompt_format import PromptFormat, prompt_format
from dschat.rlhf.generation import SamplingConfig
from dschat.utils import dist


@torch.no_grad()
def generate_texts(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    synced_gpus: bool = False,
    generator=None,
    sampling: SamplingConfig | None = None,
    fmt: PromptFormat | None = None,
) -> list[str]:
    """Greedy completions (text after the prompt) for ``prompts`` (dialogue text or bare questions,
    rendered by ``fmt``: default the tokenizer's own format, as in training), left-padded batches;
    sampled ones with ``sampling`` (its ``max_new_tokens`` then replaces ``max_new_tokens``). A reply
    ends at one of the format's stop tokens (EOS, a chat template's end of turn).

    ``synced_gpus`` keeps ZeRO-3 ranks stepping together until all of them are done. ``generator``
    (the ``gen`` of ``with g.generation_mode() as gen``, e.g. the hybrid engine) generates instead of
    ``model.generate``.
    """
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    out: list[str] = []
    cfg = sampling or SamplingConfig(max_new_tokens=max_new_tokens, do_sample=False)
    fmt = fmt or prompt_format(tokenizer)
    try:
        for s in range(0, len(prompts), batch_size):
            texts = [fmt.prompt_text(p) for p in prompts[s : s + batch_size]]
            enc = tokenizer(
                texts, return_tensors="pt", padding=True, add_special_tokens=fmt.add_special_tokens
            )
            enc = enc.to(device)
            if generator is not None:
                seq = generator.generate(enc["input_ids"], enc["attention_mask"], cfg)
            else:
                extra = (
                    {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
                    if cfg.do_sample
                    else {}
                )
                seq = model.generate(
                    **enc,
                    **extra,
                    max_new_tokens=cfg.max_new_tokens,
                    do_sample=cfg.do_sample,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=list(fmt.stop_ids),
                    synced_gpus=synced_gpus,
                    use_cache=True,
                )
            out.extend(tokenizer.batch_decode(seq[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
        if was_training:
            model.train()
    return out


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
    prompts: list[str], answers: list[str], weights: list[float]
) -> dict[str, float] | None:
    """Verifier accuracy of each rank's (prompt, answer) pairs, summed over ranks (call on every rank):
    ``accuracy`` and ``accuracy/<task>``, over the prompts a built-in task recognises (None if none does)."""
    right: dict[str, float] = defaultdict(float)
    total: dict[str, float] = defaultdict(float)
    for p, a, w in zip(prompts, answers, weights, strict=True):
        name = tasks.task_of(p)
        if name is not None:
            total[name] += w
            right[name] += w * float(bool(tasks.verify(p, a)))
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
    answers = generate_texts(
        model,
        tokenizer,
        mine,
        device=device,
        synced_gpus=synced_gpus,
        max_new_tokens=max_new_tokens,
        generator=generator,
        sampling=sampling,
        fmt=fmt,
    )
    return verifier_accuracy(mine, answers, weights)


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
