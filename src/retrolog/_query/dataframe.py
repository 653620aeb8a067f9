"""The wide view: one row per (run, loop context), one column per requested name.

FlorDB's dataframe, computed by the store's database, SQLite or PostgreSQL (see
:func:`_ctes`, :func:`_rows_sql`; the reader's ``Dialect``, store/metastore.py, holds
what their SQL says differently):

==============  ===============================================================
``hop``         the runs that logged a requested loop-level name, found by
                hopping along the ``logs_by_name`` index from run to run
``run_values``  the run-level values (logged outside loops: arguments, final
                metrics) pivoted into one row per run
``chosen``      the runs that get rows, numbered in start order, with their
                run-level values
``wide``        each loop context of a chosen run (``a0``, in execution order)
                joined to the log record holding each name's value there, and to
                its ancestors (``a1``, ``a2``, ... one self-join of ``loops`` per
                level) so that every loop name becomes a column; only contexts
                where a requested name has a value are kept, and a run with
                run-level values only gets one row
outer query     the user's ``where`` predicate, then the order
==============  ===============================================================

Of several records for one (run, context, name) the value is the newest
recorded one, else the newest backfilled one.

Python writes the SQL text and gives each column its dtype. The driver builds a
Python object per cell, which at 100,000 rows costs as much as the query, so
some columns travel in a cheaper form than the view shows them: the run columns
come once per run (spread over the rows with one vectorized take), an empty
dimension comes as -1, and the value types of up to eight names come as one
bit mask per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from retrolog._query.sql import execute_read_any
from retrolog.errors import QueryError, UnknownNameError
from retrolog.store.metastore import (
    Dialect,
    activity_stamp,
    dialect_of,
    read_snapshot,
    store_file,
)
from retrolog.store.paths import storable_text
from retrolog.store.reads import name_logged

META_COLUMNS: tuple[str, ...] = ("projid", "run_id", "tstamp", "filename")
"""The run columns every wide view starts with."""

VALUE_TYPES: tuple[str, ...] = ("float", "int", "bool", "str", "text", "json", "none")
"""The values of ``logs.value_type``, in the order of their bit in a type mask."""

DEFINITION_OPTIONS: tuple[str, ...] = ("any", "current", "column")
"""What dataframe(definitions=...) takes."""

INEXACT_COLUMN = "inexact"
"""The column naming, per row, the values a replay that was not exact backfilled.

It is there only when some value of the result is marked (``logs.inexact``)."""
"""The values of ``logs.value_type``, in the order of their bit in a type mask."""

# A row key is (the run's compact key << 32) + ctx_id + 1: it names the run for the run
# columns and, since rows come in (run, ctx) order, shows a (run, ctx) seen twice.
# ctx_id stays far below 2**32 - 1: that many loop iterations would not fit a store.
_ROW_KEY = "__retrolog_row"
_CTX_BITS = 32
# A type mask packs 8 names, 8 bits each (7 used), into one SQLite integer.
_NAMES_PER_MASK = 8
# A double-quoted identifier, skipping single-quoted strings and comments.
_DOUBLE_QUOTED = re.compile(r"'(?:[^']|'')*'|--[^\n]*|/\*.*?\*/|\"((?:[^\"]|\"\")*)\"", re.S)


def value_parts(conn: Any, alias: str = "") -> list[str]:
    """The columns a logged value is read from, for :func:`whole_value`: SQLite's
    ``value``, or PostgreSQL's ``value_float``, ``value_int`` and ``value_text``."""
    prefix = f"{alias}." if alias else ""
    return [prefix + part for part in dialect_of(conn).parts]


def whole_value(parts: Sequence[Any]) -> Any:
    """A value read as :func:`value_parts`: the one part that is set (None for NULL)."""
    return next((part for part in parts if part is not None), None)


def number_of(conn: Any, alias: str = "") -> str:
    """SQL for a logged number (float, int or bool) as one column, for MIN, MAX and
    arithmetic: SQLite's ``value``; PostgreSQL's float or int column (an int as
    double precision there)."""
    return dialect_of(conn).number(alias)


@dataclass(frozen=True)
class _Name:
    """A log name that becomes a column of the view (shown, or used by ``where`` only)."""

    name: str
    shown: bool  # False for a name only the where-predicate refers to
    in_loops: bool  # logged inside some loop
    at_run: bool  # logged outside every loop somewhere
    repeated: bool = False  # logged more than once in some (run, context)
    # The value types it has in the store, known where a predicate can name it on
    # PostgreSQL: its column there takes one SQL type (Dialect.predicate_value).
    types: frozenset[str] | None = None


@dataclass(frozen=True)
class _Dims:
    """The loop names that may become dimension columns, and how deep loops nest."""

    names: list[str]  # outermost first, then by first occurrence
    depth: int  # the deepest loop's depth (0 when loops are not nested)
    # The shown names have values in few of the loop contexts: rows are found from their
    # values rather than by walking every context (see _sparse).
    sparse: bool = False


def logged_names(conn: Any) -> list[str]:
    """The distinct names logged in the store, sorted (conn: a SQLite connection or a
    MetadataStore's reader: the statement is standard SQL)."""
    # Hops from name to name along the logs_by_name index instead of reading every record.
    sql = (
        "WITH RECURSIVE n(name) AS ("
        " SELECT min(name) FROM logs"
        " UNION ALL"
        " SELECT (SELECT min(name) FROM logs WHERE name > n.name) FROM n WHERE n.name IS NOT NULL"
        ") SELECT name FROM n WHERE name IS NOT NULL"
    )
    # Sorted here too: PostgreSQL's min() follows the database's collation.
    return sorted(row[0] for row in conn.execute(sql))


def dataframe(
    conn: Any,
    names: Sequence[str],
    where: str | None = None,
    *,
    definitions: str = "any",
    today: Callable[[str, Sequence[str]], dict[str, str]] | None = None,
    only: Sequence[str] | None = None,
) -> pd.DataFrame:
    """The wide view of ``names``: a row per (run, loop context) where one of them has a value.

    names: log names, one column each in this order (repeats are dropped). A name
        logged outside loops (an argument, a final metric) is broadcast to every row
        of its run.
    where: a SQL predicate over the view's columns, e.g. ``"lr > 0.005 AND epoch = 4"``;
        it may also use logged names that are not requested (double-quote a name
        that is not a plain identifier: ``"val/acc" > 0.9``).

    Columns: ``projid, run_id, tstamp, filename``, one ``Int64`` column per loop
    name in the ancestry of the rows (outermost first, e.g. ``epoch, step``), then
    the names. Rows are ordered by run start, then execution order.

    definitions: which definitions' values to show (docs/replay.md, "Definitions"):
        "any" (every value), "current" (only values whose definition is the one
        today's script has: others become empty), "column" (every value, and
        one column ``<name>:definition`` per name with each value's key).
    today: for "current", the keys of today's statements of some names in a
        script: ``today(filename, names) -> {name: key}``.
    only: only these runs (ids), chosen in the view's own SQL, not by a predicate.

    Raises UnknownNameError for a name never logged in the store and QueryError
    for a predicate that is malformed, uses an unknown column, or tries to write.
    """
    frame, _ = _frame(conn, names, where, definitions, today, only, None)
    return frame


