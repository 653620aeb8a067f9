"""The executor contract (_replay/executor.py), held by the local and the Ray executor alike.

Each test runs `retrolog replay` as a user does, once per executor (Ray through the
shared cluster of scripts/services.sh). A numpy training script is recorded three
times: seed 0 whole, with a gate that can hold its replay worker at its start; seed 1
whole; seed 2 crashing with an exception at its epoch 2. The contract:

- every run's values land in the store as that run's workers end, visible to another
  reader (``Project.dataframe``) while other runs still replay; the crashed run's
  values land up to where it stopped;
- every job ends with the values its worker computed or an error, and the finished
  replay has each run's values exactly once;
- Ctrl-C stops the jobs still running (the command exits 130, the replay is recorded
  interrupted), the runs that had landed keep their values, and the next replay does
  only the rest.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import retrolog
from retrolog.errors import UnknownNameError

from conftest import Project, RecordedOnce, ray_env, read_db, read_pg

SCRIPT = """\
import argparse
import os
import time

import numpy as np

import retrolog as rl


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--crash-at", type=int, default=-1)
    # A replay worker that finds this directory says it is there and waits for `open`
    # in it; a recording never finds it.
    parser.add_argument("--gate", default="")
    return parser.parse_args()


def wait_at_gate(gate):
    if not gate or not os.path.isdir(gate):
        return
    open(os.path.join(gate, "waiting"), "w").close()
    deadline = time.monotonic() + 180
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.05)


def main():
    args = parse_args()
    np.random.seed(args.seed)
    w = np.zeros(16)
    wait_at_gate(args.gate)
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(args.epochs)):
            for step in rl.loop("step", range(3)):
                x = np.random.standard_normal((8, w.shape[0]))
                w -= 0.05 * x.T @ (x @ w - 1.0) / len(x)
            rl.log("loss", float(np.mean((x @ w - 1.0) ** 2)))
            if epoch == args.crash_at:
                raise RuntimeError("diverged")


if __name__ == "__main__":
    main()
"""
NEW = SCRIPT.replace(
    '            rl.log("loss", float(np.mean((x @ w - 1.0) ** 2)))\n',
    '            rl.log("loss", float(np.mean((x @ w - 1.0) ** 2)))\n'
    '            rl.log("w_norm", float(np.linalg.norm(w)))\n',
)
EXECUTORS = ["local", pytest.param("ray", marks=[pytest.mark.slow, pytest.mark.services])]


def _record(project: Project, gate: Path, **env: str) -> dict[int, str]:
    """The three runs (seed -> run id), then NEW as today's script; ``env``: e.g. the
    PostgreSQL store's RETROLOG_DATABASE_URL."""
    project.write("train.py", SCRIPT)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py", "--seed", "0", "--gate", str(gate), **env)
    project.run("train.py", "--seed", "1", **env)
    crashed = project.run("train.py", "--seed", "2", "--crash-at", "2", check=False, **env)
    assert crashed.returncode == 1, crashed.stderr
    project.write("train.py", NEW)
    return _seeds(project, env.get("RETROLOG_DATABASE_URL"))


def _seeds(project: Project, url: str | None = None) -> dict[int, str]:
    """Each recorded run's seed -> its run id."""
    seeds = {}
    query = "SELECT run_id, argv FROM runs"
    for run_id, argv in read_pg(url, query) if url else read_db(project.root, query):
        args = json.loads(str(argv))
        seeds[int(args[args.index("--seed") + 1])] = str(run_id)
    return seeds


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory) -> RecordedOnce:
    """The three runs on the embedded store, recorded once for the tests of both executors
    (each starts from the recording: ``recorded``); seed 0's gate is beside the project."""
    return RecordedOnce.record(tmp_path_factory, lambda project: _record(project, _gate(project)))


def _gate(project: Project) -> Path:
    return project.root.parent / "gate"


@pytest.fixture
def recorded(recorded_once: RecordedOnce) -> tuple[Project, Path, dict[int, str]]:
    """The project just after recording, its closed gate and its runs by seed."""
    project = recorded_once.fresh()
    gate = _gate(project)
    shutil.rmtree(gate, ignore_errors=True)
    gate.mkdir()
    return project, gate, _seeds(project)


def _w_norm_counts(root: Path) -> dict[str, int]:
    """Each run's w_norm values, as another reader of the store sees them now."""
    try:
        frame = retrolog.Project(root).dataframe("w_norm")
    except UnknownNameError:  # no run has a value yet
        return {}
    counts = frame.dropna(subset=["w_norm"]).groupby("run_id").size()
    return {str(run_id): int(n) for run_id, n in counts.items()}


def _env(executor: str, request: pytest.FixtureRequest) -> dict[str, str]:
    if executor == "local":
        return {}
    return ray_env(request.getfixturevalue("ray_address"))


