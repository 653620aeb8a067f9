"""The public calls: thin functions over the active :class:`~retrolog.runtime.run.Run`.

A run starts at the first recording call (``arg``, ``log``, ``loop`` or
``checkpointing``), not at import: importing retrolog starts no thread,
touches no git and does not import torch. What import does is for the
script's argparse, which usually runs before the first recording call: it
takes ``--kwargs`` out of ``sys.argv`` (argparse must not see the flag) and
wraps ``parse_known_args`` so the parsed values are recorded
(runtime/cli_args.py). In a replay worker it also puts the recorded
numerical environment in place (runtime/numerics.py).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from retrolog.errors import ArgumentError, RetrologError, UsageError
from retrolog.runtime import cli_args
from retrolog.runtime.kwargs import cast, split_argv
from retrolog.runtime.run import NO_OVERRIDE
from retrolog.runtime.values import FAST_TYPES

if TYPE_CHECKING:
    import pandas as pd

    from retrolog._project import Project
    from retrolog.runtime.notebook import Kernel
    from retrolog.runtime.run import Run

T = TypeVar("T")

_FAST = FAST_TYPES
_active: Run | None = None
_original_argv: list[str] = list(sys.argv)
_overrides: dict[str, str] = {}
_argv_error: ArgumentError | None = None
_used_overrides: set[str] = set()
# The exception that ended the script (type, value, traceback), for the run's end.
_uncaught: tuple[Any, Any, Any] | None = None
_hooks_installed = False

try:
    _rest, _overrides = split_argv(sys.argv)
    if len(_rest) != len(sys.argv):
        sys.argv[:] = _rest
except ArgumentError as _exc:  # raised at the first arg() so the message points at the script
    _argv_error = _exc


def use_argv(argv: list[str]) -> None:
    """``retrolog run script args``: the script's command line replaces the one this module
    read at import (the CLI's); ``--kwargs`` is taken out of it as at import."""
    global _original_argv, _overrides, _argv_error
    _original_argv = list(argv)
    _overrides, _argv_error = {}, None
    try:
        rest, _overrides = split_argv(argv)
        argv[:] = rest
    except ArgumentError as exc:
        _argv_error = exc


def _on_parsed(values: dict[str, Any]) -> None:
    """argparse parsed the command line: its values are run-level values of the run."""
    if _active is not None and _active.owned_by_this_process():
        _active.set_parsed_args(values)


# The script's argparse usually parses before the run starts (its first recording call):
# the values wait in cli_args.parsed until then.
cli_args.install()
cli_args.listener = _on_parsed

# runtime.replay_worker.SPEC_ENV, named here so that a recording never imports the replay runtime.
_REPLAY_SPEC_ENV = "RETROLOG_REPLAY_SPEC"
if os.environ.get(_REPLAY_SPEC_ENV):
    # A replay worker (runtime/replay_worker.py): the recorded numerical environment must be in
    # place before the script's first torch call, so before the first recording call.
    from retrolog.runtime.replay_worker import prepare_worker

    prepare_worker(os.environ[_REPLAY_SPEC_ENV])


def arg(name: str, default: T) -> T:
    """A hyper-parameter: the ``--kwargs name=value`` override cast to the default's type.

    name: how the value is called in ``--kwargs``, the dataframe and the runs list.
    default: the value when no override is given; its type decides the cast
        (bool, int, float, str; None keeps the string).
    Returns the value, which is also logged as a run-level value. In a notebook, a
    cell that only reads arguments starts no run: the next run in the kernel records them.
    """
    if type(name) is not str or not name:
        raise _refusal(f"arg() needs a non-empty string name, got {name!r}.")
    if _argv_error is not None:
        _install_hooks()
        raise _argv_error
    override: Any = NO_OVERRIDE
    if _active is None and _kernel is not None:
        if name in _overrides:
            override = cast(name, _overrides[name], default)
        value = default if override is NO_OVERRIDE else override
        _kernel.arguments[name] = value
        return value
    run = _active or _begin()
    if name in run.args:
        if _kernel is None or name not in _kernel.carried:
            value = run.args[name]
            return value
        _kernel.carried.discard(name)  # an earlier cell's, resolved again in this one
    if name in _overrides:
        override = cast(name, _overrides[name], default)
        _used_overrides.add(name)
    value = run.resolve_arg(name, default, override)
    run.set_arg(name, value)
    return value


def log(name: str, value: T) -> T:
    """Record ``value`` under ``name`` in the current loop context; returns ``value``.

    Cheap enough for inner loops: floats, ints and strs are queued as they
    are; anything else is converted at the call (bools and None kept, numpy
    and torch scalars to numbers, arrays and containers to JSON, the rest to
    text).
    """
    run = _active
    if run is None:
        run = _begin()
    if type(value) in _FAST and type(name) is str:
        run.values.append((run.ctx, name, value))
        return value
    if type(name) is not str or not name:
        raise UsageError(f"log() needs a non-empty string name, got {name!r}.")
    run.log(name, value)
    return value


def loop(name: str, iterable: Iterable[T]) -> Iterator[T]:
    """Iterate ``iterable`` as the loop ``name`` (e.g. "epoch", "step").

    Each iteration is a context the values logged in it belong to; the
    outermost loop inside ``checkpointing`` is where checkpoints are taken.
    """
    if type(name) is not str or not name:
        raise _refusal(f"loop() needs a non-empty string name, got {name!r}.")
    return (_active or _begin()).loop(name, iterable)


def begin(name: str, value: Any = None) -> None:
    """Start the next iteration of the loop ``name``, for loops driven by events.

    A framework's fit loop is not a Python iterator: it calls hooks. ``begin`` where
    an iteration starts (``on_epoch_begin``) and ``end`` where the loop is over give it
    the contexts, block roles, checkpoint points and progress of ``rl.loop``:

    - when ``name`` is an open loop, its current iteration ends (loops opened inside
      it end first) and the next one starts;
    - otherwise a loop ``name`` starts, nested in the current context; the outermost
      one inside ``checkpointing`` is the outer loop, the first one nested in an outer
      iteration is that iteration's block (checkpointed when it ends).

    value: kept as the iteration's loop value when plain (int, float, str, bool).
    """
    if type(name) is not str or not name:
        raise _refusal(f"begin() needs a non-empty string name, got {name!r}.")
    (_active or _begin()).event_loops.begin(name, value)


def end(name: str | None = None) -> None:
    """End the loop ``name`` (default: the innermost loop opened by ``begin``).

    Loops opened inside it end first. The end of a block loop is where its outer
    iteration's checkpoint may be taken; the outer loop's end is always captured.
    Loops still open when the run ends are ended then.
    """
    run = _active
    if run is None:
        raise _refusal(
            "rl.end() was called before any rl.begin(): no run has started and no loop is "
            "open. Call rl.begin(name, ...) where each iteration starts and rl.end(name) "
            "where the loop is over."
        )
    run.event_loops.end(name)


def restore_block() -> bool:
    """Whether the coming block was restored from a checkpoint (replay only).

    Ask it where an event-driven loop would start the code a checkpoint stands for:
    in an outer iteration before its nested loop (the epoch's steps), or before the
    outer loop's first iteration. While recording it returns False. In a replay
    worker whose plan restores that block, the checkpoint is put into the objects
    named by ``checkpointing`` (and the RNG states) and it returns True: the caller
    then skips that code (the framework skips the epoch's steps, or the whole loop).
    """
    run = _active or _begin()
    return bool(run.restore_block())


def volatile(*names: str) -> None:
    """Declare names whose values no replay can reproduce (wall-clock figures).

    They are recorded and shown as any other; a replay recomputes them but leaves
    them out of its exactness check and lists them as volatile in its report.
    """
    for name in names:
        if type(name) is not str or not name:
            raise _refusal(f"volatile() needs non-empty string names, got {name!r}.")
    (_active or _begin()).volatile.update(names)


def parsed_values(values: dict[str, Any]) -> None:
    """Record an integration's configuration (a framework's training arguments) as
    argparse's values are recorded: typed run-level values, compared by a replay."""
    (_active or _begin()).set_parsed_args(values)


@contextlib.contextmanager
def checkpointing(**objects: Any) -> Iterator[None]:
    """Name the objects whose state makes a checkpoint, for the loops inside the block.

    Accepts anything with ``state_dict()``/``load_state_dict()`` (torch modules,
    optimizers, schedulers, GradScaler), tensors, numpy arrays, dicts and lists.
    """
    from retrolog.checkpoint.state import validate_targets
    from retrolog.runtime.run import CheckpointScope

    validate_targets(objects)
    run = _active or _begin()
    scope = CheckpointScope(objects, depth=len(run._stack), parent=run.scope)
    run.scope = scope
    try:
        yield
    finally:
        run.scope = scope.parent


def configure(
    *,
    overhead_tolerance: float | None = None,
    checkpoints: str | None = None,
    max_in_flight: int | None = None,
    when_full: str | None = None,
    restore_ratio: float | None = None,
) -> None:
    """Set how this process checkpoints; a setting left as None keeps its current value.

    overhead_tolerance: the share of training time checkpointing may cost
        (eps, default 1/15; env RETROLOG_OVERHEAD_TOLERANCE).
    checkpoints: "adaptive" (default: as often as the tolerance allows) or
        "every" (every block, whatever it costs; env RETROLOG_CHECKPOINTS).
    max_in_flight: snapshots held in memory while the background writer stores
        them (default 2; env RETROLOG_MAX_IN_FLIGHT).
    when_full: what a block end does when the background writer already
        holds max_in_flight snapshots: "skip" (default) does not checkpoint it
        (decided before any copy; replay executes that block), "wait" makes
        training wait for a slot (the default with checkpoints="every"; env
        RETROLOG_WHEN_FULL). A checkpoint once taken is always written.
    restore_ratio: restore time over materialize time, Flor's c (default:
        learned from the script's past replays, 1 before any; env
        RETROLOG_RESTORE_RATIO).
    Takes effect at the run's first checkpoint; call it before the training loop.
    """
    from retrolog.checkpoint import settings

    settings.configure(
        overhead_tolerance=overhead_tolerance,
        checkpoints=checkpoints,
        max_in_flight=max_in_flight,
        when_full=when_full,
        restore_ratio=restore_ratio,
    )


def commit() -> None:
    """End the current run (also done at interpreter exit). A later call starts a new run."""
    global _active
    run = _active
    if run is None:
        return
    _active = None
    _warn_unused_overrides(run)
    run.event_loops.close_all()
    run.commit()


def dataframe(*names: str, where: str | None = None, definitions: str = "any") -> pd.DataFrame:
    """The wide view: one row per run and loop context, one column per name.

    names: log names (recorded or argument values) to show as columns.
    where: an optional SQL predicate over the view's columns, e.g. "lr > 0.005".
    definitions: "any" (every value), "current" (only values computed by the
        definition today's script has for their name; others are left empty) or
        "column" (a column ``<name>:definition`` with each value's definition key).
    Returns a pandas DataFrame with projid, run_id, tstamp, filename, the loop
    columns (e.g. epoch, step) and the requested names; run-level values such
    as arguments are repeated on each row of their run.
    """
    return current_project().dataframe(*names, where=where, definitions=definitions)


def query(sql: str) -> pd.DataFrame:
    """Run read-only SQL over the store (tables: runs, loops, logs, checkpoints, profile)."""
    return current_project().query(sql)


def lineage(run: str, name: str, at: dict[str, int] | None = None) -> dict[str, Any]:
    """How a run's values of ``name`` came to be.

    run: a run id or a unique prefix of one.
    at: loop iterations to narrow to, e.g. ``{"epoch": 3}``.
    Returns a dict: the run's code version and numerical environment, the
    definitions (statement and the code it depends on) by key, the replays that
    backfilled values (with their deferred check), and per value its context,
    origin, definition key, replay, propagated code object, the checkpoint it
    started from and its inexact mark.
    """
    return current_project().lineage(run, name, at)


def replay(
    names: str | Sequence[str],
    where: str | None = None,
    *,
    script: str | None = None,
    workers: int | None = None,
    threads: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    allow_inexact: bool = False,
    reuse: bool = True,
    executor: str | None = None,
    ray_address: str | None = None,
) -> pd.DataFrame:
    """Backfill the values of new log statements into past runs, by replaying them.

    names: log names present in the current version of the script (a list, or
        a comma-separated string).
    where: a SQL predicate choosing runs, over the dataframe view's columns.
    script: the script, when runs of several scripts are recorded.
    workers: worker processes (default: as many as fit the cores at the runs'
        recorded thread counts, or one per GPU).
    threads: intra-op threads per worker instead of each run's recorded count;
        values may then differ from a fresh run and are marked possibly inexact.
    dry_run: print the plan and the code each run would execute; run nothing.
    force: recompute values that were already backfilled.
    allow_inexact: return the dataframe even when recorded values came out different
        in replay (the values backfilled from those runs are stored marked inexact);
        otherwise that raises InexactReplayError.
    reuse: copy the values of a run that computed exactly what another did (same
        configuration and history) instead of replaying it.
    executor: "local" (worker processes on this machine) or "ray" (one Ray task per
        segment on a cluster; the ray extra); default the ``executor`` setting
        (RETROLOG_EXECUTOR), else local. docs/replay-on-ray.md.
    ray_address: the Ray cluster (default: RAY_ADDRESS or the ``ray_address`` setting).
    Returns the dataframe of ``names`` for the matching runs (empty after a dry run).
    The plan and a report go to stderr; nothing is asked (the CLI asks).
    """
    import pandas as pd

    from retrolog._project import ReplayRequest
    from retrolog.errors import InexactReplayError, UnknownNameError

    request = ReplayRequest(
        names, where, script=script, workers=workers, threads=threads, dry_run=dry_run,
        force=force, reuse=reuse, allow_inexact=allow_inexact, progress=False,
        executor=executor, ray_address=ray_address,
    )  # fmt: skip
    wanted = list(request.names)
    if _kernel is not None:  # a later run's cells script must not replay again
        _kernel.replayed.add(_kernel.current_cell())
    project = current_project()
    result = project.replay(request=request)
    if result.inexact and not request.allow_inexact:
        raise InexactReplayError(
            f"Replay of {len(result.inexact)} run(s) was not exact "
            f"({', '.join(result.inexact)}): recorded values came out different, so the "
            f"values of {', '.join(wanted)} backfilled from them are stored marked inexact "
            "(the report above gives the likely cause). Pass allow_inexact=True to get "
            "the dataframe anyway.",
            run_ids=result.inexact,
        )
    runs = sorted(set(result.outcomes) | set(result.skipped))
    if dry_run or not runs:
        return pd.DataFrame()
    try:
        return project.dataframe(*wanted, runs=runs)
    except UnknownNameError:  # no run produced a value
        return pd.DataFrame()


def original_argv() -> list[str]:
    """The command line as retrolog found it: ``--kwargs`` still in it."""
    return list(_original_argv)


# -- run lifecycle -----------------------------------------------------------------------


def current_run() -> Run:
    """This process's run, started now if no recording call started it yet."""
    return _active or _begin()


def _begin() -> Run:
    """Start a run for this process (at the first recording call)."""
    global _active
    from retrolog.runtime.run import Run
    from retrolog.store.paths import locate

    _install_hooks()
    spec = os.environ.get(_REPLAY_SPEC_ENV)
    if spec:  # a replay worker: see retrolog.runtime.replay_worker
        from retrolog.runtime.replay_worker import ReplayRun, WorkerSpec

        _active = ReplayRun(WorkerSpec.load(spec))  # type: ignore[assignment]
    else:
        if _kernel is not None:
            _active = _kernel.start_run(locate())
        else:
            script = _original_argv[0] if _original_argv else None
            _active = Run(locate(), _original_argv, script)
    assert _active is not None
    parsed = {**cli_args.parsed, **cli_args.click_params()}
    if parsed:
        _active.set_parsed_args(parsed)
    return _active


def _end_cell_run(run: Run, error: str | None) -> None:
    """A kernel's cell ended: so does the run it began (runtime/notebook.py)."""
    global _active
    from retrolog.runtime.run import Status

    _active = None
    _warn_unused_overrides(run)
    if error is not None:
        run.commit(Status.CRASHED, error)
    else:
        run.commit(Status.FINISHED)


def _follow_kernel() -> Kernel | None:
    """In a Jupyter/IPython kernel: its cells followed from this import on."""
    if "IPython" not in sys.modules:  # not a kernel: nothing to import
        return None
    from retrolog.runtime import notebook

    shell = notebook.kernel_shell()
    return None if shell is None else notebook.follow(shell, lambda: _active, _end_cell_run)


_kernel = _follow_kernel()


def current_project() -> Project:
    """The current directory's project, after this process's own run's records are written
    (a script reading its own run sees what it logged)."""
    from retrolog._project import Project

    if _active is not None and _active.owned_by_this_process():
        _active.writer.flush(timeout=30)
    return Project()


def _refusal(message: str) -> UsageError:
    """A usage error raised by a public call, possibly before any run has started: the
    hooks that print retrolog's errors as one paragraph are installed first, so a script
    ended by it shows the message and its own line, not a traceback."""
    _install_hooks()
    return UsageError(message)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_at_exit)
    previous = sys.excepthook

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        global _uncaught
        _uncaught = (exc_type, exc, tb)
        failed = getattr(_active, "failed", None)  # a replay worker says what went wrong
        if callable(failed):
            try:
                failed(exc, tb)
            except Exception as why:  # the traceback below still says where
                print(f"retrolog: could not diagnose the failure: {why}", file=sys.stderr)
        if isinstance(exc, RetrologError) and not os.environ.get("RETROLOG_DEBUG"):
            # retrolog's own errors say what to do; the user's script needs only where.
            sys.stderr.write(_script_error(exc, tb))
            return
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_detach_in_child)


