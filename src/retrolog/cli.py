"""The ``retrolog`` command: each command is a library call plus formatting.

Data goes to stdout, messages to stderr. Exit codes: 0 ok, 1 user error
(one paragraph on stderr, never a traceback), 2 usage.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from retrolog.errors import RetrologError

if TYPE_CHECKING:
    from retrolog._project import ReplayRequest
    from retrolog._replay.replayer import ReplayResult

DEBUG_ENV = "RETROLOG_DEBUG"


def _handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except click.ClickException:
            raise  # usage mistakes: click prints them and exits 2
        except RetrologError as exc:
            _fail(str(exc))
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)
        except Exception as exc:
            if os.environ.get(DEBUG_ENV):
                raise
            _fail(
                f"retrolog hit an internal error ({type(exc).__name__}: {exc}). This is a bug; "
                f"rerun with {DEBUG_ENV}=1 to see the traceback and report it."
            )

    return wrapper


def _fail(message: str) -> None:
    width = 100
    click.echo(terminal_safe(textwrap.fill("Error: " + message, width=width)), err=True)
    sys.exit(1)


def _output_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--csv", "as_csv", is_flag=True, help="Write CSV (for pipes).")(func)
    func = click.option("--json", "as_json", is_flag=True, help="Write JSON records.")(func)
    return func


# Control characters a logged string or a recorded script may hold (ESC starts terminal
# sequences that can move the cursor, rewrite lines, set the window title; a carriage
# return overwrites its line; bidirectional overrides reorder what is shown): shown
# escaped, never sent raw.
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}
_CONTROL.update(
    {c: f"\\u{c:04x}" for c in [0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]}
)
_ESCAPED_NOTE = (
    "(control characters in the text above, which could hide or rewrite what a terminal "
    "shows, are written as \\xNN or \\uNNNN)"
)


def terminal_safe(text: str) -> str:
    """``text`` with control characters other than newline and tab written as ``\\xNN``
    (bidirectional controls as ``\\uNNNN``)."""
    return text.translate(_CONTROL)


def _terminal_echo() -> Callable[[str], None]:
    """An echo to stderr that writes control characters escaped, and says so once if it did."""
    noted = False

    def echo(text: str) -> None:
        nonlocal noted
        shown = terminal_safe(text)
        click.echo(shown, err=True)
        if shown != text and not noted:
            noted = True
            click.echo(_ESCAPED_NOTE, err=True)

    return echo


def _emit(frame: Any, as_json: bool, as_csv: bool) -> None:
    if as_json and as_csv:
        raise click.UsageError("Choose one of --json and --csv.")
    if as_json:
        if not frame.columns.is_unique:
            twice = sorted({str(c) for c in frame.columns[frame.columns.duplicated()]})
            raise click.UsageError(
                f"The result has more than one column named {', '.join(twice)}; a JSON object "
                "cannot hold both. Name them apart (SELECT ... AS another_name), or use --csv."
            )
        click.echo(_json_records(_json_safe(frame)))
    elif as_csv:
        click.echo(frame.to_csv(index=False), nl=False)
    elif frame.empty:
        click.echo("(no rows)", err=True)
    else:
        import pandas as pd

        # A cell shows its start (an array logged as JSON can be megabytes); --json and
        # --csv write every value whole.
        with pd.option_context(
            "display.max_rows", None, "display.max_columns", None, "display.width", 250,
            "display.max_colwidth", 80,
        ):  # fmt: skip
            click.echo(terminal_safe(frame.to_string(index=False, na_rep="")))


def _json_records(frame: Any) -> str:
    """The rows as a JSON list of objects, every float written so that it reads back
    bit for bit (pandas' ``to_json`` keeps 10 significant digits); NaN, infinities
    and missing values are null."""
    import json
    import math

    import pandas as pd

    def cell(value: Any) -> Any:
        if value is None or isinstance(value, (str, bool, int, list, dict)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if value is pd.NA or value is pd.NaT:
            return None
        if hasattr(value, "item"):  # a numpy scalar
            return cell(value.item())
        return str(value)

    records = [{str(k): cell(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]
    return json.dumps(records, ensure_ascii=False, allow_nan=False, default=str)


def _json_safe(frame: Any) -> Any:
    """Blob cells (bytes) as base64 text, which JSON can hold."""
    import base64

    blobs = [c for c in frame.columns if frame[c].map(lambda v: isinstance(v, bytes)).any()]
    if not blobs:
        return frame
    frame = frame.copy()
    for column in blobs:
        frame[column] = frame[column].map(
            lambda v: base64.b64encode(v).decode() if isinstance(v, bytes) else v
        )
    return frame


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="retrolog")
def cli() -> None:
    """retrolog: log a little while training, ask for anything later.

    \b
    Example:
      python train.py --kwargs lr=0.01     # record a run
      retrolog runs                        # list the runs of this project
      retrolog dataframe lr acc            # one row per run and epoch
    """


@cli.command("runs")
@click.option("--limit", type=click.IntRange(min=1), help="Show only the newest N runs.")
@_output_options
@_handle_errors
def runs_command(limit: int | None, as_json: bool, as_csv: bool) -> None:
    """List the project's runs: id, start time, script, status, duration, args.

    \b
    Example:
      retrolog runs --limit 5
    """
    _emit(_project().runs(limit), as_json, as_csv)


@cli.command("show")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Write JSON.")
@_handle_errors
def show_command(run: str, as_json: bool) -> None:
    """Show one run: metadata, code version, logged names, loops, checkpoints.

    RUN is a run id or a unique prefix of one.

    \b
    Example:
      retrolog show 20261122-1635
    """
    details = _project().run(run)
    if as_json:
        click.echo(json.dumps(details, indent=2, default=str))
        return
    click.echo(terminal_safe(_format_details(details)))


@cli.command("lineage")
@click.argument("run")
@click.argument("name")
@click.option(
    "--at",
    "at",
    multiple=True,
    metavar="LOOP=I",
    help="Only the values at this loop iteration, e.g. --at epoch=3 (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="Write JSON.")
@_handle_errors
def lineage_command(run: str, name: str, at: tuple[str, ...], as_json: bool) -> None:
    """Explain how a run's values of NAME came to be.

    For each value: recorded or backfilled, the statement and the code it
    depends on (its definition), the code version, the replay that computed it
    and the propagated code it ran, the checkpoint it started from, the
    numerical environment, and whether the replay's deferred check was exact.

    \b
    Example:
      retrolog lineage 20261122-1635 w_norm --at epoch=3
    """
    found = _project().lineage(run, name, parse_at(at))
    if as_json:
        click.echo(json.dumps(found, indent=2, default=str))
        return
    click.echo(terminal_safe(format_lineage(found)))


def parse_at(items: tuple[str, ...]) -> dict[str, int]:
    """``("epoch=3", "step=7")`` as ``{"epoch": 3, "step": 7}``; a bad item is a usage error."""
    where: dict[str, int] = {}
    for item in items:
        loop, sep, iteration = item.partition("=")
        if not sep or not loop.strip() or not iteration.strip().lstrip("-").isdigit():
            raise click.UsageError(
                f"--at takes LOOP=ITERATION with a whole number, e.g. --at epoch=3, not {item!r}."
            )
        where[loop.strip()] = int(iteration)
    return where


def format_lineage(found: dict[str, Any]) -> str:
    """The lineage of a run's values, readable."""
    lines = [
        f"run        {found['run_id']}  {found['filename']}",
        f"code       {found['code_ref']} -> {(found['code_commit'] or '')[:12]}"
        + (" (uncommitted changes)" if found.get("dirty") else ""),
    ]
    numerics = found.get("numerics")
    if numerics:
        lines.append("numerics   " + _format_numerics(numerics))
    for key, definition in found["definitions"].items():
        lines.append(
            f"definition {key}"
            + (f" (coarse: {definition['coarse']})" if definition and definition["coarse"] else "")
        )
        for text in (definition or {}).get("text", "(not kept)").splitlines():
            lines.append(f"    {text}")
    for replay_id, replay in found["replays"].items():
        check = "exact" if not replay.get("mismatches") else "NOT exact"
        lines.append(
            f"replay     {replay_id} ({replay.get('kind')}, {replay.get('scan')}): deferred check "
            f"{check} over {replay.get('compared') or 0} recorded values"
            + (f"; {replay['inexact']}" if replay.get("inexact") else "")
        )
        if replay.get("executor"):
            where_ran = "local processes" if replay["executor"] == "local" else "Ray tasks"
            if replay.get("executor_address"):
                where_ran += f" of the cluster at {replay['executor_address']}"
            hosts = replay.get("hosts") or []
            if hosts:
                where_ran += " on " + ", ".join(hosts)
            lines.append(f"           ran as {where_ran}")
    lines.append("values")
    for v in found["values"]:
        where = " ".join(f"{k}={i}" for k, i in v["context"].items()) or "run-level"
        origin = v["origin"]
        extra = ""
        if origin == "backfilled":
            place = v.get("checkpoint_at") or {}
            start = (
                " from the start"
                if place == {} or place is None
                else f" after restoring the {place.get('kind', '')} checkpoint of "
                + (
                    " ".join(f"{k}={i}" for k, i in (place.get("context") or {}).items())
                    or "the end"
                )
            )
            extra = f" by replay {v['replay_id']} running code {str(v['code_object'])[:12]}{start}"
        mark = f"  [{v['inexact']}]" if v.get("inexact") else ""
        lines.append(
            f"  {where:<22} {v['value']!r:<24} {origin}{extra}, definition "
            f"{(v['lineage'] or '?')[:8]}{mark}"
        )
    return "\n".join(lines)


@cli.command("dataframe")
@click.argument("names", nargs=-1, required=True)
@click.option("--where", help='SQL predicate over the view\'s columns, e.g. "lr > 0.005".')
@click.option(
    "--definitions",
    type=click.Choice(["any", "current", "column"]),
    default="any",
    show_default=True,
    help="current: only values computed by today's statement for their name (others empty); "
    "column: add a NAME:definition column with each value's definition key.",
)
@_output_options
@_handle_errors
def dataframe_command(
    names: tuple[str, ...], where: str | None, definitions: str, as_json: bool, as_csv: bool
) -> None:
    """Print the wide view of NAMES: one row per run and loop context.

    --where takes one SQL expression over the view's columns and any logged name. With
    database_url naming PostgreSQL it is PostgreSQL's SQL: a bool compares as
    `flag = true`, a name with capitals is double-quoted ("Acc"), a name of both
    numbers and strings compares as text, and the role must not be a superuser
    (docs/store.md, "Query dialects").

    \b
    Example:
      retrolog dataframe lr acc --where "lr > 0.005"
      retrolog dataframe acc w_norm --definitions current
    """
    split = [n for name in names for n in name.split(",") if n]
    _emit(_project().dataframe(*split, where=where, definitions=definitions), as_json, as_csv)


@cli.command("query")
@click.argument("sql")
@_output_options
@_handle_errors
def query_command(sql: str, as_json: bool, as_csv: bool) -> None:
    """Run read-only SQL over the store (tables: runs, loops, logs, checkpoints, profile,
    replays, replay_runs, definitions, migrations).

    A query stops after RETROLOG_QUERY_TIMEOUT seconds (default 120) or when it needs
    more than RETROLOG_QUERY_MEMORY_MB (default 1024), and on Ctrl-C; 0 means no limit.
    --json writes blob columns as base64. With database_url naming PostgreSQL, the SQL
    is PostgreSQL's, values are in value_float, value_int and value_text, and the role
    must not be a superuser (docs/store.md, "Query dialects").

    \b
    Example:
      retrolog query "SELECT name, COUNT(*) FROM logs GROUP BY name"
    """
    _emit(_project().query(sql), as_json, as_csv)


# The replay command's options, in the order --help lists them: each is a field of the
# ReplayRequest the command builds.
_REPLAY_OPTIONS = [
    click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation."),
    click.option(
        "--dry-run", is_flag=True, help="Print the plan and each run's code diff; run nothing."
    ),
    click.option(
        "--workers",
        type=click.IntRange(min=1),
        help="Worker processes (default: as many as the cores hold at the runs' recorded thread "
        "counts, or one per GPU). More than that oversubscribes the cores: slower, still exact. "
        "With --executor ray: Ray tasks in flight (default: what the cluster's CPUs hold).",
    ),
    click.option(
        "--threads",
        type=click.IntRange(min=1),
        help="Intra-op threads per worker instead of each run's recorded count. Faster with more "
        "workers, but values may differ from a fresh run: they are marked possibly inexact.",
    ),
    click.option(
        "--script", help="The script whose runs to replay (needed when several have runs)."
    ),
    click.option("--force", is_flag=True, help="Recompute values that were already backfilled."),
    click.option(
        "--verify",
        is_flag=True,
        help="Replay each run's own code at the outer loop and compare what it recomputes with "
        "what it recorded; backfills nothing. Takes only an optional WHERE.",
    ),
    click.option(
        "--no-reuse",
        is_flag=True,
        help="Replay every run, even one that computed exactly what another did (same "
        "configuration and history), whose values would otherwise be copied.",
    ),
    click.option(
        "--allow-inexact",
        is_flag=True,
        help="Exit 0 even when the deferred check finds recorded values that replay recomputed "
        "differently (their backfilled values are stored marked inexact either way).",
    ),
    click.option(
        "--executor",
        type=click.Choice(["local", "ray"]),
        help="Where the workers run: 'local' processes on this machine (the default), or 'ray': "
        "each segment a task on a Ray cluster, with its CPUs (and GPU); needs the ray extra. "
        "Default: the executor setting (RETROLOG_EXECUTOR).",
    ),
    click.option(
        "--ray-address",
        metavar="ADDR",
        help="The Ray cluster for --executor ray: HOST:PORT of its head (what `ray start --head` "
        "prints), or 'auto'. Default: RAY_ADDRESS or the ray_address setting.",
    ),
]


def _replay_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_REPLAY_OPTIONS):  # click lists the last one applied first
        func = option(func)
    return func


