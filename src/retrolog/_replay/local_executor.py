"""The local executor: a replay's workers as processes on this machine.

Each job runs in a temporary checkout (_replay/execute.py's ``run_jobs``); jobs
whose start plan says so are forked from fork servers that imported the run's
heavy modules once (_replay/forkserver.py). The server the newest run most likely
needs can start before the plan is made (:meth:`LocalExecutor.warm_up`), and what
the servers' imports took is kept for the next plan.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from retrolog._replay.execute import (
    COORDINATOR_FILE,
    Job,
    default_workers,
    die_with,
    run_jobs,
    run_worker_env,
    terminate_as_interrupt,
    worker_env,
)
from retrolog._replay.executor import Capacity, Coordinator
from retrolog._replay.forkserver import Launcher, StartPlan


class LocalExecutor:
    """Worker processes on this machine (``--executor local``, the default)."""

    name = "local"
    address: str | None = None

    def __init__(self, coordinator: Coordinator, address: str | None = None) -> None:
        self.coordinator = coordinator
        self.launcher: Launcher | None = None

    @staticmethod
    def resolve_address(given: str | None) -> str | None:
        """Local workers have no address: one given is a usage error."""
        from retrolog.errors import UsageError

        if given is not None:
            raise UsageError(
                f"--ray-address {given} was given, but this replay runs its workers as "
                "local processes; add --executor ray to run them on that Ray cluster."
            )
        return None

    def _launcher(self) -> Launcher:
        """The replay's worker launcher, its logs in the replay's directory."""
        if self.launcher is None:
            paths, replay_id = self.coordinator.paths, self.coordinator.replay_id
            logs_dir = paths.store / "replays" / replay_id
            logs_dir.mkdir(parents=True, exist_ok=True)
            self.launcher = Launcher(
                python=sys.executable, logs_dir=logs_dir, preexec=die_with(os.getpid())
            )
        return self.launcher

    def warm_up(self, env: Mapping[str, str], warm: Sequence[str]) -> None:
        self._launcher().prepare(env, warm)

    def capacity(self, threads: int) -> Capacity:
        return Capacity(workers=default_workers(threads), cores=None)

    def prepare(
        self,
        runs: Mapping[str, Mapping[str, Any]],
        starts: Mapping[str, StartPlan],
        echo: Callable[[str], None],
    ) -> dict[str, StartPlan]:
        """Start the fork servers the plan needs and wait for their imports; their figures.

        A server that cannot serve (its imports started a thread, it exited) makes its
        runs' workers new interpreters, with the reason, before the plan is shown. A
        server started early that no run needs is stopped.
        """
        if not starts and self.launcher is None:
            return {}
        launcher = self._launcher()
        servers = {}
        for run_id, start in starts.items():
            if start.forked:
                env = start.server_environment(server_env(runs[run_id]))
                servers[run_id] = launcher.prepare(env, start.warm)
        launcher.retain([s for s in servers.values() if s is not None])
        if not servers:
            return dict(starts)
        packages = sorted({p for s in starts.values() for p in s.packages})
        echo(f"Preparing the replay's workers: importing {', '.join(packages)} once ...")
        found = dict(starts)
        for run_id, server in servers.items():
            if server is None or not server.wait_ready() or server.ready is None:
                why = (server.unsafe if server is not None else None) or "its fork server exited"
                found[run_id] = StartPlan(reason=why)
                continue
            found[run_id] = replace(
                starts[run_id], warm_seconds=server.saved_seconds, forked_start=server.forked_start
            )
        return found

    def run(
        self,
        jobs: Sequence[Job],
        *,
        workers: int,
        on_done: Callable[[Job], None],
        echo: Callable[[str], None],
    ) -> None:
        launcher = self._launcher()
        launcher.used = True  # its logs are this replay's from here on
        for job in jobs:
            if job.start is not None and job.start.forked:
                launcher.prepare(job.start.server_environment(worker_env(job)), job.start.warm)
        paths = self.coordinator.paths
        try:
            with terminate_as_interrupt():
                run_jobs(
                    jobs, root=paths.root, store=paths.store, workers=workers, on_done=on_done,
                    launcher=launcher,
                )  # fmt: skip
        finally:
            launcher.close()
            for line in [*launcher.notes, launcher.summary()]:
                if line:
                    echo(line)
            _keep_warm_seconds(self.coordinator, launcher, jobs)

    def close(self) -> None:
        launcher = self.launcher
        if launcher is None:
            return
        launcher.close()
        claimed = (launcher.logs_dir / COORDINATOR_FILE).exists()
        if not launcher.used and not claimed:  # cancelled before any worker: no trace
            shutil.rmtree(launcher.logs_dir, ignore_errors=True)


def server_env(row: Mapping[str, Any]) -> dict[str, str]:
    """The environment of a run's fork server: the recorded numerical environment."""
    import json

    return run_worker_env(json.loads(row.get("numerics") or "null"))


def _keep_warm_seconds(coordinator: Coordinator, launcher: Launcher, jobs: Sequence[Job]) -> None:
    """What each fork server's imports took, for the next plan of runs with those modules."""
    for server in launcher.servers.values():
        if server.ready is None:
            continue
        digests = {
            j.start.digest for j in jobs if j.start is not None and j.start.warm == server.warm
        }
        if len(digests) == 1 and None not in digests:
            coordinator.conn.execute(
                "UPDATE module_sets SET warm_seconds = ? WHERE digest = ?",
                (server.saved_seconds, digests.pop()),
            )


if TYPE_CHECKING:  # mypy holds the class to the seam's protocol
    from retrolog._replay.executor import ExecutorClass

    _CONFORMS: ExecutorClass = LocalExecutor
