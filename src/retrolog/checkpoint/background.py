"""Checkpoints whose encoding and writing happen off the training thread.

DESIGN.md, "Background materialization": the training thread only takes a
snapshot; hashing, compression and I/O happen elsewhere. The choice of a
thread over a forked child or a worker process was made from measurements
(docs/materialization.md, bench/bench_materialize.py)::

    training thread                   retrolog-checkpoint-writer thread
    ---------------                   ---------------------------------
    capture()
      snapshot(objects)  ──> pending ──> encode(snap, store): blobs first, manifest last
      (a deep copy: the    (at most      ──> sink(record), in capture order
       only work here)     max_in_flight)

The thread works because what it spends its time on releases the GIL:
hashing (xxhash), compressing (c-blosc2) and the file writes in
:class:`~retrolog.store.objects.LocalObjectStore`; and it runs at the lowest
CPU priority, so it takes only the cycles training leaves idle. Memory is
bounded: at most ``max_in_flight`` snapshots are held (queued or being
written); when a block ends while all are taken, ``when_full`` decides
whether the training thread waits (a warning, the first time) or the
checkpoint is skipped (logged, counted, and listed in
:attr:`BackgroundCheckpointer.skips` so the adaptive rule can account for it).

Visibility: the sink is called only after :func:`~retrolog.checkpoint.codec.encode`
returned, and encode puts the manifest after every blob it references, each
object being written to a temp file and renamed into place under its key.
So a checkpoint row never points at a missing or partial object, and a crash
mid-write leaves at most unreferenced objects for garbage collection, never a
checkpoint replay could pick.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from retrolog.checkpoint._arrays import _codec, all_cores, preload_codec
from retrolog.checkpoint.capture import KINDS, Checkpointer, CheckpointRecord
from retrolog.checkpoint.codec import DeltaHistory, Interrupted, encode
from retrolog.checkpoint.state import Snapshot, SnapshotBuffers, TensorMemo, snapshot
from retrolog.errors import CheckpointTargetError, RetrologWarning, StoreError
from retrolog.store.objects import ObjectStore

_log = logging.getLogger("retrolog.checkpoint")

WhenFull = Literal["wait", "skip"]
WHEN_FULL: tuple[WhenFull, ...] = ("wait", "skip")


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint that was not taken because the writer was behind (``when_full="skip"``)."""

    ctx_id: int | None
    loop_name: str
    kind: str
    at: float  # time.time() of the capture() call
    in_flight: int  # snapshots held by the writer at that moment
    dropped: bool = False  # taken, then dropped unwritten to make room for the end or at close


@dataclass
class _Job:
    """One snapshot waiting for (or going through) the writer."""

    ctx_id: int | None
    loop_name: str
    kind: str
    snap: Snapshot | None  # dropped as soon as it is encoded, to free its memory early
    created_at: float
    capture_seconds: float
    buffers: SnapshotBuffers  # the memory the snapshot's large tensors live in
    frame_locals: bytes | None = None  # stored with the checkpoint as they are
    # Writing may take two attempts (close() takes over an interrupted one):
    # when the first began, and the CPU time of all of them.
    write_started: float | None = None
    writer_cpu_seconds: float = 0.0


