"""What closing a checkpointer shows while it finishes the checkpoints in flight.

Training is over and the user waits for the exit, so the wait is shown
(after :data:`PROGRESS_AFTER` seconds: what remains, in checkpoints, bytes
and an estimate of the time, updated as tqdm would) and can be cut short: a
first Ctrl-C says what is being finished, a second one abandons it. What is
abandoned is reported, never dropped silently (docs/materialization.md).

Kept apart from background.py, which owns the writer lanes: this is the exit's
interaction with the user (signals, the progress line), private to ``checkpoint``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np

from retrolog.checkpoint.state import DeviceTensor, Snapshot, loaded_torch

# Finishing at exit shows its progress once it has taken this long (seconds).
PROGRESS_AFTER = 1.0


@dataclass(frozen=True)
class AbandonedCheckpoint:
    """A checkpoint in flight at exit that the user chose not to wait for (a second Ctrl-C)."""

    ctx_id: int | None
    loop_name: str
    kind: str
    nbytes: int  # bytes of state its snapshot held


class Finishing:
    """What close() shows while it finishes the checkpoints in flight, and its Ctrl-C handling."""

    def __init__(self, label: str, count: int, nbytes: int, rate_hint: float | None = None) -> None:
        """``rate_hint``: bytes per second the writer managed at training's priority so far,
        what the remaining time is estimated from until something is finished here."""
        self.label = label
        self.count = count
        self.nbytes = nbytes
        self.began = time.monotonic()
        self.presses = 0  # Ctrl-C presses while finishing
        self.left = count
        self.left_bytes = nbytes
        stream = sys.stderr
        self.stream = stream
        self.terminal = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
        self.tick = 0.2 if self.terminal else 1.0  # seconds between updates of the line
        self._shown = 0  # length of the progress line on screen (0: none)
        self._last_update = 0.0
        self._rate: float | None = None  # bytes per second of what was finished so far
        self._rate_hint = rate_hint

    @property
    def abandon(self) -> bool:
        return self.presses >= 2

    def interruptible(self) -> SigintHandler:
        return SigintHandler(self._on_sigint)

    def _on_sigint(self) -> None:
        self.presses += 1
        if self.presses == 1:
            self._clear()
            self._say(
                f"retrolog: finishing {_checkpoints(self.left)} ({_mb(self.left_bytes)}); "
                "press Ctrl-C again to abandon them"
            )

    def update(self, left: int, left_bytes: int) -> None:
        """What is left now: checkpoints and their bytes."""
        now = time.monotonic()
        elapsed = now - self.began
        if left_bytes < self.nbytes and elapsed > 0:
            self._rate = (self.nbytes - left_bytes) / elapsed
        self.left, self.left_bytes = left, left_bytes
        if elapsed < PROGRESS_AFTER or now - self._last_update < self.tick or not left:
            return
        self._last_update = now
        # The time left, from the rate of what was finished here, else of what the writer
        # managed while training ran (all of it expected from the start, so less what has
        # gone by). With neither, or once that expectation has passed, the time so far:
        # an estimate that grows as it is waited for tells nothing.
        if self._rate is not None:
            remaining: float | None = left_bytes / self._rate
        elif self._rate_hint:
            remaining = self.nbytes / self._rate_hint - elapsed
        else:
            remaining = None
        when = (
            f"about {_seconds(remaining)} left"
            if remaining is not None and remaining > 0
            else f"{_seconds(elapsed)} so far"
        )
        line = (
            f"retrolog: finishing {_checkpoints(left)} ({_mb(left_bytes)}) of {self.label} "
            f"before exit, {when}"
        )
        if self.presses == 0:
            line += " (Ctrl-C twice abandons them)"
        self._show(line)

    def done(self, abandoned: tuple[AbandonedCheckpoint, ...], failed: bool = False) -> None:
        """Say how finishing ended, if anything was shown; ``failed``: a write failed (the
        caller raises it, so the line only ends here)."""
        elapsed = time.monotonic() - self.began
        if failed:
            if self._shown and self.terminal and self.stream is not None:
                self.stream.write("\n")
        elif abandoned:
            self._clear()
            which = ", ".join(
                "the end state" if a.kind == "end" else f"{a.loop_name} context {a.ctx_id}"
                for a in abandoned
            )
            self._say(
                f"retrolog: abandoned {_checkpoints(len(abandoned))} "
                f"({_mb(sum(a.nbytes for a in abandoned))}) of {self.label}: {which}. They are "
                "recorded as abandoned in the run's checkpointing record; replay executes "
                "those blocks instead of restoring them."
            )
        elif self._shown or self.presses:
            self._clear()
            self._say(
                f"retrolog: wrote {_checkpoints(self.count)} ({_mb(self.nbytes)}) of "
                f"{self.label} in {elapsed:.1f} s"
            )

    def _show(self, line: str) -> None:
        if self.stream is None:
            return
        if self.terminal:
            pad = " " * max(self._shown - len(line), 0)
            self.stream.write("\r" + line + pad)
            self._shown = len(line)
        else:  # a log file: a line per update, at a slower pace
            self.stream.write(line + "\n")
            self._shown = 1
        self.stream.flush()

    def _clear(self) -> None:
        if self.terminal and self._shown and self.stream is not None:
            self.stream.write("\r" + " " * self._shown + "\r")
            self._shown = 0

    def _say(self, message: str) -> None:
        if self.stream is not None:
            self.stream.write(message + "\n")
            self.stream.flush()


class SigintHandler:
    """Calls ``on_sigint`` for each Ctrl-C while active, instead of raising KeyboardInterrupt.

    Only on the main thread (where Python runs signal handlers) and only where
    SIGINT is not ignored; the previous handler is put back on exit.
    """

    def __init__(self, on_sigint: Callable[[], None]) -> None:
        self.on_sigint = on_sigint
        self.previous: Any = None
        self.installed = False

    def __enter__(self) -> SigintHandler:
        if threading.current_thread() is not threading.main_thread():
            return self
        previous = signal.getsignal(signal.SIGINT)
        if previous in (signal.SIG_IGN, None):
            return self  # ignored (nohup, a background job), or set outside Python
        self.previous = previous
        signal.signal(signal.SIGINT, self._handle)
        self.installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.on_sigint()

    def __exit__(self, *exc: object) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, self.previous)


def _checkpoints(n: int) -> str:
    return f"{n} checkpoint{'' if n == 1 else 's'}"


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def snapshot_nbytes(snap: Snapshot | None) -> int:
    """Bytes of the arrays and tensors a snapshot holds (unchanged tensors are already stored)."""
    if snap is None:
        return 0
    torch = loaded_torch()
    total = 0
    stack: list[Any] = [snap.objects, snap.rng]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, DeviceTensor):
            stack.append(value.tensor)
        elif isinstance(value, bytes):
            total += len(value)
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        elif torch is not None and isinstance(value, torch.Tensor):
            total += value.element_size() * value.numel()
    return total
