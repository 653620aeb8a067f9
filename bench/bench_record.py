"""Benchmark: what recording costs training, against the same script without retrolog.

Run from the repository root with the project's venv (retrolog and torch installed):

    python -m bench.bench_record              # about 20 minutes on a 2-core machine
    python -m bench.bench_record --reps 5 --no-flordb
    python -m bench.bench_record --workloads stress --epochs stress=96 --no-blocking \
        --output /tmp/record-long.json   # a longer run, its one-time costs amortized

(a) Record overhead. Four workloads (bench/_record_workload.py), each run as
a plain script and as the same script recording with retrolog (default
settings: background checkpoints, adaptive rule, eps = 1/15), in a fresh git
project and a fresh process each time; the span timed is from just before the
first recording call to just after ``commit()`` returns, so the run start and
the last checkpoint writes are inside it. A recorded run is timed as its
project's second: an untimed 1-epoch run of the same script, with another
seed, comes first, so the timed one finds the store made and its code version stored, as every
run of a user's but the first does (``--first-run`` times the first run
instead: it also makes the store and copies the code, about 60 ms on the cnn):

- cnn: a small CNN, a checkpoint per epoch allowed; target: median overhead <= 1%;
- saturated: the cnn fed by a DataLoader whose worker process keeps a core
  busy, beside torch's threads on every core: the checkpoint writer's idle
  lane gets next to no CPU; target: median overhead <= eps;
- stress: a 25M-parameter MLP with Adam (300 MB of state) and blocks of a
  second or two; target: overhead <= eps (1/15) in every repetition, with the
  checkpoint count the adaptive rule chose;
- finetune: a frozen 6M-parameter backbone with a trainable head; target: <= 1%;
- the cnn workload recorded with FlorDB 4.0.1 (bench/.venv-flordb, torch linked
  in as bench_replay.py does), for its overhead on the same script.

Every recorded run must keep every block checkpoint the adaptive rule chose
(``chosen`` in runs.checkpointing equals its block checkpoint rows, none
abandoned); a run that loses one fails the benchmark. What the rule chose,
how many the writer's urgent lane wrote while training ran, and how long
the exit waited for the rest are reported per run.

``--normal-writer`` also runs cnn and saturated recorded with the writer's
idle lane left at training's priority (variant ``retrolog_normal``: no
SCHED_IDLE at all), the design the two lanes were measured against.
``--rule-cost`` also runs them recorded with eps = 1e-9 (``retrolog_minimal``:
only the first block's and the end checkpoint, which every run takes): the
default's overhead beyond it is what the adaptive rule's choices cost, which
the rule keeps under eps; the rest is recording's own cost. It also runs them
recorded with no ``checkpointing`` block (``retrolog_logs``): what loops, logs,
the run's start and ``commit()`` cost without any checkpoint.
``--baseline-src DIR`` also runs them recorded with another version of
retrolog (``retrolog_baseline``: the package in DIR, on PYTHONPATH; e.g.
``git archive 3feb204 src | tar -x -C /tmp/base`` and ``DIR=/tmp/base/src``),
interleaved with the rest: this version against it, per repetition, and how
many of the block checkpoints its rule chose it kept.

Overhead per repetition = recorded span / plain span - 1, with the plain and
recorded runs of a repetition back to back (their order alternating), so load
from elsewhere on the shared machine hits both alike. Medians with min and max.
Each repetition then runs the plain script once more ("plain again", an A/A
pair): its difference from the first plain run is what one execution differs
from the next on this machine, the floor under any overhead figure.

(b) Main-thread blocking per checkpoint: from the stress runs' checkpoints
table (capture_seconds), and measured in one process on the same 300 MB state
(bench/_record_workload.BLOCKING): retrolog's capture vs ``torch.save`` of the
same state (target: at most 0.3x) and vs a plain copy into preallocated
buffers (the floor), one torch thread.

Results: bench/results/record.json.
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
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import _record_workload as workload
from bench.harness import (
    GIT_ENV,
    BenchError,
    Measured,
    flordb_python,
    git,
    source_fingerprint,
    spread,
    tail,
)

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "record.json"
EPS = 1 / 15
# Long enough that a run's one-time costs (its code version, the first and the end
# checkpoints) are what they are in a real training: a small share.
EPOCHS = {"cnn": 12, "saturated": 12, "stress": 24, "finetune": 16}
TARGETS = {"cnn": 0.01, "saturated": EPS, "stress": EPS, "finetune": 0.01}
COMPARED = ("cnn", "saturated")  # the workloads --normal-writer and --rule-cost run on
CHILD_TIMEOUT = 900


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env.update(GIT_ENV)
    env["RETROLOG_PROGRESS"] = "0"
    env["PYTHONHASHSEED"] = "0"
    return env


def run_child(
    cmd: list[str], env: dict[str, str], what: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a benchmark child to completion; BenchError with its stderr's tail if it fails."""
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"{what} failed:\n{tail(done.stderr)}")
    return done


