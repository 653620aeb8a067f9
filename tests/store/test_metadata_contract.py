"""The metadata seam's contract: every backend in store/metastore.py's registry answers
the same operations the same way.

Each test runs once per backend: the embedded SQLite store (no ``database_url``) and
PostgreSQL (a schema of its own on the test server, see conftest's ``pg_store_url``),
opened through ``open_metadata`` as every command opens its store. What only one
backend has (PostgreSQL's roles, its crash recovery, migrations between versions) is
tested in that backend's own files.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrolog.errors import StoreError, UsageError
from retrolog.store import reads
from retrolog.store.metastore import (
    BACKENDS,
    POSTGRESQL,
    RUN_COLUMNS,
    SQLITE,
    MetadataStore,
    activity_stamp,
    backend,
    database_errors,
    dialect_of,
    open_metadata,
    read_snapshot,
    store_file,
    write_transaction,
)
from retrolog.store.paths import ProjectPaths, storable_text
from retrolog.store.processes import process_start_marker
from retrolog.store.records import RecordBatch

from conftest import DATABASE_HINT, Project, pg_role, service_setting

# PostgreSQL needs the test servers: `bash scripts/test.sh --fast` leaves that half out.
BACKEND_NAMES = ("sqlite", pytest.param("postgresql", marks=pytest.mark.services))


@pytest.fixture(params=BACKEND_NAMES)
def paths(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ProjectPaths:
    """A project whose ``database_url`` names the backend under test (none: SQLite)."""
    if request.param == "postgresql":
        monkeypatch.setenv("RETROLOG_DATABASE_URL", request.getfixturevalue("pg_store_url"))
    else:
        monkeypatch.delenv("RETROLOG_DATABASE_URL", raising=False)
    root = tmp_path / "proj"
    root.mkdir()
    return ProjectPaths(root=root, store=root / ".retrolog", in_git=False)


@pytest.fixture
def store(paths: ProjectPaths) -> Iterator[MetadataStore]:
    metadata = open_metadata(paths)
    yield metadata
    metadata.close()


def run_row(run_id: str, started_at: float, **changes: object) -> dict[str, object]:
    """A starting run's row, as runtime/run.py registers one."""
    row: dict[str, object] = {
        "run_id": run_id, "projid": "proj", "tstamp": run_id, "filename": "train.py",
        "status": "running", "started_at": started_at, "host": socket.gethostname(),
        "pid": os.getpid(), "pid_start": process_start_marker(os.getpid()),
        "python": "3.12.0", "argv": json.dumps(["train.py", "--lr", "0.1"]),
        "code_ref": None, "code_commit": None, "code_tree": None, "head_commit": None,
        "git_dir": None, "dirty": 0, "skipped_files": "[]", "cwd": ".", "numerics": "{}",
    }  # fmt: skip
    assert tuple(row) == RUN_COLUMNS
    row.update(changes)
    return row


def status(store: MetadataStore, run_id: str) -> str:
    (found,) = store.reader().execute("SELECT status FROM runs WHERE run_id = ?", (run_id,))
    return str(found[0])


def test_a_missing_store_is_one_clear_error_and_a_new_one_is_empty(
    paths: ProjectPaths,
) -> None:
    with pytest.raises(StoreError, match="Record a run first"):
        open_metadata(paths, create=False)
    made = open_metadata(paths)
    try:
        assert made.run_listing() == []
        assert dialect_of(made.reader()) is made.dialect
        assert made.dialect in (SQLITE, POSTGRESQL)
    finally:
        made.close()
    # Opened again by a reader, it is the same store.
    again = open_metadata(paths, create=False)
    try:
        assert again.run_listing() == []
    finally:
        again.close()
    # Either way the project's store directory exists, out of git's sight.
    assert (paths.store / ".gitignore").exists()


