"""Code versions a team can replay anywhere: a run's code kept in the run's object store.

A run's code version is a commit on a private ref of the recording clone
(``versions/git.py``). Another clone, or a worker with no clone at all, cannot
read that ref, so each run's code is also kept with its data (docs/code-versions.md):

- **Export** (record time, :func:`export_code`): each file's bytes as one raw
  object in the run's object store (content-addressed, so a file that does not
  change is stored once across runs), plus a JSON *code manifest* object
  listing ``path, mode, git blob id, object key`` and the tree id. The run's
  ``runs.code_manifest`` names the manifest. A small memo in the store
  (:func:`recent_exports`) lets a run whose tree was exported before reuse its
  manifest with no git call at all, and a run whose tree changed read and store
  only the files that changed.
- **Resolution** (read time, :func:`readable_version`): the git directory a
  run's code can be read from: the recorded one if it still has the commit; the
  store's private git directory; the current project's (a clone that fetched
  ``refs/retrolog/``); else the store's own cache repository (``<store>/code.git``),
  into which the manifest's files are imported and whose tree must come out
  equal to the recorded ``code_tree``: a mismatch is an error, never a replay of
  other code.

A manifest is data: it is JSON, its paths are checked (relative, no ``..``, no
``.git``), its modes come from a fixed set, its objects are verified against
their keys and their git blob ids, and nothing in it is executed.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from retrolog.errors import RetrologError, StoreError, VersionError
from retrolog.store.objects import ObjectStore, check_key
from retrolog.versions._gitcmd import SAFE_CONFIG, git_env, run_git

MANIFEST_FORMAT = "retrolog-code/1"
# Regular file, executable file, symbolic link, and a submodule's commit (a gitlink,
# whose files are not part of the version: there is no object for it).
MODES = frozenset({"100644", "100755", "120000", "160000"})
GITLINK = "160000"
CACHE_DIRNAME = "code.git"  # in the store: the code versions imported from manifests
TREES_REF_PREFIX = "refs/retrolog/trees/"
MEMO_FILE = Path("cache") / "code-exports.json"  # in the store
_MEMO_PER_LOCATION = 16
_MAX_FILES = 1_000_000
_MAX_PATH = 4096
_HEX = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@dataclass(frozen=True)
class CodeFile:
    """One file of a code version, as its manifest lists it."""

    path: str  # relative to the project root, "/"-separated
    mode: str  # one of MODES
    blob: str  # the git object id (a commit id for a gitlink)
    key: str | None  # the object key of its bytes; None for a gitlink


@dataclass(frozen=True)
class CodeManifest:
    """A code version's files: what :func:`export_code` stores and the import reads."""

    tree: str
    files: tuple[CodeFile, ...]

    def to_bytes(self) -> bytes:
        """The manifest as stored: compact JSON, the same bytes for the same tree."""
        doc = {
            "format": MANIFEST_FORMAT,
            "tree": self.tree,
            "files": [[f.path, f.mode, f.blob, f.key] for f in self.files],
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8")

    def object_keys(self) -> set[str]:
        """The keys of the objects holding its files' bytes."""
        return {f.key for f in self.files if f.key is not None}

    @classmethod
    def parse(cls, data: bytes, *, key: str) -> CodeManifest:
        """Read and check a stored manifest; StoreError says what is wrong with it."""

        def bad(problem: str) -> StoreError:
            return StoreError(
                f"The code manifest {key} in the object store is not valid: {problem}. It was "
                "not used, and nothing was written from it. The store was damaged or edited; "
                "replay the run from a clone that still has its ref "
                "(refs/retrolog/runs/<run>), or restore the store from a copy."
            )

        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise bad(f"it is not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise bad(f"it is not a {MANIFEST_FORMAT} manifest")
        tree = doc.get("tree")
        if not isinstance(tree, str) or not _HEX.fullmatch(tree):
            raise bad("its tree id is not a git object id")
        entries = doc.get("files")
        if not isinstance(entries, list) or len(entries) > _MAX_FILES:
            raise bad("its file list is missing or too long")
        files: list[CodeFile] = []
        seen: set[str] = set()
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 4:
                raise bad(f"the entry {str(entry)[:80]!r} is not [path, mode, blob, key]")
            path, mode, blob, obj = entry
            problem = path_problem(path)
            if problem is not None:
                raise bad(f"the path {str(path)[:200]!r} {problem}")
            if mode not in MODES:
                raise bad(f"{path!r} has mode {str(mode)[:20]!r}, not one of {sorted(MODES)}")
            if not isinstance(blob, str) or not _HEX.fullmatch(blob) or len(blob) != len(tree):
                raise bad(f"{path!r} has no valid git object id")
            if mode == GITLINK:
                if obj is not None:
                    raise bad(f"the submodule {path!r} names an object")
            else:
                try:
                    check_key(obj)
                except StoreError:
                    raise bad(f"{path!r} has no valid object key") from None
            if path in seen:
                raise bad(f"{path!r} is listed twice")
            seen.add(path)
            files.append(CodeFile(path, mode, blob, obj))
        for f in files:
            parent = f.path.rpartition("/")[0]
            while parent:
                if parent in seen:
                    raise bad(f"{parent!r} is listed both as a file and as a directory")
                parent = parent.rpartition("/")[0]
        return cls(tree, tuple(files))


def path_problem(path: object) -> str | None:
    """Why ``path`` cannot be a file of a code version (None when it can).

    Relative, "/"-separated, no empty, ``.`` or ``..`` component, no ``.git``
    component (in any case: case-insensitive file systems), no NUL.
    """
    if not isinstance(path, str) or not path:
        return "is not a non-empty string"
    if len(path) > _MAX_PATH or "\0" in path:
        return "is too long or holds a NUL character"
    if path.startswith("/"):
        return "is absolute"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' component"
        if part.rstrip(". ").casefold() == ".git":
            return "has a '.git' component"
    return None


def git_blob_id(data: bytes, length: int) -> str:
    """The git blob id of ``data``, in a repository whose ids have ``length`` hex digits."""
    digest = hashlib.sha1 if length == 40 else hashlib.sha256  # git's object ids
    h = digest(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


# -- export (record time) -----------------------------------------------------------------


def export_code(
    git_dir: Path,
    commit: str,
    store: ObjectStore,
    *,
    known: Mapping[str, str] | None = None,
) -> tuple[str, CodeManifest]:
    """Store the files of ``commit`` (in ``git_dir``) and their manifest; (manifest key, it).

    known: git blob id -> object key of files stored before by an export whose
        manifest a run of this store references (so they are live): not read again.
    """
    git_dir = Path(git_dir)
    env = git_env(git_dir=git_dir, isolate=True)
    doing = f"copy code version {commit} into the object store"
    tree = run_git(
        ["rev-parse", "--verify", "--end-of-options", f"{commit}^{{tree}}"],
        cwd=git_dir, env=env, subject=git_dir, doing=doing,
    ).decode().strip()  # fmt: skip
    listing = run_git(
        ["ls-tree", "-r", "-z", "--full-tree", commit],
        cwd=git_dir, env=env, subject=git_dir, doing=doing,
    )  # fmt: skip
    entries: list[tuple[str, str, str]] = []  # (path, mode, id)
    for raw in listing.split(b"\0"):
        if not raw:
            continue
        meta, _, name = raw.partition(b"\t")
        mode, _kind, blob = meta.decode("ascii").split(" ")
        entries.append((os.fsdecode(name), mode, blob))
    known = dict(known or {})
    wanted = sorted({blob for _, mode, blob in entries if mode != GITLINK and blob not in known})
    # Several puts at once where the store is remote: a first copy is one request or
    # two per file, and a round trip each, one after another, is most of its time.
    contents = (data for _, data in _cat_blobs(git_dir, env, wanted, doing))
    with contextlib.closing(store.put_all(contents)) as keys:
        for blob, key in zip(wanted, keys, strict=True):
            known[blob] = key
    files = tuple(
        CodeFile(path, mode, blob, None if mode == GITLINK else known[blob])
        for path, mode, blob in entries
    )
    manifest = CodeManifest(tree, files)
    key = store.put(manifest.to_bytes())
    store.sync()
    return key, manifest


def _cat_blobs(
    git_dir: Path, env: Mapping[str, str], blobs: Sequence[str], doing: str
) -> Iterator[tuple[str, bytes]]:
    """Each blob's bytes, streamed from one ``git cat-file --batch``."""
    if not blobs:
        return
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            ["git", *SAFE_CONFIG, "cat-file", "--batch"],
            cwd=git_dir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        feeder = threading.Thread(target=_feed, args=(proc.stdin, blobs), daemon=True)
        feeder.start()
        try:
            for blob in blobs:
                header = proc.stdout.readline().split()
                if len(header) != 3 or header[1] != b"blob":
                    raise VersionError(
                        f"Could not {doing} in {git_dir}: git has no blob {blob} "
                        f"({b' '.join(header).decode(errors='replace')}). Check the repository "
                        "with `git fsck`.",
                        path=str(git_dir),
                    )
                data = proc.stdout.read(int(header[2]))
                proc.stdout.read(1)  # the newline after each object
                yield blob, data
        finally:
            proc.stdout.close()
            if proc.poll() is None:  # stopped early: an error, or the caller's
                proc.kill()
            proc.wait()
            feeder.join()


def _feed(pipe: IO[bytes], blobs: Sequence[str]) -> None:
    with contextlib.suppress(OSError):
        pipe.write("".join(f"{b}\n" for b in blobs).encode("ascii"))
    with contextlib.suppress(OSError):
        pipe.close()


# -- the memo of recent exports ------------------------------------------------------------


def recent_exports(store_dir: Path, location: str) -> list[tuple[str, str]]:
    """(tree, manifest key) of the latest exports to the objects at ``location``, newest first.

    A hint only: an entry is used once a run row of the store is found to reference
    its manifest (then the manifest and its objects are live for gc).
    """
    try:
        doc = json.loads((store_dir / MEMO_FILE).read_bytes())
        pairs = doc["locations"][location]
        return [(str(t), str(k)) for t, k in pairs if _HEX.fullmatch(t) and _HEX.fullmatch(k)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def remember_export(store_dir: Path, location: str, tree: str, key: str) -> None:
    """Put (tree, key) first in the memo of ``location``; a failure to write is ignored."""
    path = store_dir / MEMO_FILE
    try:
        try:
            doc = json.loads(path.read_bytes())
            locations = doc["locations"]
            assert isinstance(locations, dict)
        except (OSError, ValueError, KeyError, AssertionError, TypeError):
            locations = {}
        pairs = [[tree, key]] + [
            p for p in locations.get(location, []) if isinstance(p, list) and p[0] != tree
        ]
        locations[location] = pairs[:_MEMO_PER_LOCATION]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        partial.write_text(json.dumps({"locations": locations}), encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        return


def referenced_manifests(conn: sqlite3.Connection, keys: Iterable[str]) -> set[str]:
    """Those of ``keys`` that a run of the store references as its code manifest."""
    wanted = sorted(set(keys))
    if not wanted:
        return set()
    marks = ", ".join("?" for _ in wanted)
    rows = conn.execute(
        f"SELECT DISTINCT code_manifest FROM runs WHERE code_manifest IN ({marks})", wanted
    )
    return {r[0] for r in rows}


def load_manifest(store: ObjectStore, key: str) -> CodeManifest:
    """The code manifest stored under ``key``, read, verified and checked."""
    check_key(key)
    return CodeManifest.parse(store.get(key), key=key)


# -- resolution (read time) ----------------------------------------------------------------


@dataclass(frozen=True)
class ReadableVersion:
    """Where a run's code version can be read: a git directory and a revision in it."""

    git_dir: Path
    rev: str  # the run's commit, or its tree in the store's cache repository
    source: str  # "recorded", "store", "project" or "store copy"


_RESOLVED: dict[tuple[Any, ...], ReadableVersion] = {}
_RESOLVED_LOCK = threading.Lock()
_PRIVATE_CACHES: dict[str, Path] = {}


def readable_version(
    run: Mapping[str, Any],
    *,
    store_dir: Path | None,
    root: Path | None = None,
    objects: ObjectStore | None = None,
    from_store: bool = False,
) -> ReadableVersion:
    """Where the code of ``run`` (a ``runs`` row: run_id, git_dir, code_commit,
    code_tree, code_manifest) can be read, importing it from the store if need be.

    Tried in order: the recorded git directory; the store's private one
    (``<store>/git``, projects outside git); the git directory of the project at
    ``root`` (default: the current directory's), a clone that fetched the ref;
    the store's cache repository; the run's code manifest, imported into it.
    from_store: go straight to the store's copy (two runs compared side by side).
    Raises VersionError when no place has it, StoreError when the store's copy is
    damaged (its tree does not come out as recorded).
    """
    run_id = str(run.get("run_id") or "?")
    commit = run.get("code_commit") or ""
    tree = run.get("code_tree") or ""
    manifest = run.get("code_manifest")
    recorded = run.get("git_dir")
    if not commit or not _HEX.fullmatch(commit):
        raise VersionError(
            f"Run {run_id} has no code version (it was recorded before code versions were "
            "kept, or its capture failed)."
        )
    memo_key = (run_id, commit, tree, manifest, recorded, str(store_dir), str(root), from_store)
    with _RESOLVED_LOCK:
        found = _RESOLVED.get(memo_key)
    if found is not None and found.git_dir.is_dir():
        return found
    found = _resolve(run_id, commit, tree, manifest, recorded, store_dir, root, objects, from_store)
    with _RESOLVED_LOCK:
        _RESOLVED[memo_key] = found
    return found


def _resolve(
    run_id: str,
    commit: str,
    tree: str,
    manifest: str | None,
    recorded: str | None,
    store_dir: Path | None,
    root: Path | None,
    objects: ObjectStore | None,
    from_store: bool,
) -> ReadableVersion:
    tried: list[str] = []
    if not from_store:
        candidates: list[tuple[Path, str]] = []
        if recorded:
            candidates.append((Path(recorded), "recorded"))
        if store_dir is not None:
            candidates.append((store_dir / "git", "store"))
        project = _project_git_dir(root)
        if project is not None:
            candidates.append((project, "project"))
        seen: set[Path] = set()
        for git_dir, source in candidates:
            resolved = git_dir.resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            if _has_object(resolved, f"{commit}^{{commit}}"):
                return ReadableVersion(resolved, commit, source)
            tried.append(str(git_dir) + ("" if git_dir.is_dir() else " (gone)"))
    if store_dir is not None and tree and _HEX.fullmatch(tree):
        cache = _cache_dir(store_dir, len(tree))
        if cache is not None and _has_ref(cache, TREES_REF_PREFIX + tree):
            return ReadableVersion(cache, tree, "store copy")
        if manifest:
            if objects is None:
                from retrolog.store.backends import object_store_for

                objects = object_store_for(store_dir)
            cache = _ensure_cache(store_dir, len(tree))
            import_manifest(cache, load_manifest(objects, manifest), objects, tree=tree,
                            run_id=run_id, manifest_key=manifest)  # fmt: skip
            return ReadableVersion(cache, tree, "store copy")
    where = f"it is not in {'; '.join(tried)}, and " if tried else ""
    raise VersionError(
        f"The code version of run {run_id} (commit {commit[:12]}) cannot be found: {where}"
        "the store holds no copy of it (the run was recorded before "
        "retrolog kept code in the store, or ended before its copy was written). Replay it "
        "from the clone that recorded it, or fetch its ref into this one: "
        f"git fetch <that clone> 'refs/retrolog/*:refs/retrolog/*'.",
        path=str(recorded) if recorded else None,
    )


def _project_git_dir(root: Path | None) -> Path | None:
    """The common git directory of the work tree at ``root`` (or the cwd), if any."""
    where = Path(root) if root is not None else Path.cwd()
    try:
        out = subprocess.run(
            ["git", *SAFE_CONFIG, "rev-parse", "--git-common-dir"],
            cwd=where, env=git_env(), capture_output=True, check=False,
        )  # fmt: skip
    except OSError:
        return None
    text = os.fsdecode(out.stdout.strip())
    if out.returncode != 0 or not text:
        return None
    return (where / text).resolve()


def _git(git_dir: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["git", *SAFE_CONFIG, *args],
        cwd=git_dir, env=git_env(git_dir=git_dir, isolate=True), capture_output=True,
        check=False,
    )  # fmt: skip


def _has_object(git_dir: Path, spec: str) -> bool:
    if not (git_dir / "objects").is_dir():
        return False
    try:
        return _git(git_dir, "cat-file", "-e", spec).returncode == 0
    except OSError:
        return False


def _has_ref(git_dir: Path, ref: str) -> bool:
    try:
        return _git(git_dir, "rev-parse", "-q", "--verify", ref).returncode == 0
    except OSError:
        return False


def _cache_dir(store_dir: Path, length: int) -> Path | None:
    """The cache repository for ids of ``length`` digits, if it exists."""
    name = CACHE_DIRNAME if length == 40 else "code-sha256.git"
    for place in (store_dir / name, _PRIVATE_CACHES.get(str(store_dir / name))):
        if place is not None and (place / "HEAD").is_file():
            return place
    return None


def cache_repository(store_dir: Path, length: int) -> Path:
    """The store's cache repository for object ids of ``length`` hex digits (40: sha1,
    64: sha256), created on first use (a private temporary one when the store cannot be
    written: a read-only store stays unchanged)."""
    return _ensure_cache(store_dir, length)


# The scripts replays ran (``logs.code_object``), each kept by a ref of its own: a blob
# no ref reaches is what ``git gc`` prunes.
SCRIPTS_REF_PREFIX = "refs/retrolog/replayed/"


def keep_script(store_dir: Path, length: int, source: str) -> str:
    """Keep a replayed script in the store's cache repository; its blob id.

    The blob is what a backfilled value's ``code_object`` names, so a ref keeps it
    through any garbage collection of that repository. Raises VersionError when git
    cannot write it.
    """
    git_dir = cache_repository(store_dir, length)
    env = git_env(isolate=True)
    doing = "keep the replayed script in the store's code cache repository"
    blob = run_git(
        ["--git-dir", str(git_dir), "hash-object", "-w", "--stdin"],
        cwd=git_dir, env=env, subject=git_dir, doing=doing, stdin=source.encode(),
    ).decode().strip()  # fmt: skip
    run_git(
        ["--git-dir", str(git_dir), "update-ref", SCRIPTS_REF_PREFIX + blob, blob],
        cwd=git_dir, env=env, subject=git_dir, doing=doing,
    )  # fmt: skip
    return blob


def _ensure_cache(store_dir: Path, length: int) -> Path:
    found = _cache_dir(store_dir, length)
    if found is not None:
        return found
    name = CACHE_DIRNAME if length == 40 else "code-sha256.git"
    target = store_dir / name
    if os.access(store_dir, os.W_OK):
        parent = store_dir
    else:
        parent = Path(tempfile.mkdtemp(prefix="retrolog-code-"))
        atexit.register(shutil.rmtree, parent, True)
        target = parent / name
        _PRIVATE_CACHES[str(store_dir / name)] = target
    building = parent / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fmt = "sha1" if length == 40 else "sha256"
    try:
        # No templates: a user's init.templateDir could bring hooks along.
        run_git(
            ["init", "--bare", "--quiet", "--template=", f"--object-format={fmt}", str(building)],
            cwd=parent, env=git_env(isolate=True), subject=parent,
            doing="create the store's code cache repository",
        )  # fmt: skip
        try:
            os.rename(building, target)
        except OSError:
            if not (target / "HEAD").is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target


def import_manifest(
    cache: Path,
    manifest: CodeManifest,
    objects: ObjectStore,
    *,
    tree: str,
    run_id: str,
    manifest_key: str,
) -> None:
    """Write ``manifest``'s files into the cache repository and check the tree is ``tree``.

    One ``git fast-import`` writes the blobs and a commit of their tree on a
    temporary ref; only when its tree is the recorded one does it become
    ``refs/retrolog/trees/<tree>``. Anything else is a StoreError.
    """

    def damaged(problem: str) -> StoreError:
        return StoreError(
            f"The store's copy of the code of run {run_id} (manifest {manifest_key}) does not "
            f"match what the run recorded: {problem}. It was not used. The store was damaged "
            "or edited; replay the run from a clone that still has its ref "
            f"refs/retrolog/runs/{run_id}, or restore the store from a copy."
        )

    if manifest.tree != tree:
        raise damaged(f"it describes tree {manifest.tree}, the run recorded tree {tree}")
    blobs = sorted({f.blob: f.key for f in manifest.files if f.key is not None}.items())
    present = _present(cache, [b for b, _ in blobs])
    temp_ref = f"refs/retrolog/import/{os.getpid()}-{secrets.token_hex(6)}"
    doing = f"import the code of run {run_id} from the object store"
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            ["git", *SAFE_CONFIG, "fast-import", "--quiet", "--done"],
            cwd=cache, env=git_env(git_dir=cache, isolate=True), stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=errors,
        )  # fmt: skip
        assert proc.stdin is not None
        try:
            with contextlib.suppress(BrokenPipeError):
                _write_import(
                    proc.stdin, manifest, objects, blobs, present, tree, temp_ref, damaged
                )
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if code != 0:
            errors.seek(0)
            said = " ".join(errors.read().decode("utf-8", errors="replace").split())[:500]
            raise damaged(f"git fast-import refused it ({said or 'no message'})")
    _publish_tree(cache, temp_ref, tree, damaged, doing)


def _write_import(
    stdin: IO[bytes],
    manifest: CodeManifest,
    objects: ObjectStore,
    blobs: list[tuple[str, str]],
    present: set[str],
    tree: str,
    temp_ref: str,
    damaged: Callable[[str], StoreError],
) -> None:
    """The fast-import stream: each blob the cache lacks, read from ``objects`` and checked
    against its recorded id, then a commit of the manifest's tree on ``temp_ref``."""
    marks: dict[str, int] = {}
    wanted = [(blob, key) for blob, key in blobs if blob not in present]
    # Several reads at once where the store is remote (a round trip each).
    with contextlib.closing(objects.get_all(key for _, key in wanted)) as fetched:
        for (blob, _), (_, data) in zip(wanted, fetched, strict=True):
            if git_blob_id(data, len(tree)) != blob:
                path = next(f.path for f in manifest.files if f.blob == blob)
                raise damaged(f"the bytes of {path} are not its recorded git blob {blob}")
            marks[blob] = len(marks) + 1
            stdin.write(b"blob\nmark :%d\ndata %d\n" % (marks[blob], len(data)))
            stdin.write(data)
            stdin.write(b"\n")
    message = f"retrolog: code tree {tree}\n".encode()
    stdin.write(
        b"commit %s\ncommitter retrolog <retrolog@localhost> 0 +0000\ndata %d\n%s"
        % (temp_ref.encode(), len(message), message)
    )
    for f in manifest.files:
        ref = f":{marks[f.blob]}" if f.blob in marks else f.blob
        stdin.write(f"M {f.mode} {ref} ".encode() + _quoted(f.path) + b"\n")
    stdin.write(b"\ndone\n")
    stdin.close()


def _publish_tree(
    cache: Path, temp_ref: str, tree: str, damaged: Callable[[str], StoreError], doing: str
) -> None:
    """``temp_ref``'s tree, when it is the recorded ``tree``, kept as
    ``refs/retrolog/trees/<tree>``; ``temp_ref`` deleted either way."""
    made = _git(cache, "rev-parse", "--verify", f"{temp_ref}^{{tree}}")
    try:
        got = made.stdout.decode().strip()
        if made.returncode != 0 or got != tree:
            raise damaged(f"its files make tree {got or '(none)'}, the run recorded tree {tree}")
        try:
            run_git(
                ["update-ref", TREES_REF_PREFIX + tree, temp_ref],
                cwd=cache, env=git_env(git_dir=cache, isolate=True), subject=cache, doing=doing,
            )  # fmt: skip
        except VersionError:
            # Another process importing the same tree holds the ref's lock: its ref will do.
            for _ in range(20):
                if _has_ref(cache, TREES_REF_PREFIX + tree):
                    break
                time.sleep(0.05)
            else:
                raise
    finally:
        _git(cache, "update-ref", "-d", temp_ref)


def _present(git_dir: Path, blobs: Sequence[str]) -> set[str]:
    """Those of ``blobs`` the repository has already."""
    if not blobs:
        return set()
    out = subprocess.run(
        ["git", *SAFE_CONFIG, "cat-file", "--batch-check=%(objectname) %(objecttype)"],
        cwd=git_dir, env=git_env(git_dir=git_dir, isolate=True),
        input="".join(f"{b}\n" for b in blobs).encode(), capture_output=True, check=False,
    )  # fmt: skip
    found = set()
    for line in out.stdout.decode("ascii", errors="replace").splitlines():
        name, _, kind = line.partition(" ")
        if kind == "blob":
            found.add(name)
    return found


def _quoted(path: str) -> bytes:
    """``path`` as a C-style quoted string, as fast-import reads paths."""
    out = bytearray(b'"')
    for byte in os.fsencode(path):
        if byte in (0x22, 0x5C):  # " and \
            out += b"\\" + bytes([byte])
        elif byte < 0x20 or byte == 0x7F:
            out += b"\\%03o" % byte
        else:
            out.append(byte)
    out += b'"'
    return bytes(out)


def code_objects(store: ObjectStore, manifests: Iterable[str]) -> tuple[set[str], dict[str, str]]:
    """The object keys the code ``manifests`` reference (themselves included), for gc;
    and the manifests that could not be read, with why."""
    live: set[str] = set()
    failed: dict[str, str] = {}
    for key in sorted(set(manifests)):
        live.add(key)
        try:
            live |= load_manifest(store, key).object_keys()
        except (RetrologError, OSError) as exc:
            failed[key] = str(exc)
    return live, failed
