"""The executor seam: where a replay's workers run.

The replayer plans jobs (one per segment: _replay/execute.py's ``Job``) and hands
them to an :class:`Executor`; it never asks which one it has. Two implement it:
``local`` (worker processes on this machine, _replay/local_executor.py) and
``ray`` (a Ray task per segment, _replay/ray_executor.py), chosen by name in
:data:`EXECUTORS`. tests/replay/test_executor_contract.py holds both to the
contract below.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from retrolog._config import lookup
from retrolog._replay.execute import Job
from retrolog._replay.forkserver import StartPlan
from retrolog.errors import UsageError
from retrolog.store.paths import ProjectPaths

EXECUTOR_ENV = "RETROLOG_EXECUTOR"


@dataclass(frozen=True)
class Coordinator:
    """What an executor works with on the coordinator: the store a replay writes (the
    replay's own connection), the project, and the replay's id."""

    conn: sqlite3.Connection
    paths: ProjectPaths
    replay_id: str


@dataclass(frozen=True)
class Capacity:
    """What the executor offers the plan."""

    workers: int  # workers by default, at the thread count asked
    cores: int | None  # the cores the workers share (None: this machine's)
    notes: tuple[str, ...] = ()  # lines for the plan


class Executor(Protocol):
    """Runs a replay's jobs.

    The contract, for every implementation: :meth:`run` ends each job with its
    worker's ``output`` (the values it computed, also a run's own exception's) or an
    ``error`` saying why there is none, fills ``seconds``, and calls ``on_done`` with
    it, in the caller's thread, as it ends (the replayer writes a run's values there,
    so they land run by run). At most ``workers`` run at once, in the order given.
    A KeyboardInterrupt (Ctrl-C, or SIGTERM/SIGHUP turned into one) stops the jobs
    still running, which end with neither output nor error; the finished ones keep
    theirs; the interrupt is raised again.
    """

    name: str  # "local" or "ray", as the replays table keeps it
    address: str | None  # where the workers run, for the replays table; None: here

    def warm_up(self, env: Mapping[str, str], warm: Sequence[str]) -> None:
        """Start now what the first worker most likely needs (a local fork server that
        imports ``warm`` in ``env``); may do nothing."""

    def capacity(self, threads: int) -> Capacity:
        """Workers by default at ``threads`` intra-op threads each, and what they share."""

    def prepare(
        self,
        runs: Mapping[str, Mapping[str, Any]],
        starts: Mapping[str, StartPlan],
        echo: Callable[[str], None],
    ) -> dict[str, StartPlan]:
        """Get ready to start the runs' workers as ``starts`` plan (fork servers
        importing); the start plans with what that measured."""

    def run(
        self,
        jobs: Sequence[Job],
        *,
        workers: int,
        on_done: Callable[[Job], None],
        echo: Callable[[str], None],
    ) -> None:
        """Run ``jobs`` (longest first) to their ends, as the class docstring says."""

    def close(self) -> None:
        """Free what the executor holds (fork servers, a cluster connection)."""


class ExecutorClass(Protocol):
    """An executor's class: how it reads its address option, and how it is made."""

    @staticmethod
    def resolve_address(given: str | None) -> str | None:
        """The address its workers run at (from ``given`` or the settings), or a clear
        error when the options do not fit it; checked before anything is read."""

    def __call__(self, coordinator: Coordinator, address: str | None) -> Executor: ...


# name -> "module:class", imported when chosen (Ray's module never at `import retrolog`)
EXECUTORS: dict[str, str] = {
    "local": "retrolog._replay.local_executor:LocalExecutor",
    "ray": "retrolog._replay.ray_executor:RayExecutor",
}


def choose_executor(
    executor: str | None, ray_address: str | None
) -> Callable[[Coordinator], Executor]:
    """The executor the options and the settings choose, made once the replay has an id.

    executor: a name in :data:`EXECUTORS`; None: the ``executor`` setting
        (``RETROLOG_EXECUTOR``), else local. Options that do not fit (an unknown
        name, a Ray address for local workers, Ray missing) are refused here,
        before anything is read.
    """
    import importlib

    chosen = executor if executor is not None else (lookup(EXECUTOR_ENV) or "local")
    where = EXECUTORS.get(chosen.strip().lower())
    if where is None:
        origin = "--executor" if executor is not None else f"the executor setting ({EXECUTOR_ENV})"
        raise UsageError(
            f"{origin} is {chosen!r}; it takes 'local' (worker processes on this machine, the "
            "default) or 'ray' (tasks on a Ray cluster)."
        )
    module, _, name = where.partition(":")
    kind: ExecutorClass = getattr(importlib.import_module(module), name)
    address = kind.resolve_address(ray_address)
    return lambda coordinator: kind(coordinator, address)
