"""Retention policies and garbage collection, on stores recorded by real training scripts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrolog._gc import (
    GcReport,
    Keep,
    RetentionPolicy,
    collect_garbage,
    parse_duration,
    plan_gc,
    select_runs,
)
from retrolog._replay.plan import ScanLevel, load_profiles, plan_replay
from retrolog.checkpoint.capture import load_checkpoint
from retrolog.errors import UnknownNameError, UsageError
from retrolog.store.metastore import POSTGRESQL, SQLITE
from retrolog.store.objects import LocalObjectStore
from retrolog.store.paths import locate
from retrolog.store.processes import process_start_marker
from retrolog.store.sqlite_metadata import open_store
from training_scripts import NUMPY_TRAIN, new_project, shared_torch_runs

from conftest import Project, pg_role, read_db, read_pg, values_by_run


@pytest.fixture(scope="module")
def torch_template() -> Path:
    """Two recorded torch runs (every block checkpointed), recorded once for the session
    and copied by each test."""
    return shared_torch_runs()


@pytest.fixture
def torch_runs(torch_template: Path, tmp_path: Path) -> Project:
    root = tmp_path / "proj"
    shutil.copytree(torch_template, root, symlinks=True)
    return Project(root)


def run_ids(project: Project) -> list[str]:
    return [r for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]


@pytest.fixture
def conn(project: Project) -> Iterator[sqlite3.Connection]:
    connection = open_conn(project)
    yield connection
    connection.close()


def open_conn(project: Project) -> sqlite3.Connection:
    return open_store(locate(project.root), create=True)


def store_of(project: Project) -> LocalObjectStore:
    return LocalObjectStore(project.root / ".retrolog" / "objects")


def object_files(project: Project) -> dict[Path, int]:
    """Every file in the objects directory, with its size."""
    root = project.root / ".retrolog" / "objects"
    return {p: p.stat().st_size for p in root.rglob("*") if p.is_file()}


def age_objects(project: Project, seconds: float = 7200) -> None:
    """Make every object look written ``seconds`` ago (older than the grace period)."""
    past = time.time() - seconds
    for path in object_files(project):
        os.utime(path, (past, past))


def positions(project: Project, run_id: str) -> list[object]:
    rows = read_db(
        project.root,
        "SELECT c.kind, l.iteration FROM checkpoints c LEFT JOIN loops l"
        " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id WHERE c.run_id = ?"
        " ORDER BY c.ctx_id IS NULL, c.ctx_id",
        (run_id,),
    )
    return ["end" if kind == "end" else iteration for kind, iteration in rows]


def all_checkpoints_load(project: Project) -> int:
    """Decode every remaining checkpoint (a missing object raises); returns how many."""
    store = store_of(project)
    manifests = read_db(project.root, "SELECT manifest FROM checkpoints")
    for (manifest,) in manifests:
        load_checkpoint(store, manifest)
    return len(manifests)


# -- policies ----------------------------------------------------------------------------


def test_policy_spellings() -> None:
    assert RetentionPolicy.parse("all") == RetentionPolicy(Keep.ALL)
    assert RetentionPolicy.parse("last:3") == RetentionPolicy(Keep.LAST, count=3)
    assert RetentionPolicy.parse("last:0").count == 0
    best = RetentionPolicy.parse("best:val_acc")
    assert (best.keep, best.metric, best.maximize) == (Keep.BEST, "val_acc", True)
    assert RetentionPolicy.parse("best:val/loss:min") == RetentionPolicy(
        Keep.BEST, metric="val/loss", maximize=False
    )
    assert RetentionPolicy.parse("best:a:b").metric == "a:b"  # colons stay in the name
    for text in ("all", "last:3", "best:val_acc:max", "best:loss:min"):
        assert str(RetentionPolicy.parse(text)) == text
    for bad in ("last", "last:-1", "last:x", "best", "best:", "keep", "all:1", ""):
        with pytest.raises(UsageError, match="not a retention policy"):
            RetentionPolicy.parse(bad)


def test_durations() -> None:
    assert parse_duration("0") == 0
    assert parse_duration("90") == 90
    assert parse_duration("30m") == 1800
    assert parse_duration("1.5h") == 5400
    assert parse_duration("2d") == 172800
    with pytest.raises(UsageError, match="not a duration"):
        parse_duration("1 hour")


def test_last_n_keeps_the_last_blocks_and_the_end(torch_runs: Project) -> None:
    project = torch_runs
    runs = run_ids(project)
    assert [positions(project, r) for r in runs] == [[0, 1, 2, 3, 4, "end"]] * 2
    before = object_files(project)
    age_objects(project)
    conn = open_conn(project)
    store = store_of(project)
    plan = plan_gc(conn, store, RetentionPolicy.parse("last:2"))
    assert [(r.run_id, [c.position for c in r.kept]) for r in plan.runs] == [
        (runs[0], [3, 4, "end"]),
        (runs[1], [3, 4, "end"]),
    ]
    assert [c.position for c in plan.dropped] == [0, 1, 2, 0, 1, 2]
    assert object_files(project).keys() == before.keys()  # a plan deletes nothing

    done = collect_garbage(conn, store, plan)
    conn.close()
    assert done.done and done.checkpoints_deleted == 6
    assert [positions(project, r) for r in runs] == [[3, 4, "end"]] * 2
    after = object_files(project)
    assert len(after) == len(before) - len(done.objects) > 0
    # The bytes reported are exactly what the deleted files took.
    assert done.bytes_freed == sum(before.values()) - sum(after.values()) > 0
    assert plan.bytes_freed == done.bytes_freed
    assert all_checkpoints_load(project) == 6


def test_best_metric_keeps_the_peak_and_the_end(torch_runs: Project) -> None:
    project = torch_runs
    runs = run_ids(project)
    age_objects(project)
    conn = open_conn(project)
    store = store_of(project)
    peak = plan_gc(conn, store, RetentionPolicy.parse("best:val_acc:max"))
    # val_acc is SCORES[(epoch + seed) % 5]: the peak is epoch 1 for seed 0, epoch 0 for seed 1.
    assert {r.run_id: [c.position for c in r.kept] for r in peak.runs} == {
        runs[0]: [1, "end"],
        runs[1]: [0, "end"],
    }
    low = plan_gc(conn, store, RetentionPolicy.parse("best:val_loss:min"))
    assert {r.run_id: [c.position for c in r.kept] for r in low.runs} == {
        runs[0]: [3, "end"],
        runs[1]: [2, "end"],
    }
    collect_garbage(conn, store, peak)
    conn.close()
    assert positions(project, runs[0]) == [1, "end"]
    assert all_checkpoints_load(project) == 4


def test_best_metric_logged_in_the_nested_loop_takes_each_iterations_last_value(
    torch_runs: Project,
) -> None:
    project = torch_runs
    runs = run_ids(project)
    # "loss" is logged per step: an epoch's value is its last step's loss.
    last_loss = read_db(
        project.root,
        "SELECT e.iteration, l.value FROM logs l JOIN loops s ON s.run_id = l.run_id"
        " AND s.ctx_id = l.ctx_id JOIN loops e ON e.run_id = s.run_id AND e.ctx_id = s.parent_ctx"
        " WHERE l.run_id = ? AND l.name = 'loss' AND s.iteration = 3",
        (runs[0],),
    )
    expected = min(last_loss, key=lambda row: row[1])[0]
    conn = open_conn(project)
    plan = plan_gc(conn, store_of(project), RetentionPolicy.parse("best:loss:min"), [runs[0]])
    conn.close()
    ((run,),) = [plan.runs]
    assert [c.position for c in run.kept] == [expected, "end"]


def test_best_metric_own_value_wins_and_missing_metric_keeps_everything(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    (run_id,) = run_ids(project)
    store = store_of(project)
    # "score" is logged in each epoch itself: the last epoch has the highest (w only grows).
    plan = plan_gc(conn, store, RetentionPolicy.parse("best:score"))
    assert [c.position for c in plan.runs[0].kept] == [3, "end"]
    # The epoch's own value wins over values in its nested loop, and a recorded value
    # over a backfilled one.
    conn.execute(
        "INSERT INTO logs(run_id, ctx_id, name, value, value_type)"
        " SELECT run_id, ctx_id, 'score', 1e9, 'float' FROM loops WHERE name = 'step'"
    )
    conn.execute(
        "INSERT INTO logs(run_id, ctx_id, name, value, value_type, origin)"
        " SELECT run_id, ctx_id, 'score', 1e9, 'float', 'backfilled' FROM loops"
        " WHERE name = 'epoch' AND iteration = 1"
    )
    plan = plan_gc(conn, store, RetentionPolicy.parse("best:score"))
    assert [c.position for c in plan.runs[0].kept] == [3, "end"]
    plan = plan_gc(conn, store, RetentionPolicy.parse("best:score:min"))
    assert [c.position for c in plan.runs[0].kept] == [0, "end"]
    # A name logged only at run level says nothing about iterations: nothing is dropped.
    conn.execute(
        "INSERT INTO logs(run_id, ctx_id, name, value, value_type) VALUES (?, NULL, 'm', 1, 'int')",
        (run_id,),
    )
    plan = plan_gc(conn, store, RetentionPolicy.parse("best:m"))
    assert not plan.dropped
    assert "no checkpointed iteration logged 'm'" in (plan.runs[0].note or "")
    with pytest.raises(UnknownNameError, match=r"'scor'.*Did you mean 'score'"):
        plan_gc(conn, store, RetentionPolicy.parse("best:scor"))


# -- safety ------------------------------------------------------------------------------


def _pretend_running(conn: sqlite3.Connection, run_id: str, started_at: float) -> None:
    """Mark ``run_id`` as recording in this (live) process, as a training process would be."""
    pid = os.getpid()
    conn.execute(
        "INSERT INTO runs(run_id, projid, tstamp, filename, status, started_at, host, pid,"
        " pid_start, python, argv) VALUES (?, 'p', '', 'train.py', 'running', ?, ?, ?, ?, '3',"
        " '[]')",
        (run_id, started_at, socket.gethostname(), pid, process_start_marker(pid)),
    )


def test_running_runs_and_recent_objects_are_kept(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    (finished,) = run_ids(project)
    age_objects(project)
    store = store_of(project)
    # A run recording since ten minutes ago has written a checkpoint's blob and manifest
    # but not yet its row; one more old object is referenced by nothing.
    _pretend_running(conn, "running-run", time.time() - 600)
    in_flight = [store.put(b"blob being checkpointed" * 100), store.put(b'{"manifest": 1}')]
    stray = store.put(b"left by a run that crashed long ago")
    past = time.time() - 7200
    os.utime(store.path(stray), (past, past))
    # The running run's earlier checkpoint row references an old object.
    # (the one of epoch 0, which the policy drops from the finished run).
    (old_manifest,) = read_db(
        project.root, "SELECT manifest FROM checkpoints WHERE kind = 'block' ORDER BY ctx_id"
    )[0]
    conn.execute(
        "INSERT INTO checkpoints(run_id, ctx_id, loop_name, kind, manifest, nbytes,"
        " capture_seconds, write_seconds, created_at) VALUES"
        " ('running-run', 7, 'epoch', 'block', ?, 1, 0, 0, 0)",
        (old_manifest,),
    )

    plan = plan_gc(conn, store, RetentionPolicy.parse("last:0"), grace_seconds=0)
    assert "running-run started" in plan.cutoff_reason
    assert [r.run_id for r in plan.runs if r.note] == ["running-run"]
    (running,) = [r for r in plan.runs if r.run_id == "running-run"]
    assert not running.dropped and "still recording" in (running.note or "")
    done = collect_garbage(conn, store, plan)
    assert stray in [f.key for f in done.objects]
    for key in in_flight:
        assert store.has(key)
    assert not store.has(stray)
    assert read_db(project.root, "SELECT COUNT(*) FROM checkpoints WHERE run_id = 'running-run'")
    assert positions(project, finished) == ["end"]
    load_checkpoint(store, old_manifest)  # the running run's checkpoint is whole


def test_an_old_object_a_running_run_stores_again_is_kept(
    project: Project, conn: sqlite3.Connection
) -> None:
    # Run B deduplicates against run A's old objects: LocalObjectStore.put finds them
    # stored and writes nothing, but freshens them, which is what keeps them alive.
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    age_objects(project)
    store = store_of(project)
    first = read_db(
        project.root, "SELECT manifest FROM checkpoints WHERE kind = 'block' ORDER BY ctx_id"
    )[0][0]
    reused = sorted({first} | _blobs(store, first))
    _pretend_running(conn, "run-b", time.time() - 60)
    for key in reused:
        store.put(store.get(key))  # run B's checkpoint holds the same content
    done = collect_garbage(
        conn, store, plan_gc(conn, store, RetentionPolicy.parse("last:0"), grace_seconds=3600)
    )
    assert done.objects  # run A's other dropped checkpoints were collected
    assert all(store.has(key) for key in reused)


def _blobs(store: LocalObjectStore, manifest: str) -> set[str]:
    from retrolog.checkpoint.codec import manifest_blobs

    return manifest_blobs(manifest, store)


def test_delete_leaves_an_object_written_after_the_scan(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects", durable=False)
    key = store.put(b"an object")
    cutoff = time.time() - 60
    # Freshened after gc decided it was garbage: the rename-aside check sees it.
    assert not store.remove_if_stale(key, cutoff)
    assert store.get(key) == b"an object"
    past = time.time() - 3600
    os.utime(store.path(key), (past, past))
    assert store.remove_if_stale(key, cutoff)
    assert not store.has(key)
    assert not store.remove_if_stale(key, cutoff)  # already gone: nothing to do
    assert [p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()] == []


def test_a_real_run_recording_beside_gc_keeps_every_checkpoint(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")  # run A: same seed, so run B's states are A's states
    age_objects(project)
    with project.recording_paused():
        run_b = run_ids(project)[-1]
        store = store_of(project)
        plan = plan_gc(conn, store, RetentionPolicy.parse("last:0"), grace_seconds=0)
        assert {r.run_id for r in plan.runs if r.dropped} == {run_ids(project)[0]}
        done = collect_garbage(conn, store, plan)
        assert done.checkpoints_deleted == 4 and done.objects
    assert positions(project, run_b) == [0, 1, 2, 3, "end"]
    assert all_checkpoints_load(project) == 6  # run B's five and run A's end


@pytest.mark.parametrize(
    "backend",
    ["sqlite", pytest.param("postgresql", marks=[pytest.mark.slow, pytest.mark.services])],
)
def test_gc_beside_a_run_recording_at_default_settings_loses_nothing_it_chose(
    project: Project, backend: str, request: pytest.FixtureRequest
) -> None:
    """The guarantee under the adaptive rule, whatever it chooses under this machine's
    load, with ``retrolog gc`` as a user runs it: no grace, every finished run thinned
    to its end checkpoint, while a run of the same script and seed records (so its
    checkpoints hold the finished run's content, which gc deletes). On the embedded
    store and with ``database_url`` naming PostgreSQL."""
    url = request.getfixturevalue("pg_store_url") if backend == "postgresql" else None

    def rows(sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        if url is None:
            return read_db(project.root, sql, params)
        return read_pg(url, sql.replace("?", "%s"), params)

    def where(run_id: str) -> list[object]:
        found = rows(
            "SELECT c.kind, l.iteration FROM checkpoints c LEFT JOIN loops l"
            " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id WHERE c.run_id = ?"
            " ORDER BY c.ctx_id IS NULL, c.ctx_id",
            (run_id,),
        )
        return ["end" if kind == "end" else iteration for kind, iteration in found]

    def runs() -> list[str]:
        return [str(r) for (r,) in rows("SELECT run_id FROM runs ORDER BY started_at")]

    settings = {"RETROLOG_CHECKPOINTS": "adaptive"}
    if url is not None:
        settings["RETROLOG_DATABASE_URL"] = url
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py", **settings)
    (run_a,) = runs()
    rows_a = where(run_a)
    assert rows_a[-1] == "end" and 0 in rows_a  # the first block's checkpoint, always
    age_objects(project)
    with project.recording_paused(**settings):
        run_b = runs()[-1]
        before = where(run_b)
        done = project.cli("gc", "--keep", "last:0", "--grace", "0", "--yes", "--json", **settings)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["done"] and report["checkpoints"] == len(rows_a) - 1, report
        assert where(run_a) == ["end"]
        # The recording run keeps its rows (its writer may add one meanwhile).
        assert set(before) <= set(where(run_b))
    # Run B finished: every block checkpoint its rule chose was written, and every
    # checkpoint that remains, its own among them, decodes from objects that are there.
    rows_b = where(run_b)
    ((summary,),) = rows("SELECT checkpointing FROM runs WHERE run_id = ?", (run_b,))
    policy = json.loads(str(summary))
    assert policy["mode"] == "adaptive" and policy["abandoned"] == 0
    assert policy["chosen"] == policy["written"] == len(rows_b) - 1 and rows_b[-1] == "end"
    assert set(before) <= set(rows_b)
    manifests = [str(m) for (m,) in rows("SELECT manifest FROM checkpoints")]
    for manifest in manifests:
        load_checkpoint(store_of(project), manifest)  # a missing object raises
    assert len(manifests) == 1 + len(rows_b)
    # Run A's own code still reproduces what it recorded from what gc left (run B's
    # arguments write into the project, which a replay refuses).
    # On PostgreSQL as a team's replaying role: a superuser's predicates are refused.
    with contextlib.ExitStack() as roles:
        if url is not None:
            admin = request.getfixturevalue("database_url")
            grants = "SELECT, INSERT, UPDATE, DELETE"
            settings["RETROLOG_DATABASE_URL"] = roles.enter_context(pg_role(admin, url, grants))
        verified = project.cli("replay", "--verify", "--yes", f"run_id = '{run_a}'", **settings)
    assert verified.returncode == 0, verified.stderr
    assert "Verified 1 run(s): 1 replay exactly" in verified.stderr, verified.stderr


def test_temp_files_older_than_the_grace_period_are_removed(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    objects = project.root / ".retrolog" / "objects"
    fan = next(p for p in objects.iterdir() if p.is_dir())
    old = [fan / ".abcdef.123.0a0b.tmp", objects / ".stray.tmp"]
    fresh = fan / ".abcdef.456.0c0d.tmp"
    for path in [*old, fresh]:
        path.write_bytes(b"x" * 100)
    past = time.time() - 7200
    for path in old:
        os.utime(path, (past, past))
    store = store_of(project)
    plan = plan_gc(conn, store, RetentionPolicy.parse("all"))
    assert sorted(f.location for f in plan.temp_files) == sorted(map(str, old))
    assert plan.bytes_freed == 200 and not plan.objects and not plan.dropped
    done = collect_garbage(conn, store, plan)
    assert len(done.temp_files) == 2 and done.bytes_freed == 200
    assert fresh.exists() and not any(p.exists() for p in old)
    assert all_checkpoints_load(project) == 5


def test_a_running_runs_temp_files_are_kept_even_with_no_grace(
    project: Project, conn: sqlite3.Connection
) -> None:
    """A temp file written since a running run started may be its writer's object halfway
    through: deleting it made that write fail on the rename, and the checkpoint was lost
    (seen under load in test_a_real_run_recording_beside_gc_keeps_every_checkpoint)."""
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    objects = project.root / ".retrolog" / "objects"
    fan = next(p for p in objects.iterdir() if p.is_dir())
    _pretend_running(conn, "running-run", time.time() - 600)
    being_written = fan / ".abcdef.123.0a0b.tmp"  # since the run started: its writer's
    crashed = fan / ".abcdef.456.0c0d.tmp"  # before it: a writer that died long ago
    for path, age in ((being_written, 60), (crashed, 7200)):
        path.write_bytes(b"x" * 100)
        os.utime(path, (time.time() - age, time.time() - age))
    store = store_of(project)
    plan = plan_gc(conn, store, RetentionPolicy.parse("all"), grace_seconds=0)
    assert [f.location for f in plan.temp_files] == [str(crashed)]
    collect_garbage(conn, store, plan)
    assert being_written.exists() and not crashed.exists()


def test_dry_run_and_keep_all_delete_nothing_referenced(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    age_objects(project)
    before = object_files(project)
    store = store_of(project)
    plan = plan_gc(conn, store, RetentionPolicy.parse("last:1"), grace_seconds=0)
    assert plan.dropped and plan.objects
    assert object_files(project) == before
    assert len(read_db(project.root, "SELECT * FROM checkpoints")) == 5
    plan = plan_gc(conn, store, RetentionPolicy(), grace_seconds=0)
    keep_all = collect_garbage(conn, store, plan)
    assert keep_all.empty and object_files(project) == before


def test_an_unreadable_kept_manifest_stops_object_deletion(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    age_objects(project)
    store = store_of(project)
    (end,) = read_db(project.root, "SELECT manifest FROM checkpoints WHERE kind = 'end'")[0]
    damaged = store.path(end)
    damaged.write_bytes(b"not what was written")
    past = time.time() - 7200
    os.utime(damaged, (past, past))
    before = object_files(project)
    plan = plan_gc(conn, store, RetentionPolicy.parse("last:1"), grace_seconds=0)
    (unreadable,) = plan.unreadable
    assert unreadable.manifest == end and "corrupt" in unreadable.reason
    # The last block's state is the end state: one manifest, both kept checkpoints use it.
    (run_id,) = run_ids(project)
    assert unreadable.checkpoints == (f"{run_id} at 3", f"{run_id} at end")
    assert not plan.objects and any("no object is deleted" in n for n in plan.notes)
    done = collect_garbage(conn, store, plan)
    assert done.checkpoints_deleted == 3  # the rows go; what they referenced stays for now
    assert object_files(project) == before
    # A missing manifest is just as unknown.
    damaged.unlink()
    again = plan_gc(conn, store, RetentionPolicy.parse("all"), grace_seconds=0)
    assert again.unreadable and not again.objects


def test_files_that_are_not_objects_and_code_versions_are_left_alone(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    refs = project.git("for-each-ref", "refs/retrolog")
    objects = project.root / ".retrolog" / "objects"
    strangers = [objects / "README", objects / "zz" / "not-a-key", objects / "ab" / "cd"]
    for path in strangers:
        path.parent.mkdir(exist_ok=True)
        path.write_text("keep me")
    age_objects(project)
    store = store_of(project)
    done = collect_garbage(conn, store, plan_gc(conn, store, RetentionPolicy.parse("last:0")))
    assert done.objects and all(p.exists() for p in strangers)
    assert project.git("for-each-ref", "refs/retrolog") == refs
    assert refs.count("refs/retrolog/runs/") == 1


def test_runs_of_a_script_being_replayed_are_kept(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    conn.execute(
        "INSERT INTO replays(replay_id, started_at, names, filename, workers, status)"
        " VALUES ('r1', ?, '[]', 'train.py', 1, 'running')",
        (time.time() - 60,),
    )
    plan = plan_gc(conn, store_of(project), RetentionPolicy.parse("last:0"))
    assert not plan.dropped
    assert "replay r1 of train.py is in progress" in (plan.runs[0].note or "")
    # A replay that has been 'running' for days was killed: it protects nothing.
    conn.execute("UPDATE replays SET started_at = ?", (time.time() - 3 * 86400,))
    assert plan_gc(conn, store_of(project), RetentionPolicy.parse("last:0")).dropped


def test_select_runs_by_prefix_and_predicate(project: Project, conn: sqlite3.Connection) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py", "--kwargs", "seed=1", "epochs=2")
    project.run("train.py", "--kwargs", "seed=2", "epochs=2")
    first, second = run_ids(project)
    assert select_runs(conn) is None
    assert select_runs(conn, [second]) == [second]
    assert select_runs(conn, where="seed > 1") == [second]
    assert select_runs(conn, [first, second], where="seed > 1") == [second]
    assert select_runs(conn, where="seed > 5") == []
    plan = plan_gc(conn, store_of(project), RetentionPolicy.parse("last:0"), [second])
    assert {c.run_id for c in plan.dropped} == {second}
    with pytest.raises(UsageError):
        plan_gc(conn, store_of(project), RetentionPolicy(), grace_seconds=-1)


# -- replay after gc ---------------------------------------------------------------------


def test_replay_plan_executes_dropped_blocks_and_the_estimate_grows(
    project: Project, conn: sqlite3.Connection
) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py", "--kwargs", "sleep=0.1")
    (run_id,) = run_ids(project)
    # Restores costed at 1 GB/s (as a measured throughput would be): each 16 kB checkpoint
    # is far cheaper to restore than its 0.3 s block is to run.
    per_byte = 1e-9
    (before,) = load_profiles(conn, [run_id])
    plan_before = plan_replay(ScanLevel.OUTER_LOOP, [before], 1, restore_seconds_per_byte=per_byte)
    ((segment,),) = [r.segments for r in plan_before.runs]
    assert (segment.restore, segment.execute) == ((0, 1, 2, 3), ())

    age_objects(project)
    store = store_of(project)
    collect_garbage(conn, store, plan_gc(conn, store, RetentionPolicy.parse("last:1")))
    (after,) = load_profiles(conn, [run_id])
    assert sorted(after.block_checkpoints) == [3] and after.end_checkpoint is not None
    plan_after = plan_replay(ScanLevel.OUTER_LOOP, [after], 1, restore_seconds_per_byte=per_byte)
    ((segment,),) = [r.segments for r in plan_after.runs]
    assert (segment.restore, segment.execute) == ((3,), (0, 1, 2))
    assert "3 of 4 blocks have no checkpoint: executed" in plan_after.runs[0].notes
    # The estimate now pays for training three blocks (each slept 3 x 0.1 s) instead of
    # restoring them.
    executed = sum(after.block_seconds[:3])
    assert executed > 0.85
    grown = plan_after.estimate_seconds - plan_before.estimate_seconds
    restores = sum(before.checkpoint_bytes[i] * per_byte for i in range(3))
    # At most what recording spent on those checkpoints comes on top (the planner takes
    # it out of an iteration's time only where the iteration has a checkpoint).
    recorded = sum(before.checkpoint_seconds[i] for i in range(3))
    assert executed - restores - 1e-9 <= grown <= executed + recorded + 1e-9


NEWEST = NUMPY_TRAIN.replace(
    '        rl.log("score", float(w[:10].sum()))\n',
    '        rl.log("score", float(w[:10].sum()))\n'
    '        rl.log("w_norm", float(np.linalg.norm(w)))\n',
)


@pytest.mark.slow
def test_replay_after_gc_executes_the_dropped_blocks_exactly(project: Project) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py", "--kwargs", "seed=3")
    (run_id,) = run_ids(project)
    age_objects(project)
    out = project.cli("gc", "--keep", "last:1", "--yes")
    assert out.returncode == 0, out.stderr
    assert positions(project, run_id) == [3, "end"]

    project.write("train.py", NEWEST)
    out = project.cli("replay", "w_norm", "--yes")
    assert out.returncode == 0, out.stderr
    assert "3 of 4 blocks have no checkpoint: executed" in out.stderr
    replayed = read_db(
        project.root,
        "SELECT e.iteration, l.value FROM logs l JOIN loops e ON e.run_id = l.run_id"
        " AND e.ctx_id = l.ctx_id WHERE l.name = 'w_norm' AND l.origin = 'backfilled'"
        " ORDER BY e.iteration",
    )
    with tempfile.TemporaryDirectory() as tmp:
        project.run("train.py", "--kwargs", "seed=3", RETROLOG_STORE=tmp)
        fresh = sqlite3.connect(Path(tmp) / "retrolog.db")
        expected = fresh.execute(
            "SELECT e.iteration, l.value FROM logs l JOIN loops e ON e.run_id = l.run_id"
            " AND e.ctx_id = l.ctx_id WHERE l.name = 'w_norm' ORDER BY e.iteration"
        ).fetchall()
        fresh.close()
    assert len(expected) == 4
    assert replayed == expected


def test_report_as_data_and_text(project: Project, conn: sqlite3.Connection) -> None:
    from retrolog._gc import format_report

    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    age_objects(project)
    plan: GcReport = plan_gc(
        conn, store_of(project), RetentionPolicy.parse("last:1"), grace_seconds=0
    )
    data = plan.to_dict()
    (run_id,) = run_ids(project)
    assert data["runs"] == [
        {"run_id": run_id, "status": "finished", "kept": [3, "end"], "dropped": [0, 1, 2],
         "note": None}
    ]  # fmt: skip
    assert data["checkpoints"] == 3 and data["bytes_freed"] == plan.bytes_freed > 0
    assert not data["done"] and data["objects"] == len(plan.objects)
    text = format_report(plan)
    assert f"{run_id}  finished  3, end  0-2" in text
    assert "would delete 3 checkpoint(s)" in text


# A script whose runs differ by their arguments, every block checkpointed, for the test
# below; its replay adds STATEMENT at # HINDSIGHT.
SEEDED = """\
import argparse

import numpy as np

import retrolog as rl


def train(args):
    w = np.zeros(4096)
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(4)):
            rng = np.random.default_rng(args.seed * 100 + epoch)
            for step in rl.loop("step", range(10)):
                w += rng.random(4096) * args.lr
            rl.log("acc", float(w[:8].sum()))
            # HINDSIGHT


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args())
"""
STATEMENT = 'rl.log("w_norm", float(np.linalg.norm(w)))'


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.services)]
)
def test_gc_thins_finished_runs_beside_a_recording_run_and_replay_stays_exact(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """Retention thins the finished runs' checkpoint rows and deletes the objects nothing
    references while another run records: that run keeps every row and object and
    finishes; a replay afterwards is still exact (a dropped checkpoint's block is
    executed). On the embedded store, and with ``database_url`` in pyproject.toml naming
    PostgreSQL, where a role that may only read plans and is refused the deletion."""
    url = request.getfixturevalue("pg_store_url") if backend == "postgresql" else None
    number = (SQLITE if url is None else POSTGRESQL).number()
    project = new_project(tmp_path / "proj")

    def rows(sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        if url is None:
            return read_db(project.root, sql, params)
        return read_pg(url, sql.replace("?", "%s"), params)

    def by_run() -> dict[str, list[tuple[str, object]]]:
        found: dict[str, list[tuple[str, object]]] = {}
        for run_id, kind, iteration in rows(
            "SELECT c.run_id, c.kind, l.iteration FROM checkpoints c LEFT JOIN loops l"
            " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id ORDER BY c.checkpoint_id"
        ):
            found.setdefault(str(run_id), []).append((str(kind), iteration))
        return found

    def objects() -> set[str]:
        """The keys of the objects in the project's store (objects/<2 hex>/<the rest>)."""
        found = (project.root / ".retrolog" / "objects").rglob("*")
        return {p.parent.name + p.name for p in found if p.is_file()}

    if url is not None:
        project.write("pyproject.toml", f'[tool.retrolog]\ndatabase_url = "{url}"\n')
    project.write("train.py", SEEDED)
    project.write("paused.py", NUMPY_TRAIN)
    project.git("add", "-A")
    project.git("commit", "-qm", "scripts")
    for lr, seed in (("0.1", "1"), ("0.2", "2")):
        project.run("train.py", "--lr", lr, "--seed", seed)
    finished = by_run()
    assert len(finished) == 2 and all(len(r) == 5 for r in finished.values())  # 4 blocks + end

    if url is not None:
        with pg_role(request.getfixturevalue("database_url"), url, "SELECT") as reader:
            planned = project.cli(
                "gc", "--keep", "last:1", "--grace", "0", "--dry-run", "--json",
                RETROLOG_DATABASE_URL=reader,
            )  # fmt: skip
            assert planned.returncode == 0, planned.stderr
            refused = project.cli(
                "gc", "--keep", "last:1", "--grace", "0", "--yes", RETROLOG_DATABASE_URL=reader
            )
            assert refused.returncode != 0 and "may not DELETE" in refused.stderr, refused.stderr
        assert len(json.loads(planned.stdout)["runs"]) == 2

    # Objects written since the oldest running run started (less 2 s for clocks) are
    # kept: let the finished runs' objects be older than that.
    time.sleep(3)
    with project.recording_paused("paused.py") as proc:
        ((running,),) = rows("SELECT run_id FROM runs WHERE status = 'running'")
        running = str(running)
        deadline = time.monotonic() + 30
        while len(by_run().get(running, [])) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # its epochs' checkpoints, written by its writer thread
        before = by_run()[running]
        assert before == [("block", 0), ("block", 1)]
        objects_before = objects()
        done = project.cli("gc", "--keep", "last:1", "--grace", "0", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["done"] and report["checkpoints"] == 6, report
        after = by_run()
        assert after[running] == before  # the recording run keeps every row
        for run_id in finished:
            assert after[run_id] == [("block", 3), ("end", None)], after[run_id]
        deleted = objects_before - objects()
        assert deleted and report["objects"] == len(deleted)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    # The run that was recording finished, and all its checkpoints are there to restore.
    assert [kind for kind, _ in by_run()[running]].count("block") == 4
    manifests = rows("SELECT manifest FROM checkpoints")
    assert {str(m) for (m,) in manifests} <= objects()  # every kept row's object

    # A replay after gc: the dropped checkpoints' blocks are executed, values still exact.
    project.write("train.py", SEEDED.replace("# HINDSIGHT", STATEMENT))
    out = project.cli("replay", "w_norm", "--yes", "--script", "train.py")
    assert out.returncode == 0, out.stderr
    argv = {str(r): tuple(json.loads(str(a))[1:]) for r, a in rows("SELECT run_id, argv FROM runs")}
    for run_id in finished:
        fresh = new_project(tmp_path / f"fresh-{run_id}")
        fresh.write("train.py", SEEDED.replace("# HINDSIGHT", STATEMENT))
        fresh.run("train.py", *argv[run_id])
        (expected,) = values_by_run(fresh.root, "w_norm").values()
        replayed = [
            float(str(v))
            for (v,) in rows(
                f"SELECT {number} FROM logs WHERE name = 'w_norm' AND run_id = ? ORDER BY ctx_id",
                (run_id,),
            )
        ]
        assert replayed == expected and len(expected) == 4, run_id
