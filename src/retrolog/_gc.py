"""Retention policies and garbage collection of checkpoint objects (``retrolog gc``).

A retention policy chooses, per run, which checkpoints to keep:

=======================  =====================================================
``all``                  every checkpoint; only objects nothing references go
``last:N``               the last N block checkpoints of each run, and its end
                         checkpoint
``best:NAME[:max|min]``  the block checkpoint whose outer-loop iteration has
                         the best value of the logged metric NAME, and the end
                         checkpoint ("peak and end", FlorDB)
=======================  =====================================================

Collecting is two steps. The checkpoint rows the policy drops are deleted in
one transaction; then every object file that no remaining row references (its
manifest, and :func:`~retrolog.checkpoint.codec.manifest_blobs` of it, across
all runs) is deleted. Replay plans read the remaining rows, so a block whose
checkpoint was dropped is executed instead of restored.

Why this is safe beside runs that are recording (docs/store.md):

- a run writes blobs, then the manifest, then the checkpoint row, so objects
  can be in use before any row references them: no object file newer than the
  *cutoff* is deleted, the cutoff being the earlier of "now minus the grace
  period" and the start of the oldest running run;
- ``ObjectStore.put`` freshens an object it finds already stored, so a
  run that deduplicates against an old object makes it new again; the delete
  (``ObjectStore.remove_if_stale``) looks at its time once more, after
  renaming the file aside where the backend renames atomically, so a freshen
  that races the scan wins;
- rows of running runs, and of runs whose script is being replayed, are never
  dropped;
- a kept checkpoint whose manifest cannot be read may reference anything, so
  then no object is deleted at all and the report names it.
"""

from __future__ import annotations

import enum
import math
import re
import sqlite3
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from retrolog._query.dataframe import logged_names, number_of
from retrolog._query.runs import matching_runs, resolve_run
from retrolog.checkpoint.codec import manifest_blobs
from retrolog.errors import RetrologError, StoreError, UnknownNameError, UsageError
from retrolog.store import reads
from retrolog.store.metastore import database_errors, read_snapshot, write_transaction
from retrolog.store.objects import ObjectStore, StoredFile
from retrolog.store.paths import storable_text
from retrolog.versions.portable import code_objects

GRACE_SECONDS = 3600.0
"""Objects written this recently are never collected (see :func:`plan_gc`)."""

# A replay whose coordinator was killed stays 'running' in the replays table
# forever; after this long it no longer protects its script's runs.
REPLAY_STALE_SECONDS = 24 * 3600.0
# File times and the run's start come from different clocks' readings (and
# some file systems keep times in whole seconds): start the cutoff earlier.
_CLOCK_SLACK = 2.0
_CHUNK = 500  # ids per DELETE statement


class Keep(enum.Enum):
    """Which checkpoints a retention policy keeps in each run."""

    ALL = "all"  # every checkpoint: only objects nothing references are collected
    LAST = "last"  # the last N block checkpoints and the end checkpoint
    BEST = "best"  # the best block checkpoint by a logged metric and the end checkpoint


POLICY_HELP = (
    "all (collect only unreferenced objects), last:N (the last N block checkpoints of "
    "each run plus its end checkpoint) or best:NAME[:max|min] (the checkpoint of the "
    "outer-loop iteration with the best logged NAME plus the end checkpoint)"
)


@dataclass(frozen=True)
class RetentionPolicy:
    """A retention policy; :meth:`parse` reads its command-line spelling."""

    keep: Keep = Keep.ALL
    count: int = 0  # N of last:N
    metric: str | None = None  # NAME of best:NAME
    maximize: bool = True  # best:NAME:max (default) or :min

    @classmethod
    def parse(cls, text: str) -> RetentionPolicy:
        """Read ``all``, ``last:N`` or ``best:NAME[:max|min]``."""
        spec = text.strip()
        kind, _, rest = spec.partition(":")
        if kind == "all" and not rest:
            return cls(Keep.ALL)
        if kind == "last" and re.fullmatch(r"\d+", rest):
            return cls(Keep.LAST, count=int(rest))
        if kind == "best" and rest:
            name, maximize = rest, True
            for suffix, flag in ((":max", True), (":min", False)):
                if rest.endswith(suffix) and len(rest) > len(suffix):
                    name, maximize = rest[: -len(suffix)], flag
            # The name as the store keeps names (text UTF-8 cannot hold, escaped).
            return cls(Keep.BEST, metric=storable_text(name), maximize=maximize)
        raise UsageError(
            f"{text!r} is not a retention policy; use {POLICY_HELP}, e.g. last:2 or "
            "best:val_acc:max."
        )

    def __str__(self) -> str:
        if self.keep is Keep.LAST:
            return f"last:{self.count}"
        if self.keep is Keep.BEST:
            return f"best:{self.metric}:{'max' if self.maximize else 'min'}"
        return "all"


