"""The record sink: what a recording run's writer thread commits, one batch at a time.

These are the guarantees every metadata backend's sink must give (docs/metadata-
backends.md); the embedded SQLite store's is the one built. A batch is written whole
or not at all; values keep their exact type and bits (a NaN float reads back as
NULL of value type float); what the database refuses, or another process holding
it, is reported as the kind of failure the writer acts on.
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest

from retrolog.store.metadata import connect
from retrolog.store.records import (
    RecordBatch,
    SinkBusy,
    SinkUnstorable,
    SqliteRecordSink,
)
from retrolog.store.schema import migrate

RUN = "run-'1"  # a quote in the id: the hot path's statements carry it as a literal


@pytest.fixture
def database(tmp_path: Path) -> Path:
    path = tmp_path / "retrolog.db"
    conn = connect(path)
    migrate(conn)
    conn.execute(
        "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, host, pid,"
        " python, argv) VALUES (?, 'p', 't', 'train.py', 'running', 0, 'h', 1, '3.11', '[]')",
        (RUN,),
    )
    conn.close()
    return path


def rows(database: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(database)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


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
            (1, "word", "é\n'x"),
        ],
        logs=[(None, "flag", 1, "bool"), (0, "arr", "[1, 2]", "json")],
        checkpoints=[(0, "epoch", "block", "m/1", 10, 0.1, 0.2, 3.0, 0.05, b"\x00locals")],
        profile=[("start", None, 0.5, None)],
        run_updates=[{"status": "finished", "ended_at": 9.0}],
        module_sets=[("digest-1", b"names")],
    )


def test_a_batch_lands_whole_with_each_value_exact(database: Path) -> None:
    sink = SqliteRecordSink(database)
    sink.write(RUN, a_batch())
    sink.close()
    logged = {
        name: (value, kind)
        for name, value, kind in rows(database, "SELECT name, value, value_type FROM logs")
    }
    assert logged == {
        "loss": (0.1 + 0.2, "float"),
        "nan": (None, "float"),
        "inf": (-math.inf, "float"),
        "big": (2**63 - 1, "int"),
        "word": ("é\n'x", "str"),
        "flag": (1, "bool"),
        "arr": ("[1, 2]", "json"),
    }
    assert rows(database, "SELECT ctx_id, parent_ctx, name, value, t_end FROM loops") == [
        (0, None, "epoch", 0, None),
        (1, 0, "step", "a", 2.0),
    ]
    assert rows(database, "SELECT manifest, frame_locals FROM checkpoints") == [
        ("m/1", b"\x00locals")
    ]
    assert rows(database, "SELECT phase, ctx_id FROM profile ORDER BY phase") == [
        ("iteration", 0),
        ("start", None),
    ]
    assert rows(database, "SELECT status, ended_at, modules FROM runs") == [
        ("finished", 9.0, "digest-1")
    ]
    assert rows(database, "SELECT digest FROM module_sets") == [("digest-1",)]


def test_a_value_the_database_cannot_take_writes_nothing_of_its_batch(database: Path) -> None:
    sink = SqliteRecordSink(database)
    batch = a_batch()
    batch.values.append((1, "huge", 2**70))  # beyond 64 bits
    with pytest.raises(SinkUnstorable):
        sink.write(RUN, batch)
    assert rows(database, "SELECT COUNT(*) FROM logs") == [(0,)]
    assert rows(database, "SELECT COUNT(*) FROM loops") == [(0,)]
    # The same sink writes the next batch.
    sink.write(RUN, a_batch())
    sink.close()
    assert rows(database, "SELECT COUNT(*) FROM logs") == [(7,)]


def test_another_process_holding_the_database_is_busy_not_a_failure(
    database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("retrolog.store.metadata.BUSY_TIMEOUT_MS", 200)
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    sink = SqliteRecordSink(database)
    try:
        with pytest.raises(SinkBusy):
            sink.write(RUN, a_batch())
        holder.execute("COMMIT")
        sink.write(RUN, a_batch())  # the writer retries the same batch: it lands once
    finally:
        sink.close()
        holder.close()
    assert rows(database, "SELECT COUNT(*) FROM logs") == [(7,)]
