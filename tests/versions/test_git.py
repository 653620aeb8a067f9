"""Code versions: capture a working tree on a private ref, get it back, touch nothing else."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrolog.errors import RetrologWarning, UsageError, VersionError
from retrolog.store.paths import ProjectPaths, locate
from retrolog.versions.git import (
    CodeVersion,
    capture_code_version,
    list_runs_refs,
    materialize,
    read_file,
)

# The tests' own commits need an identity; retrolog must not (see test_no_git_identity).
USER = (
    "-c",
    "user.name=Test User",
    "-c",
    "user.email=test@example.com",
    "-c",
    "init.defaultBranch=main",
    "-c",
    "commit.gpgSign=false",
)


@pytest.fixture(autouse=True)
def isolated_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user or system git config, no git identity, no inherited repository."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    # Repositories are made below tmp_path: never discover one above it.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for name in (
        "GIT_DIR",
        "GIT_WORK_TREE",
        "GIT_INDEX_FILE",
        "GIT_COMMON_DIR",
        "GIT_OBJECT_DIRECTORY",
        "GIT_CONFIG_GLOBAL",
        "GIT_CONFIG_PARAMETERS",
        "GIT_CONFIG_COUNT",
        "GIT_AUTHOR_NAME",
        "GIT_AUTHOR_EMAIL",
        "GIT_COMMITTER_NAME",
        "GIT_COMMITTER_EMAIL",
        "EMAIL",
        "RETROLOG_STORE",
        "RETROLOG_MAX_FILE_BYTES",
    ):
        monkeypatch.delenv(name, raising=False)


def git(cwd: Path, *args: str) -> str:
    """Run git as the user would; GIT_OPTIONAL_LOCKS=0 keeps `git status` from writing the index."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    done = subprocess.run(["git", *USER, *args], cwd=cwd, env=env, capture_output=True, check=True)
    return done.stdout.decode("utf-8", errors="surrogateescape")


def new_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    return path


