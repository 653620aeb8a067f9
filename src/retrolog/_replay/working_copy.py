"""Replay when the metadata is in PostgreSQL (``database_url``): through a working copy.

The replay machinery (plan, workers, backfill, reuse, lineage) reads and writes an
embedded store. With the metadata in PostgreSQL, the coordinator copies what the
replay reads into a working copy, an embedded store file of its own under
``.retrolog/working/`` (every run, replay and definition, and the loops, logs,
checkpoints and profile of the runs of the script replayed, of those only the
runs a ``where`` predicate chose when one is given), replays there
exactly as it would locally (workers read the copy's contexts and frame locals,
checkpoints come from the object store), and writes what the replay added back
into PostgreSQL (store/transfer.py, ``WriteBack``) as each run lands in the copy:
the run's ``replay_runs`` row and backfilled values (in one transaction under an
advisory lock on the run, only where the run has no value at that place, so two
replays of one run from two machines never both write one), with the replay's
row and the definitions and module sets it kept not written yet. At the end,
also when the replay stops with an error, as a local replay keeps what it
finished, it writes the runs left and the replay's row as it ended. The copy is
deleted afterwards.

Exactness is the local replay's own: the same code runs on the same rows. A
``where`` predicate is judged by PostgreSQL, in its dialect, as ``dataframe --where``
is: the working copy is only told which runs it chose.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrolog.store.paths import ProjectPaths

if TYPE_CHECKING:
    from retrolog._replay.replayer import ReplayResult
    from retrolog._replay.request import ReplayRequest
    from retrolog.store.transfer import WriteBack, WrittenBack


class _WorkingCopy(sqlite3.Connection):
    """A working copy's connection: the store directory it belongs to is the project's
    (``store_directory`` reads ``origin``), not the directory the copy's file is in."""

    origin: Path


def replay_shared(
    paths: ProjectPaths, url: str, request: ReplayRequest, **options: Any
) -> ReplayResult:
    """:func:`retrolog._replay.replayer.replay` for the PostgreSQL store at ``url``
    (``options``: its ``confirm`` and ``echo``)."""
    from retrolog._replay.replayer import replay
    from retrolog.errors import StoreError
    from retrolog.store.paths import make_store_dir
    from retrolog.store.postgres_metadata import PostgresMetadata
    from retrolog.store.schema import migrate
    from retrolog.store.sqlite_connection import connect
    from retrolog.store.transfer import WriteBack, copy_into_sqlite, copy_state

    names, where, force = list(request.names), request.where, request.force
    metadata = PostgresMetadata(url, create=False, origin=paths.database)
    make_store_dir(paths, objects=False)  # with its .gitignore: out of the user's git status
    directory = paths.store / "working"
    file = directory / f"{uuid.uuid4().hex}.db"
    conn: Any = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        conn = connect(file, factory=_WorkingCopy)
        conn.origin = paths.database
        migrate(conn)
        # A predicate is judged first, in PostgreSQL: the copy then holds the loops, logs,
        # checkpoints and profile of the runs it chose alone.
        chosen = _matching(metadata, where) if where else None
        copy_into_sqlite(conn, metadata, _scripts(metadata, paths, request.script), chosen)
        writer = WriteBack(conn, metadata, copy_state(conn, metadata), names=names, force=force)
        settled = False

        def land(run_ids: list[str]) -> None:
            # Each run into PostgreSQL as it lands, for readers there to see it while the
            # other runs replay. A run that cannot be written now (the server restarting)
            # is written by the write-back at the end, which says why when it fails.
            try:
                metadata.reconnect_if_lost()
                writer.runs(run_ids)
            except (StoreError, metadata.errors):
                pass

        def settle(outcomes: dict[str, Any]) -> None:
            # Written back before the report, so that it says what the database kept: a
            # value another replay stored first stays, and this one's is not counted.
            nonlocal settled
            settled = True
            stored = _write_back(metadata, writer)
            for run_id, written in stored.written.items():
                if run_id in outcomes:
                    outcomes[run_id].backfilled = written
                    outcomes[run_id].already = stored.already.get(run_id, {})

        try:
            return replay(
                conn, paths, request,
                choose=lambda predicate: (
                    set(chosen) if chosen is not None and predicate == where
                    else _matching(metadata, predicate)
                ),
                settle=settle, land=None if request.dry_run else land, **options,
            )  # fmt: skip
        finally:
            if not request.dry_run and not settled:
                _write_back(metadata, writer)
    finally:
        if conn is not None:
            conn.close()
        metadata.close()
        for leftover in (file, Path(f"{file}-wal"), Path(f"{file}-shm")):
            leftover.unlink(missing_ok=True)


def _matching(metadata: Any, where: str) -> set[str]:
    """The runs ``where`` chooses, judged by PostgreSQL in its dialect, as `retrolog
    dataframe --where` judges it (the working copy would judge it in SQLite's)."""
    from retrolog._query.runs import matching_runs

    return matching_runs(metadata.reader(), where)


def _write_back(metadata: Any, writer: WriteBack) -> WrittenBack:
    """What ``writer`` has not written yet, and the replay's row as it ended."""
    from retrolog.errors import StoreError

    try:
        # The server may have restarted while the replay ran on the copy: nothing was in
        # flight on the connection then, so a new one writes everything.
        metadata.reconnect_if_lost()
    except StoreError as exc:
        raise StoreError(
            f"The replay's values could not be written: {exc} They were computed but are "
            "not stored; run the replay again once the server answers."
        ) from exc
    try:
        return writer.finish()
    except metadata.operational_errors as exc:
        raise StoreError(
            f"The replay's values could not all be written into {metadata.location}: the "
            f"connection to the server was lost ({' '.join(str(exc).split())}). The runs "
            "written before are kept; run the replay again once the server answers: it "
            "writes a value only where a run has none."
        ) from exc
    except metadata.errors as exc:
        raise StoreError(
            f"The replay's values could not be written into {metadata.location}: "
            f"{' '.join(str(exc).split())}. They were computed but are not stored; run the "
            "replay again as a role that may INSERT into logs, replays and replay_runs "
            '(docs/store.md, "Query dialects", says which roles a team sets up).'
        ) from exc


def _scripts(metadata: Any, paths: ProjectPaths, script: str | None) -> list[str]:
    """The scripts whose runs' rows the copy needs: the one named, else the only one
    recorded (none when several were and none is named: the replay then stops, asking
    which)."""
    found = [f for (f,) in metadata.connection.execute("SELECT DISTINCT filename FROM runs")]
    if script is None:
        return found if len(found) == 1 else []
    given = Path(script)
    resolved = (given if given.is_absolute() else Path.cwd() / given).resolve()
    try:
        relative = os.path.relpath(resolved, paths.root)
    except ValueError:
        relative = script
    return [script, Path(relative).as_posix()]
