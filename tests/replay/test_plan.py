"""Replay planning: levels, restored vs executed blocks, segments, the estimate (replay/plan.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrolog._replay.plan import (
    FORKED_START_SECONDS,
    INTRA_OP_PARALLEL_FRACTION,
    ReplayPlan,
    RunProfile,
    ScanLevel,
    Segment,
    WorkerCosts,
    format_estimate_vs_actual,
    format_plan,
    load_profiles,
    measure_restore_throughput,
    plan_replay,
    scan_level_for,
)
from retrolog._replay.statements import Position, StatementSite
from retrolog.checkpoint.capture import CheckpointRecord, SynchronousCheckpointer
from retrolog.errors import RunNotFoundError, UsageError
from retrolog.store.objects import LocalObjectStore
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect

from conftest import Project, read_db


def make_profile(
    n: int = 4,
    *,
    run_id: str = "run-a",
    total: float | list[float] = 10.0,
    block: float | list[float] = 8.0,
    checkpoints: set[int] | None = None,
    restore: float = 0.5,
    nbytes: int = 1000,
    overhead: bool = True,
    end: bool = True,
    prefix: float = 3.0,
    suffix: float = 2.0,
    status: str = "finished",
) -> RunProfile:
    """A hand-made profile; every number is exact in binary so sums compare with ==."""
    ckpts = set(range(n)) if checkpoints is None else checkpoints
    totals = [total] * n if isinstance(total, float) else total
    blocks = [block] * n if isinstance(block, float) else block
    return RunProfile(
        run_id=run_id,
        filename="train.py",
        status=status,
        outer_loop="epoch",
        iterations=n,
        block_checkpoints={i: f"manifest-{i}" for i in sorted(ckpts)},
        end_checkpoint="manifest-end" if end else None,
        prefix_seconds=prefix,
        suffix_seconds=suffix,
        iteration_seconds=tuple(totals),
        block_seconds=tuple(blocks),
        checkpoint_bytes={i: nbytes for i in ckpts},
        code_version="abc123def456",
        checkpoint_seconds={i: restore for i in ckpts},
        # A nested block is captured inside its iteration, on the training thread.
        record_overhead_seconds={i: restore for i in ckpts} if overhead else {},
        end_checkpoint_bytes=nbytes if end else 0,
        end_checkpoint_seconds=1.0 if end else 0.0,
        end_record_overhead_seconds=1.0 if end else 0.0,
    )


# The profile the arithmetic tests use: 4 epochs of 10 s, 8 s of which in the step
# loop, checkpoints (0.5 s to materialize) for every epoch but epoch 2, prefix 3 s,
# suffix 2 s of which 1 s captured the end checkpoint.
#   non-block: 10 - 8 - 0.5 = 1.5 (epoch 2, no checkpoint captured: 2.0)
#   executed iteration: 9.5, 9.5, 10, 9.5   restored iteration: 1.5 + 0.5 = 2.0
#   head = 3, tail = 2 - 1 = 1
GAPPY = {"checkpoints": {0, 1, 3}}


def test_estimate_per_level_is_exact() -> None:
    profile = make_profile(**GAPPY)  # type: ignore[arg-type]
    expected = {
        ScanLevel.PREFIX: 3.0,
        ScanLevel.SUFFIX: 3.0 + 1.0 + 1.0,  # end restore ~ its materialize time
        ScanLevel.OUTER_LOOP: 3.0 + (2.0 + 2.0 + 10.0 + 2.0) + 1.0,
        ScanLevel.INNER_LOOP: 3.0 + (9.5 + 9.5 + 10.0 + 9.5) + 1.0,
    }
    for level, seconds in expected.items():
        plan = plan_replay(level, [profile], workers=1)
        assert plan.estimate_seconds == seconds, level
        (run,) = plan.runs
        assert run.scan is level
        assert run.estimate_seconds == seconds
        assert len(run.segments) == 1


def test_segments_per_level_say_what_the_worker_does() -> None:
    profile = make_profile(**GAPPY)  # type: ignore[arg-type]
    (prefix,) = plan_replay(ScanLevel.PREFIX, [profile], 1).runs[0].segments
    assert prefix == Segment("run-a", 0, 0, (), (), None, False, 3.0)
    (suffix,) = plan_replay(ScanLevel.SUFFIX, [profile], 1).runs[0].segments
    assert suffix == Segment("run-a", 0, 0, (), (), None, True, 5.0, restore_end=True)
    (outer,) = plan_replay(ScanLevel.OUTER_LOOP, [profile], 1).runs[0].segments
    assert outer == Segment("run-a", 0, 4, (0, 1, 3), (2,), None, True, 20.0)
    (inner,) = plan_replay(ScanLevel.INNER_LOOP, [profile], 1).runs[0].segments
    assert inner == Segment("run-a", 0, 4, (), (0, 1, 2, 3), None, True, 42.5)


def test_without_a_statement_after_the_loop_workers_stop_at_its_end() -> None:
    profile = make_profile(**GAPPY)  # type: ignore[arg-type]
    (outer,) = plan_replay(ScanLevel.OUTER_LOOP, [profile], 1, run_suffix=False).runs[0].segments
    assert outer == Segment("run-a", 0, 4, (0, 1, 3), (2,), 3, False, 19.0)  # no 1 s tail
    inner = plan_replay(ScanLevel.INNER_LOOP, [profile], 2, run_suffix=False).runs[0].segments
    assert inner[-1].stop_after == 3 and not inner[-1].run_suffix
    # A suffix scan needs the suffix whatever is asked.
    (suffix,) = plan_replay(ScanLevel.SUFFIX, [profile], 1, run_suffix=False).runs[0].segments
    assert suffix.run_suffix and suffix.estimate_seconds == 5.0


def test_missing_checkpoints_are_executed_and_noted() -> None:
    plan = plan_replay(ScanLevel.OUTER_LOOP, [make_profile(6, checkpoints={0, 2, 4})], 1)
    (run,) = plan.runs
    assert run.segments[0].restore == (0, 2, 4)
    assert run.segments[0].execute == (1, 3, 5)
    assert "3 of 6 blocks have no checkpoint: executed" in run.notes


def test_suffix_without_end_checkpoint_falls_back_to_the_outer_loop() -> None:
    profile = make_profile(end=False, status="crashed", **GAPPY)  # type: ignore[arg-type]
    (run,) = plan_replay(ScanLevel.SUFFIX, [profile], 1).runs
    assert run.scan is ScanLevel.OUTER_LOOP
    assert run.requested is ScanLevel.SUFFIX
    # No end checkpoint also means no end capture inside the recorded suffix: tail = 2.
    assert run.estimate_seconds == 3.0 + 16.0 + 2.0
    assert any("no end checkpoint (the run crashed)" in n for n in run.notes)
    assert "asked for suffix, planned as outer loop" in format_plan(
        plan_replay(ScanLevel.SUFFIX, [profile], 1)
    )


def test_levels_per_run_from_a_mapping() -> None:
    a, b = make_profile(run_id="a"), make_profile(run_id="b")
    plan = plan_replay({"a": ScanLevel.PREFIX, "b": ScanLevel.OUTER_LOOP}, [a, b], 2)
    assert [r.scan for r in plan.runs] == [ScanLevel.PREFIX, ScanLevel.OUTER_LOOP]
    with pytest.raises(UsageError, match="No scan level was given for run b"):
        plan_replay({"a": ScanLevel.PREFIX}, [a, b], 2)
    with pytest.raises(UsageError, match="at least one worker"):
        plan_replay(ScanLevel.PREFIX, [a], 0)


def test_scan_level_is_the_deepest_statement_and_unresolved_ones_are_noted() -> None:
    sites = {
        "acc": [StatementSite("acc", 10, Position.OUTER, ("epoch",))],
        "test": [StatementSite("test", 20, Position.SUFFIX, ())],
    }
    assert scan_level_for(sites) == (ScanLevel.OUTER_LOOP, ())
    sites["w"] = [StatementSite("w", 3, Position.INNER, (), "could not resolve: lambda")]
    level, notes = scan_level_for(sites)
    assert level is ScanLevel.INNER_LOOP
    assert notes == ("'w' (line 3): could not resolve: lambda",)
    plan = plan_replay(level, [make_profile()], 1, notes=notes)
    assert "could not resolve: lambda" in format_plan(plan)


def test_iterations_without_nested_loop_execute_at_the_outer_level() -> None:
    # Iteration 1 had no nested loop: its whole iteration is the block, and the
    # statement asked for at the outer level is inside it.
    profile = make_profile(3, total=[10.0, 6.0, 10.0], block=[8.0, 6.0, 8.0])
    (run,) = plan_replay(ScanLevel.OUTER_LOOP, [profile], 1).runs
    assert run.segments[0].restore == (0, 2)
    assert run.segments[0].execute == (1,)
    assert run.estimate_seconds == 3.0 + 2.0 + 6.0 + 2.0 + 1.0
    assert any("1 of 3 iterations have no nested loop" in n for n in run.notes)


def test_restore_from_measured_throughput_and_when_slower_than_the_block() -> None:
    profile = make_profile(2)
    plan = plan_replay(ScanLevel.OUTER_LOOP, [profile], 1, restore_seconds_per_byte=1 / 1024)
    # 1000 bytes at 1024 B/s per block; the end checkpoint is not needed at this level.
    assert plan.estimate_seconds == pytest.approx(3.0 + 2 * (1.5 + 1000 / 1024) + 1.0)
    assert any("measured" in n for n in plan.notes)
    slow = plan_replay(ScanLevel.OUTER_LOOP, [profile], 1, restore_seconds_per_byte=0.01)
    (run,) = slow.runs
    assert run.segments[0].restore == ()  # 10 s to restore, 8 s to run: run it
    assert run.estimate_seconds == 3.0 + 2 * 9.5 + 1.0
    assert any("take longer to restore" in n for n in run.notes)


def test_worker_start_up_is_the_prefix_without_recording_set_up_plus_its_exit() -> None:
    # Recording spent 0.5 s of its 3 s prefix capturing the code and registering the run;
    # a worker does not, but it takes 0.25 s to leave, and 0.75 s more to finalize the
    # interpreter when it runs the script to its end.
    profile = dataclasses.replace(make_profile(**GAPPY), setup_seconds=0.5)  # type: ignore[arg-type]
    worker = WorkerCosts(exit_seconds=0.25, teardown_seconds=0.75)
    expected = {
        ScanLevel.PREFIX: 2.5 + 0.25,
        ScanLevel.SUFFIX: 2.5 + 1.0 + 1.0 + 0.25 + 0.75,
        ScanLevel.OUTER_LOOP: 2.5 + 16.0 + 1.0 + 0.25 + 0.75,
        ScanLevel.INNER_LOOP: 2.5 + 38.5 + 1.0 + 0.25 + 0.75,
    }
    for level, seconds in expected.items():
        assert plan_replay(level, [profile], 1, worker=worker).estimate_seconds == seconds, level
    # Stopping at the loop's end is an os._exit: the exit, no suffix and no teardown.
    stops = plan_replay(ScanLevel.OUTER_LOOP, [profile], 1, worker=worker, run_suffix=False)
    assert stops.estimate_seconds == 2.5 + 16.0 + 0.25
    # Every segment of a split run pays its own start-up and exit.
    split = plan_replay(ScanLevel.INNER_LOOP, [profile], 2, worker=worker, run_suffix=False)
    segments = split.runs[0].segments
    assert len(segments) == 2
    bare = plan_replay(ScanLevel.INNER_LOOP, [profile], 2, run_suffix=False).runs[0].segments
    assert [s.estimate_seconds for s in segments] == [b.estimate_seconds + 0.25 for b in bare]


def test_a_forked_worker_saves_its_servers_start_and_leaves_at_its_own_cost() -> None:
    # 3 s of prefix, 2 of them the interpreter's start and imports a fork server made once:
    # a forked worker starts in the other 1 s (less recording's own 0.5 s set-up), and
    # leaves and finalizes at a forked process's costs, a new interpreter at its own.
    profile = dataclasses.replace(make_profile(**GAPPY), setup_seconds=0.5)  # type: ignore[arg-type]
    costs = {"exit_seconds": 0.25, "teardown_seconds": 0.75}
    forked_costs = {"forked_exit_seconds": 0.05, "forked_teardown_seconds": 0.25}
    new = WorkerCosts(**costs, **forked_costs)  # type: ignore[arg-type]
    forked = WorkerCosts(**costs, **forked_costs, preimported={profile.run_id: 2.0})  # type: ignore[arg-type]
    level = ScanLevel.OUTER_LOOP
    assert plan_replay(level, [profile], 1, worker=new).estimate_seconds == (
        2.5 + 16.0 + 1.0 + 0.25 + 0.75
    )
    assert plan_replay(level, [profile], 1, worker=forked).runs[0].estimate_seconds == (
        0.5 + 16.0 + 1.0 + 0.05 + 0.25
    )
    # Without forked figures a forked worker leaves as a new interpreter does.
    plain = WorkerCosts(**costs, preimported={profile.run_id: 2.0})  # type: ignore[arg-type]
    assert plan_replay(level, [profile], 1, worker=plain).runs[0].estimate_seconds == (
        0.5 + 16.0 + 1.0 + 0.25 + 0.75
    )


def test_a_forked_worker_starts_in_the_prefixs_own_work_when_the_recording_timed_its_imports() -> (
    None
):
    # 3 s of prefix: 1 s before the first retrolog call, then 0.5 s of recording's set-up
    # and 1.25 s of imports the recording timed, so 0.25 s of the script's own work. A
    # forked worker pays that and its own start, whatever its server's imports took.
    profile = dataclasses.replace(
        make_profile(**GAPPY),  # type: ignore[arg-type]
        setup_seconds=0.5,
        imports_seconds=1.0,
        late_imports_seconds=1.25,
    )
    level = ScanLevel.OUTER_LOOP
    for server in (1.5, 2.75, 9.0):
        forked = WorkerCosts(preimported={profile.run_id: server})
        (run,) = plan_replay(level, [profile], 1, worker=forked).runs
        assert run.estimate_seconds == 0.25 + FORKED_START_SECONDS + 16.0 + 1.0
    # Its own start as the fork server timed it on this machine replaces the constant; a
    # run the server did not time keeps the constant.
    timed = WorkerCosts(preimported={profile.run_id: 2.0}, forked_start={profile.run_id: 0.125})
    (run,) = plan_replay(level, [profile], 1, worker=timed).runs
    assert run.estimate_seconds == 0.25 + 0.125 + 16.0 + 1.0
    other = WorkerCosts(preimported={profile.run_id: 2.0}, forked_start={"another run": 0.125})
    (run,) = plan_replay(level, [profile], 1, worker=other).runs
    assert run.estimate_seconds == 0.25 + FORKED_START_SECONDS + 16.0 + 1.0
    # A new interpreter repeats all of it but recording's set-up.
    (run,) = plan_replay(level, [profile], 1, worker=WorkerCosts()).runs
    assert run.estimate_seconds == 2.5 + 16.0 + 1.0
    # A recording from before the clock: the prefix less what the server saves, as before.
    older = dataclasses.replace(profile, late_imports_seconds=None)
    forked = WorkerCosts(preimported={profile.run_id: 2.0})
    (run,) = plan_replay(level, [older], 1, worker=forked).runs
    assert run.estimate_seconds == 0.5 + 16.0 + 1.0


def test_the_replay_plans_a_forked_start_as_its_fork_server_timed_it() -> None:
    # The replayer's side: a start plan carrying its server's timing of a forked start
    # reaches the cost model, with the replay runtime's set-up (not timed) added.
    from retrolog._replay.forkserver import StartPlan
    from retrolog._replay.replayer import FORKED_SETUP_SECONDS, _plan

    profile = dataclasses.replace(
        make_profile(**GAPPY),  # type: ignore[arg-type]
        setup_seconds=0.5,
        imports_seconds=1.0,
        late_imports_seconds=1.25,
    )
    warm = StartPlan(warm=("torch",), packages=("torch",), warm_seconds=2.0)

    def estimate(start: StartPlan) -> float:
        starts = {profile.run_id: start}
        plan = _plan(ScanLevel.OUTER_LOOP, [profile], 1, None, (), False, "", None, starts)
        return plan.runs[0].estimate_seconds

    untimed = estimate(warm)
    timed = estimate(dataclasses.replace(warm, forked_start=0.375))
    assert timed - untimed == pytest.approx(0.375 + FORKED_SETUP_SECONDS - FORKED_START_SECONDS)
    text = _plan(
        ScanLevel.OUTER_LOOP, [profile], 1, None, (), False, "", None,
        {profile.run_id: dataclasses.replace(warm, forked_start=0.375)},
    ).notes  # fmt: skip
    assert any("a forked worker's own start (the fork, importing retrolog) measured at 0.38s" in n
               for n in text)  # fmt: skip


def test_start_up_pools_the_imports_over_the_runs_of_a_script() -> None:
    # Each run's prefix is its imports (one noisy sample of the same work) plus 3 s of
    # its own (data loading after the first retrolog call, which may depend on its args).
    def run(run_id: str, imports: float, filename: str = "train.py") -> RunProfile:
        return dataclasses.replace(
            make_profile(run_id=run_id, prefix=imports + 3.0),
            imports_seconds=imports,
            filename=filename,
        )

    three = [run("a", 1.0), run("b", 2.0), run("c", 6.0)]
    plan = plan_replay(ScanLevel.PREFIX, three, 1)
    assert [r.estimate_seconds for r in plan.runs] == [5.0, 5.0, 5.0]  # median 2 + own 3
    assert any("median over 3 runs (2.0s)" in n for n in plan.notes)
    # Runs of another script are pooled apart; fewer than 3 runs keep their own sample.
    other = [run("x", 8.0, "eval.py"), run("y", 0.5, "eval.py")]
    plan = plan_replay(ScanLevel.PREFIX, [*three, *other], 1)
    assert [r.estimate_seconds for r in plan.runs] == [5.0, 5.0, 5.0, 11.0, 3.5]
    # A profile without the split (a crashed run's guessed prefix) keeps its prefix.
    unsplit = dataclasses.replace(run("d", 4.0), imports_seconds=None)
    plan = plan_replay(ScanLevel.PREFIX, [*three, unsplit], 1)
    assert plan.runs[-1].estimate_seconds == 7.0


def test_iteration_times_pool_over_the_runs_of_a_script_that_agree() -> None:
    # 4 epochs, each checkpointed (0.5 s of snapshot on the training thread, taken out):
    # the code around the blocks (evaluation) is N_i = total - block - 0.5.
    def run(
        run_id: str, non_block: list[float], block: float, filename: str = "train.py"
    ) -> RunProfile:
        totals = [nb + block + 0.5 for nb in non_block]
        return dataclasses.replace(
            make_profile(run_id=run_id, total=totals, block=block), filename=filename
        )

    a = run("a", [2.0, 1.0, 1.0, 1.0], 8.0)  # the first epoch evaluates slower in every run
    b = run("b", [2.5, 1.25, 1.25, 1.25], 10.0)  # recorded in a process 1.25x slower
    c = run("c", [4.0, 1.0, 1.0, 1.0], 8.0)  # one evaluation disturbed
    d = run("d", [6.0, 3.0, 3.0, 3.0], 24.0)  # other arguments: 3x the work
    # Per iteration, the median over a, b and c: N = 2.5, 1, 1, 1 and B = 8; d keeps its own.
    # Outer loop: prefix 3 + sum(N_i + restore 0.5) + tail (suffix 2 - end capture 1).
    outer = plan_replay(ScanLevel.OUTER_LOOP, [a, b, c, d], 1)
    assert [r.estimate_seconds for r in outer.runs] == [11.5, 11.5, 11.5, 21.0]
    # Inner loop, every block executed: 3 + sum(N_i + B_i) + 1.
    inner = plan_replay(ScanLevel.INNER_LOOP, [a, b, c, d], 1)
    assert [r.estimate_seconds for r in inner.runs] == [41.5, 41.5, 41.5, 115.0]
    assert any(
        "code around the blocks taken per iteration as the median over 3 runs" in n
        and "run d: its own" in n
        for n in outer.notes
    ), outer.notes
    # Fewer than 3 runs of a script, or runs of another script: each run's own figures.
    x = run("x", [4.0, 1.0, 1.0, 1.0], 8.0, "eval.py")
    alone = plan_replay(ScanLevel.OUTER_LOOP, [a, b, x], 1)
    assert [r.estimate_seconds for r in alone.runs] == [11.0, 12.25, 13.0]
    assert not any("median over" in n for n in alone.notes)
    # Iterations that are their own block have no code around it to pool.
    whole = [
        make_profile(run_id=r, total=t, block=t) for r, t in (("p", 4.0), ("q", 5.0), ("r", 6.0))
    ]
    notes = plan_replay(ScanLevel.INNER_LOOP, whole, 1).notes
    assert any("time of the blocks taken per iteration as the median over 3" in n for n in notes)
    assert not any("code around the blocks" in n for n in notes), notes


def test_the_scripts_own_start_up_pools_over_the_runs_that_agree() -> None:
    # The prefix: interpreter and imports 2.0 s, packages imported later 0.5 s, recording's
    # set-up 0.25 s, then the script's own work before its first loop (data, model).
    def run(run_id: str, own: float, filename: str = "train.py") -> RunProfile:
        return dataclasses.replace(
            make_profile(run_id=run_id, prefix=2.0 + 0.5 + 0.25 + own),
            filename=filename,
            imports_seconds=2.0,
            late_imports_seconds=0.5,
            setup_seconds=0.25,
        )

    a, b, c = run("a", 0.5), run("b", 0.625), run("c", 0.5625)  # one process slower than another
    d = run("d", 2.0)  # other arguments: 4x the data to build, its own
    e = run("e", 0.4375)  # less data: 0.78x the median, beyond POOL_AGREEMENT, its own
    runs = (a, b, c, d, e)
    # Outer loop, each run alone: startup (prefix - set-up) + sum(N_i + restore) + tail.
    rest = 4 * (2.0 - 0.5 + 0.5) + (2.0 - 1.0)
    alone = [plan_replay(ScanLevel.OUTER_LOOP, [p], 1).estimate_seconds for p in runs]
    assert alone == [2.5 + own + rest for own in (0.5, 0.625, 0.5625, 2.0, 0.4375)]
    plan = plan_replay(ScanLevel.OUTER_LOOP, list(runs), 1)
    assert [r.estimate_seconds for r in plan.runs] == [
        2.5 + own + rest for own in (0.5625, 0.5625, 0.5625, 2.0, 0.4375)
    ]
    assert any(
        "own start-up work" in n and "median over 3 runs" in n and "run d, e: its own" in n
        for n in plan.notes
    ), plan.notes
    # A worker forked from a fork server repeats none of the imports: the pooled own part
    # and the fork.
    forked = WorkerCosts(preimported={p.run_id: 2.5 for p in runs})
    plan = plan_replay(ScanLevel.OUTER_LOOP, list(runs), 1, worker=forked)
    starts = [r.estimate_seconds - rest for r in plan.runs]
    assert starts == pytest.approx(
        [0.5625 + FORKED_START_SECONDS] * 3
        + [2.0 + FORKED_START_SECONDS, 0.4375 + FORKED_START_SECONDS]
    )
    # Fewer than 3 runs of a script, or a recording that did not time its imports: its own.
    x = run("x", 0.625, "eval.py")
    untimed = dataclasses.replace(run("u", 0.625), imports_seconds=None)
    plan = plan_replay(ScanLevel.OUTER_LOOP, [a, c, x, untimed], 1)
    assert [r.estimate_seconds for r in plan.runs] == [
        2.5 + 0.5 + rest,
        2.5 + 0.5625 + rest,
        2.5 + 0.625 + rest,
        3.125 + rest,
    ]
    assert not any("own start-up work" in n for n in plan.notes), plan.notes


def test_fewer_threads_than_recorded_slow_the_compute_by_amdahl() -> None:
    profile = dataclasses.replace(make_profile(**GAPPY), threads=4)  # type: ignore[arg-type]
    bare = plan_replay(ScanLevel.INNER_LOOP, [profile], 1).estimate_seconds
    assert bare == 3.0 + 38.5 + 1.0
    # 4 workers on 4 cores get 1 thread each: compute (iterations, suffix) slows by
    # speedup(4) / speedup(1); the start-up is taken as single-threaded.
    p = INTRA_OP_PARALLEL_FRACTION
    slower = 1 / ((1 - p) + p / 4)
    one_each = WorkerCosts(threads=1, cores=4)
    (run,) = plan_replay(ScanLevel.INNER_LOOP, [profile], 4, worker=one_each).runs
    assert sum(s.estimate_seconds for s in run.segments) > bare
    whole = plan_replay(ScanLevel.INNER_LOOP, [profile], 1, worker=WorkerCosts(threads=1, cores=4))
    assert whole.estimate_seconds == pytest.approx(3.0 + (38.5 + 1.0) * slower)
    # As many threads as recorded, or a script that set fewer itself: no change.
    same = WorkerCosts(threads=4, cores=4)
    assert plan_replay(ScanLevel.INNER_LOOP, [profile], 1, worker=same).estimate_seconds == bare
    own = dataclasses.replace(profile, threads=1)
    assert plan_replay(ScanLevel.INNER_LOOP, [own], 1, worker=one_each).estimate_seconds == bare
    # Unknown record-time threads: nothing to scale by.
    unknown = dataclasses.replace(profile, threads=None)
    assert plan_replay(ScanLevel.INNER_LOOP, [unknown], 1, worker=one_each).estimate_seconds == bare


def test_more_threads_than_cores_slow_every_worker() -> None:
    profile = make_profile(**GAPPY)  # type: ignore[arg-type]
    bare = plan_replay(ScanLevel.OUTER_LOOP, [profile], 1).estimate_seconds
    # 4 workers of 1 thread on 2 cores: each runs at half speed, start-up included.
    crowded = WorkerCosts(threads=1, cores=2)
    assert plan_replay(ScanLevel.OUTER_LOOP, [profile], 4, worker=crowded).estimate_seconds == (
        2 * bare
    )
    fits = WorkerCosts(threads=1, cores=4)
    assert plan_replay(ScanLevel.OUTER_LOOP, [profile], 4, worker=fits).estimate_seconds == bare


def test_inner_loop_two_workers_exact_split() -> None:
    plan = plan_replay(ScanLevel.INNER_LOOP, [make_profile(**GAPPY)], 2)  # type: ignore[arg-type]
    (run,) = plan.runs
    # [0,2) then [2,4): 3 + 19 = 22 and 3 + (2 + 2) + (10 + 9.5) + 1 = 27.5; the
    # alternatives cost max(12.5, 35) and max(32, 27.5).
    assert run.segments == (
        Segment("run-a", 0, 2, (), (0, 1), 1, False, 22.0),
        Segment("run-a", 2, 4, (0, 1), (2, 3), None, True, 27.5),
    )
    assert plan.estimate_seconds == 27.5
    assert plan.work_seconds == 49.5
    assert sorted(len(w) for w in plan.schedule) == [1, 1]


def check_segments(profile: RunProfile, segments: tuple[Segment, ...]) -> None:
    """Contiguous, covering, and each worker's restore/execute lists as pseudo-resume needs."""
    n = profile.iterations
    assert segments[0].start == 0
    assert segments[-1].stop == n
    for left, right in itertools.pairwise(segments):
        assert left.stop == right.start
        assert left.stop_after == left.stop - 1
        assert not left.run_suffix
    assert segments[-1].stop_after is None and segments[-1].run_suffix
    for s in segments:
        assert s.start < s.stop
        assert set(s.restore) <= set(profile.block_checkpoints)
        assert all(i < s.start for i in s.restore)
        assert sorted((*s.restore, *s.execute)) == list(range(s.stop))
        assert set(range(s.start, s.stop)) <= set(s.execute)


