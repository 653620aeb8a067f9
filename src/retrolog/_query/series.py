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

import contextlib
import hashlib
import json
import math
import mmap
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retrolog._query.dataframe import logged_names, value_parts, whole_value
from retrolog.errors import UnknownNameError, UsageError
from retrolog.store import series_blocks

X_AXES: tuple[str, ...] = ("step", "time")
"""What a series can be drawn against: ``step`` is the value's position among the run's
values of that name (its loop's iterations, counted across outer iterations, from 0);
``time`` is seconds since the run started, at the end of the value's loop iteration."""

NUMERIC_TYPES = ("float", "int", "bool")

# A series read with at least this many rows from ``logs`` (not from its series blocks)
# is kept in the disk cache: reading that many rows again (about 1.3 µs each) costs
# more than writing and mapping a file.
DISK_ROWS = 2000
_NUMERIC_SQL = "('float', 'int', 'bool')"

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
    replay_index: np.ndarray  # per point: its replay's index in replay_ids, -1 if recorded
    replay_ids: list[str]
    exact: bool  # every value in the range is sent (no downsampling)
    code_commit: str | None = None  # the run's code version (backfills ran in it)
    replays: dict[str, dict[str, Any]] = field(default_factory=dict)
    # When downsampled: (first, last, width), the pixel columns every run was bucketed on.
    grid: tuple[float, float, int] | None = None

    def about(self) -> dict[str, Any]:
        """Everything but the points."""
        return {"run_id": self.run_id, "loop": self.loop, "total": self.total,
                "in_range": self.in_range, "exact": self.exact, "grid": self.grid,
                "code_commit": self.code_commit, "replays": self.replays}  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """JSON-ready: NaN and infinities become null (JSON has neither); ``y_text`` keeps
        their names so a tooltip can still say which it was."""
        values = self.y.tolist()
        y = [v if math.isfinite(v) else None for v in values]
        special = {i: _special(v) for i, v in enumerate(values) if not math.isfinite(v)}
        return {
            **self.about(),
            "x": self.x.tolist(),
            "y": y,
            "y_text": special,
            "origin": self.origin.tolist(),
            # Per point, or null when every point is recorded.
            "replay": [self.replay_ids[i] if i >= 0 else None for i in self.replay_index.tolist()]
            if self.replay_ids
            else None,
        }


def encode_series(found: Sequence[Series]) -> bytes:
    """``found`` as the dashboard's page reads it: the points as raw arrays, which the
    browser views in place, instead of JSON, which it would parse number by number.

    Layout (little-endian): a uint32 header length; the header, UTF-8 JSON, a list with
    each series' ``about()`` plus ``n`` (its points) and ``replay_ids``; zero bytes up to a
    multiple of 8; then, for all series one after another, x as float64, y as float64 (NaN
    and infinities as themselves), replay_index as int32 (-1: recorded) and origin as uint8.
    """
    header = json.dumps(
        [{**s.about(), "n": len(s.x), "replay_ids": s.replay_ids} for s in found]
    ).encode()
    head = len(header).to_bytes(4, "little") + header
    parts = [head, b"\0" * (-len(head) % 8)]
    for name, dtype in (("x", "<f8"), ("y", "<f8"), ("replay_index", "<i4"), ("origin", "u1")):
        arrays = [np.asarray(getattr(s, name), dtype=dtype) for s in found]
        parts.append(np.concatenate(arrays).tobytes() if arrays else b"")
    return b"".join(parts)


