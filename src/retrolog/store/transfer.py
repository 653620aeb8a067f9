"""Copying the embedded store's metadata into a PostgreSQL store (``retrolog migrate --to``).

Run by run, each in one PostgreSQL transaction: its ``runs`` row, then its loops,
logs, checkpoints, profile and run definitions with COPY, logs and checkpoints in
the order SQLite holds them (so PostgreSQL's identities keep that order: "the
newest record counts" means the same there). A value goes to ``value_float``,
``value_int`` or ``value_text`` by its type, as the PostgreSQL record sink writes
it. The tables runs share (definitions, replays and their runs, module sets) are
copied first, keeping rows that are there already.

Verifiably: every run is read back from PostgreSQL and its fingerprint compared
with the local one (row counts and a sha256 over every copied table's rows, values
compared bit for bit: floats by their hex form). Safe to re-run: a run that is
there with the same fingerprint is left alone; one that is there with another
(recorded into PostgreSQL under the same id, or changed locally since, e.g. by a
replay) is reported and never overwritten.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sqlite3
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from retrolog.errors import StoreError
from retrolog.store.postgres_metadata import PostgresMetadata, placeholders, typed
from retrolog.store.series_blocks import fill_run
from retrolog.store.summaries import POSTGRES_NUMBER, recompute

# The tables holding one run's rows, copied with it, and how SQLite orders them
# (None: no order of their own; their fingerprint sorts them).
PER_RUN: dict[str, str | None] = {
    "loops": "ctx_id",
    "logs": "log_id",
    "checkpoints": "checkpoint_id",
    "profile": None,
    "run_definitions": None,  # PostgreSQL orders names by its collation
}
# The tables runs share, and the key a row that is there already is known by.
SHARED: dict[str, str] = {
    "definitions": "lineage",
    "replays": "replay_id",
    "replay_runs": "replay_id, run_id",
    "module_sets": "digest",
}
# Identities each database numbers itself.
_IDENTITY = {"run_key", "log_id", "checkpoint_id"}
# Tables whose SQLite ``value`` is split into three typed columns on PostgreSQL.
_SPLIT = {"loops", "logs"}
_PARTS = ("value_float", "value_int", "value_text")


@dataclass
class RunTransfer:
    """One run's copy: ``copied``, ``present`` (there with the same rows) or ``differs``."""

    run_id: str
    outcome: str
    rows: int = 0  # its rows in the per-run tables, here


@dataclass
class TransferReport:
    source: str
    target: str
    runs: list[RunTransfer] = field(default_factory=list)
    shared_rows: dict[str, int] = field(default_factory=dict)  # table -> rows here
    verified: int = 0  # runs whose fingerprint matched after the copy (or already)
    done: bool = False  # copied and verified (False: a plan)
    config_file: str | None = None  # where database_url was set
    password_kept_out: bool = False  # the URL holds a password: not written into a file
    still_overridden: str | None = None  # a variable that keeps pointing elsewhere

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.runs if r.outcome == outcome)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def copy_into_postgresql(
    conn: sqlite3.Connection,
    target: PostgresMetadata,
    *,
    source: str,
    dry_run: bool = False,
    say: Callable[[str], None] = lambda _: None,
) -> TransferReport:
    """Copy every run of ``conn`` (the embedded store) that ``target`` lacks, and verify
    every run there. dry_run: only find which runs would be copied (``copied`` in the
    report means "would be")."""
    pg = target.connection
    report = TransferReport(source=source, target=target.location)
    columns = {t: _common_columns(conn, pg, t) for t in ("runs", *PER_RUN, *SHARED)}
    there = {r for (r,) in pg.execute("SELECT run_id FROM runs")}
    local = [r for (r,) in conn.execute("SELECT run_id FROM runs ORDER BY started_at, run_id")]
    for table in SHARED:
        (report.shared_rows[table],) = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    if not dry_run:
        say(f"copying what {len(local)} run(s) share: definitions, replays, module sets")
        _copy_shared(conn, pg, columns)
    for number, run_id in enumerate(local, 1):
        mine = _fingerprint(_local_rows(conn, run_id, columns))
        rows = sum(len(v) for k, v in mine[1].items() if k != "runs")
        if run_id in there:
            theirs = _fingerprint(_remote_rows(pg, run_id, columns))
            outcome = "present" if theirs[0] == mine[0] else "differs"
            report.runs.append(RunTransfer(run_id, outcome, rows))
            report.verified += outcome == "present"
            continue
        report.runs.append(RunTransfer(run_id, "copied", rows))
        if dry_run:
            continue
        say(f"run {number} of {len(local)}: {run_id}, {rows:,} rows")
        _copy_run(conn, pg, run_id, columns)
        if _fingerprint(_remote_rows(pg, run_id, columns))[0] != mine[0]:
            raise StoreError(
                f"Run {run_id} reads back from {target.location} differently from the local "
                "store after its copy. Nothing was switched; report this, with `retrolog show "
                f"{run_id} --json` from both stores."
            )
        report.verified += 1
    if not dry_run:
        for table, key in SHARED.items():
            _check_shared(conn, pg, table, key, target.location)
        report.done = True
    return report


