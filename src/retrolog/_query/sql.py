"""Read-only SQL over the store, as a DataFrame.

``query(conn, sql)`` runs one statement with a SQLite authorizer that allows
reads only, so neither a user's query nor a ``where`` predicate spliced into
``dataframe()``'s SQL can change the store or the connection. The tables a
user may read are listed in :data:`DOCUMENTED_TABLES`.

Every such statement also runs within limits, so that a query cannot run
forever or take the machine's memory: a time budget (``RETROLOG_QUERY_TIMEOUT``
seconds, default 120, 0 for none), a memory budget for what the process grows
by while it runs, SQLite's allocations and the rows fetched alike
(``RETROLOG_QUERY_MEMORY_MB``, default 1024), and Ctrl-C, which stops it at
once (SQLite returns to Python only between steps of its virtual machine, so a
progress handler is what hears it).
"""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from retrolog._config import lookup
from retrolog.errors import QueryError
from retrolog.store.cancel import cancelled, check_cancelled, watched
from retrolog.store.metastore import dialect_of

if TYPE_CHECKING:
    import pandas as pd

DOCUMENTED_TABLES: dict[str, str] = {
    "runs": "one row per run: run_id, projid, tstamp, filename, status, args, code version",
    "loops": "one row per loop iteration: run_id, ctx_id, parent_ctx, name, iteration, depth",
    "logs": "one row per logged value: run_id, ctx_id, name, value, value_type, origin",
    "checkpoints": "one row per checkpoint: run_id, ctx_id, loop_name, kind, manifest, nbytes",
    "profile": "record-time timings for the replay cost model: run_id, phase, ctx_id, seconds",
    "replays": "one row per replay: replay_id, started_at, names, where_sql, filename, status",
    "replay_runs": "one row per run a replay answered: replay_id, run_id, status, backfilled",
    "definitions": "one row per definition of a logged name: lineage, name, text, first_run",
    "migrations": "the schema migrations applied to this store",
}
"""The tables ``query()`` documents for users, with what a row is."""

# Pragmas that only report (their argument, if any, names an object to report on).
_REPORTING_PRAGMAS = frozenset(
    {
        "collation_list",
        "compile_options",
        "database_list",
        "foreign_key_check",
        "foreign_key_list",
        "function_list",
        "index_info",
        "index_list",
        "index_xinfo",
        "integrity_check",
        "module_list",
        "pragma_list",
        "quick_check",
        "table_info",
        "table_list",
        "table_xinfo",
    }
)
# Pragmas that are settings: reading one (no argument) is allowed, setting it is not.
_READABLE_SETTINGS = frozenset(
    {
        "application_id",
        "auto_vacuum",
        "busy_timeout",
        "cache_size",
        "data_version",
        "encoding",
        "foreign_keys",
        "freelist_count",
        "journal_mode",
        "locking_mode",
        "max_page_count",
        "mmap_size",
        "page_count",
        "page_size",
        "query_only",
        "schema_version",
        "synchronous",
        "temp_store",
        "user_version",
        "wal_autocheckpoint",
    }
)
# Python's sqlite3 only names SQLITE_RECURSIVE when built against SQLite >= 3.8.3.
_SQLITE_RECURSIVE = getattr(sqlite3, "SQLITE_RECURSIVE", 33)
_SQLITE_LIMIT_LENGTH = getattr(sqlite3, "SQLITE_LIMIT_LENGTH", 0)  # Python 3.11+ names it
_SCHEMA_TABLES = frozenset({"sqlite_master", "sqlite_temp_master"})
# REINDEX writes but never calls the authorizer, so it is refused by its first word.
_UNAUTHORIZED_WRITE = re.compile(r"^(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*REINDEX\b", re.I | re.S)


