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
copy, plus any wait for a free writer slot), and, when training competes with
the writer for the CPU, the writer's CPU time too. On a CPU-bound 2-core
machine a background write still takes cycles from training
(docs/materialization.md measured it); with training on a GPU the writer uses
otherwise idle cores, and only the capture counts. The writer's figure arrives
after the write, so the rule uses the mean of the writes finished so far.

The first execution of a block is always checkpointed (nothing is known about
M yet, and a replay needs a starting point), and so is the end state; neither
goes through this class's decision.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class BlockStats:
    """What the rule knows about one skippable block (one outer loop)."""

    executions: int = 0  # n
    checkpoints: int = 0  # k: taken (a skipped one under when_full="skip" does not count)
    compute_seconds: float = 0.0  # sum of C over the executions
    capture_seconds: float = 0.0  # training-thread seconds of the captures
    captures: int = 0
    writer_cpu_seconds: float = 0.0  # writer CPU seconds of the finished writes
    writes: int = 0


class AdaptivePolicy:
    """Decides, at each block end, whether its state is checkpointed.

    eps: the overhead tolerance; c: restore time over materialize time;
    every: checkpoint every block regardless (the "every" setting);
    count_writer_cpu: whether the writer's CPU time is training's loss (CPU training).
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
            if self.count_writer_cpu and stats.writes:
                m += stats.writer_cpu_seconds / stats.writes
            return m

    def decide(self, loop_name: str, compute_seconds: float) -> bool:
        """Count one execution of ``loop_name``'s block (taking ``compute_seconds``); checkpoint?"""
        stats = self.blocks.setdefault(loop_name, BlockStats())
        stats.executions += 1
        stats.compute_seconds += max(compute_seconds, 0.0)
        if self.every or stats.checkpoints == 0:
            return True
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

    def written(self, loop_name: str, writer_cpu_seconds: float) -> None:
        """The writer finished a checkpoint of ``loop_name``'s block (called on its thread)."""
        stats = self.blocks.setdefault(loop_name, BlockStats())
        with self._lock:
            stats.writes += 1
            stats.writer_cpu_seconds += writer_cpu_seconds
