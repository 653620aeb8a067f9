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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from retrolog.store.sqlite_connection import rollback
from retrolog.store.summaries import SQLITE_NUMBER, recompute


@dataclass(frozen=True)
class Mismatch:
    """A recorded value that replay recomputed differently."""

    name: str
    count: int  # contexts where the values differ
    compared: int  # contexts compared
    example: str  # the first difference, readable


@dataclass(frozen=True)
class Check:
    """The deferred check of one run: what differed, out of how many recomputed values."""

    mismatches: list[Mismatch]
    compared: int  # recorded values that were recomputed and compared
    # Every difference came after a restored checkpoint (False when one came before
    # any restore, or there is none): points at state the checkpoint does not hold.
    first_after_restore: bool = False


def backfill(
    conn: sqlite3.Connection,
    *,
    run_id: str,
    replay_id: str,
    code_object: str | None,
    rows: Iterable[Sequence[Any]],
    names: Sequence[str],
    force: bool,
    inexact: str | None = None,
    lineage: Mapping[str, str] | None = None,
) -> int:
    """Insert replayed values of ``names``; returns how many rows were added.

    rows: (ctx_id, name, value, value_type, checkpoint) as workers write them;
        for a (ctx, name) given several times the last one counts.
    inexact: the mark every inserted value carries (``logs.inexact``): "mismatch"
        when the run's deferred check failed, "environment" when the numerical
        environment was not the recorded one; None when neither.
    lineage: the definition key of each name (``logs.lineage``).
    force: replace the backfilled values of ``names`` the run already has (an
        earlier definition, or a recomputation asked for).
    """
    keys = lineage or {}
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
            " code_object, checkpoint, inexact, lineage)"
            " SELECT ?1, ?2, ?3, ?4, ?5, 'backfilled', ?6, ?7, ?8, ?9, ?10"
            " WHERE NOT EXISTS (SELECT 1 FROM logs WHERE name = ?3 AND run_id = ?1"
            " AND ctx_id IS ?2)",
            [
                (
                    run_id,
                    ctx,
                    name,
                    value,
                    kind,
                    replay_id,
                    code_object,
                    checkpoint,
                    inexact,
                    keys.get(name),
                )
                for ctx, name, value, kind, checkpoint in latest.values()
            ],
        )
        inserted = conn.total_changes - before - deleted  # values, not summary rows
        recompute(conn, run_id, names, mark="?", number=SQLITE_NUMBER)
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return inserted


def already_stored(
    conn: sqlite3.Connection,
    *,
    run_id: str,
    replay_id: str,
    rows: Iterable[Sequence[Any]],
    names: Sequence[str],
) -> dict[str, int]:
    """Of the values of ``names`` this replay computed, those another replay had stored
    first (kept, this replay's not inserted): that replay's id -> how many.

    Two replays of one run at once (two clones, two machines) both compute every value;
    only one of them stores each, and each says which.
    """
    wanted = set(names)
    computed = {(row[0], row[1]) for row in rows if row[1] in wanted}
    if not computed:
        return {}
    marks = ", ".join("?" for _ in wanted)
    found: dict[str, int] = {}
    for ctx, name, other in conn.execute(
        "SELECT ctx_id, name, replay_id FROM logs WHERE run_id = ? AND origin = 'backfilled'"
        f" AND replay_id IS NOT ? AND name IN ({marks})",
        (run_id, replay_id, *sorted(wanted)),
    ):
        if (ctx, name) in computed:
            found[str(other)] = found.get(str(other), 0) + 1
    return found


def check_recorded(conn: sqlite3.Connection, run_id: str, rows: Iterable[Sequence[Any]]) -> Check:
    """Compare recomputed values with the recorded ones of the same contexts (deferred check).

    rows: as for :func:`backfill`; the checkpoint restored before each value tells
    whether a difference came after a restore.
    """
    replayed: dict[tuple[Any, str], tuple[Any, str]] = {}
    restored_before: dict[tuple[Any, str], bool] = {}
    for ctx, name, value, kind, *rest in rows:
        replayed[(ctx, name)] = (value, kind)
        restored_before[(ctx, name)] = bool(rest and rest[0])
    if not replayed:
        return Check([], 0)
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
    after_restore = True
    for key, (value, kind) in replayed.items():
        if key not in recorded:
            continue
        ctx, name = key
        tally = counts.setdefault(name, [0, 0])
        tally[1] += 1
        old_value, old_kind = recorded[key]
        if not _same(old_value, old_kind, value, kind):
            tally[0] += 1
            after_restore = after_restore and restored_before[key]
            examples.setdefault(name, f"context {ctx}: recorded {old_value!r}, replayed {value!r}")
    mismatches = [
        Mismatch(name, bad, compared, examples[name])
        for name, (bad, compared) in sorted(counts.items())
        if bad
    ]
    total = sum(compared for _, compared in counts.values())
    return Check(mismatches, total, bool(mismatches) and after_restore)


def _same(a: Any, a_kind: str, b: Any, b_kind: str) -> bool:
    if a_kind != b_kind:
        return False
    if a_kind == "float" and _nan(a) and _nan(b):  # SQLite keeps NaN as NULL
        return True
    return bool(a == b)


def _nan(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
