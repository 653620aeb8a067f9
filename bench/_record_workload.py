"""The training scripts bench_record.py times, each in three variants (and two more).

One template per workload, with markers that each variant fills in:

================  ===========================  ===================  ======================
marker            retrolog                     plain                flordb
================  ===========================  ===================  ======================
``IMPORT``        ``import retrolog as rl``    (nothing)            ``import flordb as flor``
``LOOP(n, it)``   ``rl.loop(n, it)``           ``it``               ``flor.loop(n, it)``
``LOG(n, v)``     ``rl.log(n, v)``             ``v``                ``flor.log(n, v)``
``CKPT(...)``     ``rl.checkpointing(...)``    ``nullcontext()``    ``flor.checkpointing(...)``
``COMMIT``        ``rl.commit()``              ``pass``             ``flor.commit()``
================  ===========================  ===================  ======================

``retrolog_normal`` is ``retrolog`` with the checkpoint writer's idle lane left
at training's priority (no SCHED_IDLE): a design compared, not a setting.
``retrolog_minimal`` records with eps = 1e-9, so it takes only the two
checkpoints every run takes: against it, ``retrolog`` shows what the adaptive
rule's own choices cost. ``retrolog_logs`` records loops and logs with no
``checkpointing`` block: against plain, what recording costs without checkpoints.

Every variant computes the same values (``LOG(n, v)`` still evaluates ``v``)
and times the same span, in wall time and in the process's CPU time (all its
threads; less disturbed by other machines' load on a shared host than wall
time, and it includes the background writer's work): from just before the
first recording call to just after ``COMMIT`` returns, so retrolog's run
start (capturing the code version) and its flush at the end (the last
checkpoints written) are inside it. Data
and models are built before the span, from fixed seeds. The script prints one
JSON line: ``{"seconds": ..., "cpu_seconds": ..., "epochs": ...}``.

Workloads (sized for a 2-core machine; all take arguments ``epochs`` and
``threads``, and optionally a seed, 0 unless given: bench_record's untimed
first run passes another, so that the timed run's checkpoints find none of
their bytes stored already):

- ``cnn``: a small CNN (two conv layers) on 28x28 synthetic images, Adam,
  about a second per epoch; the step loop is the block, so a checkpoint per
  epoch is what the adaptive rule can give;
- ``saturated``: the cnn fed by a DataLoader whose worker process spends
  0.08 ms of CPU per sample, a little less than training takes: torch's
  threads on every core and the worker keep the machine saturated, as real
  training does, so the writer's idle lane gets next to no CPU;
- ``stress``: a 25M-parameter MLP with Adam (about 300 MB of state), blocks
  of about a second: a checkpoint costs as much as a fraction of a block, so
  the adaptive rule has to thin them out;
- ``finetune``: a frozen 6M-parameter backbone with a small trainable head,
  Adam on the head only, about 0.7 s per epoch: most of the state never
  changes.
"""

from __future__ import annotations

import re

HEADER = """\
import json
import sys
import time
from contextlib import nullcontext

import torch
from torch import nn
IMPORT

epochs = int(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]))
torch.manual_seed(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
"""

FOOTER = """\
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "epochs": epochs}))
"""

# The cnn workload's data, model and optimizer (bench_writer_priority.py trains it too).
CNN_SETUP = """\
x = torch.randn(2048, 1, 28, 28)
y = torch.randint(0, 10, (2048,))
net = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, len(x), 64)]
"""

CNN = (
    CNN_SETUP
    + """\
t0, c0 = time.perf_counter(), time.process_time()
with CKPT(net=net, opt=opt):
    for epoch in LOOP("epoch", range(epochs)):
        for xb, yb in LOOP("step", batches):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            LOG("loss", loss.item())
        with torch.no_grad():
            LOG("acc", (net(x[:512]).argmax(1) == y[:512]).float().mean().item())
COMMIT
"""
)

STRESS = """\
net = nn.Sequential(
    nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
    nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10),
)
opt = torch.optim.Adam(net.parameters(), lr=1e-4)
x = torch.randn(96, 1024)
y = torch.randint(0, 10, (96,))
batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]
t0, c0 = time.perf_counter(), time.process_time()
with CKPT(net=net, opt=opt):
    for epoch in LOOP("epoch", range(epochs)):
        for xb, yb in LOOP("step", batches):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            LOG("loss", loss.item())
COMMIT
"""

FINETUNE = """\
backbone = nn.Sequential(
    nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
    nn.Linear(2048, 512), nn.ReLU(),
)
for p in backbone.parameters():
    p.requires_grad_(False)
head = nn.Linear(512, 10)
net = nn.Sequential(backbone, head)
opt = torch.optim.Adam(head.parameters(), lr=1e-3)
x = torch.randn(4096, 512)
y = torch.randint(0, 10, (4096,))
batches = [(x[i:i + 128], y[i:i + 128]) for i in range(0, len(x), 128)]
t0, c0 = time.perf_counter(), time.process_time()
with CKPT(net=net, opt=opt):
    for epoch in LOOP("epoch", range(epochs)):
        for xb, yb in LOOP("step", batches):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            LOG("loss", loss.item())
COMMIT
"""

