"""Benchmark: what a busy background writer costs CPU-bound training, by its CPU priority.

Run from the repository root with the project's venv (retrolog and torch installed):

    python -m bench.bench_writer_priority            # about 3 minutes on a 2-core machine
    python -m bench.bench_writer_priority --reps 7

A small CNN (the cnn workload of bench_record.py) trains for a fixed number of
steps with torch using every core, in a fresh process per trial, while a
second thread of the same process compresses float32 weights with retrolog's
codec (c-blosc2 shuffle + zstd, the GIL released) back to back, as a checkpoint
writer that never runs out of work would:

- ``none``: no writer, the baseline;
- ``normal``: the writer at the training's priority;
- ``low``: the writer at nice 19;
- ``idle``: the writer under the SCHED_IDLE policy (Linux), which the
  scheduler runs only on a core nothing else wants and preempts at once, as
  ``BackgroundCheckpointer`` runs it.

Per trial: the training's wall time, and the writer's CPU seconds and
megabytes compressed in that time. Slowdown = trial time / the same
repetition's ``none`` time - 1; configurations interleaved, medians with min
and max over the repetitions.

Results: bench/results/writer_priority.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import _record_workload as workload
from bench.harness import BenchError, Measured, spread, tail

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "writer_priority.json"
MODES = ("none", "normal", "low", "idle")

TRIAL = (
    """\
import json
import os
import sys
import threading
import time

import numpy as np
import torch
from torch import nn

from retrolog.checkpoint import _arrays

mode, steps = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))
torch.manual_seed(0)
"""
    + workload.CNN_SETUP
    + """\
weights = torch.randn(4_000_000).numpy().view(np.uint8)  # 16 MB of float32 to compress
_arrays._codec()  # imported before the timing, in every mode
stop = threading.Event()
writer = {"mb": 0.0, "cpu": 0.0}


def write() -> None:
    if mode == "low":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # raises if refused
    elif mode == "idle":
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    began = time.thread_time()
    while not stop.is_set():
        _arrays._compress(weights, 4)
        writer["mb"] += weights.nbytes / 1e6
    writer["cpu"] = time.thread_time() - began


thread = threading.Thread(target=write) if mode != "none" else None
t0 = time.perf_counter()
if thread is not None:
    thread.start()
for step in range(steps):
    xb, yb = batches[step % len(batches)]
    opt.zero_grad()
    nn.functional.cross_entropy(net(xb), yb).backward()
    opt.step()
seconds = time.perf_counter() - t0
stop.set()
if thread is not None:
    thread.join()
print(json.dumps({"seconds": seconds, **writer}))
"""
)


def trial(mode: str, steps: int, threads: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", TRIAL, mode, str(steps), str(threads)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise BenchError(f"trial {mode} failed:\n{tail(done.stderr)}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=160, help="training steps per trial")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("per-thread priorities are Linux's; nothing to measure here", file=sys.stderr)
        return 1
    measured = Measured("writer_priority", args.reps).start()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            runs[mode].append(trial(mode, args.steps, args.threads))
        base = runs["none"][-1]["seconds"]
        print(
            f"rep {rep + 1}/{args.reps}: "
            + "  ".join(
                f"{m} {runs[m][-1]['seconds']:.2f} s ({runs[m][-1]['seconds'] / base - 1:+.0%})"
                for m in MODES
            ),
            file=sys.stderr,
        )
    result: dict[str, Any] = measured.head()
    result.update(torch_threads=args.threads, steps=args.steps, modes={})
    for mode in MODES:
        seconds = [r["seconds"] for r in runs[mode]]
        entry: dict[str, Any] = {"training_seconds": spread(seconds)}
        if mode != "none":
            slowdown = [
                (r["seconds"] / b["seconds"] - 1) * 100
                for r, b in zip(runs[mode], runs["none"], strict=True)
            ]
            entry["slowdown_pct"] = spread(slowdown)
            entry["writer_cpu_seconds"] = spread([r["cpu"] for r in runs[mode]])
            entry["writer_mb"] = spread([r["mb"] for r in runs[mode]])
            entry["training_seconds_lost_per_writer_cpu_second"] = statistics.median(
                (r["seconds"] - b["seconds"]) / r["cpu"]
                for r, b in zip(runs[mode], runs["none"], strict=True)
                if r["cpu"] > 0
            )
        result["modes"][mode] = entry
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"writer priority: {result['nproc']} cores, torch {args.threads} threads, "
        f"{args.steps} steps, {args.reps} reps, load {measured.load_before[0]:.1f} -> "
        f"{result['load_average_after'][0]:.1f}"
    )
    for mode, entry in result["modes"].items():
        t = entry["training_seconds"]
        line = f"{mode:7s} training {t['median']:6.2f} s [{t['min']:.2f}..{t['max']:.2f}]"
        if "slowdown_pct" in entry:
            s, c = entry["slowdown_pct"], entry["writer_cpu_seconds"]
            line += (
                f"  slowdown {s['median']:+6.1f}% [{s['min']:+.1f}..{s['max']:+.1f}]"
                f"  writer {c['median']:.2f} CPU s, {entry['writer_mb']['median']:.0f} MB"
                f"  (training s lost per writer CPU s: "
                f"{entry['training_seconds_lost_per_writer_cpu_second']:.2f})"
            )
        print(line)
    print(f"\nwrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
