"""``retrolog migrate --to postgresql://...``: a project's embedded store moves to the
team's database, verifiably, and running it again is safe.

Real runs (an argparse script with checkpoints, then a replay that backfills a new
statement) are recorded into the embedded store, copied into a schema of the test
server, and read back through retrolog's own commands from both stores.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pytest

from training_scripts import new_project

from conftest import Project, read_pg, values_by_run

pytestmark = pytest.mark.slow

SCRIPT = """\
import argparse

import numpy as np

import retrolog as rl


def train(args):
    w = np.zeros(64)
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(3)):
            rng = np.random.default_rng(args.seed * 100 + epoch)  # its state is the epoch's
            for step in rl.loop("step", range(5)):
                w += rng.random(64) * args.lr
                rl.log("loss", float(w.sum()) / (step + 1))
            rl.log("acc", 0.5 + epoch / 10)
            rl.log("tag", f"epoch-{epoch}")
            rl.log("big", 2**70 + epoch)
            rl.log("nan", float("nan"))
    rl.log("final", float(w.mean()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args())
"""


def _recorded_and_replayed(project: Project) -> None:
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    for lr in ("0.1", "0.3"):
        project.run("train.py", "--lr", lr)
    # Today's code logs a new value after each epoch: a replay backfills it.
    project.write(
        "train.py",
        SCRIPT.replace(
            '            rl.log("nan", float("nan"))\n',
            '            rl.log("nan", float("nan"))\n'
            '            rl.log("w_norm", float(abs(w).sum()))\n',
        ),
    )
    done = project.cli("replay", "w_norm", "--yes")
    assert done.returncode == 0, done.stderr


def _views(project: Project, **env: str) -> dict[str, object]:
    """What retrolog answers about the store: runs, a wide view, a run's account."""
    answers: dict[str, object] = {}
    for key, args in (
        ("runs", ("runs", "--json")),
        ("dataframe", ("dataframe", "loss,acc,tag,big,nan,w_norm,final,lr", "--json")),
    ):
        done = project.cli(*args, **env)
        assert done.returncode == 0, (args, done.stderr)
        answers[key] = json.loads(done.stdout)
    runs = answers["runs"]
    assert isinstance(runs, list)
    newest = runs[-1]["run_id"]
    done = project.cli("show", newest, "--json", **env)
    assert done.returncode == 0, done.stderr
    answers["show"] = json.loads(done.stdout)
    return answers


def test_migrate_copies_every_run_and_both_stores_answer_alike(
    project: Project, pg_store_url: str
) -> None:
    _recorded_and_replayed(project)
    done = project.cli("migrate", "--to", pg_store_url, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "Copy 2 of 2 run(s)" in done.stdout
    assert read_pg(pg_store_url, "SELECT to_regclass('runs') IS NULL") == [(True,)]  # untouched

    done = project.cli("migrate", "--to", pg_store_url, "--yes")
    assert done.returncode == 0, done.stderr
    assert "Copied 2 run(s)" in done.stdout and "Verified 2 of 2" in done.stdout
    password = urllib.parse.urlsplit(pg_store_url).password
    assert password and password not in done.stdout + done.stderr
    # The URL holds a password: it is not written into a file; the user is told what to do.
    assert (
        not (project.root / ".retrolog" / "config.toml").exists()
        or "database_url" not in (project.root / ".retrolog" / "config.toml").read_text()
    )
    assert "~/.pgpass" in done.stdout

    local, team = _views(project), _views(project, RETROLOG_DATABASE_URL=pg_store_url)
    assert team["runs"] == local["runs"]
    assert team["dataframe"] == local["dataframe"]
    rows = team["dataframe"]
    assert isinstance(rows, list) and any(r["w_norm"] is not None for r in rows)  # backfilled
    assert {r["big"] for r in rows if r["big"] is not None} == {str(2**70 + e) for e in range(3)}
    sqlite_show, pg_show = local["show"], team["show"]
    assert isinstance(sqlite_show, dict) and isinstance(pg_show, dict)
    assert pg_show == sqlite_show  # every field of the run's account, backfills included
    assert pg_show["backfills"] and pg_show["checkpoints"]["written"] > 0
    counts = read_pg(
        pg_store_url,
        "SELECT (SELECT count(*) FROM replays), (SELECT count(*) FROM logs WHERE origin ="
        " 'backfilled'), (SELECT count(*) FROM checkpoints)",
    )
    assert counts[0][0] == 1 and counts[0][1] == 6 and counts[0][2] > 0

    # Again: nothing to copy, everything verified again, nothing written twice.
    before = read_pg(pg_store_url, "SELECT count(*) FROM logs")
    done = project.cli("migrate", "--to", pg_store_url, "--yes")
    assert done.returncode == 0, done.stderr
    assert "Copied 0 run(s)" in done.stdout and "2 were there already" in done.stdout
    assert read_pg(pg_store_url, "SELECT count(*) FROM logs") == before


def test_a_run_changed_since_its_copy_is_reported_and_never_overwritten(
    project: Project, pg_store_url: str
) -> None:
    _recorded_and_replayed(project)
    assert project.cli("migrate", "--to", pg_store_url, "--yes").returncode == 0
    before = read_pg(pg_store_url, "SELECT count(*) FROM logs")
    # A replay here after the copy: the runs' rows no longer match the database's.
    project.write(
        "train.py",
        (project.root / "train.py").read_text().replace(
            "            rl.log(\"w_norm\"", "            rl.log(\"w_max\", float(w.max()))\n"
            "            rl.log(\"w_norm\"",
        ),
    )  # fmt: skip
    assert project.cli("replay", "w_max", "--yes").returncode == 0
    done = project.cli("migrate", "--to", pg_store_url, "--yes")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "never overwrites a run" in done.stderr and "Nothing was switched" in done.stderr
    assert read_pg(pg_store_url, "SELECT count(*) FROM logs") == before


def test_a_url_without_a_password_becomes_the_projects_database_url(
    project: Project, pg_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The password from PGPASSWORD, as a team would keep it out of files: then the
    setting is written, and every later command reads the database without being told."""
    project.write("quick.py", "import retrolog as rl\nfor i in rl.loop('i', range(3)):\n"
                  "    rl.log('x', i / 3)\n")  # fmt: skip
    project.run("quick.py")
    parts = urllib.parse.urlsplit(pg_store_url)
    password = parts.password or ""
    bare = urllib.parse.urlunsplit(
        parts._replace(netloc=f"{parts.username}@{parts.hostname}:{parts.port}")
    )
    monkeypatch.setenv("PGPASSWORD", password)  # the CLI's environment comes from this one
    done = project.cli("migrate", "--to", bare, "--yes")
    assert done.returncode == 0, done.stderr
    config = (project.root / ".retrolog" / "config.toml").read_text()
    assert f"database_url = {json.dumps(bare)}" in config and password not in config
    runs = project.cli("runs", "--json")  # no RETROLOG_DATABASE_URL: the setting says where
    assert runs.returncode == 0, runs.stderr
    assert [r["filename"] for r in json.loads(runs.stdout)] == ["quick.py"]
    assert read_pg(pg_store_url, "SELECT count(*) FROM logs WHERE name = 'x'") == [(3,)]
    # Now the project's metadata is there: migrating "from" it is refused, saying why.
    again = project.cli("migrate", "--to", bare, "--yes")
    assert again.returncode != 0 and "already" in again.stderr and "Traceback" not in again.stderr


def test_migrate_refuses_while_a_run_records_and_copies_nothing(
    project: Project, pg_store_url: str
) -> None:
    from training_scripts import NUMPY_TRAIN

    project.write("train.py", NUMPY_TRAIN)
    with project.recording_paused():
        done = project.cli("migrate", "--to", pg_store_url, "--yes")
    assert done.returncode != 0 and "still recording" in done.stderr
    assert read_pg(pg_store_url, "SELECT to_regclass('runs') IS NULL") == [(True,)]


def test_migrate_to_a_url_that_is_not_postgresql_says_what_to_give(project: Project) -> None:
    project.write("quick.py", "import retrolog as rl\nrl.log('x', 1)\n")
    project.run("quick.py")
    for args in (("migrate", "--to", "mysql://db/x", "--yes"), ("migrate",)):
        done = project.cli(*args)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert "postgresql://" in done.stderr


def test_the_whole_move_in_one_command_then_replay_from_the_team_stores(
    project: Project, pg_store_url: str, s3_url: str, tmp_path: Path
) -> None:
    """`retrolog migrate --to postgresql://... --objects s3://...`, as the team setup
    says: afterwards, with the local store set aside, the same commands answer from
    PostgreSQL and S3 alone, and a replay backfills exactly what it backfills locally."""
    _recorded_and_replayed(project)
    local = _views(project)
    done = project.cli("migrate", "--to", pg_store_url, "--objects", s3_url, "--yes")
    assert done.returncode == 0, done.stderr
    assert f"objects_url is now {s3_url}" in done.stdout and "Copied 2 run(s)" in done.stdout
    aside = tmp_path / "aside"
    aside.mkdir()
    for part in ("objects", "retrolog.db", "retrolog.db-wal", "retrolog.db-shm"):
        path = project.root / ".retrolog" / part
        if path.exists():
            path.rename(aside / part)
    team = _views(project, RETROLOG_DATABASE_URL=pg_store_url)
    assert team["runs"] == local["runs"] and team["dataframe"] == local["dataframe"]
    # A name neither store has, replayed from the team's stores: exactly what a fresh run
    # of today's script logs.
    source = (project.root / "train.py").read_text()
    today = source.replace(
        '            rl.log("w_norm"', '            rl.log("w_max", float(w.max()))\n'
        '            rl.log("w_norm"')  # fmt: skip
    project.write("train.py", today)
    out = project.cli("replay", "w_max", "--yes", RETROLOG_DATABASE_URL=pg_store_url)
    assert out.returncode == 0, out.stderr
    assert "Replayed 2 run(s); backfilled 6 value(s)" in out.stderr, out.stderr
    assert not (project.root / ".retrolog" / "objects").exists()  # S3 alone served them
    argv = {
        str(r): tuple(json.loads(str(a))[1:])
        for r, a in read_pg(pg_store_url, "SELECT run_id, argv FROM runs")
    }
    for run_id, args in argv.items():
        fresh = new_project(tmp_path / f"fresh-{run_id}")
        fresh.write("train.py", today)
        fresh.run("train.py", *args)
        (expected,) = values_by_run(fresh.root, "w_max").values()
        replayed = read_pg(
            pg_store_url,
            "SELECT value_float FROM logs WHERE name = 'w_max' AND run_id = %s ORDER BY ctx_id",
            (run_id,),
        )
        assert [v for (v,) in replayed] == expected and len(expected) == 3, run_id
