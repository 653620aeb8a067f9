"""The runs table in a real browser (Debian's chromium driven by Playwright): its columns,
selection and filters, what it shows after any sequence of clicks, and its refreshes during
a replay from the page. The console stays clean throughout."""

from __future__ import annotations

import json
import random
import time
import urllib.parse
import urllib.request
from typing import Any

from conftest import values_by_run

READY = "body[data-ready='1']"
SETTLED = "() => !document.querySelector('#runs[aria-busy]') && window.__retrolog.rows"


def console_errors(page: Any) -> list[str]:
    """Every console error and uncaught exception of ``page`` from now on."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def header_keys(page: Any) -> list[str]:
    return page.locator("#runs thead th[data-key]").evaluate_all(  # type: ignore[no-any-return]
        "ths => ths.map(t => t.dataset.key)"
    )


def row_ids(page: Any) -> list[str]:
    return page.locator("#runs tbody tr").evaluate_all(  # type: ignore[no-any-return]
        "rows => rows.map(r => r.dataset.run)"
    )


def cells(page: Any, key: str) -> list[str]:
    """The exact values (titles) of column ``key``, row by row."""
    index = header_keys(page).index(key) + 2  # the checkbox column, then 1-based
    return page.locator(f"#runs tbody tr td:nth-child({index})").evaluate_all(  # type: ignore[no-any-return]
        "tds => tds.map(td => td.title)"
    )


def selected(page: Any) -> list[str]:
    return page.evaluate("() => window.retrolog.selection.get()")  # type: ignore[no-any-return]


def api_table(dashboard: Any, address: str) -> dict[str, Any]:
    """What /api/runs answers for the view the page's address holds."""
    q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(address).query))
    params = {
        "sort": q.get("sort", "started_at"),
        "desc": q.get("desc", "1"),
        "offset": q.get("offset", "0"),
        "limit": "100",
    }
    for key in ("where", "status"):
        if key in q:
            params[key] = q[key]
    if "columns" not in q:
        params["default"] = "1"
    elif q["columns"] != "-":
        params["columns"] = q["columns"]
    request = urllib.request.Request(
        f"{dashboard.base}/api/runs?{urllib.parse.urlencode(params)}",
        headers={"X-Retrolog-Token": dashboard.token},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def test_the_runs_table_columns_selection_and_filters(page: Any, dashboard: Any) -> None:
    errors = console_errors(page)
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    # The last value of each metric the runs log; each argument its own column (once).
    keys = header_keys(page)
    assert {"acc:last", "loss:last", "args.lr"} <= set(keys)
    assert "lr:last" not in keys
    assert "args" not in keys
    # A filter keeps the default columns (the address names none).
    page.fill("#where", "lr > 0.05")
    page.click("#filter button[type=submit]")
    page.wait_for_function("location.search.includes('where')")
    page.wait_for_load_state("networkidle")
    assert "columns" not in page.url and {"acc:last", "loss:last"} <= set(header_keys(page))
    page.fill("#where", "")
    page.click("#filter button[type=submit]")
    page.wait_for_function("!location.search.includes('where')")
    # Sorting by an argument, both ways.
    page.click("#runs thead th[data-key='args.lr']")
    page.wait_for_selector("th[data-key='args.lr'][aria-sort='descending']")
    assert cells(page, "args.lr") == ["0.3", "0.2", "0.1"]
    page.click("#runs thead th[data-key='args.lr']")
    page.wait_for_selector("th[data-key='args.lr'][aria-sort='ascending']")
    assert cells(page, "args.lr") == ["0.1", "0.2", "0.3"]

    # The picker: a checkbox per metric and aggregate; the mean of loss as a column.
    page.click("#column-picker summary")
    page.check("#column-grid input[data-column='loss:mean']")
    page.wait_for_selector("#runs thead th[data-key='loss:mean']")
    assert "loss%3Amean" in page.url
    shown = [float(v) for v in cells(page, "loss:mean")]
    assert shown == [r["loss:mean"] for r in api_table(dashboard, page.url)["rows"]]
    page.uncheck("#column-grid input[data-column='acc:last']")
    page.wait_for_function("!document.querySelector(\"#runs th[data-key='acc:last']\")")

    # Selecting: all runs, none, the runs the filter matches; each change announced.
    page.evaluate(
        "() => { window.__announced = []; document.addEventListener('retrolog:selection',"
        " e => window.__announced.push(e.detail.runs)); }"
    )
    page.click("#select-all")
    page.wait_for_function("window.retrolog.selection.get().length === 3")
    assert page.locator("#runs tbody input[type=checkbox]:checked").count() == 3
    assert page.is_checked("#runs thead input[type=checkbox]")
    page.click("#select-none")
    page.wait_for_function("window.retrolog.selection.get().length === 0")
    page.fill("#where", "lr > 0.15")
    page.click("#filter button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 2")
    page.click("#select-matching")
    page.wait_for_function("window.retrolog.selection.get().length === 2")
    assert sorted(selected(page)) == sorted(row_ids(page))
    announced = page.evaluate("() => window.__announced")
    assert [len(runs) for runs in announced] == [3, 0, 2]
    page.evaluate("() => window.retrolog.selection.set([])")
    assert page.locator("#runs tbody input[type=checkbox]:checked").count() == 0

    # Filtering by status.
    page.select_option("#status-filter", "running")
    page.wait_for_function("document.getElementById('count').textContent === 'no run matches'")
    page.select_option("#status-filter", "finished")
    page.wait_for_function("document.querySelectorAll('#runs tbody tr').length === 2")

    # A column of a name no run logged yet: an empty column with a note, the table kept.
    page.fill("#columns", "loss:max, grad_norm:max")
    page.click("#filter button[type=submit]")
    page.wait_for_selector("#runs thead th[data-key='grad_norm:max']")
    assert page.locator("#runs tbody tr").count() == 2
    assert "grad_norm" in page.inner_text("#runs-notes")
    assert cells(page, "grad_norm:max") == ["", ""]
    assert page.is_hidden("#where-error")
    # A word that is not an aggregate: one paragraph naming them; the table stays.
    page.fill("#columns", "loss:median")
    page.click("#filter button[type=submit]")
    page.wait_for_selector("#where-error:not([hidden])")
    assert ":mean" in page.inner_text("#where-error")
    assert page.locator("#runs tbody tr").count() == 2
    # The failed request's status is all the console may show (Chromium logs a 400).
    assert all("400" in e for e in errors), errors


def test_any_sequence_of_clicks_shows_the_table_its_controls_ask_for(
    page: Any, dashboard: Any
) -> None:
    """Seeded random bursts of clicks on the table's controls, none waiting for the last
    to finish; once the page settles the table is the one its address asks the API for:
    its columns, its rows in their order, and the sort shown."""
    errors = console_errors(page)
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    page.click("#column-picker summary")
    rng = random.Random(42)

    def act() -> None:
        choice = rng.randrange(5)
        if choice == 0:
            headers = page.locator("#runs thead th[data-key]")
            headers.nth(rng.randrange(headers.count())).click()
        elif choice == 1:
            boxes = page.locator("#column-grid tbody input")
            boxes.nth(rng.randrange(boxes.count())).click()
        elif choice == 2:
            page.select_option("#status-filter", rng.choice(["", "finished", "running"]))
        elif choice == 3:
            page.click(rng.choice(["#select-all", "#select-none", "#select-matching"]))
        else:
            page.fill("#where", rng.choice(["", "lr > 0.15", "lr < 0.25"]))
            page.click("#filter button[type=submit]")

    deadline = time.monotonic() + 60
    for _ in range(8):
        for _ in range(rng.randint(1, 4)):
            act()
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(100)
        want = api_table(dashboard, page.url)
        keys = header_keys(page)
        assert [k for k in keys if ":" in k] == want["columns"], page.url
        assert row_ids(page) == [r["run_id"] for r in want["rows"]], page.url
        q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(page.url).query))
        if want["rows"]:
            sort = q.get("sort", "started_at")
            shown = page.locator(f"#runs thead th[data-key='{sort}']")
            if shown.count():
                expected = "ascending" if q.get("desc") == "0" else "descending"
                assert shown.get_attribute("aria-sort") == expected
        assert set(selected(page)) == set(
            page.locator("#runs tbody tr.selected").evaluate_all("rs => rs.map(r => r.dataset.run)")
        ) | (set(selected(page)) - set(row_ids(page)))
        if time.monotonic() > deadline:
            break
    assert errors == []


