"""The adaptive rule (Flor's joint invariant) and the settings that steer it."""

from __future__ import annotations

import math

import pytest

from retrolog.checkpoint import settings
from retrolog.checkpoint.policy import DUE_SHARE_ONE_SLOT, AdaptivePolicy, Decision
from retrolog.errors import UsageError


def _run(
    policy: AdaptivePolicy, blocks: list[float], m: float, writer_cpu: float = 0.0
) -> list[int]:
    """Feed block times through the policy; each checkpoint costs ``m`` on the main thread."""
    taken = []
    for i, seconds in enumerate(blocks):
        if policy.decide("epoch", seconds):
            taken.append(i)
            policy.captured("epoch", m)
            policy.written("epoch", writer_cpu, 0.0)
    return taken


def _expected(blocks: list[float], m: float, bound: float) -> list[int]:
    """The invariant written out independently: first always, then (k+1)*M < n*mean(C)*bound."""
    taken: list[int] = []
    total = spent = 0.0  # summed as the policy sums them, so ties round the same way
    for i, seconds in enumerate(blocks):
        total += seconds
        n, k = i + 1, len(taken)
        if not taken or (k + 1) * (spent / k) < n * (total / n) * bound:
            taken.append(i)
            spent += m
    return taken


def test_first_block_is_always_checkpointed_however_expensive() -> None:
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.decide("epoch", 0.001)
    policy.captured("epoch", 10.0)
    assert not policy.decide("epoch", 0.001)


def test_checkpoints_follow_the_invariant_with_equal_blocks() -> None:
    # M = C: a checkpoint costs a whole block, so at eps = 1/15 the k-th one
    # waits until n > 15 k: blocks 0, 30, 45 and 60 of 64 (0-based n = i + 1).
    policy = AdaptivePolicy(eps=1 / 15)
    taken = _run(policy, [1.0] * 64, m=1.0)
    assert taken == [0, 30, 45, 60]
    assert taken == _expected([1.0] * 64, 1.0, 1 / 15)


def test_cheap_checkpoints_are_taken_every_block() -> None:
    policy = AdaptivePolicy(eps=1 / 15)
    assert _run(policy, [2.0] * 20, m=0.01) == list(range(20))


def test_overhead_stays_under_eps_for_any_block_times() -> None:
    blocks = [0.5 + (i * 37 % 11) / 10 for i in range(200)]
    for m in (0.001, 0.02, 0.1, 0.7, 3.0):
        policy = AdaptivePolicy(eps=1 / 15)
        taken = _run(policy, blocks, m=m)
        assert taken == _expected(blocks, m, 1 / 15)
        # Every checkpoint after the first one kept the total under eps.
        assert (len(taken) - 1) * m <= sum(blocks) / 15 + 1e-9


def test_restore_ratio_tightens_the_bound_when_restoring_is_slow() -> None:
    # c = 29: a restore costs 29 materializations, so the bound is 1/30 < eps.
    policy = AdaptivePolicy(eps=1 / 15, c=29.0)
    assert policy.bound() == pytest.approx(1 / 30)
    assert _run(policy, [1.0] * 64, m=1.0) == _expected([1.0] * 64, 1.0, 1 / 30)


def test_writer_cpu_counts_towards_m_only_when_training_shares_the_cpu() -> None:
    blocks = [1.0] * 40
    cpu = AdaptivePolicy(eps=1 / 15, count_writer_cpu=True)
    gpu = AdaptivePolicy(eps=1 / 15, count_writer_cpu=False)
    assert _run(cpu, blocks, m=0.01, writer_cpu=0.99) == _expected(blocks, 1.0, 1 / 15)
    assert _run(gpu, blocks, m=0.01, writer_cpu=0.99) == list(range(40))


