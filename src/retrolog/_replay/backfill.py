"""Writing replayed values back to the store, and checking recomputed recorded ones.

Backfilled rows are ``logs`` rows with ``origin = 'backfilled'``, the replay
id, the git object of the propagated code that produced them and the
checkpoint last restored before them. Writing is idempotent: a value that
already exists for (run, context, name) is kept, so replaying twice adds
nothing; ``force`` deletes the earlier backfilled values of those names first.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mismatch:
    """A recorded value that replay recomputed differently."""

    name: str
    count: int  # contexts where the values differ
    compared: int  # contexts compared
    example: str  # the first difference, readable


def backfill(
    conn: sqlite3.Connection,
    *,
    run_id: str,
    replay_id: str,
    code_object: str | None,
    rows: Iterable[Sequence[Any]],
    names: Sequence[str],
    force: bool,
) -> int:
    """Insert replayed values of ``names``; returns how many rows were added.

    rows: (ctx_id, name, value, value_type, checkpoint) as workers write them;
        for a (ctx, name) given several times the last one counts.
    """
    latest: dict[tuple[Any, str], Sequence[Any]] = {}
    wanted = set(names)
    for row in rows:
        if row[1] in wanted:
            latest[(row[0], row[1])] = row
    before = conn.total_changes
    conn.execute("BEGIN IMMEDIATE")
    try:
        if force:
            conn.executemany(
                "DELETE FROM logs WHERE run_id = ? AND name = ? AND origin = 'backfilled'",
                [(run_id, name) for name in names],
            )
        deleted = conn.total_changes - before
        conn.executemany(
            "INSERT INTO logs(run_id, ctx_id, name, value, value_type, origin, replay_id,"
            " code_object, checkpoint)"
            " SELECT ?1, ?2, ?3, ?4, ?5, 'backfilled', ?6, ?7, ?8"
            " WHERE NOT EXISTS (SELECT 1 FROM logs WHERE name = ?3 AND run_id = ?1"
            " AND ctx_id IS ?2)",
            [
                (run_id, ctx, name, value, kind, replay_id, code_object, checkpoint)
                for ctx, name, value, kind, checkpoint in latest.values()
            ],
        )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return conn.total_changes - before - deleted


def check_recorded(
    conn: sqlite3.Connection, run_id: str, rows: Iterable[Sequence[Any]]
) -> list[Mismatch]:
    """Compare recomputed values with the recorded ones of the same contexts (deferred check)."""
    replayed: dict[tuple[Any, str], tuple[Any, str]] = {}
    for ctx, name, value, kind, *_ in rows:
        replayed[(ctx, name)] = (value, kind)
    if not replayed:
        return []
    names = sorted({name for _, name in replayed})
    recorded: dict[tuple[Any, str], tuple[Any, str]] = {}
    marks = ", ".join("?" for _ in names)
    for ctx, name, value, kind in conn.execute(
        f"SELECT ctx_id, name, value, value_type FROM logs WHERE run_id = ?"
        f" AND origin = 'recorded' AND name IN ({marks}) ORDER BY log_id",
        (run_id, *names),
    ):
        recorded[(ctx, name)] = (value, kind)
    counts: dict[str, list[int]] = {}
    examples: dict[str, str] = {}
    for key, (value, kind) in replayed.items():
        if key not in recorded:
            continue
        ctx, name = key
        tally = counts.setdefault(name, [0, 0])
        tally[1] += 1
        old_value, old_kind = recorded[key]
        if not _same(old_value, old_kind, value, kind):
            tally[0] += 1
            examples.setdefault(name, f"context {ctx}: recorded {old_value!r}, replayed {value!r}")
    return [
        Mismatch(name, bad, compared, examples[name])
        for name, (bad, compared) in sorted(counts.items())
        if bad
    ]


def _same(a: Any, a_kind: str, b: Any, b_kind: str) -> bool:
    if a_kind != b_kind:
        return False
    if a_kind == "float" and _nan(a) and _nan(b):  # SQLite keeps NaN as NULL
        return True
    return bool(a == b)


def _nan(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
