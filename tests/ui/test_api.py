"""The dashboard's JSON API, every endpoint, against a store recorded by real runs.

Most tests call the application in process (starlette's TestClient); the security
tests and the replay go to a real ``retrolog ui`` server over TCP.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import signal
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from cpu_watch import cpu_seconds, goes_quiet, runs_a_query
from retrolog import Project
from retrolog._query.series import Series, encode_series
from retrolog._query.table import AGGREGATES
from retrolog.ui.server import TOKEN_HEADER, Settings, create_app

from conftest import read_db, values_by_run


@pytest.fixture
def client(recorded: Any) -> Iterator[TestClient]:
    settings = Settings(host="127.0.0.1", port=7431, token="t0ken")
    app = create_app(Project(recorded.root), settings)
    with TestClient(app, base_url="http://127.0.0.1:7431") as c:
        yield c


def test_project_and_names(client: TestClient, recorded: Any) -> None:
    info = client.get("/api/project").json()
    assert info["root"] == str(recorded.root)
    assert info["scripts"] == [{"filename": "train.py", "runs": 3}]
    assert client.get("/api/names").json() == ["acc", "loss", "lr"]


def test_runs_table_columns_are_the_runs_last_min_and_max(
    client: TestClient, recorded: Any
) -> None:
    table = client.get("/api/runs", params={"columns": "loss:max,loss:min,acc,lr"}).json()
    assert table["total"] == 3
    assert table["columns"] == ["loss:max", "loss:min", "acc:last", "lr:last"]
    loss, acc = values_by_run(recorded.root, "loss"), values_by_run(recorded.root, "acc")
    rows = {r["run_id"]: r for r in table["rows"]}
    assert set(rows) == set(loss)
    for run_id, row in rows.items():
        assert row["loss:max"] == max(loss[run_id])  # the spike
        assert row["loss:min"] == min(loss[run_id])
        assert row["acc:last"] == acc[run_id][-1]
        assert row["status"] == "finished"
        assert row["args"]["lr"] == row["lr:last"]
    # Newest first by default; two code versions.
    assert [r["lr:last"] for r in table["rows"]] == [0.3, 0.2, 0.1]
    assert len({r["code_version"] for r in table["rows"]}) == 2


def test_runs_table_aggregates_first_mean_and_count(client: TestClient, recorded: Any) -> None:
    table = client.get("/api/runs", params={"columns": "loss:first,loss:mean,loss:count,acc:first"})
    loss, acc = values_by_run(recorded.root, "loss"), values_by_run(recorded.root, "acc")
    for row in table.json()["rows"]:
        run_id = row["run_id"]
        assert row["loss:first"] == loss[run_id][0] and row["acc:first"] == acc[run_id][0]
        assert math.isclose(row["loss:mean"], sum(loss[run_id]) / len(loss[run_id]))
        assert row["loss:count"] == len(loss[run_id]) == 1200
    by_mean = client.get(
        "/api/runs", params={"columns": "loss:mean", "sort": "loss:mean", "desc": "0"}
    ).json()
    means = [r["loss:mean"] for r in by_mean["rows"]]
    assert means == sorted(means) and len(means) == 3


def test_runs_table_default_columns_status_argument_sort_and_ids(client: TestClient) -> None:
    default = client.get("/api/runs", params={"default": "1"}).json()
    assert default["metrics"] == ["acc", "loss", "lr"]
    assert default["columns"] == ["acc:last", "loss:last"]  # lr is an argument: its own column
    assert "ids" not in default
    by_lr = client.get("/api/runs", params={"sort": "args.lr", "desc": "0", "ids": "1"}).json()
    assert [r["args"]["lr"] for r in by_lr["rows"]] == [0.1, 0.2, 0.3]
    assert by_lr["ids"] == [r["run_id"] for r in by_lr["rows"]]
    assert all("args.lr" not in r for r in by_lr["rows"])
    finished = client.get("/api/runs", params={"status": "finished,crashed", "ids": "1"}).json()
    assert finished["total"] == 3 and len(finished["ids"]) == 3
    running = client.get("/api/runs", params={"status": "running", "ids": "1"}).json()
    assert running["total"] == 0 and running["rows"] == [] and running["ids"] == []
    matching = client.get("/api/runs", params={"where": "lr > 0.15", "ids": "1", "limit": 1})
    assert matching.json()["total"] == 2 and len(matching.json()["ids"]) == 2


def test_runs_table_sorts_filters_and_pages(client: TestClient) -> None:
    by_acc = client.get("/api/runs", params={"columns": "acc", "sort": "acc:last", "desc": "0"})
    accs = [r["acc:last"] for r in by_acc.json()["rows"]]
    assert accs == sorted(accs)
    page = client.get("/api/runs", params={"limit": 2, "offset": 2, "sort": "started_at"}).json()
    assert page["total"] == 3 and len(page["rows"]) == 1
    chosen = client.get("/api/runs", params={"where": "lr > 0.15", "columns": "lr"}).json()
    assert sorted(r["lr:last"] for r in chosen["rows"]) == [0.2, 0.3]
    assert chosen["total"] == 2


@pytest.mark.parametrize(
    "where",
    [
        "lr > 0.15",
        "lr = 0.1 OR lr >= 0.3",
        "lr > 0.15 AND filename = 'train.py'",
        "acc > 0.5 AND lr < 0.25",  # a name logged per epoch: the dataframe's way
        "lr > 0.15 AND epoch = 2",  # a loop column: the dataframe's way
        "run_id LIKE '2%' AND lr < 1",
    ],
)
def test_runs_a_predicate_chooses_are_the_dataframes(recorded: Any, where: str) -> None:
    """Run-level predicates are answered per run, without the dataframe: the same runs."""
    from retrolog._query.dataframe import dataframe
    from retrolog._query.runs import matching_runs

    project = Project(recorded.root)
    with project.reader() as conn:
        names = [n for n in ("lr", "acc") if n in where]
        expected = set(dataframe(conn, names, where)["run_id"])
        assert matching_runs(conn, where) == expected


def test_a_bad_predicate_or_column_is_a_clear_error(client: TestClient) -> None:
    bad = client.get("/api/runs", params={"where": "lr >>> 1"})
    assert bad.status_code == 400
    assert "lr >>> 1" in bad.json()["error"] and "Traceback" not in bad.text
    sort = client.get("/api/runs", params={"sort": "acc:last"})
    assert sort.status_code == 400 and "sorts by" in sort.json()["error"]
    median = client.get("/api/runs", params={"columns": "acc,loss:median"})
    assert median.status_code == 400 and "Traceback" not in median.text
    error = median.json()["error"]
    assert "'median'" in error and all(f":{a}" in error for a in AGGREGATES)


def test_a_name_no_run_logged_is_an_empty_column_with_a_note(client: TestClient) -> None:
    table = client.get(
        "/api/runs", params={"columns": "acc,grad_norm:max", "sort": "grad_norm:max"}
    ).json()
    assert table["total"] == 3 and table["columns"] == ["acc:last", "grad_norm:max"]
    assert all(r.get("grad_norm:max") is None and r["acc:last"] is not None for r in table["rows"])
    assert len(table["notes"]) == 1 and "'grad_norm'" in table["notes"][0]


def test_runs_table_exports_csv(client: TestClient) -> None:
    response = client.get("/api/runs", params={"columns": "acc", "format": "csv", "limit": 1})
    assert response.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert len(rows) == 3  # every matching run, not a page
    assert json.loads(rows[0]["args"]) == {"lr": 0.3}
    assert float(rows[0]["acc:last"]) > 0


def test_names_todays_script_logs(client: TestClient, log_w_sq_today: Any) -> None:
    before = client.get("/api/script", params={"script": "train.py"}).json()
    assert before["names"] == [{"name": "loss", "new": False}, {"name": "acc", "new": False}]
    log_w_sq_today()
    after = client.get("/api/script", params={"script": "train.py"}).json()["names"]
    assert {"name": "w_sq", "new": True} in after
    outside = client.get("/api/script", params={"script": "../../etc/passwd"})
    assert outside.status_code == 400 and "is not a file of the project" in outside.json()["error"]


def test_one_run(client: TestClient) -> None:
    run_id = client.get("/api/runs").json()["rows"][0]["run_id"]
    details = client.get(f"/api/runs/{run_id}").json()
    assert details["run_id"] == run_id
    assert {lp["name"] for lp in details["loops"]} == {"epoch", "step"}
    missing = client.get("/api/runs/nope")
    assert missing.status_code == 400 and "No run has the id 'nope'" in missing.json()["error"]


def test_series_keep_spikes_and_are_exact_at_full_zoom(client: TestClient, recorded: Any) -> None:
    loss = values_by_run(recorded.root, "loss")
    runs = sorted(loss)
    found = client.get(
        "/api/series", params={"name": "loss", "runs": ",".join(runs), "width": 50}
    ).json()
    assert [s["run_id"] for s in found] == runs
    # Bucketed on one grid of pixel columns, so the runs' points line up.
    assert all(s["grid"] == [0.0, 1199.0, 50] for s in found)
    for s in found:
        values = loss[s["run_id"]]
        assert s["total"] == len(values) == 1200 and s["loop"] == "step"
        assert not s["exact"] and len(s["x"]) <= 200
        assert max(s["y"]) == max(values)  # the one-step spike at x = 400 + 217
        assert s["x"][s["y"].index(max(values))] == 617
        for x, y in zip(s["x"], s["y"], strict=True):  # every point sent is a stored value
            assert values[int(x)] == y
        assert set(s["origin"]) == {0}
    # Zoomed in to 60 steps: every value there, exactly.
    zoom = client.get(
        "/api/series",
        params={"name": "loss", "runs": runs[0], "width": 50, "lo": 600, "hi": 659},
    ).json()[0]
    assert zoom["exact"] and zoom["in_range"] == 60
    assert zoom["x"] == list(range(600, 660)) and zoom["y"] == loss[runs[0]][600:660]


def decode_series(data: bytes) -> list[dict[str, Any]]:
    """/api/series?format=binary, read as docs/ui.md describes it, in the JSON form's shape."""
    size = int.from_bytes(data[:4], "little")
    about = json.loads(data[4 : 4 + size])
    n = sum(s["n"] for s in about)
    at = 4 + size + (-(4 + size) % 8)
    arrays = {}
    for name, dtype, width in (("x", "<f8", 8), ("y", "<f8", 8), ("r", "<i4", 4), ("o", "u1", 1)):
        arrays[name] = np.frombuffer(data, dtype=dtype, count=n, offset=at)
        at += width * n
    assert at == len(data)
    found, first = [], 0
    for s in about:
        end = first + s.pop("n")
        part = {k: v[first:end].tolist() for k, v in arrays.items()}
        first = end
        replay_ids = s.pop("replay_ids")
        found.append({
            **s, "x": part["x"], "y": [v if math.isfinite(v) else None for v in part["y"]],
            "y_text": {str(i): ("NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity")
                       for i, v in enumerate(part["y"]) if not math.isfinite(v)},
            "origin": part["o"],
            "replay": [replay_ids[i] if i >= 0 else None for i in part["r"]]
            if replay_ids else None,
        })  # fmt: skip
    return found


