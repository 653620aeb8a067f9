"""``dataframe`` and its ``where`` on a PostgreSQL store: the same view as SQLite's.

The same scripts, with the same arguments, record into the embedded store and into a
schema of the test server; every view asked of both must be equal, dtypes included
(run ids and timestamps aside, which differ between two recordings). The predicates
run as a role with SELECT on retrolog's tables only, as docs/store.md tells a team to
set up.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pandas as pd
import pytest

import retrolog
from retrolog.errors import QueryError

from conftest import DATABASE_HINT, Project, pg_role, read_pg, service_setting

pytestmark = [pytest.mark.slow, pytest.mark.services]

# Shaped like a real script (argparse, its loops in a function), logging every kind of
# value the view types: floats, ints beyond 2**53, bools, strings, JSON, NaN, a name of
# two types, a name logged twice in one context, a name logged in loops and outside them.
TRAIN = """\
import argparse

import retrolog as rl


def train(args):
    for epoch in rl.loop("epoch", range(args.epochs)):
        for step in rl.loop("step", range(4)):
            rl.log("loss", args.lr / (step + 1) + epoch / 3)
        rl.log("acc", 0.5 + epoch / 10 + args.lr)
        rl.log("flag", epoch % 2 == 0)
        rl.log("mixed", epoch if epoch else "zero")
        rl.log("big", 2**60 + epoch)
        rl.log("nan", float("nan") if epoch == 1 else epoch / 7)
        rl.log("cfg", {"epoch": epoch, "lr": args.lr})
        rl.log("Acc", epoch / 9)
        rl.log("Top5", epoch)
        rl.log("dup", epoch)
        rl.log("dup", epoch + 0.5)
        rl.log("score", epoch * 2)
    rl.log("score", -1)
    rl.log("final", 0.0)  # superseded: the newest record of a run-level name counts
    rl.log("final", 0.9 - args.lr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--opt", default="sgd")
    parser.add_argument("--epochs", type=int, default=3)
    train(parser.parse_args())
"""

# A script with run-level values only: its runs get one row each.
EVALUATE = """\
import retrolog as rl

rl.log("final", 0.5)
rl.log("opt", "none")
"""

RUNS = (
    ("train.py", "--lr", "0.1", "--opt", "adam"),
    ("train.py", "--lr", "0.2", "--opt", "sgd", "--epochs", "4"),
    ("evaluate.py",),
    ("train.py", "--lr", "0.05", "--opt", "adam", "--epochs", "2"),
)

# (names, where): each asked of both stores.
VIEWS = (
    (["loss", "acc", "lr", "opt", "final"], None),
    (["acc", "flag", "mixed", "big", "nan", "cfg"], None),
    (["final", "opt"], None),
    (["dup", "score"], None),
    (["loss"], "lr > 0.07 AND step = 2"),
    (["flag"], "acc > 0.75"),  # a logged name the view does not show
    (["acc", "big"], "flag = true"),
    (["acc"], "flag"),
    (["acc", "final"], "opt = 'adam' AND final > 0.7"),
    (["acc"], "mixed = 'zero'"),
    (["acc"], "nan IS NULL"),
    (["acc"], "big > 1152921504606846976"),
    (["score"], "score < 0 OR epoch = 3"),
    (["final"], "filename = 'evaluate.py'"),
    (["flag"], '"Acc" > 0.1'),  # SQLite ignores case in names: "Acc" would be acc if shown
    (["loss", "acc"], "epoch = 1 AND step IS NULL"),
    (["w_norm", "acc", "grad"], None),  # backfilled values, one marked inexact
    (["w_norm", "final"], "grad = 7 AND epoch > 0"),
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Project, str, str]]:
    """One project whose runs are recorded twice, into its embedded store and into a
    PostgreSQL schema; yields it, the schema's owner URL and a SELECT-only role's."""
    import urllib.parse
    import uuid

    import psycopg

    admin_url = service_setting("RETROLOG_TEST_DATABASE_URL")
    if not admin_url:
        pytest.fail(DATABASE_HINT, pytrace=False)
    project = Project(tmp_path_factory.mktemp("dataframe_pg"))
    project.git("init", "--quiet", "--initial-branch=main")
    project.write("train.py", TRAIN)
    project.write("evaluate.py", EVALUATE)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "scripts")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    parts = urllib.parse.urlsplit(admin_url)
    options = urllib.parse.quote(f"-c search_path={schema}")
    owner = urllib.parse.urlunsplit(parts._replace(query=f"options={options}"))
    try:
        for args in RUNS:
            project.run(*args)
            project.run(*args, RETROLOG_DATABASE_URL=owner)
        _backfill(project, owner)
        with pg_role(admin_url, owner, "SELECT") as reader:
            yield project, owner, reader
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


def _backfill(project: Project, owner: str) -> None:
    """What a replay would leave in both stores: a new per-epoch name (one value marked
    inexact) and a new run-level one, backfilled, written with SQL as replay writes it."""
    import sqlite3

    select = "SELECT run_id, ctx_id, 'w_norm', iteration * 1.5, 'float', 'backfilled', 'r1',"
    inexact = " CASE WHEN iteration = 1 THEN 'numerics differ' END FROM loops WHERE name = 'epoch'"
    run_level = (
        "SELECT run_id, NULL, 'grad', 7, 'int', 'backfilled', 'r1', NULL FROM runs"
        " WHERE filename = 'train.py'"
    )
    with sqlite3.connect(project.root / ".retrolog" / "retrolog.db") as conn:
        for rows in (select + inexact, run_level):
            conn.execute(
                "INSERT INTO logs(run_id, ctx_id, name, value, value_type, origin, replay_id,"
                f" inexact) {rows}"
            )
    import psycopg

    with psycopg.connect(owner, autocommit=True) as conn:
        for column, rows in (("value_float", select + inexact), ("value_int", run_level)):
            conn.execute(
                f"INSERT INTO logs(run_id, ctx_id, name, {column}, value_type, origin,"
                f" replay_id, inexact) {rows}"
            )


def _view(
    monkeypatch: pytest.MonkeyPatch, project: Project, url: str | None, *args: object, **kw: object
) -> pd.DataFrame:
    with monkeypatch.context() as env:
        if url is None:
            env.delenv("RETROLOG_DATABASE_URL", raising=False)
        else:
            env.setenv("RETROLOG_DATABASE_URL", url)
        return retrolog.Project(project.root).dataframe(*args, **kw)  # type: ignore[arg-type]


def _comparable(frame: pd.DataFrame) -> pd.DataFrame:
    """The view without what differs between two recordings of the same runs: the run
    ids (numbered in their order instead) and timestamps."""
    frame = frame.copy()
    order = {run: i for i, run in enumerate(dict.fromkeys(frame["run_id"]))}
    frame["run_id"] = frame["run_id"].map(order)
    return frame.drop(columns=["tstamp"])


@pytest.mark.parametrize(("names", "where"), VIEWS, ids=[w or ",".join(n) for n, w in VIEWS])
def test_the_view_is_the_same_on_postgresql(
    stores: tuple[Project, str, str],
    monkeypatch: pytest.MonkeyPatch,
    names: list[str],
    where: str | None,
) -> None:
    project, _, reader = stores
    sqlite = _view(monkeypatch, project, None, *names, where=where)
    pg = _view(monkeypatch, project, reader, *names, where=where)
    assert len(sqlite) > 0, "a view with no rows would compare nothing"
    pd.testing.assert_frame_equal(_comparable(pg), _comparable(sqlite))


def test_values_keep_their_types_and_bits(
    stores: tuple[Project, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the parity test cannot see if both were wrong alike: the values themselves."""
    project, _, reader = stores
    frame = _view(monkeypatch, project, reader, "loss", "big", "flag", "cfg", "nan", "mixed")
    first = frame[frame["run_id"] == frame["run_id"].iloc[0]]
    assert list(first["loss"].dropna())[:4] == [0.1 / (s + 1) for s in range(4)]  # bit for bit
    by_epoch = first.dropna(subset=["big"]).set_index("epoch")
    assert str(frame["big"].dtype) == "Int64" and by_epoch["big"].tolist() == [2**60, 2**60 + 1,
        2**60 + 2]  # fmt: skip
    assert str(frame["flag"].dtype) == "boolean" and by_epoch["flag"].tolist() == [True, False,
        True]  # fmt: skip
    assert by_epoch["cfg"].tolist()[1] == {"epoch": 1, "lr": 0.1}
    assert math.isnan(by_epoch["nan"].tolist()[1]) and by_epoch["nan"].tolist()[2] == 2 / 7
    assert by_epoch["mixed"].tolist() == ["zero", 1, 2]
    backfilled = _view(monkeypatch, project, reader, "w_norm", "grad")
    marked = backfilled[backfilled["inexact"].notna()]
    assert set(marked["epoch"]) == {1} and set(marked["inexact"]) == {"w_norm"}
    assert set(backfilled["grad"].dropna()) == {7} and str(backfilled["grad"].dtype) == "Int64"
    finals = _view(monkeypatch, project, reader, "final").groupby("run_id", sort=False)
    assert [group["final"].tolist() for _, group in finals] == [[0.9 - 0.1], [0.9 - 0.2], [0.5],
        [0.9 - 0.05]]  # fmt: skip


def test_definitions_column_is_the_same_on_postgresql(
    stores: tuple[Project, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project, _, reader = stores
    frames = [
        _view(monkeypatch, project, url, "loss", "final", definitions="column")
        for url in (None, reader)
    ]
    sqlite, pg = (_comparable(f) for f in frames)
    pd.testing.assert_frame_equal(pg, sqlite)
    assert pg["loss:definition"].notna().any()


def test_the_cli_prints_the_postgresql_view(stores: tuple[Project, str, str]) -> None:
    project, _, reader = stores
    done = project.cli(
        "dataframe", "loss,acc", "--where", "lr < 0.15 AND epoch = 1", "--json",
        RETROLOG_DATABASE_URL=reader,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {r["step"] for r in rows if r["step"] is not None} == {0, 1, 2, 3}
    assert {r["epoch"] for r in rows} == {1} and len({r["run_id"] for r in rows}) == 2
    assert [r["loss"] for r in rows if r["step"] == 3] == [0.1 / 4 + 1 / 3, 0.05 / 4 + 1 / 3]


def test_a_predicate_postgresql_cannot_apply_says_why_and_what_to_write(
    stores: tuple[Project, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project, _, reader = stores
    with pytest.raises(QueryError) as unknown:
        _view(monkeypatch, project, reader, "acc", where="nope > 1")
    said = str(unknown.value)
    assert 'PostgreSQL says \'column "nope" does not exist' in said and "acc" in said
    # An unquoted name is read in lower case: "Acc" is not acc, and Top5 is no name.
    lower = _view(monkeypatch, project, reader, "Acc", where="Acc > 0.75")
    assert len(lower) > 0 and (lower["Acc"] < 0.75).all()  # Acc is at most 3/9
    with pytest.raises(QueryError) as folded:
        _view(monkeypatch, project, reader, "acc", where="Top5 > 1")
    assert "double-quote a name with capitals" in str(folded.value)
    quoted = _view(monkeypatch, project, reader, "acc", where='"Top5" > 1')
    assert set(quoted["epoch"]) == {2, 3}
    with pytest.raises(QueryError) as mistyped:  # a bool is boolean on PostgreSQL
        _view(monkeypatch, project, reader, "acc", where="flag = 1")
    assert "boolean = integer" in str(mistyped.value)


def test_a_predicate_cannot_write_or_run_as_a_superuser(
    stores: tuple[Project, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    project, owner, reader = stores
    before = read_pg(owner, "SELECT count(*) FROM runs")
    for where in (
        "true); DROP TABLE runs; SELECT (1",
        "true) OR (SELECT count(*) FROM runs) > 0; DELETE FROM logs; SELECT (1",
    ):
        with pytest.raises(QueryError):
            _view(monkeypatch, project, owner, "acc", where=where)
        with pytest.raises(QueryError):
            _view(monkeypatch, project, reader, "acc", where=where)
    assert read_pg(owner, "SELECT count(*) FROM runs") == before
    # The owner of the test schema is the server's superuser: its predicates could
    # read the server's files (pg_read_file), so they are refused; the view without
    # one holds no SQL a user wrote, and any role may have it.
    with pytest.raises(QueryError) as privileged:
        _view(monkeypatch, project, owner, "acc", where="acc > 0")
    assert "SELECT on retrolog's tables only" in str(privileged.value)
    assert "***" in str(privileged.value)  # the URL's password masked
    assert len(_view(monkeypatch, project, owner, "acc")) > 0
