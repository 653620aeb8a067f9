"""The dashboard's HTTP server: a JSON API over ``retrolog.Project`` and the page itself.

Every endpoint is a call on the one ``Project`` the CLI and the Python API use
(docs/ui.md lists them). Replays run as a child ``retrolog replay`` process,
so the plan a user confirms is the text `retrolog replay --dry-run` prints,
and a replay's workers and signal handling are the command's own.

Security (docs/ui.md, "Who can reach it"): the Host header must name this
server (no DNS rebinding); every API request from a browser must come from this
origin; a request that changes state or runs code must carry the per-launch
token; bound to anything but loopback, every API request needs the token.

A request's reads stop when its client disconnects (``_unless_gone``).
"""

from __future__ import annotations

import csv
import hmac
import importlib.util
import io
import ipaddress
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import orjson
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from retrolog._project import Project, ReplayRequest
from retrolog.errors import RetrologError, UnknownNameError
from retrolog.ui.indexer import Indexer

STATIC = Path(__file__).parent / "static"
TOKEN_HEADER = "X-Retrolog-Token"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EVERY_INTERFACE = ("0.0.0.0", "::", "")
# Every answer is bounded (docs/ui.md, "Bounds").
MAX_WIDTH = 8192  # pixels: a series never sends more than 4 points per pixel of this
DEFAULT_WIDTH = 1000  # pixels, for a series or groups asked for without a width
MAX_HEIGHT, DEFAULT_HEIGHT = 4096, 360  # pixels of a chart's plot, for the points budget
# A chart's series send at most width x height points over all its runs together (one per
# pixel of the plot: more cannot be told apart), each run downsampled on fewer columns as
# runs are added; and never more than 4 per pixel column and run.
POINTS_PER_PIXEL = 1
RUNS_PAGE, MAX_RUNS_PAGE = 100, 1000  # rows of the runs table
FRAME_PAGE, MAX_FRAME_PAGE = 1000, 50_000  # rows of the dataframe
MAX_COMPARED = 20  # runs compared at once
MAX_COMPARED_NAMES = 40  # metrics summarised when runs are compared (3 columns each)


@dataclass
class Settings:
    """What one launch of the server knows about itself."""

    host: str
    port: int
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    # Bound to every interface: the names of this machine that a Host header may give
    # (its hostname, its fully qualified name).
    machine_names: frozenset[str] = frozenset()

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK

    @property
    def everywhere(self) -> bool:
        """Bound to every interface (0.0.0.0 or ::)."""
        return self.host in EVERY_INTERFACE

    def allowed_hosts(self) -> set[str]:
        """Host header values naming this server (with and without the port), whatever the
        address the request came to."""
        names = {"127.0.0.1", "localhost", "[::1]"}
        if not self.loopback:
            names.add(f"[{self.host}]" if ":" in self.host else self.host)
        if self.everywhere:
            names |= {name.lower() for name in self.machine_names}
        return {n.lower() for name in names for n in (name, f"{name}:{self.port}")}

    def names_this_server(self, host: str, local: str | None) -> bool:
        """Whether the Host header ``host`` names this server, for a request that came to
        the local address ``local``. Bound to every interface, that address itself (the
        one the client connected to) is a name of this server too. DNS rebinding always
        puts a domain name in the header, and the names accepted are this machine's own."""
        if host.lower() in self.allowed_hosts():
            return True
        if not self.everywhere or local is None:
            return False
        literal, _, port = host.rpartition(":")
        if not literal or port != str(self.port):
            return False
        try:
            given = ipaddress.ip_address(literal.removeprefix("[").removesuffix("]"))
            arrived = ipaddress.ip_address(local)
        except ValueError:
            return False
        return _unmapped(given) == _unmapped(arrived)

    def origins(self, host: str) -> set[str]:
        """The origins of this server's own page, for a request whose Host is ``host``
        (already checked)."""
        return {f"http://{h}" for h in self.allowed_hosts() | {host.lower()}}