def expected_segment_cost(p: RunProfile, a: int, b: int, seconds_per_byte: float | None) -> float:
    """The cost model written out per iteration, independently of the planner's prefix sums."""
    cost = p.prefix_seconds + p.pre_outer_seconds
    for i in range(b):
        nested = p.is_nested(i)
        non_block = (
            max(
                p.iteration_seconds[i] - p.block_seconds[i] - p.record_overhead_seconds.get(i, 0),
                0.0,
            )
            if nested
            else 0.0
        )
        block = p.block_seconds[i] if nested else p.iteration_seconds[i]
        cost += non_block
        if i < a and i in p.block_checkpoints:
            restore = (
                p.checkpoint_bytes[i] * seconds_per_byte
                if seconds_per_byte is not None
                else p.checkpoint_seconds[i]
            )
            cost += min(restore, block)
        else:
            cost += block
    if b == p.iterations:
        cost += max(p.post_outer_seconds + p.suffix_seconds - p.end_record_overhead_seconds, 0)
    return cost


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_inner_loop_balanced_segments(workers: int) -> None:
    profile = make_profile(30, total=4.0, block=3.5, restore=0.25, prefix=2.0, suffix=1.0)
    plan = plan_replay(ScanLevel.INNER_LOOP, [profile], workers)
    (run,) = plan.runs
    assert len(run.segments) == workers
    check_segments(profile, run.segments)
    costs = [s.estimate_seconds for s in run.segments]
    for s in run.segments:
        assert s.estimate_seconds == pytest.approx(
            expected_segment_cost(profile, s.start, s.stop, None)
        )
    # Balanced to within one iteration (segments end on iteration boundaries) plus the suffix.
    assert max(costs) - min(costs) <= 4.0 + 1.0
    assert plan.estimate_seconds == pytest.approx(max(costs))
    if workers > 1:
        single = plan_replay(ScanLevel.INNER_LOOP, [profile], 1).estimate_seconds
        assert plan.estimate_seconds < single / workers * 1.3


