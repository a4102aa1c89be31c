"""Rule-based rewards used by the step-3 tests (imported by the PPO run via --reward_fn)."""

from __future__ import annotations


def ascii_first(prompts: list[str], responses: list[str]) -> list[float]:
    """1 when the response starts with a printable ASCII character (about half of the byte tokens, so a
    random policy earns it half the time), else 0: with one-token answers a contextual bandit."""
    return [1.0 if r[:1].isascii() and r[:1].isprintable() and r[:1] != "" else 0.0 for r in responses]
