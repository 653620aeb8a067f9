"""Where runs' metadata lives: the ``MetadataStore`` seam and its registry by URL scheme.

docs/metadata-backends.md has the design. The ``database_url`` setting
(``RETROLOG_DATABASE_URL``, or the project's settings files) chooses the backend:

- unset: the embedded SQLite store, ``retrolog.db`` in the project's store directory;
- ``postgresql://...`` (or ``postgres://``): a team's PostgreSQL database
  (store/postgres.py, psycopg 3 from the ``team`` extra).

The interface holds operations, not SQL. So far it holds what a recording run does
(register itself, name its code manifest, learn the restore ratio, hand its writer
thread a record sink, mark this host's dead runs crashed), the runs listing, a
portable reader for ``show``'s queries, and, on PostgreSQL, ``query``'s read-only
statement. The operations whose SQL is the same on both backends are written once,
with ``?`` placeholders that a backend turns into its own; the rest are each
backend's own. The dataframe, replay and gc still take SQLite connections
(store/metadata.py): with PostgreSQL selected they stop with an error that says so
(:func:`require_embedded`).
"""

from __future__ import annotations

import abc
import contextlib
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrolog._config import lookup, mask
from retrolog.errors import StoreError, UsageError
from retrolog.store.paths import ProjectPaths, storable_text

if TYPE_CHECKING:  # records.py imports metadata.py, which imports this module
    from retrolog.store.records import RecordSink

DATABASE_URL_ENV = "RETROLOG_DATABASE_URL"

# Each column a recording run writes when it starts (store/schema.py's runs table).
RUN_COLUMNS = (
    "run_id", "projid", "tstamp", "filename", "status", "started_at", "host", "pid",
    "pid_start", "python", "argv", "code_ref", "code_commit", "code_tree", "head_commit",
    "git_dir", "dirty", "skipped_files", "cwd", "numerics",
)  # fmt: skip

_REGISTER = "INSERT INTO runs({}) VALUES ({})".format(
    ", ".join(RUN_COLUMNS), ", ".join("?" for _ in RUN_COLUMNS)
)

_CRASHED = (
    "UPDATE runs SET status = 'crashed', "
    "error = COALESCE(error, 'the process died without ending the run (killed?)'), "
    # Its duration ends at its last record, not whenever this is noticed.
    "ended_at = COALESCE(ended_at, started_at + (SELECT MAX(COALESCE(l.t_end,"
    " l.t_start)) FROM loops l WHERE l.run_id = runs.run_id), started_at) "
    "WHERE run_id = ? AND status = 'running'"
)


class ReadRefused(Exception):
    """A read-only statement a backend did not run to its end.

    reason: "malformed" (the database could not run it), "writes" (it would change
    something), "timeout", "memory" (its rows outgrew the budget) or "privileged"
    (the database role may read files or run programs on the server: no sandbox).
    complaint: the database's own words.
    """

    def __init__(self, reason: str, complaint: str) -> None:
        super().__init__(f"{reason}: {complaint}")
        self.reason = reason
        self.complaint = complaint


