"""``retrolog replay`` when the runs are in PostgreSQL, chosen by configuration alone.

The replayed values must be exactly what a fresh run of today's script logs; a second
replay adds nothing; ``--force`` recomputes in place; a role that may only read is told
why nothing was stored. Two replays of the same runs at once are in
tests/replay/test_replay_concurrent.py, on both backends.
The team path end to end (PostgreSQL + S3 + Ray, a torch script at default settings)
is the last test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from training_scripts import REAL_SHAPED, W_NORM, fresh_w_norms, new_project

from conftest import Project, pg_role, ray_env, read_pg, values_by_run

pytestmark = pytest.mark.slow

# An argparse script with its loops in a function; each epoch's randomness comes from a
# generator seeded by the epoch, so a restored checkpoint of ``w`` is all a block needs.
SCRIPT = """\
import argparse
import time

import numpy as np

import retrolog as rl


def train(args):
    w = np.zeros(256)
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(args.epochs)):
            rng = np.random.default_rng(args.seed * 100 + epoch)
            for step in rl.loop("step", range(20)):
                w += rng.random(256) * args.lr
                rl.log("loss", float(w.sum()) / (step + 1))
                time.sleep(0.005)  # a block worth restoring rather than rerunning
            # HINDSIGHT


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args())
"""
STATEMENT = 'rl.log("w_norm", float(np.linalg.norm(w)))'
ARGS = (("--lr", "0.1", "--seed", "1"), ("--lr", "0.3", "--seed", "2"), ("--lr", "0.2"))


def _pg_values(url: str, name: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for run_id, value in read_pg(
        url,
        "SELECT run_id, value_float FROM logs WHERE name = %s ORDER BY run_id, ctx_id",
        (name,),
    ):
        found.setdefault(str(run_id), []).append(float(value))  # type: ignore[arg-type]
    return found


def _argv_of(url: str) -> dict[str, tuple[str, ...]]:
    """Each run's command-line arguments (after the script), by run id."""
    return {
        str(run_id): tuple(json.loads(str(argv))[1:])
        for run_id, argv in read_pg(url, "SELECT run_id, argv FROM runs")
    }


# The suite pins RETROLOG_CHECKPOINTS=every; users don't: "" leaves the adaptive rule.
DEFAULTS = {"RETROLOG_CHECKPOINTS": ""}


def _record_two_at_defaults(project: Project, url: str) -> None:
    """Two runs of REAL_SHAPED at default settings; every checkpoint the rule chose is
    written."""
    for lr in ("0.1", "0.05"):
        project.run("train.py", "--lr", lr, **DEFAULTS)
    chosen = [json.loads(str(c)) for (c,) in read_pg(url, "SELECT checkpointing FROM runs")]
    assert len(chosen) == 2 and all(c["written"] == c["chosen"] for c in chosen), chosen


def _assert_fresh_runs_log_the_same(url: str, replay_stderr: str) -> None:
    """The two runs' replayed ``w_norm`` is bit for bit what fresh runs of today's script
    log, and the replay restored checkpoints rather than retraining."""
    replayed = _pg_values(url, "w_norm")
    argv = _argv_of(url)
    for run_id, values in replayed.items():
        expected = [norm for _, norm in fresh_w_norms(*argv[run_id])]
        assert values == expected and len(values) == 4, run_id
    assert len(replayed) == 2
    restored = read_pg(url, "SELECT sum(restored) FROM replay_runs")[0][0]
    assert restored and int(str(restored)) > 0, replay_stderr


@pytest.fixture
def recorded(project: Project, pg_store_url: str) -> Project:
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    for args in ARGS:
        project.run("train.py", *args, RETROLOG_DATABASE_URL=pg_store_url)
    project.write("train.py", SCRIPT.replace("# HINDSIGHT", STATEMENT))
    return project


