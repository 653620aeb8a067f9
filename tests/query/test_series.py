"""Downsampling a series for a chart: what is sent keeps every pixel column's envelope."""

from __future__ import annotations

import numpy as np
import pytest

from retrolog._query.series import Series, bin_keys, downsample, group_series


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


def test_a_continuous_argument_is_binned_into_a_handful_of_groups() -> None:
    rng = np.random.default_rng(3)
    lrs = {f"r{i}": float(v) for i, v in enumerate(10 ** rng.uniform(-5, -1, 300))}
    binned = bin_keys(lrs)
    bins = {tuple(b) for b in binned.values()}
    assert 2 <= len(bins) <= 6
    for run_id, (low, high) in binned.items():
        assert low <= float(f"{lrs[run_id]:.3g}") <= high
    # Quantile bins: about as many runs in each.
    sizes = [list(map(tuple, binned.values())).count(b) for b in bins]
    assert min(sizes) >= 300 / 6 / 2
    # Few values, text or booleans: one group per value.
    assert bin_keys({"a": 0.1, "b": 0.2, "c": 0.1}) == {"a": 0.1, "b": 0.2, "c": 0.1}
    named = {f"r{i}": f"opt{i}" for i in range(10)}
    assert bin_keys(named) == named
    # The groups come in the bins' order, low to high (not as text: "1e-05" after "0.01").
    found = [
        Series(run_id=r, loop=None, total=2, in_range=2, x=np.array([0.0, 1.0]),
               y=np.array([1.0, 2.0]), origin=np.zeros(2, np.uint8),
               replay_index=np.full(2, -1, np.int32), replay_ids=[], exact=True)
        for r in lrs
    ]  # fmt: skip
    groups = group_series(found, binned, 10, None, None)
    assert [g.key[0] for g in groups] == sorted(b[0] for b in bins)
    assert sum(len(g.run_ids) for g in groups) == 300