def test_registered_runs_are_listed_newest_first(store: MetadataStore) -> None:
    for i, started in enumerate((10.0, 30.0, 20.0)):
        store.register_run(run_row(f"run-{i}", started))
    listing = store.run_listing()
    assert [r[0] for r in listing] == ["run-1", "run-2", "run-0"]
    assert listing[0][1:6] == ("run-1", "train.py", "running", 30.0, None)
    assert listing[0].status == "running" and listing[0].args == "{}"
    assert [r[0] for r in store.run_listing(limit=2)] == ["run-1", "run-2"]


def test_scripts_are_listed_most_recently_run_first_with_their_runs(
    store: MetadataStore,
) -> None:
    assert store.scripts() == []
    store.register_run(run_row("run-0", 1.0, filename="a.py"))
    store.register_run(run_row("run-1", 2.0, filename="b.py"))
    store.register_run(run_row("run-2", 3.0, filename="a.py"))
    assert store.scripts() == [("a.py", 2), ("b.py", 1)]
    assert store.scripts()[0].runs == 2
    before = store.activity()
    store.register_run(run_row("run-3", 4.0, filename="b.py"))
    assert store.activity() != before
    assert [s.filename for s in store.scripts()] == ["b.py", "a.py"]


def test_text_that_is_not_utf8_is_stored_as_the_store_keeps_it(store: MetadataStore) -> None:
    name = "tr\udcffain.py"  # a file name's byte 0xff, as Python decodes it
    store.register_run(run_row("run-0", 1.0, filename=name))
    assert store.run_listing()[0][2] == storable_text(name) != name


def test_a_code_manifest_is_live_once_a_run_names_it(store: MetadataStore) -> None:
    store.register_run(run_row("run-0", 1.0))
    assert store.live_manifests(["m1", "m2"]) == set()
    store.set_code_manifest("run-0", "m1")
    assert store.live_manifests(["m1", "m2"]) == {"m1"}
    assert store.live_manifests([]) == set()


def test_this_hosts_dead_runs_are_marked_crashed_and_no_others(store: MetadataStore) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store.register_run(run_row("dead", 1.0, pid=gone.pid, pid_start=None))
    store.register_run(run_row("alive", 2.0))  # this process
    store.register_run(run_row("elsewhere", 3.0, host="another-host", pid=gone.pid))
    assert store.mark_dead_runs_crashed() == 1
    assert status(store, "dead") == "crashed"
    assert status(store, "alive") == status(store, "elsewhere") == "running"
    assert store.mark_dead_runs_crashed() == 0


def test_the_restore_ratio_is_learned_from_replays_of_the_script(store: MetadataStore) -> None:
    assert store.learned_restore_ratio("train.py") is None
    store.register_run(run_row("run-0", 1.0))
    sink = store.record_sink()()
    try:
        checkpoint = (None, "epoch", "block", "manifest-key", 100, 0.5, 0.1, 2.0, 0.5, None)
        sink.write("run-0", RecordBatch(checkpoints=[checkpoint, checkpoint]))
    finally:
        sink.close()
    assert store.learned_restore_ratio("train.py") is None  # no replay yet
    store._run_many(
        "INSERT INTO replay_runs(replay_id, run_id, scan, status, restored, restore_seconds)"
        " VALUES (?, ?, 'outer', 'done', ?, ?)",
        [("replay-0", "run-0", 4, 2.0)],
    )
    # restore 2.0 s / 4 checkpoints, over materializing one: 0.5 + 0.5 s.
    assert store.learned_restore_ratio("train.py") == pytest.approx(0.5)
    assert store.learned_restore_ratio("other.py") is None


