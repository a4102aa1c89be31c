"""What distribution new tokens are drawn from: one options type for every generator (plain
``generate``, the KV-cache decoder, the hybrid engine, the inference tools' greedy and sampling
strategies), checked in one place and turned into ``generate`` arguments in one place.

Pure Python (no torch), so the option parsers check it before any slow start-up work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from dschat.utils.errors import UserError

DRAWS = ("inverse_cdf", "multinomial")


@dataclass(frozen=True)
class SamplingConfig:
    """Greedy (``do_sample=False``), or one draw from ``softmax(logits / temperature)`` after the top-k
    filter (``top_k``, 0 = off) and then the nucleus filter (``top_p``, 1.0 = off), as Hugging Face
    ``generate`` applies them.

    ``draw`` is how the KV-cache decoder picks a token from that distribution (the same distribution
    either way): ``inverse_cdf`` takes one uniform number per row and the row's cumulative
    probabilities; ``multinomial`` is ``torch.multinomial``, ``generate``'s own draw, which gives
    ``generate``'s very tokens from the same seed but draws one exponential per vocabulary entry and row
    (SmolLM2, 32 rows: 42 ms a token on 2 CPU cores, against 2 ms).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    min_new_tokens: int = 0  # EOS is forbidden before this many new tokens (benchmarks force full length)
    draw: str = "inverse_cdf"  # one of DRAWS

    def validate(self, flags: dict[str, str] | None = None) -> SamplingConfig:
        """Raise :class:`UserError` naming the flag of the first out-of-range field (``flags`` maps a
        field to its flag where the two differ, e.g. ``{"max_new_tokens": "--max_answer_seq_len"}``)."""
        flag = {f.name: f"--{f.name}" for f in fields(self)} | (flags or {})
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens", "must be at least 1"),
            # greedy never reads it, and 0 is the usual way to say greedy
            (math.isfinite(self.temperature) and (self.temperature > 0 or (not self.do_sample and self.temperature == 0)),
             "temperature", "must be a finite number > 0 (sampling divides the logits by it)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0 turns it off)"),
            (0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be in [0, max_new_tokens]"),
            (self.draw in DRAWS, "draw", f"must be one of {', '.join(DRAWS)}"),
        ]  # fmt: skip
        for ok, name, rule in checks:
            if not ok:
                raise UserError(f"{flag[name]} {getattr(self, name)}: {rule}")
        return self

    def generate_kwargs(self) -> dict:
        """Arguments for Hugging Face ``generate`` / ``GenerationConfig``. Greedy sets the sampling
        fields to None, so that a checkpoint's sampling defaults are neither used nor warned about."""
        kw: dict = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.min_new_tokens:
            kw["min_new_tokens"] = self.min_new_tokens
        if self.do_sample:
            kw.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        return kw
