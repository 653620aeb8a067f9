"""``retrolog replay`` over one ReplayRequest: select, place, plan, confirm, execute, report.

store ──_select(where)──> the script's runs
newest script ──locate_statements──> scan level
each run's code version ──propagate──> script to run, kept as a git blob (_place)
runs ──load_profiles──> plan (_plan_runs) ──_confirm──> jobs ──Executor.run──> workers
each run, as its last job ends ──> deferred check + backfill, committed (_Landing)
"""

from __future__ import annotations

import json
import math
import re
import secrets
import sqlite3
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from retrolog._config import mask
from retrolog._query.runs import matching_runs
from retrolog._replay import crashed, handsfree_runs
from retrolog._replay.backfill import Check, Mismatch, already_stored, backfill, check_recorded
from retrolog._replay.execute import (
    Job,
    claim,
    cpu_cores,
    log_tail,
    sweep_stale,
)
from retrolog._replay.executor import Coordinator, Executor, choose_executor
from retrolog._replay.forkserver import StartPlan, describe, start_plan
from retrolog._replay.local_executor import server_env
from retrolog._replay.plan import (
    ReplayPlan,
    RunPlan,
    ScanLevel,
    WorkerCosts,
    format_estimate_vs_actual,
    format_plan,
    load_profiles,
    plan_replay,
    scan_level_for,
)
from retrolog._replay.propagate import Propagation, Unplaceable, propagate
from retrolog._replay.request import ReplayRequest
from retrolog._replay.reuse import copy_values, find_sources
from retrolog._replay.statements import Position, locate_statements, names_read
from retrolog.errors import RetrologError, StoreUnreachableError, UsageError
from retrolog.runtime import numerics
from retrolog.runtime.modules import decode as decode_modules
from retrolog.runtime.replay_worker import WorkerSpec
from retrolog.store.backends import objects_location
from retrolog.store.paths import ProjectPaths, storable_text
from retrolog.store.sqlite_metadata import is_readonly, read_only_error, store_directory
from retrolog.versions.notebook import read_script


@dataclass
class RunOutcome:
    """What happened to one run in a replay."""

    run_id: str
    # "replayed", "failed", "partial", "unplaceable" (a statement has no place in its
    # version), "unreadable" (its code version cannot be read), "planned", "reused"
    status: str
    scan: str = ""
    estimate_seconds: float = 0.0
    actual_seconds: float = 0.0
    backfilled: int = 0
    # Values it computed that another replay of the run stored first (kept): replay id ->
    # how many. Two replays of one run at once both compute; each value is stored once.
    already: dict[str, int] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    error: str | None = None
    log_paths: list[str] = field(default_factory=list)
    diff: str = ""
    # Checkpoints a worker could not read (missing or corrupt) and executed instead: (key, why).
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    compared: int = 0  # recorded values the replay recomputed and compared
    # What of the recorded numerical environment this replay did not reproduce.
    environment: list[str] = field(default_factory=list)
    # How its backfilled values are marked: None (exact as far as checked), "mismatch"
    # (the deferred check found a difference) or "environment" (possibly inexact).
    inexact: str | None = None
    cause: str = ""  # for a mismatch: where the first difference points
    reused_from: str | None = None  # the run whose values it got instead of replaying
    # A crashed run: values the replay computed past where the run got (name -> count),
    # not backfilled.
    past_the_crash: dict[str, int] = field(default_factory=dict)
    # Names the replayed code declared volatile (rl.volatile): left out of the check.
    volatile: list[str] = field(default_factory=list)
    # A run an exception ended, whose replay raised it again where it did: what and where.
    stopped: str = ""


@dataclass
class ReplayResult:
    """A replay's plan and outcome per run."""

    replay_id: str
    names: list[str]
    filename: str
    plan: ReplayPlan | None
    outcomes: dict[str, RunOutcome]
    skipped: list[str]  # runs that already had every value (without --force)
    executed: bool
    verify: bool = False  # a --verify replay: recorded statements only, nothing backfilled

    @property
    def inexact(self) -> list[str]:
        """Runs whose recomputed recorded values differed (their backfills are marked)."""
        return [r for r, o in self.outcomes.items() if o.inexact == "mismatch"]

    @property
    def verified(self) -> int:
        """Recorded values the replayed runs recomputed and compared."""
        return sum(o.compared for o in self.outcomes.values() if o.status == "replayed")


Echo = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def replay(
    conn: sqlite3.Connection,
    paths: ProjectPaths,
    request: ReplayRequest,
    *,
    confirm: Callable[[str], bool] | None = None,
    echo: Echo = _stderr,
    choose: Callable[[str], set[str]] | None = None,
    settle: Callable[[dict[str, RunOutcome]], None] | None = None,
    land: Callable[[list[str]], None] | None = None,
) -> ReplayResult:
    """Replay past runs of a script to backfill the values of ``request.names``.

    Phases: select the runs, place today's statements in their versions, plan,
    confirm, execute (each run's values land as its workers end), report.

    confirm: asked with the plan text before executing; returning False stops.
    echo: where the plan and the report go.
    choose: the runs ``where`` matches, when ``conn`` is a working copy of a store that
        judges it in its own dialect (_replay/working_copy.py); default: matched on ``conn``.
    settle: called with the outcomes once the values are in ``conn``, before the report:
        a working copy's are written into its store there, and each outcome's
        ``backfilled`` and ``already`` set to what that store kept.
    land: called with the runs whose values just landed in ``conn`` (a run and those
        reusing its values), while the other runs still replay: a working copy's are
        written into its store there.
    """
    make_executor = choose_executor(request.executor, request.ray_address)
    state = _select(conn, paths, request, choose, echo)
    executor = make_executor(Coordinator(conn, paths, state.replay_id))
    try:
        if not request.dry_run and not state.readonly:
            _warm_up(conn, paths, executor, state)
        if not _place(conn, paths, state, echo):
            return state.result(None, executed=False)
        _plan_runs(conn, paths, state, executor, echo)
        stop = _confirm(state, confirm, echo)
        if stop is not None:
            return stop
        if state.plan is not None:
            _execute(conn, paths, state, executor, echo, land)
        _copy_reused(conn, state.ready, state.after, state.outcomes, state.names,
                     state.replay_id, state.lineage)  # fmt: skip
        if settle is not None:
            settle(state.outcomes)
        _report_actual(state, echo)
        return state.result(state.plan, executed=True)
    finally:
        executor.close()


@dataclass
class _Replay:
    """One replay as its phases fill it in."""

    request: ReplayRequest
    replay_id: str
    filename: str
    candidates: list[str]
    readonly: bool
    outcomes: dict[str, RunOutcome] = field(default_factory=dict)
    # placing (_place)
    source: str = ""  # today's script ("" for --verify)
    level: ScanLevel = ScanLevel.OUTER_LOOP
    notes: tuple[str, ...] = ()
    needs_suffix: bool = True
    lineage: _RunLineage = field(default_factory=lambda: _RunLineage({}, {}, {}, {}))
    complete: set[str] = field(default_factory=set)
    todo: list[str] = field(default_factory=list)  # the runs not complete, in their order
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    propagations: dict[str, Propagation] = field(default_factory=dict)
    old_sources: dict[str, str] = field(default_factory=dict)
    # reuse and plan (_plan_runs)
    ready: dict[str, str] = field(default_factory=dict)
    after: dict[str, str] = field(default_factory=dict)
    plan: ReplayPlan | None = None
    starts: dict[str, StartPlan] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.request.names)

    def result(self, plan: ReplayPlan | None, *, executed: bool) -> ReplayResult:
        verify = self.request.verify
        return ReplayResult(self.replay_id, self.names, self.filename, plan, self.outcomes,
                            sorted(self.complete), executed, verify)  # fmt: skip


