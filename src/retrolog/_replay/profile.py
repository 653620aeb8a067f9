"""Run profiles: what replay planning knows about a recorded run, read from the store.

A :class:`RunProfile` is one run's outer loop, its checkpoints and its
record-time timings (prefix, each outer iteration and its block, the suffix);
the planner (plan.py) turns it into a cost model. :func:`load_profiles` reads
profiles from the metadata store, estimating what a crashed run did not record
and saying so in ``notes``; :func:`measure_restore_throughput` times the decode
of one real checkpoint, so that restores can be costed by their bytes.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from retrolog.errors import RunNotFoundError, StoreError
from retrolog.runtime.crash import Crash
from retrolog.store.objects import ForwardingStore, ObjectStore

__all__ = ["RunProfile", "load_profiles", "measure_restore_throughput"]


@dataclass(frozen=True)
class RunProfile:
    """What the planner knows about one recorded run: its loop, checkpoints and timings.

    Iterations are the outer loop's, 0-based. ``block_seconds[i]`` equals
    ``iteration_seconds[i]`` when iteration i had no nested loop (the whole
    iteration is its block).
    """

    run_id: str
    filename: str
    status: str
    outer_loop: str | None
    iterations: int
    block_checkpoints: dict[int, str]  # outer iteration -> manifest key
    end_checkpoint: str | None
    prefix_seconds: float
    suffix_seconds: float
    iteration_seconds: tuple[float, ...]
    block_seconds: tuple[float, ...]
    checkpoint_bytes: dict[int, int]  # outer iteration -> bytes of its block checkpoint
    code_version: str | None = None  # short commit of the run's code
    # capture + write time of each block checkpoint: the restore estimate when no
    # throughput was measured (restore ~ materialize, Flor's c = 1)
    checkpoint_seconds: dict[int, float] = field(default_factory=dict)
    # Checkpoint time recording spent on the training thread inside iteration i's
    # recorded seconds (a nested block is captured inside its iteration); replay
    # does not checkpoint, so the estimate leaves it out. The snapshot only for a
    # background checkpoint (its writing ran on another thread), capture + write for
    # a synchronous one.
    record_overhead_seconds: dict[int, float] = field(default_factory=dict)
    nested_block: tuple[bool, ...] | None = None  # None: iteration i is nested iff block < total
    end_checkpoint_bytes: int = 0
    end_checkpoint_seconds: float = 0.0  # capture + write of the end checkpoint
    end_record_overhead_seconds: float = 0.0  # of that, inside the recorded post + suffix
    pre_outer_seconds: float = 0.0  # other top-level loops between the prefix and the outer loop
    post_outer_seconds: float = 0.0  # other top-level loops between the outer loop and the suffix
    # What recording added to the prefix and replay does not repeat (capturing the code
    # version, registering the run): a profile row "setup", when the recording wrote one.
    setup_seconds: float = 0.0
    threads: int | None = None  # torch intra-op threads at record time (profile row "threads")
    # The prefix up to the script's first retrolog call: interpreter start and imports,
    # the same work in every run of a script (the planner pools it over runs).
    imports_seconds: float | None = None
    # Of the rest of the prefix, what importing installed packages took (profile row
    # "late_imports", runtime/import_clock.py): a forked replay worker repeats neither.
    late_imports_seconds: float | None = None
    notes: tuple[str, ...] = ()  # what loading the profile had to guess
    # Outer iterations whose checkpoint cannot restore what the block changed (a named
    # object's attribute it could not carry, runtime/frames.py), and why: not in
    # block_checkpoints, so their blocks are executed.
    unrestorable: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.iterations
        if len(self.iteration_seconds) != n or len(self.block_seconds) != n:
            raise ValueError(
                f"run {self.run_id}: {n} iterations but {len(self.iteration_seconds)} iteration "
                f"and {len(self.block_seconds)} block timings"
            )
        if self.nested_block is not None and len(self.nested_block) != n:
            raise ValueError(f"run {self.run_id}: nested_block has the wrong length")
        outside = [i for i in self.block_checkpoints if not 0 <= i < n]
        if outside:
            raise ValueError(f"run {self.run_id}: checkpoints for iterations {outside} of {n}")

    def is_nested(self, i: int) -> bool:
        """Whether iteration i's block is a nested loop (else the whole iteration is the block)."""
        if self.nested_block is not None:
            return self.nested_block[i]
        return self.block_seconds[i] < self.iteration_seconds[i]


