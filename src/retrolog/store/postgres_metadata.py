"""The PostgreSQL metadata backend, for a team's shared store (docs/metadata-backends.md).

``database_url = "postgresql://..."`` selects it (store/metastore.py's ``BACKENDS``):
the schema (the SQLite store's tables in PostgreSQL's types), the sink a recording
run's writer thread commits its batches through, :class:`PostgresMetadata` (the
seam's operations) and its reader for the standard SQL above the seam.

psycopg 3 is imported only here, and only when a PostgreSQL store is opened; the
core does not need it.

Values. SQLite's ``value`` columns hold a float, an int or a str as it is; here a
value goes to ``value_float`` (double precision), ``value_int`` (bigint) or
``value_text``, by its Python type, with ``value_type`` as on SQLite. A NaN float
is stored as NULL, as SQLite stores it, so both backends give NaN the same meaning
(PostgreSQL would keep it, and there ``'NaN' = 'NaN'`` is true).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from retrolog._config import mask
from retrolog.errors import StoreError
from retrolog.store.metastore import POSTGRESQL, MetadataStore, ReadRefused, StoreReader
from retrolog.store.paths import ProjectPaths, make_store_dir
from retrolog.store.records import (
    RecordBatch,
    RecordSink,
    SinkBusy,
    SinkFull,
    SinkUnavailable,
    SinkUnstorable,
    write_run_rows,
)
from retrolog.store.series_blocks import BlockTracker, create_table, fill
from retrolog.store.summaries import POSTGRES_NUMBER, LastCounted, add_batch, migration

POSTGRES_PARTS = ("value_float", "value_int", "value_text")

# The version SQLite's store/schema.py reaches with the same tables; a later migration
# is added to both, with the same number (MIGRATIONS, below the schema).
SCHEMA_VERSION = 12

# One advisory lock key for migrations: two processes opening a new database at once
# must not both create it (SQLite's BEGIN IMMEDIATE does this there).
_MIGRATION_LOCK = 0x7265_7472_6F6C_6F67 & 0x7FFF_FFFF_FFFF_FFFF  # "retrolog"

SCHEMA = """
CREATE TABLE runs (
    run_key       bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    run_id        text PRIMARY KEY,
    projid        text NOT NULL,
    tstamp        text NOT NULL,
    filename      text NOT NULL,
    status        text NOT NULL,
    started_at    double precision NOT NULL,
    ended_at      double precision,
    error         text,
    host          text NOT NULL,
    pid           bigint NOT NULL,
    pid_start     text,
    python        text NOT NULL,
    packages      text,
    argv          text NOT NULL,
    args          text NOT NULL DEFAULT '{}',
    code_ref      text,
    code_commit   text,
    code_tree     text,
    head_commit   text,
    git_dir       text,
    dirty         bigint,
    skipped_files text,
    cwd           text,
    checkpointing text,
    numerics      text,
    parsed_args   text,
    modules       text,
    code_manifest text
);
CREATE INDEX runs_by_status ON runs(status);
CREATE INDEX runs_by_code_manifest ON runs(code_manifest) WHERE code_manifest IS NOT NULL;

CREATE TABLE loops (
    run_id      text NOT NULL,
    ctx_id      bigint NOT NULL,
    parent_ctx  bigint,
    name        text NOT NULL,
    iteration   bigint NOT NULL,
    value_float double precision,
    value_int   bigint,
    value_text  text,
    depth       bigint NOT NULL,
    t_start     double precision NOT NULL,
    t_end       double precision,
    PRIMARY KEY (run_id, ctx_id)
);

CREATE TABLE logs (
    log_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id      text NOT NULL,
    ctx_id      bigint,
    name        text NOT NULL,
    value_float double precision,
    value_int   bigint,
    value_text  text,
    value_type  text NOT NULL,
    origin      text NOT NULL DEFAULT 'recorded',
    replay_id   text,
    code_object text,
    checkpoint  text,
    inexact     text,
    lineage     text,
    reused_from text
);
CREATE INDEX logs_by_name ON logs(name, run_id, ctx_id);
CREATE INDEX logs_by_run ON logs(run_id);
CREATE INDEX logs_inexact ON logs(name, run_id, ctx_id) WHERE inexact IS NOT NULL;

