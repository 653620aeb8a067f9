"""The background writer: every metadata write of a recording process goes through it.

The training thread appends plain tuples to two deques (append is atomic
under the GIL and costs tens of nanoseconds); this thread drains them every
``interval`` seconds into one transaction, through the store's record sink
(store/records.py, which holds the SQL). A SIGKILL therefore loses at most
the last interval of records, and the training thread never waits on the store.

- ``values``: ``(ctx_id, name, value)`` with value a float, int or str: the
  hot path of ``log()``. The writer hands these lists to the sink as they
  are, and SQLite's sink to ``executemany``, so no Python code runs per
  value on this thread either (it would hold the GIL the training thread
  needs); SQLite derives value_type.
- ``loop_starts``, ``loop_ends``, ``iterations``: one tuple each per loop
  iteration, in the column order of their statements, for the same reason: a
  tight ``loop`` must not make this thread run Python per iteration.
- ``events``: ``(Event.X, ...)`` for everything else, see :class:`Event`.

A value's loop context is always started (its start queued) before the
value is logged, and an iteration's end after its start. The writer counts
``values``, ``loop_ends`` and ``events`` before ``loop_starts``, so every batch
holds the loop rows its values and ends refer to; it inserts the starts first.

A full disk does not stop training. The batch that did not fit goes back to
the front of the deques, one message on stderr says so, and the writer retries
every ``FULL_RETRY`` seconds, holding up to ``HELD_LIMIT`` records of each kind
in memory (newer ones beyond it are dropped, and counted). Once space is
freed everything held is written and a second message says what, if anything,
was dropped. If the disk is still full when the run ends, the writer tries
for ``FULL_CLOSE_WAIT`` seconds and then reports what it could not write;
SQLite rolls a failed transaction back whole, so what was written before
stays intact.
"""

from __future__ import annotations

import collections
import enum
import itertools
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrolog.runtime import modules
from retrolog.runtime.values import DeferredJSON
from retrolog.store.paths import storable_text
from retrolog.store.records import (
    RecordBatch,
    RecordSink,
    SinkBusy,
    SinkFull,
    SinkUnavailable,
    SinkUnstorable,
    SqliteRecordSink,
)

FLUSH_INTERVAL = 0.2  # seconds; the crash-loss window is about this long
_MAX_BATCH = 20_000
_LATEST_SCAN = 256  # values looked at per drain to keep the progress bar's latest values
FULL_RETRY = 1.0  # seconds between attempts while the store's disk is full
FULL_CLOSE_WAIT = 3.0  # seconds the end of a run waits for space before giving up
HELD_LIMIT = 1_000_000  # values (and, apart, other records) held in memory while full


class Event(enum.Enum):
    """Records other than hot-path values that the runtime sends to the writer."""

    LOG = 0  # (ev, ctx_id, name, stored value, value_type): values of other types
    CHECKPOINT = 3  # (ev, CheckpointRecord)
    PROFILE = 4  # (ev, phase, ctx_id, seconds, block_seconds)
    RUN_UPDATE = 5  # (ev, {column: value or zero-argument callable})
    FLUSH = 6  # (ev, threading.Event set once everything queued before it is committed)
    MODULES = 7  # (ev, sys.modules items, project root): the run's installed modules


