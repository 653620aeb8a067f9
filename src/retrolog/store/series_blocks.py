"""A columnar copy of each run's recorded series: ``series_blocks``.

A chart reads a run's whole series of one name; as rows, that is one Python tuple per
value (about 1.3 µs each in Python's sqlite3), which puts a cold chart of 300 runs x
5,000 steps above a second of CPU. The store therefore also keeps each (run, name)'s
recorded values in loop contexts as blocks of raw arrays, read with
``numpy.frombuffer``: a block is the run's recorded rows of the name with ``log_id``
in (the previous block's ``last_log_id``, its own ``last_log_id``], in ``log_id``
order, every one of them (text and JSON values too, marked as not numbers).

The rows stay the source of truth. Only recorded rows go into blocks, and a recorded
row is never changed or deleted (replays delete and add backfilled rows only), so a
block never goes stale; a reader takes the blocks, then the rows after the last
block's ``last_log_id`` (a live run's tail) and the backfilled rows before it (through
the partial index ``logs_not_recorded``), and applies the dataframe's rule for the
record that counts (``_query/series.py``, ``read_columns``). A (run, name) without
blocks is read from its rows alone: blocks are an optional copy, so a store without
them (opened read-only before migration 12, a replay's working copy) reads the same,
only slower.

Writers: the record sinks (store/records.py, store/postgres_metadata.py) add a block
once a name has :data:`BLOCK` rows no block holds, and the rest in the batch that ends
the run, from the values they wrote (:class:`BlockTracker`); migration 12
(:func:`fill`) and a run copied into PostgreSQL (:func:`fill_run`) build them from the
rows as stored (:func:`extend`). Each in the transaction of the rows it copies.

The SQL is standard, run on SQLite or PostgreSQL through a DB-API cursor with the
backend's placeholder (``mark``) and value columns (``parts``: SQLite's ``value``,
PostgreSQL's ``value_float``, ``value_int``, ``value_text``).
"""

from __future__ import annotations

import itertools
import sqlite3
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

# numpy is imported by the functions that handle arrays: the record sinks and the
# replay's coordinator import this module, and neither should pay for numpy unless used.
if TYPE_CHECKING:
    import numpy as np


BLOCK = 4096
"""Values per full block: big enough that a block's row and its read cost little per
value, small enough that a live run's unblocked tail stays short."""

NUMERIC_TYPES = ("float", "int", "bool")

CREATE_TABLE = """
CREATE TABLE series_blocks (
    run_id       {text} NOT NULL,
    name         {text} NOT NULL,
    block        {integer} NOT NULL,
    last_log_id  {integer} NOT NULL,
    n            {integer} NOT NULL,
    ctx          {blob} NOT NULL,
    y            {blob} NOT NULL,
    is_number    {blob} NOT NULL,
    PRIMARY KEY (run_id, name, block)
);
CREATE INDEX logs_not_recorded ON logs(name, run_id, ctx_id) WHERE origin <> 'recorded'
"""
# ctx: the rows' contexts, packed (pack_contexts); y: float64 little-endian, NaN for a
# logged NaN and for a value that is not a number; is_number: empty when every row's
# value is a number, else one byte per row (1: a number).


def pack_contexts(ctx: np.ndarray) -> bytes:
    """A block's contexts as stored: the differences from one to the next (1 for a loop's
    consecutive iterations) as int64, zlib-compressed: a tenth of a byte per value
    instead of eight."""
    import numpy as np

    return zlib.compress(np.diff(ctx, prepend=0).astype("<i8").tobytes(), 1)


def unpack_contexts(data: bytes, n: int) -> np.ndarray:
    """What :func:`pack_contexts` made of ``n`` contexts. Inflating stops at their
    length (a damaged or hostile blob cannot make it allocate more); a blob of another
    length raises ValueError, one that does not inflate zlib.error."""
    import numpy as np

    inflater = zlib.decompressobj()
    raw = inflater.decompress(bytes(data), 8 * n)
    return np.cumsum(np.frombuffer(raw, dtype="<i8", count=n))


