"""Benchmark: values per second a recording run's writer commits, SQLite against PostgreSQL.

Run from the repository root with the project's venv, the loopback services started
(``bash scripts/services.sh start``, for the PostgreSQL server):

    python -m bench.bench_sink            # about a minute on 2 cores
    python -m bench.bench_sink --reps 5 --values 1000000

Log throughput into PostgreSQL against SQLite, sustained by one run and by eight
concurrent runs. A run's values reach the store through its writer
thread's record sink (store/records.py), one transaction per batch. This drives the
two sinks directly, as the writer does, to measure the sinks alone
(``bench_log --postgresql`` measures a recording into PostgreSQL end to end):

- each run is a process with its own sink and run id, writing ``--values`` hot-path
  values (floats, ``(ctx, name, value)``) in batches of ``--batch``, each batch with
  the loop start of its context, as a recording's 0.2 s intervals do;
- 1 run, then 8 at once into the same store (one SQLite file; one PostgreSQL
  database), started together behind a barrier; throughput = all values / the wall
  time from the barrier to the last commit;
- afterwards every value is counted in the store: a figure from dropped rows fails.

Repetitions alternate the backends; figures are medians [min..max], and the
PostgreSQL/SQLite ratio is taken per repetition. Results: bench/results/sink.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sqlite3
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from bench.harness import BenchError, Measured, spread

RESULTS = Path(__file__).resolve().parent / "results" / "sink.json"
SERVICES_ENV = Path(__file__).resolve().parent.parent / ".services" / "env"
RUN_ROW = (
    "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, host, pid,"
    " python, argv) VALUES ({p}, 'p', 't', 'train.py', 'running', 0, 'h', 1, '3.11', '[]')"
)


def database_url() -> str:
    url = os.environ.get("RETROLOG_TEST_DATABASE_URL", "").strip()
    if not url and SERVICES_ENV.exists():
        for line in SERVICES_ENV.read_text().splitlines():
            name, _, value = line.partition("=")
            if name == "RETROLOG_TEST_DATABASE_URL":
                url = value.strip()
    if not url:
        raise BenchError(
            "no PostgreSQL server: run `bash scripts/services.sh start` first, or set "
            "RETROLOG_TEST_DATABASE_URL"
        )
    return url


def make_sink(backend: str, target: str) -> Any:
    from retrolog.store.postgres_metadata import PostgresRecordSink
    from retrolog.store.records import SqliteRecordSink

    return SqliteRecordSink(Path(target)) if backend == "sqlite" else PostgresRecordSink(target)


def one_run(
    backend: str, target: str, run_id: str, values: int, batch: int, barrier: Any, out: Any
) -> None:
    """A recording run's writer: its sink, then every batch, timed from the barrier."""
    from retrolog.store.records import RecordBatch

    sink = make_sink(backend, target)
    batches = []
    for ctx, start in enumerate(range(0, values, batch)):
        n = min(batch, values - start)
        batches.append(
            RecordBatch(
                loop_starts=[(ctx, None, "step", ctx, None, 0, 0.0)],
                values=[(ctx, "loss", 0.5 + i * 1e-6) for i in range(n)],
            )
        )
    barrier.wait()
    for records in batches:
        sink.write(run_id, records)
    out.put((run_id, time.perf_counter()))
    sink.close()


def prepare(backend: str, work: Path, server: str, runs: list[str]) -> str:
    """A new store with the runs registered; the sink's target (a path or a URL)."""
    if backend == "sqlite":
        from retrolog.store.schema import migrate
        from retrolog.store.sqlite_connection import connect

        path = work / f"{uuid.uuid4().hex[:8]}.db"
        conn = connect(path)
        migrate(conn)
        conn.executemany(RUN_ROW.format(p="?"), [(r,) for r in runs])
        conn.close()
        return str(path)
    from retrolog.store import postgres_metadata as postgres

    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = postgres.connect(server)
    admin.execute(f"CREATE SCHEMA {schema}")
    admin.close()
    parts = urllib.parse.urlsplit(server)
    url = urllib.parse.urlunsplit(
        parts._replace(query="options=" + urllib.parse.quote(f"-c search_path={schema}"))
    )
    conn = postgres.connect(url)
    postgres.migrate(conn)
    with conn.cursor() as cur:
        cur.executemany(RUN_ROW.format(p="%s"), [(r,) for r in runs])
    conn.close()
    return url


