"""Replay on Ray against local worker processes: 8 runs, 2 workers each way.

Run from the repository root with the project's venv, with the services up (the
one-node Ray cluster on loopback that ``bash scripts/services.sh start`` starts, 2 CPUs):

    bash scripts/services.sh start
    .venv/bin/python -m bench.bench_ray            # about 5 minutes on a 2-core machine
    .venv/bin/python -m bench.bench_ray --reps 1 --ray-address HOST:PORT

The workload is bench_replay's CNN (``bench/_replay_workload.py``, code version V2,
torch with one thread), recorded once as 8 runs (8 learning rates, so no run reuses
another's values). Then, per repetition, on two copies of the recorded store, side by
side and in alternating order:

- ``retrolog replay w_norm --yes --no-reuse --workers 2``: local worker processes,
  forked from a fork server that imported torch once (the default);
- the same with ``--executor ray``: one Ray task per segment, at most 2 in flight,
  each starting its worker as a new interpreter (which imports torch itself).

It fails unless both backfill the same values bit for bit, for every run and context.
Figures: wall time of each replay command (median, min, max over ``--reps``) and the
ratio Ray / local. On one machine Ray can only add cost (task dispatch, a new
interpreter per segment instead of a fork); what it buys is more machines.

Results: bench/results/ray.json.

With ``--postgresql`` (the services' PostgreSQL server), the recorded store is also
copied into a PostgreSQL schema with ``retrolog migrate --to``, and each repetition
replays four ways, in rotating order: local and Ray, each against the embedded store
and against PostgreSQL (``RETROLOG_DATABASE_URL``; the replay runs on a working copy
and writes back, docs/metadata-backends.md). The backfilled values of all four must
be equal bit for bit; PostgreSQL's are reset between repetitions. Results:
bench/results/ray_postgresql.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _replay_workload as workload
from bench._replay_workload import read_values
from bench.harness import BenchError, spread

SERVICES_ENV = Path(__file__).resolve().parent.parent / ".services" / "env"
RUNS = 8
WORKERS = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--ray-address", help="default: .services/env's test cluster")
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--postgresql", action="store_true", help="also replay with the metadata in PostgreSQL"
    )
    args = parser.parse_args(argv)
    default = "ray_postgresql.json" if args.postgresql else "ray.json"
    args.output = args.output or Path("bench/results") / default
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    address = args.ray_address or services_address()
    workload.check_sources()
    python = Path(sys.executable)
    reps = []
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        base = Path(tmp) / "recorded"
        started = time.perf_counter()
        runs = record(python, base, args)
        print(f"recorded {len(runs)} runs in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        modes = ["local", "ray"]
        schema_url = None
        if args.postgresql:
            schema_url = to_postgresql(python, base)
            modes += ["local_pg", "ray_pg"]
        try:
            for rep in range(args.reps):
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                seconds: dict[str, float] = {}
                values: dict[str, dict[Any, Any]] = {}
                for mode in order:
                    project = Path(tmp) / f"rep{rep}-{mode}"
                    shutil.copytree(base, project, symlinks=True)
                    flags = ["--executor", "ray", "--ray-address", address] if "ray" in mode else []
                    if mode.endswith("_pg"):
                        assert schema_url is not None
                        seconds[mode] = replay(python, project, flags, schema_url)
                        values[mode] = read_pg_values(schema_url, workload.OUTER_NAME)
                        reset_postgresql(schema_url)
                    else:
                        seconds[mode] = replay(python, project, flags)
                        values[mode] = read_values(project, workload.OUTER_NAME)
                    shutil.rmtree(project)
                if any(values[m] != values["local"] for m in modes):
                    raise BenchError(f"the values backfilled differ between {', '.join(modes)}")
                summary_line = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
                print(f"rep {rep + 1}/{args.reps}: {summary_line}", file=sys.stderr)
                reps.append({"seconds": seconds, "values_compared": len(values["local"])})
        finally:
            if schema_url is not None:
                from bench.harness import drop_schema

                drop_schema(schema_url)
        if {run for run, _ in values["local"]} != set(runs):
            raise BenchError("not every run has values")
    summary = summarize(reps, modes)
    result = {
        "benchmark": "ray_postgresql" if args.postgresql else "ray",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "ray": ray_version(python),
        "settings": {k: str(v) for k, v in vars(args).items()} | {"runs": RUNS, "workers": WORKERS},
        "summary": summary,
        "reps": reps,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print_table(summary)
    return 0


def services_address() -> str:
    if SERVICES_ENV.exists():
        for line in SERVICES_ENV.read_text().splitlines():
            name, _, value = line.partition("=")
            if name == "RETROLOG_TEST_RAY_ADDRESS":
                return value.strip()
    raise BenchError("no Ray cluster: run `bash scripts/services.sh start` or pass --ray-address")


def record(python: Path, root: Path, args: argparse.Namespace) -> list[str]:
    kwargs = [
        [f"lr={0.02 * (i + 1):.2f}", f"epochs={args.epochs}", f"n_train={args.n_train}"]
        for i in range(RUNS)
    ]
    return workload.record_runs(python, root, kwargs, environment())


def replay(python: Path, project: Path, flags: list[str], database_url: str | None = None) -> float:
    args = [workload.OUTER_NAME, "--no-reuse", "--workers", str(WORKERS), *flags]
    env = environment()
    if database_url is not None:
        env["RETROLOG_DATABASE_URL"] = database_url
    return workload.timed_replay(python, project, args, env)[0]


def to_postgresql(python: Path, base: Path) -> str:
    """The recorded store copied into a new schema of the services' PostgreSQL server,
    by ``retrolog migrate --to`` (the embedded store stays as it was); its URL."""
    from bench.harness import fresh_schema, test_database_url

    admin = test_database_url()
    if admin is None:
        raise BenchError("--postgresql needs the server `bash scripts/services.sh start` starts")
    url = fresh_schema(admin)
    done = subprocess.run(
        [str(python), "-m", "retrolog", "migrate", "--to", url, "--yes"],
        cwd=base, env=environment(), capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise BenchError(f"migrate --to failed:\n{done.stderr}")
    return url


def read_pg_values(url: str, name: str) -> dict[Any, Any]:
    """The backfilled values of ``name`` in the PostgreSQL store, by (run, context)."""
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT run_id, ctx_id, value_float FROM logs"
            " WHERE name = %s AND origin = 'backfilled'",
            (name,),
        ).fetchall()
    return {(run, ctx): value for run, ctx, value in rows}


def reset_postgresql(url: str) -> None:
    """The PostgreSQL store as recorded again: no replay, no backfilled value."""
    import psycopg

    with psycopg.connect(url) as conn:
        conn.execute("DELETE FROM logs WHERE origin = 'backfilled'")
        conn.execute("DELETE FROM replay_runs")
        conn.execute("DELETE FROM replays")


def environment() -> dict[str, str]:
    env = workload.environment()
    # The services' cluster is on 127.0.0.1 only (scripts/services.sh, docs/replay-on-ray.md).
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def ray_version(python: Path) -> str:
    done = subprocess.run(
        [str(python), "-c", "import ray; print(ray.__version__)"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def summarize(reps: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {m: spread([r["seconds"][m] for r in reps]) for m in modes}
    pairs = [("ray_over_local", "ray", "local")]
    if "local_pg" in modes:
        pairs += [
            ("local_pg_over_local", "local_pg", "local"),
            ("ray_pg_over_ray", "ray_pg", "ray"),
            ("ray_pg_over_local_pg", "ray_pg", "local_pg"),
        ]
    for key, top, bottom in pairs:
        summary[key] = spread([r["seconds"][top] / r["seconds"][bottom] for r in reps])
    summary["values_compared"] = reps[0]["values_compared"]
    return summary


def print_table(summary: dict[str, Any]) -> None:
    labels = {
        "local": "local processes",
        "ray": "Ray tasks",
        "local_pg": "local, PostgreSQL",
        "ray_pg": "Ray, PostgreSQL",
        "ray_over_local": "Ray / local",
        "local_pg_over_local": "local: PostgreSQL / SQLite",
        "ray_pg_over_ray": "Ray: PostgreSQL / SQLite",
        "ray_pg_over_local_pg": "PostgreSQL: Ray / local",
    }
    print(f"replay of {RUNS} runs, {WORKERS} workers      median [min..max]")
    for key, label in labels.items():
        if key not in summary:
            continue
        s = summary[key]
        unit = "x" if "_over_" in key else "s"
        print(f"{label:28s} {s['median']:6.2f}{unit} [{s['min']:.2f}..{s['max']:.2f}]")


if __name__ == "__main__":
    sys.exit(main())
