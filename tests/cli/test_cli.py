"""The retrolog command, run as a user runs it (a subprocess in a project)."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest
from click.testing import CliRunner

from retrolog.cli import cli

from conftest import Project, RecordedOnce

SCRIPT = """
    import retrolog as rl
    lr = rl.arg("lr", 0.1)
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(2)):
            rl.log("loss", lr * (epoch + step))
        rl.log("acc", lr * epoch)
    rl.log("test_acc", lr)
"""


def _record(project: Project) -> None:
    project.write("train.py", SCRIPT)
    project.run("train.py", "--kwargs", "lr=0.5")
    project.run("train.py", "--kwargs", "lr=0.25")


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory) -> RecordedOnce:
    return RecordedOnce.record(tmp_path_factory, _record)


@pytest.fixture
def recorded(recorded_once: RecordedOnce) -> Project:
    """The project after two runs, as each test's own."""
    return recorded_once.fresh()


def test_runs_lists_each_run(recorded: Project) -> None:
    out = recorded.cli("runs")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].split() == ["run_id", "tstamp", "filename", "status", "duration", "args"]
    assert "lr=0.5" in lines[1] and "lr=0.25" in lines[2]
    assert all("train.py" in line and "finished" in line for line in lines[1:])
    records = json.loads(recorded.cli("runs", "--json").stdout)
    assert [r["args"] for r in records] == ["lr=0.5", "lr=0.25"]
    frame = pd.read_csv(io.StringIO(recorded.cli("runs", "--csv").stdout))
    assert list(frame["status"]) == ["finished", "finished"]
    assert len(json.loads(recorded.cli("runs", "--limit", "1", "--json").stdout)) == 1


def test_show_prints_one_run_by_prefix(recorded: Project) -> None:
    runs = json.loads(recorded.cli("runs", "--json").stdout)
    run_id = runs[0]["run_id"]
    out = recorded.cli("show", run_id[:-2])
    assert out.returncode == 0, out.stderr
    assert run_id in out.stdout and "lr=0.5" in out.stdout
    assert "loss (6, loop)" in out.stdout and "lr (1, run)" in out.stdout
    details = json.loads(recorded.cli("show", run_id, "--json").stdout)
    assert details["args"] == {"lr": 0.5}
    assert details["code_ref"] == f"refs/retrolog/runs/{run_id}"
    assert {lp["name"]: lp["iterations"] for lp in details["loops"]} == {"epoch": 3, "step": 6}


def test_show_unknown_run_is_a_one_paragraph_error(recorded: Project) -> None:
    out = recorded.cli("show", "nope")
    assert out.returncode == 1
    assert out.stderr.startswith("Error: No run has the id 'nope'")
    assert "Traceback" not in out.stderr


def test_dataframe_formats(recorded: Project) -> None:
    table = recorded.cli("dataframe", "lr", "acc")
    assert table.returncode == 0, table.stderr
    header = table.stdout.splitlines()[0].split()
    assert header == ["projid", "run_id", "tstamp", "filename", "epoch", "lr", "acc"]
    assert len(table.stdout.strip().splitlines()) == 7
    records = json.loads(recorded.cli("dataframe", "lr,acc", "--json").stdout)
    assert [(r["lr"], r["epoch"], r["acc"]) for r in records[:3]] == [
        (0.5, 0, 0.0),
        (0.5, 1, 0.5),
        (0.5, 2, 1.0),
    ]
    frame = pd.read_csv(io.StringIO(recorded.cli("dataframe", "acc", "--csv").stdout))
    assert frame["acc"].dtype == float and len(frame) == 6
    filtered = json.loads(recorded.cli("dataframe", "acc", "--where", "lr < 0.3", "--json").stdout)
    assert [r["acc"] for r in filtered] == [0.0, 0.25, 0.5]


def test_json_output_keeps_every_float_and_int_exact(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        for i in rl.loop("i", range(3)):
            rl.log("x", 1 / 30 + i)
            rl.log("n", 2**53 + 1 + i)
        rl.log("odd", float("inf"))
        """,
    )
    project.run("train.py")
    frame = json.loads(project.cli("dataframe", "x,n", "--json").stdout)
    assert [(r["x"], r["n"]) for r in frame] == [(1 / 30 + i, 2**53 + 1 + i) for i in range(3)]
    rows = json.loads(
        project.cli(
            "query", "SELECT value FROM logs WHERE name = 'x' ORDER BY log_id", "--json"
        ).stdout
    )
    assert [r["value"] for r in rows] == [1 / 30 + i for i in range(3)]
    odd = json.loads(project.cli("dataframe", "odd", "--json").stdout)
    assert [r["odd"] for r in odd] == [None]  # JSON has no infinity: null, as for NaN
    twice = project.cli("query", "SELECT 1 AS a, 2 AS a", "--json")
    assert twice.returncode != 0 and "Traceback" not in twice.stderr
    assert "more than one column named a" in twice.stderr


def test_dataframe_errors(recorded: Project) -> None:
    out = recorded.cli("dataframe", "acuracy")
    assert out.returncode == 1 and "acc" in out.stderr and "Traceback" not in out.stderr
    out = recorded.cli("dataframe", "acc", "--where", "lr >>> 1")
    assert out.returncode == 1 and "lr >>> 1" in out.stderr and "Traceback" not in out.stderr


def test_query_is_read_only(recorded: Project) -> None:
    out = recorded.cli("query", "SELECT name, COUNT(*) AS n FROM logs GROUP BY name ORDER BY name")
    assert out.returncode == 0, out.stderr
    assert "loss" in out.stdout and "12" in out.stdout
    refused = recorded.cli("query", "DELETE FROM logs")
    assert refused.returncode == 1 and "read-only" in refused.stderr
    again = json.loads(recorded.cli("query", "SELECT COUNT(*) AS n FROM logs", "--json").stdout)
    assert again == [{"n": 2 * (1 + 6 + 3 + 1)}]


def test_reading_without_a_store_says_how_to_make_one(project: Project) -> None:
    out = project.cli("runs")
    assert out.returncode == 1
    assert "There is no retrolog store" in out.stderr and "Traceback" not in out.stderr
    assert not (project.root / ".retrolog").exists()


def test_json_and_csv_together_is_a_usage_error(recorded: Project) -> None:
    out = recorded.cli("runs", "--json", "--csv")
    assert out.returncode == 2


def test_replay_of_a_name_the_script_does_not_log_is_a_clear_error(recorded: Project) -> None:
    out = recorded.cli("replay", "acuracy", "--yes")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "acc" in out.stderr  # the names it does log, with a suggestion


def test_replay_without_yes_on_a_pipe_refuses_to_ask(recorded: Project) -> None:
    recorded.write("train.py", SCRIPT + '    rl.log("double", 2 * lr)\n')
    out = recorded.cli("replay", "double")
    assert out.returncode == 2 and "--yes" in out.stderr and "Traceback" not in out.stderr
    assert "suffix" in out.stderr  # the plan was shown before asking


@pytest.mark.parametrize(
    "command", [[], ["runs"], ["show"], ["dataframe"], ["query"], ["replay"], ["propagate"]]
)
def test_every_command_has_help_with_an_example(command: list[str]) -> None:
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output
