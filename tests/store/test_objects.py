"""The content-addressed object store: keys, atomic idempotent writes, verified reads."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from retrolog.errors import CorruptObjectError, StoreError
from retrolog.store.objects import (
    FRAME_HEADER_SIZE,
    FRAME_MAGIC,
    LocalObjectStore,
    ObjectStore,
    frame,
    frame_payload,
    framed,
    object_key,
)

from conftest import READS, WrappingStore, read


def object_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_put_get_has_delete(tmp_path: Path) -> None:
    store: ObjectStore = LocalObjectStore(tmp_path / "objects")
    data = b"some tensor bytes"
    key = store.put(data)
    assert key == hashlib.sha256(data).hexdigest()
    assert store.has(key)
    assert store.get(key) == data
    assert (tmp_path / "objects" / key[:2] / key[2:]).read_bytes() == data
    store.delete(key)
    assert not store.has(key)
    store.delete(key)  # a missing object is not an error


def test_empty_object(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = store.put(b"")
    assert store.get(key) == b""


def test_put_is_idempotent_and_does_not_rewrite(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = store.put(b"abc")
    path = store.path(key)
    before = path.stat()
    assert store.put(b"abc") == key
    # Same file, not rewritten; its time is freshened so gc sees the object in use (gc.py).
    assert path.stat().st_ino == before.st_ino
    assert path.stat().st_mtime_ns >= before.st_mtime_ns
    assert object_files(tmp_path) == [path]


def test_put_repairs_a_truncated_object(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = store.put(b"0123456789")
    store.path(key).write_bytes(b"01234")
    with pytest.raises(CorruptObjectError):
        store.get(key)
    store.put(b"0123456789")
    assert store.get(key) == b"0123456789"


@READS
def test_get_missing_key_is_a_store_error(tmp_path: Path, how: str) -> None:
    store = LocalObjectStore(tmp_path)
    key = "ab" * 32
    with pytest.raises(StoreError, match=key) as info:
        read(store, key, how)
    assert not isinstance(info.value, CorruptObjectError)
    assert info.value.path == str(store.path(key))


@READS
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_get_detects_corruption(tmp_path: Path, damage: str, how: str) -> None:
    store = LocalObjectStore(tmp_path)
    key = store.put(bytes(range(256)))
    path = store.path(key)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[100] ^= 0x01
    else:
        del raw[200:]
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObjectError, match="corrupt") as info:
        read(store, key, how)
    assert info.value.key == key
    assert info.value.path == str(path)
    assert "Delete the file" in str(info.value)


@pytest.mark.parametrize(
    "key", ["", "../../etc/passwd", "AB" * 32, "ab" * 31, "zz" * 32, "ab" * 15, "AB" * 16]
)
def test_malformed_keys_are_refused(tmp_path: Path, key: str) -> None:
    store = LocalObjectStore(tmp_path)
    for call in (store.get, store.has, store.delete):
        with pytest.raises(StoreError, match="not an object key"):
            call(key)


def test_write_failure_is_a_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = LocalObjectStore(blocker / "objects")
    with pytest.raises(StoreError, match="Cannot write object file") as info:
        store.put(b"x")
    assert info.value.path is not None
    assert str(blocker) in info.value.path


def _put_many(root: str, data: bytes, barrier: object, rounds: int) -> None:
    store = LocalObjectStore(root)
    barrier.wait()  # type: ignore[attr-defined]
    for _ in range(rounds):
        store.put(data)
        store.get(store.put(data))


def test_concurrent_puts_of_the_same_object(tmp_path: Path) -> None:
    data = bytes(range(256)) * 8192  # 2 MiB, so the writes overlap
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    workers = [
        ctx.Process(target=_put_many, args=(str(tmp_path), data, barrier, 5)) for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    store = LocalObjectStore(tmp_path)
    key = hashlib.sha256(data).hexdigest()
    assert object_files(tmp_path) == [store.path(key)]  # one object, no temp files left
    assert store.get(key) == data


# ------------------------------------------------------------------ framed objects


KEY = "0123456789abcdef" * 2  # a framed object's key: 32 hex digits, chosen by the writer


def test_a_frame_is_stored_under_its_own_key(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    data = frame(KEY, b"head", memoryview(b"er and payload"))
    assert store.put(data) == KEY == object_key(data)
    assert store.has(KEY)
    assert store.get(KEY) == data
    assert bytes(frame_payload(store.get(KEY))) == b"header and payload"
    assert store.path(KEY) == tmp_path / KEY[:2] / KEY[2:]
    assert store.peek(KEY, 8) == data[:8]
    assert store.peek("ab" * 16, 8) is None


def test_bytes_that_only_look_like_a_frame_are_raw(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    data = bytearray(frame(KEY, b"payload"))
    data[-1] ^= 1  # the checksum no longer matches: not a frame
    key = store.put(bytes(data))
    assert key == hashlib.sha256(data).hexdigest()
    assert store.get(key) == data


def test_an_intact_frame_is_kept_and_freshened(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    store.put(frame(KEY, b"first encoding"))
    path = store.path(KEY)
    os.utime(path, (1_000_000, 1_000_000))
    # Content addressing: the same key is the same content, however it is encoded;
    # replacing it could change which delta base it needs under a reader's feet.
    store.put(frame(KEY, b"second, longer encoding"))
    assert frame_payload(store.get(KEY)).tobytes() == b"first encoding"
    assert path.stat().st_mtime > 1_000_000
    os.utime(path, (1_000_000, 1_000_000))
    assert store.touch(KEY) and path.stat().st_mtime > 1_000_000
    assert not store.touch("ab" * 16)


def test_a_torn_frame_is_replaced(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    data = frame(KEY, b"x" * 1000)
    store.put(data)
    store.path(KEY).write_bytes(data[:500])
    with pytest.raises(CorruptObjectError, match="promises 1000 payload bytes"):
        store.get(KEY)
    store.put(data)
    assert store.get(KEY) == data


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("magic", "not a retrolog frame"),
        ("key", "its header names object"),
        ("payload", "does not match the checksum"),
        ("truncate", "promises"),
        ("empty", "not a retrolog frame"),
    ],
)
@READS
def test_a_damaged_frame_is_corrupt(tmp_path: Path, damage: str, message: str, how: str) -> None:
    store = LocalObjectStore(tmp_path)
    store.put(frame(KEY, bytes(range(256))))
    path = store.path(KEY)
    raw = bytearray(path.read_bytes())
    if damage == "magic":
        raw[1] ^= 0x20
    elif damage == "key":
        raw[9] ^= 0x01
    elif damage == "payload":
        raw[100] ^= 0x01
    elif damage == "truncate":
        del raw[60:]
    else:
        raw.clear()
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObjectError, match=message) as info:
        read(store, KEY, how)
    assert info.value.key == KEY
    assert info.value.path == str(path)
    assert "Delete the file" in str(info.value)


@pytest.mark.parametrize("wrapped", [False, True], ids=["local", "default"])
def test_put_framed_stores_what_put_of_the_frame_stores(tmp_path: Path, wrapped: bool) -> None:
    """A local store writes the parts one after another; any other store gets put(frame)."""
    inner = LocalObjectStore(tmp_path / "framed")
    store: ObjectStore = WrappingStore(inner) if wrapped else inner
    parts = (b"head", memoryview(b"er and "), bytearray(b"payload" * 1000))
    expected = frame(KEY, *parts)
    assert b"".join(framed(KEY, *parts)) == expected
    assert store.put_framed(KEY, *parts) == len(expected)
    assert inner.path(KEY).read_bytes() == expected
    assert store.get(KEY) == expected
    reference = LocalObjectStore(tmp_path / "put")
    reference.put(expected)
    assert object_files(tmp_path / "framed")[0].name == object_files(tmp_path / "put")[0].name
    # As put() does: an intact frame under the key is kept (and freshened), a torn one replaced.
    path = inner.path(KEY)
    os.utime(path, (1_000_000, 1_000_000))
    assert store.put_framed(KEY, b"another encoding") == FRAME_HEADER_SIZE + 16
    assert store.get(KEY) == expected and path.stat().st_mtime > 1_000_000
    path.write_bytes(expected[:100])
    store.put_framed(KEY, *parts)
    assert store.get(KEY) == expected
    assert [p.name for p in object_files(tmp_path / "framed")] == [path.name]  # no temp left


def test_put_takes_any_bytes_like_buffer(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    for data in (bytearray(b"abc" * 100), memoryview(b"def" * 100)):
        key = store.put(data)  # type: ignore[arg-type]
        assert store.get(key) == bytes(data) and key == hashlib.sha256(data).hexdigest()


def test_put_framed_failure_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "store").write_text("a file where the store's directory should be")
    with pytest.raises(StoreError, match="Cannot write object file"):
        LocalObjectStore(tmp_path / "store").put_framed(KEY, b"payload")


def test_frame_refuses_a_bad_key() -> None:
    with pytest.raises(StoreError, match="not a framed object key"):
        frame("ab" * 32, b"x")


def test_peek_and_touch_have_working_defaults(tmp_path: Path) -> None:
    store = WrappingStore(LocalObjectStore(tmp_path))  # the four abstract methods only
    store.put(frame(KEY, b"payload"))
    assert store.peek(KEY, 8) == FRAME_MAGIC
    assert store.peek("ab" * 16, 8) is None
    assert store.touch(KEY) and not store.touch("ab" * 16)
    with store.view(KEY) as data:
        assert frame_payload(data) == b"payload"


def test_a_view_is_the_object_and_may_outlive_its_block(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    payload = os.urandom(1 << 20)
    store.put(frame(KEY, payload))
    with store.view(KEY) as data:
        assert data.readonly
        assert frame_payload(data) == payload
        kept = frame_payload(data)[:16]  # a slice still alive when the block ends
    assert bytes(kept) == payload[:16]  # the mapping lives on until its last reference


class SyscallLog:
    """Records fsync (of which path) and rename calls, in order, then performs them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            self.calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
            self.calls.append(("rename", str(dst)))
            real_replace(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)


needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")


@needs_proc
@pytest.mark.parametrize("kind", ["raw", "framed"])
def test_a_durable_store_syncs_files_before_the_rename_and_directories_at_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    root = tmp_path / "store" / "objects"
    store = LocalObjectStore(root)
    log = SyscallLog(monkeypatch)
    if kind == "raw":
        key = store.put(b"first object")
    else:
        key = KEY
        store.put_framed(KEY, b"head", b"body")
    path = store.path(key)
    fanout = str(path.parent)
    # The store's first write created the root and the fan-out directory: both entries
    # synced at once; the file before its rename; the rename itself waits for sync().
    assert log.calls[:2] == [("fsync", str(root.parent)), ("fsync", str(root))]
    assert log.calls[2][0] == "fsync" and log.calls[2][1].startswith(fanout + "/.")
    assert log.calls[3:] == [("rename", str(path))]

    # More objects, in that directory and in another: each directory synced once.
    same = next(
        d for i in range(10_000) if object_key(d := b"second %d" % i)[:2] == path.parent.name
    )
    other = next(
        d for i in range(10_000) if object_key(d := b"third %d" % i)[:2] != path.parent.name
    )
    store.put(same)
    store.put(other)
    log.calls.clear()
    store.sync()
    assert sorted(log.calls) == sorted(
        [("fsync", fanout), ("fsync", str(store.path(object_key(other)).parent))]
    )
    log.calls.clear()
    store.sync()  # nothing renamed since
    assert log.calls == []
    assert read(store, object_key(same), "get") == same


@needs_proc
def test_a_scratch_store_syncs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalObjectStore(tmp_path / "objects", durable=False)
    log = SyscallLog(monkeypatch)
    key = store.put(b"scratch")
    store.sync()
    assert [c for c, _ in log.calls] == ["rename"]
    assert store.get(key) == b"scratch"


@pytest.mark.parametrize(
    ("error", "raised"), [(errno.EIO, True), (errno.EINVAL, False), (errno.EACCES, False)]
)
def test_a_directory_sync_failure_is_reported_unless_unsupported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, raised: bool
) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    store.put(b"before")
    store.sync()  # the directories exist and are synced
    key = store.put(b"after")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(error, os.strerror(error))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if raised:
        with pytest.raises(StoreError, match=r"Cannot make the object directory .* durable"):
            store.sync()
        monkeypatch.setattr(os, "fsync", real_fsync)
        synced: list[int] = []
        monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
        store.sync()  # the directory is still to do
        assert len(synced) == 1
    else:
        store.sync()
    assert store.get(key) == b"after"
