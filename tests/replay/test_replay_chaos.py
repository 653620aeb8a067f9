"""Chaos: replays killed at random moments, their coordinator or a worker, by any signal.

Each round starts ``retrolog replay`` of a new statement over two recorded runs
(default workers), waits a random moment once workers train, then sends SIGKILL
or SIGTERM to the coordinator or to one worker, chosen at random. After every
round: no replay process is left, and the user's branches, HEAD, index and files
are byte for byte what they were (retrolog's own refs and store may change).
At the end a plain replay finishes, and each context has exactly one value,
equal to what a fresh run of today's script computes.

The same rounds run on runs recorded into PostgreSQL (a server of the test's own,
tests/private_postgres.py), where a round may instead crash the database server
(``pg_ctl stop -m immediate`` or SIGKILL to its postmaster) while the replay
trains, and start it again after a random outage: the replay ends with its one
paragraph, never a traceback, and the final replay is as exact.

The draws come from one seed, printed in every assertion message, so a failing
sequence can be replayed: RETROLOG_CHAOS_SEED=<seed> pytest this file.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from private_postgres import PrivateServer

from conftest import Project, logged_values, read_db, read_pg, replay_workers

pytestmark = pytest.mark.slow

ROUNDS = 3
SEEDS = (0, 1)

SCRIPT = """\
import argparse
import time

import numpy as np
import retrolog as rl

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
np.random.seed(args.seed)  # numpy's global generator: checkpoints hold its state
state = {"w": np.zeros(2)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(4)):
            state["w"] += np.random.standard_normal(2)
            time.sleep(0.1)
        rl.log("w0", float(state["w"][0]))
