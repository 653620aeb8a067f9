"""Unmodified scripts recorded with ``retrolog run`` and replayed, as a user would.

``examples/train_digits.py`` and ``examples/mnist_cnn.py`` lose every ``rl.`` call but
``rl.log`` (``rl.arg(name, default)`` becomes its default, ``rl.loop(name, it)`` its
iterable, ``with rl.checkpointing(...)`` its body), with less data so each run takes
seconds. Two code versions are recorded with ``retrolog run``; today's edit adds the
weight norm per epoch; ``retrolog replay`` at default settings must backfill, bit for bit,
what a fresh ``retrolog run`` of each run's version with the statement propagated into it
logs, restoring outer epochs from checkpoints. A script the analysis cannot understand (a
``while`` loop driven by a callback, state in a closure) is explained, recorded without
checkpoints, and replayed exactly by executing.
"""

from __future__ import annotations

import ast
import sqlite3
from pathlib import Path

import pytest

from conftest import Project, logged_values

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The defaults the tests run at: the adaptive checkpoint policy, as users run.
DEFAULTS = {"RETROLOG_CHECKPOINTS": "adaptive"}


class _StripRetrolog(ast.NodeTransformer):
    """Every ``rl.`` call but ``rl.log`` taken out, as a script written without retrolog."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        named = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        if named and func.value.id == "rl" and func.attr in ("loop", "arg"):  # type: ignore[attr-defined]
            return node.args[1]
        return node

    def visit_With(self, node: ast.With) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        call = node.items[0].context_expr
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "checkpointing":
            return node.body
        return node


def unmodified(example: str, *edits: tuple[str, str]) -> str:
    tree = _StripRetrolog().visit(ast.parse((EXAMPLES / example).read_text()))
    text = ast.unparse(ast.fix_missing_locations(tree)) + "\n"
    for old, new in edits:
        assert old in text, f"{example} no longer contains {old!r}"
        text = text.replace(old, new)
    assert "rl.loop" not in text and "rl.checkpointing" not in text and "rl.arg" not in text
    return text


def _commit(project: Project, text: str, message: str) -> str:
    project.write("train.py", text)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", message)
    return project.git("rev-parse", "HEAD").strip()


def _record(project: Project, *args: str) -> None:
    proc = project.cli("run", "train.py", *args, **DEFAULTS)
    assert proc.returncode == 0, proc.stderr


def _propagated_fresh(
    project: Project, commit: str, args: tuple[str, ...], name: str, database: Path
) -> dict[int, object]:
    """``name`` per epoch from a fresh ``retrolog run`` of ``commit``'s train.py with today's
    statement propagated into it."""
    project.write("old.py", project.git("show", f"{commit}:train.py"))
    proc = project.cli("propagate", "train.py", "old.py", "--names", name)
    assert proc.returncode == 0, proc.stderr
    project.write("check.py", proc.stdout)
    before = {r for (r, *_rest) in logged_values(database)}
    proc = project.cli("run", "check.py", *args, **DEFAULTS)
    assert proc.returncode == 0, proc.stderr
    values = logged_values(database, "WHERE l.name = ?", (name,))
    return {e: v for (r, _, e, _s), v in values.items() if r not in before}


def _replayed(database: Path, run_id: str, name: str) -> dict[int, object]:
    values = logged_values(database, "WHERE l.name = ? AND l.run_id = ?", (name, run_id))
    return {e: v for (_, _, e, _s), v in values.items()}


def _runs(database: Path) -> list[str]:
    with sqlite3.connect(database) as conn:
        return [r for (r,) in conn.execute("SELECT run_id FROM runs ORDER BY started_at")]


def _restored(database: Path) -> int:
    with sqlite3.connect(database) as conn:
        return int(conn.execute("SELECT COALESCE(SUM(restored), 0) FROM replay_runs").fetchone()[0])


def _hindsight(project: Project, text: str, after: str, statement: str) -> None:
    assert after in text
    project.write("train.py", text.replace(after, after + statement))


def _check_exact(project: Project, versions: list[tuple[str, tuple[str, ...]]], name: str) -> None:
    database = project.root / ".retrolog" / "retrolog.db"
    runs = _runs(database)
    assert len(runs) == len(versions)
    proc = project.cli("replay", name, "--yes", **DEFAULTS)
    assert proc.returncode == 0, proc.stderr
    assert "recorded hands-free (retrolog run)" in proc.stderr
    assert _restored(database) > 0, proc.stderr  # outer epochs restored, not executed
    for run_id, (commit, args) in zip(runs, versions, strict=True):
        replayed = _replayed(database, run_id, name)
        fresh = _propagated_fresh(project, commit, args, name, database)
        assert replayed and replayed == fresh, (run_id, replayed, fresh)


DIGITS_SMALL = (
    (".repeat(16, 1), y[train_idx].repeat(16)", ".repeat(1, 1), y[train_idx].repeat(1)"),
    ("epochs = 6", "epochs = 3"),
    ("hidden = 256", "hidden = 64"),
)


def test_unmodified_digits_script_replays_exactly(project: Project) -> None:
    v1 = unmodified("train_digits.py", *DIGITS_SMALL, ("momentum=0.9", "momentum=0.5"))
    v2 = unmodified("train_digits.py", *DIGITS_SMALL)
    first = _commit(project, v1, "digits, momentum 0.5")
    _record(project, "--seed", "1")
    second = _commit(project, v2, "digits, momentum 0.9")
    _record(project, "--seed", "2")
    _hindsight(
        project,
        v2,
        "    scheduler.step()\n",
        "    rl.log('w_norm', sum(float(p.norm()) for p in net.parameters()))\n",
    )
    _check_exact(project, [(first, ("--seed", "1")), (second, ("--seed", "2"))], "w_norm")


def test_unmodified_mnist_script_replays_exactly(project: Project) -> None:
    v1 = unmodified("mnist_cnn.py", ("default=0.7", "default=0.5"))
    v2 = unmodified("mnist_cnn.py")
    args = ("--epochs", "3", "--train-size", "256")
    first = _commit(project, v1, "mnist, gamma 0.5")
    _record(project, *args)
    second = _commit(project, v2, "mnist, gamma 0.7")
    _record(project, *args)
    _hindsight(
        project,
        v2,
        "        scheduler.step()\n",
        "        rl.log('w_norm', sum(float(p.norm()) for p in model.parameters()))\n",
    )
    _check_exact(project, [(first, args), (second, args)], "w_norm")


def test_explain_prints_the_inference_and_runs_nothing(project: Project) -> None:
    project.write("train.py", unmodified("mnist_cnn.py"))
    proc = project.cli("run", "--explain", "train.py", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "training loop train.py:" in out and "in main(): rl.loop('epoch')" in out
    assert "in train(): rl.loop('step')" in out
    assert (
        "changed by the loop (method called or assigned into): model, optimizer, scheduler" in out
    )
    assert "plain variables it assigns: accuracy, test_loss" in out
    # synthetic_digits() builds data in a nested loop: no training state, executed as it is
    assert "calls no method of an object made before it" in out
    assert not (project.root / ".retrolog").exists()


UNCLEAR = '''\
import numpy as np

import retrolog as rl


class Stopper:
    """Says when to stop: the loop's end is decided by what runs inside it."""

    def __init__(self, patience):
        self.patience, self.seen = patience, 0

    def done(self):
        return self.seen >= self.patience

    def update(self, value):
        self.seen += 1


