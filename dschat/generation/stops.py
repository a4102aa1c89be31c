"""Where a rollout ends: the stop token ids of a model's format and the masks they cut. Pure torch, so
the PPO maths (``dschat.rlhf.ppo_math``) uses them without importing a generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def model_eos_ids(model) -> tuple[int, ...]:
    """The end-of-sequence ids of ``model``'s generation config (a transformers model, a peft wrapper or a
    DeepSpeed engine): a list on Llama 3 (``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``) and
    Qwen2.5 (``<|im_end|>``, ``<|endoftext|>``), which the tokenizer's single EOS misses; () without one."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's model; peft forwards the attribute
    ids = getattr(getattr(inner, "generation_config", None), "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]))


def stop_ids_for(tokenizer, stop_ids: Sequence[int] | None = None, model=None) -> tuple[int, ...]:
    """The token ids at which a reply or rollout stops, in this order: ``stop_ids`` (a prompt format's, e.g.
    a chat template's end of turn and EOS, :attr:`dschat.data.prompt_format.PromptFormat.stop_ids`), the
    tokenizer's EOS, and every EOS of ``model``'s generation config (:func:`model_eos_ids`), as
    ``generate`` would stop there. The one place every generator takes its stops from."""
    eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    extra = model_eos_ids(model) if model is not None else ()
    return tuple(dict.fromkeys(int(i) for i in (*(stop_ids or ()), *eos, *extra)))


def is_stop(tokens: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """Token ids (any shape) -> bool of the same shape: True where the token is one of ``stop_ids``."""
    return torch.isin(tokens, torch.tensor(list(stop_ids), dtype=tokens.dtype, device=tokens.device))


def truncated_rows(sequences: torch.Tensor, prompt_len: int, stop_ids: Sequence[int]) -> torch.Tensor:
    """(B, T) prompt + generated tokens -> (B,) bool: True where the response has no stop token, i.e.
    generation stopped at the token budget mid-answer (``--truncation_penalty`` charges these; on-policy
    pairs never choose them)."""
    return ~is_stop(sequences[:, prompt_len:], stop_ids).any(dim=1)


def through_first_stop(response: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """(B, n) generated tokens -> (B, n) bool: True up to and including each row's first stop token
    (whatever follows it, padding that may equal a stop id, is not part of the answer)."""
    stop = is_stop(response, stop_ids).long()
    return (stop.cumsum(dim=1) - stop) == 0