class BackgroundCheckpointer(Checkpointer):
    """Snapshots on the calling thread; encodes, writes and reports on a writer thread.

    ``store`` and ``sink`` are as for
    :class:`~retrolog.checkpoint.capture.SynchronousCheckpointer`; ``sink`` is
    called on the writer thread, once per written checkpoint, in capture order.
    ``max_in_flight`` bounds the snapshots held at once (each is a full copy of
    the state). ``when_full`` is what a capture does when that bound is reached:
    ``"wait"`` blocks until the oldest is written (counted in
    :attr:`waited_seconds`), ``"skip"`` takes no checkpoint (counted in
    :attr:`skipped`). The ``end`` checkpoint is never skipped: it is the only
    one replay always needs, so it waits.

    ``low_priority`` (the default) runs the writer at the lowest CPU priority
    (SCHED_IDLE, else nice 19, for its thread only; Linux), so it takes only
    cycles training leaves idle: on a CPU-bound machine a writer at training's
    priority slows training several times its own CPU time
    (docs/materialization.md). What is left to write at :meth:`close` is
    written by the closing thread, at its priority and with every core, since
    training is over by then and a busy machine could starve an idle-priority
    writer.

    A failure on the writer thread is raised in the training thread, as
    StoreError (or CheckpointTargetError for a value that cannot be encoded),
    at the next :meth:`capture` or at :meth:`close`; the checkpoints still
    queued behind it are not written and the message says how many.
    """

    def __init__(
        self,
        store: ObjectStore,
        sink: Callable[[CheckpointRecord], None],
        *,
        max_in_flight: int = 2,
        when_full: WhenFull = "wait",
        low_priority: bool = True,
    ) -> None:
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int of at least 1, not {max_in_flight!r}")
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, not {when_full!r}")
        self.store = store
        self.sink = sink
        self.history = DeltaHistory()  # used by the writer thread only
        self.max_in_flight = max_in_flight
        self.when_full: WhenFull = when_full
        # Whether the writer runs below training's priority: requested, and possible
        # here (per-thread priorities are a Linux feature).
        self.low_priority = low_priority and sys.platform.startswith("linux")
        # Here, on the training thread (~10 ms): a low-priority writer importing it would
        # hold the GIL while the scheduler starves it, and training would wait for the GIL.
        preload_codec()
        self._cond = threading.Condition()
        # Queued jobs and, at the head, the one being written: len() is the
        # number of snapshots held, which is what max_in_flight bounds.
        self._pending: deque[_Job] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._closed = False
        self._error: BaseException | None = None  # the writer's failure, converted
        self._error_reported = False
        self._warned = False
        self._captured = 0
        self._written = 0
        self._waited_seconds = 0.0
        self._busy_total = 0.0  # wall seconds spent in finished writes (attempts)
        self._busy_since: float | None = None  # start of the write going on, if any
        self._busy_lock = threading.Lock()
        self._skips: list[SkippedCheckpoint] = []
        # One set of reusable buffers per snapshot that may be held at once; a job
        # takes one when it is captured and gives it back once it is written.
        # They share one memo of which tensors did not change, which are then not copied.
        memo = TensorMemo()
        self._free_buffers: list[SnapshotBuffers] = [
            SnapshotBuffers(memo) for _ in range(max_in_flight)
        ]

    def __repr__(self) -> str:
        return (
            f"BackgroundCheckpointer({self.store!r}, max_in_flight={self.max_in_flight}, "
            f"when_full={self.when_full!r})"
        )

    def __enter__(self) -> BackgroundCheckpointer:
        return self

    # -- counters ------------------------------------------------------------------------

    @property
    def captured(self) -> int:
        """Snapshots taken and handed to the writer."""
        return self._captured

    @property
    def written(self) -> int:
        """Checkpoints completely written and reported to the sink."""
        return self._written

    @property
    def skipped(self) -> int:
        """Checkpoints not taken, or not written, because the writer was behind (``"skip"``)."""
        return len(self._skips)

    @property
    def dropped(self) -> int:
        """Of :attr:`skipped`, the snapshots taken and then dropped unwritten."""
        return sum(s.dropped for s in self._skips)

    @property
    def skips(self) -> tuple[SkippedCheckpoint, ...]:
        """The skipped checkpoints, oldest first."""
        return tuple(self._skips)

    @property
    def waited_seconds(self) -> float:
        """Training-thread time spent waiting for the writer (``when_full="wait"``)."""
        return self._waited_seconds

    def busy_seconds(self) -> float:
        """Wall seconds spent writing so far, the write going on included."""
        with self._busy_lock:
            since, total = self._busy_since, self._busy_total
        return total + (time.perf_counter() - since if since is not None else 0.0)

    @property
    def in_flight(self) -> int:
        """Snapshots held right now: queued or being written."""
        with self._cond:
            return len(self._pending)

    # -- training thread -----------------------------------------------------------------

    def capture(
        self,
        *,
        ctx_id: int | None,
        loop_name: str,
        kind: str,
        objects: Mapping[str, object],
        frame_locals: bytes | None = None,
    ) -> float | None:
        """Snapshot ``objects`` and the RNGs now; they are written in the background.

        Returns the training-thread seconds this took (waiting for a slot
        included), or None when the checkpoint was skipped.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        created_at = time.time()
        start = time.perf_counter()
        with self._cond:
            self._raise_if_failed()
            if self._closing:
                raise StoreError(
                    "This checkpointer is closed; create a new one to checkpoint again."
                )
            if len(self._pending) >= self.max_in_flight:
                if self.when_full == "skip" and kind != "end":
                    self._skip(ctx_id, loop_name, kind, created_at)
                    return None
                # The end state is never skipped; under "skip" a queued block
                # checkpoint makes room for it rather than training waiting.
                if not (self.when_full == "skip" and self._drop_queued_blocks(newest_only=True)):
                    self._wait_for_slot(ctx_id, kind)
            buffers = self._free_buffers.pop()
        # The snapshot is taken outside the lock so the writer can report the
        # previous checkpoint meanwhile; only this thread adds jobs, so the
        # slot found above is still free.
        try:
            snap = snapshot(objects, buffers)
        except BaseException:
            with self._cond:
                self._free_buffers.append(buffers)
            raise
        job = _Job(
            ctx_id=ctx_id,
            loop_name=loop_name,
            kind=kind,
            snap=snap,
            created_at=created_at,
            # Waiting for a slot is main-thread time this checkpoint cost, so it
            # is part of what the adaptive rule sees as M.
            capture_seconds=time.perf_counter() - start,
            buffers=buffers,
            frame_locals=frame_locals,
        )
        with self._cond:
            self._raise_if_failed()
            self._pending.append(job)
            self._captured += 1
            self._ensure_writer()
            self._cond.notify_all()
        return job.capture_seconds

    def _drop_queued_blocks(self, *, newest_only: bool) -> bool:
        """Drop unwritten block checkpoints (the newest queued one, or all); whether any was.

        Called holding the lock. The one being written is left to the writer
        unless it has stopped (``close``). A dropped checkpoint counts as
        skipped: it is listed in :attr:`skips` and replay executes its block.
        """
        writing = 1 if self._thread is not None and self._thread.is_alive() else 0
        dropped = False
        for job in reversed(list(self._pending)[writing:]):
            if job.kind != "block":
                continue
            self._pending.remove(job)
            self._free_buffers.append(job.buffers)
            self._skips.append(
                SkippedCheckpoint(
                    job.ctx_id,
                    job.loop_name,
                    job.kind,
                    job.created_at,
                    len(self._pending),
                    dropped=True,
                )
            )
            dropped = True
            if newest_only:
                break
        return dropped

    def _skip(self, ctx_id: int | None, loop_name: str, kind: str, at: float) -> None:
        self._skips.append(SkippedCheckpoint(ctx_id, loop_name, kind, at, len(self._pending)))
        if len(self._skips) == 1:
            # Skipping is the adaptive default's way of never making training wait for
            # a writer that takes only idle cycles: logged, counted, not warned about.
            _log.info(
                "the checkpoint writer was behind at ctx %s of loop %r (%d checkpoint(s) "
                "in flight), so that checkpoint was not taken; skips are counted in "
                "runs.checkpointing and the adaptive rule sees them as not taken, so replay "
                "executes those blocks",
                ctx_id,
                loop_name,
                len(self._pending),
            )

    def _wait_for_slot(self, ctx_id: int | None, kind: str) -> None:
        """Block (holding nothing but the condition) until the writer frees a slot.

        A block's wait is warned about once per run (training waited on the
        writer); the end checkpoint, which always waits, is only counted.
        """
        began = time.perf_counter()
        while len(self._pending) >= self.max_in_flight and self._error is None:
            self._cond.wait()
        waited = time.perf_counter() - began
        self._waited_seconds += waited
        self._raise_if_failed()
        if kind == "end":
            return
        self._warn_once(
            f"made training wait {waited:.3f} s for a free slot (ctx {ctx_id}); waits are "
            "counted in waited_seconds and in each checkpoint's capture time"
        )

    def _warn_once(self, what: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"retrolog's checkpoint writer fell behind: {self.max_in_flight} checkpoint(s) to "
            f"{self.store!r} were still being written when the next one was due, so it "
            f"{what}. This is reported once per run. If it keeps happening, checkpoints are "
            "produced faster than the store takes them: raise max_in_flight (memory: one copy "
            "of the state each) or use a faster store.",
            RetrologWarning,
            stacklevel=4,
        )

    def close(self) -> None:
        """Write and report the checkpoints in flight, stop the writer, raise its failure.

        The writer stops at the next array it would encode, and this thread
        writes the rest, with every core, lz4 and no deltas (an interrupted
        checkpoint is started again; what it wrote is found stored). Under
        ``when_full="skip"`` only end states are written: block checkpoints
        still unwritten are dropped (see :attr:`dropped`).
        """
        with self._cond:
            self._closing = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            if self.when_full == "skip":
                # Block checkpoints are optional, and training is over: the user
                # would wait for them. Only end states are written now.
                with self._cond:
                    self._drop_queued_blocks(newest_only=False)
            while True:
                with self._cond:
                    if not self._pending or self._error is not None:
                        break
                    job = self._pending[0]
                if not self._write_one(job, threads=all_cores(), fast=True):
                    break
        with self._cond:
            if not self._closed:
                self._closed = True
                atexit.unregister(self._close_at_exit)
            self._raise_if_failed()

    def _close_at_exit(self) -> None:
        # A run's commit() closes its checkpointer; this catches a checkpointer
        # used on its own and never closed, so interpreter exit still flushes
        # (atexit runs before daemon threads are stopped).
        try:
            self.close()
        except StoreError as exc:
            # Nobody is left to raise to at exit; stderr is the last place to say it.
            warnings.warn(str(exc), RetrologWarning, stacklevel=1)

    def _raise_if_failed(self) -> None:
        """Raise the writer's failure here; close() raises it only if no capture did already."""
        error = self._error
        if error is None:
            return
        if self._error_reported and self._closing:
            return  # close() after the failure was already raised at a capture
        self._error_reported = True
        raise error

    def _ensure_writer(self) -> None:
        if self._thread is None:
            # Started on the first capture, not at construction: importing or
            # configuring retrolog must not start threads.
            self._thread = threading.Thread(
                target=self._run, name="retrolog-checkpoint-writer", daemon=True
            )
            self._thread.start()
            atexit.register(self._close_at_exit)

    # -- writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        if self.low_priority:
            _lower_priority()
        # Loaded by preload_codec() already, unless that failed: then say so here.
        try:
            _codec()
        except BaseException as exc:  # the training thread must hear of it, not hang
            with self._cond:
                self._error = StoreError(
                    f"retrolog's checkpoint writer cannot load its compression library "
                    f"(c-blosc2, from imagecodecs): {type(exc).__name__}: {exc}. No checkpoint "
                    "is written; reinstall retrolog's dependencies "
                    "(pip install --force-reinstall imagecodecs)."
                )
                self._error.__cause__ = exc
                self._pending.clear()
                self._cond.notify_all()
            return
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return  # close() writes what is left
                job = self._pending[0]
            if not self._write_one(job, threads=1, interrupt=self._is_closing):
                return

    def _is_closing(self) -> bool:
        return self._closing

    def _write_one(
        self,
        job: _Job,
        *,
        threads: int,
        interrupt: Callable[[], bool] | None = None,
        fast: bool = False,
    ) -> bool:
        """Write ``job``, the head of the queue; False if that ended the writing."""
        try:
            self._write(job, threads=threads, interrupt=interrupt, fast=fast)
        except Interrupted:
            return False  # still queued: close() writes it
        except BaseException as exc:  # all of it goes to the training thread, none is lost
            with self._cond:
                dropped = len(self._pending) - 1
                self._pending.clear()
                self._error = _converted(exc, job, dropped)
                self._cond.notify_all()
            return False
        with self._cond:
            self._pending.popleft()
            self._free_buffers.append(job.buffers)
            self._written += 1
            self._cond.notify_all()
        return True

    def _write(
        self, job: _Job, *, threads: int, interrupt: Callable[[], bool] | None, fast: bool
    ) -> None:
        snap = job.snap
        assert snap is not None
        began = time.perf_counter()
        if job.write_started is None:
            job.write_started = began
        cpu_started = time.thread_time()
        with self._busy_lock:
            self._busy_since = began
        try:
            manifest, nbytes = encode(
                snap,
                self.store,
                history=self.history,
                threads=threads,
                interrupt=interrupt,
                fast=fast,
            )
        finally:
            job.writer_cpu_seconds += time.thread_time() - cpu_started
            with self._busy_lock:
                self._busy_total += time.perf_counter() - began
                self._busy_since = None
        written = time.perf_counter()
        job.snap = None
        # Only now, with the manifest (written last by encode) in place, may the
        # checkpoint become visible.
        self.sink(
            CheckpointRecord(
                ctx_id=job.ctx_id,
                loop_name=job.loop_name,
                kind=job.kind,
                manifest=manifest,
                nbytes=nbytes,
                capture_seconds=job.capture_seconds,
                write_seconds=written - job.write_started,
                created_at=job.created_at,
                writer_cpu_seconds=job.writer_cpu_seconds,
                frame_locals=job.frame_locals,
            )
        )