# -- loading profiles ------------------------------------------------------------------


def load_profiles(conn: sqlite3.Connection, run_ids: Sequence[str]) -> list[RunProfile]:
    """Read the runs' loops, checkpoints and timing profile from the store.

    Raises RunNotFoundError for an id that is not in the store.
    """
    try:
        return [_load_profile(conn, run_id) for run_id in run_ids]
    except sqlite3.Error as exc:
        raise StoreError(f"Cannot read the timing profile from the store: {exc}.") from exc


@dataclass
class _LoopRow:
    ctx: int
    name: str
    depth: int
    t_start: float
    t_end: float | None


# ctx -> (manifest, bytes, capture + write seconds, training-thread seconds)
_Checkpoint = tuple[str, int, float, float]


def _load_profile(conn: sqlite3.Connection, run_id: str) -> RunProfile:
    filename, status, commit, started_at, ended_at, notes = _run_row(conn, run_id)
    loops, with_children = _loop_rows(conn, run_id)
    checkpoints, end, checkpoint_loops, blocked = _checkpoint_rows(conn, run_id)
    phases, iteration_rows = _profile_rows(conn, run_id)

    top = [r for r in loops if r.depth == 0]
    outer = _outer_loop_name(checkpoint_loops, top, iteration_rows)
    candidates = [r for r in loops if r.name == outer]
    depth = min((r.depth for r in candidates), default=0)
    outer_rows = [r for r in candidates if r.depth == depth]
    if depth > 0:
        notes.append(f"loop {outer!r} is nested in another loop: the estimate is rough")
    seconds, blocks, nested = _iteration_times(outer_rows, iteration_rows, with_children, notes)
    if status == "crashed":
        checkpoints, end = _without_unfinished(outer_rows, checkpoints, end, notes)

    index = {r.ctx: i for i, r in enumerate(outer_rows)}
    unrestorable = {index[c]: why for c, why in blocked.items() if c in index}
    if None in blocked:
        notes.append(f"the end checkpoint cannot hold {blocked[None]}: not restored")
    block_checkpoints = {index[c]: m for c, (m, _, _, _) in checkpoints.items() if c in index}
    overhead = {
        index[c]: t for c, (_, _, _, t) in checkpoints.items() if c in index and nested[index[c]]
    }
    end_overhead = end[3] if end else 0.0
    # Recording set up its checkpointer (imports, the writer thread) where the first block
    # ended: inside iteration 0 when that block is a nested loop, else after it ends.
    checkpoint_setup = phases.get("checkpoint_setup", 0.0)
    if nested and nested[0]:
        overhead[0] = overhead.get(0, 0.0) + checkpoint_setup
    elif not nested:
        end_overhead += checkpoint_setup
    prefix, imports, suffix = _prefix_and_suffix(phases, top, started_at, ended_at, notes)
    pre, post = _around_outer(outer_rows, top)

    return RunProfile(
        run_id=run_id,
        filename=filename,
        status=status,
        outer_loop=outer,
        iterations=len(outer_rows),
        block_checkpoints=block_checkpoints,
        end_checkpoint=end[0] if end else None,
        prefix_seconds=prefix,
        suffix_seconds=suffix,
        iteration_seconds=tuple(seconds),
        block_seconds=tuple(blocks),
        checkpoint_bytes={index[c]: b for c, (_, b, _, _) in checkpoints.items() if c in index},
        code_version=commit[:12] if commit else None,
        checkpoint_seconds={index[c]: s for c, (_, _, s, _) in checkpoints.items() if c in index},
        record_overhead_seconds=overhead,
        nested_block=tuple(nested),
        end_checkpoint_bytes=end[1] if end else 0,
        end_checkpoint_seconds=end[2] if end else 0.0,
        end_record_overhead_seconds=end_overhead,
        pre_outer_seconds=pre,
        post_outer_seconds=post,
        setup_seconds=phases.get("setup", 0.0),
        imports_seconds=imports,
        late_imports_seconds=phases.get("late_imports"),
        threads=int(phases["threads"]) if phases.get("threads") else None,
        notes=tuple(notes),
        unrestorable=unrestorable,
    )


