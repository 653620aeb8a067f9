"""The metadata seam: the ``MetadataStore`` interface, its readers, and the registry of
backends by URL scheme.

docs/metadata-backends.md has the design. The ``database_url`` setting
(``RETROLOG_DATABASE_URL``, or the project's settings files) chooses the backend,
looked up in :data:`BACKENDS` by its URL's scheme:

- unset: the embedded SQLite store, ``retrolog.db`` in the project's store directory
  (store/sqlite_metadata.py);
- ``postgresql://...`` (or ``postgres://``): a team's PostgreSQL database
  (store/postgres_metadata.py, psycopg 3 from the ``team`` extra).

A backend's module is imported only when its store is opened, so this module imports
no backend (and ``import retrolog`` no database driver), and the backends import it,
never the other way round.

The interface holds operations, not SQL: what a recording run does (register itself,
name its code manifest, learn the restore ratio, hand its writer thread a record
sink, mark this host's dead runs crashed), the runs listing, gc's live manifests, and
:meth:`MetadataStore.reader`, a :class:`StoreReader` for the queries written once in
standard SQL with ``?`` placeholders (``show``, ``lineage``, the dataframe, gc). Where
that SQL must differ, it asks the reader's :class:`Dialect` (:func:`dialect_of`) for
the fragment, never which backend it is. The operations whose SQL is the same on
both backends are written here once; the rest are each backend's own.
"""

from __future__ import annotations

import abc
import importlib
import re
import socket
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from retrolog._config import lookup, mask
from retrolog.errors import StoreError, UsageError
from retrolog.store.paths import ProjectPaths, storable_text
from retrolog.store.processes import process_alive
from retrolog.store.sqlite_connection import rollback

if TYPE_CHECKING:
    from retrolog.store.records import RecordSink

DATABASE_URL_ENV = "RETROLOG_DATABASE_URL"

# Each column a recording run writes when it starts (store/schema.py's runs table).
RUN_COLUMNS = (
    "run_id", "projid", "tstamp", "filename", "status", "started_at", "host", "pid",
    "pid_start", "python", "argv", "code_ref", "code_commit", "code_tree", "head_commit",
    "git_dir", "dirty", "skipped_files", "cwd", "numerics",
)  # fmt: skip

_REGISTER = "INSERT INTO runs({}) VALUES ({})".format(
    ", ".join(RUN_COLUMNS), ", ".join("?" for _ in RUN_COLUMNS)
)

_CRASHED = (
    "UPDATE runs SET status = 'crashed', "
    "error = COALESCE(error, 'the process died without ending the run (killed?)'), "
    # Its duration ends at its last record, not whenever this is noticed.
    "ended_at = COALESCE(ended_at, started_at + (SELECT MAX(COALESCE(l.t_end,"
    " l.t_start)) FROM loops l WHERE l.run_id = runs.run_id), started_at) "
    "WHERE run_id = ? AND status = 'running'"
)