def _select(
    conn: sqlite3.Connection,
    paths: ProjectPaths,
    request: ReplayRequest,
    choose: Callable[[str], set[str]] | None,
    echo: Echo,
) -> _Replay:
    """The runs to consider: the script's finished or crashed runs ``where`` matches."""
    readonly = is_readonly(conn)
    if readonly and not request.dry_run:
        raise read_only_error(paths, "replay --verify" if request.verify else "replay")
    # What a killed coordinator left behind (a read-only store keeps its marks).
    stale = [] if readonly else sweep_stale(conn, paths.store)
    for replay_id in stale:
        echo(f"replay {replay_id} was stopped without finishing (its coordinator was killed); "
             "marked interrupted, its temporary checkouts removed.")  # fmt: skip
    request.checked()
    filename = _script(conn, paths, request.script)
    where = request.where
    candidates = _candidates(conn, filename, where, choose)
    if not candidates:
        raise UsageError(
            f"No finished or crashed run of {filename} matches"
            + (f" the predicate {where!r}" if where else "")
            + "; `retrolog runs` lists the runs."
        )
    replay_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    return _Replay(request, replay_id, filename, candidates, readonly)


def _warm_up(
    conn: sqlite3.Connection, paths: ProjectPaths, executor: Executor, state: _Replay
) -> None:
    """Start the fork server the newest matching run will most likely need.

    Its imports are the longest wait before the first worker; they run while the
    runs' code is propagated and the plan made. The guess takes the script as it is
    now for the propagated one (they differ by the statements added, which rarely
    import); the plan asks for the servers it needs and gets this one where the guess
    was right, a wrong guess is stopped unused. Nothing starts early when there is no
    fork server for this script, the script is gone, or the run's row cannot be read.
    """
    columns = ("modules", "numerics", "filename")
    found = conn.execute(
        f"SELECT {', '.join(columns)} FROM runs WHERE run_id = ?", (state.candidates[-1],)
    )
    row = dict(zip(columns, found.fetchone() or (), strict=False))
    if not row:
        return
    try:
        source = read_script(paths.root / state.filename)
        start = _start_plan(conn, paths, row, source)
        env = start.server_environment(server_env(row)) if start.forked else None
    except (OSError, ValueError):
        return  # the plan reports a damaged row; a guess does not
    if env is not None:
        executor.warm_up(env, start.warm)


def _place(conn: sqlite3.Connection, paths: ProjectPaths, state: _Replay, echo: Echo) -> bool:
    """Today's statements placed in each run's version; False when no run needs them."""
    request, names = state.request, state.names
    versions: dict[str, tuple[str, Propagation, dict[str, str]]] = {}
    state.todo = state.candidates
    if not request.verify:
        state.source = _read_newest(paths, state.filename)
        placed = state.source
        if handsfree_runs.any_handsfree(conn, state.candidates):
            placed = handsfree_runs.loops_source(state.source, state.filename)
        sites = locate_statements(placed, names, state.filename)
        state.level, state.notes = scan_level_for(sites)
        # Without a requested statement after the outer loop, workers stop at its end: the
        # rest of the script only recomputes recorded values, and may use variables of
        # skipped blocks.
        state.needs_suffix = any(
            site.position is Position.SUFFIX for group in sites.values() for site in group
        )
        # Propagate into every candidate's version (once per version): what a replay would
        # compute now is the evidence for both "missing" and "definition changed since".
        versions = _propagate_all(
            conn, state.source, state.filename, names, state.candidates, paths.root
        )
        state.lineage = _lineage_of(
            conn, paths, state.source, state.filename, names, state.candidates, versions
        )
        complete = set() if request.force else _complete_runs(conn, state.candidates, names)
        state.complete = complete - set(state.lineage.changed)
        state.todo = [r for r in state.candidates if r not in state.complete]
        if not state.todo:
            echo(
                f"Every matching run already has {', '.join(names)} by today's definition; "
                "nothing to replay (--force recomputes them)."
                + _inexact_hint(conn, state.candidates, names)
                + _recorded_hint(state.lineage, names)
            )
            return False
    state.runs = _run_rows(conn, state.todo, paths.root)
    for run_id in state.todo:
        if request.verify:
            _own_version(state, run_id)
        else:
            _propagated_version(state, run_id, versions[run_id])
    return True


def _own_version(state: _Replay, run_id: str) -> None:
    """A --verify run: its own code, unchanged."""
    try:
        old = _old_source(state.runs[run_id], state.filename)
    except RetrologError as exc:
        error = _version_gone(state.runs[run_id], state.filename, exc)
        state.outcomes[run_id] = RunOutcome(run_id, "unreadable", error=error)
        return
    state.old_sources[run_id] = old
    state.propagations[run_id] = Propagation(old, (), ())


def _propagated_version(
    state: _Replay, run_id: str, version: tuple[str, Propagation, dict[str, str]]
) -> None:
    """A run's version with today's statements, or why they have no place there."""
    old, result, _ = version
    state.old_sources[run_id] = old
    if result.problems:
        # Each reason names the statement and its line in today's script, then what the
        # old version lacks.
        reasons = "; ".join(p.reason for p in result.problems)
        gone = any(p.name == _NO_CODE for p in result.problems)
        status = "unreadable" if gone else "unplaceable"
        state.outcomes[run_id] = RunOutcome(run_id, status, error=reasons)
    else:
        state.propagations[run_id] = result


def _plan_runs(
    conn: sqlite3.Connection, paths: ProjectPaths, state: _Replay, executor: Executor, echo: Echo
) -> None:
    """Reuse where a run computed what another did; the plan for the others."""
    request = state.request
    placeable = [r for r in state.todo if r in state.propagations]
    # Runs that computed exactly what another did get that one's values (_replay/reuse.py).
    if request.reuse and not request.verify and not request.force:
        from retrolog.store.backends import object_store_for

        objects = object_store_for(paths.store)
        state.ready, state.after = find_sources(
            conn, placeable, state.runs, state.names, state.lineage.would, objects.get
        )
    for run_id, source_run in {**state.ready, **state.after}.items():
        state.outcomes[run_id] = RunOutcome(run_id, "reused", reused_from=source_run)
    to_run = [r for r in placeable if r not in state.ready and r not in state.after]
    if not to_run:
        if not request.dry_run:
            executor.prepare({}, {}, echo)  # no worker will run: an early server is moot
        return
    profiles = load_profiles(conn, to_run)
    per_byte = _restore_seconds_per_byte(paths, profiles)
    widest = max((p.threads or 1 for p in profiles), default=1)
    capacity = executor.capacity(request.threads or widest)
    workers = request.workers or capacity.workers
    state.starts = _start_plans(conn, paths, state.runs, state.propagations, to_run)
    if not request.dry_run:
        # The fork servers start now: what their imports take is in the estimate, and the
        # workers need them anyway once the plan is confirmed.
        state.starts = executor.prepare(state.runs, state.starts, echo)
    state.plan = _plan(
        state.level, profiles, workers, per_byte, (*state.notes, *capacity.notes),
        state.needs_suffix, state.source, request.threads, state.starts, cores=capacity.cores,
    )  # fmt: skip
    for run_plan in state.plan.runs:
        run_id = run_plan.run_id
        old = state.old_sources[run_id]
        state.outcomes[run_id] = RunOutcome(
            run_id,
            "planned",
            scan=run_plan.scan.name,
            estimate_seconds=run_plan.estimate_seconds,
            diff="" if request.verify else state.propagations[run_id].diff(old, state.filename),
            environment=_environment_differences(state.runs[run_id], run_plan, request.threads),
        )


def _confirm(
    state: _Replay, confirm: Callable[[str], bool] | None, echo: Echo
) -> ReplayResult | None:
    """Show the plan; the result to return instead of executing (a dry run, nothing to
    run, or the user said no), else None."""
    request = state.request
    text = _plan_text(state.plan, state.outcomes, state.complete, state.names, state.filename,
                      request.verify, state.lineage)  # fmt: skip
    text = "\n".join([text, *handsfree_runs.plan_lines(state.runs, state.outcomes)])
    echo(text)
    if request.dry_run:
        for outcome in state.outcomes.values():
            if outcome.diff:
                echo(f"--- {outcome.run_id}: the code that will run ---\n{outcome.diff}")
        return state.result(state.plan, executed=False)
    if state.plan is None and not state.ready and not state.after:
        _report_unreadable(state.outcomes, echo)
        if request.verify:
            echo(_nothing_verified([]))
        return state.result(None, executed=False)
    if confirm is not None and not confirm(text):
        echo("Replay cancelled; nothing was run.")
        return state.result(state.plan, executed=False)
    return None