def test_missing_early_checkpoints_make_early_boundaries_expensive() -> None:
    full = make_profile(30, total=4.0, block=3.5, restore=0.25)
    gappy = make_profile(30, total=4.0, block=3.5, restore=0.25, checkpoints=set(range(10, 30)))
    full_run = plan_replay(ScanLevel.INNER_LOOP, [full], 3).runs[0]
    gappy_run = plan_replay(ScanLevel.INNER_LOOP, [gappy], 3).runs[0]
    check_segments(gappy, gappy_run.segments)
    # Later segments must execute blocks 0..9 to pseudo-resume, so they take fewer iterations.
    first = gappy_run.segments[0]
    assert first.stop > full_run.segments[0].stop
    for later in gappy_run.segments[1:]:
        assert set(range(10)) <= set(later.execute)
    assert any("10 of 30 blocks have no checkpoint" in n for n in gappy_run.notes)


def test_without_checkpoints_splitting_does_not_pay() -> None:
    profile = make_profile(10, checkpoints=set())
    plan = plan_replay(ScanLevel.INNER_LOOP, [profile], 3)
    (run,) = plan.runs
    assert len(run.segments) == 1
    assert any("not split" in n for n in run.notes)


def test_segments_of_several_runs_are_packed_longest_first() -> None:
    profiles = [
        make_profile(6, run_id="a", total=8.0, block=7.5, restore=0.25),
        make_profile(6, run_id="b", total=8.0, block=7.5, restore=0.25),
        make_profile(6, run_id="c", total=2.0, block=1.5, restore=0.25),
    ]
    plan = plan_replay(ScanLevel.INNER_LOOP, profiles, 2)
    scheduled = [s for worker in plan.schedule for s in worker]
    all_segments = [s for run in plan.runs for s in run.segments]
    assert sorted(map(id, scheduled)) == sorted(map(id, all_segments))
    loads = [sum(s.estimate_seconds for s in worker) for worker in plan.schedule]
    assert plan.estimate_seconds == pytest.approx(max(loads))
    assert plan.estimate_seconds >= plan.work_seconds / 2
    # Two long runs and a short one on two workers: one long run per worker beats splitting.
    assert plan.estimate_seconds < plan_replay(ScanLevel.INNER_LOOP, profiles, 1).estimate_seconds
    for p, run in zip(profiles, plan.runs, strict=True):
        check_segments(p, run.segments)


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 20.0), st.booleans(), st.booleans()),
        min_size=1,
        max_size=20,
    ),
    workers=st.integers(1, 4),
    restore=st.floats(0.0, 3.0),
    per_byte=st.one_of(st.none(), st.floats(0.0, 0.01)),
)
def test_inner_loop_plan_invariants(
    times: list[tuple[float, float, bool, bool]],
    workers: int,
    restore: float,
    per_byte: float | None,
) -> None:
    n = len(times)
    profile = make_profile(
        n,
        total=[nb + b if nested else b for nb, b, nested, _ in times],
        block=[b for _, b, _, _ in times],
        checkpoints={i for i, (_, _, _, has) in enumerate(times) if has},
        restore=restore,
    )
    plan = plan_replay(ScanLevel.INNER_LOOP, [profile], workers, restore_seconds_per_byte=per_byte)
    (run,) = plan.runs
    assert 1 <= len(run.segments) <= min(workers, n)
    check_segments(profile, run.segments)
    for s in run.segments:
        expected = expected_segment_cost(profile, s.start, s.stop, per_byte)
        assert s.estimate_seconds == pytest.approx(expected, abs=1e-9)
        # A restored block is never the more expensive choice.
        assert all(i in profile.block_checkpoints for i in s.restore)
    single = plan_replay(ScanLevel.INNER_LOOP, [profile], 1, restore_seconds_per_byte=per_byte)
    assert plan.estimate_seconds <= single.estimate_seconds + 1e-9
    assert plan.estimate_seconds >= max(s.estimate_seconds for s in run.segments) - 1e-9


