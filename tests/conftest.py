"""Fixtures: each test gets a fresh project directory with a real git repository."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from retrolog.checkpoint._arrays import DECODED
from retrolog.store.objects import ForwardingStore, ObjectStore, frame

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "Test User",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "Test User",
    "GIT_COMMITTER_EMAIL": "test@example.com",
}


class WrappingStore(ForwardingStore):
    """A store that passes put, get, has and delete to ``inner``'s, every write through put
    and every read through get.

    As a wrapper a user might write would; tests subclass it to delay or fail writes, or
    to count reads (``put_framed`` goes through ``put``; ``view`` and ``peek`` through
    ``get``; ``touch`` only checks ``has``).
    """

    def put(self, data: bytes) -> str:
        return self.inner.put(data)

    def put_framed(self, key: str, *parts: Any) -> int:
        data = frame(key, *parts)
        self.put(data)
        return len(data)

    @contextlib.contextmanager
    def view(self, key: str) -> Iterator[memoryview]:
        with memoryview(self.get(key)) as data:
            yield data

    def peek(self, key: str, size: int) -> bytes | None:
        return self.get(key)[:size] if self.has(key) else None

    def touch(self, key: str) -> bool:
        return self.has(key)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def read(store: ObjectStore, key: str, how: str) -> bytes:
    """Object ``key`` as ``get`` returns it, or as ``view`` shows it (mapped, for a local store)."""
    if how == "get":
        return store.get(key)
    with store.view(key) as data:
        return bytes(data)


READS = pytest.mark.parametrize("how", ["get", "view"])


@dataclass
class Project:
    """A user's project: a directory (a git repo unless made with git=False) and its scripts."""

    root: Path

    def write(self, relpath: str, text: str) -> Path:
        path = self.root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    def git(self, *args: str) -> str:
        out = subprocess.run(
            ["git", *args],
            cwd=self.root,
            env={**os.environ, **GIT_IDENTITY},
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RETROLOG_")}
        env["RETROLOG_PROGRESS"] = "0"
        # Tests that check where checkpoints are taken, or replay from them, want every
        # block checkpointed; the adaptive rule is tested with RETROLOG_CHECKPOINTS=adaptive.
        env["RETROLOG_CHECKPOINTS"] = "every"
        env.update(extra)
        return env

    def run(
        self, script: str, *args: str, check: bool = True, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run ``python script args`` in the project, as a user would: from a terminal,
        where Ctrl-C (SIGINT) reaches it, also when the suite runs as a background job."""
        proc = subprocess.run(
            [sys.executable, script, *args],
            cwd=self.root,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=default_sigint,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run the ``retrolog`` command in the project."""
        return subprocess.run(
            [sys.executable, "-m", "retrolog", *args],
            cwd=self.root,
            env=self.env(**env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )

    @contextlib.contextmanager
    def recording_paused(
        self, script: str = "train.py", **env: str
    ) -> Iterator[subprocess.Popen[str]]:
        """A run of ``script`` (training_scripts.NUMPY_TRAIN) held after its epoch 1, still
        recording while the block runs; it is let go at the end and must then finish."""
        gate = self.root / "go"
        with subprocess.Popen(
            [sys.executable, script, "--kwargs", f"pause={gate}"],
            cwd=self.root,
            env=self.env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            ready = Path(f"{gate}.ready")
            deadline = time.monotonic() + 120
            while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert ready.exists(), proc.communicate()
            try:
                yield proc
            finally:
                gate.write_text("")
                _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err

    def start_cli(self, *args: str, **env: str) -> subprocess.Popen[str]:
        """Start the ``retrolog`` command in the background, as from a terminal: Ctrl-C
        (SIGINT) reaches it even when the suite runs as a background job."""
        return subprocess.Popen(
            [sys.executable, "-m", "retrolog", *args],
            cwd=self.root,
            env=self.env(**env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=default_sigint,
        )


def logged_values(
    database: Path, where: str = "", params: tuple[object, ...] = ()
) -> dict[tuple[object, ...], object]:
    """A store's logged values keyed by (run_id, name, epoch, step), read with plain sqlite3.

    ``where`` filters over ``l`` (logs); epoch and step are the iterations of the depth-0
    and depth-1 loops the value sits in (None outside them).
    """
    import sqlite3

    conn = sqlite3.connect(database)
    try:
        rows = conn.execute(
            "SELECT l.run_id, l.name, e.iteration, s.iteration, l.value FROM logs l"
            " LEFT JOIN loops s ON s.run_id = l.run_id AND s.ctx_id = l.ctx_id AND s.depth = 1"
            " LEFT JOIN loops e ON e.run_id = l.run_id AND e.ctx_id = COALESCE(s.parent_ctx,"
            f" l.ctx_id) AND e.depth = 0 {where}",
            params,
        ).fetchall()
    finally:
        conn.close()
    return {(r, n, e, s): v for r, n, e, s, v in rows}


def new_project(root: Path) -> Project:
    """A git repository with one commit at ``root``, as most users' projects are."""
    root.mkdir()
    p = Project(root)
    p.git("init", "--quiet", "--initial-branch=main")
    p.write("README.md", "a project\n")
    p.write(".gitignore", "data/\n")
    p.git("add", "-A")
    p.git("commit", "--quiet", "-m", "initial")
    return p


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Project]:
    """A git repository with one commit, as most users' projects are."""
    yield new_project(tmp_path / "proj")


@dataclass
class RecordedOnce:
    """A project whose runs a module records once; :meth:`fresh` gives each test the
    project as it was just after recording, at the same path, whatever an earlier test
    changed in it (its store, scripts, git repository).

    The same path, not a copy elsewhere, so that the store, the git repository and
    everything that names the project's directory are byte for byte what a recording in
    the test itself would leave. A module's tests run one at a time in one process
    (pytest-xdist's ``--dist loadfile``), so they never share the directory at once.
    """

    project: Project
    saved: Path

    @classmethod
    def record(
        cls, tmp_path_factory: pytest.TempPathFactory, recording: Callable[[Project], None]
    ) -> RecordedOnce:
        """A new project in a temporary directory, after ``recording(project)``."""
        base = tmp_path_factory.mktemp("recorded")
        project = new_project(base / "proj")
        recording(project)
        saved = base / "saved"
        shutil.copytree(project.root, saved, symlinks=True)
        return cls(project, saved)

    def fresh(self) -> Project:
        shutil.rmtree(self.project.root)
        shutil.copytree(self.saved, self.project.root, symlinks=True)
        return self.project


@pytest.fixture
def whole_machine() -> None:
    """For a test that trains with torch's default threads (one per core): it has the
    machine to itself, whichever pytest worker it is in (``pytest_runtest_protocol``).

    A user trains one run per machine (replay too: its default workers fit the cores),
    and torch's default threads assume it. Beside another busy process, OpenMP's
    threads spin while they wait for each other: the word_lm example took 236 s beside
    the S3 default-settings test instead of 18 s alone, and once ran past its 300 s
    limit; the dcgan example took 148 s beside the other pytest worker's tests against
    47 s alone.
    """


# The directory of the machine lock, made by the controlling pytest process and inherited
# by pytest-xdist's workers (they start after pytest_configure); removed at the end.
MACHINE_LOCK_DIR = "PYTEST_MACHINE_LOCK_DIR"
_OWN_LOCK_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and MACHINE_LOCK_DIR not in os.environ:
        os.environ[MACHINE_LOCK_DIR] = tempfile.mkdtemp(prefix="pytest-machine-")
        config.stash[_OWN_LOCK_DIR] = os.environ[MACHINE_LOCK_DIR]


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_LOCK_DIR, None)
    if own is not None:
        import shutil

        shutil.rmtree(own, ignore_errors=True)
        del os.environ[MACHINE_LOCK_DIR]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test holds the machine lock while it is set up, runs and is torn down (its
    module fixtures' set-up included): exclusive for a ``whole_machine`` test, shared
    for every other. Only pytest-xdist's workers need it; they share one lock file.

    It also tells ``require_services_marker`` whether the test is marked ``services``."""
    os.environ[_SERVICES_MARKED] = "1" if item.get_closest_marker("services") else "0"
    where = os.environ.get(MACHINE_LOCK_DIR)
    if where is None or not hasattr(item.config, "workerinput"):
        yield
        return
    import fcntl

    exclusive = "whole_machine" in getattr(item, "fixturenames", ())
    base = Path(where)
    with (base / "turnstile").open("w") as gate, (base / "lock").open("w") as lock:
        # The turnstile stops new sharers while an exclusive test waits for the lock, so
        # the other worker's stream of short tests cannot keep it waiting for ever.
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield


# -- the lanes: markers that say what a test needs ------------------------------------------
#
# `bash scripts/test.sh --fast` runs the tests marked none of slow, services and browser,
# on a machine without the test servers or chromium (docs/testing.md). The markers are
# kept true here: a test that takes a server's or the browser's fixture gets the marker
# at collection, and a test that reaches a server another way (a private server,
# ``service_setting``) fails unless it carries ``services`` itself.

SERVICE_FIXTURES = frozenset({"s3_url", "ray_address", "database_url", "pg_store_url"})
BROWSER_FIXTURES = frozenset({"browser", "page"})
# Whether the running test is marked ``services``: in the environment, not a global,
# because test modules import this file a second time as ``conftest``.
_SERVICES_MARKED = "PYTEST_SERVICES_MARKED"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test that takes a server's fixture ``services``, each that takes the
    browser's ``browser`` and each that takes ``whole_machine`` ``whole_machine``, before
    ``-m`` selects (hence ``tryfirst``); puts slow files first."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & SERVICE_FIXTURES and item.get_closest_marker("services") is None:
            item.add_marker(pytest.mark.services)
        if used & BROWSER_FIXTURES and item.get_closest_marker("browser") is None:
            item.add_marker(pytest.mark.browser)
        if "whole_machine" in used and item.get_closest_marker("whole_machine") is None:
            item.add_marker(pytest.mark.whole_machine)
    # Files with a slow test first, each file's tests in their own order: pytest-xdist
    # (scripts/test.sh passes --no-loadscope-reorder) then hands out the long files while
    # the short ones are left to even out the workers' ends, instead of leaving a file of
    # one 40 s test to run alone at the end.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def require_services_marker(what: str) -> None:
    """Fails the running test unless it is marked ``services``: it is about to use ``what``,
    which the fast lane's machine does not have."""
    if os.environ.get(_SERVICES_MARKED) == "0":
        pytest.fail(
            f"this test uses {what}, but it is not marked `services`: add "
            "`@pytest.mark.services` (or `pytestmark = pytest.mark.services` for the module) "
            "so that `bash scripts/test.sh --fast`, which runs without the test servers, "
            "leaves it out.",
            pytrace=False,
        )


@pytest.fixture
def plain_dir(tmp_path: Path) -> Project:
    """A project directory that is not a git repository."""
    root = tmp_path / "plain"
    root.mkdir()
    return Project(root)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETROLOG_PROGRESS", "0")
    monkeypatch.setenv("RETROLOG_CHECKPOINTS", "every")
    monkeypatch.delenv("RETROLOG_STORE", raising=False)
    # Delta bases decoded by an earlier test would spare this one its reads from disk.
    DECODED.clear()


def default_sigint() -> None:
    """For ``preexec_fn``: a child gets Ctrl-C as a terminal would deliver it.

    Run as a background job of a non-interactive shell (CI, nohup), the tests inherit
    SIGINT ignored, and so would their children: Python leaves an ignored SIGINT ignored.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_db(root: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Rows from a project's store, read with plain sqlite3 (independent of our readers)."""
    import sqlite3

    conn = sqlite3.connect(root / ".retrolog" / "retrolog.db")
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


sys.path.insert(0, str(Path(__file__).parent))


# A replay worker runs the script from a temporary checkout whose path starts so.
REPLAY_WORKERS = f"{tempfile.gettempdir()}/retrolog-"


def replay_workers(text: str = REPLAY_WORKERS) -> list[int]:
    """Pids of running replay workers (a train.py) whose command line or directory holds ``text``.

    A worker started as a new interpreter has the script on its command line; one
    forked by a fork server has the server's command line, and its checkout as cwd.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Another test's process may have bytes that are not UTF-8 on its command line.
            raw = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            cmdline = raw.decode(errors="surrogateescape")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if ("train.py" in cmdline and (text in cmdline or cwd.startswith(text))) or (
            "forkserver_main.py" in cmdline and cwd.startswith(text)
        ):
            found.append(int(entry.name))
    return found


def values_by_run(root: Path, name: str) -> dict[str, list[float]]:
    """Each run's values of ``name`` in logging order, read with plain sqlite3."""
    found: dict[str, list[float]] = {}
    for run_id, value in read_db(
        root, "SELECT run_id, value FROM logs WHERE name = ? ORDER BY run_id, ctx_id", (name,)
    ):
        found.setdefault(str(run_id), []).append(float(value))  # type: ignore[arg-type]
    return found


# -- the S3-compatible server (scripts/services.sh) ---------------------------------------

S3_BUCKET = "retrolog-tests"
SERVICES_ENV = Path(__file__).resolve().parent.parent / ".services" / "env"
S3_HINT = (
    "The S3 tests need the S3-compatible server that `bash scripts/services.sh start` starts "
    "(the README's test command does); or set RETROLOG_TEST_S3_ENDPOINT to an S3 endpoint."
)


def service_setting(variable: str) -> str:
    """``variable`` from the environment, else from .services/env (scripts/services.sh
    writes it), else ''."""
    require_services_marker(f"the test servers' setting {variable}")
    found = os.environ.get(variable, "").strip()
    if not found and SERVICES_ENV.exists():
        for line in SERVICES_ENV.read_text().splitlines():
            name, _, value = line.partition("=")
            if name == variable:
                found = value.strip()
    return found


def s3_endpoint() -> str:
    """The test S3 server's endpoint: RETROLOG_TEST_S3_ENDPOINT, else .services/env's."""
    endpoint = service_setting("RETROLOG_TEST_S3_ENDPOINT")
    if not endpoint:
        pytest.fail(S3_HINT, pytrace=False)
    return endpoint


@pytest.fixture
def s3_url(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ``s3://`` prefix on the test server, with this process's AWS variables set
    (and so its children's) as a user of an S3-compatible server sets them."""
    endpoint = s3_endpoint()
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "retrolog-tests",
        "AWS_SECRET_ACCESS_KEY": "retrolog-tests",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    try:
        if not fs.exists(S3_BUCKET):
            fs.call_s3("create_bucket", Bucket=S3_BUCKET)
    except OSError as exc:
        if "BucketAlready" not in str(exc):
            pytest.fail(
                f"cannot reach the S3 server at {endpoint}: {exc}\n{S3_HINT}", pytrace=False
            )
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"


# -- the Ray cluster (scripts/services.sh) ------------------------------------------------

RAY_HINT = (
    "The replay-on-Ray tests need the one-node Ray cluster that `bash scripts/services.sh "
    "start` starts (the README's test command does); or set RETROLOG_TEST_RAY_ADDRESS to a "
    "Ray cluster's HOST:PORT."
)


@pytest.fixture
def ray_address() -> str:
    """The test Ray cluster's address: RETROLOG_TEST_RAY_ADDRESS, else .services/env's.
    Fails, never skips, when there is none or nothing answers there."""
    import socket

    address = service_setting("RETROLOG_TEST_RAY_ADDRESS")
    if not address:
        pytest.fail(RAY_HINT, pytrace=False)
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as exc:
        pytest.fail(f"cannot reach the Ray cluster at {address}: {exc}\n{RAY_HINT}", pytrace=False)
    return address


def ray_env(address: str) -> dict[str, str]:
    """What a `retrolog replay --executor ray` process needs to reach the test cluster: its
    address, and Ray told that a cluster on 127.0.0.1 is one machine (scripts/services.sh)."""
    return {"RAY_ADDRESS": address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# -- PostgreSQL (scripts/services.sh) -----------------------------------------------------

DATABASE_HINT = (
    "The PostgreSQL tests need the server that `bash scripts/services.sh start` starts (the "
    "README's test command does); or set RETROLOG_TEST_DATABASE_URL to a postgresql:// URL "
    "of a database these tests may write."
)


@pytest.fixture
def database_url() -> str:
    """The test PostgreSQL database's URL (with its password): RETROLOG_TEST_DATABASE_URL,
    else .services/env's. Fails, never skips, when there is none."""
    url = service_setting("RETROLOG_TEST_DATABASE_URL")
    if not url:
        pytest.fail(DATABASE_HINT, pytrace=False)
    return url


@pytest.fixture
def pg_store_url(database_url: str) -> Iterator[str]:
    """A URL of the test database whose tables go into a schema of this test's own (its
    ``search_path``), as a team's retrolog database; the schema is dropped afterwards."""
    import urllib.parse

    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    parts = urllib.parse.urlsplit(database_url)
    options = urllib.parse.quote(f"-c search_path={schema}")
    query = f"{parts.query}&options={options}" if parts.query else f"options={options}"
    yield urllib.parse.urlunsplit(parts._replace(query=query))
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")


@contextlib.contextmanager
def pg_role(admin_url: str, store_url: str, privileges: str) -> Iterator[str]:
    """``store_url`` as a new login role that has ``privileges`` (e.g. "SELECT") on the
    tables of the URL's schema and nothing more; the role is dropped afterwards."""
    import urllib.parse

    import psycopg

    parts = urllib.parse.urlsplit(store_url)
    schema = urllib.parse.unquote(parts.query).split("search_path=")[1].split("&")[0]
    role, password = f"role_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        admin.execute(f"GRANT {privileges} ON ALL TABLES IN SCHEMA {schema} TO {role}")
    try:
        netloc = f"{role}:{password}@{parts.hostname}:{parts.port}"
        yield urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


def read_pg(url: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Rows from a PostgreSQL store, read with plain psycopg (independent of our readers)."""
    import psycopg

    with psycopg.connect(url) as conn:
        return conn.execute(sql, params).fetchall()