CREATE TABLE checkpoints (
    checkpoint_id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id             text NOT NULL,
    ctx_id             bigint,
    loop_name          text NOT NULL,
    kind               text NOT NULL,
    manifest           text NOT NULL,
    nbytes             bigint NOT NULL,
    capture_seconds    double precision NOT NULL,
    write_seconds      double precision NOT NULL,
    created_at         double precision NOT NULL,
    writer_cpu_seconds double precision,
    frame_locals       bytea
);
CREATE INDEX checkpoints_by_run ON checkpoints(run_id, ctx_id);

CREATE TABLE profile (
    run_id        text NOT NULL,
    phase         text NOT NULL,
    ctx_id        bigint,
    seconds       double precision NOT NULL,
    block_seconds double precision
);
CREATE INDEX profile_by_run ON profile(run_id, phase);

CREATE TABLE replays (
    replay_id        text PRIMARY KEY,
    started_at       double precision NOT NULL,
    ended_at         double precision,
    names            text NOT NULL,
    where_sql        text,
    filename         text NOT NULL,
    workers          bigint NOT NULL,
    status           text NOT NULL,
    estimate_seconds double precision,
    kind             text NOT NULL DEFAULT 'backfill',
    executor         text,
    executor_address text
);

CREATE TABLE replay_runs (
    replay_id        text NOT NULL,
    run_id           text NOT NULL,
    scan             text NOT NULL,
    code_object      text,
    status           text NOT NULL,
    estimate_seconds double precision,
    actual_seconds   double precision,
    backfilled       bigint NOT NULL DEFAULT 0,
    mismatches       text,
    error            text,
    restored         bigint,
    restore_seconds  double precision,
    compared         bigint,
    inexact          text,
    environment      text,
    hosts            text,
    PRIMARY KEY (replay_id, run_id)
);

CREATE TABLE definitions (
    lineage      text PRIMARY KEY,
    name         text NOT NULL,
    text         text NOT NULL,
    dependencies text NOT NULL DEFAULT '[]',
    coarse       text,
    first_seen   double precision NOT NULL,
    first_run    text,
    first_replay text
);

CREATE TABLE run_definitions (
    run_id  text NOT NULL,
    name    text NOT NULL,
    lineage text NOT NULL,
    PRIMARY KEY (run_id, name)
);

CREATE VIEW value_lineage AS
    SELECT l.log_id, l.run_id, l.ctx_id, l.name, l.origin, l.replay_id,
           COALESCE(l.lineage, r.lineage) AS lineage
    FROM logs l LEFT JOIN run_definitions r
      ON l.origin = 'recorded' AND r.run_id = l.run_id AND r.name = l.name;

