"""Where a replay's time goes, against what the plan estimated: a per-segment breakdown.

Run from the repository root with the project's venv:

    python -m bench.replay_breakdown                  # about 6 minutes on a 2-core machine
    python -m bench.replay_breakdown --reps 1 --epochs 6
    python -m bench.replay_breakdown --torch-threads default --reps 1   # about 2 minutes

It records the bench_replay workload (3 runs, 2 code versions), re-records each
run once more into a scratch store (the run-to-run spread of the same run on this
machine: the floor under any estimate), then replays the outer-loop and the
inner-loop probe with 1 and 2 workers, and a suffix probe. Every worker runs with
bench/_breakdown_site on ``PYTHONPATH``, whose ``sitecustomize`` notes a
timeline (process start, first retrolog call, each loop and iteration, each
restore, the finish); the coordinator's own start and end of each worker are
taken around ``execute._start``. Per segment it reports, next to the plan's
figure for the same part:

- start-up: worker launch -> first top-level loop, split into exec (launch ->
  process start), interpreter (-> sitecustomize), script until its first
  retrolog call (imports), the replay runtime's set-up, script until its first
  loop (data, model); estimated as the record-time prefix;
- per outer iteration: block executed or restored (and the restore itself), and
  the non-block code, against X_i / S_i of the cost model;
- tail: last iteration's end -> the coordinator seeing the worker gone
  (the suffix, the output, the process's exit); a suffix probe (a statement
  after the loop) shows what a worker that runs the script to its end adds.

Last, the thread experiment behind the default number of workers: 50 training
steps of the workload's CNN in one process and in two at once, with torch's
default threads (one per core) and with the cores shared out
(``OMP_NUM_THREADS``). Replay keeps each run's recorded thread count, so two
workers at the default threads oversubscribe the cores: the default is as many
workers as the cores hold at that count.

With ``--torch-threads default`` every script trains at torch's own thread count,
as a script that never calls ``set_num_threads`` does, and each probe is replayed
once with the workers retrolog picks.

Results: bench/results/replay_breakdown.json (``--torch-threads default``:
replay_breakdown_default_threads.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import _replay_workload as workload
from bench.bench_replay import add_thread_options, base_env, new_project, run_ids, run_kwargs, timed
from bench.harness import BenchError, Measured

BENCH_DIR = Path(__file__).resolve().parent
SITE_DIR = BENCH_DIR / "_breakdown_site"
RESULTS = BENCH_DIR / "results" / "replay_breakdown.json"
RESULTS_DEFAULT_THREADS = BENCH_DIR / "results" / "replay_breakdown_default_threads.json"
# (probe, statement, worker counts)
PROBES = (
    ("outer", workload.OUTER_NAME, (1, 2)),
    ("inner", workload.INNER_NAME, (1, 2)),
    ("suffix", workload.SUFFIX_NAME, (1,)),
)


@contextmanager
def environment(values: dict[str, str], cwd: Path) -> Iterator[None]:
    """Run the in-process replay as the CLI would in ``cwd``, with ``values`` in the env."""
    saved_env, saved_cwd = dict(os.environ), Path.cwd()
    os.environ.clear()
    os.environ.update(values)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def replay_with_timeline(
    project: Path, env: dict[str, str], name: str, workers: int | None, timelines: Path
) -> dict[str, Any]:
    """Replay ``name`` in-process; return the plan, each job's span and its worker timeline."""
    from retrolog._replay import execute, replayer
    from retrolog._replay.request import ReplayRequest
    from retrolog.store.paths import locate
    from retrolog.store.sqlite_metadata import open_store

    spans: dict[str, dict[str, float]] = {}
    planned: dict[str, Any] = {}
    original_start, original_finish = execute._start, execute._finish
    original_plan = replayer.plan_replay

    def plan(*args: Any, **kwargs: Any) -> Any:
        # What the replayer costed the plan with: the measured restore throughput and its
        # WorkerCosts (exit, teardown, cores, the fork server's imports saved per run).
        planned.update(kwargs)
        return original_plan(*args, **kwargs)

    def start(job: Any, **kwargs: Any) -> None:
        before = time.time()
        original_start(job, **kwargs)
        spans[job.key] = {
            "checkout": time.time() - before,
            "launch": time.time() - (time.perf_counter() - job.started),
        }

    def finish(job: Any) -> None:
        original_finish(job)
        spans[job.key]["gone"] = spans[job.key]["launch"] + job.seconds
        spans[job.key]["spec"] = str(job.log_path.with_suffix(".spec.json"))

    shutil.rmtree(timelines, ignore_errors=True)
    timelines.mkdir(parents=True)
    worker_env = {
        **env,
        "PYTHONPATH": str(SITE_DIR),
        "REPLAY_BREAKDOWN_DIR": str(timelines),
    }
    execute._start, execute._finish = start, finish  # type: ignore[assignment]
    replayer.plan_replay = plan  # type: ignore[assignment]
    try:
        with environment(worker_env, project):
            paths = locate()
            conn = open_store(paths, create=False)
            try:
                request = ReplayRequest([name], workers=workers, progress=False)
                result = replayer.replay(conn, paths, request, echo=lambda _: None)
            finally:
                conn.close()
    finally:
        execute._start, execute._finish = original_start, original_finish
        replayer.plan_replay = original_plan  # type: ignore[assignment]
    by_spec = {}
    for path in timelines.glob("*.json"):
        timeline = json.loads(path.read_text())
        by_spec[timeline["spec"]] = timeline
    assert result.plan is not None
    return {
        "plan": result.plan,
        "outcomes": result.outcomes,
        "spans": spans,
        "by_spec": by_spec,
        "worker": planned.get("worker"),
        "per_byte": planned.get("restore_seconds_per_byte"),
    }