@dataclass
class Columns:
    """A run's whole series of one name in context order, as kept between requests: what
    both x axes are made from. One value per context: the one the dataframe counts."""

    ctx: np.ndarray  # int64 context ids, increasing
    y: np.ndarray  # float64; NaN where a float NaN was logged
    # float64 seconds since the run started, at the end of each iteration; read when first
    # drawn against time (all NaN until then: ``timed`` says whether it was)
    t: np.ndarray
    origin: np.ndarray  # int8: RECORDED, BACKFILLED or INEXACT
    replay_index: np.ndarray  # int32 index into replay_ids; -1 for recorded values
    replay_ids: list[str]
    loop: str | None
    timed: bool = False
    # rows read from ``logs`` one Python tuple each (not from series blocks): what the
    # disk cache saves a later reading of (not kept in its files)
    rows_read: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.ctx, self.y, self.t, self.origin, self.replay_index))

    def save(self, path: Path, key: tuple[str, str], stamp: str) -> None:
        """To ``path``, atomically: a JSON header, then the arrays' raw bytes (little-endian,
        each at a multiple of 8). Loading maps it, copies nothing and runs no code."""
        n = len(self.ctx)
        meta = {"key": list(key), "stamp": stamp, "n": n, "loop": self.loop,
                "replay_ids": self.replay_ids, "timed": self.timed}  # fmt: skip
        header = json.dumps(meta).encode()
        body = [_CACHE_MAGIC, len(header).to_bytes(8, "little"), header]
        offset = len(_CACHE_MAGIC) + 8 + len(header)
        for name, dtype in _CACHE_ARRAYS:
            padding = -offset % 8
            data = np.ascontiguousarray(getattr(self, name), dtype=dtype).tobytes()
            body += [b"\0" * padding, data]
            offset += padding + len(data)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.writelines(body)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, key: tuple[str, str], stamp: str) -> Columns | None:
        """What ``save`` wrote for ``key``, if it is there, whole and made at ``stamp``. The
        arrays are read-only views of the file, mapped: only the pages a chart touches are
        read (drawn against steps, neither the contexts nor the times are). The file is
        never changed in place (``save`` renames a new one over it), so a mapping stays
        valid."""
        try:
            with open(path, "rb") as f:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            meta, offset = _cache_header(data, key, stamp)
            if meta is None:
                return None  # absent, from another version or stale: read the store again
            n = int(meta["n"])
            if n < 0:
                return None
            arrays = {}
            for name, dtype in _CACHE_ARRAYS:
                offset += -offset % 8
                arrays[name] = np.frombuffer(data, dtype=dtype, count=n, offset=offset)
                offset += arrays[name].nbytes
            if offset != len(data):
                return None  # cut short or padded: not what save wrote
            found = cls(ctx=arrays["ctx"], y=arrays["y"], t=arrays["t"],
                        origin=arrays["origin"], replay_index=arrays["replay_index"],
                        replay_ids=[str(r) for r in meta["replay_ids"]],
                        loop=meta["loop"], timed=bool(meta["timed"]))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if n and int(found.replay_index.max()) >= len(found.replay_ids):
            return None
        return found


def _cache_header(data: bytes | mmap.mmap, key: tuple[str, str], stamp: str) -> tuple[Any, int]:
    """The header of a file ``Columns.save`` wrote, and where its arrays start; (None, 0)
    when ``data`` does not start with one for ``key`` made at ``stamp``."""
    if data[: len(_CACHE_MAGIC)] != _CACHE_MAGIC:
        return None, 0
    at = len(_CACHE_MAGIC)
    size = int.from_bytes(data[at : at + 8], "little")
    if len(data) < at + 8 + size:
        return None, 0
    meta = json.loads(data[at + 8 : at + 8 + size])
    if not isinstance(meta, dict) or meta.get("stamp") != stamp or meta.get("key") != list(key):
        return None, 0
    return meta, at + 8 + size


_CACHE_MAGIC = b"retrolog series 1\n"
_CACHE_ARRAYS = (("ctx", "<i8"), ("y", "<f8"), ("t", "<f8"), ("replay_index", "<i4"),
                 ("origin", "i1"))  # fmt: skip


