"""How PPO gets its rollouts, behind one call:

    with generator.generation_mode() as gen:
        sequences = gen.generate(input_ids, attention_mask)

:class:`PlainGenerator` calls Hugging Face ``generate`` on the training module (under ZeRO-3 every
new token re-gathers each layer's weights: correct, and slow). The hybrid engine is a second
implementation of the same interface. Both sample from exactly the distribution :class:`SamplingConfig`
describes (``softmax(logits / temperature)``, then the top-k / top-p filters), whatever generation
settings the checkpoint carries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from dschat.generation.sampling import SamplingConfig

if TYPE_CHECKING:
    from transformers import GenerationConfig


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them: (B, T)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


def stop_ids_for(tokenizer, stop_ids: Sequence[int] | None = None) -> tuple[int, ...]:
    """The token ids at which a rollout stops: ``stop_ids`` (a prompt format's, e.g. a chat template's end
    of turn and EOS, :attr:`dschat.data.prompt_format.PromptFormat.stop_ids`), else the tokenizer's EOS."""
    if stop_ids:
        return tuple(dict.fromkeys(int(i) for i in stop_ids))
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def is_stop(tokens: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """Token ids (any shape) -> bool of the same shape: True where the token is one of ``stop_ids``."""
    return torch.isin(tokens, torch.tensor(list(stop_ids), dtype=tokens.dtype, device=tokens.device))


def through_first_stop(response: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """(B, n) generated tokens -> (B, n) bool: True up to and including each row's first stop token
    (whatever follows it, padding that may equal a stop id, is not part of the answer)."""
    stop = is_stop(response, stop_ids).long()
    return (stop.cumsum(dim=1) - stop) == 0


def generation_config_for(
    sampling: SamplingConfig, tokenizer, stop_ids: Sequence[int] = ()
) -> GenerationConfig:
    """The Hugging Face ``GenerationConfig`` of ``sampling``: greedy, or one draw from the tempered and
    filtered distribution, stopping at any of :func:`stop_ids_for`."""
    from transformers import GenerationConfig

    stops = list(stop_ids_for(tokenizer, stop_ids))
    return GenerationConfig(**sampling.generate_kwargs(), use_cache=True, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=stops or None)  # fmt: skip


@contextlib.contextmanager
def without_checkpoint_generation_config(module: torch.nn.Module) -> Iterator[None]:
    """Inside the block the Hugging Face model under ``module`` (a peft wrapper's base model) has a blank
    ``generation_config``.

    ``generate`` fills every field the config it is given leaves unset from the model's own
    ``generation_config`` (a hub checkpoint's ``repetition_penalty``, ``top_k``, ``min_p``,
    ``suppress_tokens`` ...), so an explicit config alone does not fix the distribution sampled from;
    with a blank one only transformers' neutral defaults fill the gaps. The checkpoint's settings are
    restored afterwards (they are saved with the exported model).
    """
    from transformers import GenerationConfig

    hf = module.get_base_model() if hasattr(module, "get_base_model") else module
    saved = getattr(hf, "generation_config", None)
    hf.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf.generation_config = saved


class PlainGenerator:
    """``generate`` on the training module; a row stops at any of ``stop_ids`` (:func:`stop_ids_for`)."""

    def __init__(
        self, engine, tokenizer, sampling: SamplingConfig, zero3: bool, stop_ids: Sequence[int] | None = None
    ) -> None:
        self.engine, self.tokenizer, self.sampling, self.zero3 = engine, tokenizer, sampling, zero3
        self.stop_ids = stop_ids_for(tokenizer, stop_ids)

    @contextlib.contextmanager
    def generation_mode(self) -> Iterator[PlainGenerator]:
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            yield self
        finally:
            if was_training:
                module.train()

    def stats(self) -> dict[str, float]:
        """Generator-specific summary entries (the hybrid engine reports its switches here)."""
        return {}

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingConfig | None = None
    ) -> torch.Tensor:
        """(B, P) left-padded prompts -> (B, P + n) sequences (rows padded after their stop token)."""
        module = self.engine.module
        config = generation_config_for(sampling or self.sampling, self.tokenizer, self.stop_ids)
        with without_checkpoint_generation_config(module):
            return module.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                synced_gpus=self.zero3,
            )
