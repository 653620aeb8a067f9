"""The runs list and one run's details, as the CLI's ``runs`` and ``show`` print them."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from retrolog._query.sql import execute_read, execute_read_any
from retrolog.errors import RetrologError, RunNotFoundError
from retrolog.store import reads
from retrolog.store.metastore import MetadataStore, dialect_of
from retrolog.store.paths import storable_text

if TYPE_CHECKING:
    import pandas as pd

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRING = re.compile(r"'(?:[^']|'')*'")


def list_runs(metadata: MetadataStore, limit: int | None = None) -> pd.DataFrame:
    """One row per run, newest last: run_id, tstamp, filename, status, duration, args."""
    import pandas as pd  # here: the replay coordinator imports this module, needing none

    rows = metadata.run_listing(limit)[::-1]
    now = time.time()
    records = [
        {
            "run_id": run_id,
            "tstamp": tstamp,
            "filename": filename,
            "status": status,
            "duration": format_duration((ended or now) - started),
            "args": _format_args(parsed, args),
        }
        for run_id, tstamp, filename, status, started, ended, args, parsed in rows
    ]
    columns = ["run_id", "tstamp", "filename", "status", "duration", "args"]
    return pd.DataFrame.from_records(records, columns=columns)


def resolve_run(conn: Any, ref: str) -> str:
    """The run id ``ref`` names: an exact id or a unique prefix of one."""
    # As the store keeps text (a byte UTF-8 cannot hold, from the command line, escaped).
    ref = storable_text(ref.strip())
    if reads.run_exists(conn, ref):
        return ref
    matches = reads.run_ids_starting(conn, ref)
    if len(matches) == 1:
        return matches[0]
    if not matches:
        newest = reads.newest_run_ids(conn, 3)
        hint = f" The newest runs are: {', '.join(newest)}." if newest else " There are no runs."
        raise RunNotFoundError(
            f"No run has the id {ref!r}.{hint} `retrolog runs` lists them all; a unique "
            "prefix of an id is enough.",
            run_id=ref,
        )
    shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
    raise RunNotFoundError(
        f"{ref!r} matches {len(matches)} runs ({shown}); give more of the id.", run_id=ref
    )


def run_details(conn: Any, ref: str) -> dict[str, Any]:
    """Everything known about one run: metadata, code version, names, loops, checkpoints.

    conn: a SQLite connection or a MetadataStore's ``reader()`` (PostgreSQL): the
        statements here are standard SQL that both run.
    """
    run_id = resolve_run(conn, ref)

    def dicts(sql: str) -> list[dict[str, Any]]:
        # Standard SQL only: both backends run these (MetadataStore.reader).
        cursor = conn.execute(sql, (run_id,))
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]

    (row,) = dicts("SELECT * FROM runs WHERE run_id = ?")
    row.pop("run_key", None)  # PostgreSQL's compact run key (SQLite's rowid)
    names = dicts(
        "SELECT name, COUNT(*) AS count, MIN(origin) AS origin,"
        " CASE WHEN COUNT(ctx_id) = 0 THEN 'run' ELSE 'loop' END AS level"
        " FROM logs WHERE run_id = ? GROUP BY name ORDER BY MIN(log_id)"
    )
    loops = dicts(
        "SELECT name, depth, COUNT(*) AS iterations FROM loops WHERE run_id = ?"
        " GROUP BY name, depth ORDER BY depth, MIN(ctx_id)"
    )
    (ckpt,) = dicts(
        "SELECT COUNT(*) AS count, COALESCE(SUM(nbytes), 0) AS bytes,"
        " COALESCE(SUM(capture_seconds), 0) AS capture_seconds,"
        " COUNT(CASE WHEN kind = 'block' THEN 1 END) AS blocks"
        " FROM checkpoints WHERE run_id = ?"
    )
    backfills = dicts(
        "SELECT l.name, l.replay_id, COUNT(*) AS count, l.inexact,"
        " r.inexact AS reason FROM logs l LEFT JOIN replay_runs r"
        " ON r.replay_id = l.replay_id AND r.run_id = l.run_id"
        " WHERE l.run_id = ? AND l.origin = 'backfilled'"
        " GROUP BY l.name, l.replay_id, l.inexact, r.inexact ORDER BY MIN(l.log_id)"
    )
    ckpt.update(_checkpoint_outcome(conn, run_id, row.get("checkpointing"), ckpt["blocks"]))
    profile = {
        r["phase"]: {"count": r["n"], "seconds": r["s"], "block_seconds": r["b"]}
        for r in dicts(
            "SELECT phase, COUNT(*) AS n, SUM(seconds) AS s, SUM(block_seconds) AS b"
            " FROM profile WHERE run_id = ? GROUP BY phase"
        )
    }
    for key in (
        "args",
        "packages",
        "argv",
        "skipped_files",
        "numerics",
        "parsed_args",
        "checkpointing",
    ):
        if row.get(key):
            row[key] = json.loads(row[key])
    row["dirty"] = bool(row["dirty"]) if row.get("dirty") is not None else None
    end = row["ended_at"] or time.time()
    row["duration"] = format_duration(end - row["started_at"])
    row["names"] = names
    row["backfills"] = backfills
    row["definitions"] = _definitions(conn, run_id)
    row["loops"] = loops
    row["checkpoints"] = ckpt
    row["profile"] = profile
    return row


def _definitions(conn: Any, run_id: str) -> list[dict[str, Any]]:
    """Each logged name's definition(s): recorded ones from the code version, backfilled ones
    from the replay that computed them."""
    from retrolog._query.lineage import recorded_definitions, stored

    pairs = [("recorded", name, key) for name, key in recorded_definitions(conn, run_id).items()]
    pairs += [
        ("backfilled", name, key)
        for name, key in conn.execute(
            "SELECT DISTINCT name, lineage FROM logs WHERE run_id = ? AND origin = 'backfilled'"
            " ORDER BY name",
            (run_id,),
        )
    ]
    result = []
    for origin, name, key in pairs:
        found = stored(conn, key) if key else None
        result.append(
            {
                "name": name,
                "origin": origin,
                "lineage": key,
                "statement": found.text.split("\n", 1)[0] if found else None,
                "dependencies": list(found.dependencies) if found else [],
                "coarse": found.coarse if found else None,
            }
        )
    return result


def _checkpoint_outcome(
    conn: Any, run_id: str, summary_json: str | None, written: int
) -> dict[str, Any]:
    """Block checkpoints the adaptive rule chose, and what became of them.

    From the run's ``checkpointing`` record (written at the run's end, so
    nothing while it runs) and its block checkpoint rows, which are what was
    written. ``lost`` is what neither a row nor the abandoned list accounts
    for: a write that failed, either while training went on (``lost_at`` says
    which and why: a full disk, an object store that did not answer) or raised
    by the run.
    """
    summary: Any = None
    with contextlib.suppress(ValueError):  # not JSON: show what the rows say, nothing more
        summary = json.loads(summary_json) if summary_json else None
    if not isinstance(summary, dict) or not isinstance(summary.get("blocks"), dict):
        return {}
    # Records of earlier versions have no totals: "checkpoints" per block counted the
    # ones taken, and "dropped_unwritten" the ones taken and then dropped at exit.
    chosen = int(
        summary["chosen"]
        if summary.get("chosen") is not None
        else sum(int(b.get("checkpoints", 0)) for b in summary["blocks"].values())
    )
    abandoned = int(summary.get("abandoned", summary.get("dropped_unwritten")) or 0)
    listed = summary.get("abandoned_checkpoints") or []
    not_stored = summary.get("lost_checkpoints") or []
    ctx_ids = [a["ctx_id"] for a in [*listed, *not_stored] if a.get("ctx_id") is not None]
    iterations: dict[Any, tuple[Any, Any]] = {}
    if ctx_ids:
        marks = ", ".join("?" * len(ctx_ids))
        iterations = {
            ctx: (name, iteration)
            for ctx, name, iteration in conn.execute(
                "SELECT ctx_id, name, iteration FROM loops"
                f" WHERE run_id = ? AND ctx_id IN ({marks})",
                (run_id, *ctx_ids),
            )
        }
    abandoned_at = []
    for item in listed:
        loop, iteration = iterations.get(item.get("ctx_id"), (item.get("loop"), None))
        abandoned_at.append({"kind": item.get("kind"), "loop": loop, "iteration": iteration})
    lost_at = []
    for item in not_stored:
        loop, iteration = iterations.get(item.get("ctx_id"), (item.get("loop"), None))
        lost_at.append(
            {
                "kind": item.get("kind"),
                "loop": loop,
                "iteration": iteration,
                "reason": item.get("reason"),
            }
        )
    return {
        "chosen": chosen,
        "written": written,
        "abandoned": abandoned,
        "lost": max(chosen - written - abandoned, 0),
        "refused_writer_full": int(summary.get("refused_writer_full", 0)),
        "abandoned_at": abandoned_at,
        "lost_at": lost_at,
    }


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def arguments(parsed_json: str | None, args_json: str | None) -> dict[str, Any]:
    """A run's arguments: its parsed command-line values, then its rl.arg values (which win
    on a clash), from the runs table's ``parsed_args`` and ``args`` columns."""
    return {**json.loads(parsed_json or "{}"), **json.loads(args_json or "{}")}


