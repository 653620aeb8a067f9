"""Where a project's store lives.

The project root is the git work tree containing the current directory, or the
current directory itself outside git. The store is ``<root>/.retrolog`` unless
``RETROLOG_STORE``, or ``store`` in the root's pyproject.toml ``[tool.retrolog]``,
names another directory (retrolog/_config.py).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from retrolog import _config
from retrolog.errors import StoreError, UsageError

STORE_ENV = "RETROLOG_STORE"
STORE_DIRNAME = ".retrolog"

# Written into the store so git never sees it, without touching the user's .gitignore.
_STORE_GITIGNORE = "# retrolog's store: never part of the project's history\n*\n"


@dataclass(frozen=True)
class ProjectPaths:
    """The directories a run or a reader works with."""

    root: Path  # project root: git top level, or the cwd outside git
    store: Path  # the .retrolog directory (or RETROLOG_STORE)
    in_git: bool  # whether root is a git work tree of the user's

    @property
    def projid(self) -> str:
        return self.root.name

    @property
    def database(self) -> Path:
        return self.store / "retrolog.db"

    @property
    def objects(self) -> Path:
        return self.store / "objects"

    @property
    def private_git_dir(self) -> Path:
        """The git directory retrolog keeps for projects that are not git repositories."""
        return self.store / "git"


def git_toplevel(start: Path) -> Path | None:
    """The top of the git work tree containing ``start``, or None outside git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=start,
            capture_output=True,
            text=True,
            errors="surrogateescape",  # a directory name that is not UTF-8 stays its bytes
            check=False,
        )
    except FileNotFoundError:  # no git binary: behave as outside git
        return None
    if out.returncode != 0:
        return None
    top = out.stdout.strip()
    return Path(top).resolve() if top else None


def locate(cwd: Path | None = None) -> ProjectPaths:
    """Find the project root and store for ``cwd`` (default: the current directory).

    Also takes the project's settings files for the settings' readers
    (:func:`retrolog._config.use`).
    """
    here = (cwd or Path.cwd()).resolve()
    top = git_toplevel(here)
    root = top if top is not None else here
    _require_text_path(root, "the project")
    store = _config.use(root, root / STORE_DIRNAME)
    _require_text_path(store, "the store")
    return ProjectPaths(root=root, store=store, in_git=top is not None)


def storable_text(text: str) -> str:
    """``text`` as the store keeps it: code points UTF-8 cannot hold (lone surrogates,
    e.g. from a file name decoded with ``surrogateescape``) written as ``\\udcxx``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _require_text_path(path: Path, what: str) -> None:
    """Refuse a path holding bytes that are not UTF-8 (decoded as lone surrogates): the
    store names its files and a run's code by path as text, and SQLite takes only text."""
    shown = storable_text(str(path))
    if shown != str(path):
        raise UsageError(
            f"retrolog cannot use {what} at {shown}: its path holds bytes that are not UTF-8 "
            "text, and the store keeps and opens paths as text. Rename the directory to a "
            "UTF-8 name (or, for the store, set RETROLOG_STORE to a path that is); nothing "
            "was recorded or read."
        )


def make_store_dir(paths: ProjectPaths, *, objects: bool = True) -> None:
    """The store directory, made with a .gitignore that keeps it out of the project's
    git status (its database, or with PostgreSQL its objects, caches and working
    copies); ``objects``: with its objects directory. Raises StoreError when it
    cannot be made."""
    try:
        paths.store.mkdir(parents=True, exist_ok=True)
        if objects:
            paths.objects.mkdir(exist_ok=True)
        if paths.store.name == STORE_DIRNAME or paths.store.parent == paths.root:
            ignore = paths.store / ".gitignore"
            if not ignore.exists():
                ignore.write_text(_STORE_GITIGNORE)
    except OSError as exc:
        raise StoreError(
            f"Cannot create the retrolog store at {paths.store}: {exc}. Make the project "
            "directory writable, or set RETROLOG_STORE to a writable directory.",
            path=str(paths.store),
        ) from exc
