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

A store across a network may stop answering (its server stopped, paused, restarting).
Every request then waits at most ``objects_timeout`` seconds (``RETROLOG_OBJECTS_TIMEOUT``,
default 60) before it is given up as :class:`~retrolog.errors.StoreUnreachableError`,
retried meanwhile; a wait over two seconds is said on stderr, and Ctrl-C (or the end of
the batch it belongs to, ``objects.in_order``) cancels the request itself, so no thread
is left blocked on a socket. The client's own retries are turned off for S3 so that
this is the one retry loop (docs/store.md, "When the object store does not answer").

fsspec is imported when a store is made, never with retrolog: it is an optional
dependency (the ``team`` extra).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from retrolog._config import lookup
from retrolog.errors import StoreError, StoreUnreachableError, store_unreachable
from retrolog.store.objects import ObjectStore, requests_abandoned

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

TIMEOUT_ENV = "RETROLOG_OBJECTS_TIMEOUT"
DEFAULT_TIMEOUT = 60.0  # seconds a request may go unanswered, retries included
# A write's limit grows by its size at this rate, so a large object on a slow link is
# not cut off while it is still being sent.
SLOWEST_BYTES_PER_SECOND = 1 << 20
# Once a request was given up, the next ones get this long until one succeeds: a store
# that is down costs each later request seconds, not another whole timeout.
WHILE_DOWN_SECONDS = 5.0
NOTICE_AFTER = 2.0  # seconds without an answer before stderr says what retrolog waits for
NOTICE_EVERY = 10.0  # seconds between such notices, per store
_POLL = 0.1  # seconds between checks for Ctrl-C, the timeout and an abandoned batch
# botocore's settings for S3: a refused or silent connection fails the attempt quickly
# (a socket that sends nothing for read_timeout s, a server paused or gone), and the
# client retries nothing itself: retrolog's loop does, within the timeout.
S3_CLIENT_CONFIG: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 20,
    "retries": {"total_max_attempts": 1},
}


