"""Benchmark: the dashboard (`retrolog ui`) on a store of 10,000 runs.

Run from the repository root with the project's venv (retrolog[ui] and playwright installed,
Debian's chromium at /usr/bin/chromium: `bash scripts/setup_browser.sh`):

    python -m bench.bench_ui                  # about 5 minutes on a 2-core machine
    python -m bench.bench_ui --reps 7
    python -m bench.bench_ui --sizes 300,1000 --reps 3   # the table and charts at these sizes

The store is a real one (``connect`` + ``migrate`` on a temporary directory's
``.retrolog/retrolog.db``), filled the way the runtime fills it, seeded:

- 10,000 runs of ``train.py``, each with 4 arguments (``lr``, ``batch_size``,
  ``seed``, ``optimizer``, recorded as parsed arguments and as run-level values)
  and 10 epochs;
- per epoch 15 names (``acc``, ``val_loss``, ``m1`` .. ``m13``);
- ``loss`` at every step: 100,000 steps (10 epochs x 10,000) in 50 runs, 100
  steps in the others.

20 names, 8.0 million log records and 6.0 million loop rows. Then a real
``retrolog ui --no-browser`` process serves it, and the benchmark measures:

- the runs table's JSON (HTTP, median of ``--reps``): the first page as the page
  opens it; with two picked columns (``acc``, ``loss:min``); sorted by a picked
  column (``acc:max``, computed for every run); filtered by ``lr > 0.005`` (an
  argument) and by ``acc > 0.9`` (a name logged per epoch: the dataframe view);
- in Chromium (Playwright): from navigation to the table drawn (``ready``; for the
  chart, to its last line stroked), first contentful paint, and the longest
  main-thread task (``longtask`` entries), for the runs page and for a chart of
  ``loss`` over the 50 long runs (50 x 100,000 points; the view's state is in the
  address);
- the chart's series alone (HTTP, 50 runs x 100,000 points at 1,200 px), each with
  a fresh cache per repetition: the first time with no indexer (read from the
  store), again (kept in the server's memory; as JSON and in the page's binary
  form), after a restart (kept in .retrolog/cache), and the first time on a
  dashboard started as users start it, once its background indexer is done (and
  how long the indexer took for the whole store);
- the server's resident memory after serving those requests, with the store at
  1,000, 5,000 and 10,000 runs (the same seeded runs, a fresh server each).

Targets: table under 1 s, chart under 0.5 s, no browser task longer
than 200 ms, server memory flat in the number of runs. Results:
bench/results/ui.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import retrolog
from bench.harness import conditions, spread
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect

RUNS, EPOCHS = 10_000, 10
LONG_RUNS, LONG_STEPS, SHORT_STEPS = 50, 10_000, 10  # steps per epoch
EPOCH_NAMES = ["acc", "val_loss"] + [f"m{i}" for i in range(1, 14)]
CHROMIUM = os.environ.get("RETROLOG_CHROMIUM", "/usr/bin/chromium")
TARGETS = {"table_seconds": 1.0, "chart_seconds": 0.5, "longest_task_ms": 200}


def build_store(root: Path, runs: int, start: int = 0) -> None:
    """Runs ``start`` .. ``runs - 1`` of the seeded shape, appended to root's store."""
    store = root / ".retrolog"
    store.mkdir(parents=True, exist_ok=True)
    conn = connect(store / "retrolog.db")
    migrate(conn)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("BEGIN")
    for r in range(start, runs):
        rng = random.Random(r)
        run_id = f"20260101-{r // 3600:02d}{(r // 60) % 60:02d}{r % 60:02d}-{r:06x}"
        started = 1_780_000_000.0 + r * 600
        args = {
            "lr": rng.choice([0.001, 0.003, 0.01, 0.03]),
            "batch_size": rng.choice([32, 64, 128]),
            "seed": r,
            "optimizer": rng.choice(["adam", "sgd"]),
        }
        conn.execute(
            "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, ended_at,"
            " host, pid, python, argv, args, parsed_args, code_commit, code_tree, dirty)"
            " VALUES (?, 'proj', ?, 'train.py', 'finished', ?, ?, 'host', 1, '3.11', '[]', '{}',"
            " ?, ?, ?, 0)",
            (
                run_id,
                time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)),
                started,
                started + 500,
                json.dumps(args),
                f"{r % 7:040x}",
                f"{r % 7:040x}",
            ),
        )
        logs: list[tuple[Any, ...]] = [
            (run_id, None, name, value, type(value).__name__) for name, value in args.items()
        ]
        loops: list[tuple[Any, ...]] = []
        steps = LONG_STEPS if r < LONG_RUNS else SHORT_STEPS
        ctx = 0
        t = 0.0
        loss = 2.5
        for epoch in range(EPOCHS):
            epoch_ctx, ctx = ctx, ctx + 1
            t_epoch = t
            for step in range(steps):
                step_ctx, ctx = ctx, ctx + 1
                loops.append((run_id, step_ctx, epoch_ctx, "step", step, 1, t, t + 0.01))
                t += 0.01
                loss = max(0.01, loss * 0.99995 + rng.gauss(0, 0.01))
                logs.append((run_id, step_ctx, "loss", loss, "float"))
            loops.append((run_id, epoch_ctx, None, "epoch", epoch, 0, t_epoch, t))
            for name in EPOCH_NAMES:
                logs.append((run_id, epoch_ctx, name, rng.random(), "float"))
        conn.executemany(
            "INSERT INTO loops (run_id, ctx_id, parent_ctx, name, iteration, depth, t_start,"
            " t_end) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            loops,
        )
        conn.executemany(
            "INSERT INTO logs (run_id, ctx_id, name, value, value_type) VALUES (?, ?, ?, ?, ?)",
            logs,
        )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


