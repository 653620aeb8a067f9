"""Browser fixtures for the dashboard (``retrolog ui``) tests.

Playwright drives the system chromium (Debian's /usr/bin/chromium, or $RETROLOG_CHROMIUM), not
the browser ``playwright install`` downloads: that download needs the internet, which our test
machines do not have. A missing browser or Playwright fails the tests rather than skipping
them, so that a machine without them cannot pass the suite while testing no UI;
``bash scripts/setup_browser.sh`` sets both up.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from conftest import RecordedOnce

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

SETUP_HINT = "run `bash scripts/setup_browser.sh`"

# Playwright already passes these on Linux (--no-sandbox because chromium_sandbox=False); they
# are spelled out because the tests depend on them. The sandbox cannot start as root ("Running
# as root without --no-sandbox is not supported"), and containers often mount a 64 MB /dev/shm,
# too small for Chromium's shared memory; this flag puts it in /tmp instead.
LAUNCH_ARGS = ["--no-sandbox", "--disable-dev-shm-usage"]


def chromium_path() -> Path:
    return Path(os.environ.get("RETROLOG_CHROMIUM", "/usr/bin/chromium"))


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """One headless chromium for the whole session; each test gets its own context (``page``).

    Starting Playwright's driver takes about 0.4 s and a launch 0.2 s; a context and page 0.15 s.

    While it is open, Playwright's event loop counts as running in this thread, so no test may
    call ``asyncio.run()``; and its objects work only in the thread that made them.
    """
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError as e:
        pytest.fail(f"cannot import playwright ({e}); {SETUP_HINT}", pytrace=False)
    executable = chromium_path()
    if not (executable.is_file() and os.access(executable, os.X_OK)):
        pytest.fail(
            f"no chromium at {executable} (set RETROLOG_CHROMIUM to use another); {SETUP_HINT}",
            pytrace=False,
        )
    with sync_playwright() as playwright:
        try:
            launched = playwright.chromium.launch(
                executable_path=executable,
                headless=True,
                chromium_sandbox=False,
                args=LAUNCH_ARGS,
                timeout=30_000,
            )
        except Error as e:
            pytest.fail(f"cannot launch {executable}: {e}\n{SETUP_HINT}", pytrace=False)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a fresh context, so no cookies or storage carry over from another test."""
    context = browser.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()


# -- a recorded project and a running dashboard ------------------------------------------------

TRAIN = """\
import argparse

import retrolog as rl

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()


def train(state):
    with rl.checkpointing(state=state):
        for epoch in rl.loop("epoch", range(3)):
            for step in rl.loop("step", range(400)):
                state["w"] -= args.lr * state["w"] * DECAY
                # A one-step spike that a chart sampling every k-th point would lose.
                rl.log("loss", state["w"] + (5.0 if (epoch, step) == (1, 217) else 0.0))
            rl.log("acc", 1 - state["w"])


DECAY = {decay}
train({{"w": 1.0}})
"""


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory) -> RecordedOnce:
    return RecordedOnce.record(tmp_path_factory, _record)


@pytest.fixture
def recorded(recorded_once: RecordedOnce) -> Any:
    """A project whose script has three runs across two code versions:
    lr 0.1 and 0.2 in the first, lr 0.3 in the second (a different decay). Recorded once
    for each test module, the same for each test."""
    return recorded_once.fresh()


def _record(project: Any) -> None:
    project.write("train.py", TRAIN.format(decay="0.001"))
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    # As users record: the adaptive rule chooses the checkpoints (the suite's default is
    # every block).
    adaptive = {"RETROLOG_CHECKPOINTS": "adaptive"}
    project.run("train.py", "--lr", "0.1", **adaptive)
    project.run("train.py", "--lr", "0.2", **adaptive)
    project.write("train.py", TRAIN.format(decay="0.002"))
    project.git("commit", "--quiet", "-am", "faster decay")
    project.run("train.py", "--lr", "0.3", **adaptive)


@pytest.fixture
def log_w_sq_today(recorded: Any) -> Any:
    """Call it to add a statement to today's script (not committed): a name no run logged."""

    def edit() -> None:
        path = recorded.root / "train.py"
        line = '            rl.log("acc", 1 - state["w"])\n'
        source = path.read_text()
        assert line in source
        path.write_text(
            source.replace(line, line + '            rl.log("w_sq", state["w"] ** 2)\n')
        )

    return edit


@dataclass
class Dashboard:
    """A ``retrolog ui`` process serving a project, and the address it printed."""

    process: subprocess.Popen[str]
    url: str  # with ?token=...
    base: str  # http://127.0.0.1:PORT
    token: str


@contextlib.contextmanager
def serving(project: Any, *args: str, **env: str) -> Iterator[Dashboard]:
    """``retrolog ui --no-browser --port 0 [args]`` started in the project, as a user would."""
    process = project.start_cli("ui", "--no-browser", "--port", "0", *args, **env)
    assert process.stderr is not None
    deadline = time.monotonic() + 60
    url = None
    while url is None and time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        found = re.search(r"(http://\S+/\?token=(\S+))", line)
        if found:
            url = found.group(1)
    if url is None:
        process.kill()
        pytest.fail(f"retrolog ui printed no address: {process.communicate()}")
    token = url.rsplit("token=", 1)[1]
    try:
        yield Dashboard(process, url, url.split("/?", 1)[0], token)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


@pytest.fixture
def serve() -> Any:
    """``serving``, for a test that records its own project: ``with serve(project) as d:``."""
    return serving


@pytest.fixture
def dashboard(recorded: Any) -> Iterator[Dashboard]:
    """``retrolog ui --no-browser --port 0`` started in the project, as a user would."""
    with serving(recorded) as started:
        yield started


@pytest.fixture
def dashboard_everywhere(recorded: Any) -> Iterator[Dashboard]:
    """``retrolog ui --host 0.0.0.0``: bound to every interface of the machine."""
    with serving(recorded, "--host", "0.0.0.0") as started:
        yield started


@pytest.fixture
def dashboard_of_large_values(project: Any) -> Iterator[Dashboard]:
    """A dashboard over one run that logs ``big``: values up to about six million."""
    project.write(
        "big.py",
        "import retrolog as rl\n\nfor step in rl.loop('step', range(50)):\n"
        "    rl.log('big', 123456.0 * step)\n",
    )
    project.run("big.py")
    with serving(project) as started:
        yield started


@pytest.fixture
def team_dashboard(project: Any, pg_store_url: str, database_url: str) -> Iterator[Dashboard]:
    """The runs of ``recorded``, recorded into PostgreSQL under the adaptive rule; the
    dashboard connects as a team member's role (may read and write retrolog's tables,
    is no superuser)."""
    from conftest import pg_role

    project.write("train.py", TRAIN.format(decay="0.001"))
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    env = {"RETROLOG_CHECKPOINTS": "adaptive", "RETROLOG_DATABASE_URL": pg_store_url}
    project.run("train.py", "--lr", "0.1", **env)
    project.run("train.py", "--lr", "0.2", **env)
    project.write("train.py", TRAIN.format(decay="0.002"))
    project.git("commit", "--quiet", "-am", "faster decay")
    project.run("train.py", "--lr", "0.3", **env)
    with (
        pg_role(database_url, pg_store_url, "SELECT, INSERT, UPDATE, DELETE") as member,
        serving(project, RETROLOG_DATABASE_URL=member) as started,
    ):
        yield started
