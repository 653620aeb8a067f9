"""A checkpoint the adaptive rule chose is never lost: on a busy CPU, and at exit.

Recording processes are real training scripts run as a user would. Tests of
the adaptive rule override conftest's RETROLOG_CHECKPOINTS=every with the
default, ``adaptive``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from retrolog.checkpoint.codec import decode
from retrolog.store.objects import LocalObjectStore

from conftest import Project, default_sigint, read_db

pytestmark = pytest.mark.slow

# An MNIST-sized CNN with torch's default thread count (every core here), fed by a
# DataLoader whose worker process spends 0.25 ms of CPU per sample (augmentation), a
# little less than training takes (16-20 ms a batch of 64 on 2 cores): training stays
# the bottleneck, its threads keep every core busy and the worker competes with them,
# as in real training, so the checkpoint writer's idle lane gets next to no CPU.
SATURATED = """\
import time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
import retrolog as rl


class Augmented(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        end = time.perf_counter() + 0.00025
        while time.perf_counter() < end:
            pass
        return self.x[i], self.y[i]


torch.manual_seed(0)
net = nn.Sequential(
    nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
loader = DataLoader(Augmented(1024), batch_size=64, shuffle=True, num_workers=1)
print("threads", torch.get_num_threads(), flush=True)
with rl.checkpointing(net=net, opt=opt):
    for epoch in rl.loop("epoch", range(5)):
        for xb, yb in rl.loop("step", loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            rl.log("loss", loss.item())
"""


def checkpointing(project: Project) -> dict[str, Any]:
    ((summary,),) = read_db(project.root, "SELECT checkpointing FROM runs")
    record: dict[str, Any] = json.loads(str(summary))
    return record


def kinds(project: Project) -> list[str]:
    return [str(k) for (k,) in read_db(project.root, "SELECT kind FROM checkpoints")]


# The rule's timing at torch's default threads is what it checks, against the load its own
# DataLoader worker adds: beside other tests' load the first write can miss its due time.
@pytest.mark.usefixtures("whole_machine")
def test_a_cpu_saturated_run_writes_every_checkpoint_the_rule_chose(project: Project) -> None:
    project.write("train.py", SATURATED)
    done = project.run("train.py", RETROLOG_CHECKPOINTS="adaptive")
    assert f"threads {os.cpu_count()}" in done.stdout  # torch's default: every core
    record = checkpointing(project)
    why = f"the run's checkpointing record: {record}"
    assert record["mode"] == "adaptive" and record["when_full"] == "skip", why
    chosen = record["blocks"]["epoch"]["checkpoints"]  # k: what the rule chose
    assert chosen == kinds(project).count("block"), why
    assert kinds(project).count("end") == 1, why
    assert record["chosen"] == record["written"] == chosen, why
    assert record["abandoned"] == 0 and record["abandoned_checkpoints"] == [], why
    # The rule kept choosing after the first checkpoint: blocks of a second or more, and
    # a checkpoint costing training tens of milliseconds, whichever lane wrote it.
    assert chosen >= 2, why
    # The first write was due half a block in, so the second block end had its price.
    assert record["blocks"]["epoch"]["refused_unpriced"] == 0, why
    ((status,),) = read_db(project.root, "SELECT status FROM runs")
    assert status == "finished"
    # And every one of them restores: each object verifies against its key, whichever
    # lane wrote it and however often the urgent lane took one over from the idle lane
    # (an interrupted idle encode once left a delta base holding other bytes).
    store = LocalObjectStore(project.root / ".retrolog" / "objects")
    for (manifest,) in read_db(project.root, "SELECT manifest FROM checkpoints"):
        decode(str(manifest), store)


# Blocks of 0.2 s; the idle lane never runs at all (its thread stops where it would
# lower its priority), the worst case of SCHED_IDLE beside a busy training, made
# deterministic.
STARVED = """\
import threading
import time
import numpy as np
import retrolog as rl
from retrolog.checkpoint import background

background._lower_priority = lambda: threading.Event().wait()
state = {"w": np.zeros(200_000)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(12)):
        for step in rl.loop("step", range(4)):
            state["w"] += 1.0
            time.sleep(0.05)
"""


def test_with_the_idle_lane_starved_the_rule_keeps_choosing_and_nothing_is_lost(
    project: Project,
) -> None:
    project.write("train.py", STARVED)
    project.run("train.py", RETROLOG_CHECKPOINTS="adaptive")
    record = checkpointing(project)
    why = f"the run's checkpointing record: {record}"
    chosen = record["blocks"]["epoch"]["checkpoints"]
    assert chosen == kinds(project).count("block") == record["written"], why
    assert record["abandoned"] == 0, why
    # The rule kept choosing after its first checkpoint, as the costs it measured allow:
    # (k + 1) * M < n * C * eps, M being the capture plus the urgent lane's wall time on a
    # write (it writes every one). How many that allows depends on how fast this machine
    # copies and writes 1.6 MB (on a busy 2-core VM 8 to 30 ms, against 0.2 s blocks), so
    # it is read from the record. When a checkpoint costs about a block's share of eps,
    # each decision is close and the running means decide it (8 of 12 afforded, say), so
    # the test asks for half: a rule that stopped choosing would take 1.
    block = record["blocks"]["epoch"]
    # The first write is due half a block after its capture, so the urgent lane has
    # written it by the second block end, which is priced rather than refused unseen.
    assert block["refused_unpriced"] == 0, why
    cost = block["mean_capture_seconds"] + block["mean_urgent_write_seconds"]
    budget = block["executions"] * block["mean_block_seconds"] * record["overhead_tolerance"]
    affordable = min(block["executions"], int(budget / cost))
    assert chosen >= max(min(2, affordable), affordable // 2), why
    assert record["urgent_writes"] + record["finished_at_exit"] == record["chosen"] + 1, why
    stored = read_db(
        project.root,
        "SELECT l.iteration FROM checkpoints c JOIN loops l"
        " ON l.run_id = c.run_id AND l.ctx_id = c.ctx_id ORDER BY c.checkpoint_id",
    )
    iterations = [it for (it,) in stored]
    assert iterations == sorted(iterations) and iterations[0] == 0, why


# Three quick epochs and a store that takes 0.3 s a write: at exit, the block
# checkpoints and the end state are still being written.
SLOW_STORE = """\
import time
import numpy as np
import retrolog as rl
from retrolog.store import objects

def slow(method):
    def wrapper(self, *args, **kwargs):
        time.sleep(0.3)
        return method(self, *args, **kwargs)
    return wrapper

objects.LocalObjectStore.put = slow(objects.LocalObjectStore.put)
objects.LocalObjectStore.put_framed = slow(objects.LocalObjectStore.put_framed)
state = {f"w{i}": np.full(20_000, float(i)) for i in range(3)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(2)):
            for w in state.values():
                w += 1.0
print("training done", flush=True)
"""


def lines_of(stream: Any) -> Iterator[str]:
    for line in iter(stream.readline, ""):
        yield line.rstrip("\n")


def record_slowly(project: Project, presses: int) -> tuple[int, str]:
    """Run SLOW_STORE, pressing Ctrl-C ``presses`` times while it finishes; exit code, stderr."""
    project.write("train.py", SLOW_STORE)
    env = project.env(RETROLOG_CHECKPOINTS="every", RETROLOG_MAX_IN_FLIGHT="4")
    with subprocess.Popen(
        [sys.executable, "train.py"],
        cwd=project.root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    ) as proc:
        assert proc.stderr is not None
        killer = threading.Timer(120, proc.kill)  # a hang fails the test instead
        killer.start()
        seen: list[str] = []
        pressed = 0
        try:
            for line in lines_of(proc.stderr):
                seen.append(line)
                if pressed < presses and (
                    (pressed == 0 and "before exit" in line)
                    or (pressed == 1 and "press Ctrl-C again to abandon them" in line)
                ):
                    proc.send_signal(signal.SIGINT)
                    pressed += 1
            code = proc.wait()
        finally:
            killer.cancel()
    return code, "\n".join(seen)


def test_exit_finishes_the_checkpoints_in_flight_and_shows_what_remains(
    project: Project,
) -> None:
    code, err = record_slowly(project, presses=0)
    assert code == 0, err
    assert "before exit, about" in err and "retrolog: wrote" in err, err
    record = checkpointing(project)
    assert record["chosen"] == record["written"] == 3 and record["abandoned"] == 0, record
    assert record["finished_at_exit"] >= 2 and record["finish_seconds"] > 1.0, record
    assert kinds(project) == ["block"] * 3 + ["end"]


def test_one_ctrl_c_at_exit_keeps_finishing(project: Project) -> None:
    code, err = record_slowly(project, presses=1)
    assert code == 0, err
    assert "press Ctrl-C again to abandon them" in err, err
    assert "KeyboardInterrupt" not in err and "abandoned" not in err, err
    record = checkpointing(project)
    assert record["chosen"] == record["written"] == 3 and record["abandoned"] == 0, record
    assert kinds(project) == ["block"] * 3 + ["end"]


def test_ctrl_c_twice_at_exit_abandons_and_records_what_it_abandoned(project: Project) -> None:
    code, err = record_slowly(project, presses=2)
    assert code == 0, err
    assert "retrolog: abandoned" in err and "KeyboardInterrupt" not in err, err
    record = checkpointing(project)
    written = kinds(project).count("block")
    abandoned = record["abandoned_checkpoints"]
    assert record["chosen"] == 3 and written < 3, record
    assert record["abandoned"] == 3 - written == sum(a["kind"] == "block" for a in abandoned)
    assert abandoned[-1]["kind"] == "end" and record["end_written"] == 0, record
    ((status,),) = read_db(project.root, "SELECT status FROM runs")
    assert status == "finished"  # training did finish; only checkpoints were given up
    # `retrolog show` lists what was chosen, written and abandoned, by iteration.
    shown = project.cli("show", str(read_db(project.root, "SELECT run_id FROM runs")[0][0]))
    assert shown.returncode == 0, shown.stderr
    assert f"chosen 3, written {written}, abandoned {3 - written}" in shown.stdout, shown.stdout
    epochs = ", ".join(f"epoch {i}" for i in range(written, 3))
    assert f"abandoned {epochs}, the end state" in shown.stdout, shown.stdout
    details = json.loads(project.cli("show", "--json", shown.stdout.split()[1]).stdout)
    assert details["checkpoints"]["abandoned_at"][0] == {
        "kind": "block",
        "loop": "epoch",
        "iteration": written,
    }


# The idle lane spends its time inside torch with the GIL released (each tensor it views
# as bytes first runs a 1500x1500 matmul), and training ends while it is there. A daemon
# thread inside torch when the interpreter finalizes aborts the process ("terminate
# called without an active exception", exit status -6): seen in real recordings of the
# suite run two at a time, and here in 3 of 3 runs without the exit gate.
IN_TORCH_AT_EXIT = """\
import threading
import time
import torch
import retrolog as rl

big = torch.randn(1500, 1500)
contiguous = torch.Tensor.contiguous


def slow(self, *args, **kwargs):
    if threading.current_thread().name == "retrolog-checkpoint-writer":
        torch.mm(big, big)
    return contiguous(self, *args, **kwargs)


torch.Tensor.contiguous = slow
state = {f"t{i}": torch.randn(2048) for i in range(10)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(2)):
        for t in state.values():
            t += 1.0
        time.sleep(0.3)
print("training done", flush=True)
"""


def test_a_run_ending_while_the_idle_lane_is_inside_torch_exits_cleanly(
    project: Project,
) -> None:
    project.write("train.py", IN_TORCH_AT_EXIT)
    done = project.run("train.py", check=False, RETROLOG_CHECKPOINTS="every")
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr, done.stderr
    assert "training done" in done.stdout
    record = checkpointing(project)
    assert record["chosen"] == record["written"] == 2 and record["abandoned"] == 0, record
    assert kinds(project) == ["block", "block", "end"]


FORKS_CHILDREN = """\
import multiprocessing as mp
import time

import numpy as np

import retrolog as rl


def child():
    pass  # a DataLoader worker's life, in short: forked, then it ends


w = np.zeros(2_000_000)  # 16 MB: still being written when the child is forked
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(3)):
        w += 1.0
        rl.log("s", float(w[0]))
        child_process = mp.get_context("fork").Process(target=child)
        started = time.perf_counter()
        child_process.start()
        child_process.join()
        print(f"child {child_process.exitcode} {time.perf_counter() - started:.2f}", flush=True)
        time.sleep(0.3)  # the rest of the epoch: the writer keeps up
"""


def test_a_forked_child_ending_leaves_the_parents_checkpoints_alone(project: Project) -> None:
    """multiprocessing runs threading's exit hooks when a forked child ends, and a child
    inherits the parent's: the checkpointer's copy closed in each DataLoader worker,
    warning of lost checkpoints, and held every epoch's worker exit for 5 s (bench_record's
    saturated workload, 2026-11-27, caught before it landed)."""
    project.write("train.py", FORKS_CHILDREN)
    done = project.run("train.py", RETROLOG_CHECKPOINTS="every")
    # On a busy machine "every" may make training wait for its writer once (a wait,
    # reported once per run, nothing lost: seen with three pytest workers on 2 cores).
    # Any other warning, a child's above all, is the bug.
    warned = [line for line in done.stderr.splitlines() if "Warning" in line]
    assert all("checkpoint writer fell behind" in line for line in warned), done.stderr
    assert "lost" not in done.stderr, done.stderr
    children = [line.split() for line in done.stdout.splitlines() if line.startswith("child")]
    assert [c[1] for c in children] == ["0", "0", "0"]
    # The hold was 5 s per child; a busy machine's fork and join take well under 4.
    assert max(float(c[2]) for c in children) < 4.0, children
    record = checkpointing(project)
    assert record["chosen"] == record["written"] == 3 and record["end_written"] == 1, record