def test_a_replay_of_postgresql_runs_is_exact_and_idempotent(
    recorded: Project, pg_store_url: str, tmp_path: Path
) -> None:
    done = recorded.cli("replay", "w_norm", "--yes", RETROLOG_DATABASE_URL=pg_store_url)
    assert done.returncode == 0, done.stderr
    assert "Replayed 3 run(s); backfilled 12 value(s)" in done.stderr, done.stderr
    replayed = _pg_values(pg_store_url, "w_norm")
    argv = _argv_of(pg_store_url)
    for run_id, values in replayed.items():
        fresh = tmp_path / f"fresh-{run_id}"
        recorded.run("train.py", *argv[run_id], RETROLOG_STORE=str(fresh / ".retrolog"))
        (expected,) = values_by_run(fresh, "w_norm").values()
        assert values == expected and len(values) == 4, run_id  # bit for bit
    assert len(replayed) == 3
    # Checkpoints were restored, not retrained: the replay's own record says so.
    restored = read_pg(pg_store_url, "SELECT sum(restored) FROM replay_runs")[0][0]
    assert restored and int(str(restored)) > 0
    # The working copy is gone; the project holds no store file of its own.
    assert not list((recorded.root / ".retrolog" / "working").glob("*"))
    assert not (recorded.root / ".retrolog" / "retrolog.db").exists()
    # The values are in the team's view, marked as what they are.
    view = recorded.cli("dataframe", "w_norm", "--json", RETROLOG_DATABASE_URL=pg_store_url)
    assert view.returncode == 0, view.stderr
    assert len([r for r in json.loads(view.stdout) if r["w_norm"] is not None]) == 12
    lineage = read_pg(
        pg_store_url,
        "SELECT count(*) FROM logs l JOIN replays r USING (replay_id)"
        " WHERE l.name = 'w_norm' AND l.origin = 'backfilled' AND r.status = 'finished'",
    )
    assert lineage == [(12,)]

    again = recorded.cli("replay", "w_norm", "--yes", RETROLOG_DATABASE_URL=pg_store_url)
    assert again.returncode == 0, again.stderr
    assert "nothing to replay" in again.stderr
    forced = recorded.cli(
        "replay", "w_norm", "--yes", "--force", RETROLOG_DATABASE_URL=pg_store_url
    )
    assert forced.returncode == 0, forced.stderr
    assert _pg_values(pg_store_url, "w_norm") == replayed  # recomputed in place, once
    assert read_pg(pg_store_url, "SELECT count(DISTINCT replay_id) FROM logs"
                   " WHERE name = 'w_norm'") == [(1,)]  # fmt: skip


def test_a_predicate_chooses_the_runs_in_postgresqls_dialect(
    recorded: Project, pg_store_url: str, database_url: str, tmp_path: Path
) -> None:
    """As a team's replaying role (may write retrolog's tables, is no superuser): the
    predicate is judged by PostgreSQL, as `dataframe --where` judges it."""
    with pg_role(database_url, pg_store_url, "SELECT, INSERT, UPDATE, DELETE") as role:
        done = recorded.cli(
            "replay", "w_norm", "lr > 0.15 AND seed > 0", "--yes", RETROLOG_DATABASE_URL=role
        )
        assert done.returncode == 0, done.stderr
        assert "Replayed 1 run(s); backfilled 4 value(s)" in done.stderr, done.stderr
        # An int is bigint there: a predicate PostgreSQL cannot apply is explained.
        wrong = recorded.cli("replay", "w_norm", "seed = 'two'", "--yes",
                             RETROLOG_DATABASE_URL=role)  # fmt: skip
        assert wrong.returncode != 0 and "Traceback" not in wrong.stderr
        assert "PostgreSQL says" in wrong.stderr, wrong.stderr
    argv = _argv_of(pg_store_url)
    ((run_id, values),) = _pg_values(pg_store_url, "w_norm").items()
    assert argv[run_id] == ("--lr", "0.3", "--seed", "2")
    assert read_pg(pg_store_url, "SELECT where_sql FROM replays") == [("lr > 0.15 AND seed > 0",)]
    # The working copy held the chosen run's rows alone; its values are still exact.
    fresh = tmp_path / "fresh"
    recorded.run("train.py", *argv[run_id], RETROLOG_STORE=str(fresh / ".retrolog"))
    assert [values] == list(values_by_run(fresh, "w_norm").values())


