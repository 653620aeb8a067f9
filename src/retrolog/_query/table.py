"""The runs table the dashboard shows: one row per run, a page at a time.

Each row has the run's fixed fields (status, start, duration, script, code
version, arguments) and the columns the user picked, each a logged name with
an aggregate: its ``last`` value (the value of the run's last context that has
one, or the run-level value), its ``min`` or its ``max``. A column is computed
only for the rows on the page, unless the table is sorted by it. Values count
as the dataframe counts them: per context, the newest recorded record, else
the newest backfilled one.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from retrolog._query.dataframe import (
    _not_superseded,
    logged_names,
    number_of,
    value_parts,
    whole_value,
)
from retrolog._query.runs import arguments, matching_runs
from retrolog.errors import UnknownNameError, UsageError

AGGREGATES: tuple[str, ...] = ("last", "min", "max")

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

    @property
    def key(self) -> str:
        return f"{self.name}:{self.aggregate}"

    @classmethod
    def parse(cls, text: str) -> Column:
        """``acc``, ``acc:last``, ``loss:min``; a name may itself hold colons."""
        name, _, agg = text.rpartition(":")
        if not name or agg not in AGGREGATES:
            name, agg = text, "last"
        if not name.strip():
            raise UsageError("A column names a logged value, e.g. acc or loss:min.")
        return cls(name, agg)


def runs_table(
    conn: sqlite3.Connection,
    *,
    where: str | None = None,
    columns: Sequence[Column] = (),
    sort: str = "started_at",
    descending: bool = True,
    offset: int = 0,
    limit: int | None = 100,
) -> dict[str, Any]:
    """A page of the runs table.

    where: the predicate `retrolog dataframe --where` takes, choosing runs.
    columns: the picked columns, computed for the page's rows only (or for every
        matching run when ``sort`` is one of them).
    sort: a field of FIELDS or a picked column's key (``acc:last``); runs without a
        value sort last either way.
    Returns {"total": matching runs, "offset", "fields", "columns": keys, "rows": [...]}.
    """
    if offset < 0 or (limit is not None and limit < 1):
        raise UsageError("A page starts at offset 0 or later and holds at least one run.")
    keys = [c.key for c in columns]
    if sort not in FIELDS and sort not in keys:
        raise UsageError(
            f"The table sorts by one of {', '.join(FIELDS)} or a shown column "
            f"({', '.join(keys) or 'none is shown'}), not {sort!r}."
        )
    logged = set(logged_names(conn)) if columns else set()
    missing = [c.name for c in columns if c.name not in logged]
    if missing:
        raise UnknownNameError(
            f"No run logged {', '.join(map(repr, missing))}; pick a column from the names "
            "`retrolog show RUN` lists."
        )
    rows = _base_rows(conn)
    if where and where.strip():
        chosen = matching_runs(conn, where)
        rows = [r for r in rows if r["run_id"] in chosen]
    total = len(rows)
    by_column = {c.key: c for c in columns}
    if sort in by_column:
        values = _column_values(conn, by_column[sort], [r["run_id"] for r in rows])
        for r in rows:
            r[sort] = values.get(r["run_id"])
    if sort == "args":
        _decode_args(rows)
    rows = _sorted(rows, sort, descending)
    page = rows[offset : None if limit is None else offset + limit]
    _decode_args(page)
    for column in columns:
        if column.key == sort:
            continue
        values = _column_values(conn, column, [r["run_id"] for r in page])
        for r in page:
            r[column.key] = values.get(r["run_id"])
    return {"total": total, "offset": offset, "fields": list(FIELDS), "columns": keys,
            "rows": page}  # fmt: skip


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


def _column_values(
    conn: sqlite3.Connection, column: Column, run_ids: Iterable[str]
) -> dict[str, Any]:
    """One cell per run: the aggregate of the run's values of the column's name."""
    found: dict[str, Any] = {}
    for run_id in run_ids:
        if column.aggregate == "last":
            value = _last(conn, column.name, run_id)
        else:
            fn = "MIN" if column.aggregate == "min" else "MAX"
            row = conn.execute(
                f"SELECT {fn}({number_of(conn, 'l')}) FROM logs l WHERE l.name = ?"
                " AND l.run_id = ? AND l.value_type IN ('float', 'int', 'bool')"
                + _not_superseded("l"),
                (column.name, run_id),
            ).fetchone()
            value = row[0] if row else None
        if value is not None:
            found[run_id] = value
    return found


def _last(conn: sqlite3.Connection, name: str, run_id: str) -> Any:
    """The value of the run's last context holding ``name`` (else its run-level value)."""
    ctx = conn.execute(
        "SELECT ctx_id FROM logs WHERE name = ? AND run_id = ? AND ctx_id IS NOT NULL"
        " ORDER BY ctx_id DESC LIMIT 1",
        (name, run_id),
    ).fetchone()
    where = "l.ctx_id = ?" if ctx else "l.ctx_id IS NULL"
    params = (name, run_id, ctx[0]) if ctx else (name, run_id)
    parts = value_parts(conn, "l")
    row = conn.execute(
        f"SELECT l.value_type, {', '.join(parts)} FROM logs l WHERE l.name = ?"
        " AND l.run_id = ? AND "
        + where
        + " ORDER BY (l.origin = 'recorded') DESC, l.log_id DESC LIMIT 1",
        params,
    ).fetchone()
    if row is None:
        return None
    value_type, value = row[0], whole_value(row[1:])
    if value_type == "float":
        return None if value is None else float(value)  # a NaN is stored as NULL
    if value_type == "bool":
        return bool(value)
    if value_type == "json":
        return json.loads(value)
    return value


def argument_values(conn: sqlite3.Connection, run_ids: Sequence[str], name: str) -> dict[str, Any]:
    """Each run's value of argument ``name`` (parsed or rl.arg), None where it has none."""
    found: dict[str, Any] = {}
    for run_id in run_ids:
        row = conn.execute("SELECT parsed_args, args FROM runs WHERE run_id = ?", (run_id,))
        parsed, given = row.fetchone() or (None, None)
        found[run_id] = arguments(parsed, given).get(name)
    return found
