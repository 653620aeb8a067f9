"""Reuse: a value computed once is copied, not recomputed, where it is provably the same.

After LIMA (lineage-keyed reuse of intermediates): work whose inputs have the
same lineage is done once. For a replay the inputs of a backfilled value are
the statement's definition, the run's code, arguments, numerical environment
and the state it restores. Two runs agree on all of that when

- their configuration is the same: code version tree, script, working
  directory, command line, ``rl.arg`` and parsed arguments, numerical
  environment, package and Python versions (:func:`fingerprint`); and
- what they did is the same, bit for bit: the same loop iterations, every
  recorded value equal, and equal checkpoint contents wherever both kept one
  (content addressing makes equal states equal keys) (:func:`same_history`).

Then the script computed the same thing twice (a configuration launched again,
a sweep driver's retry), so today's statement gives the same values in both:
one run is replayed (or its values are already there, by the same
definition), and the others get a copy, recorded as reused
(``logs.reused_from``). Where any of it differs (another seed, another
late-epoch setting) nothing can show that the values agree, and the run is
replayed.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from retrolog.errors import RetrologError
from retrolog.store.sqlite_connection import rollback
from retrolog.store.summaries import SQLITE_NUMBER, recompute

# Run columns that decide what a run computes. Host and timing do not; the CPU
# model does, and is in numerics.
_CONFIGURATION = ("code_tree", "filename", "cwd", "argv", "args", "parsed_args", "python")


def fingerprint(row: Mapping[str, Any]) -> str | None:
    """A digest of what decides a run's computation; None when it is not comparable."""
    if row.get("status") != "finished" or not row.get("code_tree"):
        return None
    parts = {key: row.get(key) for key in _CONFIGURATION}
    numerics = json.loads(row.get("numerics") or "null")
    if numerics is None:
        return None  # recorded before the environment was kept: nothing to compare
    parts["numerics"] = numerics
    packages = json.loads(row.get("packages") or "{}")
    parts["packages"] = {k: v for k, v in packages.items() if k != "retrolog"}
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def same_history(
    conn: sqlite3.Connection, a: str, b: str, read: Callable[[str], bytes] | None = None
) -> bool:
    """Whether two runs iterated the same loops, recorded equal values and equal states.

    read: gives a manifest's bytes from the object store. States are compared by
    the named objects (and the frame's locals), not the global RNGs: Python's and
    numpy's global generators start from OS entropy in every process, so two runs
    of a script that never seeds or uses them differ there and nowhere else; a
    script that does use them unseeded records different values and fails the
    comparison above.
    """
    loops = "SELECT ctx_id, parent_ctx, name, iteration, depth FROM loops WHERE run_id = ?"
    if _rows(conn, loops + " ORDER BY ctx_id", a) != _rows(conn, loops + " ORDER BY ctx_id", b):
        return False
    values = (
        "SELECT ctx_id, name, value, value_type FROM logs WHERE run_id = ? AND origin ="
        " 'recorded' ORDER BY ctx_id IS NULL, ctx_id, name, log_id"
    )
    if _rows(conn, values, a) != _rows(conn, values, b):
        return False
    kept = "SELECT kind, ctx_id, manifest, frame_locals FROM checkpoints WHERE run_id = ?"
    ours = {(k, c): (m, f) for k, c, m, f in _rows(conn, kept, a)}
    theirs = {(k, c): (m, f) for k, c, m, f in _rows(conn, kept, b)}
    for key, (manifest, frame) in ours.items():
        if key not in theirs:
            continue
        other, other_frame = theirs[key]
        if frame != other_frame and not _same_locals(frame, other_frame):
            return False
        if manifest != other and _objects(manifest, read) != _objects(other, read):
            return False
    return True


def _same_locals(a: bytes | None, b: bytes | None) -> bool:
    """Whether two checkpoints carry equal frame locals (their bytes may differ: a tensor
    pickles with where its storage happened to be)."""
    from retrolog.runtime import frames

    try:
        ours = (frames.load(a), frames.load_attrs(a))
        theirs = (frames.load(b), frames.load_attrs(b))
    except Exception:  # unreadable: equal to nothing
        return False
    return _equal(ours, theirs)


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equality, also for tensors and arrays inside containers."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if hasattr(a, "detach") and hasattr(a, "cpu"):  # a torch tensor
        a, b = a.detach().cpu().numpy(), b.detach().cpu().numpy()
    if hasattr(a, "tobytes") and hasattr(a, "dtype"):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    try:
        return bool(a == b)
    except Exception:
        return False


