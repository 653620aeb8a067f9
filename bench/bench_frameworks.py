"""Benchmark: transformers' Trainer recorded with RetrologCallback, against the plain
Trainer; and replay of an epoch-level question against retraining.

Run from the repository root with the project's venv (the transformers extra):

    python bench/bench_frameworks.py                # about 15 minutes on 2 busy cores
    python bench/bench_frameworks.py --reps 3 --epochs 10

The workload is examples/hf_trainer.py (a tiny BERT from its config, synthetic
tokens), at default settings (adaptive checkpoints, eps = 1/15, torch's default
threads), in a fresh git project per repetition.

(a) Record overhead. Each repetition runs the plain script (the example without
its ``RetrologCallback``, retrolog not imported), the recorded script, and the plain
script again (an A/A pair: what one execution differs from the next on this
machine, the floor under any overhead figure), the first two in alternating order.
The span timed is ``trainer.train()`` plus, recorded, ``rl.commit()`` after it, so the
run's start (code capture, store), every checkpoint and the last writes are inside
it. A recorded run is timed as its project's second: an untimed 1-epoch run comes
first, as every run of a user's but the first finds the store made. Overhead =
recorded span / plain span - 1, per repetition; medians with min and max. Every
recorded run must write every block checkpoint the adaptive rule chose.

(b) Outer replay against retraining. In each repetition's project, today's code adds
a weight norm in the example's ``on_epoch_end`` (outer level); ``retrolog replay
w_norm --yes`` restores the epochs the rule kept and trains the others. Its wall
time (the whole command: planning, the worker's start, restores, evaluations)
against the wall time of a plain run of the same script from its start (what
retraining costs): speed-up = retrain / replay.

Results: bench/results/frameworks.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "hf_trainer.py").read_text()
GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
}
TIMED = (
    "_t0 = __import__('time').perf_counter()\n"
    "trainer.train()\n"
    "{commit}"
    "print('BENCH_SPAN', __import__('time').perf_counter() - _t0)\n"
)
RECORDED = EXAMPLE.replace(
    "trainer.train()\n", TIMED.format(commit="__import__('retrolog').commit()\n")
)
PLAIN = (
    EXAMPLE.replace("from retrolog.integrations.transformers import RetrologCallback\n", "")
    .replace(", RetrologCallback()]", "]")
    .replace("trainer.train()\n", TIMED.format(commit=""))
)
TODAY = RECORDED.replace(
    "from retrolog.integrations.transformers",
    "import retrolog as rl\nfrom retrolog.integrations.transformers",
).replace(
    "    def on_epoch_end(self, args, state, control, model=None, **kwargs):\n        pass\n",
    "    def on_epoch_end(self, args, state, control, model=None, **kwargs):\n"
    '        rl.log("w_norm", sum(p.norm().item() for p in model.parameters()))\n',
)


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    out.update(GIT_ENV, RETROLOG_PROGRESS="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out["PYTHONPATH"] = str(ROOT / "src")
    return out


def run(project: Path, script: str, *args: str) -> tuple[float, float]:
    """(span printed by the script, wall time of the process)."""
    (project / "train.py").write_text(script)
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=project, env=env(), capture_output=True,
        text=True, timeout=1800,
    )  # fmt: skip
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
    spans = [float(line.split()[1]) for line in proc.stdout.splitlines() if "BENCH_SPAN" in line]
    return spans[-1], wall


def new_project(base: Path, rep: int) -> Path:
    project = base / f"rep{rep}"
    project.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=project, check=True, env=env())
    (project / ".gitignore").write_text("hf_out/\n")
    return project


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "frameworks.json"))
    opts = parser.parse_args()
    config = ["--epochs", str(opts.epochs), "--samples", str(opts.samples)]
    reps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as tmp:
        for rep in range(opts.reps):
            project = new_project(Path(tmp), rep)
            run(project, RECORDED, "--epochs", "1", "--samples", str(opts.samples), "--seed", "9")
            order = ["plain", "recorded"] if rep % 2 == 0 else ["recorded", "plain"]
            spans: dict[str, float] = {}
            for which in order:
                spans[which], _ = run(project, PLAIN if which == "plain" else RECORDED, *config)
            spans["plain_again"], retrain_wall = run(project, PLAIN, *config)
            conn = sqlite3.connect(project / ".retrolog" / "retrolog.db")
            (summary_json, run_id) = conn.execute(
                "SELECT checkpointing, run_id FROM runs ORDER BY started_at DESC LIMIT 1"
            ).fetchone()
            conn.close()
            checkpointing = json.loads(summary_json)
            if checkpointing["chosen"] != checkpointing["written"] or checkpointing["abandoned"]:
                raise SystemExit(f"rep {rep}: a chosen checkpoint was not written: {checkpointing}")
            (project / "train.py").write_text(TODAY)
            began = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "retrolog", "replay", "w_norm", "--yes"],
                cwd=project, env=env(), capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            replay_wall = time.perf_counter() - began
            if proc.returncode != 0:
                raise SystemExit(f"replay failed:\n{proc.stderr[-3000:]}")
            conn = sqlite3.connect(project / ".retrolog" / "retrolog.db")
            found = conn.execute(
                "SELECT restored FROM replay_runs WHERE run_id = ?", (run_id,)
            ).fetchall()
            conn.close()
            if len(found) != 1:
                raise SystemExit(f"run {run_id} was not replayed:\n{proc.stderr[-3000:]}")
            ((restored,),) = found
            figures = {
                "spans": spans,
                "overhead": spans["recorded"] / spans["plain"] - 1,
                "aa": abs(spans["plain_again"] / spans["plain"] - 1),
                "extra_seconds": spans["recorded"] - spans["plain"],
                "checkpoints_chosen": checkpointing["chosen"],
                "checkpoints_written": checkpointing["written"],
                "epochs_restored": restored,
                "replay_seconds": replay_wall,
                "retrain_seconds": retrain_wall,
                "speedup": retrain_wall / replay_wall,
            }
            reps.append(figures)
            print(
                f"rep {rep}: plain {spans['plain']:.2f}s recorded {spans['recorded']:.2f}s "
                f"(overhead {figures['overhead']:+.1%}, A/A {figures['aa']:.1%}), checkpoints "
                f"{checkpointing['chosen']} chosen = {checkpointing['written']} written; replay "
                f"{replay_wall:.1f}s ({restored} of {opts.epochs} epochs restored) vs retrain "
                f"{retrain_wall:.1f}s: {figures['speedup']:.1f}x",
                flush=True,
            )
    result = {
        "workload": f"examples/hf_trainer.py {' '.join(config)}",
        "reps": reps,
        "overhead": summary([r["overhead"] for r in reps]),
        "aa_floor": summary([r["aa"] for r in reps]),
        "extra_seconds": summary([r["extra_seconds"] for r in reps]),
        "speedup": summary([r["speedup"] for r in reps]),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(opts.output).write_text(json.dumps(result, indent=2) + "\n")
    o, a, s = result["overhead"], result["aa_floor"], result["speedup"]
    print(
        f"record overhead: median {o['median']:+.1%} (min {o['min']:+.1%}, max {o['max']:+.1%}); "
        f"A/A floor median {a['median']:.1%}; outer replay speed-up: median "
        f"{s['median']:.1f}x (min {s['min']:.1f}x, max {s['max']:.1f}x)"
    )


if __name__ == "__main__":
    main()
