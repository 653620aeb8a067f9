"""Benchmark: transformers' and Lightning's Trainers recorded with their
RetrologCallback, against the plain Trainer; and replay of an epoch-level question
against retraining.

Run from the repository root with the project's venv (the transformers and
lightning extras):

    python -m bench.bench_frameworks --framework both --part both --reps 3
    python -m bench.bench_frameworks --framework lightning --part replay --reps 3

The workloads are examples/hf_trainer.py (a tiny BERT from its config, synthetic
tokens) and examples/lightning_train.py (a small MLP on synthetic data), at default
settings (adaptive checkpoints, eps = 1/15, torch's default threads), in a fresh git
project per repetition. The default sample counts make a 10-epoch run spend most of
its CPU time training rather than starting (importing the framework): the results
give the start-up share, as measured.

Every figure is given twice: wall time, and CPU time (user + sys of the process
tree: the script's own ``getrusage`` around the timed span, and the benchmark's
``getrusage(RUSAGE_CHILDREN)`` deltas around each whole process). On a shared
machine wall time carries the other users' load; CPU time carries much less of it.
Each has its own A/A floor.

(a) Record (``--part record``). Each repetition runs the plain script (the example
without its ``RetrologCallback``, retrolog not imported), the recorded script, and
the plain script again (the A/A pair: what one execution differs from the next on
this machine, the floor under any overhead figure), the first two in alternating
order. The span timed is ``trainer.train()`` / ``trainer.fit()`` plus, recorded,
``rl.commit()`` after it, so the run's start (code capture, store), every checkpoint
and the last writes are inside it. The fixed start-up cost is the rest of the
process (interpreter, imports, retrolog's import), recorded minus plain, given
apart. A recorded run is timed as its project's second: an untimed 1-epoch run
comes first, as every run of a user's but the first finds the store made.
Overhead = recorded span / plain span - 1, per repetition; medians with min and
max. Every recorded run must write every block checkpoint the adaptive rule chose.

(b) Outer replay against retraining (``--part replay``). In each repetition's
project (after an untimed recorded run when part (a) did not record one), today's
code adds a weight norm in an epoch-end hook (transformers: the example's
``on_epoch_end``; Lightning: the module's ``on_train_epoch_end``), outer level;
``retrolog replay w_norm --yes`` restores the epochs the rule kept and trains the
others. The whole replay command (planning, the worker's start, restores,
evaluations) against a whole plain run of the same script (what retraining costs),
in alternating order: speed-up = retrain / replay, in wall and in CPU time. Both pay
a start-up before any training: the interpreter, the framework's import, the script's
set-up (the retraining process outside its ``train()``/``fit()`` span). It is given
apart, with what each side spends beyond it: the retraining its training, the replay
its command, planning, restores and evaluations. The speed-up of a longer run tends to
the ratio of those two. The split is approximate: the replay's own start-up is not the
same work (its fork server imports what the run had imported by its first loop), so its
figure beyond it can come out near zero, or below.

Results: bench/results/frameworks_<framework>.json (a part re-run replaces that
part's figures and keeps the other's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import source_fingerprint

ROOT = Path(__file__).resolve().parents[1]
GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
}
# The span's CPU time: this process's threads and the children it waited for (git).
TIMED = (
    "import resource as _r, time as _t\n"
    "def _cpu():\n"
    "    s, c = _r.getrusage(_r.RUSAGE_SELF), _r.getrusage(_r.RUSAGE_CHILDREN)\n"
    "    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime\n"
    "_t0, _c0 = _t.perf_counter(), _cpu()\n"
    "{call}"
    "{commit}"
    "print('BENCH_SPAN', _t.perf_counter() - _t0, _cpu() - _c0)\n"
)
COMMIT = "__import__('retrolog').commit()\n"
SOURCE: dict[str, Any] = {}


@dataclass(frozen=True)
class Framework:
    example: str
    callback_import: str
    callback_arg: str  # its text in the example, and what the plain script has instead
    plain_arg: str
    call: str
    hook: str  # today's epoch-end hook, and the weight norm it gains
    hook_norm: str
    samples: int
    gitignore: str

    def scripts(self) -> tuple[str, str, str]:
        """(plain, recorded, today's recorded) scripts."""
        text = (ROOT / "examples" / self.example).read_text()
        for needle in (self.callback_import, self.callback_arg, self.call, self.hook):
            if needle not in text:
                raise SystemExit(f"examples/{self.example} no longer has {needle!r}")
        recorded = text.replace(self.call, TIMED.format(call=self.call, commit=COMMIT))
        plain = (
            text.replace(self.callback_import, "")
            .replace(self.callback_arg, self.plain_arg)
            .replace(self.call, TIMED.format(call=self.call, commit=""))
        )
        today = recorded.replace(
            self.callback_import, "import retrolog as rl\n" + self.callback_import
        ).replace(self.hook, self.hook_norm)
        return plain, recorded, today


FRAMEWORKS = {
    "hf": Framework(
        example="hf_trainer.py",
        callback_import="from retrolog.integrations.transformers import RetrologCallback\n",
        callback_arg=", RetrologCallback()]",
        plain_arg="]",
        call="trainer.train()\n",
        hook="    def on_epoch_end(self, args, state, control, model=None, **kwargs):\n"
        "        pass\n",
        hook_norm="    def on_epoch_end(self, args, state, control, model=None, **kwargs):\n"
        '        rl.log("w_norm", sum(p.norm().item() for p in model.parameters()))\n',
        samples=384,
        gitignore="hf_out/\n",
    ),
    "lightning": Framework(
        example="lightning_train.py",
        callback_import="from retrolog.integrations.lightning import RetrologCallback\n",
        callback_arg="    callbacks=[RetrologCallback()],\n",
        plain_arg="",
        call="trainer.fit(Classifier(opts.hidden, opts.lr), train, val)\n",
        hook="    def on_train_epoch_end(self):\n        pass\n",
        hook_norm="    def on_train_epoch_end(self):\n"
        '        rl.log("w_norm", sum(p.norm().item() for p in self.parameters()))\n',
        samples=16384,
        gitignore="lightning_logs/\n",
    ),
}


# --torch-threads N: both sides run with N intra-op threads (OMP_NUM_THREADS), which
# tells a cost of retrolog's own from torch's threads contending with its background ones.
EXTRA_ENV: dict[str, str] = {}


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    out.update(GIT_ENV, RETROLOG_PROGRESS="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out["PYTHONPATH"] = str(ROOT / "src")
    out.update(EXTRA_ENV)
    return out


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """The finished process, its wall time and its tree's CPU time (user + sys)."""
    cpu0, began = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=3600)
    wall, cpu = time.perf_counter() - began, children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return proc, wall, cpu


def run(project: Path, script: str, *args: str) -> dict[str, float]:
    """The span's wall and CPU time printed by the script, and the whole process's."""
    (project / "train.py").write_text(script)
    proc, wall, cpu = timed([sys.executable, "train.py", *args], project)
    spans = [line.split() for line in proc.stdout.splitlines() if line.startswith("BENCH_SPAN")]
    return {
        "span_wall": float(spans[-1][1]),
        "span_cpu": float(spans[-1][2]),
        "process_wall": wall,
        "process_cpu": cpu,
    }


def new_project(base: Path, framework: Framework, rep: int) -> Path:
    project = base / f"rep{rep}"
    project.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=project, check=True, env=env())
    (project / ".gitignore").write_text(framework.gitignore)
    return project


