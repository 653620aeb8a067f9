"""Notebooks as scripts: the Python a notebook's cells make, and a script read either way.

A run recorded in a Jupyter/IPython kernel keeps, at the notebook's path in its code
version, the cells that ran in the order they ran, as one Python script with a
``# %% [n]`` marker before each cell (n: its execution count). Replay reads today's
notebook the same way (its code cells in document order), so propagation, the replay
worker, ``retrolog show`` and the dashboard all see Python, never the notebook's JSON.

IPython syntax has no meaning in a plain Python process, which is what a replay worker
is: a cell that is not valid Python has its line magics (``%time x``), shell escapes
(``!ls``, ``files = !ls``) and help lines (``x?``) commented out, except ``%time
<statement>``, which runs its statement once, so the statement is kept. A cell magic
(``%%...``) runs its body in another language or runs it under a control of its own;
``%%time``, ``%%capture`` and ``%%prun`` run the body once as Python, so they keep it;
any other cell magic's cell is commented out whole. A statement that reads what a
commented-out line made fails in replay with a NameError: the replay reports it, and no
value is backfilled.

No IPython import: this module reads text only, in the CLI as in a kernel.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from pathlib import Path

NOTEBOOK_SUFFIX = ".ipynb"
# The notebook file as it was saved when the run started, beside the cells in the version.
SAVED_SUFFIX = ".json"
_NOT_RUN = "# (IPython, not run outside a kernel) "
# Cell magics whose body is Python run once, as it would run without the magic.
_PYTHON_BODY_MAGICS = frozenset({"time", "capture", "prun"})
# `%time <statement>` runs the statement once: it is kept, the magic dropped.
_TIME_LINE = re.compile(r"^(\s*)%time\s+(\S.*)$")
_IPYTHON_LINE = re.compile(r"^\s*(?:[%!]|[\w.,\s\[\]]+=\s*[%!])|^[^#]*\?\s*$")


def is_notebook(path: str | Path) -> bool:
    """Whether ``path`` names a notebook (its code version holds the cells as a script)."""
    return str(path).endswith(NOTEBOOK_SUFFIX)


def python_of_cell(source: str) -> str:
    """A cell's code as plain Python (IPython syntax commented out, see the module)."""
    lines = source.splitlines()
    if not lines:
        return ""
    first = lines[0].lstrip()
    if first.startswith("%%"):
        magic = first[2:].split(maxsplit=1)[0] if first[2:].strip() else ""
        if magic in _PYTHON_BODY_MAGICS:
            return "\n".join(
                [_NOT_RUN + lines[0], *python_of_cell("\n".join(lines[1:])).split("\n")]
            )
        return "\n".join(_NOT_RUN + line for line in lines)
    try:
        ast.parse(source)
        return "\n".join(lines)
    except SyntaxError:
        pass
    return "\n".join(_python_of_line(line) for line in lines)


def _python_of_line(line: str) -> str:
    timed = _TIME_LINE.match(line)
    if timed is not None:
        return f"{timed.group(1)}{timed.group(2)}  # (IPython) %time"
    return _NOT_RUN + line if _IPYTHON_LINE.match(line) else line


def cells_script(cells: Iterable[tuple[str, str]], origin: str) -> str:
    """One script of ``cells`` (label, source), each after a ``# %% [label]`` marker.

    origin: the first line's description of where the cells come from.
    """
    parts = [f"# {origin}\n"]
    for label, source in cells:
        body = python_of_cell(source).rstrip()
        parts.append(f"# %% [{label}]\n{body}\n" if body else f"# %% [{label}]\n")
    return "\n".join(parts)


def notebook_script(text: str, name: str) -> str:
    """Today's notebook (its JSON ``text``) as a script: its code cells in document order.

    Raises ValueError, saying what to do, when ``text`` is not a notebook.
    """
    try:
        notebook = json.loads(text)
        cells = notebook["cells"]
        if not isinstance(cells, list):
            raise TypeError("cells is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{name} is not a readable Jupyter notebook ({exc}); save it from Jupyter "
            "(File > Save) and try again."
        ) from None
    code = []
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list):
            source = "".join(str(part) for part in source)
        count = cell.get("execution_count")
        code.append((str(count) if isinstance(count, int) else " ", str(source)))
    return cells_script(code, f"{name}: its code cells in document order")


def read_script(path: Path) -> str:
    """A script's text, or a notebook's code cells as a script (raises OSError,
    UnicodeDecodeError, or ValueError for a notebook that cannot be read)."""
    text = path.read_text()
    return notebook_script(text, path.name) if is_notebook(path) else text
