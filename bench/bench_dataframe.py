"""Benchmark: building the wide view with ``dataframe()``, against pandas' ``pivot_table``.

Run from the repository root with the project's venv (retrolog installed):

    python -m bench.bench_dataframe              # about a minute on a 2-core machine
    python -m bench.bench_dataframe --reps 9

The store is a real one (``retrolog.store.sqlite_connection.connect`` and
``retrolog.store.schema.migrate`` on a temporary file), filled the way the
runtime fills it, with log_ids in execution order:

- 10 runs x 5 epochs x 2,000 steps = 100,000 ``step`` contexts under 50
  ``epoch`` contexts (100,060 loop rows);
- at every step 10 names (``loss``, ``grad_norm``, ``lr_now``, ``tokens`` (an int),
  ``m1`` .. ``m6``): 1,000,000 records;
- at every epoch ``acc``: 50 records; per run the arguments ``lr`` (float),
  ``batch_size`` (int), ``optimizer`` (str) and a final ``test_acc``: 40 records.

1,000,090 log records in all. What is timed is ``dataframe(conn, ["loss", "acc",
"lr"])``: a step-level, an epoch-level and a run-level name, 100,050 rows of
``projid, run_id, tstamp, filename, epoch, step, loss, acc, lr``. The baseline
builds the same frame the way one would with pandas: ``read_sql_query`` of the
long rows (the requested names, the loops, the runs), keep the record that
counts per (run, ctx, name), ``pivot_table`` the loop-level and the run-level
values, merge each context's own and parent loop into ``epoch``/``step``,
broadcast the run-level values, order by run start and execution order.

Each repetition runs both, interleaved so that load from other processes
spreads over both; figures are medians with min and max, and the ratio
baseline / dataframe. Both results must be equal (columns, dtypes after
aligning the baseline's, every value, NaN where NaN) or the benchmark fails,
so no figure can come from a wrong result.

Also measured, for the design notes: the same timing with a covering index
``logs(name, run_id, ctx_id, origin, value_type, value)`` created in the
benchmark's store (the schema does not have it), and the two ways of joining a
context to its ancestors (self-joins, as dataframe() does, against a recursive
CTE). Results: bench/results/dataframe.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import retrolog
from bench.harness import spread
from retrolog._query import dataframe as wide
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect

RUNS, EPOCHS, STEPS = 10, 5, 2_000
STEP_NAMES = ["loss", "grad_norm", "lr_now", "tokens", "m1", "m2", "m3", "m4", "m5", "m6"]
NAMES = ["loss", "acc", "lr"]
TARGET_SECONDS = 1.0
COVERING_INDEX = (
    "CREATE INDEX bench_logs_covering ON logs(name, run_id, ctx_id, origin, value_type, value)"
)


def shape() -> Iterator[tuple[tuple[Any, ...], list[tuple[Any, ...]], list[tuple[Any, ...]]]]:
    """Per run, in the module docstring's shape: its runs row (run_id, tstamp,
    started_at), its loop rows and its log records (in execution order)."""
    rng = random.Random(0)
    for r in range(RUNS):
        run_id = f"20240101-{r:06d}-{rng.getrandbits(24):06x}"
        # Start times are not in run id order, so ordering by start is visible.
        started_at = 1_700_000_000.0 + ((r * 7) % RUNS) * 3600
        run = (run_id, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started_at)), started_at)
        lr = rng.choice([0.001, 0.003, 0.01, 0.03])
        logs: list[tuple[Any, ...]] = [
            (run_id, None, "lr", lr, "float"),
            (run_id, None, "batch_size", 64, "int"),
            (run_id, None, "optimizer", "adam", "str"),
        ]
        loops: list[tuple[Any, ...]] = []
        ctx = 0
        for epoch in range(EPOCHS):
            epoch_ctx, ctx = ctx, ctx + 1
            loops.append((run_id, epoch_ctx, None, "epoch", epoch, 0))
            for step in range(STEPS):
                step_ctx, ctx = ctx, ctx + 1
                loops.append((run_id, step_ctx, epoch_ctx, "step", step, 1))
                for name in STEP_NAMES:
                    if name == "tokens":
                        logs.append((run_id, step_ctx, name, step * 512, "int"))
                    else:
                        logs.append((run_id, step_ctx, name, rng.random(), "float"))
            logs.append((run_id, epoch_ctx, "acc", rng.random(), "float"))
        logs.append((run_id, None, "test_acc", rng.random(), "float"))
        yield run, loops, logs


_RUN_ROW = (
    "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, ended_at,"
    " host, pid, python, argv, args) VALUES (?, 'proj', ?, 'train.py', 'finished', ?, ?,"
    " 'host', 1, '3.11', '[]', '{}')"
)


def build_store(path: Path) -> sqlite3.Connection:
    """A store holding the shape in the module docstring."""
    conn = connect(path)
    migrate(conn)
    conn.execute("BEGIN")
    for (run_id, tstamp, started_at), loops, logs in shape():
        conn.execute(_RUN_ROW, (run_id, tstamp, started_at, started_at + 3000))
        conn.executemany(
            "INSERT INTO loops (run_id, ctx_id, parent_ctx, name, iteration, depth, t_start)"
            " VALUES (?, ?, ?, ?, ?, ?, 0)",
            loops,
        )
        conn.executemany(
            "INSERT INTO logs (run_id, ctx_id, name, value, value_type) VALUES (?, ?, ?, ?, ?)",
            logs,
        )
    conn.execute("COMMIT")
    return conn


def build_postgresql(url: str) -> None:
    """The same store in the PostgreSQL database (schema) ``url`` names, by retrolog's
    own migration; rows copied in, then ``VACUUM ANALYZE``, as autovacuum would leave a
    table this size."""
    from retrolog.store.postgres_metadata import connect as pg_connect
    from retrolog.store.postgres_metadata import migrate as pg_migrate
    from retrolog.store.postgres_metadata import placeholders, typed

    conn = pg_connect(url)
    try:
        pg_migrate(conn)
        with conn.transaction():
            for (run_id, tstamp, started_at), loops, logs in shape():
                conn.execute(
                    placeholders(_RUN_ROW), (run_id, tstamp, started_at, started_at + 3000)
                )
                cur = conn.cursor()
                with cur.copy(
                    "COPY loops (run_id, ctx_id, parent_ctx, name, iteration, depth, t_start)"
                    " FROM STDIN"
                ) as copy:
                    for row in loops:
                        copy.write_row((*row, 0.0))
                with cur.copy(
                    "COPY logs (run_id, ctx_id, name, value_float, value_int, value_text,"
                    " value_type) FROM STDIN"
                ) as copy:
                    for run, ctx, name, value, kind in logs:
                        copy.write_row((run, ctx, name, *typed(value), kind))
        conn.execute("VACUUM ANALYZE")
    finally:
        conn.close()


def pandas_baseline(conn: sqlite3.Connection, names: list[str]) -> pd.DataFrame:
    """The same wide view built from the long rows with pandas (loops nest one level here)."""
    marks = ", ".join("?" for _ in names)
    logs = pd.read_sql_query(
        f"SELECT log_id, run_id, ctx_id, name, value, origin FROM logs WHERE name IN ({marks})",
        conn,
        params=names,
    )
    loops = pd.read_sql_query("SELECT run_id, ctx_id, parent_ctx, name, iteration FROM loops", conn)
    runs = pd.read_sql_query("SELECT run_id, projid, tstamp, filename, started_at FROM runs", conn)
    # The record that counts: the newest recorded one, else the newest backfilled one.
    logs["recorded"] = logs["origin"] == "recorded"
    logs = logs.sort_values(["recorded", "log_id"]).drop_duplicates(
        ["run_id", "ctx_id", "name"], keep="last"
    )
    in_loops = logs[logs["ctx_id"].notna()]
    at_run = logs[logs["ctx_id"].isna()]
    rows = in_loops.pivot_table(
        index=["run_id", "ctx_id"], columns="name", values="value", aggfunc="first"
    ).reset_index()
    own = loops.rename(columns={"name": "l0", "iteration": "i0"})
    rows = rows.merge(own, on=["run_id", "ctx_id"], how="left")
    parents = loops[["run_id", "ctx_id", "name", "iteration"]].rename(
        columns={"ctx_id": "parent_ctx", "name": "l1", "iteration": "i1"}
    )
    rows = rows.merge(parents, on=["run_id", "parent_ctx"], how="left")
    dims = [d for d in ("epoch", "step") if (rows["l0"] == d).any() or (rows["l1"] == d).any()]
    for dim in dims:
        rows[dim] = rows["i0"].where(rows["l0"] == dim, rows["i1"].where(rows["l1"] == dim))
    per_run = at_run.pivot_table(index="run_id", columns="name", values="value", aggfunc="first")
    rows = rows.drop(columns=[n for n in per_run.columns if n in rows.columns])
    rows = rows.merge(per_run.reset_index(), on="run_id", how="left")
    rows = rows.merge(runs, on="run_id").sort_values(["started_at", "run_id", "ctx_id"])
    return rows[["projid", "run_id", "tstamp", "filename", *dims, *names]].reset_index(drop=True)


def check_equal(ours: pd.DataFrame, theirs: pd.DataFrame) -> None:
    """Fail unless both frames hold the same view (the baseline's dtypes aligned to ours)."""
    if list(ours.columns) != list(theirs.columns):
        raise SystemExit(f"columns differ: {list(ours.columns)} != {list(theirs.columns)}")
    aligned = theirs.astype(dict(ours.dtypes))
    pd.testing.assert_frame_equal(ours, aligned, check_exact=True)
    expected_rows = RUNS * EPOCHS * (STEPS + 1)
    if len(ours) != expected_rows:
        raise SystemExit(f"dataframe() gave {len(ours)} rows, the store has {expected_rows}")


def ancestry_sql(recursive: bool) -> str:
    """(run, ctx, epoch, step) for every step context: by self-join, or by a recursive CTE."""
    if not recursive:
        return (
            "SELECT a0.run_id, a0.ctx_id,"
            " CASE WHEN a0.name = 'epoch' THEN a0.iteration"
            " WHEN a1.name = 'epoch' THEN a1.iteration END,"
            " CASE WHEN a0.name = 'step' THEN a0.iteration"
            " WHEN a1.name = 'step' THEN a1.iteration END"
            " FROM loops a0 LEFT JOIN loops a1"
            " ON a1.run_id = a0.run_id AND a1.ctx_id = a0.parent_ctx"
            " ORDER BY a0.run_id, a0.ctx_id"
        )
    return (
        "WITH RECURSIVE up(run_id, ctx_id, next_ctx, name, iteration) AS ("
        " SELECT run_id, ctx_id, parent_ctx, name, iteration FROM loops"
        " UNION ALL"
        " SELECT up.run_id, up.ctx_id, p.parent_ctx, p.name, p.iteration"
        " FROM up JOIN loops p ON p.run_id = up.run_id AND p.ctx_id = up.next_ctx)"
        " SELECT run_id, ctx_id,"
        " max(CASE WHEN name = 'epoch' THEN iteration END),"
        " max(CASE WHEN name = 'step' THEN iteration END)"
        " FROM up GROUP BY run_id, ctx_id ORDER BY run_id, ctx_id"
    )


def store_bytes(conn: sqlite3.Connection) -> int:
    """The database's size: pages in use times the page size."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    return int(pages * conn.execute("PRAGMA page_size").fetchone()[0])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(conn: sqlite3.Connection, reps: int, baseline: bool) -> dict[str, Any]:
    """Interleaved repetitions of dataframe() and (optionally) the baseline, checked equal.

    Wall time is the figure; the process's CPU time is kept beside it because on a
    shared machine other processes' load shows in the first and much less in the second.
    """
    ours: list[float] = []
    ours_cpu: list[float] = []
    theirs: list[float] = []
    theirs_cpu: list[float] = []
    # The first call of a fresh connection and process is reported apart: it also pays
    # for filling SQLite's page cache and for pandas' lazy imports.
    first_ours, _ = timed(lambda: wide.dataframe(conn, NAMES))
    first_theirs = timed(lambda: pandas_baseline(conn, NAMES))[0] if baseline else None
    for _ in range(reps):
        cpu = time.process_time()
        seconds, frame = timed(lambda: wide.dataframe(conn, NAMES))
        ours_cpu.append(time.process_time() - cpu)
        ours.append(seconds)
        if baseline:
            cpu = time.process_time()
            seconds, expected = timed(lambda: pandas_baseline(conn, NAMES))
            theirs_cpu.append(time.process_time() - cpu)
            theirs.append(seconds)
            check_equal(frame, expected)
    out: dict[str, Any] = {
        "dataframe_s": spread(ours),
        "dataframe_cpu_s": spread(ours_cpu),
        "dataframe_first_call_s": first_ours,
    }
    if baseline:
        out["pivot_table_s"] = spread(theirs)
        out["pivot_table_cpu_s"] = spread(theirs_cpu)
        out["pivot_table_first_call_s"] = first_theirs
        out["ratio_pivot_table_over_dataframe"] = statistics.median(theirs) / statistics.median(
            ours
        )
    return out


def query_plan(conn: sqlite3.Connection) -> list[str]:
    """EXPLAIN QUERY PLAN of the statement that builds the rows."""
    columns = [wide._describe(conn, n, shown=True, check_repeats=False) for n in NAMES]
    sql, _ = wide._rows_sql(columns, wide._dimensions(conn), None, [], wide._SQLITE)
    return [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]


WHERE = "lr > 0.002 AND epoch >= 2"
"""The predicate of the PostgreSQL comparison's second call (a run-level and a loop name)."""


def _server_cpu(pid: int) -> float:
    """CPU seconds of the PostgreSQL backend process ``pid`` (the server is local)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def compare_postgresql(admin_url: str, sqlite_path: Path, reps: int) -> dict[str, Any]:
    """dataframe() over the same store in SQLite and in PostgreSQL, side by side.

    Interleaved repetitions, alternating which goes first; every PostgreSQL frame must
    equal SQLite's (the shape is generated the same way into both: same run ids,
    values and order). Without a predicate, and with ``WHERE`` (run as a role with
    SELECT only: retrolog refuses a user's predicate as a superuser).
    """
    import psycopg

    from bench.harness import drop_schema, fresh_schema
    from retrolog.store.postgres_metadata import PostgresMetadata

    url = fresh_schema(admin_url)
    schema = urllib.parse.unquote(url).rsplit("search_path=", 1)[1].split("&")[0]
    role, password = f"bench_reader_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    try:
        build_s, _ = timed(lambda: build_postgresql(url))
        print(f"PostgreSQL store built in {build_s:.1f} s", file=sys.stderr)
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
            admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
            admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}")
        parts = urllib.parse.urlsplit(url)
        netloc = f"{role}:{password}@{parts.hostname}:{parts.port}"
        reader_url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        sqlite = connect(sqlite_path, readonly=True)
        pg = PostgresMetadata(reader_url, create=False)
        pg_reader = pg.reader()
        backend = pg_reader._conn.info.backend_pid
        out: dict[str, Any] = {"build_s": build_s, "where": WHERE}
        for label, where in (("no_predicate", None), ("with_predicate", WHERE)):
            kinds = ("sqlite", "sqlite_cpu", "postgresql", "postgresql_cpu")
            kinds += ("postgresql_server_cpu",)
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            first = {
                "sqlite": timed(lambda w=where: wide.dataframe(sqlite, NAMES, w))[0],
                "postgresql": timed(lambda w=where: wide.dataframe(pg_reader, NAMES, w))[0],
            }
            rows = 0
            for rep in range(reps):
                frames = {}
                for side in ("sqlite", "postgresql") if rep % 2 == 0 else ("postgresql", "sqlite"):
                    conn = sqlite if side == "sqlite" else pg_reader
                    cpu, server = time.process_time(), _server_cpu(backend)
                    seconds, frames[side] = timed(
                        lambda c=conn, w=where: wide.dataframe(c, NAMES, w)
                    )
                    samples[side].append(seconds)
                    samples[f"{side}_cpu"].append(time.process_time() - cpu)
                    if side == "postgresql":
                        samples["postgresql_server_cpu"].append(_server_cpu(backend) - server)
                pd.testing.assert_frame_equal(frames["postgresql"], frames["sqlite"])
                rows = len(frames["sqlite"])
            if rows == 0:
                raise SystemExit(f"the {label} view has no rows: it would compare nothing")
            out[label] = {
                "rows": rows,
                "first_call_s": first,
                **{f"{k}_s": spread(v) for k, v in samples.items()},
                "ratio_postgresql_over_sqlite": spread(
                    [a / b for a, b in zip(samples["postgresql"], samples["sqlite"], strict=True)]
                ),
            }
        out["working_copy"] = working_copy_seconds(reader_url, reps=3)
        pg.close()
        sqlite.close()
        return out
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE IF EXISTS {role}")
        drop_schema(url)


# A replay's predicate over a run-level argument, as `retrolog replay NAME "lr >= 0.03"`.
COPY_WHERE = "lr >= 0.03"


def working_copy_seconds(url: str, reps: int) -> dict[str, Any]:
    """What a replay of this store's runs pays before its plan (_replay/working_copy.py): a
    working copy of every run's rows (the script's: all of them here), into a fresh
    embedded store file, timed whole (migration, copy, commit), as a role that may
    read retrolog's tables (a user's predicate is refused to a superuser); and,
    interleaved, the copy a replay with the predicate :data:`COPY_WHERE` makes
    (judged in PostgreSQL first, as the replay judges it, and timed with it): the
    chosen runs' rows alone."""
    from retrolog._query.runs import matching_runs
    from retrolog._replay.working_copy import _WorkingCopy
    from retrolog.store.postgres_metadata import PostgresMetadata
    from retrolog.store.transfer import copy_into_sqlite

    samples: dict[str, list[float]] = {"all": [], "where": []}
    copied = {"all": 0, "where": 0}
    chosen: set[str] = set()
    for _ in range(reps):
        for kind in ("all", "where"):
            with tempfile.TemporaryDirectory(prefix="retrolog-bench-copy-") as tmp:
                source = PostgresMetadata(url, create=False)
                start = time.perf_counter()
                conn = connect(Path(tmp) / "copy.db", factory=_WorkingCopy)
                migrate(conn)
                runs = None
                if kind == "where":
                    runs = chosen = matching_runs(source.reader(), COPY_WHERE)
                copied[kind] = copy_into_sqlite(conn, source, ["train.py"], runs)
                samples[kind].append(time.perf_counter() - start)
                conn.close()
                source.close()
    if not 0 < len(chosen) < RUNS:
        raise SystemExit(f"{COPY_WHERE!r} chose {len(chosen)} of {RUNS} runs: nothing to compare")
    return {
        "rows": copied["all"],
        "seconds": spread(samples["all"]),
        "with_predicate": {
            "where": COPY_WHERE,
            "runs": len(chosen),
            "of_runs": RUNS,
            "rows": copied["where"],
            "seconds": spread(samples["where"]),
        },
    }


