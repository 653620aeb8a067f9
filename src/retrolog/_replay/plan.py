"""Replay planning: scan level, restored vs executed blocks, segments, and a cost estimate.

A plan says, for each past run, how a worker replays it (docs/replay-planning.md):
which scan level, which outer-loop iterations have their block restored from a
checkpoint and which execute it, and how an inner-loop scan is cut into
contiguous iteration ranges for parallel workers. The estimate comes from the
run's record-time profile (DESIGN.md, "Cost estimate")::

    prefix | pre | it 0: non-block + block | it 1 ... | it n-1 | post + suffix
                            ^ restored from its checkpoint, or executed

Times are the recorded ones minus what recording added and replay does not
repeat (checkpoint capture on the training thread). Restore time comes from a
measured decode throughput when the caller has one, else from the recorded
materialize time of that checkpoint (Flor's c = 1).
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import sqlite3
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from retrolog._replay.statements import Position, StatementSite
from retrolog.errors import RunNotFoundError, StoreError, UsageError
from retrolog.store.objects import ObjectStore


class ScanLevel(enum.IntEnum):
    """How much of a run a replay executes; higher levels execute more."""

    PREFIX = 0  # run until the first top-level loop starts, then stop
    SUFFIX = 1  # skip the outer loop by restoring the end checkpoint, run what follows
    OUTER_LOOP = 2  # step through the outer loop, restoring each block from its checkpoint
    INNER_LOOP = 3  # execute the blocks, split into iteration ranges across workers


_LEVEL_OF_POSITION = {
    Position.PREFIX: ScanLevel.PREFIX,
    Position.SUFFIX: ScanLevel.SUFFIX,
    Position.OUTER: ScanLevel.OUTER_LOOP,
    Position.INNER: ScanLevel.INNER_LOOP,
}


def scan_level_for(
    sites: Mapping[str, Sequence[StatementSite]],
) -> tuple[ScanLevel, tuple[str, ...]]:
    """The scan level the requested statements need (the deepest), and notes for the plan.

    The notes name the statements whose place could not be resolved (they were
    put at INNER_LOOP, which executes everything).
    """
    level = ScanLevel.PREFIX
    notes = []
    for name, found in sites.items():
        for site in found:
            level = max(level, _LEVEL_OF_POSITION[site.position])
            if site.note.startswith("could not resolve"):
                notes.append(f"{name!r} (line {site.line}): {site.note}")
    return level, tuple(notes)


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
    # does not checkpoint, so the estimate leaves it out.
    record_overhead_seconds: dict[int, float] = field(default_factory=dict)
    nested_block: tuple[bool, ...] | None = None  # None: iteration i is nested iff block < total
    end_checkpoint_bytes: int = 0
    end_checkpoint_seconds: float = 0.0  # capture + write of the end checkpoint
    end_record_overhead_seconds: float = 0.0  # of that, inside the recorded post + suffix
    pre_outer_seconds: float = 0.0  # other top-level loops between the prefix and the outer loop
    post_outer_seconds: float = 0.0  # other top-level loops between the outer loop and the suffix
    notes: tuple[str, ...] = ()  # what loading the profile had to guess

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


@dataclass(frozen=True)
class Segment:
    """One worker's share of one run's replay.

    The worker runs the script from the start. At the outer loop it restores
    the blocks in ``restore`` from their checkpoints and executes those in
    ``execute``; iterations whose block is restored still run their non-block
    code (pseudo-resume). It stops after iteration ``stop_after`` (None: it
    does not stop inside the loop), then runs the rest of the script when
    ``run_suffix``. Requested values of iterations [start, stop) come from this
    segment. With ``restore_end`` it skips the whole outer loop by restoring
    the end checkpoint (suffix scan). A segment with nothing to restore or
    execute, no suffix and no end restore stops where the first loop starts
    (prefix scan).
    """

    run_id: str
    start: int
    stop: int
    restore: tuple[int, ...]
    execute: tuple[int, ...]
    stop_after: int | None
    run_suffix: bool
    estimate_seconds: float
    restore_end: bool = False


@dataclass(frozen=True)
class RunPlan:
    """How one run is replayed, and its estimated cost (the sum of its segments)."""

    run_id: str
    scan: ScanLevel
    segments: tuple[Segment, ...]
    estimate_seconds: float  # worker-seconds: with one segment, also its wall time
    notes: tuple[str, ...]  # e.g. "3 of 6 blocks have no checkpoint: executed"
    profile: RunProfile | None = None  # what the plan was made from (manifest keys for workers)
    requested: ScanLevel | None = None  # the level asked for, when a fallback changed it


@dataclass(frozen=True)
class ReplayPlan:
    """Every run's plan and the estimated wall time on ``workers`` workers."""

    runs: tuple[RunPlan, ...]
    workers: int
    estimate_seconds: float  # wall time: segments packed onto workers, longest first
    schedule: tuple[tuple[Segment, ...], ...] = ()  # per worker, in the order to run them
    notes: tuple[str, ...] = ()  # plan-wide: unresolved statements, the restore model

    @property
    def work_seconds(self) -> float:
        """The sum of all segments' estimates (the wall time on one worker)."""
        return sum(run.estimate_seconds for run in self.runs)


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


