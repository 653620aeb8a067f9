"""Whether the process that started a run is still alive (this host's runs only)."""

from __future__ import annotations

import os
from pathlib import Path


def process_start_marker(pid: int) -> str | None:
    """A value that differs between two processes that had the same pid (Linux: start tick)."""
    try:
        # The command name (field 2) is any bytes a process chose, not always UTF-8.
        stat = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces; fields after the closing paren are plain.
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def process_alive(pid: int, start_marker: str | None) -> bool:
    """Whether the process that started a run on this host is still running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if start_marker is not None:
        current = process_start_marker(pid)
        if current is not None and current != start_marker:
            return False  # the pid was reused by another process
    return True
