"""``ReplayRequest``: what a replay is asked to do, the options defined once.

The command line, the Python API (``rl.replay``, ``Project.replay``) and the
dashboard each build one; the replayer reads it, and :meth:`ReplayRequest.argv`
turns it back into ``retrolog replay`` arguments (the dashboard runs a replay as
that command). How a replay talks to its caller (asking, printing) is not part of
the request: ``replay()`` takes those as callables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from retrolog.errors import UsageError


def split_names(names: str | Sequence[str]) -> tuple[str, ...]:
    """Log names from a comma-separated string or a list, stripped, empty ones dropped."""
    given = names.split(",") if isinstance(names, str) else list(names)
    return tuple(n.strip() for n in given if n.strip())


@dataclass(frozen=True)
class ReplayRequest:
    """One replay's options (``retrolog replay --help`` says what each does).

    names: the log statements of today's script to backfill (none with ``verify``),
        as a list or one comma-separated string.
    where: a SQL predicate over the dataframe view choosing runs.
    script: the script whose runs to replay, when runs of several are recorded.
    workers: concurrent workers (default: as many as fit the cores at the runs'
        recorded thread counts, or one per GPU; on Ray, the cluster's CPUs).
    threads: intra-op threads per worker instead of each run's recorded count;
        values may then differ from a fresh run and are marked possibly inexact.
    dry_run: show the plan and the code each run would execute; run nothing.
    force: recompute values that were already backfilled.
    verify: replay each run's own code and compare what it recomputes with what
        it recorded; backfills nothing.
    reuse: copy the values of a run that computed exactly what another did.
    allow_inexact: a replay whose recorded values came out different is no error
        (read by the callers that turn it into one: the CLI's exit, ``rl.replay``).
    executor: "local" or "ray"; None: the ``executor`` setting, else local.
    ray_address: the Ray cluster (default: RAY_ADDRESS or the ``ray_address`` setting).
    yes: replay without asking (the command line asks otherwise).
    progress: a progress bar on a terminal.
    """

    # A comma-separated string or a list; kept as a tuple of stripped names.
    names: Sequence[str] = field(default=())
    where: str | None = None
    script: str | None = None
    workers: int | None = None
    threads: int | None = None
    dry_run: bool = False
    force: bool = False
    verify: bool = False
    reuse: bool = True
    allow_inexact: bool = False
    executor: str | None = None
    ray_address: str | None = None
    yes: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", split_names(self.names))

    def checked(self) -> ReplayRequest:
        """This request, or a UsageError saying what to change."""
        if self.verify and self.names:
            raise UsageError(
                "--verify replays the statements each run recorded; it takes no NAMES, only an "
                'optional WHERE predicate, e.g. `retrolog replay --verify "lr > 0.5"`.'
            )
        if not self.names and not self.verify:
            raise UsageError(
                "Name at least one log statement to replay, e.g. `retrolog replay w_norm`."
            )
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads needs a positive number of threads, not {self.threads}.")
        return self

    def argv(self) -> list[str]:
        """The ``retrolog replay`` arguments that make this request (without ``retrolog``)."""
        argv = ["replay"]
        if self.names:
            argv.append(",".join(self.names))
        if self.where:
            argv.append(self.where)
        flags = {
            "--script": self.script,
            "--workers": self.workers,
            "--threads": self.threads,
            "--executor": self.executor,
            "--ray-address": self.ray_address,
        }
        for flag, value in flags.items():
            if value is not None:
                argv += [flag, str(value)]
        switches = {
            "--dry-run": self.dry_run,
            "--force": self.force,
            "--verify": self.verify,
            "--no-reuse": not self.reuse,
            "--allow-inexact": self.allow_inexact,
            "--yes": self.yes,
        }
        argv += [switch for switch, on in switches.items() if on]
        return argv