def dataframe_page(
    conn: Any,
    names: Sequence[str],
    where: str | None = None,
    *,
    offset: int,
    limit: int,
    definitions: str = "any",
    today: Callable[[str, Sequence[str]], dict[str, str]] | None = None,
    only: Sequence[str] | None = None,
) -> tuple[pd.DataFrame, int]:
    """Rows ``offset`` to ``offset + limit`` of ``dataframe(conn, names, where, ...)``, cut
    in SQL (the rows before and after are never read into Python), and the number of rows
    of the whole view, read from the same snapshot.

    A column's dtype is the one its values on the page need, and a loop column shows
    when a row of the page is in that loop.
    """
    if offset < 0 or limit < 0:
        raise QueryError(f"A page starts at a row >= 0 and holds >= 0 rows, not {offset}, {limit}.")
    frame, total = _frame(conn, names, where, definitions, today, only, (offset, limit))
    assert total is not None
    return frame, total


def _frame(
    conn: Any,
    names: Sequence[str],
    where: str | None,
    definitions: str,
    today: Callable[[str, Sequence[str]], dict[str, str]] | None,
    only: Sequence[str] | None,
    window: tuple[int, int] | None,
) -> tuple[pd.DataFrame, int | None]:
    """``dataframe``, or with ``window`` (offset, limit) one page of it and the number of
    rows of the whole view."""
    requested, where = _request(conn, names, where, definitions, today)
    # A training process may add runs and logs meanwhile: every statement reads one snapshot.
    with _snapshot(conn):
        # A name logged twice in one context shows as two rows for that context. Without
        # a predicate they are found in the result (cheaper than asking first); a
        # predicate could drop one of the two, so then the names are checked first.
        # A page cannot tell from its rows whether a name repeats elsewhere (which would
        # move the rows of the pages after it): asked first too.
        check = where is not None or window is not None
        query = _wide_query(conn, requested, where, check=check)
        query.only = None if only is None else tuple(only)
        query.window = window
        rows = query.rows()
        total = None if window is None else query.count()
        if not check and _has_repeats(rows[_ROW_KEY]):
            query.columns = [
                dataclasses.replace(c, repeated=_repeated(conn, c.name)) if c.in_loops else c
                for c in query.columns
            ]
            rows = query.rows()
        runs = query.runs()
        take = _run_positions(rows, runs)
        rows, types = _column_types(conn, query, rows, runs, take)
        inexact = _inexact_column(conn, rows, requested)
        keys = (
            {name: _cell_keys(conn, rows, name) for name in requested}
            if definitions != "any"
            else {}
        )
    frame = _typed_frame(rows, runs, take, query, types)
    _show_definitions(frame, keys, definitions, today, requested)
    if inexact is not None:
        taken = {c.casefold() for c in frame.columns}
        frame[INEXACT_COLUMN if INEXACT_COLUMN not in taken else "__" + INEXACT_COLUMN] = inexact
    return frame, total


def _request(
    conn: Any,
    names: Sequence[str],
    where: str | None,
    definitions: str,
    today: Callable[[str, Sequence[str]], dict[str, str]] | None,
) -> tuple[list[str], str | None]:
    """The names requested (repeats dropped) and the predicate (None when blank), checked."""
    if definitions not in DEFINITION_OPTIONS:
        raise QueryError(
            f"definitions must be one of {', '.join(DEFINITION_OPTIONS)}, not {definitions!r}."
        )
    if definitions == "current" and today is None:
        raise QueryError('definitions="current" needs today\'s script to compare with.')
    # A lone string is one name, not a sequence of one-letter names.
    requested = [names] if isinstance(names, str) else list(dict.fromkeys(names))
    requested = [storable_text(n) if isinstance(n, str) else n for n in requested]
    if where is not None and not where.strip():
        where = None
    if not requested:
        raise QueryError(
            "dataframe() needs at least one log name, e.g. dataframe(['loss', 'acc']); "
            f"the names logged in this store are: {_listing(logged_names(conn))}."
        )
    return requested, where


def _column_types(
    conn: Any,
    query: _WideQuery,
    rows: dict[str, tuple[Any, ...]],
    runs: dict[str, tuple[Any, ...]],
    take: np.ndarray,
) -> tuple[dict[str, tuple[Any, ...]], dict[str, set[str]]]:
    """The value types of each name's column, and the rows again with each cell's type
    where a column's types share a Python class."""
    types = _types_in(rows, runs, take, query.columns)
    mixed = [c.name for c in query.per_row if _dtype_for(types[c.name]) is None]
    if mixed:
        # Types that share a Python class (bool and int; json and str) need each
        # cell's type to be decoded: ask again for those.
        query.per_cell = mixed
        rows = query.rows()
    for name, kinds in types.items():
        if not kinds:  # no value in any row: take the types the store has
            types[name] = _store_types(conn, name)
    return rows, types


def _show_definitions(
    frame: pd.DataFrame,
    keys: dict[str, list[str | None]],
    definitions: str,
    today: Callable[[str, Sequence[str]], dict[str, str]] | None,
    requested: Sequence[str],
) -> None:
    """``definitions="column"``: a column of each value's definition key; "current": the
    values of other definitions than today's emptied."""
    if definitions == "column":
        for name, column in keys.items():
            frame[f"{name}:definition"] = pd.Series(column, dtype=object)
    elif definitions == "current":
        assert today is not None
        current: dict[str, dict[str, str]] = {}
        for script in set(frame["filename"]):
            current[script] = today(script, requested)
        for name, column in keys.items():
            wanted = np.array([current[f].get(name) for f in frame["filename"]], dtype=object)
            stale = np.array(
                [k is not None and k != w for k, w in zip(column, wanted, strict=True)], bool
            )
            if stale.any():
                frame.loc[stale, name] = None