def test_a_record_sinks_batch_reads_back_through_the_reader(store: MetadataStore) -> None:
    store.register_run(run_row("run-0", 1.0))
    before = activity_stamp(store.reader())
    batch = RecordBatch(
        loop_starts=[(0, None, "epoch", 0, None, 0, 1.5)],
        logs=[(0, "loss", 0.25, "float"), (0, "step", 7, "int"), (None, "note", "hé", "str")],
        run_updates=[{"status": "finished", "ended_at": 9.0}],
    )
    sink = store.record_sink()()
    try:
        sink.write("run-0", batch)
    finally:
        sink.close()
    reader = store.reader()
    parts = ", ".join(dialect_of(reader).parts)
    with read_snapshot(reader):
        rows = reader.execute(
            f"SELECT name, ctx_id, {parts}, value_type FROM logs WHERE run_id = ? ORDER BY name",
            ("run-0",),
        ).fetchall()
        loops = reader.execute("SELECT name, iteration FROM loops WHERE run_id = ?", ("run-0",))
        assert [tuple(r) for r in loops] == [("epoch", 0)]
    width = len(dialect_of(reader).parts)
    values = [(r[0], r[1], next((v for v in r[2 : 2 + width] if v is not None), None), r[-1])
              for r in rows]  # fmt: skip
    assert values == [
        ("loss", 0, 0.25, "float"), ("note", None, "hé", "str"), ("step", 0, 7, "int"),
    ]  # fmt: skip
    assert status(store, "run-0") == "finished"
    assert activity_stamp(store.reader()) != before


def test_the_reader_takes_question_marks_and_keeps_them_inside_strings(
    store: MetadataStore,
) -> None:
    store.register_run(run_row("run-?", 1.0))
    reader = store.reader()
    found = reader.execute(
        "SELECT run_id, 'what?' FROM runs WHERE run_id = ? AND filename LIKE '%.py'", ("run-?",)
    ).fetchall()
    assert [tuple(r) for r in found] == [("run-?", "what?")]


def test_the_typed_reads_answer_alike(store: MetadataStore) -> None:
    store.register_run(run_row("b_1", 20.0, code_commit="c1", code_tree="t1", git_dir="g"))
    store.register_run(run_row("a%2", 10.0, status="ended"))
    store.register_run(run_row("b_10", 20.0))
    reader = store.reader()
    assert reads.run_exists(reader, "b_1") and not reads.run_exists(reader, "b")
    # LIKE's wildcards in a prefix are taken literally.
    assert reads.run_ids_starting(reader, "b_1") == ["b_1", "b_10"]
    assert reads.run_ids_starting(reader, "a%") == ["a%2"]
    assert reads.run_ids_starting(reader, "_") == []
    assert sorted(reads.newest_run_ids(reader, 2)) == ["b_1", "b_10"]
    assert reads.newest_run_ids(reader, 3)[2] == "a%2"
    assert reads.run_ids_oldest_first(reader) == ["a%2", "b_1", "b_10"]
    assert sorted(reads.running_run_ids(reader)) == ["b_1", "b_10"]
    assert reads.run_arguments(reader, "b_1") == (None, "{}")
    assert reads.run_arguments(reader, "nope") is None
    assert reads.all_run_arguments(reader) == [(None, "{}")] * 3
    version = reads.code_version(reader, "b_1")
    assert version is not None and version.code_commit == "c1"
    assert version == ("g", "c1", 0, "t1", "train.py", None)
    assert reads.code_version(reader, "nope") is None
    assert reads.checkpoint_positions(reader, "b_1") == []
    assert reads.checkpoints_written(reader, "b_1") == []
    assert reads.oldest_running_run(reader) in (("b_1", 20.0), ("b_10", 20.0))
    assert reads.runs_without_code_copy(reader) == ["b_1"]
    store.set_code_manifest("b_1", "manifest")
    assert reads.runs_without_code_copy(reader) == []


