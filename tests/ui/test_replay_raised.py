"""The dashboard's replay of a run that an exception ended says what the command says.

The dashboard runs ``retrolog replay`` as a child and shows its output and exit status:
a run that raised at epoch 2 is replayed to where it stopped (exit 0, the place named,
the epochs it completed backfilled); a replay that raises elsewhere ends with status 1
and says what it raised and where, with no worker traceback.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

import pytest

from retrolog.ui.server import TOKEN_HEADER

from conftest import Project, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import argparse
import os

import numpy as np
import retrolog as rl


def train_epoch(state, epoch):
    for step in rl.loop("step", range(3)):
        if os.environ.get("FAIL_AT", "2.1") == f"{epoch}.{step}":
            raise ValueError(f"bad batch at epoch {epoch}")
        state["w"] += np.random.standard_normal(2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.parse_args()
    np.random.seed(0)
    state = {"w": np.zeros(2)}
    with rl.checkpointing(state=state):
        for epoch in rl.loop("epoch", range(4)):
            train_epoch(state, epoch)
            rl.log("w0", float(state["w"][0]))


main()
"""


def _call(url: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=60) as response:
        return json.loads(response.read())


def _replay(dashboard: Any, names: list[str]) -> dict[str, Any]:
    headers = {TOKEN_HEADER: dashboard.token, "Origin": dashboard.base}
    job = _call(f"{dashboard.base}/api/replay", {"names": names}, headers)
    deadline = time.monotonic() + 240
    while job["running"] and time.monotonic() < deadline:
        time.sleep(0.3)
        job = _call(f"{dashboard.base}/api/replay/{job['id']}")
    assert not job["running"]
    return dict(job)


def test_the_dashboards_replay_of_a_run_that_raised_stops_where_it_did(
    project: Project, serve: Any
) -> None:
    project.write("train.py", SCRIPT)
    ran = project.run("train.py", check=False, RETROLOG_CHECKPOINTS="adaptive")
    assert ran.returncode == 1, ran.stderr
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    project.write(
        "train.py",
        SCRIPT.replace(
            '            rl.log("w0", float(state["w"][0]))\n',
            '            rl.log("w0", float(state["w"][0]))\n'
            '            rl.log("w1", float(state["w"][1]))\n',
        ),
    )
    with serve(project) as dashboard:
        job = _replay(dashboard, ["w1"])
        output = "\n".join(job["output"])
        assert job["returncode"] == 0, output
        assert (
            f"run {run_id}: replay stopped where it did during recording: ValueError('bad "
            "batch at epoch 2') at train.py, line 11, in train_epoch, in epoch 2, step 1"
        ) in output
        assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'w1'") == [(2,)]

    # The replay raises an epoch early: not what the run did. A statement in the step loop
    # has every epoch executed, so the replay reaches epoch 1 whichever checkpoints the
    # adaptive rule took. A worker whose segment starts at epoch 1 (the plan splits by the
    # recorded timings) restores epoch 0 first: its account of that leads, and the
    # comparison with the recording follows in brackets (and the run is partial when the
    # segment before it finished).
    step = '        state["w"] += np.random.standard_normal(2)\n'
    project.write(
        "train.py", SCRIPT.replace(step, step + '        rl.log("w2", float(state["w"][0]))\n')
    )
    with serve(project, FAIL_AT="1.0") as dashboard:
        job = _replay(dashboard, ["w2"])
        output = "\n".join(job["output"])
        assert job["returncode"] == 1, output
        assert "Traceback" not in output
        assert re.search(
            rf"run {run_id}: replay (failed|partial): (the script raised ValueError: bad batch "
            r"at epoch 1 at train\.py, line 11 .*, after the worker had restored the checkpoints "
            r"of 'epoch' iteration 0 .* \(Compared with the recording: )?its replay raised "
            r"ValueError\('bad batch at epoch 1'\) at train\.py, line 11, in train_epoch, in "
            r"epoch 1, step 0; during recording the run raised ValueError\('bad batch at epoch "
            r"2'\) at train\.py, line 11",
            output,
        ), output
