"""Watching a server process's CPU time: whether a query runs in it, and whether it stops."""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """The CPU time ``pid`` (all its threads) used so far."""
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b") ", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runs_a_query(pid: int, since: float, seconds: float = 30.0) -> bool:
    """Whether ``pid`` has used 0.2 s of CPU since it had used ``since``, within ``seconds``
    (a busy machine gives it a fraction of a core)."""
    deadline = time.monotonic() + seconds
    while cpu_seconds(pid) - since <= 0.2:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def goes_quiet(pid: int, seconds: float = 30.0) -> bool:
    """Whether ``pid`` uses under 0.2 s of CPU in some 2 s, within ``seconds``: well within
    an endless predicate's 120 s budget, however busy the machine."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(2.0)
        if cpu_seconds(pid) - before < 0.2:
            return True
    return False