@dataclass(frozen=True)
class Dialect:
    """The few fragments of the standard SQL that a backend writes its own way.

    The queries above the seam (the dataframe's SQL builder, gc, ``show``) are written
    once; where a backend's SQL differs, they take the fragment from here.
    """

    #: the backend's name in messages ("SQLite says ...")
    name: str
    #: the columns a logged value is kept in: SQLite's one untyped ``value``, or
    #: PostgreSQL's ``value_float``, ``value_int`` and ``value_text``, exactly one of
    #: them set (none for NULL)
    parts: tuple[str, ...]
    #: the runs table's compact integer key
    run_key: str
    #: a constant false condition
    false: str
    #: what a predicate's help adds about how the backend reads a name (PostgreSQL folds an
    #: unquoted one to lower case)
    identifier_hint: str = ""
    #: whether user SQL's read-only sandbox is the server's (a ``READ ONLY`` transaction
    #: through the reader's ``read``) rather than this process's (SQLite's authorizer)
    server_sandbox: bool = False
    #: statements that set up a snapshot for the dataframe view's reads
    view_settings: tuple[str, ...] = ()
    #: how the database says a statement named a column that does not exist
    undefined_column: re.Pattern[str] = re.compile(r"no such column: (.+)$")
    #: the SQLSTATE of that error, for a backend whose errors carry one
    undefined_column_state: str | None = None
    #: a statement whose third column of its first row is the database's file, for a
    #: backend kept in a local file
    file_query: str | None = None

    @property
    def split(self) -> bool:
        """Whether a value is split over typed columns (PostgreSQL)."""
        return len(self.parts) > 1

    def any_of(self, condition: str) -> str:
        """An aggregate: whether ``condition`` holds in some row of the group."""
        return f"bool_or({condition})" if self.split else f"max({condition})"

    def in_looped(self, run_id: str) -> str:
        """Whether ``run_id`` is in the CTE ``looped``."""
        return f"{run_id} IN (SELECT run_id FROM looped)" if self.split else f"{run_id} IN looped"

    @property
    def nulls_first(self) -> str:
        """What an ascending ORDER BY term adds to sort NULLs first, as SQLite does."""
        return " NULLS FIRST" if self.split else ""

    def bigint(self, expr: str) -> str:
        """``expr`` as a 64-bit integer (SQLite's integers are already)."""
        return f"CAST({expr} AS bigint)" if self.split else expr

    def number(self, alias: str = "") -> str:
        """A logged number (float, int or bool) as one column, for MIN, MAX and
        arithmetic: SQLite's ``value``; PostgreSQL's float or int column."""
        prefix = f"{alias}." if alias else ""
        if self.split:
            return f"COALESCE({prefix}value_float, {prefix}value_int)"
        return f"{prefix}value"

    @property
    def embedded(self) -> bool:
        """Whether the database is a file this process opens itself (SQLite), rather
        than a server's (which marks a dead run crashed when a store is opened)."""
        return self.file_query is not None

    @property
    def typed_predicates(self) -> bool:
        """Whether a name a predicate compares needs its value types known: its column
        then takes the one SQL type they call for (:meth:`predicate_value`)."""
        return self.split

    def latest_at_run(self, names: str) -> str:
        """A subquery: for each run and each of ``names`` (an SQL list) logged outside
        loops, the record that counts (the newest recorded, else the newest), as
        ``run_id, name, <parts>, value_type``."""
        where = f"FROM logs WHERE name IN ({names}) AND ctx_id IS NULL"
        if self.split:
            return (
                f"SELECT DISTINCT ON (run_id, name) run_id, name, {', '.join(self.parts)},"
                f" value_type\n        {where}\n"
                "        ORDER BY run_id, name, (origin = 'recorded') DESC, log_id DESC"
            )
        # SQLite takes the other columns from the row of the bare max().
        return (
            "SELECT run_id, name, value, value_type,"
            f" max((origin = 'recorded') * {_RECORDED_FIRST} + log_id)\n"
            f"        {where} GROUP BY name, run_id"
        )

    def predicate_value(self, parts: Sequence[str], types: frozenset[str] | None) -> str | None:
        """A name's value (SQL for each of its ``parts``) as the one column a predicate
        compares; None when it has none (its ``types`` unknown where they are needed).

        A split value takes the SQL type its ``types`` call for, so a predicate compares
        it as on SQLite: floats (ints among them cast) as double precision, ints as
        bigint, bools as boolean, strings and JSON as text, a mix of numbers and text as
        text."""
        if not self.split:
            return parts[0]
        if types is None:
            return None
        real, whole, text = parts
        present = types - {"none"}
        if present == {"bool"}:
            return f"({whole} <> 0)"
        if present and present <= {"int", "bool"}:
            return whole
        if present and present <= {"float", "int", "bool"}:
            return f"COALESCE({real}, CAST({whole} AS double precision))"
        if present <= {"str", "text", "json"}:
            return text
        return f"COALESCE({text}, CAST({real} AS text), CAST({whole} AS text))"

    def missing_column(self, error: BaseException | None) -> str | None:
        """The column ``error`` (the database's own) says does not exist, if that is
        what it says."""
        if self.undefined_column_state is None:
            if not isinstance(error, sqlite3.OperationalError):
                return None
        elif getattr(error, "sqlstate", None) != self.undefined_column_state:
            return None
        match = self.undefined_column.search(str(error))
        return match.group(1) if match else None


# Recorded values outrank backfilled ones: this rank is added above any log_id.
_RECORDED_FIRST = 1 << 62

