"""Per-step disjoint shares of each source (DeepSpeed-Chat's ``--data_split 2,4,4``)."""

from __future__ import annotations

import random

from dschat.data.schema import Sample


def phase_indices(n: int, fractions: list[float], phase: int, seed: int) -> list[int]:
    """Indices of step ``phase`` (1, 2 or 3) among ``n`` samples.

    One permutation per (n, seed) is cut into contiguous shares in proportion to ``fractions``, so the
    three steps' shares are disjoint and together cover every index. Boundaries are rounded cumulative
    sums, hence independent of which phase asks.
    """
    if phase not in (1, 2, 3):
        raise ValueError(f"phase must be 1, 2 or 3, got {phase}")
    perm = list(range(n))
    random.Random(f"split:{seed}:{n}").shuffle(perm)
    bounds = [0]
    acc = 0.0
    for f in fractions:
        acc += f
        bounds.append(round(acc * n))
    bounds[-1] = n
    return sorted(perm[bounds[phase - 1] : bounds[phase]])


def phase_share(samples: list[Sample], fractions: list[float], phase: int, seed: int) -> list[Sample]:
    return [samples[i] for i in phase_indices(len(samples), fractions, phase, seed)]
