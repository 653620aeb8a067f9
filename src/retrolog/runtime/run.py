"""The active run: lifecycle, loop contexts, block roles and checkpoint points.

One :class:`Run` exists per recording process at a time. It owns the record
deque (drained by :class:`~retrolog.runtime.writer.Writer`) and decides, as
loops start and end, which context each value belongs to and where a
checkpoint is taken:

- the outermost loop started inside ``checkpointing`` is the OUTER loop;
- the first loop nested directly in an OUTER iteration is that iteration's
  skippable BLOCK: its state is captured when it ends (normally, by ``break``,
  or by an exception the body catches; a generator cannot tell these apart);
- an OUTER iteration with no nested loop is itself the block, captured at its end;
- the OUTER loop's end is always captured ("end" checkpoint).
"""

from __future__ import annotations

import enum
import json
import os
import platform
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from retrolog.errors import StoreError, UsageError
from retrolog.runtime import cli_args, frames, numerics, progress
from retrolog.runtime.crash import Crash
from retrolog.runtime.heap import HeapFreeze
from retrolog.runtime.import_clock import ImportClock
from retrolog.runtime.values import FAST_TYPES, PLAIN_TYPES, slow_path
from retrolog.runtime.writer import Event, Writer
from retrolog.store.metastore import MetadataStore, open_metadata
from retrolog.store.paths import ProjectPaths, storable_text
from retrolog.store.processes import process_start_marker

NO_OVERRIDE = object()  # arg() had no --kwargs value for this name


class Status(str, enum.Enum):
    """Where a run is in its life."""

    RUNNING = "running"  # the process is recording
    FINISHED = "finished"  # commit() ran, explicitly or at interpreter exit
    CRASHED = "crashed"  # an uncaught exception, or the process died (found at next open)


class Role(enum.Enum):
    """What a loop is for checkpointing."""

    PLAIN = 0  # no checkpoint boundary
    OUTER = 1  # outermost loop under checkpointing(): its iterations are the units
    BLOCK = 2  # first loop nested in an OUTER iteration: the skippable block


class CheckpointScope:
    """The objects named by one ``checkpointing(...)`` context."""

    def __init__(
        self, objects: Mapping[str, object], depth: int, parent: CheckpointScope | None
    ) -> None:
        self.objects: dict[str, object] = {**(parent.objects if parent else {}), **objects}
        self.ids = frozenset(id(obj) for obj in self.objects.values())  # restored in place
        self.depth = depth  # loop depth at entry: a loop started at this depth is OUTER
        self.parent = parent


class _Frame:
    __slots__ = ("block_seconds", "block_seen", "ctx", "depth", "iteration", "name", "role")

    def __init__(self, name: str, depth: int, role: Role) -> None:
        self.name = name
        self.depth = depth
        self.role = role
        self.ctx: int | None = None
        self.iteration = -1
        self.block_seen = False
        self.block_seconds: float | None = None


class _LoopEntry:
    """What a loop took as it started, for its iterations and its end (:meth:`Run.loop`)."""

    __slots__ = (
        "attrs_at_start",
        "bar",
        "busy_started",
        "first_nested",
        "frame",
        "locals_before",
        "outer",
        "parent_ctx",
        "started",
        "user_frame",
    )

    frame: _Frame
    outer: _Frame | None
    first_nested: bool
    parent_ctx: int | None
    bar: progress.LoopProgress | None
    started: float
    busy_started: float
    user_frame: FrameType | None
    locals_before: dict[str, Any]
    attrs_at_start: dict[tuple[str, str], Any]


def loop_role(stack: list[_Frame], scope: CheckpointScope | None) -> tuple[Role, bool]:
    """The role of a loop starting now, and whether it is the first one nested in its parent.

    The first loop nested in an iteration is its block: for the profile always, and for
    checkpointing when the enclosing loop is OUTER. Marks the parent as having one.
    Record and replay both decide roles here, so they always agree.
    """
    outer = stack[-1] if stack else None
    first_nested = False
    if outer is not None and not outer.block_seen:
        first_nested = outer.block_seen = True
    if scope is not None and len(stack) == scope.depth:
        return Role.OUTER, first_nested
    if first_nested and outer is not None and outer.role is Role.OUTER:
        return Role.BLOCK, first_nested
    return Role.PLAIN, first_nested


