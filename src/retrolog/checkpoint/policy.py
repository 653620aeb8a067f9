"""When a block's end state is checkpointed: Flor's joint invariant, per skippable block.

DESIGN.md, "Adaptive checkpointing": with M the main-thread cost of
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
writer's work costs training. The writer runs at the lowest priority on idle
cycles (docs/materialization.md), which costs a CPU-bound training little but
not nothing: memory bandwidth, a hyperthread sibling, the GIL. So the rule
measures it. Each block end reports the share f of the block the writer was
busy; a least-squares line through (f, C) over the block's executions (the
first left out: it is warming up) gives C = C0 * (1 + s * f), s being how much
slower blocks run while the writer writes, and a checkpoint costs training
W * s / (1 + s), with W the wall time of a write. Until the line is
identifiable (some blocks with the writer idle, some with it busy for at
least :data:`BUSY` of the block), training on the CPU counts the writer's CPU
time instead (training on a GPU: nothing); the writer's figures arrive after
each write, so the rule uses the means of the writes finished so far.

The first execution of a block is always checkpointed (nothing is known about
M yet, and a replay needs a starting point), and so is the end state; neither
goes through this class's decision.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

BUSY = 0.25  # the slowdown is measured once a block had the writer busy this share of it
IDLE = 0.05  # ... and one had it busy at most this share


@dataclass
class BlockStats:
    """What the rule knows about one skippable block (one outer loop)."""

    executions: int = 0  # n
    checkpoints: int = 0  # k: taken (a skipped one under when_full="skip" does not count)
    compute_seconds: float = 0.0  # sum of C over the executions
    capture_seconds: float = 0.0  # training-thread seconds of the captures
    captures: int = 0
    writer_cpu_seconds: float = 0.0  # writer CPU seconds of the finished writes
    write_seconds: float = 0.0  # wall seconds of the finished writes
    writes: int = 0
    # Sums for the least-squares line C = a + b * f, f the writer's busy share.
    fits: int = 0
    sum_f: float = 0.0
    sum_c: float = 0.0
    sum_ff: float = 0.0
    sum_fc: float = 0.0
    busy_seen: bool = False  # a block with f >= BUSY
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
    count_writer_cpu: whether to count the writer's CPU time as training's
      loss until its slowdown is measured (training on the CPU).
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
            slowdown = stats.writer_slowdown()
            if slowdown is not None:
                m += stats.write_seconds / stats.writes * slowdown / (1.0 + slowdown)
            elif self.count_writer_cpu:
                m += stats.writer_cpu_seconds / stats.writes
            return m

    def decide(self, loop_name: str, compute_seconds: float, writer_busy: float = 0.0) -> bool:
        """Count one execution of ``loop_name``'s block; checkpoint its end state?

        compute_seconds: the block's time (C); writer_busy: seconds of it the
        background writer spent writing.
        """
        stats = self.blocks.setdefault(loop_name, BlockStats())
        stats.executions += 1
        compute = max(compute_seconds, 0.0)
        stats.compute_seconds += compute
        # The first execution is left out of the fit: it is warming up (allocations,
        # caches, lazy initialization), and as the one block with the writer surely
        # idle it would pass for "the writer costs nothing" (a CNN whose first epoch
        # ran 20% slower got s = 0 and a checkpoint every epoch, each costing ~15%).
        if compute > 0 and stats.executions > 1:
            # The fit is only touched on the training thread: no lock.
            share = min(max(writer_busy / compute, 0.0), 1.0)
            stats.fits += 1
            stats.sum_f += share
            stats.sum_c += compute
            stats.sum_ff += share * share
            stats.sum_fc += share * compute
            stats.busy_seen = stats.busy_seen or share >= BUSY
            stats.idle_seen = stats.idle_seen or share <= IDLE
        if self.every or stats.checkpoints == 0:
            return True
        with self._lock:
            if not stats.writes:
                # The first write has not finished: what a checkpoint costs beyond
                # the capture is unknown yet, and a guess could take one too many.
                return False
        n, k = stats.executions, stats.checkpoints
        mean_compute = stats.compute_seconds / n
        m = self.materialize_seconds(stats)
        return (k + 1) * m < n * mean_compute * self.bound()

    def captured(self, loop_name: str, capture_seconds: float) -> None:
        """A checkpoint of ``loop_name``'s block was taken, costing the training thread this."""
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            stats.checkpoints += 1
            stats.captures += 1
            stats.capture_seconds += capture_seconds

    def not_taken(self, loop_name: str, capture_seconds: float) -> None:
        """A decided checkpoint was skipped because the writer was behind (when_full="skip")."""
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            # What the skip itself cost is still training's loss; k stays, so the
            # rule keeps asking and replay executes the block.
            stats.capture_seconds += capture_seconds

    def written(self, loop_name: str, writer_cpu_seconds: float, write_seconds: float) -> None:
        """The writer finished a checkpoint of ``loop_name``'s block (called on its thread)."""
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            stats.writes += 1
            stats.writer_cpu_seconds += writer_cpu_seconds
            stats.write_seconds += write_seconds
