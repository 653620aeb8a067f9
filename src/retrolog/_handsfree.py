"""``retrolog run train.py``: an unmodified script recorded (or replayed) hands-free.

The script is read, its training loops found and rewritten (runtime/handsfree.py), and the
rewritten code run as ``python train.py ...`` would run the file: as ``__main__``, with the
script's own ``sys.argv`` and its directory first on ``sys.path``. The rewritten loops call
:class:`Helpers` (the script's global ``__retrolog_handsfree__``), which enter
``rl.checkpointing`` with the objects that can be checkpointed when the loop starts and
record what was inferred with the run. A replay worker of a hands-free run is started the
same way, so the propagated old version goes through the same rewrite.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from retrolog import _api
from retrolog._replay.forkserver_main import main_namespace
from retrolog.errors import UsageError
from retrolog.runtime import handsfree
from retrolog.runtime.handsfree import Analysis


class Helpers:
    """What the rewritten script calls."""

    def __init__(self, analysis: Analysis) -> None:
        self.analysis = analysis
        self.inferred: dict[str, Any] = {**analysis.as_record(), "objects": {}}
        self._said: set[int] = set()

    def loop(self, name: str, iterable: Iterable[Any]) -> Iterator[Any]:
        return _api.loop(name, iterable)

    @contextlib.contextmanager
    def checkpointing(
        self, index: int, scope: dict[str, Any], module: dict[str, Any]
    ) -> Iterator[None]:
        from retrolog.checkpoint.state import validate_targets

        loop = self.analysis.loops[index]

        def accepts(value: Any) -> bool:
            try:
                validate_targets({"value": value})
            except Exception:
                return False
            return True

        values = {**module, **scope}
        objects, _, uncertain = handsfree.checkpoint_objects(loop, values, accepts)
        uncertain = [*loop.uncertain, *uncertain]
        record = self.inferred["loops"][index]
        record["objects"] = sorted(objects)
        record["uncertain"] = uncertain
        self.inferred["objects"][str(loop.line)] = sorted(objects)
        run = _api.current_run()
        set_inferred = getattr(run, "set_handsfree", None)
        if set_inferred is not None:
            set_inferred(self.inferred)
        where = f"{self.analysis.filename}:{loop.line}"
        if index not in self._said:
            self._said.add(index)
            if uncertain:
                print(
                    f"retrolog run: the loop at {where} is recorded without checkpoints, so a "
                    f"replay executes it: {'; '.join(uncertain)}.",
                    file=sys.stderr,
                )
        if uncertain or not objects:
            yield
            return
        with _api.checkpointing(**objects):
            yield


def run_script(script: str, args: list[str]) -> None:
    """Run ``script`` hands-free with ``args`` as its command line, as ``__main__``."""
    execute(prepare(script, args))


def prepare(script: str, args: list[str]) -> Any:
    """Read, analyse, rewrite and compile ``script``; set up the process as ``python script
    args`` would be. Returns what :func:`execute` runs. Raises UsageError for a file that
    cannot be read or compiled."""
    path = Path(script)
    if not path.is_file():
        raise UsageError(
            f"retrolog run: no script {script!r}. Give the path of a Python file, then its own "
            "arguments: retrolog run train.py --epochs 3."
        )
    source = _read(path)
    filename = str(path.resolve())
    try:
        code, analysis = handsfree.compile_script(source, filename)
    except SyntaxError as exc:
        raise UsageError(
            f"retrolog run: {script} is not valid Python (line {exc.lineno}: {exc.msg}); "
            "fix it and run again."
        ) from exc
    analysis.filename = script
    sys.argv[:] = _command_line(script, args)
    _api.use_argv(sys.argv)
    # As ``python script`` does: the script's directory first on the path.
    directory = os.path.dirname(filename)
    if sys.path and not getattr(sys.flags, "safe_path", False):
        sys.path[0] = directory
    namespace = main_namespace(filename)
    namespace[handsfree.HELPER] = Helpers(analysis)
    return code, namespace


def execute(prepared: Any) -> None:
    """Run the script :func:`prepare` made ready; its exceptions are the script's own."""
    code, namespace = prepared
    exec(code, namespace)


def explain_script(script: str) -> str:
    """What ``retrolog run --explain`` prints: the analysis, nothing run."""
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"retrolog run --explain: no script {script!r}.")
    try:
        analysis = handsfree.analyse(_read(path), script)
    except SyntaxError as exc:
        raise UsageError(
            f"retrolog run --explain: {script} is not valid Python (line {exc.lineno}: {exc.msg})."
        ) from exc
    return handsfree.explain(analysis)


def _command_line(script: str, args: list[str]) -> list[str]:
    """The script's own command line, ``--kwargs`` included: importing retrolog took that
    flag out of the CLI's ``sys.argv`` before click parsed it, so it is read from the
    command line as retrolog found it at import."""
    full = _api.original_argv()
    if "run" in full:
        start = full.index("run") + 1
        if script in full[start:]:
            return full[full.index(script, start) :]
    return [script, *args]


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"retrolog run: cannot read {path}: {exc}.") from exc