def _report_actual(state: _Replay, echo: Echo) -> None:
    """The estimate against what the runs took, then the report."""
    actual = {r: o.actual_seconds for r, o in state.outcomes.items() if o.status == "replayed"}
    if actual and state.plan is not None:
        echo(format_estimate_vs_actual(state.plan, actual))
    _report(state.outcomes, echo, state.request.verify)


def _copy_reused(
    conn: sqlite3.Connection,
    ready: Mapping[str, str],
    after: Mapping[str, str],
    outcomes: dict[str, RunOutcome],
    names: Sequence[str],
    replay_id: str,
    lineage: _RunLineage,
) -> None:
    """Give the reusing runs their sources' values (after the sources were replayed)."""
    for run_id, source_run in {**ready, **after}.items():
        outcome = outcomes[run_id]
        source_outcome = outcomes.get(source_run)
        if run_id in after and (source_outcome is None or source_outcome.status != "replayed"):
            outcome.status = "failed"
            outcome.error = f"its values were to come from run {source_run}, which did not finish"
            continue
        outcome.backfilled = copy_values(
            conn, source=source_run, target=run_id, names=names, replay_id=replay_id,
            replace=run_id in lineage.changed,
        )  # fmt: skip
        outcome.status = "replayed"
        if source_outcome is not None:
            outcome.inexact = source_outcome.inexact
        conn.execute(
            "INSERT OR REPLACE INTO replay_runs(replay_id, run_id, scan, status, backfilled,"
            " mismatches, error, inexact) VALUES (?, ?, 'REUSED', 'reused', ?, '[]', ?, ?)",
            (replay_id, run_id, outcome.backfilled, f"copied from run {source_run}",
             source_outcome.inexact if source_outcome else None),
        )  # fmt: skip


@dataclass
class _RunLineage:
    """Today's definitions of the names, and how the runs' values relate to them."""

    today: dict[str, Any]  # name -> versions.definitions.Definition, in today's script
    changed: dict[str, list[str]]  # run -> names whose backfilled values have another key
    recorded_differs: dict[str, list[str]]  # name -> runs that recorded it by another key
    # run -> name -> the key of what a replay computes there now (the statement propagated
    # into the run's version, today's helpers carried with it)
    would: dict[str, dict[str, str]] = field(default_factory=dict)


def _propagate_all(
    conn: sqlite3.Connection,
    source: str,
    filename: str,
    names: Sequence[str],
    run_ids: Sequence[str],
    root: Path | None = None,
) -> dict[str, tuple[str, Propagation, dict[str, str]]]:
    """Per run: its old source, today's statements propagated into it, and the definition
    keys of the names in the propagated file (what a replay would compute now)."""
    from retrolog._query.lineage import version_reader
    from retrolog.versions.definitions import definitions

    rows = _run_rows(conn, run_ids, root)
    by_version: dict[tuple[str, str], tuple[str, Propagation, dict[str, str]]] = {}
    result = {}
    for run_id in run_ids:
        row = rows[run_id]
        version = (row["code_git_dir"], row["code_rev"] or run_id)
        if version not in by_version:
            try:
                old = _old_source(row, filename)
            except RetrologError as exc:
                # This run alone cannot be replayed; the others still are.
                problem = Unplaceable(_NO_CODE, _version_gone(row, filename, exc))
                by_version[version] = ("", Propagation("", (), (problem,)), {})
                result[run_id] = by_version[version]
                continue
            propagated = propagate(source, old, names)
            keys: dict[str, str] = {}
            if not propagated.problems:
                read = version_reader(*_code(row), filename)
                found = definitions(
                    propagated.source, names, filename=filename, read=read,
                    rename=_carried_back(propagated),
                )  # fmt: skip
                keys = {name: d.key for name, d in found.items()}
            by_version[version] = (old, propagated, keys)
        result[run_id] = by_version[version]
    return result


def _lineage_of(
    conn: sqlite3.Connection,
    paths: ProjectPaths,
    source: str,
    filename: str,
    names: Sequence[str],
    runs: Sequence[str],
    versions: Mapping[str, tuple[str, Propagation, dict[str, str]]],
) -> _RunLineage:
    """Compare the definitions the runs' values came from with what a replay computes now."""
    from retrolog._query.lineage import value_keys, working_tree_reader
    from retrolog.versions.definitions import definitions

    today = definitions(
        source, names, filename=filename, read=working_tree_reader(paths.root, filename)
    )
    changed: dict[str, list[str]] = {}
    recorded_differs: dict[str, list[str]] = {}
    would: dict[str, dict[str, str]] = {}
    for run_id in runs:
        would[run_id] = versions[run_id][2]
    for (run_id, name), keys in value_keys(conn, runs, names).items():
        key = would[run_id].get(name)
        backfilled = keys.get("backfilled", set()) - {None}  # None: kept before definitions
        if key is not None and backfilled and backfilled != {key}:
            changed.setdefault(run_id, []).append(name)
        differs = bool(keys.get("recorded")) and keys["recorded"] != {today[name].key}
        if differs and not _same_after_renames(source, versions[run_id][0], name, today[name].key):
            recorded_differs.setdefault(name, []).append(run_id)
    return _RunLineage(today, changed, recorded_differs, would)


def _same_after_renames(new_source: str, old_source: str, name: str, key: str) -> bool:
    """Whether the old statement is today's but for variables the alignment maps renamed."""
    from retrolog._replay.propagate import renames
    from retrolog.versions.definitions import definitions

    mapping = renames(new_source, old_source)
    if not mapping:
        return False
    try:
        found = definitions(old_source, [name], rename=mapping)
    except (SyntaxError, ValueError):
        return False
    return found[name].key == key


def _recorded_hint(lineage: _RunLineage, names: Sequence[str]) -> str:
    """A note when recorded values of a requested name come from another definition."""
    parts = [
        f"recorded {name!r} in {len(runs)} run(s) was computed by another definition than "
        "today's statement, so the column mixes definitions (`retrolog show RUN` shows each)"
        for name in names
        if (runs := lineage.recorded_differs.get(name))
    ]
    return "".join(" " + part + "." for part in parts)


def _inexact_hint(conn: sqlite3.Connection, runs: Sequence[str], names: Sequence[str]) -> str:
    """A note when some of the values already there are marked inexact."""
    marks_n = ", ".join("?" for _ in names)
    marks_r = ", ".join("?" for _ in runs)
    (count,) = conn.execute(
        f"SELECT COUNT(DISTINCT run_id) FROM logs WHERE name IN ({marks_n})"
        f" AND run_id IN ({marks_r}) AND inexact IS NOT NULL",
        (*names, *runs),
    ).fetchone()
    if not count:
        return ""
    return (
        f" {count} of these run(s) have values marked inexact; `retrolog show RUN` says why, "
        "and --force replays them again."
    )


def _environment_differences(
    row: dict[str, Any], run_plan: RunPlan, threads: int | None
) -> list[str]:
    """What of the run's recorded numerical environment this replay will not reproduce."""
    recorded = json.loads(row.get("numerics") or "null")
    packages = json.loads(row.get("packages") or "null")
    found = numerics.differences(recorded, packages, row.get("python"))
    had = run_plan.profile.threads if run_plan.profile is not None else None
    if threads is not None and had is not None and threads != had:
        found.append(f"{threads} intra-op thread(s) asked for, {had} recorded")
    return found


# -- planning with what a worker process costs ---------------------------------------------


