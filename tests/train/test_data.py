"""Data sets: sizes, seeded determinism, the held-out switch, npz round trip and errors."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from tandem.core.errors import DataError
from tandem.core.spec import DataSpec
from tandem.train.data import load_datasets


def tensors(ds):
    return ds.tensors[0], ds.tensors[1]


def test_digits_sizes_and_types():
    train, held = load_datasets(DataSpec(name="digits", held_out=0.2), seed=0, num_classes=10, in_channels=1)
    assert len(train) + len(held) == 1797
    assert len(held) == round(1797 * 0.2)
    x, y = tensors(train)
    assert x.shape == (len(train), 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert set(y.tolist()) == set(range(10)) and set(tensors(held)[1].tolist()) == set(range(10))
    # Normalised by the train split's own statistics.
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-3


def test_digits_split_is_stratified():
    train, held = load_datasets(DataSpec(name="digits", held_out=0.2), seed=3, num_classes=10, in_channels=1)
    counts = torch.bincount(tensors(held)[1], minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38  # ~180 per class * 0.2


def test_digits_cache_gives_the_same_arrays_and_survives_damage(tmp_path, monkeypatch):
    """The split is cached (no scikit-learn import at each worker start): the cached read, a
    fresh computation and a recomputation over a damaged file are identical."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    spec = DataSpec(name="digits", held_out=0.2)
    first = load_datasets(spec, seed=5, num_classes=10, in_channels=1)
    (cached,) = tmp_path.glob("digits-v1-sklearn*-held359-seed5.npz")
    again = load_datasets(spec, seed=5, num_classes=10, in_channels=1)  # read from the cache
    cached.write_bytes(cached.read_bytes()[:1000])  # cut short, as by a crash mid-write elsewhere
    redone = load_datasets(spec, seed=5, num_classes=10, in_channels=1)
    for other in (again, redone):
        for a, b in zip(first, other):
            assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert cached.stat().st_size > 100_000 and not list(tmp_path.glob("*.tmp.npz"))


def test_digits_deterministic_by_seed():
    spec = DataSpec(name="digits", held_out=0.25)
    a, _ = load_datasets(spec, seed=1, num_classes=10, in_channels=1)
    b, _ = load_datasets(spec, seed=1, num_classes=10, in_channels=1)
    c, _ = load_datasets(spec, seed=2, num_classes=10, in_channels=1)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[1], c.tensors[1])


def test_digits_held_out_zero_gives_none():
    train, held = load_datasets(DataSpec(name="digits", held_out=0.0), seed=0, num_classes=10, in_channels=1)
    assert held is None and len(train) == 1797


def test_digits_resize_and_channels():
    train, held = load_datasets(DataSpec(name="digits", image_size=32, held_out=0.1), seed=0,
                                num_classes=10, in_channels=3)
    x, _ = tensors(train)
    assert x.shape[1:] == (3, 32, 32) and tensors(held)[0].shape[1:] == (3, 32, 32)
    assert torch.equal(x[:, 0], x[:, 2])


def test_digits_too_few_classes():
    with pytest.raises(DataError) as e:
        load_datasets(DataSpec(name="digits"), seed=0, num_classes=5, in_channels=1)
    assert e.value.field == "model.num_classes"


def test_synthetic_shapes_range_and_determinism():
    spec = DataSpec(name="synthetic", num_samples=300, image_size=6, held_out=0.1)
    train, held = load_datasets(spec, seed=7, num_classes=4, in_channels=2)
    assert len(train) == 270 and len(held) == 30
    x, y = tensors(train)
    assert x.shape == (270, 2, 6, 6) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0 <= y.min() and y.max() < 4
    again, _ = load_datasets(spec, seed=7, num_classes=4, in_channels=2)
    other, _ = load_datasets(spec, seed=8, num_classes=4, in_channels=2)
    assert torch.equal(x, again.tensors[0]) and torch.equal(y, again.tensors[1])
    assert not torch.equal(x, other.tensors[0])


def test_synthetic_is_learnable():
    spec = DataSpec(name="synthetic", num_samples=2048, image_size=8, held_out=0.25)
    train, held = load_datasets(spec, seed=0, num_classes=10, in_channels=3)
    (x, y), (xh, yh) = tensors(train), tensors(held)
    assert len(torch.unique(y)) == 10  # no class collapsed
    clf = LogisticRegression(max_iter=300).fit(x.flatten(1).numpy(), y.numpy())
    # Chance is ~0.1; the teacher is linear, so a linear probe must do far better.
    assert clf.score(xh.flatten(1).numpy(), yh.numpy()) > 0.5


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3, 5, 5)).astype(np.float64)
    y = rng.integers(0, 4, size=50)
    p = tmp_path / "d.npz"
    np.savez(p, x=x, y=y)
    train, held = load_datasets(DataSpec(name="npz", path=str(p), held_out=0.2), seed=0,
                                num_classes=4, in_channels=3)
    assert len(train) == 40 and len(held) == 10
    assert train.tensors[0].dtype == torch.float32 and train.tensors[1].dtype == torch.int64
    # Every sample lands exactly once, unchanged (up to float32).
    xs = torch.cat([train.tensors[0], held.tensors[0]]).flatten(1)
    ys = torch.cat([train.tensors[1], held.tensors[1]])
    order = [int(np.argmin(np.abs(x.reshape(50, -1) - r.numpy()).sum(1))) for r in xs]
    assert sorted(order) == list(range(50))
    assert torch.allclose(xs, torch.from_numpy(x.reshape(50, -1)[order]).float())
    assert ys.tolist() == y[order].tolist()
    _, none = load_datasets(DataSpec(name="npz", path=str(p), held_out=0), seed=0, num_classes=4,
                            in_channels=3)
    assert none is None


def _npz_error(path, **kw):
    with pytest.raises(DataError) as e:
        load_datasets(DataSpec(name="npz", path=str(path)), seed=0, num_classes=kw.get("num_classes", 4),
                      in_channels=kw.get("in_channels", 1))
    assert e.value.field == "data.path" and e.value.fix
    return e.value


def test_npz_missing_file(tmp_path):
    err = _npz_error(tmp_path / "nope.npz")
    assert err.value == str(tmp_path / "nope.npz")
    assert "not found" in str(err)


def test_npz_missing_array(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.zeros((4, 1, 2, 2)))
    assert "y" in _npz_error(p).message


def test_npz_length_mismatch(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.zeros((4, 1, 2, 2)), y=np.zeros(3, dtype=np.int64))
    assert "4" in _npz_error(p).message and "3" in _npz_error(p).message


def test_npz_bad_shapes_labels_channels_and_garbage(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.zeros((4, 2, 2)), y=np.zeros(4, dtype=np.int64))
    _npz_error(p)
    np.savez(p, x=np.zeros((4, 1, 2, 2)), y=np.array([0, 1, 2, 9]))
    assert "num_classes" in _npz_error(p).fix
    np.savez(p, x=np.zeros((4, 3, 2, 2)), y=np.zeros(4, dtype=np.int64))
    assert "in_channels" in _npz_error(p, in_channels=1).fix
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    _npz_error(junk)


def test_unknown_data_name():
    with pytest.raises(DataError) as e:
        load_datasets(DataSpec(name="imagenet"), seed=0, num_classes=10, in_channels=3)
    assert e.value.field == "data.name"