def _common_columns(conn: sqlite3.Connection, pg: Any, table: str) -> list[str]:
    """The columns ``table`` has in both stores (``value`` for PostgreSQL's three parts),
    identities left out: each database numbers those itself."""
    here = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
    there = {
        name
        for (name,) in pg.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_name = %s AND table_schema = current_schema()",
            (table,),
        )
    }
    if table in _SPLIT:
        there.add("value")
    return [c for c in here if c in there and c not in _IDENTITY]


def _copy_shared(conn: sqlite3.Connection, pg: Any, columns: dict[str, list[str]]) -> None:
    with pg.transaction():
        for table, key in SHARED.items():
            rows = conn.execute(f"SELECT {', '.join(columns[table])} FROM {table}").fetchall()
            _insert(pg, table, columns[table], rows, f" ON CONFLICT ({key}) DO NOTHING")


def _check_shared(conn: sqlite3.Connection, pg: Any, table: str, key: str, location: str) -> None:
    """Every local row of a shared table has its key there (what is there already is
    the team's, and may hold more)."""
    keys = key.split(", ")
    here = set(conn.execute(f"SELECT {key} FROM {table}").fetchall())
    there = {tuple(row) for row in pg.execute(f"SELECT {key} FROM {table}")}
    missing = here - there
    if missing:
        raise StoreError(
            f"{len(missing)} row(s) of {table} (by {', '.join(keys)}) are not in {location} "
            "after the copy. Nothing was switched; run `retrolog migrate` again."
        )


def _copy_run(
    conn: sqlite3.Connection, pg: Any, run_id: str, columns: dict[str, list[str]]
) -> None:
    """One run's rows into PostgreSQL, in one transaction."""
    names = columns["runs"]
    (row,) = conn.execute(
        f"SELECT {', '.join(names)} FROM runs WHERE run_id = ?", (run_id,)
    ).fetchall()
    ended = dict(zip(names, row, strict=True)).get("status") != "running"
    with pg.transaction():
        pg.execute(
            placeholders(f"INSERT INTO runs ({', '.join(names)}) VALUES ({_marks(names)})"), row
        )
        cursor = pg.cursor()
        for table, order in PER_RUN.items():
            names = columns[table]
            found = _select(conn, table, names, order, run_id)
            targets = [p for n in names for p in (_PARTS if n == "value" else (n,))]
            with cursor.copy(f"COPY {table} ({', '.join(targets)}) FROM STDIN") as copy:
                for values in found:
                    copy.write_row(_split(names, values))
        recompute(cursor, run_id, None, mark="%s", number=POSTGRES_NUMBER)
        fill_run(cursor, run_id, mark="%s", parts=_PARTS, final=ended)


