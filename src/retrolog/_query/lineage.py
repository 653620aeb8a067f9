"""Which definition produced each value in the store, and how a value came to be.

A definition (``versions/definitions.py``) is what the statement logging a name
computes: the statement plus the project functions and constants it reaches.
The store keeps each definition once, in ``definitions`` (key, name, text,
dependencies, why it is coarse, first seen), and links values to them:

- a recorded value: through ``run_definitions`` (run, name -> key), computed
  from the run's code version the first time anything asks (a replay, ``show``,
  ``lineage``, the dataframe's definition option) and kept;
- a backfilled value: ``logs.lineage``, the key of the statement the replay
  inserted (today's, with today's helpers).

The view ``value_lineage`` joins both: every value with its key.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from retrolog._query.runs import resolve_run
from retrolog.errors import UnknownNameError
from retrolog.store import reads
from retrolog.store.metastore import dialect_of
from retrolog.store.sqlite_connection import rollback
from retrolog.versions.definitions import Definition, Reader, definitions
from retrolog.versions.notebook import read_script


@dataclass(frozen=True)
class StoredDefinition:
    """A definition as the store keeps it."""

    key: str
    name: str
    text: str
    dependencies: tuple[str, ...]
    coarse: str | None


def working_tree_reader(root: Path, script: str) -> Reader:
    """Project modules as the working tree has them, relative to the script's directory."""
    base = (root / script).parent

    def read(relpath: str) -> str | None:
        for folder in (base, root):
            path = folder / relpath
            try:
                return path.read_text()
            except (OSError, UnicodeDecodeError):
                continue
        return None

    return read


def version_reader(git_dir: Path, commit: str, script: str) -> Reader:
    """Project modules as a run's code version has them."""
    from retrolog.errors import VersionError
    from retrolog.versions.git import read_file

    base = PurePosixPath(script).parent

    def read(relpath: str) -> str | None:
        for folder in (base, PurePosixPath(".")):
            try:
                return read_file(git_dir, commit, str(folder / relpath)).decode()
            except (VersionError, UnicodeDecodeError):
                continue
        return None

    return read


def today_keys(root: Path) -> Callable[[str, Sequence[str]], dict[str, str]]:
    """For dataframe(definitions="current"): the keys of the statements a script has today.

    A name today's script does not log (or that cannot be read) has no key there.
    """

    def keys(filename: str, names: Sequence[str]) -> dict[str, str]:
        try:
            source = read_script(root / filename)
            found = definitions(source, filename=filename, read=working_tree_reader(root, filename))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            return {}
        return {name: found[name].key for name in names if name in found}

    return keys


def keep(
    conn: sqlite3.Connection,
    found: Iterable[Definition],
    *,
    run_id: str | None = None,
    replay_id: str | None = None,
) -> None:
    """Store definitions not stored yet (the first run or replay that used each)."""
    conn.executemany(
        "INSERT OR IGNORE INTO definitions(lineage, name, text, dependencies, coarse,"
        " first_seen, first_run, first_replay) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        _definition_rows(found, run_id, replay_id),
    )


def _definition_rows(
    found: Iterable[Definition], run_id: str | None, replay_id: str | None
) -> list[tuple[Any, ...]]:
    """Rows of the definitions table, in its column order."""
    now = time.time()
    return [
        (d.key, d.name, d.text, json.dumps(list(d.dependencies)), d.coarse, now, run_id, replay_id)
        for d in found
    ]


def recorded_definitions(conn: Any, run_id: str) -> dict[str, str]:
    """The definition key of each name the run recorded (arguments excepted), computed once.

    Names whose definition cannot be computed (the code version is gone) are left out.
    """
    version = reads.code_version(conn, run_id)
    given = reads.run_arguments(conn, run_id)
    if version is None or given is None:
        return {}
    git_dir, commit, _, tree, filename, manifest = version
    arguments = set(json.loads(given.args or "{}")) | set(json.loads(given.parsed_args or "{}"))
    names = reads.recorded_names(conn, run_id) - arguments
    known = reads.run_definitions(conn, run_id)
    missing = sorted(names - set(known))
    if missing and commit and not filename.startswith("<"):
        from retrolog.errors import RetrologError
        from retrolog.store.sqlite_metadata import store_directory
        from retrolog.versions.portable import readable_version

        recorded = {"run_id": run_id, "git_dir": git_dir, "code_commit": commit,
                    "code_tree": tree, "code_manifest": manifest}  # fmt: skip
        try:
            where = readable_version(recorded, store_dir=store_directory(conn))
        except RetrologError:  # the code version is nowhere: no definitions
            return {name: key for name, key in known.items() if name in names}
        found = _from_version(where.git_dir, where.rev, filename, missing)
        if found:
            _write(conn, found, run_id)
            known.update({name: d.key for name, d in found.items()})
    return {name: key for name, key in known.items() if name in names}


