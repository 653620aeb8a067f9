"""When a block's end state is checkpointed: Flor's joint invariant, per skippable block.

With M the main-thread cost of
materializing a checkpoint, C the block's compute time, n the block's
executions so far (this one included) and k its checkpoints so far, take a
checkpoint when

    M / C  <  n / (k + 1) * min(1 / (1 + c), eps)

Multiplied out, ``(k + 1) * M < n * C * min(...)``: after this checkpoint, the
time spent materializing stays under eps of the time spent computing (record
overhead), and the time spent restoring (c * M each) stays under the time
executing would take (replay never loses to re-execution). M and C are running
means over what was measured, so one slow block neither starves nor floods
the rule.

What M counts: the training thread's own time in the capture (the snapshot
copy, plus any wait for a free writer slot), plus what the background
writer's work costs training. The writer has two lanes
(docs/materialization.md). Its idle lane runs at the lowest priority on idle
cycles, which costs a CPU-bound training little but not nothing: memory
bandwidth, a hyperthread sibling, the GIL. So the rule measures it. Each
block end reports the share f of the block the idle lane was busy; a
least-squares line through (f, C) over the block's executions (the first
left out: it is warming up; and blocks during which the urgent lane wrote,
which are slower for another reason) gives C = C0 * (1 + s * f), s being how
much slower blocks run while the idle lane writes, and its share of a
checkpoint costs training W * s / (1 + s), with W its wall time. Until the
line is identifiable (some blocks with the lane idle, some with it busy for
at least :data:`BUSY` of the block), training on the CPU counts the idle
lane's CPU time instead (training on a GPU: nothing). The urgent lane writes
at training's priority what the idle lane has not written in time; training
on the CPU counts its whole wall time on a write as lost: while it writes it
competes with training for the cores (a writer at training's priority cost
0.9 s of training per second of its CPU, docs/materialization.md) and for the
GIL, and on the cnn workload a write cost training several times its CPU
time. The writer's figures arrive after each write, so the rule uses the
means of the writes finished so far.

A checkpoint the rule chose is written, so the rule must also know whether
the writer can take one: when all ``max_in_flight`` snapshots are held at a
block end the invariant would checkpoint, training waits for a slot at most
as long as the invariant still holds with the wait charged to this
checkpoint, and at most one block's share of the bound (the writer hurries
the oldest meanwhile). A slot is often held only by the idle lane, stalled
inside a checkpoint the urgent lane has written already, and it lets go
within milliseconds of the block end. If none comes free in that time, the
block end is refused (:attr:`Decision.WRITER_FULL`, counted apart from the
cost refusals), and the rule asks again at the next one.

The first execution of a block is always checkpointed (nothing is known about
M yet, and a replay needs a starting point) if the writer has room, and so is
the end state, which goes through no decision.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass

BUSY = 0.25  # the slowdown is measured once a block had the writer busy this share of it
IDLE = 0.05  # ... and one had it busy at most this share
# With a single writer slot, a checkpoint is due this share of a mean block after its
# capture, so that the urgent lane has the rest of the block to free the slot.
DUE_SHARE_ONE_SLOT = 0.5


class Decision(enum.Enum):
    """What the rule decided at a block end; true only for TAKE."""

    TAKE = "take"  # checkpoint this block end
    COST = "cost"  # the invariant says no: it would cost more than the bound allows
    UNPRICED = "unpriced"  # the block's first write has not finished: M is not known yet
    WRITER_FULL = "writer_full"  # the invariant says yes, but the writer holds max_in_flight

    def __bool__(self) -> bool:
        return self is Decision.TAKE

    @property
    def waits_on_writer(self) -> bool:
        """Whether the rule cannot take a checkpoint until the writer finishes the oldest."""
        return self is Decision.WRITER_FULL or self is Decision.UNPRICED


@dataclass
class BlockStats:
    """What the rule knows about one skippable block (one outer loop)."""

    executions: int = 0  # n
    checkpoints: int = 0  # k: chosen (each is captured and written, or lost)
    lost: int = 0  # of them, those the store could not take (a full disk, an outage)
    refused_cost: int = 0  # block ends refused by the invariant, or before M was known
    refused_writer_full: int = 0  # ... that the invariant would take, the writer being full
    refused_unpriced: int = 0  # of refused_cost, those before the block's first write finished
    room_waits: int = 0  # block ends taken after waiting for a slot (within the slack)
    compute_seconds: float = 0.0  # sum of C over the executions
    capture_seconds: float = 0.0  # training-thread seconds of the captures
    captures: int = 0
    writer_cpu_seconds: float = 0.0  # writer CPU seconds of the finished writes, both lanes
    urgent_cpu_seconds: float = 0.0  # of them, the urgent lane's (at training's priority)
    urgent_write_seconds: float = 0.0  # wall seconds the urgent lane spent on finished writes
    idle_write_seconds: float = 0.0  # wall seconds the idle lane spent on finished writes
    write_seconds: float = 0.0  # wall seconds of the finished writes
    writes: int = 0
    urgent_writes: int = 0  # finished writes the urgent lane took part in
    # Sums for the least-squares line C = a + b * f, f the writer's busy share.
    fits: int = 0
    sum_f: float = 0.0
    sum_c: float = 0.0
    sum_ff: float = 0.0
    sum_fc: float = 0.0
    busy_seen: bool = False  # a block with f >= BUSY
    urgent_mark: float = 0.0  # the urgent lane's busy seconds at the block's previous end
    idle_seen: bool = False  # a block with f <= IDLE

    def writer_slowdown(self) -> float | None:
        """s: how much slower blocks run while the writer writes; None until measurable."""
        if not (self.busy_seen and self.idle_seen):
            return None
        n = self.fits
        spread = n * self.sum_ff - self.sum_f**2
        if spread <= 0:
            return None
        slope = (n * self.sum_fc - self.sum_f * self.sum_c) / spread
        intercept = (self.sum_c - slope * self.sum_f) / n
        if intercept <= 0:
            return None
        return max(slope / intercept, 0.0)


class AdaptivePolicy:
    """Decides, at each block end, whether its state is checkpointed.

    eps: the overhead tolerance; c: restore time over materialize time;
    every: checkpoint every block regardless (the "every" setting);
    count_writer_cpu: whether training loses the writer's CPU time (training
      on the CPU): the urgent lane's always, the idle lane's until its
      slowdown is measured.
    """

    def __init__(
        self, *, eps: float, c: float = 1.0, every: bool = False, count_writer_cpu: bool = True
    ) -> None:
        self.eps = eps
        self.c = c
        self.every = every
        self.count_writer_cpu = count_writer_cpu
        self.blocks: dict[str, BlockStats] = {}
        self._lock = threading.Lock()  # written from the writer thread too

    def bound(self) -> float:
        """min(1/(1+c), eps): the share of compute a checkpoint may cost."""
        return min(1.0 / (1.0 + self.c), self.eps)

    def materialize_seconds(self, stats: BlockStats) -> float:
        """M: the mean main-thread cost of one checkpoint of this block so far."""
        with self._lock:
            if not stats.captures:
                return 0.0
            m = stats.capture_seconds / stats.captures
            if not stats.writes:
                return m
            if self.count_writer_cpu:
                m += stats.urgent_write_seconds / stats.writes
            slowdown = stats.writer_slowdown()
            if slowdown is not None:
                m += stats.idle_write_seconds / stats.writes * slowdown / (1.0 + slowdown)
            elif self.count_writer_cpu:
                m += (stats.writer_cpu_seconds - stats.urgent_cpu_seconds) / stats.writes
            return m

    def due_in(self, loop_name: str, max_in_flight: int) -> float:
        """Seconds after a capture of ``loop_name``'s block after which the urgent lane writes it.

        As late as the rule can afford, so that the idle lane, which costs
        training next to nothing, has every chance to write it first: with
        ``max_in_flight`` slots and a checkpoint at every block end, a
        checkpoint's slot is needed again ``max_in_flight`` block ends after
        its capture, so it is due one mean block before that (the urgent lane
        then has a block to write it); with one slot, half a block after its
        capture.

        The block's first checkpoint is due half a block after its capture
        whatever the slots: until one of its writes has finished the rule
        cannot price the next block end (:attr:`Decision.UNPRICED`), and a
        first write left to the idle lane on a machine that training fills
        would leave that block end unchecked. Written by then, it prices it.
        """
        stats = self.blocks.get(loop_name)
        if stats is None or not stats.executions:
            return 0.0
        with self._lock:
            priced = stats.writes > 0
        blocks = max(max_in_flight - 1, DUE_SHARE_ONE_SLOT) if priced else DUE_SHARE_ONE_SLOT
        return blocks * stats.compute_seconds / stats.executions

    def decide(
        self,
        loop_name: str,
        compute_seconds: float,
        writer_busy: float = 0.0,
        *,
        room: bool = True,
        urgent_seconds: float = 0.0,
        wait_for_room: Callable[[float], bool] | None = None,
    ) -> Decision:
        """Count one execution of ``loop_name``'s block; checkpoint its end state?

        compute_seconds: the block's time (C); writer_busy: seconds of it the
        idle lane spent writing; room: whether the writer can take a
        checkpoint now without training waiting; urgent_seconds: the urgent
        lane's busy seconds so far in the run (it wrote during this block if
        they grew since the block's previous end); wait_for_room: when there
        is no room but the invariant would take the checkpoint, called with
        the most seconds training may wait for a slot, true if one came free
        (the caller charges the wait to the capture).
        """
        stats = self.blocks.setdefault(loop_name, BlockStats())
        stats.executions += 1
        urgent_busy, stats.urgent_mark = urgent_seconds - stats.urgent_mark, urgent_seconds
        compute = max(compute_seconds, 0.0)
        stats.compute_seconds += compute
        # The first execution is left out of the fit: it is warming up (allocations,
        # caches, lazy initialization), and as the one block with the writer surely
        # idle it would pass for "the writer costs nothing" (a CNN whose first epoch
        # ran 20% slower got s = 0 and a checkpoint every epoch, each costing ~15%).
        # So is a block the urgent lane wrote in: it is slower by that lane's CPU time,
        # which M counts on its own, and the line would charge it to the idle lane.
        if compute > 0 and stats.executions > 1 and urgent_busy <= 0:
            # The fit is only touched on the training thread: no lock.
            share = min(max(writer_busy / compute, 0.0), 1.0)
            stats.fits += 1
            stats.sum_f += share
            stats.sum_c += compute
            stats.sum_ff += share * share
            stats.sum_fc += share * compute
            stats.busy_seen = stats.busy_seen or share >= BUSY
            stats.idle_seen = stats.idle_seen or share <= IDLE
        decision = self._invariant(stats)
        if decision is Decision.TAKE and not room:
            decision = Decision.WRITER_FULL
            # Training may wait for a slot as long as the invariant still holds with the
            # wait charged to this checkpoint, and no longer than one block's share of
            # the bound: what a checkpoint of this block may cost on its own.
            if wait_for_room is not None:
                share = stats.compute_seconds / stats.executions * self.bound()
                limit = min(self.slack(stats), share)
                if limit > 0 and wait_for_room(limit):
                    decision = Decision.TAKE
                    stats.room_waits += 1
        if decision is Decision.WRITER_FULL:
            stats.refused_writer_full += 1
        elif decision is not Decision.TAKE:
            stats.refused_cost += 1
            if decision is Decision.UNPRICED:
                stats.refused_unpriced += 1
        return decision

    def _invariant(self, stats: BlockStats) -> Decision:
        # With none taken, or every one taken lost to the store, no write is under way:
        # the next is taken as the first was, to learn its price.
        if self.every or stats.checkpoints == stats.lost:
            return Decision.TAKE
        with self._lock:
            if not stats.writes:
                # The first write has not finished: what a checkpoint costs beyond
                # the capture is unknown yet, and a guess could take one too many.
                return Decision.UNPRICED
        return Decision.TAKE if self.slack(stats) > 0 else Decision.COST

    def slack(self, stats: BlockStats) -> float:
        """n * C * min(...) - (k + 1) * M: seconds the next checkpoint may add to M's sum."""
        k = stats.checkpoints
        return stats.compute_seconds * self.bound() - (k + 1) * self.materialize_seconds(stats)

    def captured(self, loop_name: str, capture_seconds: float) -> None:
        """A checkpoint of ``loop_name``'s block was taken, costing the training thread this."""
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            stats.checkpoints += 1
            stats.captures += 1
            stats.capture_seconds += capture_seconds

    def lost(self, loop_name: str) -> None:
        """A checkpoint of ``loop_name``'s block was not stored (called on a writer thread).

        Its capture stays charged to M; it no longer holds back the next one as a
        write whose price is still to come.
        """
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            stats.lost += 1

    def waited(self, loop_name: str, seconds: float) -> None:
        """Training waited this long for a writer slot at a block end and took nothing.

        Charged to the block's checkpoints (M) like a wait that ended in a
        capture: it is recording's cost all the same, and the invariant keeps
        the sum under the bound.
        """
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            stats.capture_seconds += max(seconds, 0.0)

    def written(
        self,
        loop_name: str,
        writer_cpu_seconds: float,
        write_seconds: float,
        urgent_cpu_seconds: float = 0.0,
        idle_seconds: float | None = None,
        urgent_seconds: float = 0.0,
    ) -> None:
        """The writer finished a checkpoint of ``loop_name``'s block (called on its thread).

        writer_cpu_seconds: CPU time of both lanes; urgent_cpu_seconds: of it,
        the urgent lane's; write_seconds: wall time from the first attempt to
        the end; idle_seconds and urgent_seconds: the idle lane's and the
        urgent lane's wall time on it (idle_seconds None: all of write_seconds).
        """
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            stats.writes += 1
            stats.writer_cpu_seconds += writer_cpu_seconds
            stats.urgent_cpu_seconds += urgent_cpu_seconds
            stats.urgent_write_seconds += urgent_seconds
            stats.write_seconds += write_seconds
            stats.idle_write_seconds += write_seconds if idle_seconds is None else idle_seconds
            if urgent_seconds > 0 or urgent_cpu_seconds > 0:
                stats.urgent_writes += 1
