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

And on runs whose objects are at an S3-compatible server of the test's own
(tests/s3_outage.py, with a short RETROLOG_OBJECTS_TIMEOUT), each round stops that
server (its endpoint down), pauses it (SIGSTOP) or restarts it at a random moment
of a replay (``--force``, so each round has work), planning included, and may kill
the coordinator during the outage:
a replay never hangs on a store that does not answer, ends with its one paragraph
or finishes, and the final replay, with the server back, is as exact.

The draws come from one seed, printed in every assertion message, so a failing
sequence can be replayed: RETROLOG_CHAOS_SEED=<seed> pytest this file.
RETROLOG_SOAK_TRIALS=<n> runs n rounds per test instead of 3.
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
from s3_outage import BUCKET, OwnS3

from conftest import Project, logged_values, read_db, read_pg, replay_workers

pytestmark = [pytest.mark.slow, pytest.mark.services]

ROUNDS = int(os.environ.get("RETROLOG_SOAK_TRIALS") or 3)
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

# Values of the last epoch only: a replay of one run on the default workers splits it,
# and the last epoch's worker restores the checkpoint before it from the object store.
S3_SEEDS = (0,)
LAST_EPOCH = SCRIPT.replace(
    "            time.sleep(0.1)\n",
    "            time.sleep(0.1)\n"
    '            if epoch == 2:\n                rl.log("w1", float(state["w"][1]))\n',
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


# Seconds an object store request may go unanswered in the S3 test: short, so a round
# whose store stays down ends in seconds.
OBJECTS_TIMEOUT = 3
# A replay against a store that stays down must end within this: each of its requests
# gives up after the timeout (later ones sooner), and a restore that fails executes its
# block instead. Generous for a busy 2-core machine; a wait without limit exceeds it.
GIVES_UP_WITHIN = 60.0


def _error_paragraph(err: str) -> str:
    """What the command said after "Error: ", which must be its last, one paragraph."""
    assert "Error: " in err, err
    error = err[err.index("Error: ") :].strip()
    assert "\n\n" not in error, error
    return " ".join(error.split())


def _s3_chaos_round(
    project: Project,
    rng: random.Random,
    seed: int,
    n: int,
    coordinators: list[int],
    s3: OwnS3,
    env: dict[str, str],
) -> str:
    # --force: every round recomputes the values, from checkpoints on the store, even
    # those an earlier round backfilled.
    proc = project.start_cli("replay", "w1", "--yes", "--force", **env)
    coordinators.append(proc.pid)
    mine = f"{tempfile.gettempdir()}/retrolog-checkout-{proc.pid}-"
    what = f"seed {seed}, round {n}"
    try:
        # While the coordinator plans (it probes the store's restore speed), or once
        # workers train (they restore checkpoints from the store).
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 3.0))
            what += ": while planning or starting"
        else:
            _wait_for(lambda: replay_workers(mine) or proc.poll() is not None, 60)
            time.sleep(rng.uniform(0.0, 1.5))
            what += ": once workers trained" if replay_workers(mine) else ": after it ended"
        # The first round keeps the store down, and the coordinator alive, until the
        # replay ends: every sequence checks that a replay gives up rather than hangs.
        first = n == 0
        fault = rng.choice(["stopped", "paused"] if first else ["stopped", "paused", "restarted"])
        kill = None if first else rng.choice([None, None, signal.SIGKILL, signal.SIGTERM])
        if fault == "paused":
            s3.pause()
        else:
            s3.stop()
        if fault == "restarted":
            s3.start()
            what += ", the object store restarted"
        # Down until the replay gives up on it and ends, or only a while.
        held = first or rng.random() < 0.5
        outage = None if held else rng.uniform(0.0, 2 * OBJECTS_TIMEOUT)
        if fault != "restarted":
            lasting = "until the replay ended" if outage is None else f"for {outage:.2f} s"
            what += f", the object store {fault} {lasting}"
        if kill is not None:
            time.sleep(rng.uniform(0.0, 1.0))
            what += f", {kill.name} to the coordinator"
            try:
                os.kill(proc.pid, kill)
            except ProcessLookupError:
                what += " (already gone)"
        if fault != "restarted":
            if outage is None:
                if not _wait_for(lambda: proc.poll() is not None, GIVES_UP_WITHIN):
                    proc.kill()
                    _, err = proc.communicate()
                    raise AssertionError(
                        f"{what}: still running after {GIVES_UP_WITHIN:.0f} s\n{err}"
                    )
            else:
                time.sleep(outage)
            if fault == "paused":
                s3.resume()
            else:
                s3.start()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if s3.paused:
            s3.resume()
        if s3.proxy is None:
            s3.start()
    what += f", the replay exited {proc.returncode}"
    assert "Traceback" not in err, f"{what}\n{err}"
    if proc.returncode not in (0, -signal.SIGKILL) and kill is None:
        said = _error_paragraph(err)
        assert proc.returncode == 1, f"{what}\n{err}"
        # A store that did not answer says so, and what to do.
        if "object store" in said:
            assert "RETROLOG_OBJECTS_TIMEOUT" in said, f"{what}\n{err}"
    assert _wait_for(lambda: not replay_workers(mine), 5.0), f"{what}: a worker outlived it"
    return what


