"""The object store contract: every backend passes the same tests.

An ``ObjectStore`` keeps its checks in the base class and leaves raw reads, writes,
listing and deletion to the backend; these tests hold each backend to what the checks
and ``retrolog gc`` rely on (docs/checkpoint-storage.md, "Backends"). Damage is done
through the backend's own raw layer (``_write``), so it is the same damage everywhere.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from retrolog.errors import CorruptObjectError, StoreError
from retrolog.store.backends import open_object_store
from retrolog.store.fsspec_objects import FsspecObjectStore
from retrolog.store.objects import (
    FRAME_HEADER_SIZE,
    ForwardingStore,
    LocalObjectStore,
    ObjectStore,
    frame,
    frame_payload,
)

from conftest import READS, read

FRAMED = "0123456789abcdef" * 2  # a framed object's key, chosen by its writer
HOUR = 3600.0


@dataclass
class Backend:
    """A store and what a test needs to do to it behind its back."""

    store: ObjectStore
    set_mtime: Callable[[str, float], None]  # a file's time, by its name in the layout
    # Makes the next write fail midway, calling the function given first (to look then).
    break_writes: Callable[[pytest.MonkeyPatch, Callable[[], None]], None]

    def age(self, name: str, seconds: float = 2 * HOUR) -> None:
        self.set_mtime(name, time.time() - seconds)

    def mtime(self, key: str) -> float:
        return next(f.mtime for f in self.store.scan()[0] if f.key == key)


def _local(tmp_path: Path) -> Backend:
    store = LocalObjectStore(tmp_path / "objects", durable=False)

    def set_mtime(name: str, when: float) -> None:
        os.utime(store.root / name, (when, when))

    def break_writes(monkeypatch: pytest.MonkeyPatch, midway: Callable[[], None]) -> None:
        real_write = os.write
        calls: list[int] = []

        def write(fd: int, data: Any) -> int:
            if calls:
                midway()
                raise OSError(errno.ENOSPC, "No space left on device")
            calls.append(fd)
            return real_write(fd, memoryview(data)[: max(1, len(data) // 2)])

        monkeypatch.setattr(os, "write", write)

    return Backend(store, set_mtime, break_writes)


def _fsspec_file(tmp_path: Path) -> Backend:
    root = tmp_path / "objects"
    store = FsspecObjectStore(root.as_uri())

    def set_mtime(name: str, when: float) -> None:
        os.utime(root / name, (when, when))

    return Backend(store, set_mtime, lambda mp, midway: _break_open(store, mp, midway))


def _break_open(
    store: FsspecObjectStore, monkeypatch: pytest.MonkeyPatch, midway: Callable[[], None]
) -> None:
    """Files the store opens for writing fail once half of their first write is written."""
    real_open = store.fs.open

    def open_(path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = real_open(path, mode, **kwargs)
        if "w" in mode:
            real_write = f.write

            def write(data: Any) -> int:
                real_write(memoryview(data)[: max(1, len(data) // 2)])
                midway()
                raise OSError(errno.ENOSPC, "No space left on device")

            f.write = write
        return f

    monkeypatch.setattr(store.fs, "open", open_)


def _fsspec_memory(tmp_path: Path) -> Backend:
    store = FsspecObjectStore(f"memory://contract-{uuid.uuid4().hex}")

    def set_mtime(name: str, when: float) -> None:
        entry = store.fs.store[store._path(name)]
        entry.modified = datetime.datetime.fromtimestamp(when, tz=datetime.timezone.utc)

    return Backend(store, set_mtime, lambda mp, midway: _break_upload(store, mp, midway))


def _break_upload(
    store: FsspecObjectStore, monkeypatch: pytest.MonkeyPatch, midway: Callable[[], None]
) -> None:
    """An object store's upload is one request: what can fail midway is the request, and
    the object must not appear. A file opened for writing fails too, in case the store
    writes through one."""

    def pipe_file(path: str, value: bytes, **kwargs: Any) -> None:
        midway()
        raise OSError(errno.ECONNRESET, "Connection reset by peer")

    async def pipe_file_async(path: str, value: bytes, **kwargs: Any) -> None:
        # On fsspec's event loop: a request made from here would wait for the loop itself.
        import asyncio

        await asyncio.to_thread(midway)
        # A reset connection would be retried (tests/store/test_object_store_outage.py);
        # the server's refusal of the upload is not.
        raise OSError(errno.EIO, "The upload failed midway")

    monkeypatch.setattr(store.fs, "pipe_file", pipe_file)
    monkeypatch.setattr(store.fs, "_pipe_file", pipe_file_async, raising=False)
    _break_open(store, monkeypatch, midway)


class _AgedS3(FsspecObjectStore):
    """An S3 store whose objects can be made to look older than they are.

    S3 sets an object's time when it is written and offers no way to set it back, so
    the tests' "written two hours ago" is an offset per name that this store takes
    off the times the server reports (in ``_mtime`` and ``_list``, the only places
    the base class reads them). Writing or freshening a name drops its offset, as
    writing an object on S3 renews its time. Everything else is real requests to the
    S3-compatible server of scripts/services.sh.
    """

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.aged: dict[str, float] = {}

    def _mtime(self, name: str) -> float | None:
        t = super()._mtime(name)
        return None if t is None else t - self.aged.get(name, 0.0)

    def _list(self) -> Iterator[tuple[str, int, float]]:
        for name, size, mtime in super()._list():
            yield name, size, mtime - self.aged.get(name, 0.0)

    def _freshen(self, name: str) -> bool:
        self.aged.pop(name, None)
        return super()._freshen(name)

    def _write(self, name: str, parts: list[memoryview]) -> None:
        self.aged.pop(name, None)
        super()._write(name, parts)


def _s3(url: str) -> Backend:
    store = _AgedS3(url)

    def set_mtime(name: str, when: float) -> None:
        store.aged[name] = time.time() - when

    return Backend(store, set_mtime, lambda mp, midway: _break_upload(store, mp, midway))


BACKENDS = {"local": _local, "fsspec-file": _fsspec_file, "fsspec-memory": _fsspec_memory}


@pytest.fixture(params=[*sorted(BACKENDS), pytest.param("s3", marks=pytest.mark.services)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "s3":  # the S3-compatible server on loopback (scripts/services.sh)
        made = _s3(request.getfixturevalue("s3_url"))
    else:
        made = BACKENDS[request.param](tmp_path)
    yield made
    store = made.store
    if isinstance(store, FsspecObjectStore) and not store.local and store.fs.exists(store.root):
        store.fs.rm(store.root, recursive=True)


def name_of(key: str) -> str:
    return f"{key[:2]}/{key[2:]}"


def damage(store: ObjectStore, key: str, change: Callable[[bytearray], None]) -> None:
    """Rewrite object ``key`` changed by ``change``, through the backend's raw layer."""
    raw = bytearray(store._read(name_of(key)))
    change(raw)
    store._write(name_of(key), [memoryview(bytes(raw))])