def _load_profile(conn: sqlite3.Connection, run_id: str) -> RunProfile:
    row = conn.execute(
        "SELECT filename, status, code_commit, started_at, ended_at FROM runs WHERE run_id = ?",
        (run_id,),
    ).fetchone()
    if row is None:
        raise RunNotFoundError(
            f'No run {run_id!r} in the store; `retrolog query "SELECT run_id FROM runs"` '
            "lists the runs there are.",
            run_id=run_id,
        )
    filename, status, commit, started_at, ended_at = row
    notes: list[str] = []
    if status == "crashed":
        notes.append("the run crashed: its replay is expected to stop where it did")

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
    checkpoints: dict[int, tuple[str, int, float]] = {}  # ctx -> (manifest, bytes, seconds)
    end: tuple[str, int, float] | None = None
    checkpoint_loops: list[str] = []
    for ctx, loop_name, kind, manifest, nbytes, capture, write in conn.execute(
        "SELECT ctx_id, loop_name, kind, manifest, nbytes, capture_seconds, write_seconds"
        " FROM checkpoints WHERE run_id = ? ORDER BY checkpoint_id",
        (run_id,),
    ):
        checkpoint_loops.append(loop_name)
        if kind == "end":
            end = (manifest, nbytes, capture + write)
        elif ctx is not None:
            checkpoints[ctx] = (manifest, nbytes, capture + write)
    phases: dict[str, float] = {}
    iteration_rows: dict[int, tuple[float, float]] = {}
    for phase, ctx, seconds, block in conn.execute(
        "SELECT phase, ctx_id, seconds, block_seconds FROM profile WHERE run_id = ?", (run_id,)
    ):
        if phase == "iteration" and ctx is not None:
            iteration_rows[ctx] = (seconds, seconds if block is None else block)
        elif phase in ("prefix", "suffix"):
            phases[phase] = seconds

    top = [r for r in loops if r.depth == 0]
    outer = _outer_loop_name(checkpoint_loops, top, iteration_rows)
    candidates = [r for r in loops if r.name == outer]
    depth = min((r.depth for r in candidates), default=0)
    outer_rows = [r for r in candidates if r.depth == depth]
    if depth > 0:
        notes.append(f"loop {outer!r} is nested in another loop: the estimate is rough")

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

    index = {r.ctx: i for i, r in enumerate(outer_rows)}
    block_checkpoints = {index[c]: m for c, (m, _, _) in checkpoints.items() if c in index}
    overhead = {
        index[c]: s for c, (_, _, s) in checkpoints.items() if c in index and nested[index[c]]
    }

    if "prefix" in phases:
        prefix = phases["prefix"]
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

    pre = post = 0.0
    if outer_rows and top:
        pre = max(outer_rows[0].t_start - top[0].t_start, 0.0)
        last_end = outer_rows[-1].t_end
        ends = [r.t_end for r in top if r.t_end is not None]
        if last_end is not None and ends:
            post = max(max(ends) - last_end, 0.0)

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
        checkpoint_bytes={index[c]: b for c, (_, b, _) in checkpoints.items() if c in index},
        code_version=commit[:12] if commit else None,
        checkpoint_seconds={index[c]: s for c, (_, _, s) in checkpoints.items() if c in index},
        record_overhead_seconds=overhead,
        nested_block=tuple(nested),
        end_checkpoint_bytes=end[1] if end else 0,
        end_checkpoint_seconds=end[2] if end else 0.0,
        end_record_overhead_seconds=end[2] if end else 0.0,
        pre_outer_seconds=pre,
        post_outer_seconds=post,
        notes=tuple(notes),
    )


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


