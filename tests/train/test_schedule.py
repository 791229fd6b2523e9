import math

import pytest

from tandem.train.schedule import lr_factor


def test_warmup_then_cosine_to_floor():
    total, warm = 100, 10
    assert lr_factor(0, total, warm, "cosine", 0.0) == pytest.approx(0.1)
    assert lr_factor(9, total, warm, "cosine", 0.0) == pytest.approx(1.0)
    assert lr_factor(10, total, warm, "cosine", 0.0) == pytest.approx(1.0)
    mid = 10 + 45
    assert lr_factor(mid, total, warm, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_factor(100, total, warm, "cosine", 0.1) == pytest.approx(0.1)
    vals = [lr_factor(s, total, warm, "cosine", 0.0) for s in range(warm, total)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_linear_and_constant():
    assert lr_factor(50, 100, 0, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(50, 100, 0, "constant", 0.0) == 1.0
    assert math.isclose(lr_factor(0, 100, 0, "cosine", 0.0), 1.0)
