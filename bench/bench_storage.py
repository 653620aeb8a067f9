"""Benchmark: checkpoint storage size and restore time against torch.save / torch.load.

Run from the repository root with the project's venv (retrolog installed):

    python -m bench.bench_storage                     # both parts, ~4 min on 2 cores
    python -m bench.bench_storage --mode compressors  # only the codec comparison
    python -m bench.bench_storage --mode storage --reps 5
    python -m bench.bench_storage --mode chains       # deltas: max_chain 0, 1, 2, 4

Two parts, each side by side in one run, repetitions interleaved (every
configuration once, then again) so that load from other processes spreads over
all of them; figures are medians with [min..max]. torch runs one thread.

compressors (the codec is chosen from these measurements):
  the tensors of a real trained model (the CNN of workload (i) below after its
  last epoch): fp32 weights, Adam's exp_avg and exp_avg_sq, the weights cast
  to bf16 and fp16, and the change of the weights and of exp_avg_sq over the
  last epoch as XOR and as integer difference of the bit patterns. Each
  candidate codec (zstandard plain and after a numpy byte shuffle, c-blosc2
  with shuffle or bitshuffle and zstd or lz4 at several levels as retrolog
  binds it through imagecodecs, and python-blosc2, python-blosc and zipnn when
  installed) compresses and decompresses each in one thread: ratio, compress
  MB/s and decompress MB/s (of uncompressed bytes, wall time).

storage (benchmarks (c) and (d)): two training workloads on sklearn's digits
  (shipped with scikit-learn, no download), a checkpoint of model and Adam
  state after every epoch:

  (i) full training: a CNN (1.07M parameters) trained for 10 epochs;
  (ii) fine-tuning: a frozen MLP backbone (2.2M parameters) and a trainable
       linear head, Adam on the head only, 8 epochs.

  Each workload is trained once (deterministically) and its per-epoch
  snapshots (retrolog's own, as the checkpointer takes them) kept in memory;
  every repetition then writes them (c) as one torch.save file per checkpoint
  (the baseline), into a fresh retrolog object store with a DeltaHistory (what
  the checkpointers do), and into one without (no deltas); stored bytes are
  the sum of the files' sizes (also their disk blocks), the compression MB/s
  is the snapshots' uncompressed bytes over the encode time. (d) restores every
  checkpoint in order, as a replay worker does: ``decode`` from the store into
  tensors against ``torch.load`` of the torch.save file, both from a warm page
  cache (each read once before the timed pass), with retrolog's in-process
  cache of decoded arrays emptied before the timed pass as in a fresh worker
  (within the pass it serves content shared by checkpoints: the keyframe of
  several deltas, a frozen layer). Our restore decodes on every core, torch.load
  uses one. Stores are not durable (no fsync), like torch.save.

chains: workload (i) stored with DeltaHistory(max_chain=0, 1, 2, 4): the
  stored ratio and the CPU time (all threads) of restoring every checkpoint
  over torch.load's (CPU time, steadier than wall time on a shared machine).

Targets: stored bytes at most 0.8x torch.save for (i) and 0.2x for (ii);
restore no slower than torch.load. Results: bench/results/storage.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import Measured

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "storage.json"
TARGETS = {"full_training": 0.8, "fine_tuning": 0.2}  # stored bytes / torch.save bytes


def fmt(values: list[float], digits: int = 0) -> str:
    """Median [min..max]."""
    med = statistics.median(values)
    return f"{med:.{digits}f} [{min(values):.{digits}f}..{max(values):.{digits}f}]"


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- workloads ---------------------------------------------------------------------------


def digits() -> tuple[Any, Any]:
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x, y


def train(net: Any, params: Any, epochs: int, flatten: bool) -> list[Any]:
    """Train on digits with Adam; retrolog snapshots of model and optimizer after each epoch."""
    import torch

    from retrolog.checkpoint.state import snapshot

    x, y = digits()
    if flatten:
        x = x.reshape(len(x), -1)
    opt = torch.optim.Adam(params, lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    snaps = []
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 64):
            batch = order[i : i + 64]
            loss = torch.nn.functional.cross_entropy(net(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        snaps.append(snapshot({"model": net, "optimizer": opt}))
    return snaps


def full_training(epochs: int) -> list[Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    return train(net, net.parameters(), epochs, flatten=False)


def fine_tuning(epochs: int) -> list[Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    # Stands in for a pretrained backbone: its values are as incompressible as a
    # trained one's (float32 mantissas), and it never changes.
    backbone = nn.Sequential(
        nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(),
    )  # fmt: skip
    backbone.requires_grad_(False)
    head = nn.Linear(1024, 10)
    net = nn.Sequential(backbone, head)
    return train(net, head.parameters(), epochs, flatten=True)


def tensors_bytes(value: Any) -> int:
    """Uncompressed bytes of the tensors and arrays in ``value``."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensors_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensors_bytes(v) for v in value)
    return 0