class SeriesCache:
    """Whole series of runs that can no longer change, kept between requests: in memory up
    to ``max_bytes`` (least recently used dropped first), and, when ``directory`` is given,
    on disk, so a chart drawn once draws fast again, after a restart too.

    A run's series changes while it runs and when a replay backfills it. So only series of
    runs that have ended are kept, each stamped with its status and the replays that
    touched it (their number and the newest end); a later replay of the run changes the
    stamp. While a replay of the run is in progress nothing is kept or served.
    """

    def __init__(self, max_bytes: int = 256 * 2**20, directory: Path | None = None) -> None:
        self.max_bytes = max_bytes
        self.directory = directory
        self.nbytes = 0
        self._kept: OrderedDict[tuple[str, str], tuple[str, Columns]] = OrderedDict()
        self._lock = threading.Lock()

    def _path(self, key: tuple[str, str]) -> Path | None:
        if self.directory is None:
            return None
        run_id, name = key
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:20]
        return self.directory / _safe(run_id) / f"{digest}.series"

    def get(self, key: tuple[str, str], stamp: str) -> Columns | None:
        with self._lock:
            found = self._kept.get(key)
            if found is not None and found[0] == stamp:
                self._kept.move_to_end(key)
                return found[1]
        path = self._path(key)
        loaded = Columns.load(path, key, stamp) if path is not None else None
        if loaded is not None:
            self._remember(key, stamp, loaded)
        return loaded

    def kept(self, key: tuple[str, str], stamp: str) -> bool:
        """Whether the disk holds ``key`` made at ``stamp`` (its header only is read)."""
        path = self._path(key)
        if path is None:
            return False
        try:
            with open(path, "rb") as f:
                head = f.read(len(_CACHE_MAGIC) + 8)
                size = int.from_bytes(head[len(_CACHE_MAGIC) :], "little")
                meta, _ = _cache_header(head + f.read(min(size, 2**20)), key, stamp)
        except (OSError, ValueError):
            return False
        return meta is not None

    def put(
        self, key: tuple[str, str], stamp: str, columns: Columns, *, to_disk: bool = True
    ) -> None:
        """Keep ``columns`` in memory and, with ``to_disk``, in the cache's directory."""
        self._remember(key, stamp, columns)
        path = self._path(key)
        if path is not None and to_disk:
            with contextlib.suppress(OSError):  # a cache: a full disk only makes it slower
                columns.save(path, key, stamp)

    def _remember(self, key: tuple[str, str], stamp: str, columns: Columns) -> None:
        with self._lock:
            old = self._kept.pop(key, None)
            if old is not None:
                self.nbytes -= old[1].nbytes
            if columns.nbytes > self.max_bytes:
                return
            self._kept[key] = (stamp, columns)
            self.nbytes += columns.nbytes
            while self.nbytes > self.max_bytes:
                _, (_, dropped) = self._kept.popitem(last=False)
                self.nbytes -= dropped.nbytes


