"""Recording through the public API: runs, contexts, values, timings, checkpoints."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from conftest import Project, read_db

NESTED = """
    import retrolog as rl

    rl.log("before", 1)
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(4)):
            rl.log("loss", epoch * 10.0 + step)
        rl.log("acc", epoch / 10)
    rl.log("final", "done")
"""


def test_nested_loops_make_contexts_with_parents(project: Project) -> None:
    project.write("train.py", NESTED)
    project.run("train.py")
    loops = read_db(
        project.root,
        "SELECT ctx_id, parent_ctx, name, iteration, value, depth, t_start, t_end FROM loops"
        " ORDER BY ctx_id",
    )
    epochs = [row for row in loops if row[2] == "epoch"]
    steps = [row for row in loops if row[2] == "step"]
    assert [(r[3], r[4], r[5], r[1]) for r in epochs] == [(i, i, 0, None) for i in range(3)]
    assert len(steps) == 12
    for row in steps:
        parent = next(e for e in epochs if e[0] == row[1])
        assert row[5] == 1
        assert parent[6] <= row[6] <= row[7] <= parent[7]  # nested in time too
    # Each log sits in the innermost context; before/final are run-level.
    logs = read_db(
        project.root,
        "SELECT l.name, l.value, l.value_type, c.name, c.iteration, p.iteration FROM logs l"
        " LEFT JOIN loops c ON c.run_id = l.run_id AND c.ctx_id = l.ctx_id"
        " LEFT JOIN loops p ON p.run_id = c.run_id AND p.ctx_id = c.parent_ctx ORDER BY l.log_id",
    )
    assert logs[0] == ("before", 1, "int", None, None, None)
    losses = [r for r in logs if r[0] == "loss"]
    assert [(r[1], r[3], r[5], r[4]) for r in losses[:5]] == [
        (0.0, "step", 0, 0),
        (1.0, "step", 0, 1),
        (2.0, "step", 0, 2),
        (3.0, "step", 0, 3),
        (10.0, "step", 1, 0),
    ]
    accs = [r for r in logs if r[0] == "acc"]
    assert [(r[1], r[2], r[3], r[4]) for r in accs] == [
        (0.0, "float", "epoch", 0),
        (0.1, "float", "epoch", 1),
        (0.2, "float", "epoch", 2),
    ]
    assert logs[-1] == ("final", "done", "str", None, None, None)


def test_run_metadata(project: Project) -> None:
    project.write("sub/train.py", NESTED)
    project.run("sub/train.py")
    rows = read_db(
        project.root,
        "SELECT projid, filename, status, tstamp, ended_at > started_at, host, python,"
        " packages, code_ref, code_commit FROM runs",
    )
    assert len(rows) == 1
    projid, filename, status, tstamp, ordered, host, python, packages, ref, commit = rows[0]
    assert (projid, filename, status, ordered) == ("proj", "sub/train.py", "finished", 1)
    assert len(tstamp) == 19 and tstamp[10] == "T"
    assert host and python.count(".") == 2
    assert "numpy" in json.loads(packages)
    assert ref.startswith("refs/retrolog/runs/") and len(commit) == 40
    assert project.git("rev-parse", ref).strip() == commit


def test_profile_has_prefix_iterations_blocks_and_suffix(project: Project) -> None:
    project.write(
        "train.py",
        """
        import time
        import retrolog as rl

        time.sleep(0.2)
        for epoch in rl.loop("epoch", range(2)):
            for step in rl.loop("step", range(2)):
                time.sleep(0.05)
            time.sleep(0.1)
        time.sleep(0.15)
        """,
    )
    project.run("train.py")
    rows = read_db(project.root, "SELECT phase, ctx_id, seconds, block_seconds FROM profile")
    phases = {r[0]: r for r in rows if r[0] != "iteration"}
    iterations = [r for r in rows if r[0] == "iteration"]
    assert phases["prefix"][2] >= 0.2
    assert 0.15 <= phases["suffix"][2] < 1.0
    assert len(iterations) == 2
    for _, _, seconds, block in iterations:
        assert 0.1 <= block < seconds  # the nested loop is inside the iteration
        assert seconds - block >= 0.1  # and the sleep after it is outside the block


def test_value_types_are_kept(project: Project) -> None:
    project.write(
        "train.py",
        """
        import numpy as np
        import torch
        import retrolog as rl

        class Thing:
            def __str__(self):
                return "a thing"

        rl.log("f", 2.0)
        rl.log("i", 3)
        rl.log("b", True)
        rl.log("s", "x")
        rl.log("n", None)
        rl.log("nan", float("nan"))
        rl.log("np_f", np.float32(0.5))
        rl.log("np_i", np.int64(7))
        rl.log("tensor_scalar", torch.tensor(1.5, requires_grad=True) * 2)
        rl.log("vector", torch.arange(3))
        rl.log("d", {"a": [1, 2], "b": 0.5})
        rl.log("obj", Thing())
        assert rl.log("ret", 5) == 5
        """,
    )
    project.run("train.py")
    rows = {
        name: (value, kind)
        for name, value, kind in read_db(project.root, "SELECT name, value, value_type FROM logs")
    }
    assert rows["f"] == (2.0, "float") and isinstance(rows["f"][0], float)
    assert rows["i"] == (3, "int")
    assert rows["b"] == (1, "bool")
    assert rows["s"] == ("x", "str")
    assert rows["n"] == (None, "none")
    assert rows["nan"] == (None, "float")  # SQLite has no NaN: NULL typed float
    assert rows["np_f"] == (0.5, "float")
    assert rows["np_i"] == (7, "int")
    assert rows["tensor_scalar"] == (3.0, "float")
    assert rows["vector"] == ("[0, 1, 2]", "json")
    assert json.loads(rows["d"][0]) == {"a": [1, 2], "b": 0.5}
    assert rows["obj"] == ("a thing", "text")


def test_exception_marks_the_run_crashed_and_keeps_its_values(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        for epoch in rl.loop("epoch", range(5)):
            rl.log("loss", float(epoch))
            if epoch == 2:
                raise RuntimeError("diverged")
        """,
    )
    proc = project.run("train.py", check=False)
    assert proc.returncode == 1 and "diverged" in proc.stderr
    ((status, error),) = read_db(project.root, "SELECT status, error FROM runs")
    assert status == "crashed" and "RuntimeError: diverged" in error
    assert read_db(project.root, "SELECT value FROM logs WHERE name='loss' ORDER BY log_id") == [
        (0.0,),
        (1.0,),
        (2.0,),
    ]