def latest_run(project: Path) -> tuple[str, dict[str, Any]]:
    conn = sqlite3.connect(project / ".retrolog" / "retrolog.db")
    try:
        (checkpointing, run_id) = conn.execute(
            "SELECT checkpointing, run_id FROM runs ORDER BY started_at DESC LIMIT 1"
        ).fetchone()
    finally:
        conn.close()
    return run_id, json.loads(checkpointing)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def record_rep(project: Path, scripts: tuple[str, str, str], config: list[str], rep: int) -> dict:
    plain, recorded, _ = scripts
    order = ["plain", "recorded"] if rep % 2 == 0 else ["recorded", "plain"]
    times: dict[str, dict[str, float]] = {}
    for which in order:
        times[which] = run(project, plain if which == "plain" else recorded, *config)
    times["plain_again"] = run(project, plain, *config)
    _, checkpointing = latest_run(project)
    if checkpointing["chosen"] != checkpointing["written"] or checkpointing["abandoned"]:
        raise SystemExit(f"rep {rep}: a chosen checkpoint was not written: {checkpointing}")
    p, r, a = times["plain"], times["recorded"], times["plain_again"]
    figures: dict[str, Any] = {"times": times}
    for kind in ("wall", "cpu"):
        span = f"span_{kind}"
        startup_plain = p[f"process_{kind}"] - p[span]
        startup_recorded = r[f"process_{kind}"] - r[span]
        figures[kind] = {
            "overhead": r[span] / p[span] - 1,
            "aa": abs(a[span] / p[span] - 1),
            "extra_seconds": r[span] - p[span],
            "startup_extra_seconds": startup_recorded - startup_plain,
            "startup_share_plain": startup_plain / p[f"process_{kind}"],
        }
    figures["checkpoints_chosen"] = checkpointing["chosen"]
    figures["checkpoints_written"] = checkpointing["written"]
    w, c = figures["wall"], figures["cpu"]
    print(
        f"  record rep {rep}: span plain {p['span_wall']:.1f}s / {p['span_cpu']:.1f}s CPU, "
        f"recorded {r['span_wall']:.1f}s / {r['span_cpu']:.1f}s CPU: overhead wall "
        f"{w['overhead']:+.1%} (A/A {w['aa']:.1%}), CPU {c['overhead']:+.1%} (A/A "
        f"{c['aa']:.1%}); start-up extra {w['startup_extra_seconds']:+.2f}s wall, "
        f"{c['startup_extra_seconds']:+.2f}s CPU; checkpoints {checkpointing['chosen']} "
        f"chosen = {checkpointing['written']} written",
        flush=True,
    )
    return figures