def _unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Any:
    """An IPv4 client of a socket bound to :: arrives at an IPv4-mapped IPv6 address."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


class ReplayJob:
    """One ``retrolog replay`` child process and what it printed so far."""

    def __init__(self, job_id: str, argv: list[str], cwd: Path) -> None:
        self.job_id = job_id
        self.argv = argv
        self.started_at = time.time()
        self.lines: deque[str] = deque(maxlen=2000)
        self.returncode: int | None = None
        self._proc = subprocess.Popen(
            argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, name="retrolog-ui-replay", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        pending = b""
        while chunk := os.read(self._proc.stdout.fileno(), 65536):
            pending += chunk
            # A progress bar rewrites its line with \r: keep its newest state only.
            *done, pending = pending.replace(b"\r\n", b"\n").split(b"\n")
            for raw in done:
                self.lines.append(raw.decode(errors="replace").rsplit("\r", 1)[-1])
        if pending:
            self.lines.append(pending.decode(errors="replace").rsplit("\r", 1)[-1])
        self.returncode = self._proc.wait()

    def cancel(self) -> None:
        """Ctrl-C for the replay: it stops its workers and records what was backfilled."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGINT)

    def wait(self, timeout: float) -> int | None:
        """Its exit code, once it has exited and its output is read (None after ``timeout``)."""
        self._reader.join(timeout)
        return self.returncode

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.job_id,
            "argv": self.argv[3:],
            "started_at": self.started_at,
            "running": self.returncode is None,
            "returncode": self.returncode,
            "output": list(self.lines),
        }