# -- storing and reading ------------------------------------------------------------------


def test_put_get_has_delete(backend: Backend) -> None:
    store = backend.store
    data = b"some tensor bytes" * 10
    key = store.put(data)
    assert key == hashlib.sha256(data).hexdigest()
    assert store.has(key) and store.get(key) == data
    store.delete(key)
    assert not store.has(key)
    store.delete(key)  # a missing object is not an error
    assert store.get(store.put(b"")) == b""  # the empty object


def test_framed_objects(backend: Backend) -> None:
    store = backend.store
    data = frame(FRAMED, b"head", b"er and payload")
    assert store.put(data) == FRAMED
    assert store.get(FRAMED) == data
    assert bytes(frame_payload(store.get(FRAMED))) == b"header and payload"
    other = "fedcba9876543210" * 2
    parts = (b"head", memoryview(b"er and "), bytearray(b"payload" * 1000))
    assert store.put_framed(other, *parts) == len(frame(other, *parts))
    assert store.get(other) == frame(other, *parts)


def test_batches_put_and_get_in_order(backend: Backend) -> None:
    store = backend.store
    datas = [f"file {i}".encode() * (i + 1) for i in range(25)] + [b"file 3" * 4]  # a repeat
    keys = list(store.put_all(iter(datas)))
    assert keys == [hashlib.sha256(d).hexdigest() for d in datas]
    assert list(store.get_all(iter(keys))) == list(zip(keys, datas, strict=True))
    assert list(store.put_all([])) == [] and list(store.get_all([])) == []


