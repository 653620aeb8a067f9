"""Fuzzing ``query`` and ``where``: any text gets rows or a QueryError, in bounded time,
and the store is never changed.

Hypothesis builds statements and predicates from SQL's pieces (keywords that read
and that write, the store's tables and columns, functions that allocate, literals
at the edges of SQLite's types, comments, quotes and stray bytes) and from raw
text. Each goes through the same functions the CLI and ``rl.query`` /
``rl.dataframe`` use, on a real store with recorded runs, under a 2 s time
budget (pinned here so that a statement that runs too long shows quickly).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from retrolog.errors import RetrologError
from retrolog.store.paths import locate
from retrolog.store.sqlite_metadata import open_store

from conftest import Project

pytestmark = pytest.mark.slow

BUDGET_SECONDS = 2.0

SCRIPT = """\
import argparse
import retrolog as rl

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
args = parser.parse_args()
for epoch in rl.loop("epoch", range(3)):
    for step in rl.loop("step", range(4)):
        rl.log("loss", 1.0 / (1 + epoch * 4 + step) * args.lr)
    rl.log("val/acc", epoch * 0.1)
    rl.log("note", "it's \\"quoted\\"")
"""

PIECES = [
    # reading
    "SELECT",
    "*",
    "FROM",
    "WHERE",
    "GROUP BY",
    "ORDER BY",
    "LIMIT",
    "UNION ALL",
    "JOIN",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c)",
    "SELECT x FROM c",
    "EXISTS",
    "IN",
    "AND",
    "OR",
    "NOT",
    "LIKE",
    "GLOB",
    "BETWEEN",
    "IS NULL",
    "CASE WHEN",
    "THEN",
    "ELSE",
    "END",
    "count(*)",
    "max(",
    "json_each(",
    "printf('%s',",
    "substr(",
    # writing and escaping the sandbox
    "INSERT INTO logs VALUES",
    "UPDATE runs SET status = 'x'",
    "DELETE FROM logs",
    "DROP TABLE runs",
    "CREATE TABLE t(x)",
    "CREATE TEMP VIEW v AS",
    "ATTACH DATABASE",
    "'fuzz.db' AS f",
    "DETACH",
    "PRAGMA writable_schema = 1",
    "PRAGMA journal_mode = DELETE",
    "VACUUM INTO 'copy.db'",
    "REINDEX",
    "ANALYZE",
    "load_extension('x')",
    "BEGIN",
    "COMMIT",
    "ROLLBACK",
    "SAVEPOINT s",
    "REPLACE INTO",
    "randomblob(100000000)",
    "zeroblob(2000000000)",
    "replace(hex(zeroblob(1000000)), '0', 'ab')",
    # the store's names
    "runs",
    "logs",
    "loops",
    "checkpoints",
    "sqlite_master",
    "run_id",
    "name",
    "value",
    "status",
    "loss",
    "epoch",
    "step",
    "lr",
    '"val/acc"',
    "note",
    "nonexistent",
    # literals, punctuation, comments
    "1",
    "-9223372036854775808",
    "9223372036854775808",
    "1e999",
    "0.5",
    "NULL",
    "'a''b'",
    "x'00ff'",
    "'\\x1b[2J'",
    "(",
    ")",
    ",",
    ";",
    "=",
    "<",
    "||",
    "/",
    "--",
    "/*",
    "*/",
    "'",
    '"',
    "`",
    "[",
    "]",
    "?",
    ":x",
    "$y",
    "@z",
    "\x00",
    "\ud800",
]

statements = st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map(" ".join)
raw_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("fuzzq") / "proj"
    root.mkdir()
    project = Project(root)
    project.git("init", "--quiet", "--initial-branch=main")
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    for lr in ("0.1", "0.5"):
        project.run("train.py", "--lr", lr)
    yield root


@pytest.fixture(scope="module")
def conn(store: Path) -> Iterator[object]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RETROLOG_QUERY_TIMEOUT", str(BUDGET_SECONDS))
        patch.chdir(store)  # a statement that made a file would make it here
        before = _fingerprint(store)
        connection = open_store(locate(store), create=False, write=False)
        yield connection
        connection.close()
        assert _fingerprint(store) == before, "a query changed the store or made a file"


def _fingerprint(root: Path) -> dict[str, str]:
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.endswith("-shm")]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _bounded(call: object) -> object:
    started = time.monotonic()
    try:
        return call()  # type: ignore[operator]
    except RetrologError as exc:
        assert str(exc).strip(), "an error with no message"
        return exc
    finally:
        assert time.monotonic() - started < BUDGET_SECONDS + 3.0


FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(sql=statements | raw_text)
@example(sql="WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c")
@example(sql="SELECT \ud800")
@example(sql="SELECT 1; DROP TABLE runs")
@example(sql="ATTACH DATABASE 'fuzz.db' AS f")
@example(sql="SELECT randomblob(900000000)")
def test_any_query_reads_or_says_why_not(conn: object, sql: str) -> None:
    from retrolog._query.sql import query

    result = _bounded(lambda: query(conn, sql))  # type: ignore[arg-type]
    assert isinstance(result, (pd.DataFrame, RetrologError))


@FUZZ
@given(where=statements | raw_text)
@example(where="lr > 0.2")
@example(where='"val/acc" >= 0.1 AND epoch = 2')
@example(where="1) UNION SELECT * FROM sqlite_master --")
@example(where='" \ud800 "')  # a quoted name UTF-8 cannot hold: once a traceback
@example(
    where="loss IN (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT x FROM c)"
)
def test_any_where_predicate_filters_or_says_why_not(conn: object, where: str) -> None:
    from retrolog._query.dataframe import dataframe

    result = _bounded(lambda: dataframe(conn, ["loss", "lr"], where))  # type: ignore[arg-type]
    assert isinstance(result, (pd.DataFrame, RetrologError))
    if where == "lr > 0.2":
        assert isinstance(result, pd.DataFrame) and set(result["lr"]) == {0.5}