def _plan(
    level: ScanLevel,
    profiles: Sequence[Any],
    workers: int,
    per_byte: float | None,
    notes: Sequence[str],
    run_suffix: bool,
    source: str,
    threads: int | None,
    starts: Mapping[str, StartPlan] | None = None,
    *,
    cores: int | None = None,
) -> ReplayPlan:
    """The plan, for workers that keep each run's recorded thread count (or ``threads``).

    starts: how each run's workers start; a forked worker skips the imports its fork
    server made once (the server's measured time, else the recorded imports).
    cores: the cores the workers share (default: this machine's; a Ray cluster's CPUs).
    """
    cores = cores or cpu_cores()
    starts = starts or {}
    preimported = {
        p.run_id: _preimport_seconds(starts[p.run_id], p)
        for p in profiles
        if p.run_id in starts and starts[p.run_id].forked
    }
    # A forked worker's own start, as its server measured it on this machine now, plus the
    # replay runtime's set-up that the measurement leaves out.
    forked_start = {
        run_id: start.forked_start + FORKED_SETUP_SECONDS
        for run_id, start in starts.items()
        if start.forked and start.forked_start is not None
    }
    worker = WorkerCosts(
        exit_seconds=EXIT_SECONDS,
        teardown_seconds=teardown_seconds(source),
        forked_exit_seconds=FORKED_EXIT_SECONDS,
        forked_teardown_seconds=teardown_seconds(source, forked=True),
        threads=threads,
        cores=cores,
        preimported=preimported,
        forked_start=forked_start,
    )
    start = describe([starts[p.run_id] for p in profiles if p.run_id in starts])
    return plan_replay(
        level, profiles, workers, restore_seconds_per_byte=per_byte,
        notes=(*notes, *_thread_notes(profiles, workers, threads, cores), *([start] * bool(start))),
        run_suffix=run_suffix, worker=worker,
    )  # fmt: skip


def _preimport_seconds(start: StartPlan, profile: Any) -> float:
    """What a forked worker of this run does not repeat: a new interpreter's start and its
    fork server's imports.

    Measured by this replay's server before the plan is made; for a dry run (no
    server), by the last replay's server for the same modules; failing both, the
    run's recorded start before its first retrolog call (interpreter and imports:
    less than the server imports, so the estimate errs long).
    """
    if start.warm_seconds is not None:
        return start.warm_seconds
    return float(profile.imports_seconds or 0.0)


def _start_plans(
    conn: sqlite3.Connection,
    paths: ProjectPaths,
    runs: Mapping[str, Mapping[str, Any]],
    propagations: Mapping[str, Propagation],
    run_ids: Sequence[str],
) -> dict[str, StartPlan]:
    """How each run's workers start (_replay/forkserver.py), from what the run imported."""
    return {
        run_id: _start_plan(conn, paths, runs[run_id], propagations[run_id].source)
        for run_id in run_ids
    }


def _start_plan(
    conn: sqlite3.Connection, paths: ProjectPaths, row: Mapping[str, Any], source: str
) -> StartPlan:
    """How a worker of the run ``row`` running ``source`` starts."""
    recorded, warm_seconds = _recorded_modules(conn, row.get("modules"))
    script_dir = (paths.root / row["filename"]).parent
    start = start_plan(source, recorded, root=paths.root, script_dir=script_dir)
    if start.forked:
        start = replace(start, digest=row.get("modules"), warm_seconds=warm_seconds)
    return start


def _recorded_modules(
    conn: sqlite3.Connection, digest: str | None
) -> tuple[list[str] | None, float | None]:
    """The module set a run recorded (None: none recorded), and its measured import time."""
    if not digest:
        return None, None
    row = conn.execute(
        "SELECT names, warm_seconds FROM module_sets WHERE digest = ?", (digest,)
    ).fetchone()
    if row is None:
        return None, None
    seconds = row[1] if isinstance(row[1], float) and row[1] >= 0 else None
    return decode_modules(row[0]), seconds


def _thread_notes(
    profiles: Sequence[Any], workers: int, threads: int | None, cores: int
) -> list[str]:
    """How the workers' threads relate to the recordings' and to the cores."""
    recorded = sorted({p.threads for p in profiles if p.threads})
    if threads is not None:
        return [
            f"{threads} intra-op thread(s) per worker as asked (--threads), instead of the "
            f"recorded {', '.join(map(str, recorded)) or 'unknown'}: floating-point results "
            "may differ from a fresh run, so backfilled values are marked possibly inexact"
        ]
    if not recorded:
        return []
    widest = recorded[-1]
    shown = " or ".join(map(str, recorded))
    note = f"each worker keeps its run's recorded {shown} intra-op thread(s) (exact replay)"
    if workers * widest > cores:
        note += (
            f"; {workers} worker(s) on {cores} core(s) oversubscribe them: slower, values "
            "unaffected"
        )
    return [note]


# Measured by bench/replay_breakdown.py (docs/replay-planning.md, "What a worker adds"):
# from a worker's last iteration to the coordinator seeing it gone when it leaves by
# os._exit (writing its output, freeing a torch-sized process), and what finalizing the
# interpreter adds when the script runs to its end: 0.25 s with torch imported once the
# worker has frozen the garbage collector (0.7 s without), 0.05 s without torch. A worker
# forked from a fork server frees less (most of its pages are still the server's): 0.015 s
# to leave. Run to its end, it joins threads, runs the atexit handlers and leaves by
# os._exit without finalizing its modules (forkserver_main._leave): 0.025 s more, whatever it
# imported (finalizing took 0.17 s with torch on bench_replay's workload, 0.4-0.7 s with
# scikit-learn too). The recorded profile has none of these: a recording ends at commit().
EXIT_SECONDS = 0.05
TEARDOWN_SECONDS = 0.05
# What a forked worker's runtime set-up adds to what its fork server measures
# (forkserver.WORKER_MODULES imported): reading its spec, the run's contexts from the
# store and starting the prefetch thread.
FORKED_SETUP_SECONDS = 0.005
TORCH_TEARDOWN_SECONDS = 0.3
FORKED_EXIT_SECONDS = 0.015
FORKED_TEARDOWN_SECONDS = 0.025
_IMPORTS_TORCH = re.compile(r"^\s*(?:import|from)\s+torch\b", re.MULTILINE)


def teardown_seconds(source: str, *, forked: bool = False) -> float:
    """What a worker running ``source`` to its end spends finalizing the interpreter."""
    if forked:
        return FORKED_TEARDOWN_SECONDS
    return TORCH_TEARDOWN_SECONDS if _IMPORTS_TORCH.search(source) else TEARDOWN_SECONDS


# -- choosing runs ---------------------------------------------------------------------


def _script(conn: sqlite3.Connection, paths: ProjectPaths, script: str | None) -> str:
    if script is not None:
        path = Path(script).expanduser()
        path = path.resolve() if path.is_absolute() else (Path.cwd() / path).resolve()
        try:
            return path.relative_to(paths.root).as_posix()
        except ValueError:
            raise UsageError(
                f"--script {script} is outside the project {paths.root}; give a script of "
                "this project."
            ) from None
    rows = [r[0] for r in conn.execute("SELECT DISTINCT filename FROM runs ORDER BY filename")]
    rows = [r for r in rows if not r.startswith("<")]
    if len(rows) == 1:
        return str(rows[0])
    if not rows:
        raise UsageError("No run of a script is recorded yet; record one before replaying.")
    raise UsageError(
        f"Runs of several scripts are recorded ({', '.join(rows)}); choose one with --script FILE."
    )


def _read_newest(paths: ProjectPaths, filename: str) -> str:
    path = paths.root / filename
    try:
        return read_script(path)  # a notebook: its code cells (versions/notebook.py)
    except OSError as exc:
        raise UsageError(
            f"Cannot read the newest version of {filename} at {path} ({exc.strerror}); replay "
            "takes the statements to add from the script as it is now."
        ) from exc
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _candidates(
    conn: sqlite3.Connection,
    filename: str,
    where: str | None,
    choose: Callable[[str], set[str]] | None = None,
) -> list[str]:
    rows = [
        r[0]
        for r in conn.execute(
            "SELECT run_id FROM runs WHERE filename = ? AND status != 'running'"
            " ORDER BY started_at, run_id",
            (storable_text(filename),),  # as the store keeps a name UTF-8 cannot hold
        )
    ]
    if not where or not rows:
        return rows
    matching = choose(where) if choose is not None else matching_runs(conn, where)
    return [r for r in rows if r in matching]