def test_a_batch_read_raises_at_the_missing_object_in_its_turn(backend: Backend) -> None:
    store = backend.store
    keys = [store.put(b"before"), "ab" * 32, store.put(b"after")]
    batch = store.get_all(keys)
    assert next(batch) == (keys[0], b"before")
    with pytest.raises(StoreError, match=f"No object {'ab' * 32}"):
        next(batch)


@READS
def test_view_and_peek(backend: Backend, how: str) -> None:
    store = backend.store
    payload = os.urandom(1 << 16)
    store.put_framed(FRAMED, payload)
    assert frame_payload(read(store, FRAMED, how)) == payload
    assert store.peek(FRAMED, FRAME_HEADER_SIZE) == store.get(FRAMED)[:FRAME_HEADER_SIZE]
    assert store.peek("ab" * 16, 8) is None


def test_missing_object_is_a_store_error(backend: Backend) -> None:
    store = backend.store
    key = "ab" * 32
    for how in ("get", "view"):
        with pytest.raises(StoreError, match=f"No object {key}") as info:
            read(store, key, how)
        assert not isinstance(info.value, CorruptObjectError)
        assert info.value.path is not None and key[2:] in info.value.path
    assert not store.has(key) and not store.touch(key)


@pytest.mark.parametrize("key", ["", "../../etc/passwd", "AB" * 32, "ab" * 31, "zz" * 16])
def test_malformed_keys_are_refused(backend: Backend, key: str) -> None:
    store = backend.store
    for call in (store.get, store.has, store.delete, store.touch):
        with pytest.raises(StoreError, match="not an object key"):
            call(key)


def test_a_second_put_writes_nothing_and_freshens(backend: Backend) -> None:
    store = backend.store
    key = store.put(b"abc" * 100)
    backend.age(name_of(key))
    assert store.put(b"abc" * 100) == key
    assert backend.mtime(key) > time.time() - 60  # gc sees the reused object as new
    store.put(frame(FRAMED, b"first encoding"))
    backend.age(name_of(FRAMED))
    # The same key is the same content however it is encoded: the first stays.
    store.put_framed(FRAMED, b"second, longer encoding")
    assert bytes(frame_payload(store.get(FRAMED))) == b"first encoding"
    assert backend.mtime(FRAMED) > time.time() - 60
    objects, temps = store.scan()
    assert sorted(f.key or "" for f in objects) == sorted([key, FRAMED]) and temps == []


def test_touch_freshens_an_object(backend: Backend) -> None:
    store = backend.store
    key = store.put(b"reused" * 100)
    backend.age(name_of(key))
    assert backend.mtime(key) < time.time() - HOUR
    assert store.touch(key)
    assert backend.mtime(key) > time.time() - 60
    assert store.get(key) == b"reused" * 100


# -- damage -------------------------------------------------------------------------------


@READS
@pytest.mark.parametrize("kind", ["raw", "framed"])
def test_a_flipped_byte_is_detected_on_read(backend: Backend, kind: str, how: str) -> None:
    store = backend.store
    key = store.put(bytes(range(256)) if kind == "raw" else frame(FRAMED, bytes(range(256))))

    def flip(raw: bytearray) -> None:
        raw[100] ^= 0x01

    damage(store, key, flip)
    with pytest.raises(CorruptObjectError, match="corrupt") as info:
        read(store, key, how)
    assert info.value.key == key and "Delete the file" in str(info.value)


@READS
@pytest.mark.parametrize("kind", ["raw", "framed"])
def test_a_truncated_object_is_detected_and_a_put_repairs_it(
    backend: Backend, kind: str, how: str
) -> None:
    store = backend.store
    data = bytes(range(256)) * 4 if kind == "raw" else frame(FRAMED, bytes(range(256)) * 4)
    key = store.put(data)

    def truncate(raw: bytearray) -> None:
        del raw[500:]

    damage(store, key, truncate)
    with pytest.raises(CorruptObjectError, match=r"promises 1024 payload bytes|hash to"):
        read(store, key, how)
    assert store.put(data) == key
    assert read(store, key, how) == data