def test_the_pages_binary_series_are_the_json_ones(client: TestClient, recorded: Any) -> None:
    runs = ",".join(sorted(values_by_run(recorded.root, "loss")))
    for params in ({"width": 50}, {"width": 50, "lo": 600, "hi": 659}, {"x": "time"}):
        query = {"name": "loss", "runs": runs, **params}
        as_json = client.get("/api/series", params=query).json()
        binary = client.get("/api/series", params={**query, "format": "binary"})
        assert binary.headers["content-type"] == "application/octet-stream"
        assert decode_series(binary.content) == as_json
    # NaN, infinities and backfilled points (from two replays) too.
    made = Series(
        run_id="r", loop="step", total=5, in_range=5, x=np.arange(5.0),
        y=np.array([1.5, np.nan, np.inf, -np.inf, 2.0]), origin=np.array([0, 1, 2, 1, 0]),
        replay_index=np.array([-1, 0, 1, 0, -1]), replay_ids=["p0", "p1"], exact=True,
    )  # fmt: skip
    assert decode_series(encode_series([made, made])) == json.loads(
        json.dumps([made.to_json(), made.to_json()])
    )
    assert decode_series(encode_series([])) == []


def test_series_against_time_and_bad_requests(client: TestClient, recorded: Any) -> None:
    run_id = sorted(values_by_run(recorded.root, "acc"))[0]
    timed = client.get("/api/series", params={"name": "acc", "runs": run_id, "x": "time"}).json()
    xs = timed[0]["x"]
    assert len(xs) == 3 and xs == sorted(xs) and xs[0] > 0
    assert (
        client.get("/api/series", params={"name": "acc", "runs": run_id, "x": "bogus"}).status_code
        == 400
    )
    assert "name= is required" in client.get("/api/series").json()["error"]
    # A name not logged yet (a replay may add it) is an empty chart, not an error.
    unknown = {"name": "nope", "runs": run_id}
    assert client.get("/api/series", params=unknown).json() == []
    empty = client.get("/api/series", params={**unknown, "format": "binary"}).content
    assert decode_series(empty) == []
    assert client.get("/api/groups", params={**unknown, "by": "lr"}).json() == []


