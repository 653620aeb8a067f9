"""One tensor or array as one framed object: content key, compression, deltas.

docs/checkpoint-storage.md has the byte layout and the measurements behind
the choices. In short:

- the key is the xxh3-128 of the dtype, the shape and the raw bytes, hashed
  from the tensor's own memory (no copy), so an unchanged tensor is found in
  the store before any compression work and written once across checkpoints
  and runs;
- float data of at least :data:`MIN_COMPRESS_BYTES` is compressed by
  c-blosc2 (bound by imagecodecs): its shuffle filter stores the bytes of
  equal significance together (byte planes), then zstd; everything else is
  stored as it comes;
- with a :class:`DeltaHistory`, a float tensor may instead be stored as the
  difference of its bit patterns, taken as unsigned integers of the element's
  width (wrapping), from an earlier version of the same tensor (same manifest
  path, dtype and shape) in the run, compressed the same way, when that is at
  most ``min_gain`` of the full object; chains are capped at ``max_chain``
  deltas so a restore reads a bounded number of objects. The difference
  rather than the XOR of the bit patterns: a carry makes XOR set many bits
  where the difference stays small, which stored Adam's moments 3-6 points
  smaller, for 1-3 points lost on weights (the docs' table).

Everything here that touches bulk data (xxhash, blosc2, numpy's integer
arithmetic and copies) releases the GIL, so the background writer thread does
not stall training.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
import xxhash

from retrolog.errors import CorruptObjectError, StoreError
from retrolog.store.objects import (
    FRAME_HEADER_SIZE,
    ObjectStore,
    frame_payload,
    frame_size,
    is_framed_key,
)

_R = TypeVar("_R")

# Array bytes a checkpoint's writes to a remote store hold in flight beyond the one in
# hand (ArrayWriter._submit), and reads of a restore (codec._Decoder.fill).
WRITE_BEHIND_BYTES = 256 << 20
MIN_COMPRESS_BYTES = 4096  # smaller float data is stored as it comes: no gain worth a call
SEGMENT_BYTES = 1 << 30  # blosc2 compresses at most 2 GB per call
CLEVEL = 1  # zstd level inside blosc2: best ratio and speed on weights (docs table)
BLOCK_BYTES = 256 * 1024  # blosc2 block: larger blocks decode faster, 256 KiB fits in L2
# Restores decode several tensors at once, one thread per tensor. Restoring the
# CNN's checkpoints on the 2-core benchmark VM: 1.97x torch.load's time with one
# thread, 1.50x with two; two threads per blosc2 call instead gave 1.80x.
DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))
MAX_DEPTH = 64  # a chain longer than any writer makes is a damaged header, not a delta chain
# Delta bases kept in memory per run, at most. A base beyond it is decoded from the
# store each time a delta is tried against it, instead of copied once when it is
# written: less memory (a third copy of a large state), more writer CPU per delta.
BASE_BUDGET_BYTES = 64 << 20

RAW, BLOSC, DELTA_BLOSC = 0, 1, 2
CODEC_NAMES = {RAW: "raw", BLOSC: "blosc2 shuffle+zstd", DELTA_BLOSC: "delta, blosc2"}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}  # element widths a delta is taken in

# codec, item size (the shuffle's element width), chain depth, raw length, base key
_HEAD = struct.Struct("<BBB5xQ16s")
HEADER_SIZE = FRAME_HEADER_SIZE + _HEAD.size  # what a header read (ObjectStore.peek) needs
_SEGMENT = struct.Struct("<Q")  # compressed length, before each segment
# A blosc2 chunk's header: version bytes, flags, type size, then these two (and its block size
# between them): the bytes it decompresses to and its own length.
_CHUNK_SIZES = struct.Struct("<4xI4xI")

_codec_module: Any = None


class Interrupted(Exception):
    """An encode stopped between two arrays because its ``interrupt`` callable said so."""


def all_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _codec() -> Any:
    """The c-blosc2 binding (imagecodecs' ``_blosc2``), imported on first use.

    imagecodecs binds the c-blosc2 library alone: its import takes ~10 ms, where
    the python-blosc2 package imports half a second of modules (an HTTP client,
    numexpr, pydantic). Its calls release the GIL. On the main thread python's
    global random state is put back around the import, so that checkpointing can
    never change what a run (or its replay) draws.
    """
    global _codec_module
    if _codec_module is None:
        on_main = threading.current_thread() is threading.main_thread()
        state = random.getstate() if on_main else None
        try:
            from imagecodecs import _blosc2
        finally:
            if state is not None:
                random.setstate(state)
        if not _blosc2.BLOSC2.available:
            raise ImportError("imagecodecs was built without c-blosc2")
        _codec_module = _blosc2
    return _codec_module


def preload_codec() -> None:
    """Import the codec on the calling (training) thread before a background writer needs it.

    It takes ~10 ms. Imported from the writer thread instead, the import would
    hold the GIL in a thread that runs at the lowest priority: the training
    thread, waiting for the GIL, would wait on a thread the scheduler starves.
    A failure is left for the writer to report (see BackgroundCheckpointer).
    """
    with contextlib.suppress(ImportError):
        _codec()


def content_key(dtype: str, shape: Sequence[int], data: np.ndarray[Any, Any]) -> str:
    """The object key of an array: xxh3-128 of dtype, shape and the bytes of ``data``.

    ``data`` is a contiguous uint8 view of the values (hashed in place).
    """
    h = xxhash.xxh3_128(f"retrolog.array\0{dtype}\0{','.join(map(str, shape))}\0".encode())
    h.update(data.data)
    return h.hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    """What the header of a framed array object says."""

    size: int  # stored bytes, frame included
    codec: int
    depth: int  # deltas between this object and a full one (0: full)
    base: str | None  # the object a delta applies to


def parse_header(key: str, header: bytes | memoryview) -> ObjectInfo:
    """Read ``key``'s :class:`ObjectInfo` from its first :data:`HEADER_SIZE` bytes."""
    view = memoryview(header).cast("B")
    size = frame_size(key, view)
    if view.nbytes < HEADER_SIZE:
        raise _corrupt(key, f"its header is cut short ({view.nbytes} bytes)")
    codec, _itemsize, depth, _raw, base = _HEAD.unpack_from(view, FRAME_HEADER_SIZE)
    if codec not in CODEC_NAMES or depth > MAX_DEPTH or (codec == DELTA_BLOSC) != (depth > 0):
        raise _corrupt(key, f"its header names codec {codec} at depth {depth}")
    return ObjectInfo(
        size=size,
        codec=codec,
        depth=depth,
        base=base.hex() if codec == DELTA_BLOSC else None,
    )


def read_info(store: ObjectStore, key: str) -> ObjectInfo | None:
    """The header of array object ``key``, or None if the store does not have it."""
    header = store.peek(key, HEADER_SIZE)
    return None if header is None else parse_header(key, header)


def _corrupt(key: str, what: str) -> CorruptObjectError:
    return CorruptObjectError(
        f"Checkpoint object {key} is corrupt: {what}. Delete the file; a checkpoint that "
        "references it cannot be restored, so replay has to execute those blocks again.",
        key=key,
    )


# ---------------------------------------------------------------- statistics


@dataclass
class EncodeStats:
    """What encoding one checkpoint (or, summed, a run's checkpoints) did."""

    logical_bytes: int = 0  # raw size of the distinct arrays, tensors and blobs, plus manifest
    stored_bytes: int = 0  # encode()'s nbytes: manifest + distinct objects incl. delta bases
    written_bytes: int = 0  # bytes of the objects this encode wrote (not found stored)
    objects: int = 0  # distinct objects the checkpoint needs, manifest and delta bases included
    written_objects: int = 0
    delta_objects: int = 0  # written objects stored as deltas
    reused_objects: int = 0  # referenced objects that were already stored (dedup)
    seconds: float = 0.0  # wall time of the encode

    def add(self, other: EncodeStats) -> None:
        """Add ``other``'s counts to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# ---------------------------------------------------------------- per-run state


@dataclass
class _PathState:
    """The version of one manifest path the next one may be written as a delta of.

    That is the most recent version stored less than ``max_chain`` deltas away
    from a full object: with ``max_chain=1`` every delta is against the last
    full version (a keyframe), with more, deltas chain.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    depth: int
    # A private copy of its bytes (snapshot buffers get reused), or None: read it back from
    # the store when a delta is tried (it did not fit in the history's base budget).
    base: np.ndarray[Any, Any] | None
    full_size: int | None = None  # compressed size the last time it was stored in full
    fails: int = 0  # delta attempts in a row that did not pay off
    skip: int = 0  # delta attempts still to skip (backing off after failures)


class DeltaHistory:
    """Per-run state that lets :func:`~retrolog.checkpoint.codec.encode` write deltas.

    Create one per checkpointer and pass it to every encode of that run, from
    one thread at a time. It holds the headers of the objects the previous
    checkpoint used and, up to ``base_budget`` bytes, a copy of its float
    tensors of at least :data:`MIN_COMPRESS_BYTES` (the delta bases). A base
    beyond the budget is decoded from the store each time a delta is tried
    against it, so the budget bounds the memory deltas take beside the
    snapshots, at the price of a decode per delta of a large state.

    max_chain: most deltas between a stored version and a full object (0: no
      deltas). Each version's delta is taken against the most recent version
      stored fewer than ``max_chain`` deltas deep, so the default, 1, makes
      every delta one against the last full version (a keyframe): a restore
      decodes at most two objects. Deeper chains store a little less and
      restore proportionally slower (docs/checkpoint-storage.md).
    min_gain: a delta is kept only if it is at most this fraction of the full
      compressed object.
    base_budget: bytes of delta bases kept in memory, at most (default
      :data:`BASE_BUDGET_BYTES`); bases are kept in the order the tensors
      are first stored.
    """

    def __init__(
        self, *, max_chain: int = 1, min_gain: float = 0.9, base_budget: int = BASE_BUDGET_BYTES
    ) -> None:
        if not isinstance(max_chain, int) or not 0 <= max_chain <= MAX_DEPTH:
            raise ValueError(f"max_chain must be an int from 0 to {MAX_DEPTH}, not {max_chain!r}")
        if not 0 < min_gain <= 1:
            raise ValueError(f"min_gain must be in (0, 1], not {min_gain!r}")
        if not isinstance(base_budget, int) or base_budget < 0:
            raise ValueError(f"base_budget must be a whole number of bytes, not {base_budget!r}")
        self.max_chain = max_chain
        self.min_gain = min_gain
        self.base_budget = base_budget
        self.base_bytes = 0  # bytes of the bases held in memory now
        self.last: EncodeStats | None = None  # the most recent encode
        self.total = EncodeStats()  # every encode so far
        self._paths: dict[str, _PathState] = {}
        self._known: dict[str, ObjectInfo] = {}

    def __repr__(self) -> str:
        return f"DeltaHistory(max_chain={self.max_chain}, min_gain={self.min_gain})"


# ---------------------------------------------------------------- writing


class ArrayWriter:
    """Stores the arrays of one checkpoint; collects what the manifest depends on."""

    def __init__(
        self,
        store: ObjectStore,
        history: DeltaHistory | None,
        *,
        interrupt: Callable[[], bool] | None = None,
        compress: bool = True,
    ) -> None:
        self.store = store
        self.history = history
        # False: every array is stored as it comes (RAW), without delta attempts (a
        # delta is a pass over the data and, when it does not clearly win, a second
        # compression): the least CPU, for writes that take it from training.
        self.compress = compress
        self.interrupt = interrupt  # polled before each array: stop with Interrupted
        self.stats = EncodeStats()
        self.infos: dict[str, ObjectInfo] = {}  # every object the checkpoint needs, bases too
        self._paths: dict[str, _PathState] = {}  # this checkpoint's states, for the history
        # The history is left as it was until finish(): an encode that is interrupted (the
        # urgent lane took the checkpoint over) or fails must not leave a base holding
        # bytes other than those of the object it names, or the next delta against it
        # would decode to other values. So a base's memory is reused only at finish(),
        # and the bytes the bases hold are counted here meanwhile.
        self._base_updates: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
        self._base_bytes_held = history.base_bytes if history is not None else 0
        # Writes in flight, on a store that serves several requests at once (a remote
        # one: each write waits a round trip). Their parts are the snapshot's memory, so
        # the encode waits for all of them (wait_written, close) before it returns.
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: deque[tuple[Future[Any], int]] = deque()  # and its bytes
        self._in_flight_bytes = 0
        # Without deltas (the urgent lane) on such a store, the question whether an array
        # is stored already (a request too) goes to the pool with its write: key -> (its
        # header, whether this encode wrote it), collected by wait_written().
        self._overlap_checks = store.parallel_requests > 1 and not compress
        self._checked: dict[str, Future[tuple[ObjectInfo, bool]]] = {}

    def put(
        self,
        path: str,
        dtype: str,
        shape: Sequence[int],
        data: np.ndarray[Any, Any],
        itemsize: int,
        is_float: bool,
    ) -> str:
        """Store array ``data`` (contiguous uint8 view) as found at ``path``; returns its key.

        Raises Interrupted, before any work on it, when ``interrupt()`` is true.
        """
        if self.interrupt is not None and self.interrupt():
            raise Interrupted
        shape = tuple(shape)
        key = content_key(dtype, shape, data)
        if self._overlap_checks:
            if key not in self.infos and key not in self._checked:
                self.stats.logical_bytes += data.nbytes
                self._checked[key] = self._submit(
                    data.nbytes, self._reuse_or_write, key, itemsize, data
                )
            return key  # no history to remember: no deltas here
        if key not in self.infos:
            self.stats.logical_bytes += data.nbytes
            info = self._reuse(key)
            if info is None:
                info = self._write(path, key, dtype, shape, data, itemsize, is_float)
            else:
                self.stats.reused_objects += 1
            self.infos[key] = info
        history = self.history
        if (
            history is not None
            and history.max_chain
            and self.compress  # an uncompressed encode tries no deltas: keep no base
            and is_float
            and data.nbytes >= MIN_COMPRESS_BYTES
        ):
            self._remember(path, key, dtype, shape, data)
        return key

    def put_stored(self, path: str, key: str, nbytes: int) -> str:
        """Reference array object ``key``, which an earlier checkpoint of this writer's run stored.

        For a tensor the snapshot found unchanged (see
        :class:`~retrolog.checkpoint.state.TensorMemo`); its live bytes are
        not read, as training may be changing them.
        """
        if self.interrupt is not None and self.interrupt():
            raise Interrupted
        if self._overlap_checks:
            if key not in self.infos and key not in self._checked:
                self.stats.logical_bytes += nbytes
                self._checked[key] = self._submit(0, self._stored_info, key)
        elif key not in self.infos:
            info, _ = self._stored_info(key)
            self.stats.logical_bytes += nbytes
            self.stats.reused_objects += 1
            self.infos[key] = info
        history = self.history
        prev = history._paths.get(path) if history is not None else None
        if prev is not None and prev.key == key:
            self._paths[path] = prev  # as _remember does for an unchanged tensor
        return key

    def _stored_info(self, key: str) -> tuple[ObjectInfo, bool]:
        """The header of ``key``, which an earlier checkpoint of this run stored (touched)."""
        info = self._reuse(key)
        if info is None:
            raise StoreError(
                f"Checkpoint object {key}, which this run stored a few checkpoints ago and "
                "references again for a tensor that did not change, is no longer in the "
                f"store {self.store!r}. Something deleted it while the run was recording "
                "(a garbage collection with a retention policy, or by hand); let "
                "recording runs finish before removing their checkpoints."
            )
        return info, False

    def _reuse_or_write(
        self, key: str, itemsize: int, data: np.ndarray[Any, Any]
    ) -> tuple[ObjectInfo, bool]:
        """On a pool thread: ``key``'s header if stored (touched), else stored as it comes."""
        info = self._reuse(key)
        if info is not None:
            return info, False
        size = self.store.put_framed(key, _head(RAW, itemsize, 0, data.nbytes, None), data)
        return ObjectInfo(size=size, codec=RAW, depth=0, base=None), True

    def _reuse(self, key: str) -> ObjectInfo | None:
        """The stored object ``key`` with its whole delta chain, touched; None to write it."""
        known = self.history._known if self.history is not None else {}
        chain: list[tuple[str, ObjectInfo]] = []
        current: str | None = key
        while current is not None:
            info = self.infos.get(current) or known.get(current)
            if info is None:
                info = read_info(self.store, current)
            if info is None or not self.store.touch(current):
                if current != key:
                    # The object is there but its base is gone, so it cannot be
                    # decoded: replace it (put keeps an intact frame otherwise).
                    self.store.delete(key)
                return None
            chain.append((current, info))
            current = info.base
            if len(chain) > MAX_DEPTH + 1:
                raise _corrupt(key, "its delta chain does not end")
        for k, info in chain[1:]:
            self.infos.setdefault(k, info)
        return chain[0][1]

    def _write(
        self,
        path: str,
        key: str,
        dtype: str,
        shape: tuple[int, ...],
        data: np.ndarray[Any, Any],
        itemsize: int,
        is_float: bool,
    ) -> ObjectInfo:
        if (
            not self.compress
            or not is_float
            or data.nbytes < MIN_COMPRESS_BYTES
            or itemsize not in _UINT
        ):
            return self._put(key, RAW, itemsize, 0, data.nbytes, None, [data])
        full: list[bytes] | None = None
        delta: list[bytes] | None = None
        prev = self._delta_base(path, key, dtype, shape)
        base = None if prev is None else self._base_bytes(prev, data.nbytes)
        if prev is not None and base is not None:
            assert self.history is not None
            gain = self.history.min_gain
            uint = _UINT[itemsize]
            diff = np.subtract(data.view(uint), base.view(uint))  # wraps, exactly invertible
            del base
            delta = _compress(diff.view(np.uint8), itemsize)
            delta_size = _size(delta)
            # Compressing in full too would double the writer's work; the last
            # full size of this path stands in for it when the delta clearly wins.
            if prev.full_size is None or delta_size > gain * prev.full_size:
                full = _compress(data, itemsize)
                if delta_size > gain * _size(full):
                    # Deltas of this tensor do not pay (an Adam moment, say): back off
                    # exponentially, so trying costs at most a few extra compressions.
                    delta = None
                    prev.fails += 1
                    prev.skip = min(2**prev.fails - 1, 15)
                else:
                    prev.fails = 0
        if delta is not None and prev is not None:
            self.stats.delta_objects += 1
            return self._put(
                key, DELTA_BLOSC, itemsize, prev.depth + 1, data.nbytes, prev.key, delta
            )
        if full is None:
            full = _compress(data, itemsize)
        if _size(full) >= data.nbytes:
            return self._put(key, RAW, itemsize, 0, data.nbytes, None, [data])
        return self._put(key, BLOSC, itemsize, 0, data.nbytes, None, full)

    def _delta_base(
        self, path: str, key: str, dtype: str, shape: tuple[int, ...]
    ) -> _PathState | None:
        """The previous version of ``path`` if a delta against it may be tried now."""
        if self.history is None or not self.history.max_chain or not self.compress:
            return None
        prev = self.history._paths.get(path)
        if prev is None or prev.dtype != dtype or prev.shape != shape or prev.key == key:
            return None
        if prev.depth >= self.history.max_chain:
            return None
        if prev.skip > 0:
            prev.skip -= 1
            return None
        # The base must still be stored (and freshened for gc) when the delta lands.
        info = self._reuse(prev.key)
        if info is None:
            return None
        self.infos.setdefault(prev.key, info)
        return prev

    def _base_bytes(self, prev: _PathState, nbytes: int) -> np.ndarray[Any, Any] | None:
        """The bytes of delta base ``prev``: kept in memory, or decoded from the store.

        None when a stored base cannot be read back (damaged, or gone since
        :meth:`_delta_base` found it): the array is then stored in full.
        """
        if prev.base is not None:
            return prev.base
        out = np.empty(nbytes, dtype=np.uint8)
        try:
            # Not remembered: the cache of decoded arrays would keep the base in this
            # recording process's memory after all.
            read_array(self.store, prev.key, prev.dtype, prev.shape, out, remember=False)
        except StoreError:  # CorruptObjectError included
            return None
        return out

    def _put(
        self,
        key: str,
        codec: int,
        itemsize: int,
        depth: int,
        raw_length: int,
        base: str | None,
        parts: Sequence[Any],
    ) -> ObjectInfo:
        head = _head(codec, itemsize, depth, raw_length, base)
        if self.store.parallel_requests > 1:
            size = FRAME_HEADER_SIZE + len(head) + sum(memoryview(p).nbytes for p in parts)
            self._submit(size, self.store.put_framed, key, head, *parts)
        else:
            size = self.store.put_framed(key, head, *parts)
        self.stats.written_objects += 1
        self.stats.written_bytes += size
        return ObjectInfo(size=size, codec=codec, depth=depth, base=base)

    def _submit(self, nbytes: int, call: Callable[..., _R], *args: Any) -> Future[_R]:
        """Run ``call(*args)``, a write of ``nbytes``, on the writer's pool.

        At most 2 x parallel_requests calls wait, and WRITE_BEHIND_BYTES of writes
        beyond one (an upload may join its parts into one buffer: a copy each).
        """
        limit = self.store.parallel_requests
        while self._in_flight and (
            len(self._in_flight) >= 2 * limit or self._in_flight_bytes + nbytes > WRITE_BEHIND_BYTES
        ):
            future, done = self._in_flight.popleft()
            self._in_flight_bytes -= done
            future.result()
        try:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(limit, thread_name_prefix="retrolog-put")
            future = self._pool.submit(call, *args)
        except RuntimeError:
            # The interpreter is exiting (a checkpoint finished from an atexit hook, see
            # BackgroundCheckpointer) and concurrent.futures takes no new work: run it here.
            future = Future()
            try:
                future.set_result(call(*args))
            except BaseException as exc:
                future.set_exception(exc)
        self._in_flight.append((future, nbytes))
        self._in_flight_bytes += nbytes
        return future

    def wait_written(self) -> None:
        """Wait for every array write in flight; the first failure is raised.

        The encode calls it before it writes the manifest, which must name only
        objects that are stored.
        """
        try:
            while self._in_flight:
                self._in_flight.popleft()[0].result()
            for key, checked in self._checked.items():
                info, wrote = checked.result()
                self.infos[key] = info
                if wrote:
                    self.stats.written_objects += 1
                    self.stats.written_bytes += info.size
                else:
                    self.stats.reused_objects += 1
        finally:
            self.close()

    def close(self) -> None:
        """Stop what has not started, wait for what has; raises nothing (an error path)."""
        for future, _ in self._in_flight:
            future.cancel()
        self._in_flight.clear()
        self._in_flight_bytes = 0
        self._checked.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _remember(
        self, path: str, key: str, dtype: str, shape: tuple[int, ...], data: np.ndarray[Any, Any]
    ) -> None:
        assert self.history is not None
        prev = self.history._paths.get(path)
        info = self.infos[key]
        if prev is not None and (prev.key == key or info.depth >= self.history.max_chain):
            # Unchanged, or stored at the deepest depth allowed: the next version's
            # delta is taken against the same base as this one was.
            self._paths[path] = prev
            return
        if info.depth >= self.history.max_chain:
            return  # (reused from another run) too deep to be a base
        history = self.history
        base = prev.base if prev is not None else None
        if base is not None and base.nbytes == data.nbytes:
            self._base_updates.append((base, data))  # its memory, reused at finish()
        else:
            if base is not None:
                self._base_bytes_held -= base.nbytes
            base = None
            if self._base_bytes_held + data.nbytes <= history.base_budget:
                base = data.copy()
                self._base_bytes_held += data.nbytes
        full_size = prev.full_size if prev is not None else None
        if info.codec == BLOSC:
            full_size = info.size
        fails, skip = (prev.fails, prev.skip) if prev is not None else (0, 0)
        self._paths[path] = _PathState(key, dtype, shape, info.depth, base, full_size, fails, skip)

    def finish(self, manifest_size: int, raw_blobs: dict[str, int], seconds: float) -> int:
        """Account for the manifest and the raw blobs, update the history; the stored size.

        raw_blobs: key -> size of the raw objects (long bytes, pickles) the
        manifest references; they are counted as written.
        """
        stats = self.stats
        raw = sum(raw_blobs.values())
        stats.logical_bytes += manifest_size + raw
        stats.objects = len(self.infos) + len(raw_blobs) + 1
        stats.stored_bytes = manifest_size + raw + sum(i.size for i in self.infos.values())
        stats.written_objects += 1 + len(raw_blobs)
        stats.written_bytes += manifest_size + raw
        stats.seconds = seconds
        if self.history is not None:
            for base, data in self._base_updates:
                np.copyto(base, data)  # the snapshot is not released before encode returns
            self._base_updates = []
            self.history._paths = self._paths
            # Exact again: a path that left the state took its base with it.
            self.history.base_bytes = sum(
                p.base.nbytes for p in self._paths.values() if p.base is not None
            )
            self.history._known = dict(self.infos)
            self.history.last = stats
            self.history.total.add(stats)
        return stats.stored_bytes


def _head(codec: int, itemsize: int, depth: int, raw_length: int, base: str | None) -> bytes:
    """An array object's payload header (docs/checkpoint-storage.md, "Array payload")."""
    return _HEAD.pack(codec, itemsize % 256, depth, raw_length, bytes.fromhex(base or "0" * 32))


def _compress(data: np.ndarray[Any, Any], itemsize: int) -> list[bytes]:
    """``data`` in blosc2 chunks of at most :data:`SEGMENT_BYTES`, each after its length.

    A blosc2 chunk names its codec, so the reader needs nothing else: chunks
    that earlier versions compressed with lz4 decode the same way.
    """
    codec = _codec()
    parts: list[bytes] = []
    step = SEGMENT_BYTES - SEGMENT_BYTES % itemsize
    for start in range(0, data.nbytes, step):
        try:
            chunk = codec.blosc2_encode(
                data[start : start + step],
                CLEVEL,
                compressor=codec.BLOSC2.COMPRESSOR.ZSTD,
                shuffle=codec.BLOSC2.FILTER.SHUFFLE,
                # Each byte plane of a block is compressed on its own, and one
                # that does not compress (low mantissa bytes) is stored as is,
                # which decompresses at memcpy speed.
                splitmode=codec.BLOSC2.SPLIT.ALWAYS,
                typesize=itemsize,
                blocksize=BLOCK_BYTES,
                numthreads=1,  # the idle lane: one thread, on cycles nobody wanted
            )
        except (RuntimeError, ValueError) as exc:
            raise StoreError(f"blosc2 could not compress {data.nbytes} bytes: {exc}") from exc
        parts += [_SEGMENT.pack(len(chunk)), chunk]
    return parts


def _size(parts: list[bytes]) -> int:
    return sum(len(p) for p in parts)


# ---------------------------------------------------------------- reading


def read_array(
    store: ObjectStore,
    key: str,
    dtype: str,
    shape: Sequence[int],
    out: np.ndarray[Any, Any],
    *,
    remember: bool = True,
) -> None:
    """Fill ``out`` (a contiguous uint8 array of the right size) with array object ``key``.

    Raises CorruptObjectError unless the result hashes to ``key``.
    remember: keep what was decoded in the cache of decoded arrays, for the
      next restore; a recording process, which restores nothing, passes False.
    """
    if DECODED.copy_to(key, out):
        return
    bases: list[tuple[str, np.ndarray[Any, Any]]] = []
    _read_into(store, key, out, MAX_DEPTH, bases)
    if content_key(dtype, shape, out) != key:
        raise _corrupt(
            key,
            f"its content, decoded as dtype {dtype} and shape {tuple(shape)}, does not hash to "
            "its key (a damaged delta base, or a manifest that does not match the object)",
        )
    if not remember:
        return
    # The result is right, so each base decoded on the way to it was too.
    for base_key, base_data in bases:
        DECODED.keep(base_key, base_data)
    DECODED.offer(key, out)


def _read_into(
    store: ObjectStore,
    key: str,
    out: np.ndarray[Any, Any],
    depth_left: int,
    bases: list[tuple[str, np.ndarray[Any, Any]]],
) -> None:
    """Decode object ``key`` into ``out``; delta bases decoded on the way go to ``bases``."""
    if not is_framed_key(key):
        raise _corrupt(key, "a checkpoint array must be a framed object")
    with store.view(key) as data:
        payload = frame_payload(data)
        if payload.nbytes < _HEAD.size:
            raise _corrupt(key, f"its payload is cut short ({payload.nbytes} bytes)")
        codec, itemsize, depth, raw_length, base = _HEAD.unpack_from(payload)
        body = payload[_HEAD.size :]
        if raw_length != out.nbytes:
            raise _corrupt(key, f"it holds {raw_length} bytes where {out.nbytes} are expected")
        if codec == RAW:
            if body.nbytes != raw_length:
                raise _corrupt(
                    key, f"it holds {body.nbytes} raw bytes, its header says {raw_length}"
                )
            out[:] = np.frombuffer(body, dtype=np.uint8)
        elif codec == BLOSC:
            _decompress(key, body, out)
        elif codec == DELTA_BLOSC and depth_left > 0 and depth > 0 and itemsize in _UINT:
            if out.nbytes % itemsize:
                raise _corrupt(key, f"its {out.nbytes} bytes are not whole {itemsize}-byte items")
            uint = _UINT[itemsize]
            _decompress(key, body, out)  # the difference to the base
            if not DECODED.add_to(base.hex(), out.view(uint)):
                base_data = np.empty_like(out)
                _read_into(store, base.hex(), base_data, depth_left - 1, bases)
                np.add(out.view(uint), base_data.view(uint), out=out.view(uint))
                bases.append((base.hex(), base_data))
        else:
            raise _corrupt(key, f"its header names codec {codec} at depth {depth}")
        del payload, body  # views of the mapping, released before it is unmapped


class DecodedArrays:
    """Arrays decoded recently, by key, so that restoring a run's checkpoints decodes each once.

    Replay restores the checkpoints of consecutive iterations, and they share
    content: a frozen backbone is the same object in every checkpoint, and with
    ``max_chain=1`` the deltas of several checkpoints in a row are taken against
    one keyframe. Without the cache each restore would decompress them again.

    Two ways in, both after the decoded content was verified against its key:
    a delta base as soon as it is decoded, and any other array the second time
    it is read (the first read of most arrays is also their last). Entries are
    private arrays, never the caller's, who may change them; the least recently
    used go first once the entries hold more than ``capacity`` bytes.
    Thread-safe.
    """

    SEEN_LIMIT = 1 << 16  # keys read once that are remembered; forgotten all at once beyond

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._arrays: OrderedDict[str, np.ndarray[Any, Any]] = OrderedDict()
        self._seen: set[str] = set()
        self._bytes = 0
        self._lock = threading.Lock()

    def _get(self, key: str, nbytes: int) -> np.ndarray[Any, Any] | None:
        with self._lock:
            cached = self._arrays.get(key)
            if cached is None or cached.nbytes != nbytes:
                return None
            self._arrays.move_to_end(key)
            return cached

    def copy_to(self, key: str, out: np.ndarray[Any, Any]) -> bool:
        """Copy array ``key`` into ``out`` (uint8) if it is cached at that size."""
        cached = self._get(key, out.nbytes)
        if cached is None:
            return False
        np.copyto(out, cached)  # entries are never written: no lock needed to read one
        return True

    def add_to(self, key: str, out: np.ndarray[Any, Any]) -> bool:
        """Add array ``key`` to ``out`` (unsigned ints, wrapping) if cached at that size."""
        cached = self._get(key, out.nbytes)
        if cached is None:
            return False
        np.add(out, cached.view(out.dtype), out=out)
        return True

    def keep(self, key: str, data: np.ndarray[Any, Any]) -> None:
        """Cache ``data`` as array ``key``; no one else may change it from now on."""
        if data.nbytes > self.capacity:
            return
        data = data.reshape(-1).view(np.uint8)
        with self._lock:
            old = self._arrays.pop(key, None)
            self._bytes += data.nbytes - (old.nbytes if old is not None else 0)
            self._arrays[key] = data
            while self._bytes > self.capacity:
                _, dropped = self._arrays.popitem(last=False)
                self._bytes -= dropped.nbytes

    def offer(self, key: str, data: np.ndarray[Any, Any]) -> None:
        """Note that array ``key`` was read as ``data``; keep a copy if it was read before."""
        with self._lock:
            if key in self._arrays:
                return
            if key not in self._seen:
                if len(self._seen) >= self.SEEN_LIMIT:
                    self._seen.clear()
                self._seen.add(key)
                return
        self.keep(key, data.copy())

    def clear(self) -> None:
        with self._lock:
            self._arrays.clear()
            self._seen.clear()
            self._bytes = 0


def _cache_capacity() -> int:
    """A sixteenth of physical memory, at most 1 GiB; 256 MiB where its size is unknown."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 256 << 20
    return int(min(1 << 30, physical // 16))


DECODED = DecodedArrays(_cache_capacity())


def _decompress(key: str, body: memoryview, out: np.ndarray[Any, Any]) -> None:
    codec = _codec()
    filled = 0
    pos = 0
    try:
        while pos < body.nbytes:
            (length,) = _SEGMENT.unpack_from(body, pos)
            pos += _SEGMENT.size
            chunk = body[pos : pos + length]
            pos += length
            size, chunk_length = _CHUNK_SIZES.unpack_from(chunk)
            if filled + size > out.nbytes or chunk.nbytes != length or chunk_length != length:
                raise ValueError("a segment overruns the array")
            if size:
                # One thread per call: restores run calls in parallel, one per tensor.
                codec.blosc2_decode(chunk, out=out[filled : filled + size], numthreads=1)
            filled += size
    except (RuntimeError, ValueError, struct.error) as exc:
        raise _corrupt(key, f"its compressed data cannot be decompressed ({exc})") from exc
    if filled != out.nbytes:
        raise _corrupt(key, f"it decompresses to {filled} bytes, not {out.nbytes}")