def run_once(
    python: Path,
    name: str,
    variant: str,
    threads: int,
    env: dict[str, str],
    epochs: int,
    first_run: bool = False,
) -> dict[str, Any]:
    """Run ``name`` in ``variant`` in a fresh git project; the span and what the store holds.

    A recorded variant is timed as the project's second run: one untimed run of one
    epoch records the same script first, with another seed, so the timed run finds
    the store made and the code version stored, as every run of a user's but their
    first does, and none of its own states (``first_run``: time the project's first
    run instead).
    """
    work = Path(tempfile.mkdtemp(prefix=f"retrolog-bench-record-{name}-"))
    try:
        project = work / "proj"
        project.mkdir()
        git(project, env, "init", "-q")
        baseline = variant == "retrolog_baseline"
        script = workload.source(name, "retrolog" if baseline else variant)
        (project / "train.py").write_text(script)
        git(project, env, "add", "train.py")
        git(project, env, "commit", "-q", "-m", "workload")
        if variant.startswith("retrolog") and not first_run:
            # Another seed: the same code version, but no state of the timed run's, so
            # none of its checkpoints' bytes are in the store already (a user's runs
            # differ in their arguments; identical ones would share the first state).
            prior = [str(python), "train.py", "1", str(threads), "1"]
            run_child(prior, env, f"{name}/{variant} (the untimed first run)", cwd=project)
        cmd = [str(python), "train.py", str(epochs), str(threads)]
        done = run_child(cmd, env, f"{name}/{variant}", cwd=project)
        # FlorDB echoes what it logs on stdout: the figures are the last JSON line.
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"seconds"')]
        if not lines:
            raise BenchError(f"{name}/{variant} printed no figures:\n{tail(done.stdout)}")
        figures: dict[str, Any] = json.loads(lines[-1])
        db = project / ".retrolog" / "retrolog.db"
        if baseline:
            figures.update(baseline_figures(db))
        elif variant == "retrolog_logs":
            figures.update(logs_figures(db))
        elif variant.startswith("retrolog"):
            figures.update(store_figures(db, epochs))
        return figures
    finally:
        shutil.rmtree(work, ignore_errors=True)


def timed_run(conn: sqlite3.Connection) -> str:
    """The run the benchmark timed: the project's last (an untimed first run may precede it)."""
    ((run_id,),) = conn.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1")
    return str(run_id)


def store_figures(db: Path, epochs: int) -> dict[str, Any]:
    """What the recorded run's store says about its checkpoints; fails on a short store.

    Also fails when a block checkpoint the adaptive rule chose was not written.
    """
    conn = sqlite3.connect(db)
    try:
        run = (timed_run(conn),)
        ((status, policy_json),) = conn.execute(
            "SELECT status, checkpointing FROM runs WHERE run_id = ?", run
        )
        rows = conn.execute(
            "SELECT kind, capture_seconds, writer_cpu_seconds, nbytes FROM checkpoints"
            " WHERE run_id = ?",
            run,
        ).fetchall()
        (losses,) = conn.execute(
            "SELECT count(*) FROM logs WHERE name = 'loss' AND run_id = ?", run
        ).fetchone()
    finally:
        conn.close()
    if status != "finished":
        raise BenchError(f"the recorded run ended {status}")
    blocks = [r for r in rows if r[0] == "block"]
    ends = [r for r in rows if r[0] == "end"]
    if len(ends) != 1 or not blocks or losses == 0:
        raise BenchError(f"the store holds {len(blocks)} block and {len(ends)} end checkpoints")
    policy = json.loads(policy_json)
    epoch = policy["blocks"]["epoch"]
    if epoch["checkpoints"] != len(blocks) or policy["abandoned"]:
        raise BenchError(
            f"the rule chose {epoch['checkpoints']} block checkpoints and {len(blocks)} were "
            f"written ({policy['abandoned']} abandoned): a chosen checkpoint was lost"
        )
    return {
        "block_checkpoints": len(blocks),
        "block_executions": epoch["executions"],
        "chosen": epoch["checkpoints"],
        "refused_cost": epoch["refused_cost"],
        "refused_writer_full": epoch["refused_writer_full"],
        "refused_unpriced": epoch.get("refused_unpriced"),
        "room_waits": epoch.get("room_waits"),
        "urgent_writes": policy["urgent_writes"],
        "finished_at_exit": policy["finished_at_exit"],
        "finish_seconds": policy["finish_seconds"],
        "capture_ms": [r[1] * 1e3 for r in rows],
        "writer_cpu_ms": [(r[2] or 0.0) * 1e3 for r in rows],
        "checkpoint_mb": [r[3] / 1e6 for r in rows],
        "waited_seconds": policy["waited_seconds"],
    }


