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

import os
import shutil
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


# -- links that leave the project ----------------------------------------------------------

# The usual scratch-disk layout: the project links its outputs and some data to
# directories elsewhere. Every kind of write goes through every kind of link: directory
# and file links, absolute and relative, at the top and nested (inside an ignored
# directory, inside a linked directory), and a link committed with the code.
LEAVING = """\
import os
import shutil

import numpy as np
import torch
import retrolog as rl

with open("data/input.txt") as f:
    scale = float(f.read())
with open("ext/scale.txt") as f:
    scale += float(f.read())
state = {"w": np.zeros(2)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(2)):
        for step in rl.loop("step", range(2)):
            state["w"] += scale
        with open("out/result.txt", "w") as f:
            f.write(f"epoch {epoch}")
        with open("out/log.txt", "a") as f:
            f.write(f"{epoch}\\n")
        if os.path.exists("out/old.txt"):
            os.rename("out/old.txt", "out/renamed.txt")
        if os.path.exists("out/stale.txt"):
            os.remove("out/stale.txt")
        os.makedirs("out/new/dir", exist_ok=True)
        with open("ext/new.txt", "w") as f:
            f.write(f"new {epoch}")
        os.truncate("ext/big.txt", 3)
        np.save("ext/w.npy", state["w"])
        fd = os.open("data/shared/f.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.write(fd, b"fd")
        os.close(fd)
        shutil.copy("data/input.txt", "out/deep/deep.txt")
        torch.save({"w": torch.tensor(state["w"])}, "out/model.pt")
        with open("config.txt", "w") as f:
            f.write(f"config {epoch}")
        with open("data/weights.bin", "r+b") as f:
            f.write(b"W")
        with open("results/summary.txt", "w") as f:
            f.write(f"summary {epoch}")
        rl.log("w0", float(state["w"][0]))
"""

# One statement (a replay adds one), reading back in the replay what each write left.
SEEN = """\
        rl.log("seen", "|".join([open(p).read() for p in (
            "out/result.txt", "out/log.txt", "ext/new.txt", "ext/big.txt",
            "data/shared/f.txt", "out/deep/deep.txt", "config.txt",
            "results/summary.txt", "out/renamed.txt")] + [
            open("data/weights.bin", "rb").read().decode(),
            str(float(torch.load("out/model.pt")["w"][0])),
            str(float(np.load("ext/w.npy")[0])),
            str([os.path.exists(p) for p in ("out/old.txt", "out/stale.txt", "out/new/dir")])]))
"""
LEAVING_PROBE = LEAVING + SEEN


def _everything(top: Path) -> dict[str, str | bytes]:
    """Each path under ``top`` (links not followed): a file's bytes, a link's target."""
    found: dict[str, str | bytes] = {}
    for directory, dirs, files in os.walk(top):
        here = Path(directory)
        dirs[:] = [d for d in dirs if d not in (".git", ".retrolog")]
        for name in [*dirs, *files]:
            path = here / name
            key = str(path.relative_to(top))
            if path.is_symlink():
                found[key] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[key] = "dir"
            else:
                found[key] = path.read_bytes()
    return found


def _scratch_files(scratch: Path, when: str) -> None:
    files = {
        "out/result.txt": f"{when} result",
        "out/log.txt": f"{when} log\n",
        "out/old.txt": f"{when} old",
        "out/stale.txt": f"{when} stale",
        "out/model.pt": f"{when} model",
        "deep/deep.txt": f"{when} deep",
        "ext/scale.txt": "0.25",
        "ext/big.txt": f"{when} big file",
        "ext/w.npy": f"{when} array",
        "shared/f.txt": f"{when} shared",
        "config.txt": f"{when} config",
        "weights.bin": f"{when} weights",
        "results/summary.txt": f"{when} summary",
    }
    for relpath, text in files.items():
        path = scratch / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for stray in ("out/renamed.txt", "ext/new.txt"):
        (scratch / stray).unlink(missing_ok=True)
    shutil.rmtree(scratch / "out" / "new", ignore_errors=True)


def test_writes_through_links_leaving_the_project_stay_in_the_checkout(
    project: Project, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"
    _scratch_files(scratch, "recorded")
    root = project.root
    (scratch / "out" / "deep").symlink_to(scratch / "deep")  # a link inside a linked dir
    (root / "out").symlink_to(scratch / "out")  # absolute, to a directory
    (root / "ext").symlink_to(Path("..", "scratch", "ext"))  # relative, to a directory
    (root / "config.txt").symlink_to(scratch / "config.txt")  # absolute, to a file
    project.write("data/input.txt", "0.5")
    (root / "data" / "shared").symlink_to(Path("..", "..", "scratch", "shared"))  # nested
    (root / "data" / "weights.bin").symlink_to(scratch / "weights.bin")  # nested, a file
    (root / "results").symlink_to(scratch / "results")  # committed with the code
    project.write(".gitignore", "/data\n/out\n/ext\n/config.txt\n")
    project.write("train.py", LEAVING)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    assert "results" in project.git("ls-files")
    project.run("train.py")
    _scratch_files(scratch, "today's")
    project.write("train.py", LEAVING_PROBE)
    before = _everything(tmp_path), _user_state(project)

    done = project.cli("replay", "seen", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (_everything(tmp_path), _user_state(project)) == before

    seen = [
        value
        for (value,) in read_db(root, "SELECT value FROM logs WHERE name = 'seen' ORDER BY ctx_id")
    ]
    # Read back inside the replay: every write happened, to the checkout's own copies.
    assert seen == [
        "epoch 0|today's log\n0\n|new 0|tod|fd|0.5|config 0|summary 0|today's old|Woday's weights"
        "|1.5|1.5|[False, False, True]",
        "epoch 1|today's log\n0\n1\n|new 1|tod|fd|0.5|config 1|summary 1|today's old"
        "|Woday's weights|3.0|3.0|[False, False, True]",
    ]
