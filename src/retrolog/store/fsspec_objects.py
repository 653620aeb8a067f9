"""Objects at an fsspec URL: the store a team shares (``s3://bucket/prefix``, ``memory://``).

The layout and every check are :class:`~retrolog.store.objects.ObjectStore`'s, as for a
local directory. What differs by protocol is what the file system offers for the two
properties those checks rely on (docs/checkpoint-storage.md, "Backends"):

- **Atomic visibility.** Object stores (S3, GCS, Azure, memory) make an upload visible
  whole or not at all, so an object is written with one ``pipe_file`` under its own
  name. Elsewhere it is written to a temp name and moved into place, which is atomic
  where ``mv`` is a rename (local and network file systems).
- **Times.** Garbage collection keeps what was written or freshened after its cutoff.
  Locally freshening sets the file's time (``os.utime``); object stores have no way to
  change an object's time in place, so there it is uploaded again (same bytes, new
  time). Only local files move aside atomically with their time kept, so elsewhere
  the collector reads the time and then deletes, and a freshen in between is lost.

fsspec is imported when a store is made, never with retrolog: it is an optional
dependency (the ``team`` extra).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from typing import Any

from retrolog.errors import StoreError
from retrolog.store.objects import ObjectStore

# Protocols whose single upload makes an object visible whole or not at all (S3 and
# GCS PUTs, Azure block blobs committed at once; memory stores the bytes in one step).
ATOMIC_UPLOAD = frozenset({"memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
# Protocols whose mv is rename(2): atomic, and the file keeps its time.
LOCAL = frozenset({"file", "local"})
# fsspec's info() spells an object's modification time differently per protocol.
_TIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified")


# Requests kept in flight by put_all and get_all on a store that is not a local disk:
# the size of the connection pool s3fs's client keeps by default (aiobotocore's
# max_pool_connections), so no request waits for a connection.
REMOTE_PARALLEL_REQUESTS = 10


class FsspecObjectStore(ObjectStore):
    """Objects under ``url``, through fsspec, laid out as a local store lays them out.

    storage_options: passed to the protocol's file system (credentials, endpoint).
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        fsspec = import_fsspec(url)
        # Other processes, on other machines, write and delete objects here. A listing
        # cached by the file system (s3fs keeps them) would answer has() and the times
        # gc reads from the past: a writer could skip an object gc has just deleted, or
        # gc delete one a writer has just freshened. So every question goes to the store.
        storage_options = {"use_listings_cache": False, **storage_options}
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as exc:
            raise StoreError(missing_package_message(url, exc)) from exc
        except (ValueError, OSError, TypeError) as exc:
            raise StoreError(
                f"Cannot open the object store {url}: {exc}. Check the URL: a directory path, "
                "file:///path, or PROTOCOL://bucket/prefix for a protocol fsspec knows."
            ) from exc
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.fs = fs
        self.url = url
        self.location = url
        self.root = str(root).rstrip("/")
        self.local = bool(LOCAL & set(protocols))
        self.renames_atomically = self.local
        self.uploads_atomically = not self.local and bool(ATOMIC_UPLOAD & set(protocols))
        self.s3 = bool({"s3", "s3a"} & set(protocols)) and hasattr(fs, "call_s3")
        if not self.local:
            self.parallel_requests = REMOTE_PARALLEL_REQUESTS

    def __repr__(self) -> str:
        return f"FsspecObjectStore({self.url!r})"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _location(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def _read(self, name: str) -> bytes:
        with _translated():
            return bytes(self.fs.cat_file(self._path(name)))

    def _read_prefix(self, name: str, size: int) -> bytes | None:
        try:
            with _translated():
                return bytes(self.fs.cat_file(self._path(name), start=0, end=size))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _write(self, name: str, parts: list[memoryview]) -> None:
        path = self._path(name)
        with _translated():
            if self.uploads_atomically:
                # One upload, complete before it starts: the bytes are joined (a copy),
                # which the network costs far more than.
                self.fs.pipe_file(path, b"".join(parts))
                return
            tmp = self._path(self._temp_name(name))
            try:
                self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
                with self.fs.open(tmp, "wb") as f:
                    for part in parts:
                        f.write(part)
                    if self.local:
                        f.flush()
                        os.fsync(f.fileno())
                self.fs.mv(tmp, path)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(tmp)
                raise

    def _info(self, name: str) -> dict[str, Any] | None:
        try:
            with _translated():
                info = self.fs.info(self._path(name))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return info if info.get("type") == "file" else None

    def _size(self, name: str) -> int | None:
        info = self._info(name)
        return None if info is None else int(info["size"])

    def _mtime(self, name: str) -> float | None:
        info = self._info(name)
        return None if info is None else self._time(self._path(name), info)

    def _time(self, path: str, info: dict[str, Any]) -> float:
        for field in _TIME_FIELDS:
            if info.get(field) is not None:
                return _seconds(info[field])
        with _translated():
            return _seconds(self.fs.modified(path))

    def _freshen(self, name: str) -> bool:
        path = self._path(name)
        if self.local:
            try:
                os.utime(path)
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True
        if self.s3:
            # S3 renews an object's time when it is copied onto itself with new metadata:
            # one request, no bytes moved (a frozen backbone is reused by every checkpoint).
            bucket, key, _ = self.fs.split_path(path)
            try:
                with _translated():
                    self.fs.call_s3(
                        "copy_object",
                        Bucket=bucket,
                        Key=key,
                        CopySource={"Bucket": bucket, "Key": key},
                        MetadataDirective="REPLACE",
                        Metadata={"retrolog-freshened": f"{time.time():.3f}"},
                    )
                return True
            except (FileNotFoundError, NotADirectoryError):
                return False
            except OSError:
                pass  # a server without self-copy, or an object over 5 GB: upload it again
        # No other protocol but a local one changes an existing object's time (s3fs refuses
        # touch(truncate=False); memory has none): upload the same bytes again. If the
        # object goes in between, the upload puts it back, which is what a writer wants.
        try:
            data = self._read(name)
        except (FileNotFoundError, NotADirectoryError):
            return False
        self._write(name, [memoryview(data)])
        return True

    def _delete(self, name: str) -> bool:
        try:
            with _translated():
                self.fs.rm_file(self._path(name))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _rename(self, name: str, new: str) -> bool:
        try:
            with _translated():
                self.fs.mv(self._path(name), self._path(new))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _list(self) -> Iterator[tuple[str, int, float]]:
        prefix = self.root + "/"
        with _translated():
            found = self.fs.find(self.root, maxdepth=2, detail=True)
        for path, info in found.items():
            if info.get("type") != "file" or not path.startswith(prefix):
                continue
            yield path[len(prefix) :], int(info["size"]), self._time(path, info)


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """Errors of a file system's own types (a cloud SDK's) as OSError, which the store reports."""
    try:
        yield
    except OSError:
        raise
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        raise OSError(f"{type(exc).__name__}: {exc}") from exc


def _seconds(value: Any) -> float:
    """A time as fsspec's info() gives it (seconds, a datetime, ISO text) in epoch seconds."""
    if isinstance(value, str):
        value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # fsspec's file systems report UTC
            value = value.replace(tzinfo=datetime.timezone.utc)
        return value.timestamp()
    return float(value)


def import_fsspec(url: str) -> Any:
    """The fsspec module, or a StoreError saying how to install it."""
    try:
        import fsspec
    except ImportError as exc:
        raise StoreError(
            f"The object store {url} is reached through fsspec, which is not installed. "
            "Install retrolog's team extra (pip install 'retrolog[team]'), plus the package "
            "for the URL's protocol (s3fs for s3://, gcsfs for gs://, adlfs for az://)."
        ) from exc
    return fsspec


def missing_package_message(url: str, exc: ImportError) -> str:
    """One paragraph for a protocol whose package is missing (fsspec's own hint included)."""
    return (
        f"The object store {url} needs a package that is not installed ({exc}). Install it "
        "in this environment (e.g. pip install s3fs for s3://, gcsfs for gs://, adlfs for "
        "az://), beside retrolog's team extra (pip install 'retrolog[team]')."
    )
