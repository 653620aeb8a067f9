"""The store's relational schema, as named migrations.

Each migration runs once, in its own transaction, and is recorded in the
``migrations`` table. Append new migrations; never edit an applied one.
The tables are documented for users in ``docs/store.md``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

from retrolog.errors import StoreError
from retrolog.store.series_blocks import create_table, fill
from retrolog.store.summaries import migration

# (version, name, statements). Columns named ``value`` are declared without a
# type on purpose: no affinity, so a float stays REAL, an int INTEGER, a str TEXT.
MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "create runs, loops, logs, checkpoints, profile",
        """
        CREATE TABLE runs (
            run_id        TEXT PRIMARY KEY,
            projid        TEXT NOT NULL,
            tstamp        TEXT NOT NULL,
            filename      TEXT NOT NULL,
            status        TEXT NOT NULL,
            started_at    REAL NOT NULL,
            ended_at      REAL,
            error         TEXT,
            host          TEXT NOT NULL,
            pid           INTEGER NOT NULL,
            pid_start     TEXT,
            python        TEXT NOT NULL,
            packages      TEXT,
            argv          TEXT NOT NULL,
            args          TEXT NOT NULL DEFAULT '{}',
            code_ref      TEXT,
            code_commit   TEXT,
            code_tree     TEXT,
            head_commit   TEXT,
            git_dir       TEXT,
            dirty         INTEGER,
            skipped_files TEXT
        );
        CREATE INDEX runs_by_status ON runs(status);

        CREATE TABLE loops (
            run_id     TEXT NOT NULL,
            ctx_id     INTEGER NOT NULL,
            parent_ctx INTEGER,
            name       TEXT NOT NULL,
            iteration  INTEGER NOT NULL,
            value,
            depth      INTEGER NOT NULL,
            t_start    REAL NOT NULL,
            t_end      REAL,
            PRIMARY KEY (run_id, ctx_id)
        ) WITHOUT ROWID;

        CREATE TABLE logs (
            log_id     INTEGER PRIMARY KEY,
            run_id     TEXT NOT NULL,
            ctx_id     INTEGER,
            name       TEXT NOT NULL,
            value,
            value_type TEXT NOT NULL,
            origin     TEXT NOT NULL DEFAULT 'recorded',
            replay_id  TEXT
        );
        CREATE INDEX logs_by_name ON logs(name, run_id, ctx_id);
        CREATE INDEX logs_by_run ON logs(run_id);

        CREATE TABLE checkpoints (
            checkpoint_id   INTEGER PRIMARY KEY,
            run_id          TEXT NOT NULL,
            ctx_id          INTEGER,
            loop_name       TEXT NOT NULL,
            kind            TEXT NOT NULL,
            manifest        TEXT NOT NULL,
            nbytes          INTEGER NOT NULL,
            capture_seconds REAL NOT NULL,
            write_seconds   REAL NOT NULL,
            created_at      REAL NOT NULL
        );
        CREATE INDEX checkpoints_by_run ON checkpoints(run_id, ctx_id);

        CREATE TABLE profile (
            run_id        TEXT NOT NULL,
            phase         TEXT NOT NULL,
            ctx_id        INTEGER,
            seconds       REAL NOT NULL,
            block_seconds REAL
        );
        CREATE INDEX profile_by_run ON profile(run_id, phase);
        """,
    ),
]

MIGRATIONS.append(
    (
        2,
        "replay: run cwd, backfill provenance, replays and replay_runs",
        """
        ALTER TABLE runs ADD COLUMN cwd TEXT;
        ALTER TABLE logs ADD COLUMN code_object TEXT;
        ALTER TABLE logs ADD COLUMN checkpoint TEXT;
        CREATE TABLE replays (
            replay_id   TEXT PRIMARY KEY,
            started_at  REAL NOT NULL,
            ended_at    REAL,
            names       TEXT NOT NULL,
            where_sql   TEXT,
            filename    TEXT NOT NULL,
            workers     INTEGER NOT NULL,
            status      TEXT NOT NULL,
            estimate_seconds REAL
        );
        CREATE TABLE replay_runs (
            replay_id   TEXT NOT NULL,
            run_id      TEXT NOT NULL,
            scan        TEXT NOT NULL,
            code_object TEXT,
            status      TEXT NOT NULL,
            estimate_seconds REAL,
            actual_seconds   REAL,
            backfilled  INTEGER NOT NULL DEFAULT 0,
            mismatches  TEXT,
            error       TEXT,
            PRIMARY KEY (replay_id, run_id)
        ) WITHOUT ROWID;
        """,
    )
)

MIGRATIONS.append(
    (
        3,
        "background checkpoints: writer CPU time, frame locals, the run's checkpoint policy",
        """
        ALTER TABLE checkpoints ADD COLUMN writer_cpu_seconds REAL;
        ALTER TABLE checkpoints ADD COLUMN frame_locals BLOB;
        ALTER TABLE runs ADD COLUMN checkpointing TEXT;
        """,
    )
)

MIGRATIONS.append(
    (
        4,
        "replay restore figures, from which recording learns c (restore / materialize)",
        """
        ALTER TABLE replay_runs ADD COLUMN restored INTEGER;
        ALTER TABLE replay_runs ADD COLUMN restore_seconds REAL;
        """,
    )
)

MIGRATIONS.append(
    (
        5,
        "exact replay: numerical environment, parsed arguments, inexact marks, verify",
        """
        ALTER TABLE runs ADD COLUMN numerics TEXT;
        ALTER TABLE runs ADD COLUMN parsed_args TEXT;
        ALTER TABLE logs ADD COLUMN inexact TEXT;
        CREATE INDEX logs_inexact ON logs(name, run_id, ctx_id) WHERE inexact IS NOT NULL;
        ALTER TABLE replays ADD COLUMN kind TEXT NOT NULL DEFAULT 'backfill';
        ALTER TABLE replay_runs ADD COLUMN compared INTEGER;
        ALTER TABLE replay_runs ADD COLUMN inexact TEXT;
        ALTER TABLE replay_runs ADD COLUMN environment TEXT
        """,
    )
)

MIGRATIONS.append(
    (
        6,
        "lineage: definitions of logged values, per run and per backfilled value",
        """
        ALTER TABLE logs ADD COLUMN lineage TEXT;
        ALTER TABLE logs ADD COLUMN reused_from TEXT;
        CREATE TABLE definitions (
            lineage      TEXT PRIMARY KEY,
            name         TEXT NOT NULL,
            text         TEXT NOT NULL,
            dependencies TEXT NOT NULL DEFAULT '[]',
            coarse       TEXT,
            first_seen   REAL NOT NULL,
            first_run    TEXT,
            first_replay TEXT
        );
        CREATE TABLE run_definitions (
            run_id  TEXT NOT NULL,
            name    TEXT NOT NULL,
            lineage TEXT NOT NULL,
            PRIMARY KEY (run_id, name)
        ) WITHOUT ROWID;
        CREATE VIEW value_lineage AS
            SELECT l.log_id, l.run_id, l.ctx_id, l.name, l.origin, l.replay_id,
                   COALESCE(l.lineage, r.lineage) AS lineage
            FROM logs l LEFT JOIN run_definitions r
              ON l.origin = 'recorded' AND r.run_id = l.run_id AND r.name = l.name
        """,
    )
)

MIGRATIONS.append(
    (
        7,
        "replay start-up: the installed modules a run had imported when training started",
        """
        ALTER TABLE runs ADD COLUMN modules TEXT;
        CREATE TABLE module_sets (
            digest       TEXT PRIMARY KEY,
            names        BLOB NOT NULL,
            warm_seconds REAL
        ) WITHOUT ROWID
        """,
    )
)

MIGRATIONS.append(
    (
        8,
        "portable code versions: the run's code manifest in the object store",
        """
        ALTER TABLE runs ADD COLUMN code_manifest TEXT;
        CREATE INDEX runs_by_code_manifest ON runs(code_manifest) WHERE code_manifest IS NOT NULL
        """,
    )
)

MIGRATIONS.append(
    (
        9,
        "replay lineage: where a replay's workers ran",
        """
        ALTER TABLE replays ADD COLUMN executor TEXT;
        ALTER TABLE replays ADD COLUMN executor_address TEXT;
        ALTER TABLE replay_runs ADD COLUMN hosts TEXT
        """,
    )
)

# Written by PostgreSQL's record sink (store/postgres_metadata.py), which must tell after a lost
# connection whether its last batch was committed. SQLite's answer to a COMMIT is never
# lost, so its sink leaves the table empty; the two schemas stay the same.
MIGRATIONS.append(
    (
        10,
        "the last batch each run's writer committed, written with the batch",
        """
        CREATE TABLE record_batches (
            run_id TEXT PRIMARY KEY,
            batch  INTEGER NOT NULL
        ) WITHOUT ROWID
        """,
    )
)

# Kept current by every writer of logs (store/summaries.py); filled here for the values a
# store holds.
MIGRATIONS.append(
    (11, "per-run summaries of each logged name, for the runs table", migration(postgres=False))
)

# Kept by the record sinks (store/series_blocks.py); filled here for the values a store
# holds, by FILLS.
MIGRATIONS.append(
    (12, "columnar blocks of each run's recorded series, for charts", create_table(postgres=False))
)

# Steps of a migration that SQL alone cannot do, run after its statements in its transaction.
FILLS: dict[int, Callable[[sqlite3.Connection], None]] = {
    12: lambda conn: fill(conn, mark="?", parts=["value"]),
}

LATEST_VERSION = MIGRATIONS[-1][0]


def migrate(conn: sqlite3.Connection) -> int:
    """Apply the migrations ``conn`` lacks; returns the schema version afterwards."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS migrations ("
        " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at TEXT NOT NULL)"
    )
    applied = {row[0] for row in conn.execute("SELECT version FROM migrations")}
    newest = max(applied, default=0)
    if newest > LATEST_VERSION:
        raise StoreError(
            f"This store has schema version {newest}, newer than this retrolog understands "
            f"({LATEST_VERSION}); upgrade retrolog (pip install -U retrolog) to read it."
        )
    for version, name, script in MIGRATIONS:
        if version in applied:
            continue
        # BEGIN IMMEDIATE: two processes opening a fresh store at once must not both migrate.
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("SELECT 1 FROM migrations WHERE version = ?", (version,)).fetchone():
                conn.execute("COMMIT")
                continue
            for statement in _split(script):
                conn.execute(statement)
            if version in FILLS:
                FILLS[version](conn)
            conn.execute(
                "INSERT INTO migrations(version, name, applied_at) VALUES (?, ?, ?)",
                (version, name, time.strftime("%Y-%m-%dT%H:%M:%S")),
            )
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite has rolled back already after a full disk
                conn.execute("ROLLBACK")
            raise
    return LATEST_VERSION


def _split(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