def test_format_plan_shows_runs_levels_and_totals() -> None:
    plan = plan_replay(
        {"run-a": ScanLevel.INNER_LOOP, "run-b": ScanLevel.SUFFIX},
        [make_profile(**GAPPY), make_profile(run_id="run-b")],  # type: ignore[arg-type]
        2,
    )
    text = format_plan(plan)
    assert "run-a" in text and "run-b" in text
    assert "inner loop" in text and "suffix" in text
    assert "abc123def456" in text and "train.py" in text
    assert "2 run(s) on 2 worker(s)" in text
    assert "[0, 2)" in text and "[2, 4)" in text  # the inner-loop run's segments
    assert "total: 54.5s of work, about 27.5s on 2 worker(s)" in text
    assert "1 of 4 blocks have no checkpoint: executed" in text


def test_format_estimate_vs_actual() -> None:
    plan = plan_replay(
        ScanLevel.OUTER_LOOP, [make_profile(run_id="a"), make_profile(run_id="b")], 1
    )
    text = format_estimate_vs_actual(plan, {"a": 16.0, "b": 19.0})
    lines = text.splitlines()
    assert lines[0].split() == ["run", "estimate", "actual", "error"]
    assert lines[1].split() == ["a", "12.0s", "16.0s", "-25.0%"]
    assert lines[2].split() == ["b", "12.0s", "19.0s", "-36.8%"]
    assert lines[3].split() == ["total", "24.0s", "35.0s", "-31.4%"]
    assert "-" in format_estimate_vs_actual(plan, {"a": 16.0}).splitlines()[2]


