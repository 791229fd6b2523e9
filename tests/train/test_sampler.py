"""DistributedSampler remainder handling over uneven data set sizes, and mid-epoch resume."""

from collections import Counter

import pytest

from tandem.train.sampler import ResumableDistributedSampler


def shares(n, world, drop, epoch=0, seed=0):
    out = []
    for r in range(world):
        s = ResumableDistributedSampler(range(n), world, r, shuffle=True, seed=seed, drop_last=drop)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n", [1, 7, 100, 101, 102, 103, 1437])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pad_every_sample_at_least_once_and_pad_counted(n, world):
    if n < world:
        pytest.skip("fewer samples than ranks")
    parts = shares(n, world, drop=False)
    assert len({len(p) for p in parts}) == 1  # equal share: DDP needs the same step count
    count = Counter(i for p in parts for i in p)
    assert set(count) == set(range(n))  # every sample in the epoch
    pad = (-n) % world
    assert sum(count.values()) == n + pad
    assert sum(c - 1 for c in count.values()) == pad  # only the padded ones twice


@pytest.mark.parametrize("n", [7, 100, 101, 103, 1437])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_drop_every_kept_sample_exactly_once(n, world):
    parts = shares(n, world, drop=True)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == n - n % world
    # a different epoch drops different samples, so none is left out for good
    flat2 = {i for p in shares(n, world, drop=True, epoch=1) for i in p}
    if n % world:
        assert set(flat) != flat2


def test_epochs_reshuffle_and_are_deterministic():
    assert shares(100, 2, False, epoch=0) == shares(100, 2, False, epoch=0)
    assert shares(100, 2, False, epoch=0) != shares(100, 2, False, epoch=1)


def test_set_start_resumes_mid_epoch():
    full = shares(101, 2, False, epoch=3)[1]
    s = ResumableDistributedSampler(range(101), 2, 1, seed=0)
    s.set_epoch(3)
    s.set_start(20)
    assert list(s) == full[20:] and len(s) == len(full) - 20
    s.set_epoch(4)  # a new epoch starts from its beginning
    assert len(s) == len(full)
