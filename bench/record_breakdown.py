"""Where a recorded run's extra time goes: per-thread CPU accounting of bench_record's cnn.

    .venv/bin/python -m bench.record_breakdown      # ~6 min on 2 cores -> bench/results/
    .venv/bin/python -m bench.record_breakdown --workload saturated --reps 5
    .venv/bin/python -m bench.record_breakdown --baseline-src /tmp/base/src   # vs another version

bench_record.py measures that recording costs the cnn workload a few percent of
wall time; this says which thread pays it and how. Each repetition runs the
workload (bench/_record_workload.py, torch on every core as users run it) three
times in fresh git projects, in an order that rotates between repetitions:
plain, plain again (the A/A floor) and recorded with retrolog's defaults. Inside
each process, over the timed span (first recording call to ``commit()``
returning):

- the training (main) thread's CPU time, ``time.thread_time()``, and its wall
  time minus that: the time it was off the CPU, waiting (for the GIL, for
  torch's intra-op threads, or runnable but not scheduled);
- the same two split in three: up to the first recording call's return (the
  run's start: its code version, the store, the checkpointer; for the plain
  script, entering ``nullcontext()``), training (the loops with retrolog's
  calls), and ``commit()`` (the end: the last records and checkpoints written);
- every other thread's CPU time from ``/proc/self/task/<tid>/stat`` (10 ms
  ticks), named by Python's ``threading`` where the thread is a Python thread
  (``retrolog-writer``, ``retrolog-checkpoint-writer``, ...) and ``native``
  otherwise (torch's OpenMP pool), read at the span's start, just before
  ``commit()`` (retrolog's threads still run then) and at its end.

With ``--baseline-src DIR`` each repetition also records with the retrolog package
in DIR (another version, e.g. ``git archive COMMIT src | tar -x -C /tmp/base``), and
the same figures are compared between the two versions per repetition, with how
many checkpoints each run kept, how many its urgent lane wrote and their stored size.

Figures are medians over repetitions of recorded minus plain, with min and max,
next to the same difference between the two plain runs (A/A). The extra wall
time splits exactly into the training thread's extra CPU (work retrolog's calls
do on it: loops, logs, snapshots) and its extra off-CPU time (what the other
threads' work makes it wait for).
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
from pathlib import Path
from typing import Any

from bench import _record_workload as workload
from bench.harness import GIT_ENV, BenchError, Measured, git, tail

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "record_breakdown.json"
EPOCHS = {"cnn": 12, "saturated": 12, "stress": 24, "finetune": 16}
VARIANTS = ("plain", "plain_again", "retrolog")

# Put into the workload: per-thread CPU seconds, by thread name.
PROBE = """
def _thread_cpu():
    import os as _os
    import threading as _threading

    names = {t.native_id: t.name for t in _threading.enumerate()}
    tick = _os.sysconf("SC_CLK_TCK")
    found = {}
    for tid in _os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "native")
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found
"""


def instrument(source: str) -> str:
    """The workload with the probe read at the span's start, before commit and at its end."""
    start = "t0, c0 = time.perf_counter(), time.process_time()\n"
    if start not in source:
        raise BenchError("the workload's span start moved; update record_breakdown.py")
    source = source.replace(start, start + "m0 = time.thread_time()\n_at_start = _thread_cpu()\n")
    lines = source.splitlines(keepends=True)
    # Just inside the checkpointing block: the first recording call (the run's start:
    # code version, store, checkpointer) has returned.
    for i, line in enumerate(lines):
        if line.startswith("with ") and ("checkpointing(" in line or "nullcontext(" in line):
            lines.insert(i + 1, "    _started = (time.perf_counter(), time.thread_time())\n")
            break
    else:
        raise BenchError("no checkpointing block found in the workload")
    # The commit line: rl.commit() or pass, at the top level after the loop.
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip() in ("rl.commit()", "pass") and not lines[i].startswith(" "):
            lines.insert(
                i,
                "_before_commit = _thread_cpu()\n"
                "_at_commit = (time.perf_counter(), time.thread_time())\n",
            )
            break
    else:
        raise BenchError("no commit line found in the workload")
    source = "".join(lines)
    footer = 'print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "epochs": epochs}))\n'
    if footer not in source:
        raise BenchError("the workload's footer moved; update record_breakdown.py")
    return source.replace(
        footer,
        "main_cpu = time.thread_time() - m0\n"
        'print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "epochs": epochs,'
        ' "main_cpu": main_cpu, "start": _at_start, "before_commit": _before_commit,'
        ' "end": _thread_cpu(), "run_start_wall": _started[0] - t0,'
        ' "run_start_main_cpu": _started[1] - m0,'
        ' "commit_wall": t0 + seconds - _at_commit[0],'
        ' "commit_main_cpu": m0 + main_cpu - _at_commit[1]}))\n',
    ).replace("import torch\n", PROBE + "\nimport torch\n", 1)


