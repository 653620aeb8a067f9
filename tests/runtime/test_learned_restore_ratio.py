"""Flor's c (restore / materialize) is learned from the script's past replays."""

from __future__ import annotations

import json
import sqlite3

from conftest import Project, read_db

SCRIPT = """\
import numpy as np

import retrolog as rl

state = {"w": np.zeros(100_000)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(3)):
        state["w"] += 1.0
        rl.log("w0", float(state["w"][0]))
"""


def _policy(project: Project, run_id: object) -> dict[str, object]:
    ((summary,),) = read_db(
        project.root, "SELECT checkpointing FROM runs WHERE run_id = ?", (run_id,)
    )
    return dict(json.loads(str(summary)))


def test_c_is_learned_from_the_scripts_replays_unless_configured(project: Project) -> None:
    project.write("train.py", SCRIPT)
    project.run("train.py")
    ((first,),) = read_db(project.root, "SELECT run_id FROM runs")
    assert _policy(project, first)["restore_ratio"] == 1.0
    assert _policy(project, first)["restore_ratio_from"] == "default"

    # A replay of that run restored 4 checkpoints, each 20 times as long as the run's
    # mean materialization (the figures replay writes into replay_runs).
    ((materialize,),) = read_db(
        project.root,
        "SELECT AVG(capture_seconds + COALESCE(writer_cpu_seconds, 0)) FROM checkpoints",
    )
    conn = sqlite3.connect(project.root / ".retrolog" / "retrolog.db")
    conn.execute(
        "INSERT INTO replay_runs(replay_id, run_id, scan, status, restored, restore_seconds)"
        " VALUES ('r1', ?, 'OUTER', 'replayed', 4, ?)",
        (first, 4 * 20 * float(materialize)),  # type: ignore[arg-type]
    )
    conn.commit()
    conn.close()

    project.run("train.py")
    project.run("train.py", RETROLOG_RESTORE_RATIO="2")
    _, learned, configured = (
        r for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")
    )
    got = _policy(project, learned)
    assert abs(float(got["restore_ratio"]) - 20.0) < 1e-6  # type: ignore[arg-type]
    assert got["restore_ratio_from"] == "learned from replays"
    assert _policy(project, configured)["restore_ratio"] == 2.0
    assert _policy(project, configured)["restore_ratio_from"] == "configured"
