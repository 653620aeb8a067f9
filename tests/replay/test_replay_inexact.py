"""A replay that is not exact is never silent: reported, marked in the store, non-zero exit.

The script's block changes state that ``checkpointing`` does not name (a
velocity buffer too large to travel with the checkpoint as a plain local), so
replaying it from checkpoints recomputes the recorded ``score`` differently.
"""

from __future__ import annotations

import json
import sqlite3

import pytest

from conftest import Project, read_db

pytestmark = pytest.mark.slow

SCRIPT = """\
import time

import numpy as np

import retrolog as rl

w = np.zeros(10)
velocity = np.zeros(5000)
with rl.checkpointing({named}):
    for epoch in rl.loop("epoch", range(4)):
        for step in rl.loop("step", range(3)):
            velocity += 1.0
            w += velocity[:10]
            time.sleep(0.02)  # training takes longer than restoring its checkpoint
        rl.log("score", float(w.sum() + velocity.sum()))
"""
STATEMENT = '        rl.log("score", float(w.sum() + velocity.sum()))\n'
NEW = '        rl.log("w_sum", float(w.sum()))\n'


def _record(project: Project, named: str) -> str:
    project.write("train.py", SCRIPT.format(named=named))
    project.run("train.py")  # every block checkpointed (the test default), so all restore
    project.write("train.py", SCRIPT.format(named=named).replace(STATEMENT, STATEMENT + NEW))
    ((run_id,),) = read_db(project.root, "SELECT run_id FROM runs")
    return str(run_id)


def test_a_failed_deferred_check_marks_reports_and_exits_non_zero(project: Project) -> None:
    run_id = _record(project, "w=w")
    out = project.cli("replay", "w_sum", "--yes")
    assert out.returncode == 1, out.stderr
    assert f"run {run_id}: recorded 'score' differs in replay" in out.stderr
    paragraph = next(line for line in out.stderr.splitlines() if "was not exact" in line)
    assert "only after restored checkpoints" in paragraph
    assert "rl.checkpointing" in paragraph and "--allow-inexact" in paragraph
    assert "Traceback" not in out.stderr
    # Stored, marked: by query, by the dataframe, by show.
    marks = read_db(project.root, "SELECT inexact, COUNT(*) FROM logs WHERE name = 'w_sum'")
    assert marks == [("mismatch", 4)]
    frame = json.loads(project.cli("dataframe", "w_sum", "--json").stdout)
    assert [row["inexact"] for row in frame] == ["w_sum"] * 4
    both = json.loads(project.cli("dataframe", "score", "w_sum", "--json").stdout)
    assert {row["inexact"] for row in both} == {"w_sum"}  # recorded score is not marked
    show = project.cli("show", run_id)
    assert "backfilled w_sum (4, replay" in show.stdout and "INEXACT" in show.stdout
    reason = read_db(project.root, "SELECT compared, inexact FROM replay_runs")
    assert reason[0][0] == 4 and "checkpoint" in str(reason[0][1])

    # --allow-inexact accepts it; the values are still marked.
    again = project.cli("replay", "w_sum", "--yes", "--force", "--allow-inexact")
    assert again.returncode == 0, again.stderr
    assert "was not exact" in again.stderr
    assert read_db(project.root, "SELECT DISTINCT inexact FROM logs WHERE name = 'w_sum'") == [
        ("mismatch",)
    ]
    # Replaying without --force says the marked values are there.
    none = project.cli("replay", "w_sum", "--yes")
    assert none.returncode == 0 and "marked inexact" in none.stderr

    # --verify finds it too, without backfilling anything.
    before = read_db(project.root, "SELECT COUNT(*) FROM logs")
    verified = project.cli("replay", "--verify", "--yes")
    assert verified.returncode == 1, verified.stderr
    assert "Verified 1 run(s): 0 replay exactly, 1 do not." in verified.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM logs") == before


