"""Hyper-parameters parsed by argparse or click are recorded without rl.arg."""

from __future__ import annotations

import json

import pytest

from conftest import Project, read_db

ARGPARSE = """\
import argparse
from pathlib import Path

import retrolog as rl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--no-cuda", action="store_true")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", type=Path, default=Path("runs/out"))
    parser.add_argument("--tag", default=None)
    parser.add_argument("data")
    args = parser.parse_args()
    for epoch in rl.loop("epoch", range(2)):
        rl.log("acc", 0.5 + epoch * args.lr)


if __name__ == "__main__":
    main()
"""


def _parsed(project: Project) -> list[dict[str, object]]:
    rows = read_db(project.root, "SELECT parsed_args FROM runs ORDER BY started_at")
    return [json.loads(str(r)) for (r,) in rows]


def _run_level(project: Project, run_index: int = 0) -> dict[str, tuple[object, str]]:
    ((run_id,),) = read_db(
        project.root, "SELECT run_id FROM runs ORDER BY started_at LIMIT 1 OFFSET ?", (run_index,)
    )
    rows = read_db(
        project.root,
        "SELECT name, value, value_type FROM logs WHERE run_id = ? AND ctx_id IS NULL"
        " ORDER BY log_id",
        (run_id,),
    )
    return {str(n): (v, str(t)) for n, v, t in rows}  # the last record of a name counts


def test_argparse_flags_are_run_level_values_with_their_types(project: Project) -> None:
    project.write("train.py", ARGPARSE)
    project.run("train.py", "mnist", "--lr", "0.8", "--batch-size", "32", "--layers", "4", "5")
    project.run("train.py", "--no-cuda", "cifar")
    assert _parsed(project) == [
        {
            "lr": 0.8,
            "batch_size": 32,
            "no_cuda": False,
            "layers": [4, 5],
            "out": "runs/out",
            "tag": None,
            "data": "mnist",
        },
        {
            "lr": 0.01,
            "batch_size": 64,
            "no_cuda": True,
            "layers": [2, 3],
            "out": "runs/out",
            "tag": None,
            "data": "cifar",
        },
    ]
    values = _run_level(project)
    assert values["lr"] == (0.8, "float") and values["batch_size"] == (32, "int")
    assert values["no_cuda"] == (0, "bool") and values["layers"] == ("[4, 5]", "json")
    assert values["tag"] == (None, "none")

    # Queryable as the user would ask: a where clause and dataframe columns.
    frame = project.cli("dataframe", "acc", "batch_size", "--where", "lr > 0.5", "--json")
    assert frame.returncode == 0, frame.stderr
    rows = json.loads(frame.stdout)
    assert [(r["epoch"], r["batch_size"]) for r in rows] == [(0, 32), (1, 32)]
    assert "no such column" not in frame.stderr
    runs = project.cli("runs")
    assert "lr=0.8 batch_size=32" in runs.stdout and "data=cifar" in runs.stdout
    first = read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")[0][0]
    show = project.cli("show", str(first))
    assert "parsed     lr=0.8 batch_size=32" in show.stdout


@pytest.mark.parametrize("order", ["arg first", "parse first"])
def test_rl_arg_wins_over_argparse_for_the_same_name(project: Project, order: str) -> None:
    parse = "args = parser.parse_args()\n"
    arg = 'lr = rl.arg("lr", 0.1)\n'
    project.write(
        "train.py",
        "import argparse\n\nimport retrolog as rl\n\n"
        "parser = argparse.ArgumentParser()\n"
        'parser.add_argument("--lr", type=float, default=0.5)\n'
        'parser.add_argument("--epochs", type=int, default=3)\n'
        + (arg + parse if order == "arg first" else parse + arg)
        + 'rl.log("seen", lr)\n'
        'rl.log("flag", args.lr)\n',
    )
    project.run("train.py", "--lr", "0.7", "--kwargs", "lr=0.2")
    values = _run_level(project)
    assert values["lr"] == (0.2, "float")  # rl.arg's value, however the calls are ordered
    assert values["seen"] == (0.2, "float") and values["flag"] == (0.7, "float")
    assert _parsed(project) == [{"epochs": 3}]
    args = read_db(project.root, "SELECT args FROM runs")
    assert json.loads(str(args[0][0])) == {"lr": 0.2}


def test_only_parses_of_the_command_line_are_recorded(project: Project) -> None:
    project.write(
        "train.py",
        """
        import argparse
        import sys

        import retrolog as rl

        library = argparse.ArgumentParser()
        library.add_argument("--secret", default="x")
        library.parse_args([])  # a library's own parse of a fixed list
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command")
        fit = sub.add_parser("fit")
        fit.add_argument("--lr", type=float, default=0.1)
        args = parser.parse_args(sys.argv[1:])  # the command line, passed explicitly
        rl.log("done", 1)
        """,
    )
    project.run("train.py", "fit", "--lr", "0.3")
    assert _parsed(project) == [{"command": "fit", "lr": 0.3}]


def test_click_parameters_are_recorded(project: Project) -> None:
    project.write(
        "train.py",
        """
        import click

        import retrolog as rl


        @click.command()
        @click.option("--lr", type=float, default=0.1)
        @click.option("--epochs", type=int, default=2)
        @click.argument("name")
        def main(lr, epochs, name):
            for epoch in rl.loop("epoch", range(epochs)):
                rl.log("acc", lr * epoch)


        if __name__ == "__main__":
            main()
        """,
    )
    project.run("train.py", "--lr", "0.9", "exp1")
    assert _parsed(project) == [{"lr": 0.9, "epochs": 2, "name": "exp1"}]
    frame = project.cli("dataframe", "acc", "--where", "lr > 0.5 AND name = 'exp1'", "--json")
    assert frame.returncode == 0, frame.stderr
    assert len(json.loads(frame.stdout)) == 2


@pytest.mark.slow
def test_replay_checks_that_argparse_parses_the_recorded_values(project: Project) -> None:
    project.write(
        "train.py",
        """
        import argparse
        import os

        import retrolog as rl

        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=float(os.environ.get("LR", "0.1")))
        args = parser.parse_args()
        for epoch in rl.loop("epoch", range(2)):
            rl.log("acc", args.lr * epoch)
        """,
    )
    project.run("train.py", LR="0.4")  # a default that came from the environment
    project.run("train.py", "--lr", "0.3")
    source = project.root.joinpath("train.py").read_text()
    project.write("train.py", source + '    rl.log("double", 2 * args.lr)\n')
    out = project.cli("replay", "double", "--yes")
    # The first run parses 0.1 in replay (LR is not set): caught, reported, marked.
    assert out.returncode == 1, out.stderr
    assert "'<arguments>' differs in replay in 1 of 1 places" in out.stderr
    assert "lr: recorded 0.4, replayed 0.1" in out.stderr
    marks = read_db(
        project.root,
        "SELECT r.parsed_args, l.inexact FROM logs l JOIN runs r ON r.run_id = l.run_id"
        " WHERE l.name = 'double' GROUP BY r.run_id ORDER BY r.started_at",
    )
    assert [(json.loads(str(a))["lr"], mark) for a, mark in marks] == [
        (0.4, "mismatch"),
        (0.3, None),
    ]