def logs_figures(db: Path) -> dict[str, Any]:
    """A run recorded without checkpointing: finished, its losses stored, no checkpoint."""
    conn = sqlite3.connect(db)
    try:
        run = (timed_run(conn),)
        ((status,),) = conn.execute("SELECT status FROM runs WHERE run_id = ?", run)
        (losses,) = conn.execute(
            "SELECT count(*) FROM logs WHERE name = 'loss' AND run_id = ?", run
        ).fetchone()
        (checkpoints,) = conn.execute(
            "SELECT count(*) FROM checkpoints WHERE run_id = ?", run
        ).fetchone()
    finally:
        conn.close()
    if status != "finished" or losses == 0 or checkpoints:
        raise BenchError(
            f"the run recorded without checkpointing ended {status} with {losses} losses and "
            f"{checkpoints} checkpoints"
        )
    return {"block_checkpoints": 0}


def baseline_figures(db: Path) -> dict[str, Any]:
    """What another version's run kept: block checkpoints written, and chosen if it says.

    Earlier versions may lose chosen checkpoints; that is reported, not failed on.
    """
    conn = sqlite3.connect(db)
    try:
        run = (timed_run(conn),)
        ((policy_json,),) = conn.execute("SELECT checkpointing FROM runs WHERE run_id = ?", run)
        (blocks,) = conn.execute(
            "SELECT count(*) FROM checkpoints WHERE kind = 'block' AND run_id = ?", run
        ).fetchone()
    finally:
        conn.close()
    policy = json.loads(policy_json or "{}")
    chosen = policy.get("blocks", {}).get("epoch", {}).get("checkpoints")
    return {"block_checkpoints": blocks, "chosen": chosen}


def blocking_figures(python: Path, env: dict[str, str], reps: int) -> dict[str, Any]:
    """(b): one checkpoint's main-thread blocking vs torch.save and a plain copy, in ms."""
    blocking = run_child(
        [str(python), "-c", workload.BLOCKING, str(reps)], env, "blocking measurement"
    )
    block = json.loads(blocking.stdout.strip().splitlines()[-1])
    ours, saved, copied = block["retrolog"], block["torch_save"], block["copy"]
    return {
        "state_mb": block["state_mb"],
        "retrolog_ms": spread([x * 1e3 for x in ours]),
        "torch_save_ms": spread([x * 1e3 for x in saved]),
        "copy_ms": spread([x * 1e3 for x in copied]),
        "ratio_vs_torch_save": statistics.median(ours) / statistics.median(saved),
        "ratio_vs_copy": statistics.median(ours) / statistics.median(copied),
        "target_ratio_vs_torch_save": 0.3,
    }


def parse_epochs(items: list[str]) -> dict[str, int]:
    """``--epochs`` values (``NAME=N``) as a mapping; ValueError naming the bad one."""
    out: dict[str, int] = {}
    for item in items:
        name, _, count = item.partition("=")
        if name not in EPOCHS or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--epochs {item!r}: expected NAME=N with NAME one of {', '.join(EPOCHS)}"
                " and N a positive whole number"
            )
        out[name] = int(count)
    return out


