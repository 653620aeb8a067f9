"""Benchmark: what one checkpoint of the cnn workload costs, against the floor of persisting it.

Run from the repository root with the project's venv (retrolog and torch installed):

    python -m bench.bench_checkpoint_floor            # ~1 min on 2 cores
    python -m bench.bench_checkpoint_floor --reps 30

The target is at most 1% record overhead on bench_record's cnn
workload, whose epochs are the blocks the adaptive rule checkpoints. A 1%
target is finer than what whole-run timings resolve on a shared 2-core VM
(bench_record's A/A floor is 3-15%), so this measures the per-checkpoint
cost directly, in CPU time, which other processes' load disturbs much less:

- ``epoch``: one epoch of the cnn (bench/_record_workload.py's CNN_SETUP, torch
  at its default thread count), its wall time and the process's CPU time;
- ``capture``: retrolog's snapshot of the model and Adam state into reused
  buffers, on the training thread (what the training thread pays);
- ``encode``: the urgent lane's encode of that snapshot while training runs
  (``background.encode_urgent``: uncompressed, small arrays in the manifest,
  no deltas) into a durable object store in a temporary directory, in the
  process's CPU time (every thread the encode uses);
- ``floor``: the least work that persists the same state: the tensors' bytes
  copied into preallocated memory, hashed once (xxh3-128), written as one file
  and fsynced, in the process's CPU time. Anything that keeps a checkpoint
  through a power loss and verifies it on read does at least this.

When torch keeps every core busy, a checkpoint's CPU seconds are taken from
training. Its share of an epoch lies between its CPU over the epoch's CPU
(training loses only the core time it took) and its CPU over the epoch's wall
time (training's threads all wait for the one that lost its core). Both are
reported, with the floor's, as medians [min..max] over interleaved
repetitions. The A/A line is the process CPU measured across a sleep as long
as an encode: what the measurement reads when nothing runs.

Results: bench/results/checkpoint_floor.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash

from bench._record_workload import CNN_SETUP
from bench.harness import Measured, spread

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_floor.json"


def percent(parts: list[float], wholes: list[float]) -> dict[str, Any]:
    """Each repetition's part as a percentage of its whole."""
    return spread([100 * a / b for a, b in zip(parts, wholes, strict=True)])


def fmt(values: list[float], scale: float = 1e3, unit: str = "ms") -> str:
    return (
        f"{statistics.median(values) * scale:.2f} {unit} "
        f"[{min(values) * scale:.2f}..{max(values) * scale:.2f}]"
    )