# -- profiles from a real store ------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = connect(tmp_path / "retrolog.db")
    migrate(conn)
    yield conn
    conn.close()


def insert_run(
    conn: sqlite3.Connection, run_id: str, status: str = "finished", **cols: Any
) -> None:
    row = {
        "run_id": run_id,
        "projid": "proj",
        "tstamp": "2026-06-23T10:00:00",
        "filename": "train.py",
        "status": status,
        "started_at": 1000.0,
        "ended_at": 1100.0,
        "host": "h",
        "pid": 1,
        "python": "3.11",
        "argv": "[]",
        "code_commit": "0123456789abcdef0123",
        **cols,
    }
    conn.execute(
        f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
        tuple(row.values()),
    )


def insert_epochs(
    conn: sqlite3.Connection,
    run_id: str,
    epochs: int,
    *,
    checkpointed: set[int],
    finished: bool = True,
) -> None:
    """An epoch loop with 2 steps per epoch, 10 s an epoch of which 8 s in the steps."""
    ctx = 0
    for e in range(epochs):
        last = e == epochs - 1
        t0 = 2.0 + 10.0 * e
        done = finished or not last
        conn.execute(
            "INSERT INTO loops VALUES (?, ?, NULL, 'epoch', ?, ?, 0, ?, ?)",
            (run_id, ctx, e, e, t0, t0 + 10.0 if done else None),
        )
        outer = ctx
        for s in range(2):
            ctx += 1
            conn.execute(
                "INSERT INTO loops VALUES (?, ?, ?, 'step', ?, ?, 1, ?, ?)",
                (run_id, ctx, outer, s, s, t0 + 1 + 4 * s, t0 + 5 + 4 * s),
            )
        ctx += 1
        if done:
            conn.execute(
                "INSERT INTO profile VALUES (?, 'iteration', ?, 10.0, 8.0)", (run_id, outer)
            )
        if e in checkpointed:
            conn.execute(
                "INSERT INTO checkpoints (run_id, ctx_id, loop_name, kind, manifest, nbytes,"
                " capture_seconds, write_seconds, created_at) VALUES (?, ?, 'epoch', 'block',"
                " ?, 4096, 0.125, 0.375, 0)",
                (run_id, outer, f"m{e}"),
            )


