"""PostgreSQL's schema is SQLite's: the same tables, columns, view and indexes.

docs/metadata-backends.md: the PostgreSQL schema is SQLite's schema version
(store/schema.py) in PostgreSQL's types, the untyped ``value`` columns split into
``value_float``, ``value_int`` and ``value_text``, and ``runs`` given ``run_key``
for SQLite's rowid. A migration added to one list and not the other fails here.
"""

from __future__ import annotations

import sqlite3
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from retrolog.errors import StoreError
from retrolog.store import postgres_metadata as postgres
from retrolog.store.schema import LATEST_VERSION, migrate
from retrolog.store.sqlite_connection import connect

SPLIT = {"value": {"value_float", "value_int", "value_text"}}


@pytest.fixture
def schema_url(database_url: str) -> Iterator[str]:
    """The test server's database with a schema of this test's own on the search path."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    parts = urllib.parse.urlsplit(database_url)
    yield urllib.parse.urlunsplit(
        parts._replace(query="options=" + urllib.parse.quote(f"-c search_path={schema}"))
    )
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")


def sqlite_shape(tmp_path: Path) -> dict[str, set[str]]:
    conn = connect(tmp_path / "retrolog.db")
    migrate(conn)
    shape = {}
    for (name,) in conn.execute(
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
    ).fetchall():
        columns = set()
        for row in conn.execute(f"PRAGMA table_info({name})"):
            columns |= SPLIT.get(row[1], {row[1]})
        shape[name] = columns
    conn.close()
    return shape


def postgres_shape(url: str) -> dict[str, set[str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema()"
        ).fetchall()
    shape: dict[str, set[str]] = {}
    for table, column in rows:
        shape.setdefault(table, set()).add(column)
    return shape


def indexes(tmp_path: Path, url: str) -> tuple[set[str], set[str]]:
    lite = sqlite3.connect(tmp_path / "retrolog.db")
    ours = {
        name
        for (name,) in lite.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
        )
    }
    lite.close()
    with psycopg.connect(url) as conn:
        theirs = {
            name
            for (name,) in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
                " AND indexname NOT LIKE '%%_pkey' AND indexname NOT LIKE '%%_key'"
            )
        }
    return ours, theirs


def test_the_two_schemas_have_the_same_tables_columns_and_indexes(
    tmp_path: Path, schema_url: str
) -> None:
    conn = postgres.connect(schema_url)
    assert postgres.migrate(conn) == postgres.SCHEMA_VERSION == LATEST_VERSION
    conn.close()
    lite, pg = sqlite_shape(tmp_path), postgres_shape(schema_url)
    pg["runs"].discard("run_key")  # SQLite's implicit rowid, named
    assert pg == lite
    ours, theirs = indexes(tmp_path, schema_url)
    assert theirs == ours


def test_processes_opening_a_new_database_at_once_create_it_once(schema_url: str) -> None:
    results: list[object] = []

    def open_it() -> None:
        try:
            conn = postgres.connect(schema_url)
            results.append(postgres.migrate(conn))
            conn.close()
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [postgres.SCHEMA_VERSION] * 4
    with psycopg.connect(schema_url) as conn:
        rows = conn.execute("SELECT version FROM migrations ORDER BY version").fetchall()
    assert rows == [(version,) for version, _, _ in postgres.MIGRATIONS]


def test_a_database_of_an_earlier_version_gets_the_migrations_it_lacks(schema_url: str) -> None:
    conn = postgres.connect(schema_url)
    postgres.migrate(conn)
    conn.execute("DROP TABLE run_summaries")
    conn.execute("DROP TABLE record_batches")
    conn.execute("DROP TABLE series_blocks")
    conn.execute("DROP INDEX logs_not_recorded")
    conn.execute("DELETE FROM migrations WHERE version >= 10")
    assert postgres.migrate(conn) == 12
    assert conn.execute("SELECT COUNT(*) FROM record_batches").fetchone() == (0,)
    assert conn.execute("SELECT COUNT(*) FROM run_summaries").fetchone() == (0,)
    assert conn.execute("SELECT COUNT(*) FROM series_blocks").fetchone() == (0,)
    assert conn.execute("SELECT MAX(version) FROM migrations").fetchone() == (12,)
    conn.close()


def test_a_database_from_a_newer_retrolog_is_refused_and_left_alone(schema_url: str) -> None:
    conn = postgres.connect(schema_url)
    postgres.migrate(conn)
    conn.execute("INSERT INTO migrations VALUES (99, 'from the future', 'then')")
    with pytest.raises(StoreError, match="newer retrolog"):
        postgres.migrate(conn)
    count = len(postgres.MIGRATIONS) + 1
    assert conn.execute("SELECT COUNT(*) FROM migrations").fetchone() == (count,)
    conn.close()


def test_an_unreachable_server_is_one_clear_error_without_the_password(
    database_url: str,
) -> None:
    parts = urllib.parse.urlsplit(database_url)
    with pytest.raises(StoreError) as caught:
        postgres.connect(
            urllib.parse.urlunsplit(parts._replace(netloc="retrolog:s3cret@127.0.0.1:1"))
        )
    text = str(caught.value)
    assert "Cannot reach the PostgreSQL store at postgresql://retrolog:***@127.0.0.1:1" in text
    assert "s3cret" not in text


def test_the_embedded_store_is_not_opened_while_postgresql_is_selected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guard under every command: with database_url naming PostgreSQL, opening the local
    file (which holds none of the team's runs) is refused in one paragraph, the password
    masked, and no file is made."""
    from retrolog.errors import StoreError
    from retrolog.store.paths import ProjectPaths
    from retrolog.store.sqlite_metadata import open_store

    monkeypatch.setenv("RETROLOG_DATABASE_URL", "postgresql://team:secret@db.example/runs")
    paths = ProjectPaths(root=tmp_path, store=tmp_path / ".retrolog", in_git=False)
    with pytest.raises(StoreError) as refused:
        open_store(paths, create=True)
    said = str(refused.value)
    assert "PostgreSQL" in said and "secret" not in said and "\n" not in said
    assert not (tmp_path / ".retrolog").exists()