def _lower_priority() -> bool:
    """Give the calling thread, and it alone, the lowest CPU priority; whether that worked.

    SCHED_IDLE where Linux allows it: the scheduler runs such a thread only on
    a core no other thread wants and takes the core back the moment training
    wakes up, where a thread at nice 19 still gets a small share and is
    preempted less promptly. Beside a CPU-bound torch training a busy writer
    cost training 0.26 s per second of its CPU time at nice 19 and none
    measurable under SCHED_IDLE (bench/bench_writer_priority.py). Nice 19 is
    set as well, for where SCHED_IDLE is refused. Both are per thread on Linux
    and need no privilege to take; the thread cannot give them back, which is
    why close() writes the rest elsewhere.
    """
    tid = threading.get_native_id()
    lowered = False
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        lowered = True
    except (AttributeError, OSError):
        pass
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        lowered = True
    except (AttributeError, OSError):
        pass
    return lowered


def _converted(exc: BaseException, job: _Job, dropped: int) -> BaseException:
    """``exc`` from the writer thread as the error the training thread should see."""
    where = (
        f"the end checkpoint of loop {job.loop_name!r}"
        if job.kind == "end"
        else f"the checkpoint of loop {job.loop_name!r} at context {job.ctx_id}"
    )
    lost = (
        f" The {dropped} checkpoint(s) queued after it were not written either." if dropped else ""
    )
    if isinstance(exc, CheckpointTargetError):
        # The user's fix is in the original message (a value that cannot be
        # encoded); keep its type so callers and the CLI treat it as a usage error.
        converted: BaseException = CheckpointTargetError(
            f"Writing {where} failed in the background: {exc}{lost}", name=exc.name
        )
    else:
        converted = StoreError(
            f"Writing {where} failed in the background checkpoint writer: "
            f"{type(exc).__name__}: {exc}.{lost} No later checkpoint is taken; fix the cause "
            "(disk full? permissions?) and run again.",
            path=getattr(exc, "path", None),
        )
    converted.__cause__ = exc
    return converted
