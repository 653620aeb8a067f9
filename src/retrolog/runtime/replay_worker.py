"""The runtime of a replay worker: the script runs again, in its own code version.

``retrolog replay`` starts each worker as ``python <script> <original argv>``
in a temporary checkout, with ``RETROLOG_REPLAY_SPEC`` naming a JSON
:class:`WorkerSpec`. When that variable is set, the first recording call makes
a :class:`ReplayRun` instead of a recording :class:`~retrolog.runtime.run.Run`:

- nothing is recorded as a new run: values go to the spec's output file,
  keyed by the *recorded* context they belong to (mapped by loop name,
  occurrence and iteration under the same parent), and the coordinator
  backfills them;
- ``arg()`` returns the run's historical values;
- the OUTER loop under ``checkpointing`` follows the segment: a block whose
  iteration is in ``restore`` is not executed; its checkpoint is restored into
  the live objects (and RNG states) where the block ended, so the code after
  it sees what it saw during record (pseudo-resume); ``restore_end`` skips the
  whole loop by restoring the end checkpoint; after ``stop_after`` the worker
  writes its output and exits.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import socket
import sqlite3
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from retrolog.runtime import cli_args, frames, numerics
from retrolog.runtime.crash import Crash
from retrolog.runtime.run import (
    NO_OVERRIDE,
    CheckpointScope,
    EventLoops,
    Role,
    Status,
    _Frame,
    loop_role,
)
from retrolog.runtime.values import FAST_TYPES, slow_path, storage_form

SPEC_ENV = "RETROLOG_REPLAY_SPEC"
_UNMAPPED = -1  # a context the recorded run does not have (values there are dropped, counted)


@dataclass
class WorkerSpec:
    """What one replay worker does: one segment of one run."""

    replay_id: str
    run_id: str
    store: str  # the store directory (objects/ and retrolog.db)
    names: list[str]  # hindsight names to backfill
    check_names: list[str]  # recorded names recomputed here: compared afterwards
    args: dict[str, Any]  # the run's recorded arg() values
    outer_loop: str | None
    block_checkpoints: dict[str, str]  # outer iteration (as str, JSON keys) -> manifest
    end_checkpoint: str | None
    restore: list[int]  # outer iterations whose block is restored instead of executed
    whole_iterations: list[int]  # outer iterations with no nested loop: the iteration is the block
    stop_after: int | None  # exit after this outer iteration ends
    restore_end: bool  # skip the outer loop by restoring the end checkpoint
    prefix_only: bool  # exit when the first top-level loop starts
    output: str  # JSON file the worker writes
    code_object: str | None = None
    # What a worker of another retrolog version may ignore. "crash_within", for a run an
    # exception ended: the recorded context it was raised in and the ones that context is
    # in, innermost first (empty: outside the loops); the worker says whether it went past
    # that place without raising.
    extra: dict[str, Any] = field(default_factory=dict)
    # Torch threads and flags to apply as soon as torch is imported (runtime/numerics.py):
    # the recorded ones, or the thread count the user asked for instead.
    torch_state: dict[str, Any] = field(default_factory=dict)
    parsed_args: dict[str, Any] = field(default_factory=dict)  # recorded argparse/click values
    # Variables the statements of names and check_names read: a checkpoint that does not
    # hold one of them (a large local) is not restored; its block executes instead.
    reads: list[str] = field(default_factory=list)
    # The worker's checkout and the user's project: writes through the checkout's links
    # into the project are made private to the checkout (runtime/isolation.py).
    checkout: str | None = None
    # The database the coordinator reads, when it is not <store>/retrolog.db: a replay of
    # a PostgreSQL store reads a working copy of the runs it replays (_replay/working_copy.py).
    database: str | None = None
    project: str | None = None
    # Where the checkpoint objects are: the coordinator's RETROLOG_OBJECTS_URL, which the
    # worker's environment (RETROLOG_ variables removed) does not carry; None: objects/.
    objects: str | None = None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str) -> WorkerSpec:
        return cls(**json.loads(Path(path).read_text()))


# What could not be applied of the recorded numerical environment, for the output.
_NUMERICS_PROBLEMS: list[str] = []


def prepare_worker(spec_path: str) -> None:
    """At ``import retrolog`` in a replay worker: guard writes, set the recorded torch state.

    Writes through the checkout's links into the user's project are made private to
    the checkout from here on (runtime/isolation.py). The torch state is applied now if
    the script imported torch first, else right after torch's import, so the script's
    own code (which may set some of it again) runs in the recorded environment from
    its first torch call.
    """
    try:
        spec = json.loads(Path(spec_path).read_text())
    except (OSError, ValueError) as exc:
        _NUMERICS_PROBLEMS.append(f"cannot read the worker spec {spec_path}: {exc}")
        return
    if spec.get("checkout") and spec.get("project"):
        from retrolog.runtime import isolation

        isolation.install(
            Path(spec["checkout"]), Path(spec["project"]), allowed=[Path(spec["store"])]
        )
    wanted = spec.get("torch_state") or {}
    if wanted:
        numerics.apply_in_worker(wanted, _NUMERICS_PROBLEMS)


class ReplayRun:
    """A replay worker's stand-in for Run, with the same surface for the public calls."""

    def __init__(self, spec: WorkerSpec) -> None:
        from collections import deque

        self.spec = spec
        self.run_id = spec.run_id
        self.args: dict[str, Any] = {}
        self.parsed_args: dict[str, Any] = {}
        self.status = Status.RUNNING
        self.ctx: int | None = None
        self.scope: CheckpointScope | None = None
        self._stack: list[_Frame] = []
        self.event_loops = EventLoops(self)
        self.volatile: set[str] = set()
        self.values: deque[tuple[Any, ...]] = deque()
        self.events: deque[tuple[Any, ...]] = deque()
        self._pid = os.getpid()
        self._wanted = set(spec.names) | set(spec.check_names)
        whole = set(spec.whole_iterations)
        self._restore = set(spec.restore) - whole  # restored where the nested loop would run
        self._restore_whole = set(spec.restore) & whole  # the iteration is skipped whole
        self._last_checkpoint: str | None = None
        # (values queued, events queued, manifest) at each restore: a value's checkpoint is the
        # last one restored before it was logged.
        self._checkpoint_at: list[tuple[int, int, str]] = []
        self._started = time.perf_counter()
        # A worker that runs the script to its end then finalizes the interpreter, whose
        # last garbage collection over every object took 0.7-1.1 s with torch imported
        # (docs/replay-planning.md, "What a worker adds"). The worker is ending: skip it.
        # Registered after retrolog's own exit hook, so it runs first.
        atexit.register(gc.freeze)
        self._restore_seconds = 0.0
        self._restored = 0
        self._restored_where: list[str] = []  # for the diagnosis of a failure
        self._diagnosis: str | None = None
        self._outer_iteration: int | None = None
        database = Path(spec.database or Path(spec.store) / "retrolog.db")
        self._contexts = _load_contexts(database, spec.run_id)
        self._frame_locals = _load_frame_locals(database, spec.run_id)
        self._fallbacks: list[list[str]] = []  # [manifest, why] of checkpoints executed instead
        self._reads = set(spec.reads)
        self._occurrences: dict[tuple[int | None, str], int] = {}
        self._outer_seen = False
        # (values, events) queued when the first top-level loop began: a run-level value
        # queued after it is one a crashed run may never have got to.
        self._loop_mark: tuple[int, int] | None = None
        # Iterations begun and not ended, in the order they began (a counter -> the recorded
        # context): the newest is where an exception that ends the script was raised.
        self._open: dict[int, int] = {}
        self._begun = 0
        self._crash: Crash | None = None
        within = spec.extra.get("crash_within")
        self._crash_within = frozenset(within or ())
        self._passed_crash = False
        self._stopping = False  # the segment ended it (finish), not the script
        self._store: Any = None
        self._prefetch: Any = None
        self.writer = None
        self._torch_ran: dict[str, Any] | None = None  # torch's state when training started
        if "torch" in sys.modules:  # the checkpoints' tensors can be made off this thread now
            self._start_prefetch()

    def _start_prefetch(self) -> None:
        """Read and decode the checkpoints this segment restores, ahead, in their order."""
        if self._prefetch is not None:
            return
        from retrolog.checkpoint.prefetch import Prefetcher
        from retrolog.store.backends import object_store_for

        spec = self.spec
        if spec.restore_end:
            order = [spec.end_checkpoint]
        else:
            order = [spec.block_checkpoints.get(str(i)) for i in sorted(spec.restore)]
        self._store = object_store_for(Path(spec.store), spec.objects)
        self._prefetch = Prefetcher(self._store, [m for m in order if m])
        self._prefetch.start()

    # -- the public calls ------------------------------------------------------------

    def resolve_arg(self, name: str, default: Any, override: Any) -> Any:
        if name in self.spec.args:
            return self.spec.args[name]
        return default if override is NO_OVERRIDE else override

    def set_arg(self, name: str, value: Any) -> None:
        self.args[name] = value
        self.parsed_args.pop(name, None)

    def set_parsed_args(self, values: Mapping[str, Any]) -> None:
        # Not logged again: reported, for the deferred check against the recorded ones.
        self.parsed_args.update({k: v for k, v in values.items() if k not in self.args})

    def log(self, name: str, value: Any, *, run_level: bool = False) -> None:
        ctx = None if run_level else self.ctx
        if type(value) in FAST_TYPES:
            self.values.append((ctx, name, value))
        else:
            stored, kind = slow_path(value, name=name)
            self.events.append((ctx, name, stored, kind))

    def loop(self, name: str, iterable: Iterable[Any], *, events: bool = False) -> Iterator[Any]:
        # An event-driven loop (events=True) is never skipped from inside: its caller asks
        # restore_block() before the code it would skip, and skips that code itself.
        stack = self._stack
        depth = len(stack)
        parent_ctx = self.ctx
        outer = stack[-1] if stack else None
        scope = self.scope
        role, _ = loop_role(stack, scope)
        if depth == 0:
            self._top_level_loop_starts()
        key = (parent_ctx, name)
        occurrence = self._occurrences.get(key, -1) + 1
        self._occurrences[key] = occurrence
        frame = _Frame(name, depth, role)
        # The script's frame running this loop: a restored checkpoint puts back the
        # locals the skipped code set there (runtime/frames.py).
        user_frame = None if role is Role.PLAIN or events else frames.script_frame(sys._getframe(1))

        if not events and self._skipped_by_restore(role, outer, scope, user_frame):
            return
        if role is Role.OUTER:
            self._outer_seen = True

        stack.append(frame)
        contexts = self._contexts
        try:
            for iteration, item in enumerate(iterable):
                if parent_ctx == _UNMAPPED:
                    ctx = _UNMAPPED
                else:
                    ctx = contexts.get((parent_ctx, name, occurrence, iteration), _UNMAPPED)
                frame.ctx = ctx
                frame.block_seen = False
                frame.iteration = iteration
                self.ctx = ctx
                if role is Role.OUTER:
                    self._outer_iteration = iteration
                self._begun += 1
                began = self._begun
                self._open[began] = ctx
                if (
                    role is Role.OUTER
                    and not events
                    and iteration in self._restore_whole
                    and self._restore_checkpoint(
                        self.spec.block_checkpoints.get(str(iteration)),
                        scope,
                        user_frame,
                        ("block", ctx),
                    )
                ):
                    # No nested loop: the whole iteration is the block, skipped by restoring.
                    self.ctx = parent_ctx
                    del self._open[began]
                    if ctx in self._crash_within:
                        self._passed_crash = True
                    if self.spec.stop_after == iteration:
                        self.finish()
                    continue
                yield item
                self.ctx = parent_ctx
                del self._open[began]
                if ctx in self._crash_within:  # that iteration (or one it is in) ended
                    self._passed_crash = True
                if role is Role.OUTER and self.spec.stop_after == iteration:
                    self.finish()
        finally:
            stack.pop()
            self.ctx = parent_ctx
            user_frame = None

    def _top_level_loop_starts(self) -> None:
        """At a top-level loop's start: the prefix's output marked, checkpoints read ahead,
        the script's parsed flags and torch's state taken (once each); a worker that
        replays the prefix alone finishes here."""
        if self._loop_mark is None:
            self._loop_mark = (len(self.values), len(self.events))
        if self._prefetch is None:
            self._start_prefetch()
        if self._torch_ran is None:
            self.set_parsed_args(cli_args.click_params())
            torch = sys.modules.get("torch")
            self._torch_ran = numerics.torch_state(torch) if torch is not None else {}
        if self.spec.prefix_only:
            self.finish()

    def _skipped_by_restore(
        self,
        role: Role,
        outer: _Frame | None,
        scope: CheckpointScope | None,
        user_frame: FrameType | None,
    ) -> bool:
        """Whether the loop starting is skipped by restoring a checkpoint: the outer loop's
        end checkpoint, or the block checkpoint of the outer iteration it is the block of."""
        if role is Role.OUTER and self.spec.restore_end and not self._outer_seen:
            self._outer_seen = True
            if self._restore_checkpoint(self.spec.end_checkpoint, scope, user_frame, ("end", None)):
                return True
            # The end checkpoint is unreadable: step through the loop instead.
        if role is Role.BLOCK and outer is not None:
            iteration_of_outer = outer.iteration
            if iteration_of_outer in self._restore:
                manifest = self.spec.block_checkpoints.get(str(iteration_of_outer))
                if self._restore_checkpoint(manifest, scope, user_frame, ("block", outer.ctx)):
                    return True
                # Unreadable: the block executes, from the state the earlier ones left.
        return False

    # -- checkpoints -----------------------------------------------------------------

    def restore_block(self) -> bool:
        """Restore the coming block when this segment restores it; True if it did.

        Asked before the outer loop's first iteration, it restores the end checkpoint
        when the segment skips the whole loop; asked in an outer iteration before its
        nested loop began, it restores that iteration's block. The caller then skips
        the code the checkpoint stands for (the loop, or the iteration's block).
        """
        scope = self.scope
        if scope is None:
            return False
        stack = self._stack
        if len(stack) == scope.depth:
            if not self.spec.restore_end or self._outer_seen:
                return False
            self._outer_seen = True
            return self._restore_checkpoint(self.spec.end_checkpoint, scope, None, ("end", None))
        if len(stack) != scope.depth + 1:
            return False
        outer = stack[-1]
        if outer.role is not Role.OUTER or outer.block_seen:
            return False
        iteration = outer.iteration
        if iteration not in self._restore and iteration not in self._restore_whole:
            return False
        manifest = self.spec.block_checkpoints.get(str(iteration))
        if not self._restore_checkpoint(manifest, scope, None, ("block", outer.ctx)):
            return False  # unreadable: the block executes, from the state the earlier ones left
        outer.block_seen = True
        return True

    def _restore_checkpoint(
        self,
        manifest: str | None,
        scope: CheckpointScope | None,
        user_frame: FrameType | None,
        key: tuple[str, int | None],
    ) -> bool:
        """Restore a checkpoint into the live objects, RNGs and frame; False if unreadable.

        An object that is missing or corrupt is found while decoding, before any live
        object changes, so the caller can execute the code instead, from the same state.
        """
        from retrolog.checkpoint.state import restore
        from retrolog.errors import StoreError

        if manifest is None or scope is None:
            raise RuntimeError(
                "retrolog replay: the plan asked to restore a checkpoint this run does not have"
            )
        self._start_prefetch()
        started = time.perf_counter()
        blob = self._frame_locals.get(key)
        try:
            values, not_captured = frames.load(blob)
            attrs, blocked = frames.load_attrs(blob)
        except StoreError as exc:
            self._fallbacks.append([manifest, f"its saved locals are not usable: {exc}"])
            return False
        if blocked:
            # Code after the block reads the named objects: one left as it was before the
            # block would make it compute something training never did.
            self._fallbacks.append([manifest, f"it cannot hold {frames.describe_blocked(blocked)}"])
            return False
        stale = sorted(set(not_captured) & self._reads)
        if stale:
            # The statement would read what the variable held before the skipped code.
            self._fallbacks.append(
                [manifest, f"it does not hold {', '.join(stale)}, which a statement reads"]
            )
            return False
        try:
            try:
                # Decoded ahead by the prefetcher (checkpoint/prefetch.py) while the code
                # before this point ran; what is left here is putting it into the live objects.
                restore(scope.objects, self._prefetch.take(manifest), thawed=True)
            except StoreError as exc:
                self._fallbacks.append([manifest, f"it cannot be read: {exc}"])
                print(
                    f"retrolog replay: checkpoint {manifest} cannot be read ({exc}); executing "
                    "that code instead of restoring it.",
                    file=sys.stderr,
                )
                return False
            frames.restore_attrs(scope.objects, attrs)
            frames.restore(user_frame, values)
            _mark_optimizers_stepped(scope.objects)
            self._restore_seconds += time.perf_counter() - started
        finally:
            # The next one is decoded from now on, while the code after the restore runs,
            # not during it (the frame's locals included), where it would take the GIL from
            # it: a thread that asks for the GIL back waits up to the switch interval, 5 ms.
            self._prefetch.release()
        self._restored += 1
        self._restored_where.append(self._iteration_of(manifest))
        self._checkpoint_at.append((len(self.values), len(self.events), manifest))
        self._last_checkpoint = manifest
        return True

    def _iteration_of(self, manifest: str) -> str:
        if manifest == self.spec.end_checkpoint:
            return "the end of the loop"
        found = [i for i, m in self.spec.block_checkpoints.items() if m == manifest]
        return f"iteration {found[0]}" if found else manifest

    def failed(self, exc: BaseException, tb: Any) -> None:
        """The script raised ``exc``: what went wrong, where, and what was restored before.

        Written to the output for the coordinator, which reports it instead of the
        worker's traceback.
        """
        import traceback

        where = ""
        for entry in reversed(traceback.extract_tb(tb)):
            if frames.is_script_file(entry.filename):
                code = f" ({entry.line.strip()})" if entry.line else ""
                where = f" at {Path(entry.filename).name}, line {entry.lineno}{code}"
                break
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        loop = self.spec.outer_loop or "the outer loop"
        during = (
            f" in {loop!r} iteration {self._outer_iteration}"
            if self._outer_iteration is not None
            else ""
        )
        if self._restored_where:
            restored = ", ".join(self._restored_where)
            self._diagnosis = (
                f"the script raised {message}{where}{during}, after the worker had restored "
                f"the checkpoints of {loop!r} {restored} instead of running those blocks. "
                "Code after a restored block sees what the checkpoint holds: the objects "
                "named in rl.checkpointing() (their state_dict and public plain attributes), "
                "the random states and the small local variables of the loop's frame. If "
                "that line reads other state the skipped block changed (an object not "
                "passed to rl.checkpointing(), an attribute whose name starts with an "
                "underscore, a global), pass that object (or a dict holding that state) to "
                "rl.checkpointing(); runs recorded from then on replay it."
            )
        else:
            self._diagnosis = (
                f"the script raised {message}{where}{during} before the worker restored any "
                "checkpoint, so the run's own code fails there in this replay: check what "
                "differs from the recording (a file the script reads, the propagated "
                "statements, the environment)."
            )

    # -- the end ---------------------------------------------------------------------

    def owned_by_this_process(self) -> bool:
        return os.getpid() == self._pid

    def crash_of(self, exc_type: Any, exc: Any, tb: Any) -> Crash:
        """The crash an uncaught exception makes; the checkout stands for the project."""
        return Crash.of(exc_type, exc, tb, Path(self.spec.checkout or os.getcwd()))

    def commit(
        self, status: Status = Status.FINISHED, error: str | None = None, crash: Crash | None = None
    ) -> None:
        if self.status is not Status.RUNNING:
            return
        self.status = status
        self._crash = crash
        if crash is not None:
            error = crash.text()
        elif "crash_within" in self.spec.extra and not self._stopping:
            self._passed_crash = True  # the script ran to its end
        self._write_output(status, error)

    def finish(self) -> None:
        """The segment is done: write the output and leave without running the rest."""
        self._stopping = True
        self.commit()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _after_loop_names(self) -> list[str]:
        """Names logged at run level (outside any loop) once the first top-level loop began."""
        if self._loop_mark is None:
            return []
        values, events = self._loop_mark
        found = {
            name for i, (ctx, name, _) in enumerate(self.values) if ctx is None and i >= values
        }
        found |= {
            name for i, (ctx, name, *_) in enumerate(self.events) if ctx is None and i >= events
        }
        return sorted(found & self._wanted)

    def _write_output(self, status: Status, error: str | None) -> None:
        wanted = self._wanted
        rows: list[list[Any]] = []
        dropped = 0
        marks = self._checkpoint_at
        for position, (ctx, name, value) in enumerate(self.values):
            if name not in wanted:
                continue
            if ctx == _UNMAPPED:
                dropped += 1
                continue
            stored, kind = storage_form(value)
            rows.append([ctx, name, stored, kind, _checkpoint_before(marks, 0, position)])
        for position, (ctx, name, stored, kind) in enumerate(self.events):
            if name not in wanted:
                continue
            if ctx == _UNMAPPED:
                dropped += 1
                continue
            rows.append([ctx, name, stored, kind, _checkpoint_before(marks, 1, position)])
        out = {
            "status": status.value,
            "error": error,
            "values": rows,
            "unmapped": dropped,
            "restored": self._restored,
            "fallbacks": self._fallbacks,
            "restore_seconds": self._restore_seconds,
            "prefetch": self._prefetch.figures() if self._prefetch is not None else None,
            "seconds": time.perf_counter() - self._started,
            "host": socket.gethostname(),  # the machine it ran on (a Ray node, this one)
            "last_checkpoint": self._last_checkpoint,
            "threads": _torch_threads(),
            "torch_state": self._torch_ran or {},
            "numerics_problems": list(_NUMERICS_PROBLEMS),
            "parsed_args": self.parsed_args,
            "after_loop": self._after_loop_names(),
            "diagnosis": self._diagnosis,
            "restored_before_failure": bool(self._diagnosis and self._restored_where),
            "volatile": sorted(self.volatile),
            "crash": self._crash_output(),
            "passed_crash": self._passed_crash,
        }
        path = Path(self.spec.output)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, path)

    def _crash_output(self) -> dict[str, Any] | None:
        """The exception that ended the script and the recorded context it was raised in
        (the newest unfinished one, -1 for one the run never began; None outside every
        loop), for the coordinator."""
        if self._crash is None:
            return None
        newest = self._open[max(self._open)] if self._open else None
        # _UNMAPPED: an iteration the recorded run never began.
        return {**asdict(self._crash), "ctx": newest}


