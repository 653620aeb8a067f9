"""Plain variables a skipped block set are restored with its checkpoint (runtime/frames.py).

Each script keeps running totals in plain locals (``total += ...`` in the step
loop, a counter, a list appended in place, the loop variables) that code after
the block, or after the loop, reads. Replay skips blocks by restoring their
checkpoints; the values it backfills must still equal a fresh run's, in a
function (fast locals) and at module level (a dict), for a nested block, for a
whole-iteration block split across two workers, and for the end checkpoint.
"""

from __future__ import annotations

import re
import sqlite3
import tempfile
import textwrap
from pathlib import Path

import pytest

from conftest import Project, read_db

pytestmark = pytest.mark.slow

NESTED = """\
import time

import numpy as np
import retrolog as rl

np.random.seed(0)
state = {"w": np.zeros(3)}
best = -100.0
history = []
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(4)):
        total = 0.0
        count = 0
        seen = []
        for step in rl.loop("step", range(5)):
            g = np.random.standard_normal(3)
            state["w"] += 0.1 * g
            total += float(g.sum())
            count += 1
            seen.append(round(float(g[0]), 6))
            time.sleep(0.04)  # a block worth restoring rather than executing
        history.append(total)
        best = max(best, total)
        rl.log("total", total)
rl.log("best", best)
"""

NESTED_PROBE = NESTED.replace(
    '        rl.log("total", total)\n',
    '        rl.log("total", total)\n'
    '        rl.log("mean_g", total / count)\n'
    '        rl.log("last_step", step)\n'
    '        rl.log("seen_sum", sum(seen))\n'
    '        rl.log("history_len", len(history))\n',
).replace(
    'rl.log("best", best)\n',
    'rl.log("best", best)\nrl.log("final_total", total)\nrl.log("final_epoch", epoch)\n',
)

WHOLE = """\
import time

import numpy as np
import retrolog as rl

np.random.seed(1)
state = {"w": np.zeros(2)}
running = 0.0
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(6)):
        g = np.random.standard_normal(2)
        state["w"] += g
        running = 0.9 * running + float(g.sum())
        time.sleep(0.2)
        rl.log("w0", float(state["w"][0]))
"""

WHOLE_PROBE = WHOLE.replace(
    '        rl.log("w0", float(state["w"][0]))\n',
    '        rl.log("w0", float(state["w"][0]))\n        rl.log("running", running)\n',
)


def _in_function(source: str) -> str:
    """The same script with its body in main(): locals become fast locals."""
    head, _, body = source.partition("import retrolog as rl\n")
    return (
        head
        + "import retrolog as rl\n\n\ndef main():\n"
        + textwrap.indent(body, "    ")
        + ("\n\nmain()\n")
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


def _replay_matches_fresh(
    project: Project, record: str, probe: str, names: tuple[str, ...], workers: int
) -> str:
    """Record, replay ``names`` and compare with a fresh run; returns replay's stderr."""
    project.write("train.py", record)
    project.run("train.py")
    project.write("train.py", probe)
    done = project.cli("replay", ",".join(names), "--yes", "--workers", str(workers))
    assert done.returncode == 0, done.stderr
    replayed = _values(project.root / ".retrolog" / "retrolog.db", names, "backfilled")
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        project.run("train.py", RETROLOG_STORE=str(store))
        fresh = _values(store / "retrolog.db", names, "recorded")
    assert fresh and replayed == fresh
    return done.stderr


@pytest.mark.parametrize("wrap", [False, True], ids=["module", "function"])
def test_block_locals_are_restored_for_code_after_the_block(project: Project, wrap: bool) -> None:
    record = _in_function(NESTED) if wrap else NESTED
    probe = _in_function(NESTED_PROBE) if wrap else NESTED_PROBE
    report = _replay_matches_fresh(
        project, record, probe, ("mean_g", "last_step", "seen_sum", "history_len"), 1
    )
    # The plan restored all four blocks and executed none: the values came from the locals.
    assert re.search(r"outer loop\s+0\s+4\s", report), report


@pytest.mark.parametrize("wrap", [False, True], ids=["module", "function"])
def test_end_locals_are_restored_for_the_suffix(project: Project, wrap: bool) -> None:
    record = _in_function(NESTED) if wrap else NESTED
    probe = _in_function(NESTED_PROBE) if wrap else NESTED_PROBE
    _replay_matches_fresh(project, record, probe, ("final_total", "final_epoch"), 1)
    ((plan,),) = read_db(project.root, "SELECT scan FROM replay_runs")
    assert plan == "SUFFIX"


def test_whole_iteration_locals_carry_a_second_worker_into_its_range(project: Project) -> None:
    _replay_matches_fresh(
        project, _in_function(WHOLE), _in_function(WHOLE_PROBE), ("running",), workers=2
    )


CARRIED = """\
import torch
from torch import nn

import retrolog as rl

torch.manual_seed(0)
rnn = nn.LSTM(8, 128, 2)
opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
# The hidden state is carried from epoch to epoch, not reset: 2 x 20 x 128 floats each.
hidden = (torch.zeros(2, 20, 128), torch.zeros(2, 20, 128))
with rl.checkpointing(rnn=rnn, opt=opt):
    for epoch in rl.loop("epoch", range(4)):
        for step in rl.loop("step", range(6)):
            out, hidden = rnn(torch.randn(5, 20, 8), tuple(h.detach() for h in hidden))
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        rl.log("loss", loss.item())
"""

CARRIED_PROBE = CARRIED.replace(
    '        rl.log("loss", loss.item())\n',
    '        rl.log("loss", loss.item())\n        rl.log("h_norm", hidden[0].norm().item())\n',
)


def test_a_hidden_state_carried_across_epochs_is_restored(project: Project) -> None:
    """Larger than a few thousand elements, it still travels with the block checkpoints."""
    report = _replay_matches_fresh(
        project, _in_function(CARRIED), _in_function(CARRIED_PROBE), ("h_norm",), 1
    )
    assert re.search(r"outer loop\s+0\s+4\s", report), report


LARGE = NESTED.replace(
    "            g = np.random.standard_normal(3)\n",
    "            g = np.random.standard_normal(3)\n"
    "            big = np.full(300_000, float(g[0]))  # 2.4 MB: more than a checkpoint's locals\n",
)
LARGE_PROBE = LARGE.replace(
    '        rl.log("total", total)\n',
    '        rl.log("total", total)\n        rl.log("big_last", float(big[-1]))\n',
)


@pytest.mark.parametrize("wrap", [False, True], ids=["module", "function"])
def test_a_block_whose_checkpoint_lacks_what_the_statement_reads_is_executed(
    project: Project, wrap: bool
) -> None:
    record = _in_function(LARGE) if wrap else LARGE
    probe = _in_function(LARGE_PROBE) if wrap else LARGE_PROBE
    report = _replay_matches_fresh(project, record, probe, ("big_last",), 1)
    assert re.search(r"checkpoint \S+ was not restored.*it does not hold big, which", report), (
        report
    )