def create_table(*, postgres: bool) -> str:
    """Migration 12's statements for the table and the index, in the backend's types."""
    if postgres:
        return CREATE_TABLE.format(text="text", integer="bigint", blob="bytea")
    return CREATE_TABLE.format(text="TEXT", integer="INTEGER", blob="BLOB")


def _marked(sql: str, mark: str) -> str:
    return sql if mark == "?" else sql.replace("?", mark)


def _whole(row: Sequence[Any]) -> Any:
    return next((part for part in row if part is not None), None)


def extend(
    cursor: Any, run_id: str, name: str, *, mark: str, parts: Sequence[str], final: bool
) -> int:
    """Add blocks of ``run_id``'s recorded rows of ``name`` that no block holds yet, in
    the caller's transaction: full blocks of :data:`BLOCK` rows, and with ``final`` (the
    run has ended) the rest too. Returns how many rows went into blocks."""
    import numpy as np

    last, block = cursor.execute(
        _marked(
            "SELECT MAX(last_log_id), MAX(block) FROM series_blocks WHERE run_id = ? AND name = ?",
            mark,
        ),
        (run_id, name),
    ).fetchone()
    rows = cursor.execute(
        _marked(
            f"SELECT log_id, ctx_id, value_type, {', '.join(parts)} FROM logs"
            " WHERE name = ? AND run_id = ? AND ctx_id IS NOT NULL AND origin = 'recorded'"
            " AND log_id > ? ORDER BY log_id",
            mark,
        ),
        (name, run_id, -1 if last is None else last),
    ).fetchall()
    usable = len(rows) if final else len(rows) - len(rows) % BLOCK
    if usable == 0:
        return len(rows)
    log_ids, contexts, kinds, *values = zip(*rows[:usable], strict=True)
    whole = values[0] if len(values) == 1 else tuple(_whole(v) for v in zip(*values, strict=True))
    number = np.fromiter((k in NUMERIC_TYPES for k in kinds), dtype=bool, count=usable)
    if number.all():
        y = np.array(whole, dtype=np.float64)  # None (a logged NaN) becomes NaN
    else:
        y = np.array([v if ok else None for v, ok in zip(whole, number, strict=True)],
                     dtype=np.float64)  # fmt: skip
    ctx = np.array(contexts, dtype="<i8")
    y = y.astype("<f8", copy=False)
    found = []
    next_block = 0 if block is None else block + 1
    for start in range(0, usable, BLOCK):
        stop = min(start + BLOCK, usable)
        flags = number[start:stop]
        found.append(
            (run_id, name, next_block, int(log_ids[stop - 1]), stop - start,
             pack_contexts(ctx[start:stop]), y[start:stop].tobytes(),
             b"" if flags.all() else flags.astype(np.uint8).tobytes())
        )  # fmt: skip
        next_block += 1
    cursor.executemany(
        _marked(
            "INSERT INTO series_blocks(run_id, name, block, last_log_id, n, ctx, y, is_number)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            mark,
        ),
        found,
    )
    return len(rows) - usable


def fill(cursor: Any, *, mark: str, parts: Sequence[str]) -> None:
    """Blocks of every (run, name) a store holds values of in loop contexts (migration
    12): a run that has ended gets all of its rows in blocks, a running one its full
    blocks (its writer adds the rest)."""
    pairs = cursor.execute(
        "SELECT s.run_id, s.name, r.status FROM run_summaries s"
        " JOIN runs r ON r.run_id = s.run_id WHERE s.last_ctx IS NOT NULL"
        " ORDER BY s.run_id, s.name"
    ).fetchall()
    for run_id, name, status in pairs:
        extend(cursor, run_id, name, mark=mark, parts=parts, final=status != "running")