def new_run_id() -> str:
    """A sortable, readable id: start time plus random hex (unique across hosts)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def process_started_at() -> float:
    """Wall-clock start of this process (the prefix includes imports and data loading)."""
    try:
        ticks = int(process_start_marker(os.getpid()) or "")
        # Ticks since boot against the boot clock now, not /proc/stat's btime: btime is in
        # whole seconds, which put the start up to 1 s early and the prefix up to 1 s long.
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since
    except (ValueError, OSError, AttributeError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


class Run:
    """One execution of a script being recorded."""

    def __init__(
        self,
        paths: ProjectPaths,
        argv: list[str],
        script: str | None,
        *,
        code_files: Mapping[str, bytes] | None = None,
    ) -> None:
        """code_files: files the code version holds instead of the working tree's
        (runtime/notebook.py: a notebook's executed cells at its path)."""
        self.paths = paths
        self.run_id = new_run_id()
        self.started_at = time.time()
        self._t0 = time.perf_counter()  # loop times are seconds since this instant
        self.process_started_at = min(process_started_at(), self.started_at)
        self.filename = _relative_script(paths.root, script)
        _require_text_name(self.filename)
        self.args: dict[str, Any] = {}
        self.status = Status.RUNNING
        self.ctx: int | None = None
        self.scope: CheckpointScope | None = None
        self._stack: list[_Frame] = []
        self.event_loops = EventLoops(self)
        self.volatile: set[str] = set()
        self._next_ctx = 0
        self._first_loop_at: float | None = None
        self._last_top_loop_end: float | None = None
        # Iterations a loop was left from (break, return, or an exception on its way out):
        # (ctx, t_end, top-level timing or None). A break ended the iteration, an exception
        # that crashes the run did not; which it was shows later, so their ends are written
        # once the script goes on (an iteration ends) or finishes, and dropped on a crash.
        self._left: list[tuple[int, float, tuple[int, float, float | None] | None]] = []
        self._checkpointer: Any = None
        self._policy: Any = None
        self._settings: Any = None
        self._restore_ratio: tuple[float, str] = (1.0, "default")  # c, and where it came from
        self._pid = os.getpid()
        self._import_clock = ImportClock(paths.root)
        self._heap = HeapFreeze()  # frozen from the first loop to the run's end
        # What changes floating-point results besides the code (runtime/numerics.py):
        # replay workers reproduce it. Torch's state is taken again when training starts.
        self.numerics: dict[str, Any] = numerics.capture()
        self.parsed_args: dict[str, Any] = {}  # argparse/click values, runtime/cli_args.py
        self.handsfree: dict[str, Any] | None = None  # what `retrolog run` inferred

        self._code_export: CodeExport | None = None
        metadata = open_metadata(paths)
        self.store_location = metadata.location
        try:
            self.writer = Writer(self.store_location, self.run_id, sink=metadata.record_sink())
            self.values = self.writer.values  # log()'s hot path appends here directly
            self.events = self.writer.events
            self._register(metadata, argv, code_files)
        except Exception as exc:
            if isinstance(exc, StoreError) or not hasattr(exc, "sqlite_errorcode"):
                raise
            raise StoreError(
                f"Cannot register the run in {paths.database}: {exc}.", path=str(paths.database)
            ) from exc
        finally:
            metadata.close()
        self.writer.start()

        # Package versions take tens of ms to collect: the writer thread evaluates the lambda.
        self.events.append(
            (Event.RUN_UPDATE, {"packages": lambda: json.dumps(_package_versions())})
        )
        # Replay's cost model: recording's own start (code capture, store) is in the prefix,
        # and a replay worker does not pay it.
        self.events.append((Event.PROFILE, "setup", None, time.perf_counter() - self._t0, None))
        # ... and what the rest of the prefix spends importing packages a replay's fork
        # server will have imported (runtime/import_clock.py).
        self._import_clock.start()

    def _register(
        self, metadata: MetadataStore, argv: list[str], code_files: Mapping[str, bytes] | None
    ) -> None:
        """The code version captured, the run registered with it in the store, its copy
        into the object store started, and the restore ratio replays of this script
        learned."""
        from retrolog.versions.git import capture_code_version

        code = capture_code_version(
            self.paths,
            self.run_id,
            message=f"retrolog run {self.run_id}: {self.filename}",
            replace=code_files,
        )
        tstamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started_at))
        metadata.register_run(
            {
                "run_id": self.run_id,
                "projid": self.paths.projid,
                "tstamp": tstamp,
                "filename": self.filename,
                "status": Status.RUNNING.value,
                "started_at": self.started_at,
                "host": socket.gethostname(),
                "pid": self._pid,
                "pid_start": process_start_marker(self._pid),
                "python": platform.python_version(),
                "argv": json.dumps(argv),
                "code_ref": code.ref,
                "code_commit": code.commit,
                "code_tree": code.tree,
                "head_commit": code.head_commit,
                "git_dir": str(code.git_dir),
                "dirty": int(code.dirty),
                "skipped_files": json.dumps(list(code.skipped)),
                "cwd": _relative_cwd(self.paths.root),
                "numerics": json.dumps(self.numerics),
            }
        )
        self._code_export = _start_code_export(self.paths, metadata, self.run_id, code, self.events)
        learned = metadata.learned_restore_ratio(self.filename)
        if learned is not None:
            self._restore_ratio = (learned, "learned from replays")

    # -- values ----------------------------------------------------------------------

    def log(self, name: str, value: Any, *, run_level: bool = False) -> None:
        """Queue a value (log()'s hot path inlines the float/int/str case)."""
        ctx = None if run_level else self.ctx
        if type(value) in FAST_TYPES:
            self.values.append((ctx, name, value))
        else:
            stored, kind = slow_path(value, name=name, defer=True)
            self.events.append((Event.LOG, ctx, name, stored, kind))

    def restore_block(self) -> bool:
        """Recording executes every block: nothing is restored."""
        return False

    def resolve_arg(self, name: str, default: Any, override: Any) -> Any:
        """The value of arg(name): the --kwargs override (already cast) or the default."""
        return default if override is NO_OVERRIDE else override

    def set_arg(self, name: str, value: Any) -> None:
        """Record an argument: a run-level value, whatever loop is active, and in runs.args."""
        self.args[name] = value
        self.log(name, value, run_level=True)
        self.events.append((Event.RUN_UPDATE, {"args": json.dumps(self.args, default=str)}))
        if self.parsed_args.pop(name, NO_OVERRIDE) is not NO_OVERRIDE:  # rl.arg wins
            self.events.append((Event.RUN_UPDATE, {"parsed_args": json.dumps(self.parsed_args)}))

    def set_handsfree(self, inferred: Mapping[str, Any]) -> None:
        """What ``retrolog run`` inferred (runtime/handsfree.py): kept in the run's
        ``checkpointing`` record from now (a killed run has it too) and in its summary."""
        self.handsfree = dict(inferred)
        self.events.append(
            (Event.RUN_UPDATE, {"checkpointing": json.dumps({"handsfree": self.handsfree})})
        )

    def set_parsed_args(self, values: Mapping[str, Any]) -> None:
        """Record what argparse/click parsed (plain data) as run-level values.

        A name ``rl.arg`` reads keeps ``rl.arg``'s value.
        """
        fresh = {
            name: value
            for name, value in values.items()
            if name not in self.args and self.parsed_args.get(name, NO_OVERRIDE) != value
        }
        if not fresh:
            return
        self.parsed_args.update(fresh)
        for name, value in fresh.items():
            self.log(name, value, run_level=True)
        self.events.append((Event.RUN_UPDATE, {"parsed_args": json.dumps(self.parsed_args)}))

    # -- loops -----------------------------------------------------------------------

    def loop(self, name: str, iterable: Iterable[Any], *, events: bool = False) -> Iterator[Any]:
        """Iterate ``iterable`` as loop ``name``: contexts, timings, checkpoint points.

        events: the loop is driven by ``begin``/``end`` calls (:class:`EventLoops`): no
        script frame runs it, so a checkpoint carries no frame locals.
        """
        entry = self._enter_loop(name, iterable, events, sys._getframe(1))
        frame, parent_ctx, bar = entry.frame, entry.parent_ctx, entry.bar
        depth = frame.depth
        clock = time.perf_counter
        t0 = self._t0
        attrs_before = entry.attrs_at_start
        iteration = 0
        # Locals, and tuples in the column order of the writer's statements: this runs per
        # step, and the writer then runs no Python per iteration either (writer.py).
        writer = self.writer
        start_append = writer.loop_starts.append
        end_append = writer.loop_ends.append
        iteration_append = writer.iterations.append
        plain = PLAIN_TYPES
        top_level = depth == 0
        is_outer = frame.role is Role.OUTER
        left = self._left
        try:
            for item in iterable:
                ctx = self._next_ctx
                self._next_ctx = ctx + 1
                t_iter = clock()
                busy_iter = self._writer_busy() if is_outer else 0.0
                if is_outer and self.scope is not None:
                    attrs_before = frames.attr_ids(self.scope.objects)
                # Only plain items are kept as the loop value; a batch tensor is not.
                value = item if type(item) in plain else None
                start_append((ctx, parent_ctx, name, iteration, value, depth, t_iter - t0))
                frame.ctx = ctx
                frame.block_seen = False
                self.ctx = ctx
                try:
                    yield item
                except GeneratorExit:
                    self._iteration_left(ctx, frame, t_iter)
                    raise
                t_end = clock()
                self.ctx = parent_ctx
                if left:  # loops left inside this iteration, which went on: they finished
                    self._write_left()
                end_append((t_end - t0, ctx))
                if top_level:
                    seconds = t_end - t_iter
                    block = frame.block_seconds if frame.block_seen else seconds
                    iteration_append((ctx, seconds, block))
                if is_outer and not frame.block_seen:
                    self._block_ended(
                        ctx,
                        name,
                        t_end - t_iter,
                        self._writer_busy() - busy_iter,
                        user_frame=entry.user_frame,
                        before=entry.locals_before,
                        attrs_before=attrs_before,
                    )
                if bar is not None:
                    bar.tick()
                iteration += 1
                if writer.failure is not None:
                    self.check_writer()
        finally:
            self._exit_loop(entry)

    def _enter_loop(
        self, name: str, iterable: Iterable[Any], events: bool, caller: FrameType
    ) -> _LoopEntry:
        """Loop ``name`` starts: its role decided, its frame pushed, and what its end (or its
        block's) compares against taken now. ``caller`` is the frame iterating the loop."""
        self.check_writer()
        if self._left:  # a loop left before this one starts: the script went on
            self._write_left()
        stack = self._stack
        depth = len(stack)
        entry = _LoopEntry()
        entry.parent_ctx = self.ctx
        entry.outer = stack[-1] if stack else None
        role, entry.first_nested = loop_role(stack, self.scope)
        entry.frame = _Frame(name, depth, role)
        entry.bar = (
            progress.LoopProgress(name, iterable, self.writer.latest)
            if depth == 0 and (progress.enabled())
            else None
        )
        entry.started = time.perf_counter()
        # How long the checkpoint writer had been busy: a block's share of it tells
        # the adaptive rule what the writer costs training (policy.py).
        entry.busy_started = self._writer_busy() if role is Role.BLOCK else 0.0
        # The script's frame running this loop, and its locals now: a checkpoint taken
        # where this loop (or its iteration) ends carries what the loop rebound.
        entry.user_frame = None
        entry.locals_before = {}
        # The named objects' plain attributes now: one that changes in the block and
        # cannot be carried makes its checkpoint one replay does not restore.
        entry.attrs_at_start = {}
        if role is not Role.PLAIN:
            if not events:
                entry.user_frame = frames.script_frame(caller)
                entry.locals_before = frames.local_ids(entry.user_frame)
            if self.scope is not None:
                entry.attrs_at_start = frames.attr_ids(self.scope.objects)
        if depth == 0 and self._first_loop_at is None:
            self._first_loop_at = time.time()
            self._training_starts()
        stack.append(entry.frame)
        return entry

    def _iteration_left(self, ctx: int, frame: _Frame, t_iter: float) -> None:
        """The script left the loop inside iteration ``ctx`` (break, return, an exception):
        its end is kept for :meth:`_write_left`, written only if the script goes on."""
        t_end = time.perf_counter()
        timing = None
        if frame.depth == 0:
            seconds = t_end - t_iter
            timing = (ctx, seconds, frame.block_seconds if frame.block_seen else seconds)
        self._left.append((ctx, t_end - self._t0, timing))

    def _exit_loop(self, entry: _LoopEntry) -> None:
        """The loop ended (or was left): its frame popped, its progress line closed, and the
        checkpoint its end calls for taken: its parent's block's, or the OUTER loop's end."""
        frame = entry.frame
        outer = entry.outer
        self._stack.pop()
        self.ctx = entry.parent_ctx
        if entry.bar is not None:
            # The writer updates the latest values as it drains; drain once so the final
            # line shows the values the loop ended with.
            self.writer.flush(timeout=1.0)
            entry.bar.close()
        loop_seconds = time.perf_counter() - entry.started
        if frame.depth == 0:
            self._last_top_loop_end = time.time()
        if entry.first_nested and outer is not None:
            outer.block_seconds = loop_seconds
        if frame.role is Role.BLOCK and outer is not None:
            self._block_ended(
                outer.ctx,
                outer.name,
                loop_seconds,
                self._writer_busy() - entry.busy_started,
                user_frame=entry.user_frame,
                before=entry.locals_before,
                attrs_before=entry.attrs_at_start,
            )
        elif frame.role is Role.OUTER:
            self._capture(
                None,
                frame.name,
                "end",
                user_frame=entry.user_frame,
                before=entry.locals_before,
                attrs_before=entry.attrs_at_start,
            )
        entry.user_frame = None  # no frame reference outlives the loop

    def _write_left(self) -> None:
        """Write the ends of the iterations loops were left from: the script went on."""
        for ctx, t_end, timing in self._left:
            self.writer.loop_ends.append((t_end, ctx))
            if timing is not None:
                self.writer.iterations.append(timing)
        self._left.clear()

    def _training_starts(self) -> None:
        """At the first top-level loop: torch's state as training runs with it, and the
        heap so far kept out of full collections (runtime/heap.py)."""
        self._heap.start()
        # A run that started before its click command was invoked sees the command now.
        params = cli_args.click_params()
        if params:
            self.set_parsed_args(params)
        # What a replay's fork server imports before forking workers (runtime/modules.py):
        # the items are listed by the writer thread, not here.
        self.events.append((Event.MODULES, list(sys.modules.items()), self.paths.root))
        imports = self._import_clock.stop()
        if imports is not None:
            self.events.append((Event.PROFILE, "late_imports", None, imports, None))
        torch = sys.modules.get("torch")
        if torch is None:
            return
        state = numerics.torch_state(torch)
        self.numerics["torch"] = state
        self.events.append((Event.RUN_UPDATE, {"numerics": json.dumps(self.numerics)}))
        # Replay's cost model scales compute by the threads the recording had.
        threads = state.get("intra_op_threads")
        if isinstance(threads, int):
            self.events.append((Event.PROFILE, "threads", None, float(threads), None))

    # -- checkpoints -----------------------------------------------------------------

    def _writer_busy(self) -> float:
        """Seconds the checkpoint writer has spent writing so far in this run."""
        checkpointer = self._checkpointer
        return 0.0 if checkpointer is None else float(checkpointer.busy_seconds())

    def _block_ended(
        self,
        ctx: int | None,
        loop_name: str,
        seconds: float,
        writer_busy: float,
        *,
        user_frame: FrameType | None,
        before: Mapping[str, Any],
        attrs_before: Mapping[tuple[str, str], Any],
    ) -> None:
        """A skippable block took ``seconds``; checkpoint it if the adaptive rule says so."""
        scope = self.scope
        if scope is None or not scope.objects:
            return
        checkpointer, policy = self._checkpointing()
        # A chosen checkpoint is always written, so the rule must know whether the
        # writer can take one without training waiting (when_full="wait": it waits).
        room = self._settings.when_full == "wait" or checkpointer.has_room()
        waited = 0.0

        def wait_for_room(limit: float) -> bool:
            nonlocal waited
            began = time.perf_counter()
            try:
                return bool(checkpointer.wait_for_room(limit))
            finally:
                waited = time.perf_counter() - began

        decision = policy.decide(
            loop_name,
            seconds,
            writer_busy,
            room=room,
            urgent_seconds=checkpointer.urgent_seconds(),
            wait_for_room=wait_for_room,
        )
        if not decision:
            if decision.waits_on_writer and not waited:
                # Training would otherwise keep refusing: have the urgent lane write
                # the oldest checkpoint now, so the next block end finds room (or a price).
                # (A wait for a slot has done so already.)
                checkpointer.escalate()
            if waited:
                # Training waited for a slot in vain: what the rule's next prices include.
                policy.waited(loop_name, waited)
            return
        began = time.perf_counter() - waited  # a wait for the slot is this checkpoint's cost
        self._capture(
            ctx,
            loop_name,
            "block",
            user_frame=user_frame,
            before=before,
            attrs_before=attrs_before,
            due_in=policy.due_in(loop_name, self._settings.max_in_flight),
        )
        policy.captured(loop_name, time.perf_counter() - began)

    def _capture(
        self,
        ctx: int | None,
        loop_name: str,
        kind: str,
        *,
        user_frame: FrameType | None,
        before: Mapping[str, Any],
        attrs_before: Mapping[tuple[str, str], Any],
        due_in: float | None = None,
    ) -> bool:
        """Checkpoint the scope's objects (with their plain attributes) and the frame's small
        locals; False if none are named.

        due_in: when the writer should have written it (None: the end state,
        written in the background or at the latest at commit()).
        """
        scope = self.scope
        if scope is None or not scope.objects:
            return False
        checkpointer, _ = self._checkpointing()
        checkpointer.capture(
            ctx_id=ctx,
            loop_name=loop_name,
            kind=kind,
            objects=scope.objects,
            frame_locals=frames.capture(user_frame, before, scope.ids, scope.objects, attrs_before),
            due_in=due_in,
        )
        return True

    def _checkpointing(self) -> tuple[Any, Any]:
        """The run's background checkpointer and adaptive policy, made at the first block end."""
        if self._checkpointer is not None:
            return self._checkpointer, self._policy
        started = time.perf_counter()
        from retrolog.checkpoint import settings
        from retrolog.checkpoint.background import BackgroundCheckpointer
        from retrolog.checkpoint.policy import AdaptivePolicy
        from retrolog.store.backends import object_store_for

        config = settings.current()
        append = self.events.append
        checkpoint_event = Event.CHECKPOINT

        def sink(record: Any) -> None:
            # Called on a writer thread, after the policy below exists.
            if record.kind == "block" and record.writer_cpu_seconds is not None:
                policy.written(
                    record.loop_name,
                    record.writer_cpu_seconds,
                    record.write_seconds,
                    record.urgent_cpu_seconds,
                    record.idle_seconds,
                    record.urgent_seconds,
                )
            append((checkpoint_event, record))

        checkpointer = BackgroundCheckpointer(
            object_store_for(self.paths.store),
            sink,
            max_in_flight=config.max_in_flight,
            label=f"run {self.run_id}",
            on_lost=lambda lost: policy.lost(lost.loop_name) if lost.kind == "block" else None,
        )
        torch = sys.modules.get("torch")
        # Until the policy has measured what the writer costs training, training on
        # the CPU counts the writer's CPU time as lost (a GPU leaves the CPU to it).
        on_gpu = bool(torch is not None and torch.cuda.is_initialized())
        policy = AdaptivePolicy(
            eps=config.overhead_tolerance,
            c=self._c(config),
            every=config.checkpoints == "every",
            count_writer_cpu=not on_gpu,
        )
        self._checkpointer = checkpointer
        self._policy = policy
        self._settings = config
        # Replay's cost model: a one-time cost (imports, the writer) inside the iteration
        # whose block ended first, which a replay worker does not pay.
        seconds = time.perf_counter() - started
        self.events.append((Event.PROFILE, "checkpoint_setup", None, seconds, None))
        return self._checkpointer, policy

    def _c(self, config: Any) -> float:
        """c: configured, else learned from this script's replays, else 1."""
        return float(config.restore_ratio or self._restore_ratio[0])

    def _checkpointing_summary(self) -> str:
        """What checkpointing did in this run, for runs.checkpointing (JSON).

        ``chosen`` block checkpoints are ``written`` plus ``abandoned`` (a
        second Ctrl-C at exit; listed in ``abandoned_checkpoints``) plus ``lost``
        (the store could not take them while training went on: a full disk, an
        object store that did not answer; listed in ``lost_checkpoints`` with why)
        plus any other write failure lost, which was raised in the training thread.
        """
        config, policy, checkpointer = self._settings, self._policy, self._checkpointer
        blocks = {
            name: {
                "executions": stats.executions,
                "checkpoints": stats.checkpoints,
                "refused_cost": stats.refused_cost,
                "refused_writer_full": stats.refused_writer_full,
                "refused_unpriced": stats.refused_unpriced,
                "room_waits": stats.room_waits,
                "mean_block_seconds": stats.compute_seconds / max(stats.executions, 1),
                "mean_capture_seconds": stats.capture_seconds / max(stats.captures, 1),
                "mean_writer_cpu_seconds": stats.writer_cpu_seconds / max(stats.writes, 1),
                "mean_urgent_cpu_seconds": stats.urgent_cpu_seconds / max(stats.writes, 1),
                "mean_urgent_write_seconds": stats.urgent_write_seconds / max(stats.writes, 1),
                "mean_write_seconds": stats.write_seconds / max(stats.writes, 1),
                "urgent_writes": stats.urgent_writes,
                # How much slower blocks ran while the idle lane wrote (None: not measured).
                "writer_slowdown": stats.writer_slowdown(),
            }
            for name, stats in policy.blocks.items()
        }
        abandoned = checkpointer.abandoned
        abandoned_blocks = sum(a.kind == "block" for a in abandoned)
        lost = checkpointer.lost
        return json.dumps(
            {
                **({"handsfree": self.handsfree} if self.handsfree is not None else {}),
                "mode": config.checkpoints,
                "overhead_tolerance": config.overhead_tolerance,
                "restore_ratio": self._c(config),
                "restore_ratio_from": (
                    "configured" if config.restore_ratio is not None else self._restore_ratio[1]
                ),
                "max_in_flight": config.max_in_flight,
                "when_full": config.when_full,
                "writer_cpu_counted": policy.count_writer_cpu,
                "writer_low_priority": checkpointer.low_priority,
                "blocks": blocks,
                "chosen": sum(stats.checkpoints for stats in policy.blocks.values()),
                "written": checkpointer.written_of("block"),
                "abandoned": abandoned_blocks,
                "refused_writer_full": sum(
                    stats.refused_writer_full for stats in policy.blocks.values()
                ),
                "end_written": checkpointer.written_of("end"),
                "end_abandoned": len(abandoned) - abandoned_blocks,
                "abandoned_checkpoints": [
                    {"ctx_id": a.ctx_id, "loop": a.loop_name, "kind": a.kind, "bytes": a.nbytes}
                    for a in abandoned
                ],
                "lost": sum(x.kind == "block" for x in lost),
                "end_lost": sum(x.kind == "end" for x in lost),
                "lost_checkpoints": [
                    {"ctx_id": x.ctx_id, "loop": x.loop_name, "kind": x.kind, "reason": x.reason}
                    for x in lost
                ],
                "urgent_writes": checkpointer.urgent_writes,
                "finished_at_exit": checkpointer.finished_at_close,
                "finish_seconds": checkpointer.finish_seconds,
                "waited_seconds": checkpointer.waited_seconds,
                # The name earlier versions gave what is now "abandoned", for their readers.
                "dropped_unwritten": abandoned_blocks,
            }
        )

    # -- lifecycle -------------------------------------------------------------------

    def check_writer(self) -> None:
        """Raise in the training thread if the background writer has failed."""
        failure = self.writer.failure
        if failure is not None:
            raise StoreError(
                f"retrolog stopped recording run {self.run_id}: writing to {self.store_location} "
                f"failed ({failure}). Values logged since the last successful write are lost; "
                "fix the store (disk full? permissions?) and run again.",
                path=self.store_location,
            ) from failure

    def owned_by_this_process(self) -> bool:
        """False in a forked child (e.g. a DataLoader worker), which must not end the run."""
        return os.getpid() == self._pid

    def crash_of(self, exc_type: Any, exc: Any, tb: Any) -> Crash:
        """The crash an uncaught exception makes, placed in the project's code."""
        return Crash.of(exc_type, exc, tb, self.paths.root)

    def commit(
        self, status: Status = Status.FINISHED, error: str | None = None, crash: Crash | None = None
    ) -> None:
        """End the run: write what is in flight, then record its status (and ``crash``, the
        exception that ended it, as its error)."""
        if self.status is not Status.RUNNING:
            return
        if crash is not None:
            error = crash.text()
        self.status = status
        ended = time.time()
        if status is Status.FINISHED:
            self._write_left()
        self._import_clock.stop()  # a run with no loop: importlib as it was
        try:
            if self._checkpointer is not None:
                try:
                    self._checkpointer.close()
                finally:
                    self.events.append(
                        (Event.RUN_UPDATE, {"checkpointing": self._checkpointing_summary()})
                    )
        finally:
            if self._code_export is not None:
                self._code_export.finish()
            if self._first_loop_at is not None:
                self.events.append(
                    (
                        Event.PROFILE,
                        "prefix",
                        None,
                        self._first_loop_at - self.process_started_at,
                        None,
                    )
                )
            if self._last_top_loop_end is not None:
                self.events.append(
                    (Event.PROFILE, "suffix", None, ended - self._last_top_loop_end, None)
                )
            self.events.append(
                (Event.RUN_UPDATE, {"status": status.value, "ended_at": ended, "error": error})
            )
            try:
                self.writer.close()
            finally:
                self._heap.stop()
        self.check_writer()