@cli.command("replay")
@click.argument("names", required=False)
@click.argument("where", required=False)
@_replay_options
@_handle_errors
def replay_command(
    names: str | None, where: str | None, yes: bool, dry_run: bool, workers: int | None,
    threads: int | None, script: str | None, force: bool, verify: bool, no_reuse: bool,
    allow_inexact: bool, executor: str | None, ray_address: str | None,
) -> None:  # fmt: skip
    """Backfill new log statements into past runs by replaying them.

    NAMES is a comma-separated list of names logged by the current version of the
    script; WHERE an optional SQL predicate over the dataframe view choosing runs
    (in PostgreSQL's SQL when database_url names it: see `retrolog dataframe --help`).
    Each run is replayed in its own code version with the statements inserted, in
    its recorded numerical environment (thread counts, torch flags), skipping
    training it does not need by restoring checkpoints. Recorded values that the
    replay recomputes are compared at the end; if any differ, the values
    backfilled from that run are marked inexact and the command exits 1 (unless
    --allow-inexact).

    \b
    Example:
      retrolog replay w_norm "lr > 0.005" --dry-run
      retrolog replay w_norm,grad_norm --yes
      retrolog replay --verify "lr > 0.005"
      retrolog replay w_norm --yes --executor ray --ray-address 10.0.0.5:6379
    """
    names, where = _replay_targets(names, where, verify)
    from retrolog._project import ReplayRequest

    request = ReplayRequest(
        names or (), where, script=script, workers=workers, threads=threads, dry_run=dry_run,
        force=force, verify=verify, reuse=not no_reuse, allow_inexact=allow_inexact,
        executor=executor, ray_address=ray_address, yes=yes,
    )  # fmt: skip
    # The plan shows recorded code (each run's diff, the lines statements go after): a
    # control character planted there must not hide a line from the review.
    result = _project().replay(
        request=request, confirm=_replay_confirmation(request.yes), echo=_terminal_echo()
    )
    if _replay_failed(request, result):
        sys.exit(1)