def test_dataframe_json_and_csv(client: TestClient, recorded: Any) -> None:
    frame = client.get("/api/dataframe", params={"names": "lr,acc", "where": "lr < 0.25"}).json()
    assert {"run_id", "epoch", "lr", "acc"} <= set(frame["columns"])
    assert len(frame["data"]) == 6  # two runs, three epochs
    text = client.get("/api/dataframe", params={"names": "acc", "format": "csv"}).text
    assert len(list(csv.DictReader(io.StringIO(text)))) == 9


def test_the_dataframe_comes_in_pages_cut_in_sql(client: TestClient, recorded: Any) -> None:
    whole = Project(recorded.root).dataframe("loss", "lr")
    assert len(whole) == 3600
    first = client.get("/api/dataframe", params={"names": "loss,lr"}).json()
    assert (first["total"], first["offset"], first["limit"]) == (3600, 0, 1000)
    assert len(first["data"]) == 1000  # the default page
    rows: list[list[Any]] = []
    for offset in range(0, 3600, 700):  # pages of 700 rows give back the whole view
        page = client.get(
            "/api/dataframe", params={"names": "loss,lr", "offset": offset, "limit": 700}
        ).json()
        assert page["columns"] == list(whole.columns) and page["total"] == 3600
        rows += page["data"]
    expected = json.loads(whole.to_json(orient="split", index=False))["data"]
    assert rows == expected
    chosen = client.get(
        "/api/dataframe", params={"names": "loss", "where": "lr > 0.15", "limit": 5}
    ).json()
    assert chosen["total"] == 2400 and len(chosen["data"]) == 5
    text = client.get(
        "/api/dataframe", params={"names": "acc", "format": "csv", "offset": 7, "limit": 5}
    )
    assert len(list(csv.DictReader(io.StringIO(text.text)))) == 2
    assert text.headers["X-Total-Count"] == "9"
    for bad in ({"limit": 50_001}, {"limit": -1}, {"offset": "x"}):
        refused = client.get("/api/dataframe", params={"names": "loss", **bad})
        assert refused.status_code == 400 and "Traceback" not in refused.text


