"""Code versions a team can replay anywhere (docs/code-versions.md), end to end.

A run is recorded in clone A of a repository, with an uncommitted edit, into a
store outside both clones. It is then replayed with a new statement from clone
B (a fresh clone, without A's refs/retrolog/), or from a directory with no git
repository at all, after A is deleted: the code must come from the store's copy.
The backfilled values must equal a fresh run of A's version with the statement,
and differ from what B's committed code computes, so the replay ran A's edit.
Neither clone's HEAD, index, branches, refs or status may change.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from training_scripts import REAL_SHAPED, W_NORM, fresh_w_norms, new_project

from conftest import Project

pytestmark = pytest.mark.slow

TRAIN = """\
import numpy as np

import retrolog as rl
from helpers import SCALE

epochs = rl.arg("epochs", 3)
seed = rl.arg("seed", 0)
np.random.seed(seed)
w = np.zeros(500)
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(epochs)):
        for step in rl.loop("step", range(3)):
            w += np.random.random(500) * SCALE
        rl.log("score", float(w[:10].sum()))
"""
WITH_NORM = TRAIN.replace(
    '        rl.log("score", float(w[:10].sum()))\n',
    '        rl.log("score", float(w[:10].sum()))\n'
    '        rl.log("w_norm", float(np.linalg.norm(w)))\n',
)
COMMITTED_HELPERS = "SCALE = 1.0\n"
EDITED_HELPERS = "SCALE = 2.5  # an edit clone A never committed\n"
NORMS = (
    "SELECT e.iteration, l.value FROM logs l JOIN loops e ON e.run_id = l.run_id"
    " AND e.ctx_id = l.ctx_id WHERE l.name = 'w_norm' {origin} ORDER BY e.iteration"
)


def _rows(store: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(store / "retrolog.db")
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _upstream(tmp: Path) -> Path:
    """A bare repository with train.py and helpers.py committed."""
    seed = new_project(tmp / "seed")
    seed.write("train.py", TRAIN)
    seed.write("helpers.py", COMMITTED_HELPERS)
    seed.git("add", "-A")
    seed.git("commit", "--quiet", "-m", "train")
    bare = tmp / "upstream.git"
    subprocess.run(["git", "clone", "--quiet", "--bare", str(seed.root), str(bare)], check=True)
    shutil.rmtree(seed.root)
    return bare


def _clone(bare: Path, dest: Path) -> Project:
    subprocess.run(["git", "clone", "--quiet", str(bare), str(dest)], check=True)
    return Project(dest)


def _fresh(files: dict[str, str], **env: str) -> list[tuple[object, ...]]:
    """w_norm of a fresh run of ``files`` (in a plain directory, its own store)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "fresh"
        root.mkdir()
        project = Project(root)
        for name, text in files.items():
            project.write(name, text)
        store = Path(tmp) / "store"
        project.run("train.py", RETROLOG_STORE=str(store), **env)
        return _rows(store, NORMS.format(origin=""))


