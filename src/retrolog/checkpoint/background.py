"""Checkpoints whose encoding and writing happen off the training thread, never lost.

The training thread only takes a snapshot; hashing, compression and I/O happen
elsewhere. The choice of a thread over a forked child or a worker process was
made from measurements (docs/materialization.md, bench/bench_materialize.py)::

    training thread                   writer lanes (threads)
    ---------------                   ----------------------
    capture(due_in=...)
      snapshot(objects)  ──> pending ──> idle lane (SCHED_IDLE): writes the oldest
      (a deep copy: the    (at most          on cycles training leaves idle (zstd, deltas)
       only work here)     max_in_flight) ─> urgent lane (training's priority): writes
                                             the oldest once it is due (lz4, the least
                                             CPU), and at close whatever is left
                                          ──> sink(record), in capture order

Two lanes because a thread cannot raise its own priority again without
privilege (leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that
distributions set to 0): the idle lane alone gets no CPU while training keeps
every core busy, and a checkpoint chosen by the adaptive rule would wait
until the process exits. So a checkpoint is *due* ``due_in`` seconds after its
capture (the run passes a block less than the time until its slot may be
needed again), or at once when training would otherwise have to wait or refuse
(:meth:`BackgroundCheckpointer.escalate`); the urgent lane, which sleeps
until then, writes it at training's priority. Both lanes only ever write the
oldest checkpoint not yet written, so checkpoints are reported in capture
order and a tensor referenced as unchanged (``StoredTensor``) was always
stored by an earlier checkpoint first.

Memory is bounded: at most ``max_in_flight`` snapshots are held, and a
capture that finds them all held waits (the run asks :meth:`has_room` first
and, under the adaptive rule, does not choose that block end instead). A
snapshot's memory goes back to the pool only when no lane is reading it any
more: the idle lane may be stalled in the middle of an array when the urgent
lane takes its checkpoint over, and reusing that memory then would let it
store one state's bytes under another's key.

Nothing chosen is dropped: :meth:`close` writes everything in flight, with
progress on stderr when that takes over a second, and abandons checkpoints
only on a second Ctrl-C, listing them in :attr:`abandoned`. Two failures of the
store do not stop training either: a full disk, and a remote object store that
did not answer within its timeout (``RETROLOG_OBJECTS_TIMEOUT``; the request is
retried meanwhile, its snapshot held in its slot). Such a checkpoint alone is
not stored, listed in :attr:`lost` with why, and each later one is tried as usual;
replay executes the blocks that have no checkpoint.

Visibility: the sink is called only after :func:`~retrolog.checkpoint.codec.encode`
returned, and encode puts the manifest after every blob it references, each
object being written to a temp file and renamed into place under its key.
So a checkpoint row never points at a missing or partial object, and a crash
mid-write leaves at most unreferenced objects for garbage collection, never a
checkpoint replay could pick.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import os
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from retrolog.checkpoint._arrays import _codec, preload_codec
from retrolog.checkpoint._exitgate import ExitGate
from retrolog.checkpoint._finish import AbandonedCheckpoint, Finishing, snapshot_nbytes
from retrolog.checkpoint.capture import KINDS, Checkpointer, CheckpointRecord
from retrolog.checkpoint.codec import DeltaHistory, Interrupted, encode
from retrolog.checkpoint.state import Snapshot, SnapshotBuffers, TensorMemo, snapshot
from retrolog.errors import (
    CheckpointTargetError,
    RetrologWarning,
    StoreError,
    disk_full,
    store_unreachable,
)
from retrolog.store.objects import ObjectStore

# How long close() waits for the idle lane to end once everything is written. It stops
# at its next array; training is over, so it has the CPU, unless something else keeps
# every core busy or its store hangs, and then the exit does not wait for it longer.
IDLE_JOIN_SECONDS = 2.0


class _Lane(enum.Enum):
    """Which writer thread does a write."""

    IDLE = "idle"  # under SCHED_IDLE: only cycles training leaves idle; zstd with deltas
    URGENT = "urgent"  # at training's priority: what is due, and at close what is left


class _State(enum.Enum):
    """Where a captured checkpoint is."""

    PENDING = "pending"  # queued or being written
    WRITTEN = "written"  # stored and reported to the sink
    ABANDONED = "abandoned"  # in flight at exit; the user pressed Ctrl-C twice
    LOST = "lost"  # a write failed, this one's or an earlier one's (raised to training)


@dataclass(frozen=True)
class LostCheckpoint:
    """A checkpoint the store could not take (a full disk, an object store not answering)."""

    ctx_id: int | None
    loop_name: str
    kind: str
    reason: str  # LOST_DISK_FULL or LOST_UNREACHABLE


LOST_DISK_FULL = "disk full"
LOST_UNREACHABLE = "object store not answering"


@dataclass(eq=False)
class _Job:
    """One snapshot waiting for (or going through) the writer lanes."""

    ctx_id: int | None
    loop_name: str
    kind: str
    snap: Snapshot | None  # dropped once no lane reads it, to free its memory early
    created_at: float
    capture_seconds: float
    buffers: SnapshotBuffers | None  # the memory the snapshot's large tensors live in
    frame_locals: bytes | None  # stored with the checkpoint as they are
    due_at: float | None  # time.monotonic() after which the urgent lane writes it
    state: _State = _State.PENDING
    encoders: int = 0  # lanes encoding it now: its memory is reused only at 0
    idle_writing: bool = False
    urgent: bool = False  # the urgent lane has it: the idle lane stops at its next array
    # Writing may take several attempts (a lane interrupted, the other taking over):
    # when the first began, the CPU time of all of them, and of that the urgent lane's.
    write_started: float | None = None
    writer_cpu_seconds: float = 0.0
    urgent_cpu_seconds: float = 0.0
    urgent_seconds: float = 0.0  # wall seconds the urgent lane spent on it
    idle_seconds: float = 0.0  # wall seconds the idle lane spent on it
    idle_since: float | None = None  # start of the idle lane's attempt going on
    urgent_since: float | None = None  # start of the urgent lane's attempt


class BackgroundCheckpointer(Checkpointer):
    """Snapshots on the calling thread; encodes, writes and reports on two writer lanes.

    ``store`` and ``sink`` are as for
    :class:`~retrolog.checkpoint.capture.SynchronousCheckpointer`; ``sink`` is
    called on a writer thread, once per written checkpoint, in capture order.
    ``max_in_flight`` bounds the snapshots held at once (each is a full copy of
    the state); a capture that finds them all held waits for one (counted in
    :attr:`waited_seconds`), after making the oldest due. ``label`` names what
    the checkpoints belong to in messages (e.g. ``"run 20261123-..."``).

    ``low_priority`` (the default) runs the idle lane at the lowest CPU
    priority (SCHED_IDLE, else nice 19, for its thread only; Linux), so it
    takes only cycles training leaves idle: on a CPU-bound machine a writer at
    training's priority slows training about as much as its own CPU time
    (docs/materialization.md). The urgent lane runs at the priority of the
    thread that made the first capture, and writes only what is due
    (``capture(due_in=...)``, :meth:`escalate`) and, at :meth:`close`, the rest.

    A failure on a writer thread is raised in the training thread, as
    StoreError (or CheckpointTargetError for a value that cannot be encoded),
    at the next :meth:`capture` or :meth:`has_room` or at :meth:`close`; the
    checkpoints still queued behind it are not written and the message says
    how many. Two failures are not raised: a full disk and an object store that did
    not answer in time lose that checkpoint alone (:attr:`lost`; ``on_lost`` is
    called with each, on a writer thread).
    """

    def __init__(
        self,
        store: ObjectStore,
        sink: Callable[[CheckpointRecord], None],
        *,
        max_in_flight: int = 2,
        low_priority: bool = True,
        label: str = "this run",
        on_lost: Callable[[LostCheckpoint], None] | None = None,
    ) -> None:
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int of at least 1, not {max_in_flight!r}")
        self.store = store
        self.sink = sink
        self.label = label
        self.on_lost = on_lost
        # Used by the idle lane only: the urgent lane writes without deltas (see _write).
        self.history = DeltaHistory()
        self.max_in_flight = max_in_flight
        # Whether the idle lane runs below training's priority: requested, and possible
        # here (per-thread priorities are a Linux feature).
        self.low_priority = low_priority and sys.platform.startswith("linux")
        # Here, on the training thread (~10 ms): a low-priority writer importing it would
        # hold the GIL while the scheduler starves it, and training would wait for the GIL.
        preload_codec()
        self._cond = threading.Condition()
        # The lanes' torch calls; closed by close(), so that the interpreter never
        # finalizes with a lane inside torch (checkpoint/_exitgate.py).
        self._gate = ExitGate()
        # Checkpoints not yet written, oldest first; both lanes write only the head.
        self._pending: deque[_Job] = deque()
        self._idle: threading.Thread | None = None
        self._urgent: threading.Thread | None = None
        self._closing = False
        self._closed = False
        self._pid = os.getpid()  # the process whose exit closes this checkpointer
        self._abandoning = False
        self._error: BaseException | None = None  # a writer's failure, converted
        self._error_reported = False
        self._warned = False
        self.lost_to_full_disk = 0  # checkpoints a full disk kept from being written
        self._lost: list[LostCheckpoint] = []  # every checkpoint the store could not take
        self._captured = 0
        self._written: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._urgent_writes = 0
        self._finished_at_close = 0
        self._waited_seconds = 0.0
        self._finish_seconds = 0.0
        # Bytes of state the urgent lane wrote, and its wall seconds doing it: how fast
        # the rest goes at close, until something is finished there.
        self._urgent_bytes = 0
        self._urgent_wall = 0.0
        self._abandoned: list[AbandonedCheckpoint] = []
        # Wall seconds each lane spent in writes: finished attempts, and the start of
        # the one going on.
        self._busy_lock = threading.Lock()
        self._busy_total = dict.fromkeys(_Lane, 0.0)
        self._busy_since: dict[_Lane, float | None] = dict.fromkeys(_Lane, None)
        # One set of reusable buffers per snapshot that may be held at once; a job
        # takes one when it is captured and gives it back once no lane reads it.
        # They share one memo of which tensors did not change, which are then not copied.
        memo = TensorMemo()
        self._free_buffers: list[SnapshotBuffers] = [
            SnapshotBuffers(memo) for _ in range(max_in_flight)
        ]

    def __repr__(self) -> str:
        return f"BackgroundCheckpointer({self.store!r}, max_in_flight={self.max_in_flight})"

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
        return sum(self._written.values())

    def written_of(self, kind: str) -> int:
        """Checkpoints of ``kind`` ("block" or "end") written and reported."""
        return self._written[kind]

    @property
    def urgent_writes(self) -> int:
        """Checkpoints the urgent lane wrote while training ran (due, or escalated)."""
        return self._urgent_writes

    @property
    def finished_at_close(self) -> int:
        """Checkpoints written by :meth:`close`, after training ended."""
        return self._finished_at_close

    @property
    def finish_seconds(self) -> float:
        """Seconds :meth:`close` spent finishing the checkpoints in flight."""
        return self._finish_seconds

    @property
    def abandoned(self) -> tuple[AbandonedCheckpoint, ...]:
        """Checkpoints in flight at close that a second Ctrl-C abandoned, oldest first."""
        return tuple(self._abandoned)

    @property
    def lost(self) -> tuple[LostCheckpoint, ...]:
        """Checkpoints the store could not take while training went on, oldest first."""
        return tuple(self._lost)

    @property
    def waited_seconds(self) -> float:
        """Training-thread time spent waiting for a free slot."""
        return self._waited_seconds

    def busy_seconds(self) -> float:
        """Wall seconds the idle lane spent writing so far, the write going on included."""
        return self._busy(_Lane.IDLE)

    def urgent_seconds(self) -> float:
        """Wall seconds the urgent lane spent writing so far, the write going on included."""
        return self._busy(_Lane.URGENT)

    def _busy(self, lane: _Lane) -> float:
        with self._busy_lock:
            since, total = self._busy_since[lane], self._busy_total[lane]
        return total + (time.perf_counter() - since if since is not None else 0.0)

    @property
    def in_flight(self) -> int:
        """Snapshots held right now: queued, being written, or still read by a lane."""
        with self._cond:
            return self.max_in_flight - len(self._free_buffers)

    # -- training thread -----------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether a capture now would find a free slot (and so not wait).

        Raises the writer's failure, if there was one: the adaptive rule asks
        this at every block end, so a failure is heard there too.
        """
        with self._cond:
            self._raise_if_failed()
            return bool(self._free_buffers)

    def wait_for_room(self, timeout: float) -> bool:
        """Hurry the oldest checkpoint and wait at most ``timeout`` s for a free slot.

        Whether a slot is free. For the adaptive rule's block ends: a slot is
        often held only by the idle lane, stalled inside a checkpoint the
        urgent lane has already written, until it next gets a core; on a full
        machine that is a few milliseconds later, at a block end where
        training's threads pause. The wait is counted in
        :attr:`waited_seconds`, and the caller charges it to the checkpoint.
        """
        began = time.perf_counter()
        with self._cond:
            self._raise_if_failed()
            self._escalate()
            room = self._cond.wait_for(
                lambda: bool(self._free_buffers) or self._error is not None,
                timeout=max(timeout, 0.0),
            )
            self._waited_seconds += time.perf_counter() - began
            self._raise_if_failed()
            return bool(room)

    def escalate(self) -> None:
        """Make the oldest checkpoint in flight due now: the urgent lane writes it.

        For when training would otherwise have to refuse a checkpoint (no free
        slot) or wait for one.
        """
        with self._cond:
            self._escalate()

    def capture(
        self,
        *,
        ctx_id: int | None,
        loop_name: str,
        kind: str,
        objects: Mapping[str, object],
        frame_locals: bytes | None = None,
        due_in: float | None = None,
    ) -> float:
        """Snapshot ``objects`` and the RNGs now; they are written in the background.

        due_in: seconds after which the urgent lane writes it if the idle lane
          has not (None: only when escalated, or at close).
        Returns the training-thread seconds this took, waiting for a slot included.
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
            if not self._free_buffers:
                self._escalate()
                self._wait_for_slot(ctx_id, kind)
            buffers = self._free_buffers.pop()
        # The snapshot is taken outside the lock so a lane can report the previous
        # checkpoint meanwhile; only this thread takes buffers, so this set stays ours.
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
            due_at=None if due_in is None else time.monotonic() + max(due_in, 0.0),
        )
        with self._cond:
            self._raise_if_failed()
            self._pending.append(job)
            self._captured += 1
            self._ensure_lanes()
            self._cond.notify_all()
        return job.capture_seconds

    def _escalate(self) -> None:
        """Make the head due now (called holding the lock)."""
        if not self._pending:
            return
        head = self._pending[0]
        now = time.monotonic()
        if head.due_at is None or head.due_at > now:
            head.due_at = now
            self._cond.notify_all()

    def _wait_for_slot(self, ctx_id: int | None, kind: str) -> None:
        """Block (holding nothing but the condition) until a slot is free.

        A block's wait is warned about once per run (training waited on the
        writer); the end checkpoint's is only counted.
        """
        began = time.perf_counter()
        while not self._free_buffers and self._error is None:
            self._cond.wait()
            # The checkpoint written last may have freed its slot's turn to the next one.
            self._escalate()
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
            "of the state each), use a faster store, or leave the choice to the adaptive rule "
            "(checkpoints='adaptive', when_full='skip').",
            RetrologWarning,
            stacklevel=4,
        )

    def close(self) -> None:
        """Write and report every checkpoint in flight, stop the writers, raise a failure.

        The urgent lane writes what is left, uncompressed and without deltas
        (training is over and the user waits for the exit); the idle lane stops
        at its next array. When that takes over :data:`PROGRESS_AFTER` seconds,
        what remains is shown on stderr. On the main thread, a first Ctrl-C
        says what is being finished and a second one abandons it (see
        :attr:`abandoned`).
        """
        with self._cond:
            if self._closed:
                self._raise_if_failed()
                return
            self._closing = True
            lanes = (self._idle, self._urgent)
            self._cond.notify_all()
        if threading.current_thread() not in lanes:
            if self._urgent is not None:
                began = time.perf_counter()
                try:
                    self._finish()
                finally:
                    self._finish_seconds += time.perf_counter() - began
            # Everything is written (or abandoned): no lane needs torch again. A lane still
            # inside a torch call (the idle lane, stopping at its next array) is waited for,
            # and then, briefly, for the idle lane to end, so that the tensors it lets go
            # of are not freed while the interpreter finalizes (checkpoint/_exitgate.py).
            self._gate.close()
            idle = self._idle
            if idle is not None and idle.is_alive():
                idle.join(timeout=IDLE_JOIN_SECONDS)
        with self._cond:
            if not self._closed:
                self._closed = True
                atexit.unregister(self._close_at_exit)
            self._raise_if_failed()

    def _finish(self) -> None:
        """Wait for the urgent lane to write what is in flight, showing and handling Ctrl-C."""
        with self._cond:
            sizes = {id(job): snapshot_nbytes(job.snap) for job in self._pending}
            rate = self._urgent_bytes / self._urgent_wall if self._urgent_wall > 0 else None
        finishing = Finishing(self.label, len(sizes), sum(sizes.values()), rate)
        urgent = self._urgent
        with finishing.interruptible():
            while True:
                with self._cond:
                    if not self._pending or self._error is not None:
                        break
                    if finishing.abandon:
                        self._abandon(sizes)
                        break
                    if urgent is None or not urgent.is_alive():
                        # Not expected (the lane catches what its writes raise), but
                        # waiting for a thread that is gone would hang the exit.
                        self._lose_pending(
                            StoreError(
                                f"retrolog's checkpoint writer stopped with "
                                f"{len(self._pending)} checkpoint(s) of {self.label} not "
                                "written; they are lost. Please report this as a bug."
                            )
                        )
                        break
                    self._cond.wait(0.1)  # Ctrl-C is handled between waits
                    left = [sizes.get(id(job), 0) for job in self._pending]
                finishing.update(len(left), sum(left))
        finishing.done(self.abandoned, failed=self._error is not None)
        if urgent is not None and not self._abandoning:
            urgent.join(timeout=1.0)  # it has nothing left to do: it is returning

    def _abandon(self, sizes: Mapping[int, int]) -> None:
        """Give up the checkpoints in flight (called holding the lock)."""
        self._abandoning = True
        for job in self._pending:
            job.state = _State.ABANDONED
            self._abandoned.append(
                AbandonedCheckpoint(job.ctx_id, job.loop_name, job.kind, sizes.get(id(job), 0))
            )
            self._release(job)
        self._pending.clear()
        self._cond.notify_all()

    def _close_at_exit(self) -> None:
        # Registered at the first capture, after the run's own exit hook, so it runs
        # first (atexit is last in, first out) and the run's commit() finds it closed;
        # it also closes a checkpointer used on its own. atexit runs before daemon
        # threads are stopped, so exit finishes what is in flight.
        try:
            self.close()
        except StoreError as exc:
            # Nobody is left to raise to at exit; stderr is the last place to say it.
            warnings.warn(str(exc), RetrologWarning, stacklevel=1)

    def _close_before_executors_stop(self) -> None:
        # A forked child (a DataLoader worker) inherits the hook, and multiprocessing runs
        # threading's exit hooks when the child ends: closing this copy there waited for
        # lanes the child does not have, and held each worker's exit for seconds.
        if os.getpid() != self._pid:
            return
        # These hooks run before Python joins the threads that are not daemons: training
        # may go on in one of them (the main thread only started it), and capture more.
        # Then close at atexit, once they have ended, as without this hook.
        main = threading.main_thread()
        for thread in threading.enumerate():
            if thread is main or thread.daemon or not thread.is_alive():
                continue
            if not thread.name.startswith("retrolog-"):  # ours: the code copy, array writes
                return
        self._close_at_exit()

    def _raise_if_failed(self) -> None:
        """Raise the writer's failure here; close() raises it only if no capture did already."""
        error = self._error
        if error is None:
            return
        if self._error_reported and self._closing:
            return  # close() after the failure was already raised at a capture
        self._error_reported = True
        raise error

    def _ensure_lanes(self) -> None:
        if self._urgent is None:
            # Started on the first capture, not at construction: importing or configuring
            # retrolog must not start threads. Both are started here, on the training
            # thread, because a thread inherits its creator's priority: the urgent lane
            # keeps training's, and the idle lane lowers its own.
            self._idle = threading.Thread(
                target=self._run_idle, name="retrolog-checkpoint-writer", daemon=True
            )
            self._urgent = threading.Thread(
                target=self._run_urgent, name="retrolog-checkpoint-urgent", daemon=True
            )
            self._idle.start()
            self._urgent.start()
            atexit.register(self._close_at_exit)
            # atexit runs after Python has stopped concurrent.futures, whose executors a
            # remote store's client needs to open a connection (s3fs resolves the host
            # name in one): a checkpoint finished there on S3 failed with "cannot schedule
            # new futures after shutdown". threading's exit hooks run before that (newest
            # first, so after this one, concurrent.futures' own), and finish it there.
            import concurrent.futures.thread  # noqa: F401  (its exit hook older than ours)

            register = getattr(threading, "_register_atexit", None)
            if register is not None:
                self._pid = os.getpid()
                with contextlib.suppress(RuntimeError):  # a first capture during exit
                    register(self._close_before_executors_stop)

    # -- writer lanes ----------------------------------------------------------------------

    def _run_idle(self) -> None:
        if self.low_priority:
            _lower_priority()
        # Loaded by preload_codec() already, unless that failed: then say so here.
        try:
            _codec()
        except BaseException as exc:  # the training thread must hear of it, not hang
            error = StoreError(
                f"retrolog's checkpoint writer cannot load its compression library "
                f"(c-blosc2, from imagecodecs): {type(exc).__name__}: {exc}. No checkpoint "
                "is written; reinstall retrolog's dependencies "
                "(pip install --force-reinstall imagecodecs)."
            )
            error.__cause__ = exc
            with self._cond:
                self._lose_pending(error)
            return
        while True:
            with self._cond:
                job = self._idle_job()
                while job is None:
                    if self._closing or self._error is not None:
                        return  # close() has the urgent lane write what is left
                    self._cond.wait()
                    job = self._idle_job()
                job.encoders += 1
                job.idle_writing = True
                job.idle_since = time.perf_counter()
            self._write(job, _Lane.IDLE)

    def _idle_job(self) -> _Job | None:
        """The checkpoint the idle lane may write now, if any (called holding the lock)."""
        if self._closing or self._error is not None or not self._pending:
            return None
        job = self._pending[0]
        if job.urgent or job.idle_writing or _is_due(job):
            return None
        return job

    def _run_urgent(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._error is not None or self._abandoning:
                        return
                    job = self._pending[0] if self._pending else None
                    if job is None:
                        if self._closing:
                            return
                        self._cond.wait()
                    elif self._closing or _is_due(job):
                        break
                    else:
                        wait = None if job.due_at is None else job.due_at - time.monotonic()
                        self._cond.wait(wait)
                job.urgent = True
                job.encoders += 1
                finishing = self._closing
            if not self._write(job, _Lane.URGENT, finishing=finishing):
                return

    def _write(self, job: _Job, lane: _Lane, *, finishing: bool = False) -> bool:
        """Encode ``job`` on this lane and settle the outcome; False if writing must stop."""
        snap = job.snap
        assert snap is not None  # a lane holds an encoder count, so it was not released
        began = time.perf_counter()
        with self._cond:
            if job.write_started is None:
                job.write_started = began
            if lane is _Lane.URGENT:
                job.urgent_since = began
        with self._busy_lock:
            self._busy_since[lane] = began
        cpu_started = time.thread_time()
        if lane is _Lane.IDLE:

            def interrupt() -> bool:
                return self._closing or job.urgent or job.state is not _State.PENDING

        else:

            def interrupt() -> bool:
                return self._abandoning

        result: tuple[str, int] | None = None
        failure: BaseException | None = None
        try:
            if lane is _Lane.IDLE:
                # zstd with deltas: the smallest checkpoints, on cycles nobody wanted.
                result = encode(
                    snap,
                    self.store,
                    history=self.history,
                    interrupt=interrupt,
                    section=self._gate.section,
                )
            else:
                result = encode_urgent(
                    snap, self.store, interrupt=interrupt, section=self._gate.section
                )
        except Interrupted:
            pass  # the other lane, or close(), writes it
        except BaseException as exc:  # all of it goes to the training thread, none is lost
            failure = exc
        finally:
            cpu = time.thread_time() - cpu_started
            ended = time.perf_counter()
            with self._busy_lock:
                self._busy_total[lane] += ended - began
                self._busy_since[lane] = None
        with self._cond:
            job.encoders -= 1
            job.writer_cpu_seconds += cpu
            if lane is _Lane.URGENT:
                job.urgent_cpu_seconds += cpu
                job.urgent_seconds += ended - began
            elif job.idle_since is not None:
                job.idle_seconds += ended - job.idle_since
                job.idle_since = None
                job.idle_writing = False
            if job.state is _State.PENDING:
                if failure is not None and (disk_full(failure) or store_unreachable(failure)):
                    self._lose_one(job, failure)
                elif failure is not None:
                    self._lose_pending(_converted(failure, job, len(self._pending) - 1))
                elif result is not None:
                    self._report(job, result, lane, finishing)
            self._release(job)
            self._cond.notify_all()
            return self._error is None and not self._abandoning

    def _report(self, job: _Job, result: tuple[str, int], lane: _Lane, finishing: bool) -> None:
        """``job`` is written: hand it to the sink and free its turn (called holding the lock).

        The sink is called under the lock, so that no later checkpoint can be
        reported before it and close() cannot return before it was.
        """
        manifest, nbytes = result
        now = time.perf_counter()
        assert self._pending[0] is job and job.write_started is not None
        idle_seconds = job.idle_seconds
        if job.idle_since is not None:  # the idle lane is still inside it (stalled)
            idle_seconds += now - job.idle_since
        try:
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
                    write_seconds=now - job.write_started,
                    created_at=job.created_at,
                    writer_cpu_seconds=job.writer_cpu_seconds,
                    frame_locals=job.frame_locals,
                    urgent_cpu_seconds=job.urgent_cpu_seconds,
                    urgent_seconds=job.urgent_seconds,
                    idle_seconds=idle_seconds,
                )
            )
        except BaseException as exc:
            self._lose_pending(_converted(exc, job, len(self._pending) - 1))
            return
        job.state = _State.WRITTEN
        self._pending.popleft()
        if lane is _Lane.URGENT and job.urgent_since is not None:
            self._urgent_bytes += snapshot_nbytes(job.snap)
            self._urgent_wall += now - job.urgent_since
        self._written[job.kind] += 1
        if finishing:
            self._finished_at_close += 1
        elif lane is _Lane.URGENT:
            self._urgent_writes += 1

    def _lose_one(self, job: _Job, exc: BaseException) -> None:
        """A full disk, or an object store that does not answer: this checkpoint is lost,
        training and later checkpoints go on.

        Its objects that were written are referenced by nothing (gc collects them); the
        delta history still describes the last checkpoint written, so later ones stay
        decodable. The run's summary lists it (:attr:`lost`), and replay executes its
        block. Said on stderr once per cause.
        """
        job.state = _State.LOST
        self._pending.remove(job)
        self._release(job)
        full = disk_full(exc)
        reason = LOST_DISK_FULL if full else LOST_UNREACHABLE
        first = not any(lost.reason == reason for lost in self._lost)
        lost = LostCheckpoint(job.ctx_id, job.loop_name, job.kind, reason)
        self._lost.append(lost)
        if self.on_lost is not None:
            self.on_lost(lost)
        if full:
            self.lost_to_full_disk += 1
        if not first:
            return
        which = "the end checkpoint" if job.kind == "end" else "a checkpoint"
        if full:
            why = f"the disk holding {self.store!r} is full ({exc})."
            fix = "Free space on that disk to keep them."
        else:
            why = (
                f"the object store at {self.store.location} did not answer within "
                "RETROLOG_OBJECTS_TIMEOUT, retried meanwhile."
            )
            fix = (
                "Replay executes the blocks of the lost ones instead of restoring them; check "
                "the store's server and the network."
            )
        print(
            f"retrolog: {which} of {self.label} (loop {job.loop_name!r}) was not written: "
            f"{why} Training goes on, and each later checkpoint is tried as usual; "
            f"`retrolog show` lists the lost ones. {fix}",
            file=sys.stderr,
            flush=True,
        )

    def _lose_pending(self, error: BaseException) -> None:
        """Stop writing after a failure: everything queued is lost (called holding the lock)."""
        self._error = error
        for job in self._pending:
            job.state = _State.LOST
            self._release(job)
        self._pending.clear()
        self._cond.notify_all()

    def _release(self, job: _Job) -> None:
        """Give ``job``'s memory back to the pool once it is settled and no lane reads it."""
        if job.state is _State.PENDING or job.encoders or job.buffers is None:
            return
        self._free_buffers.append(job.buffers)
        job.buffers = None
        job.snap = None