class Server:
    """A ``retrolog ui --no-browser --port 0`` process in ``root`` (``index``: with its
    background indexer)."""

    def __init__(self, root: Path, index: bool = False) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
        flags = [] if index else ["--no-index"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "retrolog", "ui", "--no-browser", "--port", "0", *flags],
            cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stderr is not None
        for line in self.process.stderr:
            found = re.search(r"(http://\S+)/\?token=(\S+)", line)
            if found:
                self.base, self.token = found.group(1), found.group(2)
                return
        raise RuntimeError(f"retrolog ui did not start: {self.process.wait()}")

    def get(self, path: str, **params: Any) -> tuple[float, Any]:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        began = time.perf_counter()
        with urllib.request.urlopen(url, timeout=600) as response:
            body = response.read()
        seconds = time.perf_counter() - began
        return seconds, body if params.get("format") == "binary" else json.loads(body)

    def get_bytes(self, path_and_query: str) -> bytes:
        with urllib.request.urlopen(f"{self.base}{path_and_query}", timeout=600) as response:
            return response.read()

    def indexed(self) -> float:
        """Seconds until the background indexer has read every long series."""
        began = time.perf_counter()
        while self.get("/api/project")[1]["indexer"].get("state") != "idle":
            time.sleep(0.5)
        return time.perf_counter() - began

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()


TABLE_VIEWS: dict[str, dict[str, Any]] = {
    "first page": {},
    "two columns": {"columns": "acc,loss:min"},
    "sorted by acc:max": {"columns": "acc:max", "sort": "acc:max"},
    "where lr > 0.005": {"where": "lr > 0.005", "columns": "acc"},
    "where acc > 0.9 (a per-epoch name)": {"where": "acc > 0.9", "columns": "acc"},
}

LONGTASKS = """
window.__longtasks = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__longtasks.push(e.duration);
}).observe({type: "longtask", buffered: true});
"""


def browser_view(page: Any, url: str, wait: str) -> dict[str, float]:
    """Navigate to ``url`` and wait for ``wait``: seconds to ready, first paint, longest task."""
    began = time.perf_counter()
    page.goto(url)
    page.wait_for_function(wait, timeout=600_000)
    ready = time.perf_counter() - began
    page.wait_for_timeout(300)  # let the last tasks be reported
    timing = page.evaluate(
        "() => ({fcp: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime"
        " || null, tasks: window.__longtasks})"
    )
    return {
        "ready_seconds": ready,
        "first_paint_seconds": (timing["fcp"] or 0) / 1000,
        "longest_task_ms": max(timing["tasks"], default=0.0),
    }


# -- runs x steps x metrics: the runs table read from the runs' summaries ---------------------
#
# ``--sizes 300,1000``: stores of that many runs, each 5,000 steps of 3 metrics (``loss``,
# ``acc``, ``lr_now``) plus 3 arguments, written through the embedded store's record sink
# (store/records.py: the writer's own path, which keeps the summaries), one batch per run.
# Measured per size, at the API (a real ``retrolog ui --no-index``) and in Chromium: the
# table with 5 metric columns, and sorted by an aggregate. Chart timings (a 300-run chart,
# a grid of 6, parallel coordinates) belong in METRIC_VIEWS / browser_metric_views as more
# entries over the same stores.

