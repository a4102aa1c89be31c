"""How PPO gets its rollouts, behind one call:

    with generator.generation_mode() as gen:
        sequences = gen.generate(input_ids, attention_mask)

:class:`PlainGenerator` calls Hugging Face ``generate`` on the training module (under ZeRO-3 every
new token re-gathers each layer's weights: correct, and slow). The hybrid engine is a second
implementation of the same interface.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    min_new_tokens: int = 0  # EOS is forbidden before this many new tokens (benchmarks force full length)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as ``generate`` computes them: (B, T)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


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
        s = sampling or self.sampling
        kwargs = {"do_sample": s.do_sample, "max_new_tokens": s.max_new_tokens}
        if s.min_new_tokens:
            kwargs["min_new_tokens"] = s.min_new_tokens
        if s.do_sample:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        return self.engine.module.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            synced_gpus=self.zero3,
            use_cache=True,
            **kwargs,
        )
