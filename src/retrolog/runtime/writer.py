"""The background writer: every SQLite write of a recording process goes through it.

The training thread appends plain tuples to a deque (append is atomic under the
GIL and costs tens of nanoseconds); this thread drains the deque every
``interval`` seconds into one transaction. A SIGKILL therefore loses at most
the last interval of records, and the training thread never waits on SQLite.

Record shapes, in append order:

- a log value: ``(ctx_id, name, value)``, where value passed through log()
- an event: ``(Event.X, ...)``, see :class:`Event`
"""

from __future__ import annotations

import collections
import enum
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from retrolog.runtime.values import Typed, storage_form
from retrolog.store.metadata import connect

FLUSH_INTERVAL = 0.2  # seconds; the crash-loss window is about this long


class Event(enum.Enum):
    """Non-log records the runtime sends to the writer."""

    LOOP_START = 1  # (ev, ctx_id, parent_ctx, name, iteration, value, depth, t_start)
    LOOP_END = 2  # (ev, ctx_id, t_end)
    CHECKPOINT = 3  # (ev, CheckpointRecord)
    PROFILE = 4  # (ev, phase, ctx_id, seconds, block_seconds)
    RUN_UPDATE = 5  # (ev, {column: value})
    FLUSH = 6  # (ev, threading.Event set once everything before it is committed)


class Writer:
    """Drains a run's record deque into the store from a daemon thread."""

    def __init__(self, database: Path, run_id: str, interval: float = FLUSH_INTERVAL) -> None:
        self.database = database
        self.run_id = run_id
        self.interval = interval
        self.records: collections.deque[tuple[Any, ...]] = collections.deque()
        self.latest: dict[str, Any] = {}  # last value per name, for the progress bar
        self.failure: BaseException | None = None
        self.lock_retries = 0
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="retrolog-writer", daemon=True)
        self._conn: sqlite3.Connection | None = None

    def start(self) -> None:
        self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record appended before this call is committed; False on timeout."""
        if not self._thread.is_alive():
            return not self.records
        done = threading.Event()
        self.records.append((Event.FLUSH, done))
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Commit everything and stop the thread."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- writer thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._conn = connect(self.database)
            while True:
                self._wake.wait(self.interval)
                self._wake.clear()
                stopping = self._stop
                self._drain()
                if stopping:
                    break
        except BaseException as exc:  # reported to the training thread by Run.check_writer
            self.failure = exc
            self._release_waiters()
        finally:
            if self._conn is not None:
                self._conn.close()

    def _drain(self) -> None:
        records = self.records
        n = len(records)
        if n == 0:
            return
        batch = [records.popleft() for _ in range(n)]
        while True:
            try:
                self._write(batch)
                break
            except sqlite3.OperationalError as exc:
                # Another process holds the write lock past busy_timeout: keep the batch, retry.
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                self.lock_retries += 1
                time.sleep(0.05)
        for record in batch:
            if record[0] is Event.FLUSH:
                record[1].set()

    def _write(self, batch: list[tuple[Any, ...]]) -> None:
        run_id = self.run_id
        logs: list[tuple[Any, ...]] = []
        starts: list[tuple[Any, ...]] = []
        ends: list[tuple[Any, ...]] = []
        checkpoints: list[tuple[Any, ...]] = []
        profile: list[tuple[Any, ...]] = []
        updates: list[dict[str, Any]] = []
        latest = self.latest
        for record in batch:
            head = record[0]
            if type(head) is not Event:
                ctx, name, value = record
                stored, kind = storage_form(value)
                logs.append((run_id, ctx, name, stored, kind))
                latest[name] = value.value if type(value) is Typed else value
                continue
            if head is Event.LOOP_START:
                starts.append((run_id, *record[1:]))
            elif head is Event.LOOP_END:
                ends.append((record[2], run_id, record[1]))
            elif head is Event.CHECKPOINT:
                c = record[1]
                checkpoints.append(
                    (
                        run_id,
                        c.ctx_id,
                        c.loop_name,
                        c.kind,
                        c.manifest,
                        c.nbytes,
                        c.capture_seconds,
                        c.write_seconds,
                        c.created_at,
                    )
                )
            elif head is Event.PROFILE:
                profile.append((run_id, *record[1:]))
            elif head is Event.RUN_UPDATE:
                updates.append(record[1])
        conn = self._conn
        assert conn is not None
        conn.execute("BEGIN IMMEDIATE")
        try:
            if starts:
                conn.executemany(
                    "INSERT OR REPLACE INTO loops(run_id, ctx_id, parent_ctx, name, iteration,"
                    " value, depth, t_start) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    starts,
                )
            if ends:
                conn.executemany("UPDATE loops SET t_end = ? WHERE run_id = ? AND ctx_id = ?", ends)
            if logs:
                conn.executemany(
                    "INSERT INTO logs(run_id, ctx_id, name, value, value_type)"
                    " VALUES (?, ?, ?, ?, ?)",
                    logs,
                )
            if checkpoints:
                conn.executemany(
                    "INSERT INTO checkpoints(run_id, ctx_id, loop_name, kind, manifest, nbytes,"
                    " capture_seconds, write_seconds, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    checkpoints,
                )
            if profile:
                conn.executemany(
                    "INSERT INTO profile(run_id, phase, ctx_id, seconds, block_seconds)"
                    " VALUES (?, ?, ?, ?, ?)",
                    profile,
                )
            for columns in updates:
                assignments = ", ".join(f"{column} = ?" for column in columns)
                # A callable value is evaluated here, off the training thread.
                values = [v() if callable(v) else v for v in columns.values()]
                conn.execute(f"UPDATE runs SET {assignments} WHERE run_id = ?", (*values, run_id))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _release_waiters(self) -> None:
        # After a failure nobody will commit the pending records; unblock flush() callers.
        while self.records:
            record = self.records.popleft()
            if record[0] is Event.FLUSH:
                record[1].set()