def test_every_answer_is_bounded(client: TestClient, recorded: Any) -> None:
    runs = sorted(values_by_run(recorded.root, "loss"))
    assert client.get("/api/runs", params={"limit": 1001}).status_code == 400
    assert len(client.get("/api/runs", params={"limit": 1000}).json()["rows"]) == 3
    wide = client.get("/api/series", params={"name": "loss", "runs": runs[0], "width": 8193})
    assert wide.status_code == 400 and "8192" in wide.json()["error"]
    tall = client.get("/api/series", params={"name": "loss", "runs": runs[0], "height": 4097})
    assert tall.status_code == 400 and "4096" in tall.json()["error"]
    compared = client.get("/api/compare", params={"runs": ",".join(runs * 7)})
    assert compared.status_code == 400 and "at most 20" in compared.json()["error"]


def test_a_series_without_a_width_is_drawn_for_a_chart(project: Any) -> None:
    """Asked for without a width, a long series comes downsampled to 1,000 pixel columns:
    at most 4,000 of its 10,000 values."""
    project.write(
        "long.py",
        "import retrolog as rl\n\nfor step in rl.loop('step', range(10_000)):\n"
        "    rl.log('v', float(step % 97))\n",
    )
    project.run("long.py")
    settings = Settings(host="127.0.0.1", port=7431, token="t0ken")
    app = create_app(Project(project.root), settings)
    with TestClient(app, base_url="http://127.0.0.1:7431") as c:
        run_id = c.get("/api/runs").json()["rows"][0]["run_id"]
        (found,) = c.get("/api/series", params={"name": "v", "runs": run_id}).json()
    assert found["total"] == 10_000 and not found["exact"]
    assert found["grid"] == [0.0, 9999.0, 1000] and len(found["x"]) <= 4000
    assert max(found["y"]) == 96.0 and min(found["y"]) == 0.0


def test_a_chart_of_many_runs_sends_what_its_pixels_can_show(
    client: TestClient, recorded: Any
) -> None:
    """The runs of a chart share one budget of points, width x height, however many they are:
    each is downsampled on fewer pixel columns, keeping every column's min and max."""
    loss = values_by_run(recorded.root, "loss")  # 3 runs of 1,200 values
    runs = sorted(loss)
    params = {"name": "loss", "runs": ",".join(runs), "width": 100, "height": 4}
    found = client.get("/api/series", params=params).json()
    # 4 points per column and run would be 1,200; the budget is 400, 33 columns a run.
    assert sum(len(s["x"]) for s in found) <= 100 * 4
    for s in found:
        assert s["grid"] == [0.0, 1199.0, 33] and not s["exact"]
        stored = loss[s["run_id"]]
        assert max(s["y"]) == max(stored) and min(s["y"]) == min(stored)  # the spike stays
        assert all(stored[int(x)] == y for x, y in zip(s["x"], s["y"], strict=True))
    binary = client.get("/api/series", params={**params, "format": "binary"}).content
    assert len(binary) < 400 * 21 + 2000  # 21 bytes a point, and the header
    # One run alone keeps the chart's full width: 4 points per pixel column.
    (alone,) = client.get("/api/series", params={**params, "runs": runs[0]}).json()
    assert alone["grid"] == [0.0, 1199.0, 100] and len(alone["x"]) <= 400


