"""The record sink: what a recording run's writer thread commits, one batch at a time.

The guarantees every metadata backend's sink gives (docs/metadata-backends.md), on
the embedded SQLite store and on the PostgreSQL server scripts/services.sh starts:
a batch is written whole or not at all; values keep their exact type and bits (a
NaN float reads back as NULL of value type float, on both); what the database
refuses, or another process holding it, is the kind of failure the writer acts on.
"""

from __future__ import annotations

import math
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from retrolog.store import postgres_metadata as postgres
from retrolog.store.records import (
    RecordBatch,
    RecordSink,
    SinkBusy,
    SinkUnstorable,
    SqliteRecordSink,
)
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect

from conftest import read_pg

RUN = "run-'1"  # a quote in the id: SQLite's hot-path statements carry it as a literal

RUN_ROW = (
    "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, host, pid,"
    " python, argv) VALUES ({p}, 'p', 't', 'train.py', 'running', 0, 'h', 1, '3.11', '[]')"
)


@dataclass
class Backend:
    """A fresh store of one backend, and how a test reads it back."""

    name: str
    sink: Any  # () -> RecordSink
    query: Any  # (sql) -> rows; ``VALUE`` in sql is the value column(s) as one value

    def rows(self, sql: str) -> list[tuple[object, ...]]:
        return [tuple(row) for row in self.query(sql)]


def _sqlite(tmp_path: Path) -> Backend:
    path = tmp_path / "retrolog.db"
    conn = connect(path)
    migrate(conn)
    conn.execute(RUN_ROW.format(p="?"), (RUN,))
    conn.close()

    def query(sql: str) -> list[Any]:
        reader = sqlite3.connect(path)
        try:
            return reader.execute(sql.replace("VALUE", "value")).fetchall()
        finally:
            reader.close()

    return Backend("sqlite", lambda: SqliteRecordSink(path), query)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        yield _sqlite(tmp_path)
        return
    # A schema of its own per test, on the test server's database.
    url = request.getfixturevalue("pg_store_url")
    conn = postgres.connect(url)
    postgres.migrate(conn)
    conn.execute(RUN_ROW.format(p="%s"), (RUN,))
    conn.close()

    def query(sql: str) -> list[Any]:
        # A value is in the column its type picks; read back as the one that is set.
        columns = [c.strip() for c in sql.split("SELECT", 1)[1].split("FROM", 1)[0].split(",")]
        at = columns.index("VALUE") if "VALUE" in columns else None
        with psycopg.connect(url) as reader:
            found = reader.execute(
                sql.replace("VALUE", "value_float, value_int, value_text")
            ).fetchall()
        if at is None:
            return found
        merged = []
        for row in found:
            f, i, t = row[at : at + 3]
            one = f if f is not None else i if i is not None else t
            merged.append((*row[:at], one, *row[at + 3 :]))
        return merged

    yield Backend("postgresql", lambda: postgres.PostgresRecordSink(url), query)


def a_batch() -> RecordBatch:
    return RecordBatch(
        loop_starts=[(0, None, "epoch", 0, 0, 0, 1.0), (1, 0, "step", 0, "a", 1, 1.5)],
        loop_ends=[(2.0, 1)],
        iterations=[(0, 1.0, 0.9)],
        values=[
            (1, "loss", 0.1 + 0.2),
            (1, "nan", math.nan),
            (1, "inf", -math.inf),
            (1, "big", 2**63 - 1),
            (1, "word", "é\n'x\t\\"),
        ],
        logs=[(None, "flag", 1, "bool"), (0, "arr", "[1, 2]", "json"), (0, "none", None, "none")],
        checkpoints=[(0, "epoch", "block", "m/1", 10, 0.1, 0.2, 3.0, 0.05, b"\x00locals")],
        profile=[("start", None, 0.5, None)],
        run_updates=[{"status": "finished", "ended_at": 9.0}],
        module_sets=[("digest-1", b"names")],
    )


def written(sink: RecordSink, *batches: RecordBatch) -> None:
    try:
        for batch in batches:
            sink.write(RUN, batch)
    finally:
        sink.close()