def make_counter():
    count = 0

    def tick():
        nonlocal count
        count += 1
        return count

    return tick


rng = np.random.default_rng(0)
w = np.zeros(4)
tick = make_counter()
stopper = Stopper(3)
while not stopper.done():
    for step in range(5):
        w += 0.1 * rng.standard_normal(4)
    stopper.update(float(w.sum()))
    rl.log("w_sum", float(w.sum()))

for epoch in range(3):
    for step in range(4):
        w += 0.01 * tick() * rng.standard_normal(4)
        stopper.update(0.0)
    rl.log("w0", float(w[0]))
'''


def test_a_script_the_analysis_cannot_understand_is_executed_exactly(project: Project) -> None:
    commit = _commit(project, UNCLEAR, "a loop driven by a callback, a counter in a closure")
    proc = project.cli("run", "--explain", "train.py")
    assert proc.returncode == 0, proc.stderr
    assert "a while loop with a nested loop" in proc.stdout
    assert "executed, not restored" in proc.stdout
    proc = project.cli("run", "train.py", **DEFAULTS)
    assert proc.returncode == 0, proc.stderr
    # Decided when the loop starts: the closure's counter and the Stopper, which has no
    # state_dict(), cannot be checkpointed, so the loop is recorded without checkpoints.
    assert "tick() keeps state in a closure" in proc.stderr
    assert "stopper (Stopper) has no state_dict()" in proc.stderr
    project.write(
        "train.py",
        UNCLEAR.replace(
            '    rl.log("w0", float(w[0]))\n',
            '    rl.log("w0", float(w[0]))\n    rl.log("w1", float(w[1]))\n',
        ),
    )
    database = project.root / ".retrolog" / "retrolog.db"
    [run_id] = _runs(database)
    proc = project.cli("replay", "w1", "--yes", **DEFAULTS)
    assert proc.returncode == 0, proc.stderr
    assert "executed, not restored" in proc.stderr
    replayed = _replayed(database, run_id, "w1")
    fresh = _propagated_fresh(project, commit, (), "w1", database)
    assert len(replayed) == 3 and replayed == fresh
