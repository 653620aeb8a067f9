"""query(): read-only SQL over a store built row by row."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from retrolog._query.sql import DOCUMENTED_TABLES, query
from retrolog.errors import QueryError
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect


@pytest.fixture
def conn(tmp_path: Path) -> sqlite3.Connection:
    """A store with one run, two loop contexts and a few typed values."""
    c = connect(tmp_path / "retrolog.db")
    migrate(c)
    c.execute(
        "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, host, pid,"
        " python, argv) VALUES ('r1', 'proj', '2024-01-01T00:00:00', 'train.py', 'finished',"
        " 1.0, 'host', 1, '3.11', '[]')"
    )
    c.executemany(
        "INSERT INTO loops (run_id, ctx_id, parent_ctx, name, iteration, depth, t_start)"
        " VALUES ('r1', ?, NULL, 'epoch', ?, 0, 0)",
        [(0, 0), (1, 1)],
    )
    c.executemany(
        "INSERT INTO logs (run_id, ctx_id, name, value, value_type) VALUES ('r1', ?, ?, ?, ?)",
        [
            (0, "loss", 0.5, "float"),
            (1, "loss", 2.0, "float"),
            (None, "batch", 64, "int"),
            (None, "opt", "adam", "str"),
            (1, "nan", None, "float"),
        ],
    )
    return c


def snapshot(c: sqlite3.Connection) -> list[object]:
    """Everything a write could change: every table's rows and the schema."""
    tables = [row[0] for row in c.execute("SELECT name FROM sqlite_master ORDER BY name")]
    rows = [c.execute(f"SELECT * FROM sqlite_master WHERE name = '{t}'").fetchall() for t in tables]
    data = [c.execute(f'SELECT * FROM "{t}"').fetchall() for t in tables if t in DOCUMENTED_TABLES]
    return [tables, rows, data, c.execute("PRAGMA journal_mode").fetchone()]


def test_reads_keep_sqlite_types(conn: sqlite3.Connection) -> None:
    frame = query(
        conn,
        "SELECT name, value, ctx_id, log_id FROM logs ORDER BY log_id",
    )
    assert list(frame.columns) == ["name", "value", "ctx_id", "log_id"]
    assert frame["name"].tolist() == ["loss", "loss", "batch", "opt", "nan"]
    assert frame["name"].dtype == np.dtype(object)
    # A column of mixed storage classes keeps each value's own Python type.
    assert frame["value"].dtype == np.dtype(object)
    assert [type(v).__name__ for v in frame["value"]] == [
        "float",
        "float",
        "int",
        "str",
        "NoneType",
    ]
    assert frame["ctx_id"].dtype == pd.Int64Dtype()  # integers with NULLs
    assert frame["ctx_id"].tolist() == [0, 1, pd.NA, pd.NA, 1]
    assert frame["log_id"].dtype == np.dtype("int64")


def test_reals_read_as_float64_and_empty_results_keep_their_columns(
    conn: sqlite3.Connection,
) -> None:
    frame = query(conn, "SELECT value FROM logs WHERE name IN ('loss', 'nan') ORDER BY log_id")
    assert frame["value"].dtype == np.dtype("float64")
    assert frame["value"].tolist()[:2] == [0.5, 2.0]
    empty = query(conn, "SELECT run_id, name FROM logs WHERE 0")
    assert list(empty.columns) == ["run_id", "name"] and len(empty) == 0


def test_recursive_ctes_json_and_reporting_pragmas_are_reads(conn: sqlite3.Connection) -> None:
    counted = query(
        conn,
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) "
        "SELECT i FROM n",
    )
    assert counted["i"].tolist() == [1, 2, 3]
    assert query(conn, "SELECT value FROM json_each('[1, 2]')")["value"].tolist() == [1, 2]
    assert "value_type" in query(conn, "PRAGMA table_info(logs)")["name"].tolist()
    assert query(conn, "PRAGMA journal_mode")["journal_mode"].tolist() == ["wal"]
    assert query(conn, "SELECT 1 AS one;")["one"].tolist() == [1]