METRIC_STEPS = 5_000
METRICS = ("loss", "acc", "lr_now")
FIVE_COLUMNS = "loss:last,loss:min,acc:max,acc:mean,lr_now:last"
METRIC_VIEWS: dict[str, dict[str, Any]] = {
    "5 metric columns": {"columns": FIVE_COLUMNS},
    "5 metric columns, sorted by loss:min": {"columns": FIVE_COLUMNS, "sort": "loss:min"},
    "5 metric columns, sorted by acc:mean": {"columns": FIVE_COLUMNS, "sort": "acc:mean"},
}


def build_metric_store(root: Path, runs: int, start: int = 0) -> None:
    """Runs ``start`` .. ``runs - 1``: METRIC_STEPS steps of METRICS each, seeded."""
    from retrolog.store.records import RecordBatch, SqliteRecordSink

    store = root / ".retrolog"
    store.mkdir(parents=True, exist_ok=True)
    conn = connect(store / "retrolog.db")
    migrate(conn)
    conn.close()
    sink = SqliteRecordSink(store / "retrolog.db")
    sink._conn.execute("PRAGMA synchronous = OFF")
    try:
        for r in range(start, runs):
            rng = random.Random(r)
            run_id = f"20260102-{r // 3600:02d}{(r // 60) % 60:02d}{r % 60:02d}-{r:06x}"
            started = 1_780_000_000.0 + r * 600
            args = {"lr": rng.choice([1e-3, 3e-3, 1e-2]), "seed": r,
                    "optimizer": rng.choice(["adam", "sgd"])}  # fmt: skip
            sink._conn.execute(
                "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at,"
                " ended_at, host, pid, python, argv, args, parsed_args, code_commit, code_tree,"
                " dirty) VALUES (?, 'proj', ?, 'train.py', 'finished', ?, ?, 'host', 1, '3.11',"
                " '[]', '{}', ?, ?, ?, 0)",
                (run_id, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)), started,
                 started + 500, json.dumps(args), f"{r % 7:040x}", f"{r % 7:040x}"),
            )  # fmt: skip
            batch = RecordBatch()
            batch.values.extend((None, name, value) for name, value in args.items())
            loss, acc, t = 2.5, 0.1, 0.0
            for step in range(METRIC_STEPS):
                batch.loop_starts.append((step, None, "step", step, None, 0, t))
                batch.loop_ends.append((t + 0.01, step))
                t += 0.01
                loss = max(0.01, loss * 0.9995 + rng.gauss(0, 0.01))
                acc = min(1.0, acc + rng.random() * 1e-4)
                batch.values.append((step, "loss", loss))
                batch.values.append((step, "acc", acc))
                batch.values.append((step, "lr_now", args["lr"] * (1 - step / METRIC_STEPS)))
            sink.write(run_id, batch)
    finally:
        sink.close()


def browser_metric_views(page: Any, server: Server, reps: int) -> dict[str, Any]:
    """In Chromium: the page opened with 5 metric columns (navigation to the table drawn),
    and a click on a metric column's header to the table sorted by it."""
    url = f"{server.base}/?token={server.token}&" + urllib.parse.urlencode(
        {"columns": FIVE_COLUMNS}
    )
    drawn = "document.body.dataset.ready === '1' && document.querySelector('#runs tbody tr')"
    opened, sorted_by = [], []
    for _ in range(reps):
        opened.append(browser_view(page, url, drawn)["ready_seconds"])
        for key in ("loss:min", "acc:mean"):
            header = f"#runs thead th[data-key='{key}']"
            began = time.perf_counter()
            page.click(header)
            page.wait_for_selector(f"{header}[aria-sort]", timeout=600_000)
            sorted_by.append(time.perf_counter() - began)
    return {"open with 5 metric columns": spread(opened),
            "click to sort by an aggregate": spread(sorted_by)}  # fmt: skip


