"""Capture the exact code a run executes as a git commit on a private ref, and get it back.

At run start :func:`capture_code_version` snapshots the project's working tree
(tracked files as they are on disk, plus untracked files that are not ignored)
into a commit on ``refs/retrolog/runs/<run_id>``. The snapshot is built in a
temporary index, so the user's HEAD, index, branches, stash, config and
working tree are never touched; the only traces are new objects and the ref
(unlike FlorDB, which commits the user's edits and switches branches).
Outside a git repository the same happens in a private git directory inside
the store. :func:`materialize` and :func:`read_file` give a version back
without going near any work tree of the user's.

Captures are cheap because the temporary index is a copy of the real one:
git trusts its cached stat data and rehashes only files that changed. An
unchanged tree always gets the same tree sha, which gives content addressing
of code versions for free.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

from retrolog._config import lookup
from retrolog.errors import RetrologWarning, UsageError, VersionError
from retrolog.store.paths import ProjectPaths
from retrolog.versions._gitcmd import DEFAULT_HINT, git_env, run_git

REF_NAMESPACE = "refs/retrolog/"
RUNS_REF_PREFIX = REF_NAMESPACE + "runs/"
MAX_FILE_BYTES_ENV = "RETROLOG_MAX_FILE_BYTES"
DEFAULT_MAX_FILE_BYTES = 2 * 1024 * 1024

# Written to the private git directory's info/exclude: outside git there is no
# .gitignore to keep caches and environments out, so retrolog supplies the
# obvious ones (the project's own .gitignore files still apply on top).
PRIVATE_EXCLUDES = """\
# Written by retrolog: never part of a captured code version.
__pycache__/
*.pyc
.venv/
venv/
.ipynb_checkpoints/
node_modules/
.git/
"""

_SHA = re.compile(rb"[0-9a-f]{40,64}")
_WARN_LIST_LIMIT = 20


@dataclass(frozen=True)
class CodeVersion:
    """A run's code, captured as a commit on a private ref."""

    ref: str  # e.g. "refs/retrolog/runs/<run_id>"
    commit: str  # commit sha
    tree: str  # tree sha: equal trees mean equal code
    head_commit: str | None  # user's HEAD at capture; None with an unborn HEAD or outside git
    git_dir: Path  # the git directory holding the objects and the ref
    dirty: bool  # the captured tree differs from HEAD's (always True outside git or unborn)
    skipped: tuple[str, ...]  # paths relative to root left out for exceeding the size cap


@dataclass(frozen=True)
class _Workspace:
    """Where one capture builds its snapshot."""

    git_dir: Path  # common git directory: objects and refs go here
    env: dict[str, str]  # environment of every call that uses the temporary index
    index: Path  # the temporary index
    head_commit: str | None
    head_tree: str | None


@dataclass(frozen=True)
class _Selection:
    """What the working tree scan decided to leave out of the snapshot."""

    drop: tuple[bytes, ...]  # index entries to remove (big tracked files, tracked store files)
    exclude: tuple[str, ...]  # paths `git add` must not look at
    skipped: tuple[str, ...]  # files over the size cap
    nested: tuple[str, ...]  # untracked nested git repositories


def capture_code_version(
    paths: ProjectPaths,
    run_id: str,
    *,
    message: str = "",
    max_file_bytes: int | None = None,
    replace: Mapping[str, bytes] | None = None,
) -> CodeVersion:
    """Capture the project's working tree as a commit on ``refs/retrolog/runs/<run_id>``.

    message: extra text for the commit message (the run id is always in it).
    max_file_bytes: files larger than this are left out (and listed in one
        RetrologWarning); default: ``RETROLOG_MAX_FILE_BYTES``, else 2 MiB.
    replace: files (paths relative to root) the version holds with these contents
        instead of the working tree's (a notebook run's executed cells); the working
        tree is not touched.
    Returns the captured version. Raises VersionError when git fails.
    """
    cap = _size_cap(max_file_bytes)
    root = paths.root
    ref = RUNS_REF_PREFIX + run_id
    doing = f"capture the code version of run {run_id!r}"
    if paths.in_git:
        with tempfile.TemporaryDirectory(prefix="retrolog-index-") as tmp:
            work = _user_repo_workspace(root, Path(tmp), doing)
            version, nested = _capture(paths, work, ref, run_id, message, cap, doing, replace)
    else:
        git_dir = _ensure_private_repo(paths.private_git_dir, root)
        # The temporary index lives in the private git directory so it can be
        # renamed over the persistent index afterwards: the next capture then
        # starts with fresh stat data and rehashes only what changed.
        with tempfile.TemporaryDirectory(prefix="index-", dir=git_dir) as tmp:
            work = _private_workspace(git_dir, root, Path(tmp))
            version, nested = _capture(paths, work, ref, run_id, message, cap, doing, replace)
            if work.index.exists():
                os.replace(work.index, git_dir / "index")
    if version.skipped or nested:
        _warn_left_out(root, run_id, cap, version.skipped, nested)
    return version


