"""A distributed sampler that can resume mid-epoch with the same data order."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    """Shuffle ``n`` indices per epoch by ``(seed, epoch)``, give rank ``r`` every ``world``-th one.

    Each epoch is truncated to a multiple of ``world * batch_size * accumulation`` so that every rank
    runs the same number of full micro-batches and every epoch ends on an optimizer step.
    ``start_batch`` skips the first batches of the current epoch, for resume.
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
    ):
        self.n, self.batch_size, self.rank, self.world = n, batch_size, rank, world
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

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        usable = self.batches_per_epoch() * self.world * self.batch_size
        mine = order[self.rank : usable : self.world]
        return iter(mine[self.start_batch * self.batch_size :])
