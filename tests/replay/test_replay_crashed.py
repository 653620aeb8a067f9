"""A run that was killed mid-training: replay answers only for what it completed.

The run is killed (SIGKILL, as the OOM killer or a preemption would) during
the second step of epoch 2. Its replay does not die there (the kill came from
outside), so it computes values for the rest of that epoch, for epoch 3 and
after the loop; none of them may be stored as the run's. What the run did
complete (epochs 0 and 1, step 0 of epoch 2) is backfilled, exactly. The run's
duration ends at its last record and stays there.
"""

from __future__ import annotations

import re
import sqlite3
import tempfile
import time

import pytest

from conftest import Project, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import contextlib
import os
import signal
import sqlite3
import time

import numpy as np
import retrolog as rl


def wait_until_stored(steps):
    # The writer commits every 0.2 s, in order: once the newest step's start is stored,
    # so is everything before it, and the kill loses none of it.
    database = os.path.join(os.environ.get("RETROLOG_STORE", ".retrolog"), "retrolog.db")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.closing(sqlite3.connect(database)) as conn:
            (stored,) = conn.execute("SELECT COUNT(*) FROM loops WHERE depth = 1").fetchone()
        if stored == steps:
            return
        time.sleep(0.05)
    raise SystemExit(f"the writer stored {stored} steps' starts, not {steps}")


np.random.seed(0)
state = {"w": np.zeros(2)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(4)):
        for step in rl.loop("step", range(3)):
            if os.environ.get("KILL_AT") == f"{epoch}.{step}":
                wait_until_stored(3 * epoch + step + 1)
                os.kill(os.getpid(), signal.SIGKILL)
            state["w"] += np.random.standard_normal(2)
            rl.log("w0", float(state["w"][0]))
        rl.log("w1", float(state["w"][1]))
rl.log("done", 1)
"""

PROBE = (
    SCRIPT.replace(
        '            rl.log("w0", float(state["w"][0]))\n',
        '            rl.log("w0", float(state["w"][0]))\n'
        '            rl.log("w_sum", float(state["w"].sum()))\n',
    )
    .replace(
        '        rl.log("w1", float(state["w"][1]))\n',
        '        rl.log("w1", float(state["w"][1]))\n'
        '        rl.log("w_norm", float(abs(state["w"]).sum()))\n',
    )
    .replace('rl.log("done", 1)\n', 'rl.log("done", 1)\nrl.log("final", float(state["w"][0]))\n')
)


def _keyed(project: Project, name: str) -> dict[tuple[int | None, int | None], object]:
    rows = read_db(
        project.root,
        "SELECT e.iteration, s.iteration, g.value FROM logs g"
        " LEFT JOIN loops s ON s.run_id = g.run_id AND s.ctx_id = g.ctx_id AND s.depth = 1"
        " LEFT JOIN loops e ON e.run_id = g.run_id AND e.ctx_id = COALESCE(s.parent_ctx, g.ctx_id)"
        " AND e.depth = 0 WHERE g.name = ?",
        (name,),
    )
    return {(e, s): v for e, s, v in rows}


def test_a_killed_run_is_backfilled_only_where_it_got(project: Project) -> None:
    project.write("train.py", SCRIPT)
    killed = project.run("train.py", check=False, KILL_AT="2.1")
    assert killed.returncode == -9
    shown = project.cli("runs").stdout  # the next command that opens the store finds it dead
    assert read_db(project.root, "SELECT status FROM runs") == [("crashed",)]
    ((started, ended, last),) = read_db(
        project.root,
        "SELECT started_at, ended_at, (SELECT MAX(COALESCE(t_end, t_start)) FROM loops) FROM runs",
    )
    assert ended is not None and abs(ended - (started + last)) < 1e-6
    time.sleep(1.5)
    assert project.cli("runs").stdout == shown  # its duration no longer grows

    project.write("train.py", PROBE)  # the replay runs on: KILL_AT is not set now
    done = project.cli("replay", "w_sum,w_norm,final", "--yes")
    assert done.returncode == 0, done.stderr
    assert re.search(r"crashed: values the replay computed past where the run got", done.stderr)

    completed_steps = {(e, s) for e in (0, 1) for s in range(3)} | {(2, 0)}
    assert set(_keyed(project, "w_sum")) == completed_steps
    assert set(_keyed(project, "w_norm")) == {(0, None), (1, None)}  # not epoch 2: unfinished
    assert _keyed(project, "final") == {}  # after the loop, where the run never got
    # What was backfilled is exact: a fresh run of today's code, killed at the same
    # place, logs the same values where it got.
    with tempfile.TemporaryDirectory() as tmp:
        project.run("train.py", check=False, KILL_AT="2.1", RETROLOG_STORE=f"{tmp}/s")
        conn = sqlite3.connect(f"{tmp}/s/retrolog.db")
        fresh = dict(conn.execute("SELECT name || ':' || log_id, value FROM logs").fetchall())
        by_name = {
            name: [v for k, v in sorted(fresh.items(), key=lambda kv: int(kv[0].split(":")[1]))
                   if k.startswith(name + ":")]
            for name in ("w_sum", "w_norm")
        }  # fmt: skip
        conn.close()
    assert [v for _, v in sorted(_keyed(project, "w_sum").items())] == by_name["w_sum"]
    assert [v for _, v in sorted(_keyed(project, "w_norm").items())] == by_name["w_norm"]