def fill_run(cursor: Any, run_id: str, *, mark: str, parts: Sequence[str], final: bool) -> None:
    """:func:`extend` for every name ``run_id`` has values of in loop contexts (its
    summaries list them), in the caller's transaction."""
    names = cursor.execute(
        _marked(
            "SELECT name FROM run_summaries WHERE run_id = ? AND last_ctx IS NOT NULL"
            " ORDER BY name",
            mark,
        ),
        (run_id,),
    ).fetchall()
    for (name,) in names:
        extend(cursor, run_id, name, mark=mark, parts=parts, final=final)


def read(conn: Any, run_id: str, name: str) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """``run_id``'s blocks of ``name``, joined: (the last block's ``last_log_id``, contexts,
    values, whether each is a number); -1 and empty arrays when it has none. ``conn``:
    a SQLite connection or a MetadataStore's reader (``?`` placeholders)."""
    import numpy as np

    none = -1, np.zeros(0, np.int64), np.zeros(0, np.float64), np.zeros(0, bool)
    try:
        found = conn.execute(
            "SELECT last_log_id, n, ctx, y, is_number FROM series_blocks"
            " WHERE run_id = ? AND name = ? ORDER BY block",
            (run_id, name),
        ).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return none  # a store opened read-only before its migration 12: rows alone
        raise
    if not found:
        return none
    # Sizes from the blobs themselves: a damaged or hostile n allocates nothing.
    if any(int(n) < 0 or len(y) != 8 * int(n) or len(flags) not in (0, int(n))
           for _, n, _, y, flags in found):  # fmt: skip
        return none
    total = sum(int(row[1]) for row in found)
    ctx = np.empty(total, dtype=np.int64)
    y = np.empty(total, dtype=np.float64)
    number = np.ones(total, dtype=bool)
    at = 0
    try:
        for _, n, ctx_bytes, y_bytes, flags in found:
            n = int(n)
            # Each blob is checked against n (frombuffer's count, inflating up to n
            # values): a damaged one is never read past.
            ctx[at : at + n] = unpack_contexts(ctx_bytes, n)
            y[at : at + n] = np.frombuffer(y_bytes, dtype="<f8", count=n)
            if len(flags):
                number[at : at + n] = np.frombuffer(flags, dtype=np.uint8, count=n) != 0
            at += n
    except (ValueError, zlib.error):
        return none  # a damaged block: the rows alone, which hold the same values
    return int(found[-1][0]), ctx, y, number


