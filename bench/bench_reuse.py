"""Reuse in replay: a sweep whose configurations were launched more than once.

Run from the repository root with the project's venv:

    python bench/bench_reuse.py                 # about 10 minutes on a 2-core machine
    python bench/bench_reuse.py --reps 1 --launches 2

The workload is bench_replay's CNN (``bench/_replay_workload.py``, code version
V2, torch with one thread), recorded as a small sweep: ``--configs`` learning
rates, each launched ``--launches`` times with the same seed, as a sweep driver
that retries, or a user who runs a configuration again, leaves them. Then, on
copies of the same recorded store, side by side:

- ``retrolog replay w_norm --yes`` (outer-loop probe) and ``retrolog replay
  grad_norm --yes`` (inner-loop probe) with reuse (the default): one launch of
  each configuration is replayed, the others get its values;
- the same with ``--no-reuse``: every run is replayed;
- ``--no-reuse`` once more on a third copy: the A/A floor of the timing.

It fails unless the values with and without reuse are equal bit for bit, for
every run and context, and unless the plan reused exactly the repeated launches.
Figures: wall time of each replay command (median, min, max over ``--reps``),
and the ratio no-reuse / reuse next to the A/A ratio.

What reuse cannot take, it does not: runs of one configuration whose histories
differ (another seed, a data file changed between launches, a late-epoch
setting that differs) are replayed; docs/replay.md says why.

Results: bench/results/reuse.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _replay_workload as workload

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.invalid",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.invalid",
}


class BenchError(RuntimeError):
    """The benchmark could not produce a trustworthy figure."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--configs", type=int, default=2, help="learning rates in the sweep")
    parser.add_argument("--launches", type=int, default=3, help="launches of each configuration")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--output", type=Path, default=Path("bench/results/reuse.json"))
    args = parser.parse_args(argv)
    if args.reps < 1 or args.configs < 1 or args.launches < 2:
        parser.error("--reps and --configs must be at least 1, --launches at least 2")
    workload.check_sources()
    python = Path(sys.executable)
    reps = []
    for rep in range(args.reps):
        print(f"rep {rep + 1}/{args.reps}", file=sys.stderr)
        reps.append(one_rep(python, args))
    summary = summarize(reps)
    result = {
        "benchmark": "reuse",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "reps": reps,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print_table(summary)
    return 0


def one_rep(python: Path, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-reuse-") as tmp:
        base = Path(tmp) / "recorded"
        runs = record(python, base, args)
        rep: dict[str, Any] = {"runs": len(runs)}
        for probe in (workload.OUTER_NAME, workload.INNER_NAME):
            seconds: dict[str, float] = {}
            values: dict[str, dict[Any, Any]] = {}
            for mode in ("reuse", "no_reuse", "no_reuse_again"):
                project = Path(tmp) / f"{probe}-{mode}"
                shutil.copytree(base, project, symlinks=True)
                flags = [] if mode == "reuse" else ["--no-reuse"]
                seconds[mode], out = replay(python, project, probe, flags)
                values[mode] = read_values(project, probe)
                if mode == "reuse":
                    reused = out.count(": reused from ")
                    expected = args.configs * (args.launches - 1)
                    if reused != expected:
                        raise BenchError(f"{probe}: {reused} runs reused, expected {expected}")
            reference = values["no_reuse"]
            if values["reuse"] != reference or values["no_reuse_again"] != reference:
                raise BenchError(f"{probe}: values with and without reuse differ")
            if {run for run, _ in reference} != set(runs):
                raise BenchError(f"{probe}: not every run has values")
            rep[probe] = {"seconds": seconds, "values_compared": len(reference)}
            shown = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
            print(f"  {probe}: {shown}", file=sys.stderr)
    return rep


def record(python: Path, root: Path, args: argparse.Namespace) -> list[str]:
    root.mkdir(parents=True)
    env = environment()
    subprocess.run(["git", "init", "-q", "."], cwd=root, check=True, env=env)
    (root / "train.py").write_text(workload.V2)
    subprocess.run(["git", "add", "train.py"], cwd=root, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "v2"], cwd=root, check=True, env=env)
    lrs = [0.05 * (i + 1) for i in range(args.configs)]
    for lr in lrs:
        for _ in range(args.launches):
            kwargs = [f"lr={lr}", f"epochs={args.epochs}", f"n_train={args.n_train}"]
            done = subprocess.run(
                [str(python), "train.py", "--kwargs", *kwargs],
                cwd=root, env=env, capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode != 0:
                raise BenchError(f"recording failed:\n{done.stderr}")
    (root / "train.py").write_text(workload.NEWEST)
    conn = sqlite3.connect(root / ".retrolog" / "retrolog.db")
    try:
        return [r[0] for r in conn.execute("SELECT run_id FROM runs ORDER BY started_at")]
    finally:
        conn.close()


def replay(python: Path, project: Path, name: str, flags: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [str(python), "-m", "retrolog", "replay", name, "--yes", *flags],
        cwd=project, env=environment(), capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise BenchError(f"replay {name} {flags} failed:\n{done.stderr}")
    if "differs" in done.stderr:
        raise BenchError(f"replay {name} {flags} was not exact:\n{done.stderr}")
    return seconds, done.stderr


def read_values(project: Path, name: str) -> dict[Any, Any]:
    conn = sqlite3.connect(project / ".retrolog" / "retrolog.db")
    try:
        rows = conn.execute(
            "SELECT run_id, ctx_id, value FROM logs WHERE name = ? AND origin = 'backfilled'",
            (name,),
        ).fetchall()
    finally:
        conn.close()
    return {(run, ctx): value for run, ctx, value in rows}


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env.update(GIT_IDENTITY)
    env["RETROLOG_PROGRESS"] = "0"
    return env


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for probe in (workload.OUTER_NAME, workload.INNER_NAME):
        block: dict[str, Any] = {}
        for mode in ("reuse", "no_reuse", "no_reuse_again"):
            block[mode] = spread([r[probe]["seconds"][mode] for r in reps])
        speedup = [r[probe]["seconds"]["no_reuse"] / r[probe]["seconds"]["reuse"] for r in reps]
        floor = [
            r[probe]["seconds"]["no_reuse_again"] / r[probe]["seconds"]["no_reuse"] for r in reps
        ]
        block["no_reuse_over_reuse"] = spread(speedup)
        block["aa_ratio"] = spread(floor)
        block["values_compared"] = reps[0][probe]["values_compared"]
        summary[probe] = block
    return summary


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'probe':<12}{'reuse':>10}{'no reuse':>10}{'ratio':>18}{'A/A':>18}")
    for probe, block in summary.items():
        ratio, floor = block["no_reuse_over_reuse"], block["aa_ratio"]
        print(
            f"{probe:<12}{block['reuse']['median']:>9.1f}s{block['no_reuse']['median']:>9.1f}s"
            f"{ratio['median']:>8.2f}x [{ratio['min']:.2f}..{ratio['max']:.2f}]"
            f"{floor['median']:>8.2f}x [{floor['min']:.2f}..{floor['max']:.2f}]"
        )


if __name__ == "__main__":
    sys.exit(main())
