"""A run recorded in a Jupyter/IPython kernel.

The code that ran is the cells the kernel executed, in order: the run's code version
holds them as one script at the notebook's path (versions/notebook.py), with the saved
notebook beside it (``<path>.json``) when the notebook file is found. The run's
filename is the notebook's path and its argv that path alone (not the kernel launcher
and its connection file), so replay finds and runs it as it would a script.

One execution of a cell that records is one run: the run begins at the cell's first
recording call and ends when the cell ends (``finished``, or ``crashed`` when the cell
raised). A cell that began an earlier run stays in a later run's script commented out:
its loops belong to that other run, and replaying them would train twice. A later run
that depends on what such a cell trained (a model carried over, not re-created) replays
inexactly, and the replay's deferred check says so.

The kernel's notebook is found from ipykernel's ``__session__`` or ``JPY_SESSION_NAME``
(set by Jupyter Server, relative to the server's root). A kernel that has neither (a
bare ``jupyter console``, nbclient without them) records the cells at
``<interactive>``, which replay cannot name; the first run says so.

Nothing here imports IPython: a kernel is recognized from ``sys.modules``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrolog.errors import RetrologWarning
from retrolog.runtime.run import Run, _relative_script
from retrolog.store.paths import ProjectPaths
from retrolog.versions.notebook import SAVED_SUFFIX, cells_script, is_notebook

# Cells (their number in the kernel's history) that began a run in this process.
_run_cells: set[int] = set()
_hooked: set[int] = set()  # id() of the shells whose post_run_cell ends runs
_warned_unknown = False


def kernel_shell() -> Any | None:
    """The running IPython shell when this process is a kernel executing a cell, else None."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    if get is None:
        return None
    try:
        shell = get()
    except Exception:  # an IPython that cannot say is not a kernel we can record from
        return None
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    return shell if isinstance(history, list) and len(history) > 1 else None


def notebook_path(shell: Any, cwd: Path) -> Path | None:
    """The kernel's notebook file, when the kernel knows it and it exists."""
    names = [shell.user_ns.get("__session__"), os.environ.get("JPY_SESSION_NAME")]
    for name in names:
        if not isinstance(name, str) or not is_notebook(name):
            continue
        path = Path(name).expanduser()
        if path.is_absolute():
            candidates = [path]
        else:  # relative to the server's root, which is the cwd or one of its parents
            candidates = [cwd / path, cwd / path.name, *(parent / path for parent in cwd.parents)]
        for candidate in candidates:
            if candidate.is_file():
                return candidate.resolve()
    return None


def start_run(shell: Any, paths: ProjectPaths, on_cell_end: Callable[[Any], None]) -> Run:
    """Begin the run of the cell executing now; ``on_cell_end(result)`` ends it."""
    global _warned_unknown
    history: list[str] = shell.history_manager.input_hist_raw
    current = len(history) - 1
    cwd = Path.cwd().resolve()
    notebook = notebook_path(shell, cwd)
    script = str(notebook) if notebook is not None else None
    filename = _relative_script(paths.root, script)
    cells = [
        (str(n), history[n] if n not in _run_cells else _commented(history[n], n))
        for n in range(1, current + 1)
    ]
    origin = (
        f"{filename}: the cells this kernel executed, in order, up to cell [{current}]"
        if notebook is not None
        else f"the cells this kernel executed, in order, up to cell [{current}]"
    )
    files: dict[str, bytes] = {}
    if not Path(filename).is_absolute():
        files[filename] = cells_script(cells, origin).encode()
        if notebook is not None:
            files[filename + SAVED_SUFFIX] = notebook.read_bytes()
    if notebook is None and not _warned_unknown:
        _warned_unknown = True
        warnings.warn(
            "retrolog cannot tell which notebook this kernel runs (neither __session__ nor "
            "JPY_SESSION_NAME names one): the run is recorded with the cells that ran, as "
            "<interactive>, which replay cannot name. Start the kernel from Jupyter, or set "
            "os.environ['JPY_SESSION_NAME'] = 'train.ipynb' (the notebook's path) in a cell "
            "before the first recording call.",
            RetrologWarning,
            stacklevel=4,
        )
    run = Run(paths, [filename], script, code_files=files)
    _run_cells.add(current)
    if id(shell) not in _hooked:
        _hooked.add(id(shell))
        shell.events.register("post_run_cell", on_cell_end)
    return run


def _commented(source: str, number: int) -> str:
    note = f"# cell [{number}] began another run: not run again here\n"
    return note + "\n".join("# " + line for line in source.splitlines())