def _torch_threads() -> int | None:
    """The intra-op threads torch ran with (the worker's OMP_NUM_THREADS unless the script
    set its own), or None when the script did not import torch."""
    torch = sys.modules.get("torch")
    get = getattr(torch, "get_num_threads", None)
    return int(get()) if callable(get) else None


def _mark_optimizers_stepped(objects: Mapping[str, object]) -> None:
    """Tell torch's LR schedulers that the restored optimizers did step.

    A scheduler warns "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" on its first step when the ``step`` wrapper it puts on
    its optimizer never ran in this process: the wrapper sets ``_opt_called``
    (torch/optim/lr_scheduler.py, ``patch_track_step_called``). A restored
    block did step its optimizers when it ran at record time, so the warning is
    wrong here; set the flag the wrapper would have set. Nothing else is muted.
    """
    torch = sys.modules.get("torch")  # a script that never imported torch has no optimizer
    optimizer_type = getattr(getattr(torch, "optim", None), "Optimizer", None)
    if not isinstance(optimizer_type, type):
        return
    for obj in objects.values():
        if isinstance(obj, optimizer_type):
            obj._opt_called = True  # type: ignore[attr-defined]


def _checkpoint_before(marks: list[tuple[int, int, str]], which: int, position: int) -> str | None:
    found = None
    for n_values, n_events, manifest in marks:  # few restores per segment: a scan is fine
        if (n_events if which else n_values) <= position:
            found = manifest
        else:
            break
    return found


