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
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from dschat.generation.sampling import SamplingConfig

if TYPE_CHECKING:
    from transformers import GenerationConfig


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them: (B, T)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


def generation_config_for(sampling: SamplingConfig, tokenizer) -> GenerationConfig:
    """The Hugging Face ``GenerationConfig`` of ``sampling``: greedy, or one draw from the tempered and
    filtered distribution, stopping at the tokenizer's EOS."""
    from transformers import GenerationConfig

    return GenerationConfig(**sampling.generate_kwargs(), use_cache=True, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id)  # fmt: skip


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
    def __init__(self, engine, tokenizer, sampling: SamplingConfig, zero3: bool) -> None:
        self.engine, self.tokenizer, self.sampling, self.zero3 = engine, tokenizer, sampling, zero3

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
        """(B, P) left-padded prompts -> (B, P + n) sequences (rows padded after their EOS)."""
        module = self.engine.module
        config = generation_config_for(sampling or self.sampling, self.tokenizer)
        with without_checkpoint_generation_config(module):
            return module.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                synced_gpus=self.zero3,
            )