def test_the_typed_reads_of_a_runs_records_answer_alike(store: MetadataStore) -> None:
    store.register_run(run_row("run-0", 1.0))
    store.register_run(run_row("run-1", 2.0, filename="other.py"))
    batch = RecordBatch(
        loop_starts=[(0, None, "epoch", 0, None, 0, 1.0), (1, 0, "step", 3, None, 1, 1.5)],
        logs=[(1, "loss", 0.25, "float"), (0, "acc", 1, "int"), (None, "note", "x", "str")],
        checkpoints=[
            (None, "epoch", "end", "m-end", 30, 0.5, 0.25, 4.0, None, None),
            (0, "epoch", "block", "m-0", 20, 0.5, 0.25, 3.0, None, None),
        ],
    )
    sink = store.record_sink()()
    try:
        sink.write("run-0", batch)
    finally:
        sink.close()
    reader = store.reader()
    assert reads.loop_contexts(reader, "run-0") == [(0, None, "epoch", 0), (1, 0, "step", 3)]
    assert reads.loop_contexts(reader, "run-1") == []
    assert reads.run_has_name(reader, "run-0", "loss")
    assert reads.name_logged(reader, "note") and not reads.name_logged(reader, "nope")
    assert not reads.run_has_name(reader, "run-1", "loss")
    assert reads.run_names(reader, "run-0") == ["acc", "loss", "note"]
    assert reads.recorded_names(reader, "run-0") == {"acc", "loss", "note"}
    assert reads.run_definitions(reader, "run-0") == {}
    assert reads.runs_of_script(reader, "other.py") == ["run-1"]
    assert reads.summarised_number_names(reader) == ["acc", "loss"]
    # Context order, the end checkpoint last; and the order they were written.
    assert reads.checkpoint_positions(reader, "run-0") == [
        (0, "block", 0, "epoch", "m-0"), (None, "end", None, "epoch", "m-end"),
    ]  # fmt: skip
    written = reads.checkpoints_written(reader, "run-0")
    assert [(c.kind, c.loop, c.iteration, c.nbytes) for c in written] == [
        ("end", "epoch", None, 30), ("block", "epoch", 0, 20),
    ]  # fmt: skip


def test_a_write_transaction_commits_or_rolls_back_on_either_reader(
    store: MetadataStore,
) -> None:
    store.register_run(run_row("run-0", 1.0))
    reader = store.reader()
    with write_transaction(reader):
        reader.execute("UPDATE runs SET status = 'ended' WHERE run_id = ?", ("run-0",))
    assert status(store, "run-0") == "ended"
    with pytest.raises(RuntimeError), write_transaction(reader):
        reader.execute("UPDATE runs SET status = 'crashed' WHERE run_id = ?", ("run-0",))
        raise RuntimeError("stop")
    assert status(store, "run-0") == "ended"
    with pytest.raises(database_errors(reader)) as missing:
        reader.execute("SELECT no_such_column FROM runs")
    # The dialect reads the column's name out of the database's own complaint.
    assert store.dialect.missing_column(missing.value) == "no_such_column"
    assert store.dialect.missing_column(ValueError("no such column: x")) is None
    # Only the embedded store is a file a cache can be keyed by.
    found = store_file(reader)
    assert (found is not None) == store.dialect.embedded
    if found is not None:
        assert Path(found).name == "retrolog.db"


def test_the_registry_opens_each_backend_by_its_urls_scheme(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from retrolog.store import postgres_metadata, sqlite_metadata

    assert backend(None) is sqlite_metadata.open_backend
    for url in ("postgresql://u@h/db", "postgres://u@h/db", "POSTGRESQL://u@h/db"):
        assert backend(url) is postgres_metadata.open_backend
    assert set(BACKENDS) == {"", "postgresql", "postgres"}
    for url in ("mysql://team:hunter2@db/runs", "runs.db"):
        monkeypatch.setenv("RETROLOG_DATABASE_URL", url)
        with pytest.raises(UsageError) as refused:
            open_metadata(ProjectPaths(Path("/nonexistent"), Path("/nonexistent/s"), False))
        said = str(refused.value)
        assert "postgresql://" in said and "unset" in said.lower()
        assert "hunter2" not in said


def test_import_retrolog_loads_no_backend() -> None:
    code = (
        "import sys, retrolog, retrolog.store.metastore\n"
        "print(sorted(m for m in sys.modules if m.startswith(('psycopg', 'retrolog.store.'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = done.stdout
    assert "psycopg" not in loaded and "postgres_metadata" not in loaded, loaded
    assert "sqlite_metadata" not in loaded, loaded


# -- through the command line, as a user reads each backend ---------------------------------

SCRIPT = """\
import argparse
import retrolog as rl

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()
for epoch in rl.loop("epoch", range(3)):
    for step in rl.loop("step", range(50)):
        rl.log("loss", args.lr / (step + 1) + epoch)
    rl.log("acc", 0.5 + epoch / 10)
"""


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def recorded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Project, dict[str, str], str]]:
    """A project with two runs of SCRIPT in the backend under test; yields it, the
    environment a reader uses (on PostgreSQL a role with SELECT on retrolog's tables
    alone, as docs/store.md tells a team to set up) and the backend's name."""
    project = Project(tmp_path_factory.mktemp("contract"))
    project.git("init", "--quiet", "--initial-branch=main")
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "script")
    if request.param == "sqlite":
        for lr in ("0.1", "0.2"):
            project.run("train.py", "--lr", lr)
        yield project, {}, request.param
        return
    with private_schema() as (admin, owner):
        for lr in ("0.1", "0.2"):
            project.run("train.py", "--lr", lr, RETROLOG_DATABASE_URL=owner)
        with pg_role(admin, owner, "SELECT") as reader:
            yield project, {"RETROLOG_DATABASE_URL": reader}, request.param