class Writer:
    """Drains a run's deques into the store from a daemon thread."""

    def __init__(
        self,
        database: Path | str,
        run_id: str,
        interval: float = FLUSH_INTERVAL,
        sink: Callable[[], RecordSink] | None = None,
    ) -> None:
        self.database = database
        self.run_id = run_id
        self.interval = interval
        self.values: collections.deque[tuple[Any, ...]] = collections.deque()
        self.loop_starts: collections.deque[tuple[Any, ...]] = collections.deque()
        self.loop_ends: collections.deque[tuple[Any, ...]] = collections.deque()
        self.iterations: collections.deque[tuple[Any, ...]] = collections.deque()
        self.events: collections.deque[tuple[Any, ...]] = collections.deque()
        self.latest: dict[str, Any] = {}  # last value per name, for the progress bar
        self.failure: BaseException | None = None
        self.lock_retries = 0
        self.full_error: str | None = None  # set while the store's disk is full
        self.dropped = 0  # records dropped while the disk was full (over HELD_LIMIT)
        self.unwritten = (0, 0)  # (values, other records) a full disk kept from being written
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="retrolog-writer", daemon=True)
        self._sink: RecordSink | None = None
        # Made on the writer thread: a connection belongs to the thread that uses it.
        self._make_sink = sink or (lambda: SqliteRecordSink(Path(database)))
        self._unreachable = False  # what is held is held because the store did not answer

    def _queues(self) -> tuple[collections.deque[tuple[Any, ...]], ...]:
        """The deques in the order a batch takes them (loop starts last, see the module)."""
        return (self.values, self.loop_ends, self.iterations, self.events, self.loop_starts)

    def _pending(self) -> bool:
        return any(self._queues())

    def start(self) -> None:
        self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before this call is committed; False on timeout.

        False at once while the store's disk is full: nothing can be committed then, and
        the caller (often the training thread) must not wait for space.
        """
        if not self._thread.is_alive():
            return not self._pending()
        if self.full_error is not None:
            return False
        done = threading.Event()
        self.events.append((Event.FLUSH, done))
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
            self._sink = self._make_sink()
            stop_deadline: float | None = None
            while True:
                if self.full_error is None:
                    self._wake.wait(self.interval)
                else:  # a full disk: retry now and then, whoever asks for a flush
                    time.sleep(FULL_RETRY if stop_deadline is None else 0.2)
                self._wake.clear()
                stopping = self._stop
                flushes = self._drain()
                # A backlog: commit it batch by batch.
                while len(self.values) >= _MAX_BATCH and self.full_error is None:
                    flushes += self._drain()
                if flushes or stopping:
                    # Everything queued before a FLUSH (or close) is ahead of it in the deques;
                    # the thread that asked is waiting, so emptying them terminates.
                    while self._pending() and self.full_error is None:
                        flushes += self._drain()
                for done in flushes:
                    done.set()
                if stopping and self.full_error is not None:
                    stop_deadline = stop_deadline or time.monotonic() + FULL_CLOSE_WAIT
                    if time.monotonic() < stop_deadline:
                        continue
                    self._give_up()
                if stopping:
                    break
        except BaseException as exc:  # reported to the training thread by Run.check_writer
            self.failure = exc
            self._release_waiters()
        finally:
            if self._sink is not None:
                self._sink.close()

    def _drain(self) -> list[threading.Event]:
        # At most _MAX_BATCH values per transaction: when logging outpaces SQLite, the backlog
        # is committed piece by piece (each piece is durable) instead of in one long write.
        # Counted in _queues() order: values, ends and events before the starts they need.
        counts = [min(len(q), _MAX_BATCH) if q is self.values else len(q) for q in self._queues()]
        if not any(counts):
            return []
        # islice over popleft: the batch is taken without running Python code per record.
        batch = _Batch(
            *(
                list(itertools.islice(iter(q.popleft, None), n))
                for q, n in zip(self._queues(), counts, strict=True)
            )
        )
        cleaned = False
        while True:
            try:
                flushes = self._write(batch)
                break
            except SinkUnstorable:
                # An int beyond 64 bits or text UTF-8 cannot hold (a lone surrogate), queued
                # as is by log()'s hot path: store those as text, once per batch.
                if cleaned:
                    raise
                batch = _storable(batch)
                cleaned = True
            except (SinkFull, SinkUnavailable) as exc:
                self._hold(batch, exc)
                return []
            except SinkBusy:
                # Another process holds the write lock past busy_timeout: keep the batch, retry.
                self.lock_retries += 1
                time.sleep(0.05)
        if self.full_error is not None:
            self.full_error = None
            dropped = (
                f"; {self.dropped} record(s) logged while it was full were dropped "
                f"(over the {HELD_LIMIT:,} held in memory)"
                if self.dropped
                else "; nothing was lost"
            )
            run = self.run_id
            if self._unreachable:
                _say(f"the store answers again: run {run}'s records are written{dropped}.")
            else:
                _say(f"the store's disk has space again: run {run}'s records are written{dropped}.")
            self._unreachable = False
        self._note_latest(batch.values)
        return flushes

    def _hold(self, batch: _Batch, exc: BaseException) -> None:
        """Keep a batch that did not fit, ahead of what was queued since, within HELD_LIMIT."""
        for queue, records in zip(self._queues(), batch.lists(), strict=True):
            queue.extendleft(reversed(records))
        for queue in self._queues():
            while len(queue) > HELD_LIMIT:
                record = queue.pop()  # the newest: the held records stay a consistent prefix
                if record and record[0] is Event.FLUSH:
                    record[1].set()
                else:
                    self.dropped += 1
        if self._unreachable and isinstance(exc, SinkUnavailable):
            self.full_error = str(exc)  # the latest reason, which the end of the run reports
        elif self.full_error is None and isinstance(exc, SinkUnavailable):
            self.full_error = str(exc)
            self._unreachable = True
            _say(
                f"cannot reach the store: {exc}. Training goes on: run {self.run_id}'s "
                f"records are held in memory (up to {HELD_LIMIT:,} values) and written as "
                "soon as it answers again, or lost when the script ends before it does."
            )
        elif self.full_error is None:
            self.full_error = str(exc)
            _say(
                f"the disk holding the store {self.database} is full ({exc}). Training goes "
                f"on: run {self.run_id}'s records are held in memory (up to {HELD_LIMIT:,} "
                "values) and written as soon as space is freed. Free space on that disk, or "
                "what is held is lost when the script ends."
            )

    def _give_up(self) -> None:
        """The run ends and the store is still full or unreachable: say what is not written."""
        flushes = [r[1] for r in self.events if r[0] is Event.FLUSH]
        other = sum(len(q) for q in self._queues()) - len(self.values) - len(flushes)
        self.unwritten = (len(self.values), other)
        n_values, n_other = self.unwritten
        if self._unreachable:
            _say(
                f"run {self.run_id} ended with {n_values} value(s) and {n_other} other "
                "record(s) not written"
                + (f", and {self.dropped} more were dropped meanwhile" if self.dropped else "")
                + f": the store could not be reached: {self.full_error}. What was written "
                "before is intact; the run will be listed as crashed, since its end could "
                "not be recorded either."
            )
        else:
            _say(
                f"run {self.run_id} ended with {n_values} value(s) and {n_other} other "
                f"record(s) not written: the disk holding {self.database} is still full "
                f"({self.full_error})"
                + (f", and {self.dropped} more were dropped while it was" if self.dropped else "")
                + ". What was written before it filled is intact; the run will be listed as "
                "crashed, since its end could not be recorded either. Free space on that disk "
                "before the next run."
            )
        for queue in self._queues():
            queue.clear()
        for done in flushes:
            done.set()

    def _write(self, batch: _Batch) -> list[threading.Event]:
        records = RecordBatch(
            loop_starts=batch.starts,
            loop_ends=batch.ends,
            iterations=batch.iterations,
            values=batch.values,
        )
        flushes: list[threading.Event] = []
        for record in batch.events:
            head = record[0]
            if head is Event.LOG:
                if type(record[3]) is DeferredJSON:  # an array copied at log time
                    record = (*record[:3], *record[3].encode(), *record[5:])
                records.logs.append(record[1:])
                self.latest[record[2]] = record[3]
            elif head is Event.CHECKPOINT:
                c = record[1]
                records.checkpoints.append(
                    (
                        c.ctx_id,
                        c.loop_name,
                        c.kind,
                        c.manifest,
                        c.nbytes,
                        c.capture_seconds,
                        c.write_seconds,
                        c.created_at,
                        c.writer_cpu_seconds,
                        c.frame_locals,
                    )
                )
            elif head is Event.PROFILE:
                records.profile.append(record[1:])
            elif head is Event.RUN_UPDATE:
                # A callable value is evaluated here, off the training thread.
                records.run_updates.append(
                    {k: v() if callable(v) else v for k, v in record[1].items()}
                )
            elif head is Event.FLUSH:
                flushes.append(record[1])
            elif head is Event.MODULES:
                # Listed here, off the training thread (runtime/modules.py).
                records.module_sets.append(modules.encode(modules.installed(record[1], record[2])))
        assert self._sink is not None
        self._sink.write(self.run_id, records)
        return flushes

    def _note_latest(self, values: list[tuple[Any, ...]]) -> None:
        # Bounded work per drain: the newest few hundred values name what the bar shows.
        seen: set[str] = set()
        for _, name, value in itertools.islice(reversed(values), _LATEST_SCAN):
            if name not in seen:
                seen.add(name)
                self.latest[name] = value

    def _release_waiters(self) -> None:
        # After a failure nobody will commit what is queued; unblock flush() callers.
        for queue in self._queues():
            if queue is not self.events:
                queue.clear()
        while self.events:
            record = self.events.popleft()
            if record[0] is Event.FLUSH:
                record[1].set()


class _Batch:
    """What one transaction writes, taken from the writer's deques (see ``_queues``)."""

    __slots__ = ("ends", "events", "iterations", "starts", "values")

    def __init__(
        self,
        values: list[tuple[Any, ...]],
        ends: list[tuple[Any, ...]],
        iterations: list[tuple[Any, ...]],
        events: list[tuple[Any, ...]],
        starts: list[tuple[Any, ...]],
    ) -> None:
        self.values = values
        self.ends = ends
        self.iterations = iterations
        self.events = events
        self.starts = starts

    def lists(self) -> tuple[list[tuple[Any, ...]], ...]:
        """In ``Writer._queues`` order."""
        return (self.values, self.ends, self.iterations, self.events, self.starts)