def dir_bytes(root: Path) -> tuple[int, int]:
    """Apparent size and disk blocks (bytes) of the files under ``root``."""
    size = blocks = 0
    for path in root.rglob("*"):
        if path.is_file():
            st = path.stat()
            size += st.st_size
            blocks += st.st_blocks * 512
    return size, blocks


# -- storage (c) and restore (d) ---------------------------------------------------------


def torch_save_all(snaps: list[Any], root: Path) -> tuple[list[Path], float]:
    import torch

    paths, seconds = [], 0.0
    for i, snap in enumerate(snaps):
        path = root / f"epoch{i}.pt"
        started = time.perf_counter()
        torch.save(snap.objects, path)
        seconds += time.perf_counter() - started
        paths.append(path)
    return paths, seconds


def retrolog_save_all(snaps: list[Any], root: Path, deltas: bool) -> tuple[list[str], float, Any]:
    from retrolog.checkpoint.codec import DeltaHistory, encode
    from retrolog.store.objects import LocalObjectStore

    store = LocalObjectStore(root, durable=False)
    history = DeltaHistory() if deltas else DeltaHistory(max_chain=0)
    keys, seconds = [], 0.0
    for snap in snaps:
        started = time.perf_counter()
        key, _ = encode(snap, store, history=history)
        seconds += time.perf_counter() - started
        keys.append(key)
    return keys, seconds, history.total


def time_restores(restore: Callable[[Any], Any], items: list[Any]) -> tuple[float, float]:
    """Wall and CPU seconds to restore every item in order, as a replay worker restores a run's
    checkpoints: from a warm page cache (each item is read once before) but with retrolog's
    in-process cache of decoded arrays emptied, as in a fresh worker process."""
    from retrolog.checkpoint._arrays import DECODED

    for item in items:
        restore(item)
    DECODED.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    for item in items:
        restore(item)
    return time.perf_counter() - wall, time.process_time() - cpu


def check_equal(snaps: list[Any], keys: list[str], root: Path) -> None:
    """Every decoded checkpoint holds exactly the snapshot's tensors."""
    import torch

    from retrolog.checkpoint.codec import decode
    from retrolog.store.objects import LocalObjectStore

    store = LocalObjectStore(root)
    for snap, key in zip(snaps, keys, strict=True):
        out = decode(key, store).objects
        for name in ("model",):
            for k, v in snap.objects[name].items():
                if not torch.equal(v, out[name][k]):
                    raise SystemExit(f"decoded checkpoint {key} differs in {name}.{k}")


