"""Downsampling a series for a chart: what is sent keeps every pixel column's envelope."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from retrolog._query import series as series_module
from retrolog._query.series import (
    BACKFILLED,
    INEXACT,
    RECORDED,
    Columns,
    Series,
    bin_keys,
    downsample,
    encode_series,
    group_series,
    read_columns,
    series,
)
from retrolog._replay.backfill import backfill
from retrolog.store.records import RecordBatch, SqliteRecordSink
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect


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


def _rows_read_columns(conn: Any, name: str, run_id: str) -> Columns | None:
    """The series read the straightforward way, every column of every row in Python: what
    read_columns must return, however it reads."""
    found = conn.execute(
        "SELECT ctx_id, origin, inexact, replay_id, value_type, value FROM logs"
        " WHERE name = ? AND run_id = ? AND ctx_id IS NOT NULL ORDER BY ctx_id, log_id",
        (name, run_id),
    ).fetchall()
    chosen: dict[int, tuple[Any, ...]] = {}
    for row in found:  # per context the last recorded row, else the last backfilled one
        ctx, origin = row[0], row[1]
        if ctx not in chosen or origin == "recorded" or chosen[ctx][1] != "recorded":
            chosen[ctx] = row
    kept = [r for _, r in sorted(chosen.items()) if r[4] in ("float", "int", "bool")]
    if not kept:
        return None
    replay_ids = list(dict.fromkeys(r[3] for r in found if r[1] != "recorded" and r[3]))
    replay_ids = [r for r in replay_ids if any(k[3] == r for k in kept)]
    loops = dict(
        conn.execute(
            "SELECT name, COUNT(*) FROM loops WHERE run_id = ? AND ctx_id IN (?, ?, ?)"
            " GROUP BY name",
            (run_id, kept[0][0], kept[len(kept) // 2][0], kept[-1][0]),
        ).fetchall()
    )
    return Columns(
        ctx=np.array([r[0] for r in kept], dtype=np.int64),
        y=np.array([r[5] for r in kept], dtype=np.float64),
        t=np.full(len(kept), np.nan),
        origin=np.array(
            [RECORDED if r[1] == "recorded" else INEXACT if r[2] else BACKFILLED for r in kept],
            dtype=np.int8,
        ),
        replay_index=np.array(
            [replay_ids.index(r[3]) if r[1] != "recorded" and r[3] else -1 for r in kept],
            dtype=np.int32,
        ),
        replay_ids=replay_ids,
        loop=max(loops, key=lambda k: loops[k]) if loops else None,
    )


def _mixed_store(root: Path) -> list[str]:
    """Three runs through the record sink and the replay's backfill: two loops (epoch,
    step), gaps, NaN and infinities, a context logged twice, text and JSON values under a
    numeric name, and backfilled values (one replay inexact) beside and instead of
    recorded ones."""
    database = root / ".retrolog" / "retrolog.db"
    database.parent.mkdir(parents=True)
    conn = connect(database)
    migrate(conn)
    sink = SqliteRecordSink(database)
    runs = [f"20260101-00000{i}-abcdef{i}" for i in range(3)]
    rng = np.random.default_rng(7)
    specials = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324]
    for r, run_id in enumerate(runs):
        conn.execute(
            "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, ended_at,"
            " host, pid, python, argv) VALUES (?, 'p', 't', 'train.py', 'finished', 0, 9,"
            " 'h', 1, '3.11', '[]')",
            (run_id,),
        )
        conn.commit()
        batch = RecordBatch()
        ctx, t = 0, 0.0
        for epoch in range(3):
            epoch_ctx, ctx = ctx, ctx + 1
            batch.loop_starts.append((epoch_ctx, None, "epoch", epoch, None, 0, t))
            for step in range(40):
                batch.loop_starts.append((ctx, epoch_ctx, "step", step, None, 1, t))
                t += 0.5
                batch.loop_ends.append((t, ctx))
                if r == 2 or (r == 1 and step % 2) or step % 7 == 3:
                    ctx += 1  # a gap (run 1: every other step is replayed)
                    continue
                value = specials[step % 7] if step % 5 == 0 else float(rng.normal())
                batch.values.append((ctx, "loss", value))
                if step == 11:
                    batch.values.append((ctx, "loss", float(step)))  # twice in a context
                if step == 13:
                    batch.values.append((ctx, "loss", step))  # an int
                    batch.logs.append((ctx, "loss", "null", "json"))
                if step == 17:
                    batch.values.append((ctx, "loss", "seventeen"))  # text, not drawn
                ctx += 1
            batch.loop_ends.append((t, epoch_ctx))
            batch.values.append((epoch_ctx, "acc", float(epoch) / 3))  # the outer loop
        sink.write(run_id, batch)
    sink.close()
    for replay_id, inexact, run_id in (("r1", None, runs[1]), ("r2", "mismatch", runs[2]),
                                       ("r3", None, runs[2])):  # fmt: skip
        steps = conn.execute(
            "SELECT ctx_id FROM loops WHERE run_id = ? AND name = 'step'", (run_id,)
        ).fetchall()
        upto = len(steps) * 2 // 3 if replay_id == "r2" else None
        rows = [(c, "loss", c * 0.25 if c % 9 else None, "float" if c % 13 else "text", None)
                for (c,) in steps[:upto]]  # fmt: skip
        backfill(conn, run_id=run_id, replay_id=replay_id, code_object=None, rows=rows,
                 names=["loss"], force=False, inexact=inexact)  # fmt: skip
    conn.close()
    return runs


def test_a_series_read_is_every_rows_own_answer(tmp_path: Path) -> None:
    """What a chart is drawn from equals the straightforward reading of every row: with
    NaN and infinities, gaps, two loops, a context logged twice, text among numbers,
    and backfilled values (inexact too) beside recorded ones."""
    runs = _mixed_store(tmp_path)
    conn = connect(tmp_path / ".retrolog" / "retrolog.db", readonly=True)
    for name in ("loss", "acc"):
        for run_id in runs:
            found, expected = (
                read_columns(conn, name, run_id),
                _rows_read_columns(conn, name, run_id),
            )
            assert (found is None) == (expected is None)
            if found is None or expected is None:
                continue
            assert found.replay_ids == expected.replay_ids and found.loop == expected.loop
            for array in ("ctx", "y", "origin", "replay_index"):
                assert getattr(found, array).tobytes() == getattr(expected, array).tobytes()
    loss = {c.run_id: c for c in series(conn, "loss", runs)}
    assert set(np.unique(loss[runs[2]].origin).tolist()) == {BACKFILLED, INEXACT}
    assert np.isinf(loss[runs[0]].y).sum() == 6 and np.isnan(loss[runs[0]].y).any()
    expected_bytes = {}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(series_module, "read_columns", _rows_read_columns)
        for x, width in (("step", None), ("step", 5), ("time", 5)):
            expected_bytes[x, width] = encode_series(series(conn, "loss", runs, x=x, width=width))
    for (x, width), expected in expected_bytes.items():
        assert encode_series(series(conn, "loss", runs, x=x, width=width)) == expected
    conn.close()


def test_a_series_read_from_postgresql_is_sqlites(tmp_path: Path, pg_store_url: str) -> None:
    """The same rows copied into PostgreSQL (three value columns there) draw the same
    charts."""
    from retrolog.store.postgres_metadata import PostgresMetadata
    from retrolog.store.transfer import copy_into_postgresql

    runs = _mixed_store(tmp_path)
    conn = connect(tmp_path / ".retrolog" / "retrolog.db")
    target = PostgresMetadata(pg_store_url)
    try:
        copy_into_postgresql(conn, target, source=str(tmp_path))
        reader = target.reader()
        for name in ("loss", "acc"):
            for x, width in (("step", None), ("step", 5), ("time", 5)):
                expected = series(conn, name, runs, x=x, width=width)
                found = series(reader, name, runs, x=x, width=width)
                assert [s.about() for s in found] == [s.about() for s in expected]
                assert encode_series(found) == encode_series(expected)
    finally:
        target.close()
        conn.close()


def _blocked_store(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``_mixed_store``'s runs with blocks of 25 values, written by the sink as the rows
    arrive in batches of 15 contexts; runs 0 and 2 end (their last batch carries the end),
    run 1 is still running, so its newest rows are in no block (a live run's tail)."""
    from retrolog.store import series_blocks

    monkeypatch.setattr(series_blocks, "BLOCK", 25)
    real_write = SqliteRecordSink.write

    def in_batches(self: SqliteRecordSink, run_id: str, batch: RecordBatch) -> None:
        ended = not run_id.endswith("1")
        contexts = sorted({row[0] for row in batch.values + batch.logs})
        for at in range(0, len(contexts), 15):
            chosen = set(contexts[at : at + 15])
            part = RecordBatch(
                loop_starts=batch.loop_starts if at == 0 else [],
                loop_ends=batch.loop_ends if at == 0 else [],
                values=[r for r in batch.values if r[0] in chosen],
                logs=[r for r in batch.logs if r[0] in chosen],
            )
            if ended and at + 15 >= len(contexts):
                part.run_updates.append({"status": "finished", "ended_at": 9.0})
            real_write(self, run_id, part)

    monkeypatch.setattr(SqliteRecordSink, "write", in_batches)
    runs = _mixed_store(root)
    monkeypatch.setattr(SqliteRecordSink, "write", real_write)
    return runs


