"""Benchmark: the per-value cost of ``log`` inside ``loop``, against a bare loop and FlorDB.

Run from the repository root with the project's venv (retrolog installed):

    python -m bench.bench_log            # about four minutes on a 2-core machine
    python -m bench.bench_log --reps 7 --n-inner 500000

What is measured, each repetition in a fresh git project and a fresh process
(bench/_log_child.py, copied in as train.py):

- bare: ``for i in range(N): x = i * 0.5``, the same arithmetic without logging;
- inner: inside one iteration of ``loop("epoch", range(1))``, a plain
  ``for i in range(N): log("x", i * 0.5)``; cost per logged value =
  (loop time - bare time) / N. The headline; target: at most 1 microsecond;
- loop: ``for i in loop("step", range(N)): log("x", i * 0.5)``: the cost of one
  loop iteration carrying one value, minus bare; target: at most 1.5 microseconds;
- flush: from the end of the logging loop until ``commit()`` returns, i.e. until
  every value is in the store. After each run the store is read back and must
  hold exactly N values named "x" with the right sum, so no figure can come from
  dropped records;
- the same shapes with FlorDB 4.0.1 (``flor.log``/``flor.loop``/``flor.commit``)
  in a benchmark-only venv, bench/.venv-flordb, created on first use. FlorDB is
  an anchor for the ratio, not a dependency; its N is smaller because each of
  its calls takes about a hundred times longer, and the per-value figures are
  what is compared.

With ``--postgresql`` retrolog also records into PostgreSQL (``database_url``, a
schema of its own per run on the server ``scripts/services.sh`` starts), read back
the same way, and each figure is also given as PostgreSQL / SQLite per repetition.

Repetitions are interleaved (every configuration once, then again) so that load
from other processes on a shared machine spreads over all of them; figures are
medians with min and max. Results: bench/results/log.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.harness import (
    FLORDB_VERSION,
    GIT_ENV,
    BenchError,
    Measured,
    drop_schema,
    flordb_python,
    fresh_schema,
    git,
    spread,
    tail,
    test_database_url,
)

BENCH_DIR = Path(__file__).resolve().parent
CHILD = BENCH_DIR / "_log_child.py"
RESULTS = BENCH_DIR / "results" / "log.json"
TARGET_US = 1.0  # the target: at most 1 microsecond per logged value
TARGET_LOOP_US = 1.5  # a loop iteration carrying one value: at most 1.5 microseconds
SHAPES = ("inner", "loop")
POSTGRESQL = "retrolog_postgresql"  # retrolog recording into PostgreSQL (--postgresql)
WARMUP_N = 1000  # one untimed run per configuration first: cold caches, .pyc files
CHILD_TIMEOUT = 900  # seconds; a run that never ends is a failure, not a figure

# -- one measurement ---------------------------------------------------------------------


def measure(
    python: Path, lib: str, shape: str, n: int, database_url: str | None = None
) -> dict[str, Any]:
    """Run one workload in a fresh git project; return its timings after checking the store.

    database_url: a PostgreSQL database the run records into (``database_url``), in a
        schema of its own that is dropped afterwards; None for the embedded store.
    """
    work = Path(tempfile.mkdtemp(prefix=f"retrolog-bench-log-{lib}-"))
    schema_url = None if database_url is None else fresh_schema(database_url)
    try:
        project = work / f"bench-{lib}-{shape}"
        project.mkdir()
        shutil.copy(CHILD, project / "train.py")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RETROLOG_", "FLOR"))}
        env.update(GIT_ENV, RETROLOG_PROGRESS="0", PYTHONDONTWRITEBYTECODE="1")
        git(project, env, "-c", "init.defaultBranch=main", "init", "-q")
        git(project, env, "add", "train.py")
        git(project, env, "commit", "-q", "-m", "benchmark script")
        out = work / "timings.json"
        env.update(BENCH_LIB=lib, BENCH_SHAPE=shape, BENCH_N=str(n), BENCH_OUT=str(out))
        if schema_url is not None:
            env["RETROLOG_DATABASE_URL"] = schema_url
        stderr = work / "stderr.txt"
        with stderr.open("w") as err:
            # stdout to /dev/null: flor.log echoes every value there, the cheapest sink.
            proc = subprocess.run(
                [str(python), "train.py"],
                cwd=project,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
                timeout=CHILD_TIMEOUT,
                check=False,
            )
        if proc.returncode != 0:
            raise BenchError(
                f"{lib} {shape} N={n} exited with {proc.returncode}:\n"
                f"{tail(stderr.read_text(errors='replace'))}"
            )
        timings: dict[str, Any] = json.loads(out.read_text())
        if schema_url is not None:
            timings["stored"] = verify_postgresql(schema_url, shape, n)
        else:
            timings["stored"] = verify_store(project, lib, shape, n)
        return timings
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if schema_url is not None:
            drop_schema(schema_url)


def verify_postgresql(schema_url: str, shape: str, n: int) -> int:
    """verify_store, for a run recorded into PostgreSQL."""
    import psycopg

    expected_sum = 0.5 * n * (n - 1) / 2
    with psycopg.connect(schema_url) as conn:
        count, total = conn.execute(
            "SELECT COUNT(*), SUM(value_float) FROM logs WHERE name = 'x'"
        ).fetchone()
        statuses = [row[0] for row in conn.execute("SELECT status FROM runs")]
        (steps,) = conn.execute("SELECT COUNT(*) FROM loops WHERE name = 'step'").fetchone()
    problems = []
    if count != n or total != expected_sum:
        problems.append(f"{count} values named 'x' summing to {total}")
    if statuses != ["finished"]:
        problems.append(f"run statuses {statuses}")
    if shape == "loop" and steps != n:
        problems.append(f"{steps} 'step' loop contexts")
    if problems:
        raise BenchError(
            f"retrolog into PostgreSQL, {shape}: the store does not hold what was logged "
            f"(expected {n} values summing to {expected_sum}): {'; '.join(problems)}"
        )
    return int(count)


def verify_store(project: Path, lib: str, shape: str, n: int) -> int:
    """Check the store holds exactly the N values logged, with the right sum."""
    expected_sum = 0.5 * n * (n - 1) / 2  # exact in binary floating point at these sizes
    if lib == "retrolog":
        db = project / ".retrolog" / "retrolog.db"
        count_sql = "SELECT COUNT(*), SUM(value) FROM logs WHERE name = 'x'"
    else:
        db = project / ".flor" / f"{project.name}.db"
        count_sql = "SELECT COUNT(*), SUM(CAST(value AS REAL)) FROM logs WHERE value_name = 'x'"
    if not db.exists():
        raise BenchError(f"{lib} {shape}: no store at {db} after the run")
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        count, total = conn.execute(count_sql).fetchone()
        problems = []
        if count != n or total != expected_sum:
            problems.append(f"{count} values named 'x' summing to {total}")
        if lib == "retrolog":
            statuses = [row[0] for row in conn.execute("SELECT status FROM runs")]
            if statuses != ["finished"]:
                problems.append(f"run statuses {statuses}")
            if shape == "loop":
                (steps,) = conn.execute("SELECT COUNT(*) FROM loops WHERE name = 'step'").fetchone()
                if steps != n:
                    problems.append(f"{steps} 'step' loop contexts")
    finally:
        conn.close()
    if problems:
        raise BenchError(
            f"{lib} {shape}: the store does not hold what was logged (expected {n} values "
            f"summing to {expected_sum}{' and as many step contexts' if shape == 'loop' else ''}"
            f"): {'; '.join(problems)}"
        )
    return int(count)


# -- figures -----------------------------------------------------------------------------


def per_sample(t: dict[str, Any], n: int) -> dict[str, float]:
    """The figures of one run, per iteration or per logged value."""
    return {
        "bare_ns_per_iter": t["bare"] / n * 1e9,
        "logged_ns_per_iter": t["logged"] / n * 1e9,
        "cost_us_per_value": (t["logged"] - t["bare"]) / n * 1e6,
        "flush_s": t["flush"],
        "flush_us_per_value": t["flush"] / n * 1e6,
        "end_to_end_us_per_value": (t["logged"] + t["flush"] - t["bare"]) / n * 1e6,
        "cpu_us_per_value": (t["logged_cpu"] + t["flush_cpu"]) / n * 1e6,
        "start_s": t["start"],
        "max_rss_mb": t["max_rss_mb"] if t.get("max_rss_mb") is not None else float("nan"),
    }


def summarize(samples: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    return {
        key: {
            "median": statistics.median(s[key] for s in samples),
            "min": min(s[key] for s in samples),
            "max": max(s[key] for s in samples),
            "samples": [s[key] for s in samples],
        }
        for key in samples[0]
    }


def ratio(flordb: dict[str, Any], ours: dict[str, Any], key: str) -> dict[str, float | None]:
    """FlorDB's figure over ours: ratio of medians, and the widest range the spreads allow."""
    f, r = flordb[key], ours[key]

    def over(a: float, b: float) -> float | None:
        return a / b if b > 0 else None  # noise can push a tiny cost to zero or below

    return {
        "median": over(f["median"], r["median"]),
        "low": over(f["min"], r["max"]),
        "high": over(f["max"], r["min"]),
    }


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions (>= 5 for the record)")
    parser.add_argument(
        "--n-inner",
        type=int,
        default=1_000_000,
        help="values per retrolog inner-loop run: long enough (about a second) for the "
        "background writer to be draining while the loop runs, as in a long training loop",
    )
    parser.add_argument(
        "--n-loop", type=int, default=200_000, help="iterations per retrolog loop run"
    )
    parser.add_argument("--n-flordb", type=int, default=20_000, help="values per FlorDB run")
    parser.add_argument("--no-flordb", action="store_true", help="skip the FlorDB anchor")
    parser.add_argument("--output", type=Path, default=RESULTS, help="results JSON file")
    parser.add_argument(
        "--postgresql",
        action="store_true",
        help="also record into PostgreSQL (database_url): the server of "
        "`bash scripts/services.sh start`, or RETROLOG_TEST_DATABASE_URL",
    )
    args = parser.parse_args(argv)
    database_url = None
    if args.postgresql:
        database_url = test_database_url()
        if database_url is None:
            print(
                "--postgresql needs a server: run `bash scripts/services.sh start`, or set "
                "RETROLOG_TEST_DATABASE_URL to a database this benchmark may write.",
                file=sys.stderr,
            )
            return 1
    if args.reps < 5:
        print(
            f"note: {args.reps} repetitions; figures for the record use at least 5.",
            file=sys.stderr,
        )

    try:
        retrolog_version = metadata.version("retrolog")
    except metadata.PackageNotFoundError:
        print(
            f"retrolog is not installed in {sys.executable}; run this with the project's "
            "venv: .venv/bin/python -m bench.bench_log",
            file=sys.stderr,
        )
        return 1
    ours = Path(sys.executable)
    flor_python, flordb_note = (None, "skipped (--no-flordb)")
    if not args.no_flordb:
        flor_python, flordb_note = flordb_python()
    n_ours = {"inner": args.n_inner, "loop": args.n_loop}
    configs: list[tuple[str, Path, int, str]] = [("retrolog", ours, n_ours[s], s) for s in SHAPES]
    if database_url is not None:
        configs += [(POSTGRESQL, ours, n_ours[s], s) for s in SHAPES]
    if flor_python is not None:
        configs += [("flordb", flor_python, args.n_flordb, s) for s in SHAPES]
    else:
        print(f"flordb unavailable: {flordb_note}", file=sys.stderr)

    measured = Measured("log", args.reps).start()
    raw: dict[tuple[str, str], list[dict[str, Any]]] = {(c[0], c[3]): [] for c in configs}
    try:

        def run(label: str, python: Path, shape: str, n: int) -> dict[str, Any]:
            if label == POSTGRESQL:
                return measure(python, "retrolog", shape, n, database_url)
            return measure(python, label, shape, n)

        for lib, python, _, shape in configs:
            run(lib, python, shape, WARMUP_N)
        for rep in range(args.reps):
            for lib, python, n, shape in configs:
                print(f"rep {rep + 1}/{args.reps}: {lib} {shape} N={n}", file=sys.stderr)
                raw[lib, shape].append(run(lib, python, shape, n))
    except (BenchError, subprocess.SubprocessError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    measured.finish()

    figures: dict[str, dict[str, Any]] = {}
    for lib, _, n, shape in configs:
        samples = [per_sample(t, n) for t in raw[lib, shape]]
        figures.setdefault(lib, {})[shape] = {"n": n, **summarize(samples)}
    ours_inner = figures["retrolog"]["inner"]["cost_us_per_value"]
    result: dict[str, Any] = {
        **measured.head(retrolog_version),
        "units": "cost_us_per_value = (logging loop - bare loop) / N; end_to_end adds the "
        "flush (end of loop to commit() returned); cpu counts every thread of the process",
        "target_us_per_value": TARGET_US,
        "headline_us_per_value": ours_inner["median"],
        "target_met": ours_inner["median"] <= TARGET_US,
        "target_loop_us_per_iteration": TARGET_LOOP_US,
        "loop_us_per_iteration": figures["retrolog"]["loop"]["cost_us_per_value"]["median"],
        "loop_target_met": figures["retrolog"]["loop"]["cost_us_per_value"]["median"]
        <= TARGET_LOOP_US,
        "retrolog": figures["retrolog"],
        "flordb": {"available": flor_python is not None, "note": flordb_note},
    }
    if database_url is not None:
        # Per repetition: the PostgreSQL run and the SQLite run of the same repetition.
        result[POSTGRESQL] = figures[POSTGRESQL]
        result["ratio_postgresql_over_sqlite"] = {
            shape: {
                key: spread(
                    [
                        pg[key] / sq[key]
                        for pg, sq in zip(
                            [per_sample(t, n_ours[shape]) for t in raw[POSTGRESQL, shape]],
                            [per_sample(t, n_ours[shape]) for t in raw["retrolog", shape]],
                            strict=True,
                        )
                        if sq[key] > 0
                    ]
                )
                for key in ("cost_us_per_value", "flush_s", "end_to_end_us_per_value", "start_s")
            }
            for shape in SHAPES
        }
    if flor_python is not None:
        result["flordb"].update(figures["flordb"], version=FLORDB_VERSION)
        result["ratio_flordb_over_retrolog"] = {
            shape: {
                key: ratio(figures["flordb"][shape], figures["retrolog"][shape], key)
                for key in ("cost_us_per_value", "end_to_end_us_per_value")
            }
            for shape in SHAPES
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.output)
    print_report(result)
    print(f"\nresults: {args.output}")
    return 0


def print_report(result: dict[str, Any]) -> None:
    def cell(stats: dict[str, Any], fmt: str) -> str:
        return f"{stats['median']:{fmt}} [{stats['min']:{fmt}}..{stats['max']:{fmt}}]"

    print(
        f"\nlog benchmark: Python {result['python']}, {result['nproc']} cores, "
        f"{result['repetitions']} repetitions, load average "
        f"{result['load_average_before'][0]:.1f} -> {result['load_average_after'][0]:.1f}"
    )
    print("median [min..max]; cost = (logging loop - bare loop) / N; end-to-end adds the flush\n")
    header = (
        f"{'library':9} {'shape':6} {'N':>8}  {'bare ns/iter':>16}  {'cost us/value':>22}  "
        f"{'flush s':>20}  {'end-to-end us/value':>24}"
    )
    print(header)
    print("-" * len(header))
    rss: list[str] = []
    for lib in ("retrolog", POSTGRESQL, "flordb"):
        if lib not in result:
            continue
        figures = result[lib]
        if lib == "flordb" and not figures["available"]:
            print(f"flordb    unavailable: {figures['note']}")
            continue
        for shape in SHAPES:
            f = figures[shape]
            print(
                f"{lib:9} {shape:6} {f['n']:>8}  {cell(f['bare_ns_per_iter'], '.0f'):>16}  "
                f"{cell(f['cost_us_per_value'], '.2f'):>22}  {cell(f['flush_s'], '.2f'):>20}  "
                f"{cell(f['end_to_end_us_per_value'], '.2f'):>24}"
            )
            rss.append(f"{lib} {shape} {f['max_rss_mb']['median']:.0f}")
    print(f"peak memory, MB (median): {', '.join(rss)}")
    for shape, ratios in result.get("ratio_postgresql_over_sqlite", {}).items():
        print(
            f"PostgreSQL / SQLite, {shape}: cost "
            f"{cell(ratios['cost_us_per_value'], '.2f')}, flush {cell(ratios['flush_s'], '.2f')},"
            f" end-to-end {cell(ratios['end_to_end_us_per_value'], '.2f')}, run start "
            f"{cell(ratios['start_s'], '.2f')}"
        )
    verdict = "met" if result["target_met"] else "MISSED"
    head = result["retrolog"]["inner"]["cost_us_per_value"]
    print(
        f"\nheadline: retrolog log() in an inner loop costs {head['median']:.2f} us per value "
        f"(min {head['min']:.2f}, max {head['max']:.2f}); target <= {TARGET_US:g} us: {verdict}"
    )
    loop = result["retrolog"]["loop"]["cost_us_per_value"]
    print(
        f"loop: one rl.loop iteration with one rl.log costs {loop['median']:.2f} us over the "
        f"bare loop (min {loop['min']:.2f}, max {loop['max']:.2f}); target <= "
        f"{TARGET_LOOP_US:g} us: {'met' if result['loop_target_met'] else 'MISSED'}"
    )
    ratios = result.get("ratio_flordb_over_retrolog")
    if ratios:
        for shape in SHAPES:
            c = ratios[shape]["cost_us_per_value"]
            e = ratios[shape]["end_to_end_us_per_value"]
            print(
                f"flordb {FLORDB_VERSION} / retrolog, {shape:5}: per value in the loop "
                f"{times(c['median'], '.0f')} "
                f"[{times(c['low'], '.0f')}..{times(c['high'], '.0f')}], "
                f"end to end with the flush {times(e['median'], '.1f')} "
                f"[{times(e['low'], '.1f')}..{times(e['high'], '.1f')}]"
            )


def times(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else f"{value:{fmt}}x"


if __name__ == "__main__":
    sys.exit(main())
