"""``retrolog query`` on a PostgreSQL store: what only PostgreSQL can be asked (a write
inside a WITH, several statements, the server's files and sequences), and its roles.
What every backend answers alike is in tests/store/test_metadata_contract.py, and the
budgets every backend keeps in tests/query/test_query_limits.py.

The runs are recorded by real scripts into a schema of the test server; the queries
run as a role with SELECT on retrolog's tables only, as docs/store.md tells a team
to set up, and as the server's superuser, which query refuses.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator

import pytest

from conftest import Project, database_url, pg_role, read_pg  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow

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


@pytest.fixture
def recorded(project: Project, pg_store_url: str) -> Project:
    project.write("train.py", SCRIPT)
    for lr in ("0.1", "0.2"):
        project.run("train.py", "--lr", lr, RETROLOG_DATABASE_URL=pg_store_url)
    return project


@pytest.fixture
def reader_url(pg_store_url: str, database_url: str) -> Iterator[str]:  # noqa: F811
    """``pg_store_url`` as a login role with SELECT on the schema's tables, nothing else."""
    with pg_role(database_url, pg_store_url, "SELECT") as url:
        yield url


def _query(project: Project, url: str, sql: str, **env: str) -> tuple[int, str, str]:
    done = project.cli("query", sql, "--json", RETROLOG_DATABASE_URL=url, **env)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize(
    ("sql", "said"),
    [
        ("WITH d AS (DELETE FROM logs RETURNING 1) SELECT * FROM d", "read-only"),
        ("SELECT 1; DELETE FROM logs", "cannot be run"),
        ("SELECT pg_read_file('/etc/hostname')", "cannot be run"),
        ("SELECT nextval('logs_log_id_seq')", "permission denied"),
    ],
)
def test_query_on_postgresql_refuses_what_is_not_one_read(
    recorded: Project, reader_url: str, pg_store_url: str, sql: str, said: str
) -> None:
    before = read_pg(pg_store_url, "SELECT COUNT(*) FROM logs")
    code, _, err = _query(recorded, reader_url, sql)
    assert code != 0 and "Traceback" not in err
    assert said in " ".join(err.split()), err  # the message is wrapped to the terminal
    assert read_pg(pg_store_url, "SELECT COUNT(*) FROM logs") == before
    assert read_pg(pg_store_url, "SELECT to_regclass('mine') IS NULL") == [(True,)]


def test_query_refuses_a_role_that_can_read_the_servers_files(
    recorded: Project, pg_store_url: str
) -> None:
    code, _, err = _query(recorded, pg_store_url, "SELECT COUNT(*) FROM runs")
    assert code != 0 and "Traceback" not in err
    said = " ".join(err.split())
    assert "superuser" in said and "SELECT on retrolog's tables" in said, err
    password = urllib.parse.urlsplit(pg_store_url).password
    assert password and password not in err
