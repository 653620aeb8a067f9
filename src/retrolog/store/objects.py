"""The content-addressed object store: immutable objects named by a hash of their content.

Checkpoints are written as one object per tensor or array plus a manifest, so
identical content (frozen layers, a shared base model) is stored once. Every
read is verified, so a damaged file is reported, never restored.
:class:`ObjectStore` is the interface, and holds every check; a backend only
reads, writes, lists and deletes files laid out as::

    objects/
        3f/
            a9c1...   the object whose key is 3fa9c1...
        .tmp files    only while a write is in flight (name starts with '.')

:class:`LocalObjectStore` keeps them in a local directory;
``store/fsspec_objects.py`` at an fsspec URL, and ``store/backends.py`` chooses
one from a location (docs/checkpoint-storage.md, "Backends").

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
import stat
import struct
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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
    if not _is_key(key):
        raise StoreError(
            f"{key!r} is not an object key; keys are 64 (the sha256 of a raw object) or 32 "
            "(a framed object) lowercase hex digits, as returned by put()."
        )


def _is_key(key: object) -> bool:
    return (
        isinstance(key, str)
        and len(key) in (RAW_KEY_LENGTH, FRAMED_KEY_LENGTH)
        and _HEX.issuperset(key)
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


_T = TypeVar("_T")
_R = TypeVar("_R")
# Bytes handed to put_all that a batch holds at once, not yet stored (at least one item).
IN_FLIGHT_BYTES = 64 << 20


def in_order(
    call: Callable[[_T], _R],
    items: Iterable[_T],
    workers: int,
    *,
    size: Callable[[_T], int] | None = None,
) -> Generator[_R, None, None]:
    """``call(item)`` for each of ``items``, results in order, up to ``workers`` calls at once.

    At most 2 x ``workers`` calls are queued or running, and with ``size`` at most
    IN_FLIGHT_BYTES of items beyond one, so a long stream of items is never all in
    memory. A call that raises raises here in its turn; calls not yet started are
    cancelled, and those running are waited for, before the error (or the caller's
    closing of this iterator) leaves.
    """
    if workers <= 1:
        for item in items:
            yield call(item)
        return
    from concurrent.futures import Future, ThreadPoolExecutor

    pending: deque[tuple[Future[_R], int]] = deque()
    held = 0
    stop = threading.Event()

    def run(item: _T) -> _R:
        _batch.stop = stop
        try:
            return call(item)
        finally:
            _batch.stop = None

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="retrolog-objects") as pool:
        try:
            for item in items:
                nbytes = size(item) if size is not None else 0
                while pending and (len(pending) >= 2 * workers or held + nbytes > IN_FLIGHT_BYTES):
                    future, done = pending.popleft()
                    held -= done
                    yield future.result()
                pending.append((pool.submit(run, item), nbytes))
                held += nbytes
            while pending:
                yield pending.popleft()[0].result()
        finally:
            for future, _ in pending:
                future.cancel()
            # Calls still running (a store that does not answer) give up their requests,
            # so that leaving here (Ctrl-C, a failure) does not wait for their timeouts.
            stop.set()


# The batch (in_order) a pool thread's call belongs to, so a request it waits on can see
# that the batch was left.
_batch = threading.local()


def requests_abandoned() -> bool:
    """Whether the batch of requests the calling thread works for was left (for backends:
    a request that still waits gives up)."""
    stop = getattr(_batch, "stop", None)
    return stop is not None and stop.is_set()


@dataclass(frozen=True)
class StoredFile:
    """An object, or a temp file a write left behind, as :meth:`ObjectStore.scan` lists it."""

    name: str  # in the store's layout: "3f/a9c1..." (an object), "3f/.a9c1....tmp" (a temp file)
    key: str | None  # the object's key; None for a temp file
    size: int
    mtime: float  # when it was written or last freshened, in seconds since the epoch
    location: str  # its path or URL, for reports


def is_temp(name: str) -> bool:
    """Whether the file name ``name`` (no directory) is a temp file's: ``.*.tmp``."""
    return name.startswith(".") and name.endswith(".tmp")


