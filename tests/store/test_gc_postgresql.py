"""``retrolog gc`` when the runs are in PostgreSQL (``database_url`` in pyproject.toml).

Retention thins the team's checkpoint rows and deletes the objects nothing references,
while another run records: that run keeps every row and object, and finishes; a
replay afterwards is still exact (a dropped checkpoint's block is executed instead).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from training_scripts import NUMPY_TRAIN, new_project

from conftest import Project, pg_role, read_pg, values_by_run

pytestmark = pytest.mark.slow

SCRIPT = """\
import argparse

import numpy as np

import retrolog as rl


def train(args):
    w = np.zeros(4096)
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(4)):
            rng = np.random.default_rng(args.seed * 100 + epoch)
            for step in rl.loop("step", range(10)):
                w += rng.random(4096) * args.lr
            rl.log("acc", float(w[:8].sum()))
            # HINDSIGHT


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    train(parser.parse_args())
"""
STATEMENT = 'rl.log("w_norm", float(np.linalg.norm(w)))'


def _objects(project: Project) -> set[str]:
    """The keys of the objects in the project's store (objects/<2 hex>/<the rest>)."""
    found = (project.root / ".retrolog" / "objects").rglob("*")
    return {p.parent.name + p.name for p in found if p.is_file()}


def _rows(url: str) -> dict[str, list[tuple[str, object]]]:
    found: dict[str, list[tuple[str, object]]] = {}
    for run_id, kind, iteration in read_pg(
        url,
        "SELECT c.run_id, c.kind, l.iteration FROM checkpoints c LEFT JOIN loops l"
        " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id ORDER BY c.checkpoint_id",
    ):
        found.setdefault(str(run_id), []).append((str(kind), iteration))
    return found


def test_gc_thins_postgresql_runs_beside_a_recording_run_and_replay_stays_exact(
    tmp_path: Path, pg_store_url: str, database_url: str
) -> None:
    project = new_project(tmp_path / "proj")
    project.write("pyproject.toml", f'[tool.retrolog]\ndatabase_url = "{pg_store_url}"\n')
    project.write("train.py", SCRIPT)
    project.write("paused.py", NUMPY_TRAIN)
    project.git("add", "-A")
    project.git("commit", "-qm", "scripts")
    for lr, seed in (("0.1", "1"), ("0.2", "2")):
        project.run("train.py", "--lr", lr, "--seed", seed)
    finished = _rows(pg_store_url)
    assert len(finished) == 2 and all(len(r) == 5 for r in finished.values())  # 4 blocks + end

    with pg_role(database_url, pg_store_url, "SELECT") as reader:
        planned = project.cli(
            "gc", "--keep", "last:1", "--grace", "0", "--dry-run", "--json",
            RETROLOG_DATABASE_URL=reader,
        )  # fmt: skip
        assert planned.returncode == 0, planned.stderr
        refused = project.cli(
            "gc", "--keep", "last:1", "--grace", "0", "--yes", RETROLOG_DATABASE_URL=reader
        )
        assert refused.returncode != 0 and "may not DELETE" in refused.stderr, refused.stderr
    assert len(json.loads(planned.stdout)["runs"]) == 2

    # Objects written since the oldest running run started (less 2 s for clocks) are
    # kept: let the finished runs' objects be older than that.
    time.sleep(3)
    with project.recording_paused("paused.py") as proc:
        ((running,),) = read_pg(pg_store_url, "SELECT run_id FROM runs WHERE status = 'running'")
        deadline = time.monotonic() + 30
        while len(_rows(pg_store_url).get(running, [])) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # its epochs' checkpoints, written by its writer thread
        before = _rows(pg_store_url)[running]
        assert before == [("block", 0), ("block", 1)]
        objects_before = _objects(project)
        done = project.cli("gc", "--keep", "last:1", "--grace", "0", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["done"] and report["checkpoints"] == 6, report
        after = _rows(pg_store_url)
        assert after[running] == before  # the recording run keeps every row
        for run_id in finished:
            assert after[run_id] == [("block", 3), ("end", None)], after[run_id]
        deleted = objects_before - _objects(project)
        assert deleted and report["objects"] == len(deleted)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    # The run that was recording finished, and all its checkpoints are there to restore.
    assert [kind for kind, _ in _rows(pg_store_url)[running]].count("block") == 4
    manifests = read_pg(pg_store_url, "SELECT manifest FROM checkpoints")
    assert {str(m) for (m,) in manifests} <= _objects(project)  # every kept row's object

    # A replay after gc: the dropped checkpoints' blocks are executed, values still exact.
    project.write("train.py", SCRIPT.replace("# HINDSIGHT", STATEMENT))
    out = project.cli("replay", "w_norm", "--yes", "--script", "train.py")
    assert out.returncode == 0, out.stderr
    argv = {
        str(r): tuple(json.loads(str(a))[1:])
        for r, a in read_pg(pg_store_url, "SELECT run_id, argv FROM runs")
    }
    for run_id in finished:
        fresh = new_project(tmp_path / f"fresh-{run_id}")
        fresh.write("train.py", SCRIPT.replace("# HINDSIGHT", STATEMENT))
        fresh.run("train.py", *argv[run_id])
        (expected,) = values_by_run(fresh.root, "w_norm").values()
        replayed = [
            float(str(v))
            for (v,) in read_pg(
                pg_store_url,
                "SELECT value_float FROM logs WHERE name = 'w_norm' AND run_id = %s"
                " ORDER BY ctx_id",
                (run_id,),
            )
        ]
        assert replayed == expected and len(expected) == 4, run_id