@contextlib.contextmanager
def private_schema() -> Iterator[tuple[str, str]]:
    """The test server's URL and a URL whose tables go into a schema of its own (conftest's
    ``pg_store_url``, for a module's fixture); the schema is dropped afterwards."""
    import urllib.parse
    import uuid

    import psycopg

    admin = service_setting("RETROLOG_TEST_DATABASE_URL")
    if not admin:
        pytest.fail(DATABASE_HINT, pytrace=False)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    parts = urllib.parse.urlsplit(admin)
    options = urllib.parse.quote(f"-c search_path={schema}")
    try:
        yield admin, urllib.parse.urlunsplit(parts._replace(query=f"options={options}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def query(project: Project, env: dict[str, str], sql: str) -> tuple[int, str, str]:
    done = project.cli("query", sql, "--json", **env)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.slow
def test_query_reads_the_store_exactly(recorded: tuple[Project, dict[str, str], str]) -> None:
    project, env, name = recorded
    number = (SQLITE if name == "sqlite" else POSTGRESQL).number("l")
    code, out, err = query(
        project,
        env,
        f"SELECT r.parsed_args, {number} AS value FROM logs l JOIN runs r USING (run_id)"
        " WHERE l.name = 'loss' ORDER BY r.started_at, l.log_id",
    )
    assert code == 0, err
    expected = [
        (lr, lr / (step + 1) + epoch)
        for lr in (0.1, 0.2)
        for epoch in range(3)
        for step in range(50)
    ]
    got = [(json.loads(r["parsed_args"])["lr"], r["value"]) for r in json.loads(out)]
    assert got == expected  # bit for bit, through JSON's shortest round-trip repr
    code, out, err = query(
        project,
        env,
        f"SELECT name, COUNT(*) AS n, SUM({number}) AS total FROM logs l"
        " WHERE name IN ('loss', 'acc') GROUP BY name ORDER BY name",
    )
    assert code == 0, err
    totals = {r["name"]: (r["n"], r["total"]) for r in json.loads(out)}
    assert totals["acc"] == (6, pytest.approx(2 * sum(0.5 + e / 10 for e in range(3))))
    assert totals["loss"][0] == 300


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sql", "said"),
    [
        ("DELETE FROM logs", "read-only"),
        ("UPDATE runs SET status = 'x'", "read-only"),
        ("CREATE TABLE mine(a int)", "read-only"),
        ("SELEC 1", "cannot be run"),
    ],
)
def test_query_refuses_what_is_not_one_read_and_changes_nothing(
    recorded: tuple[Project, dict[str, str], str], sql: str, said: str
) -> None:
    project, env, _ = recorded
    count = "SELECT COUNT(*) AS n FROM logs"
    before = query(project, env, count)
    code, _, err = query(project, env, sql)
    assert code != 0 and "Traceback" not in err
    assert said in " ".join(err.split()), err  # the message is wrapped to the terminal
    assert query(project, env, count) == before
