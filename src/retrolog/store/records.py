"""Where a recording run's records go: the store operation its writer thread calls.

The first operation behind the metadata seam (docs/metadata-backends.md): a run's
writer thread (runtime/writer.py) hands :meth:`RecordSink.write` one
:class:`RecordBatch` per interval, which is committed whole or not at all. The
writer keeps the policy (when to write, what to hold while the disk is full, when
to retry); the sink holds the SQL and says what went wrong in terms the writer acts
on: :class:`SinkBusy` (another process holds the database: retry),
:class:`SinkFull` (out of space) and :class:`SinkUnavailable` (a server that cannot
be reached): hold the batch; and :class:`SinkUnstorable` (a
value the database cannot take as it is: an int beyond 64 bits, text that is not
UTF-8). :class:`SqliteRecordSink` is the embedded store's.
"""

from __future__ import annotations

import abc
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrolog.errors import disk_full
from retrolog.store.series_blocks import BlockTracker
from retrolog.store.sqlite_connection import connect, rollback
from retrolog.store.summaries import SQLITE_NUMBER, LastCounted, add_batch

Row = tuple[Any, ...]


@dataclass(slots=True)
class RecordBatch:
    """One interval of a run's records, in the order they are committed.

    Loop starts come first: this batch's ends and values may be in the loops they start.
    """

    # (ctx_id, parent_ctx, name, iteration, value, depth, t_start); replaces a start
    # written before (a context is started once; a retried batch writes it again)
    loop_starts: list[Row] = field(default_factory=list)
    loop_ends: list[Row] = field(default_factory=list)  # (t_end, ctx_id)
    # (ctx_id, seconds, block_seconds) of the top-level loop's iterations
    iterations: list[Row] = field(default_factory=list)
    # (ctx_id, name, value): a float, int (64-bit) or str; the sink names the type, and
    # a NULL float is a NaN
    values: list[Row] = field(default_factory=list)
    logs: list[Row] = field(default_factory=list)  # (ctx_id, name, stored value, value_type)
    # (ctx_id, loop_name, kind, manifest, nbytes, capture_seconds, write_seconds,
    #  created_at, writer_cpu_seconds, frame_locals)
    checkpoints: list[Row] = field(default_factory=list)
    profile: list[Row] = field(default_factory=list)  # (phase, ctx_id, seconds, block_seconds)
    run_updates: list[dict[str, Any]] = field(default_factory=list)  # {column: value}
    module_sets: list[tuple[str, bytes]] = field(default_factory=list)  # (digest, names)

    def lengths(self) -> tuple[int, ...]:
        """How many records each list holds, in field order."""
        return tuple(len(getattr(self, name)) for name in self.__slots__)

    def after(self, lengths: tuple[int, ...]) -> RecordBatch:
        """This batch without the first ``lengths`` records of each list (a batch that
        begins with one already written: :class:`SinkUnavailable`)."""
        return RecordBatch(
            *(getattr(self, name)[n:] for name, n in zip(self.__slots__, lengths, strict=True))
        )


# The columns of the rows a batch carries for these tables, after run_id, in RecordBatch's
# field order; every sink inserts them in this order, whatever its SQL dialect.
CHECKPOINT_COLUMNS = (
    "ctx_id", "loop_name", "kind", "manifest", "nbytes", "capture_seconds", "write_seconds",
    "created_at", "writer_cpu_seconds", "frame_locals",
)  # fmt: skip
PROFILE_COLUMNS = ("phase", "ctx_id", "seconds", "block_seconds")


def insert_sql(table: str, columns: tuple[str, ...], placeholder: str) -> str:
    """``INSERT INTO table(run_id, columns...) VALUES (...)`` with the dialect's placeholder."""
    names = ", ".join(("run_id", *columns))
    marks = ", ".join([placeholder] * (len(columns) + 1))
    return f"INSERT INTO {table}({names}) VALUES ({marks})"


def with_run(run_id: str, rows: list[Row]) -> list[Row]:
    """``rows`` with the run id in front of each, as the INSERTs above take them."""
    return [(run_id, *row) for row in rows]


def write_run_rows(cursor: Any, run_id: str, batch: RecordBatch, mark: str) -> None:
    """A batch's checkpoints, profile rows and run updates, in a sink's transaction: the
    same statements on every backend but for the placeholder ``mark`` (``?``, ``%s``)."""
    if batch.checkpoints:
        cursor.executemany(
            insert_sql("checkpoints", CHECKPOINT_COLUMNS, mark), with_run(run_id, batch.checkpoints)
        )
    if batch.profile:
        cursor.executemany(
            insert_sql("profile", PROFILE_COLUMNS, mark), with_run(run_id, batch.profile)
        )
    for columns in batch.run_updates:
        assignments = ", ".join(f"{column} = {mark}" for column in columns)
        cursor.execute(
            f"UPDATE runs SET {assignments} WHERE run_id = {mark}", (*columns.values(), run_id)
        )


