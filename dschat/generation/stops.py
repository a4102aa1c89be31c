"""Where a rollout ends: the stop token ids of a model's format and the masks they cut. Pure torch, so
the PPO maths (``dschat.rlhf.ppo_math``) uses them without importing a generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def stop_ids_for(tokenizer, stop_ids: Sequence[int] | None = None) -> tuple[int, ...]:
    """The token ids at which a rollout stops: ``stop_ids`` (a prompt format's, e.g. a chat template's end
    of turn and EOS, :attr:`dschat.data.prompt_format.PromptFormat.stop_ids`), else the tokenizer's EOS."""
    if stop_ids:
        return tuple(dict.fromkeys(int(i) for i in stop_ids))
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


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