def test_the_working_copy_of_a_predicates_replay_holds_the_chosen_runs_alone(
    recorded: Project, pg_store_url: str, tmp_path: Path
) -> None:
    """What a replay with ``where`` copies out of PostgreSQL before it replays: every
    run's row (reuse and lineage read them), the loops, logs, checkpoints and profile
    of the runs chosen and of no other."""
    from retrolog.store.postgres_metadata import PostgresMetadata
    from retrolog.store.schema import migrate
    from retrolog.store.sqlite_connection import connect
    from retrolog.store.transfer import copy_into_sqlite

    runs = sorted(_argv_of(pg_store_url))
    chosen = {runs[1]}
    source = PostgresMetadata(pg_store_url, create=False)
    narrow, whole = connect(tmp_path / "narrow.db"), connect(tmp_path / "whole.db")
    try:
        migrate(narrow)
        migrate(whole)
        copied = copy_into_sqlite(narrow, source, ["train.py"], chosen)
        all_rows = copy_into_sqlite(whole, source, ["train.py"])
        assert {r for (r,) in narrow.execute("SELECT run_id FROM runs")} == set(runs)
        for table in ("loops", "logs", "checkpoints", "profile"):
            found = {r for (r,) in narrow.execute(f"SELECT DISTINCT run_id FROM {table}")}
            assert found == chosen, table
            # The chosen run's rows are all there, in the same order (a row's own id,
            # an INTEGER PRIMARY KEY, is the copy's).
            info = narrow.execute(f"PRAGMA table_info({table})").fetchall()
            own = [c for (_, c, kind, _, _, pk) in info if pk == 1 and kind == "INTEGER"]
            shown = ", ".join(c for (_, c, *_) in info if c not in own)
            order = own[0] if len(own) == 1 else shown
            query = f"SELECT {shown} FROM {table} WHERE run_id = ? ORDER BY {order}"
            assert (
                narrow.execute(query, (runs[1],)).fetchall()
                == whole.execute(query, (runs[1],)).fetchall()
            ), table
        assert 0 < copied < all_rows
    finally:
        narrow.close()
        whole.close()
        source.close()


def test_a_role_that_may_only_read_is_told_why_nothing_was_stored(
    recorded: Project, pg_store_url: str, database_url: str
) -> None:
    with pg_role(database_url, pg_store_url, "SELECT") as reader:
        done = recorded.cli("replay", "w_norm", "--yes", RETROLOG_DATABASE_URL=reader)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "could not be written" in done.stderr and "INSERT" in done.stderr, done.stderr
    assert read_pg(pg_store_url, "SELECT count(*) FROM logs WHERE name = 'w_norm'") == [(0,)]
    assert read_pg(pg_store_url, "SELECT count(*) FROM replays") == [(0,)]


@pytest.mark.usefixtures("whole_machine")
def test_the_team_setup_records_and_replays_by_configuration_alone(
    tmp_path: Path, pg_store_url: str, s3_url: str, ray_address: str
) -> None:
    """PostgreSQL for the metadata, S3 for the objects, Ray for the replay, all chosen in
    the project's pyproject.toml; a torch script shaped like a real one, at torch's own
    threads and the adaptive rule. The backfilled values are exactly a fresh run's."""
    project = new_project(tmp_path / "proj")
    project.write(
        "pyproject.toml",
        f'[tool.retrolog]\ndatabase_url = "{pg_store_url}"\nobjects_url = "{s3_url}"\n'
        'executor = "ray"\n',
    )
    project.write("train.py", REAL_SHAPED)
    project.git("add", "-A")
    project.git("commit", "-qm", "train")
    _record_two_at_defaults(project, pg_store_url)
    assert not (project.root / ".retrolog" / "objects").exists()  # objects went to S3

    project.write("train.py", REAL_SHAPED.replace("# HINDSIGHT", W_NORM))
    out = project.cli("replay", "w_norm", "--yes", **ray_env(ray_address), **DEFAULTS)
    assert out.returncode == 0, out.stderr
    assert f"workers run as Ray tasks on the cluster at {ray_address}" in out.stderr
    assert "Replayed 2 run(s)" in out.stderr, out.stderr
    # The nodes restored checkpoints the rule kept (from S3), rather than retraining.
    _assert_fresh_runs_log_the_same(pg_store_url, out.stderr)


