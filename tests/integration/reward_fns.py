"""Rule-based rewards used by the step-3 tests (imported by the PPO run via --reward_fn)."""

from __future__ import annotations


def letters_abc(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of the response's characters that are a, b or c: every token can earn it, so PPO
    gets signal from the first batch even for a random policy."""
    out = []
    for r in responses:
        r = r[:16]
        out.append(sum(ch in "abc" for ch in r) / max(len(r), 1))
    return out
