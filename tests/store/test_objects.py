"""The content-addressed object store: keys, atomic idempotent writes, verified reads."""

from __future__ import annotations

import hashlib
import multiprocessing
from pathlib import Path

import pytest

from retrolog.errors import CorruptObjectError, StoreError
from retrolog.store.objects import LocalObjectStore, ObjectStore


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
    before = path.stat().st_mtime_ns, path.stat().st_ino
    assert store.put(b"abc") == key
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert object_files(tmp_path) == [path]


def test_put_repairs_a_truncated_object(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = store.put(b"0123456789")
    store.path(key).write_bytes(b"01234")
    with pytest.raises(CorruptObjectError):
        store.get(key)
    store.put(b"0123456789")
    assert store.get(key) == b"0123456789"


def test_get_missing_key_is_a_store_error(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = "ab" * 32
    with pytest.raises(StoreError, match=key) as info:
        store.get(key)
    assert not isinstance(info.value, CorruptObjectError)
    assert info.value.path == str(store.path(key))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_get_detects_corruption(tmp_path: Path, damage: str) -> None:
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
        store.get(key)
    assert info.value.key == key
    assert info.value.path == str(path)
    assert "Delete the file" in str(info.value)


@pytest.mark.parametrize("key", ["", "../../etc/passwd", "AB" * 32, "ab" * 31, "zz" * 32])
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
