"""DistributedSampler that can start mid-epoch, so a resumed run sees the rest of the epoch.

Remainder handling (``drop_last``) is torch's: with pad (False) the shuffled index list
is extended by its own first few entries until it divides by the world size, so
those few samples are seen twice; with drop (True) the last few shuffled indices are
left out of that epoch. Either way every rank gets ``num_samples`` indices and no
sample appears on two ranks except the padded ones.
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    def __init__(self, dataset, num_replicas: int, rank: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start = 0

    @property
    def padding(self) -> int:
        """Samples repeated (pad) or, if negative, left out (drop) each epoch."""
        return self.total_size - len(self.dataset)

    def set_start(self, consumed: int) -> None:
        """Skip the first ``consumed`` indices of this rank's share of the current epoch."""
        self.start = consumed

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start