def _from_version(
    git_dir: Path, commit: str, filename: str, names: list[str]
) -> dict[str, Definition]:
    from retrolog.errors import VersionError
    from retrolog.versions.git import read_file

    try:
        source = read_file(git_dir, commit, filename).decode()
        return definitions(
            source, names, filename=filename, read=version_reader(git_dir, commit, filename)
        )
    except (VersionError, UnicodeDecodeError, SyntaxError, ValueError):
        return {}


def _write(conn: Any, found: Mapping[str, Definition], run_id: str) -> None:
    """Keep computed definitions; a store that cannot be written (read-only) just does not."""
    if not isinstance(conn, sqlite3.Connection):  # a MetadataStore's reader (PostgreSQL)
        conn.keep_definitions(
            _definition_rows(found.values(), run_id, None),
            [(run_id, name, d.key) for name, d in found.items()],
        )
        return
    # Computed again next time: the code version does not change.
    with contextlib.suppress(sqlite3.OperationalError):
        _insert(conn, found, run_id)


def _insert(conn: sqlite3.Connection, found: Mapping[str, Definition], run_id: str) -> None:
    own = not conn.in_transaction
    if own:
        conn.execute("BEGIN IMMEDIATE")
    try:
        keep(conn, found.values(), run_id=run_id)
        conn.executemany(
            "INSERT OR REPLACE INTO run_definitions(run_id, name, lineage) VALUES (?, ?, ?)",
            [(run_id, name, d.key) for name, d in found.items()],
        )
        if own:
            conn.execute("COMMIT")
    except BaseException:
        if own:
            rollback(conn)
        raise


def stored(conn: Any, key: str) -> StoredDefinition | None:
    row = conn.execute(
        "SELECT lineage, name, text, dependencies, coarse FROM definitions WHERE lineage = ?",
        (key,),
    ).fetchone()
    if row is None:
        return None
    return StoredDefinition(row[0], row[1], row[2], tuple(json.loads(row[3] or "[]")), row[4])


def value_keys(
    conn: sqlite3.Connection, run_ids: Iterable[str], names: Iterable[str]
) -> dict[tuple[str, str], dict[str, set[str | None]]]:
    """Per (run, name): the definition keys of its values, by origin.

    A backfilled value stored before definitions were kept has the key None.
    """
    runs, wanted = list(run_ids), list(names)
    result: dict[tuple[str, str], dict[str, set[str | None]]] = {}
    if not runs or not wanted:
        return result
    marks_r = ", ".join("?" for _ in runs)
    marks_n = ", ".join("?" for _ in wanted)
    for run_id, name, lineage in conn.execute(
        f"SELECT DISTINCT run_id, name, lineage FROM logs WHERE origin = 'backfilled'"
        f" AND run_id IN ({marks_r}) AND name IN ({marks_n})",
        (*runs, *wanted),
    ):
        result.setdefault((run_id, name), {}).setdefault("backfilled", set()).add(lineage)
    for run_id in runs:
        recorded = recorded_definitions(conn, run_id)
        for name in wanted:
            if name in recorded:
                result.setdefault((run_id, name), {})["recorded"] = {recorded[name]}
    return result


def explain(conn: Any, ref: str, name: str, at: Mapping[str, int] | None = None) -> dict[str, Any]:
    """How the values of ``name`` in a run came to be: definition, code, replay, checkpoint.

    at: loop iterations to narrow to, e.g. ``{"epoch": 3}`` (every value otherwise).
    Returns a dict with the run's code version and numerical environment and, per
    value, its context, origin, definition, replay, code object, checkpoint and mark.
    """
    run_id = resolve_run(conn, ref)
    if not reads.run_has_name(conn, run_id, name):
        logged = reads.run_names(conn, run_id)
        raise UnknownNameError(
            f"Run {run_id} has no value of {name!r}; it has: {', '.join(logged) or 'none'}. "
            f"`retrolog replay {name}` backfills it if today's script logs it.",
            name=name,
        )
    recorded = recorded_definitions(conn, run_id)
    run = _explained_run(conn, run_id)
    values = _explained_values(conn, run_id, name, recorded.get(name), at)
    if at and not values:
        shown = ", ".join(f"{k}={v}" for k, v in at.items())
        raise UnknownNameError(
            f"Run {run_id} has no value of {name!r} at {shown}; `retrolog dataframe {name} "
            f"--where \"run_id = '{run_id}'\"` lists where it has one.",
            name=name,
        )
    keys = {v["lineage"] for v in values if v["lineage"]}
    replays = {v["replay_id"] for v in values if v["replay_id"]}
    return {
        "run_id": run_id,
        "name": name,
        **run,
        "numerics": json.loads(run["numerics"] or "null"),
        "packages": json.loads(run["packages"] or "null"),
        "definitions": {key: _definition_dict(stored(conn, key)) for key in sorted(keys)},
        "replays": {replay: _replay_dict(conn, replay, run_id) for replay in sorted(replays)},
        "values": values,
    }


