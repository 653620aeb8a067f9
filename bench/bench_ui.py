"""Benchmark: the dashboard (`retrolog ui`) on a store of 10,000 runs.

Run from the repository root with the project's venv (retrolog[ui] and playwright installed,
Debian's chromium at /usr/bin/chromium: `bash scripts/setup_browser.sh`):

    python -m bench.bench_ui                  # about 5 minutes on a 2-core machine
    python -m bench.bench_ui --reps 7

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


def measure_metric_store(sizes: list[int], reps: int, root: Path) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    found: dict[str, Any] = {}
    built = 0
    for size in sizes:
        t0 = time.perf_counter()
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
        }
    return found


def run_metric_stores(args: argparse.Namespace, root: Path) -> int:
    from bench_log import source_fingerprint

    started, load_before = time.time(), os.getloadavg()
    source = source_fingerprint()
    sizes = sorted(int(n) for n in args.sizes.split(","))
    result = measure_metric_store(sizes, args.reps, root)
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
        "by_runs": result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for size, figures in result.items():
        print(f"{size} runs ({figures['values']:,} values):")
        for label, s in {**figures["api_seconds"], **figures["chromium_seconds"]}.items():
            print(f"  {label:45s} {s['median']:.3f} s [{s['min']:.3f}..{s['max']:.3f}]")
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
