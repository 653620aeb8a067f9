"""Benchmark: a chart's series read cold (no series cache, no indexer), at the API's call.

Run from the repository root with the project's venv:

    python -m bench.bench_series_cold                        # 300 runs, about 2 minutes
    python -m bench.bench_series_cold --runs 300 --reps 5 --store /tmp/series300

The store is bench_ui's metric store (``build_metric_store``: N runs x 5,000 steps x 3
metrics, written through the record sink), built in ``--store`` unless it holds one
already (keep it between runs: building 300 runs takes about a minute). Each repetition
deletes the store's series cache, opens a fresh ``Project`` and times
``Project.series_bytes("loss", every run, width=1000, budget=1000 x 360)``: what
``/api/series?format=binary`` does for a 300-run chart of the page's default size. The
figures are CPU seconds of this process (the machine may be shared: wall time is given
beside), medians over ``--reps``, and the same for ``read_columns`` alone (the store's
read of every run's series, the part the cache saves). Target: under 1.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_ui import build_metric_store
from bench.harness import spread

WIDTH, HEIGHT = 1000, 360  # the page's chart and the server's DEFAULT_HEIGHT


def measure(root: Path, reps: int, name: str = "loss") -> dict[str, Any]:
    """CPU and wall seconds of a cold chart of ``name`` over every run in ``root``."""
    from retrolog import Project
    from retrolog._query.series import read_columns

    runs = list(Project(root).runs()["run_id"])
    cpu, wall, read_cpu, size = [], [], [], 0
    for _ in range(reps):
        shutil.rmtree(root / ".retrolog" / "cache", ignore_errors=True)
        project = Project(root)
        began, began_wall = time.process_time(), time.perf_counter()
        size = len(project.series_bytes(name, runs, width=WIDTH, budget=WIDTH * HEIGHT))
        cpu.append(round(time.process_time() - began, 3))
        wall.append(round(time.perf_counter() - began_wall, 3))
        with project._portable() as conn:
            began = time.process_time()
            for run_id in runs:
                read_columns(conn, name, run_id)
            read_cpu.append(round(time.process_time() - began, 3))
    return {
        "runs": len(runs),
        "response_bytes": size,
        "series_bytes_cpu_seconds": spread(cpu),
        "series_bytes_wall_seconds": spread(wall),
        "read_columns_cpu_seconds": spread(read_cpu),
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--store", type=Path, help="where the store is kept (default: a temp dir)")
    args = parser.parse_args(argv)
    root = args.store or Path(tempfile.mkdtemp(prefix="retrolog-series-"))
    if not (root / ".retrolog" / "retrolog.db").exists():
        build_metric_store(root, args.runs)
    try:
        print(json.dumps(measure(root, args.reps), indent=1))
    finally:
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
