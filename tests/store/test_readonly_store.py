"""A store this process cannot write: the read commands work, the writing ones say why not.

A colleague's store on a shared disk, a read-only mount, a snapshot: reading it
must not need write access, and must not write. As root, permissions do not stop
writes, so the store is made read-only by a read-only bind mount in a private
mount namespace (``unshare -m``); as another user, by taking its write bits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Project, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import argparse
import numpy as np
import retrolog as rl

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.5)
args = parser.parse_args()
w = np.zeros(4)
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(2)):
            w += args.lr
            rl.log("loss", float(1.0 / (1.0 + w.sum())))
"""


def _snapshot(store: Path) -> dict[str, str]:
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file()
    }


class ReadOnly:
    """Runs commands against the project's store made read-only for them."""

    def __init__(self, project: Project, tmpdir: Path) -> None:
        self.project = project
        self.store = project.root / ".retrolog"
        self.tmpdir = tmpdir  # the commands' TMPDIR, to see what they leave behind

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        env = self.project.env(TMPDIR=str(self.tmpdir))
        if os.geteuid() == 0:
            wrap = 'mount --bind -o ro "$0" "$0" && exec "$@"'
            argv = ("unshare", "-m", "sh", "-c", wrap, str(self.store), *argv)
        return subprocess.run(
            argv, cwd=self.project.root, env=env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run(sys.executable, "-m", "retrolog", *args)


@pytest.fixture
def readonly(project: Project, tmp_path: Path) -> Iterator[ReadOnly]:
    if os.geteuid() == 0:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount --bind -o ro {tmp_path} {tmp_path}"],
            capture_output=True, text=True,
        )  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"root, and cannot make a read-only mount here: {probe.stderr.strip()}")
    tmpdir = tmp_path / "cmd-tmp"
    tmpdir.mkdir()
    ro = ReadOnly(project, tmpdir)
    yield ro
    if os.geteuid() != 0:
        _chmod_tree(ro.store, writable=True)


def _chmod_tree(store: Path, *, writable: bool) -> None:
    for path in [store, *store.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | 0o200 if writable else mode & ~0o222)


def _make_readonly(ro: ReadOnly) -> None:
    if os.geteuid() != 0:
        _chmod_tree(ro.store, writable=False)


def _no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stderr, out.stderr