def _split(names: Sequence[str], values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for name, value in zip(names, values, strict=True):
        if name == "value":
            out.extend(typed(value))
        else:
            out.append(value)
    return out


def _select(
    conn: sqlite3.Connection, table: str, names: list[str], order: str | None, run_id: str
) -> list[tuple[Any, ...]]:
    ordered = f" ORDER BY {order}" if order else ""
    sql = f"SELECT {', '.join(names)} FROM {table} WHERE run_id = ?{ordered}"
    return conn.execute(sql, (run_id,)).fetchall()


def _local_rows(
    conn: sqlite3.Connection, run_id: str, columns: dict[str, list[str]]
) -> dict[str, list[tuple[Any, ...]]]:
    rows = {"runs": _select(conn, "runs", columns["runs"], None, run_id)}
    for table, order in PER_RUN.items():
        rows[table] = _select(conn, table, columns[table], order, run_id)
    return rows


def _remote_rows(
    pg: Any, run_id: str, columns: dict[str, list[str]]
) -> dict[str, list[tuple[Any, ...]]]:
    """A run's rows in PostgreSQL, as the local store holds them (a value whole again)."""
    rows: dict[str, list[tuple[Any, ...]]] = {}
    for table in ("runs", *PER_RUN):
        names = columns[table]
        select = ", ".join(", ".join(_PARTS) if n == "value" else n for n in names)
        by = PER_RUN.get(table)
        ordered = f" ORDER BY {by}" if by else ""
        found = pg.execute(f"SELECT {select} FROM {table} WHERE run_id = %s{ordered}", (run_id,))
        rows[table] = [_whole(names, row) for row in found]
    return rows


def _whole(names: Sequence[str], row: Sequence[Any]) -> tuple[Any, ...]:
    """A PostgreSQL row with its three value parts as the one value SQLite holds."""
    if "value" not in names:
        return tuple(row)
    out: list[Any] = []
    it = iter(row)
    for name in names:
        if name == "value":
            real, whole, text = next(it), next(it), next(it)
            out.append(real if real is not None else whole if whole is not None else text)
        else:
            out.append(next(it))
    return tuple(out)


def _fingerprint(rows: dict[str, list[tuple[Any, ...]]]) -> tuple[str, dict[str, list[str]]]:
    """A sha256 over a run's rows, table by table (rows of a table without an order of
    its own sorted), and the rows as the text it hashed."""
    digest = hashlib.sha256()
    texts: dict[str, list[str]] = {}
    for table, found in rows.items():
        lines = [_canonical(row) for row in found]
        if table in PER_RUN and PER_RUN[table] is None:
            lines.sort()
        texts[table] = lines
        digest.update(f"{table}:{len(lines)}\n".encode())
        for line in lines:
            digest.update(line.encode("utf-8", "surrogatepass") + b"\n")
    return digest.hexdigest(), texts


def _canonical(row: Iterable[Any]) -> str:
    """A row as text that tells apart what the stores tell apart: a float by its bits,
    an int from a float, bytes from text."""
    parts = []
    for v in row:
        if isinstance(v, float):
            parts.append("nan" if math.isnan(v) else v.hex())
        elif isinstance(v, bool):
            parts.append(repr(int(v)))
        elif isinstance(v, (bytes, memoryview)):
            parts.append("b" + bytes(v).hex())
        else:
            parts.append(repr(v))
    return "\t".join(parts)


def _insert(
    pg: Any, table: str, names: Sequence[str], rows: list[tuple[Any, ...]], tail: str = ""
) -> None:
    """``rows`` (of ``names``) into ``table`` of PostgreSQL; ``tail``: e.g. ON CONFLICT."""
    if rows:
        sql = f"INSERT INTO {table} ({', '.join(names)}) VALUES ({_marks(names)}){tail}"
        pg.cursor().executemany(placeholders(sql), rows)


def _marks(names: Sequence[str]) -> str:
    return ", ".join("?" * len(names))


# -- a working copy for replay, and what the replay wrote, back --------------------------------


def copy_into_sqlite(
    target: sqlite3.Connection,
    source: PostgresMetadata,
    scripts: Sequence[str] | None,
    runs: Collection[str] | None = None,
) -> int:
    """A working copy of ``source`` in the embedded store ``target`` (migrated, empty),
    for a replay: every run, replay and definition, and the loops, logs, checkpoints
    and profile of the runs of ``scripts`` (None: of every run), of those only the
    ``runs`` named when given (the runs a replay's predicate chose). Logs keep their
    order. Returns how many rows of those four tables it copied."""
    pg = source.connection
    columns = {t: _common_columns(target, pg, t) for t in ("runs", *PER_RUN, *SHARED)}
    chosen = (
        None
        if scripts is None
        else [
            r
            for (r,) in pg.execute(
                "SELECT run_id FROM runs WHERE filename = ANY(%s) ORDER BY run_key",
                (list(scripts),),
            )
        ]
    )
    if runs is not None:
        wanted = set(runs)
        chosen = [r for r in (chosen if chosen is not None else sorted(wanted)) if r in wanted]
    copied = 0
    # The indexes of logs are built after its rows are in, not row by row.
    indexes = target.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'logs'"
        " AND sql IS NOT NULL"
    ).fetchall()
    with pg.transaction():
        pg.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        target.execute("BEGIN IMMEDIATE")
        try:
            for name, _ in indexes:
                target.execute(f'DROP INDEX "{name}"')
            for table in ("runs", *SHARED, "run_definitions"):
                first = " ORDER BY run_key" if table == "runs" else ""
                _copy_rows(pg, target, table, columns[table], f"SELECT * FROM {table}{first}")
            for table, order in PER_RUN.items():
                if table == "run_definitions":
                    continue
                where = "" if chosen is None else " WHERE run_id = ANY(%s)"
                by = f" ORDER BY {order}" if order else ""
                copied += _copy_rows(
                    pg, target, table, columns[table], f"SELECT * FROM {table}{where}{by}",
                    () if chosen is None else (chosen,),
                )  # fmt: skip
            for _, sql in indexes:
                target.execute(sql)
        except BaseException:
            target.execute("ROLLBACK")
            raise
        target.execute("COMMIT")
    return copied


