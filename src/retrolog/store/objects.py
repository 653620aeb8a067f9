"""The content-addressed object store: immutable objects named by a hash of their content.

Checkpoints are written as one object per tensor or array plus a manifest, so
identical content (frozen layers, a shared base model) is stored once. Every
read is verified, so a damaged file is reported, never restored.
:class:`ObjectStore` is the interface; :class:`LocalObjectStore` keeps
objects in a directory::

    objects/
        3f/
            a9c1...   the object whose key is 3fa9c1...
        .tmp files    only while a write is in flight (name starts with '.')

An object is one of two kinds, told apart by the length of its key
(docs/checkpoint-storage.md has the byte layout):

- **raw**: the file is the bytes given to :meth:`ObjectStore.put`, and the key
  is their sha256 (64 hex digits). Manifests, pickles and every object of a
  ``retrolog.snapshot/1`` checkpoint are raw.
- **framed**: the bytes given to ``put`` are a *frame* built by :func:`frame`:
  a 48-byte header (magic, key, payload length, xxh3-128 of the payload) and
  a payload. The key (32 hex digits) is chosen by whoever built the frame; the
  checkpoint codec uses the xxh3-128 of a tensor's dtype, shape and raw bytes,
  so an unchanged tensor is found by key *before* it is compressed, and the
  payload holds its compressed bytes. The store checks the header and the
  payload checksum on read; the codec checks the content hash after
  decompression.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import hashlib
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from retrolog.errors import CorruptObjectError, StoreError

_HEX = frozenset("0123456789abcdef")
RAW_KEY_LENGTH = 64  # hex digits of a sha256
FRAMED_KEY_LENGTH = 32  # hex digits of a 128-bit key

# PNG-style: a non-ASCII first byte so no text (a JSON manifest) starts like
# a frame, and \r\n so a file mangled by line-ending conversion is caught.
FRAME_MAGIC = b"\x89RLOBJ\r\n"
_FRAME_TAIL = struct.Struct("<16sQ16s")  # key, payload length, xxh3-128 of the payload
FRAME_HEADER_SIZE = len(FRAME_MAGIC) + _FRAME_TAIL.size  # 48
# A read-only shared mapping, its pages read in by the mmap call itself (Linux) so that
# decompression does not fault them in one by one; None where mmap takes no flags.
_MAP_FLAGS: int | None = (
    mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0) if hasattr(mmap, "MAP_SHARED") else None
)


def object_key(data: bytes) -> str:
    """The key ``put(data)`` stores ``data`` under.

    The key a frame carries (see :func:`frame`), or else the sha256 of the bytes
    as 64 lowercase hex digits.
    """
    key = frame_key(data)
    return hashlib.sha256(data).hexdigest() if key is None else key


def is_framed_key(key: str) -> bool:
    """Whether ``key`` (a valid key) names a framed object rather than a raw one."""
    return len(key) == FRAMED_KEY_LENGTH


def check_key(key: str) -> None:
    """Raise StoreError unless ``key`` looks like an object key.

    Keys become file names, so anything else (``..``, a slash) is refused
    before it reaches the file system.
    """
    if not (
        isinstance(key, str)
        and len(key) in (RAW_KEY_LENGTH, FRAMED_KEY_LENGTH)
        and _HEX.issuperset(key)
    ):
        raise StoreError(
            f"{key!r} is not an object key; keys are 64 (the sha256 of a raw object) or 32 "
            "(a framed object) lowercase hex digits, as returned by put()."
        )


def frame(key: str, *parts: bytes | bytearray | memoryview | Any) -> bytes:
    """The bytes to ``put`` so that the concatenated ``parts`` are stored under ``key``.

    ``key`` is 32 lowercase hex digits; the caller vouches that it identifies
    the content: content addressing means a second put of the same key keeps
    the first object. Parts are any contiguous buffers (bytes, numpy arrays).
    :meth:`ObjectStore.put_framed` stores the same object without joining
    the parts into one ``bytes`` first.
    """
    return b"".join(framed(key, *parts))


def framed(key: str, *parts: bytes | bytearray | memoryview | Any) -> list[memoryview]:
    """The frame of :func:`frame` as buffers, without copying: its header, then ``parts``."""
    if not (isinstance(key, str) and len(key) == FRAMED_KEY_LENGTH and _HEX.issuperset(key)):
        raise StoreError(f"{key!r} is not a framed object key (32 lowercase hex digits).")
    views = [memoryview(p).cast("B") for p in parts]
    checksum = xxhash.xxh3_128()
    for view in views:
        checksum.update(view)
    header = FRAME_MAGIC + _FRAME_TAIL.pack(
        bytes.fromhex(key), sum(v.nbytes for v in views), checksum.digest()
    )
    return [memoryview(header), *views]


def frame_size(key: str, header: bytes | bytearray | memoryview) -> int:
    """The stored size of framed object ``key`` as its first 48 bytes (``header``) say.

    Raises CorruptObjectError when they are not the header of a frame for ``key``.
    """
    problem = _frame_problem(key, header, whole=False)
    if problem is not None:
        raise CorruptObjectError(
            f"Object {key} is corrupt: {problem}. Delete the file; a checkpoint that "
            "references it cannot be restored, so replay has to execute those blocks again.",
            key=key,
        )
    return FRAME_HEADER_SIZE + int(_FRAME_TAIL.unpack_from(header, len(FRAME_MAGIC))[1])


def frame_key(data: bytes | bytearray | memoryview) -> str | None:
    """The key of the frame ``data``, or None unless it is a complete, intact frame."""
    view = memoryview(data).cast("B")
    if view.nbytes < FRAME_HEADER_SIZE or view[: len(FRAME_MAGIC)] != FRAME_MAGIC:
        return None
    key, length, checksum = _FRAME_TAIL.unpack_from(view, len(FRAME_MAGIC))
    if length != view.nbytes - FRAME_HEADER_SIZE:
        return None
    if xxhash.xxh3_128(view[FRAME_HEADER_SIZE:]).digest() != checksum:
        return None
    return key.hex()


def frame_payload(data: bytes | bytearray | memoryview) -> memoryview:
    """The payload of a frame returned by :meth:`ObjectStore.get` (no copy)."""
    return memoryview(data).cast("B")[FRAME_HEADER_SIZE:]


def _frame_problem(key: str, data: bytes | bytearray | memoryview, *, whole: bool) -> str | None:
    """What is wrong with ``data`` as the framed object ``key``, or None.

    ``whole=False`` checks only what a header read can: the magic and the key.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < FRAME_HEADER_SIZE or view[: len(FRAME_MAGIC)] != FRAME_MAGIC:
        return f"its {min(view.nbytes, FRAME_HEADER_SIZE)}-byte header is not a retrolog frame"
    stored_key, length, checksum = _FRAME_TAIL.unpack_from(view, len(FRAME_MAGIC))
    if stored_key.hex() != key:
        return f"its header names object {stored_key.hex()}"
    if not whole:
        return None
    if length != view.nbytes - FRAME_HEADER_SIZE:
        return (
            f"its header promises {length} payload bytes but the file holds "
            f"{view.nbytes - FRAME_HEADER_SIZE} (truncated or extended)"
        )
    if xxhash.xxh3_128(view[FRAME_HEADER_SIZE:]).digest() != checksum:
        return "its payload does not match the checksum in its header"
    return None


