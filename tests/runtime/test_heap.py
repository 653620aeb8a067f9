"""The heap a training process holds when its first loop starts is frozen out of Python's
full collections until the run ends (runtime/heap.py), and a heap the script froze itself
is left as the script set it."""

from __future__ import annotations

import json
from pathlib import Path

from training_scripts import new_project

SCRIPT = """\
import gc
import json
import sys

import retrolog as rl

if "--own-freeze" in sys.argv:
    gc.freeze()
own = gc.get_freeze_count()
# What a framework's import leaves: many containers, alive to the end.
heap = [[i] for i in range(200_000)]
seen = {"own": own}
state = {"w": [0.0] * 100}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(3)):
        seen.setdefault("in_loop", gc.get_freeze_count())
        # Containers that survive a while, as checkpoint snapshots are.
        state["w"] = [[float(epoch)] * 10 for _ in range(100)]
        rl.log("epoch_sum", float(epoch))
seen["after_loop"] = gc.get_freeze_count()
rl.commit()
seen["after_commit"] = gc.get_freeze_count()
print(json.dumps(seen))
"""


def _record(tmp_path: Path, *args: str) -> dict[str, int]:
    project = new_project(tmp_path / "proj")
    project.write("train.py", SCRIPT)
    project.git("add", "train.py")
    project.git("commit", "-qm", "train")
    done = project.run("train.py", *args)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_the_heap_at_the_first_loop_is_frozen_until_the_run_ends(tmp_path: Path) -> None:
    seen = _record(tmp_path)
    assert seen["own"] == 0
    # Every object alive when training started: at least the 200,000 lists.
    assert seen["in_loop"] > 200_000, seen
    assert seen["after_loop"] > 200_000, seen  # the run goes on after its loop
    assert seen["after_commit"] == 0, seen  # handed back when the run ends


def test_a_heap_the_script_froze_itself_is_left_frozen(tmp_path: Path) -> None:
    seen = _record(tmp_path, "--own-freeze")
    assert seen["own"] > 0
    # Not frozen again (the 200,000 lists made since stay collectable), and not
    # unfrozen by the run's end. (The count falls as frozen objects are freed.)
    assert 0 < seen["in_loop"] <= seen["own"], seen
    assert 0 < seen["after_commit"] <= seen["own"], seen