@pytest.fixture
def own_s3(tmp_path: Path) -> Iterator[OwnS3]:
    s3 = OwnS3(tmp_path / "s3")
    try:
        s3.make_bucket()
        yield s3
    finally:
        s3.close()


def test_replays_of_s3_runs_with_the_object_store_down_at_random_finish_exactly(
    project: Project, own_s3: OwnS3
) -> None:
    seed = int(os.environ.get("RETROLOG_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    env = {
        **own_s3.env(),
        "RETROLOG_OBJECTS_URL": f"s3://{BUCKET}/chaos",
        "RETROLOG_OBJECTS_TIMEOUT": str(OBJECTS_TIMEOUT),
    }
    project.write("train.py", SCRIPT)
    project.write("data/cache.bin", "the user's ignored data\n")
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    for s in S3_SEEDS:
        project.run("train.py", "--seed", str(s), **env)
    # The checkpoints went to the server, none to the project's directory.
    objects = project.root / ".retrolog" / "objects"
    assert not objects.exists() or not any(p.is_file() for p in objects.rglob("*"))
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints") != [(0,)]
    project.write("train.py", LAST_EPOCH)
    before = _user_state(project)

    coordinators: list[int] = []
    rounds = [
        _s3_chaos_round(project, rng, seed, n, coordinators, own_s3, env) for n in range(ROUNDS)
    ]
    print(f"seed {seed}: {rounds}")
    assert _user_state(project) == before, f"seed {seed}: {rounds}"

    done = project.cli("replay", "w1", "--yes", **env)
    assert done.returncode == 0, f"seed {seed}: {rounds}\n{done.stderr}"
    assert "Traceback" not in done.stderr, f"seed {seed}: {rounds}\n{done.stderr}"
    assert _user_state(project) == before, f"seed {seed}: {rounds}"
    counts = read_db(
        project.root,
        "SELECT COUNT(*) FROM logs WHERE name = 'w1' GROUP BY run_id, ctx_id",
    )
    assert len(counts) == len(S3_SEEDS) * 4, f"seed {seed}: {rounds}"
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
        for s in S3_SEEDS:
            store = Path(tmp) / f"s{s}"
            project.run("train.py", "--seed", str(s), RETROLOG_STORE=str(store))
            for (_, _, epoch, step), value in logged_values(
                store / "retrolog.db", "WHERE l.name = 'w1'"
            ).items():
                fresh[(s, epoch, step)] = value
    assert replayed == fresh, f"seed {seed}: {rounds}"


def test_replay_workers_get_the_users_object_store_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The environment a worker (or its fork server) starts with keeps the one retrolog
    setting that bounds its waits on the object store; the others it does not carry."""
    from retrolog._replay.execute import run_worker_env

    monkeypatch.setenv("RETROLOG_OBJECTS_TIMEOUT", "3")
    monkeypatch.setenv("RETROLOG_OBJECTS_URL", "s3://bucket/prefix")
    env = run_worker_env(None)
    assert env["RETROLOG_OBJECTS_TIMEOUT"] == "3"
    assert "RETROLOG_OBJECTS_URL" not in env  # the worker's spec says where the objects are