def run_once(
    python: Path,
    name: str,
    variant: str,
    threads: int,
    epochs: int,
    baseline_src: Path | None = None,
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env.update(GIT_ENV, RETROLOG_PROGRESS="0", PYTHONHASHSEED="0")
    if variant == "baseline":
        assert baseline_src is not None
        env["PYTHONPATH"] = str(baseline_src.resolve())
    work = Path(tempfile.mkdtemp(prefix="retrolog-bench-breakdown-"))
    try:
        project = work / "proj"
        project.mkdir()
        git(project, env, "init", "-q")
        kind = "plain" if variant.startswith("plain") else "retrolog"
        (project / "train.py").write_text(instrument(workload.source(name, kind)))
        git(project, env, "add", "train.py")
        git(project, env, "commit", "-q", "-m", "workload")
        done = subprocess.run(
            [str(python), "train.py", str(epochs), str(threads)], cwd=project, env=env,
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise BenchError(f"{name}/{variant} failed:\n{tail(done.stderr)}")
        line = [ln for ln in done.stdout.splitlines() if ln.startswith('{"seconds"')][-1]
        found = account(json.loads(line))
        if kind == "retrolog":
            found.update(checkpoint_figures(project / ".retrolog" / "retrolog.db"))
        return found
    finally:
        shutil.rmtree(work, ignore_errors=True)


def checkpoint_figures(db: Path) -> dict[str, Any]:
    """What the recorded run's store says about its checkpoints: how many, by whom, bytes."""
    conn = sqlite3.connect(db)
    try:
        ((policy_json,),) = conn.execute("SELECT checkpointing FROM runs")
        ((blocks, stored),) = conn.execute(
            "SELECT count(*) FILTER (WHERE kind = 'block'), coalesce(sum(nbytes), 0)"
            " FROM checkpoints"
        )
    finally:
        conn.close()
    policy = json.loads(policy_json)
    epoch = policy["blocks"]["epoch"]
    if epoch["checkpoints"] != blocks or policy["abandoned"]:
        raise BenchError(f"a chosen checkpoint was lost: {policy}")
    # Per checkpoint, as the writer measured them (thread CPU time, not 10 ms ticks).
    return {
        "block_checkpoints": blocks,
        "urgent_writes": policy["urgent_writes"],
        "stored_mb": stored / 1e6,
        "capture_ms": epoch["mean_capture_seconds"] * 1e3,
        "writer_cpu_ms": epoch["mean_writer_cpu_seconds"] * 1e3,
        "urgent_cpu_ms": epoch["mean_urgent_cpu_seconds"] * 1e3,
        "urgent_wall_ms": epoch["mean_urgent_write_seconds"] * 1e3,
    }


def account(raw: dict[str, Any]) -> dict[str, Any]:
    """Per-thread CPU over the span; retrolog's threads as of just before commit()."""

    def delta(at: dict[str, float], name: str) -> float:
        return at.get(name, 0.0) - raw["start"].get(name, 0.0)

    end, before = raw["end"], raw["before_commit"]
    retrolog_threads = {
        name: delta(before, name) for name in before if name.startswith("retrolog-")
    }
    return {
        "wall": raw["seconds"],
        "run_start_wall": raw["run_start_wall"],
        "run_start_main_cpu": raw["run_start_main_cpu"],
        "training_wall": raw["seconds"] - raw["run_start_wall"] - raw["commit_wall"],
        "training_main_off_cpu": (raw["seconds"] - raw["run_start_wall"] - raw["commit_wall"])
        - (raw["main_cpu"] - raw["run_start_main_cpu"] - raw["commit_main_cpu"]),
        "commit_wall": raw["commit_wall"],
        "commit_main_off_cpu": raw["commit_wall"] - raw["commit_main_cpu"],
        "process_cpu": raw["cpu_seconds"],
        "main_cpu": raw["main_cpu"],
        "main_off_cpu": raw["seconds"] - raw["main_cpu"],
        "native_cpu": delta(end, "native"),
        "retrolog_threads_cpu": sum(retrolog_threads.values()),
        "retrolog_threads": retrolog_threads,
    }


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def difference(
    runs: list[dict[str, dict[str, Any]]], key: str, this: str, other: str, prefix: str
) -> dict[str, Any]:
    """``this`` minus ``other`` per repetition, in seconds and in % of the plain run's wall."""
    diffs = [(r[this][key] - r[other][key], r["plain"]["wall"]) for r in runs]
    return {
        f"{prefix}seconds": stats([d for d, _ in diffs]),
        f"{prefix}pct_of_plain_wall": stats([d / wall * 100 for d, wall in diffs]),
    }


CHECKPOINT_KEYS = (
    "block_checkpoints",
    "urgent_writes",
    "stored_mb",
    "capture_ms",
    "writer_cpu_ms",
    "urgent_cpu_ms",
    "urgent_wall_ms",
)


KEYS = (
    "wall",
    "run_start_wall",
    "run_start_main_cpu",
    "training_wall",
    "training_main_off_cpu",
    "commit_wall",
    "commit_main_off_cpu",
    "main_cpu",
    "main_off_cpu",
    "native_cpu",
    "retrolog_threads_cpu",
    "process_cpu",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="cnn", choices=sorted(EPOCHS))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also record with the retrolog package in this src directory (another version,"
        " e.g. from `git archive COMMIT src`), on PYTHONPATH, and compare it per repetition",
    )
    args = parser.parse_args(argv)
    epochs = args.epochs or EPOCHS[args.workload]
    variants = VARIANTS
    if args.baseline_src is not None:
        if not (args.baseline_src / "retrolog" / "__init__.py").is_file():
            parser.error(f"--baseline-src {args.baseline_src}: no retrolog package in it")
        variants = (*VARIANTS, "baseline")
    python = Path(sys.executable)
    measured = Measured("record_breakdown", args.reps).start()
    runs: list[dict[str, dict[str, Any]]] = []
    try:
        for rep in range(args.reps):
            shift = rep % len(variants)
            order = variants[shift:] + variants[:shift]
            found = {
                v: run_once(python, args.workload, v, args.threads, epochs, args.baseline_src)
                for v in order
            }
            runs.append(found)
            r, p = found["retrolog"], found["plain"]
            print(
                f"rep {rep + 1}/{args.reps}: wall plain {p['wall']:.2f}s recorded "
                f"{r['wall']:.2f}s; main cpu {p['main_cpu']:.2f} -> {r['main_cpu']:.2f}s",
                file=sys.stderr,
            )
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    figures: dict[str, Any] = {}
    for key in KEYS:
        figures[key] = {
            "plain_seconds": stats([r["plain"][key] for r in runs]),
            **difference(runs, key, "retrolog", "plain", "recorded_minus_plain_"),
            "aa_abs_pct_of_plain_wall": statistics.median(
                abs(r["plain_again"][key] - r["plain"][key]) / r["plain"]["wall"] * 100
                for r in runs
            ),
        }
    compared: dict[str, Any] = {}
    if args.baseline_src is not None:
        for key in KEYS:
            compared[key] = {
                "baseline_seconds": stats([r["baseline"][key] for r in runs]),
                **difference(runs, key, "retrolog", "baseline", "this_minus_baseline_"),
            }
    per_thread: dict[str, list[float]] = {}
    for r in runs:
        for name, seconds in r["retrolog"]["retrolog_threads"].items():
            per_thread.setdefault(name, []).append(seconds)
    checkpoints = {
        v: {key: stats([r[v][key] for r in runs]) for key in CHECKPOINT_KEYS}
        for v in variants
        if v in ("retrolog", "baseline")
    }
    result = {
        **measured.head(),
        "workload": args.workload,
        "epochs": epochs,
        "torch_threads": args.threads,
        "figures": figures,
        "retrolog_threads_cpu_seconds": {k: stats(v) for k, v in per_thread.items()},
        "checkpoints": checkpoints,
        "baseline_src": None if args.baseline_src is None else str(args.baseline_src),
        "versus_baseline": compared,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\n{args.workload}, {args.reps} reps, torch on {args.threads} threads; seconds over "
        "the span, recorded - plain: median [min..max] (% of plain wall), A/A |plain2 - plain|"
    )
    for key in KEYS:
        f = figures[key]
        d, pct = f["recorded_minus_plain_seconds"], f["recorded_minus_plain_pct_of_plain_wall"]
        print(
            f"  {key:22} plain {f['plain_seconds']['median']:7.2f}  "
            f"{d['median']:+6.2f} [{d['min']:+.2f}..{d['max']:+.2f}]  "
            f"({pct['median']:+5.1f}%)  A/A {f['aa_abs_pct_of_plain_wall']:.1f}%"
        )
    for name, s in result["retrolog_threads_cpu_seconds"].items():
        print(f"  {name:28} CPU {s['median']:.2f}s [{s['min']:.2f}..{s['max']:.2f}]")
    for v, c in checkpoints.items():
        print(
            f"  {v}: block checkpoints {c['block_checkpoints']['median']:.0f}, urgent writes "
            f"{c['urgent_writes']['median']:.0f}, stored {c['stored_mb']['median']:.1f} MB;"
            f" per block checkpoint: capture {c['capture_ms']['median']:.1f} ms, writer CPU "
            f"{c['writer_cpu_ms']['median']:.1f} ms, urgent lane CPU "
            f"{c['urgent_cpu_ms']['median']:.1f} ms and wall {c['urgent_wall_ms']['median']:.1f}"
            " ms (medians of the runs' means)"
        )
    if compared:
        print(f"\nthis version - baseline ({args.baseline_src}), per repetition:")
        for key in KEYS:
            d = compared[key]["this_minus_baseline_seconds"]
            pct = compared[key]["this_minus_baseline_pct_of_plain_wall"]
            print(
                f"  {key:22} {d['median']:+6.2f} [{d['min']:+.2f}..{d['max']:+.2f}]"
                f"  ({pct['median']:+5.1f}%)"
            )
    print(f"\nresults: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