def test_a_batch_lands_whole_with_each_value_exact(backend: Backend) -> None:
    written(backend.sink(), a_batch())
    logged = {
        name: (value, kind)
        for name, value, kind in backend.rows("SELECT name, VALUE, value_type FROM logs")
    }
    assert logged == {
        "loss": (0.1 + 0.2, "float"),
        "nan": (None, "float"),
        "inf": (-math.inf, "float"),
        "big": (2**63 - 1, "int"),
        "word": ("é\n'x\t\\", "str"),
        "flag": (1, "bool"),
        "arr": ("[1, 2]", "json"),
        "none": (None, "none"),
    }
    assert backend.rows(
        "SELECT ctx_id, parent_ctx, name, VALUE, t_end FROM loops ORDER BY ctx_id"
    ) == [(0, None, "epoch", 0, None), (1, 0, "step", "a", 2.0)]
    assert backend.rows("SELECT manifest, frame_locals FROM checkpoints") == [
        ("m/1", b"\x00locals")
    ]
    assert backend.rows("SELECT phase, ctx_id FROM profile ORDER BY phase") == [
        ("iteration", 0),
        ("start", None),
    ]
    assert backend.rows("SELECT status, ended_at, modules FROM runs") == [
        ("finished", 9.0, "digest-1")
    ]
    assert backend.rows("SELECT digest FROM module_sets") == [("digest-1",)]


def test_a_loop_started_again_replaces_its_row(backend: Backend) -> None:
    # A batch retried after a failure writes its loop starts again.
    again = RecordBatch(loop_starts=[(1, 0, "step", 0, 2.5, 1, 1.6)])
    written(backend.sink(), a_batch(), again)
    assert backend.rows("SELECT ctx_id, VALUE, t_start, t_end FROM loops ORDER BY ctx_id") == [
        (0, 0, 1.0, None),
        (1, 2.5, 1.6, None),
    ]


@pytest.mark.parametrize("bad", [2**70, "lone \udfff surrogate"])
def test_a_value_the_database_cannot_take_writes_nothing_of_its_batch(
    backend: Backend, bad: object
) -> None:
    sink = backend.sink()
    batch = a_batch()
    batch.values.append((1, "bad", bad))
    try:
        with pytest.raises(SinkUnstorable):
            sink.write(RUN, batch)
        assert backend.rows("SELECT COUNT(*) FROM logs") == [(0,)]
        assert backend.rows("SELECT COUNT(*) FROM loops") == [(0,)]
        sink.write(RUN, a_batch())  # the same sink writes the next batch
    finally:
        sink.close()
    assert backend.rows("SELECT COUNT(*) FROM logs") == [(8,)]