SQLITE = Dialect("SQLite", ("value",), "rowid", "0", file_query="PRAGMA database_list")
POSTGRESQL = Dialect(
    "PostgreSQL",
    ("value_float", "value_int", "value_text"),
    "run_key",
    "false",
    identifier_hint=(
        " PostgreSQL reads an unquoted name in lower case: double-quote a name "
        'with capitals ("Loss" > 0.5).'
    ),
    server_sandbox=True,
    # Memoize caches the lookups of a name's value per (run, context), which never
    # repeat: over a million records (bench/bench_dataframe.py --postgresql, medians of
    # 7) the view took 0.80 s with it, 0.43 s without.
    view_settings=("SELECT set_config('enable_memoize', 'off', true)",),
    undefined_column=re.compile(r'column "((?:[^"]|"")+)" does not exist'),
    undefined_column_state="42703",  # undefined_column
)


class Cursor(Protocol):
    """What a :class:`StoreReader`'s ``execute`` returns (a DB-API cursor)."""

    @property
    def description(self) -> Any: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class StoreReader(Protocol):
    """A store's reader for the queries written once in standard SQL.

    SQLite's is its ``sqlite3.Connection``; PostgreSQL's a wrapper of its connection
    that takes the same ``?`` placeholders and also has ``dialect`` (:data:`POSTGRESQL`)
    and ``snapshot()``. Ask :func:`dialect_of` for a reader's dialect.
    """

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...


def dialect_of(reader: object) -> Dialect:
    """The SQL dialect of ``reader``: what it names as its ``dialect``, else SQLite's
    (whose reader is a plain ``sqlite3.Connection``)."""
    dialect = getattr(reader, "dialect", None)
    return dialect if isinstance(dialect, Dialect) else SQLITE


@contextmanager
def read_snapshot(conn: Any) -> Iterator[None]:
    """Run the reads inside the block against one snapshot of the store.

    A training process may add runs, logs and checkpoints meanwhile; in SQLite's WAL
    mode the read transaction sees none of them and does not block the writer. Inside
    a transaction already, the block joins it. A PostgreSQL store's reader takes its
    own snapshot (its ``snapshot()``).
    """
    snapshot = getattr(conn, "snapshot", None)
    if snapshot is not None:
        with snapshot():
            yield
        return
    if conn.in_transaction:
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


def activity_stamp(conn: StoreReader) -> tuple[tuple[object, ...], tuple[object, ...]]:
    """The runs' and the replays' (count, how many running, last start, last end).

    It changes whenever a run or a replay starts or ends, so a reader that keeps
    something computed from the store (the dataframe's loop names, the dashboard's
    indexer) compares stamps to know when to compute it again.
    """
    stamp = (
        "SELECT COUNT(*), COUNT(CASE WHEN status = 'running' THEN 1 END), MAX(started_at),"
        " MAX(ended_at) FROM "
    )
    runs = conn.execute(stamp + "runs").fetchone()
    replays = conn.execute(stamp + "replays").fetchone()
    return tuple(runs), tuple(replays)


def store_file(conn: StoreReader) -> str | None:
    """The file ``conn``'s database is kept in; None for one without a file (an in-memory
    SQLite database, a PostgreSQL server's)."""
    query = dialect_of(conn).file_query
    if query is None:
        return None
    path = conn.execute(query).fetchone()[2]
    return str(path) if path else None


@contextmanager
def write_transaction(conn: Any) -> Iterator[None]:
    """One write transaction on ``conn``, a store's reader: PostgreSQL's reader's own
    (its ``transaction()``), or SQLite's ``BEGIN IMMEDIATE``, rolled back on an error."""
    transaction = getattr(conn, "transaction", None)
    if transaction is not None:
        with transaction():
            yield
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        rollback(conn)
        raise
    conn.execute("COMMIT")


def database_errors(conn: object) -> tuple[type[BaseException], ...]:
    """The errors ``conn``'s database reports: SQLite's, and a reader's own (its
    ``errors``: PostgreSQL's driver's)."""
    own = getattr(conn, "errors", None)
    return (sqlite3.Error,) if own is None else (sqlite3.Error, own)


class ReadRefused(Exception):
    """A read-only statement a backend did not run to its end.

    reason: "malformed" (the database could not run it), "writes" (it would change
    something), "timeout", "memory" (its rows outgrew the budget) or "privileged"
    (the database role may read files or run programs on the server: no sandbox).
    complaint: the database's own words.
    """

    def __init__(self, reason: str, complaint: str) -> None:
        super().__init__(f"{reason}: {complaint}")
        self.reason = reason
        self.complaint = complaint