def storage(reps: int, epochs_full: int, epochs_ft: int) -> dict[str, Any]:
    import torch

    from retrolog.checkpoint.codec import decode
    from retrolog.store.objects import LocalObjectStore

    workloads = {}
    started = time.perf_counter()
    workloads["full_training"] = full_training(epochs_full)
    workloads["fine_tuning"] = fine_tuning(epochs_ft)
    print(f"trained both workloads in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    raw: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    sizes: dict[str, dict[str, Any]] = {w: {} for w in workloads}

    def add(workload: str, name: str, value: float) -> None:
        raw[workload].setdefault(name, []).append(value)

    for rep in range(reps):
        for workload, snaps in workloads.items():
            logical = sum(tensors_bytes(s.objects) for s in snaps)
            with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
                root = Path(tmp)
                (root / "torch").mkdir()
                # Alternate the order so neither side always runs on a warmer machine.
                order = ["torch", "ours", "ours_nodelta"]
                if rep % 2:
                    order.reverse()
                for side in order:
                    if side == "torch":
                        paths, seconds = torch_save_all(snaps, root / "torch")
                        add(workload, "torch_save_mb_s", logical / seconds / 1e6)
                        sizes[workload]["torch"] = dir_bytes(root / "torch")
                    else:
                        deltas = side == "ours"
                        keys, seconds, stats = retrolog_save_all(snaps, root / side, deltas)
                        add(workload, f"{side}_encode_mb_s", logical / seconds / 1e6)
                        sizes[workload][side] = dir_bytes(root / side)
                        sizes[workload][f"{side}_stats"] = {
                            "objects_written": stats.written_objects,
                            "objects_reused": stats.reused_objects,
                            "delta_objects": stats.delta_objects,
                        }
                        if side == "ours":
                            ours_keys = keys
                        else:
                            nodelta_keys = keys
                if rep == 0:
                    check_equal(snaps, ours_keys, root / "ours")
                ours = LocalObjectStore(root / "ours")
                plain = LocalObjectStore(root / "ours_nodelta")
                restores: list[tuple[str, Callable[[Any], Any], list[Any]]] = [
                    ("torch_load", torch.load, paths),
                    ("ours_restore", lambda k, s=ours: decode(k, s), ours_keys),
                    ("ours_nodelta_restore", lambda k, s=plain: decode(k, s), nodelta_keys),
                ]
                if rep % 2:
                    restores.reverse()
                for name, fn, items in restores:
                    seconds = time_restores(fn, items)[0]
                    add(workload, f"{name}_s", seconds)
                    add(workload, f"{name}_mb_s", logical / seconds / 1e6)
                add(
                    workload,
                    "restore_ratio",
                    raw[workload]["ours_restore_s"][-1] / raw[workload]["torch_load_s"][-1],
                )
                add(
                    workload,
                    "restore_ratio_nodelta",
                    raw[workload]["ours_nodelta_restore_s"][-1] / raw[workload]["torch_load_s"][-1],
                )
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr)

    out: dict[str, Any] = {}
    for workload, snaps in workloads.items():
        logical = sum(tensors_bytes(s.objects) for s in snaps)
        s = sizes[workload]
        entry: dict[str, Any] = {
            "checkpoints": len(snaps),
            "parameters": sum(
                v.numel() for v in snaps[-1].objects["model"].values() if hasattr(v, "numel")
            ),
            "uncompressed_tensor_bytes": logical,
            "torch_save_bytes": s["torch"][0],
            "torch_save_disk_bytes": s["torch"][1],
            "ours_bytes": s["ours"][0],
            "ours_disk_bytes": s["ours"][1],
            "ours_nodelta_bytes": s["ours_nodelta"][0],
            "ratio": s["ours"][0] / s["torch"][0],
            "ratio_disk": s["ours"][1] / s["torch"][1],
            "ratio_nodelta": s["ours_nodelta"][0] / s["torch"][0],
            "target_ratio": TARGETS[workload],
            "ours_stats": s["ours_stats"],
            "ours_nodelta_stats": s["ours_nodelta_stats"],
        }
        entry.update({name: spread(values) for name, values in raw[workload].items()})
        out[workload] = entry
    return out


def chains(reps: int, epochs: int) -> dict[str, Any]:
    """Workload (i) with several ``max_chain`` settings: stored ratio and restore CPU time."""
    import torch

    from retrolog.checkpoint.codec import DeltaHistory, decode, encode
    from retrolog.store.objects import LocalObjectStore

    snaps = full_training(epochs)
    settings = (0, 1, 2, 4)
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-chains-") as tmp:
        root = Path(tmp)
        (root / "torch").mkdir()
        paths, _ = torch_save_all(snaps, root / "torch")
        torch_bytes = dir_bytes(root / "torch")[0]
        stores = {}
        for max_chain in settings:
            store = LocalObjectStore(root / f"chain{max_chain}", durable=False)
            history = DeltaHistory(max_chain=max_chain)
            keys = [encode(snap, store, history=history)[0] for snap in snaps]
            stores[max_chain] = (store, keys, dir_bytes(store.root)[0] / torch_bytes)

        for _ in range(reps):
            # CPU time (of every thread): steadier than wall time on a busy box.
            cpu.setdefault("torch", []).append(time_restores(torch.load, paths)[1])
            for max_chain, (store, keys, _) in stores.items():
                ours = time_restores(lambda k, s=store: decode(k, s), keys)[1]
                ratio = ours / cpu["torch"][-1]
                cpu.setdefault(str(max_chain), []).append(ratio)
    return {
        str(m): {"ratio": stores[m][2], "restore_cpu_vs_torch_load": spread(cpu[str(m)])}
        for m in settings
    }


