"""Event-driven loops (rl.begin/rl.end, rl.restore_block, rl.volatile) recorded and replayed.

The loop lives in a module of its own that calls the script's hooks, as a framework's
fit loop does; the script only writes callbacks. Replay of a statement in the epoch
hook restores the blocks the adaptive rule kept and trains the others; one in the step
hook executes the steps; both compared bit for bit with fresh runs of today's code.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from conftest import Project, logged_values, read_db

pytestmark = pytest.mark.slow

FIT = """\
import time

import torch
from torch import nn

import retrolog as rl


class Fit:
    # A fit loop that calls hooks: its loops are no Python iterators the script sees.
    def __init__(self, net, opt, x, y, callbacks, epochs, steps):
        self.net, self.opt, self.x, self.y = net, opt, x, y
        self.callbacks, self.epochs, self.steps = callbacks, epochs, steps

    def fit(self):
        rl.volatile("epoch_seconds")
        with rl.checkpointing(net=self.net, opt=self.opt):
            for epoch in range(self.epochs):
                rl.begin("epoch", epoch)
                started = time.perf_counter()
                if not rl.restore_block():
                    for step in range(self.steps):
                        rl.begin("step", step)
                        batch = torch.randint(0, len(self.x), (32,))
                        self.opt.zero_grad()
                        loss = nn.functional.cross_entropy(self.net(self.x[batch]), self.y[batch])
                        loss.backward()
                        self.opt.step()
                        rl.log("loss", loss.item())
                        for callback in self.callbacks:
                            callback.on_step_end(self, step)
                    rl.end("step")
                for callback in self.callbacks:
                    callback.on_epoch_end(self, epoch)
                rl.log("epoch_seconds", time.perf_counter() - started)
            rl.end("epoch")
"""

V1 = """\
import torch
from torch import nn

import retrolog as rl
from fitloop import Fit


class Report:
    def on_step_end(self, fit, step):
        pass

    def on_epoch_end(self, fit, epoch):
        with torch.no_grad():
            acc = (fit.net(fit.x).argmax(1) == fit.y).float().mean().item()
        rl.log("acc", acc)