def _replay_targets(
    names: str | None, where: str | None, verify: bool
) -> tuple[str | None, str | None]:
    """The replay's NAMES and WHERE: --verify takes the first argument as WHERE."""
    if verify:
        if names is not None and where is not None:
            raise click.UsageError(
                "--verify takes only an optional WHERE predicate, not NAMES: it replays the "
                'statements each run recorded, e.g. `retrolog replay --verify "lr > 0.5"`.'
            )
        return None, names
    if not names:
        raise click.UsageError(
            "Name the log statements to replay, e.g. `retrolog replay w_norm`, or check "
            "that past runs replay exactly with `retrolog replay --verify`."
        )
    return names, where


def _replay_confirmation(yes: bool) -> Callable[[str], bool]:
    """The answer to the replay's question before it runs: --yes, else the user's on a
    terminal."""

    def confirm(_: str) -> bool:
        if yes:
            return True
        if not sys.stdin.isatty():
            raise click.UsageError("Not asking on a non-interactive input: pass --yes to replay.")
        return click.confirm("Replay these runs?", default=True, err=True)

    return confirm


def _replay_failed(request: ReplayRequest, result: ReplayResult) -> bool:
    """Whether the replay exits 1: a run got nothing or part of its values, a verification
    compared nothing, or values came out inexact without --allow-inexact."""
    # A run skipped because its code cannot be read is a run the user asked for that got
    # nothing: the exit says so (the report names it and why).
    failed = [
        o for o in result.outcomes.values() if o.status in ("failed", "partial", "unreadable")
    ]
    # A verification that compared nothing verified nothing (the report says why).
    unverified = request.verify and not request.dry_run and not result.verified
    return bool(failed or unverified or (result.inexact and not request.allow_inexact))


