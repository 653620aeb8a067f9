"""Torch calls on retrolog's own threads, and an interpreter that exits safely around them.

A daemon thread that is inside a torch operation when the interpreter finalizes
aborts the whole process: torch releases the GIL around its operations, and a
thread that takes the GIL back once finalization has begun is ended by CPython
with a forced unwind, which a C++ destructor in torch turns into
``std::terminate`` ("terminate called without an active exception", exit status
-6). A user's training that ran to its end would then exit as if it had
crashed. A throwaway script with one daemon thread calling
``t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()`` in a loop
aborted in 40 of 40 exits here.

retrolog's threads that call torch (the checkpoint writer's two lanes, the
replay prefetcher) are daemon threads, so that a hung store can never keep a
process alive. Each does its torch calls inside :meth:`ExitGate.section`, and
whoever ends them (``close()``, or an exit hook before finalization) calls
:meth:`ExitGate.close`: it waits until no thread is inside a section, and every
later attempt to enter one raises :class:`GateClosed` instead. Sections are
short (the calls that view a snapshot's tensor as bytes, or that turn decoded
arrays into tensors), and the work between them (compression, I/O) holds no
torch frame, so a thread ended by finalization there exits quietly.

Sections of different threads do not exclude each other: the idle lane, at the
lowest CPU priority, must never make the urgent lane wait.

A module of its own because two packages' threads share it (the writer lanes in
background.py, the prefetcher in prefetch.py); private to ``checkpoint``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from retrolog.checkpoint._arrays import Interrupted

# How long close() waits for the threads inside a section. A section is microseconds to
# milliseconds of CPU; a thread at the lowest priority still gets a small share of a busy
# core (SCHED_IDLE's weight), so this is only reached if something is badly wrong.
CLOSE_TIMEOUT = 30.0


class GateClosed(Interrupted):
    """A thread tried to call torch after its owner closed the gate: it stops there."""


class ExitGate:
    """Counts the threads inside torch calls; once closed, lets none in."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False

    @contextmanager
    def section(self) -> Iterator[None]:
        """Run the block's torch calls; raises GateClosed (before any) once the gate is closed."""
        with self._cond:
            if self._closed:
                raise GateClosed
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                if not self._inside:
                    self._cond.notify_all()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Let no thread in again, and wait for those inside; whether they all left in time.

        Called by the thread that owns the others (never from inside a section).
        """
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._inside == 0, timeout)
