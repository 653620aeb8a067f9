"""Listing an object store's files and deleting them safely: what ``retrolog gc`` does to
the objects directory once it knows which keys are live (``retrolog._gc`` decides that).

The two deletions are safe beside writers (docs/store.md, "Garbage collection"):
``remove_if_stale`` renames an object aside before it reads its time, so a writer that
freshened it first keeps it and one that comes later writes it again;
``remove_temp`` leaves a temp file a writer touched after the cutoff.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from retrolog.errors import StoreError
from retrolog.store.objects import LocalObjectStore, check_key


@dataclass(frozen=True)
class StoredFile:
    """An object or temp file in the objects directory."""

    path: Path
    size: int
    mtime: float


def scan_objects(store: LocalObjectStore) -> tuple[list[tuple[str, StoredFile]], list[StoredFile]]:
    """Every object file (with its key) and every leftover temp file in ``store``.

    A file counts as an object only if its name is a valid key whose path, by
    the store's own layout, is where it was found; anything else is left alone.
    """
    objects: list[tuple[str, StoredFile]] = []
    temps: list[StoredFile] = []
    try:
        top = list(os.scandir(store.root))
    except FileNotFoundError:
        return objects, temps
    except OSError as exc:
        raise StoreError(f"Cannot list the object store {store.root}: {exc}.") from exc
    for entry in top:
        if is_temp(entry.name) and entry.is_file(follow_symlinks=False):
            temps.append(_stored(entry))
        elif entry.is_dir(follow_symlinks=False):
            try:
                inner = list(os.scandir(entry.path))
            except OSError as exc:
                raise StoreError(f"Cannot list {entry.path}: {exc}.") from exc
            for item in inner:
                if not item.is_file(follow_symlinks=False):
                    continue
                if is_temp(item.name):
                    temps.append(_stored(item))
                    continue
                key = entry.name + item.name
                try:
                    check_key(key)
                except StoreError:
                    continue
                if store.path(key) == Path(item.path):
                    objects.append((key, _stored(item)))
    return objects, temps


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _stored(entry: os.DirEntry[str]) -> StoredFile:
    st = entry.stat(follow_symlinks=False)
    return StoredFile(Path(entry.path), st.st_size, st.st_mtime)


def remove_if_stale(path: Path, cutoff: float) -> bool:
    """Delete the object file at ``path`` unless it was written at or after ``cutoff``.

    The file is renamed aside first and its time read from there: a writer
    that freshened it before the rename is seen, and one that comes after
    finds no file and writes the object again.
    """
    aside = path.with_name(f".{path.name[:16]}.gc.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise StoreError(f"Cannot delete object file {path}: {exc}.", path=str(path)) from exc
    try:
        if os.stat(aside).st_mtime >= cutoff:
            os.replace(aside, path)  # in use again; a copy written meanwhile is identical
            return False
        os.unlink(aside)
    except FileNotFoundError:
        return False  # a gc running beside this one removed it as a stale temp file
    except OSError as exc:
        raise StoreError(
            f"Cannot delete object file {path} (moved aside to {aside}): {exc}.", path=str(path)
        ) from exc
    return True


def remove_temp(path: Path, cutoff: float) -> bool:
    """Delete a leftover temp file unless a writer touched it at or after ``cutoff``."""
    try:
        if os.stat(path).st_mtime >= cutoff:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False  # renamed into place or removed by its writer meanwhile
    except OSError as exc:
        raise StoreError(f"Cannot delete temp file {path}: {exc}.", path=str(path)) from exc
    return True