def _storable(batch: _Batch) -> _Batch:
    """The batch with what SQLite refuses made storable (the rest is unchanged).

    A value's int beyond 64 bits becomes its decimal text (value type "text", as
    ``storage_form`` gives it off the hot path), a loop item's too; text that is not
    valid UTF-8 is kept with the offending code points escaped (``\\ud800``), in names
    and values alike.
    """
    kept: list[tuple[Any, ...]] = []
    moved: list[tuple[Any, ...]] = []
    for ctx, name, value in batch.values:
        name = storable_text(name)
        if type(value) is int and not -(2**63) <= value < 2**63:
            moved.append((Event.LOG, ctx, name, str(value), "text"))
        else:
            kept.append((ctx, name, storable_text(value) if type(value) is str else value))
    events = [tuple(_storable_field(field) for field in record) for record in batch.events]
    starts = [tuple(_storable_field(field) for field in record) for record in batch.starts]
    return _Batch(kept, batch.ends, batch.iterations, events + moved, starts)


def _storable_field(field: Any) -> Any:
    if type(field) is str:
        return storable_text(field)
    if type(field) is int and not -(2**63) <= field < 2**63:
        return str(field)
    if type(field) is dict:
        return {k: storable_text(v) if type(v) is str else v for k, v in field.items()}
    return field


def _say(message: str) -> None:
    # From the writer thread, straight to stderr: a warning raised here would reach no one.
    print(f"retrolog: {message}", file=sys.stderr, flush=True)