def _script_error(exc: BaseException, tb: Any) -> str:
    """The message of a retrolog error that ended the user's script, and where it came
    from in the script: the last frame of the traceback outside retrolog's package and
    the standard library (``with rl.checkpointing(...)`` passes through contextlib)."""
    import sysconfig
    import textwrap
    import traceback

    package = os.path.dirname(os.path.abspath(__file__))
    stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"])

    def ours_or_stdlib(filename: str) -> bool:
        path = os.path.abspath(filename)
        if path.startswith(package + os.sep):
            return True
        installed = {"site-packages", "dist-packages"} & set(path.split(os.sep))
        return path.startswith(stdlib + os.sep) and not installed

    where = ""
    for frame in reversed(traceback.extract_tb(tb)):
        if not ours_or_stdlib(frame.filename):
            code = f": {frame.line}" if frame.line else ""
            where = f" at {frame.filename}, line {frame.lineno}{code}"
            break
    message = textwrap.fill(f"{type(exc).__name__}: {' '.join(str(exc).split())}", width=100)
    return (
        f"retrolog stopped the script{where}\n{message}\n(RETROLOG_DEBUG=1 shows the traceback.)\n"
    )


def _detach_in_child() -> None:
    # A forked child (DataLoader worker) has no writer thread; what it logs is dropped
    # rather than piling up, and it never ends the parent's run.
    if _active is not None:
        _active.values = collections.deque(maxlen=0)
        _active.events = collections.deque(maxlen=0)
        writer = getattr(_active, "writer", None)
        if writer is not None:  # loops started in the child append to these
            writer.loop_starts = collections.deque(maxlen=0)
            writer.loop_ends = collections.deque(maxlen=0)
            writer.iterations = collections.deque(maxlen=0)


def _at_exit() -> None:
    global _active
    run = _active
    if run is None or not run.owned_by_this_process():
        return
    _active = None
    from retrolog.runtime.run import Status

    _warn_unused_overrides(run)
    if _uncaught is not None:
        run.commit(Status.CRASHED, crash=run.crash_of(*_uncaught))
    else:
        run.event_loops.close_all()
        run.commit(Status.FINISHED)


def _warn_unused_overrides(run: Run) -> None:
    unused = sorted(set(_overrides) - _used_overrides)
    if unused and run.owned_by_this_process():
        asked = ", ".join(sorted(run.args)) or "none"
        print(
            f"retrolog: --kwargs {', '.join(unused)} given but the script never called "
            f"arg() with {'that name' if len(unused) == 1 else 'those names'} "
            f"(arguments it read: {asked}); check the spelling.",
            file=sys.stderr,
        )