def _run_row(
    conn: sqlite3.Connection, run_id: str
) -> tuple[str, str, str | None, float, float | None, list[str]]:
    """The run's file, status, commit, start and end, and the note a crashed run gets."""
    row = conn.execute(
        "SELECT filename, status, code_commit, started_at, ended_at, error FROM runs"
        " WHERE run_id = ?",
        (run_id,),
    ).fetchone()
    if row is None:
        raise RunNotFoundError(
            f'No run {run_id!r} in the store; `retrolog query "SELECT run_id FROM runs"` '
            "lists the runs there are.",
            run_id=run_id,
        )
    filename, status, commit, started_at, ended_at, error = row
    notes: list[str] = []
    if status == "crashed":
        crash = Crash.parse(error)
        if crash is None:
            notes.append("the run crashed: its replay is expected to stop where it did")
        else:
            at = f" at {crash.file}:{crash.line}" if crash.file is not None else ""
            notes.append(f"the run raised {crash.type}{at}: its replay is expected to stop there")
    return filename, status, commit, started_at, ended_at, notes


def _loop_rows(conn: sqlite3.Connection, run_id: str) -> tuple[list[_LoopRow], set[int]]:
    """The run's top-level loops and those one level down, and the contexts with a loop
    inside them."""
    loops = [
        _LoopRow(ctx, name, depth, t_start, t_end)
        for ctx, name, depth, t_start, t_end in conn.execute(
            "SELECT ctx_id, name, depth, t_start, t_end FROM loops"
            " WHERE run_id = ? AND depth <= 1 ORDER BY ctx_id",
            (run_id,),
        )
    ]
    with_children = {
        parent
        for (parent,) in conn.execute(
            "SELECT DISTINCT parent_ctx FROM loops WHERE run_id = ? AND parent_ctx IS NOT NULL",
            (run_id,),
        )
    }
    return loops, with_children


def _checkpoint_rows(
    conn: sqlite3.Connection, run_id: str
) -> tuple[dict[int, _Checkpoint], _Checkpoint | None, list[str], dict[int | None, str]]:
    """The run's restorable block checkpoints by context, its end checkpoint, every
    checkpoint's loop name in order, and what the others cannot restore (None: the end)."""
    checkpoints: dict[int, _Checkpoint] = {}
    end: _Checkpoint | None = None
    checkpoint_loops: list[str] = []
    # A background checkpoint (writer CPU measured) cost the training thread its
    # snapshot only; a synchronous one (no writer, NULL) its capture and its write.
    has_writer = _has_column(conn, "checkpoints", "writer_cpu_seconds")
    writer_cpu = "writer_cpu_seconds" if has_writer else "NULL"
    blocked: dict[int | None, str] = {}  # ctx (None: the end) -> what it cannot restore
    locals_column = "frame_locals" if _has_column(conn, "checkpoints", "frame_locals") else "NULL"
    for ctx, loop_name, kind, manifest, nbytes, capture, write, background, blob in conn.execute(
        "SELECT ctx_id, loop_name, kind, manifest, nbytes, capture_seconds, write_seconds,"
        f" {writer_cpu} IS NOT NULL, {locals_column} FROM checkpoints WHERE run_id = ?"
        " ORDER BY checkpoint_id",
        (run_id,),
    ):
        checkpoint_loops.append(loop_name)
        why = _cannot_restore(blob)
        if why:
            blocked[None if kind == "end" else ctx] = why
            continue
        on_thread = capture if background else capture + write
        if kind == "end":
            end = (manifest, nbytes, capture + write, on_thread)
        elif ctx is not None:
            checkpoints[ctx] = (manifest, nbytes, capture + write, on_thread)
    return checkpoints, end, checkpoint_loops, blocked


