"""The runs table the dashboard shows: one row per run, a page at a time.

Each row has the run's fixed fields (status, start, duration, script, code
version, arguments) and the columns the user picked, each a logged name with
an aggregate: ``last`` (the value of the run's greatest loop context holding the
name, or its run-level value), ``first`` (its smallest), ``min``, ``max``, ``mean``
(over its numbers), ``count`` (its values). Every cell is read from the runs'
summaries (store/summaries.py), which the writers keep current, never from a scan
of the values. Values count as the dataframe counts them: per context, the newest
recorded record, else the newest backfilled one. A name no run logged is an empty
column with a note.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from retrolog._query.dataframe import (
    logged_names,
    value_parts,
    whole_value,
)
from retrolog._query.runs import arguments, matching_runs
from retrolog.errors import UsageError
from retrolog.store import reads

AGGREGATES: tuple[str, ...] = ("last", "first", "min", "max", "mean", "count")

DEFAULT_COLUMNS = 8
"""How many metrics' last values the table shows when no column is picked."""

FIELDS: tuple[str, ...] = (
    "run_id",
    "tstamp",
    "filename",
    "status",
    "started_at",
    "duration",
    "code_version",
    "dirty",
    "args",
)
"""Every row's fixed fields: ``duration`` in seconds (to now for a running run),
``code_version`` the hash of the code's tree (two runs of the same code share it), ``args``
the run's parsed command-line values and rl.arg values (``rl.arg`` wins on a clash)."""


@dataclass(frozen=True)
class Column:
    """A picked column: a logged name and how a run's values of it become one cell."""

    name: str
    aggregate: str = "last"
    # A word after the name's last colon that is not an aggregate (``loss:median``): an
    # error, unless the whole text is itself a logged name.
    unknown_aggregate: str | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return f"{self.name}:{self.aggregate}"

    @classmethod
    def parse(cls, text: str) -> Column:
        """``acc``, ``acc:last``, ``loss:min``; a name may itself hold colons."""
        name, _, agg = text.rpartition(":")
        if name and agg in AGGREGATES:
            return cls(name, agg)
        if not text.strip():
            raise UsageError("A column names a logged value, e.g. acc or loss:min.")
        asked = agg if name and agg.isidentifier() else None
        return cls(text, "last", unknown_aggregate=asked)


def runs_table(
    conn: sqlite3.Connection,
    *,
    where: str | None = None,
    columns: Sequence[Column] = (),
    sort: str = "started_at",
    descending: bool = True,
    offset: int = 0,
    limit: int | None = 100,
    status: Sequence[str] = (),
    default_columns: bool = False,
    ids: bool = False,
) -> dict[str, Any]:
    """A page of the runs table.

    where: the predicate `retrolog dataframe --where` takes, choosing runs.
    columns: the picked columns, computed for the page's rows only (or for every
        matching run when ``sort`` is one of them).
    sort: a field of FIELDS, a picked column's key (``acc:last``) or an argument
        (``args.lr``); runs without a value sort last either way.
    status: the statuses of the runs chosen (any when empty).
    default_columns: without ``columns``, the last value of each metric the runs log, their
        arguments left out (the first DEFAULT_COLUMNS of them by name).
    ids: also every matching run's id, in the table's order (selecting all of them).
    Returns {"total": matching runs, "offset", "fields", "columns": keys, "rows": [...],
    "notes": [why a column is empty, ...], "metrics": names holding numbers[, "ids"]}.
    """
    if offset < 0 or (limit is not None and limit < 1):
        raise UsageError("A page starts at offset 0 or later and holds at least one run.")
    metrics = reads.summarised_number_names(conn)
    if default_columns and not columns:
        columns = _default_columns(conn, metrics)
    keys = [c.key for c in columns]
    argument = sort[len("args.") :] if sort.startswith("args.") else None
    if sort not in FIELDS and sort not in keys and not argument:
        raise UsageError(
            f"The table sorts by one of {', '.join(FIELDS)}, an argument (args.NAME) or a "
            f"shown column ({', '.join(keys) or 'none is shown'}), not {sort!r}."
        )
    notes = _column_notes(conn, columns)
    rows = _chosen_rows(conn, where, status)
    total = len(rows)
    rows = _sorted_rows(conn, rows, columns, sort, argument, descending)
    page = rows[offset : None if limit is None else offset + limit]
    _decode_args(page)
    for column in columns:
        if column.key == sort:
            continue
        values = _column_values(conn, column, [r["run_id"] for r in page])
        for r in page:
            r[column.key] = values.get(r["run_id"])
    return {"total": total, "offset": offset, "fields": list(FIELDS), "columns": keys,
            "rows": page, "notes": notes, "metrics": metrics,
            **({"ids": [r["run_id"] for r in rows]} if ids else {})}  # fmt: skip