def series(
    conn: sqlite3.Connection,
    name: str,
    run_ids: Sequence[str],
    *,
    x: str = "step",
    lo: float | None = None,
    hi: float | None = None,
    width: int | None = None,
    budget: int | None = None,
    cache: SeriesCache | None = None,
) -> list[Series]:
    """``name``'s numeric values in each of ``run_ids`` (runs without any are left out).

    x: "step" or "time" (X_AXES).
    lo, hi: the x range to send (inclusive; None: unbounded).
    width: the chart's width in pixels; with it, a range holding more than
        4 * width values is downsampled to each pixel column's first, last, min and
        max. None sends every value.
    budget: with ``width``, the most points to send over all runs together: the runs
        share it, each downsampled on fewer columns than ``width`` when ``4 * width``
        points per run would exceed it (so a chart of many runs sends what its pixels
        can show, not 4 points per column per run).
    cache: where whole series of ended runs are kept between calls (see SeriesCache).
    """
    if x not in X_AXES:
        raise UsageError(f"A series is drawn against one of {', '.join(X_AXES)}, not {x!r}.")
    if width is not None and width < 1:
        raise UsageError(f"A chart needs a positive width in pixels, not {width}.")
    if name not in set(logged_names(conn)):
        raise UnknownNameError(f"No run logged {name!r}; `retrolog show RUN` lists a run's names.")
    found = []
    for run_id, status, code_commit, stamp, replaying in _stamps(conn, run_ids):
        usable = cache is not None and status != "running" and not replaying
        columns = cache.get((run_id, name), stamp) if cache is not None and usable else None
        fresh = columns is None
        if columns is None:
            columns = read_columns(conn, name, run_id)
            if columns is None:
                continue
        if x == "time" and not columns.timed:
            columns.t, columns.timed = _times(conn, run_id, columns.ctx), True
            fresh = True
        if fresh and cache is not None and usable:
            # A file costs about as much to write as a series of blocks costs to read:
            # only a series read from its rows, or with its times, is worth one.
            to_disk = columns.timed or columns.rows_read >= DISK_ROWS
            cache.put((run_id, name), stamp, columns, to_disk=to_disk)
        if x == "step":
            keep = slice(None)
            xs = np.arange(len(columns.ctx), dtype=np.float64)
        else:
            keep = ~np.isnan(columns.t)  # contexts without a time: never in a written store
            xs = columns.t[keep]
        whole = Series(
            run_id=run_id, loop=columns.loop, total=len(xs), in_range=len(xs), x=xs,
            y=columns.y[keep], origin=columns.origin[keep],
            replay_index=columns.replay_index[keep], replay_ids=columns.replay_ids,
            exact=True, code_commit=code_commit,
            replays=_replays(conn, run_id, set(columns.replay_ids)),
        )  # fmt: skip
        found.append(whole)
    # One grid of pixel columns for every run, so that their points line up.
    starts = [float(w.x[0]) for w in found if len(w.x)]
    stops = [float(w.x[-1]) for w in found if len(w.x)]
    first = lo if lo is not None else min(starts, default=0.0)
    last = hi if hi is not None else max(stops, default=0.0)
    shared = width
    if width is not None and budget is not None and found:
        shared = max(1, min(width, budget // (4 * len(found))))
    return [_window(w, lo, hi, shared, (first, last)) for w in found]


def index_series(
    conn: sqlite3.Connection,
    cache: SeriesCache,
    *,
    min_values: int = 1000,
    skip: set[tuple[str, str, str]] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    progress: Callable[[int, int], None] = lambda done, todo: None,
) -> int:
    """Read ahead into ``cache``'s files every series of an ended run that holds at least
    ``min_values`` values and is not there yet, with both x axes, newest runs first: what
    the dashboard's background indexer does, so that a chart's first drawing does not wait
    on the store (about 1.5-4 µs per value). Returns how many series it wrote.

    skip: (run, name, stamp) found to hold no numeric value; added to, and not read again.
    should_stop: asked between series; True ends the pass.
    progress: called with (series done, series to do) after each one.
    """
    if cache.directory is None:
        raise UsageError("Indexing series needs a cache directory (a store that can be written).")
    skip = set() if skip is None else skip
    names: dict[str, list[str]] = {}
    for name, run_id in conn.execute(  # one scan of the covering index (name, run, context)
        "SELECT name, run_id FROM logs WHERE ctx_id IS NOT NULL GROUP BY name, run_id"
        " HAVING COUNT(*) >= ?",
        (min_values,),
    ):
        names.setdefault(run_id, []).append(name)
    newest_first = [r for (r,) in conn.execute("SELECT run_id FROM runs ORDER BY started_at DESC")]
    todo = [
        (run_id, name, stamp)
        for run_id, status, _, stamp, replaying in _stamps(
            conn, [r for r in newest_first if r in names]
        )
        if status != "running" and not replaying
        for name in names[run_id]
        if (run_id, name, stamp) not in skip and not cache.kept((run_id, name), stamp)
    ]
    written = 0
    for done, (run_id, name, stamp) in enumerate(todo, 1):
        if should_stop():
            break
        columns = read_columns(conn, name, run_id)
        if columns is None:
            skip.add((run_id, name, stamp))
        else:
            columns.t, columns.timed = _times(conn, run_id, columns.ctx), True
            cache.put((run_id, name), stamp, columns)
            written += 1
        progress(done, len(todo))
    return written


def _stamps(
    conn: sqlite3.Connection, run_ids: Sequence[str]
) -> list[tuple[str, str, str | None, str, bool]]:
    """Per run that exists: (run_id, status, code commit, the cache stamp, whether a replay
    of it is in progress)."""
    found = []
    for run_id in dict.fromkeys(run_ids):
        row = conn.execute(
            "SELECT r.status, r.code_commit, COUNT(p.replay_id), MAX(p.ended_at),"
            " COUNT(CASE WHEN p.replay_id IS NOT NULL AND p.ended_at IS NULL THEN 1 END)"
            " FROM runs r"
            " LEFT JOIN replay_runs rr ON rr.run_id = r.run_id"
            " LEFT JOIN replays p ON p.replay_id = rr.replay_id"
            " WHERE r.run_id = ? GROUP BY r.run_id",
            (run_id,),
        ).fetchone()
        if row is None:
            continue
        status, commit, replays, newest, open_replays = row
        found.append((run_id, status, commit, f"{status}:{replays}:{newest!r}", open_replays > 0))
    return found


def read_columns(conn: sqlite3.Connection, name: str, run_id: str) -> Columns | None:
    """``name``'s whole series in ``run_id``, from the store (None: no numeric value): its
    recorded values from the run's series blocks (store/series_blocks.py), the rest from
    its rows."""
    last, block_ctx, block_y, block_number = series_blocks.read(conn, run_id, name)
    found = _series_rows(conn, name, run_id, last)
    blocked = len(block_ctx)
    if not found and not blocked:
        return None
    ctx, y, numeric, recorded, inexact, replay_of = _row_columns(conn, found)
    if blocked:
        # The blocks' rows first (recorded, in log_id order), then a stable sort by
        # context and origin: the order of the rows alone, up to the order of recorded
        # and backfilled rows within a context, which the rule below does not use.
        ctx = np.r_[block_ctx, ctx]
        y = np.r_[block_y, y]
        numeric = np.r_[block_number, numeric]
        recorded = np.r_[np.ones(blocked, dtype=bool), recorded]
        inexact = np.r_[np.zeros(blocked, dtype=bool), inexact]
        replay_of = np.r_[np.full(blocked, None, dtype=object), replay_of]
        order = np.lexsort((recorded, ctx))
        ctx, y, numeric = ctx[order], y[order], numeric[order]
        recorded, inexact, replay_of = recorded[order], inexact[order], replay_of[order]
    origin, replay_index, replay_ids = _origins(recorded, inexact, replay_of)
    # Several records of one context: keep the one that counts. Rows come in log_id
    # order within a context and origin, so a stable sort by (context, recorded) puts
    # it last.
    n = len(ctx)
    if n > 1 and bool(np.any(ctx[1:] == ctx[:-1])):
        order = np.lexsort((recorded, ctx))
        last_of = np.r_[ctx[order][1:] != ctx[order][:-1], True]
        keep = np.sort(order[last_of])
        ctx, y, origin = ctx[keep], y[keep], origin[keep]
        replay_index, numeric = replay_index[keep], numeric[keep]
    if not numeric.all():  # a context whose value is text, JSON or None: not drawn
        if not numeric.any():
            return None
        ctx, y, origin = ctx[numeric], y[numeric], origin[numeric]
        replay_index = replay_index[numeric]
    return Columns(
        rows_read=len(found),
        ctx=ctx, y=y, t=np.full(len(ctx), np.nan), origin=origin, replay_index=replay_index,
        replay_ids=replay_ids, loop=_loop_name(conn, run_id, ctx),
    )  # fmt: skip


def _series_rows(
    conn: sqlite3.Connection, name: str, run_id: str, last: int
) -> list[tuple[Any, ...]]:
    """The rows of ``name`` in ``run_id`` that the series blocks up to log_id ``last`` do
    not hold (``last`` < 0: every row), as (ctx_id, value parts..., mark)."""
    # Each row as few Python objects as it can be: the context, the value and a mark that
    # is NULL for the common row (recorded, numeric) and the row's log_id otherwise, whose
    # origin and type are then read apart. Reading the text of every row's origin and type
    # (new str objects each) cost more than SQLite's whole read of the row. The mark is
    # named: PostgreSQL names the CASE after its ELSE, and ORDER BY log_id would sort by it.
    select = (
        f"SELECT ctx_id, {', '.join(value_parts(conn))}, CASE WHEN origin = 'recorded' AND"
        f" value_type IN {_NUMERIC_SQL} THEN NULL ELSE log_id END AS mark FROM logs"
        " WHERE name = ? AND run_id = ? AND ctx_id IS NOT NULL"
    )
    if last < 0:
        found: list[tuple[Any, ...]] = conn.execute(
            select + " ORDER BY ctx_id, log_id", (name, run_id)
        ).fetchall()
        return found
    # The blocks hold every recorded row up to ``last``: what is left are the rows
    # that are not recorded (backfilled) up to there, found through their partial
    # index, then every row after it (a live run's tail). In this order, the rows of
    # one context and origin follow each other in log_id order, as the rule for the
    # record that counts needs.
    found = conn.execute(
        # (``+log_id``: a range of the rowid would lead SQLite to the run's index, a
        # lookup of every row of the run.)
        select + " AND origin <> 'recorded' AND +log_id <= ? ORDER BY ctx_id, log_id",
        (name, run_id, last),
    ).fetchall()
    found += conn.execute(
        select + " AND log_id > ? ORDER BY ctx_id, log_id", (name, run_id, last)
    ).fetchall()
    return found


def _row_columns(
    conn: sqlite3.Connection, found: Sequence[tuple[Any, ...]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rows as arrays: context, value (NaN where not a number), whether numeric,
    whether recorded, whether inexact, and the replay that backfilled it."""
    if found:
        # Column by column: a per-row Python step costs more than SQLite's read of the row.
        ctx_ids, *value_columns, marks = zip(*found, strict=True)
    else:
        ctx_ids, value_columns, marks = (), [()], ()
    n = len(found)
    ctx = np.array(ctx_ids, dtype=np.int64)
    if len(value_columns) == 1:
        values = value_columns[0]
    else:  # the value whole again from its parts
        values = tuple(whole_value(v) for v in zip(*value_columns, strict=True))
    numeric = np.ones(n, dtype=bool)
    recorded = np.ones(n, dtype=bool)
    inexact = np.zeros(n, dtype=bool)
    replay_of = np.full(n, None, dtype=object)
    if marks.count(None) != n:
        marked = [i for i, mark in enumerate(marks) if mark is not None]
        rows = _marked_rows(conn, sorted({marks[i] for i in marked}))
        for i in marked:
            # A row gone since (a run collected meanwhile) is left out like a text value.
            origin, inexact_mark, replay_id, value_type = rows.get(marks[i], (None, None, None, ""))
            numeric[i] = value_type in NUMERIC_TYPES
            recorded[i] = origin == "recorded"
            inexact[i], replay_of[i] = inexact_mark is not None, replay_id
    if numeric.all():
        y = np.array(values, dtype=np.float64)  # None (a logged NaN) becomes NaN
    else:
        y = np.array([v if ok else None for v, ok in zip(values, numeric, strict=True)],
                     dtype=np.float64)  # fmt: skip
    return ctx, y, numeric, recorded, inexact, replay_of


def _marked_rows(conn: sqlite3.Connection, wanted: Sequence[Any]) -> dict[Any, Any]:
    """Origin, inexact mark, replay and value type of the rows with these log ids."""
    rows: dict[Any, Any] = {}
    for at in range(0, len(wanted), 500):
        chunk = wanted[at : at + 500]
        rows.update(
            (log_id, rest)
            for log_id, *rest in conn.execute(
                "SELECT log_id, origin, inexact, replay_id, value_type FROM logs"
                f" WHERE log_id IN ({', '.join('?' for _ in chunk)})",
                chunk,
            )
        )
    return rows


def _origins(
    recorded: np.ndarray, inexact: np.ndarray, replay_of: np.ndarray
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Each row's origin code, the index of its replay in the list of replays, and that
    list (in the order the rows name them)."""
    origin = np.where(recorded, RECORDED, BACKFILLED).astype(np.int8)
    replay_ids: list[str] = []
    replay_index = np.full(len(recorded), -1, dtype=np.int32)
    if not recorded.all():
        known: dict[str, int] = {}
        for i in np.flatnonzero(~recorded).tolist():
            if inexact[i]:
                origin[i] = INEXACT
            if replay_of[i] is not None:
                replay_index[i] = known.setdefault(replay_of[i], len(known))
        replay_ids = list(known)
    return origin, replay_index, replay_ids


def _loop_name(conn: sqlite3.Connection, run_id: str, ctx: np.ndarray) -> str | None:
    """The loop most of the contexts belong to, from the first, middle and last."""
    loops = dict(
        conn.execute(
            "SELECT name, COUNT(*) FROM loops WHERE run_id = ? AND ctx_id IN (?, ?, ?)"
            " GROUP BY name",
            (run_id, int(ctx[0]), int(ctx[len(ctx) // 2]), int(ctx[-1])),
        ).fetchall()
    )
    return max(loops, key=lambda k: loops[k]) if loops else None


def _times(conn: sqlite3.Connection, run_id: str, ctx: np.ndarray) -> np.ndarray:
    """Seconds since the run started at the end of each context in ``ctx`` (NaN if none)."""
    times = dict(
        conn.execute(
            "SELECT ctx_id, COALESCE(t_end, t_start) FROM loops WHERE run_id = ?"
            " AND ctx_id BETWEEN ? AND ?",
            (run_id, int(ctx[0]), int(ctx[-1])),
        ).fetchall()
    )
    return np.array([times.get(c) for c in ctx.tolist()], dtype=np.float64)


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


def _window(
    s: Series, lo: float | None, hi: float | None, width: int | None, extent: tuple[float, float]
) -> Series:
    """``s`` cut to [lo, hi] and, when that holds more than 4 values per pixel, bucketed on
    ``width`` columns spanning ``extent`` (the same for every run of a chart)."""
    start = 0 if lo is None else int(np.searchsorted(s.x, lo, side="left"))
    stop = len(s.x) if hi is None else int(np.searchsorted(s.x, hi, side="right"))
    grid = None
    if width is not None and stop - start > 4 * width:
        index = downsample(s.x[start:stop], s.y[start:stop], width, extent) + start
        grid = (extent[0], extent[1], width)
    else:
        index = np.arange(start, stop)
    exact = len(index) == stop - start
    return Series(
        run_id=s.run_id,
        loop=s.loop,
        total=s.total,
        in_range=stop - start,
        x=s.x[index],
        y=s.y[index],
        origin=s.origin[index],
        replay_index=s.replay_index[index],
        replay_ids=s.replay_ids,
        exact=exact,
        code_commit=s.code_commit,
        replays=s.replays,
        grid=grid,
    )


def downsample(
    x: np.ndarray, y: np.ndarray, width: int, extent: tuple[float, float] | None = None
) -> np.ndarray:
    """Indices of the points to draw of ``(x, y)`` (x sorted) on ``width`` pixel columns.

    Each column keeps its first and last point and its lowest and highest value (NaN
    values are kept where they are first or last, never chosen as a min or max), so
    the drawn line has the same envelope as the full series: M4 aggregation (Jugel
    et al., VLDB 2014). The columns split ``extent`` (default: x's own range) evenly.
    Returns sorted, distinct indices.
    """
    n = len(x)
    if n == 0:
        return np.arange(0)
    first, last = extent if extent is not None else (float(x[0]), float(x[-1]))
    span = last - first
    if span <= 0 or not math.isfinite(span):
        starts = np.zeros(1, dtype=np.int64)
    else:
        # A point's column is floor((x - first) / span * width), clipped to the chart. That
        # is monotone in x, so column c starts at the first point whose scaled x is >= c: a
        # binary search per column instead of a column number per point.
        scaled = (x - first) / span * width
        bounds = np.searchsorted(scaled, np.arange(1, width, dtype=np.float64), side="left")
        starts = np.unique(np.r_[0, bounds[bounds < n]])
    counts = np.diff(np.r_[starts, n])
    nan = np.isnan(y)
    has_nan = bool(nan.any())
    chosen = [starts, starts + counts - 1]
    for reduce, fill in ((np.minimum, np.inf), (np.maximum, -np.inf)):
        key = np.where(nan, fill, y) if has_nan else y
        extreme = reduce.reduceat(key, starts)
        hits = np.flatnonzero(key == np.repeat(extreme, counts))
        # The first hit in each column (every column has one: its extreme is a value of it).
        chosen.append(hits[np.searchsorted(hits, starts)])
    # Per column its (up to) four indices, in order; columns follow one another.
    ordered = np.sort(np.stack(chosen), axis=0).T.ravel()
    return ordered[np.r_[True, ordered[1:] != ordered[:-1]]]


def _safe(run_id: str) -> str:
    """A run id as a directory name (ids are ours, but a store is data: no path tricks)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id) or "_"


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


# Grouping by a numeric argument with more distinct values than this bins it (quantiles).
BINS = 6


def bin_keys(keys: dict[str, Any], bins: int = BINS) -> dict[str, Any]:
    """``keys`` (run id -> argument value) with a numeric argument of more than ``bins``
    distinct values replaced by its bin, ``[low, high]`` (3 significant digits): at most
    ``bins`` bins holding about as many runs each (quantiles of the values). Any other
    argument is returned as it is: one group per value."""
    numeric = [
        v for v in keys.values()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ]  # fmt: skip
    if len(set(numeric)) <= bins or len(numeric) < len([v for v in keys.values() if v is not None]):
        return keys
    values = np.asarray(numeric, dtype=np.float64)
    quantiles = np.quantile(values, np.linspace(0.0, 1.0, bins + 1))
    edges = np.unique([float(f"{e:.3g}") for e in quantiles])
    edges[0], edges[-1] = min(edges[0], values.min()), max(edges[-1], values.max())
    if len(edges) < 2:
        return keys
    binned: dict[str, Any] = {}
    for run_id, value in keys.items():
        if value is None:
            binned[run_id] = None
            continue
        i = min(int(np.searchsorted(edges, value, side="right")) - 1, len(edges) - 2)
        binned[run_id] = [float(f"{edges[i]:.3g}"), float(f"{edges[i + 1]:.3g}")]
    return binned


def _key_order(key: Any) -> tuple[int, float, str]:
    """Groups in their values' order: numbers and bins by value, the rest by text."""
    if isinstance(key, (int, float)) and not isinstance(key, bool):
        return (0, float(key), "")
    if isinstance(key, list) and key and isinstance(key[0], (int, float)):
        return (0, float(key[0]), "")
    return (1, 0.0, json.dumps(key, sort_keys=True, default=str))


def group_series(
    found: Sequence[Series], keys: dict[str, Any], width: int, lo: float | None, hi: float | None
) -> list[Group]:
    """``found`` (whole series, not downsampled) grouped by ``keys[run_id]``: per group and
    pixel column over [lo, hi] (default: the groups' whole x range), the mean, min and max
    of its runs' values (NaN ignored). Groups are ordered by key (numbers and bins by
    value)."""
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
    for label in sorted(members, key=lambda label: _key_order(labels[label])):
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