@cli.command(
    "run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.option(
    "--explain",
    is_flag=True,
    help="Print the training loops, objects, plain variables and uncertainties the analysis "
    "finds; run nothing.",
)
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_command(explain: bool, script: str, args: tuple[str, ...]) -> None:
    """Record SCRIPT unmodified: its training loops found and checkpointed hands-free.

    ARGS are the script's own arguments (and --kwargs). The loops (an outermost for
    loop with a nested one, also through functions of the same file) become rl.loop,
    and the objects they change that have state_dict() are checkpointed; what was
    inferred is recorded with the run and shown in replay plans. Where the analysis is
    unsure, that loop is recorded without checkpoints and replay executes it.

    \b
    Example:
      retrolog run --explain train.py
      retrolog run train.py --epochs 3 --kwargs lr=0.01
    """
    from retrolog import _handsfree
    from retrolog.errors import RetrologError

    try:
        if explain:
            click.echo(terminal_safe(_handsfree.explain_script(script)))
            return
        code = _handsfree.prepare(script, list(args))
    except RetrologError as exc:
        _fail(str(exc))
        return
    _handsfree.execute(code)


@cli.command("propagate")
@click.argument("new_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("old_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--names", required=True, help="Comma-separated log names to carry over.")
@click.option("--diff", "as_diff", is_flag=True, help="Print a unified diff instead of the file.")
@_handle_errors
def propagate_command(new_file: str, old_file: str, names: str, as_diff: bool) -> None:
    """Print OLD_FILE with NEW_FILE's log statements for NAMES inserted where they align.

    This is what replay runs in each past version; use it to review a propagation.

    \b
    Example:
      retrolog propagate train.py old_train.py --names w_norm --diff
    """
    from pathlib import Path

    from retrolog._replay.propagate import propagate
    from retrolog.errors import UsageError

    new = Path(new_file).read_text()
    old = Path(old_file).read_text()
    try:
        result = propagate(new, old, [n.strip() for n in names.split(",") if n.strip()])
    except ValueError as exc:
        raise UsageError(f"{new_file}: {exc}") from exc
    # The diff is for review, and the file for review too when it goes to a terminal: a
    # control character in either code must not hide a line. Piped, the file is exact.
    text = result.diff(old, old_file) if as_diff else result.source
    shown = terminal_safe(text) if as_diff or sys.stdout.isatty() else text
    click.echo(shown, nl=False)
    if shown != text:
        click.echo(_ESCAPED_NOTE, err=True)
    echo = _terminal_echo()
    for placement in result.placements:
        echo(f"{placement.name}: line {placement.line}, {placement.anchor}")
    for name, alias in result.carried:
        shown = name if alias == name else f"{name} (as {alias}: the old file has its own)"
        echo(f"carried today's {shown}")
    for class_name, method in result.methods:
        echo(f"carried today's method {class_name}.{method} into the old class")
    for class_name, statement in result.classes:
        echo(f"carried today's class {class_name}, created by `{statement}`")
    if result.added_import is not None:
        added = result.added_import
        echo(
            f"import: `{added.statement}` added at line {added.line}, since "
            f"{old_file} does not import retrolog"
        )
    for problem in result.problems:
        echo(f"{problem.name}: not placed: {problem.reason}")
    if result.problems:
        sys.exit(1)


def _parse_with(parse: Callable[[str], Any]) -> Callable[..., Any]:
    """A click callback turning a library parser's UsageError into a usage mistake (exit 2)."""

    def callback(ctx: click.Context, param: click.Parameter, value: str) -> Any:
        from retrolog.errors import UsageError

        try:
            return parse(value)
        except UsageError as exc:
            raise click.BadParameter(str(exc)) from exc

    return callback


def _policy(text: str) -> Any:
    from retrolog._gc import RetentionPolicy

    return RetentionPolicy.parse(text)


def _duration(text: str) -> float:
    from retrolog._gc import parse_duration

    return parse_duration(text)


@cli.command("gc")
@click.argument("runs", nargs=-1)
@click.option(
    "--keep",
    default="all",
    show_default=True,
    metavar="POLICY",
    callback=_parse_with(_policy),
    help="all | last:N | best:NAME[:max|min] (the best checkpoint by a logged metric).",
)
@click.option("--where", help='Thin only runs matching this predicate, e.g. "lr > 0.005".')
@click.option(
    "--grace",
    default="1h",
    show_default=True,
    callback=_parse_with(_duration),
    help="Never delete objects written this recently (e.g. 30m, 2h, 0).",
)
@click.option("--dry-run", is_flag=True, help="Print what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Write the report as JSON.")
@_handle_errors
def gc_command(
    runs: tuple[str, ...], keep: Any, where: str | None, grace: float, dry_run: bool,
    yes: bool, as_json: bool,
) -> None:  # fmt: skip
    """Delete the checkpoints a retention policy drops, then objects nothing references.

    RUNS (ids or unique prefixes) and --where limit whose checkpoints are
    thinned; objects no remaining checkpoint references are collected across
    the whole store. Running runs keep everything, and objects written since
    the oldest running run started (or within --grace) are never deleted.
    Without --yes the plan is printed and confirmed first.

    \b
    Example:
      retrolog gc --keep last:2 --dry-run
      retrolog gc --keep best:val_acc:max --where "lr > 0.005" --yes
    """
    from retrolog._gc import format_report

    def emit(report: Any, *, table: bool = True) -> None:
        if as_json:
            click.echo(json.dumps(report.to_dict(), indent=2))
        else:
            click.echo(format_report(report, table=table))
        if report.unreadable:
            click.echo(
                f"Warning: {len(report.unreadable)} checkpoint manifest(s) cannot be read, so "
                "no object was deleted; see the notes.",
                err=True,
            )

    asked = declined = False

    def confirm(plan: Any) -> bool:
        nonlocal asked, declined
        if yes:
            return True
        if not as_json:
            click.echo(format_report(plan))
        if not sys.stdin.isatty():
            raise click.UsageError(
                "Not asking on a non-interactive input: pass --yes to delete, or --dry-run."
            )
        asked = True
        declined = not click.confirm("Delete these?", default=False, err=True)
        return not declined

    def say(line: str) -> None:
        click.echo(line, err=True)

    done = _project().gc(
        runs, keep=keep, where=where, grace_seconds=grace, dry_run=dry_run,
        confirm=confirm, echo=say,
    )  # fmt: skip
    if declined:
        click.echo("Nothing deleted.", err=True)
        return
    if not done.done:
        emit(done)
        if done.empty and not as_json:
            click.echo("Nothing to collect.", err=True)
        return
    emit(done, table=not asked)


@cli.group("checkpoint")
def checkpoint_group() -> None:
    """A run's checkpoints as files other tools read."""


@checkpoint_group.command("export")
@click.argument("run")
@click.argument("at", required=False)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, writable=True),
    help="The file to write (e.g. model.pt).",
)
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
@_handle_errors
def checkpoint_export_command(run: str, at: str | None, output: str, force: bool) -> None:
    """Write RUN's checkpoint at AT as a torch.save file.

    RUN is a run id or a unique prefix of one. AT is the outer-loop iteration
    whose block ended at the checkpoint (0-based), or `end`; without it, the end
    checkpoint, else the latest. The file is a dict of the checkpoint's named
    objects (state_dicts, tensors, plain values), which
    torch.load(path, weights_only=True) reads. Needs torch.

    \b
    Example:
      retrolog checkpoint export 20261122-1635 3 -o epoch3.pt
    """
    position: int | str | None = at
    if at is not None and at != "end":
        try:
            position = int(at)
        except ValueError:
            raise click.BadParameter(
                f"{at!r} is neither an iteration number nor 'end'", param_hint="AT"
            ) from None
    if os.path.exists(output) and not force:
        _fail(f"{output} exists; pass --force to replace it, or write to another file.")
    done = _project().export_checkpoint(run, position, output)
    where = "the end" if done["at"] == "end" else f"{done['loop']} {done['at']}"
    click.echo(
        terminal_safe(
            f"wrote {output}: the checkpoint at {where} of run {done['run_id']} "
            f"({', '.join(done['names'])})"
        ),
        err=True,
    )


