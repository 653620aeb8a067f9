"""Recording into PostgreSQL chosen by ``database_url`` alone: real scripts, real server.

Each test gets a schema of its own on the test server (``pg_store_url``), and reads
what landed with plain psycopg.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from training_scripts import REAL_SHAPED, STEPPING

from conftest import Project, pg_role, read_pg

pytestmark = pytest.mark.slow

# Shaped like a real script: argparse, the loops inside a function, state that is
# checkpointed, values of every kind the store keeps apart.
SCRIPT = """\
import argparse

import numpy as np

import retrolog as rl


def train(args):
    rng = np.random.default_rng(args.seed)
    w = np.zeros(512)
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(args.epochs)):
            for step in rl.loop("step", range(args.steps)):
                w += rng.random(512) * args.lr
                rl.log("loss", (args.lr * (step + 1)) / 7.0 + epoch)
            rl.log("w_sum", float(w.sum()))
            rl.log("big", 2**70 + epoch)
            rl.log("nan", float("nan"))
            rl.log("tag", f"epoch-{epoch}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args())
"""


def _value(row: tuple[object, ...]) -> object:
    set_ones = [v for v in row if v is not None]
    assert len(set_ones) <= 1, row  # one column per value, by its type
    return set_ones[0] if set_ones else None


@pytest.mark.parametrize("objects", ["local", "s3"])
def test_eight_runs_recording_at_once_all_land(
    project: Project, pg_store_url: str, objects: str, request: pytest.FixtureRequest
) -> None:
    """Metadata in PostgreSQL; checkpoints in the project's store, or on the S3 server.
    Default settings: the adaptive checkpoint rule (the suite pins "every"; users don't)."""
    project.write("train.py", SCRIPT)
    # The S3 fixture puts the server's address and credentials in the environment first.
    s3 = {"RETROLOG_OBJECTS_URL": request.getfixturevalue("s3_url")} if objects == "s3" else {}
    env = project.env(RETROLOG_DATABASE_URL=pg_store_url, RETROLOG_CHECKPOINTS="", **s3)
    lrs = [0.1 * (i + 1) for i in range(8)]
    procs = [
        subprocess.Popen(
            [sys.executable, "train.py", "--lr", repr(lr), "--seed", str(i)],
            cwd=project.root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, lr in enumerate(lrs)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err

    runs = read_pg(
        pg_store_url,
        "SELECT run_id, status, parsed_args, code_commit, filename FROM runs"
        " ORDER BY started_at, run_id",
    )
    runs_order = {str(r[0]): i for i, r in enumerate(runs)}
    assert len(runs) == 8
    assert {r[1] for r in runs} == {"finished"}
    assert all(r[3] and r[4] == "train.py" for r in runs)
    by_lr = {json.loads(str(r[2]))["lr"]: str(r[0]) for r in runs}
    assert sorted(by_lr) == lrs  # argparse's flags, parsed, on every run
    for lr, run_id in by_lr.items():
        losses = read_pg(
            pg_store_url,
            "SELECT l.value_float, l.value_int, l.value_text FROM logs l"
            " JOIN loops s ON s.run_id = l.run_id AND s.ctx_id = l.ctx_id"
            " JOIN loops e ON e.run_id = s.run_id AND e.ctx_id = s.parent_ctx"
            " WHERE l.run_id = %s AND l.name = 'loss' ORDER BY e.iteration, s.iteration",
            (run_id,),
        )
        # Bit for bit what the script computed, each once, in order.
        expected = [(lr * (step + 1)) / 7.0 + epoch for epoch in range(3) for step in range(200)]
        assert [_value(r) for r in losses] == expected
        kinds = dict(
            read_pg(
                pg_store_url,
                "SELECT name, string_agg(DISTINCT value_type, ',') FROM logs"
                " WHERE run_id = %s GROUP BY name",
                (run_id,),
            )
        )
        assert kinds == {"loss": "float", "w_sum": "float", "big": "text", "nan": "float",
                         "tag": "str", "lr": "float", "epochs": "int", "steps": "int",
                         "seed": "int"}  # fmt: skip
        big = read_pg(
            pg_store_url,
            "SELECT value_float, value_int, value_text FROM logs WHERE run_id = %s"
            " AND name IN ('big', 'nan') ORDER BY name, log_id",
            (run_id,),
        )
        # Beyond 64 bits an int is kept as its digits; NaN is NULL with value_type float.
        assert [_value(r) for r in big] == [str(2**70 + e) for e in range(3)] + [None] * 3
        ((loops, ended),) = read_pg(
            pg_store_url,
            "SELECT COUNT(*), COUNT(t_end) FROM loops WHERE run_id = %s",
            (run_id,),
        )
        assert loops == ended == 3 + 3 * 200
        checkpoints = read_pg(
            pg_store_url,
            "SELECT manifest FROM checkpoints WHERE run_id = %s AND manifest IS NOT NULL",
            (run_id,),
        )
        assert checkpoints
        # Their objects are where objects_url says (the store directory by default).
        from retrolog.store.backends import open_object_store

        store = open_object_store(
            env.get("RETROLOG_OBJECTS_URL") or str(project.root / ".retrolog" / "objects")
        )
        assert all(store.has(str(key)) for (key,) in checkpoints)
    # The embedded store holds no run: the metadata went to PostgreSQL only.
    assert not (project.root / ".retrolog" / "retrolog.db").exists()
    # `retrolog runs` lists them from there, oldest first, with their arguments.
    listed = project.cli("runs", "--json", RETROLOG_DATABASE_URL=pg_store_url)
    assert listed.returncode == 0, listed.stderr
    shown = json.loads(listed.stdout)
    assert [r["run_id"] for r in shown] == sorted(by_lr.values(), key=lambda r: runs_order[r])
    assert {r["status"] for r in shown} == {"finished"}
    assert all(r["args"].startswith("lr=") for r in shown)
    newest = project.cli("runs", "--json", "--limit", "3", RETROLOG_DATABASE_URL=pg_store_url)
    assert [r["run_id"] for r in json.loads(newest.stdout)] == [r["run_id"] for r in shown][-3:]


def test_a_killed_run_is_marked_crashed_by_the_next_run_on_its_host(
    project: Project, pg_store_url: str
) -> None:
    project.write("slow.py", STEPPING)
    env = project.env(RETROLOG_DATABASE_URL=pg_store_url)
    with subprocess.Popen(
        [sys.executable, "slow.py"], cwd=project.root, env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        last = -1
        while last < 150:
            last = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    ((status,),) = read_pg(pg_store_url, "SELECT status FROM runs")
    assert status == "running"
    project.write("quick.py", "import retrolog as rl\nfor i in rl.loop('i', range(2)):\n    pass\n")
    project.run("quick.py", RETROLOG_DATABASE_URL=pg_store_url)
    rows = read_pg(
        pg_store_url, "SELECT filename, status, error, ended_at - started_at FROM runs ORDER BY 1"
    )
    assert [r[:2] for r in rows] == [("quick.py", "finished"), ("slow.py", "crashed")]
    assert "died" in str(rows[1][2])
    assert 1.0 < float(rows[1][3]) < 60  # its duration ends at its last record  # type: ignore[arg-type]
    stored = [
        v
        for (v,) in read_pg(
            pg_store_url, "SELECT value_int FROM logs WHERE name = 'i' ORDER BY log_id"
        )
    ]
    # A prefix, nothing out of order or twice; all but about the last second is there.
    assert stored == list(range(len(stored)))
    assert max(stored) >= last - 100  # type: ignore[operator]


# Epochs long enough that replay restores their checkpoints rather than rerunning them,
# each epoch's randomness seeded by the epoch (a restored ``w`` is all a block needs).
SLOW_EPOCHS = """\
import time

import numpy as np

import retrolog as rl

lr = rl.arg("lr", 0.1)
w = np.zeros(4096)
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(3)):
        rng = np.random.default_rng(epoch)
        for step in rl.loop("step", range(10)):
            w += rng.random(4096) * lr
            time.sleep(0.05)
        # HINDSIGHT
"""


def test_objects_move_to_s3_when_the_runs_are_in_postgresql(
    project: Project, pg_store_url: str, s3_url: str, tmp_path: Path
) -> None:
    """`migrate --objects` on a team's store: the runs' objects go to S3, the setting
    follows, and a replay then restores from S3 alone (the local objects set aside)."""
    project.write("train.py", SLOW_EPOCHS)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    env = {"RETROLOG_DATABASE_URL": pg_store_url}
    for lr in ("0.1", "0.2"):
        project.run("train.py", "--kwargs", f"lr={lr}", **env)
    password = urllib.parse.urlsplit(pg_store_url).password
    assert password  # the test server's URL carries one, as a user's may
    done = project.cli("migrate", "--objects", s3_url, "--yes", **env)
    assert done.returncode == 0, done.stderr
    assert "Copied" in done.stdout and f"objects_url is now {s3_url}" in done.stdout
    assert password not in done.stderr + done.stdout
    objects = project.root / ".retrolog" / "objects"
    objects.rename(tmp_path / "objects-aside")
    statement = 'rl.log("w_norm", float(np.linalg.norm(w)))'
    project.write("train.py", SLOW_EPOCHS.replace("# HINDSIGHT", statement))
    out = project.cli("replay", "w_norm", "--yes", **env)
    assert out.returncode == 0, out.stderr
    assert "Replayed 2 run(s); backfilled 6 value(s)" in out.stderr, out.stderr
    restored = read_pg(pg_store_url, "SELECT sum(restored) FROM replay_runs")[0][0]
    assert restored and int(str(restored)) > 0, out.stderr  # from S3: the local copy is gone
    assert not objects.exists()


RESTORE = """\
import sys

import numpy as np

import retrolog as rl

w = np.zeros(512)
done = rl.restore(sys.argv[1], at=1, w=w)
print(done.at, float(w.sum()))
"""


def test_restore_loads_a_checkpoint_of_a_postgresql_run(
    project: Project, pg_store_url: str
) -> None:
    """rl.restore by run id and iteration: the state at the end of epoch 1's block,
    which the run logged as w_sum right after it."""
    project.write("train.py", SCRIPT)
    project.write("load.py", RESTORE)
    env = {"RETROLOG_DATABASE_URL": pg_store_url}
    project.run("train.py", "--epochs", "3", "--steps", "20", **env)
    ((run_id,),) = read_pg(pg_store_url, "SELECT run_id FROM runs")
    ((w_sum,),) = read_pg(
        pg_store_url,
        "SELECT l.value_float FROM logs l JOIN loops p ON p.run_id = l.run_id"
        " AND p.ctx_id = l.ctx_id WHERE l.name = 'w_sum' AND p.iteration = 1",
    )
    out = project.run("load.py", str(run_id), **env)
    at, restored = out.stdout.split()
    assert at == "1" and float(restored) == w_sum
    # The local part of the store (objects, caches) stays out of the user's git status.
    assert ".retrolog" not in project.git("status", "--porcelain")


def test_runs_on_an_empty_postgresql_database_says_to_record_first(
    project: Project, pg_store_url: str
) -> None:
    done = project.cli("runs", RETROLOG_DATABASE_URL=pg_store_url)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "no retrolog store" in done.stderr and "Record a run first" in done.stderr
    assert read_pg(pg_store_url, "SELECT to_regclass('runs') IS NULL") == [(True,)]  # untouched


def test_retrolog_config_shows_the_database_url_without_its_password(project: Project) -> None:
    url = "postgresql://team:hunter2@db.example:5432/runs?password=hunter3"
    done = project.cli("config", RETROLOG_DATABASE_URL=url)
    assert done.returncode == 0, done.stderr
    assert "database_url" in done.stdout and "db.example" in done.stdout
    assert "hunter2" not in done.stdout and "hunter3" not in done.stdout


def test_a_database_url_retrolog_cannot_use_stops_the_run_with_what_to_do(
    project: Project,
) -> None:
    project.write("quick.py", "import retrolog as rl\nfor i in rl.loop('i', range(2)):\n    pass\n")
    done = project.run("quick.py", check=False, RETROLOG_DATABASE_URL="mysql://db/runs")
    assert done.returncode != 0
    assert "postgresql://" in done.stderr and "unset" in done.stderr.lower(), done.stderr
    # What to do, and where in the script, without retrolog's frames.
    assert "Traceback" not in done.stderr
    assert "quick.py, line 2" in done.stderr
    # An unreachable server: the run stops before training, saying where it looked.
    started = time.monotonic()
    done = project.run(
        "quick.py", check=False, RETROLOG_DATABASE_URL="postgresql://nobody@127.0.0.1:1/runs"
    )
    assert done.returncode != 0
    assert "Cannot reach the PostgreSQL store at postgresql://nobody@127.0.0.1:1/runs" in (
        done.stderr
    ), done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60


def test_a_role_that_may_only_write_retrologs_tables_records(
    project: Project, pg_store_url: str, database_url: str
) -> None:
    """What a team gives its training machines: no CREATE, once the tables exist."""
    project.write(
        "quick.py",
        "import retrolog as rl\nfor i in rl.loop('i', range(3)):\n    rl.log('x', i / 3)\n",
    )
    project.run("quick.py", RETROLOG_DATABASE_URL=pg_store_url)  # an admin's first run
    with pg_role(database_url, pg_store_url, "SELECT, INSERT, UPDATE") as url:
        project.run("quick.py", RETROLOG_DATABASE_URL=url)
    rows = read_pg(
        pg_store_url,
        "SELECT r.status, COUNT(l.log_id) FROM runs r JOIN logs l USING (run_id)"
        " WHERE l.name = 'x' GROUP BY r.run_id, r.status",
    )
    assert rows == [("finished", 3), ("finished", 3)]


def test_show_says_the_same_of_a_run_on_either_backend(project: Project, pg_store_url: str) -> None:
    """The same script recorded into the embedded store and into PostgreSQL: `retrolog
    show` gives the same account of each run."""
    project.write("train.py", SCRIPT)
    args = ("train.py", "--epochs", "2", "--steps", "20", "--lr", "0.5")
    project.run(*args, RETROLOG_CHECKPOINTS="adaptive")
    project.run(*args, RETROLOG_DATABASE_URL=pg_store_url, RETROLOG_CHECKPOINTS="adaptive")
    shown = []
    for env in ({}, {"RETROLOG_DATABASE_URL": pg_store_url}):
        done = project.cli("show", "2", "--json", **env)  # every run id starts with the year
        assert done.returncode == 0, done.stderr
        shown.append(json.loads(done.stdout))
    sqlite, pg = shown
    same = ("filename", "status", "args", "parsed_args", "names", "loops", "definitions",
            "dirty", "code_tree")  # fmt: skip
    for key in same:
        assert pg[key] == sqlite[key], key
    assert pg["run_id"] != sqlite["run_id"]
    assert [n["name"] for n in pg["names"]][:5] == ["lr", "epochs", "steps", "seed", "loss"]
    statements = {d["name"]: d["statement"] for d in pg["definitions"]}
    assert statements["loss"] == "log('loss', args.lr * (step + 1) / 7.0 + epoch)"
    for key in ("count", "blocks", "chosen", "written"):
        assert pg["checkpoints"][key] == sqlite["checkpoints"][key], key
    assert isinstance(pg["checkpoints"]["bytes"], int) and pg["checkpoints"]["bytes"] > 0
    assert set(pg["profile"]) == set(sqlite["profile"])


READER = """\
import json
import retrolog as rl

p = rl.Project()
runs = list(p.runs()["run_id"])
print(json.dumps({
    "names": p.names(),
    "checkpoints": [(c["kind"], c["loop"], c["iteration"]) for c in p.checkpoints(runs[0])],
    "code": p.code(runs[0])["path"],
    "differ": p.compare(runs)["args_differ"],
    "script": p.script_names("train.py"),
}))
"""


def test_the_projects_run_readers_answer_alike_from_either_backend(
    project: Project, pg_store_url: str
) -> None:
    project.write("train.py", SCRIPT)
    project.write("read.py", READER)
    answers = []
    for env in ({}, {"RETROLOG_DATABASE_URL": pg_store_url}):
        for lr in ("0.5", "0.25"):
            project.run("train.py", "--epochs", "2", "--steps", "5", "--lr", lr, **env)
        answers.append(json.loads(project.run("read.py", **env).stdout))
    sqlite, pg = answers
    assert pg == sqlite
    assert pg["names"] == sorted(pg["names"]) and "loss" in pg["names"]
    assert pg["differ"] == {"lr": [0.5, 0.25]}
    # How a run's values came to be, value by value.
    explained = []
    for env in ({}, {"RETROLOG_DATABASE_URL": pg_store_url}):
        newest = json.loads(project.cli("runs", "--json", "--limit", "1", **env).stdout)
        done = project.cli("lineage", newest[0]["run_id"], "w_sum", "--json", **env)
        assert done.returncode == 0, done.stderr
        explained.append(json.loads(done.stdout))
    keep = ("context", "value", "value_type", "origin", "lineage")
    sqlite_values, pg_values = ([{k: v[k] for k in keep} for v in e["values"]] for e in explained)
    assert pg_values == sqlite_values and len(pg_values) == 2
    assert [v["context"] for v in pg_values] == [{"epoch": 0}, {"epoch": 1}]
    assert all(isinstance(v["value"], float) for v in pg_values)
    assert explained[1]["definitions"] == explained[0]["definitions"]
    assert ("block", "epoch", 0) in [tuple(c) for c in pg["checkpoints"]]


@pytest.mark.usefixtures("whole_machine")
def test_a_torch_script_at_default_settings_records_into_postgresql_and_keeps_its_checkpoints(
    project: Project, pg_store_url: str
) -> None:
    """torch's own threads, the adaptive rule, an argparse script with its loops in a
    function, a DataLoader and a scheduler: every checkpoint the rule chose is written,
    and the run's values are all there."""
    project.write("train.py", REAL_SHAPED)
    project.run(
        "train.py", "--epochs", "3", RETROLOG_DATABASE_URL=pg_store_url, RETROLOG_CHECKPOINTS=""
    )
    done = project.cli("show", "2", "--json", RETROLOG_DATABASE_URL=pg_store_url)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["status"] == "finished"
    assert shown["parsed_args"] == {"lr": 0.05, "epochs": 3, "seed": 0}
    checkpoints = shown["checkpoints"]
    assert checkpoints["chosen"] >= 1  # the first block's, at least
    assert checkpoints["written"] == checkpoints["chosen"]
    assert checkpoints["abandoned"] == 0 and checkpoints["lost"] == 0
    assert {n["name"]: n["count"] for n in shown["names"]}["loss"] == 3 * 8192 // 32
    ((finite,),) = read_pg(
        pg_store_url,
        "SELECT COUNT(*) FROM logs WHERE name = 'loss' AND value_float IS NOT NULL"
        " AND value_type = 'float'",
    )
    assert finite == 3 * 8192 // 32
