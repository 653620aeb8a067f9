"""One logged name's values per run, as a chart draws them: x, y and where each came from.

A chart is a few hundred pixels wide; a series may have a million points. The
server sends at most four points per pixel column: in each column (bucket) the
first, the last, the lowest and the highest point, so a spike is never
averaged or sampled away, and every point sent is a stored value, exactly
(hovering shows it). Zooming asks again for the narrower range, which is
bucketed again; once the range holds few enough points, all are sent.
docs/ui.md says how the dashboard uses it.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retrolog._query.dataframe import logged_names
from retrolog.errors import UnknownNameError, UsageError

X_AXES: tuple[str, ...] = ("step", "time")
"""What a series can be drawn against: ``step`` is the value's position among the run's
values of that name (its loop's iterations, counted across outer iterations, from 0);
``time`` is seconds since the run started, at the end of the value's loop iteration."""

NUMERIC_TYPES = ("float", "int", "bool")

# Where each point came from (the ``origin`` array).
RECORDED, BACKFILLED, INEXACT = 0, 1, 2


@dataclass
class Series:
    """One run's values of one name, in x order (after downsampling, if any)."""

    run_id: str
    loop: str | None  # the loop its values are logged in (most of them)
    total: int  # values in the whole series (before the range and downsampling)
    in_range: int  # values in the requested x range
    x: np.ndarray
    y: np.ndarray  # NaN where a float NaN was logged
    origin: np.ndarray  # RECORDED, BACKFILLED or INEXACT per point
    replay: list[str | None]  # per point: the replay that backfilled it (None: recorded)
    exact: bool  # every value in the range is sent (no downsampling)
    code_commit: str | None = None  # the run's code version (backfills ran in it)
    replays: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: NaN and infinities become null (JSON has neither); ``y_text`` keeps
        their names so a tooltip can still say which it was."""
        y = [None if not math.isfinite(v) else v for v in self.y.tolist()]
        special = {i: _special(v) for i, v in enumerate(self.y.tolist()) if not math.isfinite(v)}
        return {
            "run_id": self.run_id,
            "loop": self.loop,
            "total": self.total,
            "in_range": self.in_range,
            "exact": self.exact,
            "x": self.x.tolist(),
            "y": y,
            "y_text": special,
            "origin": self.origin.tolist(),
            "replay": self.replay,
            "code_commit": self.code_commit,
            "replays": self.replays,
        }


def series(
    conn: sqlite3.Connection,
    name: str,
    run_ids: Sequence[str],
    *,
    x: str = "step",
    lo: float | None = None,
    hi: float | None = None,
    width: int | None = None,
) -> list[Series]:
    """``name``'s numeric values in each of ``run_ids`` (runs without any are left out).

    x: "step" or "time" (X_AXES).
    lo, hi: the x range to send (inclusive; None: unbounded).
    width: the chart's width in pixels; with it, a range holding more than
        4 * width values is downsampled to each pixel column's first, last, min and
        max. None sends every value.
    """
    if x not in X_AXES:
        raise UsageError(f"A series is drawn against one of {', '.join(X_AXES)}, not {x!r}.")
    if width is not None and width < 1:
        raise UsageError(f"A chart needs a positive width in pixels, not {width}.")
    if name not in set(logged_names(conn)):
        raise UnknownNameError(f"No run logged {name!r}; `retrolog show RUN` lists a run's names.")
    found = []
    for run_id in dict.fromkeys(run_ids):
        one = _run_series(conn, name, run_id, x)
        if one is None:
            continue
        found.append(_window(one, lo, hi, width))
    return found


def _run_series(conn: sqlite3.Connection, name: str, run_id: str, x: str) -> Series | None:
    # One value per context: the newest recorded record, else the newest backfilled one
    # (a replay run again with --force supersedes the earlier one), as the dataframe has it.
    rows = conn.execute(
        "SELECT l.ctx_id, l.value, l.value_type, l.origin, l.replay_id, l.inexact, l.log_id,"
        " lp.name, COALESCE(lp.t_end, lp.t_start)"
        " FROM logs l JOIN runs r ON r.run_id = l.run_id"
        " LEFT JOIN loops lp ON lp.run_id = l.run_id AND lp.ctx_id = l.ctx_id"
        " WHERE l.name = ? AND l.run_id = ? AND l.ctx_id IS NOT NULL"
        " AND l.value_type IN ('float', 'int', 'bool')"
        " ORDER BY l.ctx_id, (l.origin = 'recorded'), l.log_id",
        (name, run_id),
    ).fetchall()
    if not rows:
        return None
    kept: dict[int, tuple[Any, ...]] = {}
    for row in rows:
        kept[row[0]] = row  # ordered so that the last one per context is the one that counts
    chosen = list(kept.values())
    n = len(chosen)
    y = np.fromiter(
        (math.nan if r[1] is None else float(r[1]) for r in chosen), dtype=np.float64, count=n
    )
    origin = np.fromiter(
        (
            RECORDED if r[3] == "recorded" else INEXACT if r[5] is not None else BACKFILLED
            for r in chosen
        ),
        dtype=np.int8,
        count=n,
    )
    if x == "step":
        xs = np.arange(n, dtype=np.float64)
    else:
        xs = np.fromiter(
            (math.nan if r[8] is None else float(r[8]) for r in chosen), dtype=np.float64, count=n
        )
        if np.isnan(xs).any():  # contexts without a time (never in a written store)
            keep = ~np.isnan(xs)
            xs, y, origin = xs[keep], y[keep], origin[keep]
            chosen = [r for r, k in zip(chosen, keep, strict=True) if k]
    loops = [r[7] for r in chosen if r[7] is not None]
    loop = max(set(loops), key=loops.count) if loops else None
    replay = [r[4] for r in chosen]
    code = conn.execute("SELECT code_commit FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return Series(
        run_id=run_id,
        loop=loop,
        total=len(chosen),
        in_range=len(chosen),
        x=xs,
        y=y,
        origin=origin,
        replay=replay,
        exact=True,
        code_commit=code[0] if code else None,
        replays=_replays(conn, run_id, {r for r in replay if r}),
    )


def _replays(conn: sqlite3.Connection, run_id: str, replay_ids: set[str]) -> dict[str, Any]:
    """What a tooltip says of each replay that backfilled points: when, and its check."""
    found: dict[str, Any] = {}
    for replay_id in sorted(replay_ids):
        row = conn.execute(
            "SELECT p.started_at, r.inexact, r.status FROM replays p"
            " LEFT JOIN replay_runs r ON r.replay_id = p.replay_id AND r.run_id = ?"
            " WHERE p.replay_id = ?",
            (run_id, replay_id),
        ).fetchone()
        if row is not None:
            found[replay_id] = {"started_at": row[0], "inexact": row[1], "status": row[2]}
    return found


def _window(s: Series, lo: float | None, hi: float | None, width: int | None) -> Series:
    """``s`` cut to [lo, hi] and, when that holds more than 4 values per pixel, bucketed."""
    start = 0 if lo is None else int(np.searchsorted(s.x, lo, side="left"))
    stop = len(s.x) if hi is None else int(np.searchsorted(s.x, hi, side="right"))
    index = np.arange(start, stop)
    if width is not None and len(index) > 4 * width:
        index = downsample(s.x[start:stop], s.y[start:stop], width) + start
    exact = len(index) == stop - start
    return Series(
        run_id=s.run_id,
        loop=s.loop,
        total=s.total,
        in_range=stop - start,
        x=s.x[index],
        y=s.y[index],
        origin=s.origin[index],
        replay=[s.replay[i] for i in index.tolist()],
        exact=exact,
        code_commit=s.code_commit,
        replays=s.replays,
    )


def downsample(x: np.ndarray, y: np.ndarray, width: int) -> np.ndarray:
    """Indices of the points to draw of ``(x, y)`` (x sorted) on ``width`` pixel columns.

    Each column keeps its first and last point and its lowest and highest value (NaN
    values are kept where they are first or last, never chosen as a min or max), so
    the drawn line has the same envelope as the full series: M4 aggregation (Jugel
    et al., VLDB 2014). Returns sorted, distinct indices.
    """
    n = len(x)
    if n == 0:
        return np.arange(0)
    span = float(x[-1] - x[0])
    if span <= 0 or not math.isfinite(span):
        bucket = np.zeros(n, dtype=np.int64)
    else:
        bucket = np.minimum(((x - x[0]) / span * width).astype(np.int64), width - 1)
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    ends = np.r_[starts[1:], n] - 1
    low_key = np.where(np.isnan(y), np.inf, y)
    high_key = np.where(np.isnan(y), -np.inf, y)
    lowest = np.lexsort((low_key, bucket))[starts]  # first per bucket: its minimum
    highest = np.lexsort((-high_key, bucket))[starts]  # first per bucket: its maximum
    return np.unique(np.concatenate([starts, ends, lowest, highest]))


def _special(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


@dataclass
class Group:
    """Runs sharing one value of an argument, drawn as a mean line in a min-max band."""

    key: Any  # the argument's value
    run_ids: list[str]
    x: np.ndarray  # each pixel column's mean x
    mean: np.ndarray  # the mean of every value of every run in the column
    low: np.ndarray
    high: np.ndarray
    count: np.ndarray  # values in the column

    def to_json(self) -> dict[str, Any]:
        def finite(a: np.ndarray) -> list[float | None]:
            return [v if math.isfinite(v) else None for v in a.tolist()]

        return {"key": self.key, "run_ids": self.run_ids, "x": self.x.tolist(),
                "mean": finite(self.mean), "low": finite(self.low), "high": finite(self.high),
                "count": self.count.tolist()}  # fmt: skip


def group_series(
    found: Sequence[Series], keys: dict[str, Any], width: int, lo: float | None, hi: float | None
) -> list[Group]:
    """``found`` (whole series, not downsampled) grouped by ``keys[run_id]``: per group and
    pixel column over [lo, hi] (default: the groups' whole x range), the mean, min and max
    of its runs' values (NaN ignored). Groups are ordered by key."""
    if width < 1:
        raise UsageError(f"A chart needs a positive width in pixels, not {width}.")
    xs = [s.x for s in found if len(s.x)]
    if not xs:
        return []
    start = min(float(x[0]) for x in xs) if lo is None else lo
    stop = max(float(x[-1]) for x in xs) if hi is None else hi
    span = stop - start if stop > start else 1.0
    members: dict[str, list[Series]] = {}
    labels: dict[str, Any] = {}
    for s in found:
        label = json.dumps(keys.get(s.run_id), sort_keys=True, default=str)
        members.setdefault(label, []).append(s)
        labels[label] = keys.get(s.run_id)
    groups = []
    for label in sorted(members):
        x = np.concatenate([s.x for s in members[label]])
        y = np.concatenate([s.y for s in members[label]])
        keep = (x >= start) & (x <= stop) & ~np.isnan(y)
        x, y = x[keep], y[keep]
        column = np.minimum(((x - start) / span * width).astype(np.int64), width - 1)
        count = np.bincount(column, minlength=width)
        used = count > 0
        total = np.bincount(column, weights=y, minlength=width)
        at = np.bincount(column, weights=x, minlength=width)
        low = np.full(width, np.inf)
        high = np.full(width, -np.inf)
        np.minimum.at(low, column, y)
        np.maximum.at(high, column, y)
        groups.append(
            Group(
                key=labels[label],
                run_ids=[s.run_id for s in members[label]],
                x=at[used] / count[used],
                mean=total[used] / count[used],
                low=low[used],
                high=high[used],
                count=count[used],
            )
        )
    return groups
