"""Text in, text out: completions of rendered prompts with the KV-cache decoder (``generate``'s tokens,
a shared prefill for repeated prompts) or any generator of this package (the hybrid engine), for
evaluation and on-policy pairs."""

from __future__ import annotations

import torch

from dschat.data.prompt_format import PromptFormat, prompt_format
from dschat.generation.kv_decode import decode
from dschat.generation.sampling import SamplingConfig


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
    ends at one of the format's stop tokens (EOS, a chat template's end of turn). Exactly greedy, or
    exactly ``sampling``: as in the rollouts, a checkpoint's generation config (a repetition penalty, say)
    is not applied.

    ``synced_gpus`` keeps ZeRO-3 ranks stepping together until all of them are done. ``generator``
    (the ``gen`` of ``with g.generation_mode() as gen``, e.g. the hybrid engine) generates instead of
    the decoder on ``model``. Rows that repeat a prompt (K samples each) share its prefill.
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
                seq = decode(model, enc["input_ids"], enc["attention_mask"], cfg, eos_token_id=list(fmt.stop_ids),
                             pad_token_id=tokenizer.pad_token_id,
                             lockstep=True if synced_gpus else None).sequences  # fmt: skip
            out.extend(tokenizer.batch_decode(seq[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
        if was_training:
            model.train()
    return out
