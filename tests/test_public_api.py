"""Tests about the package itself: its surface, its import, its error tree, its help."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import retrolog
from retrolog import errors

# The recording calls and the reading ones.
CORE_CALLS = {"arg", "log", "loop", "checkpointing", "commit", "dataframe", "query", "replay"}
# rl.configure (checkpoint settings), rl.restore (load a past checkpoint into live objects,
# the model-registry use), rl.lineage (how a value came to be) and rl.Project (one
# project's store: what the CLI, the API and the UI go through).
PROJECT_CALLS = {"configure", "restore", "lineage", "Project"}
# Loops driven by events (a framework's hooks), for the integrations: docs/integrations.md.
# rl.autolog: the frameworks' trainers patched so an unmodified script records.
EVENT_CALLS = {"begin", "end", "restore_block", "volatile", "autolog"}


def test_all_is_the_api_and_docs_api_md_documents_each_call() -> None:
    reference = Path(__file__).resolve().parents[1] / "docs" / "api.md"
    documented = set(re.findall(r"^\| `(\w+)\(", reference.read_text(), flags=re.M))
    assert set(retrolog.__all__) == CORE_CALLS | PROJECT_CALLS | EVENT_CALLS
    assert set(retrolog.__all__) <= documented
    for name in retrolog.__all__:
        assert callable(getattr(retrolog, name))


def test_import_starts_no_thread_touches_no_git_and_skips_torch(tmp_path: Path) -> None:
    code = (
        "import sys, threading, os\n"
        "import retrolog\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert 'torch' not in sys.modules\n"
        "assert 'pandas' not in sys.modules\n"
        "assert not os.path.exists('.retrolog')\n"
        "print('ok')\n"
    )
    # A PATH without git: importing must not need it.
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/nonexistent", "RETROLOG_PROGRESS": "0"},
    )
    assert proc.stdout.strip() == "ok", proc.stderr


def test_every_error_derives_from_the_base_and_is_drawn_in_the_docstring() -> None:
    classes = [
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type)
        and issubclass(obj, Exception)
        and not issubclass(obj, Warning)
        and obj.__module__ == errors.__name__
    ]
    assert len(classes) >= 8
    doc = errors.__doc__ or ""
    for cls in classes:
        assert issubclass(cls, errors.RetrologError)
        assert cls.__name__ in doc


def test_sqlite_errors_on_open_are_store_errors(tmp_path: Path) -> None:
    from retrolog.store.sqlite_connection import connect

    bad = tmp_path / "not-a-db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(errors.StoreError, match="Cannot open the retrolog store"):
        connect(bad)


def test_the_replay_coordinator_imports_no_pandas_nor_numpy() -> None:
    """A replay's coordinator starts its fork server after its own imports: pandas (0.13 s
    here) is imported only by what returns a DataFrame, numpy (0.04 s) only by what
    handles arrays (a process that never imported numpy holds no numpy value)."""
    code = (
        "import sys\n"
        "import retrolog._replay.replayer, retrolog.cli\n"
        "assert 'pandas' not in sys.modules, 'pandas imported'\n"
        "assert 'numpy' not in sys.modules, 'numpy imported'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_the_readme_shows_the_tool_working_in_its_first_screen() -> None:
    """Installs, records, adds a statement, replays and shows the dataframe in about 50
    lines; every ``retrolog`` command its shell blocks run is one the CLI has."""
    from retrolog.cli import cli

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:50])
    for shown in ("pip install", "rl.checkpointing(", "rl.loop(", "rl.log(", "retrolog replay"):
        assert shown in first_screen, shown
    assert "retrolog dataframe" in first_screen and "w_norm" in first_screen
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    commands = {
        line.split()[1]
        for block in blocks
        for line in block.splitlines()
        if line.startswith("retrolog ")
    }
    assert commands and commands <= set(cli.commands), commands - set(cli.commands)