def print_chains(result: dict[str, Any]) -> None:
    print("\ndelta chains, workload (i): stored/torch.save, restore CPU/torch.load CPU")
    for max_chain, e in result.items():
        r = e["restore_cpu_vs_torch_load"]
        print(
            f"  max_chain={max_chain}: {e['ratio']:.3f}   "
            f"{r['median']:.2f} [{r['min']:.2f}..{r['max']:.2f}]"
        )


def print_storage(result: dict[str, Any]) -> None:
    print("\n(c) bytes stored per run vs torch.save files of the same checkpoints")
    print(
        f"{'workload':14s} {'ckpts':>5s} {'torch.save MB':>13s} {'ours MB':>8s} "
        f"{'ratio':>6s} {'target':>6s} {'no-delta':>8s} {'disk ratio':>10s}"
    )
    for name, e in result.items():
        print(
            f"{name:14s} {e['checkpoints']:5d} {e['torch_save_bytes'] / 1e6:13.2f} "
            f"{e['ours_bytes'] / 1e6:8.2f} {e['ratio']:6.3f} {e['target_ratio']:6.2f} "
            f"{e['ratio_nodelta']:8.3f} {e['ratio_disk']:10.3f}"
        )
    print("\nthroughput, MB/s of uncompressed tensors, median [min..max]")
    for name, e in result.items():
        print(f"  {name}:")
        for key in (
            "ours_encode_mb_s", "ours_nodelta_encode_mb_s", "torch_save_mb_s",
            "ours_restore_mb_s", "ours_nodelta_restore_mb_s", "torch_load_mb_s",
        ):  # fmt: skip
            v = e[key]
            print(f"    {key:28s} {v['median']:7.0f} [{v['min']:.0f}..{v['max']:.0f}]")
    print("\n(d) restore time (all checkpoints) / torch.load time, median [min..max]")
    for name, e in result.items():
        r, n = e["restore_ratio"], e["restore_ratio_nodelta"]
        print(
            f"  {name:14s} with deltas {r['median']:.2f} [{r['min']:.2f}..{r['max']:.2f}]   "
            f"without {n['median']:.2f} [{n['min']:.2f}..{n['max']:.2f}]"
        )


# -- compressors -------------------------------------------------------------------------


def compressor_data() -> dict[str, tuple[np.ndarray[Any, Any], int]]:
    """Name -> (uint8 bytes, item size) of the tensors a trained model's checkpoint holds."""
    import torch

    snaps = full_training(10)
    last, before = snaps[-1].objects, snaps[-2].objects

    def cat(tensors: list[Any]) -> Any:
        return torch.cat([t.reshape(-1) for t in tensors if t.numel() * 4 >= 4096])

    w = cat(list(last["model"].values()))
    w_before = cat(list(before["model"].values()))
    states = last["optimizer"]["state"].values()
    m = cat([s["exp_avg"] for s in states])
    v = cat([s["exp_avg_sq"] for s in states])
    v_before = cat([s["exp_avg_sq"] for s in before["optimizer"]["state"].values()])
    wi, bi = w.view(torch.int32), w_before.view(torch.int32)
    vi, vbi = v.view(torch.int32), v_before.view(torch.int32)

    def u8(t: Any) -> np.ndarray[Any, Any]:
        return t.contiguous().view(torch.uint8).numpy().copy()

    return {
        "fp32 weights": (u8(w), 4),
        "fp32 adam exp_avg": (u8(m), 4),
        "fp32 adam exp_avg_sq": (u8(v), 4),
        "bf16 weights": (u8(w.bfloat16()), 2),
        "fp16 weights": (u8(w.half()), 2),
        "fp32 epoch delta, xor": (u8(wi ^ bi), 4),
        "fp32 epoch delta, difference": (u8(wi - bi), 4),  # wraps, like the codec's
        "exp_avg_sq epoch delta, xor": (u8(vi ^ vbi), 4),
        "exp_avg_sq epoch delta, difference": (u8(vi - vbi), 4),
    }