@cli.command("ui")
@click.option(
    "--port", type=click.IntRange(min=0, max=65535), help="Port (default 7431, or a free one)."
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Anything but loopback lets other machines in: every request "
    "then needs the printed token.",
)
@click.option("--no-browser", is_flag=True, help="Print the address; do not open a browser.")
@click.option(
    "--no-index",
    is_flag=True,
    help="Do not read long series ahead in the background (an idle-priority process that "
    "makes first charts fast).",
)
@_handle_errors
def ui_command(port: int | None, host: str, no_browser: bool, no_index: bool) -> None:
    """Open the dashboard: runs, charts, code diffs, and replays with their estimate.

    Serves the project's store on a local web server until Ctrl-C. Anything that
    runs code (a replay) needs the token in the printed address.

    \b
    Example:
      retrolog ui
      retrolog ui --port 8080 --no-browser
    """
    from retrolog.ui import serve

    serve(_project(), host=host, port=port, open_browser=not no_browser, index=not no_index)


@cli.command("migrate")
@click.option(
    "--objects",
    "url",
    help="Where the objects go: s3://bucket/prefix, another fsspec URL, or a directory.",
)
@click.option(
    "--to",
    "database",
    help="Where the metadata goes: a PostgreSQL URL, postgresql://user@host:5432/dbname.",
)
@click.option("--dry-run", is_flag=True, help="Print what would be copied; copy nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--json", "as_json", is_flag=True, help="Write the report as JSON.")
@_handle_errors
def migrate_command(
    url: str | None, database: str | None, dry_run: bool, yes: bool, as_json: bool
) -> None:
    """Move the store's objects (checkpoints, code copies) to another object store,
    and its metadata (runs, logs) to a PostgreSQL database a team shares.

    --objects: runs recorded without a copy of their code in the objects get one first.
    Then every object is copied, read back from the target and verified against
    its key, and only when all verified is objects_url set in the store's
    config.toml, so later recordings, replays and gc use the target. Nothing is
    deleted: the local objects stay until you remove them, and running it again
    copies only what is missing and verifies everything again. It refuses while
    a run is recording.

    --to: every run of the embedded store that the database lacks is copied (its
    loops, logs, checkpoints' records, profile and definitions, with the replays
    and definitions runs share), each in one transaction, read back and compared
    row by row (counts and a sha256); a run already there is compared the same way
    and never overwritten. Then database_url is set in the store's config.toml,
    unless the URL holds a password (put that in ~/.pgpass). Nothing is deleted;
    running it again copies only what is missing. With both, the objects go first.

    \b
    Example:
      retrolog migrate --objects s3://team-bucket/retrolog --dry-run
      retrolog migrate --objects s3://team-bucket/retrolog --yes
      retrolog migrate --to postgresql://trainer@db.internal/retrolog --objects s3://team/rl
    """
    if url is None and database is None:
        raise click.UsageError(
            "Say where to move: --objects URL (checkpoints and code copies), --to "
            "postgresql://... (runs and logs), or both."
        )
    project = _project()
    reports: dict[str, Any] = {}
    if url is not None:
        reports["objects"] = _migrate_objects(project, url, dry_run, yes, as_json)
    if database is not None:
        reports["database"] = _migrate_database(project, database, dry_run, yes, as_json)
    if as_json:
        only = reports["objects"] if database is None else reports["database"]
        click.echo(json.dumps(reports if len(reports) > 1 else only, indent=2))