class _WideQuery:
    """The statements of one dataframe() call, re-run as it learns about the names."""

    def __init__(
        self,
        conn: Any,
        columns: list[_Name],
        dims: _Dims,
        where: str | None,
        requested: list[str],
    ) -> None:
        self.conn = conn
        self.dialect = dialect_of(conn)
        self.columns = columns
        self.dims = dims
        self.where = where
        self.requested = requested
        self.per_cell: list[str] = []  # shown loop-level names whose cells carry their type
        self.only: tuple[str, ...] | None = None  # only these runs (dataframe(runs=...))
        self.window: tuple[int, int] | None = None  # offset, limit: one page of the rows

    @property
    def per_row(self) -> list[_Name]:
        """The shown names that travel per row: those logged inside loops."""
        return [c for c in self.columns if c.shown and c.in_loops]

    @property
    def per_run(self) -> list[_Name]:
        """The shown names that travel once per run: those logged outside loops only."""
        return [c for c in self.columns if c.shown and not c.in_loops]

    def rows(self) -> dict[str, tuple[Any, ...]]:
        """The rows of the view, as columns by name.

        A logged name the predicate uses without requesting it (sqlite reports
        "no such column") becomes a hidden column, and the query runs again.
        """
        found = _columns(*self._with_hidden(lambda: _rows_sql(
            self.columns, self.dims, self.where, self.per_cell, self.dialect,
            self.only, self.window)))  # fmt: skip
        names = [c.name for c in self.per_row]
        return _whole_values(found, names, len(self.dialect.parts))

    def run_ids(self) -> set[str]:
        """The runs that have a row of the view (which passes the predicate)."""
        predicate = "" if self.where is None else f" WHERE (\n{self.where}\n)"

        def sql() -> tuple[str, list[str]]:
            ctes = _ctes(self.columns, self.dims, self.dialect, self.only)
            return ctes + f"\nSELECT DISTINCT run_id FROM wide{predicate}", ["run_id"]

        _, found = self._with_hidden(sql)
        return {run_id for (run_id,) in found}

    def count(self) -> int:
        """The number of rows of the view (which pass the predicate), without a window;
        kept while the store is quiet, as each page of one view asks again."""
        predicate = "" if self.where is None else f" WHERE (\n{self.where}\n)"
        quiet = _quiet_store_key(self.conn)
        key = None if quiet is None else (*quiet, tuple(self.requested), self.where, self.only)
        kept = _kept(_KEPT_COUNTS, key)
        if kept is not None:
            return int(kept)

        def sql() -> tuple[str, list[str]]:
            ctes = _ctes(self.columns, self.dims, self.dialect, self.only)
            return ctes + f"\nSELECT count(*) FROM wide{predicate}", ["count"]

        _, ((found,),) = self._with_hidden(sql)
        _keep(_KEPT_COUNTS, key, int(found))
        return int(found)

    def _with_hidden(
        self, sql: Callable[[], tuple[str, list[str]]]
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """``sql()`` read (its text, and the keys of its columns); a logged name the
        predicate uses without requesting it becomes a hidden column, and it is read
        again."""
        while True:
            text, keys = sql()
            try:
                return keys, self._read(text)[1]
            except QueryError as exc:
                missing = self.dialect.missing_column(exc.__cause__)
                if (
                    self.where is None
                    or missing is None
                    or any(c.name == missing for c in self.columns)
                    or not name_logged(self.conn, missing)
                ):
                    raise
                hidden = _describe(self.conn, missing, shown=False, check_repeats=True, typed=True)
                self.columns.append(hidden)

    def runs(self) -> dict[str, tuple[Any, ...]]:
        """The runs that have rows: their run columns and run-level values, by name."""
        sql, keys = _runs_sql(self.columns, self.dialect, self.only)
        found = _columns(keys, self._read(sql)[1])
        names = [c.name for c in self.per_run]
        return _whole_values(found, names, len(self.dialect.parts))

    def _read(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Execute ``sql`` read-only; a failure is explained in terms of the predicate."""
        where = self.where
        said = f"{self.dialect.name} says"

        def usage() -> str:
            visible = _listing([*META_COLUMNS, *self.dims.names, *self.requested])
            return (
                f"It must be one SQL expression over the columns {visible}, or over any logged "
                f'name ({_listing(logged_names(self.conn))}), e.g. "lr > 0.005 AND epoch = 4".'
                + self.dialect.identifier_hint
            )

        def malformed(complaint: str) -> str:
            if where is None:
                # Without a predicate the SQL is ours alone: a failure is a bug or a damaged store.
                return f"The dataframe query failed: {said} {complaint!r}."
            return (
                f"The where-predicate {where!r} cannot be applied: {said} {complaint!r}. " + usage()
            )

        def writes(action: str, complaint: str) -> str:
            tries = f"tries to {action}" if action else "would change the store"
            return (
                f"dataframe() is read-only: the where-predicate {where!r} {tries} "
                f"({said} {complaint!r}). " + usage()
            )

        # Without a predicate the SQL is ours alone: any role may run it.
        return execute_read_any(
            self.conn, sql, subject=where, trusted=where is None, malformed=malformed, writes=writes
        )


def _columns(header: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    """Rows turned into columns, by name."""
    # One comprehension per column is about three times faster than zip(*rows).
    return {h: tuple([row[j] for row in rows]) for j, h in enumerate(header)}


def _ctes(
    columns: Sequence[_Name],
    dims: _Dims,
    dialect: Dialect,
    only: Sequence[str] | None = None,
) -> str:
    """The common table expressions of the view; ``wide`` is the view itself.

    ``wide`` holds each name's value as ``__retrolog_v{i}_{k}``, one column per part
    of ``dialect`` (i: the name's place in ``columns``), the type of a shown loop-level
    name's value as ``__retrolog_t{i}``, and the name itself as a column for the
    predicate (on PostgreSQL, only for names whose ``types`` are known).
    """
    at_run = [(i, c) for i, c in enumerate(columns) if c.at_run]
    shown_in_loops = [(i, c) for i, c in enumerate(columns) if c.in_loops and c.shown]
    hop = _hop_cte(shown_in_loops, dialect)
    looped = "looped AS (SELECT DISTINCT run_id FROM hop WHERE run_id IS NOT NULL)"
    run_values = _run_values_cte(at_run, dialect)
    chosen = _chosen_cte(at_run, dialect, only)
    wide = _wide_cte(columns, dims, dialect, shown_in_loops)
    return "WITH RECURSIVE\n" + ",\n".join([hop, looped, run_values, chosen, wide])


def _hop_cte(shown_in_loops: Sequence[tuple[int, _Name]], dialect: Dialect) -> str:
    """``hop``: for each shown loop-level name, the runs that logged it in a loop."""
    # A run's run-level records (ctx_id NULL) come first in the index and are skipped.
    seeds = "\n  UNION ALL ".join(
        f"SELECT {_literal(c.name)}, (SELECT min(run_id) FROM logs"
        f" WHERE name = {_literal(c.name)} AND ctx_id IS NOT NULL)"
        for _, c in shown_in_loops
    )
    return (
        "hop(name, run_id) AS (\n  "
        + (seeds or f"SELECT CAST(NULL AS text), CAST(NULL AS text) WHERE {dialect.false}")
        + "\n  UNION ALL\n  SELECT name, (SELECT min(run_id) FROM logs"
        " WHERE name = hop.name AND run_id > hop.run_id AND ctx_id IS NOT NULL)"
        "\n  FROM hop WHERE run_id IS NOT NULL\n)"
    )


def _run_values_cte(at_run: Sequence[tuple[int, _Name]], dialect: Dialect) -> str:
    """``run_values``: each run's newest run-level values of the names, one row per run,
    and whether it has a shown one."""
    parts = dialect.parts
    run_in = ", ".join(_literal(c.name) for _, c in at_run) or "NULL"
    run_shown = (
        " OR ".join(f"name = {_literal(c.name)}" for _, c in at_run if c.shown) or dialect.false
    )
    run_pivot = "".join(
        "".join(
            f",\n    max(CASE WHEN name = {_literal(c.name)} THEN {part} END) AS v{i}_{k}"
            for k, part in enumerate(parts)
        )
        + f",\n    max(CASE WHEN name = {_literal(c.name)} THEN value_type END) AS t{i}"
        for i, c in at_run
    )
    latest = dialect.latest_at_run(run_in)
    return (
        "run_values AS (\n"
        f"  SELECT run_id, {dialect.any_of(run_shown)} AS shown{run_pivot}\n"
        f"  FROM ({latest}) AS latest\n"
        "  GROUP BY run_id\n)"
    )


def _chosen_cte(
    at_run: Sequence[tuple[int, _Name]], dialect: Dialect, only: Sequence[str] | None
) -> str:
    """``chosen``: the runs that get rows, in start order, with their run-level values."""
    run_columns = "".join(
        "".join(f", r.v{i}_{k}" for k in range(len(dialect.parts))) + f", r.t{i}" for i, _ in at_run
    )
    return (
        "chosen AS MATERIALIZED (\n"
        f"  SELECT u.{dialect.run_key} AS run_key, u.run_id, u.projid, u.tstamp, u.filename,\n"
        "    row_number() OVER (ORDER BY u.started_at, u.run_id) AS run_order,\n"
        f"    {dialect.in_looped('u.run_id')} AS looped{run_columns}\n"
        "  FROM runs u LEFT JOIN run_values r ON r.run_id = u.run_id\n"
        f"  WHERE ({dialect.in_looped('u.run_id')} OR r.shown){_only(only)}\n)"
    )


def _wide_cte(
    columns: Sequence[_Name],
    dims: _Dims,
    dialect: Dialect,
    shown_in_loops: Sequence[tuple[int, _Name]],
) -> str:
    """``wide``: the chosen runs' loop contexts joined to their ancestors (the dimension
    columns) and to each name's value there; the contexts where no shown name has a
    value are left out."""
    levels = [(f"a{j}.name", f"a{j}.iteration") for j in range(dims.depth + 1)]
    select = [
        f"(h.run_key << {_CTX_BITS}) + COALESCE(a0.ctx_id + 1, 0) AS {_ROW_KEY}",
        "h.projid",
        "h.run_id",
        "h.tstamp",
        "h.filename",
    ]
    for dim in dims.names:
        cases = " ".join(f"WHEN {n} = {_literal(dim)} THEN {it}" for n, it in levels)
        select.append(f"CASE {cases} END AS {_ident(dim)}")
    joins = [_contexts_join(dims, shown_in_loops)]
    for i, c in enumerate(columns):
        if c.in_loops:
            joins.append(
                f"LEFT JOIN logs v{i} ON v{i}.name = {_literal(c.name)}"
                f" AND v{i}.run_id = a0.run_id AND v{i}.ctx_id = a0.ctx_id"
                + (_not_superseded(f"v{i}") if c.repeated else "")
            )
        select += _value_columns(i, c, dialect)
    joins += [
        f"LEFT JOIN loops a{j} ON a{j}.run_id = a0.run_id AND a{j}.ctx_id = a{j - 1}.parent_ctx"
        for j in range(1, dims.depth + 1)
    ]
    select += ["h.run_order AS __retrolog_run_order", "a0.ctx_id AS __retrolog_ctx_id"]
    has_value = "".join(f" OR v{i}.log_id IS NOT NULL" for i, _ in shown_in_loops)
    return (
        "wide AS (\n  SELECT\n    "
        + ",\n    ".join(select)
        + "\n  FROM chosen h\n  "
        + "\n  ".join(joins)
        + f"\n  WHERE NOT h.looped{has_value}\n)"
    )


def _contexts_join(dims: _Dims, shown_in_loops: Sequence[tuple[int, _Name]]) -> str:
    """The join of a chosen run (``h``) to its loop contexts (``a0``)."""
    join = "LEFT JOIN loops a0 ON h.looped AND a0.run_id = h.run_id"
    if dims.sparse:
        # Only the contexts where a shown loop-level name has a value make rows
        # (``has_value`` in ``wide``): join just those, so a name logged per epoch does not
        # walk every step of every run.
        valued = ", ".join(_literal(c.name) for _, c in shown_in_loops)
        join += (
            f" AND a0.ctx_id IN (SELECT ctx_id FROM logs WHERE name IN ({valued})"
            " AND run_id = h.run_id AND ctx_id IS NOT NULL)"
        )
    return join


def _value_columns(i: int, c: _Name, dialect: Dialect) -> list[str]:
    """The columns of ``wide`` for name ``c``, the ``i``-th: its value's parts, the name
    itself for the predicate, its value's type and its log id (as they apply to it)."""
    parts = dialect.parts
    # A name logged both in and outside loops in one run: the loop value wins in its row.
    if c.in_loops and c.at_run:
        values = [
            f"CASE WHEN v{i}.log_id IS NOT NULL THEN v{i}.{part} ELSE h.v{i}_{k} END"
            for k, part in enumerate(parts)
        ]
        vtype = f"CASE WHEN v{i}.log_id IS NOT NULL THEN v{i}.value_type ELSE h.t{i} END"
    elif c.in_loops:
        values = [f"v{i}.{part}" for part in parts]
        vtype = f"v{i}.value_type"
    else:
        values = [f"h.v{i}_{k}" for k in range(len(parts))]
        vtype = f"h.t{i}"
    select = [f"{value} AS {_value_column(i, k)}" for k, value in enumerate(values)]
    named = dialect.predicate_value(values, c.types)
    if named is not None:
        select.append(f"{named} AS {_ident(c.name)}")
    if c.shown and c.in_loops:
        select.append(f"{vtype} AS {_type_column(i)}")
    if c.in_loops and c.repeated:  # its rows of one context, in the order logged
        select.append(f"v{i}.log_id AS __retrolog_log{i}")
    return select


def _only(runs: Sequence[str] | None) -> str:
    """The condition keeping only ``runs`` (none: every run), as literals: run ids."""
    if runs is None:
        return ""
    return f" AND u.run_id IN ({', '.join(_literal(r) for r in runs) or 'NULL'})"


@contextlib.contextmanager
def _snapshot(conn: Any) -> Iterator[None]:
    """The view's statements read one snapshot of the store, planned with the settings
    of the reader's dialect (``Dialect.view_settings``)."""
    with read_snapshot(conn):
        for setting in dialect_of(conn).view_settings:
            conn.execute(setting)
        yield


def matching_run_ids(conn: Any, names: Sequence[str], where: str) -> set[str]:
    """The runs with at least one row of ``dataframe(conn, names, where)``, found without
    building the frame: the same view and predicate, asked only for its distinct runs
    (what ``--where`` chooses for replay, gc and the dashboard's table)."""
    requested = [storable_text(n) for n in dict.fromkeys(names)]
    if not requested:
        raise QueryError("Choosing runs by a predicate needs a logged name in it.")
    with _snapshot(conn):
        return _wide_query(conn, requested, where).run_ids()


def _wide_query(
    conn: Any, requested: list[Any], where: str | None, *, check: bool | None = None
) -> _WideQuery:
    """The view of ``requested`` (checked: logged, not loop names) filtered by ``where``:
    its columns, dimensions and the way its rows are found. Inside a read snapshot.
    check: whether names that repeat in a context are found first (default: with a
    predicate; see dataframe())."""
    if where is not None:
        _require_text(where)
    for name in requested:
        _require_logged(conn, name)
    dims = _dimensions(conn)
    _check_collisions(requested, dims.names)
    if check is None:
        check = where is not None  # see dataframe(): with a predicate, repeats are asked first
    columns = [
        _describe(conn, name, shown=True, check_repeats=check, typed=check) for name in requested
    ]
    dims = dataclasses.replace(dims, sparse=_sparse(conn, columns))
    if where is not None:
        columns += _quoted_names(conn, where, columns, dims)
    return _WideQuery(conn, columns, dims, where, requested)


def _rows_sql(
    columns: Sequence[_Name],
    dims: _Dims,
    where: str | None,
    per_cell: Sequence[str],
    dialect: Dialect,
    only: Sequence[str] | None = None,
    window: tuple[int, int] | None = None,
) -> tuple[str, list[str]]:
    """The rows of the view that pass ``where``, in order, as Python reads them, and the
    key Python gives each column read; ``window``: (offset, limit), those rows only.

    That is the row key, the dimensions (-1 for empty), the shown loop-level
    names (the parts of their values, see :func:`_whole_values`), and their types as
    bit masks; names logged outside loops only come from :func:`_runs_sql`.
    """
    outer = [_ROW_KEY]
    keys = [_ROW_KEY]
    for d in dims.names:
        outer.append(f"COALESCE({_ident(d)}, -1)")
        keys.append(d)
    masks: dict[int, list[str]] = {}
    shown = [(i, c) for i, c in enumerate(columns) if c.shown and c.in_loops]
    for slot, (i, c) in enumerate(shown):
        for k in range(len(dialect.parts)):
            outer.append(_value_column(i, k))
            keys.append(_part_key(c.name, k))
        if c.name in per_cell:
            outer.append(_type_column(i))
            keys.append(_type_key(c.name))
        group, place = divmod(slot, _NAMES_PER_MASK)
        bit = dialect.bigint(_type_bit(_type_column(i)))
        masks.setdefault(group, []).append(f"({bit} << {8 * place})")
    for g, bits in masks.items():
        outer.append(" | ".join(bits))
        keys.append(_mask_column(g))
    predicate = "" if where is None else f"WHERE (\n{where}\n)\n"
    nulls = dialect.nulls_first
    # A total order, so that pages neither repeat nor skip a row.
    order = [f"__retrolog_run_order, __retrolog_ctx_id{nulls}"] + [
        f"__retrolog_log{i}{nulls}" for i, c in enumerate(columns) if c.in_loops and c.repeated
    ]
    sql = (
        _ctes(columns, dims, dialect, only)
        + "\nSELECT "
        + ",\n  ".join(outer)
        + f"\nFROM wide\n{predicate}ORDER BY {', '.join(order)}"
    )
    if window is not None:
        offset, limit = window
        sql += f"\nLIMIT {int(limit)} OFFSET {int(offset)}"
    return sql, keys


def _runs_sql(
    columns: Sequence[_Name], dialect: Dialect, only: Sequence[str] | None = None
) -> tuple[str, list[str]]:
    """The runs of the view with their run columns and their run-only names and types,
    and the key Python gives each column read."""
    select = ["run_key", *META_COLUMNS]
    keys = list(select)
    for i, c in enumerate(columns):
        if c.shown and not c.in_loops:
            for k in range(len(dialect.parts)):
                select.append(f"v{i}_{k}")
                keys.append(_part_key(c.name, k))
            select.append(f"t{i}")
            keys.append(_type_key(c.name))
    # The rows' dimensions do not matter here: no self-join is written.
    sql = _ctes(columns, _Dims([], 0), dialect, only)
    sql += f"\nSELECT {', '.join(select)} FROM chosen"
    return sql, keys


def _whole_values(
    found: dict[str, tuple[Any, ...]], names: Iterable[str], parts: int
) -> dict[str, tuple[Any, ...]]:
    """``found`` with each of ``names``' values made whole from its parts (PostgreSQL
    keeps a value in one of three columns by its type, SQLite in one)."""
    for name in names:
        split = [found.pop(_part_key(name, k)) for k in range(parts)]
        if parts == 1:
            found[name] = split[0]
            continue
        real, whole, text = split
        found[name] = tuple(
            [
                f if f is not None else i if i is not None else t
                for f, i, t in zip(real, whole, text, strict=True)
            ]
        )
    return found


def _not_superseded(alias: str) -> str:
    """A join condition keeping only the record of ``alias`` whose value counts.

    That is the newest recorded record of its (run, ctx, name), else the newest
    backfilled one. It costs a second index search per row, so it is only used
    for names logged more than once in some context.
    """
    rank_b = "(b.origin = 'recorded')"
    rank_v = f"({alias}.origin = 'recorded')"
    return (
        f" AND NOT EXISTS (SELECT 1 FROM logs b WHERE b.name = {alias}.name"
        f" AND b.run_id = {alias}.run_id AND b.ctx_id = {alias}.ctx_id"
        f" AND b.log_id <> {alias}.log_id"
        f" AND ({rank_b} > {rank_v} OR ({rank_b} = {rank_v} AND b.log_id > {alias}.log_id)))"
    )


def _type_bit(vtype: str) -> str:
    """SQL for the bit of a value type (0 when the cell is empty)."""
    cases = " ".join(f"WHEN {_literal(t)} THEN {1 << b}" for b, t in enumerate(VALUE_TYPES))
    return f"(CASE {vtype} {cases} ELSE 0 END)"


def _sparse(conn: Any, columns: Sequence[_Name]) -> bool:
    """Whether the shown loop-level names have values in under half of the loop contexts.

    Then the view's rows are found from those values (an index lookup per value), else by
    walking every context in order (a scan, faster when most contexts have a value): on
    10,000 runs with 6 million loop rows, a per-epoch name took 9.9 s by the walk and 2.4 s
    from its values; a per-step name in most contexts, 42 s and 50 s.
    """
    shown = [c.name for c in columns if c.shown and c.in_loops]
    if not shown:
        return False
    marks = ", ".join("?" * len(shown))
    (values,) = conn.execute(  # a count over the index (name, run, context)
        f"SELECT COUNT(*) FROM logs WHERE name IN ({marks}) AND ctx_id IS NOT NULL", shown
    ).fetchone()
    (contexts,) = conn.execute(  # about the loop rows: a run's context ids count from 0
        "SELECT COALESCE(SUM((SELECT MAX(ctx_id) + 1 FROM loops l WHERE l.run_id = r.run_id)),"
        " 0) FROM runs r"
    ).fetchone()
    return bool(values * 2 < contexts)


# The loop names of stores in which nothing is recording or replaying, by database file
# and a stamp of its runs and replays: loop rows are only added by a run that records or a
# replay that runs, and finding the names is a scan of every loop row (1.2 s for 6 million),
# paid once per store instead of at every call of a notebook or the dashboard.
_KEPT_DIMS: dict[tuple[Any, ...], _Dims] = {}
_KEPT_DIMS_LOCK = threading.Lock()


def _dimensions(conn: Any) -> _Dims:
    """The store's loop names, outermost first then by first occurrence, and the max depth.

    A loop name outside the ancestry of every row of a view is left out of it
    afterwards (its column is all empty).
    """
    key = _quiet_store_key(conn)
    with _KEPT_DIMS_LOCK:
        kept = _KEPT_DIMS.get(key) if key is not None else None
    if kept is not None:
        return _Dims(list(kept.names), kept.depth)
    dims = _find_dimensions(conn)
    if key is not None:
        with _KEPT_DIMS_LOCK:
            if len(_KEPT_DIMS) >= 64:
                _KEPT_DIMS.clear()
            _KEPT_DIMS[key] = _Dims(list(dims.names), dims.depth)
    return dims


def _quiet_store_key(conn: Any) -> tuple[Any, ...] | None:
    """The database file and its runs' and replays' stamp, when no run is recording and no
    replay running (None otherwise, or for a database with no file, as PostgreSQL's)."""
    path = store_file(conn)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    runs, replays = activity_stamp(conn)
    if runs[1] or replays[1]:
        return None
    return (path, st.st_dev, st.st_ino, *runs, *replays)


def _find_dimensions(conn: Any) -> _Dims:
    # DISTINCT keeps the few pairs in a small b-tree, far cheaper than GROUP BY's sort.
    pairs = conn.execute("SELECT DISTINCT name, depth FROM loops").fetchall()
    names: list[str] = []
    for name, _ in sorted(pairs, key=lambda pair: pair[1]):  # stable: keeps first occurrence
        if name not in names:
            names.append(name)
    return _Dims(names, max((depth for _, depth in pairs), default=0))


def _describe(
    conn: Any, name: str, *, shown: bool, check_repeats: bool, typed: bool = False
) -> _Name:
    """Where ``name`` was logged: inside loops, outside them, or both.

    check_repeats: also find out whether it was logged twice in one context (a
        scan of its index entries); otherwise it is assumed not to be.
    typed: a predicate may name it: on PostgreSQL, find the value types it has
        (its column's SQL type follows them).
    """
    # These probes read only the logs_by_name index (ctx_id is in it). A name's
    # run-level records are few, so that probe hops from run to run rather than
    # reading every entry of the name.
    in_loops = conn.execute(
        "SELECT 1 FROM logs WHERE name = ? AND ctx_id IS NOT NULL LIMIT 1", (name,)
    ).fetchone()
    at_run = conn.execute(
        "WITH RECURSIVE r(run_id) AS ("
        " SELECT min(run_id) FROM logs WHERE name = ?"
        " UNION ALL"
        " SELECT (SELECT min(run_id) FROM logs WHERE name = ? AND run_id > r.run_id)"
        " FROM r WHERE run_id IS NOT NULL)"
        " SELECT 1 FROM r WHERE run_id IS NOT NULL AND EXISTS"
        " (SELECT 1 FROM logs WHERE name = ? AND run_id = r.run_id AND ctx_id IS NULL)"
        " LIMIT 1",
        (name, name, name),
    ).fetchone()
    repeated = check_repeats and in_loops is not None and _repeated(conn, name)
    typed = typed and dialect_of(conn).typed_predicates
    types = frozenset(_store_types(conn, name)) if typed else None
    return _Name(name, shown, in_loops is not None, at_run is not None, repeated, types)


def _repeated(conn: Any, name: str) -> bool:
    """Whether ``name`` was logged more than once in some (run, context); kept while the
    store is quiet (a scan of the name's records: 0.9 s for a million)."""
    quiet = _quiet_store_key(conn)
    key = None if quiet is None else (*quiet, name)
    kept = _kept(_KEPT_REPEATS, key)
    if kept is not None:
        return bool(kept)
    row = conn.execute(
        "SELECT 1 FROM logs WHERE name = ? GROUP BY run_id, ctx_id HAVING count(*) > 1 LIMIT 1",
        (name,),
    ).fetchone()
    _keep(_KEPT_REPEATS, key, row is not None)
    return row is not None


# Facts about a quiet store (no run recording, no replay running), by _quiet_store_key.
_KEPT_COUNTS: dict[tuple[Any, ...], Any] = {}
_KEPT_REPEATS: dict[tuple[Any, ...], Any] = {}


def _kept(kept: dict[tuple[Any, ...], Any], key: tuple[Any, ...] | None) -> Any:
    if key is None:
        return None
    with _KEPT_DIMS_LOCK:
        return kept.get(key)


def _keep(kept: dict[tuple[Any, ...], Any], key: tuple[Any, ...] | None, value: Any) -> None:
    if key is None:
        return
    with _KEPT_DIMS_LOCK:
        if len(kept) >= 256:
            kept.clear()
        kept[key] = value


def _has_repeats(row_keys: Sequence[int]) -> bool:
    """Whether two rows share a (run, context): a name had several records there."""
    keys = np.array(row_keys, dtype=np.int64)
    return bool(len(keys) > 1 and (keys[1:] == keys[:-1]).any())


def _require_text(where: str) -> None:
    """Refuse a predicate that holds code points UTF-8 cannot (a lone surrogate, as from
    a command line decoded with ``surrogateescape``): no store can read it."""
    try:
        where.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise QueryError(
            f"The where-predicate {where!r} holds {bad!r} (at character {exc.start}), which is "
            "not text a store can read. A name logged with such a character is kept with it "
            f"written as a backslash escape: write {storable_text(bad)} in its place.",
            sql=storable_text(where),
        ) from None


def _quoted_names(conn: Any, where: str, columns: Sequence[_Name], dims: _Dims) -> list[_Name]:
    """Hidden columns for the double-quoted logged names of ``where`` that are not columns.

    SQLite reads an unknown double-quoted name as a string literal, which would
    compare against text instead of failing, so such a name that is not logged
    either is refused here.
    """
    taken = {n.casefold() for n in (*META_COLUMNS, *dims.names)}
    taken.update(c.name.casefold() for c in columns)
    hidden = []
    for name in _quoted_identifiers(where):
        if name.casefold() in taken:
            continue
        if not name_logged(conn, name):
            visible = [*META_COLUMNS, *dims.names, *(c.name for c in columns)]
            raise QueryError(
                f'The where-predicate {where!r} uses "{name}", which is neither one of the '
                f"columns {_listing(visible)} nor a logged name "
                f"({_listing(logged_names(conn))}); SQL quotes strings with single quotes, "
                "e.g. filename = 'train.py'.",
                sql=where,
            )
        hidden.append(_describe(conn, name, shown=False, check_repeats=True, typed=True))
        taken.add(name.casefold())
    return hidden


def _run_positions(
    rows: dict[str, tuple[Any, ...]], runs: dict[str, tuple[Any, ...]]
) -> np.ndarray:
    """For each row, the position of its run in ``runs``."""
    run_keys = np.array(rows[_ROW_KEY], dtype=np.int64) >> _CTX_BITS
    return pd.Index(np.array(runs["run_key"], dtype=np.int64)).get_indexer(run_keys)


def _types_in(
    rows: dict[str, tuple[Any, ...]],
    runs: dict[str, tuple[Any, ...]],
    take: np.ndarray,
    columns: Sequence[_Name],
) -> dict[str, set[str]]:
    """The value types each shown name has in the result."""
    types: dict[str, set[str]] = {}
    for slot, c in enumerate(c for c in columns if c.shown and c.in_loops):
        group, place = divmod(slot, _NAMES_PER_MASK)
        masks = np.array(rows[_mask_column(group)], dtype=np.int64)
        bits = (int(np.bitwise_or.reduce(masks)) if len(masks) else 0) >> (8 * place)
        types[c.name] = {t for b, t in enumerate(VALUE_TYPES) if bits & (1 << b)}
    present = np.unique(take)
    for c in columns:
        if c.shown and not c.in_loops:
            run_types = runs[_type_key(c.name)]
            types[c.name] = {run_types[k] for k in present if run_types[k] is not None}
    return types


def _store_types(conn: Any, name: str) -> set[str]:
    """The value types ``name`` has anywhere in the store."""
    sql = "SELECT DISTINCT value_type FROM logs WHERE name = ?"
    return {row[0] for row in conn.execute(sql, (name,))}


def _dtype_for(types: set[str]) -> str | None:
    """The dtype of a column holding values of ``types``; None when cells need their own type."""
    present = types - {"none"}
    if not present or present <= {"str", "text"}:
        return "object"
    if present <= {"float", "int"}:
        return "float64" if "float" in present else "Int64"
    if present == {"bool"}:
        return "boolean"
    if present == {"json"}:
        return "json"
    return None


def _inexact_column(
    conn: Any, rows: dict[str, tuple[Any, ...]], requested: Sequence[str]
) -> pd.Series | None:
    """Per row, the requested names whose value there is marked inexact; None if none is.

    The marks are few (only replays whose deferred check failed, or that ran in
    another numerical environment, leave them) and a partial index holds just
    them, so asking costs nothing when there are none.
    """
    marks = ", ".join(_literal(name) for name in requested)
    found = conn.execute(
        f"SELECT l.name, u.{dialect_of(conn).run_key}, l.ctx_id FROM logs l"
        f" JOIN runs u ON u.run_id = l.run_id WHERE l.inexact IS NOT NULL AND l.name IN ({marks})"
    ).fetchall()
    if not found:
        return None
    keys = np.array(rows[_ROW_KEY], dtype=np.int64)
    labels = np.full(len(keys), None, dtype=object)
    for name in requested:
        cells = [
            (run << _CTX_BITS) + ctx + 1 for n, run, ctx in found if n == name and ctx is not None
        ]
        whole_runs = [run for n, run, ctx in found if n == name and ctx is None]
        hit = np.isin(keys, cells) | np.isin(keys >> _CTX_BITS, whole_runs)
        for index in np.flatnonzero(hit):
            labels[index] = name if labels[index] is None else f"{labels[index]},{name}"
    if all(label is None for label in labels):
        return None
    return pd.Series(labels, dtype=object)


def _cell_keys(conn: Any, rows: dict[str, tuple[Any, ...]], name: str) -> list[str | None]:
    """Per row, the definition key of the value of ``name`` shown there (None: no value)."""
    from retrolog._query.lineage import recorded_definitions

    keys = np.array(rows[_ROW_KEY], dtype=np.int64)
    run_keys = sorted({int(k) for k in keys >> _CTX_BITS})
    if not run_keys:
        return []
    marks = ", ".join(str(k) for k in run_keys)
    run_key = dialect_of(conn).run_key
    run_ids = dict(conn.execute(f"SELECT {run_key}, run_id FROM runs WHERE {run_key} IN ({marks})"))
    recorded = {
        key: recorded_definitions(conn, run_id).get(name) for key, run_id in run_ids.items()
    }
    cell: dict[int, str | None] = {}  # row key -> key of the value there
    whole_run: dict[int, str | None] = {}  # run key -> key of its run-level value
    recorded_at: set[int] = set()
    found = conn.execute(
        f"SELECT u.{run_key}, l.ctx_id, l.origin, l.lineage FROM logs l JOIN runs u"
        f" ON u.run_id = l.run_id WHERE l.name = ? AND u.{run_key} IN ({marks})"
        " ORDER BY l.log_id",
        (name,),
    )
    # As the view chooses: the newest recorded value of a place, else the newest backfilled.
    for run_key, ctx, origin, lineage in found:
        key = recorded.get(run_key) if origin == "recorded" else lineage
        place, at = (
            (whole_run, run_key) if ctx is None else (cell, (run_key << _CTX_BITS) + ctx + 1)
        )
        if origin == "recorded" or at not in recorded_at:
            place[at] = key
        if origin == "recorded":
            recorded_at.add(at)
    result: list[str | None] = []
    for row_key in keys.tolist():
        key = cell.get(row_key)
        result.append(key if key is not None else whole_run.get(row_key >> _CTX_BITS))
    return result


def _typed_frame(
    rows: dict[str, tuple[Any, ...]],
    runs: dict[str, tuple[Any, ...]],
    take: np.ndarray,
    query: _WideQuery,
    types: dict[str, set[str]],
) -> pd.DataFrame:
    """The view as a DataFrame with each column's dtype; per-run columns spread over rows."""
    data: dict[str, Any] = {}
    for meta in META_COLUMNS:
        data[meta] = pd.Series(_objects(runs[meta])[take], dtype=object)
    for dim in query.dims.names:
        iterations = np.array(rows[dim], dtype=np.int64)
        empty = iterations < 0
        if not empty.all():  # the loop is in the ancestry of some row
            data[dim] = pd.arrays.IntegerArray(iterations, empty)
    per_run = {c.name for c in query.per_run}
    for name in query.requested:
        if name in per_run:
            column = _typed(runs[name], runs[_type_key(name)], types[name])
            data[name] = column.take(take).reset_index(drop=True)
        else:
            cell_types = rows.get(_type_key(name))
            data[name] = _typed(rows[name], cell_types, types[name])
    return pd.DataFrame(data)


def _typed(
    values: Sequence[Any], cell_types: Sequence[str | None] | None, types: set[str]
) -> pd.Series:
    """One name's values as a Series of the dtype its ``types`` call for."""
    kind = _dtype_for(types)
    if kind is None:
        if cell_types is None:
            raise AssertionError("a mixed-type column was read without its cell types")
        return pd.Series(_objects(map(_decode, values, cell_types)), dtype=object)
    if kind == "float64":
        return pd.Series(np.array(values, dtype=np.float64), copy=False)
    if kind in ("Int64", "boolean"):
        return pd.Series(pd.array(values, dtype=kind))
    if kind == "json":
        decoded = (None if v is None else json.loads(v) for v in values)
        return pd.Series(_objects(decoded), dtype=object)
    return pd.Series(_objects(values), dtype=object)


def _decode(value: Any, value_type: str | None) -> Any:
    """One cell of a mixed-type column, as the Python value that was logged."""
    if value_type == "float":
        return math.nan if value is None else float(value)
    if value_type == "bool":
        return None if value is None else bool(value)
    if value_type == "json":
        return None if value is None else json.loads(value)
    return value


def _objects(values: Iterable[Any]) -> np.ndarray:
    """An object array holding ``values`` as elements (lists stay lists, strs stay str)."""
    return np.fromiter(values, dtype=object)


def _mask_column(group: int) -> str:
    return f"__retrolog_types_{group}"


def _value_column(index: int, part: int) -> str:
    """The view's column holding part ``part`` of the values of ``columns[index]``."""
    return f"__retrolog_v{index}_{part}"


def _type_column(index: int) -> str:
    """The view's column holding the value type of ``columns[index]``."""
    return f"__retrolog_t{index}"


def _part_key(name: str, part: int) -> str:
    return f"__retrolog_part{part}_of_{name}"


def _type_key(name: str) -> str:
    return f"__retrolog_type_of_{name}"


def _require_logged(conn: Any, name: str) -> None:
    """Raise UnknownNameError, with the closest logged names, unless ``name`` was logged."""
    if name_logged(conn, name):
        return
    known = logged_names(conn)
    if not known:
        raise UnknownNameError(
            f"No run logged {name!r}: this store holds no logged values yet. Record a run "
            "with rl.log(...) calls first.",
            name=name,
        )
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise UnknownNameError(
        f"No run logged {name!r}; the names logged in this store are: {_listing(known)}.{hint}",
        name=name,
    )


def _quoted_identifiers(where: str) -> list[str]:
    """The double-quoted identifiers in ``where``."""
    found = (m.group(1) for m in _DOUBLE_QUOTED.finditer(where))
    return [name.replace('""', '"') for name in found if name is not None]


def _check_collisions(requested: Sequence[str], dims: Sequence[str]) -> None:
    """Refuse a name that would share its column name with another column.

    SQL compares column names without regard to case, so 'Loss' and 'loss' collide too.
    """
    taken = {c.casefold(): c for c in (*META_COLUMNS, *dims)}
    for name in requested:
        other = taken.get(name.casefold())
        if other is not None:
            raise QueryError(
                f"The log name {name!r} would share its column with {other!r} (a run column, "
                "a loop name or another requested name; SQL ignores case), so dataframe() "
                "cannot show both; read it with query(), e.g. "
                f"SELECT run_id, ctx_id, value FROM logs WHERE name = {_literal(name)}.",
            )
        taken[name.casefold()] = name


def _listing(names: Sequence[str], limit: int = 30) -> str:
    if len(names) <= limit:
        return ", ".join(names) if names else "(none)"
    return ", ".join(names[:limit]) + f", ... ({len(names) - limit} more)"


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'