def decompress_into(blosc2: Any, blob: bytes, out: np.ndarray[Any, Any]) -> Any:
    """python-blosc2 straight into the destination's memory, as retrolog restores."""
    blosc2.decompress2(blob, dst=out, nthreads=1)
    return out


def compressors() -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """Name -> (compress(data, itemsize), decompress(blob, data)) for the installed codecs."""
    from retrolog.checkpoint._arrays import _codec

    codec = _codec()  # c-blosc2, as retrolog binds it (imagecodecs)
    b2 = codec.BLOSC2
    out: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
    try:
        import zstandard
    except ImportError:  # not a dependency of retrolog: pip install zstandard to compare
        zstandard = None

    def shuffle(a: np.ndarray[Any, Any], it: int) -> np.ndarray[Any, Any]:
        return np.ascontiguousarray(a.reshape(-1, it).T)

    def unshuffle(b: bytes, it: int) -> np.ndarray[Any, Any]:
        return np.ascontiguousarray(np.frombuffer(b, np.uint8).reshape(it, -1).T)

    for level in (1, 3) if zstandard is not None else ():
        zc, zd = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        out[f"zstd-{level}"] = (
            lambda a, it, zc=zc: zc.compress(a),
            lambda b, a, it, zd=zd: zd.decompress(b),
        )
        out[f"numpy shuffle + zstd-{level}"] = (
            lambda a, it, zc=zc: zc.compress(shuffle(a, it)),
            lambda b, a, it, zd=zd: unshuffle(zd.decompress(b), it),
        )
    variants = [
        ("shuffle", "ZSTD", 1), ("shuffle", "ZSTD", 3), ("shuffle", "ZSTD", 5),
        ("shuffle", "LZ4", 1), ("shuffle", "LZ4", 5), ("shuffle", "LZ4HC", 5),
        ("bitshuffle", "ZSTD", 1), ("bitshuffle", "LZ4", 1),
    ]  # fmt: skip
    for filt, name, level in variants:
        kw = {
            "compressor": getattr(b2.COMPRESSOR, name),
            "shuffle": b2.FILTER.SHUFFLE if filt == "shuffle" else b2.FILTER.BITSHUFFLE,
            "splitmode": b2.SPLIT.ALWAYS,
            "blocksize": 256 * 1024,
            "numthreads": 1,
        }
        chosen = " (chosen)" if (filt, name, level) == ("shuffle", "ZSTD", 1) else ""
        out[f"blosc2 {filt}+{name.lower()}-{level}{chosen}"] = (
            lambda a, it, level=level, kw=kw: codec.blosc2_encode(a, level, typesize=it, **kw),
            # As the codec restores: straight into the destination's memory.
            lambda b, a, it: codec.blosc2_decode(b, out=np.empty_like(a), numthreads=1),
        )
    try:
        import blosc2  # the python-blosc2 package: the same library, a heavier binding

        blosc2.set_releasegil(True)
        out["python-blosc2 shuffle+zstd-1"] = (
            lambda a, it: blosc2.compress2(
                a, typesize=it, codec=blosc2.Codec.ZSTD, clevel=1,
                filters=[blosc2.Filter.SHUFFLE], splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
                blocksize=256 * 1024, nthreads=1,
            ),
            lambda b, a, it: decompress_into(blosc2, b, np.empty_like(a)),
        )  # fmt: skip
    except ImportError:
        pass
    try:
        import blosc

        blosc.set_nthreads(1)
        blosc.set_releasegil(True)
        out["python-blosc (1.x) shuffle+zstd-5"] = (
            lambda a, it: blosc.compress(a, typesize=it, clevel=5, shuffle=blosc.SHUFFLE,
                                         cname="zstd"),
            lambda b, a, it: blosc.decompress(b),
        )  # fmt: skip
    except ImportError:
        pass
    try:
        from zipnn import ZipNN  # Huffman-codes the exponent bytes (imports torch)

        zipnn = {
            4: ZipNN(bytearray_dtype="float32", threads=1),
            2: ZipNN(bytearray_dtype="bfloat16", threads=1),
        }
        out["zipnn (zstd-3, 1 thread)"] = (
            lambda a, it: zipnn[it].compress(a.tobytes()),
            lambda b, a, it: zipnn[it].decompress(b),
        )
    except ImportError:
        pass
    return out