def _complete_runs(conn: sqlite3.Connection, runs: Sequence[str], names: Sequence[str]) -> set[str]:
    """Runs that have every one of ``names`` in full: recorded, or backfilled by a replay
    that replayed the whole run.

    Values a partial replay backfilled (a worker of one segment failed or was killed,
    the others finished) do not count: the run is replayed again, and the values it
    already has are kept (backfill is idempotent), the missing segments filled in.
    """
    marks_n = ", ".join("?" for _ in names)
    marks_r = ", ".join("?" for _ in runs)
    return {
        r[0]
        for r in conn.execute(
            f"SELECT l.run_id FROM logs l WHERE l.name IN ({marks_n}) AND l.run_id IN ({marks_r})"
            " AND NOT EXISTS (SELECT 1 FROM replay_runs rr WHERE l.origin = 'backfilled'"
            " AND rr.replay_id = l.replay_id AND rr.run_id = l.run_id AND rr.status = 'partial')"
            " GROUP BY l.run_id HAVING COUNT(DISTINCT l.name) = ?",
            (*names, *runs, len(set(names))),
        )
    }


def _run_rows(
    conn: sqlite3.Connection, run_ids: Sequence[str], root: Path | None = None
) -> dict[str, dict[str, Any]]:
    """The runs' rows, each with where its code can be read (versions/portable.py):
    ``code_git_dir`` and ``code_rev``, or ``code_error`` when nowhere."""
    from retrolog.versions.portable import readable_version

    conn.row_factory = sqlite3.Row
    try:
        marks = ", ".join("?" for _ in run_ids)
        rows = conn.execute(f"SELECT * FROM runs WHERE run_id IN ({marks})", tuple(run_ids))
        found = {row["run_id"]: dict(row) for row in rows}
    finally:
        conn.row_factory = None
    store_dir = store_directory(conn)
    for row in found.values():
        try:
            version = readable_version(row, store_dir=store_dir, root=root)
        except RetrologError as exc:  # this run alone cannot be replayed
            row.update(code_git_dir=None, code_rev=None, code_error=exc)
        else:
            row.update(code_git_dir=str(version.git_dir), code_rev=version.rev, code_error=None)
    return found


def _database_file(conn: sqlite3.Connection) -> str | None:
    """The file ``conn`` reads (a working copy, when the store is in PostgreSQL), which
    the workers read too; None for one with no file."""
    for _, name, file in conn.execute("PRAGMA database_list"):
        if name == "main" and file:
            return str(file)
    return None


def _code(row: dict[str, Any]) -> tuple[Path, str]:
    """(git dir, revision) the run's code is read from; raises why there is none."""
    if row.get("code_error") is not None:
        raise row["code_error"]
    return Path(row["code_git_dir"]), row["code_rev"]


def _old_source(row: dict[str, Any], filename: str) -> str:
    from retrolog.versions.git import read_file

    return read_file(*_code(row), filename).decode()


# The problem "name" of a run whose code version cannot be read: no statement is at fault.
_NO_CODE = "*"


def _version_gone(row: dict[str, Any], filename: str, exc: Exception) -> str:
    return (
        f"its code version ({str(row['code_commit'])[:12]}, {filename}) cannot be read: "
        f"{exc} Only this run is skipped."
    )


_RESTORE_READS = 3  # timings of a quick checkpoint read, the fastest kept
_QUICK_READ_SECONDS = 0.05


def _restore_seconds_per_byte(paths: ProjectPaths, profiles: Sequence[Any]) -> float | None:
    """Seconds per checkpoint byte to read and verify one checkpoint's objects.

    Reading and checksumming the objects is most of a restore; decoding them into
    tensors is not. Measured here without importing torch, which alone takes seconds.
    The manifest is read once before the clock starts: a remote store's first request
    opens its connection (on S3, many times what a small checkpoint's read takes), which
    a worker pays once, not at every restore. A quick read is timed up to three times
    and the fastest kept: on a busy machine one preemption can make a read of a few
    milliseconds look ten times dearer, and every block the plan weighs against it with
    it.
    """
    from retrolog.checkpoint.codec import manifest_blobs
    from retrolog.store.backends import object_store_for

    for profile in profiles:
        manifest = next(iter(profile.block_checkpoints.values()), None) or profile.end_checkpoint
        if manifest is None:
            continue
        store = object_store_for(paths.store)
        try:
            store.get(manifest)
            seconds, total = math.inf, 0
            for _ in range(_RESTORE_READS):
                started = time.perf_counter()
                total = len(store.get(manifest))
                total += sum(len(store.get(key)) for key in manifest_blobs(manifest, store))
                seconds = min(seconds, time.perf_counter() - started)
                if seconds > _QUICK_READ_SECONDS:  # long enough not to hang on one preemption
                    break
        except StoreUnreachableError:
            raise  # every restore would wait for it too: say so now, before anything runs
        except RetrologError:  # the estimate falls back to record-time timings
            return None
        return seconds / total if total else None
    return None


# -- executing ---------------------------------------------------------------------------


def _execute(
    conn: sqlite3.Connection,
    paths: ProjectPaths,
    state: _Replay,
    executor: Executor,
    echo: Echo,
    land: Callable[[list[str]], None] | None = None,
) -> None:
    """Run the plan's jobs on ``executor``; each run's values land as its last job ends."""
    plan, request = state.plan, state.request
    assert plan is not None
    logs_dir, code_objects = _begin(conn, paths, state, executor)
    jobs = _jobs(
        conn, plan, state.runs, state.propagations, code_objects, state.names, paths, logs_dir,
        state.replay_id, request.threads, request.verify,
    )  # fmt: skip
    for job in jobs:
        job.start = state.starts.get(job.run_id)
    landing = _Landing(conn, state, jobs, code_objects, land)
    bar, step = _progress_bar(request.progress, len(jobs), "replay")

    def done(job: Job) -> None:
        step(job)
        landing.job_ended(job)

    status = "finished"
    try:
        executor.run(jobs, workers=plan.workers, on_done=done, echo=echo)
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        if bar is not None:
            bar.close()
        landing.rest()
        _mark_ended(conn, state.replay_id, status)


def _begin(
    conn: sqlite3.Connection, paths: ProjectPaths, state: _Replay, executor: Executor
) -> tuple[Path, dict[str, str | None]]:
    """The replay's row, directory and kept code and definitions; (its logs directory,
    each run's propagated script as a git object)."""
    from retrolog._query.lineage import keep

    logs_dir = paths.store / "replays" / state.replay_id
    logs_dir.mkdir(parents=True, exist_ok=True)
    claim(logs_dir)
    verify = state.request.verify
    code_objects = {
        run_id: None if verify else _store_code(paths.store, state.runs[run_id], prop.source)
        for run_id, prop in state.propagations.items()
    }
    assert state.plan is not None
    address = None if executor.address is None else mask(executor.address)
    conn.execute(
        "INSERT INTO replays(replay_id, started_at, names, where_sql, filename, workers, status,"
        " estimate_seconds, kind, executor, executor_address)"
        " VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?)",
        (state.replay_id, time.time(), json.dumps(state.names), state.request.where,
         state.filename, state.plan.workers, state.plan.estimate_seconds,
         "verify" if verify else "backfill", executor.name, address),
    )  # fmt: skip
    keep(conn, state.lineage.today.values(), replay_id=state.replay_id)
    _keep_propagated(conn, state.propagations, state.runs, state.filename, state.replay_id)
    return logs_dir, code_objects


