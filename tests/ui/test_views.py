"""The dashboard's views in a real browser (Debian's chromium driven by Playwright): a run's
page as its own view with its address, Back and Forward between views, a checkpoint
downloaded and loaded with torch.load(weights_only=True), the environment as a table, and
the comparison's metric summaries."""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import values_by_run

READY = "body[data-ready='1']"
SECTIONS = "() => [...document.querySelectorAll('main > section:not([hidden])')].map(s => s.id)"


def watch(page: Any) -> list[str]:
    """Console errors and failed responses (a 404 favicon among them) the page meets."""
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on(
        "response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None
    )
    return problems


def test_a_run_opens_as_its_own_view_and_back_and_forward_step_through_views(
    page: Any, dashboard: Any, recorded: Any, tmp_path: Path
) -> None:
    problems = watch(page)
    page.set_viewport_size({"width": 900, "height": 400})
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    assert page.evaluate(SECTIONS) == ["runs-view", "chart-view", "explore-view"]
    # The table's own state: a filter and a selection.
    page.fill("#where", "lr > 0.15")
    page.click("#filter button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 2")
    rows = page.locator("#runs tbody tr")
    chosen = rows.nth(0).get_attribute("data-run")
    opened = rows.nth(1).get_attribute("data-run")
    page.check(f"#runs tbody tr[data-run='{chosen}'] input[type=checkbox]")
    table_address = page.url

    # The run's page replaces the table, at the top of the window, with its own address.
    page.evaluate("window.scrollTo(0, document.body.scrollHeight)")
    assert page.evaluate("window.scrollY") > 0
    page.click(f"#runs tbody tr[data-run='{opened}'] a.run-link")
    page.wait_for_function(f"document.getElementById('run-title').textContent === 'run {opened}'")
    assert page.evaluate(SECTIONS) == ["run-view"]
    assert page.evaluate("window.scrollY") == 0
    assert "view=run" in page.url and f"run={opened}" in page.url
    assert page.locator("#run-charts").count() == 1  # the metric charts' place

    # The environment as a table: packages with their versions, no JSON.
    env = page.inner_text("#run-environment table.env")
    assert f"numpy\t{__import__('numpy').__version__}" in env
    assert "python\t" in env and "{" not in env

    # A checkpoint downloaded is a torch.save file of the checkpoint's objects.
    acc = values_by_run(recorded.root, "acc")[opened]
    with page.expect_download() as download:
        page.click("#run-checkpoints a[data-at='0']")
    saved = tmp_path / "epoch0.pt"
    download.value.save_as(saved)
    assert download.value.suggested_filename == f"{opened}-epoch0.pt"
    loaded = torch.load(saved, weights_only=True)
    assert list(loaded) == ["state"]
    assert 1 - loaded["state"]["w"] == acc[0]  # the run logged acc = 1 - w after epoch 0
    with page.expect_download() as download:
        page.click("#run-checkpoints a[data-at='end']")
    download.value.save_as(saved)
    assert 1 - torch.load(saved, weights_only=True)["state"]["w"] == acc[-1]

    # Back: the table as it was, filter and selection kept; Forward: the run again.
    page.go_back()
    page.wait_for_function("!document.getElementById('runs-view').hidden")
    assert page.evaluate(SECTIONS) == ["runs-view", "chart-view", "explore-view"]
    assert page.url == table_address
    assert page.input_value("#where") == "lr > 0.15"
    page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 2")
    assert page.is_checked(f"#runs tbody tr[data-run='{chosen}'] input[type=checkbox]")
    page.go_forward()
    page.wait_for_function("!document.getElementById('run-view').hidden")
    assert page.evaluate(SECTIONS) == ["run-view"]
    assert page.inner_text("#run-title") == f"run {opened}"

    # The address alone gives the view: reloaded, the run's page.
    page.reload()
    page.wait_for_selector(READY)
    assert page.evaluate(SECTIONS) == ["run-view"]
    page.wait_for_function("document.querySelectorAll('#run-checkpoints a[download]').length")
    assert problems == []