CREATE TABLE module_sets (
    digest       text PRIMARY KEY,
    names        bytea NOT NULL,
    warm_seconds double precision
)
"""

# The last batch each run's writer committed: the sink updates its run's row in every
# batch's transaction, so after a connection lost around a COMMIT the row says whether
# that batch is in (PostgresRecordSink._settle).
RECORD_BATCHES = """
CREATE TABLE record_batches (
    run_id text PRIMARY KEY,
    batch  bigint NOT NULL
)
"""

# (version, name, statements) in order; a new database gets them all, one at a time in
# one transaction. Append new migrations; never edit an applied one.
MIGRATIONS: list[tuple[int, str, str]] = [
    (9, "the schema of SQLite's version 9, in PostgreSQL's types", SCHEMA),
    (10, "the last batch each run's writer committed, written with the batch", RECORD_BATCHES),
    (11, "per-run summaries of each logged name, for the runs table", migration(postgres=True)),
    (12, "columnar blocks of each run's recorded series, for charts", create_table(postgres=True)),
]

# Steps of a migration that SQL alone cannot do, run after its statements (the same
# transaction).
FILLS: dict[int, Callable[[Any], None]] = {
    12: lambda conn: fill(conn.cursor(), mark="%s", parts=POSTGRES_PARTS),
}


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise StoreError(
            "A PostgreSQL store needs psycopg 3, which is not installed in this environment; "
            "install it: pip install 'psycopg[binary]'."
        ) from exc
    return psycopg


def connect(url: str) -> Any:
    """A psycopg connection to ``url`` (autocommit: transactions are explicit)."""
    psycopg = _psycopg()
    try:
        return psycopg.connect(url, autocommit=True, connect_timeout=30)
    except psycopg.OperationalError as exc:
        detail = " ".join(str(exc).split())
        if not detail.endswith((".", "?", "!")):
            detail += "."
        raise StoreError(
            f"Cannot reach the PostgreSQL store at {mask(url)}: {detail} Check "
            "that the server runs and the URL's host, port, database and user are right "
            "(a password can come from ~/.pgpass or PGPASSWORD instead of the URL)."
        ) from exc


def migrate(conn: Any) -> int:
    """Bring the database to :data:`SCHEMA_VERSION`; returns the version.

    The migrations it lacks (:data:`MIGRATIONS`; all of them for a new database) are
    applied in one transaction, under an advisory lock that a second process opening
    it at the same time waits for. A current one is only read: a role that may write
    retrolog's tables but not create any (what a team gives the machines that record)
    opens it.
    """
    if _has_store(conn):
        (newest,) = conn.execute("SELECT MAX(version) FROM migrations").fetchone()
        if newest == SCHEMA_VERSION:
            return SCHEMA_VERSION
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS migrations("
            "version bigint PRIMARY KEY, name text NOT NULL, applied_at text NOT NULL)"
        )
        (newest,) = conn.execute("SELECT COALESCE(MAX(version), 0) FROM migrations").fetchone()
        if newest > SCHEMA_VERSION:
            raise StoreError(
                f"The PostgreSQL store was written by a newer retrolog (schema version "
                f"{newest}, this one knows {SCHEMA_VERSION}); upgrade retrolog "
                "(pip install -U retrolog) to use it."
            )
        for version, name, script in MIGRATIONS:
            if version <= newest:
                continue
            for statement in script.split(";"):
                if statement.strip():
                    conn.execute(statement)
            if version in FILLS:
                FILLS[version](conn)
            conn.execute(
                "INSERT INTO migrations(version, name, applied_at) VALUES (%s, %s, %s)",
                (version, name, time.strftime("%Y-%m-%dT%H:%M:%S")),
            )
    return SCHEMA_VERSION


def _complaint(exc: BaseException) -> str:
    """The server's message, on one line, without its final period."""
    return " ".join(str(exc).split()).rstrip(".") or type(exc).__name__


def has_store(url: str) -> bool:
    """Whether the database ``url`` names holds a retrolog store (its tables)."""
    conn = connect(url)
    try:
        return _has_store(conn)
    finally:
        conn.close()


def _has_store(conn: Any) -> bool:
    """Whether retrolog's tables are in the database (its search path)."""
    (found,) = conn.execute("SELECT to_regclass('migrations') IS NOT NULL").fetchone()
    return bool(found)


def typed(value: Any) -> tuple[float | None, int | None, str | None]:
    """``value`` (a float, int, str or None) as (value_float, value_int, value_text)."""
    t = type(value)
    if t is float:
        return (None if math.isnan(value) else value), None, None
    if t is int or t is bool:
        return None, int(value), None
    if value is None:
        return None, None, None
    return None, None, str(value)


_VALUE_TYPE = {float: "float", int: "int", str: "str"}


# How long a batch's transaction waits for its run's row of record_batches while a
# transaction of a lost connection still holds it: the writer thread must not hang on it.
SETTLE_LOCK_TIMEOUT = "2s"


