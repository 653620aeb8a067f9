"""Per-run summaries of logged values: ``run_summaries``, one row per (name, run).

The runs table sorts and shows aggregates (``loss:min``, ``acc:last``) of every run
at once; reading every value of a thousand runs per request is seconds, one row per
run is milliseconds. Every writer of ``logs`` keeps the rows current in the same
transaction as the values it writes: the record sinks (store/records.py,
store/postgres.py) with :func:`add_batch`, the replay's backfill and reuse and
PostgreSQL's write-back and transfer with :func:`recompute`.

What a row holds, over the values that count (as the dataframe counts them: per loop
context the newest recorded record, else the newest backfilled one; every run-level
record):

``n_values``   how many values (any type)
``n_numbers``  how many numbers (float, int, bool; a NaN is not one)
``total``      their sum, ``smallest``, ``largest`` (floats on both backends)
``first_ctx``  the smallest loop context holding the name; NULL when only run-level
``last_ctx``   the greatest loop context holding the name; NULL when only run-level

"Last" is the value at ``last_ctx``: contexts are numbered in the order they start,
so for a name logged at one loop level it is the latest one; with none in a loop,
the run-level value. "First" mirrors it at ``first_ctx``. The values themselves stay
in ``logs`` (any type): a reader looks them up by their context.

The SQL is standard, run on SQLite or PostgreSQL through a DB-API cursor with the
backend's placeholder (``mark``) and its expression for a value as a number
(``number``: SQLite's ``value``, PostgreSQL's ``COALESCE(value_float, value_int)``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NUMERIC_TYPES = ("float", "int", "bool")
SQLITE_NUMBER = "l.value"
POSTGRES_NUMBER = "COALESCE(l.value_float, l.value_int)"

COLUMNS = (
    "name", "run_id", "n_values", "n_numbers", "total", "smallest", "largest", "first_ctx",
    "last_ctx",
)  # fmt: skip

# The table and its rows for the values a store holds (both backends' migration 11).
CREATE_TABLE = """
CREATE TABLE run_summaries (
    name      {text} NOT NULL,
    run_id    {text} NOT NULL,
    n_values  {integer} NOT NULL,
    n_numbers {integer} NOT NULL,
    total     {real},
    smallest  {real},
    largest   {real},
    first_ctx {integer},
    last_ctx  {integer},
    PRIMARY KEY (name, run_id)
){rowid}
"""


def _scan(number: str, where: str) -> str:
    """The summaries of the (name, run) pairs ``where`` picks (over ``logs l``), from
    their values.

    The record that counts in a (run, ctx, name) is the dataframe's: the newest recorded
    one, else the newest backfilled one; every run-level record counts. It is found per
    context with one grouping (``kept``), not a lookup per record: a name logged many
    times in one context (every batch inside one epoch) has as many records there.
    """
    is_number = f"p.value_type IN {NUMERIC_TYPES!r} AND p.num IS NOT NULL"
    return (
        f"WITH picked AS (SELECT l.log_id, l.name, l.run_id, l.ctx_id, l.origin,"
        f" l.value_type, {number} AS num FROM logs l WHERE {where}),"
        " kept AS (SELECT COALESCE(MAX(CASE WHEN origin = 'recorded' THEN log_id END),"
        " MAX(log_id)) AS log_id FROM picked WHERE ctx_id IS NOT NULL"
        " GROUP BY name, run_id, ctx_id)"
        f" INSERT INTO run_summaries({', '.join(COLUMNS)})"
        f" SELECT p.name, p.run_id, COUNT(*), COUNT(CASE WHEN {is_number} THEN 1 END),"
        f" SUM(CASE WHEN {is_number} THEN CAST(p.num AS DOUBLE PRECISION) END),"
        f" MIN(CASE WHEN {is_number} THEN CAST(p.num AS DOUBLE PRECISION) END),"
        f" MAX(CASE WHEN {is_number} THEN CAST(p.num AS DOUBLE PRECISION) END),"
        " MIN(p.ctx_id), MAX(p.ctx_id) FROM picked p"
        " WHERE p.ctx_id IS NULL OR p.log_id IN (SELECT log_id FROM kept)"
        " GROUP BY p.name, p.run_id"
    )


def migration(*, postgres: bool) -> str:
    """Migration 11's statements: the table, and the summaries of every stored value."""
    if postgres:
        table = CREATE_TABLE.format(text="text", integer="bigint", real="double precision",
                                    rowid="")  # fmt: skip
        number = POSTGRES_NUMBER
    else:
        table = CREATE_TABLE.format(text="TEXT", integer="INTEGER", real="REAL",
                                    rowid=" WITHOUT ROWID")  # fmt: skip
        number = SQLITE_NUMBER
    return table + ";\n" + _scan(number, "1 = 1")