def test_compare_shows_metric_summaries_beside_the_arguments_and_code(
    page: Any, dashboard: Any, recorded: Any
) -> None:
    problems = watch(page)
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    for box in page.locator("#runs tbody input[type=checkbox]").all():
        box.check()
    runs = page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.run)")
    page.click("#compare-selected")
    page.wait_for_function("document.querySelector('#compare-metrics table')")
    assert page.evaluate(SECTIONS) == ["compare-view"]
    assert "view=compare" in page.url
    assert "lr" in page.inner_text("#compare-args")
    assert "+DECAY = 0.002" in page.inner_text("#compare-diffs")
    header = page.locator("#compare-metrics thead th").all_inner_texts()
    assert sorted(header[1:]) == sorted(runs)
    runs = header[1:]  # the comparison's order, oldest first
    cells: dict[tuple[str, str], list[str]] = {}
    section = ""
    for row in page.locator("#compare-metrics tbody tr").all():
        texts = row.locator("th, td").all_inner_texts()
        if len(texts) == 1:
            section = texts[0]
        else:
            cells[(section, texts[0])] = texts[1:]
    assert {name for name, _ in cells} == {"acc", "loss"}  # lr is an argument, not a metric
    for name in ("acc", "loss"):
        stored = values_by_run(recorded.root, name)
        for how, pick in (("last", lambda v: v[-1]), ("min", min), ("max", max)):
            for run_id, text in zip(runs, cells[(name, how)], strict=True):
                assert math.isclose(float(text), pick(stored[run_id]), rel_tol=1e-5)
    # Back: the table.
    page.go_back()
    page.wait_for_function("!document.getElementById('runs-view').hidden")
    assert page.evaluate(SECTIONS) == ["runs-view", "chart-view", "explore-view"]
    assert problems == []


def test_without_torch_on_the_server_a_download_says_what_to_install(
    page: Any, serve: Any, recorded: Any, tmp_path: Path
) -> None:
    # The dashboard's own Python cannot import torch (the runs were recorded with it).
    blocker = tmp_path / "no_torch"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\n\nsys.modules['torch'] = None\n")
    path = os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))
    with serve(recorded, PYTHONPATH=path) as dashboard:
        page.goto(dashboard.url)
        page.wait_for_selector(READY)
        run_id = page.locator("#runs tbody tr").first.get_attribute("data-run")
        page.click(f"#runs tbody tr[data-run='{run_id}'] a.run-link")
        page.click("#run-checkpoints a[data-at='end']")
        page.wait_for_selector("#run-checkpoint-error:not([hidden])")
        assert "pip install 'retrolog[torch]'" in page.inner_text("#run-checkpoint-error")
        # The address itself answers with the same advice, never a traceback.
        address = f"{dashboard.base}/api/runs/{run_id}/checkpoints/end"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(address, timeout=30)
        assert refused.value.code == 400
        error = json.loads(refused.value.read())["error"]
        assert "needs torch, which is not installed" in error
        assert "pip install 'retrolog[torch]'" in error


def test_the_download_address_names_what_is_wrong_and_the_favicon_is_served(
    recorded: Any,
) -> None:
    from starlette.testclient import TestClient

    from retrolog import Project
    from retrolog.ui.server import Settings, create_app

    app = create_app(Project(recorded.root), Settings(host="127.0.0.1", port=7431))
    with TestClient(app, base_url="http://127.0.0.1:7431") as client:
        run_id = client.get("/api/runs").json()["rows"][0]["run_id"]
        word = client.get(f"/api/runs/{run_id}/checkpoints/last")
        assert word.status_code == 400
        assert "outer-loop iteration or 'end'" in word.json()["error"]
        missing = client.get(f"/api/runs/{run_id}/checkpoints/99")
        assert missing.status_code == 400
        assert f"Run {run_id} has no checkpoint at epoch 99" in missing.json()["error"]
        assert "end" in missing.json()["error"]
        assert client.get("/api/runs/nope/checkpoints/end").status_code == 400
        icon = client.get("/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
        assert client.get("/api/project").json()["torch"] is True