class PostgresRecordSink(RecordSink):
    """A recording run's batches into PostgreSQL: one transaction per batch.

    Values go in with COPY, the fastest way into PostgreSQL; their columns and types
    are chosen here, on the writer thread, never on the training thread.

    Each batch's transaction also sets its run's row of ``record_batches`` to the batch's
    number, so whether a batch was committed is a row written with it. A connection lost
    before the COMMIT's answer came back leaves that unknown here; the next transaction
    reads the row (:meth:`_settle`) and leaves out what it says is stored.
    """

    def __init__(self, url: str) -> None:
        self._psycopg = _psycopg()
        self._url = url
        self._location = mask(url)
        self._conn: Any = connect(url)
        # Per run: the number of the last batch this sink began (its row's value when the
        # sink first wrote the run). (number, lengths of the writer's batch it completes)
        # of the transaction being written, and of each whose connection was lost before
        # its COMMIT was answered (committed or not, unknown) since the last that succeeded.
        self._numbers: dict[str, int] = {}
        self._attempt: tuple[int, tuple[int, ...]] | None = None
        self._unsure: list[tuple[int, tuple[int, ...]]] = []
        self._staged: Any = None  # the connection whose staging tables exist
        self._blocks = BlockTracker("%s", POSTGRES_PARTS)
        self._last = LastCounted()

    def write(self, run_id: str, batch: RecordBatch) -> None:
        errors = self._psycopg.errors
        if self._conn is None or self._conn.closed:
            try:
                self._conn = connect(self._url)
            except StoreError as exc:
                raise SinkUnavailable(
                    f"the PostgreSQL server at {self._location} does not answer "
                    f"({_complaint(exc.__cause__ or exc)}); check that it runs and that this "
                    "machine reaches it"
                ) from exc
        # Set by _write when the batch's transaction begins, and left set after the COMMIT:
        # a connection lost while committing leaves its outcome unknown.
        self._attempt = None
        try:
            self._staging()
            self._first(run_id)
            self._write(run_id, batch)
            self._unsure = []
        except (UnicodeEncodeError, OverflowError, errors.NumericValueOutOfRange) as exc:
            raise SinkUnstorable(str(exc)) from exc
        except errors.DataError as exc:
            if "out of range" in str(exc) or "invalid byte sequence" in str(exc):
                raise SinkUnstorable(str(exc)) from exc
            raise
        except (errors.DiskFull, errors.OutOfMemory) as exc:
            raise SinkFull(str(exc)) from exc
        except (errors.LockNotAvailable, errors.DeadlockDetected) as exc:
            raise SinkBusy(str(exc)) from exc
        except self._psycopg.OperationalError as exc:
            # The server went away (restarted, the network dropped, the connection was
            # ended): connect again on the next write, and find out then whether the
            # batch in flight was committed (_settle).
            if not self._conn.closed and not self._conn.broken:
                raise
            self._conn.close()
            if self._attempt is not None:
                self._unsure.append(self._attempt)
            raise SinkUnavailable(
                f"the PostgreSQL server at {self._location} closed the connection "
                f"({_complaint(exc)}); check that it runs and that this machine reaches it"
            ) from exc

    def _first(self, run_id: str) -> None:
        """Make the run's row of record_batches, once, and take its number from there."""
        if run_id in self._numbers:
            return
        self._conn.execute(
            "INSERT INTO record_batches(run_id, batch) VALUES (%s, 0)"
            " ON CONFLICT (run_id) DO NOTHING",
            (run_id,),
        )
        (number,) = self._conn.execute(
            "SELECT batch FROM record_batches WHERE run_id = %s", (run_id,)
        ).fetchone()
        self._numbers[run_id] = number

    def _settle(self, cur: Any, run_id: str) -> tuple[int, ...] | None:
        """How much of the writer's batch the server already has: the lengths its lists
        begin with, from the transactions whose answers were lost; None for nothing.

        The writer's retry begins with every record of the batch it was given then
        (SinkUnavailable), and each such transaction wrote that batch to its end; the
        run's row of record_batches names the last of them that committed. The row is
        locked first: a transaction of the lost connection that the server has not yet
        ended holds it, and its outcome is known only once it ends.
        """
        (timeout,) = cur.execute("SELECT current_setting('lock_timeout')").fetchone()
        cur.execute("SELECT set_config('lock_timeout', %s, true)", (SETTLE_LOCK_TIMEOUT,))
        try:
            (number,) = cur.execute(
                "SELECT batch FROM record_batches WHERE run_id = %s FOR UPDATE", (run_id,)
            ).fetchone()
        except self._psycopg.errors.LockNotAvailable as exc:
            raise SinkUnavailable(
                f"the PostgreSQL server at {self._location} still runs the transaction of "
                "the connection this run lost, which may yet commit its records; it ends "
                "it when it notices the connection is gone (its TCP keepalive settings, "
                "idle_in_transaction_session_timeout), and an administrator can end it "
                "with pg_terminate_backend"
            ) from exc
        cur.execute("SELECT set_config('lock_timeout', %s, true)", (timeout,))
        return next((upto for attempt, upto in self._unsure if attempt == number), None)

    def _write(self, run_id: str, whole: RecordBatch) -> None:
        """Write the writer's batch ``whole``, or what of it is not stored yet, in one
        transaction."""
        try:
            self._transaction(run_id, whole)
        except BaseException:
            # Written or not (a lost answer), the next batch reads the store again.
            self._blocks.forget(run_id)
            self._last.forget(run_id)
            raise

    def _transaction(self, run_id: str, whole: RecordBatch) -> None:
        conn = self._conn
        with conn.transaction():
            cur = conn.cursor()
            written = self._settle(cur, run_id) if self._unsure else None
            number = self._numbers[run_id] + 1
            self._numbers[run_id] = number
            self._attempt = (number, whole.lengths())
            cur.execute("UPDATE record_batches SET batch = %s WHERE run_id = %s", (number, run_id))
            self._records(cur, run_id, whole if written is None else whole.after(written))

    def _records(self, cur: Any, run_id: str, batch: RecordBatch) -> None:
        """The statements that write ``batch``, in the transaction of ``cur``."""
        # Loop rows go in with COPY as values do (a loop of 200,000 short iterations
        # is 200,000 starts and ends): into this connection's staging tables, then one
        # statement each into loops.
        if batch.loop_starts:
            with cur.copy(
                "COPY pg_temp.rl_starts (ctx_id, parent_ctx, name, iteration, value_float,"
                " value_int, value_text, depth, t_start) FROM STDIN"
            ) as copy:
                for ctx, parent, name, i, value, depth, t_start in batch.loop_starts:
                    copy.write_row((ctx, parent, name, i, *typed(value), depth, t_start))
            cur.execute(
                "INSERT INTO loops(run_id, ctx_id, parent_ctx, name, iteration, value_float,"
                " value_int, value_text, depth, t_start)"
                " SELECT %s, ctx_id, parent_ctx, name, iteration, value_float, value_int,"
                " value_text, depth, t_start FROM pg_temp.rl_starts"
                # A context is started once; a batch written again after a lost answer
                # (an unknown outcome) writes its starts again: the same row.
                " ON CONFLICT (run_id, ctx_id) DO UPDATE SET parent_ctx = EXCLUDED.parent_ctx,"
                " name = EXCLUDED.name, iteration = EXCLUDED.iteration,"
                " value_float = EXCLUDED.value_float, value_int = EXCLUDED.value_int,"
                " value_text = EXCLUDED.value_text, depth = EXCLUDED.depth,"
                " t_start = EXCLUDED.t_start, t_end = NULL",
                (run_id,),
            )
        if batch.loop_ends:
            with cur.copy("COPY pg_temp.rl_ends (t_end, ctx_id) FROM STDIN") as copy:
                for row in batch.loop_ends:
                    copy.write_row(row)
            cur.execute(
                "UPDATE loops l SET t_end = e.t_end FROM pg_temp.rl_ends e"
                " WHERE l.run_id = %s AND l.ctx_id = e.ctx_id",
                (run_id,),
            )
        if batch.iterations:
            with cur.copy(
                "COPY profile (run_id, phase, ctx_id, seconds, block_seconds) FROM STDIN"
            ) as copy:
                for ctx, seconds, block_seconds in batch.iterations:
                    copy.write_row((run_id, "iteration", ctx, seconds, block_seconds))
        if batch.values or batch.logs:
            with cur.copy(
                "COPY logs (run_id, ctx_id, name, value_float, value_int, value_text,"
                " value_type) FROM STDIN"
            ) as copy:
                for ctx, name, value in batch.values:
                    copy.write_row((run_id, ctx, name, *typed(value), _VALUE_TYPE[type(value)]))
                for ctx, name, value, kind in batch.logs:
                    copy.write_row((run_id, ctx, name, *typed(value), kind))
            add_batch(
                cur, run_id, batch.values, batch.logs, mark="%s", number=POSTGRES_NUMBER,
                last=self._last,
            )  # fmt: skip
        write_run_rows(cur, run_id, batch, "%s")
        self._blocks.after_batch(cur, run_id, batch.values, batch.logs, batch.run_updates)
        for digest, blob in batch.module_sets:
            cur.execute(
                "INSERT INTO module_sets(digest, names) VALUES (%s, %s)"
                " ON CONFLICT (digest) DO NOTHING",
                (digest, blob),
            )
            cur.execute("UPDATE runs SET modules = %s WHERE run_id = %s", (digest, run_id))

    def _staging(self) -> None:
        """This connection's temporary tables for loop rows, emptied at each commit;
        made outside a batch's transaction, so a batch rolled back does not undo them."""
        if self._staged is self._conn:
            return
        cur = self._conn.cursor()
        cur.execute(
            "CREATE TEMP TABLE IF NOT EXISTS pg_temp.rl_starts (ctx_id bigint, parent_ctx bigint,"
            " name text, iteration bigint, value_float double precision, value_int bigint,"
            " value_text text, depth bigint, t_start double precision) ON COMMIT DELETE ROWS"
        )
        cur.execute(
            "CREATE TEMP TABLE IF NOT EXISTS pg_temp.rl_ends"
            " (t_end double precision, ctx_id bigint) ON COMMIT DELETE ROWS"
        )
        self._staged = self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def placeholders(sql: str) -> str:
    """``sql`` written with SQLite's ``?`` placeholders, in psycopg's: each ``?`` outside a
    quoted string becomes ``%s`` and every ``%`` is doubled."""
    parts = sql.replace("%", "%%").split("'")
    # Even parts are outside quotes (SQL escapes a quote inside a string by doubling it,
    # which leaves an empty odd part: still inside).
    return "'".join(part.replace("?", "%s") if i % 2 == 0 else part for i, part in enumerate(parts))


