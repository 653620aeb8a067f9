"""Temporary checkouts of a run's code version, with the statements propagated in.

A checkout is a fresh directory under the system's temp dir: the run's commit
materialised there (never a worktree of the user's repository, so their HEAD,
index and branches cannot be touched), the propagated script written over the
old one, and every top-level path of the project that the code version lacks
(ignored data directories like ``./data``, files skipped for size) linked
back, so relative paths resolve as they did when the run was recorded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from retrolog.store.processes import process_alive
from retrolog.versions.git import materialize

_NEVER_LINKED = {".git", ".retrolog"}
_PREFIX = "retrolog-checkout-"  # then the coordinator's pid


def make_checkout(
    *,
    root: Path | None,
    store: Path,
    git_dir: Path,
    commit: str,
    filename: str,
    script_source: str,
    skipped: list[str],
    prefix: str,
) -> Path:
    """Materialise ``commit`` into a new temporary directory prepared for a replay worker.

    root: the project whose paths the code version lacks are linked in; None on a
        machine that does not have it (a Ray node: docs/replay-on-ray.md).
    """
    # The coordinator's pid in the name: a checkout a killed coordinator left behind is
    # recognised, and removed, by the next replay or gc (sweep_checkouts).
    dest = Path(tempfile.mkdtemp(prefix=checkout_prefix(prefix)))
    try:
        materialize(git_dir, commit, dest)
        target = dest / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(script_source)
        if root is not None:
            _link_missing(root, store, dest, skipped)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def checkout_prefix(prefix: str) -> str:
    """The name a temporary directory of this process's replay work starts with.

    It carries this process's pid, so that :func:`sweep_checkouts` removes it once the
    process is gone, however it ended.
    """
    return f"{_PREFIX}{os.getpid()}-{prefix}-"


def _link_missing(root: Path, store: Path, dest: Path, skipped: list[str]) -> None:
    for entry in root.iterdir():
        if entry.name in _NEVER_LINKED or entry.resolve() == store.resolve():
            continue
        if not (dest / entry.name).exists() and not (dest / entry.name).is_symlink():
            os.symlink(entry, dest / entry.name)
    for relpath in skipped:
        source = root / relpath
        link = dest / relpath
        if source.exists() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(source, link)


def remove_checkout(path: Path) -> None:
    """Delete a checkout; the links in it are removed, never followed."""
    shutil.rmtree(path, ignore_errors=True)


def sweep_checkouts() -> list[Path]:
    """Remove checkouts whose coordinator is gone (killed before it could clean up).

    Only directories of this user named ``retrolog-checkout-<pid>-...`` whose pid is not a live
    process are removed; their links are removed, never followed.
    """
    removed: list[Path] = []
    tmp = Path(tempfile.gettempdir())
    try:
        entries = list(tmp.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(_PREFIX):
            continue
        pid_text = name[len(_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not entry.is_dir() or entry.is_symlink() or info.st_uid != os.getuid():
            continue
        if process_alive(int(pid_text), None):
            continue
        remove_checkout(entry)
        removed.append(entry)
    return removed