def _format_args(parsed_json: str | None, args_json: str | None) -> str:
    args = arguments(parsed_json, args_json)
    return " ".join(f"{k}={v}" for k, v in args.items())


def matching_runs(conn: sqlite3.Connection, where: str) -> set[str]:
    """Runs with at least one row of the dataframe view satisfying ``where``.

    ``where`` is the predicate `retrolog dataframe`, `replay`, `gc` and the UI take.
    """
    from retrolog._query.dataframe import logged_names, matching_run_ids

    logged = set(logged_names(conn))
    # Words inside string literals ('adam') are not names.
    identifiers = list(dict.fromkeys(_IDENTIFIER.findall(_STRING.sub("''", where))))
    referenced = [n for n in identifiers if n in logged]
    # A value split over typed columns has no one column to compare here: the view's
    # own predicate types it.
    if dialect_of(conn).split:
        if referenced:
            return matching_run_ids(conn, referenced, where)
        return _matching_by_run_columns(conn, where)
    if referenced and not _run_level_only(conn, identifiers, referenced):
        return matching_run_ids(conn, referenced, where)

    malformed, writes = _choosing_messages(where, "SQLite")

    # Run-level names (arguments, final metrics) are one value per run: a column each, the
    # record that counts (the newest recorded one, else the newest backfilled one).
    columns = "".join(
        f", (SELECT l.value FROM logs l WHERE l.name = {_literal(n)} AND l.run_id = r.run_id"
        " AND l.ctx_id IS NULL ORDER BY l.origin = 'recorded' DESC, l.log_id DESC LIMIT 1)"
        f" AS {_quoted(n)}"
        for n in referenced
    )
    _, rows = execute_read(
        conn,
        f"SELECT run_id FROM (SELECT projid, run_id, tstamp, filename{columns} FROM runs r)"
        f" WHERE {where}",
        subject=where, malformed=malformed, writes=writes,
    )  # fmt: skip
    return {r[0] for r in rows}