@functools.cache
def _numbers_loader() -> type:
    """psycopg's loader of numeric, giving an int for a whole number, else a float."""
    from psycopg.types.numeric import NumericLoader

    class Numbers(NumericLoader):
        def load(self, data: Any) -> Any:
            number = super().load(data)
            if number.is_finite() and number == number.to_integral_value():
                return int(number)
            return float(number)

    return Numbers


class _Reader:
    """A PostgreSQL connection as the portable queries use one (MetadataStore.reader):
    SQLite's ``?`` placeholders, and numeric results (what SUM of integers gives) as
    int or float, as SQLite returns them."""

    # A logged value is in one of its parts (none for NULL and NaN), by its type.
    dialect = POSTGRESQL

    def __init__(self, conn: Any, origin: Path | None, location: str) -> None:
        conn.adapters.register_loader("numeric", _numbers_loader())
        self._conn = conn
        self._psycopg = _psycopg()
        self._privileged: bool | None = None
        self.origin = origin
        self.location = location

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(placeholders(sql), params)

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Run the reads inside the block against one snapshot of the database (a
        ``REPEATABLE READ READ ONLY`` transaction); inside one already, join it."""
        if self._conn.info.transaction_status != self._psycopg.pq.TransactionStatus.IDLE:
            yield
            return
        with self._conn.transaction():
            self._conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield

    def read(
        self,
        sql: str,
        *,
        seconds: float,
        over_budget: Callable[[], bool],
        trusted: bool = False,
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one statement that holds user-written SQL, read-only; its column names
        and rows.

        One statement only (sent as a prepared ``DECLARE ... CURSOR FOR``, which
        PostgreSQL refuses to hold two), in a ``REPEATABLE READ READ ONLY``
        transaction (inside :meth:`snapshot`, a savepoint of its transaction), fetched
        in batches: ``statement_timeout`` is set to what is left of ``seconds`` (0: no
        limit) before each, and ``over_budget()`` is asked after each. A role that is a
        superuser or may read files or run programs on the server is refused first: a
        read-only transaction does not stop those (``trusted``: ``sql`` holds no text a
        user wrote, and any role may run it). Raises :class:`ReadRefused`, caused by
        psycopg's error when PostgreSQL refused the statement.
        """
        psycopg = self._psycopg
        errors = psycopg.errors
        conn = self._conn
        if self._privileged is None and not trusted:
            (self._privileged,) = conn.execute(
                "SELECT rolsuper OR pg_has_role(current_user, 'pg_read_server_files', 'MEMBER')"
                " OR pg_has_role(current_user, 'pg_write_server_files', 'MEMBER')"
                " OR pg_has_role(current_user, 'pg_execute_server_program', 'MEMBER')"
                " FROM pg_roles WHERE rolname = current_user"
            ).fetchone()
        if self._privileged and not trusted:
            raise ReadRefused("privileged", "the role may read files or run programs")
        deadline = time.monotonic() + seconds if seconds else None
        rows: list[tuple[Any, ...]] = []
        columns: list[str] | None = None
        nested = conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
        try:
            with conn.transaction():
                if not nested:
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                conn.execute(f"DECLARE retrolog_query NO SCROLL CURSOR FOR {sql}", prepare=True)
                while True:
                    left = 0  # ms; 0 is no limit
                    if deadline is not None:
                        left = max(1, int((deadline - time.monotonic()) * 1000))
                    conn.execute("SELECT set_config('statement_timeout', %s, true)", (str(left),))
                    cursor = conn.execute("FETCH FORWARD 4096 FROM retrolog_query")
                    if columns is None:
                        columns = [d.name for d in cursor.description or ()]
                    batch = cursor.fetchall()
                    if not batch:
                        break
                    rows.extend(batch)
                    if over_budget():
                        raise ReadRefused("memory", f"{len(rows):,} rows fetched")
                conn.execute("CLOSE retrolog_query")
                conn.execute("SELECT set_config('statement_timeout', '0', true)")
        except errors.QueryCanceled as exc:
            raise ReadRefused("timeout", _complaint(exc)) from exc
        except errors.ReadOnlySqlTransaction as exc:
            raise ReadRefused("writes", _complaint(exc)) from exc
        except errors.FeatureNotSupported as exc:  # DECLARE of a WITH that writes
            reason = "writes" if "data-modifying" in str(exc) else "malformed"
            raise ReadRefused(reason, _complaint(exc)) from exc
        except psycopg.OperationalError as exc:
            raise StoreError(
                f"The PostgreSQL store at {self.location} failed: {_complaint(exc)}."
            ) from exc
        except psycopg.Error as exc:
            raise ReadRefused("malformed", _complaint(exc)) from exc
        return columns or [], rows

    @property
    def errors(self) -> type[Exception]:
        """psycopg's base class of the errors the database reports."""
        error: type[Exception] = self._psycopg.Error
        return error

    def transaction(self) -> Any:
        """A write transaction (psycopg's context manager; a savepoint inside one)."""
        return self._conn.transaction()

    def commit(self) -> None:
        """Nothing to do: the connection commits each statement outside a transaction
        (for code written for SQLite's connection, which commits explicitly)."""

    def may_write(self, table: str, privilege: str) -> bool:
        """Whether this role has ``privilege`` (e.g. "DELETE") on ``table``."""
        row = self._conn.execute("SELECT has_table_privilege(%s, %s)", (table, privilege))
        return bool(row.fetchone()[0])

    def keep_definitions(
        self, definitions: list[tuple[Any, ...]], run_definitions: list[tuple[Any, ...]]
    ) -> None:
        """Store computed definitions (rows of ``definitions``, each kept once) and a run's
        (``run_definitions``); a role that may only read leaves them to be computed again."""
        import psycopg

        try:
            with self._conn.transaction():
                cur = self._conn.cursor()
                cur.executemany(
                    "INSERT INTO definitions(lineage, name, text, dependencies, coarse,"
                    " first_seen, first_run, first_replay)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (lineage) DO NOTHING",
                    definitions,
                )
                cur.executemany(
                    "INSERT INTO run_definitions(run_id, name, lineage) VALUES (%s, %s, %s)"
                    " ON CONFLICT (run_id, name) DO UPDATE SET lineage = EXCLUDED.lineage",
                    run_definitions,
                )
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ReadOnlySqlTransaction):
            pass