class _CountingStore(ObjectStore):
    """Delegates reads and counts the bytes of the distinct objects read."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.sizes: dict[str, int] = {}

    def put(self, data: bytes) -> str:
        return self.inner.put(data)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.sizes[key] = len(data)
        return data

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def measure_restore_throughput(store_root: Path, manifest: str) -> float:
    """Bytes per second at which a real checkpoint decodes, for the restore estimate.

    store_root: the store directory (``.retrolog``, holding ``objects/``).
    manifest: the manifest key of one of the checkpoints to be restored.

    Pass ``1 / throughput`` to :func:`plan_replay` as ``restore_seconds_per_byte``.
    """
    from retrolog.checkpoint.capture import load_checkpoint
    from retrolog.store.objects import LocalObjectStore

    store = _CountingStore(LocalObjectStore(store_root / "objects"))
    had_torch = "torch" in sys.modules
    started = time.perf_counter()
    load_checkpoint(store, manifest)
    elapsed = time.perf_counter() - started
    if not had_torch and "torch" in sys.modules:
        # The first decode imported torch, which a worker pays in its prefix: time a
        # second decode (from the page cache, so a little optimistic for a cold disk).
        store.sizes.clear()
        started = time.perf_counter()
        load_checkpoint(store, manifest)
        elapsed = time.perf_counter() - started
    return sum(store.sizes.values()) / max(elapsed, 1e-9)


# -- planning ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Costs:
    """One run's cost model, per outer iteration, in seconds."""

    head: float  # prefix + other loops before the outer loop
    tail: float  # other loops after it + suffix, without the end checkpoint's capture
    run: tuple[float, ...]  # iteration i with its block executed
    skip: tuple[float, ...]  # iteration i with its block restored when that is cheaper
    restorable: tuple[bool, ...]  # the block has a checkpoint that is cheaper to restore
    end_restore: float | None  # restoring the end checkpoint; None without one
    run_prefix: tuple[float, ...]  # run_prefix[i] = sum(run[:i])
    skip_prefix: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.run)

    def segment(self, a: int, b: int) -> float:
        """Pseudo-resume through iterations < a, execute [a, b), stop (or run the suffix)."""
        cost = self.head + self.skip_prefix[a] + self.run_prefix[b] - self.run_prefix[a]
        return cost + (self.tail if b == self.n else 0.0)


def _costs(profile: RunProfile, seconds_per_byte: float | None) -> _Costs:
    n = profile.iterations
    run, skip, restorable = [], [], []
    for i in range(n):
        total, block = profile.iteration_seconds[i], profile.block_seconds[i]
        if profile.is_nested(i):
            overhead = profile.record_overhead_seconds.get(i, 0.0)
            non_block = max(total - block - overhead, 0.0)
        else:
            non_block, block = 0.0, total
        restore = _restore_seconds(profile, i, seconds_per_byte)
        cheaper = restore is not None and restore <= block
        run.append(non_block + block)
        skip.append(non_block + (restore if cheaper and restore is not None else block))
        restorable.append(cheaper)
    end_restore = None
    if profile.end_checkpoint is not None:
        end_restore = (
            profile.end_checkpoint_bytes * seconds_per_byte
            if seconds_per_byte is not None
            else profile.end_checkpoint_seconds
        )
    tail = profile.post_outer_seconds + profile.suffix_seconds - profile.end_record_overhead_seconds
    return _Costs(
        head=profile.prefix_seconds + profile.pre_outer_seconds,
        tail=max(tail, 0.0),
        run=tuple(run),
        skip=tuple(skip),
        restorable=tuple(restorable),
        end_restore=end_restore,
        run_prefix=tuple(_prefix_sums(run)),
        skip_prefix=tuple(_prefix_sums(skip)),
    )