def _objects(manifest: str, read: Callable[[str], bytes] | None) -> Any:
    """The named objects of a checkpoint manifest (None when it cannot be read)."""
    if read is None:
        return None
    try:
        return json.loads(read(manifest)).get("objects")
    except (RetrologError, ValueError, AttributeError):
        return object()  # unreadable: equal to nothing


def _rows(conn: sqlite3.Connection, sql: str, run_id: str) -> list[tuple[Any, ...]]:
    return conn.execute(sql, (run_id,)).fetchall()


def find_sources(
    conn: sqlite3.Connection,
    todo: Sequence[str],
    rows: Mapping[str, Mapping[str, Any]],
    names: Sequence[str],
    keys: Mapping[str, Mapping[str, str]],
    read: Callable[[str], bytes] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Which runs to copy instead of replaying.

    keys: per run, the definition key of each name in what a replay computes there.
    Returns (ready, after): ``ready`` maps a run to one whose values of every name,
    by the same definitions, are in the store already; ``after`` maps a run to
    another run of this replay whose values it copies once that one is replayed.
    """
    ready: dict[str, str] = {}
    after: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for run_id in todo:
        print_ = fingerprint(rows[run_id])
        if print_ is not None and keys.get(run_id):
            groups.setdefault(print_, []).append(run_id)
    if not groups:
        return ready, after
    for print_, members in groups.items():
        done = _already_computed(conn, print_, members, names, keys[members[0]])
        leader: str | None = None
        for run_id in members:
            if keys[run_id] != keys[members[0]]:
                continue
            if done is not None and same_history(conn, done, run_id, read):
                ready[run_id] = done
            elif leader is None:
                leader = run_id
            elif same_history(conn, leader, run_id, read):
                after[run_id] = leader
    return ready, after


def _already_computed(
    conn: sqlite3.Connection,
    print_: str,
    members: Sequence[str],
    names: Sequence[str],
    keys: Mapping[str, str],
) -> str | None:
    """A run outside this replay with the same configuration that has every name by
    the same definition, exactly (nothing marked inexact)."""
    marks = ", ".join("?" for _ in names)
    candidates = conn.execute(
        f"SELECT run_id FROM logs WHERE origin = 'backfilled' AND name IN ({marks})"
        " GROUP BY run_id HAVING COUNT(DISTINCT name) = ? AND MAX(inexact IS NOT NULL) = 0",
        (*names, len(set(names))),
    ).fetchall()
    for (run_id,) in candidates:
        if run_id in members:
            continue
        row = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        columns = [c[0] for c in row.description]
        found = row.fetchone()
        if found is None or fingerprint(dict(zip(columns, found, strict=True))) != print_:
            continue
        stored = dict(
            conn.execute(
                f"SELECT name, MIN(lineage) FROM logs WHERE run_id = ? AND origin = 'backfilled'"
                f" AND name IN ({marks}) GROUP BY name HAVING COUNT(DISTINCT lineage) = 1",
                (run_id, *names),
            ).fetchall()
        )
        if all(stored.get(name) == keys.get(name) for name in names):
            return str(run_id)
    return None


def copy_values(
    conn: sqlite3.Connection,
    *,
    source: str,
    target: str,
    names: Sequence[str],
    replay_id: str,
    replace: bool,
) -> int:
    """Copy ``source``'s backfilled values of ``names`` to ``target`` (the same contexts:
    identical runs number their loop iterations identically); returns rows added."""
    marks = ", ".join("?" for _ in names)
    before = conn.total_changes
    conn.execute("BEGIN IMMEDIATE")
    try:
        if replace:
            conn.execute(
                "DELETE FROM logs WHERE run_id = ? AND origin = 'backfilled'"
                f" AND name IN ({marks})",
                (target, *names),
            )
        deleted = conn.total_changes - before
        conn.execute(
            "INSERT INTO logs(run_id, ctx_id, name, value, value_type, origin, replay_id,"
            " code_object, checkpoint, inexact, lineage, reused_from)"
            " SELECT ?, s.ctx_id, s.name, s.value, s.value_type, 'backfilled', ?, s.code_object,"
            " s.checkpoint, s.inexact, s.lineage, ? FROM logs s"
            f" WHERE s.run_id = ? AND s.origin = 'backfilled' AND s.name IN ({marks})"
            " AND NOT EXISTS (SELECT 1 FROM logs t WHERE t.run_id = ? AND t.name = s.name"
            " AND t.ctx_id IS s.ctx_id)",
            (target, replay_id, source, source, *names, target),
        )
        inserted = conn.total_changes - before - deleted  # values, not summary rows
        recompute(conn, target, names, mark="?", number=SQLITE_NUMBER)
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return inserted
