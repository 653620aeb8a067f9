"""--kwargs parsing and casting, and coexistence with a script's own argparse."""

from __future__ import annotations

import json

import pytest

from retrolog.errors import ArgumentError
from retrolog.runtime.kwargs import cast, split_argv

from conftest import Project, read_db


def test_split_argv_takes_out_every_kwargs_group() -> None:
    rest, overrides = split_argv(
        ["train.py", "--seed", "3", "--kwargs", "lr=0.1", "epochs=2", "--verbose", "--kwargs=x=1"]
    )
    assert rest == ["train.py", "--seed", "3", "--verbose"]
    assert overrides == {"lr": "0.1", "epochs": "2", "x": "1"}


def test_split_argv_stops_at_a_token_that_is_not_a_pair() -> None:
    rest, overrides = split_argv(["t.py", "--kwargs", "a=1", "positional", "b=2"])
    assert rest == ["t.py", "positional", "b=2"]
    assert overrides == {"a": "1"}


def test_split_argv_keeps_equals_signs_in_values() -> None:
    _, overrides = split_argv(["t.py", "--kwargs", "expr=a=b"])
    assert overrides == {"expr": "a=b"}


def test_split_argv_rejects_an_empty_group() -> None:
    with pytest.raises(ArgumentError, match="at least one name=value"):
        split_argv(["t.py", "--kwargs", "--other"])


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [
        ("0.01", 1e-3, 0.01),
        ("3", 1.0, 3.0),
        ("64", 32, 64),
        ("1e3", 10, 1000),
        ("1_000", 10, 1000),
        ("true", False, True),
        ("No", True, False),
        ("0", True, False),
        ("adam", "sgd", "adam"),
        ("anything", None, "anything"),
        ("[1, 2]", [0], [1, 2]),
    ],
)
def test_cast_follows_the_default_type(text: str, default: object, expected: object) -> None:
    value = cast("x", text, default)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "default", "wanted"),
    [("abc", 0.1, "a number"), ("2.5", 3, "an integer"), ("maybe", True, "true or false")],
)
def test_cast_errors_name_the_argument_and_the_fix(text: str, default: object, wanted: str) -> None:
    with pytest.raises(ArgumentError) as info:
        cast("lr", text, default)
    message = str(info.value)
    assert "lr" in message and wanted in message and "--kwargs" in message
    assert info.value.name == "lr"


SCRIPT = """
    import argparse
    import retrolog as rl

    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    lr = rl.arg("lr", 0.001)
    epochs = rl.arg("epochs", 3)
    optim = rl.arg("optim", "sgd")
    amp = rl.arg("amp", False)
    tag = rl.arg("tag", None)
    print(repr((cli.seed, lr, epochs, optim, amp, tag)))
"""


def test_script_gets_cast_overrides_and_its_argparse_still_works(project: Project) -> None:
    project.write("train.py", SCRIPT)
    proc = project.run(
        "train.py", "--seed", "7", "--kwargs", "lr=0.01", "epochs=5", "amp=yes", "tag=exp1"
    )
    assert proc.stdout.strip() == "(7, 0.01, 5, 'sgd', True, 'exp1')"
    (args_json,) = read_db(project.root, "SELECT args FROM runs")[0]
    assert json.loads(args_json) == {
        "lr": 0.01,
        "epochs": 5,
        "optim": "sgd",
        "amp": True,
        "tag": "exp1",
    }
    # Arguments are run-level values, with their types.
    rows = dict(
        (name, (value, kind))
        for name, value, kind in read_db(
            project.root, "SELECT name, value, value_type FROM logs WHERE ctx_id IS NULL"
        )
    )
    assert rows["lr"] == (0.01, "float")
    assert rows["epochs"] == (5, "int")
    assert rows["amp"] == (1, "bool")
    assert rows["tag"] == ("exp1", "str")
    (argv,) = read_db(project.root, "SELECT argv FROM runs")[0]
    assert "--kwargs" in json.loads(argv)  # the original command line is kept


def test_bad_override_is_a_clear_error(project: Project) -> None:
    project.write("train.py", SCRIPT)
    proc = project.run("train.py", "--kwargs", "epochs=many", check=False)
    assert proc.returncode != 0
    assert "ArgumentError" in proc.stderr
    assert "'many' is not an integer" in proc.stderr
    # The message and the script's line, not retrolog's frames; RETROLOG_DEBUG shows them.
    assert "Traceback" not in proc.stderr and "train.py, line" in proc.stderr
    debug = project.run("train.py", "--kwargs", "epochs=many", check=False, RETROLOG_DEBUG="1")
    assert "Traceback" in debug.stderr and "ArgumentError" in debug.stderr


def test_unused_override_is_reported(project: Project) -> None:
    project.write("train.py", SCRIPT)
    proc = project.run("train.py", "--kwargs", "lrr=0.1")
    assert "lrr" in proc.stderr and "never called" in proc.stderr
