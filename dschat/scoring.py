"""Scoring prompt/response pairs with a reward model outside training (inference tools, benchmarks)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dschat.data.collate import length_batches, pad_right
from dschat.data.prompt_format import PromptFormat, keep_last_tokens, prompt_format
from dschat.generation.decoding import context_length


@torch.no_grad()
def score_texts(model, tokenizer, prompts: list[str], responses: list[str], *, batch_size: int = 32,
                device: str | torch.device = "cpu", max_len: int | None = None,
                fmt: PromptFormat | None = None, partners: list[str] | None = None) -> torch.Tensor:  # fmt: skip
    """(N,) reward scores of ``prompt + response`` by a reward model (``ScalarHeadModel``), in eval mode;
    see :func:`score_with`. Rows are cut to ``max_len``, by default to the length step 2 cut the model's
    training rows to (``trained_max_len`` of :func:`~dschat.models.reward.load_reward_model`: a model that
    learned from the last 256 tokens of a dialogue is scored on the same view of it, as its own held-out
    accuracy was), and never beyond what the model attends to (its position table: a learned one has no
    position past it, whatever the tokenizer's limit says)."""
    model.eval()
    limit = context_length(model.hf_model, tokenizer)
    max_len = max_len or getattr(model, "trained_max_len", None) or limit
    return score_with(model.score, tokenizer, prompts, responses, batch_size=batch_size, device=device,
                      max_len=min(max_len, limit), fmt=fmt, partners=partners)  # fmt: skip


@torch.no_grad()
def score_with(score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tokenizer, prompts: list[str],
               responses: list[str], *, batch_size: int = 32, device: str | torch.device = "cpu",
               max_len: int | None = None, fmt: PromptFormat | None = None,
               partners: list[str] | None = None) -> torch.Tensor:  # fmt: skip
    """(N,) scores of ``prompt + response`` by ``score_fn(input_ids, attention_mask) -> (B,)`` (right
    padded), tokenized exactly as step 2 trains (the prompt rendered by ``fmt``, default the tokenizer's
    own format; the response without an end token), scored at the last real token. Rows longer than
    ``max_len`` (default: the tokenizer's ``model_max_length``) have their prompt fitted as step 2 fits its
    pairs' (:meth:`PromptFormat.fit_prompt`); a response that alone is too long keeps BOS and its end (step
    2 drops such a pair, a score is still given). ``partners``: each row's rival answer in a preference
    pair, whose room the prompt leaves too, as step 2 cuts a pair's one prompt for the longer answer (so
    both answers read the same prompt). Batches hold
    rows of similar length (:func:`~dschat.data.collate.length_batches`); they are ``ceil(N / batch_size)``
    calls, so ranks with equally many rows call ``score_fn`` equally often (collective ZeRO-3 forward
    passes)."""
    fmt = fmt or prompt_format(tokenizer)
    p_ids, r_ids = fmt.encode_prompts(prompts), fmt.encode_responses(responses)
    limit = max_len or min(getattr(tokenizer, "model_max_length", 10**9), 10**9)
    # the prompt fitted as step 2 fitted its training rows (old turns, then the question's start); a
    # response that alone is too long keeps BOS and its end
    room = [len(r) for r in r_ids]  # the answer's tokens, or the longer of a pair's two
    if partners is not None:
        room = [max(n, len(o)) for n, o in zip(room, fmt.encode_responses(partners), strict=True)]
    rows = []
    for prompt, p, r, need in zip(prompts, p_ids, r_ids, room, strict=True):
        if len(p) + need > limit and need < limit:
            p = fmt.fit_prompt(prompt, limit - need).ids
        rows.append(keep_last_tokens(p + r, limit, tokenizer.bos_token_id))
    scores = torch.zeros(len(rows))
    for ix in length_batches([len(r) for r in rows], batch_size):
        batch = pad_right([rows[i] for i in ix], tokenizer.pad_token_id)
        scores[ix] = score_fn(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu()
    return scores
