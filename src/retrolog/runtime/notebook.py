"""A run recorded in a Jupyter/IPython kernel.

The code that ran is the cells the kernel executed, in order: the run's code version
holds them as one script at the notebook's path (versions/notebook.py), with the saved
notebook beside it (``<path>.json``) when the notebook file is found. The run's
filename is the notebook's path and its argv that path alone (not the kernel launcher
and its connection file), so replay finds and runs it as it would a script.

A run is one execution of a cell that records: it begins at the cell's first recording
call and ends with the cell, ``finished``, or ``crashed`` when the cell raised (so its
code version holds every cell it ran). ``rl.arg`` outside a run (hyper-parameters set in
a cell of their own) begins none: each later run in the kernel records the arguments the
kernel resolved (its variables still hold them), until a cell resolves one again.

In a later run's script, a cell in which an earlier run trained, a cell that raised and
a cell that called ``rl.replay`` stay commented out: the first's loops are that other
run's (replaying them would train twice), the second stopped part-way in the kernel and
would stop the replay, the third would start a replay inside the replay. A run that
starts from what such a cell left (a model trained further, not re-created) replays
inexactly, and the replay's deferred check says so.

A run's prefix (replay's cost model) is the time the kernel spent executing the cells
before its first loop, measured from ``import retrolog`` on, not the time the kernel has
been up (which counts the user's pauses between cells).

The kernel's notebook is found from ipykernel's ``__session__`` or ``JPY_SESSION_NAME``
(set by Jupyter Server, relative to the server's root). A kernel that has neither (a
bare ``jupyter console``, nbclient without them) records the cells at
``<interactive>``, which replay cannot name; the first run says so.

Nothing here imports IPython: a kernel is recognized from ``sys.modules``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrolog.errors import RetrologWarning
from retrolog.runtime.run import Run, _relative_script
from retrolog.store.paths import ProjectPaths
from retrolog.versions.notebook import SAVED_SUFFIX, cells_script, is_notebook


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


class Kernel:
    """What retrolog follows of one kernel's cells: when each ran, how long, which trained
    a run or raised. ``end(run, crashed)`` (the API's) ends the active run."""

    def __init__(self, shell: Any, active: Callable[[], Run | None], end: Callable[..., None]):
        self.shell = shell
        self._active = active
        self._end = end
        self.trained: set[int] = set()  # cells in which a run trained (and ended)
        self.failed: set[int] = set()  # cells that raised
        self.replayed: set[int] = set()  # cells that called rl.replay
        self.seconds: dict[int, float] = {}  # each cell's execution time, from the import on
        self.arguments: dict[str, Any] = {}  # what rl.arg resolved in this kernel
        self.carried: set[str] = set()  # the active run's arguments from earlier runs
        self._cell_started = time.time()  # the cell importing retrolog: from now
        self._warned_unknown = False
        shell.events.register("pre_run_cell", self._pre_run_cell)
        shell.events.register("post_run_cell", self._post_run_cell)

    def current_cell(self) -> int:
        return len(self.shell.history_manager.input_hist_raw) - 1

    def _pre_run_cell(self, *_: Any) -> None:
        self._cell_started = time.time()

    def _post_run_cell(self, result: Any) -> None:
        number = self.current_cell()
        stored = getattr(getattr(result, "info", None), "store_history", True)
        error = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        if stored:
            self.seconds[number] = time.time() - self._cell_started
            if error is not None:
                self.failed.add(number)
        run = self._active()
        if run is None or not run.owned_by_this_process():
            return
        first_loop = run._first_loop_at
        if first_loop is not None and stored:
            self.trained.add(number)
            run.process_started_at = first_loop - self._prefix(number, first_loop)
        self.arguments.update(run.args)
        self._end(run, None if error is None else f"{type(error).__name__}: {error}")

    def _prefix(self, number: int, first_loop: float) -> float:
        """The kernel's time executing the cells a replay of the run executes before its
        first loop (at ``first_loop``): the earlier cells it keeps, and this cell up to it."""
        earlier = sum(
            seconds
            for cell, seconds in self.seconds.items()
            if cell < number and cell not in self.trained and cell not in self.failed
        )
        return earlier + max(0.0, first_loop - self._cell_started)

    def start_run(self, paths: ProjectPaths) -> Run:
        """Begin a run in the cell executing now."""
        history: list[str] = self.shell.history_manager.input_hist_raw
        current = self.current_cell()
        cwd = Path.cwd().resolve()
        notebook = notebook_path(self.shell, cwd)
        script = str(notebook) if notebook is not None else None
        filename = _relative_script(paths.root, script)
        cells = [(str(n), self._cell_source(history[n], n)) for n in range(1, current + 1)]
        upto = f"the cells this kernel executed, in order, up to cell [{current}]"
        origin = f"{filename}: {upto}" if notebook is not None else upto
        files: dict[str, bytes] = {}
        if not Path(filename).is_absolute():
            files[filename] = cells_script(cells, origin).encode()
            if notebook is not None:
                files[filename + SAVED_SUFFIX] = notebook.read_bytes()
        if notebook is None and not self._warned_unknown:
            self._warned_unknown = True
            warnings.warn(
                "retrolog cannot tell which notebook this kernel runs (neither __session__ "
                "nor JPY_SESSION_NAME names one): the run is recorded with the cells that "
                "ran, as <interactive>, which replay cannot name. Start the kernel from "
                "Jupyter, or set os.environ['JPY_SESSION_NAME'] = 'train.ipynb' (the "
                "notebook's path) in a cell before the first recording call.",
                RetrologWarning,
                stacklevel=4,
            )
        run = Run(paths, [filename], script, code_files=files)
        for name, value in self.arguments.items():
            run.set_arg(name, value)
        self.carried = set(self.arguments)
        return run

    def _cell_source(self, source: str, number: int) -> str:
        if number in self.trained:
            note = f"# cell [{number}] trained another run: not run again here"
        elif number in self.failed:
            note = f"# cell [{number}] raised in the kernel: not run here"
        elif number in self.replayed:
            note = f"# cell [{number}] replayed past runs: not run again here"
        else:
            return source
        return "\n".join([note, *("# " + line for line in source.splitlines())])


_kernels: dict[int, Kernel] = {}


def follow(shell: Any, active: Callable[[], Run | None], end: Callable[..., None]) -> Kernel:
    """The kernel of ``shell``, followed from now on (once per shell)."""
    kernel = _kernels.get(id(shell))
    if kernel is None:
        kernel = _kernels[id(shell)] = Kernel(shell, active, end)
    return kernel
