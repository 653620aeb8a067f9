"""The dashboard in a real browser (Debian's chromium driven by Playwright), end to end:
runs recorded across two code versions, found in the table, charted, replayed from the page,
and a page on another site refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from cpu_watch import cpu_seconds, goes_quiet, runs_a_query

from conftest import read_db, read_pg, values_by_run

READY = "body[data-ready='1']"


# Whether the chart's canvas holds pixels of each colour (anti-aliasing blends the edges of a
# line, so its middle pixels are the ones to find).
STROKED = """(colours) => {
  const canvas = window.__retrolog.chart.ctx.canvas;
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  return colours.map((hex) => {
    const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
    for (let i = 0; i < data.length; i += 4) {
      if (Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b) < 12
          && data[i + 3] > 240) return true;
    }
    return false;
  });
}"""


def drawn(page: Any) -> list[dict[str, Any]]:
    """The series the chart holds, as the page received them (x, y, origin per run)."""
    return page.evaluate(
        "() => window.__retrolog.chart ? window.__retrolog.series.map(s => ({run_id: s.run_id,"
        " x: s.x, y: s.y, origin: s.origin})) : []"
    )


def picked_cells(page: Any) -> list[list[str]]:
    """Per row of the runs table: its run id and the exact value (the title) of the
    next-to-last column, the first picked column (``loss:max``)."""
    return page.locator("#runs tbody tr").evaluate_all(  # type: ignore[no-any-return]
        "rows => rows.map(r => [r.dataset.run, r.lastElementChild.previousElementSibling.title])"
    )


def chart_every_row(page: Any, name: str) -> None:
    """Select every run of the table and chart ``name`` in a narrow window (300 px: more
    values per run than 4 per pixel column), until both runs' series are in."""
    page.set_viewport_size({"width": 300, "height": 900})
    for box in page.locator("#runs tbody input[type=checkbox]").all():
        box.check()
    page.select_option("#chart-name", name)
    page.wait_for_function("window.__retrolog.chart && window.__retrolog.series.length === 2")


def test_find_chart_and_replay_runs_from_the_browser(
    page: Any, dashboard: Any, recorded: Any, log_w_sq_today: Any
) -> None:
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    assert "token" not in page.url  # dropped from the address bar and history
    rows = page.locator("#runs tbody tr")
    assert rows.count() == 3

    # Filter with the CLI's predicate; a bad one is an inline error.
    page.fill("#where", "lr >>> 1")
    page.click("#filter button[type=submit]")
    page.wait_for_selector("#where-error:not([hidden])")
    assert "lr >>> 1" in page.inner_text("#where-error")
    page.fill("#where", "lr > 0.15")
    page.fill("#columns", "loss:max, acc")
    page.click("#filter button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 2")
    assert "where=lr+%3E+0.15" in page.url  # the view's state is in the address
    loss = values_by_run(recorded.root, "loss")
    shown = picked_cells(page)
    for run_id, loss_max in shown:
        assert float(loss_max) == max(loss[run_id])

    # Select both and chart loss: every drawn point is a stored value, the spike included.
    # A narrow window: 1,200 values per run are more than 4 per pixel column.
    chart_every_row(page, "loss")
    # The page strokes the lines itself, a few runs per frame: both runs' colours are on it.
    page.wait_for_function("window.__retrolog.drawn === true")
    colours = page.evaluate("ids => ids.map(runColor)", [s["run_id"] for s in drawn(page)])
    assert page.evaluate(STROKED, colours) == [True, True]
    for series in drawn(page):
        stored = loss[series["run_id"]]
        assert max(series["y"]) == max(stored)
        assert all(stored[int(x)] == y for x, y in zip(series["x"], series["y"], strict=True))
        assert len(series["x"]) < len(stored)  # downsampled to the chart's width
    # Hovering the spike shows its exact stored value.
    spike_run = drawn(page)[0]["run_id"]
    page.evaluate(  # the mouse on the spike, where it is drawn
        "() => { const u = window.__retrolog.chart, s = window.__retrolog.series[0];"
        " const j = s.x.indexOf(617);"
        " u.setCursor({left: u.valToPos(s.shown_x[j], 'x'), top: 10}); }"
    )
    assert f"{spike_run}: {max(loss[spike_run])!r}" in page.inner_text("#chart-tip")
    # Compare the two: lr differs, and the code diff between their versions shows.
    page.click("#compare-selected")
    page.wait_for_selector("#compare-args table")
    assert "lr" in page.inner_text("#compare-args")
    diff = page.inner_text("#compare-diffs")
    assert "-DECAY = 0.001" in diff and "+DECAY = 0.002" in diff
    # A run's page: its arguments, checkpoints and the code it ran.
    page.go_back()
    newest = page.locator("#runs tbody tr").first.get_attribute("data-run")
    page.click(f"#runs tbody tr[data-run='{newest}'] a.run-link")
    page.wait_for_function("document.getElementById('run-code').textContent.includes('DECAY')")
    assert "DECAY = 0.002" in page.inner_text("#run-code")
    assert "epoch 0" in page.inner_text("#run-checkpoints")  # which iterations have one
    # Reloading the address gives the same view.
    page.reload()
    page.wait_for_selector(READY)
    page.wait_for_function("window.__retrolog.chart && window.__retrolog.series.length === 2")

    # Today's script logs a new name; replay the selected runs from the page.
    log_w_sq_today()
    page.click("#nav a[data-view='replay']")
    page.focus("#replay-names")  # the page offers what today's script logs that no run has
    page.wait_for_function("document.getElementById('replay-hint').textContent.includes('w_sq')")
    page.fill("#replay-names", "w_sq")
    page.click("#replay-plan")
    page.wait_for_selector("#replay-start:not([disabled])", timeout=120_000)
    plan = page.inner_text("#replay-output")
    assert "w_sq" in plan
    page.click("#replay-start")
    page.wait_for_function(
        "document.getElementById('status').textContent.startsWith('replay')", timeout=240_000
    )
    assert page.inner_text("#status") == "replay finished", page.inner_text("#replay-output")
    page.click("#nav a[data-view='runs']")
    page.select_option("#chart-name", "w_sq")
    page.wait_for_function(
        "window.__retrolog.series.length === 2"
        " && window.__retrolog.series.every(s => s.x.length === 3)"
    )
    acc = values_by_run(recorded.root, "acc")
    for series in drawn(page):
        assert set(series["origin"]) == {1}  # backfilled
        assert len(series["y"]) == 3 == len(acc[series["run_id"]])
    # Drawn as backfilled: on the dashed series of each run, none on the solid one.
    lines = page.evaluate(
        "() => { const u = window.__retrolog.chart; return u.series.slice(1).map((s, i) =>"
        " [s.label, !!s.dash, u.data[i + 1].filter(v => v !== null && v !== undefined).length]); }"
    )
    for label, dashed, points in lines:
        if label.endswith(" backfilled"):
            assert dashed and points == 3
        elif not label.endswith(" inexact"):
            assert not dashed and points == 0