def _in_layout(folder: str) -> bool:
    """Whether ``folder`` is the store's root ("") or one of its fan-out directories."""
    return folder == "" or (len(folder) == 2 and _HEX.issuperset(folder))


class ObjectStore(abc.ABC):
    """Immutable objects addressed by a hash of their content (see the module docstring).

    This class holds everything that makes a store trustworthy, so that every backend
    gets it the same way: key checks, verification of every read, the decision whether
    a put must write, and listing and deleting objects safely beside writers (what
    ``retrolog gc`` needs). A backend implements the raw primitives at the end of the
    class (the methods named ``_...``) on *names* in the store's layout (``3f/a9c1...``,
    ``3f/.a9c1....tmp``), reports failures as OSError (FileNotFoundError for a missing
    file) and never checks content: that is done here. docs/checkpoint-storage.md,
    "Backends", says what each backend guarantees.
    """

    # Whether _rename moves a file atomically and keeps its modification time. Then
    # remove_if_stale moves an object aside before it reads the time, so no freshen can
    # slip in between the check and the deletion; otherwise it checks, then deletes.
    renames_atomically: bool = False
    # The store's root (a path or URL), for messages.
    location: str = "(object store)"
    # Requests the backend serves well at once: put_all and get_all keep this many in
    # flight. A local disk gains nothing from more than one; a store across a network
    # waits a round trip per request, which several requests at once overlap.
    parallel_requests: int = 1

    # -- objects -------------------------------------------------------------------------

    def put(self, data: bytes) -> str:
        """Store ``data`` and return its key; storing content that is already there is a no-op.

        The write is atomic: the object is visible under its key only once complete.
        """
        key = object_key(data)
        name = self._name(key)
        if not self._stored(key, name, len(data)):
            self._write_object(name, [memoryview(data)])
        return key

    def put_framed(self, key: str, *parts: bytes | bytearray | memoryview | Any) -> int:
        """Store the concatenated ``parts`` as framed object ``key``; its stored size.

        What ``put(frame(key, *parts))`` stores, written part after part without
        first joining them into one ``bytes`` (a checkpoint's arrays are hundreds of MB).
        """
        views = framed(key, *parts)
        size = sum(v.nbytes for v in views)
        name = self._name(key)
        if not self._stored(key, name, size):
            self._write_object(name, views)
        return size

    def put_all(self, datas: Iterable[bytes]) -> Generator[str, None, None]:
        """:meth:`put` each of ``datas``; their keys, in order, each once its object is stored.

        Up to ``parallel_requests`` puts are in flight at once, holding at most
        about 64 MB of data not yet stored beyond the one in hand. The first
        failure is raised in its turn; puts not yet started are then not made.
        """
        return in_order(self.put, datas, self.parallel_requests, size=len)

    def get_all(self, keys: Iterable[str]) -> Generator[tuple[str, bytes], None, None]:
        """(key, :meth:`get` of it) for each of ``keys``, in order, several reads at a time.

        As :meth:`put_all`: up to ``parallel_requests`` reads in flight, the
        first failure raised in its turn.
        """
        return in_order(lambda key: (key, self.get(key)), keys, self.parallel_requests)

    def sync(self) -> None:
        """Make every object put so far survive a power loss (call before relying on them).

        The checkpoint writer calls it once per checkpoint, after the manifest
        and before the checkpoint is recorded. This default does nothing, for
        stores whose puts are durable when they return.
        """
        return None

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key`` (a frame, for a framed object), verified.

        Raises StoreError when there is no such object and CorruptObjectError
        when the stored content does not match ``key`` or its checksum.
        """
        name = self._name(key)
        try:
            data = self._read(name)
        except OSError as exc:
            raise self._unreadable(key, name, exc) from exc
        self._verify(key, name, data)
        return data

    @contextlib.contextmanager
    def view(self, key: str) -> Iterator[memoryview]:
        """The verified content of object ``key`` as a buffer valid inside the ``with`` block.

        For reading large objects without a copy where the backend can (a local
        store maps the file); errors as :meth:`get`.
        """
        name = self._name(key)
        with contextlib.ExitStack() as stack:
            try:
                data = stack.enter_context(self._open_view(name))
            except OSError as exc:
                raise self._unreadable(key, name, exc) from exc
            self._verify(key, name, data)
            yield data

    def peek(self, key: str, size: int) -> bytes | None:
        """Up to ``size`` leading bytes of object ``key``, unverified; None if it is not stored.

        For reading a framed object's header cheaply (its stored size, its delta base).
        """
        name = self._name(key)
        try:
            return self._read_prefix(name, size)
        except OSError as exc:
            raise self._unreadable(key, name, exc) from exc

    def has(self, key: str) -> bool:
        """Whether an object is stored under ``key`` (its content is not verified)."""
        name = self._name(key)
        try:
            return self._size(name) is not None
        except OSError as exc:
            raise self._unreadable(key, name, exc) from exc

    def touch(self, key: str) -> bool:
        """Record that object ``key`` is being reused, as a put of it would; False if missing.

        A writer that finds its object already stored calls this instead of
        writing it again, so garbage collection treats the object as just
        written (:meth:`remove_if_stale`).
        """
        name = self._name(key)
        try:
            return self._freshen(name)
        except OSError as exc:
            raise self._unreadable(key, name, exc) from exc

    def delete(self, key: str) -> None:
        """Remove the object stored under ``key``; a missing object is not an error."""
        name = self._name(key)
        try:
            self._delete(name)
        except OSError as exc:
            where = self._location(name)
            raise StoreError(f"Cannot delete object file {where}: {exc}", path=where) from exc

    # -- listing and safe deletion (garbage collection) ------------------------------------

    def scan(self) -> tuple[list[StoredFile], list[StoredFile]]:
        """Every object and every leftover temp file in the store.

        A file counts as an object only if its name is a valid key at the place the
        layout gives it; anything else (a README, a stray directory) is left out, so
        nothing that lists it can delete it.
        """
        objects: list[StoredFile] = []
        temps: list[StoredFile] = []
        try:
            entries = list(self._list())
        except OSError as exc:
            raise StoreError(f"Cannot list the object store {self.location}: {exc}.") from exc
        for name, size, mtime in entries:
            folder, _, leaf = name.rpartition("/")
            if not _in_layout(folder):
                continue
            if is_temp(leaf):
                temps.append(StoredFile(name, None, size, mtime, self._location(name)))
            elif folder and _is_key(folder + leaf):
                key = folder + leaf
                objects.append(StoredFile(name, key, size, mtime, self._location(name)))
        return objects, temps

    def remove_if_stale(self, key: str, cutoff: float) -> bool:
        """Delete object ``key`` unless it was written or freshened at or after ``cutoff``.

        True if this call deleted it. Where the backend renames atomically the object
        is moved aside first and its time read from there: a writer that freshened
        it before the move is seen (and the object put back), and one that comes
        after finds no object and writes it again. Elsewhere the time is read, then
        the object deleted: a freshen in between is lost (docs/checkpoint-storage.md,
        "Backends").
        """
        name = self._name(key)
        where = self._location(name)
        if not self.renames_atomically:
            try:
                mtime = self._mtime(name)
                return mtime is not None and mtime < cutoff and self._delete(name)
            except OSError as exc:
                raise StoreError(f"Cannot delete object file {where}: {exc}.", path=where) from exc
        aside = self._temp_name(name, "gc.")
        try:
            if not self._rename(name, aside):
                return False
        except OSError as exc:
            raise StoreError(f"Cannot delete object file {where}: {exc}.", path=where) from exc
        try:
            mtime = self._mtime(aside)
            if mtime is None:
                return False  # a gc running beside this one removed it as a stale temp file
            if mtime >= cutoff:
                self._rename(aside, name)  # in use again; a copy written meanwhile is identical
                return False
            return self._delete(aside)
        except OSError as exc:
            raise StoreError(
                f"Cannot delete object file {where} (moved aside to "
                f"{self._location(aside)}): {exc}.",
                path=where,
            ) from exc

    def remove_temp(self, name: str, cutoff: float) -> bool:
        """Delete temp file ``name`` (from :meth:`scan`) unless touched at or after ``cutoff``."""
        folder, _, leaf = name.rpartition("/")
        if not (_in_layout(folder) and is_temp(leaf)):
            raise StoreError(f"{name!r} is not a temp file of the object store {self.location}.")
        try:
            mtime = self._mtime(name)
            # Gone meanwhile: renamed into place or removed by its writer.
            return mtime is not None and mtime < cutoff and self._delete(name)
        except OSError as exc:
            where = self._location(name)
            raise StoreError(f"Cannot delete temp file {where}: {exc}.", path=where) from exc

    # -- shared by the methods above -------------------------------------------------------

    def _name(self, key: str) -> str:
        """Object ``key``'s name in the layout, after checking that ``key`` is a key."""
        check_key(key)
        return f"{key[:2]}/{key[2:]}"

    def _temp_name(self, name: str, tag: str = "") -> str:
        """A fresh temp file name beside ``name``, unique to this process and call."""
        folder, _, leaf = name.rpartition("/")
        temp = f".{leaf[:16]}.{tag}{os.getpid()}.{secrets.token_hex(6)}.tmp"
        return f"{folder}/{temp}" if folder else temp

    def _stored(self, key: str, name: str, size: int) -> bool:
        """Whether object ``key`` (``size`` bytes) is in place; if so, freshened."""
        try:
            if is_framed_key(key):
                # An intact frame under this key is the object, even if encoded
                # differently (a delta vs a full copy): replacing it would change
                # which other objects it depends on under a reader's feet.
                header = self._read_prefix(name, FRAME_HEADER_SIZE)
                if header is None or _frame_problem(key, header, whole=False) is not None:
                    return False
                length = _FRAME_TAIL.unpack_from(header, len(FRAME_MAGIC))[1]
                keep = self._size(name) == FRAME_HEADER_SIZE + length
            else:
                # An object of the right size is the object: content addressing makes
                # rewriting it pointless. One of the wrong size is a torn or damaged
                # copy, which this write repairs.
                keep = self._size(name) == size
            return keep and self._freshen(name)
        except OSError as exc:
            raise self._unreadable(key, name, exc) from exc

    def _write_object(self, name: str, parts: list[memoryview]) -> None:
        try:
            self._write(name, parts)
        except OSError as exc:
            where = self._location(name)
            raise StoreError(
                f"Cannot write object file {where}: {exc}. Check that the object store "
                f"{self.location} is writable and not full.",
                path=where,
            ) from exc

    def _unreadable(self, key: str, name: str, exc: OSError) -> StoreError:
        where = self._location(name)
        if isinstance(exc, FileNotFoundError):
            return StoreError(
                f"No object {key} in the object store {self.location} (expected at {where}). "
                "It was deleted (garbage collection, a retention policy, or by hand) or the "
                "store was copied incompletely; anything that references it cannot be loaded.",
                path=where,
            )
        return StoreError(f"Cannot read object file {where}: {exc}", path=where)

    def _verify(self, key: str, name: str, data: bytes | memoryview) -> None:
        if is_framed_key(key):
            problem = _frame_problem(key, data, whole=True)
        else:
            actual = hashlib.sha256(data).hexdigest()
            problem = None if actual == key else f"its {len(data)} bytes hash to {actual}"
        if problem is not None:
            where = self._location(name)
            raise CorruptObjectError(
                f"Object {key} at {where} is corrupt: {problem}, so the file was damaged or "
                "truncated after it was written. Delete the file; a checkpoint that "
                "references it cannot be restored, so replay has to execute those blocks "
                "again (or restore the file from a backup).",
                path=where,
                key=key,
            )

    # -- the backend's primitives ----------------------------------------------------------
    # Names are relative to the store's root, "/"-separated. Failures are OSError.

    @abc.abstractmethod
    def _location(self, name: str) -> str:
        """The path or URL of ``name``, for messages."""

    @abc.abstractmethod
    def _read(self, name: str) -> bytes:
        """The whole content of ``name``; FileNotFoundError if there is none."""

    @abc.abstractmethod
    def _read_prefix(self, name: str, size: int) -> bytes | None:
        """Up to ``size`` leading bytes of ``name``; None if there is none."""

    @contextlib.contextmanager
    def _open_view(self, name: str) -> Iterator[memoryview]:
        """The content of ``name`` as a buffer valid inside the block (default: a read)."""
        with memoryview(self._read(name)) as data:
            yield data

    @abc.abstractmethod
    def _write(self, name: str, parts: list[memoryview]) -> None:
        """Store ``parts``, concatenated, as ``name``, visible only once complete.

        A reader sees no file or the whole file, never a part, even if the write
        fails midway or another write of the same name races it (both write the
        same bytes: content addressing). Replaces a file already there.
        """

    @abc.abstractmethod
    def _size(self, name: str) -> int | None:
        """The size of the file ``name``; None if there is none."""

    @abc.abstractmethod
    def _mtime(self, name: str) -> float | None:
        """When ``name`` was written or last freshened, in seconds since the epoch; None if none."""

    @abc.abstractmethod
    def _freshen(self, name: str) -> bool:
        """Set the time of the existing file ``name`` to now; False if there is none.

        Garbage collection never deletes what was written or freshened after its
        cutoff, so a writer that finds its object already stored freshens it
        instead of writing it, as git does for objects it would have written.
        """

    @abc.abstractmethod
    def _delete(self, name: str) -> bool:
        """Remove ``name``; False if there was none."""

    def _rename(self, name: str, new: str) -> bool:
        """Move ``name`` to ``new`` (replacing it), keeping its time; False if ``name`` is missing.

        Called only where :attr:`renames_atomically` is true.
        """
        raise NotImplementedError(f"{type(self).__name__} does not rename")

    @abc.abstractmethod
    def _list(self) -> Iterator[tuple[str, int, float]]:
        """(name, size, mtime) of each file in the root and its fan-out directories.

        Files deeper down need not be listed; a missing root lists nothing.
        """