def test_commit_ends_a_run_and_a_later_call_starts_another(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        rl.log("x", 1)
        rl.commit()
        rl.log("x", 2)
        """,
    )
    project.run("train.py")
    rows = read_db(
        project.root,
        "SELECT r.status, l.value FROM runs r JOIN logs l USING (run_id) ORDER BY r.started_at",
    )
    assert rows == [("finished", 1), ("finished", 2)]


def test_loop_break_and_non_sized_iterables(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        def gen():
            yield from "abc"
        for epoch in rl.loop("epoch", gen()):
            for step in rl.loop("step", range(100)):
                if step == 2:
                    break
                rl.log("loss", 1.0)
            rl.log("epoch_value", epoch)
        """,
    )
    project.run("train.py")
    assert read_db(project.root, "SELECT value FROM loops WHERE name='epoch'") == [
        ("a",),
        ("b",),
        ("c",),
    ]
    assert read_db(project.root, "SELECT COUNT(*) FROM loops WHERE name='step'") == [(9,)]
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name='loss'") == [(6,)]


def test_a_loop_ended_by_break_or_return_is_finished(project: Project) -> None:
    # Early stopping (break in the outer loop), a step loop cut short, a loop in a function
    # left by return: every iteration ended, and the replay plan calls none unfinished.
    project.write(
        "train.py",
        """
        import retrolog as rl

        def warm_up():
            for i in rl.loop("warm", range(10)):
                if i == 1:
                    return i

        warm_up()
        for epoch in rl.loop("epoch", range(10)):
            for step in rl.loop("step", range(100)):
                if step == 2:
                    break
            rl.log("loss", 1.0 / (epoch + 1))
            if epoch == 2:
                break
        """,
    )
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    project.run("train.py")
    assert read_db(
        project.root, "SELECT name, COUNT(*) FROM loops GROUP BY name ORDER BY name"
    ) == [
        ("epoch", 3),
        ("step", 9),
        ("warm", 2),
    ]
    assert read_db(project.root, "SELECT COUNT(*) FROM loops WHERE t_end IS NULL") == [(0,)]
    project.write(
        "train.py",
        (project.root / "train.py")
        .read_text()
        .replace(
            '    rl.log("loss", 1.0 / (epoch + 1))\n',
            '    rl.log("loss", 1.0 / (epoch + 1))\n    rl.log("half", 0.5 / (epoch + 1))\n',
        ),
    )
    plan = project.cli("replay", "half", "--dry-run")
    assert plan.returncode == 0, plan.stderr
    assert "unfinished" not in plan.stderr, plan.stderr