# The cnn fed by a DataLoader whose worker process spends 0.08 ms of CPU per sample (an
# augmentation), a little less than training takes per sample here (5.5 ms a batch of 64
# on both cores): training stays the bottleneck, so torch's threads keep every core busy
# and the worker competes with them, as in real training, and the checkpoint writer's
# idle lane gets next to no CPU.
SATURATED = (
    """\
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        end = time.perf_counter() + 0.00008
        while time.perf_counter() < end:
            pass
        return self.x[i], self.y[i]


"""
    + CNN_SETUP
    + """\
loader = DataLoader(Augmented(x, y), batch_size=64, shuffle=True, num_workers=1)
t0, c0 = time.perf_counter(), time.process_time()
with CKPT(net=net, opt=opt):
    for epoch in LOOP("epoch", range(epochs)):
        for xb, yb in LOOP("step", loader):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            LOG("loss", loss.item())
        with torch.no_grad():
            LOG("acc", (net(x[:512]).argmax(1) == y[:512]).float().mean().item())
COMMIT
"""
)

WORKLOADS = {"cnn": CNN, "saturated": SATURATED, "stress": STRESS, "finetune": FINETUNE}

# Main-thread blocking of one checkpoint of the stress state, against torch.save of the
# same state and a plain copy into preallocated buffers (the floor), in one process with
# one torch thread. Prints one JSON line of per-repetition seconds.
BLOCKING = """\
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from retrolog.checkpoint.background import BackgroundCheckpointer
from retrolog.store.objects import LocalObjectStore

reps = int(sys.argv[1])
torch.set_num_threads(1)
torch.manual_seed(0)
net = nn.Sequential(
    nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
    nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10),
)
opt = torch.optim.Adam(net.parameters(), lr=1e-4)


def train_step():
    opt.zero_grad()
    nn.functional.cross_entropy(net(torch.randn(32, 1024)), torch.randint(0, 10, (32,))).backward()
    opt.step()


for _ in range(2):
    train_step()
objects = {"net": net, "opt": opt}
tensors = [t for t in net.state_dict().values()] + [
    v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)
]
nbytes = sum(t.numel() * t.element_size() for t in tensors)
buffers = [torch.empty_like(t) for t in tensors]
out = {"state_mb": nbytes / 1e6, "retrolog": [], "torch_save": [], "copy": []}
with tempfile.TemporaryDirectory() as tmp:
    store = LocalObjectStore(os.path.join(tmp, "objects"))
    with BackgroundCheckpointer(store, lambda record: None, max_in_flight=1) as ckpt:
        for i in range(reps):
            # Training changes every tensor between checkpoints, as in the stress
            # workload: a state found unchanged would be hashed instead of copied.
            train_step()
            out["retrolog"].append(
                ckpt.capture(ctx_id=i, loop_name="epoch", kind="block", objects=objects)
            )
            # Let the writer finish so each capture finds a free slot, as the adaptive
            # rule's spacing makes it in training; waiting would be counted otherwise.
            while ckpt.in_flight:
                time.sleep(0.05)
    for i in range(reps):
        path = os.path.join(tmp, f"state{i}.pt")
        began = time.perf_counter()
        torch.save({"net": net.state_dict(), "opt": opt.state_dict()}, path)
        out["torch_save"].append(time.perf_counter() - began)
        os.unlink(path)
    for i in range(reps):
        began = time.perf_counter()
        for buffer, t in zip(buffers, tensors):
            buffer.copy_(t)
        out["copy"].append(time.perf_counter() - began)
print(json.dumps(out))
"""
VARIANTS = ("plain", "retrolog", "retrolog_normal", "retrolog_minimal", "retrolog_logs", "flordb")

_FILL = {
    "retrolog": (
        "import retrolog as rl",
        "rl.loop(",
        "rl.log(",
        "rl.checkpointing(",
        "rl.commit()",
    ),
    # A design compared, not a setting: the writer's idle lane left at training's
    # priority, so both lanes are a writer at normal priority (docs/materialization.md).
    "retrolog_normal": (
        "import retrolog as rl\n"
        "from retrolog.checkpoint import background as _background\n"
        "_background._lower_priority = lambda: False",
        "rl.loop(",
        "rl.log(",
        "rl.checkpointing(",
        "rl.commit()",
    ),
    # Only the checkpoints every run takes (the first block's and the end state): what
    # recording costs apart from the adaptive rule's choices.
    "retrolog_minimal": (
        "import retrolog as rl\nrl.configure(overhead_tolerance=1e-9)",
        "rl.loop(",
        "rl.log(",
        "rl.checkpointing(",
        "rl.commit()",
    ),
    # Loops and logs recorded, no checkpointing at all: what recording costs apart from
    # checkpoints (the run's start, rl.loop and rl.log, the log writer, commit()).
    "retrolog_logs": (
        "import retrolog as rl",
        "rl.loop(",
        "rl.log(",
        "nullcontext(",
        "rl.commit()",
    ),
    "plain": ("", "(", "(", "nullcontext(", "pass"),
    "flordb": (
        "import flordb as flor",
        "flor.loop(",
        "flor.log(",
        "flor.checkpointing(",
        "flor.commit()",
    ),
}


def source(workload: str, variant: str) -> str:
    """The script text of ``workload`` in ``variant``."""
    imp, loop, log, ckpt, commit = _FILL[variant]
    body = WORKLOADS[workload]
    if variant == "retrolog_logs":
        body = body.replace("CKPT(net=net, opt=opt)", "nullcontext()")
    if variant == "plain":
        # LOOP("name", it) -> it; LOG("name", v) -> v; the loop variable and value stay.
        body = re.sub(r'LOOP\("\w+", (.*?)\):', r"\1:", body)
        body = re.sub(r'LOG\("\w+", (.*)\)\n', r"\1\n", body)
        body = body.replace("CKPT(net=net, opt=opt)", "nullcontext()")
    else:
        body = body.replace("LOOP(", loop).replace("LOG(", log).replace("CKPT(", ckpt)
    body = body.replace("COMMIT", commit)
    return HEADER.replace("IMPORT", imp) + body + FOOTER
