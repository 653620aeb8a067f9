"""Runs recorded in an IPython shell: one per cell execution that records, named by the
notebook, keeping the cells that ran (an IPython shell in a subprocess, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import Project, read_db

pytest.importorskip("IPython")

SHELL = """\
import sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
for cell in {cells!r}:
    shell.run_cell(cell, store_history=True)
"""

CELLS = [
    "import retrolog as rl\n%time n = 3",
    "for e in rl.loop('epoch', range(n)):\n    rl.log('v', e * 2)",
    "for e in rl.loop('epoch', range(n)):\n    rl.log('v', e * 2)",
    "for e in rl.loop('epoch', range(n)):\n    raise ValueError('boom')",
]


def _shell(project: Project, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SHELL.format(cells=CELLS)],
        cwd=project.root,
        env=project.env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_each_cell_execution_that_records_is_one_run(project: Project) -> None:
    project.write("train.ipynb", '{"cells": [], "nbformat": 4, "nbformat_minor": 5}')
    out = _shell(project, JPY_SESSION_NAME="train.ipynb")
    assert "boom" in out.stdout + out.stderr
    runs = read_db(project.root, "SELECT run_id, filename, argv, status FROM runs ORDER BY rowid")
    assert [(f, json.loads(str(a)), s) for _, f, a, s in runs] == [
        ("train.ipynb", ["train.ipynb"], "finished"),
        ("train.ipynb", ["train.ipynb"], "finished"),
        ("train.ipynb", ["train.ipynb"], "crashed"),
    ]
    counts = read_db(project.root, "SELECT run_id, COUNT(*) FROM loops GROUP BY run_id")
    assert sorted(n for _, n in counts) == [1, 3, 3]

    from retrolog import Project as Store

    second = Store(project.root).code(str(runs[1][0]))
    assert second["text"].splitlines()[:8] == [
        "# train.ipynb: the cells this kernel executed, in order, up to cell [3]",
        "",
        "# %% [1]",
        "import retrolog as rl",
        "# (IPython, not run outside a kernel) %time n = 3",
        "",
        "# %% [2]",
        "# cell [2] began another run: not run again here",
    ]
    assert "train.ipynb.json" in second["files"]
    # The user's notebook is untouched and nothing is left in the working tree.
    assert project.git("status", "--porcelain").split() == ["??", "train.ipynb"]


def test_a_kernel_without_its_notebook_records_and_says_so(project: Project) -> None:
    out = _shell(project)
    assert "cannot tell which notebook this kernel runs" in out.stderr
    assert out.stderr.count("cannot tell which notebook") == 1
    runs = read_db(project.root, "SELECT filename FROM runs")
    assert runs == [("<interactive>",)] * 3
