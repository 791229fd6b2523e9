"""The straggler rule (tandem/train/elastic/straggler.py) on made-up windows: no processes, the
ranks' all_gather replaced by a table of per-rank medians."""

from types import SimpleNamespace

import pytest
import torch

from tandem.train.elastic import straggler
from tandem.train.elastic.straggler import StragglerMonitor


class Recorder:
    def __init__(self):
        self.rows = []

    def write(self, kind, **kw):
        self.rows.append((kind, kw))


def run(windows: list[list[float]], every=2, ratio=1.5, min_ms=10.0, monkeypatch=None):
    """Feed each window's per-rank data wait (ms) to a monitor as rank 0; every rank's busy is 50 ms."""
    world = len(windows[0])
    table = iter(windows)

    def all_gather(rows, mine):
        data = next(table)
        for r, row in enumerate(rows):
            row.copy_(torch.tensor([50.0, data[r]], dtype=torch.float64))

    monkeypatch.setattr(straggler.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(straggler.dist, "all_gather", all_gather)
    metrics, logged = Recorder(), []
    mon = StragglerMonitor(SimpleNamespace(world=world, rank=0), metrics, lambda msg, **kw: logged.append(msg), every, ratio,
                           min_ms)
    found = []
    for w in range(len(windows)):
        for i in range(every):
            found += mon.record(w * every + i + 1, 0.05, 0.001)
    return found, metrics.rows, logged


def test_slow_in_two_windows_in_a_row_is_a_straggler(monkeypatch):
    found, rows, logged = run([[1, 40, 1, 1], [1, 40, 1, 1]], monkeypatch=monkeypatch)
    assert [(f["step"], f["rank"], f["what"]) for f in found] == [(4, 1, "data wait")]
    assert found[0]["ratio"] == 40.0 and found[0]["ref_ms"] == 1.0
    assert [k for k, _ in rows] == ["ranks", "ranks", "straggler"] and rows[0][1]["data_ms"] == [1, 40, 1, 1]
    assert logged and "straggler: rank 1 data wait 40.0 ms/step" in logged[0] and "over steps 1-4" in logged[0]


def test_one_noisy_window_is_not_one(monkeypatch):
    found, rows, _ = run([[1, 40, 1, 1], [1, 1, 1, 1], [1, 40, 1, 1], [40, 1, 1, 1]], monkeypatch=monkeypatch)
    assert found == [] and [k for k, _ in rows] == ["ranks"] * 4


@pytest.mark.parametrize("slow,why", [
    (14.9, "under ratio x the others' median (1.5 x 10 ms)"),
    (19.0, "1.9x but only 9 ms more: under min_ms"),
])
def test_both_the_ratio_and_the_margin_must_hold(slow, why, monkeypatch):
    found, _, _ = run([[10, slow, 10], [10, slow, 10]], monkeypatch=monkeypatch)
    assert found == [], why


def test_the_reference_is_the_median_of_the_others(monkeypatch):
    """Two slow ranks of four: each is compared with the median of the other three, which holds the
    other slow one, so a half-slow group is judged against a raised reference."""
    found, _, _ = run([[1, 30, 30, 1], [1, 30, 30, 1]], monkeypatch=monkeypatch)
    assert {f["rank"] for f in found} == {1, 2} and all(f["ref_ms"] == 1.0 for f in found)
    found, _, _ = run([[1, 30, 30, 30], [1, 30, 30, 30]], monkeypatch=monkeypatch)
    assert found == []  # three of four alike: the odd one out is fast, not a straggler


def test_off_and_alone(monkeypatch):
    assert run([[1, 40], [1, 40]], every=0, monkeypatch=monkeypatch)[:2] == ([], [])
    found, rows, _ = run([[40], [40]], monkeypatch=monkeypatch)
    assert found == [] and len(rows) == 2  # a world of one has nobody to be slower than