def _restore_seconds(profile: RunProfile, i: int, seconds_per_byte: float | None) -> float | None:
    if i not in profile.block_checkpoints:
        return None
    if seconds_per_byte is not None:
        return profile.checkpoint_bytes.get(i, 0) * seconds_per_byte
    return profile.checkpoint_seconds.get(i, 0.0)


def _prefix_sums(values: Sequence[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def plan_replay(
    levels: Mapping[str, ScanLevel] | ScanLevel,
    profiles: Sequence[RunProfile],
    workers: int,
    *,
    restore_seconds_per_byte: float | None = None,
    notes: Sequence[str] = (),
) -> ReplayPlan:
    """Plan the replay of ``profiles`` on ``workers`` workers and estimate its time.

    levels: the scan level per run id, or one level for every run.
    restore_seconds_per_byte: from :func:`measure_restore_throughput` (its
        inverse); without it a restore is estimated as the checkpoint's
        recorded capture + write time.
    notes: plan-wide notes to carry (e.g. from :func:`scan_level_for`).
    """
    if workers < 1:
        raise UsageError(f"A replay needs at least one worker, not {workers}.")
    if restore_seconds_per_byte is not None and not restore_seconds_per_byte >= 0:
        raise UsageError(
            f"restore_seconds_per_byte must be a non-negative number, not "
            f"{restore_seconds_per_byte!r}."
        )
    drafts = [
        _draft(profile, _level_of(levels, profile.run_id), restore_seconds_per_byte)
        for profile in profiles
    ]
    splits = _choose_splits(drafts, workers)
    runs = []
    for draft, k in zip(drafts, splits, strict=True):
        runs.append(draft.finish(k, workers))
    segments = [segment for run in runs for segment in run.segments]
    makespan, schedule = _pack(segments, workers)
    plan_notes = list(notes)
    if any(_uses_restores(run) for run in runs):
        if restore_seconds_per_byte is not None:
            rate = 1 / restore_seconds_per_byte if restore_seconds_per_byte else math.inf
            plan_notes.append(f"restore time from checkpoint size at {_rate(rate)} (measured)")
        else:
            plan_notes.append(
                "restore time taken as each checkpoint's recorded capture + write time "
                "(Flor's c = 1); measure_restore_throughput gives a closer estimate"
            )
    return ReplayPlan(
        runs=tuple(runs),
        workers=workers,
        estimate_seconds=makespan,
        schedule=schedule,
        notes=tuple(plan_notes),
    )


def _level_of(levels: Mapping[str, ScanLevel] | ScanLevel, run_id: str) -> ScanLevel:
    if isinstance(levels, ScanLevel):
        return levels
    try:
        return ScanLevel(levels[run_id])
    except KeyError:
        raise UsageError(f"No scan level was given for run {run_id}.") from None


def _uses_restores(run: RunPlan) -> bool:
    return any(s.restore or s.restore_end for s in run.segments)


@dataclass
class _Draft:
    """A run whose level is settled and whose split into segments is not yet."""

    profile: RunProfile
    requested: ScanLevel
    scan: ScanLevel
    costs: _Costs
    notes: list[str]
    _splits: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def splittable(self) -> int:
        """How many segments this run may be cut into at most."""
        return max(self.costs.n, 1) if self.scan is ScanLevel.INNER_LOOP else 1

    def split(self, k: int) -> list[tuple[int, int]]:
        if k not in self._splits:
            self._splits[k] = _balanced_split(self.costs, k)
        return self._splits[k]

    def segment_costs(self, k: int) -> list[float]:
        if self.scan is not ScanLevel.INNER_LOOP:
            return [self.single_cost()]
        return [self.costs.segment(a, b) for a, b in self.split(k)]

    def single_cost(self) -> float:
        c = self.costs
        if self.scan is ScanLevel.PREFIX:
            return self.profile.prefix_seconds
        if self.scan is ScanLevel.SUFFIX:
            assert c.end_restore is not None
            return c.head + c.end_restore + c.tail
        if self.scan is ScanLevel.OUTER_LOOP:
            restored = self._outer_restored()
            return (
                c.head + sum(c.skip[i] if i in restored else c.run[i] for i in range(c.n)) + c.tail
            )
        return c.segment(0, c.n)

    def _outer_restored(self) -> set[int]:
        # A statement in the outer iteration is inside the block of an iteration that
        # had no nested loop, so that block must execute.
        return {
            i for i in range(self.costs.n) if self.costs.restorable[i] and self.profile.is_nested(i)
        }

    def finish(self, k: int, workers: int) -> RunPlan:
        run_id, c = self.profile.run_id, self.costs
        if self.scan is ScanLevel.PREFIX:
            segments = [Segment(run_id, 0, 0, (), (), None, False, self.single_cost())]
        elif self.scan is ScanLevel.SUFFIX:
            segments = [
                Segment(run_id, 0, 0, (), (), None, True, self.single_cost(), restore_end=True)
            ]
        elif self.scan is ScanLevel.OUTER_LOOP:
            restored = self._outer_restored()
            segments = [
                Segment(
                    run_id,
                    0,
                    c.n,
                    tuple(sorted(restored)),
                    tuple(i for i in range(c.n) if i not in restored),
                    None,
                    True,
                    self.single_cost(),
                )
            ]
        else:
            segments = []
            for a, b in self.split(k):
                segments.append(
                    Segment(
                        run_id,
                        a,
                        b,
                        tuple(i for i in range(a) if c.restorable[i]),
                        (*(i for i in range(a) if not c.restorable[i]), *range(a, b)),
                        b - 1 if b < c.n else None,
                        b == c.n,
                        c.segment(a, b),
                    )
                )
            if len(segments) > 1:
                # With one segment every block executes anyway: nothing to explain.
                self.notes += _checkpoint_notes(self.profile, c)
            elif workers > 1 and c.n > 1:
                self.notes.append(
                    "not split across workers: splitting would not shorten the replay"
                )
        return RunPlan(
            run_id=run_id,
            scan=self.scan,
            segments=tuple(segments),
            estimate_seconds=sum(s.estimate_seconds for s in segments),
            notes=tuple(self.notes),
            profile=self.profile,
            requested=self.requested if self.requested is not self.scan else None,
        )


def _draft(profile: RunProfile, requested: ScanLevel, seconds_per_byte: float | None) -> _Draft:
    costs = _costs(profile, seconds_per_byte)
    notes = list(profile.notes)
    scan = requested
    if scan is ScanLevel.SUFFIX and costs.end_restore is None:
        scan = ScanLevel.OUTER_LOOP
        why = "the run crashed" if profile.status == "crashed" else "it did not checkpoint"
        notes.append(f"no end checkpoint ({why}): the suffix scan steps through the outer loop")
    n = profile.iterations
    if scan is ScanLevel.OUTER_LOOP:
        notes += _checkpoint_notes(profile, costs)
        whole = sum(1 for i in range(n) if not profile.is_nested(i))
        if whole:
            notes.append(
                f"{whole} of {n} iterations have no nested loop, so the whole iteration is the "
                "block: executed"
            )
    return _Draft(profile, requested, scan, costs, notes)


def _checkpoint_notes(profile: RunProfile, costs: _Costs) -> list[str]:
    """Why blocks that are skipped in principle get executed (only where restores happen)."""
    n, notes = profile.iterations, []
    missing = n - len(profile.block_checkpoints)
    if missing:
        notes.append(f"{missing} of {n} blocks have no checkpoint: executed")
    slower = sum(1 for i in profile.block_checkpoints if not costs.restorable[i])
    if slower:
        notes.append(
            f"{slower} checkpoint(s) take longer to restore than their block takes to run: "
            "executed instead"
        )
    return notes


def _balanced_split(costs: _Costs, k: int) -> list[tuple[int, int]]:
    """Cut [0, n) into at most k contiguous ranges minimising the costliest segment.

    A segment's cost grows with its end and does not grow with its start (its
    skipped prefix restores what it would otherwise execute), so for a bound X
    greedily taking the longest range that fits is optimal; X is found by bisection.
    """
    n = costs.n
    if n <= 1 or k <= 1:
        return [(0, n)]
    hi = costs.segment(0, n)
    lo = 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _greedy(costs, mid, k) is None:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
    ranges = _greedy(costs, hi, k)
    assert ranges is not None  # hi is always feasible: it starts as the one-segment cost
    return ranges


def _greedy(costs: _Costs, bound: float, k: int) -> list[tuple[int, int]] | None:
    """The longest-first ranges whose costs stay within ``bound``, or None if k do not cover."""
    n, a = costs.n, 0
    ranges: list[tuple[int, int]] = []
    while a < n:
        if len(ranges) == k:
            return None
        if costs.segment(a, n) <= bound:
            ranges.append((a, n))
            break
        # Largest b < n with cost(a, b) <= bound: run_prefix[b] <= room.
        room = bound - costs.head - costs.skip_prefix[a] + costs.run_prefix[a]
        b = bisect.bisect_right(costs.run_prefix, room, a + 1, n) - 1
        if b <= a:
            return None
        ranges.append((a, b))
        a = b
    return ranges


def _choose_splits(drafts: list[_Draft], workers: int) -> list[int]:
    """How many segments each inner-loop run gets, to shorten the packed wall time.

    Starting from one segment per run, the run with the costliest segment is cut
    once more, while that can still help; the best configuration seen wins, the
    cheaper in total work on a tie (more segments repeat prefixes).
    """
    ks = [1] * len(drafts)
    limits = [min(d.splittable, workers) for d in drafts]

    def evaluate() -> tuple[float, float]:
        costs = [c for d, k in zip(drafts, ks, strict=True) for c in d.segment_costs(k)]
        return _makespan(costs, workers), sum(costs)

    best_ks, (best_span, _) = list(ks), evaluate()
    while True:
        open_runs = [i for i, d in enumerate(drafts) if ks[i] < limits[i]]
        if not open_runs:
            break
        i = max(open_runs, key=lambda j: max(drafts[j].segment_costs(ks[j])))
        before = len(drafts[i].split(ks[i]))
        ks[i] += 1
        if len(drafts[i].split(ks[i])) <= before:
            limits[i] = ks[i] - 1  # more cuts do not help this run: stop cutting it
            ks[i] -= 1
            continue
        span, work = evaluate()
        if span < best_span * (1 - 1e-9):
            best_ks, best_span = list(ks), span
        elif work / workers >= best_span:
            break  # every further cut adds work: the wall time cannot drop below this
    return best_ks


def _makespan(costs: Iterable[float], workers: int) -> float:
    loads = [0.0] * workers
    for cost in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + cost)
    return max(loads)


def _pack(
    segments: Sequence[Segment], workers: int
) -> tuple[float, tuple[tuple[Segment, ...], ...]]:
    """Longest processing time first: each segment to the least loaded worker."""
    heap = [(0.0, w) for w in range(workers)]
    assigned: list[list[Segment]] = [[] for _ in range(workers)]
    for segment in sorted(segments, key=lambda s: -s.estimate_seconds):
        load, w = heapq.heappop(heap)
        assigned[w].append(segment)
        heapq.heappush(heap, (load + segment.estimate_seconds, w))
    makespan = max(load for load, _ in heap)
    return makespan, tuple(tuple(a) for a in assigned if a)


# -- formatting --------------------------------------------------------------------------


def format_plan(plan: ReplayPlan) -> str:
    """The plan as a readable table: one row per run, then segments, notes and totals."""
    header = ("run", "version", "file", "scan", "blocks run", "restored", "segments", "estimate")
    rows = []
    for run in plan.runs:
        profile = run.profile
        executed = sum(len(s.execute) for s in run.segments)
        restored = sum(len(s.restore) + s.restore_end for s in run.segments)
        rows.append(
            (
                run.run_id,
                (profile.code_version if profile else None) or "-",
                profile.filename if profile else "-",
                _level_name(run.scan),
                "-" if run.scan is ScanLevel.PREFIX else str(executed),
                "end" if run.scan is ScanLevel.SUFFIX else str(restored),
                str(len(run.segments)),
                _duration(run.estimate_seconds),
            )
        )
    lines = [
        f"Replay plan: {len(plan.runs)} run(s) on {plan.workers} worker(s), estimated "
        f"{_duration(plan.estimate_seconds)} wall time ({_duration(plan.work_seconds)} of work)",
        "",
        *_table(header, rows, right={4, 5, 6, 7}),
    ]
    split = [run for run in plan.runs if len(run.segments) > 1]
    if split:
        lines += ["", "segments (outer iterations executed in full; earlier ones pseudo-resumed):"]
        worker_of = {id(s): w for w, segs in enumerate(plan.schedule, 1) for s in segs}
        for run in split:
            for s in run.segments:
                lines.append(
                    f"  {run.run_id}  [{s.start}, {s.stop})  restores {len(s.restore)}, "
                    f"runs {len(s.execute)} block(s)  {_duration(s.estimate_seconds)}"
                    f"  worker {worker_of.get(id(s), '-')}"
                )
    notes = [f"  {n}" for n in plan.notes]
    for run in plan.runs:
        if run.requested is not None:
            notes.append(
                f"  {run.run_id}: asked for {_level_name(run.requested)}, "
                f"planned as {_level_name(run.scan)}"
            )
        notes += [f"  {run.run_id}: {n}" for n in run.notes]
    if notes:
        lines += ["", "notes:", *notes]
    lines += [
        "",
        f"total: {_duration(plan.work_seconds)} of work, "
        f"about {_duration(plan.estimate_seconds)} on {plan.workers} worker(s)",
    ]
    return "\n".join(lines)


def format_estimate_vs_actual(plan: ReplayPlan, actual_seconds: Mapping[str, float]) -> str:
    """Each run's estimate next to its measured replay time, with the error in percent.

    actual_seconds: per run id, the summed duration of its segments (worker-seconds).
    """
    rows = []
    total_est = total_act = 0.0
    for run in plan.runs:
        actual = actual_seconds.get(run.run_id)
        if actual is None:
            rows.append((run.run_id, _duration(run.estimate_seconds), "-", "-"))
            continue
        total_est += run.estimate_seconds
        total_act += actual
        rows.append(
            (
                run.run_id,
                _duration(run.estimate_seconds),
                _duration(actual),
                _error(run.estimate_seconds, actual),
            )
        )
    rows.append(("total", _duration(total_est), _duration(total_act), _error(total_est, total_act)))
    return "\n".join(_table(("run", "estimate", "actual", "error"), rows, right={1, 2, 3}))


def _error(estimate: float, actual: float) -> str:
    if actual <= 0:
        return "-"
    return f"{(estimate - actual) / actual * 100:+.1f}%"


def _level_name(level: ScanLevel) -> str:
    return level.name.lower().replace("_", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes}m{rest:02d}s"
    hours, rest = divmod(round(seconds) // 60, 60)
    return f"{hours}h{rest:02d}m"


def _rate(bytes_per_second: float) -> str:
    if math.isinf(bytes_per_second):
        return "unlimited speed"
    return f"{bytes_per_second / 1e6:.0f} MB/s"
