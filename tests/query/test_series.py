"""Downsampling a series for a chart: what is sent keeps every pixel column's envelope."""

from __future__ import annotations

import numpy as np
import pytest

from retrolog._query.series import downsample


def columns(x: np.ndarray, width: int) -> np.ndarray:
    """The pixel column of each x, computed independently of the code under test."""
    return np.array([min(width - 1, int((v - x[0]) / (x[-1] - x[0]) * width)) for v in x])


@pytest.mark.parametrize("seed", range(5))
def test_every_column_keeps_its_first_last_min_and_max(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, width = 50_000, 300
    x = np.cumsum(rng.uniform(0.1, 2.0, n))  # uneven spacing, as times are
    y = np.cumsum(rng.normal(size=n))
    col = columns(x, width)
    # One-point spikes, up or down, each in a column of its own.
    spikes = [rng.choice(np.flatnonzero(col == c)) for c in rng.choice(width, 20, replace=False)]
    y[spikes] += rng.choice([-1, 1], 20) * 1000.0
    kept = downsample(x, y, width)
    assert np.all(np.diff(kept) > 0)  # sorted, distinct
    assert len(kept) <= 4 * width
    for c in np.unique(col):
        members = np.flatnonzero(col == c)
        sent = np.intersect1d(kept, members)
        assert members[0] in sent and members[-1] in sent
        assert y[sent].min() == y[members].min()
        assert y[sent].max() == y[members].max()
    for i in spikes:  # no spike is lost
        assert i in kept


def test_nan_is_never_chosen_as_a_minimum_or_maximum() -> None:
    x = np.arange(10.0)
    y = np.array([1.0, np.nan, 3.0, 0.5, 2.0, np.nan, 9.0, 4.0, 5.0, 6.0])
    kept = downsample(x, y, 1)
    assert set(kept.tolist()) == {0, 9, 3, 6}


def test_a_series_at_one_x_and_an_empty_one() -> None:
    assert downsample(np.zeros(5), np.arange(5.0), 3).tolist() == [0, 4]
    assert downsample(np.zeros(0), np.zeros(0), 3).tolist() == []