class ObjectStore(abc.ABC):
    """Immutable objects addressed by a hash of their content (see the module docstring)."""

    # Whether the methods may be called from several threads at once. The checkpoint
    # writer then overlaps compressing one array with writing the previous one, at exit.
    concurrent_calls: bool = False

    @abc.abstractmethod
    def put(self, data: bytes) -> str:
        """Store ``data`` and return its key; storing content that is already there is a no-op."""

    def put_framed(self, key: str, *parts: bytes | bytearray | memoryview | Any) -> int:
        """Store the concatenated ``parts`` as framed object ``key``; its stored size.

        What ``put(frame(key, *parts))`` stores. This default does exactly
        that; stores that can write buffers one after another override it to
        skip the copy that joins them (a checkpoint's arrays are hundreds of MB).
        """
        data = frame(key, *parts)
        self.put(data)
        return len(data)

    def sync(self) -> None:
        """Make every object put so far survive a power loss (call before relying on them).

        The checkpoint writer calls it once per checkpoint, after the manifest
        and before the checkpoint is recorded. This default does nothing, for
        stores whose puts are durable when they return.
        """
        return None

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes stored under ``key`` (a frame, for a framed object), verified.

        Raises StoreError when there is no such object and CorruptObjectError
        when the stored content does not match ``key`` or its checksum.
        """

    @abc.abstractmethod
    def has(self, key: str) -> bool:
        """Whether an object is stored under ``key`` (its content is not verified)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object stored under ``key``; a missing object is not an error."""

    @contextlib.contextmanager
    def view(self, key: str) -> Iterator[memoryview]:
        """The verified content of object ``key`` as a buffer valid inside the ``with`` block.

        For reading large objects without a copy; this default wraps :meth:`get`.
        """
        with memoryview(self.get(key)) as data:
            yield data

    def peek(self, key: str, size: int) -> bytes | None:
        """Up to ``size`` leading bytes of object ``key``, unverified; None if it is not stored.

        For reading a framed object's header cheaply (its stored size, its delta
        base). This default reads the whole object; stores override it.
        """
        return self.get(key)[:size] if self.has(key) else None

    def touch(self, key: str) -> bool:
        """Record that object ``key`` is being reused, as a put of it would; False if missing.

        A writer that finds its object already stored calls this instead of
        writing it again, so garbage collection treats the object as just
        written (store/sweep.py). This default only checks that it is there.
        """
        return self.has(key)


class LocalObjectStore(ObjectStore):
    """Objects as files in a local directory, fanned out by the first two hex digits.

    ``root`` is created on the first write. A durable store (the default)
    fsyncs each object's file before renaming it into place, and the store's
    directories when it creates them; :meth:`sync` fsyncs the directories
    renamed into since, once each, so that the renames survive a power loss
    too. ``durable=False`` skips all of these, for scratch stores and tests
    where a power loss does not matter; a torn write is still caught by the
    checksum on read.
    """

    concurrent_calls = True  # each write goes to its own temp file; reads are of renamed files

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable
        self._unsynced: set[Path] = set()  # directories renamed into since the last sync()
        self._unsynced_lock = threading.Lock()

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
        if not self._stored(key, path, len(data)):
            self._write_atomically(path, data)
        return key

    def put_framed(self, key: str, *parts: bytes | bytearray | memoryview | Any) -> int:
        """Store framed object ``key`` atomically, writing ``parts`` without joining them."""
        views = framed(key, *parts)
        size = sum(v.nbytes for v in views)
        path = self.path(key)
        if not self._stored(key, path, size):
            self._write_atomically(path, views)
        return size

    def _stored(self, key: str, path: Path, size: int) -> bool:
        """Whether object ``key`` (``size`` bytes) is in place at ``path``; if so, freshened."""
        try:
            if is_framed_key(key):
                # An intact frame under this key is the object, even if encoded
                # differently (a delta vs a full copy): replacing it would change
                # which other objects it depends on under a reader's feet.
                keep = self._has_intact_frame(key, path)
            else:
                # A file of the right size is the object: content addressing makes
                # rewriting it pointless. A file of the wrong size is a torn or
                # damaged copy, which this write repairs.
                keep = path.stat().st_size == size
            return keep and _freshen(path)
        except (FileNotFoundError, NotADirectoryError):
            return False  # not there yet; a store that cannot be created is reported by the write
        except OSError as exc:
            raise StoreError(f"Cannot read object file {path}: {exc}", path=str(path)) from exc

    def _has_intact_frame(self, key: str, path: Path) -> bool:
        """Whether ``path`` holds a frame for ``key`` whose header and size agree."""
        header = self.peek(key, FRAME_HEADER_SIZE)
        if header is None or _frame_problem(key, header, whole=False) is not None:
            return False
        length = _FRAME_TAIL.unpack_from(header, len(FRAME_MAGIC))[1]
        return bool(path.stat().st_size == FRAME_HEADER_SIZE + length)

    def _write_atomically(self, path: Path, data: bytes | list[memoryview]) -> None:
        """Write ``data`` (one buffer, or a list of buffers written in order) as ``path``."""
        # The temp file sits in the destination directory so os.replace is a
        # same-filesystem rename, atomic on POSIX and Windows. Each writer has
        # its own random temp name, so concurrent puts of one key (several
        # processes of a grid search) race only on the rename, and both
        # renames install identical content.
        parts = data if isinstance(data, list) else [data]
        tmp = path.with_name(f".{path.name[:16]}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        try:
            self._make_directory(path.parent)
            fd = os.open(tmp, flags, 0o644)
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
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
            if _size_or_none(path) == sum(memoryview(p).nbytes for p in parts):
                return
            raise StoreError(
                f"Cannot write object file {path}: {exc}. Check that the directory "
                f"{self.root} is writable and its file system is not full.",
                path=str(path),
            ) from exc
        if self.durable:
            # The rename is a change to the directory, made durable by sync(): once per
            # directory and checkpoint rather than per object, since on a busy disk each
            # directory fsync waits for a journal commit.
            with self._unsynced_lock:
                self._unsynced.add(path.parent)

    def sync(self) -> None:
        """fsync the directories objects were renamed into since the last call."""
        with self._unsynced_lock:
            pending, self._unsynced = sorted(self._unsynced), set()
        for i, directory in enumerate(pending):
            try:
                _fsync_directory(directory)
            except StoreError:
                with self._unsynced_lock:  # still to do, for the next call
                    self._unsynced.update(pending[i:])
                raise

    def _make_directory(self, directory: Path) -> None:
        """Create ``directory`` (a fan-out directory of the root) if missing, durably."""
        try:
            os.mkdir(directory)
        except FileExistsError:
            return
        except FileNotFoundError:  # the store's first write: the root is missing too
            self.root.mkdir(parents=True, exist_ok=True)
            if self.durable:
                _fsync_directory(self.root.parent)
            try:
                os.mkdir(directory)
            except FileExistsError:
                return
        if self.durable:
            _fsync_directory(self.root)

    def get(self, key: str) -> bytes:
        """The verified content of object ``key`` (the whole frame, for a framed object)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise self._unreadable(key, path, exc) from exc
        self._verify(key, path, data)
        return data

    @contextlib.contextmanager
    def view(self, key: str) -> Iterator[memoryview]:
        """Object ``key`` verified, read from the page cache without a copy (memory-mapped).

        Objects are immutable files replaced only by rename, so the mapping
        cannot change under the reader. Falls back to :meth:`get` where
        files cannot be mapped (an empty file, a platform without mmap flags).
        """
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mapped = (
                    mmap.mmap(f.fileno(), 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
                    if size and _MAP_FLAGS is not None
                    else None
                )
        except OSError as exc:
            raise self._unreadable(key, path, exc) from exc
        if mapped is None:
            data = self.get(key)
            with memoryview(data) as whole:
                yield whole
            return
        try:
            with memoryview(mapped) as whole:
                self._verify(key, path, whole)
                yield whole
        finally:
            # A slice the caller kept holds the mapping until its last reference goes.
            with contextlib.suppress(BufferError):
                mapped.close()

    def _unreadable(self, key: str, path: Path, exc: OSError) -> StoreError:
        if isinstance(exc, FileNotFoundError):
            return StoreError(
                f"No object {key} in the object store {self.root} (expected at {path}). "
                "It was deleted (garbage collection, a retention policy, or by hand) or the "
                "store was copied incompletely; anything that references it cannot be loaded.",
                path=str(path),
            )
        return StoreError(f"Cannot read object file {path}: {exc}", path=str(path))

    def _verify(self, key: str, path: Path, data: bytes | memoryview) -> None:
        if is_framed_key(key):
            problem = _frame_problem(key, data, whole=True)
        else:
            actual = hashlib.sha256(data).hexdigest()
            problem = None if actual == key else f"its {len(data)} bytes hash to {actual}"
        if problem is not None:
            raise CorruptObjectError(
                f"Object {key} at {path} is corrupt: {problem}, so the file was damaged or "
                "truncated after it was written. Delete the file; a checkpoint that "
                "references it cannot be restored, so replay has to execute those blocks "
                "again (or restore the file from a backup).",
                path=str(path),
                key=key,
            )

    def has(self, key: str) -> bool:
        """Whether object ``key`` has a file in the store."""
        path = self.path(key)
        try:
            return path.is_file()
        except OSError as exc:
            raise StoreError(f"Cannot read object file {path}: {exc}", path=str(path)) from exc

    def peek(self, key: str, size: int) -> bytes | None:
        """Up to ``size`` leading bytes of object ``key``, unverified; None if it is missing."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                return f.read(size)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"Cannot read object file {path}: {exc}", path=str(path)) from exc

    def touch(self, key: str) -> bool:
        """Mark object ``key`` as just written (see :func:`_freshen`); False if it is missing."""
        path = self.path(key)
        return path.is_file() and _freshen(path)

    def delete(self, key: str) -> None:
        """Remove object ``key`` if it is there."""
        path = self.path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"Cannot delete object file {path}: {exc}", path=str(path)) from exc


def _freshen(path: Path) -> bool:
    """Mark an existing object as just written; False if it vanished meanwhile.

    Garbage collection (_gc.py, store/sweep.py) never deletes an object written after a
    running run started, so a writer that finds its object already stored must
    count as writing it, as git freshens objects it would have written.
    """
    try:
        os.utime(path)
    except FileNotFoundError:
        return False  # collected between the stat and now: write it again
    except OSError:
        pass  # not ours to touch (a shared store): the grace period still covers it
    return True


# fsync on a directory is refused where directories cannot be opened or synced
# (Windows, some network file systems); there is nothing more to make durable then.
_NO_DIRECTORY_SYNC = {errno.EACCES, errno.EBADF, errno.EINVAL, errno.EISDIR, errno.EPERM}
_NO_DIRECTORY_SYNC |= {getattr(errno, "ENOTSUP", errno.EINVAL), getattr(errno, "EOPNOTSUPP", 0)}


def _fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` durable; StoreError if the disk fails to."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        if exc.errno in _NO_DIRECTORY_SYNC:
            return
        raise StoreError(
            f"Cannot open the object directory {directory} to make what was written there "
            f"durable: {exc}. Check that it exists and that this user may read it.",
            path=str(directory),
        ) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIRECTORY_SYNC:
            raise StoreError(
                f"Cannot make the object directory {directory} durable: {exc}. The disk "
                "reported an error; check it (dmesg) before trusting what was written.",
                path=str(directory),
            ) from exc
    finally:
        os.close(fd)


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