class _Landing:
    """Each run's values into the store as the last of its jobs ends, so that a reader
    (the dashboard, ``dataframe``) sees them while the other runs still replay; the runs
    whose jobs were stopped, at the end. A run reusing another's values gets them as
    that one lands."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        state: _Replay,
        jobs: Sequence[Job],
        code_objects: dict[str, str | None],
        land: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.conn, self.state, self.code_objects, self.land = conn, state, code_objects, land
        self.per_run: dict[str, list[Job]] = {}
        for job in jobs:
            self.per_run.setdefault(job.run_id, []).append(job)
        self.ended: dict[str, int] = {}
        self.landed: set[str] = set()

    def job_ended(self, job: Job) -> None:
        self.ended[job.run_id] = self.ended.get(job.run_id, 0) + 1
        if self.ended[job.run_id] == len(self.per_run[job.run_id]):
            self._land(job.run_id)

    def rest(self) -> None:
        for run_id in self.per_run:
            if run_id not in self.landed:
                self._land(run_id)

    def _land(self, run_id: str) -> None:
        self.landed.add(run_id)  # once, even when writing it fails
        state = self.state
        _collect(self.conn, self.per_run[run_id], state, self.code_objects)
        reusers = {r: s for r, s in state.after.items() if s == run_id}
        if reusers and state.outcomes[run_id].status == "replayed":
            _copy_reused(self.conn, {}, reusers, state.outcomes, state.names, state.replay_id,
                         state.lineage)  # fmt: skip
            state.after = {r: s for r, s in state.after.items() if r not in reusers}
        if self.land is not None:
            self.land([run_id, *reusers])


def _progress_bar(progress: bool, total: int, desc: str) -> tuple[Any, Callable[[Job], None]]:
    """A tqdm bar of segments on a terminal (else None), and what marks one done."""
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="segment", file=sys.stderr)

    def done(job: Job) -> None:
        if bar is not None:
            bar.update(1)

    return bar, done


def _mark_ended(conn: sqlite3.Connection, replay_id: str, status: str) -> None:
    conn.execute(
        "UPDATE replays SET ended_at = ?, status = ? WHERE replay_id = ?",
        (time.time(), status, replay_id),
    )


def _keep_propagated(
    conn: sqlite3.Connection,
    propagations: Mapping[str, Propagation],
    runs: Mapping[str, dict[str, Any]],
    filename: str,
    replay_id: str,
) -> None:
    """The definitions of what each replayed version computes (most are today's)."""
    from retrolog._query.lineage import keep, version_reader
    from retrolog.versions.definitions import definitions

    seen: set[tuple[str, str]] = set()
    for run_id, propagated in propagations.items():
        row = runs[run_id]
        version = (row["code_git_dir"], row["code_rev"])
        names = [p.name for p in propagated.placements]
        if version in seen or not names:
            continue
        seen.add(version)
        read = version_reader(*_code(row), filename)
        found = definitions(
            propagated.source, names, filename=filename, read=read,
            rename=_carried_back(propagated),
        )  # fmt: skip
        keep(conn, found.values(), replay_id=replay_id)


def _carried_back(propagated: Propagation) -> dict[str, str]:
    """Carried definitions' private names back to today's, for their definition keys."""
    return {alias: name for name, alias in propagated.carried if alias != name}


def _jobs(
    conn: sqlite3.Connection,
    plan: ReplayPlan,
    runs: dict[str, dict[str, Any]],
    propagations: dict[str, Propagation],
    code_objects: dict[str, str | None],
    names: list[str],
    paths: ProjectPaths,
    logs_dir: Path,
    replay_id: str,
    threads: int | None,
    verify: bool,
) -> list[Job]:
    jobs: list[Job] = []
    for run_plan in plan.runs:
        row = runs[run_plan.run_id]
        profile = run_plan.profile
        assert profile is not None
        args = json.loads(row["args"] or "{}")
        parsed = json.loads(row.get("parsed_args") or "{}")
        recorded = json.loads(row.get("numerics") or "null")
        nested = profile.nested_block or tuple(True for _ in range(profile.iterations))
        whole = [i for i, has_nested in enumerate(nested) if not has_nested]
        check_names = _recorded_names(conn, run_plan.run_id, args, parsed, names)
        reads = sorted(names_read(propagations[run_plan.run_id].source, [*names, *check_names]))
        for index, segment in enumerate(run_plan.segments):
            spec = WorkerSpec(
                replay_id=replay_id,
                run_id=run_plan.run_id,
                store=str(paths.store),
                database=_database_file(conn),
                objects=objects_location(paths.store),
                names=list(names),
                check_names=check_names,
                args=args,
                outer_loop=profile.outer_loop,
                block_checkpoints={str(i): m for i, m in profile.block_checkpoints.items()},
                end_checkpoint=profile.end_checkpoint,
                restore=list(segment.restore),
                whole_iterations=whole,
                stop_after=segment.stop_after,
                restore_end=segment.restore_end,
                prefix_only=run_plan.scan is ScanLevel.PREFIX,
                output="",
                code_object=code_objects.get(run_plan.run_id),
                torch_state=_torch_state_for_worker(recorded, profile.threads, threads),
                parsed_args=parsed,
                reads=reads,
                extra=crashed.recorded_site(conn, row),
            )
            jobs.append(
                Job(
                    key=f"{run_plan.run_id}#{index}",
                    run_id=run_plan.run_id,
                    spec=spec,
                    argv=json.loads(row["argv"]),
                    filename=row["filename"],
                    cwd=row.get("cwd") or ".",
                    source=propagations[run_plan.run_id].source,
                    git_dir=_code(row)[0],
                    commit=_code(row)[1],
                    skipped=json.loads(row["skipped_files"] or "[]"),
                    estimate_seconds=segment.estimate_seconds,
                    log_path=logs_dir / f"{run_plan.run_id}-{index}.log",
                    numerics=recorded,
                    handsfree=handsfree_runs.inferred(row) is not None,
                )
            )
    jobs.sort(key=lambda j: -j.estimate_seconds)
    return jobs


def _torch_state_for_worker(
    recorded: dict[str, Any] | None, training_threads: int | None, threads: int | None
) -> dict[str, Any]:
    """The torch threads and flags a worker applies at torch's import.

    The state the run had when it started (the script's own later settings are made
    again by its code), else the one it trained with; a run recorded before the
    numerical environment was kept has only its training thread count.
    """
    state: dict[str, Any] = {}
    if recorded:
        state = dict(recorded.get("torch_at_start") or recorded.get("torch") or {})
    state.pop("version", None)
    state.pop("cpu_capability", None)
    state.pop("cuda_devices", None)
    if "intra_op_threads" not in state and training_threads:
        state["intra_op_threads"] = training_threads
    if threads is not None:
        state["intra_op_threads"] = threads
    return state


def _recorded_names(
    conn: sqlite3.Connection,
    run_id: str,
    args: dict[str, Any],
    parsed: dict[str, Any],
    names: Sequence[str],
) -> list[str]:
    """Names the run recorded that replay recomputes (arguments are not re-logged)."""
    rows = conn.execute(
        "SELECT DISTINCT name FROM logs WHERE run_id = ? AND origin = 'recorded'", (run_id,)
    )
    return sorted({r[0] for r in rows} - set(args) - set(parsed) - set(names))


def _store_code(store: Path, row: dict[str, Any], source: str) -> str | None:
    """Keep the propagated script as a git blob, so any value traces back to its code.

    In the store's cache repository (versions/portable.py), never the user's, with a
    ref that keeps it through git's garbage collection.
    """
    from retrolog.versions.portable import keep_script

    try:
        return keep_script(store, len(row["code_commit"] or ""), source)
    except RetrologError:
        return None


def _collect(
    conn: sqlite3.Connection,
    run_jobs_: Sequence[Job],
    state: _Replay,
    code_objects: dict[str, str | None],
) -> None:
    """One run's outcome from its jobs: the deferred check, its values backfilled, its
    ``replay_runs`` row."""
    run_id = run_jobs_[0].run_id
    row, outcome, names = state.runs[run_id], state.outcomes[run_id], state.names
    outcome.log_paths = [str(j.log_path) for j in run_jobs_]
    outcome.stopped = crashed.check(conn, row, run_jobs_, _source_if_raised(row, run_jobs_)).stopped
    finished = [j for j in run_jobs_ if j.output is not None]
    if not finished and not any(j.error is not None for j in run_jobs_):
        outcome.status = "interrupted"
        return
    outcome.actual_seconds = sum(j.seconds for j in run_jobs_)
    outputs = [j.output or {} for j in finished]
    rows = [r for out in outputs for r in out.get("values", [])]
    outcome.fallbacks = [
        (str(key), str(why)) for out in outputs for key, why in out.get("fallbacks", [])
    ]
    _check_run(conn, row, outcome, outputs, rows, names)
    if row["status"] == "crashed":
        rows, outcome.past_the_crash = _within_what_ran(conn, run_id, rows, outputs, set(names))
    lineage, replay_id = state.lineage, state.replay_id
    outcome.backfilled = backfill(
        conn, run_id=run_id, replay_id=replay_id, code_object=code_objects.get(run_id),
        rows=rows, names=names, force=state.request.force or run_id in lineage.changed,
        inexact=outcome.inexact, lineage=lineage.would.get(run_id, {}),
    )  # fmt: skip
    outcome.already = already_stored(
        conn, run_id=run_id, replay_id=replay_id, rows=rows, names=names
    )
    _settle_status(outcome, run_jobs_)
    assert state.plan is not None
    scan = next(rp.scan.name for rp in state.plan.runs if rp.run_id == run_id)
    _keep_run(conn, replay_id, outcome, scan, code_objects.get(run_id), outputs)


def _check_run(
    conn: sqlite3.Connection,
    row: dict[str, Any],
    outcome: RunOutcome,
    outputs: Sequence[dict[str, Any]],
    rows: Sequence[Any],
    names: Sequence[str],
) -> None:
    """The deferred check: recorded values and arguments the replay recomputed, and the
    numerical environment the workers had; how the run's values are marked."""
    # Names the code declares volatile (rl.volatile: wall-clock figures) are recomputed
    # and backfilled like any other, but no replay can reproduce them: not compared.
    outcome.volatile = sorted({n for out in outputs for n in out.get("volatile", [])})
    unchecked = set(names) | set(outcome.volatile)
    check = check_recorded(conn, outcome.run_id, [r for r in rows if r[1] not in unchecked])
    check = _check_arguments(check, row, outputs)
    outcome.mismatches, outcome.compared = check.mismatches, check.compared
    outcome.environment += _worker_environment(row, outputs)
    if check.mismatches:
        outcome.inexact = "mismatch"
        outcome.cause = _likely_cause(check, outcome.environment)
    elif outcome.environment:
        outcome.inexact = "environment"


def _settle_status(outcome: RunOutcome, run_jobs_: Sequence[Job]) -> None:
    """Replayed, or failed or partial with why."""
    finished = [j for j in run_jobs_ if j.output is not None]
    failed = [j for j in run_jobs_ if j.error is not None]
    # A segment with neither output nor error was stopped (Ctrl-C, SIGTERM) before it
    # finished: the run then has only some of its values, as when a worker fails.
    unfinished = [j for j in run_jobs_ if j.output is None and j.error is None]
    if failed:
        outcome.status = "partial" if finished else "failed"
        # What the script raised, and where, in each segment that says so (in their
        # order); otherwise the first failure's log tail.
        diagnosed = sorted((j for j in failed if j.diagnosed), key=_segment)
        if diagnosed:
            outcome.error = "\n".join(f"{j.error}; log: {j.log_path}" for j in diagnosed)
        else:
            job = failed[0]
            outcome.error = f"{job.error}; log: {job.log_path}\n{log_tail(job.log_path)}"
    elif unfinished:
        outcome.status = "partial"
        outcome.error = (
            f"stopped before {len(unfinished)} of its {len(run_jobs_)} segments finished"
        )
    else:
        outcome.status = "replayed"


def _keep_run(
    conn: sqlite3.Connection,
    replay_id: str,
    outcome: RunOutcome,
    scan: str,
    code_object: str | None,
    outputs: Sequence[dict[str, Any]],
) -> None:
    """The run's ``replay_runs`` row."""
    # What restoring cost, for recording's restore/materialize ratio (policy's c).
    restored = sum(int(out.get("restored", 0)) for out in outputs)
    restore_seconds = sum(float(out.get("restore_seconds", 0.0)) for out in outputs)
    hosts = sorted({str(out["host"]) for out in outputs if out.get("host")})
    conn.execute(
        "INSERT OR REPLACE INTO replay_runs(replay_id, run_id, scan, code_object, status,"
        " estimate_seconds, actual_seconds, backfilled, mismatches, error, restored,"
        " restore_seconds, compared, inexact, environment, hosts)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            replay_id, outcome.run_id, scan, code_object,
            outcome.status, outcome.estimate_seconds, outcome.actual_seconds,
            outcome.backfilled, json.dumps([m.__dict__ for m in outcome.mismatches]),
            outcome.error, restored, restore_seconds, outcome.compared,
            outcome.inexact and (outcome.cause or "possibly inexact: the numerical "
                                 "environment differed"),
            json.dumps(outcome.environment), json.dumps(hosts),
        ),
    )  # fmt: skip