def test_the_writers_measured_slowdown_replaces_its_cpu_time() -> None:
    policy = AdaptivePolicy(eps=1 / 15, count_writer_cpu=True)
    assert policy.decide("epoch", 5.0, 0.0)  # the first execution: warming up, not fitted
    stats = policy.blocks["epoch"]
    policy.captured("epoch", 0.01)
    policy.written("epoch", 2.0, 3.0)  # a write: 2 s of CPU over 3 s of wall time
    policy.decide("epoch", 1.0, 0.0)  # the writer idle: block time 1.0
    # Nothing measured about the writer's cost yet: its CPU time counts.
    assert stats.writer_slowdown() is None
    assert policy.materialize_seconds(stats) == pytest.approx(2.01)
    # A block the writer was busy for throughout ran 25% slower: a write of 3 s
    # costs training 3 * 0.25 / 1.25 = 0.6 s.
    policy.decide("epoch", 1.25, 1.25)
    assert stats.writer_slowdown() == pytest.approx(0.25)
    assert policy.materialize_seconds(stats) == pytest.approx(0.61)
    # Partly busy blocks on the same line keep the estimate.
    policy.decide("epoch", 1.125, 0.5625)  # busy half of it: 12.5% slower
    policy.decide("epoch", 1.0, 0.0)
    assert stats.writer_slowdown() == pytest.approx(0.25)
    # A writer measured as free costs nothing beyond the capture.
    free = AdaptivePolicy(eps=1 / 15, count_writer_cpu=True)
    for busy in (0.0, 0.0, 1.0):
        free.decide("epoch", 1.0, busy)
    free.captured("epoch", 0.01)
    free.written("epoch", 2.0, 3.0)
    assert free.materialize_seconds(free.blocks["epoch"]) == pytest.approx(0.01)


def test_a_slow_first_execution_does_not_hide_the_writers_cost() -> None:
    """The first block warms up; taken as the writer-idle reference it would make every
    later block look as fast with the writer busy as without, and the writer free."""
    policy = AdaptivePolicy(eps=1 / 15, count_writer_cpu=True)
    assert policy.decide("epoch", 1.3, 0.0)  # warm-up, and the writer has nothing to do
    policy.captured("epoch", 0.005)
    policy.written("epoch", 0.05, 1.0)  # the write took all of the next block
    stats = policy.blocks["epoch"]
    policy.decide("epoch", 1.15, 1.15)  # 15% slower with the writer busy throughout
    # Only the warm-up had the writer idle: nothing to measure against, so the
    # writer's CPU time counts (with the warm-up as reference, s would be 0).
    assert stats.writer_slowdown() is None
    assert policy.materialize_seconds(stats) == pytest.approx(0.055)
    policy.decide("epoch", 1.0, 0.0)  # the writer idle: now it is measured
    assert stats.writer_slowdown() == pytest.approx(0.15)
    # M: the capture plus 1.0 s * 0.15 / 1.15 of the write, not its 0.05 s of CPU.
    assert policy.materialize_seconds(stats) == pytest.approx(0.005 + 0.15 / 1.15)


def test_every_mode_checkpoints_every_block() -> None:
    policy = AdaptivePolicy(eps=1 / 15, every=True)
    assert _run(policy, [0.001] * 10, m=5.0) == list(range(10))


def test_no_second_checkpoint_before_the_first_write_reports_its_cost() -> None:
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.decide("epoch", 1.0)
    policy.captured("epoch", 0.001)
    assert not policy.decide("epoch", 1.0)  # cheap capture, but the write's cost is unknown
    policy.written("epoch", 0.001, 0.01)
    assert policy.decide("epoch", 1.0)


def test_a_full_writer_is_a_refusal_of_its_own_and_the_rule_asks_again() -> None:
    """The rule decides against a block end the writer cannot take, before any capture,
    counts it apart from the cost refusals, and takes the next block end that has room."""
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.decide("epoch", 1.0) is Decision.TAKE
    policy.captured("epoch", 0.001)
    policy.written("epoch", 0.001, 0.01)
    full = policy.decide("epoch", 1.0, room=False)
    assert full is Decision.WRITER_FULL and not full and full.waits_on_writer
    stats = policy.blocks["epoch"]
    assert stats.checkpoints == 1 and stats.refused_writer_full == 1 and stats.refused_cost == 0
    assert policy.decide("epoch", 1.0) is Decision.TAKE
    # A block end the invariant refuses is a cost refusal, whether the writer has room or not.
    policy.captured("epoch", 100.0)
    assert policy.decide("epoch", 1.0, room=False) is Decision.COST
    assert (stats.refused_cost, stats.refused_writer_full) == (1, 1)