def test_another_process_holding_sqlite_is_busy_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _sqlite(tmp_path)
    monkeypatch.setattr("retrolog.store.sqlite_connection.BUSY_TIMEOUT_MS", 200)
    holder = sqlite3.connect(tmp_path / "retrolog.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    sink = backend.sink()
    try:
        with pytest.raises(SinkBusy):
            sink.write(RUN, a_batch())
        holder.execute("COMMIT")
        sink.write(RUN, a_batch())  # the writer retries the same batch: it lands once
    finally:
        sink.close()
        holder.close()
    assert backend.rows("SELECT COUNT(*) FROM logs") == [(8,)]


def test_a_postgresql_server_that_goes_away_loses_no_value(
    database_url: str, pg_store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The writer holds what the server did not take and writes it once it answers."""
    from retrolog.runtime.writer import Writer

    name = f"retrolog-test-{uuid.uuid4().hex[:8]}"
    url = f"{pg_store_url}&application_name={name}"
    conn = postgres.connect(url)
    postgres.migrate(conn)
    conn.close()
    writer = Writer(
        Path("unused.db"), RUN, interval=0.05, sink=lambda: postgres.PostgresRecordSink(url)
    )
    writer.start()
    try:
        writer.loop_starts.append((0, None, "epoch", 0, None, 0, 0.0))
        writer.values.extend((0, "x", float(i)) for i in range(1000))
        assert writer.flush(10)
        with psycopg.connect(database_url, autocommit=True) as admin:
            (ended,) = admin.execute(
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (name,),
            ).fetchone()
        assert ended == 1  # the writer's connection, ended by the server
        writer.values.extend((0, "x", float(i)) for i in range(1000, 2000))
        writer._wake.set()
        deadline = time.monotonic() + 20
        landed = 0
        while time.monotonic() < deadline:
            with psycopg.connect(url) as reader:
                (landed,) = reader.execute("SELECT COUNT(*) FROM logs").fetchone()
            if landed == 2000 and writer.full_error is None:
                break
            time.sleep(0.2)
    finally:
        writer.close(30)
    rows = read_pg(url, "SELECT value_float FROM logs ORDER BY value_float")
    assert writer.failure is None
    assert [r[0] for r in rows] == [float(i) for i in range(2000)]  # each once, none lost
    err = capsys.readouterr().err
    assert "cannot reach the store" in err and "the store answers again" in err
    assert "nothing was lost" in err


@pytest.mark.parametrize(
    "losses",
    [("after",), ("before",), ("after", "before"), ("after", "after")],
    ids=["after-commit", "before-commit", "after-then-before", "after-twice"],
)
def test_a_connection_lost_around_commit_writes_each_record_once(
    pg_store_url: str, losses: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """The connection drops after the server committed a batch, before its answer came
    back (or before the commit), once or again on the retry: the writer's retries leave
    out exactly what was committed."""
    from retrolog.runtime.writer import Writer

    conn = postgres.connect(pg_store_url)
    postgres.migrate(conn)
    conn.execute(RUN_ROW.format(p="%s"), (RUN,))
    conn.close()
    dropped: list[int] = []

    class DropsOnce(postgres.PostgresRecordSink):
        before = False  # lose the connection in the transaction, before its COMMIT

        def _write(self, run_id: str, whole: RecordBatch) -> None:
            marked = any(name == "drop-here" for _, name, _ in whole.values)
            if len(dropped) == len(losses) or not marked:
                super()._write(run_id, whole)
                return
            loss = losses[len(dropped)]
            dropped.append(len(whole.values))
            self.before = loss == "before"
            super()._write(run_id, whole)  # "after": the server has it all
            self._conn.close()
            raise psycopg.OperationalError("the connection was lost")

        def _records(self, cur: Any, run_id: str, batch: RecordBatch) -> None:
            super()._records(cur, run_id, batch)
            if self.before:
                self.before = False
                self._conn.close()
                raise psycopg.OperationalError("the connection was lost")

    writer = Writer(Path("unused.db"), RUN, interval=0.05, sink=lambda: DropsOnce(pg_store_url))
    writer.start()
    try:
        writer.loop_starts.append((0, None, "epoch", 0, None, 0, 0.0))
        writer.values.extend((0, "x", float(i)) for i in range(500))
        writer.values.append((0, "drop-here", 1.0))
        writer.values.extend((0, "x", float(i)) for i in range(500, 1000))
        time.sleep(0.3)  # a later batch, which the retries carry behind the first
        writer.values.extend((0, "x", float(i)) for i in range(1000, 1500))
        deadline = time.monotonic() + 20
        while not writer.flush(1) and time.monotonic() < deadline:
            pass
        assert writer.flush(10)
    finally:
        writer.close(30)
    assert writer.failure is None and len(dropped) == len(losses)
    rows = read_pg(pg_store_url, "SELECT value_float FROM logs WHERE name = 'x'")
    assert sorted(r[0] for r in rows) == [float(i) for i in range(1500)]  # each once
    assert read_pg(pg_store_url, "SELECT COUNT(*) FROM logs WHERE name = 'drop-here'") == [(1,)]
    assert read_pg(pg_store_url, "SELECT COUNT(*) FROM loops") == [(1,)]
    err = capsys.readouterr().err
    assert "cannot reach the store" in err and "nothing was lost" in err


def test_a_transaction_the_server_still_runs_for_a_lost_connection_is_waited_for(
    pg_store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a lost connection the run's row of record_batches is held by a transaction
    the server has not ended yet (here another connection's, standing for the lost one's):
    the writer holds its records and says why, then writes each once when it ends."""
    from retrolog.runtime.writer import Writer

    conn = postgres.connect(pg_store_url)
    postgres.migrate(conn)
    conn.execute(RUN_ROW.format(p="%s"), (RUN,))
    conn.close()
    holder = psycopg.connect(pg_store_url, autocommit=True)
    lost: list[int] = []

    class LosesOnce(postgres.PostgresRecordSink):
        def _write(self, run_id: str, whole: RecordBatch) -> None:
            super()._write(run_id, whole)
            if not lost and any(name == "drop-here" for _, name, _ in whole.values):
                lost.append(1)
                holder.execute("BEGIN")
                holder.execute("SELECT * FROM record_batches FOR UPDATE")
                self._conn.close()
                raise psycopg.OperationalError("the connection was lost")

    writer = Writer(Path("unused.db"), RUN, interval=0.05, sink=lambda: LosesOnce(pg_store_url))
    writer.start()
    try:
        writer.loop_starts.append((0, None, "epoch", 0, None, 0, 0.0))
        writer.values.extend((0, "x", float(i)) for i in range(500))
        writer.values.append((0, "drop-here", 1.0))
        deadline = time.monotonic() + 20
        while "still runs the transaction" not in (writer.full_error or ""):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        writer.values.extend((0, "x", float(i)) for i in range(500, 1000))
        holder.execute("COMMIT")
        while not writer.flush(1) and time.monotonic() < deadline:
            pass
        assert writer.flush(10)
    finally:
        writer.close(30)
        holder.close()
    assert writer.failure is None and lost == [1]
    rows = read_pg(pg_store_url, "SELECT value_float FROM logs WHERE name = 'x'")
    assert sorted(r[0] for r in rows) == [float(i) for i in range(1000)]  # each once
    assert read_pg(pg_store_url, "SELECT COUNT(*) FROM logs WHERE name = 'drop-here'") == [(1,)]
    err = capsys.readouterr().err
    assert "cannot reach the store" in err and "nothing was lost" in err