def _explained_run(conn: Any, run_id: str) -> dict[str, Any]:
    """The run's script, code version, numerical environment and packages, as stored."""
    return dict(
        zip(
            ("filename", "code_commit", "code_ref", "numerics", "packages", "dirty"),
            conn.execute(
                "SELECT filename, code_commit, code_ref, numerics, packages, dirty FROM runs"
                " WHERE run_id = ?",
                (run_id,),
            ).fetchone(),
            strict=True,
        )
    )


def _explained_values(
    conn: Any, run_id: str, name: str, recorded: str | None, at: Mapping[str, int] | None
) -> list[dict[str, Any]]:
    """Each value of ``name`` in the run (those at ``at``), in log order: its context,
    origin, definition (``recorded``: the run's own), replay, code object and checkpoint."""
    # SQLite keeps a value in one column; PostgreSQL in typed columns, of which at most
    # one is set.
    value_columns = dialect_of(conn).parts
    width = len(value_columns)
    rows = [
        (r[0], r[1], next((v for v in r[2 : 2 + width] if v is not None), None), *r[2 + width :])
        for r in conn.execute(
            "SELECT l.log_id, l.ctx_id, "
            + ", ".join(f"l.{c}" for c in value_columns)
            + ", l.value_type, l.origin, l.replay_id, l.code_object, l.checkpoint, l.inexact,"
            " l.lineage FROM logs l WHERE l.run_id = ? AND l.name = ? ORDER BY l.log_id",
            (run_id, name),
        ).fetchall()
    ]
    contexts = _contexts(conn, run_id)
    values = []
    for log_id, ctx, value, kind, origin, replay, code, checkpoint, inexact, key in rows:
        where = contexts.get(ctx, {}) if ctx is not None else {}
        if at and any(where.get(loop) != iteration for loop, iteration in at.items()):
            continue
        key = key if origin == "backfilled" else recorded
        values.append(
            {
                "log_id": log_id,
                "context": where,
                "value": value,
                "value_type": kind,
                "origin": origin,
                "lineage": key,
                "replay_id": replay,
                "code_object": code,
                "checkpoint": checkpoint,
                "checkpoint_at": _checkpoint_place(conn, run_id, checkpoint, ctx, contexts),
                "inexact": inexact,
            }
        )
    return values


def _definition_dict(found: StoredDefinition | None) -> dict[str, Any] | None:
    if found is None:
        return None
    return {
        "text": found.text,
        "dependencies": list(found.dependencies),
        "coarse": found.coarse,
    }


def _replay_dict(conn: Any, replay_id: str, run_id: str) -> dict[str, Any]:
    row = conn.execute(
        "SELECT r.started_at, r.kind, p.scan, p.status, p.compared, p.mismatches, p.inexact,"
        " p.environment, r.executor, r.executor_address, p.hosts"
        " FROM replays r LEFT JOIN replay_runs p ON p.replay_id = r.replay_id"
        " AND p.run_id = ? WHERE r.replay_id = ?",
        (run_id, replay_id),
    ).fetchone()
    if row is None:
        return {}
    started, kind, scan, status, compared, mismatches, inexact, environment = row[:8]
    executor, address, hosts = row[8:]
    return {
        "started_at": started,
        "kind": kind,
        "scan": scan,
        "status": status,
        "compared": compared,
        "mismatches": json.loads(mismatches or "[]"),
        "inexact": inexact,
        "environment": json.loads(environment or "[]"),
        # Where its workers ran: "local" (processes of the machine that ran the replay)
        # or "ray" (tasks on the cluster at executor_address); None before this was kept.
        "executor": executor,
        "executor_address": address,
        "hosts": json.loads(hosts or "[]"),  # the machines the run's segments ran on
    }


def _contexts(conn: Any, run_id: str) -> dict[int, dict[str, int]]:
    """Each context's loop iterations, outermost first: {ctx: {"epoch": 3, "step": 7}}."""
    result: dict[int, dict[str, int]] = {}
    for ctx, parent, loop, iteration in reads.loop_contexts(conn, run_id):
        result[ctx] = {**(result.get(parent, {}) if parent is not None else {}), loop: iteration}
    return result


def _checkpoint_place(
    conn: Any,
    run_id: str,
    manifest: str | None,
    value_ctx: int | None,
    contexts: dict[int, Any],
) -> dict[str, Any] | None:
    """Where the checkpoint restored before a value was taken.

    Identical states have one manifest (content addressing), so a block's and the
    end's may share it: the block at or before the value's context is the one.
    """
    if manifest is None:
        return None
    rows = conn.execute(
        "SELECT kind, ctx_id FROM checkpoints WHERE run_id = ? AND manifest = ?"
        # NULLs sort first on SQLite and last on PostgreSQL: none here.
        " ORDER BY kind = 'block' DESC, COALESCE(ctx_id, -1) DESC",
        (run_id, manifest),
    ).fetchall()
    before = [r for r in rows if r[0] == "block" and (value_ctx is None or r[1] <= value_ctx)]
    row = before[0] if before else (rows[-1] if rows else None)
    if row is None:
        return {"manifest": manifest}
    kind, ctx = row
    return {"manifest": manifest, "kind": kind, "context": contexts.get(ctx, {})}