def test_another_clone_replays_the_teams_runs_from_postgresql_and_s3_alone(
    tmp_path: Path, pg_store_url: str, s3_url: str
) -> None:
    """Machine A records (metadata in PostgreSQL, objects on S3, both set in the
    committed pyproject.toml), with an uncommitted edit, and is gone; machine B, a
    fresh clone without A's private refs, replays: the code comes from S3's copy of
    A's version, edit included, and the values are exactly a fresh run's."""
    a = new_project(tmp_path / "a")
    a.write(
        "pyproject.toml",
        f'[tool.retrolog]\ndatabase_url = "{pg_store_url}"\nobjects_url = "{s3_url}"\n',
    )
    a.write("train.py", SCRIPT)
    a.git("add", "-A")
    a.git("commit", "-qm", "train")
    edited = SCRIPT.replace("range(20)", "range(15)")  # A's uncommitted edit, recorded
    a.write("train.py", edited)
    for args in ARGS[:2]:
        a.run("train.py", *args)
    bare = tmp_path / "origin.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(a.root), str(bare)], check=True)
    b = Project(tmp_path / "b")
    subprocess.run(["git", "clone", "-q", str(bare), str(b.root)], check=True)
    assert b.git("for-each-ref", "refs/retrolog/") == ""  # B lacks A's code refs
    shutil.rmtree(a.root)  # machine A is gone
    today = edited.replace("# HINDSIGHT", STATEMENT)
    b.write("train.py", today)
    done = b.cli("replay", "w_norm", "--yes")
    assert done.returncode == 0, done.stderr
    assert "Replayed 2 run(s); backfilled 8 value(s)" in done.stderr, done.stderr
    # B's git status shows its edit and nothing of retrolog's (.retrolog/ ignores itself).
    assert b.git("status", "--porcelain").splitlines() == [" M train.py"]
    replayed = _pg_values(pg_store_url, "w_norm")
    argv = _argv_of(pg_store_url)
    for run_id, values in replayed.items():
        fresh = new_project(tmp_path / f"fresh-{run_id}")
        fresh.write("train.py", today)
        fresh.run("train.py", *argv[run_id])
        (expected,) = values_by_run(fresh.root, "w_norm").values()
        assert values == expected and len(values) == 4, run_id
    assert len(replayed) == 2


REPLAY_API = """\
import json

import retrolog as rl

frame = rl.replay("w_norm")
print(json.dumps({"rows": len(frame), "runs": sorted(set(frame["run_id"])),
                  "values": int(frame["w_norm"].notna().sum())}))
"""


def test_rl_replay_returns_the_replayed_runs_view_on_postgresql(
    recorded: Project, pg_store_url: str
) -> None:
    """The Python API, as the schema's owner (a superuser, whose predicates retrolog
    refuses): the view it returns is chosen by run id in retrolog's own SQL."""
    recorded.write("api.py", REPLAY_API)
    out = recorded.run("api.py", RETROLOG_DATABASE_URL=pg_store_url)
    shown = json.loads(out.stdout.splitlines()[-1])
    assert shown["values"] == 12 and len(shown["runs"]) == 3
    assert shown["runs"] == sorted(_argv_of(pg_store_url))


@pytest.mark.usefixtures("whole_machine")
def test_a_local_replay_of_postgresql_runs_is_exact_under_default_settings(
    tmp_path: Path, pg_store_url: str
) -> None:
    """Local workers, their default number, torch's own threads and the adaptive rule:
    a torch script shaped like a real one, its metadata in PostgreSQL by pyproject.toml."""
    project = new_project(tmp_path / "proj")
    project.write("pyproject.toml", f'[tool.retrolog]\ndatabase_url = "{pg_store_url}"\n')
    project.write("train.py", REAL_SHAPED)
    project.git("add", "-A")
    project.git("commit", "-qm", "train")
    _record_two_at_defaults(project, pg_store_url)
    project.write("train.py", REAL_SHAPED.replace("# HINDSIGHT", W_NORM))
    out = project.cli("replay", "w_norm", "--yes", **DEFAULTS)
    assert out.returncode == 0, out.stderr
    assert "Replayed 2 run(s)" in out.stderr, out.stderr
    _assert_fresh_runs_log_the_same(pg_store_url, out.stderr)
