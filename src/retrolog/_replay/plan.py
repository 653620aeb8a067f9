"""Replay planning: scan level, restored vs executed blocks, segments, and a cost estimate.

A plan says, for each past run, how a worker replays it (docs/replay-planning.md):
which scan level, which outer-loop iterations have their block restored from a
checkpoint and which execute it, and how an inner-loop scan is cut into
contiguous iteration ranges for parallel workers. The estimate comes from the
run's record-time profile, which splits a run's time as::

    prefix | pre | it 0: non-block + block | it 1 ... | it n-1 | post + suffix
                            ^ restored from its checkpoint, or executed

Times are the recorded ones minus what recording added and replay does not
repeat (checkpoint capture on the training thread). Restore time comes from a
measured decode throughput when the caller has one, else from the recorded
materialize time of that checkpoint (Flor's c = 1). The profiles, and that
throughput, come from profile.py (re-exported here).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import heapq
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Profiles are read in profile.py; RunProfile, load_profiles and
# measure_restore_throughput stay importable from here.
from retrolog._replay.profile import RunProfile
from retrolog._replay.profile import load_profiles as load_profiles
from retrolog._replay.profile import (
    measure_restore_throughput as measure_restore_throughput,
)
from retrolog._replay.statements import Position, StatementSite
from retrolog.errors import UsageError


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
    worker: WorkerCosts | None = None  # what the estimate assumed of each worker (its threads)

    @property
    def work_seconds(self) -> float:
        """The sum of all segments' estimates (the wall time on one worker)."""
        return sum(run.estimate_seconds for run in self.runs)


# -- planning ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerCosts:
    """What running a segment in a replay worker process changes in the recorded times.

    The defaults change nothing: the bare model of docs/replay-planning.md. The
    replayer passes the figures of this machine (``exit_seconds``, ``teardown_seconds``
    measured by bench/replay_breakdown.py) and the threads it gives each worker.
    """

    exit_seconds: float = 0.0  # worker done -> the coordinator sees it gone (output, exit)
    teardown_seconds: float = 0.0  # more, when the script runs to its end (finalization)
    # The same two for a worker forked from a fork server (its pages are the server's until
    # written, so it frees less); None: as a new interpreter's.
    forked_exit_seconds: float | None = None
    forked_teardown_seconds: float | None = None
    # Intra-op threads per worker when the user asked for a count other than the
    # recorded one; None: each run keeps its recorded count (the default: exact).
    threads: int | None = None
    cores: int | None = None  # cores the workers share; None: no oversubscription model
    # Per run forked from a fork server: the seconds of imports its workers do not repeat
    # (_replay/forkserver.py); the server pays them once, before the first worker.
    preimported: Mapping[str, float] = field(default_factory=dict)
    # Per run forked from a fork server that timed a forked start on this machine before
    # the plan (F of docs/replay-planning.md); the others take FORKED_START_SECONDS.
    forked_start: Mapping[str, float] = field(default_factory=dict)

    def scales(self, profile: RunProfile, workers: int) -> tuple[float, float]:
        """How much slower than recorded a worker runs: (any work, the loop's compute).

        Threads beyond the cores queue behind each other: everything slows by
        demand / cores. Fewer intra-op threads than at record time (only when the
        user asks for them) slow the compute (iterations, loops, suffix) by
        Amdahl's law with :data:`INTRA_OP_PARALLEL_FRACTION`; start-up and
        restores are taken as single-threaded. Unknown record-time threads: no
        thread scaling.
        """
        recorded = profile.threads
        threads = self.threads if self.threads is not None else recorded
        overloaded = 1.0
        if self.cores and threads is not None:
            overloaded = max(1.0, workers * threads / self.cores)
        fewer = 1.0
        if threads is not None and recorded is not None and threads < recorded:
            fewer = _amdahl(recorded) / _amdahl(threads)
        return overloaded, overloaded * fewer


# Share of intra-op (torch/OpenMP) compute that parallelises over threads, used only
# when a worker gets fewer threads than the recording had: the benchmark's small CNN
# measured 0.78 on 2 cores (docs/replay-planning.md, "Threads"); other models differ.
INTRA_OP_PARALLEL_FRACTION = 0.75