def torch_path(flor_python: Path, scratch: Path) -> tuple[Path | None, str]:
    from bench.bench_replay import torch_path_for

    return torch_path_for(flor_python, scratch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--no-flordb", action="store_true", help="skip the FlorDB anchor")
    parser.add_argument("--blocking-reps", type=int, default=7)
    parser.add_argument(
        "--blocking-only",
        action="store_true",
        help="measure (b) only, replacing the blocking figures of the existing --output file",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="results JSON file")
    parser.add_argument(
        "--workloads", default=",".join(workload.WORKLOADS), help="comma-separated subset"
    )
    parser.add_argument(
        "--epochs",
        action="append",
        default=[],
        metavar="NAME=N",
        help="run workload NAME for N epochs instead of its default (repeatable)",
    )
    parser.add_argument("--no-blocking", action="store_true", help="skip (b)")
    parser.add_argument(
        "--normal-writer",
        action="store_true",
        help="also record cnn and saturated with the writer at training's priority",
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also record cnn and saturated with the retrolog package in this src directory"
        " (another version, e.g. from `git archive COMMIT src`), on PYTHONPATH",
    )
    parser.add_argument(
        "--first-run",
        action="store_true",
        help="time each recorded run as its project's first (it makes the store and stores"
        " the code version) instead of after one untimed 1-epoch run, as a user's later runs",
    )
    parser.add_argument(
        "--rule-cost",
        action="store_true",
        help="also record cnn and saturated with only the two checkpoints every run takes",
    )
    args = parser.parse_args(argv)
    try:
        epochs = dict(EPOCHS, **parse_epochs(args.epochs))
    except ValueError as exc:
        parser.error(str(exc))
    if args.blocking_only:
        result = json.loads(args.output.read_text())
        result["blocking"] = blocking_figures(Path(sys.executable), base_env(), args.blocking_reps)
        result["blocking"]["date"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        result["blocking"]["source"] = source_fingerprint()
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print_report(result)
        return 0
    measured = Measured("record", args.reps).start()
    python = Path(sys.executable)
    env = base_env()
    names = [n for n in args.workloads.split(",") if n]

    flor_python, flordb_note, flor_env = None, "skipped (--no-flordb)", dict(env)
    scratch = Path(tempfile.mkdtemp(prefix="retrolog-bench-record-"))
    if not args.no_flordb and "cnn" in names:
        flor_python, flordb_note = flordb_python()
        if flor_python is not None:
            linked, note = torch_path(flor_python, scratch / "torch-path")
            flordb_note += f"; {note}"
            if linked is None:
                flor_python = None
            else:
                flor_env["PYTHONPATH"] = str(linked)
                flor_env["PATH"] = f"{flor_python.parent}{os.pathsep}{env.get('PATH', '')}"
        if flor_python is None:
            print(f"flordb unavailable: {flordb_note}", file=sys.stderr)

    baseline_env = dict(env)
    if args.baseline_src is not None:
        if not (args.baseline_src / "retrolog" / "__init__.py").is_file():
            parser.error(f"--baseline-src {args.baseline_src}: no retrolog package in it")
        baseline_env["PYTHONPATH"] = str(args.baseline_src.resolve())
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    flordb_samples: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            for name in names:
                order = ["plain", "retrolog"]
                if args.normal_writer and name in COMPARED:
                    order.append("retrolog_normal")
                if args.rule_cost and name in COMPARED:
                    order += ["retrolog_minimal", "retrolog_logs"]
                if args.baseline_src is not None and name in COMPARED:
                    order.append("retrolog_baseline")
                # Each variant first in turn, so a trend in the machine's load does not
                # always fall on the same one.
                shift = rep % len(order)
                order = order[shift:] + order[:shift]
                got = {
                    v: run_once(
                        python,
                        name,
                        v,
                        args.threads,
                        baseline_env if v == "retrolog_baseline" else env,
                        epochs[name],
                        first_run=args.first_run,
                    )
                    for v in order
                }
                # A/A: the plain script once more, right after: what the same run differs
                # by from one execution to the next here, the floor of any overhead claim.
                got["plain_again"] = run_once(
                    python, name, "plain", args.threads, env, epochs[name]
                )
                if name == "cnn" and flor_python is not None:
                    got["flordb"] = run_once(
                        flor_python, name, "flordb", args.threads, flor_env, epochs[name]
                    )
                    flordb_samples.append(got["flordb"])
                if "retrolog_normal" in got:
                    got["normal_overhead"] = (
                        got["retrolog_normal"]["seconds"] / got["plain"]["seconds"] - 1
                    )
                if "retrolog_baseline" in got:
                    got["baseline_overhead"] = (
                        got["retrolog_baseline"]["seconds"] / got["plain"]["seconds"] - 1
                    )
                    # This version against the baseline version, per repetition.
                    got["versus_baseline"] = (
                        got["retrolog"]["seconds"] / got["retrolog_baseline"]["seconds"] - 1
                    )
                if "retrolog_minimal" in got:
                    got["minimal_overhead"] = (
                        got["retrolog_minimal"]["seconds"] / got["plain"]["seconds"] - 1
                    )
                    # What the rule's own checkpoints cost, against the same run's minimal.
                    got["rule_overhead"] = (
                        got["retrolog"]["seconds"] / got["retrolog_minimal"]["seconds"] - 1
                    )
                if "retrolog_logs" in got:
                    got["logs_overhead"] = (
                        got["retrolog_logs"]["seconds"] / got["plain"]["seconds"] - 1
                    )
                    got["logs_cpu_overhead"] = (
                        got["retrolog_logs"]["cpu_seconds"] / got["plain"]["cpu_seconds"] - 1
                    )
                got["overhead"] = got["retrolog"]["seconds"] / got["plain"]["seconds"] - 1
                got["noise"] = got["plain_again"]["seconds"] / got["plain"]["seconds"] - 1
                got["cpu_overhead"] = (
                    got["retrolog"]["cpu_seconds"] / got["plain"]["cpu_seconds"] - 1
                )
                if "flordb" in got:
                    got["flordb_overhead"] = got["flordb"]["seconds"] / got["plain"]["seconds"] - 1
                samples[name].append(got)
                print(
                    f"rep {rep + 1}/{args.reps} {name:9s} plain {got['plain']['seconds']:6.2f} s"
                    f"  retrolog {got['retrolog']['seconds']:6.2f} s"
                    f"  overhead {got['overhead'] * 100:+.2f}%"
                    f" (CPU {got['cpu_overhead'] * 100:+.2f}%)"
                    f"  plain again {got['noise'] * 100:+.2f}%"
                    f"  checkpoints {got['retrolog']['block_checkpoints']}"
                    f"/{got['retrolog']['block_executions']} blocks + end"
                    f" ({got['retrolog']['urgent_writes']} urgent,"
                    f" {got['retrolog']['finished_at_exit']} at exit)"
                    + (
                        f"  normal writer {got['normal_overhead'] * 100:+.2f}%"
                        f" ({got['retrolog_normal']['block_checkpoints']} checkpoints)"
                        if "normal_overhead" in got
                        else ""
                    )
                    + (
                        f"  baseline {got['baseline_overhead'] * 100:+.2f}%"
                        f" ({got['retrolog_baseline']['block_checkpoints']} of"
                        f" {got['retrolog_baseline']['chosen']} kept)"
                        if "baseline_overhead" in got
                        else ""
                    )
                    + (
                        f"  minimal {got['minimal_overhead'] * 100:+.2f}%, the rule's"
                        f" {got['rule_overhead'] * 100:+.2f}%"
                        if "minimal_overhead" in got
                        else ""
                    )
                    + (
                        f"  flordb {got['flordb_overhead'] * 100:+.2f}%"
                        if "flordb_overhead" in got
                        else ""
                    ),
                    file=sys.stderr,
                )
        block = None if args.no_blocking else blocking_figures(python, env, args.blocking_reps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    result: dict[str, Any] = measured.head()
    result["torch_version"] = metadata.version("torch")
    result["torch_threads"] = args.threads
    result["overhead_tolerance"] = EPS
    result["timed_run"] = (
        "the project's first recorded run (--first-run)"
        if args.first_run
        else "the project's second recorded run, after an untimed 1-epoch run of the same script"
    )
    result["workloads"] = {}
    for name, reps in samples.items():
        overheads = [s["overhead"] * 100 for s in reps]
        entry: dict[str, Any] = {
            "epochs": epochs[name],
            "plain_seconds": spread([s["plain"]["seconds"] for s in reps]),
            "retrolog_seconds": spread([s["retrolog"]["seconds"] for s in reps]),
            "overhead_pct": spread(overheads),
            # The plain script run again after the pair, against the first plain run.
            "plain_again_pct": spread([s["noise"] * 100 for s in reps]),
            "plain_again_median_abs_pct": statistics.median(abs(s["noise"]) * 100 for s in reps),
            # CPU time of the whole process, the writer's included: what recording
            # adds in work, whether or not it cost training wall time.
            "cpu_overhead_pct": spread([s["cpu_overhead"] * 100 for s in reps]),
            "target_pct": TARGETS[name] * 100,
            "target_met": (
                max(overheads) <= TARGETS[name] * 100
                if name == "stress"
                else statistics.median(overheads) <= TARGETS[name] * 100
            ),
            "block_checkpoints": [s["retrolog"]["block_checkpoints"] for s in reps],
            "block_executions": reps[0]["retrolog"]["block_executions"],
            # Every block checkpoint chosen was written (store_figures checks it).
            "chosen": [s["retrolog"]["chosen"] for s in reps],
            "abandoned": [0 for _ in reps],
            "refused_cost": [s["retrolog"]["refused_cost"] for s in reps],
            "refused_writer_full": [s["retrolog"]["refused_writer_full"] for s in reps],
            "refused_unpriced": [s["retrolog"]["refused_unpriced"] for s in reps],
            "room_waits": [s["retrolog"]["room_waits"] for s in reps],
            "urgent_writes": [s["retrolog"]["urgent_writes"] for s in reps],
            "finished_at_exit": [s["retrolog"]["finished_at_exit"] for s in reps],
            "finish_seconds": spread([s["retrolog"]["finish_seconds"] for s in reps]),
            "capture_ms": spread([x for s in reps for x in s["retrolog"]["capture_ms"]]),
            "writer_cpu_ms": spread([x for s in reps for x in s["retrolog"]["writer_cpu_ms"]]),
            "checkpoint_mb": statistics.median(
                x for s in reps for x in s["retrolog"]["checkpoint_mb"]
            ),
            "waited_seconds": [s["retrolog"]["waited_seconds"] for s in reps],
        }
        if all("retrolog_normal" in s for s in reps):
            entry["normal_writer"] = {
                "seconds": spread([s["retrolog_normal"]["seconds"] for s in reps]),
                "overhead_pct": spread([s["normal_overhead"] * 100 for s in reps]),
                "cpu_overhead_pct": spread(
                    [
                        (s["retrolog_normal"]["cpu_seconds"] / s["plain"]["cpu_seconds"] - 1) * 100
                        for s in reps
                    ]
                ),
                "block_checkpoints": [s["retrolog_normal"]["block_checkpoints"] for s in reps],
            }
        if all("retrolog_baseline" in s for s in reps):
            entry["baseline"] = {
                "src": str(args.baseline_src),
                "seconds": spread([s["retrolog_baseline"]["seconds"] for s in reps]),
                "overhead_pct": spread([s["baseline_overhead"] * 100 for s in reps]),
                "versus_baseline_pct": spread([s["versus_baseline"] * 100 for s in reps]),
                "block_checkpoints": [s["retrolog_baseline"]["block_checkpoints"] for s in reps],
                "chosen": [s["retrolog_baseline"]["chosen"] for s in reps],
            }
        if all("retrolog_minimal" in s for s in reps):
            entry["minimal"] = {
                "seconds": spread([s["retrolog_minimal"]["seconds"] for s in reps]),
                "overhead_pct": spread([s["minimal_overhead"] * 100 for s in reps]),
                "block_checkpoints": [s["retrolog_minimal"]["block_checkpoints"] for s in reps],
                # The default against minimal, per repetition: the adaptive rule's choices.
                "rule_overhead_pct": spread([s["rule_overhead"] * 100 for s in reps]),
            }
        if all("retrolog_logs" in s for s in reps):
            entry["logs_only"] = {
                "what": "recorded without a checkpointing block: loops, logs, start, commit()",
                "seconds": spread([s["retrolog_logs"]["seconds"] for s in reps]),
                "overhead_pct": spread([s["logs_overhead"] * 100 for s in reps]),
                "cpu_overhead_pct": spread([s["logs_cpu_overhead"] * 100 for s in reps]),
            }
        if name == "cnn" and flordb_samples:
            entry["flordb_seconds"] = spread([s["seconds"] for s in flordb_samples])
            entry["flordb_overhead_pct"] = spread([s["flordb_overhead"] * 100 for s in reps])
        result["workloads"][name] = entry
    result["flordb"] = {"available": flor_python is not None, "note": flordb_note}
    result["blocking"] = block
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print_report(result)
    print(f"\nwrote {args.output}", file=sys.stderr)
    return 0


def print_report(result: dict[str, Any]) -> None:
    def cell(s: dict[str, Any], fmt: str) -> str:
        return f"{s['median']:{fmt}} [{s['min']:{fmt}}..{s['max']:{fmt}}]"

    print(
        f"record overhead: Python {result['python']}, torch {result['torch_version']} "
        f"({result['torch_threads']} threads), {result['nproc']} cores, "
        f"{result['repetitions']} reps, load {result['load_average_before'][0]:.1f} -> "
        f"{result['load_average_after'][0]:.1f}; timed: {result.get('timed_run', 'first run')}"
    )
    print(
        f"{'workload':9s} {'plain s':>22s} {'retrolog s':>22s} {'overhead %':>24s} "
        f"{'target':>7s} checkpoints/blocks  capture ms"
    )
    for name, w in result["workloads"].items():
        print(
            f"{name:9s} {cell(w['plain_seconds'], '6.2f'):>22s} "
            f"{cell(w['retrolog_seconds'], '6.2f'):>22s} {cell(w['overhead_pct'], '+6.2f'):>24s} "
            f"{w['target_pct']:6.2f}% {w['block_checkpoints']}/{w['block_executions']}"
            f"  {w['capture_ms']['median']:.1f}  {'met' if w['target_met'] else 'NOT met'}"
        )
        print(f"{'':9s} CPU time overhead %: {cell(w['cpu_overhead_pct'], '+6.2f')}")
        if "chosen" in w:
            print(
                f"{'':9s} block checkpoints chosen {w['chosen']} = written, none abandoned;"
                f" urgent-lane writes {w['urgent_writes']}, at exit {w['finished_at_exit']}"
                f" ({cell(w['finish_seconds'], '.2f')} s), refused for a full writer"
                f" {w['refused_writer_full']}, taken after a wait for a slot"
                f" {w.get('room_waits')}"
            )
        if "baseline" in w:
            b = w["baseline"]
            print(
                f"{'':9s} baseline {b['src']}: overhead % {cell(b['overhead_pct'], '+6.2f')};"
                f" this version against it % {cell(b['versus_baseline_pct'], '+6.2f')};"
                f" block checkpoints kept {b['block_checkpoints']} of chosen {b['chosen']}"
            )
        if "minimal" in w:
            m = w["minimal"]
            print(
                f"{'':9s} only the two mandatory checkpoints: overhead % "
                f"{cell(m['overhead_pct'], '+6.2f')}; the default against it (the rule's"
                f" choices) % {cell(m['rule_overhead_pct'], '+6.2f')}"
            )
        if "normal_writer" in w:
            n = w["normal_writer"]
            print(
                f"{'':9s} writer at training's priority: overhead % "
                f"{cell(n['overhead_pct'], '+6.2f')}, CPU % {cell(n['cpu_overhead_pct'], '+6.2f')},"
                f" checkpoints {n['block_checkpoints']}"
            )
        print(
            f"{'':9s} plain run again vs plain run (A/A) %: {cell(w['plain_again_pct'], '+6.2f')}"
            f", median |difference| {w['plain_again_median_abs_pct']:.2f}%"
        )
        if "flordb_overhead_pct" in w:
            print(f"{'':9s} flordb 4.0.1 overhead %: {cell(w['flordb_overhead_pct'], '+6.2f')}")
    b = result["blocking"]
    if b is None:
        print("\nblocking per checkpoint: not measured (--no-blocking)")
        return
    print(
        f"\nblocking per checkpoint of {b['state_mb']:.0f} MB: retrolog "
        f"{cell(b['retrolog_ms'], '.1f')} ms, torch.save {cell(b['torch_save_ms'], '.1f')} ms "
        f"(ratio {b['ratio_vs_torch_save']:.2f}, target <= 0.3), plain copy "
        f"{cell(b['copy_ms'], '.1f')} ms (ratio {b['ratio_vs_copy']:.2f})"
    )


if __name__ == "__main__":
    sys.exit(main())
