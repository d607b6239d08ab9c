import math

import pytest

from whetstone.training.schedule import lr_at

SCHEDULE = dict(peak_lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)


def test_warmup_rises_linearly_to_the_peak():
    assert [lr_at(s, **SCHEDULE) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_falls_from_peak_to_floor():
    assert lr_at(4, **SCHEDULE) == 1.0
    assert lr_at(9, **SCHEDULE) == pytest.approx(0.55)  # halfway: mean of peak and floor
    assert lr_at(14, **SCHEDULE) == pytest.approx(0.1)
    values = [lr_at(s, **SCHEDULE) for s in range(4, 15)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_stays_at_the_floor_past_the_end():
    assert lr_at(100, **SCHEDULE) == pytest.approx(0.1)


def test_no_warmup_starts_at_the_peak():
    assert lr_at(0, peak_lr=2.0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == 2.0
    assert lr_at(10, peak_lr=2.0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(0.0)
    assert not math.isnan(lr_at(0, peak_lr=1.0, warmup_steps=0, total_steps=0, min_lr_ratio=0.0))