@pytest.mark.parametrize("kind", ["raw", "framed"])
def test_a_write_that_fails_midway_leaves_nothing_visible(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    store = backend.store
    data = os.urandom(1 << 16)
    key = hashlib.sha256(data).hexdigest() if kind == "raw" else FRAMED
    seen: list[bool] = []
    backend.break_writes(monkeypatch, lambda: seen.append(store.has(key)))
    with pytest.raises(StoreError, match="Cannot write object file") as info:
        if kind == "raw":
            store.put(data)
        else:
            store.put_framed(FRAMED, data[:1000], data[1000:])
    assert not isinstance(info.value, CorruptObjectError)
    monkeypatch.undo()
    assert seen == [False]  # not visible while the write was under way
    assert not store.has(key)
    with pytest.raises(StoreError, match="No object"):
        store.get(key)
    assert store.scan() == ([], [])  # no object, and no temp file left behind


# -- listing and safe deletion (what gc uses) ---------------------------------------------


def test_scan_lists_exactly_the_objects_with_their_sizes(backend: Backend) -> None:
    store = backend.store
    assert store.scan() == ([], [])  # an empty (or not yet created) store
    sizes = {store.put(b"x" * n): n for n in (1, 10, 1000)}
    sizes[FRAMED] = store.put_framed(FRAMED, b"payload")
    # Files the layout does not name as objects are never listed as objects.
    for stranger in ("README", "zz/not-a-key", "ab/cd", f"{FRAMED[:2]}/{FRAMED}"):
        store._write(stranger, [memoryview(b"keep me")])
    temp = f"{FRAMED[:2]}/.{FRAMED[2:18]}.123.abcdef.tmp"
    store._write(temp, [memoryview(b"in flight")])
    objects, temps = store.scan()
    assert {f.key: f.size for f in objects} == sizes
    assert all(f.name == name_of(f.key or "") for f in objects)
    assert [(t.name, t.key, t.size) for t in temps] == [(temp, None, 9)]
    assert temps[0].location.endswith(temp)


def test_remove_if_stale_deletes_old_objects_only(backend: Backend) -> None:
    store = backend.store
    stale, touched, reput, fresh = (store.put(b"object %d" % i * 50) for i in range(4))
    for key in (stale, touched, reput):
        backend.age(name_of(key))
    cutoff = time.time() - HOUR / 2
    store.touch(touched)  # a writer reused it after gc chose it
    store.put(b"object 2" * 50)  # a writer stored it again
    assert store.remove_if_stale(stale, cutoff)
    assert not store.has(stale)
    assert not store.remove_if_stale(stale, cutoff)  # already gone
    for key in (touched, reput, fresh):
        assert not store.remove_if_stale(key, cutoff)
        assert store.has(key) and store.get(key)
    assert sorted(f.key or "" for f in store.scan()[0]) == sorted([touched, reput, fresh])
    assert store.scan()[1] == []  # nothing left aside


def test_remove_temp_deletes_old_temp_files_only(backend: Backend) -> None:
    store = backend.store
    old, fresh = "ab/.abcdef.1.00.tmp", ".stray.2.00.tmp"
    for name in (old, fresh):
        store._write(name, [memoryview(b"x" * 100)])
    backend.age(old)
    cutoff = time.time() - HOUR / 2
    assert store.remove_temp(old, cutoff)
    assert not store.remove_temp(fresh, cutoff)
    assert not store.remove_temp(old, cutoff)  # already gone
    assert [t.name for t in store.scan()[1]] == [fresh]
    with pytest.raises(StoreError, match="not a temp file"):
        store.remove_temp("ab/cdef", cutoff)


# -- choosing a backend -------------------------------------------------------------------


def test_a_location_chooses_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_object_store(str(tmp_path)), LocalObjectStore)
    local = open_object_store(tmp_path.as_uri())
    assert isinstance(local, LocalObjectStore) and local.root == tmp_path
    memory = open_object_store(f"memory://choose-{uuid.uuid4().hex}")
    assert isinstance(memory, FsspecObjectStore) and not memory.renames_atomically
    with pytest.raises(StoreError, match="must name a path on this machine"):
        open_object_store("file://otherhost/path")


