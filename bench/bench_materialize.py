"""Benchmark: where checkpoint materialization should run (docs/materialization.md).

Run from the repository root with the project's venv (retrolog and torch installed):

    python -m bench.bench_materialize --threads 1  # about three minutes on a 2-core machine
    python -m bench.bench_materialize --reps 7 --steps 40

One process trains an MLP with Adam (about 80 MB of state: parameters plus
the two Adam moments) on random data, for ``--steps`` steps, checkpointing
every ``--every`` steps (first at ``--every // 2``, so the work each checkpoint
leaves behind overlaps training). Mechanisms, all writing the same bytes to a
durable LocalObjectStore (fsync, then rename: the runtime's default):

- none: no checkpoints, the baseline;
- sync: SynchronousCheckpointer: snapshot, encode and write on the training thread;
- thread: BackgroundCheckpointer: snapshot (a deep copy) on the training
  thread, encode and write on a writer thread (max_in_flight=2, wait);
- fork: os.fork() a child that encodes the live state (copy-on-write pages)
  and exits; at most 2 children at once. Flor's mechanism;
- shm: a worker process (started once, outside the timings) fed through two
  shared-memory slots: the training thread copies every tensor into a free
  slot and sends a small message; the worker encodes and writes from there.

Per checkpoint, the **main-thread blocking time**: the wall time of the call
the training thread makes (capture(), fork(), copy-and-send), including any
wait for a free slot. Per repetition, the **training slowdown**: loop time
with checkpoints over loop time without, minus one, paired with the
"none" trial of the same repetition; and the **flush**: from the end of the
loop until every checkpoint is durable. Each checkpoint is decoded after the
trial and checked against the model's state at capture time (a fingerprint),
so no figure comes from a wrong or missing checkpoint. Configurations are
interleaved per repetition; figures are medians with min and max.
Results: bench/results/materialize.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.harness import spread
from retrolog.checkpoint.background import BackgroundCheckpointer
from retrolog.checkpoint.capture import CheckpointRecord, SynchronousCheckpointer
from retrolog.checkpoint.codec import decode, encode
from retrolog.checkpoint.state import Snapshot, capture_rng, snapshot
from retrolog.store.objects import LocalObjectStore

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "materialize.json"
MECHANISMS = ("none", "sync", "thread", "fork", "shm")
MAX_IN_FLIGHT = 2


class BenchError(Exception):
    """A measurement that could not be taken or did not check out."""


# -- the workload ------------------------------------------------------------------------


def make_training(width: int, batch: int) -> tuple[dict[str, Any], Callable[[], None]]:
    """An MLP with Adam and a step on random data; Adam's moments exist after one step."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(width, 2 * width),
        nn.ReLU(),
        nn.Linear(2 * width, 3 * width // 2),
        nn.ReLU(),
        nn.Linear(3 * width // 2, width),
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()

    step()
    return {"model": net, "optimizer": opt}, step


def state_bytes(objects: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(snapshot(objects)))


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in a snapshot tree, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Snapshot):
        return tensors_of(value.objects) + tensors_of(value.rng)
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors_of(v)]
    return []


def _digest(tensors: list[torch.Tensor]) -> str:
    # A strided sample of every tensor: Adam changes every element each step, so
    # a checkpoint of the wrong step or a torn one differs, and it costs ~1 ms.
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1)[::997].contiguous().numpy().tobytes())
    return h.hexdigest()


def fingerprint(objects: dict[str, Any]) -> str:
    """A digest of the model's parameters and Adam state, to check checkpoints against."""
    opt_state = tensors_of(objects["optimizer"].state_dict())
    return _digest(opt_state + [p for p in objects["model"].parameters()])


def fingerprint_of_checkpoint(store: LocalObjectStore, manifest: str) -> str:
    snap = decode(manifest, store)
    model = snap.objects["model"]
    return _digest(tensors_of(snap.objects["optimizer"]) + [model[k] for k in model])


# -- mechanisms -------------------------------------------------------------------------