def _copy_rows(
    pg: Any,
    target: sqlite3.Connection,
    table: str,
    names: list[str],
    select: str,
    params: Sequence[Any] = (),
) -> int:
    parts = [p for n in names for p in (_PARTS if n == "value" else (n,))]
    select = select.replace("SELECT *", f"SELECT {', '.join(parts)}", 1)
    # SQLite makes a value whole from its three parts (the one that is set, with its
    # type): no Python per row, which took 40% of the copy.
    marks = ", ".join("COALESCE(?, ?, ?)" if n == "value" else "?" for n in names)
    insert = f"INSERT INTO {table} ({', '.join(names)}) VALUES ({marks})"
    count = 0
    cursor = pg.cursor(name=f"rl_copy_{table}")  # a server-side cursor: rows in batches
    cursor.execute(select, params)
    while batch := cursor.fetchmany(20_000):
        target.executemany(insert, batch)
        count += len(batch)
    cursor.close()
    return count


# The tables a replay may add rows to, besides its own replays and values; each row
# that is new (or changed) after the replay is written back.
_KEPT: dict[str, str] = {
    "definitions": SHARED["definitions"],
    "run_definitions": "run_id, name",
    "module_sets": SHARED["module_sets"],
}


@dataclass
class CopyState:
    """What a working copy held when its replay began: write_back sends only what the
    replay added or changed, not the rows the copy was made of."""

    columns: dict[str, list[str]]  # the columns both stores have, by table
    replays: dict[str, str]  # replay id -> status
    rows: dict[str, set[tuple[Any, ...]]]  # rows of _KEPT's tables


def copy_state(copy: sqlite3.Connection, target: PostgresMetadata) -> CopyState:
    """The state of the working copy ``copy`` of ``target``, before its replay."""
    tables = ("logs", "replays", "replay_runs", *_KEPT)
    columns = {t: _common_columns(copy, target.connection, t) for t in tables}
    return CopyState(
        columns=columns,
        replays=dict(copy.execute("SELECT replay_id, status FROM replays").fetchall()),
        rows={t: set(_kept_rows(copy, t, columns[t])) for t in _KEPT},
    )


def _kept_rows(copy: sqlite3.Connection, table: str, names: list[str]) -> list[tuple[Any, ...]]:
    return copy.execute(f"SELECT {', '.join(names)} FROM {table}").fetchall()


def write_back(
    copy: sqlite3.Connection,
    target: PostgresMetadata,
    before: CopyState,
    *,
    names: Sequence[str],
    force: bool,
) -> WrittenBack:
    """Everything a replay on the working copy ``copy`` wrote, into ``target``, at once
    (:class:`WriteBack` for a replay whose runs land one by one)."""
    return WriteBack(copy, target, before, names=names, force=force).finish()