def _amdahl(threads: int) -> float:
    p = INTRA_OP_PARALLEL_FRACTION
    return 1.0 / ((1.0 - p) + p / max(threads, 1))


@dataclass(frozen=True)
class _Costs:
    """One run's cost model, per outer iteration, in seconds."""

    startup: float  # the worker's start to the first loop (prefix without recording's set-up)
    head: float  # startup + other loops before the outer loop + the worker's exit
    tail: float  # other loops after it + suffix, without the end checkpoint's capture
    run: tuple[float, ...]  # iteration i with its block executed
    skip: tuple[float, ...]  # iteration i with its block restored when that is cheaper
    restorable: tuple[bool, ...]  # the block has a checkpoint that is cheaper to restore
    end_restore: float | None  # restoring the end checkpoint; None without one
    run_prefix: tuple[float, ...]  # run_prefix[i] = sum(run[:i])
    skip_prefix: tuple[float, ...]
    exit: float = 0.0  # the worker's exit, in head; a prefix scan pays it after startup

    @property
    def n(self) -> int:
        return len(self.run)

    def segment(self, a: int, b: int) -> float:
        """Pseudo-resume through iterations < a, execute [a, b), stop (or run the suffix)."""
        cost = self.head + self.skip_prefix[a] + self.run_prefix[b] - self.run_prefix[a]
        return cost + (self.tail if b == self.n else 0.0)


def _costs(
    profile: RunProfile,
    seconds_per_byte: float | None,
    worker: WorkerCosts | None = None,
    workers: int = 1,
    imports: float | None = None,
    iterations: _Iterations | None = None,
    own_startup: float | None = None,
) -> _Costs:
    """One run's cost model; ``imports``, ``iterations`` and ``own_startup`` replace the
    run's own (pooled)."""
    worker = worker or WorkerCosts()
    slower, compute = worker.scales(profile, workers)
    n = profile.iterations
    timings = iterations or _own_iterations(profile)
    run, skip, restorable = [], [], []
    for i in range(n):
        non_block, block = timings.non_block[i] * compute, timings.block[i] * compute
        restore = _restore_seconds(profile, i, seconds_per_byte)
        if restore is not None:
            restore *= slower
        cheaper = restore is not None and restore <= block
        run.append(non_block + block)
        skip.append(non_block + (restore if cheaper and restore is not None else block))
        restorable.append(cheaper)
    end_restore = None
    if profile.end_checkpoint is not None:
        end_restore = slower * (
            profile.end_checkpoint_bytes * seconds_per_byte
            if seconds_per_byte is not None
            else profile.end_checkpoint_seconds
        )
    tail = profile.post_outer_seconds + profile.suffix_seconds - profile.end_record_overhead_seconds
    prefix = profile.prefix_seconds
    if imports is not None and profile.imports_seconds is not None:
        prefix += imports - profile.imports_seconds
    own = _own_startup(profile)
    if own_startup is not None and own is not None:
        prefix += own_startup - own
        own = own_startup
    forked = profile.run_id in worker.preimported
    if forked and own is not None:
        # The recording timed its own imports: the script's own work is what is left,
        # measured in one process (the fork server's import time only moves the wall time).
        startup = slower * (own + worker.forked_start.get(profile.run_id, FORKED_START_SECONDS))
    else:
        saved = worker.preimported.get(profile.run_id, 0.0)
        startup = slower * max(
            prefix - profile.setup_seconds - saved, FORK_SECONDS if forked else 0.0
        )
    exit_, teardown = worker.exit_seconds, worker.teardown_seconds
    if forked:
        if worker.forked_exit_seconds is not None:
            exit_ = worker.forked_exit_seconds
        if worker.forked_teardown_seconds is not None:
            teardown = worker.forked_teardown_seconds
    return _Costs(
        startup=startup,
        head=startup + compute * profile.pre_outer_seconds + exit_,
        tail=compute * max(tail, 0.0) + teardown,
        run=tuple(run),
        skip=tuple(skip),
        restorable=tuple(restorable),
        end_restore=end_restore,
        run_prefix=tuple(_prefix_sums(run)),
        skip_prefix=tuple(_prefix_sums(skip)),
        exit=exit_,
    )