def quiet_orphaned_unreachable(loop: Any) -> None:
    """Keep off stderr the connection errors of tasks nobody awaits on ``loop``.

    When the store stops in the middle of a request, the HTTP client (aiohttp) can leave
    a task of its own (the one writing the request body) failed and never awaited, and
    asyncio then prints its traceback ("Task exception was never retrieved") on the
    training script's terminal. The request itself fails too and is retried or given up
    by retrolog, which says so in one line; the orphan's error says nothing more. Any
    other exception on the loop, which fsspec shares with the rest of the process, goes
    to the handler that was there before.
    """
    previous = loop.get_exception_handler()
    if getattr(previous, "_retrolog", False):
        return

    def handle(loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        orphan = context.get("future") is not None and "never retrieved" in str(
            context.get("message", "")
        )
        if orphan and exc is not None and store_unreachable(exc):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handle._retrolog = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handle)


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
        if _is_s3_url(url):
            given = storage_options.get("config_kwargs") or {}
            storage_options["config_kwargs"] = {**S3_CLIENT_CONFIG, **given}
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
        if self.s3 and hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own retry loop: one attempt, retrolog's loop retries
        self.timeout = objects_timeout()
        # Requests go through fsspec's event loop, where a wait can be cancelled; a file
        # system without one (local, memory) answers at once or fails.
        self._async = bool(getattr(fs, "async_impl", False)) and not self.local
        if self._async:
            quiet_orphaned_unreachable(fs.loop)
        self._lock = threading.Lock()
        self._down_since: float | None = None  # a request was given up, none answered since
        self._waiting_since: float | None = None  # a request went unanswered (announced)
        self._noticed_at = 0.0

    def __repr__(self) -> str:
        return f"FsspecObjectStore({self.url!r})"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _location(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def _read(self, name: str) -> bytes:
        return bytes(self._request("cat_file", self._path(name)))

    def _read_prefix(self, name: str, size: int) -> bytes | None:
        try:
            return bytes(self._request("cat_file", self._path(name), start=0, end=size))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _write(self, name: str, parts: list[memoryview]) -> None:
        path = self._path(name)
        if self.uploads_atomically:
            # One upload, complete before it starts: the bytes are joined (a copy),
            # which the network costs far more than.
            data = b"".join(parts)
            self._request("pipe_file", path, data, nbytes=len(data))
            return
        with _translated():
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
            info = self._request("info", self._path(name))
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
        return _seconds(self._request("modified", path))

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
                self._request(
                    "call_s3",
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
            self._request("rm_file", self._path(name))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _rename(self, name: str, new: str) -> bool:
        try:
            self._request("mv", self._path(name), self._path(new))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _list(self) -> Iterator[tuple[str, int, float]]:
        prefix = self.root + "/"
        found = self._request("find", self.root, maxdepth=2, detail=True)
        for path, info in found.items():
            if info.get("type") != "file" or not path.startswith(prefix):
                continue
            yield path[len(prefix) :], int(info["size"]), self._time(path, info)

    # -- requests ---------------------------------------------------------------------------

    def _request(self, method: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``, within the timeout, retried while the store is away.

        nbytes: the size of what a write sends (its limit grows with it).
        Errors are OSError (FileNotFoundError for a missing file), as the primitives
        report them, or StoreUnreachableError once the store did not answer in time.
        """
        coroutine = getattr(self.fs, "_" + method, None)
        if not self._async or coroutine is None:
            with _translated():
                return getattr(self.fs, method)(*args, **kwargs)
        return self._retried(lambda: coroutine(*args, **kwargs), method, args, nbytes)

    def _retried(
        self, make: Callable[[], Any], method: str, args: tuple[Any, ...], nbytes: int
    ) -> Any:
        import asyncio
        import concurrent.futures

        started = time.monotonic()
        with self._lock:
            down = self._down_since is not None
        limit = None
        if self.timeout is not None:
            sending = nbytes / SLOWEST_BYTES_PER_SECOND
            limit = self.timeout + sending
            if down:
                limit = min(limit, WHILE_DOWN_SECONDS + sending)
        last: BaseException | None = None
        attempt = 0
        while True:
            future = asyncio.run_coroutine_threadsafe(make(), self.fs.loop)
            try:
                while not future.done():
                    concurrent.futures.wait([future], timeout=_POLL)
                    self._check_wait(started, limit, last, method, args)
                error = future.exception()
            except BaseException:
                future.cancel()  # the request itself stops: no thread stays on its socket
                raise
            if error is None:
                self._answered()
                return future.result()
            if not store_unreachable(error):
                with _translated():
                    raise error
            last = error
            attempt += 1
            pause_until = time.monotonic() + min(0.2 * 2**attempt, 5.0)
            while time.monotonic() < pause_until:
                time.sleep(_POLL)
                self._check_wait(started, limit, last, method, args)

    def _check_wait(
        self,
        started: float,
        limit: float | None,
        last: BaseException | None,
        method: str,
        args: tuple[Any, ...],
    ) -> None:
        """Give up, or say on stderr what is awaited, as the time waited says."""
        if requests_abandoned():
            raise StoreError(f"A request to the object store {self.url} was abandoned.")
        now = time.monotonic()
        waited = now - started
        if limit is not None and waited >= limit:
            with self._lock:
                self._down_since = self._down_since or now
            raise self._unreachable_error(waited, last, method, args)
        if waited < NOTICE_AFTER:
            return
        with self._lock:
            if now - self._noticed_at < NOTICE_EVERY:
                return
            self._noticed_at = now
            self._waiting_since = self._waiting_since or started
        why = f" ({_short(last)})" if last is not None else ""
        until = (
            f"retrying for up to {limit:.0f} s ({TIMEOUT_ENV})"
            if limit is not None
            else f"retrying until it answers ({TIMEOUT_ENV}=0)"
        )
        stop = "; Ctrl-C stops" if threading.current_thread() is threading.main_thread() else ""
        _say(
            f"waiting for the object store at {self.url}: no answer for {waited:.0f} s{why}, "
            f"{until}{stop}."
        )

    def _answered(self) -> None:
        with self._lock:
            announced = self._waiting_since is not None
            self._down_since = None
            self._waiting_since = None
            self._noticed_at = 0.0
        if announced:
            _say(f"the object store at {self.url} answers again.")

    def _unreachable_error(
        self, waited: float, last: BaseException | None, method: str, args: tuple[Any, ...]
    ) -> StoreUnreachableError:
        what = _WHAT.get(method, "a request")
        scheme = self.url.split("://", 1)[0]
        where = f" {scheme}://{args[0]}" if args and isinstance(args[0], str) else ""
        why = f": {_short(last)}" if last is not None else ": no answer at all"
        assert self.timeout is not None
        error = StoreUnreachableError(
            f"The object store at {self.url} did not answer {what}{where} within "
            f"{waited:.0f} s{why}. retrolog retried meanwhile and has given up. Check that "
            "the store's server is running and reachable from this machine (its endpoint, "
            "the network, a proxy), then run again; to wait longer for it, set "
            f"{TIMEOUT_ENV} (now {self.timeout:g} s; 0 waits for ever).",
            path=self.url,
        )
        error.__cause__ = last
        return error


# What each request does, for messages.
_WHAT = {
    "cat_file": "a read of",
    "pipe_file": "a write of",
    "info": "a look-up of",
    "modified": "a look-up of",
    "rm_file": "a deletion of",
    "mv": "a move of",
    "find": "a listing of",
    "call_s3": "a request (copy_object) on",
}


def objects_timeout() -> float | None:
    """Seconds a request to a remote object store may go unanswered (None: no limit)."""
    raw = (lookup(TIMEOUT_ENV) or "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise StoreError(
            f"{TIMEOUT_ENV} is {raw!r}; it takes the seconds a request to the object store "
            "may go unanswered before retrolog gives it up: a number such as 60, or 0 to "
            "wait for ever."
        )
    return value or None


def _is_s3_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in {"s3", "s3a"} and "::" not in url


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _say(message: str) -> None:
    # From whatever thread waits (a checkpoint writer's too): stderr is where it is seen.
    print(f"retrolog: {message}", file=sys.stderr, flush=True)


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