def test_load_profiles_from_the_store(db: sqlite3.Connection) -> None:
    insert_run(db, "r1")
    insert_epochs(db, "r1", 3, checkpointed={0, 2})
    db.execute("INSERT INTO profile VALUES ('r1', 'prefix', NULL, 2.5, NULL)")
    db.execute("INSERT INTO profile VALUES ('r1', 'suffix', NULL, 1.5, NULL)")
    db.execute(
        "INSERT INTO checkpoints (run_id, ctx_id, loop_name, kind, manifest, nbytes,"
        " capture_seconds, write_seconds, created_at) VALUES ('r1', NULL, 'epoch', 'end',"
        " 'mend', 8192, 0.25, 0.25, 0)"
    )
    (p,) = load_profiles(db, ["r1"])
    assert p.run_id == "r1" and p.filename == "train.py" and p.status == "finished"
    assert p.code_version == "0123456789ab"
    assert p.outer_loop == "epoch"
    assert p.iterations == 3
    assert p.block_checkpoints == {0: "m0", 2: "m2"}
    assert p.checkpoint_bytes == {0: 4096, 2: 4096}
    assert p.checkpoint_seconds == {0: 0.5, 2: 0.5}
    assert p.record_overhead_seconds == {0: 0.5, 2: 0.5}
    assert p.nested_block == (True, True, True)
    assert p.iteration_seconds == (10.0, 10.0, 10.0)
    assert p.block_seconds == (8.0, 8.0, 8.0)
    assert (p.end_checkpoint, p.end_checkpoint_bytes, p.end_checkpoint_seconds) == (
        "mend",
        8192,
        0.5,
    )
    assert (p.prefix_seconds, p.suffix_seconds) == (2.5, 1.5)
    assert (p.pre_outer_seconds, p.post_outer_seconds) == (0.0, 0.0)
    assert p.notes == ()

    # non-block 10 - 8 - 0.5 = 1.5 (2 without a checkpoint); restore 0.5; suffix 1.5 - 0.5.
    plan = plan_replay(ScanLevel.OUTER_LOOP, [p], 1)
    assert plan.estimate_seconds == 2.5 + (1.5 + 0.5) + (2.0 + 8.0) + (1.5 + 0.5) + 1.0
    assert plan.runs[0].segments[0].restore == (0, 2)
    suffix = plan_replay(ScanLevel.SUFFIX, [p], 1)
    assert suffix.estimate_seconds == 2.5 + 0.5 + 1.0


