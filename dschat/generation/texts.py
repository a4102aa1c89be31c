"""Text in, text out: completions of rendered prompts with the KV-cache decoder (``generate``'s
distribution, a shared prefill for repeated prompts) or any generator of this package (the hybrid engine), for
evaluation and on-policy pairs."""

from __future__ import annotations

import torch

from dschat.data.prompt_format import PromptFormat, prompt_format
from dschat.generation.decoding import Replies
from dschat.generation.kv_decode import decode
from dschat.generation.sampling import SamplingConfig
from dschat.generation.stops import stop_ids_for, truncated_rows


@torch.no_grad()
def generate_text_replies(
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
    greedy_rows: list[bool] | None = None,
) -> Replies:
    """Greedy completions (text after the prompt) for ``prompts`` (dialogue text or bare questions,
    rendered by ``fmt``: default the tokenizer's own format, as in training), left-padded batches;
    sampled ones with ``sampling`` (its ``max_new_tokens`` then replaces ``max_new_tokens``). A reply
    ends at one of the format's stop tokens (EOS, a chat template's end of turn). Exactly greedy, or
    exactly ``sampling``: as in the rollouts, a checkpoint's generation config (a repetition penalty, say)
    is not applied.

    ``synced_gpus`` keeps ZeRO-3 ranks stepping together until all of them are done. ``generator``
    (the ``gen`` of ``with g.generation_mode() as gen``, e.g. the hybrid engine) generates instead of
    the decoder on ``model``. Rows that repeat a prompt (K samples each) share its prefill.
    ``greedy_rows`` (one flag per prompt): those are answered greedily, the others by ``sampling``.
    A reply that reached no stop token is cut off (``Replies.cut_off``): it used every new token and
    stops mid-answer. Texts are not cut at the format's stop strings (:func:`dschat.data.prompt_format.cut_reply`
    does that where a caller needs it).
    """
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    out: list[str] = []
    cut_off: list[bool] = []
    cfg = sampling or SamplingConfig(max_new_tokens=max_new_tokens, do_sample=False)
    fmt = fmt or prompt_format(tokenizer)
    stops = generator.stop_ids if generator is not None else stop_ids_for(tokenizer, fmt.stop_ids, model)
    try:
        for s in range(0, len(prompts), batch_size):
            texts = [fmt.prompt_text(p) for p in prompts[s : s + batch_size]]
            enc = tokenizer(
                texts, return_tensors="pt", padding=True, add_special_tokens=fmt.add_special_tokens
            )
            enc = enc.to(device)
            greedy = None if greedy_rows is None else torch.tensor(greedy_rows[s : s + batch_size])
            if generator is not None:
                seq = generator.generate(enc["input_ids"], enc["attention_mask"], cfg, greedy_rows=greedy)
            else:
                seq = decode(model, enc["input_ids"], enc["attention_mask"], cfg, eos_token_id=list(stops),
                             pad_token_id=tokenizer.pad_token_id, lockstep=True if synced_gpus else None,
                             greedy_rows=greedy).sequences  # fmt: skip
            width = enc["input_ids"].shape[1]
            out.extend(tokenizer.batch_decode(seq[:, width:], skip_special_tokens=True))
            # the decoder runs until every row stopped or the budget is spent: a row without a stop ran out
            cut_off.extend(truncated_rows(seq, width, stops).tolist())
    finally:
        tokenizer.padding_side = side
        if was_training:
            model.train()
    return Replies(out, cut_off)


def greedy_and_sampled_texts(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    sampling: SamplingConfig,
    *,
    batch_size: int = 32,
    **kw,
) -> tuple[list[str], list[str]]:
    """For each prompt its greedy answer and one answer drawn by ``sampling`` (whose ``max_new_tokens``
    and ``min_new_tokens`` hold for both), generated in the same batches of ``batch_size`` rows (half as
    many prompts) so that the two rows of a prompt share its prefill where the decoder's cache allows
    (not a ``StaticCache``). Returns ``(greedy, sampled)``; ``kw`` as for :func:`generate_text_replies`."""
    rows = [p for p in prompts for _ in range(2)]
    out = generate_text_replies(model, tokenizer, rows, batch_size=max(2, batch_size - batch_size % 2),
                                sampling=sampling, greedy_rows=[True, False] * len(prompts), **kw).texts  # fmt: skip
    return out[0::2], out[1::2]
