"""A notebook's cells as the Python script its runs keep and replay reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrolog.versions.notebook import cells_script, python_of_cell, read_script

NOT_RUN = "# (IPython, not run outside a kernel) "


def test_valid_python_is_kept_as_it_is() -> None:
    source = "a = 7 % 3\nb = a != 2\nprint(f'{a}?')\n"
    assert python_of_cell(source) == source.rstrip("\n")


def test_line_magics_shell_escapes_and_help_are_commented_out() -> None:
    source = "%matplotlib inline\nfiles = !ls\n!pip list\nx = 1\nx?\n%timeit x + 1\n"
    assert python_of_cell(source).splitlines() == [
        NOT_RUN + "%matplotlib inline",
        NOT_RUN + "files = !ls",
        NOT_RUN + "!pip list",
        "x = 1",
        NOT_RUN + "x?",
        NOT_RUN + "%timeit x + 1",
    ]


def test_a_timed_statement_is_kept() -> None:
    assert python_of_cell("%time y = 2\nif y:\n    %time z = y").splitlines() == [
        "y = 2  # (IPython) %time",
        "if y:",
        "    z = y  # (IPython) %time",
    ]


def test_cell_magics_keep_a_python_body_or_comment_the_cell_out() -> None:
    assert python_of_cell("%%time\nx = 1\n!ls").splitlines() == [
        NOT_RUN + "%%time",
        "x = 1",
        NOT_RUN + "!ls",
    ]
    assert python_of_cell("%%bash\necho hi").splitlines() == [
        NOT_RUN + "%%bash",
        NOT_RUN + "echo hi",
    ]


def test_cells_script_marks_each_cell_and_parses() -> None:
    script = cells_script([("1", "x = 1"), ("2", "%time y = x"), ("3", "")], "t.ipynb: cells")
    assert script.splitlines()[0] == "# t.ipynb: cells"
    assert "# %% [1]\nx = 1\n" in script and "# %% [3]\n" in script
    compile(script, "t.ipynb", "exec")


def test_notebook_script_reads_code_cells_in_document_order(tmp_path: Path) -> None:
    notebook = {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {},
        "cells": [
            {"cell_type": "markdown", "source": ["# Title"], "metadata": {}},
            {"cell_type": "code", "source": ["x = 1\n", "y = 2"], "execution_count": 5},
            {"cell_type": "raw", "source": "not code"},
            {"cell_type": "code", "source": "z = x + y", "execution_count": None},
        ],
    }
    path = tmp_path / "train.ipynb"
    path.write_text(json.dumps(notebook))
    script = read_script(path)
    assert "# %% [5]\nx = 1\ny = 2\n" in script
    assert "# %% [ ]\nz = x + y\n" in script
    assert "Title" not in script and "not code" not in script
    assert script.index("x = 1") < script.index("z = x + y")


def test_a_file_that_is_not_a_notebook_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "broken.ipynb"
    path.write_text('{"cells": ')
    with pytest.raises(ValueError, match=r"broken.ipynb is not a readable Jupyter notebook.*Save"):
        read_script(path)
    (tmp_path / "train.py").write_text("x = 1\n")
    assert read_script(tmp_path / "train.py") == "x = 1\n"
