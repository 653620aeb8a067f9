"""A code version copied into the object store and read back without the recording clone."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from retrolog.errors import StoreError, VersionError
from retrolog.store.objects import LocalObjectStore
from retrolog.store.paths import locate
from retrolog.versions.git import capture_code_version, list_files, materialize, read_file
from retrolog.versions.portable import (
    CodeManifest,
    export_code,
    git_blob_id,
    load_manifest,
    path_problem,
    readable_version,
)

from conftest import GIT_IDENTITY, Project


def _tree_of(project: Project) -> dict[str, tuple[str, bytes]]:
    """Every file of a directory: (kind, content or link target)."""
    found = {}
    for path in sorted(project.root.rglob("*")):
        rel = path.relative_to(project.root).as_posix()
        if rel.startswith(".git/") or rel == ".git" or rel.startswith(".retrolog"):
            continue
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path).encode())
        elif path.is_file():
            kind = "exec" if os.access(path, os.X_OK) else "file"
            found[rel] = (kind, path.read_bytes())
    return found


def _awkward(project: Project) -> None:
    project.write("pkg/sub/deep/mod.py", "X = 1\n")
    project.write("with space & 'quotes\".py", "Y = 2\n")
    project.write("ünïcode/名前.txt", "z\n")
    project.write("empty.txt", "")
    tool = project.write("bin/tool.sh", "#!/bin/sh\necho hi\n")
    tool.chmod(0o755)
    os.symlink("pkg/sub/deep/mod.py", project.root / "link.py")
    (project.root / "bytes.bin").write_bytes(bytes(range(256)) * 10)


def _row(paths, run_id: str, version, manifest: str | None, git_dir: str | None = None):  # type: ignore[no-untyped-def]
    return {
        "run_id": run_id,
        "git_dir": git_dir if git_dir is not None else str(version.git_dir),
        "code_commit": version.commit,
        "code_tree": version.tree,
        "code_manifest": manifest,
    }


def test_a_copied_version_reads_back_exactly_without_its_repository(
    project: Project, tmp_path: Path
) -> None:
    _awkward(project)
    paths = locate(project.root)
    version = capture_code_version(paths, "r1")
    objects = LocalObjectStore(tmp_path / "objects")
    key, manifest = export_code(version.git_dir, version.commit, objects)
    assert manifest.tree == version.tree
    assert {f.mode for f in manifest.files} == {"100644", "100755", "120000"}
    assert load_manifest(objects, key) == manifest
    # The same tree gives the same manifest: stored once.
    assert export_code(version.git_dir, version.commit, objects)[0] == key

    store = tmp_path / "elsewhere"  # another machine's store, sharing the objects
    store.mkdir()
    row = _row(paths, "r1", version, key, git_dir=str(tmp_path / "gone" / ".git"))
    where = readable_version(row, store_dir=store, root=tmp_path, objects=objects)
    assert where.source == "store copy" and where.git_dir == store / "code.git"
    assert where.rev == version.tree
    assert list_files(where.git_dir, where.rev) == list_files(version.git_dir, version.commit)
    assert read_file(where.git_dir, where.rev, "bytes.bin") == bytes(range(256)) * 10
    out = Project(tmp_path / "checkout")
    materialize(where.git_dir, where.rev, out.root)
    assert _tree_of(out) == _tree_of(project)
    # Read a second time from the cache, without the objects.
    again = readable_version(
        {**row, "run_id": "r1-again"}, store_dir=store, root=tmp_path,
        objects=LocalObjectStore(tmp_path / "no-objects"),
    )  # fmt: skip
    assert again == where


def test_the_recorded_clone_and_a_clone_with_the_ref_come_first(
    project: Project, tmp_path: Path
) -> None:
    paths = locate(project.root)
    version = capture_code_version(paths, "r1")
    row = _row(paths, "r1", version, None)
    found = readable_version(row, store_dir=tmp_path, root=tmp_path)
    assert found.source == "recorded" and found.rev == version.commit

    other = Project(tmp_path / "clone")
    subprocess.run(["git", "clone", "--quiet", str(project.root), str(other.root)], check=True)
    other.git("fetch", "--quiet", str(project.root), "refs/retrolog/*:refs/retrolog/*")
    moved = {**row, "git_dir": str(tmp_path / "moved" / ".git")}
    found = readable_version(moved, store_dir=tmp_path, root=other.root)
    assert found.source == "project" and found.git_dir == (other.root / ".git").resolve()

    with pytest.raises(VersionError, match="the store holds no copy of it") as err:
        readable_version({**moved, "run_id": "r2"}, store_dir=tmp_path, root=tmp_path)
    assert "git fetch" in str(err.value)


def test_a_sha256_repository_round_trips(tmp_path: Path) -> None:
    repo = Project(tmp_path / "repo")
    repo.root.mkdir()
    repo.git("init", "--quiet", "--object-format=sha256")
    repo.write("a.py", "A = 1\n")
    repo.write("d/b.py", "B = 2\n")
    repo.git("add", "-A")
    repo.git("commit", "--quiet", "-m", "x")
    commit = repo.git("rev-parse", "HEAD").strip()
    tree = repo.git("rev-parse", "HEAD^{tree}").strip()
    assert len(tree) == 64
    objects = LocalObjectStore(tmp_path / "objects")
    key, _ = export_code(repo.root / ".git", commit, objects)
    store = tmp_path / "store"
    store.mkdir()
    row = {"run_id": "s", "git_dir": None, "code_commit": commit, "code_tree": tree,
           "code_manifest": key}  # fmt: skip
    found = readable_version(row, store_dir=store, root=tmp_path, objects=objects)
    assert read_file(found.git_dir, found.rev, "d/b.py") == b"B = 2\n"


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "../x.py", "a/../../x.py", "..", "a//b", "./a", "a/", "", ".git/config",
     "sub/.GIT/hooks/pre-commit", "sub/.git./x", "a\0b"],
)  # fmt: skip
def test_unsafe_paths_are_refused(path: str) -> None:
    assert path_problem(path) is not None
    tree = "0" * 40
    doc = {"format": "retrolog-code/1", "tree": tree,
           "files": [[path, "100644", "1" * 40, "2" * 64]]}  # fmt: skip
    with pytest.raises(StoreError, match="is not valid"):
        CodeManifest.parse(json.dumps(doc).encode(), key="k")


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ([["a.py", "040000", "1" * 40, "2" * 64]], "mode"),
        ([["a.py", "100644", "1" * 40, "../../etc"]], "object key"),
        ([["a.py", "100644", "xyz", "2" * 64]], "git object id"),
        ([["a.py", "100644", "1" * 40, "2" * 64]] * 2, "listed twice"),
        ([["a", "100644", "1" * 40, "2" * 64], ["a/b", "100644", "1" * 40, "2" * 64]],
         "both as a file and as a directory"),
        ([["m", "160000", "1" * 40, "2" * 64]], "submodule"),
        ([["a.py", "100644", "1" * 40]], r"is not \[path, mode, blob, key\]"),
        ("not a list", "file list"),
    ],
)  # fmt: skip
def test_malformed_manifests_are_refused(files: object, says: str) -> None:
    doc = {"format": "retrolog-code/1", "tree": "0" * 40, "files": files}
    with pytest.raises(StoreError, match=says):
        CodeManifest.parse(json.dumps(doc).encode(), key="k")
    with pytest.raises(StoreError, match="not JSON"):
        CodeManifest.parse(b"{not json", key="k")
    with pytest.raises(StoreError, match="not a retrolog-code/1"):
        CodeManifest.parse(b'{"format": "pickle"}', key="k")


def test_git_blob_ids_are_gits(tmp_path: Path) -> None:
    data = b"hello\n"
    out = (
        subprocess.run(
            ["git", "hash-object", "--stdin"], input=data, capture_output=True, check=True
        )
        .stdout.decode()
        .strip()
    )
    assert git_blob_id(data, 40) == out


def _runs(store: Path) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(store / "retrolog.db")
    try:
        # In the order they ran: two runs within one second have ids in random order.
        return conn.execute(
            "SELECT run_id, code_tree, code_manifest FROM runs ORDER BY started_at"
        ).fetchall()
    finally:
        conn.close()


def test_runs_name_their_manifest_and_share_unchanged_files(project: Project) -> None:
    project.write("train.py", "import retrolog as rl\nrl.log('x', 1)\n")
    project.write("lib.py", "V = 1\n")
    project.run("train.py")
    project.run("train.py")  # the same tree: the memo names the same manifest
    project.write("lib.py", "V = 2\n")
    project.run("train.py")
    store = project.root / ".retrolog"
    (_, _, m1), (_, _, m2), (_, tree3, m3) = _runs(store)
    assert m1 == m2 and m1 != m3 and m3
    objects = LocalObjectStore(store / "objects")
    one, three = load_manifest(objects, str(m1)), load_manifest(objects, str(m3))
    assert three.tree == tree3
    shared = {f.path for f in one.files} & {f.path for f in three.files}
    same = {f.path for f in one.files if f in three.files}
    assert "train.py" in same and "lib.py" in shared and "lib.py" not in same
    memo = json.loads((store / "cache" / "code-exports.json").read_text())
    assert memo["locations"][str(store / "objects")][0] == [tree3, m3]


def test_a_run_whose_copy_never_finished_replays_from_its_ref(project: Project) -> None:
    """A process killed before its copy finished leaves code_manifest NULL: the private
    ref is then where the code is, and its absence is a clear error."""
    project.write("train.py", "import retrolog as rl\nrl.log('x', 1)\n")
    project.run("train.py")
    store = project.root / ".retrolog"
    conn = sqlite3.connect(store / "retrolog.db")
    with conn:
        conn.execute("UPDATE runs SET code_manifest = NULL")
    row = dict(
        zip(
            ("run_id", "git_dir", "code_commit", "code_tree", "code_manifest"),
            conn.execute(
                "SELECT run_id, git_dir, code_commit, code_tree, code_manifest FROM runs"
            ).fetchone(),
            strict=True,
        )
    )
    conn.close()
    found = readable_version(row, store_dir=store, root=project.root)
    assert found.source == "recorded"
    env = {**os.environ, **GIT_IDENTITY}
    subprocess.run(
        ["git", "update-ref", "-d", f"refs/retrolog/runs/{row['run_id']}"],
        cwd=project.root, env=env, check=True,
    )  # fmt: skip
    for args in (["reflog", "expire", "--expire=now", "--all"], ["gc", "--quiet", "--prune=now"]):
        subprocess.run(["git", *args], cwd=project.root, check=True)
    with pytest.raises(VersionError, match="the store holds no copy of it"):
        readable_version({**row, "run_id": "fresh-key"}, store_dir=store, root=project.root)


def test_runs_of_two_clones_compare_through_the_store(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.write("train.py", "import retrolog as rl\nrl.log('x', 1)\n")
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    other = Project(tmp_path / "clone")
    subprocess.run(["git", "clone", "--quiet", str(project.root), str(other.root)], check=True)
    store = tmp_path / "shared"
    project.run("train.py", RETROLOG_STORE=str(store))
    other.write("train.py", "import retrolog as rl\nrl.log('x', 2)\n")
    other.run("train.py", RETROLOG_STORE=str(store))
    import retrolog

    monkeypatch.setenv("RETROLOG_STORE", str(store))
    runs = [r for (r, _, _) in _runs(store)]
    found = retrolog.Project(other.root).compare(runs)
    (diff,) = found["diffs"]
    assert "-import retrolog as rl\nrl.log('x', 1)" not in diff["diff"]
    assert "-rl.log('x', 1)\n+rl.log('x', 2)" in diff["diff"]


def test_concurrent_imports_of_one_tree_all_succeed(project: Project, tmp_path: Path) -> None:
    """Replays on several machines sharing a store import the same version at once."""
    from concurrent.futures import ThreadPoolExecutor

    from retrolog.versions.portable import cache_repository, import_manifest

    _awkward(project)
    version = capture_code_version(locate(project.root), "r1")
    objects = LocalObjectStore(tmp_path / "objects")
    key, manifest = export_code(version.git_dir, version.commit, objects)
    store = tmp_path / "store"
    store.mkdir()
    cache = cache_repository(store, 40)

    def one(_: int) -> None:
        import_manifest(cache, manifest, objects, tree=version.tree, run_id="r1", manifest_key=key)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(8)))
    assert read_file(cache, version.tree, "pkg/sub/deep/mod.py") == b"X = 1\n"
    refs = subprocess.run(
        ["git", "--git-dir", str(cache), "for-each-ref"], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    assert refs.count("refs/retrolog/") == 1  # the tree's ref; no temporary one is left