def test_a_full_writer_may_be_waited_for_within_what_the_invariant_still_allows() -> None:
    policy = AdaptivePolicy(eps=0.1)
    assert policy.decide("epoch", 1.0) is Decision.TAKE
    policy.captured("epoch", 0.01)
    policy.written("epoch", 0.001, 0.01)
    stats = policy.blocks["epoch"]
    limits: list[float] = []

    def came_free(limit: float) -> bool:
        limits.append(limit)
        return True

    # n * C * eps - (k + 1) * M = 0.2 - 2 * 0.011, capped at one block's share: 0.1.
    assert policy.decide("epoch", 1.0, room=False, wait_for_room=came_free) is Decision.TAKE
    assert limits == [pytest.approx(0.1)]
    assert (stats.room_waits, stats.refused_writer_full) == (1, 0)
    policy.captured("epoch", 0.01 + 0.15)  # the capture is charged the wait
    # Less slack than a block's share: the wait is bounded by the slack. M is the mean
    # capture, 0.085, plus the idle lane's CPU per write, 0.001.
    limits.clear()
    assert policy.decide("epoch", 1.0, room=False, wait_for_room=came_free) is Decision.TAKE
    assert limits == [pytest.approx(3.0 * 0.1 - 3 * 0.086)]
    policy.captured("epoch", 0.01)
    # A wait in vain is a refusal, and charged to M all the same.
    m = policy.materialize_seconds(stats)
    assert policy.decide("epoch", 1.0, room=False, wait_for_room=lambda limit: False) is (
        Decision.WRITER_FULL
    )
    assert stats.refused_writer_full == 1
    policy.waited("epoch", 0.03)
    assert policy.materialize_seconds(stats) == pytest.approx(m + 0.03 / 3)
    # No slack left: training does not wait at all.
    policy.captured("epoch", 10.0)

    def never(limit: float) -> bool:
        raise AssertionError("asked to wait with no slack")

    assert policy.decide("epoch", 1.0, room=False, wait_for_room=never) is Decision.COST


def test_the_first_block_end_waits_for_room_too() -> None:
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.decide("round", 1.0, room=False) is Decision.WRITER_FULL
    assert policy.decide("round", 1.0) is Decision.TAKE


def test_before_the_first_write_the_rule_cannot_price_a_checkpoint() -> None:
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.decide("epoch", 1.0)
    policy.captured("epoch", 0.001)
    unpriced = policy.decide("epoch", 1.0)
    assert unpriced is Decision.UNPRICED and unpriced.waits_on_writer
    assert policy.blocks["epoch"].refused_cost == 1


def test_the_urgent_lanes_time_counts_in_full_and_its_blocks_stay_out_of_the_fit() -> None:
    """The urgent lane writes at training's priority: while it writes, training loses
    the cores and the GIL to it, whatever the idle lane's measured slowdown says."""
    policy = AdaptivePolicy(eps=1 / 15, count_writer_cpu=True)
    assert policy.decide("epoch", 5.0)  # warm-up, not fitted
    policy.captured("epoch", 0.01)
    # Taken over by the urgent lane after the idle lane spent 0.01 s of CPU in 0.3 s:
    # the urgent lane wrote for 0.06 s (0.04 s of it on a CPU).
    policy.written(
        "epoch", 0.05, 0.5, urgent_cpu_seconds=0.04, idle_seconds=0.3, urgent_seconds=0.06
    )
    stats = policy.blocks["epoch"]
    assert stats.urgent_writes == 1
    assert policy.materialize_seconds(stats) == pytest.approx(0.01 + 0.06 + 0.01)
    # Idle and busy blocks measure the idle lane's slowdown: 20% ...
    policy.decide("epoch", 1.0, 0.0, urgent_seconds=0.0)
    policy.decide("epoch", 1.2, 1.2, urgent_seconds=0.0)
    # ... and a block the urgent lane wrote in (it is slower for that) is not fitted.
    policy.decide("epoch", 3.0, 0.0, urgent_seconds=0.5)
    assert stats.fits == 2 and stats.writer_slowdown() == pytest.approx(0.2)
    # M: capture + the urgent lane's time + the idle lane's 0.3 s times s / (1 + s).
    assert policy.materialize_seconds(stats) == pytest.approx(0.01 + 0.06 + 0.3 * 0.2 / 1.2)
    policy.decide("epoch", 1.0, 0.0, urgent_seconds=0.5)  # the lane did nothing since
    assert stats.fits == 3
    # Training on a GPU leaves the CPU to the writer: neither lane counts.
    gpu = AdaptivePolicy(eps=1 / 15, count_writer_cpu=False)
    gpu.decide("epoch", 1.0)
    gpu.captured("epoch", 0.01)
    gpu.written("epoch", 0.05, 0.5, urgent_cpu_seconds=0.04, urgent_seconds=0.06)
    assert gpu.materialize_seconds(gpu.blocks["epoch"]) == pytest.approx(0.01)