# -- charts over the same stores: what a user waits for, at the API and in Chromium ---------
#
# The page draws a chart of the selected runs (the address's ``runs``), one cell of the grid
# per name (``charts``), each cell's series asked for at the cell's pixel width and
# CHART_HEIGHT with a points budget of width x height across all its runs. Parallel
# coordinates and the scatter read one /api/runs page (up to 1,000 runs) with the charted
# names' aggregates. "Cold": a fresh ``retrolog ui --no-index`` on a store whose
# .retrolog/cache was removed, so the series are read from the store; "warm": the same
# request again on that server (its series kept in memory).

CHART_RUNS = 300
VIEWPORT = {"width": 1280, "height": 900}
# Six names the runs log: the three step-level metrics and the three arguments (one
# run-level value per run, which the chart draws as an empty cell against steps).
GRID = ("loss", "acc", "lr_now", "lr", "seed", "optimizer")
EXPLORED = ("loss", "acc", "lr_now")  # charted names: parallel coordinates' metric axes
CHART_TARGETS = {"chart_cold_seconds": 1.5, "grid_seconds": 3.0}
CELL_DRAWN = (
    "(names) => { const g = window.__retrolog && window.__retrolog.grid;"
    " return !!g && names.every((n) => { const c = g.cells.get(n);"
    " return c && ['drawn', 'empty', 'error'].includes(c.state); }); }"
)
CELL_STATES = "(names) => names.map((n) => window.__retrolog.grid.cells.get(n).state)"


def server_cpu(server: Server) -> float:
    """CPU seconds the server process (its threads and waited-for children) has used."""
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Samples of one measure: wall seconds, the server's CPU seconds, the 1-minute load
    average when it began, and the bytes of the answers."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.load: list[float] = []
        self.bytes: list[int] = []

    def time(self, server: Server, action: Any, *args: Any) -> Any:
        load, cpu, began = os.getloadavg()[0], server_cpu(server), time.perf_counter()
        result = action(*args)
        self.wall.append(time.perf_counter() - began)
        self.cpu.append(server_cpu(server) - cpu)
        self.load.append(load)
        return result

    def summary(self) -> dict[str, Any]:
        found = {"seconds": spread(self.wall), "server_cpu_seconds": spread(self.cpu),
                 "load_average_1min": spread(self.load)}  # fmt: skip
        if self.bytes:
            found["response_bytes"] = spread([float(b) for b in self.bytes])
        return found


def fresh_server(root: Path) -> Server:
    """A ``--no-index`` server with nothing cached: the series are read from the store."""
    shutil.rmtree(root / ".retrolog" / "cache", ignore_errors=True)
    return Server(root)


def series_budget(query: str) -> dict[str, Any]:
    """The points a series request may send (its width x height) and what it asks for."""
    q = urllib.parse.parse_qs(query)
    width, height = int(q["width"][0]), int(q["height"][0])
    return {"name": q["name"][0], "runs": len(q["runs"][0].split(",")), "width": width,
            "height": height, "budget_points": width * height}  # fmt: skip


def binary_points(body: bytes) -> tuple[int, int]:
    """Points sent and points stored, over every series of a binary /api/series answer."""
    header = json.loads(body[4 : 4 + int.from_bytes(body[:4], "little")])
    return sum(s["n"] for s in header), sum(s.get("total", s["n"]) for s in header)


def launch(playwright: Any) -> Any:
    return playwright.chromium.launch(
        executable_path=CHROMIUM, headless=True, chromium_sandbox=False,
        args=["--no-sandbox", "--disable-dev-shm-usage"],
    )  # fmt: skip


