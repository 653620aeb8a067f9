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
    """The summaries of the (name, run) pairs ``where`` picks, from their values."""
    is_number = f"l.value_type IN {NUMERIC_TYPES!r} AND {number} IS NOT NULL"
    # The dataframe's rule for the record that counts in a (run, ctx, name): the newest
    # recorded one, else the newest backfilled one.
    newer = (
        " AND NOT EXISTS (SELECT 1 FROM logs b WHERE b.name = l.name AND b.run_id = l.run_id"
        " AND b.ctx_id = l.ctx_id AND b.log_id <> l.log_id"
        " AND ((b.origin = 'recorded') > (l.origin = 'recorded')"
        " OR ((b.origin = 'recorded') = (l.origin = 'recorded') AND b.log_id > l.log_id)))"
    )
    return (
        f"INSERT INTO run_summaries({', '.join(COLUMNS)})"
        f" SELECT l.name, l.run_id, COUNT(*), COUNT(CASE WHEN {is_number} THEN 1 END),"
        f" SUM(CASE WHEN {is_number} THEN CAST({number} AS DOUBLE PRECISION) END),"
        f" MIN(CASE WHEN {is_number} THEN CAST({number} AS DOUBLE PRECISION) END),"
        f" MAX(CASE WHEN {is_number} THEN CAST({number} AS DOUBLE PRECISION) END),"
        f" MIN(l.ctx_id), MAX(l.ctx_id) FROM logs l WHERE {where}{newer}"
        " GROUP BY l.name, l.run_id"
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
    """One name's values in one batch, summarized; ``ordered`` while each comes in a
    later context than the one before (what a run's writer sees for a name logged at one
    loop level), the condition for adding them to a stored row without a scan."""

    n_values: int
    n_numbers: int
    total: float | None
    smallest: float | None
    largest: float | None
    first_ctx: int | None
    last_ctx: int | None
    ordered: bool

    @classmethod
    def of(cls, contexts: list[Any], numbers: list[float]) -> _Part:
        """contexts: of every value in order; numbers: the values that are numbers."""
        if None in contexts:
            # A run-level value: in order only as the first, before any in a loop.
            ordered = contexts.index(None) == 0 and None not in contexts[1:]
            later = contexts[1:] if ordered else []
        else:
            ordered, later = True, contexts
        ordered = ordered and all(map(operator.lt, later, later[1:]))
        return cls(
            len(contexts), len(numbers), math.fsum(numbers) if numbers else None,
            min(numbers, default=None), max(numbers, default=None), contexts[0], contexts[-1],
            ordered,
        )  # fmt: skip


def _numbers(values: list[Any], types: list[str] | None) -> list[float]:
    """The values that are numbers (bool, int, float; not a NaN), as floats."""
    if types is None:  # RecordBatch.values: a float, int or str (None: a NaN float)
        return [float(v) for v in values if (type(v) is float and v == v) or type(v) is int]
    return [
        float(v)
        for v, kind in zip(values, types, strict=True)
        if kind in NUMERIC_TYPES and v is not None and not (type(v) is float and v != v)
    ]


def add_batch(
    cursor: Any,
    run_id: str,
    values: Iterable[Sequence[Any]],
    logs: Iterable[Sequence[Any]],
    *,
    mark: str,
    number: str,
) -> None:
    """Add a recording batch's values to the run's summaries, in the batch's transaction
    (after its values are inserted).

    values: (ctx_id, name, value) with a float, int or str (RecordBatch.values);
    logs: (ctx_id, name, stored value, value_type) (RecordBatch.logs). A name whose values
    all come after the stored row's last context is added arithmetically; any other (a
    context given twice, a run-level value after others) is summarized from its values
    (:func:`recompute`).
    """
    parts = _batch_parts(values, logs)
    if not parts:
        return
    rows, again = _added_rows(cursor, run_id, parts, mark)
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
    cursor: Any, run_id: str, parts: dict[str, _Part], mark: str
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
        elif row[8] is None or part.first_ctx is None or part.first_ctx <= row[8]:
            again.append(name)
        else:
            _, _, n_values, n_numbers, total, smallest, largest, first_ctx, _ = row
            rows.append(
                (name, run_id, n_values + part.n_values, n_numbers + part.n_numbers,
                 _plus(total, part.total),
                 _least(smallest, part.smallest), _greatest(largest, part.largest),
                 first_ctx, part.last_ctx)
            )  # fmt: skip
    return rows, again


def _plus(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _greatest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _marked(sql: str, mark: str) -> str:
    return sql if mark == "?" else sql.replace("?", mark)
