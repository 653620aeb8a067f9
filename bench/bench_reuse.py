"""Reuse in replay: a sweep whose configurations were launched more than once.

Run from the repository root with the project's venv:

    python -m bench.bench_reuse                 # about 10 minutes on a 2-core machine
    python -m bench.bench_reuse --reps 1 --launches 2

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _replay_workload as workload
from bench._replay_workload import read_values
from bench.harness import BenchError, spread


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
    kwargs = [
        [f"lr={0.05 * (i + 1)}", f"epochs={args.epochs}", f"n_train={args.n_train}"]
        for i in range(args.configs)
        for _ in range(args.launches)
    ]
    return workload.record_runs(python, root, kwargs, workload.environment())


def replay(python: Path, project: Path, name: str, flags: list[str]) -> tuple[float, str]:
    return workload.timed_replay(python, project, [name, *flags], workload.environment())


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