def encode_urgent(
    snap: Snapshot,
    store: ObjectStore,
    *,
    interrupt: Callable[[], bool] | None = None,
    section: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> tuple[str, int]:
    """How the urgent lane writes a checkpoint (bench/bench_checkpoint_floor.py times it).

    While training runs, each CPU second the urgent lane spends costs training
    about one, so it spends the least CPU per checkpoint (``least_cpu``:
    stored uncompressed, small arrays in the manifest, no write-behind thread),
    about a third of lz4's for a sixth more bytes on the cnn workload's state.
    At close, training over, the user waits for it: the same encode took less
    wall time than lz4 on every core here, 9 ms against 28 on the cnn state and
    153 ms against 198 on a 101 MB MLP with Adam, for 8% more bytes
    (docs/record-overhead.md, "The floor of one checkpoint"). Never with the
    delta history, which the idle lane may be using, stalled inside this very
    checkpoint.
    """
    return encode(snap, store, interrupt=interrupt, least_cpu=True, section=section)


def _is_due(job: _Job) -> bool:
    return job.due_at is not None and time.monotonic() >= job.due_at


def _lower_priority() -> bool:
    """Give the calling thread, and it alone, the lowest CPU priority; whether that worked.

    SCHED_IDLE where Linux allows it: the scheduler runs such a thread only on
    a core no other thread wants and takes the core back the moment training
    wakes up, where a thread at nice 19 still gets a small share and is
    preempted less promptly. Beside a CPU-bound torch training a busy writer
    cost training 0.26 s per second of its CPU time at nice 19 and none
    measurable under SCHED_IDLE (bench/bench_writer_priority.py). Nice 19 is
    set as well, for where SCHED_IDLE is refused. Both are per thread on Linux
    and need no privilege to take; the thread cannot give them back without
    privilege, which is why what is due is written by the urgent lane instead.
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
    """``exc`` from a writer thread as the error the training thread should see."""
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
