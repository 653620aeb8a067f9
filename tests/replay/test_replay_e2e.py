"""Replay through the CLI and the API, checked against fresh runs of the new code.

The exactness requirement: for a deterministic script, a value
obtained by replay equals, bit for bit, what a fresh run of that code version
with the statement logs; at every scan level, with dense and sparse
checkpoints. The script has dropout, a shuffled DataLoader and an LR scheduler
that is not checkpointed, and reads an ignored data file by relative path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import Project, RecordedOnce, read_db

pytestmark = pytest.mark.slow

V1 = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import retrolog as rl

offset = float(open("data/offset.txt").read())
lr = rl.arg("lr", 0.1)
epochs = rl.arg("epochs", 4)
torch.manual_seed(0)
x = torch.randn(192, 8) + offset
y = (x.sum(dim=1) > 8 * offset).long()
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
with rl.checkpointing(net=net, opt=opt):
    for epoch in rl.loop("epoch", range(epochs)):
        for xb, yb in rl.loop("step", loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            rl.log("loss", loss.item())
        sched.step()
        rl.log("acc", (net(x).argmax(1) == y).float().mean().item())
print("done")
"""

# Version 2 of the code: lines added around the loops (a user's later edits).
V2 = (
    V1.replace(
        "y = (x.sum(dim=1) > 8 * offset).long()\n",
        "y = (x.sum(dim=1) > 8 * offset).long()\nhidden = 2 * x.shape[1]  # width used below\n",
    )
    .replace("nn.Linear(8, 16), nn.ReLU()", "nn.Linear(8, hidden), nn.ReLU()")
    .replace("nn.Linear(16, 2)", "nn.Linear(hidden, 2)")
)

# Today's code: V2 plus hindsight statements at each scan level.
NEWEST = (
    V2.replace(
        "with rl.checkpointing(",
        'rl.log("n_params", sum(p.numel() for p in net.parameters()))\nwith rl.checkpointing(',
    )
    .replace(
        '            rl.log("loss", loss.item())\n',
        '            rl.log("loss", loss.item())\n'
        '            rl.log("grad", net[0].weight.grad.norm().item())\n',
    )
    .replace(
        "        sched.step()\n",
        "        sched.step()\n"
        '        rl.log("w_norm", sum(p.norm().item() for p in net.parameters()))\n',
    )
    .replace('print("done")\n', 'rl.log("final_norm", net[0].weight.norm().item())\n')
)


def _record(project: Project) -> None:
    project.write(".gitignore", "data/\n")
    project.write("data/offset.txt", "0.25\n")
    project.write("train.py", V1)
    project.run("train.py", "--kwargs", "lr=0.05")
    project.write("train.py", V2)
    project.run("train.py", "--kwargs", "lr=0.1", "epochs=3")
    project.write("train.py", NEWEST)


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory) -> RecordedOnce:
    return RecordedOnce.record(tmp_path_factory, _record)


@pytest.fixture
def project(recorded_once: RecordedOnce) -> Project:
    """The project after a run of V1 and one of V2, with today's code (NEWEST) in train.py:
    recorded once for the module, the same for each test."""
    return recorded_once.fresh()


def _runs(project: Project) -> list[str]:
    return [r for (r,) in read_db(project.root, "SELECT run_id FROM runs ORDER BY started_at")]


