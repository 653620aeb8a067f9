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
- a linked file that is opened for writing, truncated, hard-linked, or has its
  mode or times changed becomes a copy of the project's file, and the
  operation applies to the copy.

The user's files are all that the project's paths reach, links followed: a
project's ``out`` may itself link to a scratch disk (``out -> /scratch/me/out``),
and a link committed with the code may lead there too. A link of the checkout is
the user's when its own target names a path through the project, when it
resolves into the project, or when it ends where the project's path of the same
name ends; the entries of a directory copied on write link through the old
link's target, so they stay recognisably the user's.

Removing or renaming a link only touches the link. A write that names a path
in the project some other way (an absolute path through it, ``..`` after a link
to the user's files) is refused with ``PermissionError``. Writes below the store
(the worker's own output) and outside the project (``/tmp``, caches, a scratch
path the script names itself) are left alone.

What the hook does not see: writes made by C code that does not go through
Python's file functions, and by subprocesses the script starts (they inherit
the checkout as their directory, not the hook). ``torch.save`` to a path is
such a writer (torch's C++ opens the file), so its opener is guarded too.
docs/replay.md says so.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from retrolog.runtime.numerics import after_import

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
        self.project_as_named = os.path.abspath(project)
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
            elif event == "os.link":  # a second name for the user's file would write it
                self.before_write(args[0], follows=True)
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
            self.privatize(
                self._as_the_system_reads(os.path.join(os.getcwd(), text)), follows=follows
            )
        finally:
            _state.busy = False

    def privatize(self, path: str, *, follows: bool) -> None:
        if _inside(path, self.checkout):
            parts = path[len(self.checkout) :].split(os.sep)[1:]
            current = self.checkout
            for index, part in enumerate(parts):
                current = f"{current}{os.sep}{part}"
                last = index == len(parts) - 1
                if not os.path.islink(current):
                    continue
                if not self._users(current, parts[: index + 1]):
                    # A link elsewhere (not the user's project): not ours to guard, unless
                    # it leads on into the project, where no copy can stand in.
                    if self._reaches_project(path):
                        self._refuse(path)
                    return
                if last and not follows:
                    return  # the operation acts on the link itself
                _copy_on_write(Path(current))
            return
        if self._reaches_project(path):
            self._refuse(path)

    def _refuse(self, path: str) -> None:
        raise PermissionError(
            f"retrolog replay: the replayed script tried to write {path}, which is in "
            f"your project ({self.project_as_named}). A replay never changes your files: "
            "write relative to the script's directory (the replay's own checkout) instead."
        )

    def _as_the_system_reads(self, path: str) -> str:
        """``path`` (absolute) without ``.`` and ``..``, each ``..`` taken as the system takes it.

        After a link, ``..`` is the parent of where the link leads, not of the link:
        ``out/sub/../x`` with ``out`` a link to the user's directory is the user's
        ``x``, which no copy in the checkout can stand for; such a path is refused.
        """
        parts = path.split(os.sep)
        if ".." not in parts:
            return os.path.normpath(path)  # `.` and doubled separators: as the system reads
        current = os.sep
        for part in parts:
            if part in ("", "."):
                continue
            if part != "..":
                current = os.path.join(current, part)
                continue
            real = os.path.realpath(current)
            if real != current and self._leads_to_users(current):
                self._refuse(path)
            current = os.path.dirname(real)
        return current

    def _leads_to_users(self, path: str) -> bool:
        """Whether ``path`` goes through a link to the user's files."""
        if not _inside(path, self.checkout):
            return self._reaches_project(path)
        parts = path[len(self.checkout) :].split(os.sep)[1:]
        current = self.checkout
        for index, part in enumerate(parts):
            current = f"{current}{os.sep}{part}"
            if os.path.islink(current):
                return self._users(current, parts[: index + 1]) or self._reaches_project(path)
        return False

    def _users(self, link: str, parts: list[str]) -> bool:
        """Whether writing through ``link`` (a link of the checkout) changes the user's files.

        It does when the link leads through the project, by its literal target (the
        checkout's links name the project's paths, which may themselves be links to a
        scratch disk) or once resolved, or when it ends where the project's own path of
        the same name ends (a link committed with the code, to a directory elsewhere).
        """
        try:
            target = os.path.join(os.path.dirname(link), os.readlink(link))
        except OSError:  # removed meanwhile: the path is judged by where it leads now
            return False
        if self._reaches_project(target):
            return True
        real = os.path.realpath(link)
        if self._allowed(real):
            return False
        return real == os.path.realpath(os.path.join(self.project_as_named, *parts))

    def _reaches_project(self, path: str) -> bool:
        """Whether the system, resolving ``path``, passes through the project.

        The path itself or any directory on its way may be a link; a path under the
        store (the worker's own output) does not count. One ``lstat`` per component: this
        runs before every write outside the checkout (a library's cache, ``/tmp``).
        """
        resolved: list[str] = []  # where the system is after each component
        current = os.sep
        for part in path.split(os.sep):
            if part in ("", "."):
                continue
            if part == "..":
                current = os.path.dirname(current)
            else:
                current = f"{current}{part}" if current == os.sep else f"{current}{os.sep}{part}"
                if os.path.islink(current):
                    current = os.path.realpath(current)
            resolved.append(current)
        for place in reversed(resolved):
            if self._allowed(place):
                return False
            if _inside(place, self.project):
                return True
        return False

    def _allowed(self, path: str) -> bool:
        return any(_inside(path, a) for a in self.allowed)


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _copy_on_write(link: Path) -> None:
    """Replace ``link`` by a private directory of links, or a private copy of the file.

    The new links name the entries through the old link's own target, so an entry that
    is the user's stays recognisably the user's (a project path that links on, to a
    scratch disk) when it is written in its turn.
    """
    target = os.path.join(link.parent, os.readlink(link))
    if os.path.isdir(target):
        names = os.listdir(target)
        link.unlink()
        link.mkdir()
        for name in names:
            os.symlink(os.path.join(target, name), link / name)
    else:
        link.unlink()
        if os.path.exists(target):
            shutil.copy2(target, link)


def _guard_torch_save(guard: _Guard) -> None:
    """Guard ``torch.save`` to a path, which torch's C++ writer opens unseen by the hook."""

    def wrap(torch: ModuleType) -> None:
        serialization = getattr(torch, "serialization", None)
        opener = getattr(serialization, "_open_zipfile_writer", None)
        if opener is None or getattr(opener, "retrolog_guarded", False):
            return

        def guarded(name_or_buffer: Any) -> Any:
            if isinstance(name_or_buffer, (str, bytes, os.PathLike)):
                guard.before_write(name_or_buffer, follows=True)
            return opener(name_or_buffer)

        guarded.retrolog_guarded = True  # type: ignore[attr-defined]
        serialization._open_zipfile_writer = guarded  # type: ignore[union-attr]

    after_import("torch", wrap, key="isolation")


def install(checkout: Path, project: Path, allowed: list[Path]) -> None:
    """Guard this process's writes (once; an audit hook cannot be removed)."""
    if getattr(install, "done", False):
        return
    guard = _Guard(checkout, project, allowed)
    sys.addaudithook(guard)
    _guard_torch_save(guard)
    install.done = True  # type: ignore[attr-defined]