@dataclass(frozen=True)
class CheckpointRef:
    """One row of the checkpoints table, with its outer-loop iteration."""

    checkpoint_id: int
    run_id: str
    ctx_id: int | None
    kind: str  # "block" or "end"
    iteration: int | None  # of the outer loop; None for the end checkpoint
    manifest: str
    nbytes: int

    @property
    def position(self) -> int | str:
        """The iteration, or "end"; what ``rl.restore(..., at=)`` takes."""
        if self.kind == "end":
            return "end"
        return self.iteration if self.iteration is not None else f"ctx {self.ctx_id}"


@dataclass
class RunRetention:
    """What the policy keeps and drops in one run."""

    run_id: str
    status: str
    kept: list[CheckpointRef]
    dropped: list[CheckpointRef]
    note: str | None = None  # why more is kept than the policy says


@dataclass(frozen=True)
class UnreadableManifest:
    """A kept checkpoint's manifest that could not be read: no object is deleted."""

    manifest: str
    checkpoints: tuple[str, ...]  # "run_id at position" of each row that uses it
    reason: str


@dataclass
class GcReport:
    """A garbage collection: what it would do (a plan) or what it did (``done``)."""

    policy: RetentionPolicy
    runs: list[RunRetention]
    objects: list[StoredFile]  # unreferenced objects older than the cutoff
    temp_files: list[StoredFile]  # leftover temp files older than the cutoff
    unreadable: list[UnreadableManifest]
    cutoff: float  # no object file modified at or after this time is deleted
    cutoff_reason: str
    grace_seconds: float
    objects_total: int = 0  # object files in the store when it was scanned
    bytes_total: int = 0
    recent_unreferenced: int = 0  # unreferenced, but newer than the cutoff: kept
    done: bool = False
    checkpoints_deleted: int = 0  # when done: rows actually deleted
    notes: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> list[CheckpointRef]:
        """The checkpoint rows the policy drops, over all runs."""
        return [ref for run in self.runs for ref in run.dropped]

    @property
    def bytes_freed(self) -> int:
        """Bytes of the object and temp files deleted (or to delete)."""
        return sum(f.size for f in self.objects) + sum(f.size for f in self.temp_files)

    @property
    def empty(self) -> bool:
        """Whether there is nothing to delete."""
        return not (self.dropped or self.objects or self.temp_files)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able data (``retrolog gc --json``)."""
        return {
            "policy": str(self.policy),
            "done": self.done,
            "checkpoints": self.checkpoints_deleted if self.done else len(self.dropped),
            "objects": len(self.objects),
            "temp_files": len(self.temp_files),
            "bytes_freed": self.bytes_freed,
            "objects_total": self.objects_total,
            "bytes_total": self.bytes_total,
            "recent_unreferenced": self.recent_unreferenced,
            "cutoff": self.cutoff,
            "cutoff_reason": self.cutoff_reason,
            "grace_seconds": self.grace_seconds,
            "runs": [
                {
                    "run_id": run.run_id,
                    "status": run.status,
                    "kept": [ref.position for ref in run.kept],
                    "dropped": [ref.position for ref in run.dropped],
                    "note": run.note,
                }
                for run in self.runs
            ],
            "unreadable": [
                {"manifest": u.manifest, "checkpoints": list(u.checkpoints), "reason": u.reason}
                for u in self.unreadable
            ],
            "notes": list(self.notes),
        }


# -- choosing runs -----------------------------------------------------------------------


def select_runs(
    conn: sqlite3.Connection, refs: Sequence[str] = (), where: str | None = None
) -> list[str] | None:
    """The run ids gc thins: ``refs`` (ids or unique prefixes) and/or those matching ``where``.

    Returns None when neither is given (every run). ``where`` is a predicate over
    the dataframe view's columns, as in ``retrolog replay``.
    """
    if not refs and not where:
        return None
    chosen = [resolve_run(conn, ref) for ref in refs]
    if where:
        matching = matching_runs(conn, where)
        order = [r for (r,) in conn.execute("SELECT run_id FROM runs ORDER BY started_at")]
        matched = [r for r in order if r in matching]
        chosen = [r for r in chosen if r in matching] if refs else matched
    return list(dict.fromkeys(chosen))


# -- planning ----------------------------------------------------------------------------


def plan_gc(
    conn: sqlite3.Connection,
    store: ObjectStore,
    policy: RetentionPolicy,
    runs: Sequence[str] | None = None,
    *,
    grace_seconds: float = GRACE_SECONDS,
    now: float | None = None,
) -> GcReport:
    """What ``policy`` would delete, without deleting anything.

    runs: the runs whose checkpoints the policy thins (None: every run).
        Unreferenced objects are collected store-wide whatever the runs.
    grace_seconds: objects and temp files written this recently are kept, as
        are objects written since the oldest running run started.
    """
    if not grace_seconds >= 0:
        raise UsageError(f"The grace period must be 0 seconds or more, not {grace_seconds!r}.")
    now = time.time() if now is None else now
    try:
        with read_snapshot(conn):
            if policy.keep is Keep.BEST:
                _require_metric(conn, policy.metric or "")
            protected = _protected_runs(conn, now)
            retention = [
                _retain(conn, policy, run_id, status, refs, protected.get(run_id))
                for run_id, status, refs in _checkpoints_by_run(conn, runs)
            ]
            dropped = {ref.checkpoint_id for run in retention for ref in run.dropped}
            kept_rows = [row for row in _all_rows(conn) if row[0] not in dropped]
            code = _code_manifests(conn)
            cutoff, reason = _cutoff(conn, now, grace_seconds)
    except database_errors(conn) as exc:
        raise StoreError(f"Cannot read the checkpoints from the store: {exc}.") from exc
    report = GcReport(
        policy=policy,
        runs=[run for run in retention if run.dropped or run.note],
        objects=[],
        temp_files=[],
        unreadable=[],
        cutoff=cutoff,
        cutoff_reason=reason,
        grace_seconds=grace_seconds,
    )
    _find_garbage(store, report, kept_rows, now, code)
    return report


def collect_garbage(
    conn: sqlite3.Connection, store: ObjectStore, plan: GcReport, *, now: float | None = None
) -> GcReport:
    """Delete what ``plan`` (from :func:`plan_gc`) drops, then the objects nothing references.

    Unreferenced objects are found again after the rows are deleted, so a
    checkpoint added meanwhile keeps its objects. Returns what was done.
    """
    ids = [ref.checkpoint_id for ref in plan.dropped]
    deleted = 0
    try:
        with write_transaction(conn):
            for start in range(0, len(ids), _CHUNK):
                chunk = ids[start : start + _CHUNK]
                marks = ", ".join("?" * len(chunk))
                cursor = conn.execute(
                    f"DELETE FROM checkpoints WHERE checkpoint_id IN ({marks})"
                    " AND run_id NOT IN (SELECT run_id FROM runs WHERE status = 'running')",
                    chunk,
                )
                deleted += max(cursor.rowcount, 0)
        now = time.time() if now is None else now
        with read_snapshot(conn):
            kept_rows = _all_rows(conn)
            code = _code_manifests(conn)
            cutoff, reason = _cutoff(conn, now, plan.grace_seconds)
    except database_errors(conn) as exc:
        raise StoreError(f"Cannot delete checkpoint rows from the store: {exc}.") from exc
    done = GcReport(
        policy=plan.policy,
        runs=plan.runs,
        objects=[],
        temp_files=[],
        unreadable=[],
        cutoff=cutoff,
        cutoff_reason=reason,
        grace_seconds=plan.grace_seconds,
        done=True,
        checkpoints_deleted=deleted,
    )
    candidates = _find_garbage(store, done, kept_rows, now, code)
    done.objects = [f for f in candidates if f.key and store.remove_if_stale(f.key, cutoff)]
    # The same cutoff as objects: a temp file written since a running run started may be
    # its writer's object halfway through, and deleting it fails that write.
    done.temp_files = [t for t in done.temp_files if store.remove_temp(t.name, cutoff)]
    skipped = len(candidates) - len(done.objects)
    if skipped:
        done.notes.append(f"{skipped} object(s) were written again during the collection: kept")
    return done


# -- policies ----------------------------------------------------------------------------


def _retain(
    conn: sqlite3.Connection,
    policy: RetentionPolicy,
    run_id: str,
    status: str,
    refs: list[CheckpointRef],
    protected: str | None,
) -> RunRetention:
    blocks = [ref for ref in refs if ref.kind == "block"]
    # Only block checkpoints are ever dropped: the end one answers suffix queries,
    # and a kind this version does not know is kept.
    others = [ref for ref in refs if ref.kind != "block"]
    if policy.keep is Keep.ALL:
        return RunRetention(run_id, status, refs, [])
    if protected is not None:
        return RunRetention(run_id, status, refs, [], f"{protected}: all its checkpoints are kept")
    if policy.keep is Keep.LAST:
        keep = blocks[len(blocks) - policy.count :] if policy.count else []
        return _split(run_id, status, refs, {r.checkpoint_id for r in keep + others})
    assert policy.metric is not None
    values = _metric_values(conn, run_id, blocks, policy.metric)
    if not values:
        note = None
        if blocks:
            note = (
                f"no checkpointed iteration logged {policy.metric!r} (in the outer-loop "
                "iteration or a loop nested in it): all its checkpoints are kept"
            )
        return RunRetention(run_id, status, refs, [], note)
    order = {ref.checkpoint_id: i for i, ref in enumerate(blocks)}
    sign = 1.0 if policy.maximize else -1.0
    # Ties go to the later iteration: the same score with more training.
    best = max(values, key=lambda ref: (sign * values[ref], order[ref.checkpoint_id]))
    return _split(run_id, status, refs, {best.checkpoint_id} | {r.checkpoint_id for r in others})


def _split(run_id: str, status: str, refs: list[CheckpointRef], keep: set[int]) -> RunRetention:
    kept = [ref for ref in refs if ref.checkpoint_id in keep]
    dropped = [ref for ref in refs if ref.checkpoint_id not in keep]
    return RunRetention(run_id, status, kept, dropped)


def _metric_values(
    conn: sqlite3.Connection, run_id: str, blocks: Sequence[CheckpointRef], metric: str
) -> dict[CheckpointRef, float]:
    """Each block checkpoint's value of ``metric``, where its outer-loop iteration has one.

    The value is the one logged in the iteration's own context (the checkpoint's
    ctx_id), e.g. a validation accuracy computed after the nested training loop;
    when the iteration has none, the last one logged in a loop nested in it.
    Recorded values win over backfilled ones, later over earlier (as in the
    dataframe). Non-numbers and NaN are ignored.
    """
    by_ctx = {ref.ctx_id: ref for ref in blocks if ref.ctx_id is not None}
    if not by_ctx:
        return {}
    parents = {loop.ctx_id: loop.parent_ctx for loop in reads.loop_contexts(conn, run_id)}
    owner: dict[int, int | None] = {}

    def owning(ctx: int) -> int | None:
        """The checkpointed iteration context ``ctx`` is in (itself or an ancestor)."""
        path: list[int] = []
        found: int | None = None
        current: int | None = ctx
        while current is not None:
            if current in owner:
                found = owner[current]
                break
            path.append(current)
            if current in by_ctx:
                found = current
                break
            current = parents.get(current)
        for visited in path:
            owner[visited] = found
        return found

    best_rank: dict[int, tuple[bool, bool, int]] = {}
    values: dict[int, float] = {}
    for ctx, value, value_type, origin, log_id in conn.execute(
        f"SELECT ctx_id, {number_of(conn)}, value_type, origin, log_id FROM logs"
        " WHERE name = ? AND run_id = ? AND ctx_id IS NOT NULL",
        (metric, run_id),
    ):
        if value_type not in ("float", "int", "bool") or value is None:
            continue
        number = float(value)
        if math.isnan(number):
            continue
        at = owning(ctx)
        if at is None:
            continue
        rank = (ctx == at, origin == "recorded", log_id)
        if at not in best_rank or rank > best_rank[at]:
            best_rank[at] = rank
            values[at] = number
    return {by_ctx[ctx]: value for ctx, value in values.items()}


def _require_metric(conn: sqlite3.Connection, name: str) -> None:
    if reads.name_logged(conn, name):
        return
    import difflib

    known = logged_names(conn)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    listing = ", ".join(known[:30]) + (", ..." if len(known) > 30 else "") if known else "(none)"
    raise UnknownNameError(
        f"No run logged {name!r}, so best:{name} cannot choose checkpoints; the names logged "
        f"in this store are: {listing}.{hint}",
        name=name,
    )


# -- reading the store -------------------------------------------------------------------


def _checkpoints_by_run(
    conn: sqlite3.Connection, runs: Sequence[str] | None
) -> list[tuple[str, str, list[CheckpointRef]]]:
    sql = (
        "SELECT c.checkpoint_id, c.run_id, c.ctx_id, c.kind, l.iteration, c.manifest, c.nbytes,"
        " COALESCE(r.status, 'unknown') FROM checkpoints c"
        " LEFT JOIN loops l ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id"
        " LEFT JOIN runs r ON r.run_id = c.run_id"
    )
    params: tuple[Any, ...] = ()
    if runs is not None:
        sql += f" WHERE c.run_id IN ({', '.join('?' * len(runs)) or 'NULL'})"
        params = tuple(runs)
    # Execution order: ctx ids grow as loops run; the end checkpoint comes last.
    sql += " ORDER BY r.started_at, c.run_id, c.ctx_id IS NULL, c.ctx_id, c.checkpoint_id"
    grouped: dict[str, tuple[str, list[CheckpointRef]]] = {}
    for cid, run_id, ctx, kind, iteration, manifest, nbytes, status in conn.execute(sql, params):
        ref = CheckpointRef(cid, run_id, ctx, kind, iteration, manifest, nbytes)
        grouped.setdefault(run_id, (status, []))[1].append(ref)
    return [(run_id, status, refs) for run_id, (status, refs) in grouped.items()]


def _all_rows(conn: sqlite3.Connection) -> list[tuple[int, str, str, str]]:
    """(checkpoint_id, manifest, run_id, position) of every checkpoint row."""
    return [
        (cid, manifest, run_id, "end" if kind == "end" else str(iteration))
        for cid, manifest, run_id, kind, iteration in conn.execute(
            "SELECT c.checkpoint_id, c.manifest, c.run_id, c.kind, l.iteration"
            " FROM checkpoints c LEFT JOIN loops l ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id"
        )
    ]


def _code_manifests(conn: sqlite3.Connection) -> dict[str, list[str]]:
    """Each code manifest a run references (docs/code-versions.md), with its runs."""
    found: dict[str, list[str]] = {}
    for run_id, manifest in conn.execute(
        "SELECT run_id, code_manifest FROM runs WHERE code_manifest IS NOT NULL"
    ):
        found.setdefault(manifest, []).append(run_id)
    return found


def _protected_runs(conn: sqlite3.Connection, now: float) -> dict[str, str]:
    """Runs whose checkpoint rows must stay, and why."""
    protected = {run_id: "the run is still recording" for run_id in reads.running_run_ids(conn)}
    # Replay workers restore the checkpoints their plan named when the replay started.
    # replay_runs is written when a replay ends, so the runs in use are those of its script.
    for replay_id, filename in conn.execute(
        "SELECT replay_id, filename FROM replays WHERE status = 'running' AND started_at > ?",
        (now - REPLAY_STALE_SECONDS,),
    ):
        for run_id in reads.runs_of_script(conn, filename):
            protected.setdefault(run_id, f"replay {replay_id} of {filename} is in progress")
    return protected


def _cutoff(conn: sqlite3.Connection, now: float, grace_seconds: float) -> tuple[float, str]:
    """The time before which an unreferenced object may be deleted, and why it is that."""
    cutoff = now - grace_seconds
    reason = (
        f"objects written in the last {format_duration(grace_seconds)} are kept"
        if grace_seconds
        else "no grace period"
    )
    oldest = reads.oldest_running_run(conn)
    if oldest is not None and oldest[1] - _CLOCK_SLACK < cutoff:
        cutoff = oldest[1] - _CLOCK_SLACK
        reason = f"objects written since running run {oldest[0]} started are kept"
    return cutoff, reason


def _find_garbage(
    store: ObjectStore,
    report: GcReport,
    kept_rows: Sequence[tuple[int, str, str, str]],
    now: float,
    code: Mapping[str, Sequence[str]] | None = None,
) -> list[StoredFile]:
    """Fill ``report``'s object and temp lists from a scan of the store; returns the objects.

    code: the runs' code manifests (manifest -> runs): they and their files are live too.
    """
    users: dict[str, list[str]] = {}
    for _, manifest, run_id, position in kept_rows:
        users.setdefault(manifest, []).append(f"{run_id} at {position}")
    live, unreadable = live_objects(store, users)
    code_live, code_failed = code_objects(store, code or {})
    live |= code_live
    for manifest, reason in code_failed.items():
        runs = tuple(f"code of {run_id}" for run_id in (code or {})[manifest])
        unreadable.append(UnreadableManifest(manifest, runs, reason))
    report.unreadable = unreadable
    objects, temps = store.scan()
    report.objects_total = len(objects)
    report.bytes_total = sum(f.size for f in objects)
    garbage = [f for f in objects if f.key not in live]
    report.recent_unreferenced = sum(1 for f in garbage if f.mtime >= report.cutoff)
    garbage = [f for f in garbage if f.mtime < report.cutoff]
    if unreadable:
        report.notes.append(
            f"{len(unreadable)} kept checkpoint manifest(s) cannot be read, so the objects they "
            f"reference are unknown: no object is deleted ({len(garbage)} would have been)"
        )
        garbage = []
    report.objects = garbage
    report.temp_files = [t for t in temps if t.mtime < report.cutoff]
    return garbage


def live_objects(
    store: ObjectStore, manifests: Mapping[str, Sequence[str]]
) -> tuple[set[str], list[UnreadableManifest]]:
    """The keys the ``manifests`` reference (themselves included), and those that failed.

    manifests: manifest key -> the checkpoints using it (for the report).
    """
    live: set[str] = set()
    unreadable: list[UnreadableManifest] = []
    for manifest in sorted(manifests):
        live.add(manifest)
        try:
            live |= manifest_blobs(manifest, store)
        except (RetrologError, OSError, ValueError) as exc:
            # Missing, damaged, or not JSON: what it references cannot be known.
            unreadable.append(UnreadableManifest(manifest, tuple(manifests[manifest]), str(exc)))
    return live, unreadable


# -- formatting --------------------------------------------------------------------------


def format_report(report: GcReport, *, table: bool = True) -> str:
    """The report as text: one line per run that changes (unless not ``table``), then totals."""
    verb = "deleted" if report.done else "would delete"
    title = f"Garbage collection keeping {report.policy}" + ("" if report.done else " (plan)")
    lines = [title, ""]
    rows = []
    for run in report.runs:
        rows.append(
            (
                run.run_id,
                run.status,
                format_positions(run.kept),
                format_positions(run.dropped),
            )
        )
    if rows and table:
        header = ("run", "status", "kept", verb)
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = zip(row, widths, strict=True)
            lines.append("  ".join(str(c).ljust(w) for c, w in cells).rstrip())
        lines.append("")
    checkpoints = report.checkpoints_deleted if report.done else len(report.dropped)
    temp = f" and {len(report.temp_files)} leftover temp file(s)" if report.temp_files else ""
    lines.append(
        f"{verb} {checkpoints} checkpoint(s) and {len(report.objects)} of "
        f"{report.objects_total} object(s){temp}: {format_bytes(report.bytes_freed)} freed "
        f"of {format_bytes(report.bytes_total)}"
    )
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.cutoff))
    lines.append(f"{report.cutoff_reason} (none written after {when} is deleted)")
    if report.recent_unreferenced:
        lines.append(
            f"{report.recent_unreferenced} unreferenced object(s) are that recent: kept for now"
        )
    notes = [f"  {run.run_id}: {run.note}" for run in report.runs if run.note]
    notes += [f"  {note}" for note in report.notes]
    for u in report.unreadable:
        notes.append(
            f"  manifest {u.manifest} of {', '.join(u.checkpoints)} cannot be read: {u.reason}"
        )
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


def format_positions(refs: Sequence[CheckpointRef]) -> str:
    """Positions as ranges: 0-3, 5, end."""
    if not refs:
        return "-"
    numbers = sorted({r.position for r in refs if isinstance(r.position, int)})
    parts: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        parts.append(str(numbers[i]) if i == j else f"{numbers[i]}-{numbers[j]}")
        i = j + 1
    parts += [str(r.position) for r in refs if not isinstance(r.position, int)]
    return ", ".join(parts)


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units (kB, MB, GB)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - the loop returns at GB


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m, h or d (``90s``, ``1h``)."""
    match = _DURATION.match(text)
    if not match:
        raise UsageError(
            f"{text!r} is not a duration; give a number of seconds or a number with a unit "
            "s, m, h or d, e.g. 30m or 1h."
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def format_duration(seconds: float) -> str:
    """``seconds`` the way :func:`parse_duration` reads it, in the largest whole unit."""
    for unit in ("d", "h", "m"):
        if seconds >= _UNIT_SECONDS[unit] and seconds % _UNIT_SECONDS[unit] == 0:
            return f"{seconds / _UNIT_SECONDS[unit]:.0f}{unit}"
    return f"{seconds:g}s"
