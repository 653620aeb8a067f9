"""One measurement of bench_log.py: one library, one loop shape, one fresh process.

bench_log.py copies this file into a fresh git project as ``train.py`` and runs
it there, so each measurement has its own store and interpreter, as a training
script would. Parameters come from environment variables, not argv, because
flordb parses ``sys.argv`` when it is imported:

- BENCH_LIB: "retrolog" or "flordb" (imported at module level, as a script does)
- BENCH_SHAPE: "inner" (N plain-loop ``log`` calls inside one iteration of an
  outer ``loop``) or "loop" (N iterations of ``loop``, one ``log`` each)
- BENCH_N: number of logged values
- BENCH_OUT: path of the JSON file the timings are written to

Wall times in seconds from ``time.perf_counter``; CPU times (both threads) from
``time.process_time``. Garbage collection stays on: the records a logger keeps
alive until they are written are part of what it costs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable

if os.environ.get("BENCH_LIB") == "retrolog":
    import retrolog as rl
elif os.environ.get("BENCH_LIB") == "flordb":
    import flordb as flor

BARE_REPEATS = 3  # the bare loop is cheap; a median over a few runs steadies the baseline


def bare(n: int) -> float:
    """The same arithmetic as the logged loops, with no logging."""
    t0 = time.perf_counter()
    for i in range(n):
        _x = i * 0.5
    return time.perf_counter() - t0


def retrolog_inner(n: int) -> dict[str, float]:
    t_begin = time.perf_counter()
    rl.log("started", 1)  # the first recording call starts the run (store, code version)
    t_started = time.perf_counter()
    t0 = t1 = c0 = c1 = 0.0
    for _ in rl.loop("epoch", range(1)):
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            rl.log("x", i * 0.5)
        t1, c1 = time.perf_counter(), time.process_time()
    rl.commit()
    t_done, c_done = time.perf_counter(), time.process_time()
    return _timings(t_begin, t_started, t0, t1, t_done, c0, c1, c_done)


def retrolog_loop(n: int) -> dict[str, float]:
    t_begin = time.perf_counter()
    rl.log("started", 1)
    t_started = time.perf_counter()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in rl.loop("step", range(n)):
        rl.log("x", i * 0.5)
    t1, c1 = time.perf_counter(), time.process_time()
    rl.commit()
    t_done, c_done = time.perf_counter(), time.process_time()
    return _timings(t_begin, t_started, t0, t1, t_done, c0, c1, c_done)


def flordb_inner(n: int) -> dict[str, float]:
    t_begin = time.perf_counter()
    flor.log("started", 1)  # the first call starts the run (shadow branch, .gitignore)
    t_started = time.perf_counter()
    t0 = t1 = c0 = c1 = 0.0
    for _ in flor.loop("epoch", range(1)):
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(n):
            flor.log("x", i * 0.5)
        t1, c1 = time.perf_counter(), time.process_time()
    flor.commit()  # writes the run's JSONL and SQLite rows, then git-commits
    t_done, c_done = time.perf_counter(), time.process_time()
    return _timings(t_begin, t_started, t0, t1, t_done, c0, c1, c_done)


def flordb_loop(n: int) -> dict[str, float]:
    t_begin = time.perf_counter()
    flor.log("started", 1)
    t_started = time.perf_counter()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in flor.loop("step", range(n)):
        flor.log("x", i * 0.5)
    t1, c1 = time.perf_counter(), time.process_time()
    flor.commit()
    t_done, c_done = time.perf_counter(), time.process_time()
    return _timings(t_begin, t_started, t0, t1, t_done, c0, c1, c_done)


def _timings(
    t_begin: float,
    t_started: float,
    t0: float,
    t1: float,
    t_done: float,
    c0: float,
    c1: float,
    c_done: float,
) -> dict[str, float]:
    return {
        "start": t_started - t_begin,  # first call: the run starts
        "logged": t1 - t0,  # the logging loop, wall clock
        "flush": t_done - t1,  # end of the loop to the run committed
        "logged_cpu": c1 - c0,  # CPU of every thread of the process over the loop
        "flush_cpu": c_done - c1,
    }


def max_rss_mb() -> float | None:
    """Peak resident memory of this process: what the queued, unwritten records cost."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20  # KiB on Linux, B on macOS


WORKLOADS: dict[tuple[str, str], Callable[[int], dict[str, float]]] = {
    ("retrolog", "inner"): retrolog_inner,
    ("retrolog", "loop"): retrolog_loop,
    ("flordb", "inner"): flordb_inner,
    ("flordb", "loop"): flordb_loop,
}


def main() -> None:
    n = int(os.environ["BENCH_N"])
    workload = WORKLOADS[os.environ["BENCH_LIB"], os.environ["BENCH_SHAPE"]]
    bare_seconds = statistics.median(bare(n) for _ in range(BARE_REPEATS))
    result: dict[str, object] = dict(workload(n))
    result["bare"] = bare_seconds
    result["max_rss_mb"] = max_rss_mb()
    result["python"] = sys.version.split()[0]
    with open(os.environ["BENCH_OUT"], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