class BlockTracker:
    """A record sink's rows of each (run, name) that no block holds yet, kept in memory
    as the sink writes them, so that a block is made from the values the sink has
    rather than read back (a Python object per value again).

    A (run, name) the tracker has not seen, or one whose batch was not written (the
    sink calls :meth:`forget`), is read back from the store once (:func:`extend`'s
    query), so a restarted writer or a batch written twice never puts a row in a block
    twice or leaves one out. A block written from memory ends at the greatest
    ``log_id`` of the store at its batch's end: every row of the batch is at or below
    it, and every later row of the run above it.
    """

    def __init__(self, mark: str, parts: Sequence[str]) -> None:
        self.mark = mark
        self.parts = tuple(parts)
        # run -> name -> the contexts and values of its rows after its last block, in
        # log_id order: float, int or None (a number; None a NaN), or str (not a number)
        self._pending: dict[str, dict[str, tuple[list[Any], list[Any]]]] = {}

    def after_batch(
        self,
        cursor: Any,
        run_id: str,
        values: Iterable[Sequence[Any]],
        logs: Iterable[Sequence[Any]],
        run_updates: Iterable[dict[str, Any]],
    ) -> None:
        """In the batch's transaction, after its rows: a block of each name with at least
        :data:`BLOCK` rows pending; with the update that ends the run, of every name's
        pending rows."""
        pending = self._pending.setdefault(run_id, {})
        unseen: set[str] = set()
        # The fast path's numbers as they are; the slow path's values, a non-number as "".
        rows = itertools.chain(
            values, ((c, n, v if k in NUMERIC_TYPES else "") for c, n, v, k in logs)
        )
        for ctx, name, value in rows:
            if ctx is None:
                continue
            found = pending.get(name)
            if found is None:
                unseen.add(name)
            else:
                found[0].append(ctx)
                found[1].append(value)
        for name in sorted(unseen):
            # Read back once: what the store holds after the name's last block (this
            # batch's rows included).
            pending[name] = _after_blocks(cursor, run_id, name, self.mark, self.parts)
        ended = any("ended_at" in update for update in run_updates)
        if ended:
            names = cursor.execute(
                _marked(
                    "SELECT name FROM run_summaries WHERE run_id = ? AND last_ctx IS NOT NULL",
                    self.mark,
                ),
                (run_id,),
            ).fetchall()
            for name in sorted({row[0] for row in names} - set(pending)):
                extend(cursor, run_id, name, mark=self.mark, parts=self.parts, final=True)
        full = [name for name, rows in pending.items() if ended or len(rows[0]) >= BLOCK]
        if full:
            (last,) = cursor.execute("SELECT MAX(log_id) FROM logs").fetchone()
            for name in sorted(full):
                contexts, found_values = pending[name]
                if contexts:
                    _write(cursor, run_id, name, int(last), contexts, found_values, self.mark)
                pending[name] = ([], [])
        if ended:
            del self._pending[run_id]

    def forget(self, run_id: str) -> None:
        """Drop what is pending of ``run_id``: its batch was not written (or may not
        have been); the next batch reads the store again."""
        self._pending.pop(run_id, None)


def _after_blocks(
    cursor: Any, run_id: str, name: str, mark: str, parts: Sequence[str]
) -> tuple[list[Any], list[Any]]:
    """The contexts and values of ``run_id``'s recorded rows of ``name`` after its last
    block, in log_id order, as :class:`BlockTracker` keeps them."""
    (last,) = cursor.execute(
        _marked("SELECT MAX(last_log_id) FROM series_blocks WHERE run_id = ? AND name = ?", mark),
        (run_id, name),
    ).fetchone()
    rows = cursor.execute(
        _marked(
            f"SELECT ctx_id, value_type, {', '.join(parts)} FROM logs"
            " WHERE name = ? AND run_id = ? AND ctx_id IS NOT NULL AND origin = 'recorded'"
            " AND log_id > ? ORDER BY log_id",
            mark,
        ),
        (name, run_id, -1 if last is None else last),
    ).fetchall()
    contexts = [row[0] for row in rows]
    found = [_whole(row[2:]) if row[1] in NUMERIC_TYPES else "" for row in rows]
    return contexts, found


def _write(
    cursor: Any,
    run_id: str,
    name: str,
    last: int,
    contexts: list[Any],
    values: list[Any],
    mark: str,
) -> None:
    """One block of ``values`` (numbers, None for a NaN, str for a value that is not a
    number) at ``contexts``, after the (run, name)'s other blocks."""
    import numpy as np

    n = len(values)
    text = [type(v) is str for v in values]
    if any(text):
        number = ~np.array(text, dtype=bool)
        y = np.array([None if t else v for v, t in zip(values, text, strict=True)], dtype="<f8")
        flags = number.astype(np.uint8).tobytes()
    else:
        y = np.array(values, dtype="<f8")  # None (a logged NaN) becomes NaN
        flags = b""
    (block,) = cursor.execute(
        _marked("SELECT MAX(block) FROM series_blocks WHERE run_id = ? AND name = ?", mark),
        (run_id, name),
    ).fetchone()
    cursor.execute(
        _marked(
            "INSERT INTO series_blocks(run_id, name, block, last_log_id, n, ctx, y, is_number)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            mark,
        ),
        (run_id, name, 0 if block is None else block + 1, last, n,
         pack_contexts(np.array(contexts, dtype=np.int64)), y.tobytes(), flags),
    )  # fmt: skip