def replay_rep(
    project: Path, scripts: tuple[str, str, str], config: list[str], rep: int, epochs: int
) -> dict:
    plain, recorded, today = scripts
    if not (project / ".retrolog").exists():
        run(project, recorded, *config)
    run_id, _ = latest_run(project)
    order = ["retrain", "replay"] if rep % 2 == 0 else ["replay", "retrain"]
    times: dict[str, dict[str, float]] = {}
    out = ""
    for which in order:
        if which == "retrain":
            got = run(project, plain, *config)
            times["retrain"] = {"wall": got["process_wall"], "cpu": got["process_cpu"]}
            # What both pay before training: the interpreter, the framework's import, the
            # script's set-up (the retraining process outside its fit/train span).
            times["startup"] = {
                "wall": got["process_wall"] - got["span_wall"],
                "cpu": got["process_cpu"] - got["span_cpu"],
            }
        else:
            (project / "train.py").write_text(today)
            proc, wall, cpu = timed(
                [sys.executable, "-m", "retrolog", "replay", "w_norm", "--yes"], project
            )
            times["replay"] = {"wall": wall, "cpu": cpu}
            out = proc.stderr
    conn = sqlite3.connect(project / ".retrolog" / "retrolog.db")
    try:
        found = conn.execute(
            "SELECT restored FROM replay_runs WHERE run_id = ?", (run_id,)
        ).fetchall()
        values = conn.execute(
            "SELECT count(*) FROM logs WHERE run_id = ? AND name = 'w_norm'", (run_id,)
        ).fetchone()[0]
    finally:
        conn.close()
    if len(found) != 1 or values != epochs:
        raise SystemExit(f"run {run_id} was not replayed ({values} w_norm values):\n{out[-3000:]}")
    ((restored,),) = found
    figures: dict[str, Any] = {"times": times, "epochs_restored": restored}
    for kind in ("wall", "cpu"):
        startup = times["startup"][kind]
        figures[f"speedup_{kind}"] = times["retrain"][kind] / times["replay"][kind]
        # Beyond the start-up both pay: the training a retraining does against what the
        # replay adds to a start-up (the command, planning, restores, evaluations).
        figures[f"beyond_startup_{kind}"] = {
            "startup": startup,
            "retrain": times["retrain"][kind] - startup,
            "replay": times["replay"][kind] - startup,
        }
    w = figures["beyond_startup_wall"]
    print(
        f"  replay rep {rep}: {restored} of {epochs} epochs restored; replay "
        f"{times['replay']['wall']:.1f}s / {times['replay']['cpu']:.1f}s CPU, retrain "
        f"{times['retrain']['wall']:.1f}s / {times['retrain']['cpu']:.1f}s CPU: "
        f"{figures['speedup_wall']:.1f}x wall, {figures['speedup_cpu']:.1f}x CPU; "
        f"beyond the {w['startup']:.1f}s start-up both pay, replay {w['replay']:.1f}s "
        f"against retraining {w['retrain']:.1f}s",
        flush=True,
    )
    return figures