def _default_columns(conn: sqlite3.Connection, metrics: Sequence[str]) -> list[Column]:
    """The last value of the first DEFAULT_COLUMNS metrics that are not arguments."""
    # Arguments have their own columns: the default ones are what the runs measured.
    given = {key for run in reads.all_run_arguments(conn) for key in arguments(*run)}
    return [Column(name) for name in metrics if name not in given][:DEFAULT_COLUMNS]


def _column_notes(conn: sqlite3.Connection, columns: Sequence[Column]) -> list[str]:
    """Why a picked column is empty, one note per name no run logged; a column whose word
    after its last colon is no aggregate (and whose whole text no logged name) is an error."""
    logged = set(logged_names(conn)) if columns else set()
    for c in columns:
        if c.unknown_aggregate is not None and c.name not in logged:
            raise UsageError(
                f"{c.unknown_aggregate!r} in the column {c.name!r} is not an aggregate. A "
                "column is a logged name, alone (its last value) or followed by one of "
                f"{', '.join(':' + a for a in AGGREGATES)}: last is the value of the run's "
                "latest loop context, first its earliest, min, max and mean are over its "
                "numbers, count counts its values; e.g. loss:min."
            )
    # A name no run logged yet (a replay may fill it in) is an empty column, not an error.
    return [
        f"No run logged {name!r} yet: its column stays empty until a run logs it or a "
        "replay fills it in."
        for name in dict.fromkeys(c.name for c in columns if c.name not in logged)
    ]


def _chosen_rows(
    conn: sqlite3.Connection, where: str | None, status: Sequence[str]
) -> list[dict[str, Any]]:
    """The fixed fields of the runs ``where`` and ``status`` choose."""
    rows = _base_rows(conn)
    if where and where.strip():
        chosen = matching_runs(conn, where)
        rows = [r for r in rows if r["run_id"] in chosen]
    if status:
        rows = [r for r in rows if r["status"] in status]
    return rows


def _sorted_rows(
    conn: sqlite3.Connection,
    rows: list[dict[str, Any]],
    columns: Sequence[Column],
    sort: str,
    argument: str | None,
    descending: bool,
) -> list[dict[str, Any]]:
    """The rows in the table's order: by a field, a picked column (its cells computed for
    every row, kept in them) or an argument."""
    by_column = {c.key: c for c in columns}
    if sort in by_column:
        values = _column_values(conn, by_column[sort], [r["run_id"] for r in rows])
        for r in rows:
            r[sort] = values.get(r["run_id"])
    if sort == "args" or argument:
        _decode_args(rows)
    if argument:
        for r in rows:
            r[sort] = r["args"].get(argument)
    rows = _sorted(rows, sort, descending)
    if argument:
        for r in rows:
            del r[sort]
    return rows