def _capture(
    paths: ProjectPaths,
    work: _Workspace,
    ref: str,
    run_id: str,
    message: str,
    cap: int,
    doing: str,
    replace: Mapping[str, bytes] | None = None,
) -> tuple[CodeVersion, tuple[str, ...]]:
    """Build the snapshot in ``work``'s temporary index and commit it to ``ref``.

    Returns the version and the untracked nested repositories left out.
    """
    root = paths.root

    def git(*args: str, stdin: bytes | None = None, hint: str = DEFAULT_HINT) -> bytes:
        return run_git(
            args, cwd=root, env=work.env, subject=root, doing=doing, stdin=stdin, hint=hint
        )

    selection, tree = _stage(git, paths, cap, replace)

    commit_args = ["commit-tree", "--no-gpg-sign"]
    if work.head_commit is not None:
        commit_args += ["-p", work.head_commit]
    commit_args.append(tree)
    body = _commit_message(run_id, message, cap, selection.skipped)
    # surrogateescape: a path in the message that is not UTF-8 (a left-out file's, which
    # Python decoded with lone surrogates) goes in as the bytes it was.
    commit = _sha(git(*commit_args, stdin=body.encode("utf-8", "surrogateescape")))
    git(
        "update-ref",
        "-m",
        f"retrolog: run {run_id}",
        ref,
        commit,
        hint="The run id must be usable in a git ref name (no spaces, '..', '~', '^', ':').",
    )
    version = CodeVersion(
        ref=ref,
        commit=commit,
        tree=tree,
        head_commit=work.head_commit,
        git_dir=work.git_dir,
        dirty=work.head_tree is None or work.head_tree != tree,
        skipped=selection.skipped,
    )
    return version, selection.nested


def _stage(
    git: Callable[..., bytes],
    paths: ProjectPaths,
    cap: int,
    replace: Mapping[str, bytes] | None,
) -> tuple[_Selection, str]:
    """The working tree staged in the temporary index (the store, files over ``cap`` and
    untracked nested repositories left out; ``replace``'s files instead of the tree's):
    what was selected, and the tree written."""
    root = paths.root
    store_rel = _relative_inside(paths.store, root)
    listing = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    if store_rel is not None:
        # Prunes the walk for untracked files; tracked ones under the store are
        # still listed so they can be dropped from the snapshot below.
        listing.append(f"--exclude=/{_escape_ignore_pattern(store_rel)}/")
    selection = _select(git(*listing), root, store_rel, cap)

    if selection.drop:
        git("update-index", "-z", "--force-remove", "--stdin", stdin=b"\0".join(selection.drop))
    excluded = list(selection.exclude)
    if store_rel is not None and git(
        "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory", "--",
        store_rel,
    ):  # fmt: skip
        # The user's .gitignore already leaves the store out; naming an ignored path in a
        # pathspec, even to exclude it, makes `git add` fail.
        excluded.remove(store_rel)
    pathspecs = [b"."] + [b":(exclude,literal)" + os.fsencode(path) for path in excluded]
    git(
        "add",
        "--all",
        "--pathspec-from-file=-",
        "--pathspec-file-nul",
        stdin=b"\0".join(pathspecs),
        hint=(
            "A file git cannot read (permissions, a vanished file) stops the capture; fix it "
            "or list it in .gitignore and try again."
        ),
    )
    for path, content in (replace or {}).items():
        blob = _sha(git("hash-object", "-w", "--stdin", stdin=content))
        # No stat data: the next capture sharing this index rehashes the working tree's file.
        git("update-index", "--add", "--cacheinfo", f"100644,{blob},{path}")
    return selection, _sha(git("write-tree"))


