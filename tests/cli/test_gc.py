"""``retrolog gc``, run as a user runs it: a subprocess in a project."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from retrolog.cli import cli
from training_scripts import NUMPY_TRAIN

from conftest import Project, RecordedOnce, read_db


def _record(project: Project) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py", "--kwargs", "seed=1")
    project.run("train.py", "--kwargs", "seed=2")


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory) -> RecordedOnce:
    return RecordedOnce.record(tmp_path_factory, _record)


@pytest.fixture
def recorded(recorded_once: RecordedOnce) -> Project:
    """The project after two runs, as each test's own."""
    return recorded_once.fresh()


def runs(project: Project) -> list[str]:
    return [r for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]


def checkpoint_count(project: Project) -> int:
    return len(read_db(project.root, "SELECT checkpoint_id FROM checkpoints"))


def store_bytes(project: Project) -> int:
    root = project.root / ".retrolog" / "objects"
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_help_has_an_example() -> None:
    result = CliRunner().invoke(cli, ["gc", "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output and "retrolog gc --keep last:2 --dry-run" in result.output
    assert "best:NAME[:max|min]" in result.output


def test_dry_run_prints_the_plan_and_deletes_nothing(recorded: Project) -> None:
    before = (checkpoint_count(recorded), store_bytes(recorded))
    out = recorded.cli("gc", "--keep", "last:1", "--grace", "0", "--dry-run")
    assert out.returncode == 0, out.stderr
    first, second = runs(recorded)
    assert f"{first}  finished  3, end  0-2" in out.stdout
    assert f"{second}  finished  3, end  0-2" in out.stdout
    assert "would delete 6 checkpoint(s)" in out.stdout
    assert (checkpoint_count(recorded), store_bytes(recorded)) == before
    dry = recorded.cli("gc", "--keep", "last:1", "--grace", "0", "--dry-run", "--json")
    data = json.loads(dry.stdout)
    assert data["checkpoints"] == 6 and not data["done"] and data["bytes_freed"] > 0


def test_yes_deletes_and_reports_what_it_freed(recorded: Project) -> None:
    before = store_bytes(recorded)
    out = recorded.cli("gc", "--keep", "last:1", "--grace", "0", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["done"] and report["checkpoints"] == 6
    assert report["bytes_freed"] == before - store_bytes(recorded) > 0
    assert checkpoint_count(recorded) == 4
    again = recorded.cli("gc", "--keep", "last:1", "--grace", "0", "--yes")
    assert again.returncode == 0 and "Nothing to collect" in again.stderr


def test_objects_written_within_the_grace_period_are_kept(recorded: Project) -> None:
    before = store_bytes(recorded)
    out = recorded.cli("gc", "--keep", "last:0", "--yes")  # default grace: 1h
    assert out.returncode == 0, out.stderr
    assert "deleted 8 checkpoint(s) and 0 of" in out.stdout
    assert "objects written in the last 1h are kept" in out.stdout
    assert store_bytes(recorded) == before


def test_without_yes_on_a_pipe_it_shows_the_plan_and_refuses(recorded: Project) -> None:
    out = recorded.cli("gc", "--keep", "last:0", "--grace", "0")
    assert out.returncode == 2 and "--yes" in out.stderr and "Traceback" not in out.stderr
    assert "would delete 8 checkpoint(s)" in out.stdout
    assert checkpoint_count(recorded) == 10


@pytest.mark.parametrize(("answer", "left"), [("n", 10), ("y", 2)])
def test_on_a_terminal_it_asks(recorded: Project, answer: str, left: int) -> None:
    leader, follower = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "retrolog", "gc", "--keep", "last:0", "--grace", "0"],
            cwd=recorded.root,
            env=recorded.env(),
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.write(leader, f"{answer}\n".encode())
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 0, err
    assert "Delete these?" in err
    assert checkpoint_count(recorded) == left
    if answer == "n":
        assert "Nothing deleted" in err
    else:
        assert "deleted 8 checkpoint(s)" in out


def test_run_filter_by_prefix_and_predicate(recorded: Project) -> None:
    first, second = runs(recorded)
    out = recorded.cli("gc", second[:-1], "--keep", "last:0", "--grace", "0", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert [r["run_id"] for r in json.loads(out.stdout)["runs"]] == [second]
    out = recorded.cli("gc", "--where", "seed = 1", "--keep", "last:2", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert [(r["run_id"], r["dropped"]) for r in json.loads(out.stdout)["runs"]] == [
        (first, [0, 1])
    ]
    none = recorded.cli("gc", "--where", "seed = 7", "--keep", "last:0", "--yes")
    assert none.returncode == 0 and "No run matches 'seed = 7'" in none.stderr


def test_best_by_a_metric(recorded: Project) -> None:
    out = recorded.cli("gc", "--keep", "best:score:min", "--grace", "0", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert [r["kept"] for r in json.loads(out.stdout)["runs"]] == [[0, "end"], [0, "end"]]


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--keep", "newest"], "not a retention policy"),
        (["--keep", "last:x"], "last:N"),
        (["--grace", "soon"], "not a duration"),
    ],
)
def test_bad_options_are_usage_errors(recorded: Project, args: list[str], complaint: str) -> None:
    out = recorded.cli("gc", *args)
    assert out.returncode == 2 and complaint in out.stderr and "Traceback" not in out.stderr


def test_errors_are_one_paragraph(recorded: Project, tmp_path: Path) -> None:
    out = recorded.cli("gc", "--keep", "best:scroe", "--dry-run")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("Error: No run logged 'scroe'") and "'score'" in out.stderr
    out = recorded.cli("gc", "nope", "--dry-run")
    assert out.returncode == 1 and "No run has the id 'nope'" in out.stderr
    empty = Project(tmp_path / "empty")
    empty.root.mkdir()
    out = empty.cli("gc", "--dry-run")
    assert out.returncode == 1 and "There is no retrolog store" in out.stderr
