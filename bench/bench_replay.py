"""Benchmark: hindsight replay against retraining, parallel replay, cost estimates, FlorDB.

Run from the repository root with the project's venv (retrolog and torch installed):

    python -m bench.bench_replay               # about 25 minutes on a 2-core machine
    python -m bench.bench_replay --reps 5 --epochs 8 --no-flordb
    python -m bench.bench_replay --torch-threads default   # as a script that never sets them

The workload (bench/_replay_workload.py) is a real PyTorch CPU training script
(a small CNN on synthetic images; dropout, a shuffled DataLoader, an LR
scheduler; one thread) with ``rl.checkpointing(model=..., optimizer=...)``,
``rl.loop("epoch")`` around a nested ``rl.loop("step")``, ``loss`` logged per
step and ``acc`` per epoch. Each repetition, in a fresh temporary git project:

1. record 3 runs of 2 code versions (v1 lr=0.05, v1 lr=0.1, v2 lr=0.1), each
   ``python train.py --kwargs ...`` as a user would; then write today's code
   (v2 plus an outer-loop statement ``w_norm`` and an inner-loop statement
   ``grad_norm``) and keep a copy of the recorded store;
2. retrain: run today's script fresh for each run's ``--kwargs``, one after the
   other, each into a scratch store (``RETROLOG_STORE``). Its wall time is the
   baseline, its values the reference. Each run is retrained a second time, and
   the two executions' wall time, prefix and outer loop are compared: the noise
   floor of this machine, which no estimate made from one execution can beat;
3. replay, each time from a fresh copy of the recorded store: (a) ``retrolog
   replay w_norm --yes`` with 1 and with 2 workers; (b) ``retrolog replay
   grad_norm --yes`` with 1 and with 2 workers. Wall time of the command, as the
   user waits for it. The order of the 1- and 2-worker replays alternates
   between repetitions.

Checks (any failure stops the benchmark, so no figure can come from a wrong
replay): the recorded runs' loss and acc equal the fresh runs' (the workload is
deterministic); every backfilled value equals the fresh run's value bit for
bit, one per epoch (w_norm) or per step (grad_norm) of every run; every run is
replayed and replay's own deferred check found no difference; the project's
HEAD and working tree are unchanged by replay.

(c) Estimates: ``replay_runs.estimate_seconds`` against ``actual_seconds`` per
run and replay (error = (estimate - actual) / actual), and the plan's wall-time
estimate against the replay's measured execution time. Beside each run's error,
the error of its estimate from its own recording alone, and with only its iteration
times pooled (``add_unpooled``: the planner pools iteration times and the script's own
start-up work over a script's runs that agree), against the same replay. Each
target (median |error| over both replays within floor + 3) is held to the same replay
run twice, and also to that floor and the record-side one (the same estimate planned
from a second fresh execution's profile) in quadrature.

(d) FlorDB 4.0.1 (``--flordb-reps`` times, default once): the same script
written against its API, recorded the same way in a fresh git project, then
``python -m flordb replay w_norm`` answered "y". FlorDB runs in its own venv
(bench/.venv-flordb, created as bench_log.py does), which has no torch: the
benchmark links this interpreter's torch and its dependencies that the venv
lacks into a directory on FlorDB's ``PYTHONPATH``, so both train with the same
torch build. Its wall time, exit status and error are recorded as they come,
and its backfilled values are compared with the same references (valid because
its recorded loss and acc equal retrolog's fresh runs', which is checked).

Results: bench/results/replay.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import _replay_workload as workload
from bench.harness import (
    FLORDB_VERSION,
    GIT_ENV,
    BenchError,
    Measured,
    flordb_python,
    tail,
)
from bench.harness import spread as summary  # this file's own spread() compares two runs

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "replay.json"
RESULTS_DEFAULT_THREADS = BENCH_DIR / "results" / "replay_default_threads.json"
CHILD_TIMEOUT = 1800  # seconds; a run that never ends is a failure, not a figure
WORKER_COUNTS = (1, 2)
IDEAL_PARALLEL_SPEEDUP = 2.0
# Torch and what importing it needs, for FlorDB's venv (which has none of them).
TORCH_MODULES = (
    "torch",
    "torchgen",
    "functorch",
    "filelock",
    "fsspec",
    "jinja2",
    "markupsafe",
    "networkx",
    "sympy",
    "mpmath",
    "typing_extensions",
)


def startup_snippet(threads: int | None) -> str:
    """What every process pays: start, ``import torch`` (at ``threads``), a first optimizer."""
    pin = "" if threads is None else f"torch.set_num_threads({threads}); "
    return f"import torch; {pin}torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)"


VALUES_SQL = """
SELECT l.run_id, l.name, e.iteration, s.iteration, l.value FROM logs l
LEFT JOIN loops s ON s.run_id = l.run_id AND s.ctx_id = l.ctx_id AND s.depth = 1
LEFT JOIN loops e ON e.run_id = l.run_id AND e.depth = 0
    AND e.ctx_id = COALESCE(s.parent_ctx, l.ctx_id)