class _Refusal:
    """What the authorizer denied first during one statement's preparation."""

    def __init__(self) -> None:
        self.action: str | None = None

    def authorize(
        self, action: int, arg1: str | None, arg2: str | None, db: str | None, source: str | None
    ) -> int:
        """The sqlite3 authorizer callback: SQLITE_OK for reads, SQLITE_DENY otherwise."""
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, _SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            if arg2 == "load_extension":
                return self._deny("load an extension (load_extension)")
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if name in _REPORTING_PRAGMAS or (name in _READABLE_SETTINGS and arg2 is None):
                return sqlite3.SQLITE_OK
            setting = f"PRAGMA {arg1}" + (f" = {arg2}" if arg2 is not None else "")
            return self._deny(f"change a setting ({setting})")
        if action == sqlite3.SQLITE_UPDATE and arg1 in _SCHEMA_TABLES:
            # SQLite reports this while it sets up a table-valued function (json_each,
            # pragma_table_info); a real UPDATE of the schema table is refused by SQLite itself.
            return sqlite3.SQLITE_OK
        if arg1 in _SCHEMA_TABLES and action in _SCHEMA_CHANGES:
            # CREATE and DROP are first reported as a write to the schema table.
            return self._deny(_SCHEMA_CHANGES[action])
        return self._deny(_ACTION_NAMES.get(action, f"do what SQLite calls action {action}"))

    def _deny(self, what: str) -> int:
        if self.action is None:
            self.action = what
        return sqlite3.SQLITE_DENY


_ACTION_NAMES: dict[int, str] = {
    sqlite3.SQLITE_INSERT: "insert rows (INSERT)",
    sqlite3.SQLITE_UPDATE: "update rows (UPDATE)",
    sqlite3.SQLITE_DELETE: "delete rows (DELETE)",
    sqlite3.SQLITE_ALTER_TABLE: "alter a table (ALTER TABLE)",
    sqlite3.SQLITE_ATTACH: "attach a database (ATTACH or VACUUM)",
    sqlite3.SQLITE_DETACH: "detach a database (DETACH)",
    sqlite3.SQLITE_TRANSACTION: "control a transaction (BEGIN, COMMIT, ROLLBACK)",
    sqlite3.SQLITE_SAVEPOINT: "control a transaction (SAVEPOINT, RELEASE)",
    sqlite3.SQLITE_ANALYZE: "write statistics (ANALYZE)",
    sqlite3.SQLITE_REINDEX: "rebuild indexes (REINDEX)",
    **{
        code: "create an object (CREATE)"
        for name, code in vars(sqlite3).items()
        if name.startswith("SQLITE_CREATE_")
    },
    **{
        code: "drop an object (DROP)"
        for name, code in vars(sqlite3).items()
        if name.startswith("SQLITE_DROP_")
    },
}
_SCHEMA_CHANGES = {
    sqlite3.SQLITE_INSERT: "create an object (CREATE)",
    sqlite3.SQLITE_DELETE: "drop an object (DROP)",
}


@contextmanager
def read_only(conn: sqlite3.Connection) -> Iterator[_Refusal]:
    """Install the read-only authorizer on ``conn`` for the duration of the block.

    Yields the refusal record: when a statement fails, its ``action`` says whether
    it failed because it tried to write. Afterwards no authorizer is installed.
    """
    refusal = _Refusal()
    conn.set_authorizer(refusal.authorize)
    try:
        yield refusal
    finally:
        conn.set_authorizer(None)


TIMEOUT_ENV = "RETROLOG_QUERY_TIMEOUT"
MEMORY_ENV = "RETROLOG_QUERY_MEMORY_MB"
DEFAULT_TIMEOUT = 120.0
DEFAULT_MEMORY_MB = 1024
_PROGRESS_STEPS = 10_000  # SQLite virtual-machine steps between two looks at the clock
_FETCH_ROWS = 4096


def _setting(name: str, default: float) -> float:
    text = (lookup(name) or "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise QueryError(
            f"{name}={text!r} is not a number of {'seconds' if 'TIMEOUT' in name else 'MB'}: "
            f"set it to a positive number, or 0 for no limit (default {default:g}).",
            sql=None,
        )
    return value


