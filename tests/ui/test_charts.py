"""The dashboard's charts in a real browser (Debian's chromium driven by Playwright): a grid
of charts with a legend and one colour per run, export, a run's own charts, parallel
coordinates and a scatter that select runs, and random clicks on the chart controls."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import random
import time
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from conftest import values_by_run

READY = "body[data-ready='1']"

# Every chart of the grid has its answer and has drawn it (or has nothing to draw).
SETTLED = """() => {
  const g = window.__retrolog.grid;
  const cells = [...g.cells.values()];
  return cells.length === g.names.length
    && cells.every((c) => ["drawn", "empty", "error"].includes(c.state));
}"""

# What the grid draws, and what the controls and the address say.
SNAPSHOT = """() => {
  const g = window.__retrolog.grid;
  const el = (id) => document.getElementById(id);
  return {
    names: g.names,
    titles: [...document.querySelectorAll("#charts .chart-title")].map((e) => e.textContent),
    cells: [...g.cells.values()].map((c) => ({
      name: c.name, state: c.state, spec: c.spec,
      runs: c.series.map((s) => s.run_id),
      groups: c.groups ? c.groups.map((x) => x.key) : null,
      labels: c.u ? c.u.series.slice(1).map((s) => s.label) : [],
    })),
    legend: [...document.querySelectorAll("#chart-legend li")].map((li) => li.textContent),
    controls: { group: el("chart-group").value, smooth: Number(el("chart-smooth").value),
      log: el("chart-log").checked, x: el("chart-x").value, label: el("chart-label").value },
    search: location.search,
  };
}"""

# Whether a chart's canvas holds pixels of each colour (the middle pixels of a line).
STROKED = """([name, colours]) => {
  const canvas = window.__retrolog.grid.cells.get(name).u.ctx.canvas;
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


def console_errors(page: Any) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    return errors


def select_all(page: Any) -> list[str]:
    for box in page.locator("#runs tbody input[type=checkbox]").all():
        box.check()
    return page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.run)")  # type: ignore[no-any-return]


def settle(page: Any) -> dict[str, Any]:
    page.wait_for_function(SETTLED, timeout=60_000)
    return page.evaluate(SNAPSHOT)  # type: ignore[no-any-return]


def address(snapshot: dict[str, Any]) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(snapshot["search"][1:]).items()}


def button(page: Any, name: str, title: str) -> Any:
    return page.locator(f"#charts figure[data-name='{name}'] button[title='{title}']")


