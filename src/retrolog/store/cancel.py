"""Reads their caller gave up on: the statement stops, and no other one starts.

A dashboard request whose client went away still holds a thread that reads the
store; a user's predicate there can run for the whole query budget. The server
makes a :class:`Cancellation` per request and runs the request's work inside
``cancellation.active()``; every store connection opened there is registered by
:func:`cancellable`, and ``cancel()``, called from any thread, interrupts the
statement each one runs (SQLite's ``interrupt``, PostgreSQL's cancel request).
A read that begins after that raises :class:`ReadCancelled` at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from retrolog.errors import ReadCancelled

_CURRENT: ContextVar[Cancellation | None] = ContextVar("retrolog_cancellation", default=None)


class Cancellation:
    """One caller's reads, and the way to stop them from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interrupts: dict[int, Callable[[], None]] = {}
        self._next = 0
        self.cancelled = False

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Reads in this block (this thread and context) are the ones ``cancel`` stops."""
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def cancel(self) -> None:
        """Stop the reads running under ``active`` now, and any later one at its start."""
        with self._lock:
            self.cancelled = True
            interrupts = list(self._interrupts.values())
        for interrupt in interrupts:
            # A connection closed meanwhile has nothing left to stop.
            with contextlib.suppress(Exception):
                interrupt()

    def _add(self, interrupt: Callable[[], None]) -> int:
        with self._lock:
            if self.cancelled:
                raise cancelled_error()
            self._next += 1
            self._interrupts[self._next] = interrupt
            return self._next

    def _remove(self, key: int) -> None:
        with self._lock:
            self._interrupts.pop(key, None)


def cancelled_error() -> ReadCancelled:
    return ReadCancelled("The read was stopped: the one who asked for it no longer waits.")


@contextlib.contextmanager
def cancellable(interrupt: Callable[[], None]) -> Iterator[None]:
    """Use a connection whose running statement ``interrupt()`` stops (from any thread)
    while the current cancellation, if any, holds it. Raises ReadCancelled when that was
    cancelled already."""
    current = _CURRENT.get()
    if current is None:
        yield
        return
    key = current._add(interrupt)
    try:
        yield
    except Exception as exc:
        # Whatever the interrupted statement raised (SQLite's "interrupted", PostgreSQL's
        # QueryCanceled, a budget's message) is this, once the reads were cancelled.
        if current.cancelled:
            raise cancelled_error() from exc
        raise
    finally:
        current._remove(key)


def watched() -> bool:
    """Whether the reads here run under a cancellation (a request of the dashboard)."""
    return _CURRENT.get() is not None


def cancelled() -> bool:
    """Whether the current reads were cancelled (what a progress handler asks)."""
    current = _CURRENT.get()
    return current is not None and current.cancelled


def check_cancelled() -> None:
    """Raise ReadCancelled when the current reads were cancelled."""
    if cancelled():
        raise cancelled_error()
