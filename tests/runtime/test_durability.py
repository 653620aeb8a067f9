"""Crash safety, concurrent runs, and the user's git state during recording."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training_scripts import STEPPING

from conftest import Project, read_db

pytestmark = pytest.mark.slow


def test_sigkill_loses_at_most_the_last_second_and_the_run_shows_crashed(
    project: Project,
) -> None:
    project.write("train.py", STEPPING)
    with subprocess.Popen(
        [sys.executable, "train.py"],
        cwd=project.root,
        env=project.env(),
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        last = -1
        while last < 200:  # about two seconds of training
            last = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait()
    ((status,),) = read_db(project.root, "SELECT status FROM runs")
    assert status == "running"  # nobody has looked yet
    # The next open of the store (any command) notices the dead process.
    cli = project.cli("runs", "--json")
    assert cli.returncode == 0, cli.stderr
    ((status, error),) = read_db(project.root, "SELECT status, error FROM runs")
    assert status == "crashed" and "died" in error
    stored = [v for (v,) in read_db(project.root, "SELECT value FROM logs WHERE name='i'")]
    assert stored == list(range(len(stored)))  # a prefix, nothing out of order or duplicated
    # 100 values a second; everything logged up to one second before the kill is there.
    assert max(stored) >= last - 100, (max(stored), last)
    assert time.monotonic() - killed_at < 30


def test_sigkill_during_a_background_checkpoint_write_leaves_only_whole_checkpoints(
    project: Project,
) -> None:
    # 64 MB of state and blocks of 50 ms: the writer is always behind, so a kill lands
    # while it is writing (wait mode holds training back to two snapshots in flight).
    project.write(
        "train.py",
        """
        import time
        import numpy as np
        import retrolog as rl
        state = {"w": np.zeros(8_000_000)}
        with rl.checkpointing(state=state):
            for epoch in rl.loop("epoch", range(10_000)):
                state["w"][:] = epoch
                for step in rl.loop("step", range(5)):
                    time.sleep(0.01)
                """,
    )
    with subprocess.Popen(
        [sys.executable, "-W", "ignore", "train.py"],
        cwd=project.root,
        env=project.env(),
        stdout=subprocess.DEVNULL,
    ) as proc:
        deadline = time.monotonic() + 120
        written = 0
        while written < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                written = read_db(project.root, "SELECT count(*) FROM checkpoints")[0][0]
            except sqlite3.OperationalError:  # the store is not created yet
                continue
        # Kill while an object file is being written (its temp file exists).
        objects = project.root / ".retrolog" / "objects"
        in_flight: list[Path] = []
        while not in_flight and time.monotonic() < deadline:
            in_flight = [p for p in objects.rglob(".*") if p.is_file()]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert in_flight, "the writer was never seen writing"
    assert project.cli("runs", "--json").returncode == 0
    ((status,),) = read_db(project.root, "SELECT status FROM runs")
    assert status == "crashed"

    from retrolog.checkpoint.codec import decode
    from retrolog.store.objects import LocalObjectStore

    store = LocalObjectStore(project.root / ".retrolog" / "objects")
    rows = read_db(
        project.root,
        "SELECT l.iteration, c.manifest FROM checkpoints c JOIN loops l"
        " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id ORDER BY c.checkpoint_id",
    )
    assert len(rows) >= 3
    # Every checkpoint the store shows is whole and holds the state of its own epoch.
    for iteration, manifest in rows:
        w = decode(str(manifest), store).objects["state"]["w"]
        assert w.shape == (8_000_000,) and float(w.min()) == float(w.max()) == iteration


def test_three_concurrent_runs_land_completely(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        lr = rl.arg("lr", 0.1)
        for epoch in rl.loop("epoch", range(5)):
            for step in rl.loop("step", range(400)):
                rl.log("loss", lr * step)
            rl.log("acc", lr * epoch)
        """,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "train.py", "--kwargs", f"lr={lr}"],
            cwd=project.root,
            env=project.env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for lr in (0.1, 0.2, 0.3)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    rows = read_db(
        project.root,
        "SELECT r.args, r.status, SUM(l.name = 'loss'), SUM(l.name = 'acc'),"
        " (SELECT COUNT(*) FROM loops WHERE run_id = r.run_id)"
        " FROM runs r JOIN logs l USING (run_id) GROUP BY r.run_id ORDER BY r.args",
    )
    assert [r[0] for r in rows] == ['{"lr": 0.1}', '{"lr": 0.2}', '{"lr": 0.3}']
    assert all(r[1:] == ("finished", 2000, 5, 2005) for r in rows)


def _git_state(p: Project) -> dict[str, object]:
    git_dir = Path(p.git("rev-parse", "--absolute-git-dir").strip())
    return {
        "HEAD": p.git("rev-parse", "HEAD"),
        "symbolic": p.git("symbolic-ref", "HEAD"),
        "index": (git_dir / "index").read_bytes(),
        # --no-optional-locks: a plain `git status` refreshes the index it is asked about.
        "status": p.git("--no-optional-locks", "status", "--porcelain=v2", "--untracked-files=all"),
        "refs": [
            line for line in p.git("for-each-ref").splitlines() if "refs/retrolog/" not in line
        ],
        "stash": p.git("stash", "list"),
        "config": (git_dir / "config").read_bytes(),
        "files": {
            str(path.relative_to(p.root)): path.read_bytes()
            for path in sorted(p.root.rglob("*"))
            if path.is_file() and ".git" not in path.parts and ".retrolog" not in path.parts
        },
    }


def test_recording_never_touches_the_users_git_state(project: Project) -> None:
    project.write("model.py", "WIDTH = 1\n")
    project.git("add", "model.py")
    project.git("commit", "--quiet", "-m", "model")
    project.write("model.py", "WIDTH = 2\n")
    project.git("stash")  # a stash entry the user keeps
    project.write("model.py", "WIDTH = 3\n")
    project.git("add", "model.py")  # staged change
    project.write("model.py", "WIDTH = 4\n")  # plus an unstaged edit on top
    project.write("notes.txt", "untracked\n")
    project.write("data/big.bin", "ignored data\n")
    project.write("train.py", "import retrolog as rl\nimport model\nrl.log('w', model.WIDTH)\n")
    before = _git_state(project)
    project.run("train.py")
    after = _git_state(project)
    assert before == after
    # ...and the run's code version has exactly what ran: the unstaged edit, untracked files.
    ((commit,),) = read_db(project.root, "SELECT code_commit FROM runs")
    assert project.git("show", f"{commit}:model.py") == "WIDTH = 4\n"
    files = project.git("ls-tree", "-r", "--name-only", commit).split()
    assert "notes.txt" in files and "train.py" in files
    assert not any(f.startswith(("data/", ".retrolog")) for f in files)
    assert read_db(project.root, "SELECT value FROM logs WHERE name='w'") == [(4,)]


def test_store_is_ignored_by_git_without_editing_the_users_gitignore(project: Project) -> None:
    gitignore = (project.root / ".gitignore").read_bytes()
    project.write("train.py", "import retrolog as rl\nrl.log('x', 1)\n")
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py")
    assert (project.root / ".gitignore").read_bytes() == gitignore
    assert project.git("status", "--porcelain", "--untracked-files=all") == ""
    project.git("add", "-A")
    assert ".retrolog" not in project.git("diff", "--cached", "--name-only")
