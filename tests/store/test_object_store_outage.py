"""An object store that stops answering never kills training nor hangs a replay.

The store is an S3-compatible server of the test's own (tests/s3_outage.py): stopped
and restarted as its clients see it, paused with SIGSTOP. Recording runs at default
settings (the adaptive rule, torch's and retrolog's defaults) unless a test says which
setting it changes; each logged value is checked against what the script logged itself.

``RETROLOG_SOAK_OUTAGES=N`` makes the soak test record through N random outages
(stopped, paused, restarted, of random lengths) instead of a short fixed schedule
(docs/store.md, "When the object store does not answer").
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest

from retrolog.checkpoint.capture import load_checkpoint
from retrolog.store.backends import open_object_store
from s3_outage import BUCKET, OwnS3
from training_scripts import new_project

from conftest import Project, read_db

pytestmark = [pytest.mark.slow, pytest.mark.services]

# A numpy run whose epochs take a fifth of a second: it writes each value it logs to
# LOGGED (one JSON line each) and marks each epoch's start in MARKS, for the test's
# schedule of faults.
SCRIPT = """\
import json
import os
import time
from pathlib import Path

import fsspec
import numpy as np

import retrolog as rl

epochs = rl.arg("epochs", 30)
marks = Path(os.environ.get("MARKS", "."))  # a replay's workers have neither
logged = open(os.environ.get("LOGGED", os.devnull), "w")


def log(name, value):
    rl.log(name, value)
    logged.write(json.dumps([name, value]) + "\\n")
    logged.flush()


rng = np.random.default_rng(7)
w = np.zeros(50_000)
with rl.checkpointing(w=w, rng=rng):
    for epoch in rl.loop("epoch", range(epochs)):
        if "MARKS" in os.environ:
            (marks / str(epoch)).write_text("")
        for step in rl.loop("step", range(4)):
            w += rng.random(w.size)
            log("loss", float(w[:7].sum()) / (epoch + 1))
            time.sleep(0.05)
        log("score", float(w.mean()))
        # HINDSIGHT
print("training finished")
"""
W_MAX = 'rl.log("w_max", float(w.max()))'


@pytest.fixture(scope="module")
def _server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnS3]:
    server = OwnS3(tmp_path_factory.mktemp("s3"))
    try:
        server.make_bucket()
        yield server
    finally:
        server.close()


@pytest.fixture
def own_s3(_server: OwnS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[OwnS3]:
    """The module's own server, answering, with this process's AWS variables set (the
    test reads the store too). Each test uses a prefix of its own."""
    for name, value in _server.env().items():
        monkeypatch.setenv(name, value)
    # fsspec reuses a file system made with the same arguments, and the endpoint comes
    # from the environment, which is not among them: one made earlier in this process
    # for another server would be handed back.
    s3 = fsspec.get_filesystem_class("s3")
    s3.clear_instance_cache()
    yield _server
    s3.clear_instance_cache()
    if _server.paused:
        _server.resume()
    if _server.proxy is None:
        _server.start()


def _wait_for_mark(marks: Path, epoch: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not (marks / str(epoch)).exists():
        assert proc.poll() is None, f"the run ended before epoch {epoch}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"epoch {epoch} never started"
        time.sleep(0.02)


def _record(
    project: Project,
    server: OwnS3,
    url: str,
    schedule: list[tuple[str, int | float]],
    epochs: int,
    **env: str,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Record SCRIPT with its objects at ``url`` while the test follows ``schedule``:
    ("epoch", N) waits for epoch N to start, ("sleep", s) waits, ("stderr", text) waits
    until the run has printed ``text``, and "stop", "start", "pause", "resume" act on the
    server."""
    marks = project.root.parent / "marks"
    marks.mkdir(exist_ok=True)
    for old in marks.iterdir():
        old.unlink()
    logged = project.root.parent / "logged.jsonl"
    full_env = project.env(
        RETROLOG_CHECKPOINTS="",  # the suite pins "every"; users don't
        RETROLOG_OBJECTS_URL=url,
        MARKS=str(marks),
        LOGGED=str(logged),
        **server.env(),
        **env,
    )
    stderr = project.root.parent / "stderr.txt"
    with stderr.open("w") as stderr_file:
        proc = subprocess.Popen(
            [sys.executable, "train.py", "--kwargs", f"epochs={epochs}"],
            cwd=project.root,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            text=True,
        )
    try:
        for action, arg in schedule:
            if action == "epoch":
                _wait_for_mark(marks, int(arg), proc)
            elif action == "stderr":
                _wait_for_text(stderr, str(arg), proc)
            elif action == "sleep":
                time.sleep(float(arg))
            else:
                getattr(server, str(arg) if action == "do" else action)()
        if server.paused:
            server.resume()
        if server.proxy is None:
            server.start()
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = stderr.read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), logged


