"""PostgreSQL crashes while a run records: every logged value is stored, once.

A server of the test's own (tests/private_postgres.py) is stopped in immediate mode
(``pg_ctl stop -m immediate``) or its postmaster killed with SIGKILL, at random
moments, several times per trial, while a real recording script logs through
``rl.loop`` and ``rl.log`` with ``RETROLOG_DATABASE_URL`` pointing at it; the server
is started again after a random outage. The script writes what it logged to a side
file; at the end every (epoch, step, name, value) it logged must be in the store
exactly once, with its loop rows, and the run finished.

The draws come from one seed, printed in every assertion message:
``RETROLOG_CHAOS_SEED=<seed>`` replays a sequence. ``RETROLOG_SOAK_TRIALS=<n>`` runs
n trials instead of the suite's few (docs/store.md, "What survives a crash").
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from private_postgres import PrivateServer

from conftest import Project

pytestmark = [pytest.mark.slow, pytest.mark.services]

TRIALS = int(os.environ.get("RETROLOG_SOAK_TRIALS", "4"))
CRASHES = 3  # per trial

SCRIPT = """\
import json
import os
import random
import sys
import time

import retrolog as rl

seed, side, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = random.Random(seed)
logged = []
for epoch in rl.loop("epoch", range(100_000)):
    for step in rl.loop("step", range(10)):
        for k in range(8):
            loss = rng.random()
            rl.log(f"loss{k}", loss)
            logged.append([epoch, step, f"loss{k}", loss])
        time.sleep(0.001)
    rl.log("seen", epoch * 10)
    rl.log("note", f"epoch {epoch}")
    logged.append([epoch, None, "seen", epoch * 10])
    logged.append([epoch, None, "note", f"epoch {epoch}"])
    if epoch == 0:
        open(side + ".ready", "w").close()
    if os.path.exists(stop):
        break
with open(side, "w") as f:
    json.dump(logged, f)
"""


@pytest.fixture
def server() -> Iterator[PrivateServer]:
    own = PrivateServer()
    try:
        yield own
    finally:
        own.close()


def _stored(url: str, run_id: str) -> list[tuple[object, ...]]:
    """(epoch, step, name, value) of every value of the run; a value whose loop rows are
    missing has None for what they would give."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT CASE WHEN c.depth = 0 THEN c.iteration ELSE p.iteration END,"
            " CASE WHEN c.depth = 1 THEN c.iteration END, l.name,"
            " COALESCE(l.value_float::text, l.value_int::text, l.value_text)"
            " FROM logs l LEFT JOIN loops c ON c.run_id = l.run_id AND c.ctx_id = l.ctx_id"
            " LEFT JOIN loops p ON p.run_id = c.run_id AND p.ctx_id = c.parent_ctx"
            " WHERE l.run_id = %s AND l.name <> 'seed'",
            (run_id,),
        ).fetchall()
    return [tuple(r) for r in rows]


def _as_text(value: object) -> str:
    # PostgreSQL's float8 text output is the shortest exact form, as Python's repr
    return repr(value) if isinstance(value, float) else str(value)


def _trial(
    project: Project, server: PrivateServer, seed: int, trial: int, rng: random.Random
) -> tuple[int, int, int, list[str]]:
    """One recording with CRASHES crashes; (values logged, checked, lost) and the events."""
    side = project.root / f"logged-{trial}.json"
    stop = project.root / f"stop-{trial}"
    ready = Path(f"{side}.ready")
    proc = subprocess.Popen(
        [sys.executable, "train.py", str(trial), str(side), str(stop)],
        cwd=project.root,
        env=project.env(RETROLOG_DATABASE_URL=server.url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    what = f"seed {seed}, trial {trial}"
    events: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), f"{what}: the script did not start: {proc.communicate()}"
        for _ in range(CRASHES):
            time.sleep(rng.uniform(0.0, 0.6))
            how = rng.choice(["immediate", "kill -9"])
            if how == "immediate":
                server.stop_immediate()
            else:
                server.kill_postmaster()
            outage = rng.uniform(0.0, 1.0)
            time.sleep(outage)
            server.start()
            events.append(f"{how}, {outage:.2f} s down")
        time.sleep(rng.uniform(0.2, 0.6))
        stop.write_text("")
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    what += f" ({'; '.join(events)})"
    assert proc.returncode == 0, f"{what}: the script failed:\n{err[-3000:]}"
    assert "Traceback" not in err, f"{what}:\n{err[-3000:]}"
    if "cannot reach the store" in err:
        assert "the store answers again" in err and "nothing was lost" in err, f"{what}:\n{err}"
    logged = json.loads(side.read_text())
    with psycopg.connect(server.url) as conn:
        ((run_id, status),) = conn.execute(
            "SELECT run_id, status FROM runs WHERE argv LIKE %s", (f'%"{side}"%',)
        ).fetchall()
    assert status == "finished", f"{what}: run {run_id} is {status}"
    expected = Counter((e, s, n, _as_text(v)) for e, s, n, v in logged)
    stored = Counter(_stored(server.url, run_id))
    lost = expected - stored
    extra = stored - expected
    assert not lost and not extra, (
        f"{what}: run {run_id}: {sum(lost.values())} of {len(logged)} logged values missing"
        f" (first: {sorted(lost, key=str)[:5]}), {sum(extra.values())} stored that were not"
        f" logged once (first: {sorted(extra, key=str)[:5]})\n{err[-3000:]}"
    )
    return len(logged), sum(stored.values()), sum(lost.values()), events


def test_values_logged_while_postgresql_crashes_are_all_stored_once(
    project: Project, server: PrivateServer
) -> None:
    seed = int(os.environ.get("RETROLOG_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    project.write("train.py", SCRIPT)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    totals = [0, 0, 0]
    for trial in range(TRIALS):
        logged, checked, lost, _ = _trial(project, server, seed, trial, rng)
        totals[0] += logged
        totals[1] += checked
        totals[2] += lost
    print(
        f"seed {seed}: {TRIALS} trials, {TRIALS * CRASHES} crashes, {totals[0]} values logged,"
        f" {totals[1]} checked, {totals[2]} lost"
    )