class WriteBack:
    """What a replay on the working copy ``copy`` writes, into ``target``, run by run:
    replays the copy did not hold ``before`` and their runs, the values they backfilled,
    the definitions and module sets they kept, and replays the copy marked interrupted.

    :meth:`runs` writes runs as they land in the copy, each in one PostgreSQL
    transaction: the rows the replay shared that are not there yet (its ``replays`` row,
    marked running, with the first run), the run's ``replay_runs`` row, its values and
    its summaries. :meth:`finish` writes the runs not written yet, then the replays'
    rows as the copy ends them. Writing a run again is safe: rows that are there are
    kept, and a run's count is what this replay holds in ``target``.

    Each run's values go in under an advisory lock on the run, so two replays of one
    run, from two machines, never both write a value: as on SQLite, a backfilled value
    is only inserted where (run, context, name) has none, and ``force`` first removes
    the run's backfilled values of ``names``.
    """

    def __init__(
        self,
        copy: sqlite3.Connection,
        target: PostgresMetadata,
        before: CopyState,
        *,
        names: Sequence[str],
        force: bool,
    ) -> None:
        self.copy, self.target, self.before = copy, target, before
        self.names, self.force = list(names), force
        self.result = WrittenBack()
        self._sent: dict[str, set[tuple[Any, ...]]] = {t: set() for t in _KEPT}
        self._replays_sent: set[str] = set()

    def _new(self) -> list[str]:
        """The replays the copy holds that it did not hold before."""
        found = [r for (r,) in self.copy.execute("SELECT replay_id FROM replays")]
        return [r for r in found if r not in self.before.replays]

    def runs(self, run_ids: Iterable[str]) -> None:
        """``run_ids``' rows, each run in its own transaction; a run the copy holds no
        ``replay_runs`` row of (yet) is left for later."""
        new = self._new()
        if not new:
            return
        for run_id in run_ids:
            if (
                run_id not in self.result.written
                and self.copy.execute(
                    f"SELECT 1 FROM replay_runs WHERE run_id = ? AND replay_id IN ({_marks(new)})",
                    (run_id, *new),
                ).fetchone()
            ):
                self._run(run_id, new)

    def finish(self) -> WrittenBack:
        """The runs not written yet, then the replays' rows as the copy ends them."""
        new = self._new()
        marks = _marks(new)
        rest = [
            r
            for (r,) in self.copy.execute(
                f"SELECT DISTINCT run_id FROM replay_runs WHERE replay_id IN ({marks})", new
            )
        ]
        pg = self.target.connection
        with pg.transaction():
            done = self._shared(new)
        for mark in done:
            mark()
        self.runs(rest)
        columns = self.before.columns["replays"]
        replays = dict(self.copy.execute("SELECT replay_id, status FROM replays").fetchall())
        with pg.transaction():
            rows = self.copy.execute(
                f"SELECT {', '.join(columns)} FROM replays WHERE replay_id IN ({marks})", new
            ).fetchall()
            rest_columns = [c for c in columns if c != "replay_id"]
            pg.cursor().executemany(
                f"UPDATE replays SET {', '.join(f'{c} = %s' for c in rest_columns)}"
                " WHERE replay_id = %s",
                [
                    (
                        *(row[columns.index(c)] for c in rest_columns),
                        row[columns.index("replay_id")],
                    )
                    for row in rows
                ],
            )
            ended = dict(self.copy.execute("SELECT replay_id, ended_at FROM replays").fetchall())
            interrupted = [
                (ended[r], r)
                for r, status in replays.items()
                if status == "interrupted" and self.before.replays.get(r, "interrupted") != status
            ]
            pg.cursor().executemany(
                "UPDATE replays SET status = 'interrupted', ended_at = COALESCE(ended_at, %s)"
                " WHERE replay_id = %s AND status = 'running'",
                interrupted,
            )
        return self.result

    def _shared(self, new: list[str]) -> list[Callable[[], None]]:
        """Inside a transaction: the definitions and module sets kept and the replays'
        rows, not sent yet; what marks them sent once the transaction commits."""
        pg, columns = self.target.connection, self.before.columns
        done: list[Callable[[], None]] = []
        for table, keys in _KEPT.items():
            added = (
                set(_kept_rows(self.copy, table, columns[table]))
                - self.before.rows[table]
                - self._sent[table]
            )
            if not added:
                continue
            _insert(pg, table, columns[table], sorted(added, key=repr),
                    f" ON CONFLICT ({keys}) DO NOTHING")  # fmt: skip
            if table == "module_sets":  # a warm time measured again
                digest, warm = columns[table].index("digest"), columns[table].index("warm_seconds")
                pg.cursor().executemany(
                    "UPDATE module_sets SET warm_seconds = %s WHERE digest = %s",
                    [(row[warm], row[digest]) for row in added if row[warm] is not None],
                )
            done.append(functools.partial(self._sent[table].update, added))
        unsent = [r for r in new if r not in self._replays_sent]
        if unsent:
            rows = self.copy.execute(
                f"SELECT {', '.join(columns['replays'])} FROM replays"
                f" WHERE replay_id IN ({_marks(unsent)})",
                unsent,
            ).fetchall()
            _insert(pg, "replays", columns["replays"], rows,
                    f" ON CONFLICT ({SHARED['replays']}) DO NOTHING")  # fmt: skip
            done.append(lambda: self._replays_sent.update(unsent))
        return done

    def _run(self, run_id: str, new: list[str]) -> None:
        copy, pg, names = self.copy, self.target.connection, self.names
        columns = self.before.columns
        log_columns = columns["logs"]
        parts = [p for n in log_columns for p in (_PARTS if n == "value" else (n,))]
        marks = _marks(new)
        if self.force:  # the copy's backfilled values of names for this run replace the database's
            found = copy.execute(
                f"SELECT {', '.join(log_columns)} FROM logs WHERE run_id = ? AND origin ="
                f" 'backfilled' AND name IN ({', '.join('?' * len(names))}) ORDER BY log_id",
                (run_id, *names),
            ).fetchall()
        else:
            found = copy.execute(
                f"SELECT {', '.join(log_columns)} FROM logs WHERE run_id = ?"
                f" AND replay_id IN ({marks}) ORDER BY log_id",
                (run_id, *new),
            ).fetchall()
        own = copy.execute(
            f"SELECT {', '.join(columns['replay_runs'])} FROM replay_runs"
            f" WHERE run_id = ? AND replay_id IN ({marks})",
            (run_id, *new),
        ).fetchall()
        with pg.transaction():
            # The run's lock before any row, so two replays never wait on each other.
            pg.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (run_id,))
            done = self._shared(new)
            _insert(pg, "replay_runs", columns["replay_runs"], own,
                    f" ON CONFLICT ({SHARED['replay_runs']}) DO NOTHING")  # fmt: skip
            if self.force:
                pg.execute(
                    "DELETE FROM logs WHERE run_id = %s AND origin = 'backfilled'"
                    " AND name = ANY(%s)",
                    (run_id, names),
                )
            pg.execute(
                "CREATE TEMPORARY TABLE IF NOT EXISTS rl_backfill ON COMMIT DELETE ROWS AS"
                f" SELECT {', '.join(parts)}, CAST(0 AS bigint) AS seq FROM logs WITH NO DATA"
            )
            cursor = pg.cursor()
            with cursor.copy(f"COPY rl_backfill ({', '.join(parts)}, seq) FROM STDIN") as rows:
                for seq, row in enumerate(found):
                    rows.write_row([*_split(log_columns, row), seq])
            # Values of another replay kept; this replay's own, stored by a write of this
            # run whose commit went unanswered, count as written.
            kept = pg.execute(
                "SELECT l.replay_id, count(*) FROM rl_backfill b JOIN logs l ON"
                " l.name = b.name AND l.run_id = b.run_id"
                " AND l.ctx_id IS NOT DISTINCT FROM b.ctx_id"
                " WHERE l.origin = 'backfilled' AND NOT COALESCE(l.replay_id = ANY(%s), false)"
                " GROUP BY l.replay_id",
                (new,),
            ).fetchall()
            pg.execute(
                f"INSERT INTO logs ({', '.join(parts)}) SELECT {', '.join(parts)}"
                " FROM rl_backfill b WHERE NOT EXISTS (SELECT 1 FROM logs l WHERE"
                " l.name = b.name AND l.run_id = b.run_id"
                " AND l.ctx_id IS NOT DISTINCT FROM b.ctx_id) ORDER BY seq"
            )
            (written,) = pg.execute(
                "SELECT count(*) FROM logs WHERE run_id = %s AND replay_id = ANY(%s)",
                (run_id, new),
            ).fetchone() or (0,)
            recompute(pg.cursor(), run_id, names if self.force else
                      {row[log_columns.index("name")] for row in found},
                      mark="%s", number=POSTGRES_NUMBER)  # fmt: skip
            pg.execute(
                "UPDATE replay_runs SET backfilled = %s WHERE run_id = %s AND replay_id = ANY(%s)",
                (int(written), run_id, new),
            )
        for mark in done:
            mark()
        self.result.written[run_id] = int(written)
        self.result.already[run_id] = {str(other): int(count) for other, count in kept}


@dataclass
class WrittenBack:
    """What :func:`write_back` stored per run: values written, and values another replay
    had stored first (kept): run -> that replay's id -> how many."""

    written: dict[str, int] = field(default_factory=dict)
    already: dict[str, dict[str, int]] = field(default_factory=dict)
