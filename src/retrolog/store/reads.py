"""Typed reads over a store's reader: the questions the layers above ask of runs and
checkpoints, each a named function returning typed rows.

Each takes a :class:`~retrolog.store.metastore.StoreReader` (SQLite's connection, or
PostgreSQL's reader) and runs standard SQL with ``?`` placeholders that both backends
run alike, so no caller above the store writes these statements or unpacks their rows
by position. The reads whose shape is the product (the dataframe view, the user's own
SQL, a chart's series) stay with their layers, through the same reader.
"""

from __future__ import annotations

from typing import NamedTuple

from retrolog.store.metastore import StoreReader


class CheckpointPosition(NamedTuple):
    """A checkpoint of a run, where a restore can start from."""

    ctx_id: int | None  # its loop context; None for the end checkpoint
    kind: str  # "block" or "end"
    iteration: int | None  # its loop's iteration there
    loop_name: str  # the loop it belongs to (the end checkpoint: the outermost)
    manifest: str  # the object key of its manifest


class CheckpointWritten(NamedTuple):
    """A checkpoint as the run wrote it, with what it cost."""

    kind: str
    loop: str
    iteration: int | None
    nbytes: int | None
    capture_seconds: float | None
    write_seconds: float | None
    created_at: float | None


class CodeVersion(NamedTuple):
    """Where a run's code version was recorded (``runs``' columns)."""

    git_dir: str | None
    code_commit: str | None
    dirty: int | None
    code_tree: str | None
    filename: str
    code_manifest: str | None


class RunArguments(NamedTuple):
    """A run's values as JSON: its parsed command-line arguments and its run-level values."""

    parsed_args: str | None
    args: str | None


def run_exists(reader: StoreReader, run_id: str) -> bool:
    """Whether the store has a run with exactly this id."""
    found = reader.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return found is not None


def run_ids_starting(reader: StoreReader, prefix: str) -> list[str]:
    """The ids that begin with ``prefix`` (taken literally), oldest run first."""
    pattern = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    rows = reader.execute(
        "SELECT run_id FROM runs WHERE run_id LIKE ? ESCAPE '\\' ORDER BY started_at",
        (pattern,),
    )
    return [run_id for (run_id,) in rows]


def newest_run_ids(reader: StoreReader, limit: int) -> list[str]:
    """The ids of the ``limit`` most recently started runs, newest first."""
    rows = reader.execute("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT ?", (limit,))
    return [run_id for (run_id,) in rows]


def run_ids_oldest_first(reader: StoreReader) -> list[str]:
    """Every run's id in the order the runs started (ties by id)."""
    rows = reader.execute("SELECT run_id FROM runs ORDER BY started_at, run_id")
    return [run_id for (run_id,) in rows]


def running_run_ids(reader: StoreReader) -> list[str]:
    """The runs whose status is ``running`` (recording, or dead and not yet marked)."""
    rows = reader.execute("SELECT run_id FROM runs WHERE status = 'running'")
    return [run_id for (run_id,) in rows]


def run_arguments(reader: StoreReader, run_id: str) -> RunArguments | None:
    """``run_id``'s arguments and run-level values; None for no such run."""
    row = reader.execute(
        "SELECT parsed_args, args FROM runs WHERE run_id = ?", (run_id,)
    ).fetchone()
    return None if row is None else RunArguments(*row)


def all_run_arguments(reader: StoreReader) -> list[RunArguments]:
    """Every run's arguments and run-level values, in no particular order."""
    return [RunArguments(*row) for row in reader.execute("SELECT parsed_args, args FROM runs")]


def code_version(reader: StoreReader, run_id: str) -> CodeVersion | None:
    """Where ``run_id``'s code version was recorded; None for no such run."""
    row = reader.execute(
        "SELECT git_dir, code_commit, dirty, code_tree, filename, code_manifest FROM runs"
        " WHERE run_id = ?",
        (run_id,),
    ).fetchone()
    return None if row is None else CodeVersion(*row)


def checkpoint_positions(reader: StoreReader, run_id: str) -> list[CheckpointPosition]:
    """``run_id``'s checkpoints in context order, the end checkpoint last."""
    rows = reader.execute(
        "SELECT c.ctx_id, c.kind, l.iteration, c.loop_name, c.manifest FROM checkpoints c"
        " LEFT JOIN loops l ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id"
        " WHERE c.run_id = ? ORDER BY c.ctx_id IS NULL, c.ctx_id, c.checkpoint_id",
        (run_id,),
    )
    return [CheckpointPosition(*row) for row in rows]