# A worker forked from a fork server starts in about this long (fork, then the script's
# own code up to its first loop is in the profile): the least its start-up is estimated at.
FORK_SECONDS = 0.02
# What a forked worker adds to the script's own prefix work: the fork, importing retrolog
# (its dependencies are loaded) and the replay runtime's set-up. bench/replay_breakdown.py
# measures it at 0.005-0.024 s above the measured start-up with retrolog byte-compiled as an
# install leaves it (0.06 s compiled from source), and about 0.06 s on a machine training at
# half speed: a replay therefore measures it on its fork server
# (WorkerCosts.forked_start); this figure is for plans without one (a dry run).
FORKED_START_SECONDS = 0.04


def _own_startup(profile: RunProfile) -> float | None:
    """The script's own work before its first loop: the prefix less the interpreter and
    imports, the packages it imported later and recording's set-up; None when the
    recording did not time its imports."""
    if profile.imports_seconds is None or profile.late_imports_seconds is None:
        return None
    own = (
        profile.prefix_seconds
        - profile.imports_seconds
        - profile.late_imports_seconds
        - profile.setup_seconds
    )
    return max(own, 0.0)


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
    run_suffix: bool = True,
    worker: WorkerCosts | None = None,
) -> ReplayPlan:
    """Plan the replay of ``profiles`` on ``workers`` workers and estimate its time.

    levels: the scan level per run id, or one level for every run.
    restore_seconds_per_byte: from :func:`measure_restore_throughput` (its
        inverse); without it a restore is estimated as the checkpoint's
        recorded capture + write time.
    notes: plan-wide notes to carry (e.g. from :func:`scan_level_for`).
    run_suffix: False when no requested statement sits after the outer loop: outer-
        and inner-loop workers then stop at the loop's end and the estimate has no tail.
    worker: what a worker process adds (its exit) and how its threads and the cores
        scale the recorded times; None: nothing.
    """
    if workers < 1:
        raise UsageError(f"A replay needs at least one worker, not {workers}.")
    if restore_seconds_per_byte is not None and not restore_seconds_per_byte >= 0:
        raise UsageError(
            f"restore_seconds_per_byte must be a non-negative number, not "
            f"{restore_seconds_per_byte!r}."
        )
    imports, import_notes = _pooled_imports(profiles)
    iterations, iteration_notes = _pooled_iterations(profiles)
    startups, startup_notes = _pooled_startups(profiles)
    drafts = []
    for profile in profiles:
        level = _level_of(levels, profile.run_id)
        drafts.append(
            _draft(
                profile,
                level,
                restore_seconds_per_byte,
                run_suffix,
                worker,
                workers,
                imports.get(profile.filename),
                iterations.get(profile.run_id),
                startups.get(profile.run_id),
            )
        )
    splits = _choose_splits(drafts, workers)
    runs = []
    for draft, k in zip(drafts, splits, strict=True):
        runs.append(draft.finish(k, workers))
    segments = [segment for run in runs for segment in run.segments]
    makespan, schedule = _pack(segments, workers)
    if worker is not None and worker.preimported:
        makespan += max(worker.preimported.values())  # the fork server imports first
    plan_notes = [*notes, *import_notes, *startup_notes, *iteration_notes]
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
        worker=worker,
    )


@dataclass(frozen=True)
class _Iterations:
    """N_i and B_i of the cost model per outer iteration (B_i = T_i: the iteration is its block)."""

    non_block: tuple[float, ...]
    block: tuple[float, ...]


def _own_iterations(profile: RunProfile) -> _Iterations:
    """N_i and B_i from the run's own recording, without recording's checkpoint time."""
    non_blocks, blocks = [], []
    for i in range(profile.iterations):
        total, block = profile.iteration_seconds[i], profile.block_seconds[i]
        if profile.is_nested(i):
            overhead = profile.record_overhead_seconds.get(i, 0.0)
            non_blocks.append(max(total - block - overhead, 0.0))
            blocks.append(block)
        else:
            non_blocks.append(0.0)
            blocks.append(total)
    return _Iterations(tuple(non_blocks), tuple(blocks))