def _profile_rows(
    conn: sqlite3.Connection, run_id: str
) -> tuple[dict[str, float], dict[int, tuple[float, float]]]:
    """The run's phase timings (prefix, suffix, setup, ...) and each iteration's seconds
    and block seconds by context."""
    phases: dict[str, float] = {}
    iteration_rows: dict[int, tuple[float, float]] = {}
    for phase, ctx, seconds, block in conn.execute(
        "SELECT phase, ctx_id, seconds, block_seconds FROM profile WHERE run_id = ?", (run_id,)
    ):
        if phase == "iteration" and ctx is not None:
            iteration_rows[ctx] = (seconds, seconds if block is None else block)
        elif phase in ("prefix", "suffix", "setup", "threads", "checkpoint_setup", "late_imports"):
            phases[phase] = seconds
    return phases, iteration_rows


def _iteration_times(
    outer_rows: list[_LoopRow],
    iteration_rows: dict[int, tuple[float, float]],
    with_children: set[int],
    notes: list[str],
) -> tuple[list[float], list[float], list[bool]]:
    """Each outer iteration's seconds, block seconds and whether its block is a nested
    loop; an iteration without timing gets the others' mean, said in ``notes``."""
    seconds, blocks, nested, missing = [], [], [], 0
    for r in outer_rows:
        if r.ctx in iteration_rows:
            total, block = iteration_rows[r.ctx]
        elif r.t_end is not None:
            total = block = r.t_end - r.t_start
        else:
            total = block = math.nan
            missing += 1
        seconds.append(total)
        blocks.append(block)
        nested.append(r.ctx in with_children or block < total)
    if missing:
        known = [(s, b) for s, b in zip(seconds, blocks, strict=True) if not math.isnan(s)]
        mean_s = sum(s for s, _ in known) / len(known) if known else 0.0
        mean_b = sum(b for _, b in known) / len(known) if known else 0.0
        seconds = [mean_s if math.isnan(s) else s for s in seconds]
        blocks = [mean_b if math.isnan(b) else b for b in blocks]
        notes.append(
            f"{missing} iteration(s) have no timing (unfinished when the run ended): "
            "estimated as the mean of the others"
        )
    return seconds, blocks, nested


def _without_unfinished(
    outer_rows: list[_LoopRow],
    checkpoints: dict[int, _Checkpoint],
    end: _Checkpoint | None,
    notes: list[str],
) -> tuple[dict[int, _Checkpoint], _Checkpoint | None]:
    """A crashed run's checkpoints without those of iterations that never ended."""
    # A loop an exception leaves ends there, and checkpoints the state it was left in
    # as if its block, or the loop, had ended: restoring one would skip the failing
    # code, where a crashed run's replay is expected to stop. The iterations that never
    # ended are executed instead, and the end is not restored while one never ended.
    unfinished = {r.ctx for r in outer_rows if r.t_end is None}
    left = sum(1 for c in checkpoints if c in unfinished) + int(bool(unfinished and end))
    checkpoints = {c: v for c, v in checkpoints.items() if c not in unfinished}
    if unfinished:
        end = None
    if left:
        notes.append(
            f"{left} checkpoint(s) taken as the run stopped inside its loop are not "
            "restored: the iteration it stopped in is executed"
        )
    return checkpoints, end