def _segment(job: Job) -> int:
    return int(job.key.rsplit("#", 1)[1])


def _source_if_raised(row: dict[str, Any], jobs: Sequence[Job]) -> str | None:
    """The run's version of the script, when a worker raised (its lines are mapped to it)."""
    if not any(j.output is not None and j.output.get("crash") for j in jobs):
        return None
    try:
        return _old_source(row, jobs[0].filename)
    except (RetrologError, OSError, UnicodeDecodeError):
        return None


def _check_arguments(check: Check, row: dict[str, Any], outputs: Sequence[dict[str, Any]]) -> Check:
    """Add to the deferred check the arguments argparse/click gave the replayed script."""
    recorded = json.loads(row.get("parsed_args") or "{}")
    if not recorded:
        return check
    compared, different = 0, []
    for out in outputs:
        parsed = out.get("parsed_args") or {}
        for name, value in parsed.items():
            if name not in recorded:
                continue
            compared += 1
            if value != recorded[name]:
                different.append(f"{name}: recorded {recorded[name]!r}, replayed {value!r}")
    if not different:
        return Check(check.mismatches, check.compared + compared, check.first_after_restore)
    mismatch = Mismatch("<arguments>", len(different), compared, different[0])
    return Check([*check.mismatches, mismatch], check.compared + compared, False)


def _worker_environment(row: dict[str, Any], outputs: Sequence[dict[str, Any]]) -> list[str]:
    """Where the workers' torch state differed from the recorded one, and what they could
    not apply."""
    recorded = json.loads(row.get("numerics") or "null")
    found: list[str] = []
    for out in outputs:
        ran = out.get("torch_state") or {}
        if recorded:
            found += numerics.worker_differences(recorded, ran)
        found += [f"worker: {problem}" for problem in out.get("numerics_problems") or []]
    return list(dict.fromkeys(found))


def _likely_cause(check: Check, environment: Sequence[str]) -> str:
    """Where the differences point, in one phrase."""
    if environment:
        return f"the numerical environment was not the recorded one ({'; '.join(environment)})"
    if not check.first_after_restore:
        return (
            "values differed before any checkpoint was restored, so the script itself does "
            "not compute the same values again: something outside its code changes them "
            "(data-loading order with several loader workers, GPU kernels that are not "
            "deterministic, time- or machine-dependent code)"
        )
    return (
        "values differed only after restored checkpoints: a block changes state that the "
        "checkpoint does not hold; name every object the block changes in "
        "rl.checkpointing(...) (a second model or optimizer, an EMA copy, a stateful loss, "
        "and any random generator besides the global ones of torch, numpy and random, which "
        "are restored: a gym environment's env.np_random, a numpy Generator or "
        "random.Random the script made, a data sampler's generator)"
    )


# -- reporting ---------------------------------------------------------------------------


