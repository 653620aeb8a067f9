"""A checkpoint that cannot be read is executed instead, and the values stay exact."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest

from retrolog.store.objects import LocalObjectStore

from conftest import Project, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import time

import numpy as np
import retrolog as rl

np.random.seed(0)
state = {"w": np.zeros(4)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(4)):
        for step in rl.loop("step", range(4)):
            state["w"] += np.random.standard_normal(4)
            time.sleep(0.05)
        rl.log("w0", float(state["w"][0]))
"""

PROBE = SCRIPT.replace(
    '        rl.log("w0", float(state["w"][0]))\n',
    '        rl.log("w0", float(state["w"][0]))\n'
    '        rl.log("w_sum", float(state["w"].sum()))\n',
)


def _values(db: Path, origin: str) -> dict[object, object]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute(
            "SELECT l.iteration, g.value FROM logs g JOIN loops l"
            " ON l.run_id = g.run_id AND l.ctx_id = g.ctx_id"
            " WHERE g.name = 'w_sum' AND g.origin = ?",
            (origin,),
        ).fetchall()
    finally:
        conn.close()
    return dict(rows)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_unreadable_block_checkpoint_is_executed_and_values_stay_exact(
    project: Project, damage: str
) -> None:
    project.write("train.py", SCRIPT)
    project.run("train.py")
    ((manifest,),) = read_db(
        project.root,
        "SELECT c.manifest FROM checkpoints c JOIN loops l"
        " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id WHERE l.iteration = 1",
    )
    path = LocalObjectStore(project.root / ".retrolog" / "objects").path(str(manifest))
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()

    project.write("train.py", PROBE)
    done = project.cli("replay", "w_sum", "--yes", "--workers", "1")
    assert done.returncode == 0, done.stderr
    assert str(manifest) in done.stderr  # the report names the checkpoint it could not use

    replayed = _values(project.root / ".retrolog" / "retrolog.db", "backfilled")
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        project.run("train.py", RETROLOG_STORE=str(store))
        fresh = _values(store / "retrolog.db", "recorded")
    assert len(fresh) == 4 and replayed == fresh
