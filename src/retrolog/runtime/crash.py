"""How and where an uncaught exception ended a script: recorded, replayed, compared.

A run that an exception ended is stored as crashed with ``runs.error`` holding
:meth:`Crash.text`: the exception's type and message, then the place in the
project's own code it was raised from (``[at train.py:25 in train_epoch]``). A
replay of that run is expected to stop at the same place with the same type of
exception; its worker reports its own :class:`Crash` (with the recorded context
it was in), and the coordinator compares the two (``_replay/replayer.py``).
"""

from __future__ import annotations

import builtins
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from retrolog import errors


def _is_store_error(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, errors.StoreError)


# Exceptions whose cause is outside the script (Ctrl-C, the machine's memory, the store
# failing under the recording run): a replay is not expected to meet them again, so
# running on past them is not a failure.
_FROM_OUTSIDE = frozenset(
    {"KeyboardInterrupt", "MemoryError", "OutOfMemoryError"}
    | {name for name in dir(errors) if _is_store_error(getattr(errors, name))}
)

_SITE = re.compile(
    r"^(?P<head>.*) \[at (?P<file>[^\n]+):(?P<line>\d+) in (?P<function>[^\n\]]+)\]$", re.S
)
_HEAD = re.compile(r"^(?P<type>[A-Za-z_][\w.]*): ?(?P<message>.*)$", re.S)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Crash:
    """An uncaught exception: its type name and message, and the project line it came from.

    file is relative to the project's root (a replay worker's checkout stands for it),
    with ``/`` separators; file, line and function are None when no frame of the
    traceback is in the project's own code (or the run was recorded without them).
    """

    type: str
    message: str
    file: str | None = None
    line: int | None = None
    function: str | None = None

    @classmethod
    def of(
        cls,
        exc_type: builtins.type[BaseException],
        exc: BaseException,
        tb: TracebackType | None,
        root: Path,
    ) -> Crash:
        """The crash ``exc`` makes, placed at the last traceback frame in ``root``'s code."""
        file = line = function = None
        for frame in reversed(traceback.extract_tb(tb)):
            relative = _in_project(frame.filename, root)
            if relative is not None:
                file, line, function = relative, frame.lineno, frame.name
                break
        try:
            message = str(exc)
        except Exception:  # an exception whose __str__ fails still ended the run
            message = f"<{exc_type.__name__} that cannot be printed>"
        return cls(exc_type.__name__, message, file, line, function)

    @classmethod
    def parse(cls, text: str | None) -> Crash | None:
        """The crash a run's stored error describes; None when it names no exception."""
        if not text:
            return None
        site = _SITE.match(text)
        head = _HEAD.match(site.group("head") if site else text)
        if head is None:
            return None
        if site is None:
            return cls(head.group("type"), head.group("message"))
        return cls(
            head.group("type"),
            head.group("message"),
            site.group("file"),
            int(site.group("line")),
            site.group("function"),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Crash:
        return cls(
            str(data["type"]),
            str(data.get("message", "")),
            data.get("file"),
            data.get("line"),
            data.get("function"),
        )

    def text(self) -> str:
        """The stored form (``runs.error``): readable, and read back by :meth:`parse`."""
        head = f"{self.type}: {self.message}"
        if self.file is None or self.line is None:
            return head
        return f"{head} [at {self.file}:{self.line} in {self.function}]"

    def place(self) -> str:
        """Where it was raised, for a report."""
        if self.file is None:
            return "a place not recorded"
        return f"{self.file}, line {self.line}, in {self.function}"

    @property
    def from_outside(self) -> bool:
        """Whether its cause lies outside the script (an interrupt, memory running out)."""
        if self.type in _FROM_OUTSIDE:
            return True
        return self.type == "RuntimeError" and "out of memory" in self.message.lower()


def _in_project(filename: str, root: Path) -> str | None:
    """``filename`` relative to ``root`` when it is the project's own code, else None."""
    if filename.startswith("<"):
        return None
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE + os.sep):
        return None
    relative = _relative(path, os.path.abspath(root))
    if relative is None:  # the root or the file reached through a symbolic link
        relative = _relative(os.path.realpath(path), os.path.realpath(root))
    if relative is None:
        return None
    # An environment inside the project (.venv/lib/.../site-packages) is not its code.
    if {"site-packages", "dist-packages"} & set(relative.parts):
        return None
    if path.startswith(os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep):
        return None
    return relative.as_posix()


def _relative(path: str, root: str) -> Path | None:
    try:
        return Path(path).relative_to(root)
    except ValueError:
        return None
