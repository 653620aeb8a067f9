"""Moving a store's objects to another object store (``retrolog migrate --objects URL``).

A project that started with its checkpoints and code copies in ``.retrolog/objects``
moves them to where a team shares them (``s3://bucket/prefix``), in three steps:

1. **Code copies back-filled.** Runs recorded before code versions were kept in the
   object store get theirs now, exported from their git refs into the current
   objects, so they move with the rest (docs/code-versions.md).
2. **Objects copied, then verified.** Every object is read (verified against its key),
   put at the target (a put that finds it there writes nothing), then read back from
   the target and verified again: a key is the sha256 or the xxh3 of the content, so
   a verified read is a checksum comparison. Counts and bytes are reported.
3. **The setting switched.** Only when every object verified: ``objects_url`` is set
   in the store's ``config.toml``, so every later command and recording of this
   checkout uses the target. The local objects are left as they were.

Nothing is deleted anywhere, so running it again is safe: it copies what is missing
(runs recorded since, into a location an environment variable kept pointing at) and
verifies everything again. It refuses while a run records, since what that run
writes after the copy would be missing from the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrolog._config import BY_KEY, STORE_FILE, mask, read_file
from retrolog.errors import StoreError, VersionError
from retrolog.store.backends import open_object_store
from retrolog.store.metastore import dialect_of
from retrolog.store.objects import ObjectStore, in_order
from retrolog.store.paths import ProjectPaths
from retrolog.store.reads import run_ids_oldest_first, running_run_ids, runs_without_code_copy
from retrolog.store.sqlite_metadata import mark_dead_runs_crashed
from retrolog.store.transfer import TransferReport

OBJECTS_URL = BY_KEY["objects_url"]


@dataclass
class MigrationPlan:
    """What a migration will do, before it does it (``--dry-run`` shows this)."""

    source: str
    target: str
    objects: int = 0
    nbytes: int = 0
    missing: int = 0  # objects not yet at the target
    missing_bytes: int = 0
    code_to_backfill: list[str] = field(default_factory=list)  # run ids without a code copy

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MigrationReport(MigrationPlan):
    """What a migration did."""

    copied: int = 0
    copied_bytes: int = 0
    verified: int = 0
    verified_bytes: int = 0
    code_backfilled: list[str] = field(default_factory=list)
    code_unavailable: dict[str, str] = field(default_factory=dict)  # run id -> why
    config_file: str | None = None  # where objects_url was set
    still_overridden: str | None = None  # a variable that keeps pointing elsewhere


def plan_migration(
    paths: ProjectPaths, conn: sqlite3.Connection, source: ObjectStore, target: ObjectStore
) -> MigrationPlan:
    """Count what moving ``source``'s objects to ``target`` involves; refuse if it is unsafe."""
    if _same_place(source, target):
        raise StoreError(
            f"The objects are already at {target.location}: nothing to migrate. "
            "`retrolog config` shows where they are read from and why."
        )
    _refuse_while_recording(conn, source.location, target.location)
    plan = MigrationPlan(source=source.location, target=target.location)
    plan.code_to_backfill = runs_without_code_copy(conn)
    files = source.scan()[0]
    plan.objects = len(files)
    plan.nbytes = sum(f.size for f in files)
    there = in_order(target.has, [f.key or "" for f in files], target.parallel_requests)
    for stored, present in zip(files, there, strict=True):
        if not present:
            plan.missing += 1
            plan.missing_bytes += stored.size
    return plan


