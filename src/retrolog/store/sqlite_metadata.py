"""The embedded metadata backend: one SQLite database in WAL mode, ``retrolog.db`` in
the project's store directory (the metadata seam's backend for no ``database_url``).

Its connections (store/sqlite_connection.py) are autocommit with explicit, short
transactions. The store is opened migrated and crash-checked (:func:`open_store`),
or read-only where this process cannot write it (:func:`open_readonly`);
:class:`SqliteMetadata` is its ``MetadataStore``, whose reader is the connection.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from retrolog.errors import StoreError
from retrolog.store.metastore import SQLITE, MetadataStore, StoreReader, require_embedded
from retrolog.store.paths import ProjectPaths, make_store_dir
from retrolog.store.records import RecordSink, SqliteRecordSink
from retrolog.store.schema import LATEST_VERSION, migrate
from retrolog.store.sqlite_connection import BUSY_TIMEOUT_MS, connect


def open_store(paths: ProjectPaths, *, create: bool, write: bool = True) -> sqlite3.Connection:
    """Open (and with ``create``, make) the project's store, migrated and crash-checked.

    Without ``create`` a missing store is a StoreError that says how to make one.
    ``write=False`` (the read commands) opens a store this process cannot write (a
    read-only mount, another user's directory) read-only instead of failing: see
    :func:`open_readonly`. With ``database_url`` naming another backend it is a
    StoreError (store/metastore.py's ``require_embedded``).
    """
    require_embedded(paths)
    if not paths.database.exists():
        if not create:
            raise StoreError(
                f"There is no retrolog store for {paths.root} (looked for {paths.database}). "
                "Record a run first: add `import retrolog as rl` and rl.log(...) calls to a "
                "training script and run it from this project.",
                path=str(paths.database),
            )
        make_store_dir(paths)
    elif not write and not store_writable(paths):
        return open_readonly(paths)
    elif _stale_empty(paths.database):
        # SQLite would take an empty file for a new database: the loss would go unseen.
        raise StoreError(
            f"The retrolog store {paths.database} is an empty file (0 bytes): it was "
            "truncated, or copied before it was written. retrolog does not start a new store "
            "on top of it, which would hide what was lost. Restore the file from a backup or "
            "copy, or, to start over, move it away (with its -wal and -shm files).",
            path=str(paths.database),
        )
    conn = connect(paths.database)
    try:
        migrate(conn)
        mark_dead_runs_crashed(conn)
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(
            f"The retrolog store {paths.database} cannot be read: {exc}.", path=str(paths.database)
        ) from exc
    return conn


class ReadOnlyConnection(sqlite3.Connection):
    """A connection to a store this process cannot write; reads only.

    ``copy`` is the private directory holding a copy of the database, when one was
    needed to read it (removed on close).
    """

    copy: Path | None = None
    origin: Path | None = None  # the store's database, when it is read from a copy

    def close(self) -> None:
        super().close()
        if self.copy is not None:
            shutil.rmtree(self.copy, ignore_errors=True)
            self.copy = None


def is_readonly(conn: sqlite3.Connection) -> bool:
    """Whether ``conn`` was opened by :func:`open_readonly`."""
    return isinstance(conn, ReadOnlyConnection)


def store_directory(conn: sqlite3.Connection) -> Path | None:
    """The store directory ``conn``'s database is in (None for an in-memory database)."""
    origin = getattr(conn, "origin", None)
    if origin is not None:
        return Path(origin).parent
    for _, name, file in conn.execute("PRAGMA database_list"):
        if name == "main" and file:
            return Path(file).parent
    return None


def store_writable(paths: ProjectPaths) -> bool:
    """Whether this process may write the store (its database and directory).

    ``access(2)`` answers for the real user, and for root too on a read-only mount.
    """
    return os.access(paths.database, os.W_OK) and os.access(paths.store, os.W_OK)


def open_readonly(paths: ProjectPaths) -> sqlite3.Connection:
    """Open a store this process cannot write, for reading, without writing anything.

    The store's database is in WAL mode; how SQLite can read it without writing
    depends on what the last writer left:

    - a ``-shm`` file (a run still recording, or killed): opened ``mode=ro``, which
      reads the log through the existing shared memory and sees a live writer's
      commits as usual;
    - no ``-shm`` and no ``-wal``, or an empty one (every writer closed): everything
      is in the database file, opened ``immutable`` (no locks, no ``-shm`` to create);
    - a ``-wal`` without its ``-shm`` (copied without it): SQLite cannot read that log
      in place, so the database and its log are copied to a private temporary
      directory and read there; the copy is removed on close.

    A schema older than this retrolog's cannot be upgraded here: that is an error
    saying how to upgrade it.
    """
    require_embedded(paths)
    database = paths.database
    wal = database.with_name(database.name + "-wal")
    shm = database.with_name(database.name + "-shm")
    copy: Path | None = None
    try:
        if os.access(shm, os.R_OK):
            conn = _connect_uri(database, "mode=ro")
        elif not _nonempty(wal):
            conn = _connect_uri(database, "mode=ro&immutable=1")
        else:
            copy = Path(tempfile.mkdtemp(prefix="retrolog-readonly-"))
            shutil.copyfile(database, copy / database.name)
            shutil.copyfile(wal, copy / wal.name)
            conn = _connect_uri(copy / database.name, "")
            conn.copy = copy
            conn.origin = database
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA query_only = ON")
        version = conn.execute("SELECT MAX(version) FROM migrations").fetchone()[0] or 0
    except (sqlite3.Error, OSError) as exc:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)
        raise StoreError(
            f"Cannot read the retrolog store {database}, which this process cannot write "
            f"(a read-only file system or another user's files): {exc}. Check that its "
            "files are readable, or copy the store directory somewhere writable and point "
            "RETROLOG_STORE at the copy.",
            path=str(database),
        ) from exc
    if version != LATEST_VERSION:
        conn.close()
        newer = version > LATEST_VERSION
        raise StoreError(
            f"The retrolog store {database} has schema version {version}, "
            + (
                f"newer than this retrolog understands ({LATEST_VERSION}); upgrade retrolog "
                "(pip install -U retrolog) to read it."
                if newer
                else f"older than this retrolog's ({LATEST_VERSION}), and this process "
                "cannot write it to upgrade it. Run any retrolog command once where the store "
                "is writable (its owner, or a writable mount), or copy the store directory "
                "somewhere writable and point RETROLOG_STORE at the copy."
            ),
            path=str(database),
        )
    return conn


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _connect_uri(database: Path, query: str) -> ReadOnlyConnection:
    uri = "file:" + urllib.parse.quote(str(database.absolute())) + (f"?{query}" if query else "")
    conn = sqlite3.connect(
        uri,
        uri=True,
        timeout=BUSY_TIMEOUT_MS / 1000,
        isolation_level=None,
        check_same_thread=False,
        factory=ReadOnlyConnection,
    )
    assert isinstance(conn, ReadOnlyConnection)
    return conn


def read_only_error(paths: ProjectPaths, what: str) -> StoreError:
    """The error for a command that must write a store this process can only read."""
    return StoreError(
        f"The retrolog store {paths.store} is read-only for this process (a read-only file "
        f"system or another user's files), and {what} writes to it. The read commands (runs, "
        "show, dataframe, query, lineage, replay --dry-run, gc --dry-run) work as they are; "
        "to write, run it where the store is writable, or copy the store directory somewhere "
        "writable and point RETROLOG_STORE at the copy.",
        path=str(paths.store),
    )


EMPTY_STORE_GRACE_SECONDS = 10.0


def _stale_empty(database: Path) -> bool:
    """An empty database file that nobody is creating: 0 bytes and untouched for a while.

    A process that has just created the store (two runs starting at once) leaves it
    empty until its first write; that one is being made, not lost.
    """
    try:
        info = database.stat()
    except OSError:
        return False
    return info.st_size == 0 and time.time() - info.st_mtime > EMPTY_STORE_GRACE_SECONDS


def mark_dead_runs_crashed(conn: sqlite3.Connection) -> int:
    """Mark runs of this host whose process died without ending them as crashed."""
    return SqliteMetadata(conn, None).mark_dead_runs_crashed()


class SqliteMetadata(MetadataStore):
    """The embedded store: a SQLite connection from :func:`open_store`."""

    dialect = SQLITE

    def __init__(self, conn: sqlite3.Connection, database: Path | None) -> None:
        self.conn = conn
        self.database = database
        self.location = str(database)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()

    def _run_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        if len(params) == 1:  # autocommit: one statement is its own transaction
            self.conn.execute(sql, params[0])
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.conn.executemany(sql, params)
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def reader(self) -> StoreReader:
        return self.conn

    def interrupt(self) -> None:
        self.conn.interrupt()

    def record_sink(self) -> Callable[[], RecordSink]:
        database = self.database
        if database is None:
            raise StoreError("This SQLite store was opened for its queries only, not to record.")
        return lambda: SqliteRecordSink(database)

    def close(self) -> None:
        self.conn.close()


def open_backend(url: str | None, paths: ProjectPaths, create: bool) -> MetadataStore:
    """The embedded store as the metadata seam opens it (store/metastore.py's
    ``BACKENDS``): made when missing with ``create``, else opened for reading."""
    conn = open_store(paths, create=create, write=create)
    return SqliteMetadata(conn, paths.database if create else None)
