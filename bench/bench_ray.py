"""Replay on Ray against local worker processes: 8 runs, 2 workers each way.

Run from the repository root with the project's venv, with the services up (the
one-node Ray cluster on loopback that ``bash scripts/services.sh start`` starts, 2 CPUs):

    bash scripts/services.sh start
    .venv/bin/python bench/bench_ray.py            # about 5 minutes on a 2-core machine
    .venv/bin/python bench/bench_ray.py --reps 1 --ray-address HOST:PORT

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _replay_workload as workload
from _replay_workload import BenchError, read_values
from bench_log import spread

SERVICES_ENV = Path(__file__).resolve().parent.parent / ".services" / "env"
RUNS = 8
WORKERS = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--ray-address", help="default: .services/env's test cluster")
    parser.add_argument("--output", type=Path, default=Path("bench/results/ray.json"))
    args = parser.parse_args(argv)
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
        for rep in range(args.reps):
            order = ["local", "ray"] if rep % 2 == 0 else ["ray", "local"]
            seconds: dict[str, float] = {}
            values: dict[str, dict[Any, Any]] = {}
            for mode in order:
                project = Path(tmp) / f"rep{rep}-{mode}"
                shutil.copytree(base, project, symlinks=True)
                flags = ["--executor", "ray", "--ray-address", address] if mode == "ray" else []
                seconds[mode] = replay(python, project, flags)
                values[mode] = read_values(project, workload.OUTER_NAME)
                shutil.rmtree(project)
            if values["ray"] != values["local"]:
                raise BenchError("the values backfilled on Ray and locally differ")
            if {run for run, _ in values["local"]} != set(runs):
                raise BenchError("not every run has values")
            shown = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
            print(f"rep {rep + 1}/{args.reps}: {shown}", file=sys.stderr)
            reps.append({"seconds": seconds, "values_compared": len(values["local"])})
    summary = summarize(reps)
    result = {
        "benchmark": "ray",
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


def replay(python: Path, project: Path, flags: list[str]) -> float:
    args = [workload.OUTER_NAME, "--no-reuse", "--workers", str(WORKERS), *flags]
    return workload.timed_replay(python, project, args, environment())[0]


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


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["seconds"]["ray"] / r["seconds"]["local"] for r in reps]
    return {
        "local": spread([r["seconds"]["local"] for r in reps]),
        "ray": spread([r["seconds"]["ray"] for r in reps]),
        "ray_over_local": spread(ratios),
        "values_compared": reps[0]["values_compared"],
    }


def print_table(summary: dict[str, Any]) -> None:
    local, ray, ratio = summary["local"], summary["ray"], summary["ray_over_local"]
    print(f"replay of {RUNS} runs, {WORKERS} workers      median [min..max]")
    print(f"local processes   {local['median']:6.1f}s [{local['min']:.1f}..{local['max']:.1f}]")
    print(f"Ray tasks         {ray['median']:6.1f}s [{ray['min']:.1f}..{ray['max']:.1f}]")
    print(f"Ray / local       {ratio['median']:6.2f}x [{ratio['min']:.2f}..{ratio['max']:.2f}]")


if __name__ == "__main__":
    sys.exit(main())