def test_read_commands_work_on_a_store_this_process_cannot_write(
    project: Project, readonly: ReadOnly
) -> None:
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py", "--lr", "0.25")
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    recorded = read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'loss'")[0][0]
    # Today's script has a new statement, as when a question comes up.
    project.write("train.py", SCRIPT + "            rl.log('w_sum', float(w.sum()))\n")
    _make_readonly(readonly)
    before = _snapshot(readonly.store)

    runs = readonly.cli("runs", "--json")
    assert runs.returncode == 0, runs.stderr
    assert [r["run_id"] for r in json.loads(runs.stdout)] == [run_id]
    show = readonly.cli("show", run_id[:12])
    assert show.returncode == 0 and "lr=0.25" in show.stdout, show.stderr
    frame = readonly.cli("dataframe", "loss", "lr", "--json")
    assert frame.returncode == 0, frame.stderr
    rows = json.loads(frame.stdout)
    assert len(rows) == recorded and {r["lr"] for r in rows} == {0.25}
    query = readonly.cli("query", "SELECT COUNT(*) AS n FROM checkpoints", "--json")
    assert query.returncode == 0 and json.loads(query.stdout)[0]["n"] > 0, query.stderr
    lineage = readonly.cli("lineage", run_id[:12], "loss", "--at", "epoch=1")
    assert lineage.returncode == 0 and "recorded" in lineage.stdout, lineage.stderr
    plan = readonly.cli("replay", "w_sum", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "rl.log('w_sum'" in plan.stderr, plan.stderr
    gc_plan = readonly.cli("gc", "--keep", "last:1", "--dry-run")
    assert gc_plan.returncode == 0 and "would delete" in gc_plan.stdout, gc_plan.stderr
    # The Python API reads it too, checkpoints included.
    api = readonly.run(
        sys.executable, "-c",
        "import numpy as np, retrolog as rl\n"
        "w = np.full(4, -1.0)\n"
        f"rl.restore({run_id!r}, at=1, w=w)\n"
        "print(w.tolist(), len(rl.dataframe('loss')))\n",
    )  # fmt: skip
    assert api.returncode == 0, api.stderr
    assert api.stdout.split() == ["[1.0,", "1.0,", "1.0,", "1.0]", str(recorded)]

    # What writes says so, in one paragraph, and changes nothing.
    for args in (("replay", "w_sum"), ("replay", "--verify"), ("gc", "--keep", "last:1", "--yes")):
        out = readonly.cli(*args)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        _no_traceback(out)
        said = " ".join(out.stderr.split())  # the paragraph is wrapped to the terminal
        assert "read-only for this process" in said and "RETROLOG_STORE" in said
    assert _snapshot(readonly.store) == before
    assert list(readonly.tmpdir.iterdir()) == []


def test_code_only_in_the_store_is_read_from_a_store_this_process_cannot_write(
    project: Project, readonly: ReadOnly
) -> None:
    """The store's copy of a run's code (docs/code-versions.md) is imported into a private
    temporary repository, not into the store, when the store cannot be written."""
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py", "--lr", "0.25")
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    # Only the store has the code now: the ref and its objects are gone from the clone.
    project.git("update-ref", "-d", f"refs/retrolog/runs/{run_id}")
    project.git("reflog", "expire", "--expire=now", "--all")
    project.git("gc", "--quiet", "--prune=now")
    project.write("train.py", SCRIPT + "            rl.log('w_sum', float(w.sum()))\n")
    _make_readonly(readonly)
    before = _snapshot(readonly.store)

    code = readonly.run(
        sys.executable, "-c",
        "import json, sys, retrolog; print(json.dumps(retrolog.Project().code(sys.argv[1])))",
        run_id,
    )  # fmt: skip
    assert code.returncode == 0, code.stderr
    assert json.loads(code.stdout)["text"] == SCRIPT
    plan = readonly.cli("replay", "w_sum", "--dry-run")
    _no_traceback(plan)
    assert plan.returncode == 0 and "rl.log('w_sum'" in plan.stderr, plan.stderr
    assert _snapshot(readonly.store) == before
    assert not (readonly.store / "code.git").exists()
    assert list(readonly.tmpdir.iterdir()) == []  # the private repository was removed


def test_a_store_left_mid_run_is_read_with_its_log(project: Project, readonly: ReadOnly) -> None:
    """A run killed mid-way leaves its last values in the database's write-ahead log."""
    project.write(
        "train.py",
        "import time\nimport retrolog as rl\n"
        "for epoch in rl.loop('epoch', range(1000)):\n"
        "    rl.log('loss', epoch * 0.5)\n"
        "    if epoch == 4:\n"
        "        time.sleep(600)\n",
    )
    proc = subprocess.Popen(
        [sys.executable, "train.py"], cwd=project.root, env=project.env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    database = project.root / ".retrolog" / "retrolog.db"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if database.exists() and _loss_count(database) >= 5:
                break
        else:
            pytest.fail("the run did not record five values in 60 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wal = database.with_name("retrolog.db-wal")
    shm = database.with_name("retrolog.db-shm")
    assert wal.stat().st_size > 0 and shm.exists()
    _make_readonly(readonly)

    def losses() -> list[float]:
        out = readonly.cli("dataframe", "loss", "--json")
        assert out.returncode == 0, out.stderr
        return [r["loss"] for r in json.loads(out.stdout)]

    assert losses() == [e * 0.5 for e in range(5)]
    # Copied without its shared-memory file, the log cannot be read in place: it is
    # read from a private copy, which is removed afterwards.
    if os.geteuid() != 0:
        _chmod_tree(readonly.store, writable=True)
    shm.unlink()
    _make_readonly(readonly)
    assert losses() == [e * 0.5 for e in range(5)]
    assert list(readonly.tmpdir.iterdir()) == []
    assert wal.stat().st_size > 0 and not shm.exists()


def _loss_count(database: Path) -> int:
    import sqlite3

    try:
        conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT COUNT(*) FROM logs WHERE name = 'loss'").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def test_an_old_schema_that_cannot_be_upgraded_here_says_how(
    project: Project, readonly: ReadOnly
) -> None:
    project.write("train.py", "import retrolog as rl\nrl.log('x', 1.0)\n")
    project.run("train.py")
    database = project.root / ".retrolog" / "retrolog.db"
    shutil.copyfile(database, project.root / "backup.db")
    import sqlite3

    conn = sqlite3.connect(database)
    conn.execute("DELETE FROM migrations WHERE version = (SELECT MAX(version) FROM migrations)")
    conn.commit()
    conn.close()
    _make_readonly(readonly)
    out = readonly.cli("runs")
    assert out.returncode == 1
    _no_traceback(out)
    said = " ".join(out.stderr.split())  # the paragraph is wrapped to the terminal
    assert "older than this retrolog's" in said and "RETROLOG_STORE" in said
