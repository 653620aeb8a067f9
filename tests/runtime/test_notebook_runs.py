"""Runs recorded in an IPython shell: one per cell execution that records, named by the
notebook, keeping the cells that ran (an IPython shell in a subprocess, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import Project, read_db

pytest.importorskip("IPython")

pytestmark = pytest.mark.slow

# The user pauses 3 s before executing the training cell again.
SHELL = """\
import time
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
for number, cell in enumerate({cells!r}, 1):
    if number == 4:
        time.sleep(3)
    shell.run_cell(cell, store_history=True)
"""

CELLS = [
    "import retrolog as rl\n%time n = 3",
    "lr = rl.arg('lr', 0.5)",  # begins no run: the next runs record it
    "for e in rl.loop('epoch', range(n)):\n    rl.log('v', e * lr)",
    "for e in rl.loop('epoch', range(n)):\n    rl.log('v', e * lr)",
    "try:\n    rl.replay('v', dry_run=True)\nexcept Exception:\n    pass",
    "for e in rl.loop('epoch', range(n)):\n    raise ValueError('boom')",
    "n = 1 / 0",
    "lr = rl.arg('lr', 0.25)",  # resolved again
    "for e in rl.loop('epoch', range(n)):\n    rl.log('v', e * lr)",
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
    runs = read_db(
        project.root, "SELECT run_id, filename, argv, status, args FROM runs ORDER BY rowid"
    )
    assert [(f, json.loads(str(a)), s, json.loads(str(g))) for _, f, a, s, g in runs] == [
        ("train.ipynb", ["train.ipynb"], "finished", {"lr": 0.5}),
        ("train.ipynb", ["train.ipynb"], "finished", {"lr": 0.5}),
        ("train.ipynb", ["train.ipynb"], "crashed", {"lr": 0.5}),
        ("train.ipynb", ["train.ipynb"], "finished", {"lr": 0.25}),
    ]
    counts = dict(read_db(project.root, "SELECT run_id, COUNT(*) FROM loops GROUP BY run_id"))
    assert [counts.get(run[0], 0) for run in runs] == [3, 3, 1, 3]
    # A run's prefix is the cells' execution time, not the time the kernel was up.
    prefixes = read_db(
        project.root,
        "SELECT seconds FROM profile WHERE phase = 'prefix' AND run_id = ?",
        (runs[1][0],),
    )
    assert len(prefixes) == 1 and 0 <= float(str(prefixes[0][0])) < 3

    from retrolog import Project as Store

    second = Store(project.root).code(str(runs[1][0]))
    assert second["text"].splitlines() == [
        "# train.ipynb: the cells this kernel executed, in order, up to cell [4]",
        "",
        "# %% [1]",
        "import retrolog as rl",
        "n = 3  # (IPython) %time",
        "",
        "# %% [2]",
        "lr = rl.arg('lr', 0.5)",
        "",
        "# %% [3]",
        "# cell [3] trained another run: not run again here",
        "# for e in rl.loop('epoch', range(n)):",
        "#     rl.log('v', e * lr)",
        "",
        "# %% [4]",
        "for e in rl.loop('epoch', range(n)):",
        "    rl.log('v', e * lr)",
    ]
    assert "train.ipynb.json" in second["files"]
    last = Store(project.root).code(str(runs[3][0]))["text"]
    assert "# cell [5] replayed past runs: not run again here\n# try:" in last
    assert "# cell [6] trained another run: not run again here" in last
    assert "# cell [7] raised in the kernel: not run here\n# n = 1 / 0" in last
    # The user's notebook is untouched and nothing is left in the working tree.
    assert project.git("status", "--porcelain").split() == ["??", "train.ipynb"]

    # Today's notebook: a statement added to the training cell; every run answers,
    # the run that began after its arguments' cell too.
    training = "for e in rl.loop('epoch', range(n)):\n    rl.log('v', e * lr)"
    today = [CELLS[0], CELLS[1], training + "\n    rl.log('sq', e * e * lr)"]
    cells = [{"cell_type": "code", "source": c, "metadata": {}, "outputs": []} for c in today]
    project.write("train.ipynb", json.dumps({"cells": cells, "nbformat": 4, "nbformat_minor": 5}))
    out = project.cli("replay", "sq", "--script", "train.ipynb", "--yes")
    assert out.returncode == 0, out.stderr
    # Only the crashed run, whose loop body was `raise`, has no place for the statement.
    unplaced = [line for line in out.stderr.splitlines() if "not replayed" in line]
    assert len(unplaced) == 1 and unplaced[0].startswith(f"run {runs[2][0]}: "), out.stderr
    values = read_db(project.root, "SELECT run_id, value FROM logs WHERE name = 'sq'")
    by_run: dict[str, list[float]] = {}
    for run_id, value in values:
        by_run.setdefault(str(run_id), []).append(float(str(value)))
    lrs = {str(run[0]): json.loads(str(run[4]))["lr"] for run in runs if run[3] == "finished"}
    assert by_run == {run_id: [e * e * lr for e in range(3)] for run_id, lr in lrs.items()}


def test_a_kernel_without_its_notebook_records_and_says_so(project: Project) -> None:
    out = _shell(project)
    assert "cannot tell which notebook this kernel runs" in out.stderr
    assert out.stderr.count("cannot tell which notebook") == 1
    runs = read_db(project.root, "SELECT filename FROM runs")
    assert runs == [("<interactive>",)] * 4