def checkpoints_written(reader: StoreReader, run_id: str) -> list[CheckpointWritten]:
    """``run_id``'s checkpoints in the order it wrote them."""
    rows = reader.execute(
        "SELECT c.kind, c.loop_name, lp.iteration, c.nbytes, c.capture_seconds,"
        " c.write_seconds, c.created_at FROM checkpoints c"
        " LEFT JOIN loops lp ON lp.run_id = c.run_id AND lp.ctx_id = c.ctx_id"
        " WHERE c.run_id = ? ORDER BY c.checkpoint_id",
        (run_id,),
    )
    return [CheckpointWritten(*row) for row in rows]


class LoopContext(NamedTuple):
    """One iteration of a loop in a run: its context and its parent's."""

    ctx_id: int
    parent_ctx: int | None
    name: str
    iteration: int


def loop_contexts(reader: StoreReader, run_id: str) -> list[LoopContext]:
    """``run_id``'s loop iterations in context order (a parent before its children)."""
    rows = reader.execute(
        "SELECT ctx_id, parent_ctx, name, iteration FROM loops WHERE run_id = ? ORDER BY ctx_id",
        (run_id,),
    )
    return [LoopContext(*row) for row in rows]


def run_has_name(reader: StoreReader, run_id: str, name: str) -> bool:
    """Whether ``run_id`` has a value of ``name``, recorded or backfilled."""
    found = reader.execute(
        "SELECT 1 FROM logs WHERE run_id = ? AND name = ? LIMIT 1", (run_id, name)
    ).fetchone()
    return found is not None


def run_names(reader: StoreReader, run_id: str) -> list[str]:
    """The names ``run_id`` has values of, sorted."""
    rows = reader.execute(
        "SELECT DISTINCT name FROM logs WHERE run_id = ? ORDER BY name", (run_id,)
    )
    return [name for (name,) in rows]


def recorded_names(reader: StoreReader, run_id: str) -> set[str]:
    """The names ``run_id`` recorded itself (not backfilled by a replay)."""
    rows = reader.execute(
        "SELECT DISTINCT name FROM logs WHERE run_id = ? AND origin = 'recorded'", (run_id,)
    )
    return {name for (name,) in rows}


def run_definitions(reader: StoreReader, run_id: str) -> dict[str, str]:
    """The definition key kept for each of ``run_id``'s recorded names, by name."""
    rows = reader.execute("SELECT name, lineage FROM run_definitions WHERE run_id = ?", (run_id,))
    return {name: key for name, key in rows}


def runs_of_script(reader: StoreReader, filename: str) -> list[str]:
    """The ids of the runs of ``filename``."""
    rows = reader.execute("SELECT run_id FROM runs WHERE filename = ?", (filename,))
    return [run_id for (run_id,) in rows]


def summarised_number_names(reader: StoreReader) -> list[str]:
    """The names some run logged a number of (``run_summaries``), sorted."""
    rows = reader.execute(
        "SELECT DISTINCT name FROM run_summaries WHERE n_numbers > 0 ORDER BY name"
    )
    return [name for (name,) in rows]


def name_logged(reader: StoreReader, name: str) -> bool:
    """Whether some run has a value of ``name``."""
    found = reader.execute("SELECT 1 FROM logs WHERE name = ? LIMIT 1", (name,)).fetchone()
    return found is not None


def oldest_running_run(reader: StoreReader) -> tuple[str, float] | None:
    """The running run that started first, and when; None when none is running."""
    row = reader.execute(
        "SELECT run_id, started_at FROM runs WHERE status = 'running' ORDER BY started_at LIMIT 1"
    ).fetchone()
    return None if row is None else (row[0], row[1])


def runs_without_code_copy(reader: StoreReader) -> list[str]:
    """The runs with a code version but no copy of it in the object store (no code
    manifest), oldest first."""
    rows = reader.execute(
        "SELECT run_id FROM runs WHERE code_manifest IS NULL AND code_commit IS NOT NULL "
        "ORDER BY started_at"
    )
    return [run_id for (run_id,) in rows]
