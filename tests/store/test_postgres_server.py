"""The PostgreSQL server scripts/services.sh starts for the team-backend tests.

What the tests of a PostgreSQL metadata store will stand on: the server the project's
own script installs and starts is reachable at the URL it writes, listens on loopback
only, and takes a connection only with the password (scram-sha-256), as a team's
server would.
"""

from __future__ import annotations

import stat
import urllib.parse
from pathlib import Path

import psycopg
import pytest

from conftest import SERVICES_ENV


def test_the_server_answers_at_its_url_on_loopback_only(database_url: str) -> None:
    parts = urllib.parse.urlsplit(database_url)
    assert parts.scheme == "postgresql" and parts.hostname == "127.0.0.1"
    with psycopg.connect(database_url, connect_timeout=10) as conn:
        (listen,) = conn.execute("SHOW listen_addresses").fetchone()
        (version,) = conn.execute("SHOW server_version_num").fetchone()
        (database, user) = conn.execute("SELECT current_database(), current_user").fetchone()
    assert listen == "127.0.0.1"
    assert int(version) >= 130000
    assert (database, user) == ("retrolog", "retrolog")


def test_a_wrong_password_is_refused(database_url: str) -> None:
    parts = urllib.parse.urlsplit(database_url)
    wrong = parts._replace(netloc=f"retrolog:not-the-password@{parts.hostname}:{parts.port}")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(urllib.parse.urlunsplit(wrong), connect_timeout=10)


def test_the_file_holding_the_password_is_the_owners_alone(database_url: str) -> None:
    if not Path(SERVICES_ENV).exists():
        pytest.skip("the URL came from RETROLOG_TEST_DATABASE_URL, not .services/env")
    mode = stat.S_IMODE(Path(SERVICES_ENV).stat().st_mode)
    assert mode & 0o077 == 0, oct(mode)
