"""What a block keeps on a named module comes back with its checkpoint, or the block executes.

The scripts are the actor-critic's shape in small: the step loop appends to
lists on the model (``model.rewards``, ``model.saved``), the update after the
loop reads and empties them. Kept as data, the lists travel with the
checkpoint and an outer-loop statement replays from restored blocks, bit for
bit; kept with their autograd graph, no checkpoint can hold them, so the plan
says so and executes every block, still bit for bit. State a block changes on
an object that is not named makes the code after a restored block fail: the
replay then reports what failed, where, and after which restores.
"""

from __future__ import annotations

import re
import sqlite3
import tempfile
from pathlib import Path

import pytest

from conftest import Project

pytestmark = pytest.mark.slow

AGENT = """\
import time

import torch
from torch import nn

import retrolog as rl


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.rewards = []
        self.saved = []


def main():
    torch.manual_seed(0)
    model = Agent()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with rl.checkpointing(model=model, opt=opt):
        for epoch in rl.loop("epoch", range(4)):
            for step in rl.loop("step", range(5)):
                x = torch.randn(4)
                KEEP
                model.rewards.append(float(x.sum()))
                time.sleep(0.04)  # a block worth restoring rather than executing
            UPDATE
            loss = -(logits * torch.tensor(model.rewards).unsqueeze(1)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            del model.rewards[:]
            del model.saved[:]
            rl.log("loss", loss.item())


main()
"""

AS_DATA = AGENT.replace("KEEP", "model.saved.append(x)").replace(
    "UPDATE", "logits = model.fc(torch.stack(model.saved))"
)
WITH_GRAPH = AGENT.replace("KEEP", "model.saved.append(model.fc(x))").replace(
    "UPDATE", "logits = torch.stack(model.saved)"
)
PROBE = (
    '            rl.log("loss", loss.item())\n',
    '            rl.log("loss", loss.item())\n'
    '            rl.log("w", model.fc.weight.sum().item())\n',
)
# Reads the attribute itself, before the update empties it.
PROBE_ATTR = (
    "            loss = -(",
    '            rl.log("n_saved", len(model.saved))\n'
    '            rl.log("reward_sum", sum(model.rewards))\n'
    "            loss = -(",
)


def _values(db: Path, names: tuple[str, ...], origin: str) -> dict[tuple[str, object], object]:
    conn = sqlite3.connect(db)
    try:
        marks = ", ".join("?" for _ in names)
        rows = conn.execute(
            "SELECT g.name, l.iteration, g.value FROM logs g LEFT JOIN loops l"
            " ON l.run_id = g.run_id AND l.ctx_id = g.ctx_id"
            f" WHERE g.name IN ({marks}) AND g.origin = ?",
            (*names, origin),
        ).fetchall()
    finally:
        conn.close()
    return {(name, it): value for name, it, value in rows}


def _replay_matches_fresh(project: Project, record: str, probe: str, names: tuple[str, ...]) -> str:
    """Record, replay ``names`` and compare with a fresh run; returns replay's output."""
    project.write("train.py", record)
    project.run("train.py")
    project.write("train.py", probe)
    done = project.cli("replay", ",".join(names), "--yes", "--workers", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    replayed = _values(project.root / ".retrolog" / "retrolog.db", names, "backfilled")
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        project.run("train.py", RETROLOG_STORE=str(store))
        fresh = _values(store / "retrolog.db", names, "recorded")
    assert fresh and replayed == fresh
    return " ".join((done.stdout + done.stderr).split())


def test_attributes_a_block_filled_come_back_with_its_checkpoint(project: Project) -> None:
    probe = AS_DATA.replace(*PROBE).replace(*PROBE_ATTR)
    report = _replay_matches_fresh(project, AS_DATA, probe, ("w", "n_saved", "reward_sum"))
    # Every block restored, none executed: the update read the lists the checkpoints carried.
    assert re.search(r"outer loop 0 4 ", report), report


def test_attributes_holding_the_autograd_graph_make_the_plan_execute_blocks(
    project: Project,
) -> None:
    report = _replay_matches_fresh(project, WITH_GRAPH, WITH_GRAPH.replace(*PROBE), ("w",))
    assert re.search(r"outer loop 4 0 ", report), report
    assert (
        "4 of 4 checkpoints cannot restore what their block changed, so those blocks are "
        "executed: model.saved (it holds tensors that carry autograd history" in report
    ), report


UNNAMED = (
    AS_DATA.replace(
        "    model = Agent()\n",
        "    model = Agent()\n    seen = Agent()  # not named in checkpointing\n",
    )
    .replace("                model.saved.append(x)\n", "                seen.saved.append(x)\n")
    .replace("model.fc(torch.stack(model.saved))", "model.fc(torch.stack(seen.saved))")
    .replace("            del model.saved[:]\n", "            del seen.saved[:]\n")
)


def test_a_worker_that_fails_after_a_restore_says_why(project: Project) -> None:
    project.write("train.py", UNNAMED)
    project.run("train.py")
    project.write("train.py", UNNAMED.replace(*PROBE))
    done = project.cli("replay", "w", "--yes", "--workers", "1")
    assert done.returncode != 0
    report = " ".join((done.stdout + done.stderr).split())
    assert (
        "replay failed: the script raised RuntimeError: stack expects a non-empty TensorList "
        "at train.py, line 29 (logits = model.fc(torch.stack(seen.saved))) in 'epoch' "
        "iteration 0, after the worker had restored the checkpoints of 'epoch' iteration 0 "
        "instead of running those blocks." in report
    ), report
    assert "pass that object (or a dict holding that state) to rl.checkpointing()" in report
    assert "Traceback" not in report, report