class SinkBusy(Exception):
    """Another process held the database longer than the sink waits: retry the batch."""


class SinkFull(Exception):
    """The database's disk (or quota) is full: the batch was not written."""


class SinkUnavailable(Exception):
    """The database cannot be reached (a server that went away): retry the batch.

    The sink connects again on the next write. The connection may have been lost after
    the server committed the batch, before its answer came back; so the writer's next
    batch must begin with every record of this one, in the same order (it holds them
    ahead of what was queued since), and the sink leaves out those the server did
    commit.
    """


class SinkUnstorable(Exception):
    """A value of the batch cannot be stored as it is; nothing of the batch was written."""


class RecordSink(abc.ABC):
    """Commits a recording run's batches; one per writer thread."""

    @abc.abstractmethod
    def write(self, run_id: str, batch: RecordBatch) -> None:
        """Commit ``batch`` as one transaction, or raise and write none of it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection."""


# Only float, int and str reach ``values``, so SQLite's typeof() names the type; NULL
# there can only be a NaN float (SQLite stores NaN as NULL).
_INSERT_VALUES = (
    "INSERT INTO logs(run_id, ctx_id, name, value, value_type) VALUES ({run}, ?1, ?2, ?3,"
    " CASE typeof(?3) WHEN 'real' THEN 'float' WHEN 'integer' THEN 'int'"
    " WHEN 'text' THEN 'str' ELSE 'float' END)"
)
_INSERT_STARTS = (
    "INSERT OR REPLACE INTO loops(run_id, ctx_id, parent_ctx, name, iteration, value, depth,"
    " t_start) VALUES ({run}, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE_ENDS = "UPDATE loops SET t_end = ? WHERE run_id = {run} AND ctx_id = ?"
_INSERT_ITERATIONS = (
    "INSERT INTO profile(run_id, phase, ctx_id, seconds, block_seconds)"
    " VALUES ({run}, 'iteration', ?, ?, ?)"
)


class SqliteRecordSink(RecordSink):
    """The embedded store: one connection, a ``BEGIN IMMEDIATE`` transaction per batch.

    The hot path's statements carry the run id as a literal, so each row binds only
    its own fields and SQLite, not Python, names each value's type.
    """

    def __init__(self, database: Path) -> None:
        self.database = database
        self._conn = connect(database)
        self._statements: dict[str, tuple[str, str, str, str]] = {}
        self._blocks = BlockTracker("?", ["value"])
        self._last = LastCounted()

    def _for(self, run_id: str) -> tuple[str, str, str, str]:
        found = self._statements.get(run_id)
        if found is None:
            run = "'" + run_id.replace("'", "''") + "'"
            found = (
                _INSERT_STARTS.format(run=run),
                _UPDATE_ENDS.format(run=run),
                _INSERT_ITERATIONS.format(run=run),
                _INSERT_VALUES.format(run=run),
            )
            self._statements[run_id] = found
        return found

    def write(self, run_id: str, batch: RecordBatch) -> None:
        try:
            self._write(run_id, batch)
        except (OverflowError, UnicodeEncodeError) as exc:
            raise SinkUnstorable(str(exc)) from exc
        except sqlite3.OperationalError as exc:
            if disk_full(exc):
                raise SinkFull(str(exc)) from exc
            if "locked" in str(exc) or "busy" in str(exc):
                raise SinkBusy(str(exc)) from exc
            raise

    def _write(self, run_id: str, batch: RecordBatch) -> None:
        insert_starts, update_ends, insert_iterations, insert_values = self._for(run_id)
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            if batch.loop_starts:
                conn.executemany(insert_starts, batch.loop_starts)
            if batch.loop_ends:
                conn.executemany(update_ends, batch.loop_ends)
            if batch.iterations:
                conn.executemany(insert_iterations, batch.iterations)
            if batch.values:
                conn.executemany(insert_values, batch.values)
            if batch.logs:
                conn.executemany(
                    insert_sql("logs", ("ctx_id", "name", "value", "value_type"), "?"),
                    with_run(run_id, batch.logs),
                )
            add_batch(
                conn, run_id, batch.values, batch.logs, mark="?", number=SQLITE_NUMBER,
                last=self._last,
            )  # fmt: skip
            write_run_rows(conn, run_id, batch, "?")
            self._blocks.after_batch(conn, run_id, batch.values, batch.logs, batch.run_updates)
            for digest, blob in batch.module_sets:
                conn.execute(
                    "INSERT OR IGNORE INTO module_sets(digest, names) VALUES (?, ?)", (digest, blob)
                )
                conn.execute("UPDATE runs SET modules = ? WHERE run_id = ?", (digest, run_id))
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
            self._blocks.forget(run_id)
            self._last.forget(run_id)
            raise

    def close(self) -> None:
        self._conn.close()
