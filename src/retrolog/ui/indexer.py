"""The dashboard's background indexer: long series read ahead into the series cache.

The first chart of a name reads every value from SQLite, 1.5-4 µs each: 50 runs
of 100,000 steps take 10-20 s. So while the dashboard is open, a child process
(``python -m retrolog.ui.indexer ROOT``) reads every series of an ended run with
at least 1,000 values into ``.retrolog/cache/series/``, newest runs first, and
charts are then drawn from those files (docs/ui.md, "Kept between requests, and read
ahead").

It runs under the idle scheduling class (SCHED_IDLE): it gets the CPU only when
nothing else on the machine wants it, so it never slows a training run. It reads
the store read-only, writes only into the cache directory, prints its progress
as one JSON object per line, and stops when the dashboard does (or dies).
It does a pass when it starts, then again whenever a run or a replay ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from retrolog._project import Project

MIN_VALUES = 1000  # shorter series are read from the store in about 3 ms or less
POLL_SECONDS = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m retrolog.ui.indexer")
    parser.add_argument("root", help="the project's root (its store is ROOT/.retrolog)")
    parser.add_argument("--min-values", type=int, default=MIN_VALUES)
    args = parser.parse_args(argv)
    _idle_priority()
    project = Project(args.root)
    parent = os.getppid()
    stopping = threading.Event()  # SIGTERM (the dashboard stopping): end after this series
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())

    def orphaned() -> bool:
        return stopping.is_set() or os.getppid() != parent

    def say(**state: Any) -> None:
        print(json.dumps(state), flush=True)

    skip: set[tuple[str, str, str]] = set()
    seen: Any = None
    while not orphaned():
        now = project.endings()
        if now != seen:
            say(state="indexing", done=0, todo=None)
            began = time.monotonic()
            written = project.index_series(
                min_values=args.min_values, skip=skip, should_stop=orphaned,
                progress=lambda done, todo: say(state="indexing", done=done, todo=todo),
            )  # fmt: skip
            seen = now
            say(state="idle", written=written, seconds=round(time.monotonic() - began, 3))
        stopping.wait(POLL_SECONDS)
    return 0


def _idle_priority(pid: int = 0) -> None:
    """Let ``pid`` (0: this process) run only on CPU time nothing else wants (SCHED_IDLE),
    or else at least at the lowest nice level."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, 19)


class Indexer:
    """The indexer child of one dashboard, and the newest state it reported."""

    def __init__(self, root: Path, min_values: int = MIN_VALUES) -> None:
        self.state: dict[str, Any] = {"state": "starting"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "retrolog.ui.indexer", str(root), "--min-values",
             str(min_values)], cwd=root,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        _idle_priority(self._proc.pid)  # at once, not when it has got as far as main()
        self._errors: list[str] = []
        self._stopped = False
        self._readers = [
            threading.Thread(target=self._read, name="retrolog-ui-indexer", daemon=True),
            threading.Thread(target=self._read_errors, name="retrolog-ui-indexer", daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        with self._proc.stdout:
            for line in self._proc.stdout:
                with contextlib.suppress(ValueError):
                    self.state = json.loads(line)
        code = self._proc.wait()
        if code != 0 and not self._stopped:
            tail = " ".join(self._errors[-3:])
            self.state = {"state": "failed", "returncode": code, "error": tail}

    def _read_errors(self) -> None:
        assert self._proc.stderr is not None
        with self._proc.stderr:
            for line in self._proc.stderr:
                self._errors.append(line.decode(errors="replace").strip())
                del self._errors[:-20]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        self._stopped = True
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for reader in self._readers:
            reader.join(5)


if __name__ == "__main__":
    sys.exit(main())