def write(root: Path, rel: str, data: bytes | str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def add_store(root: Path) -> Path:
    """A store like the real one: .retrolog/ ignoring itself, with a database in it."""
    store = root / ".retrolog"
    write(store, ".gitignore", "*\n")
    write(store, "retrolog.db", b"SQLite format 3\x00")
    return store


def snapshot_names(version: CodeVersion) -> set[str]:
    ls_tree = ["ls-tree", "-r", "-z", "--name-only", version.commit]
    out = subprocess.run(
        ["git", "--git-dir", str(version.git_dir), *ls_tree],
        capture_output=True,
        check=True,
    ).stdout
    return {os.fsdecode(name) for name in out.split(b"\0") if name}


def files_under(root: Path, leave_out: tuple[str, ...] = (".git",)) -> dict[str, bytes]:
    """Every file below root (relative posix path -> bytes; symlinks -> their target)."""
    found: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if any(rel == skip or rel.startswith(skip + "/") for skip in leave_out):
            continue
        if path.is_symlink():
            found[rel] = b"-> " + os.fsencode(os.readlink(path))
        elif path.is_file():
            found[rel] = path.read_bytes()
    return found


def git_state(repo: Path) -> dict[str, object]:
    """Everything of the user's that capture must leave alone."""
    index = Path(git(repo, "rev-parse", "--git-path", "index").strip())
    index = index if index.is_absolute() else repo / index
    head = subprocess.run(
        ["git", "rev-parse", "-q", "--verify", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout
    refs = [line for line in git(repo, "for-each-ref").splitlines() if "refs/retrolog/" not in line]
    return {
        "index": index.read_bytes() if index.exists() else None,
        "head": head,
        "symbolic": git(repo, "symbolic-ref", "-q", "HEAD"),
        "status": git(repo, "status", "--porcelain=v2", "-z", "--untracked-files=all"),
        "refs": refs,
        "stash": git(repo, "stash", "list"),
        "config": (repo / ".git" / "config").read_bytes() if (repo / ".git").is_dir() else None,
        "files": files_under(repo),
    }


def busy_repo(root: Path) -> Path:
    """A repository with history, a stash, staged and unstaged edits, untracked, ignored files."""
    repo = new_repo(root)
    write(repo, ".gitignore", "*.log\ndata/\n")
    write(repo, "train.py", "print('v1')\n")
    write(repo, "model/net.py", "W = 1\n")
    write(repo, "gone.py", "x = 1\n")
    write(repo, "notes with space é.md", "hello\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    write(repo, "train.py", "print('stashed')\n")
    git(repo, "stash", "-q")
    write(repo, "model/net.py", "W = 2  # staged\n")
    git(repo, "add", "model/net.py")
    write(repo, "train.py", "print('v2, unstaged')\n")
    (repo / "gone.py").unlink()
    write(repo, "new_untracked.py", "y = 2\n")
    write(repo, "run.log", "ignored\n")
    write(repo, "data/train.csv", "1,2\n")
    add_store(repo)
    git(repo, "update-index", "-q", "--refresh")  # settle stat data before comparing
    return repo


def test_capture_leaves_git_state_untouched(tmp_path: Path) -> None:
    repo = busy_repo(tmp_path / "proj")
    before = git_state(repo)

    version = capture_code_version(locate(repo), "run1")

    assert git_state(repo) == before
    assert version.ref == "refs/retrolog/runs/run1"
    assert git(repo, "rev-parse", version.ref).strip() == version.commit


def test_snapshot_is_the_working_tree(tmp_path: Path) -> None:
    repo = busy_repo(tmp_path / "proj")
    head = git(repo, "rev-parse", "HEAD").strip()

    version = capture_code_version(locate(repo), "run1", message="lr sweep")

    assert snapshot_names(version) == {
        ".gitignore",
        "train.py",
        "model/net.py",
        "notes with space é.md",
        "new_untracked.py",
    }
    assert read_file(version.git_dir, version.commit, "train.py") == b"print('v2, unstaged')\n"
    assert read_file(version.git_dir, version.commit, "model/net.py") == b"W = 2  # staged\n"
    assert version.head_commit == head
    assert version.dirty
    assert version.skipped == ()
    assert version.git_dir == (repo / ".git").resolve()
    assert git(repo, "rev-parse", f"{version.commit}^").strip() == head
    assert git(repo, "rev-parse", f"{version.commit}^{{tree}}").strip() == version.tree
    assert "lr sweep" in git(repo, "log", "-1", "--format=%B", version.commit)


def test_materialize_gives_back_identical_files(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "import model\n")
    write(repo, "pkg/dir with space/ünïcödé 日本.py", "x = 'ü'\n")
    write(repo, "weights.bin", bytes(range(256)) * 8)
    write(repo, "crlf.txt", b"a\r\nb\r\n")
    write(repo, "run.sh", "#!/bin/sh\necho hi\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "link.py").symlink_to("train.py")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "first")
    write(repo, "train.py", "import model  # edited\n")
    add_store(repo)
    expected = files_under(repo, leave_out=(".git", ".retrolog"))

    version = capture_code_version(locate(repo), "run1")
    dest = tmp_path / "replay" / "checkout"
    materialize(version.git_dir, version.commit, dest)

    assert files_under(dest) == expected
    assert (dest / "run.sh").stat().st_mode & stat.S_IXUSR
    assert (dest / "link.py").is_symlink()
    weird = "pkg/dir with space/ünïcödé 日本.py"
    assert read_file(version.git_dir, version.commit, weird) == expected[weird]


def test_materialize_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "x = 1\n")
    version = capture_code_version(locate(repo), "run1")
    dest = tmp_path / "dest"
    write(dest, "mine.txt", "keep me\n")

    with pytest.raises(VersionError, match="not an empty directory"):
        materialize(version.git_dir, version.commit, dest)
    assert files_under(dest) == {"mine.txt": b"keep me\n"}


def test_big_files_are_skipped_listed_and_warned_once(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "small.py", "x = 1\n")
    write(repo, "tracked_big.bin", b"t" * 100)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    # Glob characters in the name: the exclusion must be literal, so the small
    # file that the glob would match stays in.
    write(repo, "big [x] *.bin", b"u" * 100)
    write(repo, "big x other.bin", b"small")
    before = git_state(repo)

    with pytest.warns(RetrologWarning) as caught:
        version = capture_code_version(locate(repo), "run1", max_file_bytes=50)

    assert len(caught) == 1
    assert version.skipped == ("big [x] *.bin", "tracked_big.bin")
    assert "tracked_big.bin" in str(caught[0].message)
    assert "big [x] *.bin" in str(caught[0].message)
    assert snapshot_names(version) == {"small.py", "big x other.bin"}
    assert version.dirty  # the tracked big file is missing from the snapshot
    assert git_state(repo) == before


def test_size_cap_from_environment_and_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "a.py", b"a" * 20)
    write(repo, "default_cap.bin", b"d" * (2 * 1024 * 1024 + 1))
    paths = locate(repo)

    with pytest.warns(RetrologWarning):
        assert capture_code_version(paths, "r1").skipped == ("default_cap.bin",)
    monkeypatch.setenv("RETROLOG_MAX_FILE_BYTES", "10")
    with pytest.warns(RetrologWarning):
        assert capture_code_version(paths, "r2").skipped == ("a.py", "default_cap.bin")
    # The argument wins over the environment; nothing skipped, so no warning.
    assert capture_code_version(paths, "r3", max_file_bytes=10**7).skipped == ()
    monkeypatch.setenv("RETROLOG_MAX_FILE_BYTES", "lots")
    with pytest.raises(UsageError, match="RETROLOG_MAX_FILE_BYTES"):
        capture_code_version(paths, "r4")


def test_unborn_head(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "x = 1\n")
    write(repo, "staged.py", "y = 2\n")
    git(repo, "add", "staged.py")
    before = git_state(repo)

    version = capture_code_version(locate(repo), "run1")

    assert git_state(repo) == before
    assert version.head_commit is None
    assert version.dirty
    assert snapshot_names(version) == {"train.py", "staged.py"}
    parents = git(repo, "rev-list", "--parents", "-n", "1", version.commit).split()
    assert parents == [version.commit]


def test_new_repository_without_index_file(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "x = 1\n")

    version = capture_code_version(locate(repo), "run1")

    assert not (repo / ".git" / "index").exists()
    assert snapshot_names(version) == {"train.py"}


def test_linked_worktree(tmp_path: Path) -> None:
    main = new_repo(tmp_path / "main")
    write(main, "train.py", "x = 1\n")
    git(main, "add", "-A")
    git(main, "commit", "-q", "-m", "first")
    linked = tmp_path / "linked"
    git(main, "worktree", "add", "-q", "-b", "feature", str(linked))
    write(linked, "train.py", "x = 2  # edited in the linked worktree\n")
    write(linked, "extra.py", "z = 3\n")
    git(linked, "update-index", "-q", "--refresh")
    before_main, before_linked = git_state(main), git_state(linked)

    version = capture_code_version(locate(linked), "run1")

    assert git_state(main) == before_main
    assert git_state(linked) == before_linked
    assert version.git_dir == (main / ".git").resolve()
    assert version.head_commit == git(linked, "rev-parse", "HEAD").strip()
    assert read_file(version.git_dir, version.commit, "train.py").startswith(b"x = 2")
    assert snapshot_names(version) == {"train.py", "extra.py"}
    # The ref is shared, not per-worktree: the main checkout sees it too.
    assert list_runs_refs(main / ".git") == {version.ref: version.commit}


def test_no_git_identity(tmp_path: Path) -> None:
    # useConfigOnly forbids git from guessing an identity from the host, so
    # without retrolog's own identity commit-tree would fail here.
    write(Path(os.environ["HOME"]), ".gitconfig", "[user]\n\tuseConfigOnly = true\n")
    repo = tmp_path / "proj"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    write(repo, "train.py", "x = 1\n")
    tree = subprocess.run(
        ["git", "write-tree"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    plain = subprocess.run(["git", "commit-tree", "-m", "x", tree], cwd=repo, capture_output=True)
    assert plain.returncode != 0

    version = capture_code_version(locate(repo), "run1")

    assert snapshot_names(version) == {"train.py"}
    assert git(repo, "log", "-1", "--format=%an", version.commit).strip() == "retrolog"


def test_outside_git_uses_a_private_git_directory(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    write(root, "train.py", "x = 1\n")
    write(root, "lib/util.py", "y = 2\n")
    write(root, "lib/a file é.txt", "z\n")
    for junk in (
        "__pycache__/train.cpython-311.pyc",
        "lib/__pycache__/util.cpython-311.pyc",
        "stray.pyc",
        ".venv/lib/site.py",
        "venv/bin/python",
        ".ipynb_checkpoints/nb-checkpoint.ipynb",
        "node_modules/pkg/index.js",
    ):
        write(root, junk, "junk\n")
    store = add_store(root)
    paths = locate(root)
    assert not paths.in_git

    first = capture_code_version(paths, "run1")
    write(root, "train.py", "x = 2\n")
    second = capture_code_version(paths, "run2")
    write(root, "train.py", "x = 1\n")
    third = capture_code_version(paths, "run3")

    assert not (root / ".git").exists()
    assert first.git_dir == (store / "git").resolve()
    assert first.head_commit is None
    assert first.dirty
    assert snapshot_names(first) == {"train.py", "lib/util.py", "lib/a file é.txt"}
    assert read_file(second.git_dir, second.commit, "train.py") == b"x = 2\n"
    assert second.tree != first.tree
    assert third.tree == first.tree
    assert list_runs_refs(first.git_dir) == {
        "refs/retrolog/runs/run1": first.commit,
        "refs/retrolog/runs/run2": second.commit,
        "refs/retrolog/runs/run3": third.commit,
    }
    dest = tmp_path / "checkout"
    materialize(third.git_dir, third.commit, dest)
    assert files_under(dest) == {
        "train.py": b"x = 1\n",
        "lib/util.py": b"y = 2\n",
        "lib/a file é.txt": b"z\n",
    }


def test_same_tree_twice_gives_same_tree_sha(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "x = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    add_store(repo)
    paths = locate(repo)

    first = capture_code_version(paths, "run1")
    second = capture_code_version(paths, "run2")

    assert first.tree == second.tree == git(repo, "rev-parse", "HEAD^{tree}").strip()
    assert not first.dirty
    assert list_runs_refs(first.git_dir) == {
        "refs/retrolog/runs/run1": first.commit,
        "refs/retrolog/runs/run2": second.commit,
    }
    assert git(repo, "for-each-ref", "--format=%(refname)", "refs/retrolog/runs/").split() == [
        "refs/retrolog/runs/run1",
        "refs/retrolog/runs/run2",
    ]


def test_store_inside_root_is_never_captured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "x = 1\n")
    write(repo, "my store/committed.txt", "tracked by mistake\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    write(repo, "my store/retrolog.db", b"db")
    write(repo, "my store/objects/ab/cdef", b"chunk")
    write(repo, ".retrolog/stray.db", b"no .gitignore here")
    monkeypatch.setenv("RETROLOG_STORE", str(repo / "my store"))
    before = git_state(repo)

    version = capture_code_version(locate(repo), "run1")

    assert snapshot_names(version) == {"train.py", ".retrolog/stray.db"}
    assert git_state(repo) == before

    monkeypatch.delenv("RETROLOG_STORE")
    version = capture_code_version(locate(repo), "run2")
    assert snapshot_names(version) == {
        "train.py",
        "my store/committed.txt",
        "my store/retrolog.db",
        "my store/objects/ab/cdef",
    }


def test_a_store_the_users_gitignore_already_ignores(tmp_path: Path) -> None:
    # Users often list the store in their own .gitignore; naming an ignored path in
    # `git add`'s pathspecs (even to exclude it) fails, so capturing failed every run.
    repo = new_repo(tmp_path / "proj")
    write(repo, ".gitignore", ".retrolog/\ndata/\n")
    write(repo, "train.py", "x = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    write(repo, ".retrolog/retrolog.db", b"db")
    write(repo, "data/big.bin", b"data")
    before = git_state(repo)
    version = capture_code_version(locate(repo), "run1")
    assert snapshot_names(version) == {".gitignore", "train.py"}
    assert git_state(repo) == before


def test_nested_repository_is_left_out_with_a_warning(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "x = 1\n")
    new_repo(repo / "vendored")
    write(repo, "vendored/lib.py", "v = 1\n")

    with pytest.warns(RetrologWarning, match="vendored"):
        version = capture_code_version(locate(repo), "run1")

    assert snapshot_names(version) == {"train.py"}
    assert version.skipped == ()


def test_git_failures_become_version_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = new_repo(tmp_path / "proj")
    write(repo, "train.py", "x = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    paths = locate(repo)
    version = capture_code_version(paths, "run1")

    with pytest.raises(VersionError, match="ref name") as bad_ref:
        capture_code_version(paths, "bad..id")
    assert str(repo) in str(bad_ref.value)
    assert bad_ref.value.path == str(repo)
    with pytest.raises(VersionError, match=r"nope\.py"):
        read_file(version.git_dir, version.commit, "nope.py")
    with pytest.raises(VersionError):
        materialize(version.git_dir, "0" * 40, tmp_path / "out")

    (repo / ".git" / "index").write_bytes(b"not an index at all")
    with pytest.raises(VersionError, match="index"):
        capture_code_version(paths, "run2")

    with pytest.raises(VersionError, match="not a git repository"):
        capture_code_version(ProjectPaths(tmp_path / "home", tmp_path / "s", True), "run3")

    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(VersionError, match="git executable"):
        capture_code_version(paths, "run4")


NAME_CHARS = "abcXYZ019 -_()[]'*?!#éü日本語🎉"
names = st.text(alphabet=NAME_CHARS, min_size=1, max_size=10).filter(
    lambda name: not name.startswith(("#", "!")) and name.strip() == name
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    files=st.dictionaries(
        st.lists(names, min_size=1, max_size=3).map("/".join),
        st.binary(max_size=200),
        min_size=1,
        max_size=6,
    )
)
def test_round_trip_of_arbitrary_names_and_bytes(files: dict[str, bytes]) -> None:
    # A file and a directory cannot share a name: keep only paths that are not
    # a prefix directory of another.
    paths = sorted(files)
    files = {p: files[p] for p in paths if not any(q.startswith(p + "/") for q in paths)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "proj"
        new_repo(root)
        for rel, data in files.items():
            write(root, rel, data)
        version = capture_code_version(locate(root), "run1")
        dest = Path(tmp) / "out"
        materialize(version.git_dir, version.commit, dest)
        assert files_under(dest) == files