class _Feed:
    """The items of an event-driven loop: each ``begin`` hands in one, then advances it."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Any] = []

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> Any:
        if self.items:
            return self.items.pop()
        raise StopIteration


class EventLoops:
    """Loops opened and closed by calls (``rl.begin``/``rl.end``), for loops that are not
    Python iterators (a framework's fit loop calling hooks).

    Each event loop is the run's own ``loop`` generator fed one item per ``begin``, so
    contexts, roles, timings and checkpoint points are those of ``rl.loop``: ``begin``
    ends the loop's current iteration (if any) and starts the next; ``end`` finishes the
    loop as a ``for`` loop finishes.
    """

    def __init__(self, run: Any) -> None:
        self.run = run
        self.open: list[tuple[str, _Feed, Iterator[Any], _Frame]] = []

    def begin(self, name: str, value: Any) -> None:
        for index in range(len(self.open) - 1, -1, -1):
            if self.open[index][0] == name:
                self._close_from(index + 1)
                _, feed, generator, frame = self.open[index]
                self._require_innermost(name, frame)
                feed.items.append(value)
                try:
                    next(generator)
                except StopIteration:  # a replay that restored the rest of the loop
                    del self.open[index]
                return
        feed = _Feed()
        feed.items.append(value)
        generator = self.run.loop(name, feed, events=True)
        try:
            next(generator)
        except StopIteration:
            return
        self.open.append((name, feed, generator, self.run._stack[-1]))

    def end(self, name: str | None) -> None:
        if not self.open:
            raise UsageError(
                "rl.end() was called with no loop open by rl.begin(); call rl.begin(name, ...) "
                "where each iteration starts and rl.end(name) where the loop is over."
            )
        if name is None:
            index = len(self.open) - 1
        else:
            found = [i for i, entry in enumerate(self.open) if entry[0] == name]
            if not found:
                opened = ", ".join(repr(entry[0]) for entry in self.open)
                raise UsageError(
                    f"rl.end({name!r}): no loop {name!r} is open (open loops, outermost "
                    f"first: {opened}). Pass the name given to rl.begin."
                )
            index = found[-1]
        self._close_from(index)

    def close_all(self) -> None:
        """The run ends: loops still open end here (the outer loop's end checkpoint)."""
        self._close_from(0)

    def _close_from(self, index: int) -> None:
        while len(self.open) > index:
            name, _, generator, frame = self.open[-1]
            self._require_innermost(name, frame)
            self.open.pop()
            next(generator, None)  # the feed is empty: the loop finishes

    def _require_innermost(self, name: str, frame: _Frame) -> None:
        stack = self.run._stack
        if not stack or stack[-1] is not frame:
            inner = stack[-1].name if stack else "?"
            raise UsageError(
                f"rl.begin/rl.end of the loop {name!r} while the loop {inner!r}, started "
                f"inside it by rl.loop, is still running; end that for loop first (an "
                "event-driven loop can hold rl.loop loops, but not end around them)."
            )


class CodeExport:
    """The copy of a run's code version into its object store, on a thread of its own.

    The run's row names the copy's manifest (``runs.code_manifest``) once it is
    complete; a run that ends first waits for it (:meth:`finish`), and a process that
    dies first leaves the column empty: the code is then read from the private ref.
    """

    def __init__(
        self, paths: ProjectPaths, run_id: str, code: Any, events: Any, base: str | None
    ) -> None:
        self.paths = paths
        self.run_id = run_id
        self.code = code
        self.events = events
        self.base = base
        self.error: BaseException | None = None
        self.key: str | None = None
        self.thread = threading.Thread(target=self._main, name="retrolog-code", daemon=True)

    def _main(self) -> None:
        from retrolog.store.backends import object_store_for, objects_location
        from retrolog.versions.portable import export_code, load_manifest, remember_export

        try:
            store = object_store_for(self.paths.store)
            known: dict[str, str] = {}
            if self.base is not None:
                try:
                    base = load_manifest(store, self.base)
                    known = {f.blob: f.key for f in base.files if f.key is not None}
                except Exception:  # a hint only: export everything
                    known = {}
            key, _ = export_code(self.code.git_dir, self.code.commit, store, known=known)
            self.events.append((Event.RUN_UPDATE, {"code_manifest": key}))
            self.key = key
            location = objects_location(self.paths.store)
            remember_export(self.paths.store, location, self.code.tree, key)
        except BaseException as exc:  # reported by finish(), on the training thread
            self.error = exc

    def finish(self) -> None:
        """Wait for the copy; warn (the run still has its private ref) if it failed.

        Ctrl-C stops the wait, not the run's end: the run is then recorded without it.
        """
        try:
            self.thread.join()
        except KeyboardInterrupt:
            self.error = KeyboardInterrupt("interrupted before the copy was complete")
        if self.error is not None:
            import warnings

            from retrolog.errors import RetrologWarning

            warnings.warn(
                f"retrolog could not copy the code version of run {self.run_id} into the "
                f"store ({self.error}). The run is recorded; its code stays readable from "
                f"this clone's ref {self.code.ref} only, so replay it from here.",
                RetrologWarning,
                stacklevel=3,
            )
            self.error = None


def _start_code_export(
    paths: ProjectPaths, metadata: MetadataStore, run_id: str, code: Any, events: Any
) -> CodeExport | None:
    """Name the run's code manifest now when its tree was copied before, else start the copy.

    A memo in the store lists recent copies; one is used only when a run of the store
    references its manifest (so gc keeps its objects). A copy of another tree still
    spares re-reading the files that tree shares with this one.
    """
    from retrolog.store.backends import objects_location
    from retrolog.versions.portable import recent_exports

    recent = recent_exports(paths.store, objects_location(paths.store))
    live = metadata.live_manifests(key for _, key in recent) if recent else set()
    for tree, key in recent:
        if tree == code.tree and key in live:
            metadata.set_code_manifest(run_id, key)
            return None
    base = next((key for _, key in recent if key in live), None)
    export = CodeExport(paths, run_id, code, events, base)
    export.thread.start()
    # A script that just ends commits its run from an atexit hook. By then the interpreter
    # has shut concurrent.futures down (s3fs needs its executor for a new connection) and
    # s3fs's own exit hook may have closed its client: a copy still going would fail
    # ("cannot schedule new futures after shutdown", "'NoneType' object has no attribute
    # 'get'"). So the copy is waited for first, by threading's exit hooks, which run
    # before both (newest first: after this one, concurrent.futures' own).
    import concurrent.futures.thread  # noqa: F401  (its exit hook older than ours)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        pid = os.getpid()

        def wait_for_the_copy() -> None:
            if os.getpid() == pid:  # not in a forked child (a DataLoader worker) at its end
                export.thread.join()

        register(wait_for_the_copy)
    return export


def _relative_cwd(root: Path) -> str:
    """The working directory relative to the project root (replay runs the script there)."""
    try:
        return Path.cwd().resolve().relative_to(root).as_posix()
    except ValueError:
        return "."


def _require_text_name(filename: str) -> None:
    """Refuse a script whose path is not text (bytes that are not UTF-8, which Python
    decodes as lone surrogates): the store, the runs table and replay name a run's
    script by its path as text."""
    shown = storable_text(filename)
    if shown != filename:
        raise UsageError(
            f"retrolog cannot record {shown}: its path holds bytes that are not UTF-8 text, "
            "and a run's script is kept and replayed by its path as text. Rename the file "
            "(or its directory) to a UTF-8 name and run it again; nothing was recorded."
        )


def _relative_script(root: Path, script: str | None) -> str:
    if not script or script in {"-c", "-"} or script.startswith("<"):
        return "<interactive>"
    path = Path(script).resolve()
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


_INTERESTING_PACKAGES = (
    "retrolog",
    "torch",
    "numpy",
    "pandas",
    "scikit-learn",
    "scipy",
    "transformers",
    "jax",
    "tensorflow",
    "lightning",
    "pytorch-lightning",
    "torchvision",
    "accelerate",
)


def _package_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": sys.version.split()[0]}
    for name in _INTERESTING_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions
