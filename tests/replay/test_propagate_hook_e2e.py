"""A statement in a callback hook only today's version has, replayed into an old run.

The old version's callback class lacks ``on_epoch_end``; today's adds it with a
statement in it (or adds a whole callback class with the hook, and a line creating
it). ``retrolog propagate --diff`` shows the method (the class and the line) carried
into the old version, and ``retrolog replay`` backfills the old run with values equal,
bit for bit, to what a fresh run of that propagated file logs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import Project, logged_values

pytestmark = pytest.mark.slow

OLD = """\
import numpy as np

import retrolog as rl


class Callback:
    def on_step_end(self, w):
        pass

    def on_epoch_end(self, w):
        pass


class Tracker(Callback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, w):
        self.steps += 1


def fit(w, callbacks, epochs):
    for epoch in rl.loop("epoch", range(epochs)):
        for step in rl.loop("step", range(3)):
            w += np.random.random(w.shape)
            for callback in callbacks:
                callback.on_step_end(w)
        for callback in callbacks:
            callback.on_epoch_end(w)
        rl.log("score", float(w[:5].sum()))


np.random.seed(rl.arg("seed", 0))
w = np.zeros(50)
callbacks = [Tracker()]
with rl.checkpointing(w=w):
    fit(w, callbacks, rl.arg("epochs", 4))
"""

HOOK = """\

    def on_epoch_end(self, w):
        # the largest weight after each epoch
        rl.log("w_max", float(w.max()) / 3)
"""

# The same hook in a callback class only today's version has, and the line creating it.
CLASS = """\

class MaxLogger(Callback):
    def on_epoch_end(self, w):
        # the largest weight after each epoch
        rl.log("w_max", float(w.max()) / 3)

"""
APPEND = "callbacks.append(MaxLogger())\n"

# Each case: today's file, and what propagation makes of the old one.
CASES = {
    "new method": OLD.replace("        self.steps += 1\n", "        self.steps += 1\n" + HOOK),
    "new class": OLD.replace("\n\ndef fit(", "\n" + CLASS + "\ndef fit(").replace(
        "callbacks = [Tracker()]\n", "callbacks = [Tracker()]\n" + APPEND
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_statement_in_a_new_callback_hook_replays_bit_exact(project: Project, case: str) -> None:
    expected = CASES[case]
    project.write("train.py", OLD)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py", "--kwargs", "epochs=3")
    # Today's edit, not committed, with another default seed (the old run is not today's).
    project.write("train.py", expected.replace('rl.arg("seed", 0)', 'rl.arg("seed", 1)'))

    with tempfile.TemporaryDirectory() as tmp:
        old_file = Path(tmp) / "old_train.py"
        old_file.write_text(OLD)
        diff = project.cli("propagate", "train.py", str(old_file), "--names", "w_max", "--diff")
        assert diff.returncode == 0, diff.stderr
        lines = diff.stdout.splitlines()
        added = [line[1:] for line in lines if line[:1] == "+" and line[:3] != "+++"]
        wanted = [line for line in (HOOK if case == "new method" else CLASS + APPEND).splitlines()]
        assert [a for a in added if a] == [w for w in wanted if w], diff.stdout
        told = {
            "new method": "carried today's method Tracker.on_epoch_end into the old class",
            "new class": f"carried today's class MaxLogger, created by `{APPEND.strip()}`",
        }
        assert told[case] in diff.stderr, diff.stderr
        shown = project.cli("propagate", "train.py", str(old_file), "--names", "w_max")
        assert shown.returncode == 0, shown.stderr
    propagated = shown.stdout
    assert propagated == expected

    out = project.cli("replay", "w_max", "--yes")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "inexact" not in out.stderr and "differs" not in out.stderr, out.stderr
    database = project.root / ".retrolog" / "retrolog.db"
    backfilled = {
        key[1:]: value
        for key, value in logged_values(database, "WHERE l.origin = 'backfilled'").items()
    }
    assert len(backfilled) == 3, backfilled
    assert backfilled == _fresh(project, propagated, "w_max")


def _fresh(project: Project, source: str, name: str) -> dict[object, object]:
    """What a fresh run of ``source`` (the old run's arguments) logs as ``name``."""
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        (where / "train.py").write_text(source)
        proc = subprocess.run(
            [sys.executable, "train.py", "--kwargs", "epochs=3"],
            cwd=where,
            env=project.env(RETROLOG_STORE=str(where / "store")),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        values = logged_values(where / "store" / "retrolog.db", "WHERE l.name = ?", (name,))
    return {key[1:]: value for key, value in values.items()}