def test_background_checkpoints_cost_the_training_thread_their_snapshot_only(
    db: sqlite3.Connection,
) -> None:
    insert_run(db, "bg")
    insert_epochs(db, "bg", 3, checkpointed={0, 1, 2})
    # Epochs 1 and 2 were checkpointed in the background: 0.125 s snapshot on the training
    # thread, 0.375 s of writing elsewhere. Epoch 0's was synchronous (no writer).
    db.execute(
        "UPDATE checkpoints SET writer_cpu_seconds = 0.25 WHERE run_id = 'bg' AND manifest != 'm0'"
    )
    db.execute("INSERT INTO profile VALUES ('bg', 'prefix', NULL, 2.5, NULL)")
    db.execute("INSERT INTO profile VALUES ('bg', 'setup', NULL, 0.5, NULL)")
    db.execute("INSERT INTO profile VALUES ('bg', 'threads', NULL, 2, NULL)")
    # Setting up the checkpointer at the first block's end, inside epoch 0: 0.25 s.
    db.execute("INSERT INTO profile VALUES ('bg', 'checkpoint_setup', NULL, 0.25, NULL)")
    db.execute(
        "INSERT INTO checkpoints (run_id, ctx_id, loop_name, kind, manifest, nbytes,"
        " capture_seconds, write_seconds, created_at, writer_cpu_seconds) VALUES ('bg', NULL,"
        " 'epoch', 'end', 'mend', 8192, 0.25, 0.25, 0, 0.125)"
    )
    (p,) = load_profiles(db, ["bg"])
    assert p.imports_seconds == 0.5  # the prefix before the first loop's start (2.0 s in)
    assert p.record_overhead_seconds == {0: 0.75, 1: 0.125, 2: 0.125}
    assert p.checkpoint_seconds == {0: 0.5, 1: 0.5, 2: 0.5}  # restore ~ materialize
    assert (p.end_checkpoint_seconds, p.end_record_overhead_seconds) == (0.5, 0.25)
    assert (p.setup_seconds, p.threads) == (0.5, 2)
    # Executed: non-block 10 - 8 - overhead = 1.25, 1.875, 1.875; prefix 2.5 - set-up 0.5.
    plan = plan_replay(ScanLevel.INNER_LOOP, [p], 1, run_suffix=False)
    assert plan.estimate_seconds == 2.0 + 9.25 + 9.875 + 9.875