def write(
    output: Path,
    result: dict[str, Any],
    recorded: list[dict],
    replayed: list[dict],
    opts: argparse.Namespace,
    framework: Framework,
    config: list[str],
    last: bool,
) -> None:
    name = output.stem.removeprefix("frameworks_").split("_threads")[0]
    context = {
        "workload": f"examples/{framework.example} {' '.join(config)}",
        "reps": len(recorded or replayed),
        "torch_threads": int(EXTRA_ENV.get("OMP_NUM_THREADS", "0")) or "default",
        "retrolog_source": SOURCE,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if recorded:
        result["record"] = {
            **context,
            "runs": recorded,
            **{
                kind: {key: summary([r[kind][key] for r in recorded]) for key in recorded[0][kind]}
                for kind in ("wall", "cpu")
            },
        }
        for kind in ("wall", "cpu"):
            o, a = result["record"][kind]["overhead"], result["record"][kind]["aa"]
            s = result["record"][kind]["startup_extra_seconds"]
            print_if(
                last,
                f"{name} record overhead ({kind}): median {o['median']:+.1%} (min "
                f"{o['min']:+.1%}, max {o['max']:+.1%}); A/A floor median {a['median']:.1%} "
                f"(max {a['max']:.1%}); start-up extra median {s['median']:+.2f}s",
            )
    if replayed:
        result["replay"] = {
            **context,
            "runs": replayed,
            "speedup_wall": summary([r["speedup_wall"] for r in replayed]),
            "speedup_cpu": summary([r["speedup_cpu"] for r in replayed]),
            **{
                f"beyond_startup_{kind}": {
                    key: summary([r[f"beyond_startup_{kind}"][key] for r in replayed])
                    for key in ("startup", "retrain", "replay")
                }
                for kind in ("wall", "cpu")
            },
        }
        for kind in ("wall", "cpu"):
            s = result["replay"][f"speedup_{kind}"]
            b = result["replay"][f"beyond_startup_{kind}"]
            print_if(
                last,
                f"{name} outer replay speed-up ({kind}): median {s['median']:.1f}x "
                f"(min {s['min']:.1f}x, max {s['max']:.1f}x); beyond the start-up both pay "
                f"(median {b['startup']['median']:.1f}s), replay {b['replay']['median']:.1f}s "
                f"against retraining {b['retrain']['median']:.1f}s",
            )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")


def print_if(last: bool, text: str) -> None:
    if last:
        print(text, flush=True)


def bench(name: str, opts: argparse.Namespace) -> None:
    framework = FRAMEWORKS[name]
    scripts = framework.scripts()
    samples = opts.samples or framework.samples
    config = ["--epochs", str(opts.epochs), "--samples", str(samples)]
    parts = ["record", "replay"] if opts.part == "both" else [opts.part]
    threads = f"_threads{opts.torch_threads}" if opts.torch_threads else ""
    output = Path(opts.output_dir) / f"frameworks_{name}{threads}.json"
    result: dict[str, Any] = json.loads(output.read_text()) if output.exists() else {}
    print(f"{name}: examples/{framework.example} {' '.join(config)}", flush=True)
    recorded: list[dict] = []
    replayed: list[dict] = []
    with tempfile.TemporaryDirectory(prefix=f"bench-frameworks-{name}-") as tmp:
        for rep in range(opts.reps):
            project = new_project(Path(tmp), framework, rep)
            if "record" in parts:
                run(project, scripts[1], "--epochs", "1", "--samples", str(samples), "--seed", "9")
                recorded.append(record_rep(project, scripts, config, rep))
            if "replay" in parts:
                replayed.append(replay_rep(project, scripts, config, rep, opts.epochs))
            # Written after every repetition, so a long run stopped early keeps its figures.
            write(
                output,
                result,
                recorded,
                replayed,
                opts,
                framework,
                config,
                last=rep == opts.reps - 1,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=["hf", "lightning", "both"], default="both")
    parser.add_argument("--part", choices=["record", "replay", "both"], default="both")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=0, help="default: the framework's")
    parser.add_argument("--output-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument(
        "--torch-threads", type=int, default=0, help="default: torch's own (the cores)"
    )
    opts = parser.parse_args()
    if opts.torch_threads:
        EXTRA_ENV["OMP_NUM_THREADS"] = str(opts.torch_threads)
    SOURCE.update(source_fingerprint())
    for name in ["hf", "lightning"] if opts.framework == "both" else [opts.framework]:
        bench(name, opts)


if __name__ == "__main__":
    main()