def _same_as_rows(conn: Any, runs: list[str]) -> None:
    for name in ("loss", "acc"):
        for run_id in runs:
            found, expected = (
                read_columns(conn, name, run_id),
                _rows_read_columns(conn, name, run_id),
            )
            assert (found is None) == (expected is None)
            if found is None or expected is None:
                continue
            assert found.replay_ids == expected.replay_ids and found.loop == expected.loop
            for array in ("ctx", "y", "origin", "replay_index"):
                assert getattr(found, array).tobytes() == getattr(expected, array).tobytes()


def test_a_series_read_from_blocks_and_tail_is_every_rows_own_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from the series blocks, the recorded rows after them and the backfilled rows
    among them, a series is what its rows alone say: NaN and infinities, text, JSON and
    ints among the numbers, a context logged twice, two loops, backfilled and inexact
    values, an ended run (all in blocks) and a live one (a tail after its blocks), and
    after a replay replaced its backfilled values."""
    runs = _blocked_store(tmp_path, monkeypatch)
    database = tmp_path / ".retrolog" / "retrolog.db"
    conn = connect(database)
    blocked = dict(
        conn.execute("SELECT run_id, SUM(n) FROM series_blocks WHERE name = 'loss' GROUP BY run_id")
    )
    recorded = dict(
        conn.execute(
            "SELECT run_id, COUNT(*) FROM logs WHERE name = 'loss' AND origin = 'recorded'"
            " AND ctx_id IS NOT NULL GROUP BY run_id"
        )
    )
    assert blocked[runs[0]] == recorded[runs[0]]  # ended: every recorded row in blocks
    assert 0 < blocked[runs[1]] < recorded[runs[1]]  # live: full blocks, then a tail
    _same_as_rows(conn, runs)
    # A replay replaces run 2's backfilled values (deleted, then written again).
    steps = conn.execute(
        "SELECT ctx_id FROM loops WHERE run_id = ? AND name = 'step'", (runs[2],)
    ).fetchall()
    rows = [(c, "loss", -float(c), "float", None) for (c,) in steps[::2]]
    backfill(conn, run_id=runs[2], replay_id="r4", code_object=None, rows=rows,
             names=["loss"], force=True, inexact=None)  # fmt: skip
    _same_as_rows(conn, runs)
    # Damaged blocks (cut short, not zlib, a wrong count) are passed over for the rows.
    conn.execute("UPDATE series_blocks SET y = substr(y, 2) WHERE run_id = ?", (runs[0],))
    conn.execute("UPDATE series_blocks SET ctx = x'00' WHERE run_id = ?", (runs[1],))
    conn.execute("UPDATE series_blocks SET n = 1000000000000 WHERE run_id = ?", (runs[2],))
    _same_as_rows(conn, runs)
    conn.close()


def test_migration_12_fills_the_blocks_of_a_store_written_without_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose runs have no blocks gets them from migration 12 (every recorded row
    of an ended run, the full blocks of a running one), and reads the same."""
    runs = _blocked_store(tmp_path, monkeypatch)
    database = tmp_path / ".retrolog" / "retrolog.db"
    conn = connect(database)
    conn.execute("UPDATE runs SET status = 'running' WHERE run_id = ?", (runs[1],))
    conn.execute("DROP TABLE series_blocks")
    conn.execute("DROP INDEX logs_not_recorded")
    conn.execute("DELETE FROM migrations WHERE version = 12")
    without = {(n, r): read_columns(conn, n, r) for n in ("loss", "acc") for r in runs}
    migrate(conn)
    counts = dict(conn.execute("SELECT run_id, SUM(n) FROM series_blocks GROUP BY run_id"))
    assert counts[runs[0]] > 0 and counts[runs[1]] % 25 == 0
    _same_as_rows(conn, runs)
    for (name, run_id), before in without.items():
        after = read_columns(conn, name, run_id)
        assert (before is None) == (after is None)
        if before is not None and after is not None:
            assert before.y.tobytes() == after.y.tobytes()
    conn.close()


