"""A replay's exceptions compared with the run's: did it stop where the run did?

A run that an exception ended (``runs.error`` holds its :class:`Crash`) is
expected to raise again when replayed, in the same context, at the same line
of its code, with an exception of the same type: its replay then stops there,
and the values it computed before are kept. A replay that raises anything else,
or anywhere else, or that runs past the place without raising (when the
exception came from the script, not from outside it) did not replay the run:
that segment's values are discarded and the run's replay fails with what each
side raised and where.
"""

from __future__ import annotations

import difflib
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from retrolog._replay.execute import Job
from retrolog.runtime.crash import Crash

_NEVER_BEGUN = -1  # a worker's context the recorded run does not have


@dataclass
class CrashCheck:
    """The outcome for one run: what to report when it stopped as recorded."""

    stopped: str = ""  # "stopped where it did during recording: ..." (empty: not applicable)


def recorded_site(conn: sqlite3.Connection, run: dict[str, Any]) -> dict[str, Any]:
    """What a worker needs to tell whether it passed the run's crash (the spec's extra
    ``crash_within``): the context it was raised in and the ones that context is in (a
    worker that ends one of them, by running it or restoring it, went past the place).

    Empty when the run did not end by an exception (it finished or was killed): a
    replay then runs on as far as its segment goes.
    """
    crash = Crash.parse(run.get("error")) if run.get("status") == "crashed" else None
    if crash is None:
        return {}
    within: list[int] = []
    current = _crash_context(conn, run["run_id"])
    while current is not None and len(within) < 64:
        within.append(current)
        row = conn.execute(
            "SELECT parent_ctx FROM loops WHERE run_id = ? AND ctx_id = ?",
            (run["run_id"], current),
        ).fetchone()
        current = None if row is None else row[0]
    return {"crash_within": within}


def check(
    conn: sqlite3.Connection, run: dict[str, Any], jobs: Sequence[Job], old_source: str | None
) -> CrashCheck:
    """Compare each finished job's exception with the run's; fail the ones that differ.

    A job that fails the comparison gets ``error`` (the diagnosis) and loses its
    output, so its values are not backfilled. old_source: the run's version of
    the script (None: not readable; lines are then compared as they are).
    """
    run_id = run["run_id"]
    recorded = Crash.parse(run.get("error")) if run.get("status") == "crashed" else None
    recorded_ctx = _crash_context(conn, run_id) if recorded is not None else None
    result = CrashCheck()
    for job in jobs:
        out = job.output
        if out is None:
            continue
        raised = out.get("crash")
        if raised:
            replayed = Crash.from_dict(raised)
            ctx = raised.get("ctx")
            if recorded is not None and (
                replayed.type == recorded.type
                and ctx == recorded_ctx
                and _same_place(recorded, replayed, job, old_source)
            ):
                result.stopped = (
                    f"stopped where it did during recording: {_described(replayed)}, "
                    f"{_context(conn, run_id, ctx)}"
                )
                if replayed.message != recorded.message:
                    result.stopped += f" (recorded message: {recorded.message!r})"
                continue
            ran = (
                f"the run raised {_described(recorded)}, {_context(conn, run_id, recorded_ctx)}"
                if recorded is not None
                else _how_the_run_ended(run)
            )
            _fail(
                job,
                f"its replay raised {_described(replayed)}, {_context(conn, run_id, ctx)}; "
                f"during recording {ran}",
            )
        elif recorded is not None and out.get("passed_crash") and not recorded.from_outside:
            _fail(
                job,
                f"during recording the run raised {_described(recorded)}, "
                f"{_context(conn, run_id, recorded_ctx)}; its replay went past that place "
                "without raising, so it did not compute what the run did",
            )
    return result


def _fail(job: Job, why: str) -> None:
    # When the worker had restored checkpoints before the script raised, its own account
    # (what was restored, what a checkpoint holds, what to pass) is the likelier cause.
    output = job.output or {}
    account = output.get("diagnosis") if output.get("restored_before_failure") else None
    job.output = None
    job.error = f"{account} (Compared with the recording: {why}.)" if account else why
    job.diagnosed = True


def _described(crash: Crash) -> str:
    message = " ".join(crash.message.split())
    if len(message) > 300:
        message = message[:297] + "..."
    if crash.file is None:
        return f"{crash.type}({message!r})"
    return f"{crash.type}({message!r}) at {crash.place()}"


def _how_the_run_ended(run: dict[str, Any]) -> str:
    if run.get("status") == "crashed":
        return "the run stopped without an exception (it was killed)"
    return f"the run {run.get('status')} without an exception"


def _same_place(recorded: Crash, replayed: Crash, job: Job, old_source: str | None) -> bool:
    """Whether the replay raised at the recorded line of the run's code.

    The script the worker runs is the run's version with today's statements placed
    in it, so its lines are mapped back to the recorded version's first. A run
    recorded without its crash's place is compared by type and context alone.
    """
    if recorded.file is None:
        return True
    if replayed.file != recorded.file or replayed.function != recorded.function:
        return False
    line = replayed.line
    if replayed.file == job.filename and old_source is not None and line is not None:
        line = _recorded_line(old_source, job.source, line)
    return line == recorded.line


def _recorded_line(old: str, new: str, line: int) -> int | None:
    """Line ``line`` (1-based) of ``new`` in ``old``; None if it is a line ``new`` added."""
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    for tag, old_start, _, new_start, new_end in matcher.get_opcodes():
        if tag == "equal" and new_start <= line - 1 < new_end:
            return old_start + (line - 1 - new_start) + 1
    return None


def _crash_context(conn: sqlite3.Connection, run_id: str) -> int | None:
    """The run's newest iteration that never ended: where its exception was raised."""
    (ctx,) = conn.execute(
        "SELECT MAX(ctx_id) FROM loops WHERE run_id = ? AND t_end IS NULL", (run_id,)
    ).fetchone()
    return None if ctx is None else int(ctx)


def _context(conn: sqlite3.Connection, run_id: str, ctx: int | None) -> str:
    """``in epoch 3, step 2``: a recorded context as its loops' iterations."""
    if ctx is None:
        return "outside the loops"
    if ctx == _NEVER_BEGUN:
        return "in a loop iteration the run never began"
    parts: list[str] = []
    current: int | None = ctx
    while current is not None and len(parts) < 32:
        row = conn.execute(
            "SELECT parent_ctx, name, iteration FROM loops WHERE run_id = ? AND ctx_id = ?",
            (run_id, current),
        ).fetchone()
        if row is None:
            break
        parent, name, iteration = row
        parts.append(f"{name} {iteration}")
        current = parent
    return "in " + ", ".join(reversed(parts)) if parts else "in an unknown loop iteration"
