"""Where checkpoints are taken (runtime/run.py: blocks and checkpoints) and what they hold."""

from __future__ import annotations

import json
import random

from retrolog.checkpoint.capture import load_checkpoint
from retrolog.checkpoint.state import restore_rng
from retrolog.store.objects import LocalObjectStore

from conftest import Project, read_db

WITH_NESTED = """
    import json, random
    import retrolog as rl

    state = {"n": 0}
    history = []
    draws = []
    with rl.checkpointing(state=state):
        for epoch in rl.loop("epoch", range(3)):
            for step in rl.loop("step", range(4)):
                state["n"] += 1
                random.random()
            history.append(dict(state))     # the state where the block ended
            draws.append(random.random())   # the first draw after the block
            state["n"] += 100               # after the block: not in its checkpoint
    print(json.dumps({"history": history, "draws": draws, "final": state}))
"""


def _checkpoints(p: Project) -> list[tuple[object, ...]]:
    return read_db(
        p.root,
        "SELECT c.kind, c.loop_name, l.iteration, c.manifest, c.nbytes FROM checkpoints c"
        " LEFT JOIN loops l ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id ORDER BY c.created_at",
    )


def test_nested_loop_is_the_block_captured_where_it_ends(project: Project) -> None:
    project.write("train.py", WITH_NESTED)
    out = json.loads(project.run("train.py").stdout)
    rows = _checkpoints(project)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("block", "epoch", 0),
        ("block", "epoch", 1),
        ("block", "epoch", 2),
        ("end", "epoch", None),
    ]
    store = LocalObjectStore(project.root / ".retrolog" / "objects")
    for (_, _, iteration, manifest, nbytes), expected, draw in zip(
        rows[:3], out["history"], out["draws"], strict=True
    ):
        assert nbytes > 0
        snap = load_checkpoint(store, str(manifest))
        assert snap.objects["state"] == expected, iteration
        restore_rng(snap.rng)
        assert random.random() == draw  # RNG state is the one at the block's end
    end = load_checkpoint(store, str(rows[3][3]))
    assert end.objects["state"] == out["final"]


def test_without_a_nested_loop_each_iteration_is_the_block(project: Project) -> None:
    project.write(
        "train.py",
        """
        import numpy as np
        import retrolog as rl
        weights = np.zeros(3)
        with rl.checkpointing(weights=weights):
            for epoch in rl.loop("epoch", range(4)):
                weights += 1
        """,
    )
    project.run("train.py")
    rows = _checkpoints(project)
    assert [(r[0], r[2]) for r in rows] == [
        ("block", 0),
        ("block", 1),
        ("block", 2),
        ("block", 3),
        ("end", None),
    ]
    store = LocalObjectStore(project.root / ".retrolog" / "objects")
    values = [load_checkpoint(store, str(r[3])).objects["weights"].tolist() for r in rows]
    assert values == [[1.0] * 3, [2.0] * 3, [3.0] * 3, [4.0] * 3, [4.0] * 3]


def test_loops_outside_checkpointing_take_no_checkpoints(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        for epoch in rl.loop("epoch", range(2)):
            for step in rl.loop("step", range(2)):
                rl.log("x", 1)
        """,
    )
    project.run("train.py")
    assert _checkpoints(project) == []


def test_checkpointing_rejects_what_it_cannot_save(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        with rl.checkpointing(epochs=5):
            pass
        """,
    )
    proc = project.run("train.py", check=False)
    assert proc.returncode == 1
    assert "CheckpointTargetError" in proc.stderr and "epochs" in proc.stderr
