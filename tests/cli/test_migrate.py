"""``retrolog migrate --objects URL``: a store's objects moved to S3, as a user moves them."""

from __future__ import annotations

import sqlite3
import subprocess

import pytest

from retrolog.checkpoint.capture import load_checkpoint
from retrolog.store.backends import open_object_store
from retrolog.store.objects import LocalObjectStore
from retrolog.versions.portable import load_manifest
from training_scripts import NUMPY_TRAIN

from conftest import Project, read_db

pytestmark = pytest.mark.slow

WITH_NORM = NUMPY_TRAIN.replace(
    '        rl.log("score", float(w[:10].sum()))\n',
    '        rl.log("score", float(w[:10].sum()))\n'
    '        rl.log("w_norm", float(np.linalg.norm(w)))\n',
)


@pytest.fixture
def recorded(project: Project) -> Project:
    """Two runs with their objects in .retrolog/objects; the first as if recorded before
    code versions were copied into the objects (no code manifest)."""
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py", "--kwargs", "seed=1")
    project.write("train.py", NUMPY_TRAIN.replace("range(3)", "range(2)"))  # another version
    project.run("train.py", "--kwargs", "seed=2")
    db = sqlite3.connect(project.root / ".retrolog" / "retrolog.db")
    with db:
        db.execute(
            "UPDATE runs SET code_manifest = NULL WHERE run_id = "
            "(SELECT run_id FROM runs ORDER BY started_at LIMIT 1)"
        )
    db.close()
    return project


def cli(project: Project, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``retrolog ARGS`` with its messages unwrapped: a paragraph is wrapped to the
    terminal's width, and a long temporary path moves where a wrap falls."""
    out = project.cli(*args, **env)
    out.stderr = " ".join(out.stderr.split())
    return out


def local_keys(project: Project) -> set[str]:
    objects, _ = LocalObjectStore(project.root / ".retrolog" / "objects").scan()
    return {f.key for f in objects if f.key is not None}


def test_the_objects_move_to_s3_and_every_command_uses_them_there(
    recorded: Project, s3_url: str
) -> None:
    project = recorded
    config = project.root / ".retrolog" / "config.toml"
    out = cli(project, "migrate", "--objects", s3_url, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "after copying the code versions of 1 run(s)" in out.stdout
    target = open_object_store(s3_url)
    assert target.scan()[0] == [] and not config.exists()  # a plan only

    out = cli(project, "migrate", "--objects", s3_url)  # not a terminal: it does not ask
    assert out.returncode == 2 and "pass --yes" in out.stderr
    assert target.scan()[0] == []

    out = cli(project, "migrate", "--objects", s3_url, "--yes")
    assert out.returncode == 0, out.stderr
    assert "Code versions copied for 1 run(s)." in out.stdout
    keys = local_keys(project)
    assert f"Copied {len(keys)} object(s)" in out.stdout
    assert f"Verified {len(keys)} of {len(keys)}" in out.stdout
    assert {f.key for f in target.scan()[0]} == keys
    assert f'objects_url = "{s3_url}"' in config.read_text()
    shown = cli(project, "config").stdout
    assert "objects_url" in shown and s3_url in shown and str(config) in shown
    # The old run now has a code copy, in the target, of the tree it recorded.
    (tree, manifest), _ = read_db(
        project.root, "SELECT code_tree, code_manifest FROM runs ORDER BY started_at"
    )
    assert manifest is not None and load_manifest(target, manifest).tree == tree

    # With the local objects gone, replay restores from S3 and is exact.
    (project.root / ".retrolog" / "objects").rename(project.root / "objects-aside")
    project.write("train.py", WITH_NORM)
    out = cli(project, "replay", "w_norm", "--yes")
    assert out.returncode == 0, out.stderr
    assert "was not restored" not in out.stderr, out.stderr
    norms = read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'w_norm'")[0][0]
    assert norms == 4 + 4  # both runs, every epoch
    out = cli(project, "replay", "--verify", "--yes")  # the recorded values, from S3
    assert out.returncode == 0 and "2 replay exactly" in out.stderr, out.stderr
    assert "was not restored" not in out.stderr, out.stderr
    # Whether a replay restores or re-executes is the planner's choice, by the machine's
    # speed; every checkpoint the runs recorded loads from S3 either way.
    manifests = [m for (m,) in read_db(project.root, "SELECT manifest FROM checkpoints")]
    assert len(manifests) == 5 + 5
    for manifest in manifests:
        load_checkpoint(target, manifest)

    again = cli(project, "migrate", "--objects", s3_url, "--yes")
    assert again.returncode == 1 and "already at" in again.stderr
    assert "Traceback" not in again.stderr


def test_it_refuses_while_a_run_is_recording(project: Project, s3_url: str) -> None:
    project.write("train.py", NUMPY_TRAIN)
    project.run("train.py")
    with project.recording_paused():
        out = cli(project, "migrate", "--objects", s3_url, "--yes")
    assert out.returncode == 1 and "still recording" in out.stderr, out.stderr
    assert open_object_store(s3_url).scan()[0] == []
    assert not (project.root / ".retrolog" / "config.toml").exists()


def test_a_damaged_object_stops_it_before_the_switch(recorded: Project, s3_url: str) -> None:
    project = recorded
    objects = project.root / ".retrolog" / "objects"
    victim = max((p for p in objects.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = cli(project, "migrate", "--objects", s3_url, "--yes")
    assert out.returncode == 1, out.stdout
    assert victim.name in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (project.root / ".retrolog" / "config.toml").exists()  # not switched
    assert victim.read_bytes() == bytes(data)  # and nothing of the user's was touched


def test_an_environment_variable_that_still_points_elsewhere_is_named(
    recorded: Project, s3_url: str
) -> None:
    project = recorded
    local = str(project.root / ".retrolog" / "objects")
    out = cli(project, "migrate", "--objects", s3_url, "--yes", RETROLOG_OBJECTS_URL=local)
    assert out.returncode == 0, out.stderr
    assert "RETROLOG_OBJECTS_URL is set in this environment" in out.stdout


def test_a_url_nothing_can_open_is_one_paragraph(recorded: Project) -> None:
    out = cli(recorded, "migrate", "--objects", "nosuchprotocol://bucket/x", "--yes")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "nosuchprotocol" in out.stderr
    assert not (recorded.root / ".retrolog" / "config.toml").exists()
