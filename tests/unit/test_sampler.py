"""dschat.data.sampler: rank partitioning, resume, epochs."""

from __future__ import annotations

import pytest
import torch

from dschat.data.sampler import ResumableDistributedSampler


def make(n=20, bs=2, rank=0, world=1, seed=0, shuffle=True, epoch=0, start_batch=0):
    s = ResumableDistributedSampler(n, batch_size=bs, rank=rank, world=world, seed=seed, shuffle=shuffle)
    s.set_epoch(epoch, start_batch)
    return s


def batches(indices, bs):
    return [indices[i : i + bs] for i in range(0, len(indices), bs)]


def test_unshuffled_order_by_hand():
    # n=10, 2 ranks x 2 per batch: 2 full global batches of 4, the last 2 indices are dropped
    assert list(make(n=10, bs=2, rank=0, world=2, shuffle=False)) == [0, 2, 4, 6]
    assert list(make(n=10, bs=2, rank=1, world=2, shuffle=False)) == [1, 3, 5, 7]
    assert list(make(n=10, bs=3, rank=0, world=1, shuffle=False)) == [0, 1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize(("n", "bs", "world"), [(20, 2, 2), (23, 2, 2), (50, 3, 4), (7, 1, 3)])
def test_ranks_partition_each_global_batch(n, bs, world):
    single = batches(list(make(n=n, bs=bs * world, world=1, seed=5)), bs * world)
    per_rank = [batches(list(make(n=n, bs=bs, rank=r, world=world, seed=5)), bs) for r in range(world)]
    assert all(len(b) == len(single) for b in per_rank)
    for step, global_batch in enumerate(single):
        parts = [per_rank[r][step] for r in range(world)]
        assert all(len(p) == bs for p in parts)
        assert sorted(i for p in parts for i in p) == sorted(global_batch)


@pytest.mark.parametrize(("n", "bs", "world"), [(20, 2, 2), (23, 2, 2), (50, 3, 4)])
def test_equal_lengths_per_rank(n, bs, world):
    samplers = [make(n=n, bs=bs, rank=r, world=world, seed=1) for r in range(world)]
    expected = (n // (bs * world)) * bs
    for s in samplers:
        assert len(s) == expected
        assert len(list(s)) == expected
        assert s.batches_per_epoch() == n // (bs * world)
    seen = [i for s in samplers for i in s]
    assert len(seen) == len(set(seen))
    assert all(0 <= i < n for i in seen)


@pytest.mark.parametrize("start_batch", [0, 1, 3, 5])
def test_resume_gives_the_tail(start_batch):
    for rank in (0, 1):
        full = list(make(n=21, bs=2, rank=rank, world=2, seed=9, epoch=2))
        resumed = make(n=21, bs=2, rank=rank, world=2, seed=9, epoch=2, start_batch=start_batch)
        assert list(resumed) == full[start_batch * 2 :]
        assert len(resumed) == len(full) - start_batch * 2


def test_epochs_reshuffle_and_repeat():
    s = make(n=30, bs=3, seed=4)
    e0 = list(s)
    assert list(s) == e0
    s.set_epoch(1)
    e1 = list(s)
    assert e1 != e0
    assert sorted(e1) == sorted(e0) == list(range(30))
    s.set_epoch(0)
    assert list(s) == e0


def test_set_epoch_resets_start_batch():
    s = make(n=12, bs=2, seed=0, start_batch=3)
    assert len(s) == 6
    s.set_epoch(1)
    assert len(s) == 12 and len(list(s)) == 12


def test_seed_changes_order():
    assert list(make(n=30, seed=1)) != list(make(n=30, seed=2))


def test_fewer_samples_than_a_global_batch():
    s = make(n=3, bs=2, world=2)
    assert len(s) == 0 and list(s) == []


def test_group_by_length_batches_similar_lengths_and_keeps_every_sample():
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 200, (1000,), generator=rng).tolist()
    world, bs = 2, 4
    samplers = [
        ResumableDistributedSampler(1000, batch_size=bs, rank=r, world=world, seed=3, lengths=lengths)
        for r in range(world)
    ]
    per_rank = [list(s) for s in samplers]
    seen = [i for idx in per_rank for i in idx]
    assert len(seen) == len(set(seen)) == samplers[0].batches_per_epoch() * world * bs
    # the micro-batches of one optimizer step (rank 0's and rank 1's j-th batch) come from one global
    # batch of similar lengths: the spread inside it is far below the spread of a random batch
    spreads = []
    for j in range(samplers[0].batches_per_epoch()):
        batch = [lengths[i] for idx in per_rank for i in idx[j * bs : (j + 1) * bs]]
        spreads.append(max(batch) - min(batch))
    assert sum(spreads) / len(spreads) < 15  # random batches of 8 from 10..199: about 140
    # deterministic in (seed, epoch), different across epochs, and resumable mid-epoch
    again = ResumableDistributedSampler(1000, batch_size=bs, rank=0, world=world, seed=3, lengths=lengths)
    assert list(again) == per_rank[0]
    again.set_epoch(1)
    assert list(again) != per_rank[0]
    again.set_epoch(0, start_batch=5)
    assert list(again) == per_rank[0][5 * bs :]


def test_group_by_length_drops_a_random_remainder_not_the_shortest_samples():
    """The samples left over from whole global batches were cut after sorting, so an epoch always dropped
    the shortest of its last group: on a small set the same shortest samples, never seen in any epoch."""
    lengths = list(range(1, 101))  # sample i has length i + 1: the shortest are 0, 1, 2, ...
    sampler = ResumableDistributedSampler(100, batch_size=16, rank=0, world=1, seed=0, lengths=lengths)
    dropped = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        dropped.append(set(range(100)) - set(sampler))
    assert all(len(d) == 100 % 16 for d in dropped)
    assert set().union(*dropped) != set(range(4))  # before: {0, 1, 2, 3} in every epoch
    assert len(set.intersection(*dropped)) < 4  # another few each epoch
    assert len(set().union(*dropped)) > 8


def test_group_by_length_gives_one_rank_with_accumulation_the_samples_of_two_ranks():
    """The equivalence '2 ranks == 1 rank with accumulation 2' holds with length grouping: every optimizer
    step takes the same 8 samples in both layouts (grouping per micro-batch broke it)."""
    lengths = torch.randint(10, 200, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    one = list(ResumableDistributedSampler(200, batch_size=4, rank=0, world=1, seed=3, accumulation=2,
                                           lengths=lengths))  # fmt: skip
    two = [list(ResumableDistributedSampler(200, batch_size=4, rank=r, world=2, seed=3, lengths=lengths))
           for r in range(2)]  # fmt: skip
    for step in range(len(one) // 8):
        assert sorted(one[step * 8 : (step + 1) * 8]) == sorted(two[0][step * 4 : (step + 1) * 4]
                                                                + two[1][step * 4 : (step + 1) * 4])  # fmt: skip


def test_group_by_length_needs_one_length_per_sample():
    with pytest.raises(ValueError, match="3 lengths for 4 samples"):
        ResumableDistributedSampler(4, batch_size=2, rank=0, world=1, seed=0, lengths=[1, 2, 3])


@pytest.mark.parametrize("world, accumulation, micro", [(1, 1, 3), (2, 2, 4), (3, 1, 7)])
def test_indices_of_run_are_exactly_what_the_ranks_draw(world, accumulation, micro):
    lengths = [(i * 7) % 13 for i in range(50)]
    samplers = [ResumableDistributedSampler(50, batch_size=4, rank=r, world=world, seed=3, accumulation=accumulation, lengths=lengths)
                for r in range(world)]  # fmt: skip
    drawn: set[int] = set()
    for s in samplers:
        left, epoch = micro, 0
        while left > 0:
            s.set_epoch(epoch)
            got = list(s)[: min(left, s.batches_per_epoch()) * 4]
            drawn.update(got)
            left -= min(left, s.batches_per_epoch())
            epoch += 1
    assert samplers[0].indices_of_run(micro) == drawn
    assert len(drawn) < 50 or micro * world * 4 >= 50  # a short run needs only part of the data


@pytest.mark.parametrize(("before", "after"), [((2, 4), (4, 2)), ((8, 1), (2, 4)), ((4, 2), (4, 2))])
def test_resume_with_another_split_of_the_global_batch_goes_on_from_the_same_sample(before, after):
    """Global batch 8 as micro-batch x accumulation: a run stopped after 3 optimizer steps (over two
    epochs of 40 samples) and resumed with another split reads the samples the uninterrupted run reads.
    The saved position counts the first run's micro-batches; read as the new run's it skipped 24 samples
    instead of 12 (2 x 4 -> 4 x 2) or 6 instead of 24 (8 x 1 -> 2 x 4)."""
    import dataclasses

    from torch.utils.data import DataLoader

    from dschat.trainer import TrainState, micro_batches

    def loader(bs, accumulation):
        sampler = ResumableDistributedSampler(
            40, batch_size=bs, rank=0, world=1, seed=3, accumulation=accumulation
        )
        return DataLoader(list(range(40)), batch_size=bs, sampler=sampler)

    (bs0, acc0), (bs1, acc1) = before, after
    whole = micro_batches(loader(bs1, acc1), TrainState(global_batch_size=8), num_epochs=2)
    expected = [i for b in whole for i in b.tolist()]
    state = TrainState(global_batch_size=8)
    first = micro_batches(loader(bs0, acc0), state, num_epochs=2)
    got = [i for _ in range(3 * acc0) for i in next(first).tolist()]
    saved = dataclasses.asdict(state)  # what a checkpoint holds
    got += [
        i for b in micro_batches(loader(bs1, acc1), TrainState(**saved), num_epochs=2) for i in b.tolist()
    ]
    assert got == expected and len(got) == 80
