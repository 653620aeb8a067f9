"""The training workload of bench_replay.py: two code versions, today's code, FlorDB's twin.

A small CNN on synthetic 28x28 images (class templates plus noise, generated from
a seed: no download), trained on the CPU with one thread, so two replay workers
on a 2-core machine do not fight over cores (``at_torch_threads`` gives the same
scripts at another thread count, or at torch's own default). It has what makes replay hard:
dropout and a shuffled DataLoader (both consume the RNG), an LR scheduler that is
not named in ``checkpointing`` (pseudo-resume must rebuild it), an evaluation
after the nested loop in every epoch (code a replay cannot skip).

- V1: the first code version; V2: the same computation after small edits (a
  comment, an added constant, a renamed variable), so replay has to propagate the
  hindsight statements into two different files;
- NEWEST: today's code, V2 plus two hindsight statements: ``w_norm`` (weight norm,
  in the epoch loop after the nested loop: an outer-loop probe) and ``grad_norm``
  (gradient norm in the step loop: an inner-loop probe); NEWEST_WITH_SUFFIX adds
  ``final_norm`` after the loop (a suffix probe);
- ``flordb_source(text)``: the same script written against FlorDB 4.0.1's API
  (``flor.arg``, ``flor.checkpointing``, ``flor.loop``, ``flor.log``), line for
  line, so both libraries run the same computation.

Sizes come in through ``--kwargs`` (``epochs``, ``n_train``), as a user's would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.harness import BenchError

OUTER_NAME = "w_norm"
INNER_NAME = "grad_norm"
SUFFIX_NAME = "final_norm"  # after the loop (a suffix probe: bench/replay_breakdown.py)

# (code version, --kwargs) of the recorded runs, in recording order: 3 runs, 2 versions.
RUNS: list[tuple[str, dict[str, str]]] = [
    ("v1", {"lr": "0.05"}),
    ("v1", {"lr": "0.1"}),
    ("v2", {"lr": "0.1"}),
]

V1 = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl

torch.set_num_threads(1)
lr = rl.arg("lr", 0.05)
epochs = rl.arg("epochs", 6)
n_train = rl.arg("n_train", 6000)
n_test = 500
torch.manual_seed(0)
templates = torch.randn(10, 1, 28, 28)
labels = torch.randint(0, 10, (n_train + n_test,))
images = templates[labels] + 2.0 * torch.randn(n_train + n_test, 1, 28, 28)
test_x, test_y = images[n_train:], labels[n_train:]
loader = DataLoader(TensorDataset(images[:n_train], labels[:n_train]), batch_size=64, shuffle=True)
net = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
)
opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def evaluate():
    net.eval()
    with torch.no_grad():
        acc = (net(test_x).argmax(1) == test_y).float().mean().item()
    net.train()
    return acc


with rl.checkpointing(model=net, optimizer=opt):
    for epoch in rl.loop("epoch", range(epochs)):
        for xb, yb in rl.loop("step", loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            rl.log("loss", loss.item())
        sched.step()
        rl.log("acc", evaluate())
print("done")
"""

# Version 2: a user's later edits that do not change the computation.
V2 = (
    V1.replace("n_test = 500\n", "n_test = 500  # held out for evaluate()\nhidden = 64\n")
    .replace("loader = DataLoader(", "train_loader = DataLoader(")
    .replace('rl.loop("step", loader)', 'rl.loop("step", train_loader)')
    .replace("nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10)",
             "nn.Linear(32 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, 10)")
    .replace("        sched.step()\n", "        # one LR step per epoch\n        sched.step()\n")
)  # fmt: skip

# Today's code: V2 plus an outer-loop and an inner-loop hindsight statement.
NEWEST = V2.replace(
    '            rl.log("loss", loss.item())\n',
    '            rl.log("loss", loss.item())\n'
    f'            rl.log("{INNER_NAME}", '
    "torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item())\n",
).replace(
    '        rl.log("acc", evaluate())\n',
    '        rl.log("acc", evaluate())\n'
    f'        rl.log("{OUTER_NAME}", '
    "torch.cat([p.detach().flatten() for p in net.parameters()]).norm().item())\n",
)

# Today's code with a suffix statement as well (bench/replay_breakdown.py only: the
# FlorDB comparison keeps NEWEST).
NEWEST_WITH_SUFFIX = NEWEST.replace(
    'print("done")\n',
    f'rl.log("{SUFFIX_NAME}", net[0].weight.norm().item())\nprint("done")\n',
)