class ForwardingStore(ObjectStore):
    """Another store's objects, with this class's checks over ``inner``'s primitives.

    The base for stores that watch or alter some calls (counting reads, delaying
    writes) and pass everything else on.
    """

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.location = inner.location
        self.renames_atomically = inner.renames_atomically
        self.parallel_requests = inner.parallel_requests

    def sync(self) -> None:
        self.inner.sync()

    def _location(self, name: str) -> str:
        return self.inner._location(name)

    def _read(self, name: str) -> bytes:
        return self.inner._read(name)

    def _read_prefix(self, name: str, size: int) -> bytes | None:
        return self.inner._read_prefix(name, size)

    @contextlib.contextmanager
    def _open_view(self, name: str) -> Iterator[memoryview]:
        with self.inner._open_view(name) as data:
            yield data

    def _write(self, name: str, parts: list[memoryview]) -> None:
        self.inner._write(name, parts)

    def _size(self, name: str) -> int | None:
        return self.inner._size(name)

    def _mtime(self, name: str) -> float | None:
        return self.inner._mtime(name)

    def _freshen(self, name: str) -> bool:
        return self.inner._freshen(name)

    def _delete(self, name: str) -> bool:
        return self.inner._delete(name)

    def _rename(self, name: str, new: str) -> bool:
        return self.inner._rename(name, new)

    def _list(self) -> Iterator[tuple[str, int, float]]:
        return self.inner._list()


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

    renames_atomically = True  # rename(2) within one directory

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self._prefix = os.path.join(self.location, "")  # string joins: no Path per call
        self.durable = durable
        self._unsynced: set[Path] = set()  # directories renamed into since the last sync()
        self._unsynced_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file that holds (or would hold) the object ``key``."""
        check_key(key)
        return self.root / key[:2] / key[2:]

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

    def _location(self, name: str) -> str:
        return self._prefix + name

    def _read(self, name: str) -> bytes:
        with open(self._prefix + name, "rb") as f:
            return f.read()

    def _read_prefix(self, name: str, size: int) -> bytes | None:
        try:
            with open(self._prefix + name, "rb") as f:
                return f.read(size)
        except (FileNotFoundError, NotADirectoryError):
            return None

    @contextlib.contextmanager
    def _open_view(self, name: str) -> Iterator[memoryview]:
        """The file read from the page cache without a copy (memory-mapped).

        Objects are immutable files replaced only by rename, so the mapping
        cannot change under the reader. Falls back to a read where files cannot
        be mapped (an empty file, a platform without mmap flags).
        """
        with open(self._prefix + name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped = (
                mmap.mmap(f.fileno(), 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
                if size and _MAP_FLAGS is not None
                else None
            )
        if mapped is None:
            with memoryview(self._read(name)) as whole:
                yield whole
            return
        try:
            with memoryview(mapped) as whole:
                yield whole
        finally:
            # A slice the caller kept holds the mapping until its last reference goes.
            with contextlib.suppress(BufferError):
                mapped.close()

    def _write(self, name: str, parts: list[memoryview]) -> None:
        # The temp file sits in the destination directory so os.replace is a
        # same-filesystem rename, atomic on POSIX and Windows. Each writer has
        # its own random temp name, so concurrent puts of one key (several
        # processes of a grid search) race only on the rename, and both
        # renames install identical content.
        path = self.root / name
        tmp = self.root / self._temp_name(name)
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
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            # On Windows a rename onto a file another process holds open
            # fails; the object is there all the same.
            if _size_or_none(path) != sum(memoryview(p).nbytes for p in parts):
                raise
            return
        if self.durable:
            # The rename is a change to the directory, made durable by sync(): once per
            # directory and checkpoint rather than per object, since on a busy disk each
            # directory fsync waits for a journal commit.
            with self._unsynced_lock:
                self._unsynced.add(path.parent)

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

    def _size(self, name: str) -> int | None:
        try:
            st = os.stat(self._prefix + name)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _mtime(self, name: str) -> float | None:
        try:
            return os.stat(self._prefix + name).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _freshen(self, name: str) -> bool:
        return _freshen_file(self._prefix + name)

    def _delete(self, name: str) -> bool:
        try:
            os.unlink(self._prefix + name)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _rename(self, name: str, new: str) -> bool:
        try:
            os.replace(self._prefix + name, self._prefix + new)
        except FileNotFoundError:
            return False
        return True

    def _list(self) -> Iterator[tuple[str, int, float]]:
        try:
            top = list(os.scandir(self.root))
        except FileNotFoundError:
            return
        for entry in top:
            if entry.is_file(follow_symlinks=False):
                yield _listed(entry.name, entry)
            elif entry.is_dir(follow_symlinks=False) and _in_layout(entry.name):
                for item in os.scandir(entry.path):
                    if item.is_file(follow_symlinks=False):
                        yield _listed(f"{entry.name}/{item.name}", item)


def _listed(name: str, entry: os.DirEntry[str]) -> tuple[str, int, float]:
    st = entry.stat(follow_symlinks=False)
    return name, st.st_size, st.st_mtime


def _freshen_file(path: str) -> bool:
    """Mark an existing object file as just written; False if it vanished meanwhile."""
    try:
        os.utime(path)
    except (FileNotFoundError, NotADirectoryError):
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