def test_the_python_api_raises_unless_inexact_values_are_allowed(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = _record(project, "w=w")
    monkeypatch.chdir(project.root)
    import retrolog as rl
    from retrolog.errors import InexactReplayError

    with pytest.raises(InexactReplayError) as caught:
        rl.replay("w_sum")
    assert caught.value.run_ids == [run_id] and "allow_inexact=True" in str(caught.value)
    frame = rl.replay("w_sum", force=True, allow_inexact=True)
    assert list(frame["inexact"]) == ["w_sum"] * 4


def test_naming_the_state_makes_the_same_replay_exact(project: Project) -> None:
    _record(project, "w=w, velocity=velocity")
    out = project.cli("replay", "w_sum", "--yes")
    assert out.returncode == 0, out.stderr
    assert "differs" not in out.stderr and "not exact" not in out.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE inexact IS NOT NULL") == [(0,)]
    verified = project.cli("replay", "--verify", "--yes")
    assert verified.returncode == 0, verified.stderr
    assert "Verified 1 run(s): 1 replay exactly (" in verified.stderr


def test_an_environment_that_cannot_be_reproduced_is_in_the_plan(project: Project) -> None:
    run_id = _record(project, "w=w, velocity=velocity")
    # As if the run had been recorded with another numpy and on another CPU.
    conn = sqlite3.connect(project.root / ".retrolog" / "retrolog.db")
    packages = json.loads(conn.execute("SELECT packages FROM runs").fetchone()[0])
    numerics = json.loads(conn.execute("SELECT numerics FROM runs").fetchone()[0])
    packages["numpy"] = "0.9.8"
    numerics["machine"]["cpu"] = "Imaginary CPU 9000"
    conn.execute(
        "UPDATE runs SET packages = ?, numerics = ?", (json.dumps(packages), json.dumps(numerics))
    )
    conn.commit()
    conn.close()
    plan = project.cli("replay", "w_sum", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "cannot be reproduced here" in plan.stderr
    assert f"{run_id}: numpy 0.9.8 then" in plan.stderr and "Imaginary CPU 9000" in plan.stderr
    out = project.cli("replay", "w_sum", "--yes")
    assert out.returncode == 0, out.stderr  # the check passed: exit 0, values marked anyway
    marks = read_db(project.root, "SELECT DISTINCT inexact FROM logs WHERE name = 'w_sum'")
    assert marks == [("environment",)]
    show = project.cli("show", run_id)
    assert "possibly inexact" in show.stdout


def test_a_verification_that_compares_nothing_is_not_a_pass(project: Project) -> None:
    # Every value is logged inside the inner loop, whose blocks --verify restores from
    # their checkpoints: no recorded value is recomputed, so nothing is verified.
    project.write(
        "train.py",
        "import time\n\nimport numpy as np\n\nimport retrolog as rl\n\n"
        "w = np.zeros(2)\n"
        "with rl.checkpointing(w=w):\n"
        "    for epoch in rl.loop('epoch', range(3)):\n"
        "        for step in rl.loop('step', range(2)):\n"
        "            w += 0.5\n"
        "            time.sleep(0.1)  # training takes longer than restoring its checkpoint\n"
        "            rl.log('loss', float(w.sum()))\n",
    )
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py")
    verified = project.cli("replay", "--verify", "--yes")
    said = " ".join(verified.stderr.split())
    assert verified.returncode == 1, said
    assert "Nothing was verified: 1 run(s) replayed, but none of their recorded values" in said
    assert "replay exactly" not in said


def test_the_cause_names_a_generator_the_script_owns(project: Project) -> None:
    # The block draws from the script's own generator, which the checkpoint does not name:
    # restored, the block's state is right but the generator is back at its start.
    script = (
        "import time\n\nimport numpy as np\n\nimport retrolog as rl\n\n"
        "rng = np.random.default_rng(0)\n"
        "w = np.zeros(4)\n"
        "with rl.checkpointing(w=w):\n"
        "    for epoch in rl.loop('epoch', range(3)):\n"
        "        for step in rl.loop('step', range(2)):\n"
        "            w += rng.random(4)\n"
        "            time.sleep(0.05)  # training takes longer than restoring its checkpoint\n"
        "        rl.log('score', float(w.sum() + rng.random()))\n"
    )
    project.write("train.py", script)
    project.run("train.py")
    project.write("train.py", script + "        rl.log('w_sum', float(w.sum()))\n")
    out = project.cli("replay", "w_sum", "--yes")
    assert out.returncode == 1, out.stderr
    paragraph = " ".join(
        next(line for line in out.stderr.splitlines() if "was not exact" in line).split()
    )
    assert "only after restored checkpoints" in paragraph
    assert "any random generator besides the global ones" in paragraph, paragraph
    assert "env.np_random" in paragraph and "numpy Generator" in paragraph
