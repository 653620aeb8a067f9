"""A full disk under the store: training goes on, what fits is kept, nothing is corrupted.

The store sits on a small tmpfs mounted in a private mount namespace (``unshare
-m``, root only), filled by a ballast file so that it runs out of space mid-run.
Everything the test reads is copied out of the namespace before it ends.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from retrolog.errors import StoreError, disk_full
from retrolog.runtime import writer as writer_module
from retrolog.runtime.writer import Event, Writer, _Batch

from conftest import Project

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")

EPOCHS, STEPS = 40, 50
SCRIPT = f"""\
import os
import time
import numpy as np
import retrolog as rl

w = np.zeros(10_000)
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range({EPOCHS})):
        for step in rl.loop("step", range({STEPS})):
            rl.log("blob", f"{{epoch}}-{{step}}-" + "x" * 200)
        w[:] = np.random.default_rng(epoch).random(w.size)  # 80 KB that do not compress
        # An epoch's other work: the writer commits a few times per epoch. The first is
        # longer, so that something is committed before the checkpoints fill the disk even
        # when the machine is busy (the test failed once with nothing kept, under load).
        time.sleep(0.6 if epoch == 0 else 0.05)
        if epoch == 25 and os.environ.get("FREE_AT_25"):
            os.remove(os.environ["BALLAST"])  # the user frees space while training runs
print("training finished")
"""

# Inside the namespace: a 4 MiB store with all but FREE_KIB of it taken by a ballast file.
INSIDE = """\
set -e
mount -t tmpfs -o size=4m tmpfs "$STORE"
dd if=/dev/zero of="$BALLAST" bs=1k count=$((4096 - FREE_KIB)) status=none 2>/dev/null || true
set +e
"$PY" train.py > "$OUT/stdout" 2> "$OUT/stderr"
echo $? > "$OUT/rc"
rm -f "$BALLAST"
"$PY" -m retrolog runs --json > "$OUT/runs.json" 2> "$OUT/runs.err"
cp -a "$STORE" "$OUT/store"
"""


def _train_on_a_full_disk(project: Project, tmp_path: Path, free_later: bool) -> Path:
    project.write("train.py", SCRIPT)
    store = tmp_path / "small-disk"
    store.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    env = project.env(
        RETROLOG_STORE=str(store), BALLAST=str(store / "ballast"), FREE_KIB="700",
        PY=sys.executable, OUT=str(out), STORE=str(store),
    )  # fmt: skip
    if free_later:
        env["FREE_AT_25"] = "1"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.strip()}")
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", INSIDE], cwd=project.root, env=env,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


def _rows(store: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(store / "retrolog.db")
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _blobs(store: Path) -> list[str]:
    conn = sqlite3.connect(store / "retrolog.db")
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return [v for (v,) in conn.execute("SELECT value FROM logs WHERE name = 'blob'")]
    finally:
        conn.close()


def _expected() -> list[str]:
    return [f"{e}-{s}-" + "x" * 200 for e in range(EPOCHS) for s in range(STEPS)]


@pytest.mark.slow
@needs_root
def test_space_freed_during_training_loses_nothing(project: Project, tmp_path: Path) -> None:
    out = _train_on_a_full_disk(project, tmp_path, free_later=True)
    stderr = (out / "stderr").read_text()
    assert (out / "rc").read_text().strip() == "0", stderr
    assert "training finished" in (out / "stdout").read_text()
    assert stderr.count("retrolog: the disk holding the store") == 1, stderr
    assert "has space again" in stderr and "nothing was lost" in stderr, stderr
    assert "Traceback" not in stderr
    assert sorted(_blobs(out / "store")) == sorted(_expected())
    (run,) = json.loads((out / "runs.json").read_text())
    assert run["status"] == "finished"
    # Checkpoints taken while the disk was full are lost, and counted; the others,
    # before and after, are whole and restore exactly.
    ((summary,),) = _rows(out / "store", "SELECT checkpointing FROM runs")
    counts = json.loads(summary)
    assert 0 < counts["written"] < counts["chosen"], counts
    assert "was not written: the disk holding" in stderr, stderr  # a checkpoint
    restored = subprocess.run(
        [sys.executable, "-c",
         "import numpy as np, retrolog as rl\n"
         "w = np.zeros(10_000)\n"
         f"rl.restore({run['run_id']!r}, at='end', w=w)\n"
         f"assert np.array_equal(w, np.random.default_rng({EPOCHS - 1}).random(w.size))\n"],
        cwd=project.root, env=project.env(RETROLOG_STORE=str(out / "store")),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert restored.returncode == 0, restored.stderr


@pytest.mark.slow
@needs_root
def test_a_disk_still_full_at_the_end_keeps_what_was_written(
    project: Project, tmp_path: Path
) -> None:
    out = _train_on_a_full_disk(project, tmp_path, free_later=False)
    stderr = (out / "stderr").read_text()
    # Training was not stopped, and the user is told, in words, what was not kept.
    assert (out / "rc").read_text().strip() == "0", stderr
    assert "training finished" in (out / "stdout").read_text()
    assert "Traceback" not in stderr and "cannot rollback" not in stderr, stderr
    assert "not written: the disk holding" in stderr and "is still full" in stderr, stderr
    assert "was not written: the disk holding" in stderr, stderr  # a checkpoint
    # The store is intact: what was written is a prefix of what was logged, exactly.
    kept = _blobs(out / "store")
    assert 0 < len(kept) < EPOCHS * STEPS
    assert kept == _expected()[: len(kept)]
    # Once space is freed, the run reads as crashed, not as running forever.
    (run,) = json.loads((out / "runs.json").read_text())
    assert run["status"] == "crashed", (out / "runs.err").read_text()


def test_a_full_disk_is_told_from_other_write_failures() -> None:
    no_space = OSError(errno.ENOSPC, "No space left on device")
    wrapped = StoreError("Cannot write object file x")
    wrapped.__cause__ = no_space
    assert disk_full(no_space) and disk_full(wrapped)
    assert disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not disk_full(PermissionError(errno.EACCES, "Permission denied"))
    assert not disk_full(sqlite3.OperationalError("database is locked"))


def test_held_records_over_the_limit_drop_the_newest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(writer_module, "HELD_LIMIT", 5)
    writer = Writer(Path("unused.db"), "run-1")  # never started: _hold is called directly
    writer.values.extend((1, "x", i) for i in range(8))
    batch = _Batch([writer.values.popleft() for _ in range(3)], [], [], [], [])  # did not fit
    flushed = threading.Event()
    writer.events.extend([(Event.PROFILE, "p", None, 0.0, None)] * 6 + [(Event.FLUSH, flushed)])
    full = sqlite3.OperationalError("database or disk is full")
    writer._hold(batch, full)
    # The oldest stay, in order, a consistent prefix; a dropped flush request is answered.
    assert [v[2] for v in writer.values] == [0, 1, 2, 3, 4]
    assert len(writer.events) == 5 and flushed.is_set()
    assert writer.dropped == 3 + 1
    writer._hold(_Batch([], [], [], [], []), full)
    assert capsys.readouterr().err.count("retrolog: the disk holding the store") == 1