def create_app(project: Project, settings: Settings, indexer: Indexer | None = None) -> Starlette:
    """The dashboard for ``project``, as an ASGI application; ``indexer``: the background
    indexer reading long series ahead, whose state /api/project reports."""
    jobs: dict[str, ReplayJob] = {}
    api = _endpoints(project, settings)
    routes = [
        *_page_routes(settings),
        *_project_routes(project, indexer, api),
        *_run_routes(project, api),
        *_value_routes(project, api),
        *_replay_routes(project, jobs, api),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.jobs = jobs
    return app


class _Endpoint(Protocol):
    """Wraps a handler as an API endpoint: the request's checks, its JSON body, the
    handler's reads cancelled when the client disconnects, its errors as 400s."""

    def __call__(
        self, handler: Callable[[Request], Any], *, changes: bool = False
    ) -> Callable[[Request], Awaitable[Response]]: ...


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _endpoints(project: Project, settings: Settings) -> _Endpoint:
    def api(
        handler: Callable[[Request], Any], *, changes: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            refused = _refusal(request, settings, changes=changes)
            if refused is not None:
                return _error(refused, 403)
            if request.method == "POST":
                try:
                    request.state.body = await request.json()
                except ValueError:
                    return _error("The request's body must be a JSON object.")
            try:
                result = await _unless_gone(request, project, handler)
            except RetrologError as exc:
                return _error(str(exc))
            except ValueError as exc:
                return _error(f"Bad request: {exc}")
            if isinstance(result, Response):
                return result
            return JSONResponse(_json_ready(result))

        return endpoint

    return api


def _page_routes(settings: Settings) -> list[Route]:
    """The page and its icon (its other files are the /static mount)."""

    async def index(request: Request) -> Response:
        refused = _host_refusal(request, settings)
        if refused is not None:
            return _error(refused, 403)
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def favicon(request: Request) -> Response:
        # What a browser or tool asks for when a page names no icon: the page's own.
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    return [Route("/", index), Route("/favicon.ico", favicon)]


def _project_routes(project: Project, indexer: Indexer | None, api: _Endpoint) -> list[Route]:
    """The project: its store, scripts and logged names."""

    def project_info(request: Request) -> dict[str, Any]:
        scripts = project.scripts()
        return {"root": str(project.root), "store": str(project.paths.store), "scripts": scripts,
                "indexer": None if indexer is None else indexer.state,
                # Whether checkpoints can be downloaded as torch.save files here.
                "torch": importlib.util.find_spec("torch") is not None}  # fmt: skip

    def names(request: Request) -> list[str]:
        return project.names()

    def script(request: Request) -> dict[str, Any]:
        filename = request.query_params.get("script")
        if not filename:
            raise ValueError("script= is required: a script as the runs table names it")
        return {"script": filename, "names": project.script_names(filename)}

    return [
        Route("/api/project", api(project_info)),
        Route("/api/names", api(names)),
        Route("/api/script", api(script)),
    ]


def _run_routes(project: Project, api: _Endpoint) -> list[Route]:
    """The runs table, one run, its checkpoints (as torch.save files), its code, and runs
    compared."""

    def runs(request: Request) -> Any:
        q = request.query_params
        csv_export = q.get("format") == "csv"  # every matching run: one row per run
        table = project.table(
            where=q.get("where") or None,
            columns=_split(q.get("columns")),
            sort=q.get("sort") or "started_at",
            descending=q.get("desc", "1") != "0",
            offset=_count(q.get("offset"), "offset", 0),
            limit=None if csv_export else _page(q.get("limit"), RUNS_PAGE, MAX_RUNS_PAGE),
            status=_split(q.get("status")),
            default_columns=q.get("default") == "1",
            ids=q.get("ids") == "1",
        )
        if q.get("format") == "csv":
            return _csv_response(table, "runs.csv")
        return table

    def run(request: Request) -> dict[str, Any]:
        return project.run(request.path_params["run_id"])

    def checkpoints(request: Request) -> list[dict[str, Any]]:
        return project.checkpoints(request.path_params["run_id"])

    def checkpoint_file(request: Request) -> Response:
        # Written to a temporary file, then streamed from it: a checkpoint can be larger
        # than the server should hold in memory.
        run_id, position = request.path_params["run_id"], request.path_params["at"]
        if position != "end" and not position.isdigit():
            raise ValueError(
                f"a checkpoint is named by its outer-loop iteration or 'end', not {position!r}"
            )
        at: int | str = position if position == "end" else int(position)
        descriptor, path = tempfile.mkstemp(prefix="retrolog-", suffix=".pt")
        try:
            with os.fdopen(descriptor, "wb") as handle:
                found = project.export_checkpoint(run_id, at, handle)
        except BaseException:
            os.unlink(path)
            raise
        label = "end" if found["at"] == "end" else f"{found['loop']}{found['at']}"
        return FileResponse(
            path, media_type="application/octet-stream",
            filename=f"{found['run_id']}-{label}.pt",
            background=BackgroundTask(os.unlink, path),
        )  # fmt: skip

    def code(request: Request) -> dict[str, Any]:
        return project.code(request.path_params["run_id"], request.query_params.get("path"))

    def compare(request: Request) -> dict[str, Any]:
        runs = _split(request.query_params.get("runs"))
        if len(runs) > MAX_COMPARED:
            raise ValueError(f"compare at most {MAX_COMPARED} runs at once, not {len(runs)}")
        found = project.compare(runs)
        found["metrics"] = _metric_summaries(project, found["runs"])
        return found

    return [
        Route("/api/runs", api(runs)),
        Route("/api/runs/{run_id}", api(run)),
        Route("/api/runs/{run_id}/checkpoints", api(checkpoints)),
        Route("/api/runs/{run_id}/checkpoints/{at}", api(checkpoint_file)),
        Route("/api/runs/{run_id}/code", api(code)),
        Route("/api/compare", api(compare)),
    ]


def _value_routes(project: Project, api: _Endpoint) -> list[Route]:
    """The logged values: charts (a name's series per run, or grouped by an argument) and
    the dataframe."""

    def groups(request: Request) -> Response:
        q = request.query_params
        name, by = q.get("name"), q.get("by")
        if not name or not by:
            raise ValueError("name= and by= are required: the logged name, the argument")
        runs = _split(q.get("runs"))
        width = _width(q.get("width"))
        try:
            found = project.groups(
                name, runs, by, x=q.get("x") or "step",
                lo=_number(q.get("lo")), hi=_number(q.get("hi")), width=width,
            )  # fmt: skip
        except UnknownNameError:
            found = []  # not logged yet (a replay may add it): an empty chart, not an error
        return _fast_json([g.to_json() for g in found])

    def series(request: Request) -> Response:
        q = request.query_params
        name = q.get("name")
        if not name:
            raise ValueError("name= is required: the logged name to draw")
        runs, x = _split(q.get("runs")), q.get("x") or "step"
        lo, hi = _number(q.get("lo")), _number(q.get("hi"))
        pixels = _width(q.get("width"))
        budget = pixels * _height(q.get("height")) * POINTS_PER_PIXEL
        binary = q.get("format") == "binary"  # the page's own form
        try:
            if binary:
                found = project.series_bytes(
                    name, runs, x=x, lo=lo, hi=hi, width=pixels, budget=budget
                )
                return Response(found, media_type="application/octet-stream")
            drawn = project.series(name, runs, x=x, lo=lo, hi=hi, width=pixels, budget=budget)
        except UnknownNameError:
            # Not logged yet (a replay may add it): an empty chart, not an error.
            if binary:
                return Response(
                    project.series_bytes(None, []), media_type="application/octet-stream"
                )
            drawn = []
        return _fast_json([s.to_json() for s in drawn])

    def dataframe(request: Request) -> Any:
        q = request.query_params
        offset = _count(q.get("offset"), "offset", 0)
        limit = _page(q.get("limit"), FRAME_PAGE, MAX_FRAME_PAGE)
        frame, total = project.dataframe_page(
            *_split(q.get("names")), where=q.get("where") or None, offset=offset, limit=limit
        )
        if q.get("format") == "csv":
            return Response(
                frame.to_csv(index=False),
                media_type="text/csv",
                headers={
                    "Content-Disposition": 'attachment; filename="dataframe.csv"',
                    "X-Total-Count": str(total),
                },
            )
        page = json.loads(frame.to_json(orient="split", index=False, default_handler=str))
        return {**page, "total": total, "offset": offset, "limit": limit}

    return [
        Route("/api/groups", api(groups)),
        Route("/api/series", api(series)),
        Route("/api/dataframe", api(dataframe)),
    ]


def _replay_routes(project: Project, jobs: dict[str, ReplayJob], api: _Endpoint) -> list[Route]:
    """Replays: the plan (``retrolog replay --dry-run``), one started as a child process,
    and those of this launch (``jobs``), each one's state, and its cancellation."""
    lock = threading.Lock()

    def plan(request: Request) -> dict[str, Any]:
        argv = [*_replay_argv(_body(request)), "--dry-run"]
        try:
            done = subprocess.run(
                [sys.executable, "-m", "retrolog", *argv], cwd=project.root,
                capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise ValueError("planning the replay took more than 10 minutes; stopped") from exc
        return {"returncode": done.returncode, "output": done.stderr + done.stdout}

    def start_replay(request: Request) -> dict[str, Any]:
        argv = [sys.executable, "-m", "retrolog", *_replay_argv(_body(request)), "--yes"]
        with lock:
            if any(j.returncode is None for j in jobs.values()):
                raise ValueError("a replay is already running; wait for it or cancel it")
            job_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
            jobs[job_id] = ReplayJob(job_id, argv, project.root)
        return jobs[job_id].to_json()

    def replays(request: Request) -> list[dict[str, Any]]:
        return [job.to_json() for job in jobs.values()]

    def replay_status(request: Request) -> dict[str, Any]:
        job = jobs.get(request.path_params["job_id"])
        if job is None:
            raise ValueError("no such replay in this launch of the dashboard")
        return job.to_json()

    def cancel_replay(request: Request) -> dict[str, Any]:
        job = jobs.get(request.path_params["job_id"])
        if job is None:
            raise ValueError("no such replay in this launch of the dashboard")
        job.cancel()
        return job.to_json()

    return [
        Route("/api/replay/plan", api(plan, changes=True), methods=["POST"]),
        Route("/api/replay", api(start_replay, changes=True), methods=["POST"]),
        Route("/api/replays", api(replays)),
        Route("/api/replay/{job_id}", api(replay_status)),
        Route("/api/replay/{job_id}/cancel", api(cancel_replay, changes=True), methods=["POST"]),
    ]


def _metric_summaries(project: Project, runs: Sequence[str]) -> dict[str, Any]:
    """The last, min and max of each name the compared runs logged (their arguments aside),
    by run, from the runs table's aggregates."""
    names: dict[str, None] = {}
    for run in runs:
        details = project.run(run)
        args = {**(details.get("parsed_args") or {}), **(details.get("args") or {})}
        names.update((n["name"], None) for n in details["names"] if n["name"] not in args)
    ordered = sorted(names)
    shown = ordered[:MAX_COMPARED_NAMES]
    values: dict[str, dict[str, Any]] = {run: {} for run in runs}
    if shown:
        quoted = ", ".join("'" + r.replace("'", "''") + "'" for r in runs)
        table = project.table(
            where=f"run_id IN ({quoted})",
            columns=[f"{name}:{how}" for name in shown for how in ("last", "min", "max")],
            limit=len(runs),
        )
        for row in table["rows"]:
            values[row["run_id"]] = {column: row.get(column) for column in table["columns"]}
    return {"names": shown, "more": len(ordered) - len(shown), "values": values}


async def _unless_gone(
    request: Request, project: Project, handler: Callable[[Request], Any]
) -> Any:
    """``handler(request)`` on a worker thread, its reads cancelled if the client
    disconnects meanwhile: a browser that left, or an abandoned ``<img>``, does not keep
    a query running for the whole of its time budget."""
    cancellation = project.cancellation()

    def call() -> Any:
        with cancellation.active():
            return handler(request)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        # PostgreSQL's cancel request is a round trip to the server: not on the event loop,
        # and not behind the busy worker threads either.
        threading.Thread(target=cancellation.cancel, name="retrolog-ui-cancel", daemon=True).start()

    outcome: list[Any] = []
    failure: list[BaseException] = []
    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        try:
            outcome.append(await run_in_threadpool(call))
        except Exception as exc:  # raised below, outside the task group (not in a group)
            failure.append(exc)
        group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return outcome[0]


def _fast_json(payload: Any) -> Response:
    """Series and groups: large lists of floats, already JSON-ready (no NaN, no numpy)."""
    return Response(orjson.dumps(payload), media_type="application/json")


def _host_refusal(request: Request, settings: Settings) -> str | None:
    host = request.headers.get("host", "")
    server = request.scope.get("server")
    local = server[0] if server else None
    if not settings.names_this_server(host, local):
        where = (
            f"this machine's addresses and names, port {settings.port}"
            if settings.everywhere
            else f"{settings.host}:{settings.port}"
        )
        return (
            f"This dashboard answers only to {where}, not to the host {host!r} (a page on "
            "another site is not allowed to reach it)."
        )
    return None


def _refusal(request: Request, settings: Settings, *, changes: bool) -> str | None:
    """Why ``request`` is refused, or None."""
    refused = _host_refusal(request, settings)
    if refused is not None:
        return refused
    # Every API request, reads too, must come from this server's own page (or from no page
    # at all: an address typed in, curl): a read can run a user's predicate, and a page on
    # another site can make a browser send a GET (an <img>) without asking.
    origin = request.headers.get("origin")
    if origin is not None and origin.lower() not in settings.origins(request.headers["host"]):
        return f"Refused a request from another site ({origin})."
    if request.headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
        return "Refused a request from another site."
    if changes or not settings.loopback:
        given = request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), settings.token.encode()):
            return (
                f"This request needs the dashboard's token in the {TOKEN_HEADER} header; open "
                "the dashboard from the address `retrolog ui` printed."
            )
    return None


def _body(request: Request) -> dict[str, Any]:
    body = getattr(request.state, "body", None)
    if not isinstance(body, dict):
        raise ValueError("the request needs a JSON object as its body")
    return body


def _replay_argv(body: dict[str, Any]) -> list[str]:
    """``retrolog replay`` arguments for a request from the dashboard."""
    names = body.get("names")
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names) or not names:
        raise ValueError('names must list the log names to replay, e.g. ["w_norm"]')
    where = body.get("where")
    runs = body.get("runs")
    if runs:
        if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
            raise ValueError("runs must be a list of run ids")
        quoted = ", ".join("'" + r.replace("'", "''") + "'" for r in runs)
        picked = f"run_id IN ({quoted})"
        where = f"({where}) AND {picked}" if where else picked
    if where and not isinstance(where, str):
        raise ValueError("where must be a predicate, as `retrolog replay` takes")
    workers = body.get("workers")
    return ReplayRequest(
        names, where or None, script=str(body["script"]) if body.get("script") else None,
        workers=int(workers) if workers else None, force=bool(body.get("force")),
        reuse=not body.get("no_reuse"), allow_inexact=bool(body.get("allow_inexact")),
    ).argv()  # fmt: skip