class MetadataStore(abc.ABC):
    """One project's metadata: the operations a recording run needs, on any backend."""

    #: where the metadata is, for messages: a file's path, or a URL with its password masked
    location: str

    # -- what a backend provides --------------------------------------------------------

    @abc.abstractmethod
    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement (``?`` placeholders) in a transaction of its own; its rows."""

    @abc.abstractmethod
    def _run_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per parameter tuple, all in one transaction."""

    @abc.abstractmethod
    def record_sink(self) -> Callable[[], RecordSink]:
        """What makes a sink for a recording run's writer thread (called on that thread:
        a connection belongs to the thread that uses it)."""

    @abc.abstractmethod
    def reader(self) -> Any:
        """A connection-like object for the queries whose SQL both backends run:
        ``execute(sql, params)`` with ``?`` placeholders returns a cursor (``fetchone``,
        ``fetchall``, iteration, ``description``); ``origin`` is the project's
        ``retrolog.db`` path, whose directory is the store directory
        (store/metadata.py's ``store_directory``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close what this store opened."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Stop the statement running on this store's connection; called from another
        thread (store/cancel.py). It fails with the backend's error."""

    # -- operations ----------------------------------------------------------------------

    def register_run(self, row: Mapping[str, Any]) -> None:
        """Insert a starting run's row: every column of :data:`RUN_COLUMNS`."""
        # Text as the store keeps it, as the writer does: a lone surrogate (bytes that are
        # not UTF-8, as Python decodes them) escaped.
        values = [row[c] for c in RUN_COLUMNS]
        self._run_many(
            _REGISTER, [tuple(storable_text(v) if isinstance(v, str) else v for v in values)]
        )

    def set_code_manifest(self, run_id: str, key: str) -> None:
        """Name the code manifest that holds ``run_id``'s code version."""
        self._run_many("UPDATE runs SET code_manifest = ? WHERE run_id = ?", [(key, run_id)])

    def live_manifests(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` that a run of the store references as its code manifest."""
        wanted = sorted(set(keys))
        if not wanted:
            return set()
        marks = ", ".join("?" for _ in wanted)
        sql = f"SELECT DISTINCT code_manifest FROM runs WHERE code_manifest IN ({marks})"
        return {r[0] for r in self._rows(sql, wanted)}

    def run_listing(self, limit: int | None = None) -> list[tuple[Any, ...]]:
        """The newest ``limit`` runs (all without it), newest first: (run_id, tstamp,
        filename, status, started_at, ended_at, args, parsed_args)."""
        sql = (
            "SELECT run_id, tstamp, filename, status, started_at, ended_at, args, parsed_args"
            " FROM runs ORDER BY started_at DESC, run_id DESC"
        )
        if limit is None:
            return self._rows(sql)
        return self._rows(sql + " LIMIT ?", (limit,))

    def mark_dead_runs_crashed(self) -> int:
        """Mark runs of this host whose process died without ending them as crashed.

        Runs of other hosts are judged by a process on their own host.
        """
        from retrolog.store.metadata import process_alive

        rows = self._rows(
            "SELECT run_id, pid, pid_start FROM runs WHERE status = 'running' AND host = ?",
            (socket.gethostname(),),
        )
        dead = [run_id for run_id, pid, marker in rows if not process_alive(pid, marker)]
        if dead:
            self._run_many(_CRASHED, [(run_id,) for run_id in dead])
        return len(dead)

    def learned_restore_ratio(self, filename: str) -> float | None:
        """Flor's c for runs of ``filename``, learned from past replays; None before any.

        c = restore / materialize: the mean seconds a replay spent restoring one
        checkpoint of this script's runs, over the mean seconds those runs spent
        materializing one (capture plus the writer's CPU time). Replays record
        their restore figures per run in ``replay_runs``.
        """
        ((restore_seconds, restored),) = self._rows(
            "SELECT SUM(rr.restore_seconds), SUM(rr.restored) FROM replay_runs rr"
            " JOIN runs r ON r.run_id = rr.run_id"
            " WHERE r.filename = ? AND rr.restored > 0 AND rr.restore_seconds IS NOT NULL",
            (filename,),
        )
        if not restored:
            return None
        ((materialize,),) = self._rows(
            "SELECT AVG(c.capture_seconds + COALESCE(c.writer_cpu_seconds, 0)) FROM checkpoints c"
            " WHERE c.run_id IN (SELECT rr.run_id FROM replay_runs rr JOIN runs r"
            " ON r.run_id = rr.run_id WHERE r.filename = ? AND rr.restored > 0)",
            (filename,),
        )
        if not materialize or materialize <= 0:
            return None
        return float(restore_seconds) / int(restored) / float(materialize)


class SqliteMetadata(MetadataStore):
    """The embedded store: a SQLite connection from store/metadata.py's ``open_store``."""

    def __init__(self, conn: Any, database: Path | None) -> None:
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

    def reader(self) -> Any:
        return self.conn

    def interrupt(self) -> None:
        self.conn.interrupt()

    def record_sink(self) -> Callable[[], RecordSink]:
        from retrolog.store.records import SqliteRecordSink

        database = self.database
        if database is None:
            raise StoreError("This SQLite store was opened for its queries only, not to record.")
        return lambda: SqliteRecordSink(database)

    def close(self) -> None:
        self.conn.close()


def database_url() -> str | None:
    """The ``database_url`` setting, checked; None for the embedded SQLite store."""
    url = (lookup(DATABASE_URL_ENV) or "").strip()
    if not url:
        return None
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("postgresql", "postgres"):
        raise UsageError(
            f"database_url ({DATABASE_URL_ENV} or [tool.retrolog] in pyproject.toml) is "
            f"{mask(url)!r}, which names no database retrolog can use. Leave it unset for the "
            "embedded SQLite store in the project's .retrolog directory, or give a PostgreSQL "
            "URL such as postgresql://user@host:5432/dbname."
        )
    return url


def open_metadata(paths: ProjectPaths, *, create: bool = True) -> MetadataStore:
    """The project's metadata store, migrated and crash-checked.

    create: make it when missing (recording); without it (the read commands) a missing
        store is a StoreError that says how to make one, and a SQLite store this process
        cannot write is opened read-only.
    Raises StoreError when it cannot be opened, with what to do.
    """
    url = database_url()
    if url is None:
        from retrolog.store.metadata import open_store

        conn = open_store(paths, create=create, write=create)
        return SqliteMetadata(conn, paths.database if create else None)
    from retrolog.store.metadata import make_store_dir
    from retrolog.store.postgres import PostgresMetadata

    metadata = PostgresMetadata(url, create=create, origin=paths.database)
    # The project's store directory still holds what is local (objects, caches, working
    # copies, replay logs): kept out of the project's git status like an embedded one.
    if create:
        make_store_dir(paths, objects=False)
    else:
        with contextlib.suppress(StoreError):  # a reader on a read-only checkout
            make_store_dir(paths, objects=False)
    return metadata


def require_embedded(paths: ProjectPaths) -> None:
    """Stop, saying why, when ``database_url`` names PostgreSQL and something opens the
    embedded SQLite store (no command does; ``Project`` reads through
    :func:`open_metadata`): it would read an empty or stale local file and answer
    wrongly."""
    url = database_url()
    if url is None:
        return
    raise StoreError(
        f"This project's runs are in the PostgreSQL database {mask(url)} (database_url), "
        "and this command reads only the embedded SQLite store so far; every other "
        "command reads the runs there (docs/metadata-backends.md). Unset "
        f"{DATABASE_URL_ENV} to use the embedded store in {paths.store}."
    )