def tensors(value: Any) -> list[Any]:
    """Every tensor in a state dict tree (model and optimizer state)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


class Floor:
    """The least work that persists the state: copy, hash, one write, one fsync."""

    def __init__(self, state: list[Any], directory: Path) -> None:
        import numpy as np
        import torch

        self.sources = [t.detach().reshape(-1).view(torch.uint8) for t in state]
        total = sum(s.numel() for s in self.sources)
        self.buffer = np.empty(total, dtype=np.uint8)
        self.directory = directory
        self.count = 0

    def persist(self) -> int:
        import numpy as np

        offset = 0
        for source in self.sources:
            n = source.numel()
            np.copyto(self.buffer[offset : offset + n], source.numpy())
            offset += n
        xxhash.xxh3_128(self.buffer.data).digest()
        self.count += 1
        path = self.directory / f"floor-{self.count}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = self.buffer.data.cast("B")
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return int(self.buffer.nbytes)


def measure(reps: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from retrolog.checkpoint.background import encode_urgent
    from retrolog.checkpoint.state import SnapshotBuffers, snapshot
    from retrolog.store.objects import LocalObjectStore

    torch.manual_seed(0)
    scope: dict[str, Any] = {"torch": torch, "nn": nn}
    exec(CNN_SETUP, scope)  # x, y, net, opt, batches: the workload's own definitions
    net, opt, batches = scope["net"], scope["opt"], scope["batches"]

    def epoch() -> None:
        for xb, yb in batches:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            loss.item()

    epoch()  # warm up: Adam's state exists from here on
    work = Path(tempfile.mkdtemp(prefix="retrolog-bench-floor-"))
    try:
        store = LocalObjectStore(work / "objects")  # durable, as a recording's store
        floor = Floor(tensors([net.state_dict(), opt.state_dict()]), work)
        buffers = SnapshotBuffers()
        out: dict[str, list[float]] = {
            k: []
            for k in (
                "epoch_wall",
                "epoch_cpu",
                "capture_wall",
                "capture_cpu",
                "encode_wall",
                "encode_cpu",
                "floor_wall",
                "floor_cpu",
                "idle_cpu",
            )
        }
        nbytes = stored = 0
        for _ in range(reps):
            w, c = time.perf_counter(), time.process_time()
            epoch()
            out["epoch_wall"].append(time.perf_counter() - w)
            out["epoch_cpu"].append(time.process_time() - c)
            time.sleep(0.3)  # torch's worker threads stop spinning before anything is timed

            w, c = time.perf_counter(), time.thread_time()
            buffers.rewind()
            snap = snapshot({"net": net, "opt": opt}, buffers)
            out["capture_wall"].append(time.perf_counter() - w)
            out["capture_cpu"].append(time.thread_time() - c)

            w, c = time.perf_counter(), time.process_time()
            _, stored = encode_urgent(snap, store)
            out["encode_wall"].append(time.perf_counter() - w)
            out["encode_cpu"].append(time.process_time() - c)

            w, c = time.perf_counter(), time.process_time()
            nbytes = floor.persist()
            out["floor_wall"].append(time.perf_counter() - w)
            out["floor_cpu"].append(time.process_time() - c)

            c = time.process_time()
            time.sleep(statistics.median(out["encode_wall"]))
            out["idle_cpu"].append(time.process_time() - c)
        checkpoint = [a + b for a, b in zip(out["capture_cpu"], out["encode_cpu"], strict=True)]
        shares: dict[str, Any] = {}
        for what, cpu in (("retrolog", checkpoint), ("floor", out["floor_cpu"])):
            shares[what] = {
                "of_epoch_cpu_pct": percent(cpu, out["epoch_cpu"]),
                "of_epoch_wall_pct": percent(cpu, out["epoch_wall"]),
            }
        return {
            "state_bytes": nbytes,
            "stored_bytes": stored,  # the last checkpoint's manifest and objects
            "torch_threads": torch.get_num_threads(),
            "seconds": {k: spread(v) for k, v in out.items()},
            "checkpoint_cpu_seconds": spread(checkpoint),
            "retrolog_over_floor": spread(
                [a / b for a, b in zip(checkpoint, out["floor_cpu"], strict=True) if b > 0]
            ),
            "share_of_an_epoch": shares,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with Measured("checkpoint_floor", args.reps) as measured:
        result = measure(args.reps)
    head = measured.head()
    s = result["seconds"]
    print(
        f"cnn state {result['state_bytes'] / 1e6:.2f} MB (stored as "
        f"{result['stored_bytes'] / 1e6:.2f} MB), torch on "
        f"{result['torch_threads']} threads, {args.reps} repetitions, median [min..max]"
    )
    print(
        f"  epoch                 wall {fmt(s['epoch_wall']['samples'], 1, 's')}, "
        f"process CPU {fmt(s['epoch_cpu']['samples'], 1, 's')}"
    )
    print(f"  capture (training)    CPU {fmt(s['capture_cpu']['samples'])}")
    print(
        f"  encode (urgent lane)  CPU {fmt(s['encode_cpu']['samples'])}, "
        f"wall {fmt(s['encode_wall']['samples'])}"
    )
    print(
        f"  floor: copy+hash+write+fsync  CPU {fmt(s['floor_cpu']['samples'])}, "
        f"wall {fmt(s['floor_wall']['samples'])}"
    )
    print(f"  A/A: process CPU across an idle sleep  {fmt(s['idle_cpu']['samples'])}")
    ratio = result["retrolog_over_floor"]
    print(
        f"  retrolog checkpoint / floor (CPU): {ratio['median']:.1f}x "
        f"[{ratio['min']:.1f}..{ratio['max']:.1f}]"
    )
    for what, share in result["share_of_an_epoch"].items():
        cpu, wall = share["of_epoch_cpu_pct"], share["of_epoch_wall_pct"]
        print(
            f"  a checkpoint per epoch, {what:8s}: {cpu['median']:.2f}% of the epoch's CPU "
            f"[{cpu['min']:.2f}..{cpu['max']:.2f}] to {wall['median']:.2f}% of its wall time "
            f"[{wall['min']:.2f}..{wall['max']:.2f}]"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({**head, **result}, indent=1) + "\n")
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
