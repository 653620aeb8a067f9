"""How long a recording's prefix spent importing installed packages after its first retrolog call.

A replay worker forked from a fork server finds the run's installed modules loaded
(runtime/modules.py, _replay/forkserver.py): of the recorded prefix it repeats only
the script's own work. The prefix before the first retrolog call is the interpreter
and the imports (``imports_seconds``, taken from the loop clock); after it, scripts
still import: ``torch.optim`` imports ``torch._dynamo`` at the first optimizer, a
second or more on a 2-core machine. Subtracting the fork server's own import time,
measured later in another process, leaves the script's work as the difference of
two figures each noisier than it is long. So from the end of the run's set-up to its
first top-level loop, the runtime times those imports itself.

:class:`ImportClock` wraps importlib's ``_find_and_load``, which an ``import``
statement, ``__import__`` and ``importlib.import_module`` all call for a module not
yet in ``sys.modules``, and adds up the outermost such loads made on the recording
thread of the recording process, of modules a fork server would pre-import: not
the standard library, not retrolog, not the project's own files. Loads already
loaded cost nothing and are not seen. It changes no import's result or error; when
stopped it puts the original back, unless something wrapped it since, in which case
its wrapper stays in place and passes every call through.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from retrolog.runtime.modules import STDLIB

__all__ = ["ImportClock"]


class ImportClock:
    """Times the installed packages' imports between :meth:`start` and :meth:`stop`."""

    def __init__(self, root: Path) -> None:
        self._root = str(root.resolve()).rstrip("/") + "/"
        self._thread = threading.get_ident()
        self._pid = os.getpid()
        self._seconds = 0.0
        self._inside = False  # within a timed load: nested loads are part of its time
        self._on = False
        self._original: Any = None
        self._wrapper: Any = None

    def start(self) -> None:
        """Wrap importlib's loader (a no-op where it has no ``_find_and_load``)."""
        import importlib._bootstrap as bootstrap

        original = getattr(bootstrap, "_find_and_load", None)
        if not callable(original) or self._wrapper is not None:
            return
        clock = self

        def _find_and_load(name: Any, *args: Any, **kwargs: Any) -> Any:
            if (
                not clock._on
                or clock._inside
                or threading.get_ident() != clock._thread
                or os.getpid() != clock._pid
                or not _installed_name(name)
            ):
                return original(name, *args, **kwargs)
            clock._inside = True
            started = time.perf_counter()
            try:
                module = original(name, *args, **kwargs)
            finally:
                clock._inside = False
            if not clock._in_project(module):
                clock._seconds += time.perf_counter() - started
            return module

        self._original, self._wrapper = original, _find_and_load
        self._on = True
        bootstrap._find_and_load = _find_and_load  # type: ignore[attr-defined]

    def stop(self) -> float | None:
        """Unwrap; the seconds counted, or None if it never ran."""
        import importlib._bootstrap as bootstrap

        if self._wrapper is None:
            return None
        self._on = False
        if getattr(bootstrap, "_find_and_load", None) is self._wrapper:
            bootstrap._find_and_load = self._original  # type: ignore[attr-defined]
        self._wrapper = None
        return self._seconds

    def _in_project(self, module: object) -> bool:
        path = getattr(module, "__file__", None) if isinstance(module, ModuleType) else None
        return isinstance(path, str) and path.startswith(self._root)


def _installed_name(name: object) -> bool:
    """Whether a module of this name may be one a fork server pre-imports."""
    if not isinstance(name, str):
        return False
    top = name.partition(".")[0]
    return top not in STDLIB and top != "retrolog"
