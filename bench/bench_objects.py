"""Benchmark: checkpoint write and restore throughput, S3-compatible server vs local disk.

Run from the repository root with the project's venv (the dev and team extras):

    python -m bench.bench_objects              # ~2 min on 2 cores
    python -m bench.bench_objects --reps 7

Checkpoint write and restore throughput to the S3 server against local disk.
Two states, each encoded as a recording's urgent lane encodes it, while
training runs and when it is over (``encode_urgent``: uncompressed, small
arrays in the manifest), and restored as a replay worker restores it
(``decode``, retrolog's in-process cache emptied first):

- ``cnn``: bench_record's cnn model and Adam state (2.5 MB, 3 objects and the
  manifest);
- ``mlp``: an 8.4M-parameter MLP with Adam (101 MB, a few large objects).

Stores, side by side, repetitions interleaved:

- ``local``: a durable LocalObjectStore in a temporary directory (fsync, rename);
- ``s3``: an FsspecObjectStore at ``s3://bench-objects/rep-N`` on moto's server
  mode on loopback, started by this script (or the one scripts/services.sh
  started). moto keeps objects in memory and answers over HTTP on this
  machine: the figures are the client's and the protocol's cost (HTTP,
  request signing, s3fs), without a network's latency or bandwidth, and
  without a real S3's durability work.

MB/s are of the state's raw (uncompressed) bytes over wall time; medians
[min..max]. Results: bench/results/objects.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench._record_workload import CNN_SETUP
from bench.bench_checkpoint_floor import tensors
from bench.harness import Measured, spread

RESULTS = Path(__file__).resolve().parent / "results" / "objects.json"
BUCKET = "bench-objects"


def _answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


@contextmanager
def s3_server() -> Any:
    """The endpoint of an S3-compatible server: scripts/services.sh's, or one of our own."""
    endpoint = os.environ.get("RETROLOG_TEST_S3_ENDPOINT")
    if endpoint:
        yield endpoint
        return
    moto = Path(sys.executable).with_name("moto_server")
    if not moto.exists():
        raise SystemExit(f"{moto} is missing: install the dev extra (moto[server]).")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(150):
            if _answers(port):
                break
            time.sleep(0.2)
        else:
            raise SystemExit("moto_server did not answer")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def states() -> dict[str, Any]:
    """The two states, each as {name: object} as rl.checkpointing gets them."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    scope: dict[str, Any] = {"torch": torch, "nn": nn}
    exec(CNN_SETUP, scope)
    net, opt, batches = scope["net"], scope["opt"], scope["batches"]
    for xb, yb in batches[:4]:
        opt.zero_grad()
        nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
    mlp = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                        nn.Linear(2048, 1024))  # fmt: skip
    mlp_opt = torch.optim.Adam(mlp.parameters(), lr=1e-4)
    x = torch.randn(64, 1024)
    for _ in range(2):
        mlp_opt.zero_grad()
        mlp(x).square().mean().backward()
        mlp_opt.step()
    return {"cnn": {"net": net, "opt": opt}, "mlp": {"net": mlp, "opt": mlp_opt}}


def measure(reps: int, endpoint: str) -> dict[str, Any]:
    from retrolog.checkpoint._arrays import DECODED
    from retrolog.checkpoint.background import encode_urgent
    from retrolog.checkpoint.codec import decode
    from retrolog.checkpoint.state import snapshot
    from retrolog.store.backends import open_object_store
    from retrolog.store.fsspec_objects import FsspecObjectStore
    from retrolog.store.objects import LocalObjectStore

    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    probe = open_object_store(f"s3://{BUCKET}/probe")
    assert isinstance(probe, FsspecObjectStore)
    if not probe.fs.exists(BUCKET):
        probe.fs.call_s3("create_bucket", Bucket=BUCKET)
    snaps = {name: snapshot(objects) for name, objects in states().items()}
    raw = {name: _raw_bytes(snap) for name, snap in snaps.items()}
    results: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="retrolog-bench-objects-"))
    try:
        times: dict[tuple[str, str, str], list[float]] = {}
        for rep in range(reps):
            for name, snap in snaps.items():
                for kind in ("local", "s3"):
                    if kind == "local":
                        store: Any = LocalObjectStore(work / f"{name}-{rep}")
                    else:
                        store = open_object_store(f"s3://{BUCKET}/{name}-{rep}")
                    t = time.perf_counter()
                    key, _ = encode_urgent(snap, store)
                    times.setdefault((name, kind, "write"), []).append(time.perf_counter() - t)
                    DECODED.clear()
                    t = time.perf_counter()
                    decode(key, store)
                    times.setdefault((name, kind, "restore"), []).append(time.perf_counter() - t)
        for (name, kind, what), seconds in times.items():
            entry = results.setdefault(name, {"raw_mb": raw[name] / 1e6})
            entry[f"{kind}_{what}_seconds"] = spread(seconds)
            entry[f"{kind}_{what}_mb_s"] = spread([raw[name] / 1e6 / s for s in seconds])
        for name, entry in results.items():
            for what in ("write", "restore"):
                s3 = entry[f"s3_{what}_seconds"]["samples"]
                local = entry[f"local_{what}_seconds"]["samples"]
                entry[f"s3_over_local_{what}"] = spread(
                    [a / b for a, b in zip(s3, local, strict=True)]
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _raw_bytes(snap: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(snap.objects))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with Measured("objects", args.reps) as measured, s3_server() as endpoint:
        result = measure(args.reps, endpoint)
    head = measured.head()
    print(f"{args.reps} repetitions, median [min..max], MB/s of raw state bytes")
    for name, entry in result.items():
        print(f"  {name} ({entry['raw_mb']:.1f} MB)")
        for what in ("write", "restore"):
            line = []
            for kind in ("local", "s3"):
                mbs = entry[f"{kind}_{what}_mb_s"]
                line.append(f"{kind} {mbs['median']:.0f} [{mbs['min']:.0f}..{mbs['max']:.0f}]")
            ratio = entry[f"s3_over_local_{what}"]
            print(
                f"    {what:8s} {'  '.join(line)} MB/s; s3 time / local time "
                f"{ratio['median']:.2f} [{ratio['min']:.2f}..{ratio['max']:.2f}]"
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({**head, "states": result}, indent=1) + "\n")
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