def _load_frame_locals(database: Path, run_id: str) -> dict[tuple[str, int | None], bytes]:
    """The frame locals recorded with each checkpoint, keyed by (kind, outer-iteration ctx)."""
    conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT kind, ctx_id, frame_locals FROM checkpoints"
            " WHERE run_id = ? AND frame_locals IS NOT NULL",
            (run_id,),
        ).fetchall()
    finally:
        conn.close()
    return {(kind, None if kind == "end" else ctx): blob for kind, ctx, blob in rows}


def _load_contexts(database: Path, run_id: str) -> Mapping[tuple[int | None, str, int, int], int]:
    """Recorded contexts keyed by (parent, loop name, occurrence under parent, iteration)."""
    conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT ctx_id, parent_ctx, name, iteration FROM loops WHERE run_id = ?"
            " ORDER BY ctx_id",
            (run_id,),
        ).fetchall()
    finally:
        conn.close()
    occurrence: dict[tuple[int | None, str], int] = {}
    mapping: dict[tuple[int | None, str, int, int], int] = {}
    for ctx, parent, name, iteration in rows:
        key = (parent, name)
        if iteration == 0:
            occurrence[key] = occurrence.get(key, -1) + 1
        mapping[(parent, name, occurrence.get(key, 0), iteration)] = ctx
    return mapping