def _prefix_and_suffix(
    phases: dict[str, float],
    top: list[_LoopRow],
    started_at: float,
    ended_at: float | None,
    notes: list[str],
) -> tuple[float, float | None, float]:
    """The prefix's seconds, the part of it before the first retrolog call (None when not
    known) and the suffix's seconds; what had to be estimated, said in ``notes``."""
    imports: float | None = None
    if "prefix" in phases:
        prefix = phases["prefix"]
        if top:
            # Loop times count from the script's first retrolog call: what came before it
            # is the interpreter, the imports and whatever the script did first.
            imports = min(max(prefix - top[0].t_start, 0.0), prefix)
    elif top:
        prefix = top[0].t_start
        notes.append(
            "no prefix timing (the process died): taken from the run's start to its first "
            "loop, without interpreter start-up"
        )
    else:
        prefix = (ended_at - started_at) if ended_at is not None else 0.0
        notes.append("no loop was recorded: the whole script is its prefix")
    suffix = phases.get("suffix", 0.0)
    if "suffix" not in phases and top:
        notes.append("no suffix timing (the process died): counted as 0")
    return prefix, imports, suffix


def _around_outer(outer_rows: list[_LoopRow], top: list[_LoopRow]) -> tuple[float, float]:
    """The seconds other top-level loops took before the outer loop and after it."""
    pre = post = 0.0
    if outer_rows and top:
        pre = max(outer_rows[0].t_start - top[0].t_start, 0.0)
        last_end = outer_rows[-1].t_end
        ends = [r.t_end for r in top if r.t_end is not None]
        if last_end is not None and ends:
            post = max(max(ends) - last_end, 0.0)
    return pre, post


def _cannot_restore(blob: bytes | None) -> str | None:
    """What a checkpoint's block changed that it could not carry (runtime/frames.py)."""
    from retrolog.runtime import frames

    if not blob:
        return None
    try:
        _, blocked = frames.load_attrs(bytes(blob))
    except StoreError:
        return None  # the worker finds it unreadable and executes the block
    return frames.describe_blocked(blocked) or None


def _has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    return any(row[1] == column for row in conn.execute(f"PRAGMA table_info({table})"))


def _outer_loop_name(
    checkpoint_loops: list[str],
    top: list[_LoopRow],
    iteration_rows: Mapping[int, tuple[float, float]],
) -> str | None:
    """The checkpointed loop; without checkpoints, the top-level loop that took longest."""
    if checkpoint_loops:
        return max(set(checkpoint_loops), key=checkpoint_loops.count)
    if not top:
        return None
    totals: dict[str, float] = {}
    for r in top:
        spent = iteration_rows.get(r.ctx, (0.0, 0.0))[0]
        totals[r.name] = totals.get(r.name, 0.0) + spent
    return max(totals, key=lambda name: totals[name])


# -- restore throughput ------------------------------------------------------------------


class _CountingStore(ForwardingStore):
    """Delegates reads and counts the bytes of the distinct objects read."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.sizes: dict[str, int] = {}

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.sizes[key] = len(data)
        return data

    @contextlib.contextmanager
    def view(self, key: str) -> Iterator[memoryview]:
        with self.inner.view(key) as data:  # as the restore reads: mapped, not copied
            self.sizes[key] = data.nbytes
            yield data


def measure_restore_throughput(store_root: Path, manifest: str) -> float:
    """Bytes per second at which a real checkpoint decodes, for the restore estimate.

    store_root: the store directory (``.retrolog``, holding ``objects/``).
    manifest: the manifest key of one of the checkpoints to be restored.

    Pass ``1 / throughput`` to :func:`plan_replay` as ``restore_seconds_per_byte``.
    """
    from retrolog.checkpoint.capture import forget_decoded, load_checkpoint
    from retrolog.store.backends import object_store_for

    store = _CountingStore(object_store_for(store_root))
    modules = len(sys.modules)
    started = time.perf_counter()
    load_checkpoint(store, manifest)
    elapsed = time.perf_counter() - started
    if len(sys.modules) > modules:
        # The first decode imported something (torch: a second or more), which a worker
        # pays once in its prefix, not per restore: time a second decode (from the page
        # cache, so a little optimistic for a cold disk), with no array cached by the first.
        forget_decoded()
        store.sizes.clear()
        started = time.perf_counter()
        load_checkpoint(store, manifest)
        elapsed = time.perf_counter() - started
    return sum(store.sizes.values()) / max(elapsed, 1e-9)
