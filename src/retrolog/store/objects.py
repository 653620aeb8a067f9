"""The content-addressed object store: immutable blobs named by their sha256.

Checkpoints are written as one object per tensor or array plus a manifest, so
identical content (frozen layers, a shared base model) is stored once. Every
read is verified against the key, so a damaged file is reported, never
restored. :class:`ObjectStore` is the interface; :class:`LocalObjectStore`
keeps objects in a directory::

    objects/
        3f/
            a9c1...   the object whose sha256 is 3fa9c1...
        .tmp files    only while a write is in flight (name starts with '.')

The format is the raw bytes, so a later codec (compression) slots in behind
the same interface without changing the keys.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import secrets
from pathlib import Path

from retrolog.errors import CorruptObjectError, StoreError

_HEX = frozenset("0123456789abcdef")
_KEY_LENGTH = 64  # hex digits of a sha256


def object_key(data: bytes) -> str:
    """The key of ``data``: its sha256 as 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


def check_key(key: str) -> None:
    """Raise StoreError unless ``key`` looks like an object key.

    Keys become file names, so anything else (``..``, a slash) is refused
    before it reaches the file system.
    """
    if not (isinstance(key, str) and len(key) == _KEY_LENGTH and _HEX.issuperset(key)):
        raise StoreError(
            f"{key!r} is not an object key; keys are the sha256 of the object's content "
            "as 64 lowercase hex digits, as returned by put()."
        )


class ObjectStore(abc.ABC):
    """Immutable blobs addressed by the sha256 of their content."""

    @abc.abstractmethod
    def put(self, data: bytes) -> str:
        """Store ``data`` and return its key; storing content that is already there is a no-op."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The content stored under ``key``, verified against the key.

        Raises StoreError when there is no such object and CorruptObjectError
        when the stored content does not hash to ``key``.
        """

    @abc.abstractmethod
    def has(self, key: str) -> bool:
        """Whether an object is stored under ``key`` (its content is not verified)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object stored under ``key``; a missing object is not an error."""


class LocalObjectStore(ObjectStore):
    """Objects as files in a local directory, fanned out by the first two hex digits.

    ``root`` is created on the first write. ``durable=False`` skips the fsync
    before the rename, for scratch stores and tests where a power loss does
    not matter; a torn write is still caught by the checksum on read.
    """

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file that holds (or would hold) the object ``key``."""
        check_key(key)
        return self.root / key[:2] / key[2:]

    def put(self, data: bytes) -> str:
        """Store ``data`` atomically and return its key."""
        key = object_key(data)
        path = self.path(key)
        try:
            # A file of the right size is the object: content addressing makes
            # rewriting it pointless. A file of the wrong size is a torn or
            # damaged copy, which this write repairs.
            if path.stat().st_size == len(data):
                return key
        except (FileNotFoundError, NotADirectoryError):
            pass  # not there yet; a store that cannot be created is reported by the write
        except OSError as exc:
            raise StoreError(f"Cannot read object file {path}: {exc}", path=str(path)) from exc
        self._write_atomically(path, data)
        return key

    def _write_atomically(self, path: Path, data: bytes) -> None:
        # The temp file sits in the destination directory so os.replace is a
        # same-filesystem rename, atomic on POSIX and Windows. Each writer has
        # its own random temp name, so concurrent puts of one key (several
        # processes of a grid search) race only on the rename, and both
        # renames install identical content.
        tmp = path.with_name(f".{path.name[:16]}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            # On Windows a rename onto a file another process holds open
            # fails; the object is there all the same.
            if _size_or_none(path) == len(data):
                return
            raise StoreError(
                f"Cannot write object file {path}: {exc}. Check that the directory "
                f"{self.root} is writable and its file system is not full.",
                path=str(path),
            ) from exc

    def get(self, key: str) -> bytes:
        """The verified content of object ``key``."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise StoreError(
                f"No object {key} in the object store {self.root} (expected at {path}). "
                "It was deleted (garbage collection, a retention policy, or by hand) or the "
                "store was copied incompletely; anything that references it cannot be loaded.",
                path=str(path),
            ) from exc
        except OSError as exc:
            raise StoreError(f"Cannot read object file {path}: {exc}", path=str(path)) from exc
        actual = object_key(data)
        if actual != key:
            raise CorruptObjectError(
                f"Object {key} at {path} is corrupt: its {len(data)} bytes hash to {actual}, "
                "so the file was damaged or truncated after it was written. Delete the file; "
                "a checkpoint that references it cannot be restored, so replay has to execute "
                "those blocks again (or restore the file from a backup).",
                path=str(path),
                key=key,
            )
        return data

    def has(self, key: str) -> bool:
        """Whether object ``key`` has a file in the store."""
        path = self.path(key)
        try:
            return path.is_file()
        except OSError as exc:
            raise StoreError(f"Cannot read object file {path}: {exc}", path=str(path)) from exc

    def delete(self, key: str) -> None:
        """Remove object ``key`` if it is there."""
        path = self.path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"Cannot delete object file {path}: {exc}", path=str(path)) from exc


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
