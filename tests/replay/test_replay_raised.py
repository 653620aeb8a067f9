"""A run that an exception ended is replayed to where it stopped, and no further.

The scripts are shaped as users write them (argparse, the training loop in functions,
a DataLoader) and recorded at the default settings (the adaptive checkpoint policy,
torch's default threads). A NaN check raises at epoch 3, in the step loop or at the
epoch level; the replay raises it again there, which is what the run did: its values
for every context the run completed are backfilled, bit for bit those of a fresh run
of today's code (which raises there too), and the replay exits 0 saying where the run
stopped. A replay that raises something else, somewhere else, or goes past the place
without raising did not replay the run: exit 1, with what each side raised and where.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from conftest import Project, logged_values, read_db

pytestmark = pytest.mark.slow

TRAIN = """\
import argparse
import math
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl


def make_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(64, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


def train_epoch(model, opt, loader, epoch, check, bad_epoch):
    total = 0.0
    for step, (xb, yb) in enumerate(rl.loop("step", loader)):
        opt.zero_grad()
        loss = ((model(xb).squeeze(-1) - yb) ** 2).mean()
        if epoch == bad_epoch and step == 2:
            loss = loss * float("nan")  # a bad batch
        if check == "step" and math.isnan(loss.item()):
            raise FloatingPointError(f"loss is NaN at epoch {epoch}, step {step}")
        loss.backward()
        opt.step()
        total += loss.item()
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--check", choices=["step", "epoch"], default="step")
    args = parser.parse_args()
    bad_epoch = int(os.environ.get("BAD_EPOCH", "3"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = make_loader()
    with rl.checkpointing(model=model, optimizer=opt):
        for epoch in rl.loop("epoch", range(args.epochs)):
            total = train_epoch(model, opt, loader, epoch, args.check, bad_epoch)
            if args.check == "epoch" and math.isnan(total):
                raise FloatingPointError(f"the loss of epoch {epoch} is NaN")
            rl.log("loss", total)


if __name__ == "__main__":
    main()
"""

STEP_STATEMENT = (
    "        total += loss.item()\n",
    '        total += loss.item()\n        rl.log("grad_norm", float(model.weight.grad.norm()))\n',
)
EPOCH_STATEMENT = (
    '            rl.log("loss", total)\n',
    '            rl.log("loss", total)\n            rl.log("w_norm", float(model.weight.norm()))\n',
)

ADAPTIVE = {"RETROLOG_CHECKPOINTS": "adaptive"}


def _today(*statements: tuple[str, str]) -> str:
    source = TRAIN
    for old, new in statements:
        assert old in source
        source = source.replace(old, new)
    return source


def _record(project: Project, *args: str) -> str:
    project.write("train.py", TRAIN)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    ran = project.run("train.py", *args, check=False, **ADAPTIVE)
    assert ran.returncode == 1 and "FloatingPointError" in ran.stderr, ran.stderr
    ((run_id, status),) = read_db(project.root, "SELECT run_id, status FROM runs")
    assert status == "crashed"
    return str(run_id)


def _fresh(project: Project, *args: str) -> dict[tuple[object, ...], object]:
    """What today's script logs when run afresh (it raises where the run did)."""
    with tempfile.TemporaryDirectory() as tmp:
        ran = project.run("train.py", *args, check=False, RETROLOG_STORE=f"{tmp}/s", **ADAPTIVE)
        assert ran.returncode == 1 and "FloatingPointError" in ran.stderr, ran.stderr
        return {k[1:]: v for k, v in logged_values(Path(tmp) / "s" / "retrolog.db").items()}


def _stored(project: Project, *names: str) -> dict[tuple[object, ...], object]:
    return {
        k[1:]: v
        for k, v in logged_values(project.root / ".retrolog" / "retrolog.db").items()
        if k[1] in names
    }


@pytest.mark.usefixtures("whole_machine")
def test_a_run_that_raised_in_its_step_loop_is_replayed_to_where_it_stopped(
    project: Project,
) -> None:
    run_id = _record(project, "--epochs", "6")
    # Where it stopped is recorded with the exception: shown with the run.
    shown = project.cli("show", run_id)
    assert "FloatingPointError: loss is NaN at epoch 3, step 2" in shown.stdout
    assert "[at train.py:" in shown.stdout and " in train_epoch]" in shown.stdout

    project.write("train.py", _today(STEP_STATEMENT, EPOCH_STATEMENT))
    done = project.cli("replay", "grad_norm,w_norm", "--yes")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(
        rf"run {run_id}: replay stopped where it did during recording: FloatingPointError\("
        r"'loss is NaN at epoch 3, step 2'\) at train\.py, line \d+, in train_epoch, "
        r"in epoch 3, step 2",
        done.stderr,
    ), done.stderr
    assert read_db(project.root, "SELECT status FROM replay_runs") == [("replayed",)]

    backfilled = _stored(project, "grad_norm", "w_norm")
    # Every step it completed (epochs 0-2, and steps 0 and 1 of epoch 3); every epoch it
    # completed (0-2): nothing of the step it raised in, nor of the epoch.
    steps = {("grad_norm", e, s) for e in range(3) for s in range(4)}
    steps |= {("grad_norm", 3, 0), ("grad_norm", 3, 1)}
    assert set(backfilled) == steps | {("w_norm", e, None) for e in range(3)}
    fresh = _fresh(project, "--epochs", "6")
    assert backfilled == {k: v for k, v in fresh.items() if k[0] in ("grad_norm", "w_norm")}


@pytest.mark.usefixtures("whole_machine")
def test_a_run_that_raised_at_the_epoch_level_is_replayed_to_where_it_stopped(
    project: Project,
) -> None:
    """The NaN check after the step loop: the epoch's block ran to its end (its checkpoint,
    if taken, holds the NaN weights); the replay of an epoch-level statement restores the
    blocks before it and executes that one, and raises where the run did."""
    run_id = _record(project, "--check", "epoch")
    project.write("train.py", _today(EPOCH_STATEMENT))
    done = project.cli("replay", "w_norm", "--yes")
    assert done.returncode == 0, done.stderr
    assert re.search(
        rf"run {run_id}: replay stopped where it did during recording: FloatingPointError\("
        r"'the loss of epoch 3 is NaN'\) at train\.py, line \d+, in main, in epoch 3\n",
        done.stderr,
    ), done.stderr
    backfilled = _stored(project, "w_norm")
    assert set(backfilled) == {("w_norm", e, None) for e in range(3)}
    fresh = _fresh(project, "--check", "epoch")
    assert backfilled == {k: v for k, v in fresh.items() if k[0] == "w_norm"}


NUMPY_TRAIN = """\
import argparse
import os
import signal
import time

import numpy as np
import retrolog as rl


def train_epoch(state, epoch):
    for step in rl.loop("step", range(3)):
        if os.environ.get("FAIL_AT") == f"{epoch}.{step}":
            raise ValueError(f"bad batch at epoch {epoch}")
        if os.environ.get("INTERRUPT_AT") == f"{epoch}.{step}":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        state["w"] += np.random.standard_normal(2)
        time.sleep(0.05)  # the step's work: restoring a block is cheaper than running it
        rl.log("w0", float(state["w"][0]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    np.random.seed(0)
    state = {"w": np.zeros(2)}
    with rl.checkpointing(state=state):
        for epoch in rl.loop("epoch", range(args.epochs)):
            train_epoch(state, epoch)
            rl.log("w1", float(state["w"][1]))


main()
"""

NUMPY_STATEMENT = (
    '        rl.log("w0", float(state["w"][0]))\n',
    '        rl.log("w0", float(state["w"][0]))\n'
    '        rl.log("w_sum", float(state["w"].sum()))\n',
)


def _record_numpy(project: Project, **env: str) -> str:
    project.write("train.py", NUMPY_TRAIN)
    ran = project.run("train.py", check=False, **ADAPTIVE, **env)
    assert ran.returncode != 0, ran.stderr
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs WHERE status = 'crashed'")
    project.write("train.py", NUMPY_TRAIN.replace(*NUMPY_STATEMENT))
    return str(run_id)


def _replay_fails(project: Project, **env: str) -> str:
    done = project.cli("replay", "w_sum", "--yes", **env)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    # The segment that did not replay the run keeps none of its values; one before it
    # (when the plan split the run) may have finished: the run is then partial.
    ((status,),) = read_db(project.root, "SELECT status FROM replay_runs")
    assert status in ("failed", "partial")
    assert all(k[1] is not None and k[1] < 2 for k in _stored(project, "w_sum"))
    return done.stderr


def test_a_replay_that_raises_elsewhere_is_a_failure_that_says_where(project: Project) -> None:
    run_id = _record_numpy(project, FAIL_AT="2.1")
    err = _replay_fails(project, FAIL_AT="1.2")  # the same exception, an epoch early
    # A plan split by the recorded timings can start a segment at epoch 1: that worker
    # restored epoch 0 first, so its account of the restore leads and the comparison with
    # the recording follows in brackets.
    assert re.search(
        rf"run {run_id}: replay (failed|partial): (the script raised ValueError: bad batch at "
        r"epoch 1 at train\.py, line 13 .*, after the worker had restored the checkpoints of "
        r"'epoch' iteration 0 .* \(Compared with the recording: )?its replay raised "
        r"ValueError\('bad batch at epoch 1'\) at train\.py, line 13, in train_epoch, in epoch "
        r"1, step 2; during recording the run raised ValueError\('bad batch at epoch 2'\) at "
        r"train\.py, line 13, in train_epoch, in epoch 2, step 1(\.\))?; log: ",
        err,
    ), err


def test_a_replay_that_raises_another_exception_is_a_failure_that_says_what(
    project: Project,
) -> None:
    run_id = _record_numpy(project, FAIL_AT="2.1")
    bad = NUMPY_TRAIN.replace(*NUMPY_STATEMENT).replace(
        'rl.log("w_sum", float(state["w"].sum()))', 'rl.log("w_sum", float(state["w"][2]))'
    )
    project.write("train.py", bad)
    err = _replay_fails(project, FAIL_AT="2.1")
    assert re.search(
        rf"run {run_id}: replay failed: its replay raised IndexError\('index 2 is out of "
        r"bounds for axis 0 with size 2'\) at train\.py, line 19, in train_epoch, in epoch 0, "
        r"step 0; during recording the run raised ValueError\('bad batch at epoch 2'\)",
        err,
    ), err


def test_a_replay_that_goes_past_where_the_run_raised_is_a_failure(project: Project) -> None:
    run_id = _record_numpy(project, FAIL_AT="2.1")
    err = _replay_fails(project)  # FAIL_AT unset: nothing raises
    assert re.search(
        rf"run {run_id}: replay (failed|partial): during recording the run raised ValueError\("
        r"'bad batch at epoch 2'\) at train\.py, line 13, in train_epoch, in epoch 2, step 1; "
        r"its replay went past that place without raising",
        err,
    ), err


def test_a_run_stopped_by_ctrl_c_is_replayed_as_far_as_it_got(project: Project) -> None:
    """Ctrl-C came from outside the script: the replay runs on, as for a killed run, and
    only what the run completed is backfilled."""
    run_id = _record_numpy(project, INTERRUPT_AT="2.1")
    ((error,),) = read_db(project.root, "SELECT error FROM runs")
    # Where the interrupt landed is recorded with it.
    assert error == "KeyboardInterrupt:  [at train.py:15 in train_epoch]", error
    done = project.cli("replay", "w_sum", "--yes")
    assert done.returncode == 0, done.stderr
    assert f"run {run_id} crashed: values the replay computed past where the run got" in (
        done.stderr
    )
    completed = {(e, s) for e in (0, 1) for s in range(3)} | {(2, 0)}
    assert {k[1:] for k in _stored(project, "w_sum")} == completed


def test_a_checkpoint_taken_as_the_exception_left_the_loop_is_not_restored(
    project: Project,
) -> None:
    """Every block checkpointed (the unit isolated from the adaptive rule's choice): the
    step loop the exception left checkpoints epoch 2 as if its block had ended. An
    epoch-level statement's replay restores blocks; restoring that one would skip the
    failing step, so it is executed, and the replay raises where the run did."""
    project.write("train.py", NUMPY_TRAIN)
    ran = project.run("train.py", check=False, RETROLOG_CHECKPOINTS="every", FAIL_AT="2.1")
    assert ran.returncode == 1, ran.stderr
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    kinds = read_db(
        project.root,
        "SELECT c.kind, l.iteration FROM checkpoints c LEFT JOIN loops l"
        " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id ORDER BY c.checkpoint_id",
    )
    assert ("block", 2) in kinds and ("end", None) in kinds  # taken as the exception left
    project.write(
        "train.py",
        NUMPY_TRAIN.replace(
            '            rl.log("w1", float(state["w"][1]))\n',
            '            rl.log("w1", float(state["w"][1]))\n'
            '            rl.log("w_norm", float(abs(state["w"]).sum()))\n',
        ),
    )
    done = project.cli("replay", "w_norm", "--yes", FAIL_AT="2.1")
    assert done.returncode == 0, done.stderr
    assert (
        f"run {run_id}: replay stopped where it did during recording: ValueError('bad batch at "
        "epoch 2') at train.py, line 13, in train_epoch, in epoch 2, step 1"
    ) in done.stderr, done.stderr
    assert {k[1:] for k in _stored(project, "w_norm")} == {(0, None), (1, None)}