def browser_charts(
    browser: Any, root: Path, runs: list[str], size: int, reps: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """In Chromium, each with a fresh server: a chart of ``runs`` from the click that adds
    it to drawn (cold, then warm after a reload), the page opened with the grid of 6, and the
    page opened with parallel coordinates and the scatter. Returns the figures and the
    series requests the page made (name -> query), which the API half repeats."""
    samples = {k: Sampler() for k in (
        "chart, click to drawn, cold", "chart, click to drawn, warm",
        "grid of 6, open to every cell drawn, cold",
        "parallel coordinates and scatter, open to drawn")}  # fmt: skip
    queries: dict[str, str] = {}
    base_query = {"runs": ",".join(runs)}
    explored = min(size, 1000)

    def seen(request: Any) -> None:
        if "/api/series" in request.url:
            query = urllib.parse.urlsplit(request.url).query
            queries[urllib.parse.parse_qs(query)["name"][0]] = query

    for _ in range(reps):
        server = fresh_server(root)
        context = browser.new_context(viewport=VIEWPORT)
        try:
            page = context.new_page()
            page.on("request", seen)
            url = f"{server.base}/?token={server.token}&" + urllib.parse.urlencode(base_query)
            for label in ("chart, click to drawn, cold", "chart, click to drawn, warm"):
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=600_000)

                samples[label].time(server, click_chart, page)
                assert page.evaluate(CELL_STATES, ["loss"]) == ["drawn"], label
                drawn = page.evaluate("window.__retrolog.grid.cells.get('loss').series.length")
                assert drawn == len(runs), label
        finally:
            context.close()
            server.stop()
        server = fresh_server(root)
        context = browser.new_context(viewport=VIEWPORT)
        try:
            page = context.new_page()
            page.on("request", seen)
            url = f"{server.base}/?token={server.token}&" + urllib.parse.urlencode(
                {**base_query, "charts": ",".join(GRID)}
            )

            samples["grid of 6, open to every cell drawn, cold"].time(server, open_grid, page, url)
            states = page.evaluate(CELL_STATES, list(GRID))
            assert states[:3] == ["drawn"] * 3 and "error" not in states, states
            url = f"{server.base}/?token={server.token}&" + urllib.parse.urlencode(
                {"charts": ",".join(EXPLORED), "sx": "lr", "sy": "acc"}
            )

            samples["parallel coordinates and scatter, open to drawn"].time(
                server, open_explore, page, url, explored
            )
        finally:
            context.close()
            server.stop()
    return {label: s.summary() for label, s in samples.items()}, queries


def click_chart(page: Any) -> None:
    """Add a chart of ``loss`` from the page's menu; wait until every line is stroked."""
    page.select_option("#chart-name", "loss")
    page.wait_for_function(CELL_DRAWN, arg=["loss"], timeout=600_000)


