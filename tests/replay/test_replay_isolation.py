"""A replayed script writes into its own checkout, never into the user's project.

The project ignores ``data/`` and ``out/``, so a run's code version lacks them
and the replay's checkout links them back: the script reads its data through
the link, and writes its outputs (a result file, an appended log, a new
subdirectory, a numpy file, a removed stale file) where it did when it was
recorded. After the replay, every file of the user's project is byte for byte
what it was, and the values the replayed statement read back from what the
script wrote equal a fresh run's.
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Project, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import os

import numpy as np
import retrolog as rl

with open("data/input.txt") as f:
    scale = float(f.read())
if os.path.exists("out/old.txt"):
    os.rename("out/old.txt", "moved.txt")  # a file of the linked out/, moved out of it
state = {"w": np.zeros(2)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(2)):
            state["w"] += scale
        with open("out/result.txt", "w") as f:
            f.write(f"epoch {epoch}: {state['w'][0]}")
        with open("out/log.txt", "a") as f:
            f.write(f"{epoch}\\n")
        os.makedirs("out/ckpt", exist_ok=True)
        np.save("out/ckpt/w.npy", state["w"])
        if os.path.exists("out/stale.txt"):
            os.remove("out/stale.txt")
        with open("out/next.tmp", "w") as f:
            f.write(str(epoch))
        os.replace("out/next.tmp", "out/latest.txt")  # write, then move into place
        rl.log("w0", float(state["w"][0]))
"""

PROBE = SCRIPT.replace(
    '        rl.log("w0", float(state["w"][0]))\n',
    '        rl.log("w0", float(state["w"][0]))\n'
    '        rl.log("written", open("out/result.txt").read() + "|" + open("out/log.txt").read())\n',
)


def _tree(root: Path) -> dict[str, bytes]:
    """Every file of the project but git's and retrolog's, with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] not in (".git", ".retrolog")
    }


def _user_state(project: Project) -> tuple[dict[str, bytes], str, str, str]:
    return (
        _tree(project.root),
        project.git("rev-parse", "HEAD"),
        project.git("status", "--porcelain", "--ignored"),
        project.git("ls-files", "--stage"),
    )


def _set_up(project: Project, edit: Callable[[str], str] = lambda s: s) -> None:
    project.write(".gitignore", "data/\nout/\n")
    project.write("data/input.txt", "0.5")
    project.write("out/log.txt", "")
    project.write("train.py", edit(SCRIPT))
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py")
    # Today the user has other outputs in out/, which a replay must leave alone.
    project.write("out/result.txt", "today's result")
    project.write("out/log.txt", "today's log\n")
    project.write("out/stale.txt", "keep me")
    project.write("out/old.txt", "stay where you are")
    project.write("out/ckpt/w.npy", "today's array")
    project.write("train.py", edit(PROBE))


def test_replay_writes_land_in_the_checkout_not_in_the_project(project: Project) -> None:
    _set_up(project)
    before = _user_state(project)
    done = project.cli("replay", "written", "--yes")
    assert done.returncode == 0, done.stderr
    assert _user_state(project) == before

    replayed = dict(
        read_db(
            project.root, "SELECT ctx_id, value FROM logs WHERE name = 'written' ORDER BY ctx_id"
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp)
        (fresh_dir / "data").mkdir()
        (fresh_dir / "data" / "input.txt").write_text("0.5")
        (fresh_dir / "out").mkdir()
        (fresh_dir / "out" / "log.txt").write_text((project.root / "out" / "log.txt").read_text())
        (fresh_dir / "train.py").write_text(PROBE)
        store = fresh_dir / "store"
        Project(fresh_dir).run("train.py", RETROLOG_STORE=str(store))
        conn = sqlite3.connect(store / "retrolog.db")
        fresh = [
            v
            for (v,) in conn.execute(
                "SELECT value FROM logs WHERE name = 'written' ORDER BY ctx_id"
            )
        ]
        conn.close()
    # The log the replay appended to is its private copy of the project's file.
    assert list(replayed.values()) == fresh
    assert fresh[0].startswith("epoch 0: 1.0|today's log\n0\n")


def test_a_write_into_the_project_by_absolute_path_is_refused(project: Project) -> None:
    target = project.root / "out" / "result.txt"
    _set_up(
        project, lambda s: s.replace('open("out/result.txt", "w")', f"open({str(target)!r}, 'w')")
    )
    before = _user_state(project)
    done = project.cli("replay", "written", "--yes")
    assert done.returncode != 0
    assert "PermissionError" in done.stderr and "never changes your files" in done.stderr
    assert _user_state(project) == before