def _where_and_when(started: float) -> dict[str, Any]:
    """The fields every results file of this benchmark starts with: when, how long since
    ``started`` (a perf_counter reading), on what."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
        "sqlite": sqlite3.sqlite_version,
    }


def main_postgresql(args: argparse.Namespace) -> None:
    """--postgresql: the SQLite store and the same store in PostgreSQL, side by side."""
    from bench.harness import test_database_url

    admin_url = test_database_url()
    if admin_url is None:
        raise SystemExit(
            "--postgresql needs a server: run `bash scripts/services.sh start`, or set "
            "RETROLOG_TEST_DATABASE_URL to a database this benchmark may write."
        )
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="retrolog-bench-") as tmp:
        path = Path(tmp) / "retrolog.db"
        build_s, conn = timed(lambda: build_store(path))
        records = conn.execute("SELECT count(*) FROM logs").fetchone()[0]
        conn.close()
        compared = compare_postgresql(admin_url, path, args.reps)
    import psycopg

    with psycopg.connect(admin_url) as admin:
        server = admin.execute("SHOW server_version").fetchone()[0]
    results = {
        "benchmark": "dataframe_postgresql",
        **_where_and_when(started),
        "postgresql": server,
        "psycopg": psycopg.__version__,
        "retrolog_version": retrolog.__version__,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "repetitions": args.reps,
        "log_records": records,
        "sqlite_build_s": build_s,
        "call": f"dataframe(conn, {NAMES!r}, where)",
        "results_equal": True,
        **compared,
    }
    output = args.output or Path("bench/results/dataframe_postgresql.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1) + "\n")

    def line(label: str, s: dict[str, Any]) -> str:
        return f"{label:44s} {s['median']:7.3f}  (min {s['min']:.3f}, max {s['max']:.3f})"

    print(f"dataframe(conn, {NAMES!r}) over {records:,} records, {args.reps} repetitions:")
    for label in ("no_predicate", "with_predicate"):
        figures = compared[label]
        print(f"{label.replace('_', ' ')} ({figures['rows']:,} rows):")
        print(line("  SQLite, s", figures["sqlite_s"]))
        print(line("  PostgreSQL, s", figures["postgresql_s"]))
        print(line("  ratio PostgreSQL / SQLite (paired)", figures["ratio_postgresql_over_sqlite"]))
        print(line("  client CPU s: SQLite", figures["sqlite_cpu_s"]))
        print(line("  client CPU s: PostgreSQL", figures["postgresql_cpu_s"]))
        print(line("  server CPU s: PostgreSQL", figures["postgresql_server_cpu_s"]))
    copy = compared["working_copy"]
    print(line(f"a replay's working copy, {copy['rows']:,} rows, s", copy["seconds"]))
    narrow = copy["with_predicate"]
    print(
        line(
            f"  with {narrow['where']!r} ({narrow['runs']} of {narrow['of_runs']} runs, "
            f"{narrow['rows']:,} rows), s",
            narrow["seconds"],
        )
    )
    print(f"-> {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--postgresql",
        action="store_true",
        help="compare with the same store in PostgreSQL (the server `bash scripts/services.sh "
        "start` starts, or RETROLOG_TEST_DATABASE_URL) -> bench/results/dataframe_postgresql.json",
    )
    args = parser.parse_args()
    if args.postgresql:
        main_postgresql(args)
        return
    args.output = args.output or Path("bench/results/dataframe.json")
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="retrolog-bench-") as tmp:
        path = Path(tmp) / "retrolog.db"
        build_s, conn = timed(lambda: build_store(path))
        records = conn.execute("SELECT count(*) FROM logs").fetchone()[0]
        print(f"store: {records:,} log records, built in {build_s:.1f} s", file=sys.stderr)
        reader = connect(path, readonly=True)
        plan = query_plan(reader)
        default = measure(reader, args.reps, baseline=True)
        ancestry = {}
        for label, recursive in (("self_joins", False), ("recursive_cte", True)):
            samples = [timed(lambda r=recursive: reader.execute(ancestry_sql(r)).fetchall())[0]]
            samples += [
                timed(lambda r=recursive: reader.execute(ancestry_sql(r)).fetchall())[0]
                for _ in range(2)
            ]
            ancestry[label] = spread(samples)
        reader.close()
        size_before = store_bytes(conn)
        index_s, _ = timed(lambda: conn.execute(COVERING_INDEX))
        size_after = store_bytes(conn)
        reader = connect(path, readonly=True)
        indexed = measure(reader, args.reps, baseline=False)
        reader.close()
        conn.close()
    load_after = os.getloadavg()
    median = default["dataframe_s"]["median"]
    results = {
        "benchmark": "dataframe",
        **_where_and_when(started),
        "pandas": pd.__version__,
        "numpy": np.__version__,
        "retrolog_version": retrolog.__version__,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "repetitions": args.reps,
        "store": {
            "log_records": records,
            "runs": RUNS,
            "epochs_per_run": EPOCHS,
            "steps_per_epoch": STEPS,
            "step_level_names": STEP_NAMES,
            "epoch_level_names": ["acc"],
            "run_level_names": ["lr", "batch_size", "optimizer", "test_acc"],
            "build_s": build_s,
        },
        "call": f"dataframe(conn, {NAMES!r})",
        "rows": RUNS * EPOCHS * (STEPS + 1),
        "target_s": TARGET_SECONDS,
        "target_met": median < TARGET_SECONDS,
        "results_equal": True,
        "default_schema": default,
        "with_covering_index": {
            "index": COVERING_INDEX,
            "create_s": index_s,
            "store_bytes_before": size_before,
            "store_bytes_after": size_after,
            **indexed,
        },
        "ancestry_join_s": ancestry,
        "query_plan": plan,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")

    def line(label: str, s: dict[str, Any]) -> str:
        return f"{label:44s} {s['median']:7.3f} s  (min {s['min']:.3f}, max {s['max']:.3f})"

    print(f"dataframe(conn, {NAMES!r}) over {records:,} records, {args.reps} repetitions:")
    print(line("retrolog dataframe()", default["dataframe_s"]))
    print(line("  its CPU time", default["dataframe_cpu_s"]))
    print(f"{'  first call on a fresh connection':44s} {default['dataframe_first_call_s']:7.3f} s")
    print(line("pandas read_sql_query + pivot_table", default["pivot_table_s"]))
    print(line("  its CPU time", default["pivot_table_cpu_s"]))
    print(
        f"{'ratio pivot_table / dataframe':44s} {default['ratio_pivot_table_over_dataframe']:7.2f}"
    )
    print(line("dataframe() with the covering index", indexed["dataframe_s"]))
    print(line("  its CPU time", indexed["dataframe_cpu_s"]))
    growth = size_after / size_before - 1
    print(f"{'  (the index adds to the store)':44s} {growth:7.0%}  ({size_after / 1e6:.0f} MB)")
    print(line("ancestry by self-joins (100,050 contexts)", ancestry["self_joins"]))
    print(line("ancestry by recursive CTE", ancestry["recursive_cte"]))
    print(f"target {TARGET_SECONDS} s: {'met' if median < TARGET_SECONDS else 'NOT met'}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; -> {args.output}")


if __name__ == "__main__":
    main()