def recompute(
    cursor: Any, run_id: str, names: Iterable[str] | None, *, mark: str, number: str
) -> None:
    """Summarize ``run_id``'s values of ``names`` (None: of every name) again from its
    values, in the caller's transaction: after values were deleted, or added where the
    run had some in the same contexts."""
    if names is None:
        cursor.execute(_marked("DELETE FROM run_summaries WHERE run_id = ?", mark), (run_id,))
        cursor.execute(_marked(_scan(number, "l.run_id = ?"), mark), (run_id,))
        return
    chosen = sorted(set(names))
    if not chosen:
        return
    marks = ", ".join("?" for _ in chosen)
    cursor.execute(
        _marked(f"DELETE FROM run_summaries WHERE run_id = ? AND name IN ({marks})", mark),
        (run_id, *chosen),
    )
    cursor.execute(
        _marked(_scan(number, f"l.run_id = ? AND l.name IN ({marks})"), mark), (run_id, *chosen)
    )


@dataclass
class _Part:
    """One name's values in one batch, summarized as they count (the last value of each
    context, every run-level one); ``ordered`` while the contexts never go back (what a
    run's writer sees for a name logged at one loop level, once or many times per
    context), the condition for adding them to a stored row without a scan. ``last``
    is the value that counts at ``last_ctx``: the float of a number, else None."""

    n_values: int
    n_numbers: int
    total: float | None
    smallest: float | None
    largest: float | None
    first_ctx: int | None
    last_ctx: int | None
    ordered: bool
    last: float | None = None

    @classmethod
    def of(cls, contexts: list[Any], numbers: list[float | None]) -> _Part:
        """contexts: of every value in order; numbers: each value's float when it is a
        number, else None."""
        if None in contexts:
            # A run-level value: in order only as the first, before any in a loop.
            ordered = contexts.index(None) == 0 and None not in contexts[1:]
            start = 1 if ordered else 0
        else:
            ordered, start = True, 0
        later = contexts[start:]
        ordered = ordered and all(map(operator.le, later, later[1:]))
        if ordered:
            # Of a context's values, the last counts; run-level ones all count.
            counted = [
                n for i, n in enumerate(numbers) if i < start or i + 1 == len(contexts)
                or contexts[i + 1] != contexts[i]
            ]  # fmt: skip
            n_values = len(counted)
        else:
            counted, n_values = numbers, len(contexts)
        found = [n for n in counted if n is not None]
        return cls(
            n_values, len(found), math.fsum(found) if found else None,
            min(found, default=None), max(found, default=None), contexts[0], contexts[-1],
            ordered, numbers[-1],
        )  # fmt: skip


def _numbers(values: list[Any], types: list[str] | None) -> list[float | None]:
    """Each value's float when it is a number (bool, int, float; not a NaN), else None."""
    if types is None:  # RecordBatch.values: a float, int or str (None: a NaN float)
        return [
            float(v) if (type(v) is float and v == v) or type(v) is int else None for v in values
        ]
    return [
        float(v)
        if kind in NUMERIC_TYPES and v is not None and not (type(v) is float and v != v)
        else None
        for v, kind in zip(values, types, strict=True)
    ]


class LastCounted:
    """A record sink's memory of the value that counts at each (run, name)'s last
    context, as its last batch left it: the next batch often logs in that context again
    (a name logged at every batch inside one epoch), and its value then replaces that
    one in the summary. Without it (a restarted sink, a batch rolled back) the name is
    summarized from its values once (:func:`recompute`)."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, tuple[int | None, float | None]]] = {}

    def get(self, run_id: str, name: str) -> tuple[int | None, float | None] | None:
        return self._last.get(run_id, {}).get(name)

    def set(self, run_id: str, name: str, ctx: int | None, value: float | None) -> None:
        self._last.setdefault(run_id, {})[name] = (ctx, value)

    def discard(self, run_id: str, name: str) -> None:
        self._last.get(run_id, {}).pop(name, None)

    def forget(self, run_id: str) -> None:
        """``run_id``'s batch was not written (or may not have been)."""
        self._last.pop(run_id, None)


def add_batch(
    cursor: Any,
    run_id: str,
    values: Iterable[Sequence[Any]],
    logs: Iterable[Sequence[Any]],
    *,
    mark: str,
    number: str,
    last: LastCounted | None = None,
) -> None:
    """Add a recording batch's values to the run's summaries, in the batch's transaction
    (after its values are inserted).

    values: (ctx_id, name, value) with a float, int or str (RecordBatch.values);
    logs: (ctx_id, name, stored value, value_type) (RecordBatch.logs). A name whose values
    all come after the stored row's last context is added arithmetically, and so is one
    whose first context is that last one when ``last`` knows the value counted there;
    any other (contexts out of order, a run-level value after others) is summarized from
    its values (:func:`recompute`).
    """
    parts = _batch_parts(values, logs)
    if not parts:
        return
    rows, again = _added_rows(cursor, run_id, parts, mark, last)
    if last is not None:
        for name, part in parts.items():
            if part.ordered and part.last_ctx is not None:
                last.set(run_id, name, part.last_ctx, part.last)
            else:
                last.discard(run_id, name)
    if rows:
        assignments = ", ".join(f"{c} = excluded.{c}" for c in COLUMNS[2:])
        cursor.executemany(
            _marked(
                f"INSERT INTO run_summaries({', '.join(COLUMNS)})"
                f" VALUES ({', '.join('?' for _ in COLUMNS)})"
                f" ON CONFLICT (name, run_id) DO UPDATE SET {assignments}",
                mark,
            ),
            rows,
        )
    if again:
        recompute(cursor, run_id, again, mark=mark, number=number)


