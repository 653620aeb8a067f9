"""The fork server a replay starts before its plan: used when the guess is right, stopped
when it is wrong or nothing is to replay, and never outliving the replay."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import Project, read_db, replay_workers

pytestmark = pytest.mark.slow

# The run imports extlib (an installed package: outside the project) without an import
# statement, so the package is in the run's recorded modules but not in its script's.
SCRIPT = """\
import importlib

import numpy as np

import retrolog as rl

importlib.import_module("extlib")
rng = np.random.default_rng(rl.arg("seed", 0))
w = np.zeros(4)
with rl.checkpointing(w=w, rng=rng):
    for epoch in rl.loop("epoch", range(3)):
        w += rng.normal(size=4)
        rl.log("acc", float(w.mean()))
"""
ANCHOR = '        rl.log("acc", float(w.mean()))\n'
STATEMENT = '        rl.log("w_norm", float(np.sqrt((w ** 2).sum())))\n'


@pytest.fixture
def site(tmp_path: Path) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "extlib.py").write_text("VALUE = 1\n")
    return folder


# Default settings: the adaptive rule chooses the checkpoints (conftest pins "every").
DEFAULTS = {"RETROLOG_CHECKPOINTS": "adaptive"}


def _record(project: Project, site: Path) -> str:
    project.write("train.py", SCRIPT)
    project.run("train.py", PYTHONPATH=str(site), **DEFAULTS)
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    return str(run_id)


def _servers(project: Project) -> list[list[str]]:
    """Per replay, in order: the fork server logs it left."""
    replays = sorted((project.root / ".retrolog" / "replays").iterdir())
    return [sorted(p.name for p in r.glob("forkserver-*.log")) for r in replays]


def _fresh_values(project: Project, site: Path) -> list[object]:
    """w_norm as a fresh run of today's script computes it, in its own store."""
    fresh = project.root.parent / "fresh"
    project.run(
        "train.py", PYTHONPATH=str(site), RETROLOG_STORE=str(fresh / ".retrolog"), **DEFAULTS
    )
    return [v for (v,) in read_db(fresh, "SELECT value FROM logs WHERE name = 'w_norm'")]


def _backfilled(project: Project) -> list[object]:
    return [
        v
        for (v,) in read_db(
            project.root,
            "SELECT value FROM logs WHERE name = 'w_norm' AND origin = 'backfilled'"
            " ORDER BY ctx_id",
        )
    ]


def test_a_right_guess_is_the_server_the_workers_fork_from(project: Project, site: Path) -> None:
    _record(project, site)
    project.write("train.py", SCRIPT.replace(ANCHOR, ANCHOR + STATEMENT))
    out = project.cli("replay", "w_norm", "--yes", PYTHONPATH=str(site), **DEFAULTS)
    assert out.returncode == 0, out.stderr
    # However many segments the plan makes (it may split the run on a busy machine).
    assert re.search(r"\d+ worker\(s\) forked from 1 fork server\(s\)", out.stderr), out.stderr
    assert _servers(project) == [["forkserver-0.log"]]  # one server started: the guess
    assert _backfilled(project) == _fresh_values(project, site)
    assert not replay_workers(str(project.root))


def test_a_wrong_guess_is_stopped_and_the_plan_starts_its_own(project: Project, site: Path) -> None:
    _record(project, site)
    # Today's script imports extlib by name; the run's version, with the statement
    # propagated into it, does not: the guess (today's imports) pre-imports extlib, the
    # plan's server does not.
    today = SCRIPT.replace(ANCHOR, ANCHOR + STATEMENT)
    project.write(
        "train.py", today.replace("import importlib\n", "import importlib\n\nimport extlib\n")
    )
    out = project.cli("replay", "w_norm", "--yes", PYTHONPATH=str(site), **DEFAULTS)
    assert out.returncode == 0, out.stderr
    # However many segments the plan makes (it may split the run on a busy machine).
    assert re.search(r"\d+ worker\(s\) forked from 1 fork server\(s\)", out.stderr), out.stderr
    assert _servers(project) == [["forkserver-0.log", "forkserver-1.log"]]
    assert not replay_workers(str(project.root))
    project.write("train.py", today)
    assert _backfilled(project) == _fresh_values(project, site)


def test_nothing_to_replay_leaves_no_server_and_no_trace(project: Project, site: Path) -> None:
    _record(project, site)
    project.write("train.py", SCRIPT.replace(ANCHOR, ANCHOR + STATEMENT))
    first = project.cli("replay", "w_norm", "--yes", PYTHONPATH=str(site), **DEFAULTS)
    assert first.returncode == 0, first.stderr
    again = project.cli("replay", "w_norm", "--yes", PYTHONPATH=str(site), **DEFAULTS)
    assert again.returncode == 0, again.stderr
    assert "nothing to replay" in again.stderr
    assert len(_servers(project)) == 1  # the second replay kept no directory
    assert not replay_workers(str(project.root))