def _wait_for_text(path: Path, text: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while text not in path.read_text():
        assert proc.poll() is None, f"the run ended without printing {text!r}: {path.read_text()}"
        assert time.monotonic() < deadline, f"the run never printed {text!r}"
        time.sleep(0.05)


def _check_run(project: Project, done: subprocess.CompletedProcess[str], logged: Path) -> str:
    """The run finished, and holds each value the script logged, in its order."""
    assert done.returncode == 0, done.stderr
    assert "training finished" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    ((run_id, status, error),) = read_db(
        project.root, "SELECT run_id, status, error FROM runs ORDER BY started_at DESC LIMIT 1"
    )
    assert (status, error) == ("finished", None)
    expected = [tuple(json.loads(line)) for line in logged.read_text().splitlines()]
    stored = read_db(
        project.root,
        "SELECT name, value FROM logs WHERE run_id = ? AND name IN ('loss', 'score')"
        " ORDER BY log_id",
        (run_id,),
    )
    assert stored == expected
    return str(run_id)


def _check_checkpoints(project: Project, run_id: str, url: str) -> dict[str, object]:
    """Every checkpoint row loads from the store; each one chosen is written or listed lost."""
    store = open_object_store(url)
    manifests = read_db(
        project.root, "SELECT manifest, kind FROM checkpoints WHERE run_id = ?", (run_id,)
    )
    for manifest, _ in manifests:
        load_checkpoint(store, str(manifest))
    ((summary_json,),) = read_db(
        project.root, "SELECT checkpointing FROM runs WHERE run_id = ?", (run_id,)
    )
    summary = json.loads(str(summary_json))
    blocks = sum(kind == "block" for _, kind in manifests)
    assert summary["written"] == blocks
    assert summary["chosen"] == summary["written"] + summary["lost"] + summary["abandoned"]
    assert summary["end_written"] + summary["end_lost"] == 1
    assert summary["lost"] + summary["end_lost"] == len(summary["lost_checkpoints"])
    for lost in summary["lost_checkpoints"]:
        assert lost["reason"] == "object store not answering"
    return dict(summary)


SOAK_ENV = "RETROLOG_SOAK_OUTAGES"
WAITING = "retrolog: waiting for the object store at s3://"


def _outages() -> tuple[list[tuple[str, int | float]], float]:
    """The faults to inject and the seconds they take: a fixed schedule, or with
    RETROLOG_SOAK_OUTAGES=N, N random ones (stopped, paused, of 1 to 12 s each)."""
    soak = int(os.environ.get(SOAK_ENV) or 0)
    if not soak:
        # Stopped until a checkpoint has waited for it (when the adaptive rule chooses
        # one depends on the machine's load), then for longer than the client's own
        # retries used to last; then paused.
        return [
            ("epoch", 3), ("do", "stop"), ("stderr", WAITING), ("sleep", 6.0),
            ("do", "start"), ("stderr", "answers again"),
            ("epoch", 3 + 3), ("do", "pause"), ("sleep", 3.0), ("do", "resume"),
        ], 11.0  # fmt: skip
    rng = random.Random(int(os.environ.get("RETROLOG_SOAK_SEED") or time.time()))
    schedule: list[tuple[str, int | float]] = [("epoch", 2)]
    total = 0.0
    for _ in range(soak):
        down, up = rng.uniform(1.0, 12.0), rng.uniform(0.5, 3.0)
        kind = rng.choice([("stop", "start"), ("pause", "resume")])
        schedule += [("do", kind[0]), ("sleep", down), ("do", kind[1]), ("sleep", up)]
        total += down + up
    return schedule, total


def test_training_outlives_the_object_store_stopped_restarted_and_paused(
    tmp_path: Path, own_s3: OwnS3
) -> None:
    """Default settings: every checkpoint is held in its slot and written once the store
    answers again (none waits 60 s), and training never waits for it."""
    project = new_project(tmp_path / "proj")
    project.write("train.py", SCRIPT)
    url = f"s3://{BUCKET}/defaults"
    schedule, seconds = _outages()
    epochs = int(seconds / 0.2) + 10  # an epoch takes a fifth of a second
    began = time.monotonic()
    done, logged = _record(project, own_s3, url, schedule, epochs=epochs)
    run_id = _check_run(project, done, logged)
    assert WAITING in done.stderr, done.stderr
    assert "answers again" in done.stderr, done.stderr
    summary = _check_checkpoints(project, run_id, url)
    assert summary["end_written"] == 1
    if not os.environ.get(SOAK_ENV):
        assert summary["lost_checkpoints"] == [], summary  # no request went unanswered 60 s
    # Training went on through the outages: it took about its own time.
    assert time.monotonic() - began < epochs * 0.2 + 30


EPOCHS = 40


def test_checkpoints_the_store_never_took_are_listed_and_replay_executes_their_blocks(
    tmp_path: Path, own_s3: OwnS3
) -> None:
    """With a timeout of one second, checkpoints due while the store is stopped are given
    up: the run lists them, `retrolog show` says so, and a replay once the store is back
    executes those blocks and computes what a fresh run does."""
    project = new_project(tmp_path / "proj")
    project.write("train.py", SCRIPT)
    url = f"s3://{BUCKET}/short-timeout"
    # The store stays stopped until the run has given a checkpoint up (when the adaptive
    # rule chooses one depends on the machine's load), then for a second more.
    schedule: list[tuple[str, int | float]] = [
        ("epoch", 2), ("do", "stop"), ("stderr", "was not written: the object store"),
        ("sleep", 1.0), ("do", "start"),
    ]  # fmt: skip
    done, logged = _record(
        project, own_s3, url, schedule, epochs=EPOCHS, RETROLOG_OBJECTS_TIMEOUT="1"
    )
    run_id = _check_run(project, done, logged)
    summary = _check_checkpoints(project, run_id, url)
    assert summary["lost_checkpoints"], done.stderr
    # The rule went on choosing checkpoints after the lost ones, and the store took them.
    assert summary["written"] >= 1, summary
    assert "was not written: the object store at s3://" in done.stderr
    shown = project.cli("show", run_id, **own_s3.env(), RETROLOG_OBJECTS_URL=url)
    assert shown.returncode == 0, shown.stderr
    assert "(object store not answering)" in shown.stdout, shown.stdout

    project.write("train.py", SCRIPT.replace("# HINDSIGHT", W_MAX))
    replay = project.cli("replay", "w_max", "--yes", **own_s3.env(), RETROLOG_OBJECTS_URL=url)
    assert replay.returncode == 0, replay.stderr
    # The plan sees the blocks whose checkpoints were lost as having none: it executes them.
    missing = EPOCHS - int(summary["written"])  # type: ignore[call-overload]
    executed = f"{missing} of {EPOCHS} blocks have no checkpoint: executed"
    assert executed in replay.stderr, replay.stderr
    ((status,),) = read_db(
        project.root, "SELECT status FROM replay_runs WHERE run_id = ?", (run_id,)
    )
    assert status == "replayed"
    replayed = [
        v
        for (v,) in read_db(
            project.root, "SELECT value FROM logs WHERE name = 'w_max' ORDER BY ctx_id"
        )
    ]
    # What today's script logs, as a fresh run computes it.
    rng = np.random.default_rng(7)
    w = np.zeros(50_000)
    expected = []
    for _ in range(EPOCHS):
        for _ in range(4):
            w += rng.random(w.size)
        expected.append(float(w.max()))
    assert replayed == expected and len(expected) == EPOCHS


def _left_running(run_id: str, seconds: float = 10.0) -> list[int]:
    """Processes still working in a checkout of run ``run_id`` (fork servers, workers),
    after giving them ``seconds`` to go."""
    deadline = time.monotonic() + seconds
    while True:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and run_id in os.readlink(entry / "cwd"):
                    found.append(int(entry.name))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


class _Stderr:
    """A child's stderr, read on a thread as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        import threading

        self.lines: list[str] = []
        self.proc = proc
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False

    def all(self) -> str:
        self.thread.join(timeout=10)
        return "".join(self.lines)


def test_replay_of_a_paused_object_store_says_it_waits_gives_up_in_time_and_stops_on_ctrl_c(
    tmp_path: Path, own_s3: OwnS3
) -> None:
    project = new_project(tmp_path / "proj")
    project.write("train.py", SCRIPT)
    url = f"s3://{BUCKET}/replay"
    env = {**own_s3.env(), "RETROLOG_OBJECTS_URL": url, "RETROLOG_CHECKPOINTS": ""}
    project.run("train.py", "--kwargs", "epochs=5", **env)
    project.write("train.py", SCRIPT.replace("# HINDSIGHT", W_MAX))
    own_s3.pause()

    # A timeout: the replay stops with one paragraph saying what to do, and runs nothing.
    began = time.monotonic()
    out = project.cli("replay", "w_max", "--yes", **env, RETROLOG_OBJECTS_TIMEOUT="4")
    took = time.monotonic() - began
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"retrolog: waiting for the object store at {url}: no answer for" in out.stderr
    error = out.stderr[out.stderr.index("Error: ") :]
    assert "\n\n" not in error.strip(), error  # one paragraph, the last thing said
    flat = " ".join(error.split())
    assert f"The object store at {url} did not answer" in flat, flat
    assert "RETROLOG_OBJECTS_TIMEOUT (now 4 s" in flat, flat
    assert took < 30, took
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'w_max'") == [(0,)]
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    assert _left_running(str(run_id)) == []

    # Ctrl-C at the default timeout: out at once, with no traceback.
    with project.start_cli("replay", "w_max", "--yes", **env) as proc:
        stderr = _Stderr(proc)
        try:
            assert stderr.wait_for("waiting for the object store at", 30), stderr.all()
            proc.send_signal(signal.SIGINT)
            began = time.monotonic()
            proc.wait(timeout=15)
            assert time.monotonic() - began < 5
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        said = stderr.all()
    assert proc.returncode == 130, said
    assert "Interrupted." in said and "Traceback" not in said, said
    assert _left_running(str(run_id)) == []


def test_what_counts_as_a_store_not_answering() -> None:
    """Worth retrying: a connection refused, reset or silent, a server that cannot serve
    now. Not: a missing object, a refusal, a bug."""
    import errno

    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    from retrolog.errors import StoreUnreachableError, store_unreachable

    def client_error(status: int, code: str) -> OSError:
        error = ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )
        translated = OSError(errno.EIO, str(error))  # as s3fs translates it
        translated.__cause__ = error
        return translated

    assert store_unreachable(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert store_unreachable(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert store_unreachable(ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert store_unreachable(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert store_unreachable(client_error(503, "SlowDown"))
    assert store_unreachable(StoreUnreachableError("gone"))
    assert not store_unreachable(client_error(403, "AccessDenied"))
    assert not store_unreachable(FileNotFoundError("no such object"))
    assert not store_unreachable(ValueError("a bug"))
    # A handler's own error is not caused by what it handled.
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError:
            raise FileNotFoundError("missing") from None
    except FileNotFoundError as missing:
        assert not store_unreachable(missing)