def test_the_iteration_a_run_crashed_in_is_not_finished(project: Project) -> None:
    project.write(
        "train.py",
        """
        import retrolog as rl
        for epoch in rl.loop("epoch", range(5)):
            for step in rl.loop("step", range(3)):
                if epoch == 1 and step == 1:
                    raise RuntimeError("diverged")
        """,
    )
    project.run("train.py", check=False)
    open_ = read_db(
        project.root, "SELECT name, iteration FROM loops WHERE t_end IS NULL ORDER BY ctx_id"
    )
    assert open_ == [("epoch", 1), ("step", 1)]


def test_log_rejects_a_non_string_name(project: Project) -> None:
    project.write("train.py", "import retrolog as rl\nrl.log(3, 1.0)\n")
    proc = project.run("train.py", check=False)
    assert "UsageError" in proc.stderr and "non-empty string name" in proc.stderr


def test_recording_outside_git_uses_a_private_git_dir(plain_dir: Project) -> None:
    plain_dir.write("train.py", NESTED)
    plain_dir.run("train.py")
    ((status, projid, ref, git_dir, head),) = read_db(
        plain_dir.root, "SELECT status, projid, code_ref, git_dir, head_commit FROM runs"
    )
    assert (status, projid, head) == ("finished", "plain", None)
    assert git_dir.endswith(".retrolog/git")
    assert not (plain_dir.root / ".git").exists()
    assert read_db(plain_dir.root, "SELECT COUNT(*) FROM logs WHERE name='loss'") == [(12,)]
    assert ref.startswith("refs/retrolog/runs/")


def test_store_location_can_be_overridden(project: Project, tmp_path: object) -> None:
    project.write("train.py", NESTED)
    elsewhere = project.root.parent / "elsewhere-store"
    project.run("train.py", RETROLOG_STORE=str(elsewhere))
    assert (elsewhere / "retrolog.db").exists()
    assert not (project.root / ".retrolog").exists()


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_infinite_floats_round_trip(project: Project, value: float) -> None:
    project.write("train.py", f"import retrolog as rl\nrl.log('x', float('{value}'))\n")
    project.run("train.py")
    assert read_db(project.root, "SELECT value, value_type FROM logs") == [(value, "float")]