def count(backend: str, target: str) -> int:
    if backend == "sqlite":
        conn = sqlite3.connect(target)
        (n,) = conn.execute("SELECT COUNT(*) FROM logs").fetchone()
        conn.close()
        return int(n)
    from retrolog.store import postgres_metadata as postgres

    conn = postgres.connect(target)
    (n,) = conn.execute("SELECT COUNT(*) FROM logs").fetchone()
    conn.close()
    return int(n)


def drop(backend: str, target: str, server: str) -> None:
    if backend == "sqlite":
        for suffix in ("", "-wal", "-shm"):
            Path(target + suffix).unlink(missing_ok=True)
        return
    from retrolog.store import postgres_metadata as postgres

    schema = urllib.parse.unquote(urllib.parse.urlsplit(target).query).rsplit("=", 1)[1]
    admin = postgres.connect(server)
    admin.execute(f"DROP SCHEMA {schema} CASCADE")
    admin.close()


def measure(backend: str, runs: int, values: int, batch: int, work: Path, server: str) -> float:
    """Values per second committed by ``runs`` concurrent writers."""
    ctx = mp.get_context("spawn")
    ids = [f"run-{i}" for i in range(runs)]
    target = prepare(backend, work, server, ids)
    barrier, out = ctx.Barrier(runs + 1), ctx.Queue()
    procs = [
        ctx.Process(target=one_run, args=(backend, target, r, values, batch, barrier, out))
        for r in ids
    ]
    for p in procs:
        p.start()
    barrier.wait(timeout=300)
    started = time.perf_counter()
    ends = [out.get(timeout=600)[1] for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise BenchError(f"a {backend} writer failed (exit code {p.exitcode})")
    landed = count(backend, target)
    drop(backend, target, server)
    if landed != runs * values:
        raise BenchError(f"{backend}: {landed} values in the store, {runs * values} written")
    return runs * values / (max(ends) - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--values", type=int, default=200_000, help="values per run")
    parser.add_argument("--batch", type=int, default=5_000, help="values per transaction")
    parser.add_argument("--concurrent", type=int, default=8, help="runs at once, second shape")
    args = parser.parse_args(argv)
    try:
        server = database_url()
        work = Path(tempfile.mkdtemp(prefix="retrolog-bench-sink-"))
        shapes = [1, args.concurrent]
        samples: dict[str, list[float]] = {}
        with Measured("sink", args.reps) as measured:
            for rep in range(args.reps):
                order = ["sqlite", "postgresql"] if rep % 2 == 0 else ["postgresql", "sqlite"]
                for runs in shapes:
                    for backend in order:
                        rate = measure(backend, runs, args.values, args.batch, work, server)
                        samples.setdefault(f"{backend}_{runs}", []).append(rate)
                        print(f"rep {rep + 1}: {backend}, {runs} run(s): {rate:,.0f} values/s")
        shutil.rmtree(work, ignore_errors=True)
    except BenchError as exc:
        print(f"bench_sink: {exc}", file=sys.stderr)
        return 1
    result: dict[str, Any] = {
        **measured.head(),
        "values_per_run": args.values,
        "values_per_transaction": args.batch,
        "units": "values per second committed, all runs together, barrier to last commit",
        "values_per_second": {k: spread(v) for k, v in samples.items()},
        "postgresql_over_sqlite": {
            str(runs): spread(
                [
                    p / s
                    for p, s in zip(
                        samples[f"postgresql_{runs}"], samples[f"sqlite_{runs}"], strict=True
                    )
                ]
            )
            for runs in shapes
        },
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print()
    for runs in shapes:
        for backend in ("sqlite", "postgresql"):
            v = result["values_per_second"][f"{backend}_{runs}"]
            print(
                f"{backend:10s} {runs} run(s): {v['median']:>12,.0f} values/s "
                f"[{v['min']:,.0f}..{v['max']:,.0f}]"
            )
        r = result["postgresql_over_sqlite"][str(runs)]
        print(
            f"  PostgreSQL / SQLite, {runs} run(s): {r['median']:.2f}x "
            f"[{r['min']:.2f}..{r['max']:.2f}]"
        )
    print(f"results: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