class Mechanism:
    """One way to materialize checkpoints; blocking time is what checkpoint() costs the caller."""

    def __init__(self, store: LocalObjectStore) -> None:
        self.store = store
        self.manifests: list[str] = []

    def checkpoint(self, ctx: int, objects: dict[str, Any]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Return once every checkpoint is durable and its manifest is in self.manifests."""


class Sync(Mechanism):
    def __init__(self, store: LocalObjectStore) -> None:
        super().__init__(store)
        self.ckpt = SynchronousCheckpointer(store, self.sink)

    def sink(self, record: CheckpointRecord) -> None:
        self.manifests.append(record.manifest)

    def checkpoint(self, ctx: int, objects: dict[str, Any]) -> None:
        self.ckpt.capture(ctx_id=ctx, loop_name="epoch", kind="block", objects=objects)

    def flush(self) -> None:
        self.ckpt.close()


class Thread(Sync):
    def __init__(self, store: LocalObjectStore) -> None:
        Mechanism.__init__(self, store)
        self.ckpt = BackgroundCheckpointer(store, self.sink, max_in_flight=MAX_IN_FLIGHT)


class Fork(Mechanism):
    """Flor's design: a child process encodes the parent's state as it was at fork()."""

    def __init__(self, store: LocalObjectStore) -> None:
        super().__init__(store)
        self.children: list[tuple[int, int]] = []  # (pid, read end of its result pipe)

    def checkpoint(self, ctx: int, objects: dict[str, Any]) -> None:
        while len(self.children) >= MAX_IN_FLIGHT:
            self.reap(self.children[0])
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no copy, the pages are the parent's until it writes them
            status = 1
            try:
                os.close(read)
                snap = Snapshot(
                    objects={name: obj.state_dict() for name, obj in objects.items()},
                    rng=capture_rng(),
                )
                manifest, _ = encode(snap, self.store)
                os.write(write, manifest.encode("ascii"))
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        self.children.append((pid, read))

    def reap(self, child: tuple[int, int]) -> None:
        pid, read = child
        manifest = os.read(read, 64).decode("ascii")
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if status != 0 or len(manifest) != 64:
            raise BenchError(f"fork child {pid} failed (status {status})")
        self.manifests.append(manifest)
        self.children.remove(child)

    def flush(self) -> None:
        while self.children:
            self.reap(self.children[0])


def _shm_worker(conn: Any, names: list[str], store_root: str) -> None:
    """The shm worker process: encode each slot it is handed, answer with the manifest."""
    torch.set_num_threads(1)
    slots = [shared_memory.SharedMemory(name=n) for n in names]
    while True:
        msg = conn.recv()
        if msg is None:
            break
        slot, skeleton, layout = msg
        buf = slots[slot].buf
        tensors = [
            torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).reshape(shape)
            if numel
            else torch.empty(shape, dtype=dtype)
            for offset, numel, shape, dtype in layout
        ]
        snap = _fill(pickle.loads(skeleton), tensors)
        manifest, _ = encode(snap, LocalObjectStore(store_root))
        del snap, tensors  # views into the slot must go before it can be reused or closed
        conn.send((slot, manifest))
    for s in slots:
        s.close()


class _Hole:
    """Where a tensor goes in a pickled snapshot skeleton."""

    def __init__(self, index: int) -> None:
        self.index = index


def _skeleton(value: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        out.append(value)
        return _Hole(len(out) - 1)
    if isinstance(value, Snapshot):
        return Snapshot(_skeleton(value.objects, out), _skeleton(value.rng, out))
    if isinstance(value, dict):
        new = type(value)((k, _skeleton(v, out)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            new._metadata = value._metadata  # type: ignore[attr-defined]
        return new
    if isinstance(value, list | tuple):
        return type(value)(_skeleton(v, out) for v in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Hole):
        return tensors[value.index]
    if isinstance(value, Snapshot):
        return Snapshot(_fill(value.objects, tensors), _fill(value.rng, tensors))
    if isinstance(value, dict):
        new = type(value)((k, _fill(v, tensors)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            new._metadata = value._metadata  # type: ignore[attr-defined]
        return new
    if isinstance(value, list | tuple):
        return type(value)(_fill(v, tensors) for v in value)
    return value


class Shm(Mechanism):
    """A worker process fed through shared memory: the caller's cost is one memcpy per tensor."""

    def __init__(self, store: LocalObjectStore, slot_bytes: int) -> None:
        super().__init__(store)
        self.slots = [
            shared_memory.SharedMemory(create=True, size=slot_bytes) for _ in range(MAX_IN_FLIGHT)
        ]
        self.free = list(range(MAX_IN_FLIGHT))
        ctx = mp.get_context("spawn")  # no fork of a process with torch's thread pools
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_shm_worker, args=(child, [s.name for s in self.slots], str(store.root))
        )
        self.proc.start()
        self.busy = 0

    def checkpoint(self, ctx: int, objects: dict[str, Any]) -> None:
        while not self.free:
            self.receive()
        slot = self.free.pop()
        live = Snapshot(
            objects={name: obj.state_dict() for name, obj in objects.items()}, rng=capture_rng()
        )
        tensors: list[torch.Tensor] = []
        skeleton = pickle.dumps(_skeleton(live, tensors))
        layout, offset, buf = [], 0, self.slots[slot].buf
        for t in tensors:
            t = t.detach()
            numel = t.numel()
            if numel:
                dest = torch.frombuffer(buf, dtype=t.dtype, count=numel, offset=offset)
                dest.view(t.shape).copy_(t)
                del dest
            layout.append((offset, numel, tuple(t.shape), t.dtype))
            offset += -(-numel * t.element_size() // 64) * 64
        self.conn.send((slot, skeleton, layout))
        self.busy += 1

    def receive(self) -> None:
        slot, manifest = self.conn.recv()
        self.manifests.append(manifest)
        self.free.append(slot)
        self.busy -= 1

    def flush(self) -> None:
        while self.busy:
            self.receive()

    def stop(self) -> None:
        self.conn.send(None)
        self.proc.join(60)
        for s in self.slots:
            s.close()
            s.unlink()


# -- one trial ---------------------------------------------------------------------------


def trial(
    mechanism: str,
    objects: dict[str, Any],
    step: Callable[[], None],
    args: argparse.Namespace,
    root: Path,
    shm: Shm | None,
) -> dict[str, Any]:
    """Train ``args.steps`` steps with ``mechanism``; time the loop, each checkpoint, the flush."""
    store_dir = root / f"objects-{mechanism}"
    shutil.rmtree(store_dir, ignore_errors=True)
    store = LocalObjectStore(store_dir)  # durable, as the runtime opens it
    mech: Mechanism | None
    if mechanism == "none":
        mech = None
    elif mechanism == "sync":
        mech = Sync(store)
    elif mechanism == "thread":
        mech = Thread(store)
    elif mechanism == "fork":
        mech = Fork(store)
    else:
        assert shm is not None
        # The worker writes into the same directory through a store of its own.
        shm.store, shm.manifests = store, []
        mech = shm
    blocking: list[float] = []
    expected: list[str] = []
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        step()
        if mech is not None and i % args.every == args.every // 2:
            # The fingerprint is not part of the checkpoint's cost: the clock stops for it.
            paused = time.perf_counter()
            expected.append(fingerprint(objects))
            start += time.perf_counter() - paused
            t0 = time.perf_counter()
            mech.checkpoint(i, objects)
            blocking.append(time.perf_counter() - t0)
    loop = time.perf_counter() - start
    t0 = time.perf_counter()
    if mech is not None:
        mech.flush()
    flush = time.perf_counter() - t0
    if mech is not None:
        got = [fingerprint_of_checkpoint(store, m) for m in mech.manifests]
        if got != expected:
            raise BenchError(f"{mechanism}: checkpoints do not match the state at capture")
    shutil.rmtree(store_dir, ignore_errors=True)
    return {"loop_s": loop, "flush_s": flush, "blocking_s": blocking}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions (>= 5 for the record)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per trial")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (1024: ~80 MB state)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS))
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory for the stores")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="what else ran on the machine, etc.")
    args = parser.parse_args(argv)
    mechanisms = [m for m in args.mechanisms.split(",") if m]
    if args.threads:
        torch.set_num_threads(args.threads)
    began = time.time()
    load_before = os.getloadavg()
    objects, step = make_training(args.width, args.batch)
    nbytes = state_bytes(objects)
    root = Path(tempfile.mkdtemp(prefix="retrolog-bench-materialize-", dir=args.dir))
    shm = (
        Shm(LocalObjectStore(root / "objects-shm"), nbytes + 64 * 64)
        if "shm" in mechanisms
        else None
    )
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in mechanisms}
    try:
        # Warm-up: one checkpoint per mechanism, untimed (first fork, first fsync, allocator).
        warm = argparse.Namespace(**{**vars(args), "steps": 2, "every": 2})
        for m in mechanisms:
            trial(m, objects, step, warm, root, shm)
        for rep in range(args.reps):
            order = mechanisms[rep % len(mechanisms) :] + mechanisms[: rep % len(mechanisms)]
            for m in order:
                samples[m].append(trial(m, objects, step, args, root, shm))
                print(f"rep {rep} {m:6} loop {samples[m][-1]['loop_s']:.2f} s", file=sys.stderr)
    finally:
        if shm is not None:
            shm.stop()
        shutil.rmtree(root, ignore_errors=True)
    figures: dict[str, Any] = {}
    base = [s["loop_s"] for s in samples.get("none", [])]
    for m in mechanisms:
        loops = [s["loop_s"] for s in samples[m]]
        fig: dict[str, Any] = {
            "loop_s": spread(loops),
            "steps_per_s": spread([args.steps / x for x in loops]),
        }
        if m != "none":
            per_ckpt = [b for s in samples[m] for b in s["blocking_s"]]
            fig["blocking_ms_per_checkpoint"] = spread([b * 1e3 for b in per_ckpt])
            fig["flush_s"] = spread([s["flush_s"] for s in samples[m]])
            if base:
                fig["slowdown_pct"] = spread(
                    [100 * (x / b - 1) for x, b in zip(loops, base, strict=True)]
                )
                fig["slowdown_with_flush_pct"] = spread(
                    [
                        100 * ((s["loop_s"] + s["flush_s"]) / b - 1)
                        for s, b in zip(samples[m], base, strict=True)
                    ]
                )
        figures[m] = fig
    result = {
        "benchmark": "materialize",
        "date": dt.datetime.fromtimestamp(began, dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - began, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "repetitions": args.reps,
        "workload": {
            "model": f"MLP {args.width}-{2 * args.width}-{3 * args.width // 2}-{args.width}, Adam",
            "state_mb": round(nbytes / 1e6, 1),
            "batch": args.batch,
            "steps_per_trial": args.steps,
            "checkpoint_every": args.every,
            "checkpoints_per_trial": sum(
                1 for i in range(1, args.steps + 1) if i % args.every == args.every // 2
            ),
            "store": "LocalObjectStore(durable=True) on " + str(root.parent),
            "max_in_flight": MAX_IN_FLIGHT,
        },
        "units": "blocking = wall time of the training thread's checkpoint call (incl. waits "
        "for a free slot); slowdown = loop time / loop time of the 'none' trial of the same "
        "repetition - 1; flush = end of loop until every checkpoint is durable",
        "figures": figures,
    }
    if args.note:
        result["note"] = args.note
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nstate {result['workload']['state_mb']} MB, torch threads {result['torch_threads']}, "
        f"load {load_before[0]:.1f} -> {result['load_average_after'][0]:.1f}"
    )
    print("median [min..max]")
    print(
        f"{'mechanism':9} {'steps/s':>18} {'blocking ms/ckpt':>22} {'slowdown %':>20} "
        f"{'flush s':>18}"
    )

    def cell(f: dict[str, Any] | None, fmt: str) -> str:
        if f is None:
            return "-"
        return f"{f['median']:{fmt}} [{f['min']:{fmt}}..{f['max']:{fmt}}]"

    for m in mechanisms:
        f = figures[m]
        print(
            f"{m:9} {cell(f['steps_per_s'], '.2f'):>18} "
            f"{cell(f.get('blocking_ms_per_checkpoint'), '.0f'):>22} "
            f"{cell(f.get('slowdown_pct'), '.1f'):>20} {cell(f.get('flush_s'), '.2f'):>18}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