def _base_rows(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    now = time.time()
    rows = []
    for (
        run_id,
        tstamp,
        filename,
        status,
        started,
        ended,
        tree,
        dirty,
        args,
        parsed,
    ) in conn.execute(
        "SELECT run_id, tstamp, filename, status, started_at, ended_at, code_tree, dirty,"
        " args, parsed_args FROM runs"
    ):
        rows.append(
            {
                "run_id": run_id,
                "tstamp": tstamp,
                "filename": filename,
                "status": status,
                "started_at": started,
                "duration": max(0.0, (ended or now) - started),
                "code_version": tree,
                "dirty": None if dirty is None else bool(dirty),
                "args": _Stored(parsed, args),  # decoded for the page only (_decode_args)
            }
        )
    return rows


@dataclass(frozen=True)
class _Stored:
    """A run's arguments as the store holds them (JSON text), not yet decoded: decoding
    10,000 runs' arguments took 0.2 s, where a page shows 100."""

    parsed: str | None
    args: str | None


def _decode_args(rows: Iterable[dict[str, Any]]) -> None:
    for r in rows:
        if isinstance(r["args"], _Stored):
            r["args"] = arguments(r["args"].parsed, r["args"].args)


def _sorted(rows: list[dict[str, Any]], key: str, descending: bool) -> list[dict[str, Any]]:
    """Sorted by ``key``; runs without a value last; ties broken by start time, then id."""

    def rank(value: Any) -> tuple[int, Any]:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return (2, 0)
        if isinstance(value, bool | int | float):
            return (0, value)
        return (1, json.dumps(value, sort_keys=True, default=str) if key == "args" else str(value))

    rows = sorted(rows, key=lambda r: (r["started_at"], r["run_id"]), reverse=descending)
    present = [r for r in rows if rank(r.get(key))[0] < 2]
    absent = [r for r in rows if rank(r.get(key))[0] == 2]
    present.sort(key=lambda r: rank(r.get(key)), reverse=descending)
    return present + absent


def _column_values(conn: Any, column: Column, run_ids: Iterable[str]) -> dict[str, Any]:
    """One cell per run, from the runs' summaries (store/summaries.py)."""
    wanted = set(run_ids)
    if not wanted:
        return {}
    if column.aggregate in ("last", "first"):
        return _at_context(conn, column, wanted)
    expression = {
        "min": "smallest",
        "max": "largest",
        "count": "n_values",
        "mean": "CASE WHEN n_numbers > 0 THEN total / n_numbers END",
    }[column.aggregate]
    found: dict[str, Any] = {}
    for run_id, value in conn.execute(
        f"SELECT run_id, {expression} FROM run_summaries WHERE name = ?", (column.name,)
    ):
        if run_id in wanted and value is not None:
            found[run_id] = value
    return found


def _at_context(conn: Any, column: Column, wanted: set[str]) -> dict[str, Any]:
    """The value each run holds at its summary's last (or first) context: the record that
    counts there; the run-level value for a run without one in a loop."""
    at = "last_ctx" if column.aggregate == "last" else "first_ctx"
    parts = value_parts(conn, "l")
    found: dict[str, Any] = {}
    run_level = []
    by_run: dict[str, tuple[Any, ...]] = {}
    for run_id, ctx in conn.execute(
        f"SELECT run_id, {at} FROM run_summaries WHERE name = ?", (column.name,)
    ).fetchall():
        if run_id not in wanted:
            continue
        if ctx is None:
            run_level.append(run_id)
    for row in conn.execute(
        f"SELECT l.run_id, l.origin, l.log_id, l.value_type, {', '.join(parts)}"
        # CROSS JOIN: SQLite then reads the summaries first and each run's record by the
        # logs_by_name index, rather than every record of the name (PostgreSQL plans it
        # as any join).
        f" FROM run_summaries s CROSS JOIN logs l WHERE s.name = ? AND l.name = s.name"
        f" AND l.run_id = s.run_id AND l.ctx_id = s.{at}",
        (column.name,),
    ).fetchall():
        run_id = row[0]
        if run_id not in wanted:
            continue
        # The record that counts in a context: the newest recorded one, else the newest.
        rank = (row[1] == "recorded", row[2])
        if run_id not in by_run or rank > (by_run[run_id][1] == "recorded", by_run[run_id][2]):
            by_run[run_id] = row
    for run_id, row in by_run.items():
        value = _plain(row[3], whole_value(row[4:]))
        if value is not None:
            found[run_id] = value
    for run_id in run_level:
        value = _last(conn, column.name, run_id)
        if value is not None:
            found[run_id] = value
    return found


def _plain(value_type: str, value: Any) -> Any:
    if value_type == "float":
        return None if value is None else float(value)  # a NaN is stored as NULL
    if value_type == "bool":
        return bool(value)
    if value_type == "json":
        return json.loads(value)
    return value


def _last(conn: Any, name: str, run_id: str) -> Any:
    """The run-level value of ``name``: the newest recorded record, else the newest."""
    parts = value_parts(conn, "l")
    row = conn.execute(
        f"SELECT l.value_type, {', '.join(parts)} FROM logs l WHERE l.name = ?"
        " AND l.run_id = ? AND l.ctx_id IS NULL"
        " ORDER BY CASE WHEN l.origin = 'recorded' THEN 1 ELSE 0 END DESC, l.log_id DESC"
        " LIMIT 1",
        (name, run_id),
    ).fetchone()
    return None if row is None else _plain(row[0], whole_value(row[1:]))


def argument_values(conn: sqlite3.Connection, run_ids: Sequence[str], name: str) -> dict[str, Any]:
    """Each run's value of argument ``name`` (parsed or rl.arg), None where it has none."""
    found: dict[str, Any] = {}
    for run_id in run_ids:
        given = reads.run_arguments(conn, run_id) or reads.RunArguments(None, None)
        found[run_id] = arguments(*given).get(name)
    return found
