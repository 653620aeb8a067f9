"""RETROLOG_OBJECTS_URL end to end: record, replay and gc with the objects in an fsspec store.

``local://`` is fsspec's own local file system, so the store is a FsspecObjectStore (not
the LocalObjectStore a path or file:// gives) that several processes can share: the
recording run, the replay's coordinator and its workers, and gc.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest

from retrolog.checkpoint.capture import load_checkpoint
from retrolog.store.backends import open_object_store
from retrolog.store.fsspec_objects import FsspecObjectStore
from training_scripts import NUMPY_TRAIN, REAL_SHAPED, W_NORM, fresh_w_norms, new_project

from conftest import read_db

pytestmark = pytest.mark.slow

WITH_NORM = NUMPY_TRAIN.replace(
    '        rl.log("score", float(w[:10].sum()))\n',
    '        rl.log("score", float(w[:10].sum()))\n'
    '        rl.log("w_norm", float(np.linalg.norm(w)))\n',
)
NORMS = (
    "SELECT e.iteration, l.value FROM logs l JOIN loops e ON e.run_id = l.run_id"
    " AND e.ctx_id = l.ctx_id WHERE l.name = 'w_norm' {origin} ORDER BY e.iteration"
)


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.services)])
def test_record_replay_and_gc_with_objects_at_a_url(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    project = new_project(tmp_path / "proj")
    shared = tmp_path / "shared" / "objects"
    # local:// is fsspec's own local file system; s3:// the S3-compatible server of
    # scripts/services.sh, reached by every process through the AWS_* variables.
    url = f"local://{shared}" if where == "local" else request.getfixturevalue("s3_url")
    store = open_object_store(url)
    assert isinstance(store, FsspecObjectStore)

    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py", "--kwargs", "seed=3", RETROLOG_OBJECTS_URL=url)
    manifests = [m for (m,) in read_db(project.root, "SELECT manifest FROM checkpoints")]
    assert len(manifests) == 5  # four epochs and the end
    assert files(project.root / ".retrolog" / "objects") == []  # all of them went to the URL
    assert {f.key for f in store.scan()[0]} >= set(manifests)

    # Replay restores the recorded checkpoints from the URL, in worker processes.
    project.write("train.py", WITH_NORM)
    out = project.cli("replay", "w_norm", "--yes", RETROLOG_OBJECTS_URL=url)
    assert out.returncode == 0, out.stderr
    assert "was not restored" not in out.stderr, out.stderr
    replayed = read_db(project.root, NORMS.format(origin="AND l.origin = 'backfilled'"))
    with tempfile.TemporaryDirectory() as fresh_store:
        project.run("train.py", "--kwargs", "seed=3", RETROLOG_STORE=fresh_store)
        fresh = sqlite3.connect(Path(fresh_store) / "retrolog.db")
        expected = fresh.execute(NORMS.format(origin="")).fetchall()
        fresh.close()
    assert len(expected) == 4 and replayed == expected

    # gc collects the dropped checkpoints' objects at the URL; what is kept still loads.
    grace = []
    if where == "local":
        past = time.time() - 7200
        for path in files(shared):
            os.utime(path, (past, past))
    else:  # S3 keeps the server's write times: wait past them, and give no grace
        time.sleep(2.0)
        grace = ["--grace", "0"]
    before = len(store.scan()[0])
    out = project.cli("gc", "--keep", "last:1", "--yes", *grace, RETROLOG_OBJECTS_URL=url)
    assert out.returncode == 0, out.stderr
    kept = [m for (m,) in read_db(project.root, "SELECT manifest FROM checkpoints")]
    assert len(kept) == 2
    assert len(store.scan()[0]) < before
    for manifest in kept:
        load_checkpoint(store, manifest)


@pytest.mark.usefixtures("whole_machine")
def test_default_settings_record_and_replay_a_torch_script_exactly_from_s3(
    tmp_path: Path, s3_url: str
) -> None:
    """torch's own threads, the adaptive rule, default replay workers, an argparse script
    with its loops in a function, a DataLoader and a scheduler; objects on S3."""
    project = new_project(tmp_path / "proj")
    default = {"RETROLOG_CHECKPOINTS": ""}  # the suite pins "every"; users don't
    project.write("train.py", REAL_SHAPED)
    project.git("add", "-A")
    project.git("commit", "-qm", "train")
    project.run("train.py", "--lr", "0.1", RETROLOG_OBJECTS_URL=s3_url, **default)
    manifests = [m for (m,) in read_db(project.root, "SELECT manifest FROM checkpoints")]
    assert manifests  # the end state at least, whatever the rule chose
    assert files(project.root / ".retrolog" / "objects") == []
    store = open_object_store(s3_url)
    for manifest in manifests:
        load_checkpoint(store, manifest)

    project.write("train.py", REAL_SHAPED.replace("# HINDSIGHT", W_NORM))
    out = project.cli("replay", "w_norm", "--yes", RETROLOG_OBJECTS_URL=s3_url, **default)
    assert out.returncode == 0, out.stderr
    replayed = read_db(project.root, NORMS.format(origin="AND l.origin = 'backfilled'"))
    expected = fresh_w_norms("--lr", "0.1")
    assert len(expected) == 4 and replayed == expected
    # Epochs of real length: the rule kept checkpoints and the replay restored them from S3.
    ((restored,),) = read_db(project.root, "SELECT restored FROM replay_runs")
    assert restored and restored > 0, out.stdout


EXIT_HEAVY = """\
import numpy as np

import retrolog as rl

rng = np.random.default_rng(0)
layers = {"layer0": rng.standard_normal(500_000)}


def train():
    with rl.checkpointing(layers=layers):
        for epoch in rl.loop("epoch", range(2)):
            if epoch == 1:  # the model grows: its last checkpoints have 8 objects, not 1
                layers.update({f"layer{i}": rng.standard_normal(500_000) for i in range(1, 8)})
            for w in layers.values():
                w *= 0.5
            rl.log("norm", float(sum(np.linalg.norm(w) for w in layers.values())))


train()  # and the script ends: its last checkpoints are still being written
"""


def test_checkpoints_finished_at_exit_reach_s3_by_its_host_name(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At exit, Python stops concurrent.futures before atexit hooks run, and s3fs needs
    an executor to resolve a host name for a new connection: a checkpoint finished from
    atexit failed ("cannot schedule new futures after shutdown") and was lost."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    assert "127.0.0.1" in endpoint  # the server scripts/services.sh starts
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.replace("127.0.0.1", "localhost"))
    project = new_project(tmp_path / "proj")
    project.write("train.py", EXIT_HEAVY)
    out = project.run("train.py", RETROLOG_OBJECTS_URL=s3_url)
    assert "Warning" not in out.stderr, out.stderr
    (record,) = read_db(project.root, "SELECT checkpointing FROM runs")
    stats = json.loads(record[0])
    assert stats["finished_at_exit"] >= 1, f"nothing was left to finish at exit: {stats}"
    assert stats["written"] == stats["chosen"] == 2 and stats["end_written"] == 1, stats
    store = open_object_store(s3_url)
    manifests = [m for (m,) in read_db(project.root, "SELECT manifest FROM checkpoints")]
    assert len(manifests) == 3
    for manifest in manifests:
        load_checkpoint(store, manifest)
