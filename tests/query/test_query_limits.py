"""A read-only query cannot run forever or take the machine's memory, and stops on Ctrl-C.

The probes are the ones a user (or a typo) produces: an unbounded recursive
CTE through ``retrolog query`` and through a ``--where`` predicate, a query
that builds a huge string inside SQLite, one that returns more rows than its
budget holds. Each stops with a clear one-paragraph error (no traceback) and
leaves the store as it was.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrolog._query.sql import query
from retrolog.errors import QueryError
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect

from conftest import Project, pg_role

FOREVER = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c"
HUGE_STRING = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 30000000)"
    " SELECT length(group_concat(x)) FROM c"
)
MANY_ROWS = (
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 200000)"
    " SELECT x, printf('%0100d', x) FROM c"
)


@pytest.fixture
def conn(tmp_path: Path) -> sqlite3.Connection:
    c = connect(tmp_path / "retrolog.db")
    migrate(c)
    return c


def _dump(c: sqlite3.Connection) -> list[object]:
    return list(c.iterdump())


def test_a_query_past_its_time_budget_stops(
    conn: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RETROLOG_QUERY_TIMEOUT", "0.5")
    before = _dump(conn)
    began = time.monotonic()
    with pytest.raises(QueryError, match=r"time budget of 0.5 s.*RETROLOG_QUERY_TIMEOUT"):
        query(conn, FOREVER)
    assert time.monotonic() - began < 5
    assert _dump(conn) == before
    assert query(conn, "SELECT 1 AS one")["one"].tolist() == [1]  # the connection still works


# The budget is on the process's resident memory growth. In a process that has freed
# memory before (a pytest worker after other tests, or the first probe here), the
# allocator reuses pages that are already resident, so each probe runs in a fresh
# interpreter, as a `retrolog query` command does.
MEMORY_PROBE = """
import sys
from collections.abc import Iterator
from pathlib import Path
from retrolog._query.sql import query
from retrolog.errors import QueryError
from retrolog.store.sqlite_connection import connect
from retrolog.store.schema import migrate

conn = connect(Path(sys.argv[1]))
migrate(conn)
try:
    rows = len(query(conn, sys.argv[2]))
except QueryError as exc:
    print("refused:", exc)
else:
    print("rows:", rows)
"""


def _probe(tmp_path: Path, sql: str, memory_mb: str) -> str:
    env = {**os.environ, "RETROLOG_QUERY_MEMORY_MB": memory_mb}
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "probe.db"), sql],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_query_past_its_memory_budget_stops(tmp_path: Path) -> None:
    huge = _probe(tmp_path, HUGE_STRING, "16")  # SQLite's own allocations
    assert re.search(r"refused:.*memory budget of 16 MB.*RETROLOG_QUERY_MEMORY_MB", huge), huge
    # The rows fetched into Python: 200k x (100 bytes + objects).
    assert re.search(r"refused:.*memory budget of 16 MB", _probe(tmp_path, MANY_ROWS, "16"))
    assert _probe(tmp_path, MANY_ROWS, "0").strip() == "rows: 200000"


def test_a_bad_budget_setting_is_a_clear_error(
    conn: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RETROLOG_QUERY_TIMEOUT", "soon")
    with pytest.raises(QueryError, match=r"RETROLOG_QUERY_TIMEOUT='soon' is not a number"):
        query(conn, "SELECT 1")


def _recorded(project: Project, **env: str) -> None:
    project.write(
        "train.py",
        "import retrolog as rl\nfor e in rl.loop('epoch', range(2)):\n    rl.log('acc', e / 2)\n",
    )
    project.run("train.py", **env)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def reader_env(request: pytest.FixtureRequest, project: Project) -> Iterator[dict[str, str]]:
    """A project with a run, in the backend under test; yields the environment its readers
    use: none for the embedded store, else ``database_url`` as a PostgreSQL role with
    SELECT on retrolog's tables only (as docs/store.md tells a team to set up; a
    superuser's SQL is refused)."""
    if request.param == "sqlite":
        _recorded(project)
        yield {}
        return
    owner = request.getfixturevalue("pg_store_url")
    _recorded(project, RETROLOG_DATABASE_URL=owner)
    with pg_role(request.getfixturevalue("database_url"), owner, "SELECT") as reader:
        yield {"RETROLOG_DATABASE_URL": reader}


# Per backend: SQL that sleeps on the server, a predicate choosing runs that never ends
# (PostgreSQL would compare run_id with the constant 'x' before running the subquery), and
# SQL whose rows outgrow 50 MB.
SLEEPS = {"sqlite": FOREVER, "postgresql": "SELECT pg_sleep(30)"}
CHOOSES = {
    "sqlite": f"run_id IN (SELECT 'x' FROM ({FOREVER}))",
    "postgresql": f"length(run_id) > ({FOREVER})",
}
GROWS = {
    "sqlite": HUGE_STRING,
    "postgresql": "SELECT repeat('x', 1000) FROM generate_series(1, 2000000)",
}


def test_the_cli_stops_an_endless_query_and_an_endless_predicate(
    project: Project, reader_env: dict[str, str]
) -> None:
    backend = "postgresql" if reader_env else "sqlite"
    before = sorted(p.name for p in (project.root / ".retrolog").iterdir())
    for args in (
        ("query", FOREVER),
        ("query", SLEEPS[backend]),
        ("dataframe", "acc", "--where", f"acc < ({FOREVER})"),
        ("replay", "acc", CHOOSES[backend], "--dry-run"),
    ):
        began = time.monotonic()
        out = project.cli(*args, RETROLOG_QUERY_TIMEOUT="1", **reader_env)
        assert out.returncode == 1, (args, out.stderr)
        assert "time budget of 1 s" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert time.monotonic() - began < 20
    out = project.cli("query", GROWS[backend], RETROLOG_QUERY_MEMORY_MB="50", **reader_env)
    assert out.returncode != 0 and "memory budget of 50 MB" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    after = project.root / ".retrolog"
    # A replay on PostgreSQL makes the working copies' directory; each copy is deleted.
    assert not any((after / "working").glob("*"))
    assert sorted(p.name for p in after.iterdir() if p.name != "working") == before


def test_ctrl_c_stops_a_running_query(project: Project) -> None:
    _recorded(project)
    with project.start_cli("query", FOREVER) as proc:
        time.sleep(2.0)  # started, and inside SQLite
        assert proc.poll() is None
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert time.monotonic() - began < 5
    assert proc.returncode == 130, err
    assert "Interrupted." in err and "Traceback" not in err