def _progress(as_json: bool) -> Callable[[str], None]:
    """Where a migration says what it is doing: stderr, unless the output is JSON."""

    def say(line: str) -> None:
        if not as_json:
            click.echo(terminal_safe(f"retrolog: {line}"), err=True)

    return say


def _ask(question: str, yes: bool, as_json: bool, plan_text: str) -> bool:
    """Whether to go on: --yes, else the user's answer on a terminal."""
    if yes:
        return True
    if not as_json:
        click.echo(terminal_safe(plan_text))
    if not sys.stdin.isatty():
        raise click.UsageError(
            "Not asking on a non-interactive input: pass --yes to migrate, or --dry-run."
        )
    if click.confirm(question, default=False, err=True):
        return True
    click.echo("Nothing copied.", err=True)
    return False


def _migrate_objects(
    project: Any, url: str, dry_run: bool, yes: bool, as_json: bool
) -> dict[str, Any] | None:
    """``migrate --objects``: its report as a dict for --json, else printed."""

    def describe(plan: Any) -> str:
        mb = plan.nbytes / 1e6
        text = (
            f"Copy {plan.missing} of {plan.objects} object(s) ({plan.missing_bytes / 1e6:.1f} of "
            f"{mb:.1f} MB) from {plan.source} to {plan.target}, verify all {plan.objects} there"
        )
        if plan.code_to_backfill:
            text += f", after copying the code versions of {len(plan.code_to_backfill)} run(s)"
        return text + ", then set objects_url in the store's config.toml."

    def confirm(plan: Any) -> bool:
        return _ask("Migrate the objects?", yes, as_json, describe(plan))

    result = project.migrate_objects(url, dry_run=dry_run, confirm=confirm, echo=_progress(as_json))
    if as_json:
        return dict(result.to_dict())
    if dry_run:
        click.echo(terminal_safe(describe(result)))
        return None
    if not hasattr(result, "verified"):
        return None  # not confirmed
    lines = [
        f"Copied {result.copied} object(s) ({result.copied_bytes / 1e6:.1f} MB) to "
        f"{result.target}; {result.objects - result.copied} were there already. Verified "
        f"{result.verified} of {result.objects} ({result.verified_bytes / 1e6:.1f} MB).",
        f"objects_url is now {result.target} in {result.config_file}; the objects in "
        f"{result.source} were left as they were (remove them yourself when you no longer "
        "need them).",
    ]
    if result.code_backfilled:
        lines.append(f"Code versions copied for {len(result.code_backfilled)} run(s).")
    for run_id, why in result.code_unavailable.items():
        lines.append(
            f"Run {run_id}: its code version could not be copied ({why}); replay it from a "
            "clone that has its ref."
        )
    if result.still_overridden:
        lines.append(
            f"{result.still_overridden} is set in this environment and still points "
            f"elsewhere; unset it (or set it to {result.target}) to use the new objects."
        )
    for line in lines:
        click.echo(terminal_safe(line))
    return None