def test_a_checkpoint_is_due_one_mean_block_before_its_slot_is_needed_again() -> None:
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.due_in("epoch", 2) == 0.0
    policy.decide("epoch", 3.0)
    policy.captured("epoch", 0.01)
    policy.written("epoch", 0.005, 0.2)  # the block's first write finished: it is priced
    policy.decide("epoch", 1.0)  # a mean block of 2 s
    assert policy.due_in("epoch", 2) == pytest.approx(2.0)
    assert policy.due_in("epoch", 4) == pytest.approx(6.0)
    # One slot: needed at the next block end, so due half a block after the capture.
    assert policy.due_in("epoch", 1) == pytest.approx(DUE_SHARE_ONE_SLOT * 2.0) == 1.0


def test_a_blocks_first_checkpoint_is_due_in_time_to_price_the_next_block_end() -> None:
    # Until the first write finishes, the next block end is refused as unpriced. Due a
    # whole block after its capture (as later ones are, with two slots), a first write
    # the idle lane cannot do on a full machine would still be running at that block end.
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.decide("epoch", 2.0)
    policy.captured("epoch", 0.01)
    assert policy.due_in("epoch", 2) == pytest.approx(DUE_SHARE_ONE_SLOT * 2.0)
    assert policy.due_in("epoch", 4) == pytest.approx(DUE_SHARE_ONE_SLOT * 2.0)
    # Not written by the next block end: refused, and counted as unpriced.
    assert policy.decide("epoch", 2.0) is Decision.UNPRICED
    stats = policy.blocks["epoch"]
    assert (stats.refused_cost, stats.refused_unpriced) == (1, 1)
    policy.written("epoch", 0.005, 0.1)
    assert policy.decide("epoch", 2.0) is Decision.TAKE
    policy.captured("epoch", 0.01)
    assert policy.due_in("epoch", 2) == pytest.approx(2.0)  # priced: the slots decide


def test_blocks_of_different_loops_are_counted_apart() -> None:
    policy = AdaptivePolicy(eps=1 / 15)
    assert policy.decide("epoch", 1.0)
    policy.captured("epoch", 100.0)
    assert policy.decide("round", 1.0)  # its own first execution


def test_settings_come_from_configure_over_environment_over_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(settings, "_configured", {})
    env = {"RETROLOG_OVERHEAD_TOLERANCE": "0.02", "RETROLOG_CHECKPOINTS": "adaptive"}
    got = settings.current(env)
    assert got.overhead_tolerance == 0.02
    assert got.checkpoints == "adaptive"
    assert got.max_in_flight == 2 and got.when_full == "skip" and got.restore_ratio is None
    assert settings.current({}).overhead_tolerance == pytest.approx(1 / 15)
    # Dense checkpoints wait for the writer unless told otherwise.
    assert settings.current({"RETROLOG_CHECKPOINTS": "every"}).when_full == "wait"
    settings.configure(overhead_tolerance=0.05, max_in_flight=3, when_full="wait")
    got = settings.current(env)
    assert (got.overhead_tolerance, got.max_in_flight, got.when_full) == (0.05, 3, "wait")
    assert (
        settings.current({"RETROLOG_CHECKPOINTS": "every", "RETROLOG_WHEN_FULL": "skip"}).when_full
        == "wait"
    )  # configure() wins over the environment
    settings.configure(when_full="skip")
    assert settings.current({"RETROLOG_CHECKPOINTS": "every"}).when_full == "skip"
    settings.configure(checkpoints=None)  # None leaves it
    assert settings.current(env).checkpoints == "adaptive"


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("RETROLOG_OVERHEAD_TOLERANCE", "0", "in (0, 1]"),
        ("RETROLOG_OVERHEAD_TOLERANCE", "lots", "in (0, 1]"),
        ("RETROLOG_CHECKPOINTS", "sometimes", "'adaptive'"),
        ("RETROLOG_MAX_IN_FLIGHT", "0", "at least 1"),
        ("RETROLOG_WHEN_FULL", "drop", "'wait'"),
        ("RETROLOG_RESTORE_RATIO", "-1", "positive"),
    ],
)
def test_bad_environment_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, fragment: str
) -> None:
    monkeypatch.setattr(settings, "_configured", {})
    with pytest.raises(UsageError) as info:
        settings.current({variable: value})
    assert variable in str(info.value) and fragment in str(info.value)


def test_configure_refuses_unknown_and_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings, "_configured", {})
    with pytest.raises(UsageError, match="no setting 'eps'"):
        settings.configure(eps=0.1)
    with pytest.raises(UsageError, match=r"configure\(max_in_flight=...\)"):
        settings.configure(max_in_flight=1.5)
    with pytest.raises(UsageError, match="in \\(0, 1\\]"):
        settings.configure(overhead_tolerance=math.inf)
    assert settings._configured == {}