def materialize(git_dir: Path, commit: str, dest: Path) -> None:
    """Write the files of ``commit`` into ``dest``, a new or empty directory.

    Uses a throwaway index, so no work tree, index or HEAD of the user's is
    touched; file modes and symlinks come back as captured.
    """
    git_dir = Path(git_dir).resolve()
    dest = Path(dest)
    doing = f"check out code version {commit} into {dest}"
    _check_revision(commit, git_dir, doing)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise VersionError(
            f"Could not {doing}: {dest} exists and is not an empty directory. "
            "Pass a new or empty directory, so that no existing file is overwritten.",
            path=str(dest),
        )
    _check_git_dir(git_dir, doing)
    dest.mkdir(parents=True, exist_ok=True)
    dest = dest.resolve()
    with tempfile.TemporaryDirectory(prefix="retrolog-index-") as tmp:
        env = git_env(git_dir=git_dir, work_tree=dest, index_file=Path(tmp) / "index", isolate=True)
        for args in (["read-tree", commit], ["checkout-index", "--all", "--force"]):
            run_git(
                args,
                cwd=dest,
                env=env,
                subject=git_dir,
                doing=doing,
                hint="Check that the commit is a captured code version of this project "
                "(list_runs_refs shows them) and that the repository is intact (`git fsck`).",
            )


def read_file(git_dir: Path, commit: str, relpath: str) -> bytes:
    """The bytes of ``relpath`` (relative to the project root) in ``commit``, as git stores them."""
    git_dir = Path(git_dir).resolve()
    path = PurePath(relpath).as_posix()
    doing = f"read {path} from code version {commit}"
    _check_revision(commit, git_dir, doing)
    _check_git_dir(git_dir, doing)
    return run_git(
        ["cat-file", "blob", f"{commit}:{path}"],
        cwd=git_dir,
        env=git_env(git_dir=git_dir, isolate=True),
        subject=git_dir,
        doing=doing,
        hint="Check that the path is a file of that run's code (paths are relative to the "
        "project root) and that the commit exists.",
    )


def list_files(git_dir: Path, commit: str) -> list[str]:
    """The paths (relative to the project root) of every file in ``commit``, sorted."""
    git_dir = Path(git_dir).resolve()
    doing = f"list the files of code version {commit}"
    _check_revision(commit, git_dir, doing)
    _check_git_dir(git_dir, doing)
    out = run_git(
        ["ls-tree", "-r", "-z", "--name-only", commit],
        cwd=git_dir,
        env=git_env(git_dir=git_dir, isolate=True),
        subject=git_dir,
        doing=doing,
    )
    return sorted(p.decode(errors="surrogateescape") for p in out.split(b"\0") if p)


def diff_versions(git_dir: Path, old: str, new: str, paths: Sequence[str] = ()) -> str:
    """The unified diff from code version ``old`` to ``new`` (limited to ``paths`` if given).

    Each version is the exact tree a run executed, uncommitted edits included. Without
    ``paths``, a notebook run's saved notebook (its JSON, beside the cells that ran at the
    notebook's path) is left out: the cells show the change as code.
    """
    from retrolog.versions.notebook import NOTEBOOK_SUFFIX, SAVED_SUFFIX

    paths = paths or [f":(exclude,glob)**/*{NOTEBOOK_SUFFIX}{SAVED_SUFFIX}"]
    git_dir = Path(git_dir).resolve()
    doing = f"compare code versions {old} and {new}"
    for commit in (old, new):
        _check_revision(commit, git_dir, doing)
    _check_git_dir(git_dir, doing)
    out = run_git(
        ["diff", "--no-color", "--no-ext-diff", "--no-textconv", old, new, "--", *paths],
        cwd=git_dir,
        env=git_env(git_dir=git_dir, isolate=True),
        subject=git_dir,
        doing=doing,
    )
    return out.decode(errors="replace")