def _migrate_database(
    project: Any, url: str, dry_run: bool, yes: bool, as_json: bool
) -> dict[str, Any] | None:
    """``migrate --to``: its report as a dict for --json, else printed."""
    from retrolog._config import mask

    def describe(plan: Any) -> str:
        copy = [r for r in plan.runs if r.outcome == "copied"]
        rows = sum(r.rows for r in copy)
        return (
            f"Copy {len(copy)} of {len(plan.runs)} run(s) ({rows:,} rows) from {plan.source} "
            f"to {plan.target}, verify every run there, then set database_url in the store's "
            "config.toml."
        )

    def confirm(plan: Any) -> bool:
        return _ask("Migrate the runs?", yes, as_json, describe(plan))

    result = project.migrate_database(
        url, dry_run=dry_run, confirm=confirm, echo=_progress(as_json)
    )
    if as_json:
        return dict(result.to_dict())
    if dry_run:
        click.echo(terminal_safe(describe(result)))
        return None
    if not result.done:
        return None  # not confirmed
    copied = [r for r in result.runs if r.outcome == "copied"]
    lines = [
        f"Copied {len(copied)} run(s) ({sum(r.rows for r in copied):,} rows) to "
        f"{result.target}; {len(result.runs) - len(copied)} were there already. Verified "
        f"{result.verified} of {len(result.runs)}.",
    ]
    if result.config_file:
        lines.append(
            f"database_url is now {mask(url)} in {result.config_file}; the embedded store "
            f"{result.source} was left as it was."
        )
    else:
        lines.append(
            "The URL holds a password, which retrolog does not write into a file: put it in "
            "~/.pgpass (or PGPASSWORD) and set database_url = "
            f"{mask(url).replace(':***@', '@')!r} in .retrolog/config.toml or [tool.retrolog]."
        )
    if result.still_overridden:
        lines.append(
            f"{result.still_overridden} is set in this environment and still points "
            "elsewhere; unset it (or set it to the new database) to use it."
        )
    for line in lines:
        click.echo(terminal_safe(line))
    return None


@cli.command("config")
@click.option("--json", "as_json", is_flag=True, help="Write JSON.")
@_handle_errors
def config_command(as_json: bool) -> None:
    """Show every setting, its value and where it came from.

    A setting comes from its environment variable, else from config.toml in the
    store, else from [tool.retrolog] in the project's pyproject.toml, else its
    default (docs/configuration.md). Passwords in URLs are shown as ***.

    \b
    Example:
      retrolog config
      RETROLOG_QUERY_TIMEOUT=30 retrolog config --json
    """
    settings = _project().config()
    if as_json:
        click.echo(json.dumps(settings, indent=2))
        return
    width = max(len(s["key"]) for s in settings)
    for s in settings:
        click.echo(terminal_safe(f"{s['key']:<{width}}  {s['value']}  ({s['source']})"))


def _project() -> Any:
    """The project of the current directory: what every command reads and replays through."""
    from retrolog._project import Project

    return Project()


def _code_location(d: dict[str, Any]) -> str:
    """Where a run's code version is kept (docs/code-versions.md)."""
    if d.get("code_manifest"):
        kept = f"in the store's objects (code manifest {d['code_manifest'][:12]})"
    else:
        kept = "not in the store (recorded before it kept code, or ended before the copy)"
    if d.get("git_dir"):
        kept += f"; ref in {d['git_dir']}"
    return kept


