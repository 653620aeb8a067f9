"""A replay coordinator killed from outside leaves nothing running and nothing held.

SIGTERM (a timeout, a batch scheduler) and SIGKILL (the OOM killer) of the
``retrolog replay`` process while its worker trains: the worker dies with it,
the temporary checkout is removed (at once for SIGTERM, by the next ``gc`` or
``replay`` for SIGKILL), the replay is marked interrupted, and a second replay
backfills exact values with no duplicates.
"""

from __future__ import annotations

import functools
import os
import signal
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import Project, read_db, replay_workers

pytestmark = pytest.mark.slow

SCRIPT = """\
import time

import numpy as np
import retrolog as rl

np.random.seed(0)
state = {"w": np.zeros(2)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(4)):
        for step in rl.loop("step", range(4)):
            state["w"] += np.random.standard_normal(2)
            time.sleep(0.5)
        rl.log("w0", float(state["w"][0]))
"""

PROBE = SCRIPT.replace(
    "            time.sleep(0.5)\n",
    '            time.sleep(0.5)\n            rl.log("w1", float(state["w"][1]))\n',
)


def _start_replay(
    project: Project, script: str = SCRIPT, probe: str = PROBE, tmp: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """Start a replay and return once its worker is training; (process, checkout marker).

    tmp: the coordinator's temporary directory (TMPDIR), for its checkouts.
    """
    project.write("train.py", script)
    project.run("train.py")
    project.write("train.py", probe)
    env = {} if tmp is None else {"TMPDIR": str(tmp)}
    proc = project.start_cli("replay", "w1", "--yes", **env)
    marker = f"{tmp or tempfile.gettempdir()}/retrolog-checkout-{proc.pid}-"
    # This coordinator's workers only (their checkouts carry its pid): the machine may
    # run other replays meanwhile, which must be neither waited for nor killed.
    deadline = time.monotonic() + 60
    while not replay_workers(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert replay_workers(marker), "the worker did not start"
    time.sleep(1.0)  # training, inside the step loop
    return proc, marker


def _checkouts(marker: str) -> list[Path]:
    return list(Path(marker).parent.glob(Path(marker).name + "*"))


def _gone(pred, seconds: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def _replays_again_exactly(project: Project) -> None:
    done = project.cli("replay", "w1", "--yes")
    assert done.returncode == 0, done.stderr
    rows = read_db(
        project.root,
        "SELECT l.ctx_id, COUNT(*), MIN(value) FROM logs l WHERE name = 'w1' GROUP BY l.ctx_id",
    )
    assert rows and all(count == 1 for _, count, _ in rows)  # no duplicates
    replayed = sorted(v for _, _, v in rows)
    assert replayed == _fresh_w1()


@functools.cache
def _fresh_w1() -> list[float]:
    """The w1 values a fresh run of PROBE logs, sorted. The tests' variants of PROBE differ
    only in how long they sleep, which changes no value, so one fresh run, without the
    sleeps, stands for each (once per module)."""
    script = PROBE.replace("time.sleep(0.5)", "pass")
    assert "sleep" not in script.replace("import time", "")
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Project(Path(tmp))
        fresh.write("train.py", script)
        fresh.run("train.py", RETROLOG_STORE=str(Path(tmp) / "s"))
        conn = sqlite3.connect(Path(tmp) / "s" / "retrolog.db")
        values = sorted(v for (v,) in conn.execute("SELECT value FROM logs WHERE name = 'w1'"))
        conn.close()
    assert len(values) == 16
    return values


def test_sigkill_of_the_coordinator_kills_its_worker_and_gc_sweeps_the_rest(
    project: Project,
) -> None:
    # A temporary directory of its own: any replay sweeps the checkouts of dead
    # coordinators, and another test's, running meanwhile, once swept this one's first.
    tmp = project.root.parent / "tmp"
    tmp.mkdir()
    proc, marker = _start_replay(project, tmp=tmp)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    # The worker has seconds of training left: gone this soon, it was killed.
    assert _gone(lambda: not replay_workers(marker), 3.0), "the worker outlived its coordinator"
    assert _checkouts(marker), "nothing to sweep: the test no longer tests the sweep"
    assert read_db(project.root, "SELECT status FROM replays") == [("running",)]

    swept = project.cli("gc", "--dry-run", TMPDIR=str(tmp))
    assert swept.returncode == 0, swept.stderr
    assert not _checkouts(marker)
    assert read_db(project.root, "SELECT status FROM replays") == [("interrupted",)]
    _replays_again_exactly(project)


def test_sigterm_of_the_coordinator_stops_and_cleans_up_like_ctrl_c(project: Project) -> None:
    proc, marker = _start_replay(project)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert not replay_workers(marker)
    assert not _checkouts(marker)
    assert read_db(project.root, "SELECT status FROM replays") == [("interrupted",)]


def test_a_run_whose_worker_was_killed_is_replayed_again_in_full(project: Project) -> None:
    """One segment's worker killed, the other finished: the run is partial, not done."""
    quick = SCRIPT.replace("time.sleep(0.5)", "time.sleep(0.2)")
    proc, marker = _start_replay(
        project, quick, PROBE.replace("time.sleep(0.5)", "time.sleep(0.2)")
    )
    assert _gone(lambda: len(replay_workers(marker)) == 2, 30.0), "expected two segments"
    os.kill(replay_workers(marker)[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err
    assert read_db(project.root, "SELECT status FROM replay_runs") == [("partial",)], err
    # Half the contexts have values: the next replay must fill in the rest.
    _replays_again_exactly(project)


def test_a_run_whose_replay_was_stopped_after_one_segment_is_replayed_again_in_full(
    project: Project,
) -> None:
    """One segment finished, the other stopped by SIGTERM to the coordinator: the run is
    partial, not done (found by the chaos test, seed 150841899: the next replay said every
    run already had the name, with a third of its contexts empty)."""
    uneven = "time.sleep(0.1 if epoch < 2 else 1.0)"  # the second segment runs far longer
    proc, marker = _start_replay(
        project, SCRIPT.replace("time.sleep(0.5)", uneven), PROBE.replace("time.sleep(0.5)", uneven)
    )
    assert _gone(lambda: len(replay_workers(marker)) == 2, 30.0), "expected two segments"
    assert _gone(lambda: len(replay_workers(marker)) == 1, 60.0), "the first did not finish"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert read_db(project.root, "SELECT status FROM replay_runs") == [("partial",)], err
    _replays_again_exactly(project)