def test_a_runs_checkpoints_and_code(client: TestClient, recorded: Any) -> None:
    newest, _, oldest = [r["run_id"] for r in client.get("/api/runs").json()["rows"]]
    ckpts = client.get(f"/api/runs/{newest}/checkpoints").json()
    blocks = [c for c in ckpts if c["kind"] == "block"]
    # The adaptive rule chose them; the first block's is always taken.
    assert [(c["loop"], c["iteration"]) for c in blocks] == read_db(
        recorded.root,
        "SELECT c.loop_name, lp.iteration FROM checkpoints c JOIN loops lp"
        " ON lp.run_id = c.run_id AND lp.ctx_id = c.ctx_id"
        " WHERE c.run_id = ? AND c.kind = 'block' ORDER BY c.checkpoint_id",
        (newest,),
    )
    assert blocks[0]["iteration"] == 0 and [c["kind"] for c in ckpts][-1] == "end"
    assert all(c["nbytes"] > 0 for c in ckpts)
    old = client.get(f"/api/runs/{oldest}/code").json()
    new = client.get(f"/api/runs/{newest}/code").json()
    assert old["path"] == "train.py" and "train.py" in old["files"]
    assert "DECAY = 0.001" in old["text"] and "DECAY = 0.002" in new["text"]
    readme = client.get(f"/api/runs/{oldest}/code", params={"path": "README.md"}).json()
    assert readme["text"] == "a project\n"
    missing = client.get(f"/api/runs/{oldest}/code", params={"path": "nope.py"})
    assert missing.status_code == 400 and "nope.py" in missing.json()["error"]


def test_compare_shows_the_arguments_and_the_code_diff(client: TestClient) -> None:
    newest, middle, oldest = [r["run_id"] for r in client.get("/api/runs").json()["rows"]]
    found = client.get("/api/compare", params={"runs": f"{oldest},{middle},{newest}"}).json()
    assert found["runs"] == [oldest, middle, newest]
    assert found["args_differ"] == {"lr": [0.1, 0.2, 0.3]}
    same, changed = found["diffs"]
    assert same["same_code"] and same["diff"] == ""
    assert not changed["same_code"]
    assert "-DECAY = 0.001" in changed["diff"] and "+DECAY = 0.002" in changed["diff"]
    one = client.get("/api/compare", params={"runs": oldest})
    assert one.status_code == 400 and "two" in one.json()["error"]


def test_groups_are_a_mean_in_a_min_max_band(client: TestClient, recorded: Any) -> None:
    acc = values_by_run(recorded.root, "acc")
    runs = sorted(acc)
    groups = client.get(
        "/api/groups", params={"name": "acc", "runs": ",".join(runs), "by": "lr", "width": 3}
    ).json()
    assert [g["key"] for g in groups] == [0.1, 0.2, 0.3]  # one run each
    for g in groups:
        (run_id,) = g["run_ids"]
        assert g["mean"] == g["low"] == g["high"] == acc[run_id] and g["count"] == [1, 1, 1]
    # All three runs in one group (none has the argument): mean, min and max per column.
    merged = client.get(
        "/api/groups", params={"name": "acc", "runs": ",".join(runs), "by": "nope", "width": 3}
    ).json()
    (g,) = merged
    columns = list(zip(*(acc[r] for r in runs), strict=True))
    assert g["key"] is None and g["count"] == [3, 3, 3]
    assert g["low"] == [min(c) for c in columns] and g["high"] == [max(c) for c in columns]
    assert all(math.isclose(m, sum(c) / 3) for m, c in zip(g["mean"], columns, strict=True))


def test_the_page_names_its_icon_and_it_is_served(client: TestClient) -> None:
    """A browser asks for /favicon.ico unless the page names an icon: a 404 on every load."""
    page = client.get("/").text
    href = page.split('rel="icon" href="', 1)[1].split('"', 1)[0]
    icon = client.get(href)
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg")


