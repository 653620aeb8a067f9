"""A connection to a SQLite store file, with the settings every retrolog connection uses.

Connections are opened in autocommit mode (``isolation_level=None``) so
transactions are explicit and short; WAL lets readers run beside a training
process's writer, and ``busy_timeout`` lets several writers (a grid search)
take turns instead of failing. The embedded store (store/sqlite_metadata.py) and
the SQLite record sink (store/records.py) both open theirs here.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from retrolog.errors import StoreError

BUSY_TIMEOUT_MS = 60_000


def connect(
    database: Path, *, readonly: bool = False, factory: type[sqlite3.Connection] | None = None
) -> sqlite3.Connection:
    """Open ``database`` with the pragmas every retrolog connection uses (factory: a
    subclass of sqlite3.Connection to make it)."""
    try:
        conn = sqlite3.connect(
            database,
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            check_same_thread=False,
            factory=factory or sqlite3.Connection,
        )
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if readonly:
            conn.execute("PRAGMA query_only = ON")
        else:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(
                    f"The store {database} could not be put in WAL mode (got {mode!r}); "
                    "it must be on a local file system that supports shared memory.",
                    path=str(database),
                )
            conn.execute("PRAGMA synchronous = NORMAL")
    except sqlite3.Error as exc:
        raise StoreError(
            f"Cannot open the retrolog store {database}: {exc}. Check that the directory is "
            "writable, or point RETROLOG_STORE at another directory.",
            path=str(database),
        ) from exc
    return conn


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if SQLite has not already (it has after a full disk).

    A bare ROLLBACK then fails with "cannot rollback - no transaction is active", which
    would hide the error that caused it.
    """
    if conn.in_transaction:
        conn.execute("ROLLBACK")
