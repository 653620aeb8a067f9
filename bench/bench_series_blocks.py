"""Benchmark: what the series blocks cost a recording's record sink, CPU per value.

Run from the repository root with the project's venv:

    python -m bench.bench_series_blocks                  # about a minute
    python -m bench.bench_series_blocks --steps 100000 --reps 5

Each repetition writes one run of 3 names (``loss``, ``acc``, ``lr_now``) x ``--steps``
steps through ``SqliteRecordSink`` into a new store, as a recording's writer does: one
loop context per step, batches of 1,000 steps (a fast loop's 0.2 s interval), the last
batch ending the run. Timed: the CPU seconds of this process around the sink's writes,
per value; and the part of it spent in ``BlockTracker.after_batch`` (the blocks' own
work, in the batch's transaction); and the store's bytes per value. Repetitions alternate
"with blocks" and "without" (``after_batch`` replaced by nothing: the sink as it is
without the blocks, but for the partial index's upkeep). Medians [min..max].
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import spread

PER_BATCH = 1_000
RUN_ROW = (
    "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, host, pid,"
    " python, argv) VALUES ('r', 'p', 't', 'train.py', 'running', 0, 'h', 1, '3.11', '[]')"
)


def one_run(steps: int, blocks: bool) -> tuple[float, float, float]:
    """(sink CPU µs per value, blocks' CPU µs per value, store bytes per value)."""
    from retrolog.store import series_blocks
    from retrolog.store.records import RecordBatch, SqliteRecordSink
    from retrolog.store.schema import migrate
    from retrolog.store.sqlite_connection import connect

    work = Path(tempfile.mkdtemp(prefix="retrolog-blocks-"))
    try:
        database = work / "retrolog.db"
        conn = connect(database)
        migrate(conn)
        conn.execute(RUN_ROW)
        conn.close()
        batches = []
        for start in range(0, steps, PER_BATCH):
            batch = RecordBatch()
            for step in range(start, min(steps, start + PER_BATCH)):
                batch.loop_starts.append((step, None, "step", step, None, 0, 0.0))
                batch.loop_ends.append((0.1, step))
                batch.values += [(step, "loss", 1.0 / (step + 1)), (step, "acc", step * 1e-6),
                                 (step, "lr_now", 0.1)]  # fmt: skip
            batches.append(batch)
        batches[-1].run_updates.append({"status": "finished", "ended_at": 1.0})
        real = series_blocks.BlockTracker.after_batch
        spent = [0.0]

        def timed(self: Any, *args: Any) -> None:
            began = time.process_time()
            if blocks:
                real(self, *args)
            spent[0] += time.process_time() - began

        series_blocks.BlockTracker.after_batch = timed  # type: ignore[method-assign]
        try:
            sink = SqliteRecordSink(database)
            began = time.process_time()
            for batch in batches:
                sink.write("r", batch)
            cpu = time.process_time() - began
            sink.close()
        finally:
            series_blocks.BlockTracker.after_batch = real  # type: ignore[method-assign]
        values = 3 * steps
        return cpu / values * 1e6, spent[0] / values * 1e6, database.stat().st_size / values
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    found: dict[str, list[tuple[float, float, float]]] = {"with blocks": [], "without": []}
    for _ in range(args.reps):
        for label in found:
            found[label].append(one_run(args.steps, label == "with blocks"))
    out = {
        label: {
            "sink_cpu_us_per_value": spread([round(r[0], 3) for r in rows]),
            "blocks_cpu_us_per_value": spread([round(r[1], 3) for r in rows]),
            "store_bytes_per_value": round(rows[0][2], 1),
        }
        for label, rows in found.items()
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