def _choosing_messages(
    where: str, database: str
) -> tuple[Callable[[str], str], Callable[[str, str], str]]:
    """What a predicate that chooses runs is told when ``database`` cannot apply it, and
    when it would write (PostgreSQL names no action: it is then "change the store")."""

    def malformed(complaint: str) -> str:
        return (
            f"The predicate {where!r} cannot be used to choose runs ({database} says "
            f"{complaint!r}). It may use projid, run_id, tstamp, filename and the names "
            "logged in this store."
        )

    def writes(action: str, complaint: str) -> str:
        return (
            f"The predicate {where!r} tries to {action or 'change the store'} ({complaint}); "
            "a predicate only reads."
        )

    return malformed, writes


def _matching_by_run_columns(reader: Any, where: str) -> set[str]:
    """The runs ``where`` chooses when it names only their own columns."""
    malformed, writes = _choosing_messages(where, dialect_of(reader).name)
    _, rows = execute_read_any(
        reader,
        f"SELECT run_id FROM (SELECT projid, run_id, tstamp, filename FROM runs) AS r"
        f" WHERE (\n{where}\n)",
        subject=where, malformed=malformed, writes=writes,
    )  # fmt: skip
    return {r[0] for r in rows}


def _run_level_only(
    conn: sqlite3.Connection, identifiers: Sequence[str], referenced: Sequence[str]
) -> bool:
    """Whether ``where`` can be answered per run: it names only the runs' own columns and
    names logged at run level alone (no loop column, no name logged inside a loop).

    Then there is no need to build the dataframe view (whose loop columns take a scan of
    every loop row of the store)."""
    own = {"projid", "run_id", "tstamp", "filename"}
    keywords = {"and", "or", "not", "in", "is", "null", "like", "glob", "between", "case",
                "when", "then", "else", "end", "true", "false", "escape", "collate", "nocase",
                "abs", "lower", "upper", "length", "coalesce", "ifnull", "round", "substr",
                "typeof", "min", "max", "cast", "as", "real", "integer", "text"}  # fmt: skip
    unknown = [i for i in identifiers if i not in referenced and i not in own]
    if any(i.lower() not in keywords for i in unknown):
        return False  # a loop column (epoch, step), or something only SQLite can judge
    return not any(
        conn.execute(
            "SELECT 1 FROM logs WHERE name = ? AND ctx_id IS NOT NULL LIMIT 1", (n,)
        ).fetchone()
        for n in referenced
    )


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _quoted(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


def checkpoint_list(conn: Any, ref: str) -> list[dict[str, Any]]:
    """A run's checkpoints in the order written: kind (block or end), the loop and its
    iteration, stored bytes, capture and write seconds."""
    run_id = resolve_run(conn, ref)
    return [row._asdict() for row in reads.checkpoints_written(conn, run_id)]


def checkpoint_positions(conn: Any, ref: str) -> tuple[str, list[tuple[Any, ...]]]:
    """The run ``ref`` names and its checkpoints as (ctx_id, kind, outer-loop iteration, loop
    name, manifest key), in context order, the end checkpoint last: what a restore chooses
    from."""
    run_id = resolve_run(conn, ref)
    return run_id, [tuple(row) for row in reads.checkpoint_positions(conn, run_id)]


def _version(
    conn: Any, run_id: str, *, from_store: bool = False
) -> tuple[str, str, bool, str | None, str]:
    """(git_dir, revision, dirty, tree, filename) of a run's code version: where it can be
    read (versions/portable.py: its recording clone, this one, or the store's copy)."""
    from retrolog.store.sqlite_metadata import store_directory
    from retrolog.versions.portable import readable_version

    row = reads.code_version(conn, run_id)
    if row is None or not row.code_commit:
        raise RunNotFoundError(
            f"Run {run_id} has no code version (it was recorded before code versions were "
            "kept, or its capture failed).",
            run_id=run_id,
        )
    git_dir, commit, dirty, tree, filename, manifest = row
    found = readable_version(
        {"run_id": run_id, "git_dir": git_dir, "code_commit": commit, "code_tree": tree,
         "code_manifest": manifest},
        store_dir=store_directory(conn), from_store=from_store,
    )  # fmt: skip
    return str(found.git_dir), found.rev, bool(dirty), tree, filename


def run_code(conn: Any, ref: str, path: str | None = None) -> dict[str, Any]:
    """The code a run executed: its version's files, and the text of ``path`` (default: the
    run's script) as it was, uncommitted edits included."""
    from pathlib import Path

    from retrolog.versions.git import list_files, read_file

    run_id = resolve_run(conn, ref)
    git_dir, rev, dirty, tree, filename = _version(conn, run_id)
    files = list_files(Path(git_dir), rev)
    shown = path or filename
    text = read_file(Path(git_dir), rev, shown).decode(errors="replace")
    version = reads.code_version(conn, run_id)
    commit = None if version is None else version.code_commit
    return {"run_id": run_id, "commit": commit, "tree": tree, "dirty": dirty, "files": files,
            "path": shown, "text": text}  # fmt: skip


def compare_runs(conn: Any, refs: list[str]) -> dict[str, Any]:
    """Two or more runs side by side, oldest first: the arguments that differ (and those that
    do not), and the code diff from the oldest run's version to each other's."""
    from pathlib import Path

    from retrolog.errors import UsageError
    from retrolog.versions.git import diff_versions

    chosen = set(resolve_run(conn, r) for r in refs)
    if len(chosen) < 2:
        raise UsageError("Compare needs at least two different runs.")
    # Oldest first, so that each diff reads forward in time.
    run_ids = [r for r in reads.run_ids_oldest_first(conn) if r in chosen]
    args = {}
    for run_id in run_ids:
        given = reads.run_arguments(conn, run_id)
        assert given is not None  # resolved above, and runs are never deleted
        args[run_id] = arguments(given.parsed_args, given.args)
    names = list(dict.fromkeys(k for a in args.values() for k in a))

    def distinct(name: str) -> int:
        return len({json.dumps(args[r].get(name), sort_keys=True) for r in run_ids})

    differ = {n: [args[r].get(n) for r in run_ids] for n in names if distinct(n) > 1}
    same = {n: args[run_ids[0]].get(n) for n in names if n not in differ}
    base = _version(conn, run_ids[0])
    diffs = []
    for run_id in run_ids[1:]:
        other = _version(conn, run_id)
        if other[3] == base[3]:
            text = ""  # the same tree: the same code
        elif other[0] != base[0]:
            # Read in different git directories (two clones): compare the store's copies.
            try:
                ours = _version(conn, run_ids[0], from_store=True)
                theirs = _version(conn, run_id, from_store=True)
            except RetrologError:
                raise UsageError(
                    f"Runs {run_ids[0]} and {run_id} keep their code in different git "
                    f"directories ({base[0]}, {other[0]}) and the store has no copy of one of "
                    "them; compare runs of one project."
                ) from None
            text = diff_versions(Path(ours[0]), ours[1], theirs[1])
        else:
            text = diff_versions(Path(base[0]), base[1], other[1])
        diffs.append({"from": run_ids[0], "to": run_id, "same_code": other[3] == base[3],
                      "diff": text})  # fmt: skip
    return {"runs": run_ids, "args_differ": differ, "args_same": same, "diffs": diffs}


def checkpoint_at(conn: Any, ref: str, at: int | str | None) -> dict[str, Any]:
    """The checkpoint of run ``ref`` at outer-loop iteration ``at`` (or ``"end"``; None:
    the end checkpoint, else the latest), as ``rl.restore`` chooses it: the last written
    of several (an outer loop that ran twice). Its run id, loop, position and manifest."""
    run_id = resolve_run(conn, ref)
    rows = conn.execute(
        "SELECT c.kind, c.loop_name, l.iteration, c.manifest FROM checkpoints c"
        " LEFT JOIN loops l ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id"
        " WHERE c.run_id = ? ORDER BY c.ctx_id IS NULL, c.ctx_id, c.checkpoint_id",
        (run_id,),
    ).fetchall()
    if not rows:
        raise RunNotFoundError(
            f"Run {run_id} has no checkpoint: it ran no loop inside rl.checkpointing(...), or "
            "garbage collection (retrolog gc) removed them all.",
            run_id=run_id,
        )
    if at is None:
        ends = [r for r in rows if r[0] == "end"]
        chosen = ends[-1] if ends else rows[-1]
    else:
        kind = "end" if at == "end" else "block"
        matches = [r for r in rows if r[0] == kind and (kind == "end" or r[2] == at)]
        if not matches:
            loop = rows[-1][1]
            have = [str(r[2]) for r in rows if r[0] == "block"] + [
                "end" for r in rows if r[0] == "end"
            ]
            raise RunNotFoundError(
                f"Run {run_id} has no checkpoint at {'the end' if at == 'end' else f'{loop} {at}'}"
                f"; it has checkpoints at {loop} {', '.join(dict.fromkeys(have))}. Adaptive "
                "checkpointing skips some blocks, a crashed run has no end checkpoint, and "
                "garbage collection (retrolog gc) may have removed others.",
                run_id=run_id,
            )
        chosen = matches[-1]
    kind, loop, iteration, manifest = chosen
    return {
        "run_id": run_id,
        "loop": loop,
        "at": "end" if kind == "end" else iteration,
        "manifest": manifest,
    }