def _resident_bytes() -> int:
    """This process's resident memory now (Linux), else its peak so far."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Limits:
    """The time and memory budgets and Ctrl-C, heard through SQLite's progress handler.

    SQLite calls the handler every few thousand steps of its virtual machine, also
    while ``fetchmany`` steps through rows, so the process's memory growth it checks
    covers SQLite's own allocations and the rows Python holds alike.
    """

    def __init__(self, seconds: float, memory_mb: float) -> None:
        now = time.monotonic()
        self.deadline = now + seconds if seconds else math.inf
        self.memory = memory_mb * (1 << 20) if memory_mb else math.inf
        self.base = _resident_bytes() if memory_mb else 0
        self.next_memory_check = now
        self.expired = False
        self.too_big = False
        self.interrupted = False

    def progress(self) -> int:
        if self.interrupted or cancelled():
            return 1
        now = time.monotonic()
        if now > self.deadline:
            self.expired = True
            return 1
        if now >= self.next_memory_check and self.memory != math.inf:
            self.next_memory_check = now + 0.02
            if _resident_bytes() - self.base > self.memory:
                self.too_big = True
                return 1
        return 0

    def on_sigint(self, signum: int, frame: Any) -> None:
        self.interrupted = True


@contextmanager
def _within_limits(conn: sqlite3.Connection, limits: _Limits) -> Iterator[None]:
    previous_sigint = None
    if threading.current_thread() is threading.main_thread():
        previous_sigint = signal.signal(signal.SIGINT, limits.on_sigint)
    conn.set_progress_handler(limits.progress, _PROGRESS_STEPS)
    try:
        yield
    finally:
        conn.set_progress_handler(None, 0)
        if watched():  # the handler Project installs for a cancellable read, back
            conn.set_progress_handler(cancelled, _PROGRESS_STEPS)
        if previous_sigint is not None:
            signal.signal(signal.SIGINT, previous_sigint)


@contextmanager
def _value_cap(conn: sqlite3.Connection, memory_mb: float) -> Iterator[None]:
    """No single value over a quarter of the memory budget (256 MB by default).

    A function such as ``randomblob(900000000)`` builds its value in one step of
    SQLite's virtual machine, which the progress handler cannot interrupt: capping
    SQLite's value length makes it fail at once instead. Stored values are far
    smaller (a logged array is at most 100,000 elements of JSON).
    """
    setlimit = getattr(conn, "setlimit", None)  # Python 3.11+
    if not memory_mb or setlimit is None:
        yield
        return
    cap = max(int(memory_mb * (1 << 20) / 4), 1 << 20)
    previous = setlimit(_SQLITE_LIMIT_LENGTH, cap)
    try:
        yield
    finally:
        setlimit(_SQLITE_LIMIT_LENGTH, previous)


def execute_read(
    conn: sqlite3.Connection,
    sql: str,
    *,
    subject: str | None,
    malformed: Callable[[str], str],
    writes: Callable[[str, str], str],
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one statement under the read-only authorizer; returns its column names and rows.

    subject: the text the user wrote (the query, or a predicate spliced into ``sql``);
        it becomes the QueryError's ``sql``.
    malformed: sqlite's complaint -> the message when the statement fails.
    writes: (what it tried, sqlite's complaint) -> the message when it tries to write.

    Raises QueryError when the statement outlasts ``RETROLOG_QUERY_TIMEOUT`` or needs
    more memory than ``RETROLOG_QUERY_MEMORY_MB``, and KeyboardInterrupt on Ctrl-C.
    """
    if _UNAUTHORIZED_WRITE.match(sql):
        what = "rebuild indexes (REINDEX)"
        raise QueryError(writes(what, "not authorized"), sql=subject)
    seconds = _setting(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    memory_mb = _setting(MEMORY_ENV, DEFAULT_MEMORY_MB)
    limits = _Limits(seconds, memory_mb)
    rows: list[tuple[Any, ...]] = []
    with _within_limits(conn, limits), _value_cap(conn, memory_mb), read_only(conn) as refusal:
        try:
            cursor = conn.execute(sql)
            while batch := cursor.fetchmany(_FETCH_ROWS):
                rows.extend(batch)
            if limits.interrupted:  # Ctrl-C while Python, not SQLite, was fetching
                raise KeyboardInterrupt
        # Python < 3.12 reports a second statement as sqlite3.Warning, not an Error;
        # ValueError: text SQLite cannot take (a NUL, a lone surrogate UTF-8 cannot hold).
        except (sqlite3.Error, sqlite3.Warning, MemoryError, ValueError) as exc:
            rows.clear()
            if limits.interrupted:
                raise KeyboardInterrupt from exc
            check_cancelled()
            if limits.expired:
                raise QueryError(_over_time(subject, seconds), sql=subject) from exc
            # "string or blob too big": one value over _value_cap, made in a single step
            # (randomblob) that the progress handler cannot interrupt.
            if limits.too_big or isinstance(exc, MemoryError) or "too big" in str(exc):
                raise QueryError(_over_memory(subject, memory_mb), sql=subject) from exc
            if refusal.action is not None:
                raise QueryError(writes(refusal.action, _complaint(exc)), sql=subject) from exc
            raise QueryError(malformed(_complaint(exc)), sql=subject) from exc
    columns = [d[0] for d in cursor.description] if cursor.description else []
    return columns, rows


def _what(subject: str | None) -> str:
    return "The query" if subject is None else f"The query {subject!r}"


def _over_time(subject: str | None, seconds: float) -> str:
    return (
        f"{_what(subject)} ran longer than its time budget of {seconds:g} s and was "
        "stopped; nothing was changed. Narrow it (a condition on run_id or name, a "
        f"LIMIT), or give it more time: {TIMEOUT_ENV}=600 (0 for no limit)."
    )


def _over_memory(subject: str | None, memory_mb: float) -> str:
    return (
        f"{_what(subject)} needs more than its memory budget of {memory_mb:g} MB "
        "and was stopped; nothing was changed. Narrow it (a condition on run_id or "
        f"name, a LIMIT, fewer columns), or allow more: {MEMORY_ENV}=4096 (0 for "
        "no limit)."
    )


def query(conn: sqlite3.Connection, sql: str) -> pd.DataFrame:
    """Run one read-only SQL statement over the store; returns its rows as a DataFrame.

    The documented tables are runs, loops, logs, checkpoints, profile, replays,
    replay_runs, definitions and migrations (see :data:`DOCUMENTED_TABLES`).
    Values keep their SQLite types: a column of integers is int64 (``Int64`` when
    it holds NULLs), of reals float64 (NULL reads as NaN), anything else object
    holding the Python values sqlite3 returns (str, bytes, None, or a mix).

    Raises QueryError when the statement would write or change the connection,
    is malformed, or is more than one statement.
    """
    tables = ", ".join(DOCUMENTED_TABLES)

    def malformed(complaint: str) -> str:
        return (
            f"The query {sql!r} cannot be run: SQLite says {complaint!r}. Give one SELECT "
            f"statement over the store's tables: {tables}."
        )

    def writes(action: str, complaint: str) -> str:
        return (
            f"query() is read-only: {sql!r} tries to {action}, which would change the store "
            f"or the connection (SQLite says {complaint!r}). Use SELECT (or WITH ... SELECT) "
            f"to read the tables {tables}; retrolog itself writes runs, logs and checkpoints."
        )

    columns, rows = execute_read(conn, sql, subject=sql, malformed=malformed, writes=writes)
    return frame_from_rows(columns, rows)


# A statement that starts so changes something; PostgreSQL's DECLARE reports it only
# as a syntax error.
_WRITING_STATEMENT = re.compile(
    r"^\s*(INSERT|UPDATE|DELETE|MERGE|CREATE|DROP|ALTER|TRUNCATE|GRANT|REVOKE|COPY|VACUUM"
    r"|ANALYZE|CLUSTER|REINDEX|REFRESH|COMMENT|SET|RESET|LOCK|CALL|DO|BEGIN|START|COMMIT"
    r"|ROLLBACK|SAVEPOINT|PREPARE|EXECUTE|DEALLOCATE|LISTEN|NOTIFY|UNLISTEN|DISCARD)\b",
    re.IGNORECASE,
)


def query_shared(metadata: Any, sql: str) -> pd.DataFrame:
    """``query`` on a PostgreSQL store (``metadata``, a PostgresMetadata): the same
    budgets and messages, PostgreSQL's SQL (docs/store.md, "Query dialects")."""
    tables = ", ".join(DOCUMENTED_TABLES)

    def malformed(complaint: str) -> str:
        if _WRITING_STATEMENT.match(sql):  # PostgreSQL's DECLARE calls it a syntax error
            return writes("", complaint)
        return (
            f"The query {sql!r} cannot be run: PostgreSQL says {complaint!r}. Give one SELECT "
            f"statement over the store's tables: {tables} (values are in value_float, "
            "value_int and value_text there)."
        )

    def writes(_: str, complaint: str) -> str:
        return (
            f"query() is read-only: {sql!r} would change the store or the connection "
            f"(PostgreSQL says {complaint!r}). Use SELECT (or WITH ... SELECT) to read the "
            f"tables {tables}; retrolog itself writes runs, logs and checkpoints."
        )

    columns, rows = execute_read_shared(
        metadata.read_statement,
        sql,
        subject=sql,
        location=metadata.location,
        malformed=malformed,
        writes=writes,
    )
    return frame_from_rows(columns, rows)


def execute_read_shared(
    read: Callable[..., tuple[list[str], list[tuple[Any, ...]]]],
    sql: str,
    *,
    subject: str | None,
    location: str,
    malformed: Callable[[str], str],
    writes: Callable[[str, str], str],
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """:func:`execute_read` for a PostgreSQL store: ``read`` (a PostgreSQL reader's
    ``read``) runs ``sql`` under the same time and memory budgets; its refusals become
    the same QueryErrors, caused by PostgreSQL's error where there is one.

    malformed and writes take PostgreSQL's complaint (writes is given no action:
    PostgreSQL does not name one).
    """
    from retrolog.store.metastore import ReadRefused

    seconds = _setting(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    memory_mb = _setting(MEMORY_ENV, DEFAULT_MEMORY_MB)
    limits = _Limits(seconds, memory_mb)

    def over_budget() -> bool:
        return bool(memory_mb) and _resident_bytes() - limits.base > limits.memory

    try:
        return read(sql, seconds=seconds, over_budget=over_budget)
    except ReadRefused as refused:
        said, reason = refused.complaint, refused.reason
        if reason == "privileged":
            message = (
                "SQL written by a user (a query, a where-predicate) runs only as a PostgreSQL "
                "role that cannot read files or run programs on the server, and the role of "
                f"database_url ({location}) is a superuser or may. A read-only transaction "
                "does not stop those: connect as a role with SELECT on retrolog's tables only "
                '(docs/store.md, "Query dialects").'
            )
        elif reason == "timeout":
            message = _over_time(subject, seconds)
        elif reason == "memory":
            message = _over_memory(subject, memory_mb)
        elif reason == "writes":
            message = writes("", said)
        else:
            message = malformed(said)
        raise QueryError(message, sql=subject) from refused.__cause__


def execute_read_any(
    reader: Any,
    sql: str,
    *,
    subject: str | None,
    trusted: bool = False,
    malformed: Callable[[str], str],
    writes: Callable[[str, str], str],
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """One read-only statement on either backend's reader, under the budgets: SQLite's
    authorizer here (:func:`execute_read`), or the server's read-only transaction
    (:func:`execute_read_shared`) where the reader's dialect keeps the sandbox there.

    trusted: ``sql`` holds no user SQL, so any database role may run it.
    """
    if dialect_of(reader).server_sandbox:
        return execute_read_shared(
            functools.partial(reader.read, trusted=trusted),
            sql,
            subject=subject,
            location=reader.location,
            malformed=malformed,
            writes=writes,
        )
    return execute_read(reader, sql, subject=subject, malformed=malformed, writes=writes)


def frame_from_rows(columns: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> pd.DataFrame:
    """A DataFrame whose columns keep the SQLite storage classes of their values."""
    # pandas is imported here, not with the module: the replay coordinator reads through
    # execute_read and needs none (0.13 s more before its fork server started).
    import pandas as pd

    values = [[row[j] for row in rows] for j in range(len(columns))]
    frame = pd.DataFrame({j: _sqlite_column(col) for j, col in enumerate(values)})
    frame.columns = pd.Index(list(columns))
    return frame


def _sqlite_column(values: Sequence[Any]) -> pd.Series:
    """One column: int64 (Int64 with NULLs), float64, or object for text, blobs and mixes."""
    import pandas as pd

    kinds = {type(v) for v in values}
    nulls = type(None) in kinds
    kinds.discard(type(None))
    if kinds == {int}:
        return pd.Series(pd.array(values, dtype="Int64") if nulls else list(values), dtype=None)
    if kinds == {float}:
        return pd.Series(list(values), dtype="float64")
    return pd.Series(list(values), dtype=object)


def _complaint(exc: BaseException) -> str:
    """sqlite's message, without its final period (it is quoted inside a sentence)."""
    if isinstance(exc, UnicodeEncodeError):
        return (
            f"it holds {exc.object[exc.start : exc.end]!r}, which is not text SQLite can read "
            f"(at character {exc.start})"
        )
    return str(exc).rstrip(".") or type(exc).__name__