def compare_compressors(reps: int) -> dict[str, Any]:
    data = compressor_data()
    codecs = compressors()
    raw: dict[tuple[str, str], dict[str, Any]] = {}
    for rep in range(reps):
        names = list(codecs) if rep % 2 == 0 else list(reversed(codecs))
        for dname, (arr, itemsize) in data.items():
            for cname in names:
                comp, dec = codecs[cname]
                started = time.perf_counter()
                blob = comp(arr, itemsize)
                compressed = time.perf_counter()
                back = dec(blob, arr, itemsize)
                done = time.perf_counter()
                if rep == 0 and bytes(memoryview(back).cast("B")) != arr.tobytes():
                    raise SystemExit(f"{cname} does not round-trip {dname}")
                entry = raw.setdefault((dname, cname), {"ratio": len(blob) / arr.nbytes})
                entry.setdefault("compress", []).append(arr.nbytes / (compressed - started) / 1e6)
                entry.setdefault("decompress", []).append(arr.nbytes / (done - compressed) / 1e6)
        print(f"compressors: repetition {rep + 1}/{reps} done", file=sys.stderr)
    out: dict[str, Any] = {
        "data_bytes": {d: int(a.nbytes) for d, (a, _) in data.items()},
        "results": {},
    }
    for (dname, cname), e in raw.items():
        out["results"].setdefault(dname, {})[cname] = {
            "ratio": round(e["ratio"], 4),
            "compress_mb_s": spread(e["compress"]),
            "decompress_mb_s": spread(e["decompress"]),
        }
    return out


def print_compressors(result: dict[str, Any]) -> None:
    print("\ncompressor comparison: ratio, compress MB/s, decompress MB/s, median [min..max]")
    for dname, by_codec in result["results"].items():
        print(f"  {dname} ({result['data_bytes'][dname] / 1e6:.1f} MB)")
        for cname, e in by_codec.items():
            c, d = e["compress_mb_s"], e["decompress_mb_s"]
            print(
                f"    {cname:38s} {e['ratio']:.3f}"
                f"  {c['median']:5.0f} [{c['min']:.0f}..{c['max']:.0f}]"
                f"  {d['median']:5.0f} [{d['min']:.0f}..{d['max']:.0f}]"
            )


# -- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mode", choices=["all", "storage", "compressors", "chains"], default="all"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs-full", type=int, default=10)
    parser.add_argument("--epochs-finetune", type=int, default=8)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.reps < 3:
        parser.error("--reps must be at least 3 (medians of fewer are not worth quoting)")

    import torch

    torch.set_num_threads(1)
    measured = Measured("storage", args.reps).start()
    result: dict[str, Any] = {}
    if args.mode in ("all", "compressors"):
        result["compressors"] = compare_compressors(args.reps)
    if args.mode in ("all", "storage"):
        result["storage"] = storage(args.reps, args.epochs_full, args.epochs_finetune)
    if args.mode in ("all", "chains"):
        result["chains"] = chains(args.reps, args.epochs_full)
    measured.finish()
    versions = {}
    for package in ("torch", "numpy", "imagecodecs", "blosc2", "xxhash", "zstandard"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    head = measured.head()
    document = {**head, "versions": versions, "torch_threads": 1, **result}
    if "compressors" in result:
        print_compressors(result["compressors"])
    if "storage" in result:
        print_storage(result["storage"])
    if "chains" in result:
        print_chains(result["chains"])
    print(f"\nload average before {measured.load_before}, after {measured.load_after}")
    if args.output.exists() and args.mode != "all":
        # A partial run keeps the other part's figures from the last full run.
        previous = json.loads(args.output.read_text())
        parts = ("compressors", "storage", "chains")
        document = {**{k: previous[k] for k in parts if k in previous},
                    **document}  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