def open_grid(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_function(CELL_DRAWN, arg=list(GRID), timeout=600_000)


def open_explore(page: Any, url: str, runs: int) -> None:
    """Open the page; wait for parallel coordinates' 5 axes (lr, seed and the charted names'
    last values) and the scatter's dot per run."""
    page.goto(url)
    page.wait_for_function(
        "(n) => document.getElementById('parallel').dataset.axes === '5'"
        " && document.getElementById('scatter').dataset.points === String(n)",
        arg=runs, timeout=600_000,
    )  # fmt: skip


def api_charts(root: Path, queries: dict[str, str], size: int, reps: int) -> dict[str, Any]:
    """At the API, each cold measure on a fresh server: the page's own series requests (the
    binary form, at the widths the page asked for), one chart and the grid's 6 at once, and
    the runs page that parallel coordinates and the scatter read."""
    from concurrent.futures import ThreadPoolExecutor

    samples = {k: Sampler() for k in (
        "chart of 300 runs, cold", "chart of 300 runs, warm",
        "grid of 6 at once, cold", "grid of 6 at once, warm",
        "parallel coordinates' and scatter's runs page")}  # fmt: skip
    budgets: dict[str, Any] = {}
    columns = ",".join(f"{m}:last" for m in EXPLORED)
    for _ in range(reps):
        server = fresh_server(root)
        try:
            for label in ("chart of 300 runs, cold", "chart of 300 runs, warm"):
                body = samples[label].time(
                    server, server.get_bytes, "/api/series?" + queries["loss"]
                )
                samples[label].bytes.append(len(body))
            sent, stored = binary_points(body)
            budgets["loss"] = {**series_budget(queries["loss"]), "points_sent": sent,
                               "points_stored": stored, "bytes": len(body)}  # fmt: skip

            label = "parallel coordinates' and scatter's runs page"
            runs_page = "/api/runs?" + urllib.parse.urlencode(
                {"limit": "1000", "sort": "started_at", "desc": "1", "columns": columns}
            )
            body = samples[label].time(server, server.get_bytes, runs_page)
            samples[label].bytes.append(len(body))
            assert len(json.loads(body)["rows"]) == min(size, 1000)
        finally:
            server.stop()
        server = fresh_server(root)
        try:
            for label in ("grid of 6 at once, cold", "grid of 6 at once, warm"):
                paths = ["/api/series?" + queries[n] for n in GRID]
                with ThreadPoolExecutor(len(GRID)) as pool:
                    bodies = samples[label].time(
                        server,
                        lambda: list(pool.map(server.get_bytes, paths)),  # noqa: B023
                    )
                samples[label].bytes.append(sum(len(b) for b in bodies))
            for name, body in zip(GRID, bodies, strict=True):
                sent, stored = binary_points(body)
                budgets[f"grid: {name}"] = {
                    **series_budget(queries[name]),
                    "points_sent": sent,
                    "points_stored": stored,
                    "bytes": len(body),
                }
        finally:
            server.stop()
    for found in budgets.values():
        found["within_budget"] = found["points_sent"] <= found["budget_points"]
    return {"seconds": {label: s.summary() for label, s in samples.items()},
            "series_budgets": budgets}  # fmt: skip


def measure_charts(root: Path, size: int, reps: int) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    server = Server(root)
    try:
        rows = server.get("/api/runs", limit=CHART_RUNS, sort="started_at")[1]["rows"]
    finally:
        server.stop()
    runs = [r["run_id"] for r in rows]
    with sync_playwright() as playwright:
        browser = launch(playwright)
        try:
            chromium, queries = browser_charts(browser, root, runs, size, reps)
        finally:
            browser.close()
    return {"chart_runs": len(runs), "viewport": VIEWPORT, "grid": list(GRID),
            "chromium": chromium, "api": api_charts(root, queries, size, reps)}  # fmt: skip


def measure_metric_store(
    sizes: list[int], reps: int, root: Path, stores: Path | None = None
) -> dict[str, Any]:
    """Per size, the table's figures and the charts'; ``stores``: a directory holding (or
    to hold, kept) one store per size, ``stores/300`` and so on, built where missing."""
    from playwright.sync_api import sync_playwright

    found: dict[str, Any] = {}
    built = 0
    for size in sizes:
        t0 = time.perf_counter()
        if stores is not None:
            root = stores / str(size)
            if not (root / ".retrolog").exists():
                build_metric_store(root, size)
        else:
            build_metric_store(root, size, built)
        built = size
        took = time.perf_counter() - t0
        print(f"store: {size} runs x {METRIC_STEPS} steps ({took:.0f} s)", file=sys.stderr)
        server = Server(root)
        try:
            api: dict[str, Any] = {}
            for label, params in METRIC_VIEWS.items():
                samples = []
                for _ in range(reps):
                    seconds, table = server.get("/api/runs", **params)
                    assert table["total"] == size and len(table["rows"]) == min(100, size)
                    samples.append(seconds)
                api[label] = spread(samples)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=CHROMIUM, headless=True, chromium_sandbox=False,
                    args=["--no-sandbox", "--disable-dev-shm-usage"],
                )  # fmt: skip
                try:
                    page = browser.new_context().new_page()
                    page.add_init_script(LONGTASKS)
                    chromium = browser_metric_views(page, server, reps)
                finally:
                    browser.close()
        finally:
            server.stop()
        found[str(size)] = {
            "runs": size,
            "values": size * METRIC_STEPS * len(METRICS),
            "build_seconds": took,
            "bytes": (root / ".retrolog" / "retrolog.db").stat().st_size,
            "api_seconds": api,
            "chromium_seconds": chromium,
            "charts": measure_charts(root, size, reps),
        }
    return found