VERSIONS = {"v1": V1, "v2": V2}
PIN_ONE_THREAD = "torch.set_num_threads(1)\n"


def at_torch_threads(text: str, threads: int | None) -> str:
    """``text`` training with ``threads`` torch threads; None leaves torch's own default
    (one per core), as a user's script that never calls ``set_num_threads`` does."""
    if PIN_ONE_THREAD not in text:
        raise AssertionError("the workload no longer pins its thread count")
    if threads is None:
        return text.replace(PIN_ONE_THREAD, "")
    return text.replace(PIN_ONE_THREAD, f"torch.set_num_threads({threads})\n")


def flordb_source(text: str) -> str:
    """The same script against FlorDB's API: same statements, same order, same computation."""
    return text.replace("import retrolog as rl\n", "import flordb as flor\n").replace(
        "rl.", "flor."
    )


def check_sources() -> None:
    """Fail if an edit above stopped matching (a replace that matched nothing)."""
    for name, text in (("V2", V2), ("NEWEST", NEWEST)):
        if text.count("\n") <= V1.count("\n"):
            raise AssertionError(f"{name} did not receive its edits")
    for name in (OUTER_NAME, INNER_NAME):
        if f'rl.log("{name}"' not in NEWEST:
            raise AssertionError(f"NEWEST lacks the {name} statement")
    if f'rl.log("{SUFFIX_NAME}"' not in NEWEST_WITH_SUFFIX:
        raise AssertionError(f"NEWEST_WITH_SUFFIX lacks the {SUFFIX_NAME} statement")
    if "train_loader" not in V2 or "hidden" not in V2:
        raise AssertionError("V2 lacks its edits")
    if "rl." in flordb_source(NEWEST):
        raise AssertionError("the FlorDB twin still calls retrolog")


# -- what the benchmarks that record and replay this workload share ------------------------

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.invalid",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.invalid",
}


def environment() -> dict[str, str]:
    """This process's environment without retrolog's settings, with a git identity and no
    progress bars: what a benchmark's recordings and replays run with."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
    env.update(GIT_IDENTITY)
    env["RETROLOG_PROGRESS"] = "0"
    return env


def read_values(project: Path, name: str) -> dict[Any, Any]:
    """The backfilled values of ``name`` in ``project``'s store, by (run, context)."""
    import sqlite3

    conn = sqlite3.connect(project / ".retrolog" / "retrolog.db")
    try:
        rows = conn.execute(
            "SELECT run_id, ctx_id, value FROM logs WHERE name = ? AND origin = 'backfilled'",
            (name,),
        ).fetchall()
    finally:
        conn.close()
    return {(run, ctx): value for run, ctx, value in rows}


def record_runs(
    python: Path, root: Path, kwargs: list[list[str]], env: dict[str, str]
) -> list[str]:
    """A git project at ``root`` with V2 committed, one recorded run per entry of
    ``kwargs`` (its ``--kwargs``), then NEWEST written over it; the runs' ids, in order."""
    import sqlite3
    import subprocess

    root.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", "."], cwd=root, check=True, env=env)
    (root / "train.py").write_text(V2)
    subprocess.run(["git", "add", "train.py"], cwd=root, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "v2"], cwd=root, check=True, env=env)
    for run_kwargs in kwargs:
        done = subprocess.run(
            [str(python), "train.py", "--kwargs", *run_kwargs],
            cwd=root, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise BenchError(f"recording failed:\n{done.stderr}")
    (root / "train.py").write_text(NEWEST)
    conn = sqlite3.connect(root / ".retrolog" / "retrolog.db")
    try:
        return [r[0] for r in conn.execute("SELECT run_id FROM runs ORDER BY started_at")]
    finally:
        conn.close()


def timed_replay(
    python: Path, project: Path, args: list[str], env: dict[str, str]
) -> tuple[float, str]:
    """``retrolog replay ARGS --yes`` in ``project``: its wall seconds and stderr; a
    BenchError unless it succeeds with every value exact."""
    import subprocess
    import time

    started = time.perf_counter()
    done = subprocess.run(
        [str(python), "-m", "retrolog", "replay", *args, "--yes"],
        cwd=project, env=env, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise BenchError(f"replay {args} failed:\n{done.stderr}")
    if "differs" in done.stderr:
        raise BenchError(f"replay {args} was not exact:\n{done.stderr}")
    return seconds, done.stderr