WHERE l.name = ? AND l.origin = ?
"""

Key = tuple[int | None, int | None]  # (epoch, step) of a logged value
Values = dict[Key, Any]


# -- processes and projects ----------------------------------------------------------------


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RETROLOG_", "FLOR"))}
    env.pop("PYTHONPATH", None)
    env.update(GIT_ENV, RETROLOG_PROGRESS="0", PYTHONDONTWRITEBYTECODE="1")
    return env


@dataclass
class Timing:
    """What one command cost."""

    seconds: float  # wall clock, as the user waits
    cpu_seconds: float  # user + system CPU of the command and every process it waited for
    returncode: int


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(
    cmd: list[str],
    cwd: Path,
    env: dict[str, str],
    log: Path,
    *,
    stdin_text: str | None = None,
    check: bool = True,
) -> Timing:
    """Run ``cmd``, stdout and stderr to ``log``, and time it."""
    with log.open("w") as out:
        cpu0 = children_cpu()
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            input=stdin_text,
            stdin=None if stdin_text is not None else subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=CHILD_TIMEOUT,
            check=False,
        )
        seconds = time.perf_counter() - t0
        cpu = children_cpu() - cpu0
    if check and proc.returncode != 0:
        raise BenchError(
            f"{' '.join(cmd)} (in {cwd}) exited with {proc.returncode}:\n"
            f"{tail(clean_output(log.read_text(errors='replace')))}"
        )
    return Timing(seconds, cpu, proc.returncode)


def git(cwd: Path, env: dict[str, str], *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)
    return out.stdout.decode()


def new_project(path: Path, env: dict[str, str], first_version: str) -> None:
    """A git repository whose one commit holds the first version of train.py."""
    path.mkdir(parents=True)
    git(path, env, "-c", "init.defaultBranch=main", "init", "-q")
    (path / "train.py").write_text(first_version)
    git(path, env, "add", "train.py")
    git(path, env, "commit", "-q", "-m", "training script")


def run_kwargs(kwargs: dict[str, str], epochs: int, n_train: int) -> list[str]:
    merged = {**kwargs, "epochs": str(epochs), "n_train": str(n_train)}
    return ["--kwargs", *(f"{k}={v}" for k, v in merged.items())]


def clean_output(text: str) -> str:
    """Drop progress-bar redraws (tqdm lines) from a captured log."""
    kept = []
    for line in text.replace("\r", "\n").splitlines():
        if "it/s]" in line or "s/it]" in line or "%|" in line or "\x1b[A" in line:
            continue
        if line.strip():
            kept.append(line)
    return "\n".join(kept)


# -- reading stores ------------------------------------------------------------------------


def read_rows(db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def run_ids(db: Path) -> list[str]:
    return [r for (r,) in read_rows(db, "SELECT run_id FROM runs ORDER BY started_at")]


def values(db: Path, name: str, origin: str) -> dict[str, Values]:
    """Per run id, the values of ``name`` keyed by (epoch, step)."""
    found: dict[str, Values] = {}
    for run_id, _, epoch, step, value in read_rows(db, VALUES_SQL, (name, origin)):
        found.setdefault(run_id, {})[epoch, step] = value
    return found


def compare(got: Values, expected: Values) -> dict[str, Any]:
    """How many expected values ``got`` holds exactly, and the largest difference."""
    exact = sum(1 for k, v in expected.items() if k in got and got[k] == v)
    diffs = [
        abs(float(got[k]) - float(v))
        for k, v in expected.items()
        if k in got and got[k] != v and isinstance(v, (int, float))
    ]
    return {
        "expected": len(expected),
        "present": sum(1 for k in expected if k in got),
        "exact": exact,
        "extra": len(set(got) - set(expected)),
        "max_abs_diff": max(diffs, default=0.0),
    }


def merge_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "expected": sum(p["expected"] for p in parts),
        "present": sum(p["present"] for p in parts),
        "exact": sum(p["exact"] for p in parts),
        "extra": sum(p["extra"] for p in parts),
        "max_abs_diff": max((p["max_abs_diff"] for p in parts), default=0.0),
    }


def all_exact(counts: dict[str, Any]) -> bool:
    return counts["expected"] > 0 and counts["exact"] == counts["expected"] and counts["extra"] == 0


# -- one repetition ------------------------------------------------------------------------


def startup_floor(
    python: Path, env: dict[str, str], log: Path, cwd: Path, threads: int | None
) -> float:
    """Interpreter start, ``import torch`` and a first optimizer: what every process pays."""
    return timed([str(python), "-c", startup_snippet(threads)], cwd, env, log).seconds


@dataclass(frozen=True)
class Mode:
    """The thread count the workload trains with, and the replays' worker counts.

    threads: torch threads per process; None leaves torch's own default.
    counts: the worker counts replayed; with ``explicit`` False there is one, the count
        ``retrolog replay`` picks by itself (no ``--workers``), checked against the plan.
    """

    threads: int | None
    counts: tuple[int, ...]
    explicit: bool


def retrolog_rep(
    rep: int, python: Path, epochs: int, n_train: int, keep: Path | None, mode: Mode
) -> dict[str, Any]:
    """Record, retrain, replay; return timings, estimates and checks of one repetition."""
    work = Path(tempfile.mkdtemp(prefix="retrolog-bench-replay-"))
    try:
        env = base_env()
        project = work / "bench-replay"
        logs = work / "logs"
        logs.mkdir()
        new_project(project, env, workload.at_torch_threads(workload.V1, mode.threads))
        db = project / ".retrolog" / "retrolog.db"

        record_seconds = []
        for index, (version, kwargs) in enumerate(workload.RUNS):
            text = workload.at_torch_threads(workload.VERSIONS[version], mode.threads)
            (project / "train.py").write_text(text)
            cmd = [str(python), "train.py", *run_kwargs(kwargs, epochs, n_train)]
            record_seconds.append(timed(cmd, project, env, logs / f"record-{index}.log").seconds)
        runs = run_ids(db)
        if len(runs) != len(workload.RUNS):
            raise BenchError(f"expected {len(workload.RUNS)} recorded runs, found {runs}")
        statuses = read_rows(db, "SELECT status FROM runs")
        if {s for (s,) in statuses} != {"finished"}:
            raise BenchError(f"recorded runs did not all finish: {statuses}")
        workload_facts = describe_recording(db, runs)
        (project / "train.py").write_text(workload.at_torch_threads(workload.NEWEST, mode.threads))
        recorded_store = work / "recorded-store"
        shutil.copytree(project / ".retrolog", recorded_store)

        # Retraining from scratch: today's script, fresh, each run's arguments; twice, for
        # the run-to-run spread of the same execution on this machine (the noise floor).
        retrain: list[Timing] = []
        noise: list[dict[str, float]] = []
        reference: dict[str, list[Values]] = {}
        names = ("loss", "acc", workload.OUTER_NAME, workload.INNER_NAME)
        for index, (_, kwargs) in enumerate(workload.RUNS):
            store = work / f"fresh-{index}"
            cmd = [str(python), "train.py", *run_kwargs(kwargs, epochs, n_train)]
            fresh_env = {**env, "RETROLOG_STORE": str(store)}
            retrain.append(timed(cmd, project, fresh_env, logs / f"fresh-{index}.log"))
            again = work / f"fresh-{index}-again"
            again_env = {**env, "RETROLOG_STORE": str(again)}
            repeat = timed(cmd, project, again_env, logs / f"fresh-{index}-again.log")
            noise.append(
                spread(
                    (retrain[-1].seconds, phase_totals(store / "retrolog.db")),
                    (repeat.seconds, phase_totals(again / "retrolog.db")),
                )
            )
            for name in names:
                got = values(store / "retrolog.db", name, "recorded")
                if len(got) != 1:
                    raise BenchError(f"fresh run {index}: {name} from {len(got)} runs")
                reference.setdefault(name, []).append(next(iter(got.values())))

        # The workload is deterministic: the recording saw what a fresh run sees.
        determinism = []
        for name in ("loss", "acc"):
            recorded = values(db, name, "recorded")
            for index, run_id in enumerate(runs):
                determinism.append(compare(recorded.get(run_id, {}), reference[name][index]))
        determinism_counts = merge_counts(determinism)
        if not all_exact(determinism_counts):
            raise BenchError(
                "the workload is not deterministic: recorded loss/acc differ from a fresh run's "
                f"({determinism_counts}); replay exactness cannot be checked"
            )

        git_before = git_state(project, env)
        replays: dict[str, dict[str, Any]] = {}
        order = mode.counts if rep % 2 == 0 else tuple(reversed(mode.counts))
        for probe, name in (("outer", workload.OUTER_NAME), ("inner", workload.INNER_NAME)):
            for workers in order:
                shutil.rmtree(project / ".retrolog")
                shutil.copytree(recorded_store, project / ".retrolog")
                replays[f"{probe}-{workers}"] = replay_once(
                    python, project, env, logs, name, workers, runs, reference[name],
                    explicit=mode.explicit,
                )  # fmt: skip
        first = mode.counts[0]
        # The same replays again, on the same recording, plan and machine: how far one
        # run's replay time moves between two identical replays. No estimate made before
        # a replay can be closer than that, so it is the floor the estimate is held to.
        for probe, name in (("outer", workload.OUTER_NAME), ("inner", workload.INNER_NAME)):
            shutil.rmtree(project / ".retrolog")
            shutil.copytree(recorded_store, project / ".retrolog")
            replays[f"{probe}-{first}-again"] = replay_once(
                python, project, env, logs, name, first, runs, reference[name],
                label="-again", explicit=mode.explicit,
            )  # fmt: skip
        # The same outer-loop replay with every worker a new interpreter: the fork
        # server's share, side by side (docs/replay.md, "How workers start").
        shutil.rmtree(project / ".retrolog")
        shutil.copytree(recorded_store, project / ".retrolog")
        replays[f"outer-{first}-fresh"] = replay_once(
            python, project, {**env, "RETROLOG_FORKSERVER": "0"}, logs, workload.OUTER_NAME,
            first, runs, reference[workload.OUTER_NAME], label="-fresh", explicit=mode.explicit,
        )  # fmt: skip
        if not replays[f"outer-{first}"]["forked"] or replays[f"outer-{first}-fresh"]["forked"]:
            raise BenchError("the fork server was not used as configured (see the replay logs)")
        # A replay that runs every script to its end: --verify recomputes the recorded
        # statements (workers finish the script, where the probes above stop at the loop).
        shutil.rmtree(project / ".retrolog")
        shutil.copytree(recorded_store, project / ".retrolog")
        verify = verify_once(python, project, env, logs, first, runs, explicit=mode.explicit)
        shutil.rmtree(project / ".retrolog")
        shutil.copytree(recorded_store, project / ".retrolog")
        verify_again = verify_once(
            python, project, env, logs, first, runs, explicit=mode.explicit, label="-again"
        )
        if git_state(project, env) != git_before:
            raise BenchError("replay changed the project's HEAD or working tree")
        firsts = [work / f"fresh-{i}" for i in range(len(runs))]
        agains = [work / f"fresh-{i}-again" for i in range(len(runs))]
        estimate_floor = {
            key: estimate_spread(
                firsts,
                agains,
                probe=key.split("-")[0],
                workers=int(key.split("-")[1]),
                actual=[r["actual_seconds"] for r in replays[key]["runs"]],
            )
            for key in (f"{p}-{w}" for p in ("outer", "inner") for w in mode.counts)
        }
        estimate_floor[f"verify-{first}"] = estimate_spread(
            firsts, agains, probe="verify", workers=first,
            actual=[r["actual_seconds"] for r in verify["runs"]],
        )  # fmt: skip
        reference_digest = {
            name: [sorted(v.items(), key=str) for v in per_run]
            for name, per_run in reference.items()
        }
        return {
            "record_seconds": record_seconds,
            "retrain_seconds": [t.seconds for t in retrain],
            "noise": noise,
            "retrain_cpu_seconds": [t.cpu_seconds for t in retrain],
            "replays": replays,
            "verify": verify,
            "verify_again": verify_again,
            "estimate_floor": estimate_floor,
            "workload": workload_facts,
            "determinism": determinism_counts,
            "reference": reference,
            "reference_digest": json.dumps(reference_digest, sort_keys=True),
        }
    except BenchError:
        if keep is not None:
            shutil.copytree(work, keep / f"rep-{rep}", dirs_exist_ok=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def estimate_spread(
    first: list[Path], second: list[Path], *, probe: str, workers: int, actual: list[float]
) -> list[float]:
    """The A/A floor of the per-run estimate, in percent of each run's replay time.

    The cost model planned twice for the same probe, once from the profiles of the
    first fresh executions (``first``, one store per run) and once from those of the
    second (``second``): the same code, arguments and machine, so the difference is
    what the record-time timings alone move an estimate by. Both plans use the same
    worker costs (a new interpreter's, nothing pre-imported, one restore throughput),
    which cancel out; ``actual`` is each run's measured replay time. ``probe`` is
    "outer", "inner" or "verify" (the outer loop, then the script to its end, as
    ``--verify`` plans it).
    """
    from retrolog._replay.plan import ScanLevel, WorkerCosts, plan_replay
    from retrolog._replay.profile import load_profiles

    level = ScanLevel.INNER_LOOP if probe == "inner" else ScanLevel.OUTER_LOOP

    def estimates(stores: list[Path]) -> list[float]:
        profiles = []
        for store in stores:
            conn = sqlite3.connect(store / "retrolog.db")
            try:
                ((run_id,),) = conn.execute("SELECT run_id FROM runs").fetchall()
                profiles.extend(load_profiles(conn, [run_id]))
            finally:
                conn.close()
        plan = plan_replay(
            level, profiles, workers, restore_seconds_per_byte=1e-9, run_suffix=probe == "verify",
            worker=WorkerCosts(cores=os.cpu_count()),
        )  # fmt: skip
        return [run.estimate_seconds for run in plan.runs]

    a, b = estimates(first), estimates(second)
    return [(y - x) / t * 100 for x, y, t in zip(a, b, actual, strict=True)]


def phase_totals(db: Path) -> dict[str, float]:
    """A one-run store's profile: prefix, the top-level iterations summed, suffix."""
    totals = {"prefix": 0.0, "loop": 0.0, "suffix": 0.0}
    for phase, seconds in read_rows(db, "SELECT phase, seconds FROM profile"):
        key = "loop" if phase == "iteration" else phase
        if key in totals:
            totals[key] += seconds
    return totals


def spread(
    first: tuple[float, dict[str, float]], second: tuple[float, dict[str, float]]
) -> dict[str, float]:
    """How far a second execution of the same run landed from the first, in percent."""
    (wall_a, a), (wall_b, b) = first, second
    return {
        "wall_pct": (wall_b - wall_a) / wall_a * 100,
        "prefix_pct": (b["prefix"] - a["prefix"]) / a["prefix"] * 100,
        "prefix_seconds": b["prefix"] - a["prefix"],
        "loop_pct": (b["loop"] - a["loop"]) / a["loop"] * 100,
    }


def describe_recording(db: Path, runs: list[str]) -> dict[str, Any]:
    """Per run: epochs, steps, checkpoints, prefix and mean epoch time from the profile."""
    facts = []
    for run_id in runs:
        (epochs,) = read_rows(
            db, "SELECT COUNT(*) FROM loops WHERE run_id = ? AND depth = 0", (run_id,)
        )[0]
        (steps,) = read_rows(
            db, "SELECT COUNT(*) FROM loops WHERE run_id = ? AND depth = 1", (run_id,)
        )[0]
        ckpts, nbytes = read_rows(
            db, "SELECT COUNT(*), SUM(nbytes) FROM checkpoints WHERE run_id = ?", (run_id,)
        )[0]
        (checked,) = read_rows(
            db,
            "SELECT COUNT(DISTINCT c.ctx_id) FROM checkpoints c JOIN loops l"
            " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id"
            " WHERE c.run_id = ? AND c.kind = 'block' AND l.depth = 0",
            (run_id,),
        )[0]
        ((summary,),) = read_rows(db, "SELECT checkpointing FROM runs WHERE run_id = ?", (run_id,))
        block = json.loads(summary or "{}").get("blocks", {}).get("epoch", {})
        phases: dict[str, list[float]] = {}
        for phase, seconds in read_rows(
            db, "SELECT phase, seconds FROM profile WHERE run_id = ?", (run_id,)
        ):
            phases.setdefault(phase, []).append(seconds)
        facts.append(
            {
                "run_id": run_id,
                "epochs": epochs,
                "steps": steps,
                "checkpoints": ckpts,
                # Epochs an outer-loop replay executes rather than restores: what the
                # adaptive rule chose not to checkpoint while recording.
                "epochs_without_checkpoint": epochs - checked,
                # Why the rule refused those epochs (runs.checkpointing): the invariant
                # (of which before the first write finished), or the writer being full.
                "refused": {
                    key: block.get(key)
                    for key in ("refused_cost", "refused_unpriced", "refused_writer_full")
                },
                "mean_checkpoint_cost_seconds": (
                    block.get("mean_capture_seconds", 0.0)
                    + block.get("mean_urgent_write_seconds", 0.0)
                ),
                "checkpoint_bytes": nbytes,
                "prefix_seconds": sum(phases.get("prefix", [0.0])),
                "epoch_seconds": statistics.fmean(phases.get("iteration", [0.0])),
            }
        )
    return {"runs": facts}


def git_state(project: Path, env: dict[str, str]) -> tuple[str, str, str]:
    return (
        git(project, env, "rev-parse", "HEAD"),
        git(project, env, "status", "--porcelain"),
        git(project, env, "branch", "--show-current"),
    )


def replay_once(
    python: Path,
    project: Path,
    env: dict[str, str],
    logs: Path,
    name: str,
    workers: int,
    runs: list[str],
    reference: list[Values],
    label: str = "",
    explicit: bool = True,
) -> dict[str, Any]:
    """One ``retrolog replay NAME --yes --workers N`` on a fresh copy of the recorded store.

    With ``explicit`` False, no ``--workers``: replay picks its own count, which must be
    ``workers``.
    """
    log = logs / f"replay-{name}-{workers}{label}.log"
    cmd = [str(python), "-m", "retrolog", "replay", name, "--yes"]
    if explicit:
        cmd += ["--workers", str(workers)]
    timing = timed(cmd, project, env, log)
    seconds = timing.seconds
    db = project / ".retrolog" / "retrolog.db"
    output = log.read_text(errors="replace")
    ((replay_id, started, ended, plan_estimate, plan_workers),) = read_rows(
        db, "SELECT replay_id, started_at, ended_at, estimate_seconds, workers FROM replays"
    )
    per_run = {
        row[0]: row[1:]
        for row in read_rows(
            db,
            "SELECT run_id, scan, status, estimate_seconds, actual_seconds, backfilled,"
            " mismatches, error FROM replay_runs WHERE replay_id = ?",
            (replay_id,),
        )
    }
    got = values(db, name, "backfilled")
    problems = []
    if plan_workers != workers:
        problems.append(f"the replay ran {plan_workers} workers, not {workers}")
    counts = []
    run_figures = []
    segments_dir = project / ".retrolog" / "replays" / replay_id
    for index, run_id in enumerate(runs):
        row = per_run.get(run_id)
        if row is None:
            problems.append(f"run {run_id} is not in replay_runs")
            continue
        scan, status, estimate, actual, backfilled, mismatches, error = row
        if status != "replayed":
            problems.append(f"run {run_id}: {status} ({error})")
        if mismatches not in (None, "", "[]"):
            problems.append(f"run {run_id}: deferred check found differences {mismatches}")
        count = compare(got.get(run_id, {}), reference[index])
        counts.append(count)
        if not all_exact(count):
            problems.append(f"run {run_id}: {count}")
        run_figures.append(
            {
                "run_id": run_id,
                "scan": scan,
                "estimate_seconds": estimate,
                "actual_seconds": actual,
                "error_pct": (estimate - actual) / actual * 100 if actual else None,
                "segments": len(list(segments_dir.glob(f"{run_id}-*.spec.json"))),
                "backfilled": backfilled,
            }
        )
    add_unpooled(db, run_figures, workers)
    if "differs" in output:
        problems.append("replay reported a difference from the recorded values")
    if problems:
        raise BenchError(
            f"retrolog replay {name} --workers {workers} is not exact:\n  "
            + "\n  ".join(problems)
            + f"\n{tail(clean_output(output))}"
        )
    execution = ended - started
    return {
        "forked": "forked from" in output,
        "restores": restore_figures(segments_dir),
        "seconds": seconds,
        "cpu_seconds": timing.cpu_seconds,
        "load_average_after": os.getloadavg()[0],
        "execution_seconds": execution,
        "before_workers_seconds": seconds - execution,
        "plan_estimate_seconds": plan_estimate,
        # The plan's wall-time estimate counts the fork server's imports, which start
        # before the replay's row does: it is compared with the whole command.
        "plan_error_pct": (plan_estimate - seconds) / seconds * 100,
        "workers": plan_workers,
        "worker_seconds": sum(r["actual_seconds"] for r in run_figures),
        "segments": sum(r["segments"] for r in run_figures),
        "runs": run_figures,
        "values": merge_counts(counts),
    }


def verify_once(
    python: Path,
    project: Path,
    env: dict[str, str],
    logs: Path,
    workers: int,
    runs: list[str],
    *,
    explicit: bool,
    label: str = "",
) -> dict[str, Any]:
    """``retrolog replay --verify --yes``: every run replayed to its script's end, its
    recorded values recomputed; the wall time and the per-run estimate errors."""
    log = logs / f"verify-{workers}{label}.log"
    cmd = [str(python), "-m", "retrolog", "replay", "--verify", "--yes"]
    if explicit:
        cmd += ["--workers", str(workers)]
    timing = timed(cmd, project, env, log)
    output = log.read_text(errors="replace")
    verified = f"Verified {len(runs)} run(s): {len(runs)} replay exactly"
    if timing.returncode != 0 or verified not in output:
        raise BenchError(
            f"retrolog replay --verify did not verify every run:\n{tail(clean_output(output))}"
        )
    db = project / ".retrolog" / "retrolog.db"
    ((replay_id,),) = read_rows(db, "SELECT replay_id FROM replays")
    rows = read_rows(
        db,
        "SELECT run_id, scan, estimate_seconds, actual_seconds FROM replay_runs"
        " WHERE replay_id = ?",
        (replay_id,),
    )
    by_run = {run_id: (scan, e, a) for run_id, scan, e, a in rows}
    figures = [
        {
            "run_id": run_id,
            "scan": scan,
            "estimate_seconds": e,
            "actual_seconds": a,
            "error_pct": (e - a) / a * 100,
        }
        for run_id in runs
        for scan, e, a in [by_run[run_id]]
    ]
    add_unpooled(db, figures, workers)
    return {"seconds": timing.seconds, "runs": figures}


# The planner's pooling over a script's runs (plan.py), each turned off for the side by side:
# "without_pooling" is each run's own recording alone (the imports' median kept, as before
# any of it); "without_startup_pooling" pools the iteration times only.
POOLING_VARIANTS = {
    "without_pooling": ("_pooled_iterations", "_pooled_startups"),
    "without_startup_pooling": ("_pooled_startups",),
}


def add_unpooled(db: Path, figures: list[dict[str, Any]], workers: int) -> None:
    """Each run's estimate as it would be without the planner's pooling, side by side.

    The planner pools a script's iteration times and its own start-up work over its
    runs that agree (plan.py, ``_pooled_iterations`` and ``_pooled_startups``).
    Planning the same runs at the same levels again with pooling off
    (:data:`POOLING_VARIANTS`) and with it on gives, per run, what pooling moved the
    estimate by; the replay's own estimate minus that is the estimate the planner
    would have made without it, against the same measured replay. Only for runs
    planned as one segment that restores the same checkpoints every way (a split, or
    executing a cheap block instead of restoring it, can differ between the plans);
    others get None.
    """
    from retrolog._replay import plan as planning
    from retrolog._replay.profile import load_profiles

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        profiles = load_profiles(conn, [f["run_id"] for f in figures])
    finally:
        conn.close()
    levels = {f["run_id"]: planning.ScanLevel[f["scan"]] for f in figures}
    worker = planning.WorkerCosts(cores=os.cpu_count())
    pooled = planning.plan_replay(levels, profiles, workers, worker=worker)
    for variant, turned_off in POOLING_VARIANTS.items():
        saved = {name: getattr(planning, name) for name in turned_off}
        for name in turned_off:
            setattr(planning, name, lambda _profiles: ({}, []))
        try:
            other = planning.plan_replay(levels, profiles, workers, worker=worker)
        finally:
            for name, function in saved.items():
                setattr(planning, name, function)
        for figure, a, b in zip(figures, pooled.runs, other.runs, strict=True):
            single = (
                len(a.segments) == 1
                and len(b.segments) == 1
                and (a.segments[0].restore, a.segments[0].execute)
                == (b.segments[0].restore, b.segments[0].execute)
            )
            estimate = figure["estimate_seconds"] - (a.estimate_seconds - b.estimate_seconds)
            actual = figure["actual_seconds"]
            figure[f"estimate_{variant}_seconds"] = estimate if single else None
            figure[f"error_{variant}_pct"] = (
                (estimate - actual) / actual * 100 if single and actual else None
            )


def restore_figures(segments_dir: Path) -> dict[str, Any]:
    """What restoring cost the workers' critical path, against torch.load of the same state.

    From the workers' outputs: restores, ``restore_seconds`` (on the worker's thread:
    waiting for the prefetched checkpoint, then putting it into the live objects) and
    the prefetcher's decode time (on its thread). Then each restored checkpoint is
    decoded here, its state saved with torch.save and loaded back with torch.load
    (warm page cache, one thread, best of 3): the time a hand-written resume would
    spend reading the same state.
    """
    import torch

    from retrolog.checkpoint.codec import decode
    from retrolog.checkpoint.state import thaw
    from retrolog.store.objects import LocalObjectStore

    torch.set_num_threads(1)
    store = LocalObjectStore(segments_dir.parent.parent / "objects")
    restored = critical = decoded = waited = 0.0
    manifests: list[str] = []
    for out_path in segments_dir.glob("*.out.json"):
        out = json.loads(out_path.read_text())
        spec = json.loads(out_path.with_name(out_path.name.replace(".out", ".spec")).read_text())
        restored += out["restored"]
        critical += out["restore_seconds"]
        prefetch = out.get("prefetch") or {}
        decoded += prefetch.get("decode_seconds", 0.0)
        waited += prefetch.get("wait_seconds", 0.0)
        manifests += [spec["block_checkpoints"][str(i)] for i in spec["restore"]]
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.pt"
        for manifest in manifests:
            torch.save(thaw(decode(manifest, store).objects), path)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                torch.load(path, weights_only=True)
                times.append(time.perf_counter() - t0)
            loads.append(min(times))
    per_restore = critical / restored if restored else None
    torch_load = statistics.median(loads) if loads else None
    return {
        "restored": int(restored),
        "critical_path_seconds_per_restore": per_restore,
        "decode_seconds_per_restore": decoded / restored if restored else None,
        "wait_seconds_per_restore": waited / restored if restored else None,
        "torch_load_seconds": torch_load,
        "critical_path_over_torch_load": (
            per_restore / torch_load if per_restore is not None and torch_load else None
        ),
    }


# -- FlorDB --------------------------------------------------------------------------------


def torch_path_for(flor_python: Path, where: Path) -> tuple[Path | None, str]:
    """A directory of links to this interpreter's torch (and deps) that FlorDB's venv lacks."""
    where.mkdir(parents=True, exist_ok=True)
    missing = subprocess.run(
        [
            str(flor_python),
            "-c",
            "import importlib.util, sys\n"
            f"for m in {TORCH_MODULES!r}:\n"
            "    if importlib.util.find_spec(m) is None: print(m)",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    for module in missing:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            return None, f"{module} (needed by torch) is not installed in {sys.executable}"
        origin = Path(spec.origin)
        target = origin.parent if origin.name == "__init__.py" else origin
        (where / target.name).symlink_to(target)
    check = subprocess.run(
        [str(flor_python), "-c", "import torch; print(torch.__version__)"],
        env={**base_env(), "PYTHONPATH": str(where)},
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0:
        return None, f"torch does not import in FlorDB's venv: {tail(check.stderr, 3)}"
    return where, f"torch {check.stdout.strip()} linked from {sys.executable}"


def flordb_rep(
    flor_python: Path,
    torch_path: Path,
    epochs: int,
    n_train: int,
    reference: dict[str, list[Values]],
) -> dict[str, Any]:
    """Record the FlorDB twin of the workload, replay w_norm with FlorDB, compare its values."""
    work = Path(tempfile.mkdtemp(prefix="retrolog-bench-replay-flordb-"))
    try:
        env = base_env()
        # FlorDB's replay starts its children as plain `python`: its venv must come first.
        env["PATH"] = f"{flor_python.parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(torch_path)
        project = work / "bench-replay-flordb"
        logs = work / "logs"
        logs.mkdir()
        new_project(project, env, workload.flordb_source(workload.V1))
        record_seconds = []
        for index, (version, kwargs) in enumerate(workload.RUNS):
            (project / "train.py").write_text(workload.flordb_source(workload.VERSIONS[version]))
            cmd = [str(flor_python), "train.py", *run_kwargs(kwargs, epochs, n_train)]
            log = logs / f"flordb-record-{index}.log"
            record_seconds.append(timed(cmd, project, env, log).seconds)
        (project / "train.py").write_text(workload.flordb_source(workload.NEWEST))
        log = logs / "flordb-replay.log"
        cmd = [str(flor_python), "-m", "flordb", "replay", workload.OUTER_NAME]
        timing = timed(cmd, project, env, log, stdin_text="y\n", check=False)
        seconds, returncode = timing.seconds, timing.returncode
        output = clean_output(log.read_text(errors="replace"))

        db = project / ".flor" / f"{project.name}.db"
        tstamps = [
            t
            for (t,) in read_rows(
                db,
                "SELECT DISTINCT tstamp FROM logs WHERE source = 'forward' AND value_name = 'lr'"
                " ORDER BY tstamp",
            )
        ]
        if len(tstamps) != len(workload.RUNS):
            raise BenchError(f"FlorDB recorded {len(tstamps)} runs, expected {len(workload.RUNS)}")
        # Its recorded values equal retrolog's fresh runs': the two scripts compute the same.
        equivalence = merge_counts(
            [
                compare(flordb_values(db, name, "forward", ts), reference[name][index])
                for name in ("loss", "acc")
                for index, ts in enumerate(tstamps)
            ]
        )
        per_run = [
            compare(
                flordb_values(db, workload.OUTER_NAME, "replay", ts),
                reference[workload.OUTER_NAME][index],
            )
            for index, ts in enumerate(tstamps)
        ]
        return {
            "record_seconds": record_seconds,
            "replay_seconds": seconds,
            "replay_cpu_seconds": timing.cpu_seconds,
            "returncode": returncode,
            "runs_with_values": sum(1 for c in per_run if c["present"]),
            "values": merge_counts(per_run),
            "values_per_run": per_run,
            "workload_equivalent": all_exact(equivalence),
            "equivalence_check": equivalence,
            "error": flordb_error(output) if returncode != 0 else None,
            "output_tail": tail(output, 25),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def flordb_values(db: Path, name: str, source: str, tstamp: str) -> Values:
    found: Values = {}
    for ctx, value in read_rows(
        db,
        "SELECT ctx, value FROM logs WHERE value_name = ? AND source = ? AND tstamp = ?",
        (name, source, tstamp),
    ):
        segments = json.loads(ctx) if ctx else []
        index = {seg["name"]: seg["iteration"] for seg in segments}
        found[index.get("epoch"), index.get("step")] = float(value)
    return found


def flordb_error(output: str) -> str:
    """The lines of FlorDB's output that say why its replay stopped."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Exception raised during"):
            block = [line]
            for nxt in lines[i + 1 :]:
                if nxt.startswith(("Checking out", "Traceback")):
                    break
                block.append(nxt)
            return "\n".join(block)
    errors = [line for line in lines if re.match(r"^\w+(\.\w+)*(Error|Exception)\b", line)]
    return "\n".join(errors[-3:]) or tail(output, 5)


# -- figures -------------------------------------------------------------------------------


def replay_floor(
    first: list[dict[str, Any]], again: list[dict[str, Any]], record: list[float]
) -> dict[str, Any]:
    """Each run's replay time in a second, identical replay against the first, and the
    estimate target held to it: median |error| over both replays within floor + 3.

    ``record`` is the same probe's record-side floor (``estimate_spread``): how far
    the estimate moves when planned from a second execution's profile. An estimate
    faces both noises, the recording's and the replay's; independent, they add in
    quadrature, and the target is also stated against that combined floor.
    """
    aa = [
        (b["actual_seconds"] - a["actual_seconds"]) / a["actual_seconds"] * 100
        for x, y in zip(first, again, strict=True)
        for a, b in zip(x["runs"], y["runs"], strict=True)
    ]
    errors = [run["error_pct"] for x in first + again for run in x["runs"]]
    floor = statistics.median(abs(f) for f in aa)
    error = statistics.median(abs(e) for e in errors)
    return {
        "what": "each run's replay time in a second, identical replay of the same recording "
        "against the first (same plan, same machine), in percent: no estimate made before a "
        "replay can be closer than that",
        "median_abs": floor,
        "worst": max(aa, key=abs),
        "samples": aa,
        "second_replay_seconds": summary([y["seconds"] for y in again]),
        "estimate_error_pct_both_replays": {
            "median_abs": error,
            "median_abs_without_pooling": unpooled(first + again),
            "median_abs_without_startup_pooling": unpooled(
                first + again, "without_startup_pooling"
            ),
            "samples_second": [run["error_pct"] for y in again for run in y["runs"]],
        },
        "target_median_abs_at_most": floor + 3,
        "target_met": error <= floor + 3,
        "with_record_floor": {
            "what": "the replay floor and the record-side floor (the same estimate planned "
            "from a second execution's profile, estimate_floor_pct_per_run) combined in "
            "quadrature, as independent noises add",
            "record_floor_median_abs": (rec := statistics.median(abs(f) for f in record)),
            "combined_floor": (both := math.hypot(floor, rec)),
            "target_median_abs_at_most": both + 3,
            "target_met": error <= both + 3,
        },
    }


def record_floor(samples: list[float]) -> dict[str, Any]:
    """A probe's record-side floor (``estimate_spread``'s samples over the repetitions)."""
    return {
        "what": "the same estimate made from a second fresh execution's profile against the "
        "first's, per run, in percent of its replay time (estimate_spread)",
        "median_abs": statistics.median(abs(f) for f in samples),
        "worst": max(samples, key=abs),
        "samples": samples,
    }


def unpooled_samples(
    replays: list[dict[str, Any]], variant: str = "without_pooling"
) -> list[float]:
    """Each run's error, in percent, of the estimate of a POOLING_VARIANTS (add_unpooled)."""
    key = f"error_{variant}_pct"
    return [run[key] for x in replays for run in x["runs"] if run.get(key) is not None]


def unpooled(replays: list[dict[str, Any]], variant: str = "without_pooling") -> float | None:
    """Median |error| per run of the estimate of a POOLING_VARIANTS, or None."""
    errors = unpooled_samples(replays, variant)
    return statistics.median(abs(e) for e in errors) if errors else None


def side_by_side(replays: list[dict[str, Any]]) -> dict[str, Any]:
    """The unpooled estimates' errors, to sit beside the planner's in a probe's figures."""
    return {
        "median_abs_without_pooling": unpooled(replays),
        "samples_without_pooling": unpooled_samples(replays),
        "median_abs_without_startup_pooling": unpooled(replays, "without_startup_pooling"),
    }


def figures(reps: list[dict[str, Any]], counts: tuple[int, ...]) -> dict[str, Any]:
    retrain = [sum(r["retrain_seconds"]) for r in reps]
    out: dict[str, Any] = {
        "record_seconds_3_runs": summary([sum(r["record_seconds"]) for r in reps]),
        "retrain_seconds_3_runs": summary(retrain),
        "retrain_cores_used": summary(
            [sum(r["retrain_cpu_seconds"]) / sum(r["retrain_seconds"]) for r in reps]
        ),
        "epoch_seconds": summary(
            [run["epoch_seconds"] for r in reps for run in r["workload"]["runs"]]
        ),
        "prefix_seconds": summary(
            [run["prefix_seconds"] for r in reps for run in r["workload"]["runs"]]
        ),
    }
    noise = [n for r in reps for n in r["noise"]]
    out["noise_floor"] = {
        "what": "a second fresh execution of the same run (same code, same arguments) against "
        "the first: the spread any estimate from one execution faces",
        **{
            key: {
                "median_abs": statistics.median(abs(n[key]) for n in noise),
                "worst": max((n[key] for n in noise), key=abs),
                "samples": [n[key] for n in noise],
            }
            for key in ("wall_pct", "prefix_pct", "prefix_seconds", "loop_pct")
        },
    }
    for probe in ("outer", "inner"):
        block: dict[str, Any] = {}
        for workers in counts:
            rs = [r["replays"][f"{probe}-{workers}"] for r in reps]
            errors = [run["error_pct"] for x in rs for run in x["runs"]]
            floor = [f for r in reps for f in r["estimate_floor"][f"{probe}-{workers}"]]
            block[f"workers_{workers}"] = {
                "replay_seconds": summary([x["seconds"] for x in rs]),
                "execution_seconds": summary([x["execution_seconds"] for x in rs]),
                "before_workers_seconds": summary([x["before_workers_seconds"] for x in rs]),
                "worker_seconds": summary([x["worker_seconds"] for x in rs]),
                "cores_used": summary([x["cpu_seconds"] / x["seconds"] for x in rs]),
                "load_average_after": summary([x["load_average_after"] for x in rs]),
                "segments": summary([x["segments"] for x in rs]),
                "speedup_vs_retrain": summary(
                    [t / x["seconds"] for t, x in zip(retrain, rs, strict=True)]
                ),
                "estimate_error_pct_per_run": {
                    "median": statistics.median(errors),
                    "median_abs": statistics.median(abs(e) for e in errors),
                    "worst": max(errors, key=abs),
                    "samples": errors,
                    **side_by_side(rs),
                },
                "estimate_floor_pct_per_run": record_floor(floor),
                "plan_error_vs_command_pct": summary([x["plan_error_pct"] for x in rs]),
                "epochs_without_checkpoint": summary(
                    [
                        sum(run["epochs_without_checkpoint"] for run in r["workload"]["runs"])
                        for r in reps
                    ]
                ),
                "values": merge_counts([x["values"] for x in rs]),
            }
            if workers == counts[0]:
                again = [r["replays"][f"{probe}-{workers}-again"] for r in reps]
                block[f"workers_{workers}"]["replay_floor_pct_per_run"] = replay_floor(
                    rs, again, floor
                )
        if counts == WORKER_COUNTS:
            one, two = ([r["replays"][f"{probe}-{w}"]["seconds"] for r in reps] for w in counts)
            block["parallel_speedup"] = summary([a / b for a, b in zip(one, two, strict=True)])
            block["parallel_efficiency"] = summary(
                [a / b / IDEAL_PARALLEL_SPEEDUP for a, b in zip(one, two, strict=True)]
            )
        out[probe] = block
    first = counts[0]
    verify_errors = [run["error_pct"] for r in reps for run in r["verify"]["runs"]]
    verify_floor = [f for r in reps for f in r["estimate_floor"][f"verify-{first}"]]
    out["verify"] = {
        "what": f"retrolog replay --verify with {first} worker(s): every run replayed to its "
        "script's end, its recorded statements recomputed",
        "replay_seconds": summary([r["verify"]["seconds"] for r in reps]),
        "estimate_error_pct_per_run": {
            "median": statistics.median(verify_errors),
            "median_abs": statistics.median(abs(e) for e in verify_errors),
            "worst": max(verify_errors, key=abs),
            "samples": verify_errors,
            **side_by_side([r["verify"] for r in reps]),
        },
        "estimate_floor_pct_per_run": record_floor(verify_floor),
        "replay_floor_pct_per_run": replay_floor(
            [r["verify"] for r in reps], [r["verify_again"] for r in reps], verify_floor
        ),
    }
    fresh = [r["replays"][f"outer-{first}-fresh"] for r in reps]
    forked = [r["replays"][f"outer-{first}"] for r in reps]
    out["outer_fresh_interpreters"] = {
        "what": f"the outer-loop replay with {first} worker(s) and RETROLOG_FORKSERVER=0 (every "
        "worker a new interpreter), in the same repetition",
        "replay_seconds": summary([x["seconds"] for x in fresh]),
        "worker_seconds": summary([x["worker_seconds"] for x in fresh]),
        "speedup_vs_retrain": summary(
            [t / x["seconds"] for t, x in zip(retrain, fresh, strict=True)]
        ),
        "fork_server_speedup": summary(
            [a["seconds"] / b["seconds"] for a, b in zip(fresh, forked, strict=True)]
        ),
    }
    out["restores"] = {
        key: summary([x["restores"][key] for x in forked if x["restores"][key] is not None])
        for key in (
            "critical_path_seconds_per_restore", "decode_seconds_per_restore",
            "wait_seconds_per_restore", "torch_load_seconds", "critical_path_over_torch_load",
        )
    }  # fmt: skip
    return out


# -- main ----------------------------------------------------------------------------------


def add_thread_options(
    parser: argparse.ArgumentParser, results: Path, default_threads: Path, threads_help: str
) -> None:
    """--output and --torch-threads, as the replay benchmarks take them."""
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"results JSON file (default {results.name}, or {default_threads.name} "
        "with --torch-threads default)",
    )
    parser.add_argument("--torch-threads", choices=("1", "default"), default="1", help=threads_help)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="repetitions of record/retrain/replay")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (at least 6)")
    parser.add_argument(
        "--n-train",
        type=int,
        default=6000,
        help="training images per epoch: 6000 is about 3 s per epoch on one core",
    )
    parser.add_argument("--no-flordb", action="store_true", help="skip the FlorDB anchor")
    parser.add_argument("--flordb-reps", type=int, default=1, help="FlorDB repetitions")
    add_thread_options(
        parser,
        RESULTS,
        RESULTS_DEFAULT_THREADS,
        "1 (the default): every process trains on one thread, replayed with 1 and with 2 "
        "workers; default: torch's own thread count, as a script that never sets it, replayed "
        "with the workers retrolog picks by itself (no --workers); FlorDB is skipped",
    )
    parser.add_argument(
        "--keep-failed",
        type=Path,
        default=None,
        help="copy a failing repetition's project and logs into this directory",
    )
    args = parser.parse_args(argv)
    if args.reps < 3:
        print(
            f"note: {args.reps} repetitions; figures for the record use at least 3.",
            file=sys.stderr,
        )
    workload.check_sources()
    try:
        retrolog_version = metadata.version("retrolog")
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError as exc:
        print(
            f"{exc.name} is not installed in {sys.executable}; run this with the project's "
            "venv: .venv/bin/python -m bench.bench_replay",
            file=sys.stderr,
        )
        return 1
    python = Path(sys.executable)
    mode = run_mode(python, args.torch_threads)
    output = args.output or (RESULTS if mode.explicit else RESULTS_DEFAULT_THREADS)
    flor_python, flordb_note = (None, "skipped (--no-flordb)")
    if not mode.explicit:
        flordb_note = "skipped (--torch-threads default)"
    elif not args.no_flordb:
        flor_python, flordb_note = flordb_python()

    measured = Measured("replay", args.reps).start()
    scratch = Path(tempfile.mkdtemp(prefix="retrolog-bench-replay-scratch-"))
    reps: list[dict[str, Any]] = []
    flordb_reps: list[dict[str, Any]] = []
    try:
        env = base_env()
        floor = [
            startup_floor(python, env, scratch / "floor.log", scratch, mode.threads)
            for _ in range(3)
        ]
        for rep in range(args.reps):
            print(f"rep {rep + 1}/{args.reps}: record, retrain, replay", file=sys.stderr)
            reps.append(
                retrolog_rep(rep, python, args.epochs, args.n_train, args.keep_failed, mode)
            )
            last = reps[-1]
            print(
                f"  retrain {sum(last['retrain_seconds']):.1f}s, replay "
                + ", ".join(f"{k} {v['seconds']:.1f}s" for k, v in last["replays"].items()),
                file=sys.stderr,
            )
        torch_path = None
        if flor_python is not None:
            torch_path, torch_note = torch_path_for(flor_python, scratch / "torch-path")
            flordb_note += f"; {torch_note}"
            if torch_path is None:
                print(f"flordb unavailable: {torch_note}", file=sys.stderr)
        if flor_python is not None and torch_path is not None:
            for rep in range(args.flordb_reps):
                print(f"flordb {rep + 1}/{args.flordb_reps}: record, replay", file=sys.stderr)
                flordb_reps.append(
                    flordb_rep(
                        flor_python, torch_path, args.epochs, args.n_train, reps[-1]["reference"]
                    )
                )
    except (BenchError, subprocess.SubprocessError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    measured.finish()

    reference_stable = len({r["reference_digest"] for r in reps}) == 1
    figs = figures(reps, mode.counts)
    result: dict[str, Any] = {
        **measured.head(retrolog_version),
        "torch_version": torch_version,
        "workload": {
            "script": "bench/_replay_workload.py",
            "epochs": args.epochs,
            "n_train": args.n_train,
            "runs": [{"version": v, "kwargs": k} for v, k in workload.RUNS],
            "outer_statement": workload.OUTER_NAME,
            "inner_statement": workload.INNER_NAME,
            "threads_per_process": mode.threads or f"torch's default ({torch_default_threads()})",
            "worker_counts": list(mode.counts),
            "workers_chosen_by": "--workers" if mode.explicit else "retrolog (no --workers)",
            "recorded_last_rep": reps[-1]["workload"]["runs"],
            # Every repetition's unchecked epochs with the rule's reasons (runs.checkpointing),
            # so that a repetition that lost epochs says why.
            "refusals_per_rep": [
                {
                    "epochs_without_checkpoint": sum(
                        run["epochs_without_checkpoint"] for run in r["workload"]["runs"]
                    ),
                    **{
                        key: sum(run["refused"].get(key) or 0 for run in r["workload"]["runs"])
                        for key in ("refused_cost", "refused_unpriced", "refused_writer_full")
                    },
                }
                for r in reps
            ],
            "startup_floor_seconds": summary(floor),
            "startup_floor_is": "python -c '" + startup_snippet(mode.threads) + "'",
        },
        "units": "seconds are wall time of the command as the user waits for it; speedup = "
        "retraining the 3 runs sequentially / the replay; parallel speedup = replay with 1 "
        "worker / with 2 workers (ideal 2.0, and the machine has only nproc cores); estimate "
        "error = (estimate - actual) / actual per run (worker-seconds)",
        **figs,
        "checks": {
            "recorded_equals_fresh_run": reps[-1]["determinism"],
            "all_replayed_values_exact": True,  # a difference stops the benchmark
            "outer_values": merge_counts(
                [figs["outer"][f"workers_{n}"]["values"] for n in mode.counts]
            ),
            "inner_values": merge_counts(
                [figs["inner"][f"workers_{n}"]["values"] for n in mode.counts]
            ),
            "deferred_check_clean": True,
            "project_head_and_tree_unchanged": True,
            "reference_values_identical_across_reps": reference_stable,
        },
        "flordb": flordb_result(flor_python, flordb_note, flordb_reps, figs),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(output)
    print_report(result)
    print(f"\nresults: {output}")
    return 0


def torch_default_threads() -> int:
    """The intra-op thread count torch picks by itself in a new process here."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=base_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(done.stdout.strip())


def run_mode(python: Path, threads: str) -> Mode:
    """The benchmark's mode for ``--torch-threads``."""
    if threads == "1":
        return Mode(threads=1, counts=WORKER_COUNTS, explicit=True)
    from retrolog._replay.execute import default_workers

    return Mode(threads=None, counts=(default_workers(torch_default_threads()),), explicit=False)


def flordb_result(
    flor_python: Path | None, note: str, reps: list[dict[str, Any]], figs: dict[str, Any]
) -> dict[str, Any]:
    if flor_python is None or not reps:
        return {"available": False, "note": note}
    last = reps[-1]
    replay = summary([r["replay_seconds"] for r in reps])
    return {
        "available": True,
        "version": FLORDB_VERSION,
        "note": note,
        "repetitions": len(reps),
        "command": f"python -m flordb replay {workload.OUTER_NAME}  (stdin: y)",
        "record_seconds_3_runs": summary([sum(r["record_seconds"]) for r in reps]),
        "replay_seconds": replay,
        "returncode": [r["returncode"] for r in reps],
        "completed": all(r["returncode"] == 0 for r in reps),
        "runs_with_values": [r["runs_with_values"] for r in reps],
        "values": last["values"],
        "values_per_run": last["values_per_run"],
        "values_exact": all_exact(last["values"]),
        "workload_equivalent": all(r["workload_equivalent"] for r in reps),
        "equivalence_check": last["equivalence_check"],
        "error": last["error"],
        "output_tail": last["output_tail"],
        "replay_over_retrolog_outer_1_worker": replay["median"]
        / figs["outer"]["workers_1"]["replay_seconds"]["median"],
        "replay_over_retrain": replay["median"] / figs["retrain_seconds_3_runs"]["median"],
    }


def without_pooling(stats: dict[str, Any]) -> str:
    own = stats.get("median_abs_without_pooling")
    if own is None:
        return ""
    text = f" (from each run's own recording: {own:.1f}%"
    iterations_only = stats.get("median_abs_without_startup_pooling")
    if iterations_only is not None:
        text += f"; iteration times pooled, start-up not: {iterations_only:.1f}%"
    return text + ")"


def print_floor(rf: dict[str, Any]) -> None:
    both = rf["estimate_error_pct_both_replays"]
    print(
        f"    the same replay run twice: a run's replay time moves {rf['median_abs']:.1f}% "
        f"(worst {rf['worst']:+.1f}%); median |error| over both replays "
        f"{both['median_abs']:.1f}%{without_pooling(both)} against "
        f"floor + 3 = {rf['target_median_abs_at_most']:.1f}%: "
        + ("met" if rf["target_met"] else "not met")
    )
    both = rf["with_record_floor"]
    print(
        f"    with the record-side floor ({both['record_floor_median_abs']:.1f}%) in quadrature, "
        f"floor + 3 = {both['target_median_abs_at_most']:.1f}%: "
        + ("met" if both["target_met"] else "not met")
    )


def print_report(result: dict[str, Any]) -> None:
    def cell(stats: dict[str, Any], fmt: str, unit: str = "") -> str:
        return f"{stats['median']:{fmt}}{unit} [{stats['min']:{fmt}}..{stats['max']:{fmt}}]"

    w = result["workload"]
    print(
        f"\nreplay benchmark: Python {result['python']}, torch {result['torch_version']}, "
        f"{result['nproc']} cores, {result['repetitions']} repetitions, load average "
        f"{result['load_average_before'][0]:.1f} -> {result['load_average_after'][0]:.1f}"
    )
    rec = w["recorded_last_rep"][0]
    print(
        f"workload: 3 runs x {w['epochs']} epochs x {rec['steps'] // max(rec['epochs'], 1)} "
        f"steps, 2 code versions, {rec['checkpoints']} checkpoints per run; epoch "
        f"{cell(result['epoch_seconds'], '.1f', 's')}, prefix (start to first epoch) "
        f"{cell(result['prefix_seconds'], '.1f', 's')}; process start-up floor "
        f"(python + import torch + first optimizer) {cell(w['startup_floor_seconds'], '.1f', 's')}"
    )
    print("median [min..max], wall seconds\n")
    header = (
        f"{'query':22} {'seconds':>20} {'vs retrain':>17} {'cores':>5} {'before workers':>14} "
        f"{'worker-s':>8} {'segs':>4} {'est. error/run':>16}"
    )
    print(header)
    print("-" * len(header))
    print(
        f"{'retrain 3 runs':22} {cell(result['retrain_seconds_3_runs'], '.1f'):>20} "
        f"{'':>17} {result['retrain_cores_used']['median']:>5.2f}"
    )
    counts = w.get("worker_counts", list(WORKER_COUNTS))
    first = counts[0]
    for probe, name in (("outer", w["outer_statement"]), ("inner", w["inner_statement"])):
        for workers in counts:
            f = result[probe][f"workers_{workers}"]
            err = f["estimate_error_pct_per_run"]
            print(
                f"{f'{probe} {name} w={workers}':22} {cell(f['replay_seconds'], '.1f'):>20} "
                f"{cell(f['speedup_vs_retrain'], '.1f', 'x'):>17} "
                f"{f['cores_used']['median']:>5.2f} "
                f"{f['before_workers_seconds']['median']:>14.1f} "
                f"{f['worker_seconds']['median']:>8.1f} {f['segments']['median']:>4.0f} "
                f"{err['median']:>+7.1f}% ({err['worst']:+.0f}%)"
            )
    print(
        "\ncores: CPU seconds / wall seconds; before workers: command start to the first "
        "worker (imports, planning); worker-s: sum of the segments' durations; est. error/run: "
        "median over runs and repetitions of (estimate - actual) / actual, worst in parentheses"
    )
    outer = result["outer"][f"workers_{first}"]["speedup_vs_retrain"]
    print(
        f"(a) outer-loop probe, {first} worker(s) ({w.get('workers_chosen_by', '--workers')}), "
        f"torch threads {w['threads_per_process']}: {outer['median']:.1f}x faster than "
        f"retraining [{outer['min']:.1f}..{outer['max']:.1f}]"
        + "".join(
            f"; {n} workers: {result['outer'][f'workers_{n}']['speedup_vs_retrain']['median']:.1f}x"
            for n in counts[1:]
        )
    )
    fresh = result["outer_fresh_interpreters"]
    print(
        f"    with every worker a new interpreter (RETROLOG_FORKSERVER=0): "
        f"{cell(fresh['replay_seconds'], '.1f', 's')}, "
        f"{fresh['speedup_vs_retrain']['median']:.1f}x vs retrain; the fork server makes the "
        f"replay {cell(fresh['fork_server_speedup'], '.2f', 'x')} faster"
    )
    r = result["restores"]
    print(
        "    restore on the worker's critical path "
        f"{cell(r['critical_path_seconds_per_restore'], '.4f', 's')} per checkpoint (decoded "
        f"ahead in {r['decode_seconds_per_restore']['median']:.4f}s, waited "
        f"{r['wait_seconds_per_restore']['median']:.4f}s); torch.load of the same state "
        f"{cell(r['torch_load_seconds'], '.4f', 's')}; ratio "
        f"{cell(r['critical_path_over_torch_load'], '.2f')}"
    )
    one = result["outer"][f"workers_{first}"]
    runs = len(w["runs"])
    print(
        f"    where its time goes: {one['before_workers_seconds']['median']:.1f}s before the "
        f"first worker starts, then {one['worker_seconds']['median'] / runs:.1f}s per run; a "
        "bare python process that imports torch and builds an optimizer takes "
        f"{w['startup_floor_seconds']['median']:.1f}s"
    )
    unchecked = one["epochs_without_checkpoint"]
    print(
        f"    epochs the recordings did not checkpoint (executed, not restored, by this "
        f"replay), of {runs * w['epochs']}: {cell(unchecked, '.0f')}; the plan's wall-time "
        f"estimate against the command's: {cell(one['plan_error_vs_command_pct'], '+.0f', '%')}"
    )
    par = result["inner"].get("parallel_speedup")
    if par is not None:
        print(
            f"(b) inner-loop probe, 2 workers vs 1: {par['median']:.2f}x "
            f"[{par['min']:.2f}..{par['max']:.2f}], ideal {IDEAL_PARALLEL_SPEEDUP:.1f}x, on "
            f"{result['nproc']} cores"
        )
    for probe in ("outer", "inner"):
        for workers in counts:
            err = result[probe][f"workers_{workers}"]["estimate_error_pct_per_run"]
            aa = result[probe][f"workers_{workers}"]["estimate_floor_pct_per_run"]
            print(
                f"(c) estimate error per run, {probe} w={workers}: median |error| "
                f"{err['median_abs']:.1f}%{without_pooling(err)}, worst {err['worst']:+.1f}%; "
                "the same estimate "
                f"from a second execution's profile moves {aa['median_abs']:.1f}% "
                f"(worst {aa['worst']:+.1f}%)"
            )
            rf = result[probe][f"workers_{workers}"].get("replay_floor_pct_per_run")
            if rf is not None:
                print_floor(rf)
    ver = result["verify"]
    err = ver["estimate_error_pct_per_run"]
    aa = ver["estimate_floor_pct_per_run"]
    print(
        f"(c) estimate error per run, --verify (scripts run to their end): median |error| "
        f"{err['median_abs']:.1f}%{without_pooling(err)}, worst {err['worst']:+.1f}%; the replay "
        f"{cell(ver['replay_seconds'], '.1f', 's')}; the same estimate from a second "
        f"execution's profile moves {aa['median_abs']:.1f}% (worst {aa['worst']:+.1f}%)"
    )
    print_floor(ver["replay_floor_pct_per_run"])
    floor = result["noise_floor"]
    print(
        "(c) noise floor, the same run executed twice: median |difference| "
        f"{floor['wall_pct']['median_abs']:.1f}% of its wall time (worst "
        f"{floor['wall_pct']['worst']:+.1f}%), prefix {floor['prefix_pct']['median_abs']:.1f}% "
        f"({floor['prefix_seconds']['median_abs']:.2f}s, worst "
        f"{floor['prefix_seconds']['worst']:+.2f}s), outer loop "
        f"{floor['loop_pct']['median_abs']:.1f}% (worst {floor['loop_pct']['worst']:+.1f}%)"
    )
    c = result["checks"]
    print(
        f"checks: {c['outer_values']['exact']}/{c['outer_values']['expected']} outer and "
        f"{c['inner_values']['exact']}/{c['inner_values']['expected']} inner values exact "
        f"(every replay, {' and '.join(map(str, counts))} workers), deferred check clean, "
        "project untouched"
    )
    fl = result["flordb"]
    if not fl["available"]:
        print(f"(d) flordb unavailable: {fl['note']}")
        return
    v = fl["values"]
    print(
        f"(d) flordb {fl['version']} replay {w['outer_statement']}: "
        f"{cell(fl['replay_seconds'], '.1f', 's')}, exit code {fl['returncode']}, runs with values "
        f"{fl['runs_with_values']} of 3, {v['exact']}/{v['expected']} values exact "
        f"({v['present']} present); workload equivalent: {fl['workload_equivalent']}"
    )
    if fl["error"]:
        print("    flordb error: " + fl["error"].replace("\n", "\n    "))


if __name__ == "__main__":
    sys.exit(main())