def run_metric_stores(args: argparse.Namespace, root: Path) -> int:
    from bench.harness import source_fingerprint

    started, load_before = time.time(), os.getloadavg()
    source = source_fingerprint()
    sizes = sorted(int(n) for n in args.sizes.split(","))
    result = measure_metric_store(sizes, args.reps, root, args.stores)
    load_after = os.getloadavg()
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    out["runs_table_by_runs"] = {
        **conditions(
            "ui",
            started,
            load_before,
            load_after,
            args.reps,
            retrolog.__version__,
            source,
            source_fingerprint(),
        ),
        "steps_per_run": METRIC_STEPS,
        "metrics": list(METRICS),
        "columns": FIVE_COLUMNS,
        "target_seconds": TARGETS["table_seconds"],
        "chart_targets": CHART_TARGETS,
        "by_runs": result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for size, figures in result.items():
        print(f"{size} runs ({figures['values']:,} values):")
        for label, s in {**figures["api_seconds"], **figures["chromium_seconds"]}.items():
            print(f"  {label:45s} {s['median']:.3f} s [{s['min']:.3f}..{s['max']:.3f}]")
        charts = figures["charts"]
        for side in ("chromium", "api"):
            table = charts[side] if side == "chromium" else charts[side]["seconds"]
            for label, m in table.items():
                s, c = m["seconds"], m["server_cpu_seconds"]
                size_note = (f", {m['response_bytes']['median'] / 1e6:.2f} MB"
                             if "response_bytes" in m else "")  # fmt: skip
                print(f"  {side}: {label:45s} {s['median']:.3f} s [{s['min']:.3f}.."
                      f"{s['max']:.3f}], server CPU {c['median']:.3f} s{size_note}")  # fmt: skip
        for name, b in charts["api"]["series_budgets"].items():
            print(f"  {name}: {b['points_sent']:,} of {b['points_stored']:,} points, budget "
                  f"{b['budget_points']:,} ({b['width']}x{b['height']}), "
                  f"{b['bytes']:,} bytes")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ui.json")
    parser.add_argument("--keep", type=Path, help="build the store here and keep it")
    parser.add_argument(
        "--sizes",
        help="measure the runs table on stores of these many runs x 5,000 steps x 3 metrics "
        "(e.g. 300,1000) instead of the 10,000-run store",
    )
    parser.add_argument(
        "--stores",
        type=Path,
        help="with --sizes: keep (or reuse) one store per size in this directory's 300/, 1000/",
    )
    args = parser.parse_args(argv)
    if args.keep is not None and (args.keep / ".retrolog").exists():
        parser.error(f"{args.keep} already holds a store; --keep takes a new directory")
    root = args.keep or Path(tempfile.mkdtemp(prefix="retrolog-bench-ui-"))
    try:
        return run_metric_stores(args, root) if args.sizes else run(args, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> int:
    from playwright.sync_api import sync_playwright

    started, load_before = time.time(), os.getloadavg()
    memory: dict[str, Any] = {}
    built = 0
    for size in (1_000, 5_000, RUNS):
        t0 = time.perf_counter()
        build_store(root, size, built)
        built = size
        print(f"store: {size} runs ({time.perf_counter() - t0:.0f} s to add)", file=sys.stderr)
        server = Server(root)
        try:
            server.get("/api/runs")
            server.get("/api/runs", columns="acc:max", sort="acc:max")
            server.get("/api/runs", where="lr > 0.005", columns="acc")
            memory[str(size)] = {"rss_mb_after_table": server.rss_mb()}
        finally:
            server.stop()
    result = measure(root, args.reps, sync_playwright, memory)
    load_after = os.getloadavg()
    out = {
        **conditions(
            "ui", started, load_before, load_after, args.reps, retrolog.__version__, None, None
        ),
        "store": {
            "runs": RUNS,
            "names": 4 + 1 + len(EPOCH_NAMES),
            "long_runs": LONG_RUNS,
            "points_per_long_run": LONG_STEPS * EPOCHS,
            "bytes": (root / ".retrolog" / "retrolog.db").stat().st_size,
        },
        "targets": TARGETS,
        **result,
        "server_memory_by_runs": memory,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    report(out)
    return 0


def chart_json(server: Server, runs: list[str], binary: bool = False) -> float:
    """Seconds for the series of a 1,200-pixel chart: the JSON API's form, or the page's."""
    extra = {"format": "binary"} if binary else {}
    seconds, found = server.get(
        "/api/series", name="loss", runs=",".join(runs), width=1200, **extra
    )
    if binary:
        header = json.loads(found[4 : 4 + int.from_bytes(found[:4], "little")])
        assert [s["n"] for s in header] and all(s["n"] <= 4 * 1200 for s in header)
        found = header
    else:
        assert all(len(s["x"]) <= 4 * 1200 for s in found)
    assert len(found) == LONG_RUNS and all(s["total"] == LONG_STEPS * EPOCHS for s in found)
    return seconds


def measure(root: Path, reps: int, sync_playwright: Any, memory: dict[str, Any]) -> dict[str, Any]:
    """Every figure but the memory by size, on the full store."""
    cache = root / ".retrolog" / "cache"
    chart: dict[str, list[float]] = {
        "first ever, before indexing": [], "again": [], "again, the page's binary form": [],
        "after a restart": [], "first, once the indexer is done": [],
    }  # fmt: skip
    indexing: list[float] = []
    for _ in range(reps):
        # The first chart of these runs reads the store (no indexer); the same chart again
        # is served from memory; after a restart, from .retrolog/cache.
        shutil.rmtree(cache, ignore_errors=True)
        server = Server(root)
        try:
            long_runs = [r["run_id"] for r in server.get(
                "/api/runs", sort="started_at", desc="0", limit=LONG_RUNS)[1]["rows"]]  # fmt: skip
            chart["first ever, before indexing"].append(chart_json(server, long_runs))
            chart["again"].append(chart_json(server, long_runs))
            chart["again, the page's binary form"].append(chart_json(server, long_runs, True))
        finally:
            server.stop()
        server = Server(root)
        try:
            chart["after a restart"].append(chart_json(server, long_runs))
        finally:
            server.stop()
        # As users run it: the dashboard's indexer reads long series ahead when it starts.
        shutil.rmtree(cache, ignore_errors=True)
        server = Server(root, index=True)
        try:
            indexing.append(server.indexed())
            chart["first, once the indexer is done"].append(chart_json(server, long_runs))
        finally:
            server.stop()
    server = Server(root)
    try:
        figures = measure_server(server, reps, sync_playwright, long_runs)
        memory[str(RUNS)]["rss_mb_after_charts"] = server.rss_mb()
    finally:
        server.stop()
    figures["chart_json_seconds"] = {k: spread(v) for k, v in chart.items()}
    figures["indexer_seconds"] = spread(indexing)
    return figures


def measure_server(
    server: Server, reps: int, sync_playwright: Any, long_runs: list[str]
) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for label, params in TABLE_VIEWS.items():
        times = []
        for _ in range(reps):
            seconds, body = server.get("/api/runs", **params)
            times.append(seconds)
        assert body["total"] > 0 and body["rows"], label
        table[label] = spread(times)
    _, found = server.get("/api/series", name="loss", runs=",".join(long_runs), width=1200)
    sent = sum(len(s["x"]) for s in found)
    views: dict[str, list[dict[str, float]]] = {"runs page": [], "chart of 50 runs": []}
    chart_query = urllib.parse.urlencode({"runs": ",".join(long_runs), "name": "loss"})
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, chromium_sandbox=False,
            args=["--no-sandbox", "--disable-dev-shm-usage"],
        )  # fmt: skip
        try:
            for _ in range(reps):
                for label, url, wait in (
                    ("runs page", f"{server.base}/?token={server.token}",
                     "document.body.dataset.ready === '1'"),
                    ("chart of 50 runs", f"{server.base}/?{chart_query}&token={server.token}",
                     "document.body.dataset.ready === '1' && window.__retrolog.chart !== null"
                     f" && window.__retrolog.series.length === {LONG_RUNS}"
                     " && window.__retrolog.drawn === true"),  # every line stroked
                ):  # fmt: skip
                    context = browser.new_context(viewport={"width": 1280, "height": 900})
                    context.add_init_script(LONGTASKS)
                    page = context.new_page()
                    views[label].append(browser_view(page, url, wait))
                    context.close()
        finally:
            browser.close()
    browser_figures = {
        label: {key: spread([v[key] for v in samples]) for key in samples[0]}
        for label, samples in views.items()
    }
    return {
        "table_json_seconds": table,
        "chart_points_sent": sent,
        "chart_points_stored": LONG_RUNS * LONG_STEPS * EPOCHS,
        "browser": browser_figures,
    }


def report(out: dict[str, Any]) -> None:
    def fmt(s: dict[str, Any], scale: float = 1.0, unit: str = "s") -> str:
        return (f"{s['median'] * scale:.3f} {unit} [{s['min'] * scale:.3f}.."
                f"{s['max'] * scale:.3f}]")  # fmt: skip

    print(f"store: {out['store']}")
    for label, s in out["table_json_seconds"].items():
        print(f"runs table JSON, {label:20s} {fmt(s)}")
    for label, s in out["chart_json_seconds"].items():
        print(f"chart series, 50 runs x 100,000 points, {label:32s} {fmt(s)}")
    print(f"indexer, every long series of the store: {fmt(out['indexer_seconds'])}")
    print(f"chart points sent: {out['chart_points_sent']} of {out['chart_points_stored']}")
    for label, figures in out["browser"].items():
        print(f"browser, {label}: ready {fmt(figures['ready_seconds'])}, first paint "
              f"{fmt(figures['first_paint_seconds'])}, longest task "
              f"{fmt(figures['longest_task_ms'], unit='ms')}")  # fmt: skip
    for size, m in out["server_memory_by_runs"].items():
        print(f"server RSS with {size} runs: {m}")


if __name__ == "__main__":
    sys.exit(main())