class RunSummary(NamedTuple):
    """A run as the runs listing shows it (the ``runs`` table's columns)."""

    run_id: str
    tstamp: str
    filename: str
    status: str
    started_at: float
    ended_at: float | None
    args: str  # its run-level values as JSON
    parsed_args: str | None  # its parsed command-line arguments as JSON


class ScriptRuns(NamedTuple):
    """A script that has runs, and how many."""

    filename: str
    runs: int


class MetadataStore(abc.ABC):
    """One project's metadata: the operations a recording run needs, on any backend."""

    #: where the metadata is, for messages: a file's path, or a URL with its password masked
    location: str
    #: the fragments of its SQL that differ from the other backends'
    dialect: Dialect

    # -- what a backend provides --------------------------------------------------------

    @abc.abstractmethod
    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one statement (``?`` placeholders) in a transaction of its own; its rows."""

    @abc.abstractmethod
    def _run_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per parameter tuple, all in one transaction."""

    @abc.abstractmethod
    def record_sink(self) -> Callable[[], RecordSink]:
        """What makes a sink for a recording run's writer thread (called on that thread:
        a connection belongs to the thread that uses it)."""

    @abc.abstractmethod
    def reader(self) -> StoreReader:
        """The reader for the queries whose SQL both backends run (:class:`StoreReader`:
        ``execute(sql, params)`` with ``?`` placeholders returns a cursor; its
        :func:`dialect_of` is this store's :attr:`dialect`). ``origin`` is the project's
        ``retrolog.db`` path, whose directory is the store directory
        (store/sqlite_metadata.py's ``store_directory``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close what this store opened."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Stop the statement running on this store's connection; called from another
        thread (store/cancel.py). It fails with the backend's error."""

    # -- operations ----------------------------------------------------------------------

    def register_run(self, row: Mapping[str, Any]) -> None:
        """Insert a starting run's row: every column of :data:`RUN_COLUMNS`."""
        # Text as the store keeps it, as the writer does: a lone surrogate (bytes that are
        # not UTF-8, as Python decodes them) escaped.
        values = [row[c] for c in RUN_COLUMNS]
        self._run_many(
            _REGISTER, [tuple(storable_text(v) if isinstance(v, str) else v for v in values)]
        )

    def set_code_manifest(self, run_id: str, key: str) -> None:
        """Name the code manifest that holds ``run_id``'s code version."""
        self._run_many("UPDATE runs SET code_manifest = ? WHERE run_id = ?", [(key, run_id)])

    def live_manifests(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` that a run of the store references as its code manifest."""
        wanted = sorted(set(keys))
        if not wanted:
            return set()
        marks = ", ".join("?" for _ in wanted)
        sql = f"SELECT DISTINCT code_manifest FROM runs WHERE code_manifest IN ({marks})"
        return {r[0] for r in self._rows(sql, wanted)}

    def run_listing(self, limit: int | None = None) -> list[RunSummary]:
        """The newest ``limit`` runs (all without it), newest first."""
        sql = (
            "SELECT run_id, tstamp, filename, status, started_at, ended_at, args, parsed_args"
            " FROM runs ORDER BY started_at DESC, run_id DESC"
        )
        rows = self._rows(sql) if limit is None else self._rows(sql + " LIMIT ?", (limit,))
        return [RunSummary(*row) for row in rows]

    def scripts(self) -> list[ScriptRuns]:
        """The scripts that have runs, the most recently started first."""
        rows = self._rows(
            "SELECT filename, COUNT(*) FROM runs GROUP BY filename ORDER BY MAX(started_at) DESC"
        )
        return [ScriptRuns(filename, int(count)) for filename, count in rows]

    def activity(self) -> tuple[tuple[object, ...], tuple[object, ...]]:
        """:func:`activity_stamp` of this store: it changes whenever a run or a replay
        starts or ends."""
        return activity_stamp(self.reader())

    def mark_dead_runs_crashed(self) -> int:
        """Mark runs of this host whose process died without ending them as crashed.

        Runs of other hosts are judged by a process on their own host.
        """
        rows = self._rows(
            "SELECT run_id, pid, pid_start FROM runs WHERE status = 'running' AND host = ?",
            (socket.gethostname(),),
        )
        dead = [run_id for run_id, pid, marker in rows if not process_alive(pid, marker)]
        if dead:
            self._run_many(_CRASHED, [(run_id,) for run_id in dead])
        return len(dead)

    def learned_restore_ratio(self, filename: str) -> float | None:
        """Flor's c for runs of ``filename``, learned from past replays; None before any.

        c = restore / materialize: the mean seconds a replay spent restoring one
        checkpoint of this script's runs, over the mean seconds those runs spent
        materializing one (capture plus the writer's CPU time). Replays record
        their restore figures per run in ``replay_runs``.
        """
        ((restore_seconds, restored),) = self._rows(
            "SELECT SUM(rr.restore_seconds), SUM(rr.restored) FROM replay_runs rr"
            " JOIN runs r ON r.run_id = rr.run_id"
            " WHERE r.filename = ? AND rr.restored > 0 AND rr.restore_seconds IS NOT NULL",
            (filename,),
        )
        if not restored:
            return None
        ((materialize,),) = self._rows(
            "SELECT AVG(c.capture_seconds + COALESCE(c.writer_cpu_seconds, 0)) FROM checkpoints c"
            " WHERE c.run_id IN (SELECT rr.run_id FROM replay_runs rr JOIN runs r"
            " ON r.run_id = rr.run_id WHERE r.filename = ? AND rr.restored > 0)",
            (filename,),
        )
        if not materialize or materialize <= 0:
            return None
        return float(restore_seconds) / int(restored) / float(materialize)


#: What opens a backend's store: (database_url or None, the project's paths, create).
Opener = Callable[[str | None, ProjectPaths, bool], "MetadataStore"]

#: The backends by ``database_url``'s scheme ("" for the embedded store: no URL); each
#: names the module whose ``open_backend`` (an :data:`Opener`) opens it.
BACKENDS: dict[str, str] = {
    "": "retrolog.store.sqlite_metadata",
    "postgresql": "retrolog.store.postgres_metadata",
    "postgres": "retrolog.store.postgres_metadata",
}


def url_scheme(url: str | None) -> str | None:
    """``url``'s scheme, lower case: "" for None (the embedded store), None for a URL
    without one."""
    if not url:
        return ""
    return url.split("://", 1)[0].lower() if "://" in url else None


def backend_module(url: str | None) -> str:
    """The module of the backend ``url`` names (None: the embedded store), not imported.
    Raises UsageError for a scheme no backend takes."""
    scheme = url_scheme(url)
    module = None if scheme is None else BACKENDS.get(scheme)
    if module is None:
        raise UsageError(
            f"database_url ({DATABASE_URL_ENV} or [tool.retrolog] in pyproject.toml) is "
            f"{mask(url or '')!r}, which names no database retrolog can use. Leave it unset "
            "for the embedded SQLite store in the project's .retrolog directory, or give a "
            "PostgreSQL URL such as postgresql://user@host:5432/dbname."
        )
    return module


def backend(url: str | None) -> Opener:
    """What opens the store ``url`` names (None: the embedded store), its module imported
    now. Raises UsageError for a scheme no backend takes."""
    opener: Opener = importlib.import_module(backend_module(url)).open_backend
    return opener


def database_url() -> str | None:
    """The ``database_url`` setting, checked against :data:`BACKENDS`; None for the
    embedded SQLite store."""
    url = (lookup(DATABASE_URL_ENV) or "").strip()
    if not url:
        return None
    backend_module(url)
    return url


def open_metadata(paths: ProjectPaths, *, create: bool = True) -> MetadataStore:
    """The project's metadata store, in the backend ``database_url`` names, migrated and
    crash-checked.

    create: make it when missing (recording); without it (the read commands) a missing
        store is a StoreError that says how to make one, and a SQLite store this process
        cannot write is opened read-only.
    Raises StoreError when it cannot be opened, with what to do.
    """
    url = database_url()
    return backend(url)(url, paths, create)


def require_embedded(paths: ProjectPaths) -> None:
    """Stop, saying why, when ``database_url`` names PostgreSQL and something opens the
    embedded SQLite store (no command does; ``Project`` reads through
    :func:`open_metadata`): it would read an empty or stale local file and answer
    wrongly."""
    url = database_url()
    if url is None:
        return
    raise StoreError(
        f"This project's runs are in the PostgreSQL database {mask(url)} (database_url), "
        "and this command reads only the embedded SQLite store so far; every other "
        "command reads the runs there (docs/metadata-backends.md). Unset "
        f"{DATABASE_URL_ENV} to use the embedded store in {paths.store}."
    )
