"""A distributed sampler that can resume mid-epoch with the same data order."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

MEGA_BATCH = 50  # global batches per length-sorted group (Hugging Face's LengthGroupedSampler uses 50)


def group_by_length(
    order: list[int], lengths: list[int], chunk: int, generator: torch.Generator
) -> list[int]:
    """Reorder a shuffled index list so that each run of ``chunk`` consecutive indices (one global batch)
    holds samples of similar length: the list is cut into mega-batches of ``MEGA_BATCH`` global batches,
    each sorted by length, and the global batches are then shuffled, so the data order stays random at
    the scale of batches while padding within a batch nearly disappears."""
    # The samples that fill no whole batch (the epoch drops them) are the shuffled order's last ones, a
    # random few that change every epoch; sorted first, they were always the shortest of the last group.
    cut = len(order) - len(order) % chunk
    order, rest = order[:cut], order[cut:]
    mega = chunk * MEGA_BATCH
    batches: list[list[int]] = []
    for s in range(0, len(order), mega):
        group = sorted(order[s : s + mega], key=lambda i: -lengths[i])
        batches += [group[b : b + chunk] for b in range(0, len(group), chunk)]
    perm = torch.randperm(len(batches), generator=generator).tolist()
    return [i for k in perm for i in batches[k]] + rest


class ResumableDistributedSampler(Sampler[int]):
    """Shuffle ``n`` indices per epoch by ``(seed, epoch)``, give rank ``r`` every ``world``-th one.

    Each epoch is truncated to a multiple of ``world * batch_size * accumulation`` so that every rank
    runs the same number of full micro-batches and every epoch ends on an optimizer step.
    ``start_batch`` skips the first batches of the current epoch, for resume. With ``lengths`` (one per
    sample) every global batch holds samples of similar length (:func:`group_by_length`).
    """

    def __init__(
        self,
        n: int,
        *,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        shuffle: bool = True,
        accumulation: int = 1,
        lengths: list[int] | None = None,
    ):
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"{len(lengths)} lengths for {n} samples")
        self.n, self.batch_size, self.rank, self.world = n, batch_size, rank, world
        self.lengths = lengths
        self.accumulation = accumulation
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch():
            raise ValueError(f"start_batch {start_batch} outside 0..{self.batches_per_epoch()}")
        self.epoch, self.start_batch = epoch, start_batch

    def batches_per_epoch(self) -> int:
        # A multiple of the accumulation steps, so that every epoch ends on an optimizer step.
        full = self.n // (self.world * self.batch_size)
        return full - full % self.accumulation

    def __len__(self) -> int:
        return (self.batches_per_epoch() - self.start_batch) * self.batch_size

    def _order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s indices of all ranks (rank r takes every world-th one from r)."""
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        order = torch.randperm(self.n, generator=g).tolist() if self.shuffle else list(range(self.n))
        if self.lengths is not None:
            # one group per optimizer step (all ranks, all accumulated micro-batches): one rank with
            # accumulation K and K ranks then take the same samples at every step
            order = group_by_length(order, self.lengths, self.world * self.batch_size * self.accumulation, g)
        return order[: self.batches_per_epoch() * self.world * self.batch_size]

    def __iter__(self) -> Iterator[int]:
        mine = self._order(self.epoch)[self.rank :: self.world]
        return iter(mine[self.start_batch * self.batch_size :])

    def indices_of_run(self, micro_batches: int) -> set[int]:
        """Every index that any rank draws in its first ``micro_batches`` micro-batches from epoch 0 on (what
        a run of that length reads: per-example work such as DPO's reference log-probs needs no more)."""
        out: set[int] = set()
        epoch, left, per_epoch = 0, micro_batches, self.batches_per_epoch()
        while left > 0 and per_epoch > 0:
            take = min(left, per_epoch)
            out.update(self._order(epoch)[: take * self.world * self.batch_size])
            left -= take
            epoch += 1
        return out
