"""Replay on Ray (docs/replay-on-ray.md), against the one-node cluster scripts/services.sh starts.

A numpy training script shaped like a real one (argparse, the loops inside functions,
a state checkpointed each epoch) is recorded for three seeds, then replayed with a new
statement as Ray tasks: the backfilled values must be exactly what a fresh recording
of the new script logs and what a local replay backfills, and replaying again adds no
row. A worker killed mid-task (the training process, or the Ray worker running it) is
reported with its log and the other runs finish; bad options are one-paragraph errors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Project, ray_env, read_db, values_by_run

pytestmark = pytest.mark.slow

SCRIPT = """\
import argparse
import os
import signal
import time
from pathlib import Path

import numpy as np

import retrolog as rl


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    # A replay that finds <die>.worker kills its own process, <die>.ray the Ray worker
    # running it, at epoch 2; a recording never finds them.
    parser.add_argument("--die", default="")
    return parser.parse_args()


def train_step(w, lr):
    x = np.random.standard_normal((16, w.shape[0]))
    grad = x.T @ (x @ w - 1.0) / len(x)
    w -= lr * grad
    return float(np.mean((x @ w - 1.0) ** 2))


def die_if_asked(die, epoch):
    if not die or epoch != 2:
        return
    if Path(die + ".worker").exists():
        print("replay worker: killing itself at epoch 2", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if Path(die + ".ray").exists():
        print("replay worker: killing its Ray worker at epoch 2", flush=True)
        os.kill(ray_worker(), signal.SIGKILL)
        time.sleep(30)


def ray_worker():
    # The Ray worker process above this replay worker (its parent, or the parent of the
    # fork server it was forked from): its title starts with ray::.
    pid = os.getppid()
    while pid > 1:
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"):
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("not under a Ray worker")


def main():
    args = parse_args()
    np.random.seed(args.seed)
    w = np.zeros(32)
    with rl.checkpointing(w=w):
        for epoch in rl.loop("epoch", range(args.epochs)):
            for step in rl.loop("step", range(5)):
                loss = train_step(w, args.lr)
                time.sleep(args.step_seconds)
            rl.log("loss", loss)
            die_if_asked(args.die, epoch)


if __name__ == "__main__":
    main()
"""
NEW = SCRIPT.replace(
    '            rl.log("loss", loss)\n',
    '            rl.log("loss", loss)\n            rl.log("w_norm", float(np.linalg.norm(w)))\n',
)
SEEDS = (0, 1, 2)


def _record(project: Project) -> dict[str, int]:
    """Record one run per seed with SCRIPT, then make NEW today's script; run id -> seed."""
    project.write("train.py", SCRIPT)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    for seed in SEEDS:
        project.run("train.py", "--seed", str(seed))
    project.write("train.py", NEW)
    seeds = {}
    for run_id, argv in read_db(project.root, "SELECT run_id, argv FROM runs"):
        args = json.loads(str(argv))
        seeds[str(run_id)] = int(args[args.index("--seed") + 1])
    return seeds


def _recorded_truth(tmp: Path) -> dict[int, list[float]]:
    """w_norm per seed as a fresh recording of NEW logs it, in a project of its own."""
    fresh = Project(tmp / "fresh")
    fresh.root.mkdir()
    fresh.write("train.py", NEW)
    for seed in SEEDS:
        fresh.run("train.py", "--seed", str(seed))
    by_run = values_by_run(fresh.root, "w_norm")
    found = {}
    for run_id, argv in read_db(fresh.root, "SELECT run_id, argv FROM runs"):
        args = json.loads(str(argv))
        found[int(args[args.index("--seed") + 1])] = by_run[str(run_id)]
    return found


def _w_norm_rows(root: Path) -> int:
    return int(read_db(root, "SELECT COUNT(*) FROM logs WHERE name = 'w_norm'")[0][0])  # type: ignore[arg-type]


def _replay(project: Project, address: str, *args: str):  # type: ignore[no-untyped-def]
    return project.cli(
        "replay", "w_norm", "--yes", "--executor", "ray", "--workers", "2", *args,
        **ray_env(address),
    )  # fmt: skip


def test_replay_on_ray_is_exact_and_idempotent(
    project: Project, tmp_path: Path, ray_address: str
) -> None:
    seeds = _record(project)
    local = Project(tmp_path / "local-copy")
    shutil.copytree(project.root, local.root, symlinks=True)

    out = _replay(project, ray_address)
    assert out.returncode == 0, out.stderr
    assert f"workers run as Ray tasks on the cluster at {ray_address}" in out.stderr
    assert "Ray tasks ran on " in out.stderr
    # numpy imported once per Ray worker process, its workers forked (docs/replay-on-ray.md).
    assert "start-up on Ray: 3 worker(s) forked from fork servers" in out.stderr
    assert "Replayed 3 run(s); backfilled 12 value(s)." in out.stderr
    on_ray = values_by_run(project.root, "w_norm")

    truth = _recorded_truth(tmp_path)
    assert {run_id: truth[seed] for run_id, seed in seeds.items()} == on_ray
    local_out = local.cli("replay", "w_norm", "--yes", "--workers", "2")
    assert local_out.returncode == 0, local_out.stderr
    assert values_by_run(local.root, "w_norm") == on_ray

    # Lineage says where each value was computed: Ray tasks of this cluster, on this
    # machine (a one-node cluster), against local processes in the copy.
    some_run = next(iter(seeds))
    for where, executor, address in ((project, "ray", ray_address), (local, "local", None)):
        found = json.loads(where.cli("lineage", some_run, "w_norm", "--json").stdout)
        (replay,) = found["replays"].values()
        assert (replay["executor"], replay["executor_address"]) == (executor, address)
        assert replay["hosts"] == [socket.gethostname()]
    text = project.cli("lineage", some_run, "w_norm").stdout
    assert f"ran as Ray tasks of the cluster at {ray_address} on {socket.gethostname()}" in text

    # The values came through the coordinator's backfill, marked as any replay's.
    marks = read_db(
        project.root,
        "SELECT DISTINCT origin, inexact, replay_id IS NOT NULL FROM logs WHERE name = 'w_norm'",
    )
    assert marks == [("backfilled", None, 1)]

    # Again: nothing to do. Forced: recomputed, replacing its values, no row added.
    again = _replay(project, ray_address)
    assert again.returncode == 0, again.stderr
    assert "nothing to replay" in again.stderr
    forced = _replay(project, ray_address, "--force")
    assert forced.returncode == 0, forced.stderr
    assert _w_norm_rows(project.root) == 12
    assert values_by_run(project.root, "w_norm") == on_ray
    statuses = read_db(project.root, "SELECT status FROM replays ORDER BY started_at")
    assert statuses == [("finished",), ("finished",)]


def _record_per_seed(project: Project, tmp: Path) -> dict[int, str]:
    """Record one run per seed, each with its own --die prefix; seed -> run id."""
    project.write("train.py", SCRIPT)
    project.git("add", "train.py")
    project.git("commit", "--quiet", "-m", "train")
    for seed in SEEDS:
        project.run("train.py", "--seed", str(seed), "--die", str(tmp / f"die-{seed}"))
    project.write("train.py", NEW)
    found = {}
    for run_id, argv in read_db(project.root, "SELECT run_id, argv FROM runs"):
        args = json.loads(str(argv))
        found[int(args[args.index("--seed") + 1])] = str(run_id)
    return found


def test_killed_workers_are_reported_and_the_other_runs_finish(
    project: Project, tmp_path: Path, ray_address: str
) -> None:
    runs = _record_per_seed(project, tmp_path)
    (tmp_path / "die-1.worker").write_text("")  # the training process is killed
    (tmp_path / "die-2.ray").write_text("")  # the Ray worker running the task is killed

    out = _replay(project, ray_address)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    # The killed process: failed with its exit status and its log's tail, as locally.
    assert f"run {runs[1]}: replay failed: worker exited with code -9" in out.stderr
    assert "replay worker: killing itself at epoch 2" in out.stderr
    # The killed Ray worker: failed, said so.
    assert f"run {runs[2]}: replay failed: its Ray task failed: the Ray worker process" in (
        out.stderr
    )
    assert "Replayed 1 run(s)" in out.stderr
    statuses = dict(read_db(project.root, "SELECT run_id, status FROM replay_runs"))
    assert statuses == {runs[0]: "replayed", runs[1]: "failed", runs[2]: "failed"}
    assert set(values_by_run(project.root, "w_norm")) == {runs[0]}

    # Without the markers, the next replay does the two failed runs, and only them.
    (tmp_path / "die-1.worker").unlink()
    (tmp_path / "die-2.ray").unlink()
    again = _replay(project, ray_address)
    assert again.returncode == 0, again.stderr
    assert "Replayed 2 run(s); backfilled 8 value(s)." in again.stderr
    values = values_by_run(project.root, "w_norm")
    truth = _recorded_truth(tmp_path)
    assert values == {runs[seed]: truth[seed] for seed in SEEDS}


def test_bad_executor_options_are_one_paragraph_errors(project: Project, tmp_path: Path) -> None:
    project.write("train.py", SCRIPT)
    project.run("train.py", "--epochs", "2", "--step-seconds", "0")
    project.write("train.py", NEW)

    def replay(*args: str, **env: str):  # type: ignore[no-untyped-def]
        out = project.cli("replay", "w_norm", "--yes", *args, RAY_ADDRESS="", **env)
        assert "Traceback" not in out.stderr
        # The paragraph is wrapped to the terminal's width, and a long temporary path
        # moves where a wrap falls (once inside "pip install 'retrolog[ray]'"): unwrap it.
        out.stderr = " ".join(out.stderr.split())
        return out

    out = replay("--ray-address", "127.0.0.1:6379")
    assert out.returncode == 1
    assert "add --executor ray" in out.stderr

    out = replay("--executor", "ray")
    assert out.returncode == 1
    assert "needs the address of a Ray cluster" in out.stderr

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    out = replay("--executor", "ray", "--ray-address", f"127.0.0.1:{closed}")
    assert out.returncode == 1
    assert f"No Ray cluster answers at 127.0.0.1:{closed}" in out.stderr

    out = replay(RETROLOG_EXECUTOR="slurm")
    assert out.returncode == 1
    assert "RETROLOG_EXECUTOR) is 'slurm'" in out.stderr

    # Ray missing from the environment: which extra to install.
    hidden = tmp_path / "no-ray"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    out = replay("--executor", "ray", "--ray-address", "127.0.0.1:1", PYTHONPATH=str(hidden))
    assert out.returncode == 1
    assert "pip install 'retrolog[ray]'" in out.stderr
    assert read_db(project.root, "SELECT COUNT(*) FROM replays") == [(0,)]


INNER = SCRIPT.replace(
    "                loss = train_step(w, args.lr)\n",
    "                loss = train_step(w, args.lr)\n"
    '                rl.log("step_norm", float(np.linalg.norm(w)))\n',
)


def _workers_of(run_id: str) -> list[int]:
    """Replay workers of ``run_id`` on Ray: new interpreters (the script on their command
    line) or forked (a fork server's), either way in a checkout named after the run."""
    marker = f"-ray-{run_id}-"
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except (OSError, ValueError):
            continue
        if ("train.py" in cmdline or "forkserver_main.py" in cmdline) and (
            marker in cmdline or marker in cwd
        ):
            found.append(int(entry.name))
    return found


def test_ctrl_c_cancels_the_ray_tasks(project: Project, ray_address: str) -> None:
    project.write("train.py", SCRIPT)
    for seed in (0, 1):
        project.run("train.py", "--seed", str(seed), "--epochs", "3", "--step-seconds", "0.2")
    runs = [str(r[0]) for r in read_db(project.root, "SELECT run_id FROM runs")]
    project.write("train.py", INNER)  # every step runs again: 3 s a run
    proc = project.start_cli(
        "replay", "step_norm", "--yes", "--executor", "ray", **ray_env(ray_address)
    )
    deadline = time.monotonic() + 60
    while not all(_workers_of(r) for r in runs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_workers_of(r) for r in runs), "the workers did not start"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "Ray tasks still running on" in stderr
    # Cancelled: the training processes are gone (with the Ray workers that ran them).
    deadline = time.monotonic() + 15
    while any(_workers_of(r) for r in runs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_workers_of(r) for r in runs)
    assert read_db(project.root, "SELECT status FROM replays") == [("interrupted",)]

    again = project.cli("replay", "step_norm", "--yes", "--executor", "ray", **ray_env(ray_address))
    assert again.returncode == 0, again.stderr
    assert "backfilled 30 value(s)" in again.stderr
    counts = read_db(project.root, "SELECT COUNT(*) FROM logs WHERE name = 'step_norm'")
    assert counts == [(30,)]


def test_ray_is_imported_only_when_chosen(project: Project) -> None:
    """A local replay, the CLI and the library never import ray (it takes seconds)."""
    project.write("train.py", SCRIPT)
    project.run("train.py", "--epochs", "2", "--step-seconds", "0")
    project.write("train.py", NEW)
    code = (
        "import sys\n"
        "import retrolog, retrolog.cli\n"
        "from retrolog import Project\n"
        "Project().replay('w_norm', progress=False, echo=lambda _: None)\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=project.root, env=project.env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert [len(v) for v in values_by_run(project.root, "w_norm").values()] == [2]