def _batch_parts(
    values: Iterable[Sequence[Any]], logs: Iterable[Sequence[Any]]
) -> dict[str, _Part]:
    """The batch's summary of each name it holds."""
    # Per name: its values' contexts, values and (for RecordBatch.logs) stored types.
    grouped: dict[str, tuple[list[Any], list[Any], list[Any], list[str]]] = {}
    for ctx, name, value in values:
        found = grouped.get(name)
        if found is None:
            found = grouped[name] = ([], [], [], [])
        found[0].append(ctx)
        found[1].append(value)
    for ctx, name, value, kind in logs:
        found = grouped.get(name)
        if found is None:
            found = grouped[name] = ([], [], [], [])
        found[0].append(ctx)
        found[2].append(value)
        found[3].append(kind)
    parts: dict[str, _Part] = {}
    for name, (contexts, plain, typed, kinds) in grouped.items():
        if plain and typed:  # one name in both lists: their order in the batch is unknown
            parts[name] = _Part(0, 0, None, None, None, None, None, ordered=False)
            continue
        numbers = _numbers(plain, None) if plain else _numbers(typed, kinds)
        parts[name] = _Part.of(contexts, numbers)
    return parts


def _added_rows(
    cursor: Any, run_id: str, parts: dict[str, _Part], mark: str, last: LastCounted | None
) -> tuple[list[tuple[Any, ...]], list[str]]:
    """The summary rows the batch's parts make with the stored rows, and the names whose
    values do not follow the stored ones (summarized again from their values)."""
    names = sorted(parts)
    marks = ", ".join("?" for _ in names)
    stored = {
        row[0]: row
        for row in cursor.execute(
            _marked(
                f"SELECT {', '.join(COLUMNS)} FROM run_summaries"
                f" WHERE run_id = ? AND name IN ({marks})",
                mark,
            ),
            (run_id, *names),
        ).fetchall()
    }
    rows: list[tuple[Any, ...]] = []
    again: list[str] = []
    for name in names:
        part, row = parts[name], stored.get(name)
        if not part.ordered:
            again.append(name)
        elif row is None:
            rows.append(
                (name, run_id, part.n_values, part.n_numbers, part.total, part.smallest,
                 part.largest, part.first_ctx, part.last_ctx)
            )  # fmt: skip
        elif row[8] is None or part.first_ctx is None or part.first_ctx < row[8]:
            again.append(name)
        elif part.first_ctx == row[8]:
            known = last.get(run_id, name) if last is not None else None
            reopened = None
            if known is not None and known[0] == row[8]:
                reopened = _reopened(row, part, known[1])
            if reopened is None:
                again.append(name)
            else:
                rows.append(reopened)
        else:
            _, _, n_values, n_numbers, total, smallest, largest, first_ctx, _ = row
            rows.append(
                (name, run_id, n_values + part.n_values, n_numbers + part.n_numbers,
                 _plus(total, part.total),
                 _least(smallest, part.smallest), _greatest(largest, part.largest),
                 first_ctx, part.last_ctx)
            )  # fmt: skip
    return rows, again


def _reopened(row: Sequence[Any], part: _Part, old: float | None) -> tuple[Any, ...] | None:
    """The stored ``row`` with ``part`` added, where the part's first context is the row's
    last one, whose counted value ``old`` (a number's float, else None) the part's value
    there replaces; None when the smallest or largest without ``old`` is not known."""
    name, run_id, n_values, n_numbers, total, smallest, largest, first_ctx, _ = row
    if old is not None:
        n_numbers -= 1
        if n_numbers == 0:  # old was the only number
            total = smallest = largest = None
        else:
            total = math.fsum([total, -old])
            if old == smallest:
                # The rest are all >= old: only a part's value at or below it is known
                # to be the smallest.
                if part.smallest is None or part.smallest > old:
                    return None
                smallest = None
            if old == largest:
                if part.largest is None or part.largest < old:
                    return None
                largest = None
    return (
        name, run_id, n_values - 1 + part.n_values, n_numbers + part.n_numbers,
        _plus(total, part.total), _least(smallest, part.smallest),
        _greatest(largest, part.largest), first_ctx, part.last_ctx,
    )  # fmt: skip


def _plus(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _greatest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _marked(sql: str, mark: str) -> str:
    return sql if mark == "?" else sql.replace("?", mark)