def _git_state(project: Project) -> dict[str, object]:
    """What a user sees of their repository, and every file under its .git, unchanged."""
    git_dir = project.root / ".git"
    files = {
        str(p.relative_to(git_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(git_dir.rglob("*"))
        if p.is_file()
    }
    return {
        "head": project.git("rev-parse", "HEAD"),
        "branches": project.git("branch", "-a", "-v"),
        "refs": project.git("for-each-ref"),
        "status": project.git("--no-optional-locks", "status", "--porcelain", "--untracked=all"),
        "index": (git_dir / "index").read_bytes(),
        "files": files,
    }


def _record(tmp: Path, store_env: dict[str, str]) -> tuple[Path, str]:
    """Record one run in clone A (with an uncommitted edit); the upstream and the run id."""
    bare = _upstream(tmp)
    a = _clone(bare, tmp / "a")
    a.write("helpers.py", EDITED_HELPERS)
    a.run("train.py", **store_env)
    store = Path(store_env["RETROLOG_STORE"])
    ((run_id, manifest, dirty),) = _rows(store, "SELECT run_id, code_manifest, dirty FROM runs")
    assert manifest and dirty == 1
    return bare, str(run_id)


@pytest.mark.parametrize(
    "where",
    [
        "clone",
        "clone-keeping-a",
        "no-repository",
        pytest.param("clone-s3", marks=pytest.mark.services),
    ],
)
def test_replay_from_another_clone_or_no_repository(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    store = tmp_path / "shared-store"
    store_env = {"RETROLOG_STORE": str(store)}
    if where == "clone-s3":
        store_env["RETROLOG_OBJECTS_URL"] = request.getfixturevalue("s3_url")
    bare, run_id = _record(tmp_path, store_env)
    if where == "clone-s3":
        assert not [p for p in (store / "objects").rglob("*") if p.is_file()]  # all at the URL
    a_state = None
    if where == "clone-keeping-a":
        a_state = _git_state(Project(tmp_path / "a"))
    else:
        shutil.rmtree(tmp_path / "a")  # the recorded git dir is gone

    if where == "no-repository":
        b = Project(tmp_path / "worker")
        b.root.mkdir()
        b.write("train.py", WITH_NORM)
    else:
        b = _clone(bare, tmp_path / "b")
        b.write("train.py", WITH_NORM)
        assert b.git("for-each-ref", "refs/retrolog/") == ""  # B lacks A's refs
        b_before = _git_state(b)

    out = b.cli("replay", "w_norm", "--yes", **store_env)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    replayed = _rows(store, NORMS.format(origin="AND l.origin = 'backfilled'"))
    expected = _fresh({"train.py": WITH_NORM, "helpers.py": EDITED_HELPERS})
    committed = _fresh({"train.py": WITH_NORM, "helpers.py": COMMITTED_HELPERS})
    assert len(expected) == 3 and replayed == expected
    assert replayed != committed  # A's uncommitted edit ran, not B's HEAD

    if where != "no-repository":
        assert _git_state(b) == b_before
    if a_state is not None:
        assert _git_state(Project(tmp_path / "a")) == a_state
    if where != "clone-keeping-a":
        # Read from the store's copy, imported into its cache repository.
        refs = subprocess.run(
            ["git", "--git-dir", str(store / "code.git"), "for-each-ref"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "refs/retrolog/trees/" in refs

    # The code itself reads the same from there: the script as A ran it.
    shown = subprocess.run(
        [sys.executable, "-c",
         "import json, sys, retrolog; print(json.dumps(retrolog.Project().code(sys.argv[1],"
         " 'helpers.py')))", run_id],
        cwd=b.root, env=b.env(**store_env), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(shown.stdout)["text"] == EDITED_HELPERS
    if where == "no-repository":
        show = b.cli("show", run_id, **store_env)
        assert show.returncode == 0, show.stderr
        assert "code kept  in the store's objects (code manifest" in show.stdout


@pytest.mark.usefixtures("whole_machine")
def test_a_torch_script_recorded_with_default_settings_replays_exactly_with_no_repository(
    tmp_path: Path,
) -> None:
    """The no-repository replay with what users run: torch's own threads, the adaptive
    rule, default replay workers, an argparse script with its loops in a function, a
    DataLoader and a scheduler, and an uncommitted edit in the recording clone."""
    default = {"RETROLOG_CHECKPOINTS": ""}  # the suite pins "every"; users don't
    seed = new_project(tmp_path / "seed")
    seed.write("train.py", REAL_SHAPED)
    seed.git("add", "-A")
    seed.git("commit", "--quiet", "-m", "train")
    bare = tmp_path / "upstream.git"
    subprocess.run(["git", "clone", "--quiet", "--bare", str(seed.root), str(bare)], check=True)
    lr = '"--lr", type=float, default='
    edited = REAL_SHAPED.replace(lr + "0.05", lr + "0.08")
    assert edited != REAL_SHAPED
    a = _clone(bare, tmp_path / "a")
    a.write("train.py", edited)  # never committed
    store = tmp_path / "shared-store"
    store_env = {"RETROLOG_STORE": str(store), **default}
    a.run("train.py", **store_env)
    shutil.rmtree(tmp_path / "a")

    worker = Project(tmp_path / "worker")  # no repository: today's code, a new statement
    worker.root.mkdir()
    worker.write("train.py", REAL_SHAPED.replace("# HINDSIGHT", W_NORM))
    out = worker.cli("replay", "w_norm", "--yes", **store_env)
    assert out.returncode == 0, out.stderr
    replayed = _rows(store, NORMS.format(origin="AND l.origin = 'backfilled'"))
    expected = _fresh({"train.py": edited.replace("# HINDSIGHT", W_NORM)}, **default)
    # The committed script's default --lr is 0.05: its shared fresh run.
    committed = fresh_w_norms("--lr", "0.05")
    assert len(expected) == 4 and replayed == expected
    assert replayed != committed  # the recording clone's uncommitted edit ran
    # Epochs of real length: the rule kept checkpoints and the replay restored them.
    ((restored,),) = _rows(store, "SELECT restored FROM replay_runs")
    assert restored and restored > 0, out.stdout


def test_gc_keeps_the_code_of_kept_runs_and_collects_the_rest(tmp_path: Path) -> None:
    store = tmp_path / "shared-store"
    store_env = {"RETROLOG_STORE": str(store)}
    _, run_id = _record(tmp_path, store_env)
    a = Project(tmp_path / "a")
    a.write("helpers.py", "SCALE = 3.0  # a second version\n")
    a.run("train.py", **store_env)
    (other,) = [r for (r,) in _rows(store, "SELECT run_id FROM runs") if r != run_id]
    shutil.rmtree(a.root)
    objects = store / "objects"

    def keys() -> set[str]:
        return {p.parent.name + p.name for p in objects.rglob("*") if p.is_file()}

    def age_everything() -> None:
        past = 1_000_000_000
        for p in objects.rglob("*"):
            if p.is_file():
                os.utime(p, (past, past))

    manifests = dict(_rows(store, "SELECT run_id, code_manifest FROM runs"))
    from retrolog.store.backends import open_object_store
    from retrolog.versions.portable import load_manifest

    local = open_object_store(str(objects))
    code = {r: {m} | load_manifest(local, str(m)).object_keys() for r, m in manifests.items()}
    assert code[run_id] & code[other]  # train.py is stored once for both runs

    age_everything()
    worker = Project(tmp_path / "worker")
    worker.root.mkdir()
    worker.write("train.py", WITH_NORM)
    out = worker.cli("gc", "--yes", **store_env)
    assert out.returncode == 0, out.stderr
    assert code[run_id] | code[other] <= keys()  # every kept run's code is live

    # The other run's row goes (as if deleted): its own files become collectable.
    conn = sqlite3.connect(store / "retrolog.db")
    with conn:
        for table in ("runs", "logs", "loops", "checkpoints", "profile"):
            conn.execute(f"DELETE FROM {table} WHERE run_id = ?", (other,))
    conn.close()
    age_everything()
    out = worker.cli("gc", "--yes", **store_env)
    assert out.returncode == 0, out.stderr
    left = keys()
    assert code[run_id] <= left
    assert not (code[other] - code[run_id]) & left

    # Replay after gc still reads the kept run's code from the store.
    out = worker.cli("replay", "w_norm", "--yes", **store_env)
    assert out.returncode == 0, out.stderr
    replayed = _rows(store, NORMS.format(origin="AND l.origin = 'backfilled'"))
    assert replayed == _fresh({"train.py": WITH_NORM, "helpers.py": EDITED_HELPERS})


def _forge(store: Path, run_id: str, edit: object) -> None:
    """Point the run at a manifest changed by ``edit`` (a function of its JSON document)."""
    from retrolog.store.backends import open_object_store

    objects = open_object_store(str(store / "objects"))
    ((key,),) = _rows(store, "SELECT code_manifest FROM runs WHERE run_id = ?", (run_id,))
    doc = json.loads(objects.get(str(key)))
    edit(doc, objects)  # type: ignore[operator]
    forged = objects.put(json.dumps(doc).encode())
    conn = sqlite3.connect(store / "retrolog.db")
    with conn:
        conn.execute("UPDATE runs SET code_manifest = ? WHERE run_id = ?", (forged, run_id))
    conn.close()


def _escape(doc: dict, objects: object) -> None:
    doc["files"][0][0] = "../escaped.py"


def _other_bytes(doc: dict, objects: object) -> None:
    from retrolog.versions.portable import git_blob_id

    data = b"SCALE = 1.0  # not what the run ran\n"
    for entry in doc["files"]:
        if entry[0] == "helpers.py":
            entry[2] = git_blob_id(data, len(entry[2]))
            entry[3] = objects.put(data)  # type: ignore[attr-defined]


def _wrong_blob(doc: dict, objects: object) -> None:
    for entry in doc["files"]:
        if entry[0] == "helpers.py":
            entry[3] = objects.put(b"SCALE = 1.0\n")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (_escape, "'..' component"),
        (_other_bytes, "make tree"),
        (_wrong_blob, "are not its recorded git blob"),
    ],
)
def test_a_tampered_copy_is_refused_and_nothing_is_written(
    tmp_path: Path, edit: object, says: str
) -> None:
    store = tmp_path / "shared-store"
    store_env = {"RETROLOG_STORE": str(store)}
    _, run_id = _record(tmp_path, store_env)
    shutil.rmtree(tmp_path / "a")
    _forge(store, run_id, edit)
    worker = Project(tmp_path / "worker")
    worker.root.mkdir()
    worker.write("train.py", WITH_NORM)

    def outside_store() -> list[str]:
        return sorted(
            str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
            if not p.is_relative_to(store)
        )  # fmt: skip

    before = outside_store()
    out = worker.cli("replay", "w_norm", "--yes", **store_env)
    assert "Traceback" not in out.stderr
    assert says in out.stderr, out.stderr
    assert "was not used" in out.stderr or "It was not used" in out.stderr, out.stderr
    assert outside_store() == before
    assert _rows(store, NORMS.format(origin="AND l.origin = 'backfilled'")) == []
    assert not (tmp_path / "escaped.py").exists() and not (store / "escaped.py").exists()