class PostgresMetadata(MetadataStore):
    """A team's PostgreSQL database: opened, migrated and crash-checked on creation.

    create: False for the read commands, which may connect as a role that can only
    read (docs/store.md): the schema is then only checked, not migrated when it is
    current, and dead runs are marked crashed only by a role that may update runs.
    """

    dialect = POSTGRESQL

    def __init__(self, url: str, *, create: bool = True, origin: Path | None = None) -> None:
        self._psycopg = _psycopg()
        self._url = url
        self.location = mask(url)
        self.origin = origin
        self._conn: Any = connect(url)
        try:
            if create:
                self._guarded(lambda: migrate(self._conn))
                self.mark_dead_runs_crashed()
                return
            if not self._guarded(lambda: _has_store(self._conn)):
                raise StoreError(
                    f"There is no retrolog store in the PostgreSQL database {self.location} "
                    "yet. Record a run first: with database_url set to it, run a training "
                    "script that calls rl.loop or rl.log."
                )
            ((version, may_update),) = self._rows(
                "SELECT (SELECT MAX(version) FROM migrations),"
                " has_table_privilege('runs', 'UPDATE')"
            )
            if version != SCHEMA_VERSION:
                self._guarded(lambda: migrate(self._conn))  # says so when it is newer
            if may_update:
                self.mark_dead_runs_crashed()
        except BaseException:
            self._conn.close()
            raise

    def reconnect_if_lost(self) -> bool:
        """Whether the connection had been lost (the server restarted, the network
        dropped) and a new one was made. Call it only between transactions: nothing
        can then have been in flight on the lost one. Raises StoreError while the
        server does not answer."""
        try:
            self._conn.execute("SELECT 1")
            return False
        except self._psycopg.OperationalError:
            if not (self._conn.closed or self._conn.broken):
                raise
        self._conn.close()
        self._conn = connect(self._url)
        return True

    def _guarded(self, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except self._psycopg.Error as exc:
            raise StoreError(
                f"The PostgreSQL store at {self.location} failed: {str(exc).strip()}. Check "
                "that the server runs and that its user may create tables in the database."
            ) from exc

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        sql = placeholders(sql)
        rows: list[tuple[Any, ...]] = self._guarded(
            lambda: self._conn.execute(sql, params).fetchall()
        )
        return rows

    def _run_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        sql = placeholders(sql)

        def run() -> None:
            with self._conn.transaction():
                self._conn.cursor().executemany(sql, params)

        self._guarded(run)

    @property
    def errors(self) -> type[Exception]:
        """psycopg's base class of the errors the database reports."""
        error: type[Exception] = self._psycopg.Error
        return error

    @property
    def operational_errors(self) -> type[Exception]:
        """psycopg's class of the errors of a lost connection or a server going away."""
        error: type[Exception] = self._psycopg.OperationalError
        return error

    @property
    def connection(self) -> Any:
        """The psycopg connection (autocommit; transactions are explicit)."""
        return self._conn

    def record_sink(self) -> Callable[[], RecordSink]:
        url = self._url
        return lambda: PostgresRecordSink(url)

    def reader(self) -> StoreReader:
        return _Reader(self._conn, self.origin, self.location)

    def read_statement(
        self, sql: str, *, seconds: float, over_budget: Callable[[], bool]
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one user-written statement read-only: :meth:`_Reader.read`, with numeric
        results (what SUM and AVG of integers give) as floats, as pandas expects a
        number. Raises :class:`ReadRefused`."""
        from psycopg.types.numeric import FloatLoader

        reader = _Reader(self._conn, self.origin, self.location)
        self._conn.adapters.register_loader("numeric", FloatLoader)
        try:
            return reader.read(sql, seconds=seconds, over_budget=over_budget)
        finally:
            self._conn.adapters.register_loader("numeric", _numbers_loader())

    def interrupt(self) -> None:
        # A cancel request on a connection of its own: the server stops the statement
        # (QueryCanceled), the session stays usable.
        self._conn.cancel_safe(timeout=5.0)

    def close(self) -> None:
        self._conn.close()


def open_backend(url: str | None, paths: ProjectPaths, create: bool) -> MetadataStore:
    """The PostgreSQL store ``url`` names, as the metadata seam opens it
    (store/metastore.py's ``BACKENDS``)."""
    assert url is not None
    metadata = PostgresMetadata(url, create=create, origin=paths.database)
    # The project's store directory still holds what is local (objects, caches, working
    # copies, replay logs): kept out of the project's git status like an embedded one.
    if create:
        make_store_dir(paths, objects=False)
    else:
        with contextlib.suppress(StoreError):  # a reader on a read-only checkout
            make_store_dir(paths, objects=False)
    return metadata