def migrate_objects(
    paths: ProjectPaths,
    conn: sqlite3.Connection,
    source: ObjectStore,
    target_url: str,
    *,
    say: Callable[[str], None] = lambda _: None,
) -> MigrationReport:
    """Back-fill code copies, copy and verify every object, then switch ``objects_url``
    to ``target_url`` (as given: a URL or a path).

    Raises StoreError (nothing switched) when an object cannot be read, written or
    verified; what was copied stays, and a second run picks up from there.
    """
    target = open_object_store(target_url)
    plan = plan_migration(paths, conn, source, target)
    report = MigrationReport(**plan.to_dict())
    if plan.code_to_backfill:
        say(f"copying the code versions of {len(plan.code_to_backfill)} run(s) into the objects")
        _backfill_code(paths, conn, source, plan.code_to_backfill, report)
    files = source.scan()[0]  # again: the code copies are new objects
    keys = [f.key for f in files if f.key is not None]
    sizes = {f.key: f.size for f in files}
    report.objects, report.nbytes = len(keys), sum(sizes[k] for k in keys)
    there = dict(zip(keys, in_order(target.has, keys, target.parallel_requests), strict=True))
    missing = [k for k in keys if not there[k]]
    say(f"copying {len(missing)} of {len(keys)} object(s) to {target.location}")
    contents = (data for _, data in source.get_all(missing))  # each verified as it is read
    for key, put in zip(missing, target.put_all(contents), strict=True):
        if put != key:  # not expected: a verified read hashes to its key
            raise StoreError(f"Object {key} was stored at {target.location} as {put}.")
        report.copied += 1
        report.copied_bytes += sizes[key]
    say(f"verifying {len(keys)} object(s) at {target.location}")
    for key, data in target.get_all(keys):  # raises at the first that is missing or damaged
        if len(data) != sizes[key]:
            raise StoreError(
                f"Object {key} at {target.location} holds {len(data)} bytes where "
                f"{source.location} holds {sizes[key]}. The setting was not switched."
            )
        report.verified += 1
        report.verified_bytes += len(data)
    report.config_file = str(_set_setting(paths.store, "objects_url", target_url))
    override = _environment_override(target_url)
    if override:
        report.still_overridden = override
    return report


def _refuse_while_recording(conn: Any, source: str, target: str) -> None:
    """Stop, nothing copied, while a run records into ``source``: what it wrote after
    the copy would be missing from ``target``."""
    if dialect_of(conn).embedded:  # a server's store marks them when it is opened
        mark_dead_runs_crashed(conn)
    running = running_run_ids(conn)
    if running:
        raise StoreError(
            f"Run(s) {', '.join(running)} are still recording into {source}; what they "
            f"write after the copy would be missing from {target}. Let them finish (or stop "
            "them), then run `retrolog migrate` again. Nothing was copied."
        )


def _backfill_code(
    paths: ProjectPaths,
    conn: sqlite3.Connection,
    store: ObjectStore,
    runs: list[str],
    report: MigrationReport,
) -> None:
    from retrolog.versions.portable import export_code, readable_version

    for run_id in runs:
        cursor = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        names = [column[0] for column in cursor.description]
        row = dict(zip(names, cursor.fetchone(), strict=True))
        try:
            version = readable_version(row, store_dir=paths.store, root=paths.root)
            key, manifest = export_code(version.git_dir, version.rev, store)
        except VersionError as exc:
            report.code_unavailable[run_id] = str(exc)
            continue
        if manifest.tree != row.get("code_tree"):
            report.code_unavailable[run_id] = (
                f"its code version {row['code_commit']} has tree {manifest.tree}, the run "
                f"recorded {row.get('code_tree')}"
            )
            continue
        conn.execute("UPDATE runs SET code_manifest = ? WHERE run_id = ?", (key, run_id))
        report.code_backfilled.append(run_id)


def _same_place(a: ObjectStore, b: ObjectStore) -> bool:
    root_a, root_b = getattr(a, "root", None), getattr(b, "root", None)
    if isinstance(root_a, Path) and isinstance(root_b, Path):
        return root_a.resolve() == root_b.resolve()
    return a.location.rstrip("/") == b.location.rstrip("/")


def _set_setting(store_dir: Path, key: str, value: str) -> Path:
    """Set ``key`` in the store's config.toml (keeping the rest); the file's path."""
    path = store_dir / STORE_FILE
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    line = f"{key} = {json.dumps(value)}"  # a TOML basic string
    existing = re.compile(rf"^\s*{re.escape(key)}\s*=.*$", re.MULTILINE)
    if existing.search(before):
        after = existing.sub(lambda _: line, before, count=1)
    else:
        after = before + ("" if not before or before.endswith("\n") else "\n") + line + "\n"
    temp = path.with_name(f".{path.name}.migrate.tmp")
    temp.write_text(after, encoding="utf-8")
    try:
        if read_file(temp, None).get(key) != value:
            raise StoreError(
                f"Could not set {key} in {path} (the edited file does not read back as "
                f"{mask(value)!r}). Set `{key} = ...` there by hand."
            )
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    temp.replace(path)
    return path