def test_a_read_from_another_sites_page_is_refused(client: TestClient) -> None:
    """A page on another site can make a browser GET anything (an <img>), and a read can
    run a user's predicate: only this server's own page, or no page, may read."""
    params = {"where": "lr > 0.15"}
    for site in ("cross-site", "same-site"):  # same-site: another port of localhost
        refused = client.get("/api/runs", params=params, headers={"Sec-Fetch-Site": site})
        assert refused.status_code == 403 and "another site" in refused.json()["error"]
    foreign = client.get("/api/runs", params=params, headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403
    for headers in ({"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}, {}):
        assert client.get("/api/runs", params=params, headers=headers).json()["total"] == 2
    # The page itself is served to a link from anywhere.
    assert client.get("/", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200


def test_bound_beyond_loopback_every_request_needs_the_token(recorded: Any) -> None:
    settings = Settings(host="0.0.0.0", port=7431, token="t0ken")
    app = create_app(Project(recorded.root), settings)
    with TestClient(app, base_url="http://0.0.0.0:7431") as c:
        refused = c.get("/api/names")
        assert refused.status_code == 403 and TOKEN_HEADER in refused.json()["error"]
        assert c.get("/api/names", headers={TOKEN_HEADER: "t0ken"}).json() == ["acc", "loss", "lr"]


def test_a_kept_series_is_not_served_after_a_replay_changed_it(
    recorded: Any, log_w_sq_today: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(recorded.root)
    project = Project(recorded.root)
    log_w_sq_today()
    project.replay("w_sq", progress=False)
    runs = project.runs()["run_id"].tolist()
    first = {s.run_id: s.to_json()["replay"] for s in project.series("w_sq", runs)}
    assert project._cache().nbytes > 0  # kept: the runs have ended, no replay is running
    project.replay("w_sq", force=True, progress=False)  # recomputes them: newer records count
    again = {s.run_id: s.to_json()["replay"] for s in project.series("w_sq", runs)}
    newest = read_db(recorded.root, "SELECT replay_id FROM replays ORDER BY started_at DESC")[0][0]
    for run_id in runs:
        assert set(first[run_id]) != {newest}
        assert set(again[run_id]) == {newest}


def test_series_are_kept_on_disk_and_a_damaged_file_is_read_again(recorded: Any) -> None:
    runs = Project(recorded.root).runs()["run_id"].tolist()
    # Against steps, these runs' series come from their blocks: no file is worth it.
    Project(recorded.root).series("loss", runs, width=40)
    assert not list((recorded.root / ".retrolog" / "cache").glob("series/*/*.series"))
    # Against time (each context's time read from the store), they are kept on disk.
    first = [s.to_json() for s in Project(recorded.root).series("loss", runs, x="time", width=40)]
    kept = sorted((recorded.root / ".retrolog" / "cache" / "series").glob("*/*.series"))
    assert len(kept) == 3
    # A new process (a restarted dashboard) draws from the files, the same points.
    reader = Project(recorded.root)
    assert [s.to_json() for s in reader.series("loss", runs, x="time", width=40)] == first
    assert reader._cache().nbytes > 0
    # Damaged: cut inside its header, not one of ours at all, cut one byte short.
    damage = {kept[0]: lambda b: b[:30], kept[1]: lambda b: b"junk", kept[2]: lambda b: b[:-1]}
    for path, damaged in damage.items():
        path.write_bytes(damaged(path.read_bytes()))
    again = Project(recorded.root).series("loss", runs, x="time", width=40)
    assert [s.to_json() for s in again] == first


def test_the_indexer_reads_long_series_ahead_at_idle_priority(
    recorded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from retrolog._query import series as series_module
    from retrolog.ui.indexer import Indexer

    project = Project(recorded.root)
    runs = project.runs()["run_id"].tolist()
    with project.reader() as conn:  # from the store, nothing kept
        expected = {x: [s.to_json() for s in series_module.series(conn, "loss", runs, x=x)]
                    for x in ("step", "time")}  # fmt: skip

    def idle(indexer: Indexer) -> dict[str, Any]:
        deadline = time.monotonic() + 120
        while indexer.state.get("state") != "idle" and time.monotonic() < deadline:
            assert indexer.state.get("state") != "failed", indexer.state
            time.sleep(0.1)
        return indexer.state

    indexer = Indexer(recorded.root)
    try:
        # Only idle CPU time: it never competes with a training run.
        assert os.sched_getscheduler(indexer.pid) == os.SCHED_IDLE
        let_run(indexer.pid)
        # loss (1,200 values per run) is read ahead; acc (3 per run) is not worth it.
        assert idle(indexer) == {"state": "idle", "written": 3, "seconds": pytest.approx(1, abs=60)}
    finally:
        indexer.stop()
    assert len(list((recorded.root / ".retrolog" / "cache" / "series").glob("*/*.series"))) == 3

    def not_the_store(*args: Any) -> None:
        raise AssertionError("read the store")

    with monkeypatch.context() as m:  # both axes now come from the files alone
        m.setattr(series_module, "read_columns", not_the_store)
        m.setattr(series_module, "_times", not_the_store)
        reader = Project(recorded.root)
        for x in ("step", "time"):
            assert [s.to_json() for s in reader.series("loss", runs, x=x)] == expected[x]
    again = Indexer(recorded.root)  # a new dashboard: nothing left to read
    let_run(again.pid)
    try:
        assert idle(again)["written"] == 0
    finally:
        again.stop()


# -- security, against a real server ---------------------------------------------------------


def request(
    url: str, *, method: str = "GET", headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_changes_need_the_token_and_this_origin_and_the_host_is_checked(dashboard: Any) -> None:
    base, token = dashboard.base, dashboard.token
    plan = {"names": ["acc"]}
    status, body = request(f"{base}/api/replay/plan", method="POST", body=plan)
    assert status == 403 and "token" in body["error"]
    status, body = request(
        f"{base}/api/replay", method="POST", body=plan,
        headers={TOKEN_HEADER: token, "Origin": "http://evil.example"},
    )  # fmt: skip
    assert status == 403 and "another site" in body["error"]
    status, body = request(f"{base}/api/names", headers={"Host": "evil.example:80"})
    assert status == 403 and "answers only to" in body["error"]
    status, body = request(
        f"{base}/api/replay/plan", method="POST", body=plan,
        headers={TOKEN_HEADER: token, "Origin": base},
    )  # fmt: skip
    assert status == 200 and body["returncode"] == 0, body
    assert "already has acc" in body["output"]
    # Reads need no token on loopback.
    assert request(f"{base}/api/names")[0] == 200


def test_a_replay_started_over_the_api_backfills_and_shows_its_output(
    dashboard: Any, recorded: Any, log_w_sq_today: Any
) -> None:
    # Today's script logs a new name; the past runs are replayed to fill it in.
    log_w_sq_today()
    base, headers = dashboard.base, {TOKEN_HEADER: dashboard.token, "Origin": dashboard.base}
    status, plan = request(
        f"{base}/api/replay/plan", method="POST", body={"names": "w_sq"}, headers=headers
    )
    assert status == 200 and plan["returncode"] == 0, plan
    assert "3 run" in plan["output"] or "runs" in plan["output"]
    status, job = request(
        f"{base}/api/replay", method="POST", body={"names": ["w_sq"]}, headers=headers
    )
    assert status == 200 and job["running"] in (True, False)
    deadline = time.monotonic() + 240
    while job["running"] and time.monotonic() < deadline:
        time.sleep(0.5)
        job = request(f"{base}/api/replay/{job['id']}")[1]
    assert job["returncode"] == 0, job["output"]
    runs = [r["run_id"] for r in request(f"{base}/api/runs")[1]["rows"]]
    found = request(f"{base}/api/series?name=w_sq&runs={','.join(runs)}")[1]
    assert {s["run_id"] for s in found} == set(runs)
    acc = values_by_run(recorded.root, "acc")
    for s in found:
        assert set(s["origin"]) == {1} and all(s["replay"])  # backfilled, by that replay
        # w_sq is (1 - acc)^2 at each epoch.
        assert all(
            math.isclose(y, (1 - a) ** 2, rel_tol=1e-12)
            for y, a in zip(s["y"], acc[s["run_id"]], strict=True)
        )


def let_run(pid: int) -> None:
    """Give an indexer (idle scheduling class, as checked) a normal share of the CPU: the
    suite's other tests keep every core busy training, and the idle class would then wait
    for them. Only the test's timing changes, not what the indexer does."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))


def test_the_dashboard_reports_its_indexer_and_stops_it_when_it_stops(dashboard: Any) -> None:
    deadline = time.monotonic() + 60
    children: list[Path] = []
    while not children and time.monotonic() < deadline:  # started just after the address
        children = [
            p for p in Path("/proc").glob("[0-9]*")
            if b"retrolog.ui.indexer" in _read(p / "cmdline")
            and str(dashboard.process.pid).encode()
            == _read(p / "stat").split(b") ", 1)[-1].split()[1]
        ]  # fmt: skip
        time.sleep(0.05)
    assert len(children) == 1
    pid = int(children[0].name)
    while os.sched_getscheduler(pid) != os.SCHED_IDLE and time.monotonic() < deadline:
        time.sleep(0.01)  # set by the dashboard just after it started the process
    assert os.sched_getscheduler(pid) == os.SCHED_IDLE
    let_run(pid)
    deadline = time.monotonic() + 120
    state: dict[str, Any] = {}
    while state.get("state") != "idle" and time.monotonic() < deadline:
        status, body = request(f"{dashboard.base}/api/project")
        assert status == 200
        state = body["indexer"]
        time.sleep(0.2)
    assert state["state"] == "idle" and state["written"] == 3  # loss, in each of the 3 runs
    dashboard.process.send_signal(signal.SIGINT)
    dashboard.process.communicate(timeout=30)
    assert not children[0].exists()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_stopping_the_dashboard_stops_the_replay_it_started(dashboard: Any, recorded: Any) -> None:
    # A statement that takes a minute to compute: the replay is certainly running when
    # the dashboard is stopped, however slow the machine is.
    path = recorded.root / "train.py"
    line = '            rl.log("acc", 1 - state["w"])\n'
    slow = '            rl.log("w_sq", (__import__("time").sleep(60), state["w"] ** 2)[1])\n'
    assert line in path.read_text()
    path.write_text(path.read_text().replace(line, line + slow))
    headers = {TOKEN_HEADER: dashboard.token, "Origin": dashboard.base}
    status, job = request(
        f"{dashboard.base}/api/replay", method="POST", body={"names": ["w_sq"]}, headers=headers
    )
    assert status == 200, job
    deadline = time.monotonic() + 120
    while not read_db(recorded.root, "SELECT 1 FROM replays WHERE status = 'running'"):
        assert time.monotonic() < deadline, "the replay never started"
        job = request(f"{dashboard.base}/api/replay/{job['id']}")[1]
        assert job["running"], f"the replay ended before the dashboard was stopped: {job}"
        time.sleep(0.1)
    replay = _descendants(dashboard.process.pid) - {dashboard.process.pid}
    assert replay  # the replay's coordinator, and its workers once they start
    dashboard.process.send_signal(signal.SIGINT)
    _, err = dashboard.process.communicate(timeout=120)
    assert "Stopping the replay started from the dashboard" in err
    assert not [pid for pid in replay if Path(f"/proc/{pid}").exists()]
    # It stopped as on Ctrl-C: recorded as interrupted, not left running.
    assert read_db(recorded.root, "SELECT status FROM replays") == [("interrupted",)]


def _descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = _read(entry / "stat").rsplit(b") ", 1)[-1].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        found.add(todo[-1])
        todo += [c for c in children.get(todo.pop(), []) if c not in found]
    return found


# -- a request whose client went away ---------------------------------------------------------

# A predicate SQLite never finishes: it counts an endless recursive CTE (one row at a time,
# so only the time budget, 120 s by default, would stop it).
ENDLESS = (
    "lr > (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c)"
)


@contextlib.contextmanager
def abandoned_get(base: str, path: str, seconds: float) -> Iterator[None]:
    """GET ``path`` over a raw connection and check no answer comes within ``seconds``
    (the query runs); then, after the block, drop the connection, as a closed tab or a
    dropped ``<img>`` does."""
    address = urllib.parse.urlsplit(base)
    assert address.hostname is not None and address.port is not None
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {address.netloc}\r\n\r\n".encode())
        sock.settimeout(seconds)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        yield


def test_a_query_stops_when_its_client_goes_away(dashboard: Any) -> None:
    pid = dashboard.process.pid
    query = urllib.parse.urlencode({"where": ENDLESS})
    start = cpu_seconds(pid)
    with abandoned_get(dashboard.base, f"/api/runs?{query}", 1.5):
        assert runs_a_query(pid, start)
    assert goes_quiet(pid)
    # The dashboard still answers.
    assert request(f"{dashboard.base}/api/names")[0] == 200


def test_a_postgresql_query_stops_when_its_client_goes_away(
    team_dashboard: Any, database_url: str, pg_store_url: str
) -> None:
    import psycopg

    schema = urllib.parse.unquote(pg_store_url).split("search_path=")[1].split("&")[0]

    def running() -> int:
        """Statements fetching a user's query over this test's tables."""
        with psycopg.connect(database_url, autocommit=True) as admin:
            (found,) = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                " AND query LIKE 'FETCH FORWARD %%' AND pid IN (SELECT l.pid FROM pg_locks l"
                " JOIN pg_class c ON c.oid = l.relation"
                " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s)",
                (schema,),
            ).fetchone() or (0,)
            return int(found)

    query = urllib.parse.urlencode({"where": ENDLESS})
    with abandoned_get(team_dashboard.base, f"/api/runs?{query}", 1.5):
        deadline = time.monotonic() + 30  # connecting and checking the role come first
        while not running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running() == 1
    deadline = time.monotonic() + 30  # well within its 120 s budget, on a busy machine too
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0
    assert request(f"{team_dashboard.base}/api/names")[0] == 200


def test_the_dataframe_comes_in_pages_on_postgresql(team_dashboard: Any) -> None:
    def page(**params: Any) -> dict[str, Any]:
        query = urllib.parse.urlencode({"names": "loss,lr", **params})
        status, body = request(f"{team_dashboard.base}/api/dataframe?{query}")
        assert status == 200, body
        return body

    whole = page(limit=3600)
    assert whole["total"] == 3600 and len(whole["data"]) == 3600
    some = page(offset=1195, limit=10)  # across two runs
    assert some["total"] == 3600 and some["data"] == whole["data"][1195:1205]
    assert page(where="lr > 0.15", limit=1)["total"] == 2400


# -- bound to every interface ----------------------------------------------------------------


def get_as(address: tuple[str, int], host: str, path: str, token: str) -> int:
    """The status of GET ``path`` sent to ``address`` with the Host header ``host``."""
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{TOKEN_HEADER}: {token}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1])


def test_bound_to_every_interface_it_answers_to_this_machines_addresses(
    dashboard_everywhere: Any,
) -> None:
    started = dashboard_everywhere
    # The address it printed is one of this machine's, and works with the token.
    assert urllib.parse.urlsplit(started.base).hostname not in ("0.0.0.0", "::")
    status, body = request(f"{started.base}/api/names", headers={TOKEN_HEADER: started.token})
    assert status == 200 and body == ["acc", "loss", "lr"]
    port = int(started.base.rsplit(":", 1)[1])
    # Another address of this machine (loopback needs no network), and its names.
    other = ("127.0.0.2", port)
    assert get_as(other, f"127.0.0.2:{port}", "/api/names", started.token) == 200
    for name in {socket.gethostname(), socket.getfqdn()}:
        assert get_as(other, f"{name}:{port}", "/api/names", started.token) == 200
    # Not another address than the one the request came to, nor another name (DNS
    # rebinding), nor another port; nor without the token.
    assert get_as(other, f"127.0.0.3:{port}", "/api/names", started.token) == 403
    assert get_as(other, f"evil.example:{port}", "/api/names", started.token) == 403
    assert get_as(other, f"127.0.0.2:{port + 1}", "/api/names", started.token) == 403
    assert get_as(other, f"127.0.0.2:{port}", "/api/names", "wrong") == 403