torch.manual_seed(0)
x = torch.randn(512, 16)
y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).long()
net = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 2))
opt = torch.optim.SGD(net.parameters(), lr=rl.arg("lr", 0.1), momentum=0.9)
Fit(net, opt, x, y, [Report()], epochs=rl.arg("epochs", 6), steps=40).fit()
"""

# A later version: a line added before training.
V2 = V1.replace("torch.manual_seed(0)\n", "torch.manual_seed(0)\nwidth = 128\n").replace(
    "nn.Linear(16, 128)", "nn.Linear(16, width)"
)

# Today's code: a weight norm per epoch, a gradient norm per step, in the hooks.
NEWEST = V2.replace(
    "    def on_step_end(self, fit, step):\n        pass\n",
    "    def on_step_end(self, fit, step):\n"
    '        rl.log("grad", fit.net[0].weight.grad.norm().item())\n',
).replace(
    '        rl.log("acc", acc)\n',
    '        rl.log("acc", acc)\n'
    '        rl.log("w_norm", sum(p.norm().item() for p in fit.net.parameters()))\n',
)

ADAPTIVE = {"RETROLOG_CHECKPOINTS": "adaptive"}  # the default users run with


def _record(project: Project) -> list[str]:
    project.write("fitloop.py", FIT)
    project.write("train.py", V1)
    project.run("train.py", "--kwargs", "lr=0.05", **ADAPTIVE)
    project.write("train.py", V2)
    project.run("train.py", "--kwargs", "epochs=5", **ADAPTIVE)
    project.write("train.py", NEWEST)
    return [str(r) for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]


def _fresh(project: Project, kwargs: list[str]) -> dict[tuple[object, ...], object]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        project.run("train.py", "--kwargs", *kwargs, RETROLOG_STORE=str(store), **ADAPTIVE)
        values = logged_values(store / "retrolog.db")
    return {key[1:]: value for key, value in values.items()}


@pytest.mark.usefixtures("whole_machine")  # torch's default threads
def test_event_loops_record_every_step_and_replay_exactly(project: Project) -> None:
    runs = _record(project)
    database = project.root / ".retrolog" / "retrolog.db"
    recorded = logged_values(database, "WHERE l.run_id = ?", (runs[0],))
    # Every step's loss has its own context under its epoch.
    losses = {(e, s) for (_, name, e, s) in recorded if name == "loss"}
    assert losses == {(e, s) for e in range(6) for s in range(40)}
    assert {e for (_, name, e, s) in recorded if name == "acc" and s is None} == set(range(6))
    kept = {
        int(str(it))
        for (it,) in read_db(
            project.root,
            "SELECT l.iteration FROM checkpoints c JOIN loops l ON l.run_id = c.run_id"
            " AND l.ctx_id = c.ctx_id WHERE c.run_id = ? AND c.kind = 'block'",
            (runs[0],),
        )
    }
    assert kept, "the adaptive rule kept no epoch"

    # The outer statement: epochs the rule kept are restored, not trained.
    out = project.cli("replay", "w_norm", "--yes", **ADAPTIVE)
    assert out.returncode == 0, out.stderr
    assert "outer loop" in out.stderr
    # The wall-clock figure is recomputed but not compared, and said so.
    assert "volatile" in out.stderr and "epoch_seconds" in out.stderr
    assert "differs" not in out.stderr
    restored = read_db(
        project.root, "SELECT restored FROM replay_runs WHERE run_id = ?", (runs[0],)
    )
    assert restored == [(len(kept),)]

    # The inner statement executes the steps.
    out = project.cli("replay", "grad", "--yes", **ADAPTIVE)
    assert out.returncode == 0, out.stderr

    fresh = [_fresh(project, ["lr=0.05"]), _fresh(project, ["epochs=5"])]
    for run_id, reference in zip(runs, fresh, strict=True):
        replayed = logged_values(
            database, "WHERE l.run_id = ? AND l.origin = 'backfilled'", (run_id,)
        )
        got = {key[1:]: value for key, value in replayed.items()}
        for name in ("w_norm", "grad"):
            expected = {k: v for k, v in reference.items() if k[0] == name}
            assert expected, name
            assert {k: v for k, v in got.items() if k[0] == name} == expected, (run_id, name)


def test_end_without_begin_and_misnested_end_say_what_to_do(project: Project) -> None:
    project.write(
        "bad.py",
        """\
        import retrolog as rl
        rl.log("x", 1)
        rl.end()
        """,
    )
    out = project.run("bad.py", check=False)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "rl.begin" in out.stderr
    project.write(
        "bad2.py",
        """\
        import retrolog as rl
        rl.begin("epoch", 0)
        rl.end("step")
        """,
    )
    out = project.run("bad2.py", check=False)
    assert out.returncode == 1
    said = " ".join(out.stderr.split())
    assert "Traceback" not in said and "no loop 'step' is open" in said


def test_refusals_before_any_run_are_one_paragraph_without_traceback(project: Project) -> None:
    # No recording call comes first: the script has not started a run when it is refused.
    for call in ("rl.end()", 'rl.begin("")', 'rl.loop("", range(2))', 'rl.volatile("")'):
        project.write("early.py", f"import retrolog as rl\n{call}\n")
        out = project.run("early.py", check=False)
        assert out.returncode == 1, call
        assert "Traceback" not in out.stderr, (call, out.stderr)
        assert "UsageError" in out.stderr and "early.py, line 2" in out.stderr, out.stderr
        if call == "rl.end()":  # the paragraph says what to call instead
            assert "Call rl.begin(name, ...)" in " ".join(out.stderr.split())
    out = project.run("early.py", check=False, RETROLOG_DEBUG="1")
    assert "Traceback" in out.stderr
    # A malformed --kwargs is refused at the first rl.arg, before the run starts.
    project.write("early.py", 'import retrolog as rl\nrl.arg("lr", 0.1)\n')
    out = project.run("early.py", "--kwargs", "lr", check=False)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "early.py, line 2" in out.stderr, out.stderr
    assert "name=value" in out.stderr


def test_loops_left_open_end_with_the_run(project: Project) -> None:
    project.write(
        "open.py",
        """\
        import retrolog as rl
        for epoch in range(3):
            rl.begin("epoch", epoch)
            for step in range(2):
                rl.begin("step")
                rl.log("loss", float(epoch * 10 + step))
        """,
    )
    project.run("open.py")
    rows = read_db(
        project.root,
        "SELECT name, iteration, value, t_end IS NOT NULL FROM loops ORDER BY ctx_id",
    )
    assert [(n, i) for n, i, _, _ in rows] == [
        ("epoch", 0), ("step", 0), ("step", 1),
        ("epoch", 1), ("step", 0), ("step", 1),
        ("epoch", 2), ("step", 0), ("step", 1),
    ]  # fmt: skip
    assert all(ended for *_, ended in rows)
    assert [v for n, _, v, _ in rows if n == "epoch"] == [0, 1, 2]
    values = logged_values(project.root / ".retrolog" / "retrolog.db")
    assert {(e, s): v for (_, _, e, s), v in values.items()} == {
        (e, s): float(e * 10 + s) for e in range(3) for s in range(2)
    }


def test_an_event_loop_cannot_end_around_a_running_for_loop(project: Project) -> None:
    project.write(
        "nested.py",
        """\
        import retrolog as rl
        rl.begin("epoch", 0)
        for step in rl.loop("step", range(3)):
            rl.log("loss", 1.0)
            rl.begin("epoch", 1)
        """,
    )
    out = project.run("nested.py", check=False)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    said = " ".join(out.stderr.split())
    assert "loop 'step', started inside it by rl.loop, is still running" in said