def _environment_override(location: str) -> str | None:
    """The environment variable that would keep the objects elsewhere, if one is set."""
    import os

    value = os.environ.get(OBJECTS_URL.env, "").strip()
    return OBJECTS_URL.env if value and value != location else None


def migrate_database(
    paths: ProjectPaths,
    conn: sqlite3.Connection,
    url: str,
    *,
    dry_run: bool = False,
    confirm: Callable[[TransferReport], bool] | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> TransferReport:
    """Copy the embedded store's runs into the PostgreSQL database ``url``, verify each,
    then set ``database_url`` in the store's config.toml (store/transfer.py).

    dry_run: only say which runs would be copied (a database with no retrolog store
    yet is left without one). confirm: called with that plan first; False stops.
    Raises StoreError, the setting unchanged, while a run records, when a run is in
    the database with other rows than here, or when a copy does not read back.
    """
    from retrolog.store.metastore import DATABASE_URL_ENV
    from retrolog.store.postgres_metadata import PostgresMetadata, has_store
    from retrolog.store.transfer import copy_into_postgresql

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("postgresql", "postgres"):
        raise StoreError(
            f"--to takes a PostgreSQL URL such as postgresql://user@host:5432/dbname, not "
            f"{mask(url)!r}."
        )
    _refuse_while_recording(conn, str(paths.database), mask(url))
    empty = not has_store(url)
    if empty:  # a plan that writes nothing: every run would be copied
        plan = TransferReport(source=str(paths.database), target=mask(url))
        plan.runs = _all_runs(conn)
    else:
        with _opened(PostgresMetadata(url, create=False)) as target:
            plan = copy_into_postgresql(conn, target, source=str(paths.database), dry_run=True)
    _refuse_differing(plan)
    if dry_run or (confirm is not None and not confirm(plan)):
        return plan
    with _opened(PostgresMetadata(url, create=True)) as target:
        report = copy_into_postgresql(conn, target, source=str(paths.database), say=say)
    _refuse_differing(report)
    if _has_password(url):
        report.password_kept_out = True
    else:
        report.config_file = str(_set_setting(paths.store, "database_url", url))
    override = os.environ.get(DATABASE_URL_ENV, "").strip()
    if override and override != url:
        report.still_overridden = DATABASE_URL_ENV
    return report


@contextlib.contextmanager
def _opened(metadata: Any) -> Iterator[Any]:
    try:
        yield metadata
    finally:
        metadata.close()


def _all_runs(conn: sqlite3.Connection) -> list[Any]:
    """Every local run, as a plan to copy it, with its rows in the per-run tables."""
    from retrolog.store.transfer import PER_RUN, RunTransfer

    rows: dict[str, int] = {}
    for table in PER_RUN:
        for run_id, count in conn.execute(f"SELECT run_id, count(*) FROM {table} GROUP BY run_id"):
            rows[run_id] = rows.get(run_id, 0) + count
    return [RunTransfer(r, "copied", rows.get(r, 0)) for r in run_ids_oldest_first(conn)]


def _refuse_differing(report: Any) -> None:
    differing = [r.run_id for r in report.runs if r.outcome == "differs"]
    if differing:
        raise StoreError(
            f"Run(s) {', '.join(differing)} are in {report.target} already with other rows "
            f"than in {report.source} (recorded there under the same id, or changed here "
            "since they were copied, e.g. by a replay). retrolog never overwrites a run "
            "there: compare them with `retrolog show RUN --json` against each store. "
            "Nothing was switched."
        )


def _has_password(url: str) -> bool:
    """Whether ``url`` holds a password (which retrolog never writes into a file)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    return bool(parts.password) or "password=" in parts.query.lower()


def require_embedded_source(paths: ProjectPaths) -> None:
    """Refuse ``migrate --to`` when the metadata is not in the embedded store."""
    from retrolog.store.metastore import DATABASE_URL_ENV, database_url

    current = database_url()
    if current is not None:
        raise StoreError(
            f"This project's metadata is in {mask(current)} already (database_url), not in "
            f"the embedded store; `retrolog migrate --to` copies the embedded store "
            f"{paths.database} into PostgreSQL. Unset {DATABASE_URL_ENV} (or database_url in "
            "the settings files) to copy it."
        )
