"""dschat.data.split: disjoint per-step shares of a source."""

from __future__ import annotations

import random

import pytest

from dschat.data.schema import Sample
from dschat.data.split import phase_indices, phase_share

F = [0.2, 0.4, 0.4]


@pytest.mark.parametrize(("n", "seed"), [(100, 0), (101, 7), (10, 3), (1, 0), (0, 0)])
def test_phases_are_disjoint_and_cover_everything(n, seed):
    parts = [phase_indices(n, F, p, seed) for p in (1, 2, 3)]
    assert sorted(i for part in parts for i in part) == list(range(n))
    for part in parts:
        assert part == sorted(part)


@pytest.mark.parametrize(
    ("n", "fractions", "sizes"),
    [
        (100, F, [20, 40, 40]),
        (10, F, [2, 4, 4]),
        (7, [1 / 3, 1 / 3, 1 / 3], [2, 3, 2]),  # cuts at round(7/3) = 2 and round(14/3) = 5
        (5, [1.0, 0.0, 0.0], [5, 0, 0]),
        (5, [0.0, 0.0, 1.0], [0, 0, 5]),
        (9, [0.5, 0.5, 0.0], [4, 5, 0]),  # round(4.5) = 4 (to even)
    ],
)
def test_share_sizes(n, fractions, sizes):
    assert [len(phase_indices(n, fractions, p, 1)) for p in (1, 2, 3)] == sizes


def test_deterministic_by_seed():
    assert phase_indices(50, F, 2, seed=11) == phase_indices(50, F, 2, seed=11)


def test_other_seed_other_share():
    assert phase_indices(50, F, 1, seed=11) != phase_indices(50, F, 1, seed=12)


def test_cut_of_one_seeded_permutation():
    perm = list(range(10))
    random.Random("split:5:10").shuffle(perm)
    assert phase_indices(10, F, 1, 5) == sorted(perm[0:2])
    assert phase_indices(10, F, 2, 5) == sorted(perm[2:6])
    assert phase_indices(10, F, 3, 5) == sorted(perm[6:10])


def test_bad_phase():
    with pytest.raises(ValueError, match="phase must be 1, 2 or 3, got 0"):
        phase_indices(10, F, 0, 0)
    with pytest.raises(ValueError, match="got 4"):
        phase_indices(10, F, 4, 0)


def test_phase_share_picks_the_samples():
    samples = [Sample(f"p{i}", f"c{i}") for i in range(20)]
    for phase in (1, 2, 3):
        assert phase_share(samples, F, phase, 4) == [samples[i] for i in phase_indices(20, F, phase, 4)]