def test_a_scheme_without_its_package_says_what_to_install() -> None:
    # gcsfs is in no extra of ours (s3fs is, in team and so in dev).
    with pytest.raises(StoreError, match=r"gs://bucket/prefix needs a package.*install gcsfs"):
        open_object_store("gs://bucket/prefix")
    with pytest.raises(StoreError, match="Protocol not known"):
        open_object_store("nosuchprotocol://bucket")


def test_importing_the_store_does_not_import_fsspec() -> None:
    import subprocess
    import sys

    code = (
        "import sys, retrolog, retrolog.store.backends, retrolog.store.fsspec_objects\n"
        "assert 'fsspec' not in sys.modules, 'fsspec imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_s3_freshens_an_object_without_moving_its_bytes(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reused object (a frozen layer, every checkpoint) is freshened by one server-side
    copy, not downloaded and uploaded again."""
    store = open_object_store(s3_url)
    assert isinstance(store, FsspecObjectStore)
    key = store.put(b"a frozen layer" * 1000)
    before = next(f.mtime for f in store.scan()[0] if f.key == key)
    time.sleep(1.1)  # S3 keeps times in whole seconds

    def no_transfer(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the object's bytes were moved to freshen it")

    monkeypatch.setattr(store.fs, "pipe_file", no_transfer)
    monkeypatch.setattr(store.fs, "cat_file", no_transfer)
    assert store.touch(key)
    assert next(f.mtime for f in store.scan()[0] if f.key == key) > before
    monkeypatch.undo()
    assert store.get(key) == b"a frozen layer" * 1000
    missing = "ab" * 32
    assert not store.touch(missing)


class Watched(ForwardingStore):
    """``inner`` with a round trip's delay on each read and write, counting those at once."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.lock = threading.Lock()
        self.now = self.most = 0

    def _watch(self, call: Callable[[], Any]) -> Any:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.02)  # a round trip to a store farther away than loopback
            return call()
        finally:
            with self.lock:
                self.now -= 1

    def _write(self, name: str, parts: list[memoryview]) -> None:
        self._watch(lambda: super(Watched, self)._write(name, parts))

    def _read(self, name: str) -> bytes:
        return self._watch(lambda: super(Watched, self)._read(name))  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def _open_view(self, name: str) -> Iterator[memoryview]:
        data = self._watch(lambda: super(Watched, self)._read(name))
        yield memoryview(data)


def test_batches_on_s3_keep_several_requests_in_flight(s3_url: str) -> None:
    """A first code copy is a request or two per file: on a remote store they overlap."""
    inner = open_object_store(s3_url)
    assert inner.parallel_requests > 1
    store = Watched(inner)
    datas = [os.urandom(64) for _ in range(40)]
    keys = list(store.put_all(datas))
    assert store.most > 1, "puts were made one at a time"
    writes, store.most = store.most, 0
    assert [data for _, data in store.get_all(keys)] == datas
    assert 1 < store.most <= inner.parallel_requests and writes <= inner.parallel_requests


def test_a_checkpoint_restores_from_s3_with_its_reads_overlapped(s3_url: str) -> None:
    """Each array object is a round trip on S3, small or not: a restore overlaps them."""
    import numpy as np

    from retrolog.checkpoint.codec import decode, encode
    from retrolog.checkpoint.state import Snapshot

    store = Watched(open_object_store(s3_url))
    rng = np.random.default_rng(0)
    state = {f"layer{i}": rng.standard_normal(20_000) for i in range(6)}  # 160 KB: objects
    key, _ = encode(Snapshot(objects=state, rng={}), store)
    store.most = 0
    restored = decode(key, store).objects
    assert store.most > 1, "the arrays were read one at a time"
    assert all(np.array_equal(restored[k], v) for k, v in state.items())