def breakdown(replay: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per segment: measured parts next to the cost model's, costed as the
    replayer costed them (its WorkerCosts and restore throughput)."""
    from retrolog._replay.plan import _costs, _pooled_imports

    workers = replay["plan"].workers
    worker, per_byte = replay["worker"], replay["per_byte"]
    pooled, _ = _pooled_imports([run.profile for run in replay["plan"].runs])
    rows = []
    for run_plan in replay["plan"].runs:
        profile = run_plan.profile
        costs = _costs(profile, per_byte, worker, workers, pooled.get(profile.filename))
        for index, segment in enumerate(run_plan.segments):
            key = f"{run_plan.run_id}#{index}"
            span = replay["spans"][key]
            timeline = replay["by_spec"].get(span["spec"])
            if timeline is None:
                raise BenchError(f"segment {key} left no timeline")
            row = segment_row(key, segment, profile, costs, span, timeline)
            # What the start-up model subtracted from the recorded prefix.
            row["model_startup_parts"] = {
                "record_prefix": profile.prefix_seconds,
                "record_imports": profile.imports_seconds,
                "record_setup": profile.setup_seconds,
                "preimported": worker.preimported.get(profile.run_id) if worker else None,
                "forked": timeline.get("forked"),
            }
            rows.append(row)
    return rows


def segment_row(
    key: str, segment: Any, profile: Any, costs: Any, span: dict[str, float], tl: dict[str, Any]
) -> dict[str, Any]:
    top = [loop for loop in tl["loops"] if loop["depth"] == 0]
    if not top:
        raise BenchError(f"segment {key}: the worker entered no loop")
    outer = top[0]
    first_loop = outer["next"][0][0]
    launch, gone = span["launch"], span["gone"]
    process_start = tl["process_start"] or launch
    startup = {
        "exec": process_start - launch,
        "interpreter": tl["site"] - process_start,
        "script_until_first_retrolog_call": tl["init_start"] - tl["site"],
        "replay_runtime_setup": tl["init_end"] - tl["init_start"],
        "script_until_first_loop": first_loop - tl["init_end"],
    }
    # Iteration i runs from the return of next() #i to the call of next() #i+1.
    calls = outer["next"]
    nested = [loop for loop in tl["loops"] if loop["depth"] == 1]
    restores = tl["restores"]
    iterations = []
    for i in range(len(calls) - 1):
        begin, end = calls[i][1], calls[i + 1][0]
        inside = [loop for loop in nested if begin <= loop["next"][0][0] <= end]
        block = sum(loop["end"] - loop["next"][0][0] for loop in inside[:1])
        restored = sum(b - a for a, b in restores if begin <= a <= end)
        # A whole-iteration block is restored inside next() itself, before the item comes.
        whole_restore = sum(b - a for a, b in restores if calls[i][0] <= a <= calls[i][1])
        executed = i in segment.execute
        iterations.append(
            {
                "i": i,
                "executed": executed,
                "seconds": end - begin + whole_restore,
                "block": block if executed else restored + whole_restore,
                "restore": restored + whole_restore,
                "non_block": end - begin - block,
                "model": costs.run[i] if executed else costs.skip[i],
                "model_block": profile.block_seconds[i],
                "model_non_block": costs.run[i] - profile.block_seconds[i],
            }
        )
    # The last call is the one that ended the loop (StopIteration, or the worker's exit).
    last_end = calls[-1][0]
    finished = tl.get("finish") or tl.get("commit") or last_end
    tail = {
        "after_loop_to_output": finished - last_end,
        "output_to_gone": gone - finished,
    }
    actual = gone - launch
    model_loop = sum(it["model"] for it in iterations)
    return {
        "segment": key,
        "range": [segment.start, segment.stop],
        "torch_threads": tl.get("torch_threads"),
        "checkout_seconds": span["checkout"],
        "actual": actual,
        "estimate": segment.estimate_seconds,
        "error_pct": (segment.estimate_seconds - actual) / actual * 100,
        "startup": startup,
        "startup_total": first_loop - launch,
        "model_startup": costs.startup,
        "record_prefix": profile.prefix_seconds,
        "loop_total": sum(it["seconds"] for it in iterations),
        "model_loop": model_loop,
        "tail": tail,
        "tail_total": gone - last_end,
        # The rest of the estimate: other loops, suffix, end restore, exit, teardown.
        "model_tail": segment.estimate_seconds - costs.startup - model_loop,
        "iterations": iterations,
    }


# 50 training steps of the workload's CNN, with torch's default threads (what a script
# that does not call set_num_threads gets): prints the seconds they took.
THREADS_SNIPPET = """
import time, torch
from torch import nn
torch.manual_seed(0)
x, y = torch.randn(3200, 1, 28, 28), torch.randint(0, 10, (3200,))
net = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
started = time.perf_counter()
for i in range(0, 3200, 64):
    opt.zero_grad()
    nn.functional.cross_entropy(net(x[i:i + 64]), y[i:i + 64]).backward()
    opt.step()
print(time.perf_counter() - started, torch.get_num_threads())
"""


def thread_experiment(python: Path, cores: int) -> dict[str, Any]:
    """Seconds of 50 steps per process: alone or W at once, with torch's threads or 1 each."""
    out: dict[str, Any] = {}
    for concurrent in (1, 2):
        for threads in (None, *sorted({1, max(1, cores // concurrent)})):
            env = base_env()
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            samples = []
            for _ in range(2):
                procs = [
                    subprocess.Popen(
                        [str(python), "-c", THREADS_SNIPPET], env=env, stdout=subprocess.PIPE
                    )
                    for _ in range(concurrent)
                ]
                for proc in procs:
                    seconds, used = proc.communicate()[0].split()
                    samples.append(float(seconds))
            label = f"{concurrent}_process_{'default' if threads is None else threads}_threads"
            out[label] = {"threads": int(used), "median": statistics.median(samples)}
    return out


def recorded_totals(db: Path) -> dict[str, dict[str, float]]:
    """Per run: prefix, the outer loop's iterations summed, and the suffix (record time)."""
    from bench.bench_replay import read_rows

    out: dict[str, dict[str, float]] = {}
    for run_id, phase, seconds in read_rows(db, "SELECT run_id, phase, seconds FROM profile"):
        entry = out.setdefault(run_id, {"prefix": 0.0, "loop": 0.0, "suffix": 0.0})
        key = "loop" if phase == "iteration" else phase
        if key in entry:
            entry[key] += seconds
    for run_id, started, ended in read_rows(db, "SELECT run_id, started_at, ended_at FROM runs"):
        out.setdefault(run_id, {})["wall"] = ended - started
    return out


def one_rep(
    python: Path, epochs: int, n_train: int, work: Path, threads: int | None
) -> dict[str, Any]:
    """One repetition; ``threads`` is torch's thread count in every script, None its own
    default (then each probe is replayed once, with the workers retrolog picks)."""
    env = base_env()

    def script(text: str) -> str:
        return workload.at_torch_threads(text, threads)

    project = work / "project"
    logs = work / "logs"
    logs.mkdir(parents=True)
    new_project(project, env, script(workload.V1))
    db = project / ".retrolog" / "retrolog.db"
    again = work / "again"
    record_timelines = work / "record-timelines"
    record_timelines.mkdir()
    probe_env = {
        **env,
        "PYTHONPATH": str(SITE_DIR),
        "REPLAY_BREAKDOWN_DIR": str(record_timelines),
    }
    for index, (version, kwargs) in enumerate(workload.RUNS):
        (project / "train.py").write_text(script(workload.VERSIONS[version]))
        cmd = [str(python), "train.py", *run_kwargs(kwargs, epochs, n_train)]
        timed(cmd, project, probe_env, logs / f"record-{index}.log")
        # The same code and arguments once more, into a scratch store: the noise floor.
        scratch_env = {**probe_env, "RETROLOG_STORE": str(again)}
        timed(cmd, project, scratch_env, logs / f"again-{index}.log")
    runs = run_ids(db)
    record_prefix = record_prefix_parts(db, record_timelines)
    first = recorded_totals(db)
    second = recorded_totals(again / "retrolog.db")
    floor = []
    for run_id, other in zip(runs, run_ids(again / "retrolog.db"), strict=True):
        a, b = first[run_id], second[other]
        floor.append(
            {
                part: (b[part] - a[part]) / a[part] * 100
                for part in ("prefix", "loop", "wall")
                if a.get(part)
            }
        )
    (project / "train.py").write_text(script(workload.NEWEST_WITH_SUFFIX))
    recorded = work / "recorded-store"
    shutil.copytree(project / ".retrolog", recorded)

    replays = {}
    for probe, name, counts in PROBES:
        for workers in counts if threads is not None else (None,):
            shutil.rmtree(project / ".retrolog")
            shutil.copytree(recorded, project / ".retrolog")
            result = replay_with_timeline(project, env, name, workers, work / "timelines")
            failed = [o for o in result["outcomes"].values() if o.status != "replayed"]
            if failed:
                raise BenchError(f"replay {probe} w={workers} failed: {failed[0].error}")
            rows = breakdown(result)
            replays[f"{probe}-{workers or 'auto'}"] = rows
            print(f"  {probe} w={workers}: " + summary_line(rows), file=sys.stderr)
    return {"noise_floor_pct": floor, "record_prefix": record_prefix, "replays": replays}


def record_prefix_parts(db: Path, timelines: Path) -> list[dict[str, Any]]:
    """Per recording: the profile's prefix, and the same interval measured in parts."""
    from bench.bench_replay import read_rows

    prefix = dict(read_rows(db, "SELECT run_id, seconds FROM profile WHERE phase = 'prefix'"))
    rows = []
    for path in sorted(timelines.glob("record-*.json")):
        tl = json.loads(path.read_text())
        start = tl["process_start"]
        rows.append(
            {
                "run_id": tl["run_id"],
                "profile_prefix": prefix.get(tl["run_id"]),
                "measured_prefix": tl["first_loop"] - start,
                "interpreter": tl["site"] - start,
                "script_until_first_retrolog_call": tl["init_start"] - tl["site"],
                "record_runtime_setup": tl["init_end"] - tl["init_start"],
                "script_until_first_loop": tl["first_loop"] - tl["init_end"],
            }
        )
    return rows


def summary_line(rows: list[dict[str, Any]]) -> str:
    parts = []
    for row in rows:
        parts.append(
            f"{row['segment'][-8:]} err {row['error_pct']:+.1f}% (startup "
            f"{row['startup_total']:.2f} vs {row['model_startup']:.2f}, loop "
            f"{row['loop_total']:.2f} vs {row['model_loop']:.2f}, tail "
            f"{row['tail_total']:.2f} vs {row['model_tail']:.2f}); start-up model "
            + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row["model_startup_parts"].items()
            )
        )
    return "\n    ".join(["", *parts])


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per replay kind of each part's measured minus estimated seconds."""
    out: dict[str, Any] = {}
    floor = [f for rep in reps for f in rep["noise_floor_pct"]]
    out["noise_floor_pct"] = {
        part: {
            "median_abs": statistics.median(abs(f[part]) for f in floor),
            "worst": max((f[part] for f in floor), key=abs),
        }
        for part in ("prefix", "loop", "wall")
    }
    prefixes = [r for rep in reps for r in rep["record_prefix"] if r["profile_prefix"]]
    out["record_prefix"] = {
        part: statistics.median(r[part] for r in prefixes)
        for part in prefixes[0]
        if part != "run_id"
    }
    out["record_prefix"]["profile_minus_measured"] = statistics.median(
        r["profile_prefix"] - r["measured_prefix"] for r in prefixes
    )
    for kind in reps[0]["replays"]:
        rows = [row for rep in reps for row in rep["replays"][kind]]
        iters = [it for row in rows for it in row["iterations"]]
        executed = [it for it in iters if it["executed"]]
        restored = [it for it in iters if not it["executed"]]

        def med(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        out[kind] = {
            "segments": len(rows),
            "error_pct": {
                "median_abs": med([abs(r["error_pct"]) for r in rows]),
                "worst": max((r["error_pct"] for r in rows), key=abs),
            },
            "startup_measured_minus_model": med(
                [r["startup_total"] - r["model_startup"] for r in rows]
            ),
            "startup_parts": {
                part: med([r["startup"][part] for r in rows]) for part in rows[0]["startup"]
            },
            "checkout_seconds": med([r["checkout_seconds"] for r in rows]),
            "executed_iteration_measured_minus_model": med(
                [it["seconds"] - it["model"] for it in executed]
            ),
            "executed_block_measured_over_model": med(
                [it["block"] / it["model_block"] for it in executed if it["model_block"]]
            ),
            "restored_iteration_measured_minus_model": med(
                [it["seconds"] - it["model"] for it in restored]
            ),
            "restore_seconds": med([it["restore"] for it in restored]),
            "non_block_measured_minus_model": med(
                [it["non_block"] - it["model_non_block"] for it in iters]
            ),
            "tail_measured_minus_model": med([r["tail_total"] - r["model_tail"] for r in rows]),
            "tail_parts": {part: med([r["tail"][part] for r in rows]) for part in rows[0]["tail"]},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--n-train", type=int, default=6000)
    add_thread_options(
        parser,
        RESULTS,
        RESULTS_DEFAULT_THREADS,
        "1 (the default): every script trains on one thread, replayed with 1 and 2 "
        "workers; default: torch's own thread count, replayed with the workers retrolog picks",
    )
    args = parser.parse_args(argv)
    threads = 1 if args.torch_threads == "1" else None
    output = args.output or (RESULTS if threads == 1 else RESULTS_DEFAULT_THREADS)
    workload.check_sources()
    python = Path(sys.executable)
    measured = Measured("replay_breakdown", args.reps).start()
    reps = []
    try:
        for rep in range(args.reps):
            print(f"rep {rep + 1}/{args.reps}", file=sys.stderr)
            work = Path(tempfile.mkdtemp(prefix="retrolog-breakdown-"))
            try:
                reps.append(one_rep(python, args.epochs, args.n_train, work, threads))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    except BenchError as exc:
        print(f"breakdown failed: {exc}", file=sys.stderr)
        return 1
    print(
        "threads: 50 steps alone and 2 at once, torch's threads or the cores shared out",
        file=sys.stderr,
    )
    threads = thread_experiment(python, os.cpu_count() or 1)
    result = {
        **measured.head(),
        "workload": {
            "epochs": args.epochs,
            "n_train": args.n_train,
            "torch_threads": args.torch_threads,
        },
        "aggregate": aggregate(reps),
        "threads": threads,
        "reps": reps,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"aggregate": result["aggregate"], "threads": threads}, indent=2))
    print(f"results: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
