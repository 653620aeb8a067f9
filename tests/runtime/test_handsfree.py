"""The hands-free analysis and rewrite (runtime/handsfree.py) and ``retrolog run`` itself."""

from __future__ import annotations

import json
import sqlite3
import textwrap

import numpy as np

from retrolog.runtime.handsfree import analyse, checkpoint_objects, explain, instrumented_text

from conftest import Project

CALLED = textwrap.dedent(
    """\
    def train(net, opt, data):
        net.train()
        for batch in enumerate(data):
            opt.step()

    def main():
        data, net, opt = [1, 2], object(), object()
        for epoch in range(3):
            train(net, opt, data)
            total = epoch

    main()
    """
)


def test_a_loop_nested_through_a_called_function_is_a_training_loop() -> None:
    analysis = analyse(CALLED, "t.py")
    [loop] = analysis.loops
    assert (loop.line, loop.name, loop.function) == (8, "epoch", "main")
    assert [(i.line, i.name, i.function) for i in loop.inner] == [(3, "step", "train")]
    # the callee changes its parameters net and opt: the caller's objects of those names
    assert loop.mutated == ["net", "opt"]
    assert loop.plain == ["total"]
    assert loop.restorable
    text = instrumented_text(CALLED, "t.py")
    assert "__retrolog_handsfree__.loop('step', enumerate(data))" in text
    assert "with __retrolog_handsfree__.checkpointing(0, locals(), globals()):" in text


def test_an_instrumented_script_runs_as_it_is() -> None:
    source = (
        "import retrolog as rl\n"
        "opt = make()\n"
        "with rl.checkpointing(opt=opt):\n"
        "    for epoch in rl.loop('epoch', range(2)):\n"
        "        for b in range(2):\n"
        "            opt.step()\n"
    )
    analysis = analyse(source, "t.py")
    assert analysis.loops == []
    assert "already calls rl.loop or rl.checkpointing" in explain(analysis)
    assert "__retrolog_handsfree__.loop" not in instrumented_text(source, "t.py")


def test_generators_and_globals_make_a_loop_uncertain() -> None:
    source = textwrap.dedent(
        """\
        seen = 0
        opt = make()

        def batches():
            for i in range(4):
                yield i

        def bump():
            global seen
            seen += 1

        for epoch in batches():
            for b in range(2):
                opt.step()
                bump()
        """
    )
    [loop] = analyse(source, "t.py").loops
    assert not loop.restorable
    said = " ".join(loop.uncertain)
    assert "generator batches()" in said and "global name(s) seen" in said
    assert "executed in replay, not restored" in explain(analyse(source, "t.py"))


def test_objects_are_chosen_from_their_values_when_the_loop_starts() -> None:
    source = textwrap.dedent(
        """\
        model, w, acc, tracker, tick = make()
        for epoch in range(2):
            for b in range(2):
                model.step()
                w.sum()
                acc[0] = 1
                tracker.update(1)
                tick()
        """
    )
    [loop] = analyse(source, "t.py").loops

    class Model:
        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    def counter() -> object:
        count = 0

        def tick() -> int:
            nonlocal count
            count += 1
            return count

        return tick

    assert loop.candidates == ["acc", "model", "tick", "tracker", "w"]
    assert loop.mutated == ["acc", "model", "tracker", "w"] and loop.in_place == ["acc"]
    values = {"model": Model(), "w": np.zeros(3), "acc": np.zeros(2), "tick": counter(),
              "tracker": object()}  # fmt: skip
    objects, _, uncertain = checkpoint_objects(loop, values, lambda v: isinstance(v, np.ndarray))
    # w.sum() reads w: an array is kept only when assigned into or changed in place
    assert sorted(objects) == ["acc", "model"]
    assert uncertain == [
        "tick() keeps state in a closure",
        "tracker (object) has no state_dict() and the loop changes it",
    ]


SCRIPT = '''\
"""The script's docstring."""
import argparse

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--seed", type=int, default=0)
cli = parser.parse_args()
print("doc", __doc__, "name", __name__)


class State:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]

    def add(self):
        self.n += 1


state = State()
for epoch in range(2):
    for step in range(3):
        state.add()
        if cli.seed == 7 and epoch == 1:
            raise ValueError("stop here")
'''


def test_retrolog_run_records_the_script_as_python_would_run_it(project: Project) -> None:
    project.write("train.py", SCRIPT)
    proc = project.cli("run", "train.py", "--seed", "3", "--kwargs", "lr=0.5")
    assert proc.returncode == 0, proc.stderr
    assert "doc The script's docstring. name __main__" in proc.stdout
    with sqlite3.connect(project.root / ".retrolog" / "retrolog.db") as conn:
        argv, parsed, record = conn.execute(
            "SELECT argv, parsed_args, checkpointing FROM runs"
        ).fetchone()
        loops = conn.execute("SELECT name, COUNT(*) FROM loops GROUP BY name").fetchall()
    assert json.loads(argv) == ["train.py", "--seed", "3", "--kwargs", "lr=0.5"]
    assert json.loads(parsed) == {"seed": 3}
    [loop] = json.loads(record)["handsfree"]["loops"]
    assert (loop["line"], loop["name"], loop["objects"]) == (25, "epoch", ["state"])
    assert sorted(loops) == [("epoch", 2), ("step", 6)]


def test_a_traceback_points_at_the_users_lines(project: Project) -> None:
    project.write("train.py", SCRIPT)
    proc = project.cli("run", "train.py", "--seed", "7")
    assert proc.returncode == 1
    assert 'train.py", line 29, in <module>' in proc.stderr
    assert 'raise ValueError("stop here")' in proc.stderr
    assert (project.root / "train.py").read_text() == SCRIPT


def test_a_missing_script_is_one_clear_paragraph(project: Project) -> None:
    proc = project.cli("run", "nothere.py")
    assert proc.returncode == 1
    assert "no script 'nothere.py'" in proc.stderr and "Traceback" not in proc.stderr
