"""Replay by lineage: a changed definition is recomputed, an unchanged one never is."""

from __future__ import annotations

import json
import socket

import pytest

from conftest import Project, RecordedOnce, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import time

import numpy as np

import retrolog as rl

SCALE = 1.0


def weight_norm(w):
    return float(np.sqrt((w ** 2).sum())) * SCALE


seed = rl.arg("seed", 0)
rng = np.random.default_rng(seed)
w = np.zeros(8)
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(2)):
            w += rng.normal(size=8)
            time.sleep(0.02)
        rl.log("acc", float(w.mean()))
"""
STATEMENT = '        rl.log("w_norm", weight_norm(w))\n'


def _with(statement: str, script: str = SCRIPT) -> str:
    anchor = '        rl.log("acc", float(w.mean()))\n'
    return script.replace(anchor, anchor + statement)


def _record(project: Project) -> None:
    project.write("train.py", SCRIPT)
    project.run("train.py", "--kwargs", "seed=0")
    project.run("train.py", "--kwargs", "seed=1")


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory) -> RecordedOnce:
    return RecordedOnce.record(tmp_path_factory, _record)


@pytest.fixture
def project(recorded_once: RecordedOnce) -> Project:
    """The project after two runs of SCRIPT (seeds 0 and 1): recorded once for the module,
    the same for each test."""
    return recorded_once.fresh()


def _runs(project: Project) -> list[str]:
    return [str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]


def _w_norms(project: Project) -> dict[tuple[str, object], object]:
    rows = read_db(
        project.root,
        "SELECT l.run_id, p.iteration, l.value FROM logs l JOIN loops p"
        " ON p.run_id = l.run_id AND p.ctx_id = l.ctx_id WHERE l.name = 'w_norm'",
    )
    return {(str(r), e): v for r, e, v in rows}


def test_a_changed_definition_is_replayed_and_a_reformatted_one_is_not(project: Project) -> None:
    runs = _runs(project)
    project.write("train.py", _with(STATEMENT))
    first = project.cli("replay", "w_norm", "--yes")
    assert first.returncode == 0, first.stderr
    l2 = _w_norms(project)
    assert len(l2) == 6

    # Reformatted and commented: the same definition, nothing to replay.
    project.write("train.py", _with('        rl.log( "w_norm",  weight_norm( w ) )  # L2\n'))
    same = project.cli("replay", "w_norm", "--yes")
    assert same.returncode == 0 and "nothing to replay" in same.stderr, same.stderr

    # The helper it calls changes: every run's w_norm is recomputed, with the new helper.
    helper = SCRIPT.replace("np.sqrt((w ** 2).sum())", "np.abs(w).sum()")
    project.write("train.py", _with(STATEMENT, helper))
    plan = project.cli("replay", "w_norm", "--dry-run")
    for run_id in runs:
        assert f"definition changed since: {run_id} has w_norm" in plan.stderr, plan.stderr
    again = project.cli("replay", "w_norm", "--yes")
    assert again.returncode == 0, again.stderr
    l1 = _w_norms(project)
    assert l1.keys() == l2.keys() and all(l1[k] != l2[k] for k in l1)  # replaced, not added
    keys = read_db(project.root, "SELECT DISTINCT lineage FROM logs WHERE name = 'w_norm'")
    assert len(keys) == 1
    (key,) = keys[0]
    text = read_db(project.root, "SELECT text FROM definitions WHERE lineage = ?", (key,))
    assert "np.abs(w).sum()" in str(text[0][0])
    # Both definitions are kept, the old one too.
    assert read_db(project.root, "SELECT COUNT(*) FROM definitions WHERE name = 'w_norm'") == [(2,)]

    # A module constant the runs bind is their configuration: a new value today changes
    # today's definition but not what a replay computes in their versions.
    project.write("train.py", _with(STATEMENT, helper.replace("SCALE = 1.0", "SCALE = 2.0")))
    scaled = project.cli("replay", "w_norm", "--yes")
    assert scaled.returncode == 0 and "nothing to replay" in scaled.stderr, scaled.stderr
    assert _w_norms(project) == l1
    current = json.loads(
        project.cli("dataframe", "w_norm", "--definitions", "current", "--json").stdout
    )
    assert all(row["w_norm"] is None for row in current)


def test_dataframe_show_and_lineage_name_each_values_definition(project: Project) -> None:
    runs = _runs(project)
    project.write("train.py", _with(STATEMENT))
    assert project.cli("replay", "w_norm", "seed = 0", "--yes").returncode == 0
    # Today's statement changes after run 0 was replayed; run 1 gets the new one.
    project.write("train.py", _with('        rl.log("w_norm", 2 * weight_norm(w))\n'))
    assert project.cli("replay", "w_norm", "seed = 1", "--yes").returncode == 0

    columns = json.loads(
        project.cli("dataframe", "w_norm", "--definitions", "column", "--json").stdout
    )
    keys = {row["run_id"]: row["w_norm:definition"] for row in columns}
    assert len(set(keys.values())) == 2
    current = json.loads(
        project.cli("dataframe", "w_norm", "--definitions", "current", "--json").stdout
    )
    shown = {row["run_id"] for row in current if row["w_norm"] is not None}
    assert shown == {runs[1]}  # run 0's values come from the earlier statement

    show = project.cli("show", runs[0])
    assert (
        "defined    acc" in show.stdout and "(recorded): log('acc', float(w.mean()))" in show.stdout
    )
    assert "w_norm" in show.stdout and "using weight_norm, SCALE" in show.stdout

    lineage = project.cli("lineage", runs[1], "w_norm", "--at", "epoch=2")
    assert lineage.returncode == 0, lineage.stderr
    out = lineage.stdout
    assert "log('w_norm', 2 * weight_norm(w))" in out and "def weight_norm(w):" in out
    assert "deferred check exact" in out and "epoch=2" in out
    assert "after restoring the block checkpoint of epoch=2" in out
    assert f"ran as local processes on {socket.gethostname()}" in out
    found = json.loads(project.cli("lineage", runs[1], "w_norm", "--json").stdout)
    assert len(found["values"]) == 3 and found["numerics"]["machine"]["cpu"]
    bad = project.cli("lineage", runs[1], "w_norm", "--at", "epoch")
    assert bad.returncode == 2 and "LOOP=ITERATION" in bad.stderr
    missing = project.cli("lineage", runs[1], "nope")
    assert missing.returncode == 1 and "has no value of 'nope'" in missing.stderr


def test_recorded_values_of_another_definition_are_reported(project: Project) -> None:
    # Today's script computes acc differently and adds a statement; the plan says the
    # recorded acc column now mixes definitions.
    today = _with(STATEMENT).replace(
        'rl.log("acc", float(w.mean()))', 'rl.log("acc", float(np.median(w)))'
    )
    project.write("train.py", today)
    plan = project.cli("replay", "w_norm", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    plan_acc = project.cli("replay", "acc", "--dry-run")
    assert "recorded 'acc' in 2 run(s) was computed by another definition" in plan_acc.stderr


def test_a_variable_renamed_since_is_not_another_definition(project: Project) -> None:
    renamed = _with(STATEMENT).replace("w = np.zeros", "weights = np.zeros")
    renamed = renamed.replace("w=w", "w=weights").replace("w +=", "weights +=")
    renamed = renamed.replace("w.mean()", "weights.mean()").replace(
        "weight_norm(w)", "weight_norm(weights)"
    )
    project.write("train.py", renamed)
    plan = project.cli("replay", "acc", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "another definition" not in plan.stderr
    changed = renamed.replace("weights.mean()", "weights.max()")
    project.write("train.py", changed)
    plan = project.cli("replay", "acc", "--dry-run")
    assert "recorded 'acc' in 2 run(s) was computed by another definition" in plan.stderr