# Runs of one script whose timings are within this factor of the runs' median are taken
# to do the same work, each at the speed of the process that recorded it: over 12
# executions of the benchmark workload on the 2-core machine, the same evaluation code
# took up to 1.43x as long in one as in another, about 1.2x either side of a median
# between them (docs/replay-planning.md, "Pooling iteration times over runs"). A run
# further off keeps its own timings: other arguments (more data, a larger model; the
# demo's run with half the hidden units trained at 0.76x the others' block time, and
# pooled at 1.5x its estimate was 42% long instead of 9%).
POOL_AGREEMENT = 1.25
POOL_MIN_RUNS = 3  # fewer runs than this: a median is no steadier than each run's own


def _pooled_iterations(
    profiles: Sequence[RunProfile],
) -> tuple[dict[str, _Iterations], list[str]]:
    """Per run, N_i and B_i as the median over the script's runs that agree with each other.

    Each recording timed its iterations in one process, and a process's speed varies
    from one execution to the next on a shared machine; the replay worker is another
    process again. The runs of a script planned together (same file, same number of
    outer iterations and the same nested pattern) that agree within
    :data:`POOL_AGREEMENT`, part by part (non-block, block), get the median over
    those runs for each iteration: the shape of the loop (a first epoch slower, an
    evaluation every k epochs) is kept, one process's speed is not. Runs that do not
    agree keep their own figures, and so do scripts with fewer than
    :data:`POOL_MIN_RUNS` runs in the plan.
    """
    groups: dict[tuple[str, tuple[bool, ...]], list[RunProfile]] = {}
    for profile in profiles:
        pattern = tuple(profile.is_nested(i) for i in range(profile.iterations))
        if pattern:
            groups.setdefault((profile.filename, pattern), []).append(profile)
    pooled: dict[str, _Iterations] = {}
    notes: list[str] = []
    for (filename, _), members in sorted(groups.items()):
        if len(members) < POOL_MIN_RUNS:
            continue
        own = {p.run_id: _own_iterations(p) for p in members}
        non_block, nb_runs = _pool_part({r: it.non_block for r, it in own.items()})
        block, b_runs = _pool_part({r: it.block for r, it in own.items()})
        for run_id, it in own.items():
            if run_id in nb_runs or run_id in b_runs:
                pooled[run_id] = _Iterations(
                    non_block if run_id in nb_runs else it.non_block,
                    block if run_id in b_runs else it.block,
                )
        for what, runs in (("blocks", b_runs), ("code around the blocks", nb_runs)):
            if runs:
                what = f"time of the {what} taken per iteration"
                notes.append(_pool_note(filename, what, runs, set(own)))
    return pooled, notes


def _pool_note(filename: str, what: str, runs: set[str], planned: set[str], unit: str = "") -> str:
    """The plan's note for a part pooled over ``runs`` of the ``planned`` runs of a file."""
    note = f"{filename}: {what} as the median over {len(runs)} runs that agree within "
    note += f"{POOL_AGREEMENT:g}x{unit}"
    apart = sorted(planned - runs)
    if apart:
        note += f" (run {', '.join(apart)}: its own, further off)"
    return note


def _pool_part(samples: Mapping[str, tuple[float, ...]]) -> tuple[tuple[float, ...], set[str]]:
    """The median per index over the runs within POOL_AGREEMENT of the runs' median, and
    those runs; nothing pooled (an empty set) when fewer than POOL_MIN_RUNS agree."""
    if not any(any(values) for values in samples.values()):
        return (), set()  # no such part (iterations that are their own block): nothing to pool
    shape = _median_per_index(list(samples.values()))
    agree = {r for r, values in samples.items() if _agrees(values, shape)}
    if len(agree) < POOL_MIN_RUNS:
        return (), set()
    return _median_per_index([samples[r] for r in sorted(agree)]), agree


