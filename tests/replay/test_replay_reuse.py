"""Reuse: a run that computed exactly what another did gets that one's values, bit for bit."""

from __future__ import annotations

import pytest

from conftest import Project, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import time

import numpy as np

import retrolog as rl

seed = rl.arg("seed", 0)
offset = float(open("data/offset.txt").read())
rng = np.random.default_rng(seed)
w = np.zeros(8) + offset
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(2)):
            w += rng.normal(size=8)
            time.sleep(0.02)
        rl.log("acc", float(w.mean()))
"""
STATEMENT = '        rl.log("w_norm", float(np.sqrt((w ** 2).sum())))\n'


def _record(project: Project, offsets: list[str], seeds: list[int]) -> list[str]:
    project.write("train.py", SCRIPT)
    for offset, seed in zip(offsets, seeds, strict=True):
        project.write("data/offset.txt", offset)
        project.run("train.py", "--kwargs", f"seed={seed}")
    anchor = '        rl.log("acc", float(w.mean()))\n'
    project.write("train.py", SCRIPT.replace(anchor, anchor + STATEMENT))
    return [str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]


def _values(project: Project) -> dict[str, list[object]]:
    rows = read_db(
        project.root,
        "SELECT run_id, value FROM logs WHERE name = 'w_norm' ORDER BY run_id, ctx_id",
    )
    found: dict[str, list[object]] = {}
    for run_id, value in rows:
        found.setdefault(str(run_id), []).append(value)
    return found


def test_a_run_launched_twice_is_replayed_once(project: Project) -> None:
    a, b, c = _record(project, ["0.5", "0.5", "0.5"], [0, 0, 1])
    plan = project.cli("replay", "w_norm", "--dry-run")
    assert f"run {b}: reused from {a}" in plan.stderr, plan.stderr
    assert f"run {c}: reused" not in plan.stderr
    out = project.cli("replay", "w_norm", "--yes")
    assert out.returncode == 0, out.stderr
    assert "(1 of them by reuse)" in out.stderr
    reused = _values(project)
    assert reused[b] == reused[a] and reused[c] != reused[a]
    sources = read_db(
        project.root, "SELECT DISTINCT run_id, reused_from FROM logs WHERE name = 'w_norm'"
    )
    assert sorted(sources, key=str) == sorted([(a, None), (b, a), (c, None)], key=str)
    assert read_db(project.root, "SELECT scan FROM replay_runs WHERE run_id = ?", (b,)) == [
        ("REUSED",)
    ]
    # Recomputed without reuse: the same values, bit for bit.
    forced = project.cli("replay", "w_norm", "--yes", "--force", "--no-reuse")
    assert forced.returncode == 0, forced.stderr
    assert _values(project) == reused
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE reused_from IS NOT NULL") == [
        (0,)
    ]


def test_values_already_there_are_copied_without_running_anything(project: Project) -> None:
    a, b, _ = _record(project, ["0.5", "0.5", "0.5"], [0, 0, 1])
    first = project.cli("replay", "w_norm", f"run_id = '{a}'", "--yes")
    assert first.returncode == 0, first.stderr
    second = project.cli("replay", "w_norm", f"run_id = '{b}'", "--yes")
    assert second.returncode == 0, second.stderr
    assert f"run {b}: reused from {a}" in second.stderr
    assert "Replay plan" not in second.stderr  # nothing to execute
    assert _values(project)[b] == _values(project)[a]


def test_the_same_configuration_with_another_history_is_replayed(project: Project) -> None:
    # The data file changed between the two launches: same code and arguments, but the
    # recorded values differ, so nothing shows the runs agree.
    a, b, _ = _record(project, ["0.5", "0.75", "0.5"], [0, 0, 1])
    out = project.cli("replay", "w_norm", "--yes")
    assert out.returncode == 0, out.stderr
    assert "reused" not in out.stderr
    values = _values(project)
    assert values[a] != values[b]