def _plan_text(
    plan: ReplayPlan | None,
    outcomes: dict[str, RunOutcome],
    complete: set[str],
    names: list[str],
    filename: str,
    verify: bool = False,
    lineage: _RunLineage | None = None,
) -> str:
    if verify:
        lines = [f"Verifying replay of {filename}: recorded statements only, nothing backfilled"]
    else:
        lines = [f"Replay of {filename} for {', '.join(names)}"]
    if plan is not None:
        lines.append(format_plan(plan))
    for outcome in outcomes.values():
        if outcome.status in ("unplaceable", "unreadable"):
            lines.append(f"run {outcome.run_id}: not replayed: {outcome.error}")
        elif outcome.status == "reused":
            lines.append(
                f"run {outcome.run_id}: reused from {outcome.reused_from} (the same "
                "configuration and history: its values are copied, not recomputed)"
            )
    different = [o for o in outcomes.values() if o.environment]
    if different:
        lines.append(
            "cannot be reproduced here (values from these runs will be marked possibly inexact):"
        )
        lines += [f"  {o.run_id}: {'; '.join(o.environment)}" for o in different]
    if lineage is not None:
        planned = {o.run_id for o in outcomes.values() if o.status == "planned"}
        changed = {r: n for r, n in lineage.changed.items() if r in planned}
        missing = [r for r in planned if r not in changed]
        if changed and missing:
            lines.append(f"missing: {len(missing)} run(s) have no value of a name")
        for run_id, changed_names in changed.items():
            lines.append(
                f"definition changed since: {run_id} has {', '.join(changed_names)} from an "
                "earlier statement; recomputed with today's"
            )
        recorded = _recorded_hint(lineage, names).strip()
        if recorded:
            lines.append(recorded)
    if complete:
        lines.append(
            f"{len(complete)} run(s) already have these values by today's definition "
            "(--force recomputes them)"
        )
    return "\n".join(lines)


def _within_what_ran(
    conn: sqlite3.Connection,
    run_id: str,
    rows: list[Any],
    outputs: list[dict[str, Any]],
    hindsight: set[str],
) -> tuple[list[Any], dict[str, int]]:
    """A crashed run's replayed rows, without the hindsight values past where it got.

    The run did not complete a loop iteration that has no end time (the epoch it died
    in, and the step), nor reach code after its outer loop; a replay that runs on
    (the run was killed, not failing deterministically) computes values there as if
    it had. Those are left out: the run has no such values to answer for.
    """
    unfinished = {
        ctx for (ctx,) in conn.execute(
            "SELECT ctx_id FROM loops WHERE run_id = ? AND t_end IS NULL", (run_id,)
        )
    }  # fmt: skip
    late = {name for out in outputs for name in out.get("after_loop", [])}
    kept: list[Any] = []
    dropped: dict[str, int] = {}
    for row in rows:
        ctx, name = row[0], row[1]
        if name in hindsight and (ctx in unfinished or (ctx is None and name in late)):
            dropped[name] = dropped.get(name, 0) + 1
            continue
        kept.append(row)
    return kept, dropped


def _report_unreadable(outcomes: dict[str, RunOutcome], echo: Echo) -> None:
    unreadable = [o.run_id for o in outcomes.values() if o.status == "unreadable"]
    if unreadable:
        echo(
            f"Skipped {len(unreadable)} run(s) whose code version cannot be read "
            f"({', '.join(unreadable)}): they are not replayed and get no values from this "
            "replay; the plan above says why for each. Make the version readable (fetch the "
            "clone that recorded it, or replay where it is) and replay again."
        )


def _report(outcomes: dict[str, RunOutcome], echo: Echo, verify: bool = False) -> None:
    _report_unreadable(outcomes, echo)
    for outcome in outcomes.values():
        if outcome.status in ("failed", "partial"):
            echo(f"run {outcome.run_id}: replay {outcome.status}: {outcome.error}")
        if outcome.stopped:
            echo(f"run {outcome.run_id}: replay {outcome.stopped}")
        if outcome.past_the_crash:
            counts = ", ".join(f"{n} x{c}" for n, c in sorted(outcome.past_the_crash.items()))
            echo(
                f"run {outcome.run_id} crashed: values the replay computed past where the run "
                f"got ({counts}: the iteration it died in, or after its loop) were not "
                "backfilled, since the run never computed them."
            )
        for key, why in outcome.fallbacks:
            echo(
                f"run {outcome.run_id}: checkpoint {key} was not restored, so its code was "
                f"executed instead (values are still exact, the replay was slower): {why}"
            )
        if outcome.volatile and outcome.status in ("replayed", "partial"):
            echo(
                f"run {outcome.run_id}: not compared, declared volatile (rl.volatile): "
                + ", ".join(outcome.volatile)
            )
        for m in outcome.mismatches:
            echo(
                f"run {outcome.run_id}: recorded {m.name!r} differs in replay in {m.count} of "
                f"{m.compared} places ({m.example})"
            )
    done = [o for o in outcomes.values() if o.status == "replayed"]
    inexact = [o for o in done if o.inexact == "mismatch" and o.reused_from is None]
    if verify and not sum(o.compared for o in done):
        echo(_nothing_verified(done))
    elif verify:
        exact = [o for o in done if not o.mismatches]
        checked = f" ({sum(o.compared for o in exact)} recorded values recomputed bit for bit)"
        echo(
            f"Verified {len(done)} run(s): {len(exact)} replay exactly"
            + (checked if exact else "")
            + (f", {len(inexact)} do not." if inexact else ".")
        )
    else:
        added = sum(o.backfilled for o in outcomes.values())
        reused = [o for o in done if o.reused_from is not None]
        shown = f" ({len(reused)} of them by reuse)" if reused else ""
        echo(f"Replayed {len(done)} run(s){shown}; backfilled {added} value(s){_kept(outcomes)}.")
    if inexact:
        echo(_inexact_paragraph(inexact, verify))


def _nothing_verified(done: Sequence[RunOutcome]) -> str:
    """Why a --verify replay compared no recorded value."""
    if not done:
        return (
            "Nothing was verified: no run could be replayed (the lines above say why for "
            "each), so no recorded value was recomputed."
        )
    return (
        f"Nothing was verified: {len(done)} run(s) replayed, but none of their recorded "
        "values was recomputed: the values they logged are all inside blocks the replay "
        "restored from checkpoints rather than ran (or they logged none). --verify compares "
        "what the replay runs again: values logged in the outer loop outside its inner "
        "loops, or after it. Log one there (a loss or metric per epoch) to verify these runs."
    )


def _kept(outcomes: Mapping[str, RunOutcome]) -> str:
    """ ", 12 already backfilled by replay R (kept)": values another replay stored first."""
    by: dict[str, int] = {}
    for outcome in outcomes.values():
        for other, count in outcome.already.items():
            by[other] = by.get(other, 0) + count
    if not by:
        return ""
    if len(by) == 1:
        ((other, count),) = by.items()
        return f", {count} already backfilled by replay {other} (kept)"
    each = ", ".join(f"{other} ({count})" for other, count in sorted(by.items()))
    return f", {sum(by.values())} already backfilled by replays {each} (kept)"


def _inexact_paragraph(inexact: Sequence[RunOutcome], verify: bool) -> str:
    runs = ", ".join(o.run_id for o in inexact)
    differed = "; ".join(
        f"{o.run_id}: " + ", ".join(f"{m.name!r} in {m.count} of {m.compared}" for m in mismatches)
        for o in inexact
        if (mismatches := o.mismatches)
    )
    causes = "; ".join(dict.fromkeys(o.cause for o in inexact if o.cause))
    stored = (
        ""
        if verify
        else (
            " The values backfilled from them are stored but marked inexact (`inexact` in "
            "`logs`, in `retrolog dataframe` and in `retrolog show RUN`)."
        )
    )
    accept = "" if verify else " Pass --allow-inexact to accept such values without an error exit."
    return (
        f"Replay of {len(inexact)} run(s) was not exact ({runs}): values they recorded came "
        f"out different when replayed ({differed}).{stored} Likely cause: {causes}.{accept}"
    )