def test_a_grid_of_charts_with_a_legend_exports_and_a_runs_own_charts(
    page: Any, dashboard: Any, recorded: Any
) -> None:
    errors = console_errors(page)
    page.set_viewport_size({"width": 1300, "height": 1000})
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    runs = select_all(page)
    page.select_option("#chart-name", "loss")
    page.select_option("#chart-name", "acc")
    shot = settle(page)
    # The newest choice first; the order is in the address.
    assert shot["titles"] == shot["names"] == ["acc", "loss"]
    assert address(shot)["charts"] == "acc,loss"
    # One legend, a colour per run: the same run has the same colour in every chart.
    assert sorted(shot["legend"]) == sorted(runs)
    colours = page.evaluate("ids => ids.map(runColor)", runs)
    assert len(set(colours)) == 3
    legend = page.locator("#chart-legend li").evaluate_all(
        "items => items.map(li => [li.textContent,"
        " getComputedStyle(li.firstChild).backgroundColor])"
    )
    for run_id, rgb in legend:
        hex_colour = colours[runs.index(run_id)]
        assert rgb == "rgb({}, {}, {})".format(*(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)))
    page.wait_for_function("[...window.__retrolog.grid.cells.values()].every(c => c.drawn)")
    for name in ("acc", "loss"):
        assert page.evaluate(STROKED, [name, colours]) == [True, True, True]
    # Reordered and labelled by an argument; a reload gives the same grid.
    button(page, "loss", "move left").click()
    page.select_option("#chart-label", "lr")
    shot = settle(page)
    assert shot["titles"] == ["loss", "acc"] and address(shot)["charts"] == "loss,acc"
    assert sorted(shot["legend"]) == ["lr=0.1", "lr=0.2", "lr=0.3"]
    page.reload()
    page.wait_for_selector(READY)
    shot = settle(page)
    assert shot["titles"] == ["loss", "acc"]
    assert sorted(shot["legend"]) == ["lr=0.1", "lr=0.2", "lr=0.3"]

    # The charts follow the window's width.
    before = page.evaluate("window.__retrolog.grid.cells.get('loss').u.width")
    page.set_viewport_size({"width": 500, "height": 1000})
    page.wait_for_function(
        f"window.__retrolog.grid.cells.get('loss').u && "
        f"window.__retrolog.grid.cells.get('loss').u.width < {before - 100}"
    )
    shot = settle(page)
    width = page.evaluate("window.__retrolog.grid.cells.get('loss').plot.clientWidth")
    assert page.evaluate("window.__retrolog.grid.cells.get('loss').u.width") <= width

    # Export: PNG and SVG of what is drawn with its legend, CSV of its points.
    with page.expect_download() as png:
        button(page, "loss", "export as PNG").click()
    data = Path(png.value.path()).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and png.value.suggested_filename == "loss.png"
    with page.expect_download() as svg:
        button(page, "loss", "export as SVG").click()
    tree = ET.parse(svg.value.path()).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    texts = [t.text for t in tree.iter(f"{ns}text")]
    assert "loss" in texts and {"lr=0.1", "lr=0.2", "lr=0.3"} <= set(texts)
    strokes = {p.get("stroke") for p in tree.iter(f"{ns}path")}
    assert strokes == set(colours)
    with page.expect_download() as table:
        button(page, "loss", "export the data as CSV").click()
    rows = list(csv.reader(io.StringIO(Path(table.value.path()).read_text())))
    loss = values_by_run(recorded.root, "loss")
    labels = {page.evaluate("id => runLabel(id, 'lr')", r): r for r in runs}
    assert rows[0][0] == "step" and sorted(rows[0][1:]) == sorted(labels)
    exact = page.evaluate("window.__retrolog.grid.cells.get('loss').series.every(s => s.exact)")
    checked = 0
    for row in rows[1:]:
        for label, value in zip(rows[0][1:], row[1:], strict=True):
            if value and exact:
                assert float(value) == loss[labels[label]][int(float(row[0]))]
                checked += 1
    assert checked == 3 * 1200 or not exact

    # A run's page charts its metrics, for that run alone.
    page.click(f"#runs tbody tr[data-run='{runs[0]}'] a.run-link")
    page.wait_for_function(
        "window.__retrolog.runGrid && window.__retrolog.runGrid.names.length === 2"
        " && [...window.__retrolog.runGrid.cells.values()].every(c => c.state === 'drawn')",
        timeout=60_000,
    )
    cells = page.evaluate(
        "[...window.__retrolog.runGrid.cells.values()].map(c => [c.name, c.series.map(s =>"
        " [s.run_id, s.y.length])])"
    )
    assert sorted(cells) == [["acc", [[runs[0], 3]]], ["loss", [[runs[0], 1200]]]]
    # Removing a chart, back in the runs view.
    page.go_back()
    page.wait_for_selector("#charts", state="visible")
    button(page, "acc", "remove").click()
    shot = settle(page)
    assert shot["titles"] == ["loss"] and address(shot)["charts"] == "loss"
    assert errors == []


