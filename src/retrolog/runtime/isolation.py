"""A replay worker writes into its own checkout, never into the user's project.

A checkout links back the project's top-level paths its code version lacks
(an ignored ``data/``, ``out/``, ``checkpoints/``) so a replayed script reads
what the run read. Written through such a link, a file would land in the
user's tree: a replayed ``torch.save(model, "out/model.pt")`` would overwrite
today's model. So a worker installs an audit hook (PEP 578) at ``import
retrolog`` that sees every file operation Python makes and, before one that
writes through a link into the project, makes the path private to the
checkout, copy on write:

- a linked directory on the way to the path becomes a real directory of the
  checkout whose entries link to the project's (one level, only along the
  written path, so a large data directory costs nothing until written into);
- a linked file that is opened for writing, truncated, or has its mode or
  times changed becomes a copy of the project's file, and the operation
  applies to the copy.

Removing or renaming a link only touches the link. A write that names a path
in the project some other way (an absolute path, ``..`` out of the checkout)
is refused with ``PermissionError``. Writes below the store (the worker's own
output) and outside the project (``/tmp``, caches) are left alone.

What this does not see: writes made by C code that does not go through
Python's file functions, and by subprocesses the script starts (they inherit
the checkout as their directory, not the hook). docs/replay.md says so.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# Events whose first argument is a path the call changes (or, for link targets, creates).
_CHANGES_FIRST = {"os.truncate", "os.chmod", "os.chown", "os.utime", "os.mkdir", "os.remove",
                  "os.rmdir", "shutil.rmtree", "os.setxattr", "os.removexattr"}  # fmt: skip
_CHANGES_SECOND = {"os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.copymode",
                   "shutil.copystat", "shutil.move"}  # fmt: skip
# Of those, the ones that act on a link itself rather than on what it points to.
_ON_THE_LINK = {"os.remove", "os.rmdir", "shutil.rmtree", "os.rename", "shutil.move"}
_MOVES = {"os.rename", "shutil.move"}

_state = threading.local()


class _Guard:
    def __init__(self, checkout: Path, project: Path, allowed: list[Path]) -> None:
        self.checkout = str(checkout.resolve())
        self.project = str(project.resolve())
        self.allowed = [str(p.resolve()) for p in allowed]

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = [*args, None, None, None][:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if writes:
                self.before_write(path, follows=True)
        elif event in _CHANGES_FIRST and args:
            self.before_write(args[0], follows=event not in _ON_THE_LINK)
        elif event in _CHANGES_SECOND and len(args) > 1:
            if event in _MOVES:  # the source leaves its directory: that one changes too
                self.before_write(args[0], follows=False)
            self.before_write(args[1], follows=event not in _ON_THE_LINK)

    def before_write(self, path: Any, *, follows: bool) -> None:
        if isinstance(path, int) or path is None or getattr(_state, "busy", False):
            return
        try:
            text = os.fsdecode(path)
        except TypeError:
            return
        _state.busy = True
        try:
            self.privatize(os.path.abspath(text), follows=follows)
        finally:
            _state.busy = False

    def privatize(self, path: str, *, follows: bool) -> None:
        if _inside(path, self.checkout):
            parts = Path(path).relative_to(self.checkout).parts
            current = Path(self.checkout)
            for index, part in enumerate(parts):
                current = current / part
                last = index == len(parts) - 1
                if not current.is_symlink():
                    continue
                target = os.path.realpath(current)
                if not _inside(target, self.project) or self._allowed(target):
                    return  # a link elsewhere (not the user's project): not ours to guard
                if last and not follows:
                    return  # the operation acts on the link itself
                _copy_on_write(current, Path(target))
            return
        resolved = os.path.realpath(path)
        if _inside(resolved, self.project) and not self._allowed(resolved):
            raise PermissionError(
                f"retrolog replay: the replayed script tried to write {path}, which is in "
                f"your project ({self.project}). A replay never changes your files: write "
                "relative to the script's directory (the replay's own checkout) instead."
            )

    def _allowed(self, path: str) -> bool:
        return any(_inside(path, a) for a in self.allowed)


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _copy_on_write(link: Path, target: Path) -> None:
    """Replace ``link`` by a private directory of links, or a private copy of the file."""
    if target.is_dir():
        entries = list(target.iterdir())
        link.unlink()
        link.mkdir()
        for entry in entries:
            os.symlink(entry, link / entry.name)
    else:
        link.unlink()
        if target.exists():
            shutil.copy2(target, link)


def install(checkout: Path, project: Path, allowed: list[Path]) -> None:
    """Guard this process's writes (once; an audit hook cannot be removed)."""
    if getattr(install, "done", False):
        return
    sys.addaudithook(_Guard(checkout, project, allowed))
    install.done = True  # type: ignore[attr-defined]