"""

PROBE = SCRIPT.replace(
    "            time.sleep(0.1)\n",
    '            time.sleep(0.1)\n            rl.log("w1", float(state["w"][1]))\n',
)

STATUS = ("status", "--porcelain=v2", "--untracked-files=all", "--ignored", "--", ".")
STATUS += (":(exclude).retrolog",)  # retrolog's store is retrolog's


def _user_state(project: Project) -> dict[str, str]:
    """Everything of the user's that retrolog must not change."""
    root = project.root
    state = {
        "HEAD": project.git("rev-parse", "HEAD"),
        "symbolic": (root / ".git" / "HEAD").read_text(),
        "branches": project.git("for-each-ref", "refs/heads", "refs/tags", "refs/stash"),
        "index": hashlib.sha256((root / ".git" / "index").read_bytes()).hexdigest(),
        "status": project.git(*STATUS),
    }
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if path.is_file() and parts[0] not in (".git", ".retrolog"):
            state[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def _wait_for(pred, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def _chaos_round(
    project: Project,
    rng: random.Random,
    seed: int,
    n: int,
    coordinators: list[int],
    server: PrivateServer | None = None,
) -> str:
    env = {"RETROLOG_DATABASE_URL": server.url} if server else {}
    proc = project.start_cli("replay", "w1", "--yes", **env)
    coordinators.append(proc.pid)
    # This coordinator's workers only: the machine may run other replays meanwhile.
    mine = f"{tempfile.gettempdir()}/retrolog-checkout-{proc.pid}-"
    # Until a worker trains, or the replay ends first (nothing left to do after earlier rounds).
    _wait_for(lambda: replay_workers(mine) or proc.poll() is not None, 60)
    what = f"seed {seed}, round {n}"
    if not replay_workers(mine):
        _, err = proc.communicate(timeout=60)
        return f"{what}: no worker started (rc {proc.returncode}): {err[-300:]}"
    time.sleep(rng.uniform(0.0, 2.0))
    if server is not None and rng.random() < 0.5:
        how = rng.choice(["immediate", "kill -9"])
        if how == "immediate":
            server.stop_immediate()
        else:
            server.kill_postmaster()
        outage = rng.uniform(0.0, 2.0)
        time.sleep(outage)
        server.start()
        what += f": the database server stopped ({how}) for {outage:.2f} s"
        _, err = proc.communicate(timeout=120)
        assert "Traceback" not in err, f"{what}\n{err}"
        # It finishes once the server is back, or says why not and what to do.
        assert proc.returncode == 0 or "once the server answers" in err, f"{what}\n{err}"
        assert _wait_for(lambda: not replay_workers(mine), 5.0), f"{what}: a worker outlived it"
        return what + f", the replay exited {proc.returncode}"
    sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
    workers = replay_workers(mine)
    target = "coordinator" if not workers or rng.random() < 0.5 else "worker"
    pid = proc.pid if target == "coordinator" else rng.choice(workers)
    what += f": {sig.name} to the {target}"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        what += " (already gone)"
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, f"{what}\n{err}"
    assert _wait_for(lambda: not replay_workers(mine), 5.0), f"{what}: a worker outlived it"
    return what


def test_replays_killed_at_random_leave_nothing_behind_and_finish_exactly(
    project: Project,
) -> None:
    seed = int(os.environ.get("RETROLOG_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    project.write("train.py", SCRIPT)
    project.write("data/cache.bin", "the user's ignored data\n")
    project.write("notes.txt", "untracked notes\n")
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    for s in SEEDS:
        project.run("train.py", "--seed", str(s))
    project.write("train.py", PROBE)  # today's edit, uncommitted
    project.git("add", "notes.txt")  # something staged, so the index is the user's too
    before = _user_state(project)

    coordinators: list[int] = []
    rounds = [_chaos_round(project, rng, seed, n, coordinators) for n in range(ROUNDS)]
    assert _user_state(project) == before, f"seed {seed}: {rounds}"

    done = project.cli("replay", "w1", "--yes")
    assert done.returncode == 0, f"seed {seed}: {rounds}\n{done.stderr}"
    # Whatever killed coordinators left in /tmp, the next replay swept.
    left = [
        p for pid in coordinators
        for p in Path(tempfile.gettempdir()).glob(f"retrolog-checkout-{pid}-*")
    ]  # fmt: skip
    assert not left, f"seed {seed}: {rounds}: {left}"
    assert _user_state(project) == before, f"seed {seed}: {rounds}"
    # One value per context, none left over from the killed replays.
    counts = read_db(
        project.root,
        "SELECT COUNT(*) FROM logs WHERE name = 'w1' GROUP BY run_id, ctx_id",
    )
    assert len(counts) == len(SEEDS) * 12, f"seed {seed}: {rounds}"
    assert {n for (n,) in counts} == {1}, f"seed {seed}: duplicates, {rounds}"
    seeds = dict(read_db(project.root, "SELECT run_id, value FROM logs WHERE name = 'seed'"))
    replayed = {
        (seeds[run], epoch, step): value
        for (run, _, epoch, step), value in logged_values(
            project.root / ".retrolog" / "retrolog.db", "WHERE l.name = 'w1'"
        ).items()
    }
    fresh = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in SEEDS:
            store = Path(tmp) / f"s{s}"
            project.run("train.py", "--seed", str(s), RETROLOG_STORE=str(store))
            for (_, _, epoch, step), value in logged_values(
                store / "retrolog.db", "WHERE l.name = 'w1'"
            ).items():
                fresh[(s, epoch, step)] = value
    inexact = project.cli("query", "SELECT * FROM replay_runs", "--json")
    assert replayed == fresh, f"seed {seed}: {rounds}\n{inexact.stdout}"


@pytest.fixture
def server() -> Iterator[PrivateServer]:
    own = PrivateServer()
    try:
        yield own
    finally:
        own.close()


def test_replays_of_postgresql_runs_with_the_server_crashed_at_random_finish_exactly(
    project: Project, server: PrivateServer
) -> None:
    seed = int(os.environ.get("RETROLOG_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    url = server.url
    project.write("train.py", SCRIPT)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    for s in SEEDS:
        project.run("train.py", "--seed", str(s), RETROLOG_DATABASE_URL=url)
    project.write("train.py", PROBE)
    before = _user_state(project)

    coordinators: list[int] = []
    rounds = [_chaos_round(project, rng, seed, n, coordinators, server) for n in range(ROUNDS)]
    print(f"seed {seed}: {rounds}")
    assert _user_state(project) == before, f"seed {seed}: {rounds}"

    done = project.cli("replay", "w1", "--yes", RETROLOG_DATABASE_URL=url)
    assert done.returncode == 0, f"seed {seed}: {rounds}\n{done.stderr}"
    assert _user_state(project) == before, f"seed {seed}: {rounds}"
    rows = read_pg(
        url,
        "SELECT r.value_int, e.iteration, s.iteration, l.value_float FROM logs l"
        " JOIN loops s ON s.run_id = l.run_id AND s.ctx_id = l.ctx_id"
        " JOIN loops e ON e.run_id = s.run_id AND e.ctx_id = s.parent_ctx"
        " JOIN logs r ON r.run_id = l.run_id AND r.name = 'seed'"
        " WHERE l.name = 'w1'",
    )
    assert len(rows) == len(SEEDS) * 12, f"seed {seed}: {rounds}: {len(rows)} values"
    replayed = {(s, e, st): v for s, e, st, v in rows}
    assert len(replayed) == len(rows), f"seed {seed}: duplicates, {rounds}"
    fresh = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in SEEDS:
            store = Path(tmp) / f"s{s}"
            project.run("train.py", "--seed", str(s), RETROLOG_STORE=str(store))
            for (_, _, epoch, step), value in logged_values(
                store / "retrolog.db", "WHERE l.name = 'w1'"
            ).items():
                fresh[(s, epoch, step)] = value
    assert replayed == fresh, f"seed {seed}: {rounds}"
