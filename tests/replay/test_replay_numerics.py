"""Replay is exact by default: workers run in the numerical environment the run recorded.

The script is shaped like the CNN people copy (argparse, the batch loop inside
``train()``, torch's default thread count), and sized so that torch uses its
intra-op threads: a replay with a different thread count computes the loss
differently in most steps. Recording and replay use default settings
(adaptive checkpoints, default workers, no thread variables).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

from retrolog.runtime.modules import decode as decode_modules

from conftest import Project, logged_values, read_db

pytestmark = pytest.mark.slow

CNN = """\
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.fc1 = nn.Linear(32 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def train(model, loader, optimizer):
    model.train()
    for data, target in rl.loop("step", loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        rl.log("loss", loss.item())


def test(model, x, y):
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(1)
    x = torch.randn(384, 1, 28, 28)
    y = torch.randint(0, 10, (384,))
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    with rl.checkpointing(model=model, optimizer=optimizer):
        for epoch in rl.loop("epoch", range(args.epochs)):
            train(model, loader, optimizer)
            rl.log("acc", test(model, x[:128], y[:128]))


if __name__ == "__main__":
    main()
"""

NEWEST = CNN.replace(
    "        optimizer.step()\n",
    "        optimizer.step()\n"
    '        rl.log("grad_norm", model.conv2.weight.grad.norm().item())\n',
).replace(
    '            rl.log("acc", test(model, x[:128], y[:128]))\n',
    '            rl.log("acc", test(model, x[:128], y[:128]))\n'
    '            rl.log("w_norm", sum(p.norm().item() for p in model.parameters()))\n',
)

# What the user's shell may hold: tests start from none of it, as a default shell would.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _shell(**extra: str) -> dict[str, str]:
    env = {name: "" for name in THREAD_VARIABLES}  # "" removes it (Project.env keeps none)
    env.update(RETROLOG_CHECKPOINTS="adaptive", **extra)
    return env


def _run(project: Project, *args: str, **env: str) -> None:
    environment = _shell(**env)
    project.run("train.py", *args, **{k: v for k, v in environment.items() if v})


def _cli(project: Project, *args: str, **env: str) -> Any:
    return project.cli(*args, **_shell(**env))


_values = logged_values


def _fresh(project: Project, args: list[str], names: tuple[str, ...], **env: str) -> dict:
    """What a fresh run of today's code logs for ``names``, keyed by (name, epoch, step)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        _run(project, *args, RETROLOG_STORE=str(store), **env)
        values = _values(store / "retrolog.db")
    return {(n, e, s): v for (_, n, e, s), v in values.items() if n in names}


def _backfilled(project: Project, run_id: str, names: tuple[str, ...]) -> dict:
    values = _values(
        project.root / ".retrolog" / "retrolog.db",
        "WHERE l.run_id = ? AND l.origin = 'backfilled'",
        (run_id,),
    )
    return {(n, e, s): v for (_, n, e, s), v in values.items() if n in names}


def _record(project: Project, runs: list[tuple[list[str], dict[str, str]]]) -> list[str]:
    project.write("train.py", CNN)
    for args, env in runs:
        _run(project, *args, **env)
    project.write("train.py", NEWEST)
    ids = read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")
    return [str(r) for (r,) in ids]


def _worker_outputs(project: Project) -> list[dict[str, Any]]:
    replays = sorted((project.root / ".retrolog" / "replays").iterdir())
    return [json.loads(p.read_text()) for p in replays[-1].glob("*.out.json")]


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def test_default_replay_keeps_the_recorded_threads_and_is_bit_exact(project: Project) -> None:
    runs = _record(project, [(["--lr", "0.05"], {}), (["--lr", "0.1", "--epochs", "2"], {})])
    recorded = [json.loads(str(n)) for (n,) in read_db(project.root, "SELECT numerics FROM runs")]
    threads = _torch_threads()  # torch's default here, what the runs trained with
    assert all(n["torch"]["intra_op_threads"] == threads for n in recorded)
    assert all(n["env"]["OMP_NUM_THREADS"] is None for n in recorded)

    # The shell replaying is not the one that recorded: it pins one thread per process.
    out = _cli(project, "replay", "w_norm", "--yes", OMP_NUM_THREADS="1")
    assert out.returncode == 0, out.stderr
    assert "differs" not in out.stderr and "not exact" not in out.stderr
    assert f"keeps its run's recorded {threads} intra-op thread(s)" in out.stderr
    cores = len(os.sched_getaffinity(0))
    assert f"on {max(1, cores // threads)} worker(s)" in out.stderr
    assert [o["threads"] for o in _worker_outputs(project)] == [threads] * len(runs)
    # Workers were forked from one server that had imported what the runs had (torch
    # and the optimizer's lazy imports), not started as new interpreters.
    assert "workers of 2 of 2 run(s) start from a fork server that imports torch" in out.stderr
    # ... which timed a forked worker's own start on this machine before the plan was made.
    measured = re.search(r"a forked worker's own start \(.*?\) measured at (\d+\.\d+)s", out.stderr)
    assert measured is not None and 0.0 < float(measured.group(1)) < 5.0, out.stderr
    assert "2 worker(s) forked from 1 fork server(s)" in out.stderr
    # ... the one started on a guess before the plan: no other server was needed.
    replays = sorted((project.root / ".retrolog" / "replays").iterdir())
    assert sorted(p.name for p in replays[-1].glob("forkserver-*.log")) == ["forkserver-0.log"]
    (digest,) = {d for (d,) in read_db(project.root, "SELECT modules FROM runs")}
    ((blob,),) = read_db(project.root, "SELECT names FROM module_sets WHERE digest = ?", (digest,))
    modules = decode_modules(blob)
    assert modules is not None and {"torch", "torch.optim", "torch._dynamo"} <= set(modules)
    assert not [m for m in modules if m.startswith("retrolog") or m in ("train", "__main__")]
    out = _cli(project, "replay", "grad_norm", "--yes")
    assert out.returncode == 0, out.stderr
    assert "differs" not in out.stderr

    names = ("w_norm", "grad_norm", "loss", "acc")
    fresh = [
        _fresh(project, ["--lr", "0.05"], names),
        _fresh(project, ["--lr", "0.1", "--epochs", "2"], names),
    ]
    for run_id, reference in zip(runs, fresh, strict=True):
        for name in ("w_norm", "grad_norm"):
            expected = {k: v for k, v in reference.items() if k[0] == name}
            assert expected
            assert _backfilled(project, run_id, (name,)) == expected, (run_id, name)
    # Nothing is marked inexact, and the dataframe has no inexact column.
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE inexact IS NOT NULL") == [(0,)]
    frame = _cli(project, "dataframe", "w_norm", "--json")
    assert frame.returncode == 0 and "inexact" not in frame.stdout

    # --verify: each run's own code at the outer loop reproduces what it recorded.
    verified = _cli(project, "replay", "--verify", "--yes")
    assert verified.returncode == 0, verified.stderr
    assert "Verified 2 run(s): 2 replay exactly" in verified.stderr
    kinds = read_db(project.root, "SELECT kind, COUNT(*) FROM replays GROUP BY kind")
    assert dict(kinds) == {"backfill": 2, "verify": 1}


def test_a_run_recorded_with_one_thread_replays_with_one(project: Project) -> None:
    runs = _record(
        project, [(["--epochs", "2"], {"OMP_NUM_THREADS": "1"}), (["--epochs", "2"], {})]
    )
    recorded = {
        str(r): json.loads(str(n))
        for r, n in read_db(project.root, "SELECT run_id, numerics FROM runs")
    }
    assert recorded[runs[0]]["env"]["OMP_NUM_THREADS"] == "1"
    assert recorded[runs[0]]["torch"]["intra_op_threads"] == 1
    out = _cli(project, "replay", "w_norm", "--yes")
    assert out.returncode == 0, out.stderr
    assert "differs" not in out.stderr
    threads = {o["threads"] for o in _worker_outputs(project)}
    assert threads == {1, _torch_threads()}
    fresh_one = _fresh(project, ["--epochs", "2"], ("w_norm",), OMP_NUM_THREADS="1")
    fresh_default = _fresh(project, ["--epochs", "2"], ("w_norm",))
    assert _backfilled(project, runs[0], ("w_norm",)) == fresh_one
    assert _backfilled(project, runs[1], ("w_norm",)) == fresh_default


def test_fewer_threads_on_request_mark_the_values(project: Project) -> None:
    runs = _record(project, [(["--epochs", "2"], {})])
    threads = _torch_threads()
    if threads < 2:
        pytest.skip("needs a machine where torch uses two or more threads")
    out = _cli(project, "replay", "w_norm", "--yes", "--threads", "1", "--allow-inexact")
    assert out.returncode == 0, out.stderr
    assert "as asked (--threads)" in out.stderr
    assert f"{runs[0]}: 1 intra-op thread(s) asked for, {threads} recorded" in out.stderr
    marks = read_db(
        project.root, "SELECT DISTINCT inexact FROM logs WHERE name = 'w_norm'"
    )  # mismatch when the check caught a difference, environment otherwise
    assert marks and all(m in ("mismatch", "environment") for (m,) in marks)
    frame = json.loads(_cli(project, "dataframe", "w_norm", "--json").stdout)
    assert {row["inexact"] for row in frame} == {"w_norm"}
    show = _cli(project, "show", runs[0])
    assert "backfilled w_norm" in show.stdout and "inexact" in show.stdout.lower()