def list_runs_refs(git_dir: Path) -> dict[str, str]:
    """Every ref under ``refs/retrolog/`` in ``git_dir``, mapped to its commit.

    A git directory that does not exist yet holds no refs.
    """
    git_dir = Path(git_dir).resolve()
    if not git_dir.is_dir():
        return {}
    out = run_git(
        ["for-each-ref", "--format=%(objectname) %(refname)", REF_NAMESPACE],
        cwd=git_dir,
        env=git_env(git_dir=git_dir, isolate=True),
        subject=git_dir,
        doing="list retrolog's code versions",
    )
    refs: dict[str, str] = {}
    for line in out.decode("utf-8", errors="surrogateescape").splitlines():
        sha, _, ref = line.partition(" ")
        refs[ref] = sha
    return refs


def _user_repo_workspace(root: Path, tmp: Path, doing: str) -> _Workspace:
    """Prepare a capture inside the user's repository: a copy of the real index in ``tmp``."""
    # One call for everything: with --revs-only an unborn HEAD is left out of
    # the output instead of being an error.
    located = run_git(
        [
            "rev-parse",
            "--git-common-dir",
            "--git-path",
            "index",
            "--revs-only",
            "HEAD^{commit}",
            "HEAD^{tree}",
        ],
        cwd=root,
        env=git_env(),
        subject=root,
        doing=doing,
    )
    lines = os.fsdecode(located).splitlines()
    common_dir, real_index = lines[0], lines[1]
    head_commit, head_tree = (lines[2], lines[3]) if len(lines) >= 4 else (None, None)
    index = tmp / "index"
    # Copying (with its mtime, which git's racy-file check compares against)
    # lets git reuse the stat data of unchanged files instead of rehashing them.
    real = root / real_index
    if real.is_file():
        shutil.copy2(real, index)
    return _Workspace(
        git_dir=(root / common_dir).resolve(),
        env=git_env(index_file=index),
        index=index,
        head_commit=head_commit,
        head_tree=head_tree,
    )


def _ensure_private_repo(git_dir: Path, root: Path) -> Path:
    """Create retrolog's own git directory for a project outside git, once."""
    git_dir = git_dir.resolve()
    if not (git_dir / "HEAD").is_file():
        git_dir.mkdir(parents=True, exist_ok=True)
        # No templates: a user's init.templateDir could bring hooks along.
        run_git(
            ["init", "--bare", "--quiet", "--template=", str(git_dir)],
            cwd=git_dir,
            env=git_env(isolate=True),
            subject=root,
            doing=f"create retrolog's private git directory {git_dir}",
        )
    exclude = git_dir / "info" / "exclude"
    if not exclude.is_file() or exclude.read_text(encoding="utf-8") != PRIVATE_EXCLUDES:
        exclude.parent.mkdir(exist_ok=True)
        partial = exclude.with_name(f"exclude.{os.getpid()}.tmp")
        partial.write_text(PRIVATE_EXCLUDES, encoding="utf-8")
        os.replace(partial, exclude)
    return git_dir


def _private_workspace(git_dir: Path, root: Path, tmp: Path) -> _Workspace:
    """Prepare a capture in the private git directory, with ``root`` as its work tree."""
    index = tmp / "index"
    persistent = git_dir / "index"
    if persistent.is_file():
        shutil.copy2(persistent, index)
    env = git_env(git_dir=git_dir, work_tree=root, index_file=index, isolate=True)
    return _Workspace(git_dir=git_dir, env=env, index=index, head_commit=None, head_tree=None)


def _select(listing: bytes, root: Path, store_rel: str | None, cap: int) -> _Selection:
    """Decide, from ``git ls-files`` output, what the snapshot leaves out."""
    drop: list[bytes] = []
    exclude: list[str] = []
    skipped: list[str] = []
    nested: list[str] = []
    if store_rel is not None:
        exclude.append(store_rel)
    seen: set[bytes] = set()
    for raw in listing.split(b"\0"):
        if not raw or raw in seen:  # unmerged paths are listed once per stage
            continue
        seen.add(raw)
        rel = os.fsdecode(raw)
        if store_rel is not None and (rel == store_rel or rel.startswith(store_rel + "/")):
            drop.append(raw)
            continue
        if rel.endswith("/"):
            # An untracked git repository inside the project: `git add` would
            # record only its HEAD as a gitlink (and fail if it has none), and
            # its files could never be checked out for a replay.
            nested.append(rel[:-1])
            exclude.append(rel)
            continue
        try:
            info = os.lstat(root / rel)
        except OSError:  # a tracked file deleted on disk: `git add --all` drops it
            continue
        if stat.S_ISREG(info.st_mode) and info.st_size > cap:
            skipped.append(rel)
            drop.append(raw)
            exclude.append(rel)
    return _Selection(
        drop=tuple(drop),
        exclude=tuple(exclude),
        skipped=tuple(sorted(skipped)),
        nested=tuple(sorted(nested)),
    )


