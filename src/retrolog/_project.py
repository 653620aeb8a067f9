"""``retrolog.Project``: one project's store, as the CLI, the Python API and the UI use it.

Every reading and replaying entry point goes through this object, so the
`retrolog` command, `rl.dataframe(...)` and the dashboard cannot drift apart:
they call the same methods with the same arguments and get the same errors.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from retrolog._replay.request import ReplayRequest
from retrolog.store.paths import ProjectPaths, locate

if TYPE_CHECKING:
    import pandas as pd

    from retrolog._gc import GcReport, RetentionPolicy
    from retrolog._migrate import MigrationPlan, MigrationReport
    from retrolog._query.series import Group, Series, SeriesCache
    from retrolog._replay.replayer import ReplayResult
    from retrolog.store.cancel import Cancellation
    from retrolog.store.metastore import MetadataStore
    from retrolog.store.transfer import TransferReport


_CACHE_LOCK = threading.Lock()


class Project:
    """The runs recorded for one project, and what can be asked of them.

    path: any directory inside the project (default: the current directory). The
        project is the git work tree holding it, or the directory itself outside
        git; its store is ``<root>/.retrolog`` unless RETROLOG_STORE names another.

    Example::

        project = retrolog.Project()
        project.runs()                      # one row per run
        project.dataframe("lr", "acc")      # the wide view
        project.replay("w_norm", dry_run=True)
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.paths: ProjectPaths = locate(Path(path) if path is not None else None)
        self._series_cache: SeriesCache | None = None  # made at the first series asked for

    def __repr__(self) -> str:
        return f"Project({str(self.paths.root)!r})"

    @property
    def root(self) -> Path:
        """The project's root directory."""
        return self.paths.root

    def config(self) -> list[dict[str, str]]:
        """Every setting: its key, environment variable, value in effect and where it came from.

        A value set nowhere shows its default. A password in a URL is masked;
        the settings files and the environment are read, never written.
        """
        from retrolog._config import resolve
        from retrolog.store.paths import STORE_DIRNAME

        return [
            {
                "key": r.setting.key,
                "env": r.setting.env,
                "value": r.shown(),
                "source": r.source,
                "help": r.setting.help,
            }
            for r in resolve(self.paths.root, self.paths.root / STORE_DIRNAME)
        ]

    @contextlib.contextmanager
    def reader(self) -> Iterator[sqlite3.Connection]:
        """A read-only connection to the store (a clear StoreError when there is none)."""
        from retrolog.store.sqlite_metadata import open_store

        conn = open_store(self.paths, create=False, write=False)
        try:
            yield conn
        finally:
            conn.close()

    @contextlib.contextmanager
    def _metadata(self) -> Iterator[MetadataStore]:
        """The store's metadata (store/metastore.py's seam, in the backend ``database_url``
        names), opened for reading; its reads stop when the active cancellation is
        cancelled."""
        from retrolog.store.cancel import cancellable, cancelled, watched
        from retrolog.store.metastore import open_metadata

        metadata = open_metadata(self.paths, create=False)
        try:
            with cancellable(metadata.interrupt):
                reader = metadata.reader()
                if watched() and isinstance(reader, sqlite3.Connection):
                    # interrupt() stops the statement running; this one, those after it.
                    reader.set_progress_handler(cancelled, 10_000)
                yield metadata
        finally:
            metadata.close()

    @contextlib.contextmanager
    def _portable(self) -> Iterator[Any]:
        """The store's reader for the queries whose SQL both backends run (SQLite's
        connection, or PostgreSQL's reader: store/metastore.py's ``StoreReader``)."""
        with self._metadata() as metadata:
            yield metadata.reader()

    @staticmethod
    def cancellation() -> Cancellation:
        """A way to stop reads from another thread: every read of this project's store
        inside ``cancellation.active()`` stops when ``cancellation.cancel()`` is called,
        raising ReadCancelled (what the dashboard does when a client goes away)."""
        from retrolog.store.cancel import Cancellation

        return Cancellation()

    # -- reading ---------------------------------------------------------------------

    def check_readable(self) -> None:
        """Raise a StoreError that says what to do unless the store can be read: there is
        none yet, or its database cannot be reached."""
        with self._portable():
            pass

    def scripts(self) -> list[dict[str, Any]]:
        """The scripts that have runs, most recently run first, each with its run count."""
        with self._metadata() as metadata:
            return [script._asdict() for script in metadata.scripts()]

    def runs(self, limit: int | None = None) -> pd.DataFrame:
        """One row per run, oldest first (the newest ``limit`` with it): run_id, tstamp,
        filename, status, duration, args."""
        from retrolog._query.runs import list_runs
        from retrolog.store.metastore import open_metadata

        metadata = open_metadata(self.paths, create=False)
        try:
            return list_runs(metadata, limit)
        finally:
            metadata.close()

    def run(self, ref: str) -> dict[str, Any]:
        """Everything known about one run (an id or a unique prefix of one): metadata,
        code version, arguments, names, loops, checkpoints, backfills, timing profile."""
        from retrolog._query.runs import run_details

        with self._portable() as conn:
            return run_details(conn, ref)

    def names(self) -> list[str]:
        """Every name logged in the store (recorded or backfilled), sorted."""
        from retrolog._query.dataframe import logged_names

        with self._portable() as conn:
            return logged_names(conn)

    def matching(self, where: str) -> list[str]:
        """The ids of the runs ``where`` (a dataframe predicate) chooses, oldest first."""
        from retrolog._query.runs import matching_runs
        from retrolog.store.reads import run_ids_oldest_first

        with self._portable() as conn:
            chosen = matching_runs(conn, where)
            return [r for r in run_ids_oldest_first(conn) if r in chosen]

    def dataframe(
        self,
        *names: str,
        where: str | None = None,
        definitions: str = "any",
        runs: Sequence[str] | None = None,
    ) -> pd.DataFrame:
        """The wide view: one row per run and loop context, one column per name
        (see ``retrolog.dataframe``); ``runs``: only these run ids."""
        from retrolog._query.dataframe import dataframe
        from retrolog._query.lineage import today_keys

        with self._portable() as conn:
            today = today_keys(self.paths.root) if definitions == "current" else None
            return dataframe(
                conn, list(names), where, definitions=definitions, today=today, only=runs
            )

    def dataframe_page(
        self,
        *names: str,
        where: str | None = None,
        offset: int = 0,
        limit: int = 1000,
        definitions: str = "any",
        runs: Sequence[str] | None = None,
    ) -> tuple[pd.DataFrame, int]:
        """Rows ``offset`` to ``offset + limit`` of ``dataframe(...)`` (cut in SQL), and
        the number of rows of the whole view."""
        from retrolog._query.dataframe import dataframe_page
        from retrolog._query.lineage import today_keys

        with self._portable() as conn:
            today = today_keys(self.paths.root) if definitions == "current" else None
            return dataframe_page(
                conn, list(names), where, offset=offset, limit=limit,
                definitions=definitions, today=today, only=runs,
            )  # fmt: skip

    def query(self, sql: str) -> pd.DataFrame:
        """Read-only SQL over the store (tables: runs, loops, logs, checkpoints, profile)."""
        from retrolog._query.sql import query, query_shared
        from retrolog.store.metastore import open_metadata
        from retrolog.store.sqlite_metadata import SqliteMetadata

        metadata = open_metadata(self.paths, create=False)
        try:
            if isinstance(metadata, SqliteMetadata):
                return query(metadata.conn, sql)
            return query_shared(metadata, sql)
        finally:
            metadata.close()

    def lineage(self, run: str, name: str, at: dict[str, int] | None = None) -> dict[str, Any]:
        """How a run's values of ``name`` came to be (see ``retrolog.lineage``)."""
        from retrolog._query.lineage import explain

        with self._portable() as conn:
            return explain(conn, run, name, at)

    def checkpoints(self, run: str) -> list[dict[str, Any]]:
        """A run's checkpoints: kind, loop and iteration, size, capture and write time."""
        from retrolog._query.runs import checkpoint_list

        with self._portable() as conn:
            return checkpoint_list(conn, run)

    def checkpoint_positions(self, run: str) -> tuple[str, list[tuple[Any, ...]]]:
        """The run ``run`` names (a unique prefix is enough) and where its checkpoints are:
        (ctx_id, kind, outer-loop iteration, loop name, manifest key), what ``rl.restore``
        chooses from."""
        from retrolog._query.runs import checkpoint_positions
        from retrolog.errors import StoreError
        from retrolog.store.metastore import database_errors

        with self._portable() as conn:  # the embedded store, or PostgreSQL's reader
            errors = database_errors(conn)
            try:
                return checkpoint_positions(conn, run)
            except errors as exc:
                raise StoreError(
                    f"Cannot read the checkpoints of run {run} from the store: {exc}."
                ) from exc

    def export_checkpoint(
        self, run: str, at: int | str | None, out: str | os.PathLike[str] | IO[bytes]
    ) -> dict[str, Any]:
        """Write a run's checkpoint as the file ``torch.save`` writes, which
        ``torch.load(path, weights_only=True)`` reads back: a dict of the checkpoint's named
        objects (state_dicts, tensors, plain values) as it holds them.

        at: the outer-loop iteration whose block ended at the checkpoint, ``"end"``, or None
            (the end checkpoint, else the latest), as ``rl.restore`` chooses.
        out: a path (written whole or not at all) or a binary file open for writing.

        Returns the run id, loop, position and the names of the objects written. Needs torch
        here; a checkpoint holding a pickle is refused (nothing read from the store runs).
        """
        from retrolog._query.runs import checkpoint_at
        from retrolog.checkpoint.export import export_torch
        from retrolog.store.backends import object_store_for

        with self._portable() as conn:
            found = checkpoint_at(conn, run, at)
        position = "the end" if found["at"] == "end" else f"{found['loop']} {found['at']}"
        where = f"checkpoint at {position} of run {found['run_id']}"
        store = object_store_for(self.paths.store)
        if not isinstance(out, str | os.PathLike):
            names = export_torch(store, found["manifest"], out, where)
            return {**found, "names": names}
        target = Path(out)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as handle:
                names = export_torch(store, found["manifest"], handle, where)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return {**found, "names": names, "path": str(target)}

    def code(self, run: str, path: str | None = None) -> dict[str, Any]:
        """The code a run executed: its version's file list and the text of ``path``
        (default: its script), uncommitted edits included."""
        from retrolog._query.runs import run_code

        with self._portable() as conn:
            return run_code(conn, run, path)

    def compare(self, runs: Sequence[str]) -> dict[str, Any]:
        """Two or more runs: the arguments that differ and the code diff from the first
        run's version to each other's."""
        from retrolog._query.runs import compare_runs

        with self._portable() as conn:
            return compare_runs(conn, list(runs))

    def script_names(self, script: str) -> list[dict[str, Any]]:
        """The names the working copy of ``script`` (a path relative to the project root,
        as runs record it) logs today, in order, each with whether any run has it yet:
        what a replay can fill in."""
        from retrolog._query.dataframe import logged_names
        from retrolog.errors import UsageError
        from retrolog.versions.definitions import definitions
        from retrolog.versions.notebook import read_script

        path = (self.paths.root / script).resolve()
        if not path.is_relative_to(self.paths.root) or not path.is_file():
            raise UsageError(f"{script} is not a file of the project {self.paths.root}.")
        try:
            found = definitions(read_script(path), filename=script)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
            raise UsageError(f"Cannot read the names {script} logs today: {exc}.") from exc
        with self._portable() as conn:
            known = set(logged_names(conn))
        return [{"name": name, "new": name not in known} for name in found]

    def table(
        self,
        *,
        where: str | None = None,
        columns: Sequence[str] = (),
        sort: str = "started_at",
        descending: bool = True,
        offset: int = 0,
        limit: int | None = 100,
        status: Sequence[str] = (),
        default_columns: bool = False,
        ids: bool = False,
    ) -> dict[str, Any]:
        """A page of the runs table: fixed fields plus ``columns`` such as ``acc``
        (its last value), ``loss:min``, ``loss:mean`` or ``acc:first``, read from the
        runs' summaries; runs of ``status`` only; see _query/table.py."""
        from retrolog._query.table import Column, runs_table

        picked = [Column.parse(c) for c in columns]
        with self._portable() as conn:
            return runs_table(
                conn, where=where, columns=picked, sort=sort, descending=descending,
                offset=offset, limit=limit, status=status, default_columns=default_columns,
                ids=ids,
            )  # fmt: skip

    def series(
        self,
        name: str,
        runs: Sequence[str],
        *,
        x: str = "step",
        lo: float | None = None,
        hi: float | None = None,
        width: int | None = None,
        budget: int | None = None,
    ) -> list[Series]:
        """``name``'s values in each of ``runs`` (ids or unique prefixes), against ``x``
        ("step" or "time"), cut to [lo, hi] and downsampled to ``width`` pixel columns
        keeping each column's first, last, min and max, sending at most ``budget`` points
        over all runs together (see _query/series.py)."""
        from retrolog._query.runs import resolve_run
        from retrolog._query.series import series

        with self._portable() as conn:
            run_ids = [resolve_run(conn, r) for r in runs]
            return series(conn, name, run_ids, x=x, lo=lo, hi=hi, width=width,
                          budget=budget, cache=self._cache())  # fmt: skip

    def series_bytes(
        self,
        name: str | None,
        runs: Sequence[str],
        *,
        x: str = "step",
        lo: float | None = None,
        hi: float | None = None,
        width: int | None = None,
        budget: int | None = None,
    ) -> bytes:
        """``series(...)`` in the dashboard page's binary form: a JSON header, then the
        points as raw little-endian arrays (docs/ui.md, the API table). No ``name``: no
        series (a chart of nothing)."""
        from retrolog._query.series import encode_series

        if name is None:
            return encode_series([])
        found = self.series(name, runs, x=x, lo=lo, hi=hi, width=width, budget=budget)
        return encode_series(found)

    def index_series(
        self,
        *,
        min_values: int = 1000,
        skip: set[tuple[str, str, str]] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        progress: Callable[[int, int], None] = lambda done, todo: None,
    ) -> int:
        """Read every series of an ended run with at least ``min_values`` values into the
        disk cache, ahead of its first chart (the dashboard's indexer; see
        ``_query.series.index_series``). Returns how many it wrote; a store that cannot be
        written has no disk cache, and this is a UsageError there."""
        from retrolog._query.series import SeriesCache, index_series

        # Nothing is kept in this process's memory: the charts are drawn by another one.
        cache = SeriesCache(max_bytes=0, directory=self._cache().directory)
        with self._portable() as conn:
            return index_series(conn, cache, min_values=min_values, skip=skip,
                                should_stop=should_stop, progress=progress)  # fmt: skip

    def endings(self) -> tuple[Any, ...]:
        """A value that changes whenever a run or a replay starts or ends (what the indexer
        waits for before it looks for new series)."""
        with self._metadata() as metadata:
            return metadata.activity()

    @property
    def indexable(self) -> bool:
        """Whether series can be kept on disk (the store can be written)."""
        return self._cache().directory is not None

    def groups(
        self,
        name: str,
        runs: Sequence[str],
        by: str,
        *,
        x: str = "step",
        lo: float | None = None,
        hi: float | None = None,
        width: int = 800,
    ) -> list[Group]:
        """``name`` over ``runs`` grouped by the value of argument ``by``: per group and
        pixel column, the mean of its runs' values and their min and max (a band). A numeric
        argument of many values is binned (``_query.series.bin_keys``): a handful of groups,
        each keyed ``[low, high]``."""
        from retrolog._query.runs import resolve_run
        from retrolog._query.series import bin_keys, group_series, series
        from retrolog._query.table import argument_values

        with self._portable() as conn:
            run_ids = [resolve_run(conn, r) for r in runs]
            found = series(conn, name, run_ids, x=x, lo=lo, hi=hi, cache=self._cache())
            keys = argument_values(conn, run_ids, by)
        return group_series(found, bin_keys(keys), width, lo, hi)

    def _cache(self) -> SeriesCache:
        """Whole series of ended runs, kept between calls (redrawing and zooming a chart)."""
        from retrolog._query.series import SeriesCache
        from retrolog.store.sqlite_metadata import store_writable

        with _CACHE_LOCK:
            if self._series_cache is None:
                # Kept on disk too, where the store can be written: .retrolog/cache/ is
                # derived data, safe to delete at any time.
                directory = self.paths.store / "cache" / "series"
                self._series_cache = SeriesCache(
                    directory=directory if store_writable(self.paths) else None
                )
            return self._series_cache

    # -- replaying -------------------------------------------------------------------

    def replay(
        self,
        names: str | Sequence[str] = (),
        where: str | None = None,
        *,
        script: str | None = None,
        workers: int | None = None,
        threads: int | None = None,
        dry_run: bool = False,
        force: bool = False,
        verify: bool = False,
        reuse: bool = True,
        confirm: Callable[[str], bool] | None = None,
        echo: Callable[[str], None] | None = None,
        progress: bool = True,
        executor: str | None = None,
        ray_address: str | None = None,
        request: ReplayRequest | None = None,
    ) -> ReplayResult:
        """Replay past runs to backfill ``names`` (see ``retrolog replay --help``).

        confirm: called with the plan's text before anything runs; False stops.
        echo: where the plan and the report go (default: stderr).
        executor, ray_address: where the workers run (docs/replay-on-ray.md).
        request: the options as one ReplayRequest, instead of as keywords.
        Returns the replay's result: per run its outcome, the runs found inexact.
        """
        from retrolog._replay.replayer import replay
        from retrolog.store.metastore import database_url

        given = ReplayRequest(
            names, where, script=script, workers=workers, threads=threads, dry_run=dry_run,
            force=force, verify=verify, reuse=reuse, progress=progress, executor=executor,
            ray_address=ray_address,
        )  # fmt: skip
        if request is None:
            request = given
        elif given != ReplayRequest():
            from retrolog.errors import UsageError

            raise UsageError(
                "Project.replay takes its options either as keywords or as request=, not "
                "both; put them all in the ReplayRequest."
            )
        extra: dict[str, Any] = {} if echo is None else {"echo": echo}
        url = database_url()
        if url is not None:  # through a working copy of the runs (_replay/working_copy.py)
            from retrolog._replay.working_copy import replay_shared

            return replay_shared(self.paths, url, request, confirm=confirm, **extra)
        with self.reader() as conn:
            return replay(conn, self.paths, request, confirm=confirm, **extra)

    # -- collecting ------------------------------------------------------------------

    def gc(
        self,
        runs: Sequence[str] = (),
        *,
        keep: str | RetentionPolicy = "all",
        where: str | None = None,
        grace_seconds: float | None = None,
        dry_run: bool = False,
        confirm: Callable[[GcReport], bool] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> GcReport:
        """Delete the checkpoints the retention policy ``keep`` drops (``all``, ``last:N``,
        ``best:NAME[:max|min]``) among ``runs`` (ids or prefixes) and/or those ``where``
        chooses, then the objects nothing references (see ``retrolog gc --help``).

        grace_seconds: objects written this recently are never deleted (default an
        hour). dry_run: the plan only. confirm: called with a plan that deletes
        something before anything is; False stops (the plan is returned). Returns
        the report; ``done`` says whether it deleted.
        """
        from retrolog._gc import (
            GRACE_SECONDS,
            RetentionPolicy,
            collect_garbage,
            plan_gc,
            select_runs,
        )
        from retrolog._replay.execute import sweep_stale
        from retrolog.errors import StoreError
        from retrolog.store.backends import object_store_for
        from retrolog.store.sqlite_metadata import is_readonly, read_only_error

        policy = keep if isinstance(keep, RetentionPolicy) else RetentionPolicy.parse(keep)
        with self._portable() as conn:
            may_delete = getattr(conn, "may_write", None)
            if may_delete is not None:  # PostgreSQL: what the role may do
                readonly = not may_delete("checkpoints", "DELETE")
                if readonly and not dry_run:
                    raise StoreError(
                        "gc deletes checkpoint rows, and the PostgreSQL role of database_url "
                        "may not DELETE from checkpoints. Run it as a role that may (`gc "
                        "--dry-run` shows the plan with this one)."
                    )
            else:
                readonly = is_readonly(conn)
                if readonly and not dry_run:
                    raise read_only_error(self.paths, "gc")
            if not readonly:
                # A replay whose coordinator was killed no longer holds runs back.
                sweep_stale(conn, self.paths.store)
            store = object_store_for(self.paths.store)
            chosen = select_runs(conn, runs, where)
            if chosen == [] and echo is not None:
                echo(f"No run matches {where!r}: no checkpoint is dropped.")
            grace = GRACE_SECONDS if grace_seconds is None else grace_seconds
            plan = plan_gc(conn, store, policy, chosen, grace_seconds=grace)
            if dry_run or plan.empty or (confirm is not None and not confirm(plan)):
                return plan
            return collect_garbage(conn, store, plan)

    # -- moving ----------------------------------------------------------------------

    def migrate_objects(
        self,
        url: str,
        *,
        dry_run: bool = False,
        confirm: Callable[[MigrationPlan], bool] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> MigrationPlan | MigrationReport:
        """Move this store's objects (checkpoints, code copies) to ``url`` and use them there.

        Back-fills the code copies of runs that have none, copies every object,
        reads each back and verifies it, and only then sets ``objects_url`` in the
        store's config.toml (see ``retrolog migrate --help``). Nothing is deleted;
        running it again copies what is missing. dry_run: the plan only.
        confirm: called with the plan before anything is written; False stops (the
        plan is returned). Raises StoreError when something cannot be copied or
        verified; the setting is then unchanged.
        """
        from retrolog._migrate import migrate_objects, plan_migration
        from retrolog.errors import StoreError
        from retrolog.store.backends import object_store_for, open_object_store
        from retrolog.store.sqlite_metadata import is_readonly, read_only_error

        with self._portable() as conn:
            may_write = getattr(conn, "may_write", None)
            if may_write is not None:  # PostgreSQL: what the role may do
                if not dry_run and not may_write("runs", "UPDATE"):
                    raise StoreError(
                        "migrate --objects records each run's code copy in the runs table, "
                        "and the PostgreSQL role of database_url may not UPDATE it. Run it "
                        "as a role that may (`--dry-run` shows the plan with this one)."
                    )
            elif is_readonly(conn) and not dry_run:
                raise read_only_error(self.paths, "migrate")
            source = object_store_for(self.paths.store)
            plan = plan_migration(self.paths, conn, source, open_object_store(url))
            if dry_run or (confirm is not None and not confirm(plan)):
                return plan
            return migrate_objects(self.paths, conn, source, url, say=echo or (lambda _: None))

    def migrate_database(
        self,
        url: str,
        *,
        dry_run: bool = False,
        confirm: Callable[[TransferReport], bool] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> TransferReport:
        """Copy this project's embedded store (runs, loops, logs, checkpoints' records,
        replays, definitions) into the PostgreSQL database ``url``, verify every run
        there, then set ``database_url`` in the store's config.toml (not when ``url``
        holds a password: put that in ~/.pgpass). Nothing is deleted; running it again
        copies only runs that are not there (see ``retrolog migrate --help``).

        dry_run: the plan only. confirm: called with the plan before anything is
        written; False stops. Raises StoreError, the setting unchanged, while a run
        records, or when a run is there already with other rows.
        """
        from retrolog._migrate import migrate_database, require_embedded_source

        require_embedded_source(self.paths)
        with self.reader() as conn:
            return migrate_database(
                self.paths,
                conn,
                url,
                dry_run=dry_run,
                confirm=confirm,
                say=echo or (lambda _: None),
            )