def test_parallel_coordinates_and_a_scatter_select_runs(
    page: Any, dashboard: Any, recorded: Any
) -> None:
    errors = console_errors(page)
    page.set_viewport_size({"width": 1300, "height": 1200})
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    page.select_option("#chart-name", "loss")
    page.wait_for_function("document.getElementById('parallel').dataset.axes === '2'")
    lr = dict(
        page.locator("#runs tbody tr").evaluate_all(
            "rows => rows.map(r => [r.dataset.run, window.__retrolog.explore.args.get("
            "r.dataset.run).lr])"
        )
    )
    # Brushing lr's axis from its top (0.3) to below its middle (0.2) selects those runs.
    grip = page.locator("#parallel g[data-axis='lr'] rect.grip").bounding_box()
    x = grip["x"] + grip["width"] / 2
    page.mouse.move(x, grip["y"] + 1)
    page.mouse.down()
    page.mouse.move(x, grip["y"] + grip["height"] * 0.6, steps=4)
    page.mouse.up()
    wanted = sorted(r for r, v in lr.items() if v >= 0.2)
    page.wait_for_function("document.querySelectorAll('#runs tbody tr.selected').length === 2")
    chosen = page.locator("#runs tbody tr.selected").evaluate_all(
        "rows => rows.map(r => r.dataset.run)"
    )
    assert sorted(chosen) == wanted
    assert sorted(urllib.parse.parse_qs(urllib.parse.urlparse(page.url).query)["runs"][0]
                  .split(",")) == wanted  # fmt: skip
    shot = settle(page)
    assert sorted(shot["cells"][0]["runs"]) == wanted  # the chart follows the selection

    # A scatter of acc's last value against lr: a rectangle over the low-lr half selects it.
    page.select_option("#scatter-x", "lr")
    page.select_option("#scatter-y", "acc")
    page.wait_for_function("document.getElementById('scatter').dataset.points === '3'")
    dots = page.locator("#scatter circle").evaluate_all(
        "cs => cs.map(c => [c.dataset.run, c.getBoundingClientRect().x])"
    )
    box = page.locator("#scatter svg").bounding_box()
    lowest = min(dots, key=lambda d: d[1])
    page.mouse.move(box["x"] + 2, box["y"] + 2)
    page.mouse.down()
    page.mouse.move(lowest[1] + 20, box["y"] + box["height"] - 2, steps=4)
    page.mouse.up()
    page.wait_for_function("document.querySelectorAll('#runs tbody tr.selected').length === 1")
    assert page.locator("#runs tbody tr.selected").get_attribute("data-run") == lowest[0]
    assert min(lr, key=lambda r: lr[r]) == lowest[0]
    assert "sx=lr" in page.url and "sy=acc" in page.url

    # Both export as SVG, PNG and CSV: one line or dot per run, the runs' values.
    def export(plot: str, kind: str) -> Path:
        with page.expect_download() as file:
            page.click(f".exports[data-plot='{plot}'] button[title='{kind}']")
        assert file.value.suggested_filename.startswith(plot)
        return Path(file.value.path())

    tree = ET.parse(export("parallel", "export as SVG")).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(list(tree.iter(f"{ns}polyline"))) == 3
    assert {"lr", "loss:last"} <= {t.text for t in tree.iter(f"{ns}text")}
    table = list(
        csv.DictReader(io.StringIO(export("parallel", "export the data as CSV").read_text()))
    )
    assert {r["run_id"]: float(r["lr"]) for r in table} == lr
    loss = values_by_run(recorded.root, "loss")
    assert all(float(r["loss:last"]) == loss[r["run_id"]][-1] for r in table)
    assert export("scatter", "export as PNG").read_bytes()[:4] == b"\x89PNG"
    points = list(
        csv.DictReader(io.StringIO(export("scatter", "export the data as CSV").read_text()))
    )
    acc = values_by_run(recorded.root, "acc")
    assert {r["run_id"]: float(r["acc:last"]) for r in points} == {r: v[-1] for r, v in acc.items()}
    assert errors == []