def _median_per_index(rows: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(statistics.median(column) for column in zip(*rows, strict=True))


def _agrees(values: tuple[float, ...], shape: tuple[float, ...]) -> bool:
    """Whether a run's figures are the shape's, within POOL_AGREEMENT, in their median ratio."""
    ratios = [v / s for v, s in zip(values, shape, strict=True) if s > 0]
    if not ratios:
        return all(v == 0 for v in values)
    level = statistics.median(ratios)
    return 1 / POOL_AGREEMENT <= level <= POOL_AGREEMENT


def _pooled_imports(profiles: Sequence[RunProfile]) -> tuple[dict[str, float], list[str]]:
    """Per script, the median over its runs of the prefix before the first retrolog call.

    That part (interpreter start, imports) is the same work in every run of a
    script, but each recording measured it once, under whatever else the machine
    was doing (docs/replay-planning.md, "Where the error comes from"). The median
    over the runs planned together is a steadier guess for a worker than one
    sample. A script with fewer than 3 runs in the plan keeps each run's own.
    """
    samples: dict[str, list[float]] = {}
    for profile in profiles:
        if profile.imports_seconds is not None:
            samples.setdefault(profile.filename, []).append(profile.imports_seconds)
    pooled = {name: statistics.median(v) for name, v in samples.items() if len(v) >= POOL_MIN_RUNS}
    notes = [
        f"start-up of {name}: interpreter and imports taken as the median over "
        f"{len(samples[name])} runs ({seconds:.1f}s)"
        for name, seconds in sorted(pooled.items())
    ]
    return pooled, notes


def _pooled_startups(profiles: Sequence[RunProfile]) -> tuple[dict[str, float], list[str]]:
    """Per run, the script's own start-up work as the median over its runs that agree.

    What a script does between its imports and its first loop (building the data and
    the model) was timed once per recording, like its iterations, at one process's
    speed; the worker that replays it is another process. As for the iterations
    (:func:`_pooled_iterations`), the runs of a file that agree within
    :data:`POOL_AGREEMENT` get the median over them when at least
    :data:`POOL_MIN_RUNS` agree; a run further off (other arguments: more data to
    load) keeps its own.
    """
    groups: dict[str, dict[str, tuple[float, ...]]] = {}
    for profile in profiles:
        own = _own_startup(profile)
        if own is not None:
            groups.setdefault(profile.filename, {})[profile.run_id] = (own,)
    pooled: dict[str, float] = {}
    notes = []
    for filename, samples in sorted(groups.items()):
        median, runs = _pool_part(samples)  # nothing for fewer than POOL_MIN_RUNS runs
        if not runs:
            continue
        pooled.update(dict.fromkeys(runs, median[0]))
        what = "its own start-up work (after the imports, before the first loop) taken"
        notes.append(_pool_note(filename, what, runs, set(samples), f" ({median[0]:.2f}s)"))
    return pooled, notes


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
    stops_early: bool = False  # the worker exits after the outer loop's last iteration
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
            return c.startup + c.exit  # the worker stops where the first loop starts
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
                    c.n - 1 if self.stops_early else None,
                    not self.stops_early,
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
                        b - 1 if b < c.n or self.stops_early else None,
                        b == c.n and not self.stops_early,
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


def _draft(
    profile: RunProfile,
    requested: ScanLevel,
    seconds_per_byte: float | None,
    run_suffix: bool,
    worker: WorkerCosts | None = None,
    workers: int = 1,
    imports: float | None = None,
    iterations: _Iterations | None = None,
    own_startup: float | None = None,
) -> _Draft:
    costs = _costs(profile, seconds_per_byte, worker, workers, imports, iterations, own_startup)
    notes = list(profile.notes)
    scan = requested
    if scan is ScanLevel.SUFFIX and costs.end_restore is None:
        scan = ScanLevel.OUTER_LOOP
        run_suffix = True
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
    stops_early = not run_suffix and scan in (ScanLevel.OUTER_LOOP, ScanLevel.INNER_LOOP)
    if stops_early and costs.n:
        # Nor does it finalize the interpreter: it leaves by os._exit (teardown is in tail).
        costs = dataclasses.replace(costs, tail=0.0)
    return _Draft(profile, requested, scan, costs, notes, stops_early=stops_early)


def _checkpoint_notes(profile: RunProfile, costs: _Costs) -> list[str]:
    """Why blocks that are skipped in principle get executed (only where restores happen)."""
    n, notes = profile.iterations, []
    missing = n - len(profile.block_checkpoints) - len(profile.unrestorable)
    if missing:
        notes.append(f"{missing} of {n} blocks have no checkpoint: executed")
    if profile.unrestorable:
        whys = sorted(set(profile.unrestorable.values()))
        notes.append(
            f"{len(profile.unrestorable)} of {n} checkpoints cannot restore what their block "
            f"changed, so those blocks are executed: {'; '.join(whys)}"
        )
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
