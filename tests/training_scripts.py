"""Training scripts the checkpoint tests record, and the digest they log."""

from __future__ import annotations

import fcntl
import inspect
import json
import os
import shutil
import sqlite3
from pathlib import Path

from conftest import MACHINE_LOCK_DIR, Project

# A numpy run: fast to record. Two runs with one seed hold identical states (dedup).
NUMPY_TRAIN = """\
import sys
import time
from pathlib import Path

import numpy as np

import retrolog as rl

epochs = rl.arg("epochs", 4)
seed = rl.arg("seed", 0)
sleep = rl.arg("sleep", 0.0)
pause = rl.arg("pause", "")  # after epoch 1, wait for this file (a run still recording)
np.random.seed(seed)
w = np.zeros(2000)
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(epochs)):
        for step in rl.loop("step", range(3)):
            w += np.random.random(2000)
            time.sleep(sleep)
        rl.log("score", float(w[:10].sum()))
        if pause and epoch == 1:
            Path(pause + ".ready").write_text("")
            deadline = time.monotonic() + 120
            while not Path(pause).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
"""


# 100 steps a second, each step's number logged and printed: a test kills it mid-run.
STEPPING = """\
import time
import retrolog as rl
for step in rl.loop("step", range(100_000)):
    rl.log("i", step)
    print(step, flush=True)
    time.sleep(0.01)
"""


# A script shaped like a real one: argparse, loops inside a function, a DataLoader, a
# scheduler. "# HINDSIGHT" marks where a test inserts a statement (W_NORM) at the end of
# each epoch.
REAL_SHAPED = """\
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl


def train(args):
    torch.manual_seed(args.seed)
    x = torch.randn(8192, 64)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                        nn.Linear(512, 2))
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with rl.checkpointing(net=net, opt=opt):
        for epoch in rl.loop("epoch", range(args.epochs)):
            for xb, yb in rl.loop("step", loader):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(net(xb), yb)
                loss.backward()
                opt.step()
                rl.log("loss", loss.item())
            sched.step()
            # HINDSIGHT


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args())
"""
W_NORM = 'rl.log("w_norm", float(sum(p.norm() ** 2 for p in net.parameters())))'


def digest(model, optimizer) -> str:  # type: ignore[no-untyped-def]
    """The exact state of a model and its optimizer (the script logs it each epoch)."""
    import hashlib

    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for key in sorted(state):
            h.update(state[key].numpy().tobytes())
    return h.hexdigest()


SCORES = [0.50, 0.80, 0.70, 0.60, 0.75]
LOSSES = [0.9, 0.4, 0.6, 0.3, 0.5]

# A small torch run: val_acc peaks at epoch (1 - seed) % 5, val_loss bottoms at (3 - seed) % 5.
TORCH_TRAIN = f"""\
import torch
from torch import nn

import retrolog as rl

torch.set_num_threads(1)
seed = rl.arg("seed", 0)
torch.manual_seed(seed)
x = torch.randn(64, 4)
y = (x.sum(dim=1) > 0).long()
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.Adam(net.parameters(), lr=0.05)
SCORES = {SCORES!r}
LOSSES = {LOSSES!r}

{inspect.getsource(digest)}

with rl.checkpointing(net=net, opt=opt):
    for epoch in rl.loop("epoch", range(5)):
        for step in rl.loop("step", range(4)):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x + 0.1 * torch.randn_like(x)), y)
            loss.backward()
            opt.step()
            rl.log("loss", loss.item())
        rl.log("digest", digest(net, opt))
        rl.log("draw", torch.rand(1).item())
        rl.log("val_acc", SCORES[(epoch + seed) % 5])
        rl.log("val_loss", LOSSES[(epoch + seed) % 5])
rl.log("final_digest", digest(net, opt))
"""


def new_project(root: Path) -> Project:
    root.mkdir(parents=True)
    project = Project(root)
    project.git("init", "--quiet", "--initial-branch=main")
    project.write("README.md", "a project\n")
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "initial")
    return project


def shared_torch_runs() -> Path:
    """The project directory of :func:`record_torch_runs`, recorded once per pytest session
    and shared by its workers: test_gc, test_restore and test_export each copy it for
    every test and never write it, so one recording serves all three files.

    It lives in the machine lock's directory (tests/conftest.py), which the controlling
    pytest process makes before its workers start and removes at the end; a file lock
    lets the first worker record while the others wait for it."""
    base = Path(os.environ[MACHINE_LOCK_DIR])
    root = base / "torch-runs" / "proj"
    with (base / "torch-runs.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = base / "torch-runs" / "recorded"
        if not done.exists():
            if root.exists():  # a worker that failed half-way through recording
                shutil.rmtree(root)
            record_torch_runs(root)
            done.touch()
    return root


def record_torch_runs(root: Path) -> Project:
    """A project at ``root`` with two runs of TORCH_TRAIN (seeds 0 and 1), every block
    checkpointed."""
    project = new_project(root)
    project.write("train.py", TORCH_TRAIN)
    project.run("train.py", "--kwargs", "seed=0", RETROLOG_CHECKPOINTS="every")
    project.run("train.py", "--kwargs", "seed=1", RETROLOG_CHECKPOINTS="every")
    return project


# (epoch, w_norm) of each epoch of a run, in epoch order.
NORMS = (
    "SELECT e.iteration, l.value FROM logs l JOIN loops e ON e.run_id = l.run_id"
    " AND e.ctx_id = l.ctx_id WHERE l.name = 'w_norm' ORDER BY e.iteration"
)


def fresh_w_norms(*args: str) -> list[tuple[int, float]]:
    """(epoch, w_norm) of a fresh run of REAL_SHAPED with W_NORM added and ``args``, at
    default settings (torch's own threads, the adaptive rule): what a replay of W_NORM
    into a run recorded with ``args`` must backfill, whatever store and executor it used.

    Run once per pytest session for each ``args`` and shared, as :func:`shared_torch_runs`
    is, by the default-settings tests that compare against it (S3, PostgreSQL, Ray,
    migrate, no repository). The caller holds the ``whole_machine`` fixture: the run
    trains at torch's own threads."""
    base = Path(os.environ[MACHINE_LOCK_DIR]) / "fresh-w-norms"
    base.mkdir(exist_ok=True)
    done = base / ("args" + "".join(f"_{a}" for a in args) + ".json")
    with (base / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            root = base / done.stem
            if root.exists():  # a worker that failed half-way through its run
                shutil.rmtree(root)
            root.mkdir()
            project = Project(root)
            project.write("train.py", REAL_SHAPED.replace("# HINDSIGHT", W_NORM))
            store = root / "store"
            project.run("train.py", *args, RETROLOG_STORE=str(store), RETROLOG_CHECKPOINTS="")
            conn = sqlite3.connect(store / "retrolog.db")
            try:
                rows = conn.execute(NORMS).fetchall()
            finally:
                conn.close()
            # JSON keeps a float's every bit (its shortest repr reads back the same).
            done.write_text(json.dumps(rows))
    return [(int(e), float(v)) for e, v in json.loads(done.read_text())]