def test_large_arrays_are_exact_up_to_the_limit_and_refused_past_it(project: Project) -> None:
    """Up to 100,000 elements an array is its exact JSON; past it (or a list past 10,000
    items) a note says what was left out, a warning says so once per name, and the call
    costs no more than for a small value: the content is never read."""
    project.write(
        "train.py",
        """
        import time

        import numpy as np
        import torch
        import retrolog as rl

        rng = np.random.default_rng(0)
        exact = rng.standard_normal(50_000)
        exact[3] = np.nan
        big = list(range(2_000_000))
        for epoch in rl.loop("epoch", range(3)):
            rl.log("exact", exact)
            rl.log("tensor", torch.arange(60_000, dtype=torch.float32).view(300, 200) / 7)
            rl.log("too_big", rng.standard_normal((500, 500)))
            started = time.perf_counter()
            rl.log("long_list", big)
            rl.log("call_seconds", time.perf_counter() - started)
        rl.log("exact_sum", float(np.nansum(exact)))
        """,
    )
    done = project.run("train.py")
    # One warning per name, naming what to do instead.
    assert done.stderr.count("'too_big' was logged as a ndarray of shape (500, 500)") == 1
    assert done.stderr.count("'long_list' was logged as a list with 2,000,000 items") == 1
    assert "Log a summary instead" in done.stderr

    rows = read_db(project.root, "SELECT name, value, value_type FROM logs")
    by_name: dict[str, list[tuple[object, object]]] = {}
    for name, value, kind in rows:
        by_name.setdefault(str(name), []).append((value, kind))
    import numpy as np

    rng = np.random.default_rng(0)
    expected = rng.standard_normal(50_000)
    expected[3] = np.nan  # as the script set it
    for value, kind in by_name["exact"]:
        assert kind == "json"
        stored = json.loads(str(value))
        assert stored[3] == "nan" and len(stored) == 50_000
        assert np.array_equal(np.array([float(v) for v in stored]), expected, equal_nan=True)
    for value, kind in by_name["tensor"]:
        stored = json.loads(str(value))
        assert (
            kind == "json"
            and len(stored) == 300
            and stored[299][199] == np.float32(59_999) / np.float32(7)
        )
    for value, kind in by_name["too_big"]:
        assert kind == "text" and "250,000 elements, over rl.log's limit of 100,000" in str(value)
    for value, kind in by_name["long_list"]:
        assert kind == "text" and "2,000,000 items, over rl.log's limit of 10,000" in str(value)
    # Deciding to refuse reads the size, not the content: far from the 1.1 s a str() took.
    assert max(float(v) for v, _ in by_name["call_seconds"]) < 0.05

    shown = project.cli("dataframe", "exact")
    # The terminal gets the start of each cell (three rows here), not 50,000 numbers each.
    assert shown.returncode == 0 and len(shown.stdout) < 10_000
    whole = json.loads(project.cli("dataframe", "exact", "--json").stdout)
    assert len(whole[0]["exact"]) == 50_000


def test_a_large_array_nested_in_a_logged_value_is_named_by_its_path(project: Project) -> None:
    project.write(
        "train.py",
        """
        import numpy as np
        import retrolog as rl

        for epoch in rl.loop("epoch", range(2)):
            rl.log("stats", {"loss": 0.5, "grads": [np.zeros(3), np.zeros(200_000)]})
        """,
    )
    done = project.run("train.py")
    said = " ".join(done.stderr.split())
    assert said.count("'stats' at ['grads'][1] was logged as a ndarray of shape (200000,)") == 1
    assert "train.py:6: RetrologWarning" in said, said  # the script's line, not retrolog's
    stored = [json.loads(str(v)) for (v,) in read_db(project.root, "SELECT value FROM logs")]
    assert stored[0]["loss"] == 0.5 and stored[0]["grads"][0] == [0.0, 0.0, 0.0]
    assert "200,000 elements" in stored[0]["grads"][1]


def test_a_recording_does_not_load_the_replay_runtime(project: Project) -> None:
    """It is for replay workers only; loading it cost every run's start its import."""
    from retrolog import _api
    from retrolog.runtime import replay_worker as replay

    assert _api._REPLAY_SPEC_ENV == replay.SPEC_ENV
    project.write(
        "train.py",
        textwrap.dedent(
            """
            import sys
            import retrolog as rl

            for i in rl.loop("epoch", range(2)):
                rl.log("x", float(i))
            rl.commit()
            print("replay runtime loaded:", "retrolog.runtime.replay_worker" in sys.modules)
            """
        ),
    )
    out = project.run("train.py")
    assert "replay runtime loaded: False" in out.stdout