def _wait_until_held(project: Project, gate: Path, seeds: dict[int, str], replay: Any) -> None:
    """Until seeds 1 and 2 have landed and seed 0's worker waits at the gate."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and replay.poll() is None:
        seen = _w_norm_counts(project.root)
        if seeds[1] in seen and seeds[2] in seen and (gate / "waiting").exists():
            return
        time.sleep(0.2)
    raise AssertionError(f"not held at the gate: {seen}, exit {replay.poll()}")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_each_runs_values_land_as_its_replay_ends(
    recorded: tuple[Project, Path, dict[int, str]], executor: str, request: pytest.FixtureRequest
) -> None:
    project, gate, seeds = recorded
    replay = project.start_cli(
        "replay", "w_norm", "--yes", "--workers", "2", "--executor", executor,
        **_env(executor, request),
    )  # fmt: skip
    # Seed 0's worker waits at the gate; the values of the other two runs must be
    # readable while it does (seed 0 may start first or after them: the contract keeps
    # the order given, which the plan makes).
    try:
        _wait_until_held(project, gate, seeds, replay)
        # Run 1 whole (4 epochs); the crashed run up to where it stopped: the epochs it
        # finished, not the one it raised in.
        assert _w_norm_counts(project.root) == {seeds[1]: 4, seeds[2]: 2}
    finally:
        (gate / "open").touch()
        _, stderr = replay.communicate(timeout=300)
    assert replay.returncode == 0, stderr
    assert "Replayed 3 run(s); backfilled 10 value(s)." in stderr
    assert _w_norm_counts(project.root) == {seeds[0]: 4, seeds[1]: 4, seeds[2]: 2}
    statuses = read_db(project.root, "SELECT executor, status FROM replays")
    assert statuses == [(executor, "finished")]


def test_each_runs_values_land_in_postgresql_as_its_replay_ends(
    project: Project, tmp_path: Path, pg_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The replay runs on a working copy of the PostgreSQL store: each run's values must
    # reach PostgreSQL as that run lands there, not when the whole replay ends.
    gate = tmp_path / "gate"
    seeds = _record(project, gate, RETROLOG_DATABASE_URL=pg_store_url)
    monkeypatch.setenv("RETROLOG_DATABASE_URL", pg_store_url)  # _w_norm_counts' reader
    gate.mkdir()
    replay = project.start_cli(
        "replay", "w_norm", "--yes", "--workers", "2", RETROLOG_DATABASE_URL=pg_store_url
    )
    try:
        _wait_until_held(project, gate, seeds, replay)
        assert _w_norm_counts(project.root) == {seeds[1]: 4, seeds[2]: 2}
        # The replay's row is there first, running; its runs that landed are listed.
        assert read_pg(pg_store_url, "SELECT status FROM replays") == [("running",)]
        landed = read_pg(pg_store_url, "SELECT run_id, backfilled FROM replay_runs")
        assert sorted(landed) == sorted([(seeds[1], 4), (seeds[2], 2)])
    finally:
        (gate / "open").touch()
        _, stderr = replay.communicate(timeout=300)
    assert replay.returncode == 0, stderr
    assert "Replayed 3 run(s); backfilled 10 value(s)." in stderr
    assert _w_norm_counts(project.root) == {seeds[0]: 4, seeds[1]: 4, seeds[2]: 2}
    assert read_pg(pg_store_url, "SELECT status FROM replays") == [("finished",)]
    counts = read_pg(pg_store_url, "SELECT run_id, backfilled FROM replay_runs")
    assert sorted(counts) == sorted([(seeds[0], 4), (seeds[1], 4), (seeds[2], 2)])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_ctrl_c_stops_the_running_jobs_and_keeps_the_runs_that_landed(
    recorded: tuple[Project, Path, dict[int, str]], executor: str, request: pytest.FixtureRequest
) -> None:
    project, gate, seeds = recorded
    replay = project.start_cli(
        "replay", "w_norm", "--yes", "--workers", "2", "--executor", executor,
        **_env(executor, request),
    )  # fmt: skip
    try:
        _wait_until_held(project, gate, seeds, replay)
        replay.send_signal(signal.SIGINT)
        _, stderr = replay.communicate(timeout=120)
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.communicate()
    assert replay.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert read_db(project.root, "SELECT status FROM replays") == [("interrupted",)]
    # The runs that had landed keep their values; the stopped one has none.
    assert _w_norm_counts(project.root) == {seeds[1]: 4, seeds[2]: 2}
    # Replayed again, only the stopped run is.
    (gate / "open").touch()
    again = project.cli("replay", "w_norm", "--yes", "--executor", executor,
                        **_env(executor, request))  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "Replayed 1 run(s); backfilled 4 value(s)." in again.stderr
    assert _w_norm_counts(project.root) == {seeds[0]: 4, seeds[1]: 4, seeds[2]: 2}


def test_ctrl_c_keeps_the_runs_that_landed_in_postgresql(
    project: Project, tmp_path: Path, pg_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    seeds = _record(project, gate, RETROLOG_DATABASE_URL=pg_store_url)
    monkeypatch.setenv("RETROLOG_DATABASE_URL", pg_store_url)  # _w_norm_counts' reader
    gate.mkdir()
    replay = project.start_cli(
        "replay", "w_norm", "--yes", "--workers", "2", RETROLOG_DATABASE_URL=pg_store_url
    )
    try:
        _wait_until_held(project, gate, seeds, replay)
        replay.send_signal(signal.SIGINT)
        _, stderr = replay.communicate(timeout=120)
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.communicate()
    assert replay.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert read_pg(pg_store_url, "SELECT status FROM replays") == [("interrupted",)]
    assert _w_norm_counts(project.root) == {seeds[1]: 4, seeds[2]: 2}
    counts = read_pg(pg_store_url, "SELECT run_id, backfilled FROM replay_runs")
    assert sorted(counts) == sorted([(seeds[1], 4), (seeds[2], 2)])
    (gate / "open").touch()
    again = project.cli("replay", "w_norm", "--yes", RETROLOG_DATABASE_URL=pg_store_url)
    assert again.returncode == 0, again.stderr
    assert "Replayed 1 run(s); backfilled 4 value(s)." in again.stderr
    assert _w_norm_counts(project.root) == {seeds[0]: 4, seeds[1]: 4, seeds[2]: 2}