def _count(text: str | None, name: str, default: int) -> int:
    """A whole number >= 0 given as ``name=``."""
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}= must be a whole number >= 0, not {text!r}")
    return value


def _page(text: str | None, default: int, most: int) -> int:
    """The rows of one page: ``limit=``, ``default`` without one, at most ``most``."""
    limit = _count(text, "limit", default)
    if limit > most:
        raise ValueError(
            f"limit= is at most {most:,} rows a request; ask for the next ones with offset="
        )
    return limit


def _width(text: str | None) -> int:
    """The pixel columns of a chart: ``width=``, DEFAULT_WIDTH without one; at most
    MAX_WIDTH."""
    width = _count(text, "width", DEFAULT_WIDTH)
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width= is a number of pixels from 1 to {MAX_WIDTH}, not {text!r}")
    return width


def _height(text: str | None) -> int:
    """The pixel rows of a chart's plot: ``height=``, DEFAULT_HEIGHT without one."""
    height = _count(text, "height", DEFAULT_HEIGHT)
    if not 1 <= height <= MAX_HEIGHT:
        raise ValueError(f"height= is a number of pixels from 1 to {MAX_HEIGHT}, not {text!r}")
    return height


def _split(text: str | None) -> list[str]:
    return [part for part in (text or "").split(",") if part]


def _number(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _json_ready(value: Any) -> Any:
    """NaN and infinities are not JSON: they become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, str | int | bool) or value is None:
        return value
    return str(value)


def _csv_response(table: dict[str, Any], filename: str) -> Response:
    out = io.StringIO()
    writer = csv.writer(out)
    header: Sequence[str] = [*table["fields"], *table["columns"]]
    writer.writerow(header)
    for row in table["rows"]:
        writer.writerow(
            [
                json.dumps(row.get(k), default=str) if isinstance(row.get(k), dict | list)
                else row.get(k)
                for k in header
            ]
        )  # fmt: skip
    return Response(
        out.getvalue(), media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )  # fmt: skip
