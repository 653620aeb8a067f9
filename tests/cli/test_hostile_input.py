"""Bad or hostile input to the read commands: a clear answer, never raw bytes or a traceback.

Logged text holding terminal escape sequences is shown escaped; a blob column
survives ``query --json``; an empty database file is refused, not silently
made into a new store; a run whose code version is gone is reported alone
while the others replay.
"""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import time

import pytest

from conftest import Project, read_db

pytestmark = pytest.mark.slow

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b"


def test_logged_escape_sequences_reach_the_terminal_escaped(project: Project) -> None:
    project.write(
        "train.py",
        "import retrolog as rl\n"
        f"rl.log('note', {ESCAPES!r})\n"
        "for e in rl.loop('epoch', range(2)):\n"
        f"    rl.log('tag', {ESCAPES!r} + str(e))\n",
    )
    project.run("train.py")
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    for args in (("dataframe", "tag"), ("show", str(run_id)), ("query", "SELECT value FROM logs")):
        out = project.cli(*args)
        assert out.returncode == 0, out.stderr
        assert not any(c in out.stdout for c in "\x1b\x07\x9b"), (args, out.stdout)
        assert "\\x1b" in out.stdout, (args, out.stdout)
    # Machine-readable output keeps the value exactly.
    raw = json.loads(project.cli("dataframe", "tag", "--json").stdout)
    assert raw[0]["tag"] == ESCAPES + "0"


def test_query_json_writes_blob_columns_as_base64(project: Project) -> None:
    project.write("train.py", "import retrolog as rl\nrl.log('x', 1.0)\n")
    project.run("train.py")
    out = project.cli("query", "SELECT x'00ff10' AS b, 'text' AS t", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        {"b": base64.b64encode(b"\x00\xff\x10").decode(), "t": "text"}
    ]


def test_an_empty_database_file_is_refused_not_made_anew(project: Project) -> None:
    store = project.root / ".retrolog"
    store.mkdir()
    (store / "retrolog.db").write_bytes(b"")
    # Left empty a while ago (one being created right now by another run is not refused).
    os.utime(store / "retrolog.db", (time.time() - 60, time.time() - 60))
    out = project.cli("runs")
    assert out.returncode == 1
    said = " ".join(out.stderr.split())
    assert "is an empty file (0 bytes)" in said and "Traceback" not in said
    assert (store / "retrolog.db").stat().st_size == 0  # left as it was found


def test_a_run_whose_code_version_is_gone_is_reported_alone(project: Project) -> None:
    script = (
        "import retrolog as rl\n"
        "lr = rl.arg('lr', 0.1)\n"
        "w = 1.0\n"
        "for epoch in rl.loop('epoch', range(3)):\n"
        "    w -= lr * w\n"
        "    rl.log('w', w)\n"
    )
    project.write("train.py", script)
    project.run("train.py", "--kwargs", "lr=0.1")
    project.write("train.py", script.replace("w -= lr * w", "w -= lr * w * 0.5"))
    project.run("train.py", "--kwargs", "lr=0.2")
    gone, kept = (
        str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")
    )
    project.git("update-ref", "-d", f"refs/retrolog/runs/{gone}")
    project.git("reflog", "expire", "--expire=now", "--all")
    project.git("gc", "--quiet", "--prune=now")
    # Nor has the store a copy of it (a run recorded before retrolog kept code there;
    # docs/code-versions.md): with one, the replay reads it from the store.
    conn = sqlite3.connect(project.root / ".retrolog" / "retrolog.db")
    with conn:
        conn.execute("UPDATE runs SET code_manifest = NULL WHERE run_id = ?", (gone,))
    conn.close()

    project.write(
        "train.py",
        script.replace("    rl.log('w', w)\n", "    rl.log('w', w)\n    rl.log('w2', w * w)\n"),
    )
    out = project.cli("replay", "w2", "--yes")
    assert "Traceback" not in out.stderr
    assert (
        f"{gone}" in out.stderr
        and "cannot be read" in out.stderr
        and "Only this run is skipped" in out.stderr
    )
    # A run asked for that got nothing: the exit says so, and the report names it.
    assert out.returncode == 1, out.stderr
    said = " ".join(out.stderr.split())
    assert f"Skipped 1 run(s) whose code version cannot be read ({gone})" in said, said
    counts = dict(
        read_db(project.root, "SELECT run_id, COUNT(*) FROM logs WHERE name = 'w2' GROUP BY run_id")
    )
    assert counts == {kept: 3}


# Cursor up and erase the line: in a raw terminal the line before vanishes from the
# diff a user reviews; a right-to-left override then reorders what is left.
HIDING = "\x1b[1A\x1b[2K\u202e"


def test_escape_sequences_in_recorded_code_reach_the_review_escaped(project: Project) -> None:
    old = (
        "import os\n"
        "import retrolog as rl\n"
        "for epoch in rl.loop('epoch', range(2)):\n"
        "    os.environ.get('HOME')  # innocent\n"
        f"    w = epoch * 2  # {HIDING}\n"
        "    rl.log('w', w)\n"
    )
    project.write("train.py", old)
    project.run("train.py")
    new = old.replace("    rl.log('w', w)\n", "    rl.log('w', w)\n    rl.log('w2', w * w)\n")
    project.write("train.py", new)
    project.write("old_train.py", old)
    dry = project.cli("replay", "w2", "--dry-run")
    diff = project.cli("propagate", "train.py", "old_train.py", "--names", "w2", "--diff")
    for done in (dry, diff):
        assert done.returncode == 0, done.stderr
        shown = done.stdout + done.stderr
        assert not any(c in shown for c in "\x1b\u202e"), shown
        assert "# \\x1b[1A\\x1b[2K\\u202e" in shown, shown
        assert "are written as \\xNN" in done.stderr
    assert "rl.log('w2', w * w)" in dry.stderr