def _fresh(project: Project, kwargs: list[str]) -> dict[tuple[str, int | None, int | None], object]:
    """Values a fresh run of the newest code logs, keyed by (name, epoch, step)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        project.run("train.py", "--kwargs", *kwargs, RETROLOG_STORE=str(store))
        import sqlite3

        conn = sqlite3.connect(store / "retrolog.db")
        rows = conn.execute(
            "SELECT l.name, e.iteration, s.iteration, l.value FROM logs l"
            " LEFT JOIN loops s ON s.run_id = l.run_id AND s.ctx_id = l.ctx_id AND s.depth = 1"
            " LEFT JOIN loops e ON e.run_id = l.run_id AND e.ctx_id = COALESCE(s.parent_ctx,"
            " l.ctx_id) AND e.depth = 0"
        ).fetchall()
        conn.close()
    return {(n, e, s): v for n, e, s, v in rows}


def _replayed(
    project: Project, run_id: str, name: str
) -> dict[tuple[str, int | None, int | None], object]:
    rows = read_db(
        project.root,
        "SELECT l.name, e.iteration, s.iteration, l.value FROM logs l"
        " LEFT JOIN loops s ON s.run_id = l.run_id AND s.ctx_id = l.ctx_id AND s.depth = 1"
        " LEFT JOIN loops e ON e.run_id = l.run_id AND e.ctx_id = COALESCE(s.parent_ctx,"
        " l.ctx_id) AND e.depth = 0"
        " WHERE l.run_id = ? AND l.name = ? AND l.origin = 'backfilled'",
        (run_id, name),
    )
    return {(n, e, s): v for n, e, s, v in rows}


def _expected(fresh: dict, name: str) -> dict:
    return {k: v for k, v in fresh.items() if k[0] == name}


def test_replay_is_exact_at_every_scan_level_across_two_versions(project: Project) -> None:
    runs = _runs(project)
    # Sparse checkpoints in the second run: blocks 1 and 2 must then execute.
    import sqlite3

    conn = sqlite3.connect(project.root / ".retrolog" / "retrolog.db")
    conn.execute(
        "DELETE FROM checkpoints WHERE run_id = ? AND ctx_id IN (SELECT ctx_id FROM loops"
        " WHERE run_id = ? AND name = 'epoch' AND iteration IN (1, 2))",
        (runs[1], runs[1]),
    )
    conn.commit()
    conn.close()
    git_before = (project.git("status", "--porcelain"), project.git("rev-parse", "HEAD"))

    out = project.cli("replay", "w_norm", "--yes", "--workers", "2")
    assert out.returncode == 0, out.stderr
    assert "outer loop" in out.stderr
    out = project.cli("replay", "grad", "--yes", "--workers", "2")
    assert out.returncode == 0, out.stderr
    out = project.cli("replay", "final_norm,n_params", "--yes")
    assert out.returncode == 0, out.stderr
    assert "differs" not in out.stderr  # the deferred check found the recorded values again
    # Each replayed run's restore figures are kept: recording learns c from them.
    figures = read_db(
        project.root, "SELECT restored, restore_seconds FROM replay_runs WHERE restored > 0"
    )
    assert figures and all(float(str(seconds)) > 0 for _, seconds in figures)

    fresh = [_fresh(project, ["lr=0.05"]), _fresh(project, ["lr=0.1", "epochs=3"])]
    for run_id, reference in zip(runs, fresh, strict=True):
        for name in ("w_norm", "grad", "final_norm", "n_params"):
            expected = _expected(reference, name)
            assert expected, name
            assert _replayed(project, run_id, name) == expected, (run_id, name)

    # Nothing of the user's changed, and no temporary checkout is left behind.
    assert (project.git("status", "--porcelain"), project.git("rev-parse", "HEAD")) == git_before
    assert not list(Path(tempfile.gettempdir()).glob(f"retrolog-checkout-*-{runs[0]}-*"))
    assert (project.root / "data" / "offset.txt").read_text() == "0.25\n"

    # Replaying again adds nothing; --force recomputes without duplicating.
    again = project.cli("replay", "w_norm", "--yes")
    assert again.returncode == 0 and "nothing to replay" in again.stderr
    count = read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'w_norm'")
    forced = project.cli("replay", "w_norm", "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'w_norm'") == count

    # Provenance: each backfilled value names its replay and the code that produced it.
    rows = read_db(
        project.root,
        "SELECT DISTINCT l.replay_id, l.code_object, r.run_id FROM logs l JOIN replay_runs r"
        " ON r.replay_id = l.replay_id AND r.run_id = l.run_id WHERE l.name = 'w_norm'",
    )
    assert len(rows) == 2
    code_git = str(project.root / ".retrolog" / "code.git")
    # Kept through git's garbage collection of that repository: a ref reaches each.
    project.git("--git-dir", code_git, "gc", "--quiet", "--prune=now")
    for _, blob, _ in rows:
        # In the store's cache repository (docs/code-versions.md), not the user's.
        assert "w_norm" in project.git("--git-dir", code_git, "cat-file", "-p", blob)


def test_dry_run_shows_plan_and_diff_and_runs_nothing(project: Project) -> None:
    runs = _runs(project)
    out = project.cli("replay", "w_norm", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert runs[0] in out.stderr and "outer loop" in out.stderr
    assert '+        rl.log("w_norm"' in out.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'w_norm'") == [(0,)]


def test_statement_the_old_version_cannot_hold_is_reported_per_run(project: Project) -> None:
    runs = _runs(project)
    project.write(
        "train.py",
        NEWEST.replace('rl.log("w_norm"', 'rl.log("width", hidden)\n        rl.log("w_norm"'),
    )
    out = project.cli("replay", "width", "--yes")
    assert out.returncode == 0, out.stderr
    assert f"run {runs[0]}: not replayed" in out.stderr and "hidden" in out.stderr
    # It names the run, the statement (and where today's script has it), what is missing.
    today = project.root.joinpath("train.py").read_text().splitlines()
    line = today.index('        rl.log("width", hidden)') + 1
    assert f'`rl.log("width", hidden)` (line {line} of the new version)' in out.stderr
    values = read_db(
        project.root, "SELECT run_id, COUNT(*) FROM logs WHERE name='width' GROUP BY 1"
    )
    assert values == [(runs[1], 3)]


def test_a_failing_worker_is_reported_with_its_log(project: Project) -> None:
    shutil.rmtree(project.root / "data")  # the data the script reads is gone
    out = project.cli("replay", "w_norm", "--yes")
    assert out.returncode == 1
    assert "replay failed" in out.stderr and "offset.txt" in out.stderr
    assert "Traceback (most recent call last)" in out.stderr  # the worker's, quoted as its log tail
    assert ".log" in out.stderr


def test_python_api_returns_the_dataframe(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = _runs(project)
    monkeypatch.chdir(project.root)
    import retrolog as rl

    frame = rl.replay("w_norm", where="lr > 0.07", workers=1)
    assert set(frame["run_id"]) == {runs[1]}
    assert list(frame["epoch"]) == [0, 1, 2]
    assert frame["w_norm"].dtype == "float64" and frame["w_norm"].notna().all()
    details = json.loads(project.cli("show", runs[1], "--json").stdout)
    assert any(n["name"] == "w_norm" and n["origin"] == "backfilled" for n in details["names"])


def test_ctrl_c_stops_workers_and_removes_checkouts(project: Project) -> None:
    import signal
    import subprocess
    import time

    runs = _runs(project)
    # Forked workers start in milliseconds: the statement takes its time, so that the
    # interrupt finds them running (0.2 s a step, 18 and 24 steps).
    slow = '(__import__("time").sleep(0.2), net[0].weight.grad.norm().item())[1]'
    project.write("train.py", NEWEST.replace("net[0].weight.grad.norm().item()", slow))
    before = (project.git("status", "--porcelain"), project.git("rev-parse", "HEAD"))

    with project.start_cli("replay", "grad", "--yes", "--workers", "2") as proc:
        replays = project.root / ".retrolog" / "replays"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [
            log for log in replays.glob("*/*.log") if not log.name.startswith("forkserver-")
        ]:
            time.sleep(0.1)  # a worker's log (not the fork server's)
        time.sleep(1.0)  # the workers are importing torch or training
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Traceback" not in err
    for run_id in runs:
        assert not list(Path(tempfile.gettempdir()).glob(f"retrolog-checkout-*-{run_id}-*"))
        # Workers run from their checkout, whose path holds the run id: none is left.
        left = subprocess.run(
            ["pgrep", "-f", f"retrolog-checkout-.*-{run_id}-"], capture_output=True
        )
        assert left.stdout == b"", left.stdout
    assert (project.git("status", "--porcelain"), project.git("rev-parse", "HEAD")) == before
    rows = read_db(project.root, "SELECT status FROM replays")
    assert rows == [("interrupted",)], err


def test_renamed_variable_and_bad_where(project: Project) -> None:
    runs = _runs(project)
    # Today's code calls the model `model`; the recorded versions call it `net`.
    renamed = NEWEST.replace("net", "model")
    project.write("train.py", renamed)
    out = project.cli("replay", "w_norm", "lr < 0.07", "--yes")
    assert out.returncode == 0, out.stderr
    values = read_db(
        project.root, "SELECT run_id, COUNT(*) FROM logs WHERE name = 'w_norm' GROUP BY 1"
    )
    assert values == [(runs[0], 4)]  # the where clause chose the lr=0.05 run only
    fresh = _fresh(project, ["lr=0.05"])
    assert _replayed(project, runs[0], "w_norm") == _expected(fresh, "w_norm")

    bad = project.cli("replay", "w_norm", "lr >>> 1", "--yes", "--force")
    assert bad.returncode == 1 and "lr >>> 1" in bad.stderr and "Traceback" not in bad.stderr
    unknown = project.cli("replay", "w_nrom", "--yes")
    assert unknown.returncode == 1 and "w_norm" in unknown.stderr


def test_restored_optimizer_does_not_make_the_scheduler_warn(project: Project) -> None:
    runs = _runs(project)
    out = project.cli("replay", "w_norm", "--yes", "--workers", "2", OMP_NUM_THREADS="")
    assert out.returncode == 0, out.stderr
    logs = sorted((project.root / ".retrolog" / "replays").glob("*/*.log"))
    workers = [p for p in logs if not p.name.startswith("forkserver-")]
    assert len(workers) == len(runs)
    outputs = [json.loads(p.read_text()) for p in logs[0].parent.glob("*.out.json")]
    # Blocks were skipped by restoring them, and sched.step() ran after each of them: every
    # epoch-end checkpoint the adaptive rule kept (the first epoch's always, more as the
    # machine allowed) was restored, in each run.
    kept = dict(read_db(
        project.root, "SELECT run_id, COUNT(*) FROM checkpoints"
        " WHERE loop_name = 'epoch' AND kind = 'block' GROUP BY run_id"
    ))  # fmt: skip
    restored = {
        p.name.rsplit("-", 1)[0]: json.loads(p.read_text())["restored"]
        for p in logs[0].parent.glob("*.out.json")
    }
    assert restored == kept and len(kept) == len(runs), (restored, kept)
    # Each worker trained with its run's recorded thread count, however many workers share
    # the cores (more threads than cores only slow them down; fewer would change values).
    recorded = [json.loads(str(n))["torch"]["intra_op_threads"] for (n,) in read_db(
        project.root, "SELECT numerics FROM runs"
    )]  # fmt: skip
    assert sorted(o["threads"] for o in outputs) == sorted(recorded)
    assert "keeps its run's recorded" in out.stderr
    for log in logs:
        text = log.read_text()
        assert "before `optimizer.step()`" not in text, text
        assert "Warning" not in text, text