def _size_cap(max_file_bytes: int | None) -> int:
    """The size cap: the argument, else RETROLOG_MAX_FILE_BYTES, else 2 MiB."""
    if max_file_bytes is not None:
        if isinstance(max_file_bytes, bool) or max_file_bytes < 0:
            raise UsageError(
                f"max_file_bytes must be a number of bytes >= 0, not {max_file_bytes!r}."
            )
        return max_file_bytes
    raw = (lookup(MAX_FILE_BYTES_ENV) or "").strip()
    if not raw:
        return DEFAULT_MAX_FILE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(
            f"{MAX_FILE_BYTES_ENV}={raw!r} is not a number of bytes; set it to a whole number "
            f"such as 10485760 (10 MiB), or unset it for the default of "
            f"{DEFAULT_MAX_FILE_BYTES} bytes."
        )
    return value


def _relative_inside(path: Path, root: Path) -> str | None:
    """``path`` relative to ``root`` in git's notation, or None when it is not below root."""
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        return None
    text = rel.as_posix()
    return None if text == "." else text


def _escape_ignore_pattern(path: str) -> str:
    """``path`` as a gitignore pattern that matches only itself."""
    return re.sub(r"([\\*?\[\] !#])", r"\\\1", path)


def _sha(out: bytes) -> str:
    """The object name git printed."""
    found = _SHA.match(out.strip())
    if found is None:
        raise VersionError(f"git printed {out[:200]!r} where an object name was expected.")
    return found.group().decode("ascii")


def _commit_message(run_id: str, message: str, cap: int, skipped: Sequence[str]) -> str:
    """The commit message of a captured version."""
    lines = [f"retrolog: code of run {run_id}"]
    if message.strip():
        lines += ["", message.strip()]
    if skipped:
        lines += ["", f"Left out (larger than {cap} bytes):", *(f"  {p}" for p in skipped)]
    return "\n".join(lines) + "\n"


def _listing(paths: Sequence[str]) -> str:
    """A readable, bounded list of paths for a message."""
    shown = ", ".join(paths[:_WARN_LIST_LIMIT])
    more = len(paths) - _WARN_LIST_LIMIT
    return f"{shown} and {more} more" if more > 0 else shown


def _warn_left_out(
    root: Path, run_id: str, cap: int, skipped: Sequence[str], nested: Sequence[str]
) -> None:
    """Warn once about everything a capture left out."""
    parts = []
    if skipped:
        parts.append(f"{len(skipped)} file(s) larger than {cap} bytes ({_listing(skipped)})")
    if nested:
        parts.append(
            f"{len(nested)} nested git repositor{'y' if len(nested) == 1 else 'ies'}, "
            f"whose files git cannot snapshot ({_listing(nested)})"
        )
    fixes = "List them in .gitignore to keep them out quietly"
    if skipped:
        fixes += f", or raise the size cap with {MAX_FILE_BYTES_ENV}=<bytes>"
    warnings.warn(
        f"retrolog left {'; and '.join(parts)} out of the code version of run {run_id!r} "
        f"in {root}, so replays of this run will not have them. {fixes}.",
        RetrologWarning,
        stacklevel=3,
    )


def _check_revision(commit: str, git_dir: Path, doing: str) -> None:
    """Refuse a revision git would read as an option."""
    if not commit or commit.startswith("-"):
        raise VersionError(
            f"Could not {doing} in {git_dir}: {commit!r} is not a commit. "
            "Pass the commit sha of a captured code version.",
            path=str(git_dir),
        )


def _check_git_dir(git_dir: Path, doing: str) -> None:
    """Fail with a clear message when the git directory is gone."""
    if not git_dir.is_dir():
        raise VersionError(
            f"Could not {doing}: the git directory {git_dir} does not exist. Code versions "
            "live in the project's git directory (or .retrolog/git outside git); check "
            "that the project or its store was not moved or deleted.",
            path=str(git_dir),
        )