def test_random_clicks_on_the_chart_controls_draw_what_they_say(page: Any, dashboard: Any) -> None:
    """Seeded: a few quick changes of the chart controls at a time, without waiting for the
    charts, then what the grid draws must be what the controls and the address say.
    RETROLOG_UI_SOAK=N runs N steps instead of 12."""
    errors = console_errors(page)
    page.set_viewport_size({"width": 1300, "height": 1000})
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    runs = select_all(page)
    rng = random.Random(int(os.environ.get("RETROLOG_UI_SEED", "42")))
    steps = int(os.environ.get("RETROLOG_UI_SOAK", "12"))
    names = ["acc", "loss", "lr"]

    def act() -> str:
        cells = page.evaluate("window.__retrolog.grid.names")
        what = rng.choice(["add", "add", "remove", "move", "group", "smooth", "log", "label", "x"])
        if what == "add" or not cells:
            page.select_option("#chart-name", rng.choice(names))
        elif what == "remove":
            button(page, rng.choice(cells), "remove").click()
        elif what == "move":
            target = button(page, rng.choice(cells), rng.choice(["move left", "move right"]))
            if target.is_enabled():
                target.click()
        elif what == "group":
            page.select_option("#chart-group", rng.choice(["", "lr"]))
        elif what == "smooth":
            page.evaluate(
                "v => { const e = document.getElementById('chart-smooth'); e.value = v;"
                " e.dispatchEvent(new Event('input')); }",
                str(rng.choice([0, 0.3, 0.9])),
            )
        elif what == "log":
            page.click("#chart-log")
        elif what == "label":
            page.select_option("#chart-label", rng.choice(["", "lr"]))
        else:
            page.select_option("#chart-x", rng.choice(["step", "time"]))
        return what

    deadline = time.monotonic() + 40 * steps
    for step in range(steps):
        done = [act() for _ in range(rng.randint(1, 3))]  # quick, before any answer
        shot = settle(page)
        where = f"step {step} ({done}): {shot}"
        want = address(shot)
        assert shot["titles"] == shot["names"], where
        assert shot["names"] == [n for n in want.get("charts", "").split(",") if n], where
        controls = shot["controls"]
        legend = set()
        for cell in shot["cells"]:
            spec = cell["spec"]
            assert cell["state"] != "error", where
            for key in ("group", "smooth", "log", "x", "label"):
                assert spec[key] == controls[key], where
            assert spec["name"] == cell["name"], where
            if controls["group"]:
                assert cell["runs"] == [] and cell["groups"] is not None, where
                assert all(label.startswith("lr=") for label in cell["labels"]), where
                legend |= {f"lr={g} (1 run)" for g in cell["groups"]}
            else:
                assert cell["groups"] is None and set(cell["runs"]) <= set(runs), where
                label = (lambda r: page.evaluate("id => runLabel(id, 'lr')", r)) if controls[
                    "label"] else (lambda r: r)  # fmt: skip
                legend |= {label(r) for r in cell["runs"]}
                assert {s.split(" ")[0] for s in cell["labels"]} <= {label(r) for r in runs}
        assert set(shot["legend"]) == legend, where
        assert errors == [], where
        assert time.monotonic() < deadline


SEEDED = """\
import argparse

import retrolog as rl

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

for step in rl.loop("step", range(50)):
    rl.log("loss", 1.0 / (step + 1) + args.seed * 1e-4)
"""


def test_grouping_by_a_continuous_argument_bins_it(page: Any, project: Any, serve: Any) -> None:
    project.write("seeded.py", SEEDED)
    seeds = [3, 17, 29, 41, 58, 64, 77, 85, 93]
    for seed in seeds:
        project.run("seeded.py", "--seed", str(seed))
    errors = console_errors(page)
    with serve(project) as dashboard:
        page.set_viewport_size({"width": 1300, "height": 1000})
        page.goto(dashboard.url)
        page.wait_for_selector(READY)
        select_all(page)
        page.select_option("#chart-name", "loss")
        page.select_option("#chart-group", "seed")
        shot = settle(page)
    (cell,) = shot["cells"]
    bins = cell["groups"]
    # A handful of [low, high] bins in order, covering every seed; not one group per run.
    assert 2 <= len(bins) <= 6 and bins == sorted(bins)
    assert all(any(low <= s <= high for low, high in bins) for s in seeds)
    assert len(shot["legend"]) == len(bins)
    assert all(entry.startswith("seed ") and ".." in entry for entry in shot["legend"])
    counts = [int(e.rsplit("(", 1)[1].split(" ")[0]) for e in shot["legend"]]
    assert sum(counts) == len(seeds)
    assert errors == []


def test_a_late_answer_is_never_drawn_over_a_newer_choice(page: Any, dashboard: Any) -> None:
    """The ungrouped chart's answer is held back until the grouped one is drawn: released
    then, it must not replace the groups (nor raise)."""
    errors = console_errors(page)
    page.set_viewport_size({"width": 1300, "height": 1000})
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    select_all(page)
    held: list[Any] = []
    page.route("**/api/series?*", lambda route: held.append(route))
    page.select_option("#chart-name", "loss")
    page.wait_for_function(
        "window.__retrolog.grid.cells.get('loss')?.state === 'loading'", timeout=30_000
    )
    while not held:
        page.wait_for_timeout(50)
    page.select_option("#chart-group", "lr")
    shot = settle(page)
    assert shot["cells"][0]["groups"] == [0.1, 0.2, 0.3]
    for route in held:  # the old answer arrives after all (its request was aborted)
        with contextlib.suppress(Exception):
            route.continue_()
    page.unroute("**/api/series?*")
    page.wait_for_timeout(1000)
    shot = settle(page)
    assert shot["cells"][0]["groups"] == [0.1, 0.2, 0.3] and shot["cells"][0]["runs"] == []
    assert all(entry.startswith("lr=") for entry in shot["legend"]), shot["legend"]
    assert errors == []
