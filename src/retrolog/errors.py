"""The exceptions retrolog raises.

Every error is a :class:`RetrologError`; the CLI prints its message as one
paragraph on stderr and exits 1. Errors from sqlite3, git, subprocesses and
codecs are converted where they enter our code (``raise ... from exc``)::

    RetrologError
    ├── UsageError                  the caller asked for something that cannot be done
    │   ├── ArgumentError           a --kwargs value does not fit its arg() default
    │   ├── CheckpointTargetError   checkpointing() was given an object it cannot save
    │   ├── QueryError              a SQL query or where-predicate is malformed or writes
    │   ├── UnknownNameError        a requested log name was never logged
    │   ├── RunNotFoundError        no run matches the given id
    │   └── RayUnavailableError     --executor ray, but Ray is missing or its cluster unreachable
    ├── ReadCancelled               a read stopped because its caller no longer waits
    ├── StoreError                  the store cannot be opened, read or written
    │   ├── UntrustedPickleError    a stored pickle, not read without the user's trust
    │   ├── CorruptObjectError      a stored object fails its checksum
    │   └── StoreUnreachableError   a remote object store did not answer within its timeout
    ├── VersionError                git failed while capturing or reading a code version
    └── InexactReplayError          a replay recomputed recorded values differently

    RetrologWarning (UserWarning)   something worth knowing that does not stop the run
"""

from __future__ import annotations


class RetrologError(Exception):
    """Base class of every error retrolog raises on purpose."""


class UsageError(RetrologError):
    """The caller asked for something that cannot be done as asked."""


class ArgumentError(UsageError):
    """A ``--kwargs`` value cannot be cast to the type of its ``arg()`` default."""

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class CheckpointTargetError(UsageError):
    """``checkpointing()`` was given an object whose state it cannot capture."""

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class QueryError(UsageError):
    """A SQL query or where-predicate is malformed, or tries to write."""

    def __init__(self, message: str, *, sql: str | None = None) -> None:
        super().__init__(message)
        self.sql = sql


class UnknownNameError(UsageError):
    """A requested log name does not occur in the store."""

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class RunNotFoundError(UsageError):
    """No run, or more than one, matches the given run id."""

    def __init__(self, message: str, *, run_id: str | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id


class RayUnavailableError(UsageError):
    """Replay on Ray was chosen, but Ray is not installed or its cluster cannot be reached."""

    def __init__(self, message: str, *, address: str | None = None) -> None:
        super().__init__(message)
        self.address = address


class ReadCancelled(RetrologError):
    """A read of the store was stopped because its caller no longer waits for it."""


class StoreError(RetrologError):
    """The store cannot be opened, read or written."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UntrustedPickleError(StoreError):
    """A stored value is a pickle, and the user has not said they trust the store's pickles.

    Unpickling can run any code the pickle names, so retrolog never does it on read
    unless RETROLOG_TRUST_PICKLES=1 (docs/store.md, "Trust").
    """


class CorruptObjectError(StoreError):
    """A stored object's content does not match its checksum."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        super().__init__(message, path=path)
        self.key = key


class StoreUnreachableError(StoreError):
    """A remote object store did not answer within ``RETROLOG_OBJECTS_TIMEOUT`` seconds.

    Its server stopped, paused or cut off by the network: nothing is known to be wrong
    with what it holds, and a later request may succeed.
    """


class VersionError(RetrologError):
    """git failed while capturing or reading a run's code version."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class InexactReplayError(RetrologError):
    """A replay's deferred check found recorded values that it recomputed differently.

    The values it backfilled from those runs are stored, marked inexact.
    """

    def __init__(self, message: str, *, run_ids: list[str] | None = None) -> None:
        super().__init__(message)
        self.run_ids = run_ids or []


class RetrologWarning(UserWarning):
    """Something the user should know about that does not stop the run (e.g. a skipped file)."""


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a disk or quota out of space.

    An OSError with ENOSPC or EDQUOT, or SQLite's SQLITE_FULL, anywhere in its chain of
    causes: a full disk is worth surviving, unlike other write failures.
    """
    import errno
    import sqlite3

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(current, sqlite3.Error):
            code = getattr(current, "sqlite_errorcode", None)  # Python 3.11+
            if code is not None and code & 0xFF == 13:  # SQLITE_FULL
                return True
            if code is None and "database or disk is full" in str(current):
                return True
        current = current.__cause__ or current.__context__
    return False


# Errors of the clients fsspec's remote file systems use (botocore, aiohttp), told by class
# name so that retrolog imports neither: a connection refused, reset or silent.
_UNREACHABLE_CLASSES = frozenset(
    {
        "ConnectionError",  # botocore's (EndpointConnectionError), not only the builtin
        "HTTPClientError",  # botocore: ConnectTimeoutError, ReadTimeoutError, ...
        "ClientConnectionError",  # aiohttp: ServerDisconnectedError, ClientConnectorError, ...
        "ServerTimeoutError",
        "ClientPayloadError",
        "FSTimeoutError",  # fsspec's own timeout
    }
)
# HTTP statuses of a server that is there but cannot serve now (S3's 500, 503 SlowDown).
_UNAVAILABLE_STATUSES = frozenset({500, 502, 503, 504})


def store_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a remote store did not answer, for now.

    A refused, reset or timed-out connection, a server that stopped answering, or one
    that answered 500/502/503/504: worth retrying, unlike a missing object or a refusal.
    """
    import errno

    if isinstance(exc, StoreUnreachableError):
        return True
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if isinstance(current, OSError) and current.errno in (
            errno.ECONNREFUSED,
            errno.ECONNRESET,
            errno.ETIMEDOUT,
            errno.EHOSTUNREACH,
            errno.ENETUNREACH,
            errno.EPIPE,
        ):
            return True
        if any(c.__name__ in _UNREACHABLE_CLASSES for c in type(current).__mro__):
            return True
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in _UNAVAILABLE_STATUSES:
                return True
        current = current.__cause__  # a handler's own error is not its cause
    return False
