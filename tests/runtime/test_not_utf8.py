"""Command lines and file names that are not UTF-8 (bytes Python decodes as lone
surrogates): recorded and replayed when they can be, one paragraph when not."""

from __future__ import annotations

import json
from pathlib import Path

from training_scripts import new_project

from conftest import Project, read_db

SCRIPT = """\
import os
import sys

import numpy as np

import retrolog as rl

size = len(os.fsencode(sys.argv[1]))  # the argument's bytes, whatever they are
w = np.zeros(4)
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(2)):
            w += size
        rl.log("s", float(w.sum()))
"""
ODD = "data-\udcff\udcfe"  # the bytes b"data-\\xff\\xfe", as Python decodes argv


def test_an_argument_that_is_not_utf8_is_recorded_and_replayed_as_its_bytes(
    project: Project,
) -> None:
    project.write("train.py", SCRIPT)
    project.run("train.py", ODD)
    ((argv,),) = read_db(project.root, "SELECT argv FROM runs")
    assert json.loads(str(argv))[1:] == [ODD]
    project.write("train.py", SCRIPT + '        rl.log("m", float(w.max()))\n')
    out = project.cli("replay", "m", "--yes")
    assert out.returncode == 0, out.stderr
    values = read_db(project.root, "SELECT value FROM logs WHERE name = 'm' ORDER BY ctx_id")
    assert [v for (v,) in values] == [14.0, 28.0, 42.0]  # 7 bytes, twice an epoch


def test_a_script_whose_name_is_not_utf8_is_refused_in_one_paragraph(project: Project) -> None:
    name = "train-\udcff.py"
    project.write(name, SCRIPT)
    project.git("add", "-A")
    proc = project.run(name, "x", check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "cannot record train-\\udcff.py" in proc.stderr and "Rename the file" in proc.stderr
    # Where in the script: its own line, not contextlib's.
    assert "train-\\udcff.py, line 10: with rl.checkpointing(w=w):" in proc.stderr
    assert not (project.root / ".retrolog").exists()  # nothing was recorded
    assert project.git("status", "--porcelain") == 'A  "train-\\377.py"\n'


def test_commands_given_bytes_that_are_not_utf8_say_so_in_one_paragraph(
    project: Project,
) -> None:
    project.write("train.py", SCRIPT)
    project.run("train.py", "x")
    for args in (
        ("show", ODD),
        ("gc", "--keep", f"best:{ODD}", "--dry-run"),
        ("replay", "s", "--dry-run", "--script", ODD),
        ("dataframe", "s", "--where", f'"{ODD}" > 1'),
        ("dataframe", ODD),
    ):
        out = project.cli(*args)
        assert out.returncode != 0, args
        assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
        assert "\\udcff" in out.stderr, (args, out.stderr)  # the odd bytes, shown escaped


def test_a_project_whose_path_is_not_utf8_is_refused_in_one_paragraph(tmp_path: Path) -> None:
    project = new_project(tmp_path / "proj-\udcfd")
    project.write("train.py", SCRIPT)
    proc = project.run("train.py", "x", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot use the project at" in proc.stderr and "proj-\\udcfd" in proc.stderr
    assert "train.py, line 10" in proc.stderr
    assert not (project.root / ".retrolog").exists()
    out = project.cli("runs")
    assert out.returncode != 0 and "Rename the directory" in out.stderr, out.stderr
    assert "internal error" not in out.stderr