def test_load_profiles_of_a_killed_run(db: sqlite3.Connection) -> None:
    # SIGKILLed in epoch 2: no prefix/suffix rows, no end checkpoint, epoch 2 unfinished.
    insert_run(db, "r2", status="crashed", ended_at=None)
    insert_epochs(db, "r2", 3, checkpointed={0, 1}, finished=False)
    (p,) = load_profiles(db, ["r2"])
    assert p.iterations == 3
    assert p.iteration_seconds == (10.0, 10.0, 10.0)  # the mean of the finished ones
    assert p.prefix_seconds == 2.0  # run start to the first loop
    assert p.end_checkpoint is None
    assert any("mean of the others" in n for n in p.notes)
    assert any("no prefix timing" in n for n in p.notes)
    (run,) = plan_replay(ScanLevel.SUFFIX, [p], 1).runs
    assert run.scan is ScanLevel.OUTER_LOOP
    assert "the run crashed" in " ".join(run.notes)


def test_load_profiles_without_loops_and_of_unknown_runs(db: sqlite3.Connection) -> None:
    insert_run(db, "r3", ended_at=1042.0)
    (p,) = load_profiles(db, ["r3"])
    assert (p.outer_loop, p.iterations, p.prefix_seconds) == (None, 0, 42.0)
    for level in ScanLevel:
        assert plan_replay(level, [p], 2).estimate_seconds == 42.0
    with pytest.raises(RunNotFoundError) as info:
        load_profiles(db, ["r3", "nope"])
    assert info.value.run_id == "nope"


def test_measure_restore_throughput(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / ".retrolog" / "objects", durable=False)
    records: list[CheckpointRecord] = []
    with SynchronousCheckpointer(store, records.append) as ckpt:
        state = {"w": np.arange(200_000, dtype=np.float64)}
        ckpt.capture(ctx_id=0, loop_name="epoch", kind="block", objects=state)
    rate = measure_restore_throughput(tmp_path / ".retrolog", records[0].manifest)
    assert rate > 0 and math.isfinite(rate)


@pytest.mark.slow
def test_plan_a_recorded_run(project: Project) -> None:
    project.write(
        "train.py",
        """
        import json, time
        import retrolog as rl

        state = {"w": [0.0] * 1000}
        with rl.checkpointing(state=state):
            for epoch in rl.loop("epoch", range(3)):
                for step in rl.loop("step", range(3)):
                    time.sleep(0.01)
                    state["w"][0] += 1
                time.sleep(0.005)
                rl.log("acc", state["w"][0])
        rl.log("done", 1)
        """,
    )
    project.run("train.py")
    conn = connect(project.root / ".retrolog" / "retrolog.db", readonly=True)
    try:
        (run_id,) = [r[0] for r in conn.execute("SELECT run_id FROM runs")]
        (p,) = load_profiles(conn, [run_id])
    finally:
        conn.close()
    assert (p.outer_loop, p.iterations, p.status) == ("epoch", 3, "finished")
    assert sorted(p.block_checkpoints) == [0, 1, 2] and p.end_checkpoint is not None
    assert p.nested_block == (True, True, True)
    assert all(b >= 0.03 for b in p.block_seconds)
    assert p.prefix_seconds > 0 and p.notes == ()
    rate = measure_restore_throughput(project.root / ".retrolog", p.block_checkpoints[0])
    plan = plan_replay(ScanLevel.OUTER_LOOP, [p], 2, restore_seconds_per_byte=1 / rate)
    inner = plan_replay(ScanLevel.INNER_LOOP, [p], 1, restore_seconds_per_byte=1 / rate)
    assert plan.estimate_seconds < inner.estimate_seconds
    assert isinstance(plan, ReplayPlan) and run_id in format_plan(plan)
    assert json.dumps([s.restore for s in plan.runs[0].segments]) == "[[0, 1, 2]]"


def test_the_plan_pools_the_iteration_times_of_runs_that_agree(project: Project) -> None:
    # Three runs that differ in an argument that does not change the work, and one whose
    # argument triples every iteration's and its start-up (loading its data, after the
    # imports): the plan takes the median per iteration and of the start-up over the
    # three and says so. The sleeps are long enough that a busy machine's scheduling
    # delays (tens of milliseconds) keep the three within the 1.25x the rule allows.
    project.write(
        "train.py",
        """
        import time
        import retrolog as rl

        work = rl.arg("work", 1)
        seed = rl.arg("seed", 0)
        time.sleep(0.5 * work)
        state = {"w": [0.0] * 100}
        with rl.checkpointing(state=state):
            for epoch in rl.loop("epoch", range(3)):
                for step in rl.loop("step", range(4)):
                    time.sleep(0.05 * work)
                    state["w"][0] += 1
                time.sleep(0.05 * work)
                rl.log("acc", state["w"][0])
        """,
    )
    for seed, work in ((1, 1), (2, 1), (3, 1), (4, 3)):
        # Recorded as a user's runs are: the adaptive rule, not the suite's every-block default.
        project.run(
            "train.py", "--kwargs", f"seed={seed}", f"work={work}", RETROLOG_CHECKPOINTS="adaptive"
        )
    runs = [r for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]
    source = (project.root / "train.py").read_text()
    statement = '        rl.log("acc", state["w"][0])\n'
    project.write(
        "train.py",
        source.replace(statement, statement + '        rl.log("twice", 2 * state["w"][0])\n'),
    )
    out = project.cli("replay", "twice", "--dry-run")
    assert out.returncode == 0, out.stderr
    for part in ("blocks", "code around the blocks"):
        assert (
            f"train.py: time of the {part} taken per iteration as the median over 3 runs that "
            f"agree within 1.25x (run {runs[3]}: its own, further off)"
        ) in out.stderr, out.stderr
    startup = re.search(
        r"train\.py: its own start-up work \(after the imports, before the first loop\) taken "
        r"as the median over 3 runs that agree within 1\.25x \((\d+\.\d+)s\) "
        rf"\(run {runs[3]}: its own, further off\)",
        out.stderr,
    )
    assert startup is not None, out.stderr
    assert 0.5 <= float(startup.group(1)) < 0.5 * 1.25, out.stderr