def _format_details(d: dict[str, Any]) -> str:
    lines = [
        f"run        {d['run_id']}",
        f"project    {d['projid']}",
        f"script     {d['filename']}",
        f"status     {d['status']}" + (f" ({d['error']})" if d.get("error") else ""),
        f"started    {d['tstamp']}   duration {d['duration']}",
        f"host       {d['host']} (pid {d['pid']}), python {d['python']}",
        f"argv       {' '.join(d.get('argv') or [])}",
        "args       " + (" ".join(f"{k}={v}" for k, v in (d.get("args") or {}).items()) or "-"),
    ]
    if d.get("parsed_args"):
        parsed = d["parsed_args"]
        lines.append("parsed     " + " ".join(f"{k}={v}" for k, v in parsed.items()))
    lines += [
        f"code       {d.get('code_ref')} -> {(d.get('code_commit') or '')[:12]}"
        + (" (uncommitted changes)" if d.get("dirty") else ""),
        f"code kept  {_code_location(d)}",
    ]
    if d.get("head_commit"):
        lines.append(f"HEAD then  {d['head_commit'][:12]}")
    if d.get("skipped_files"):
        lines.append("skipped    " + ", ".join(d["skipped_files"]) + " (over the size cap)")
    if d.get("packages"):
        lines.append("packages   " + ", ".join(f"{k} {v}" for k, v in d["packages"].items()))
    if d.get("numerics"):
        lines.append("numerics   " + _format_numerics(d["numerics"]))
    if d["loops"]:
        lines.append(
            "loops      "
            + ", ".join(
                f"{lp['name']} x{lp['iterations']} (depth {lp['depth']})" for lp in d["loops"]
            )
        )
    if d["names"]:
        lines.append(
            "logged     "
            + ", ".join(f"{n['name']} ({n['count']}, {n['level']})" for n in d["names"])
        )
    lines += _definition_lines(d.get("definitions") or [])
    lines += _backfill_lines(d.get("backfills") or [])
    lines += _checkpoint_lines(d["checkpoints"])
    if d["profile"]:
        lines.append(_profile_line(d["profile"]))
    return "\n".join(lines)


def _definition_lines(definitions: list[dict[str, Any]]) -> list[str]:
    """A run's `defined` lines: each logged name's definition, as `show` prints it."""
    lines: list[str] = []
    for n in definitions:
        if n["lineage"] is None:
            lines.append(f"defined    {n['name']} ({n['origin']}): kept before definitions were")
            continue
        uses = f" using {', '.join(n['dependencies'])}" if n["dependencies"] else ""
        coarse = f" [coarse: {n['coarse']}]" if n["coarse"] else ""
        lines.append(
            f"defined    {n['name']} {n['lineage'][:8]} ({n['origin']}): {n['statement']}"
            f"{uses}{coarse}"
        )
    return lines


def _backfill_lines(backfills: list[dict[str, Any]]) -> list[str]:
    """A run's `backfilled` lines: each replay's values, with their exactness."""
    lines: list[str] = []
    for b in backfills:
        mark = ""
        if b["inexact"] == "mismatch":
            mark = f", INEXACT: {b['reason'] or 'the deferred check found differences'}"
        elif b["inexact"]:
            mark = f", possibly inexact: {b['reason'] or 'another numerical environment'}"
        lines.append(f"backfilled {b['name']} ({b['count']}, replay {b['replay_id']}{mark})")
    return lines


def _checkpoint_lines(ck: dict[str, Any]) -> list[str]:
    """A run's checkpoint lines: how many and their size, and the chosen blocks' fate."""
    lines = [f"checkpoints {ck['count']} ({ck['bytes'] / 1e6:.2f} MB)"]
    if "chosen" in ck:
        blocks = f"chosen {ck['chosen']}, written {ck['written']}, abandoned {ck['abandoned']}"
        if ck["lost"]:
            blocks += f", lost to a failed write {ck['lost']}"
        if ck["refused_writer_full"]:
            blocks += f"; refused, writer full {ck['refused_writer_full']}"
        lines.append("  blocks    " + blocks)
        if ck["abandoned_at"]:
            lines.append(
                "  abandoned "
                + ", ".join(
                    "the end state"
                    if a["kind"] == "end"
                    else f"{a['loop']} {a['iteration'] if a['iteration'] is not None else '?'}"
                    for a in ck["abandoned_at"]
                )
            )
        if ck.get("lost_at"):
            lines.append(
                "  lost      "
                + ", ".join(
                    ("the end state" if a["kind"] == "end" else f"{a['loop']} {a['iteration']}")
                    + f" ({a['reason']})"
                    for a in ck["lost_at"]
                )
            )
    return lines


def _profile_line(prof: dict[str, Any]) -> str:
    """A run's `profile` line: its prefix, iterations and suffix timings."""
    parts = []
    for phase in ("prefix", "iteration", "suffix"):
        if phase in prof:
            p = prof[phase]
            parts.append(
                f"{phase} {p['seconds']:.2f}s"
                + (f" over {p['count']}" if phase == "iteration" else "")
            )
    return "profile    " + ", ".join(parts)


def _format_numerics(n: dict[str, Any]) -> str:
    """The recorded numerical environment, in one line."""
    parts = []
    torch = n.get("torch") or n.get("torch_at_start") or {}
    if torch:
        parts.append(
            f"torch {torch.get('version', '?')}: {torch.get('intra_op_threads', '?')} intra-op / "
            f"{torch.get('inter_op_threads', '?')} inter-op threads"
        )
        flags = [
            key.replace("_", " ")
            for key in ("cudnn_deterministic", "cudnn_benchmark")
            if torch.get(key)
        ]
        if (torch.get("deterministic_algorithms") or [False])[0]:
            flags.insert(0, "deterministic algorithms")
        if torch.get("cpu_capability"):
            flags.append(f"{torch['cpu_capability']} kernels")
        parts += flags
    env = {k: v for k, v in (n.get("env") or {}).items() if v is not None}
    parts += [f"{k}={v}" for k, v in env.items()]
    cpu = (n.get("machine") or {}).get("cpu")
    if cpu:
        parts.append(f"CPU {cpu}")
    return ", ".join(parts) or "-"


def main() -> None:
    """Entry point of the ``retrolog`` console script."""
    cli(prog_name="retrolog")
