"""How PPO gets its rollouts, behind one call:

    with generator.generation_mode() as gen:
        sequences = gen.generate(input_ids, attention_mask)

:class:`PlainGenerator` runs the KV-cache decoder (:func:`dschat.generation.kv_decode.decode`; with
``SamplingConfig.draw="multinomial"`` the same tokens as Hugging Face ``generate``) on the training
module; under ZeRO-3 every new token re-gathers each layer's weights: correct, and slow. The hybrid engine is a second implementation of the same
interface. Both sample from exactly the distribution :class:`SamplingConfig` describes
(``softmax(logits / temperature)``, then the top-k / top-p filters), whatever generation settings the
checkpoint carries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from dschat.generation.kv_decode import decode
from dschat.generation.sampling import SamplingConfig
from dschat.generation.stops import stop_ids_for
from dschat.models.attention import decode_cache
from dschat.utils import dist


class PlainGenerator:
    """The KV-cache decoder on the training module; a row stops at any of ``stop_ids`` (:func:`stop_ids_for`).

    Not ``generate``: its per-token machinery (logits processors, stopping criteria, cache bookkeeping)
    costs more than a small model's forward (6M Llama, 16 x 64 new tokens on 2 CPU cores: 0.63-0.68 s
    with ``generate``, 0.56-0.57 s here, the same tokens), and it fills unset sampling fields from the
    checkpoint's own generation config."""

    def __init__(
        self, engine, tokenizer, sampling: SamplingConfig, zero3: bool, stop_ids: Sequence[int] | None = None
    ) -> None:
        self.engine, self.tokenizer, self.sampling, self.zero3 = engine, tokenizer, sampling, zero3
        self.stop_ids = stop_ids_for(tokenizer, stop_ids, engine)

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
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sampling: SamplingConfig | None = None,
        greedy_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, P) left-padded prompts -> (B, P + n) sequences (rows padded after their stop token);
        ``greedy_rows`` (B,) bool: rows decoded greedily, the rest by ``sampling``."""
        # ZeRO-3 forwards are collective: ranks step together until every rank's rows are done
        lockstep = True if self.zero3 and dist.world_size() > 1 else None
        module = self.engine.module
        out = decode(module, input_ids, attention_mask, sampling or self.sampling, cache=decode_cache(module),
                     eos_token_id=list(self.stop_ids), pad_token_id=self.tokenizer.pad_token_id, lockstep=lockstep, greedy_rows=greedy_rows)  # fmt: skip
        return out.sequences