@pytest.mark.parametrize(
    ("sql", "action"),
    [
        (
            "INSERT INTO logs (run_id, name, value, value_type) VALUES ('r1', 'x', 1, 'int')",
            "INSERT",
        ),
        ("UPDATE logs SET value = 0", "UPDATE"),
        ("DELETE FROM logs", "DELETE"),
        ("DROP TABLE logs", "DROP"),
        ("CREATE TABLE t (x)", "CREATE"),
        ("CREATE TEMP VIEW v AS SELECT 1", "CREATE"),
        ("CREATE INDEX logs_by_value ON logs(value)", "CREATE"),
        ("ALTER TABLE logs ADD COLUMN x", "ALTER TABLE"),
        ("ATTACH DATABASE ':memory:' AS other", "ATTACH"),
        ("PRAGMA journal_mode = DELETE", "PRAGMA journal_mode = DELETE"),
        ("PRAGMA user_version = 7", "PRAGMA user_version = 7"),
        ("PRAGMA writable_schema = ON", "PRAGMA writable_schema"),
        ("BEGIN", "BEGIN"),
        ("SAVEPOINT s", "SAVEPOINT"),
        ("ANALYZE", "ANALYZE"),
        ("VACUUM", "VACUUM"),
        ("  -- comment\n  REINDEX logs", "REINDEX"),
        ("SELECT load_extension('x')", "load_extension"),
    ],
)
def test_writes_are_refused_and_change_nothing(
    conn: sqlite3.Connection, sql: str, action: str
) -> None:
    before = snapshot(conn)
    with pytest.raises(QueryError) as info:
        query(conn, sql)
    message = str(info.value)
    assert message.startswith(f"query() is read-only: {sql!r} tries to ")
    assert action in message
    assert info.value.sql == sql
    assert snapshot(conn) == before
    assert not conn.in_transaction


def test_the_connection_writes_normally_afterwards(conn: sqlite3.Connection) -> None:
    with pytest.raises(QueryError):
        query(conn, "DELETE FROM logs")
    query(conn, "SELECT * FROM runs")
    conn.execute("DELETE FROM logs WHERE name = 'nan'")  # our own writes: no authorizer left
    assert query(conn, "SELECT count(*) AS n FROM logs")["n"].tolist() == [4]


def test_syntax_errors_quote_sqlite_and_list_the_tables(conn: sqlite3.Connection) -> None:
    with pytest.raises(QueryError) as info:
        query(conn, "SELEC * FROM logs")
    assert str(info.value) == (
        "The query 'SELEC * FROM logs' cannot be run: SQLite says 'near \"SELEC\": syntax "
        "error'. Give one SELECT statement over the store's tables: runs, loops, logs, "
        "checkpoints, profile, replays, replay_runs, definitions, migrations."
    )
    with pytest.raises(QueryError, match="no such table: nope"):
        query(conn, "SELECT * FROM nope")


def test_a_second_statement_is_refused_before_anything_runs(conn: sqlite3.Connection) -> None:
    before = snapshot(conn)
    with pytest.raises(QueryError, match="one statement at a time"):
        query(conn, "SELECT 1; DELETE FROM logs")
    assert snapshot(conn) == before


def test_the_documented_tables_exist_in_a_migrated_store(conn: sqlite3.Connection) -> None:
    tables = set(query(conn, "SELECT name FROM sqlite_master WHERE type = 'table'")["name"])
    assert set(DOCUMENTED_TABLES) <= tables


def test_a_statement_prepared_earlier_is_checked_again(conn: sqlite3.Connection) -> None:
    sql = "DELETE FROM logs WHERE name = 'nan'"
    conn.execute("BEGIN")
    conn.execute(sql)  # sqlite3 now holds the prepared statement in its cache
    conn.execute("ROLLBACK")
    before = snapshot(conn)
    with pytest.raises(QueryError, match="read-only"):
        query(conn, sql)
    assert snapshot(conn) == before