def test_a_page_on_another_site_cannot_start_a_replay(
    page: Any, dashboard: Any, tmp_path: Path
) -> None:
    # A page the user happens to visit, on another origin, tries both kinds of POST.
    (tmp_path / "evil.html").write_text(
        "<script>\n"
        f"const target = '{dashboard.base}/api/replay';\n"
        "const body = JSON.stringify({names: ['acc'], force: true});\n"
        "window.results = Promise.allSettled([\n"
        "  fetch(target, {method: 'POST', mode: 'no-cors', body,"
        " headers: {'Content-Type': 'text/plain'}}),\n"
        "  fetch(target, {method: 'POST', body, headers: {'Content-Type': 'application/json',"
        " 'X-Retrolog-Token': 'guess'}}),\n"
        "]).then(r => r.map(x => x.status));\n"
        "</script>\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        port = server.stdout.readline().split("port ")[1].split()[0]
        page.goto(f"http://127.0.0.1:{port}/evil.html")
        page.wait_for_function("window.results !== undefined")
        outcomes = page.evaluate("window.results")
        assert outcomes[1] == "rejected"  # the preflight is not answered
    finally:
        server.terminate()
        server.communicate()
    with urllib.request.urlopen(f"{dashboard.base}/api/replays", timeout=30) as response:
        assert json.loads(response.read()) == []  # nothing was started


SLOW = """\
import time

import retrolog as rl

for epoch in rl.loop("epoch", range(40)):
    rl.log("acc", epoch / 40)
    time.sleep(0.25)
"""


def test_a_running_run_updates_without_reloading(page: Any, dashboard: Any, recorded: Any) -> None:
    recorded.write("slow.py", SLOW)
    proc = subprocess.Popen(
        [sys.executable, "slow.py"], cwd=recorded.root, env=recorded.env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not read_db(recorded.root, "SELECT 1 FROM runs WHERE status = 'running'"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        page.goto(dashboard.url)
        page.wait_for_selector(READY)
        running = "#runs tbody td.running"
        page.wait_for_selector(running, timeout=30_000)
        run_id = page.locator(running).first.evaluate("td => td.parentElement.dataset.run")
        page.locator(f"#runs tbody tr[data-run='{run_id}'] input[type=checkbox]").check()
        page.select_option("#chart-name", "acc")
        page.wait_for_function("window.__retrolog.series.length === 1")
        first = page.evaluate("window.__retrolog.series[0].x.length")
        # More values arrive, and the run ends, with no reload.
        page.wait_for_function(
            "window.__retrolog.series.length === 1"
            f" && window.__retrolog.series[0].x.length > {first}",
            timeout=30_000,
        )
        page.wait_for_selector(f"#runs tbody tr[data-run='{run_id}'] td.finished", timeout=60_000)
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
    finally:
        proc.kill()
        proc.wait()


def _pg_values(url: str, name: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for run_id, value in read_pg(
        url,
        "SELECT run_id, COALESCE(value_float, value_int) FROM logs WHERE name = %s"
        " ORDER BY run_id, ctx_id, log_id",
        (name,),
    ):
        found.setdefault(str(run_id), []).append(float(str(value)))
    return found


def test_the_dashboard_reads_and_replays_a_postgresql_store(
    page: Any, team_dashboard: Any, project: Any, pg_store_url: str
) -> None:
    """The team's store: the runs table with a predicate (judged by PostgreSQL) and
    picked columns, a chart of stored values, and a replay started from the page that
    backfills into the database."""
    assert not (project.root / ".retrolog" / "retrolog.db").exists()  # nothing local
    page.goto(team_dashboard.url)
    page.wait_for_selector(READY)
    assert page.locator("#runs tbody tr").count() == 3
    page.fill("#where", "lr > 0.15")
    page.fill("#columns", "loss:max, acc")
    page.click("#filter button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 2")
    loss = _pg_values(pg_store_url, "loss")
    shown = picked_cells(page)
    assert len(shown) == 2
    for run_id, loss_max in shown:
        assert float(loss_max) == max(loss[run_id])

    # Chart loss for both: every drawn point is a stored value.
    chart_every_row(page, "loss")
    for series in drawn(page):
        stored = loss[series["run_id"]]
        assert max(series["y"]) == max(stored)
        assert all(stored[int(x)] == y for x, y in zip(series["x"], series["y"], strict=True))

    # Today's script logs a new name; a replay from the page backfills it into PostgreSQL.
    path = project.root / "train.py"
    line = '            rl.log("acc", 1 - state["w"])\n'
    source = path.read_text()
    assert line in source
    path.write_text(source.replace(line, line + '            rl.log("w_sq", state["w"] ** 2)\n'))
    page.click("#nav a[data-view='replay']")
    page.fill("#replay-names", "w_sq")
    page.click("#replay-plan")
    page.wait_for_selector("#replay-start:not([disabled])", timeout=120_000)
    assert "w_sq" in page.inner_text("#replay-output")
    page.click("#replay-start")
    page.wait_for_function(
        "document.getElementById('status').textContent.startsWith('replay')", timeout=240_000
    )
    assert page.inner_text("#status") == "replay finished", page.inner_text("#replay-output")
    page.click("#nav a[data-view='runs']")
    page.select_option("#chart-name", "w_sq")
    page.wait_for_function(
        "window.__retrolog.series.length === 2"
        " && window.__retrolog.series.every(s => s.x.length === 3)"
    )
    w_sq = _pg_values(pg_store_url, "w_sq")
    for series in drawn(page):
        assert set(series["origin"]) == {1}  # backfilled
        assert series["y"] == w_sq[series["run_id"]]
    assert not (project.root / ".retrolog" / "retrolog.db").exists()


# The y axis's size, and the room its widest tick label needs (uPlot's own font).
Y_AXIS_ROOM = """() => {
  const u = window.__retrolog.chart;
  const axis = u.axes[1];
  u.ctx.font = axis.font[0];
  const widest = Math.max(...axis._values.map((v) => u.ctx.measureText(String(v)).width));
  return { size: axis._size, needed: widest / devicePixelRatio + axis.ticks.size + axis.gap,
           labels: axis._values };
}"""


def test_large_values_fit_their_axis(page: Any, dashboard_of_large_values: Any) -> None:
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(dashboard_of_large_values.url)
    page.wait_for_selector(READY)
    page.locator("#runs tbody input[type=checkbox]").first.check()
    page.select_option("#chart-name", "big")
    page.wait_for_function("window.__retrolog.chart && window.__retrolog.series.length === 1")
    room = page.evaluate(Y_AXIS_ROOM)
    assert "6,000,000" in room["labels"], room
    assert room["size"] >= room["needed"], room  # no tick label is clipped
    assert failed == []


# A predicate SQLite never finishes (as in test_api.py): only its 120 s budget would stop it.
ENDLESS = (
    "lr > (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c)"
)


def test_a_new_filter_stops_the_query_of_the_one_it_replaces(page: Any, dashboard: Any) -> None:
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    pid = dashboard.process.pid
    page.fill("#where", ENDLESS)
    page.click("#filter button[type=submit]")
    start = cpu_seconds(pid)
    assert runs_a_query(pid, start)  # the endless predicate runs
    page.fill("#where", "lr > 0.15")
    page.click("#filter button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 2")
    assert goes_quiet(pid)
    assert page.is_hidden("#where-error")  # the abandoned request shows no error
