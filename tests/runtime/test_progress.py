"""The outermost loop's progress bar: on a terminal's stderr only, switchable off."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from conftest import Project

SCRIPT = """
    import retrolog as rl
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(3)):
            rl.log("loss", 0.125)
"""


def _run_with_terminal_stderr(p: Project, **env: str) -> str:
    leader, follower = pty.openpty()
    # A terminal 120 columns wide, as a user's would be (a new pty has no size).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        proc = subprocess.run(
            [sys.executable, "train.py"],
            cwd=p.root,
            env={**p.env(), "RETROLOG_PROGRESS": "", **env},
            stdout=subprocess.DEVNULL,
            stderr=follower,
            timeout=120,
        )
        assert proc.returncode == 0
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
        if follower != -1:
            os.close(follower)


def test_bar_on_a_terminal_shows_the_outer_loop_and_latest_values(project: Project) -> None:
    project.write("train.py", SCRIPT)
    shown = _run_with_terminal_stderr(project)
    assert "epoch" in shown and "3/3" in shown and "loss=0.125" in shown
    assert "step" not in shown  # only the outermost loop has a bar


def test_bar_can_be_switched_off(project: Project) -> None:
    project.write("train.py", SCRIPT)
    assert "epoch" not in _run_with_terminal_stderr(project, RETROLOG_PROGRESS="0")


def test_no_bar_when_stderr_is_not_a_terminal(project: Project) -> None:
    project.write("train.py", SCRIPT)
    proc = project.run("train.py", RETROLOG_PROGRESS="")
    assert proc.stderr == ""
