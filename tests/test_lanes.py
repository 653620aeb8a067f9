"""The fast lane's markers (docs/testing.md): tests/conftest.py keeps them true.

A probe suite beside a copy of tests/conftest.py, run by pytest under the project's own
settings with the fast lane's selection, as `bash scripts/test.sh --fast` runs it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import Project, RecordedOnce

TESTS = Path(__file__).resolve().parent
FAST = "not slow and not services and not browser"

PROBE = """
    import pytest

    from conftest import service_setting


    @pytest.fixture
    def browser():
        return None


    def test_plain():
        pass


    def test_takes_a_server_fixture(database_url):
        pass


    def test_takes_one_built_on_a_server_fixture(pg_store_url):
        pass


    def test_takes_the_browser(browser):
        pass


    def test_reads_a_server_setting_unmarked():
        service_setting("RETROLOG_TEST_DATABASE_URL")


    def test_starts_a_private_server_unmarked():
        from private_postgres import PrivateServer

        PrivateServer()


    @pytest.mark.services
    def test_reads_a_server_setting_marked():
        service_setting("RETROLOG_TEST_DATABASE_URL")
"""


def test_the_fast_lane_leaves_out_what_needs_a_server_and_fails_what_reaches_one_unmarked(
    tmp_path: Path,
) -> None:
    for name in ("conftest.py", "private_postgres.py"):
        shutil.copy(TESTS / name, tmp_path / name)
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    settings = ["-c", str(TESTS.parent / "pyproject.toml"), "--rootdir", str(tmp_path)]
    plugins = ["-p", "no:cacheprovider", "-p", "no:xdist"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *settings, *plugins, "-rA", "-m", FAST, "test_probe.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert "PASSED test_probe.py::test_plain" in out, out
    for name in ("reads_a_server_setting_unmarked", "starts_a_private_server_unmarked"):
        assert f"FAILED test_probe.py::test_{name}" in out, out
    # Each failure says what to do once in its own section. The short summary may repeat
    # the message or cut it to the terminal's width (pytest never cuts it when CI is set),
    # so only the failures' sections are counted.
    failures = out.split(" FAILURES ", 1)[-1].split(" short test summary info ", 1)[0]
    assert failures.count("it is not marked `services`") == 2, out
    # The server's and the browser's fixtures mark their tests, which -m then leaves out.
    assert "2 failed, 1 passed, 4 deselected" in out, out


def _record(project: Project) -> None:
    project.write("notes.txt", "recorded\n")
    project.git("add", "notes.txt")
    project.git("commit", "--quiet", "-m", "recorded")


def test_a_project_recorded_once_is_given_back_as_recorded_at_the_same_path(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    once = RecordedOnce.record(tmp_path_factory, _record)
    first = once.fresh()
    head = first.git("rev-parse", "HEAD")
    first.write("notes.txt", "changed by a test\n")
    first.write("new.txt", "made by a test\n")
    first.git("commit", "--quiet", "-am", "a test's commit")
    second = once.fresh()
    assert second.root == first.root
    assert (second.root / "notes.txt").read_text() == "recorded\n"
    assert not (second.root / "new.txt").exists()
    assert second.git("rev-parse", "HEAD") == head
    assert second.git("status", "--porcelain") == ""