def test_a_series_read_from_postgresql_blocks_is_sqlites_rows(
    tmp_path: Path, pg_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs copied into PostgreSQL get their blocks there; the charts drawn from them
    are the ones SQLite's rows alone give."""
    from retrolog.store.postgres_metadata import PostgresMetadata
    from retrolog.store.transfer import copy_into_postgresql

    runs = _blocked_store(tmp_path, monkeypatch)
    conn = connect(tmp_path / ".retrolog" / "retrolog.db")
    conn.execute("DELETE FROM series_blocks")  # SQLite's answer from its rows alone
    target = PostgresMetadata(pg_store_url)
    try:
        copy_into_postgresql(conn, target, source=str(tmp_path))
        reader = target.reader()
        (blocks,) = reader.execute("SELECT COUNT(*) FROM series_blocks").fetchone()
        assert blocks > 0
        for name in ("loss", "acc"):
            for x, width in (("step", None), ("step", 5), ("time", 5)):
                expected = series(conn, name, runs, x=x, width=width)
                found = series(reader, name, runs, x=x, width=width)
                assert [s.about() for s in found] == [s.about() for s in expected]
                assert encode_series(found) == encode_series(expected)
    finally:
        target.close()
        conn.close()


def test_postgresqls_record_sink_writes_blocks_that_read_as_its_rows(
    pg_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's record sink keeps the blocks as it writes (an ended run: all of its
    rows; a live one: full blocks and a tail), and a series read from them is the one
    its rows alone give."""
    from retrolog.store import series_blocks
    from retrolog.store.postgres_metadata import PostgresMetadata, PostgresRecordSink

    monkeypatch.setattr(series_blocks, "BLOCK", 25)
    target = PostgresMetadata(pg_store_url)
    runs = ["20260101-000000-pg00000", "20260101-000001-pg00001"]
    try:
        with target.connection.transaction():
            for run_id in runs:
                target.connection.execute(
                    "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at,"
                    " host, pid, python, argv) VALUES (%s, 'p', 't', 'train.py', 'running', 0,"
                    " 'h', 1, '3.11', '[]')",
                    (run_id,),
                )
        sink = PostgresRecordSink(pg_store_url)
        specials = [math.nan, math.inf, -math.inf, -0.0, 7, "text"]
        for r, run_id in enumerate(runs):
            for start in range(0, 95, 15):  # the last batch: 5 contexts
                batch = RecordBatch()
                for ctx in range(start, min(95, start + 15)):
                    batch.loop_starts.append((ctx, None, "step", ctx, None, 0, float(ctx)))
                    batch.values.append((ctx, "loss", specials[ctx % 6] if ctx % 4 else ctx / 3))
                    if ctx % 10 == 0:
                        batch.values.append((ctx, "loss", -1.0))  # twice in a context
                    if ctx % 11 == 0:
                        batch.logs.append((ctx, "loss", '{"a": 1}', "json"))
                if r == 0 and start == 90:
                    batch.run_updates.append({"status": "finished", "ended_at": 9.0})
                sink.write(run_id, batch)
        sink.close()
        reader = target.reader()
        blocked = dict(
            reader.execute("SELECT run_id, SUM(n) FROM series_blocks GROUP BY run_id").fetchall()
        )
        stored = dict(
            reader.execute(
                "SELECT run_id, COUNT(*) FROM logs WHERE name = 'loss' GROUP BY run_id"
            ).fetchall()
        )
        assert blocked[runs[0]] == stored[runs[0]]  # every recorded row
        assert 0 < blocked[runs[1]] < stored[runs[1]]  # full blocks, then a live tail
        found = {r: read_columns(reader, "loss", r) for r in runs}
        empty = (-1, np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool))
        monkeypatch.setattr(series_blocks, "read", lambda *args: empty)
        for run_id in runs:
            expected, got = read_columns(reader, "loss", run_id), found[run_id]
            assert expected is not None and got is not None
            for array in ("ctx", "y", "origin", "replay_index"):
                assert getattr(got, array).tobytes() == getattr(expected, array).tobytes()
    finally:
        target.close()