def test_a_replay_from_the_page_fills_an_empty_column_and_the_table_stays(
    page: Any, dashboard: Any, recorded: Any, log_w_sq_today: Any
) -> None:
    """A column of a name only the replay will log is empty with a note; while the replay
    runs, each refresh keeps the table (every run, no error), and its values fill in."""
    errors = console_errors(page)
    page.goto(dashboard.url)
    page.wait_for_selector(READY)
    page.fill("#columns", "acc, w_sq:max")
    page.click("#filter button[type=submit]")
    page.wait_for_selector("#runs thead th[data-key='w_sq:max']")
    assert "w_sq" in page.inner_text("#runs-notes")
    page.click("#select-all")
    page.wait_for_function("window.retrolog.selection.get().length === 3")
    log_w_sq_today()
    page.click("#nav a[data-view='replay']")  # the replay view keeps the table in sight
    page.fill("#replay-names", "w_sq")
    page.click("#replay-plan")
    page.wait_for_selector("#replay-start:not([disabled])", timeout=120_000)
    before = page.evaluate("() => window.__retrolog.requests.runs")
    page.click("#replay-start")
    deadline = time.monotonic() + 240
    while not page.inner_text("#status").startswith("replay") and time.monotonic() < deadline:
        assert page.locator("#runs tbody tr").count() == 3
        assert page.is_hidden("#where-error"), page.inner_text("#where-error")
        page.wait_for_timeout(200)
    assert page.inner_text("#status") == "replay finished", page.inner_text("#replay-output")
    assert page.evaluate("() => window.__retrolog.requests.runs") > before  # it refreshed
    page.wait_for_function(
        "[...document.querySelectorAll('#runs tbody tr')].every(r =>"
        " r.lastElementChild.title !== '')"
    )
    acc = values_by_run(recorded.root, "acc")
    w_sq = values_by_run(recorded.root, "w_sq")
    index = header_keys(page).index("w_sq:max") + 2
    for tr in page.locator("#runs tbody tr").all():
        run_id = tr.get_attribute("data-run")
        assert len(w_sq[run_id]) == len(acc[run_id])
        shown = tr.locator(f"td:nth-child({index})").get_attribute("title")
        assert float(shown) == max(w_sq[run_id])
    assert page.is_hidden("#runs-notes")
    assert errors == []
