"""Compact checkpoint storage: compression, deltas, dedup across runs, corruption, format /1."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from retrolog.checkpoint import _arrays, codec
from retrolog.checkpoint._arrays import read_info
from retrolog.checkpoint.capture import CheckpointRecord, SynchronousCheckpointer
from retrolog.checkpoint.codec import DeltaHistory, Interrupted, decode, encode, manifest_blobs
from retrolog.checkpoint.state import Snapshot
from retrolog.errors import CorruptObjectError, StoreError
from retrolog.store.objects import LocalObjectStore

from .test_checkpoint_codec import assert_same
from conftest import WrappingStore

TORCH_FLOATS = {  # dtype -> the signed integer type of its width, for its bit patterns
    "float16": (torch.float16, torch.int16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "float32": (torch.float32, torch.int32),
    "float64": (torch.float64, torch.int64),
}
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]
# encode()'s modes: the idle lane's (zstd, deltas) and the urgent lane's (uncompressed,
# small arrays in the manifest).
MODES: dict[str, dict[str, bool]] = {"small": {}, "least_cpu": {"least_cpu": True}}


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects", durable=False)


def files(store: LocalObjectStore) -> dict[Path, int]:
    return {p: p.stat().st_size for p in store.root.rglob("*") if p.is_file()}


def weights(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 0.05).to(dtype)


def bit_patterns(rng: np.random.Generator, dtype: str, n: int) -> torch.Tensor:
    """``n`` values of every kind: normal ones, arbitrary bit patterns (nan payloads,
    subnormals, -nan) and the special values."""
    tdtype, tint = TORCH_FLOATS[dtype]
    values = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(tdtype)
    bits = values.view(tint).numpy().copy()
    info = np.iinfo(bits.dtype)
    arbitrary = rng.integers(info.min, info.max, n, dtype=bits.dtype, endpoint=True)
    special = torch.tensor(SPECIAL, dtype=tdtype).view(tint).numpy()
    kind = rng.random(n)
    bits = np.where(kind < 0.2, arbitrary, bits)
    bits = np.where(kind > 0.95, special[rng.integers(0, len(special), n)], bits)
    return torch.from_numpy(bits).view(tdtype)


def step(rng: np.random.Generator, t: torch.Tensor, how: str) -> torch.Tensor:
    """The next version of ``t`` in a made-up run."""
    if how == "same":
        return t.clone()
    if how == "random":
        return bit_patterns(rng, str(t.dtype).removeprefix("torch."), t.numel()).reshape(t.shape)
    noise = torch.from_numpy(rng.standard_normal(t.numel()).astype(np.float32) * 1e-3)
    return (t.float() + noise.reshape(t.shape)).to(t.dtype)  # nan and inf stay as they are


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "transposed" and t.dim() == 2:
        return t.t()
    if how == "strided":
        return t.reshape(-1)[::2]
    return t


# ------------------------------------------------------------------ round trips


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(sorted(TORCH_FLOATS)),
    n=st.sampled_from([0, 1, 7, 300, 1025, 2048, 6000]),
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(st.sampled_from(["same", "small", "random"]), min_size=1, max_size=7),
    how=st.sampled_from(["contiguous", "transposed", "strided"]),
    max_chain=st.sampled_from([0, 1, 2, 4]),
    history=st.booleans(),
    bases_in_memory=st.booleans(),
    mode=st.sampled_from(sorted(MODES)),
)
def test_tensor_versions_round_trip_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    dtype: str,
    n: int,
    seed: int,
    steps: list[str],
    how: str,
    max_chain: int,
    history: bool,
    bases_in_memory: bool,
    mode: str,
) -> None:
    """Every version of a tensor decodes to its exact bits, through deltas and chains,
    with the delta bases kept in memory or read back from the store, in every encode mode
    (a run's checkpoints come from both writer lanes, so the modes interleave)."""
    store = LocalObjectStore(tmp_path_factory.mktemp("objects"), durable=False)
    rng = np.random.default_rng(seed)
    # min_gain=1 takes a delta whenever it is not larger: chains get long quickly.
    budget = _arrays.BASE_BUDGET_BYTES if bases_in_memory else 0
    hist = DeltaHistory(max_chain=max_chain, min_gain=1.0, base_budget=budget) if history else None
    t = bit_patterns(rng, dtype, n).reshape(2, -1) if n % 2 == 0 else bit_patterns(rng, dtype, n)
    written = []
    for how_next in ["same", *steps]:
        t = step(rng, t, how_next)
        value = {"w": layout(t, how), "copy": t.clone(), "n": 3}
        key, _ = encode(
            Snapshot(objects={"model": value}, rng={}), store, history=hist, **MODES[mode]
        )
        fresh = layout(t, how).clone(memory_format=torch.contiguous_format)
        written.append((key, {"w": fresh, "copy": t.clone(), "n": 3}))
    for key, expected in written:
        assert_same(decode(key, store).objects["model"], expected)
    for key, _ in written:
        for blob in manifest_blobs(key, store):
            info = read_info(store, blob)
            assert info is None or info.depth <= max_chain


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(["<f2", "<f4", "<f8", ">f4", "<i4", "|u1", "|b1", "<c16"]),
    shape=st.sampled_from([(0,), (5,), (40, 30), (600, 7), (3, 0, 2), ()]),
    order=st.sampled_from(["C", "F", "strided"]),
    seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(sorted(MODES)),
)
def test_arrays_round_trip_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    dtype: str,
    shape: tuple[int, ...],
    order: str,
    seed: int,
    mode: str,
) -> None:
    store = LocalObjectStore(tmp_path_factory.mktemp("objects"), durable=False)
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    arr = np.frombuffer(rng.bytes(size), dtype=dtype).reshape(shape)  # every bit pattern
    if order == "F":
        arr = np.asfortranarray(arr)
    elif order == "strided" and arr.ndim >= 1:
        arr = np.repeat(arr, 2, axis=0)[::2]
    else:
        arr = arr.copy()
    hist = DeltaHistory(min_gain=1.0)
    changed = arr.copy()
    changed.reshape(-1).view(np.uint8)[::7] ^= 1  # a next version close to this one
    for version in (arr, arr.copy(), changed, changed):
        snap = Snapshot(objects={"a": [version]}, rng={})
        key, _ = encode(snap, store, history=hist, **MODES[mode])
        out = decode(key, store).objects["a"][0]
        assert out.dtype == version.dtype and out.shape == version.shape
        assert out.tobytes() == version.tobytes()
        if version.flags.f_contiguous and not version.flags.c_contiguous:
            assert out.flags.f_contiguous


def test_state_dicts_of_every_kind_round_trip(store: LocalObjectStore) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(8, 64)).sum().backward()
    opt.step()
    state = net.state_dict()
    assert hasattr(state, "_metadata")
    value = {
        "model": state,
        "optimizer": opt.state_dict(),
        "nested": OrderedDict([("t", (torch.arange(2000), [np.ones((40, 40), order="F")]))]),
        "set": {1, 2, 3},
        "big_bytes": os.urandom(5000),
    }
    hist = DeltaHistory()
    for _ in range(3):
        key, _ = encode(Snapshot(objects=value, rng={}), store, history=hist)
        assert_same(decode(key, store).objects, value)


def test_float_tensors_are_compressed_and_others_stored_as_they_come(
    store: LocalObjectStore,
) -> None:
    w = weights(100_000)  # 400 kB of float32 "weights": only the exponents compress
    ints = torch.randint(0, 2**31 - 1, (100_000,), dtype=torch.int32)
    key, nbytes = encode(Snapshot(objects={"w": w, "i": ints}, rng={}), store)
    infos = {b: read_info(store, b) for b in manifest_blobs(key, store)}
    by_codec = {_arrays.CODEC_NAMES[i.codec]: i.size for i in infos.values() if i}
    assert by_codec["blosc2 shuffle+zstd"] < 0.9 * 400_000
    assert by_codec["raw"] == 400_000 + _arrays.HEADER_SIZE
    assert nbytes == sum(files(store).values())


# ------------------------------------------------------------------ deltas


def training_run(store: LocalObjectStore, hist: DeltaHistory | None, epochs: int) -> list[str]:
    """Checkpoints of a tensor that moves a little each epoch, and of a frozen one."""
    w = weights(50_000, seed=1)
    frozen = weights(50_000, seed=2)
    keys = []
    for epoch in range(epochs):
        w = w + weights(50_000, seed=100 + epoch) * 1e-3
        snap = Snapshot(objects={"model": {"w": w, "frozen": frozen}}, rng={})
        keys.append(encode(snap, store, history=hist)[0])
    return keys


@pytest.mark.parametrize("max_chain", [1, 2])
def test_deltas_shrink_a_run_and_chains_are_capped(tmp_path: Path, max_chain: int) -> None:
    full = LocalObjectStore(tmp_path / "full", durable=False)
    training_run(full, None, 7)
    store = LocalObjectStore(tmp_path / "delta", durable=False)
    hist = DeltaHistory(max_chain=max_chain)
    keys = training_run(store, hist, 7)
    assert sum(files(store).values()) < 0.85 * sum(files(full).values())
    stats = hist.total
    assert stats.delta_objects == 6  # every epoch after the first
    assert stats.reused_objects == 6  # the frozen tensor after the first checkpoint
    assert stats.written_bytes == sum(files(store).values())
    infos = {b: read_info(store, b) for k in keys for b in manifest_blobs(k, store)}
    assert max(i.depth for i in infos.values() if i) == max_chain
    if max_chain == 1:
        # Every delta is against the same full version (a keyframe): restores decode two.
        (keyframe,) = {i.base for i in infos.values() if i and i.base}
        assert infos[keyframe].depth == 0  # type: ignore[union-attr]


def test_manifest_blobs_includes_delta_bases(store: LocalObjectStore) -> None:
    hist = DeltaHistory(max_chain=4, min_gain=1.0)
    keys = training_run(store, hist, 4)
    last = keys[-1]
    needed = manifest_blobs(last, store)
    # Only the frozen tensor and the newest w are named in the manifest; three bases are not.
    assert len(needed) == 2 + 3
    # Deleting everything else (what gc would do) leaves the checkpoint restorable.
    for path in files(store):
        key = path.parent.name + path.name
        if key not in needed and key != last:
            path.unlink()
    assert decode(last, store).objects["model"]["w"].shape == (50_000,)
    # An object missing from the chain makes the dependencies unknowable: say so.
    store.delete(sorted(needed, key=lambda k: read_info(store, k).depth)[0])  # type: ignore[union-attr]
    with pytest.raises(StoreError, match="cannot be known"):
        manifest_blobs(last, store)


def test_nbytes_counts_the_delta_base(store: LocalObjectStore) -> None:
    hist = DeltaHistory(min_gain=1.0)
    w = weights(50_000)
    encode(Snapshot(objects={"w": w}, rng={}), store, history=hist)
    key, nbytes = encode(Snapshot(objects={"w": w + 1e-4}, rng={}), store, history=hist)
    assert hist.last is not None and hist.last.delta_objects == 1
    needed = manifest_blobs(key, store)
    assert len(needed) == 2  # the delta and its base
    assert (
        nbytes
        == hist.last.stored_bytes
        == sum(store.path(k).stat().st_size for k in needed | {key})
    )


def test_bases_beyond_the_budget_are_read_back_and_store_the_same_bytes(
    tmp_path: Path,
) -> None:
    """A base that does not fit the budget is decoded from the store when a delta is
    tried: the objects written are byte for byte those of a history that kept it."""
    big, small = weights(60_000, seed=1), weights(20_000, seed=2)  # 240 kB and 80 kB
    stores = {}
    for budget in (_arrays.BASE_BUDGET_BYTES, small.numel() * 4, 0):
        store = LocalObjectStore(tmp_path / str(budget), durable=False)
        hist = DeltaHistory(base_budget=budget)
        state = {"small": small.clone(), "big": big.clone()}
        keys, expected = [], []
        for i in range(4):
            key, _ = encode(Snapshot(objects={"model": state}, rng={}), store, history=hist)
            keys.append(key)
            expected.append(state)
            held = {path: p.base is not None for path, p in hist._paths.items()}
            assert hist.base_bytes == sum(
                p.base.nbytes for p in hist._paths.values() if p.base is not None
            )
            assert hist.base_bytes <= budget
            if i:
                assert hist.last is not None and hist.last.delta_objects == 2
            state = {name: t + 1e-4 * (i + 1) for name, t in state.items()}
        # Kept in the order the tensors are first stored, while they fit.
        if budget == 0:
            assert not any(held.values())
        elif budget == small.numel() * 4:
            assert sorted(p for p, kept in held.items() if kept) == [
                p for p in held if "small" in p
            ]
        else:
            assert all(held.values())
        for key, state in zip(keys, expected, strict=True):
            out = decode(key, store).objects["model"]
            assert set(out) == set(state)
            assert all(torch.equal(out[name], state[name]) for name in state)
        stores[budget] = {
            p.relative_to(store.root): p.read_bytes() for p in store.root.rglob("*") if p.is_file()
        }
    first, *others = stores.values()
    assert all(other == first for other in others)


@pytest.mark.parametrize("bases_in_memory", [True, False])
def test_an_interrupted_encode_leaves_the_delta_history_as_it_was(
    tmp_path: Path, bases_in_memory: bool
) -> None:
    """The idle lane stops between two arrays when the urgent lane takes a checkpoint
    over. What it did to the first array must not reach the history: the next delta
    against that array's base would decode to other values (the demo showed it)."""
    store = LocalObjectStore(tmp_path / "objects", durable=False)
    budget = _arrays.BASE_BUDGET_BYTES if bases_in_memory else 0
    # With chains of 2, a delta becomes the next one's base: its bytes replace the base's
    # (as a version stored in full does with the default chains of 1).
    hist = DeltaHistory(max_chain=2, min_gain=1.0, base_budget=budget)

    def state(step: int) -> dict[str, Any]:
        return {"m": {name: weights(50_000, seed=seed) + 1e-3 * step for name, seed in
                      (("a", 1), ("b", 2))}}  # fmt: skip

    encode(Snapshot(objects=state(0), rng={}), store, history=hist)
    polls = iter([False, True])  # "a" is written (as a delta), then the encode stops
    with pytest.raises(Interrupted):
        encode(
            Snapshot(objects=state(1), rng={}), store, history=hist, interrupt=lambda: next(polls)
        )
    assert hist.base_bytes == (2 * 200_000 if bases_in_memory else 0)
    key, _ = encode(Snapshot(objects=state(2), rng={}), store, history=hist)
    assert hist.last is not None and hist.last.delta_objects == 2
    assert_same(decode(key, store).objects, state(2))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["same", "small", "random"]),  # how each tensor changes
            st.sampled_from(["idle", "idle stopped", "urgent"]),  # who writes it
            st.integers(0, 2),  # arrays the idle lane writes before it stops (of 3)
        ),
        min_size=1,
        max_size=8,
    ),
    max_chain=st.sampled_from([1, 2, 3]),
    bases_in_memory=st.booleans(),
)
# A stop right after an array whose bytes became a base (the bug of 2026-11-27): a delta
# with chains of 2; with chains of 1, a version stored in full while its path backs off.
@example(0, [("small", "idle", 0), ("small", "idle stopped", 1), ("small", "idle", 0)], 2, True)
@example(
    0,
    [
        ("small", "idle", 0),
        ("random", "idle", 0),
        ("small", "idle stopped", 1),
        ("small", "idle", 0),
    ],
    1,
    True,
)
def test_checkpoints_from_both_lanes_with_stops_all_restore_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    steps: list[tuple[str, str, int]],
    max_chain: int,
    bases_in_memory: bool,
) -> None:
    """A run's checkpoints as the two lanes write them: the idle lane (deltas, one history)
    stopped between arrays at any point, the urgent lane (no history) writing that
    checkpoint or the next. Every checkpoint written restores to its state, bit for bit."""
    store = LocalObjectStore(tmp_path_factory.mktemp("objects"), durable=False)
    rng = np.random.default_rng(seed)
    budget = _arrays.BASE_BUDGET_BYTES if bases_in_memory else 0
    hist = DeltaHistory(max_chain=max_chain, base_budget=budget)  # deltas that do not pay
    names = ["a", "b", "c"]  # 80 kB each: objects, not inline
    tensors = {n: bit_patterns(rng, "float32", 20_000) for n in names}
    written: list[tuple[str, dict[str, torch.Tensor]]] = []
    for how, who, after in steps:
        tensors = {n: step(rng, t, how) for n, t in tensors.items()}
        snap = Snapshot(objects={"model": dict(tensors)}, rng={})
        expected = {"model": {n: t.clone() for n, t in tensors.items()}}
        if who == "idle stopped":
            polls = iter([False] * after + [True] * 10)
            with pytest.raises(Interrupted):
                encode(snap, store, history=hist, interrupt=lambda p=polls: next(p))
            key, _ = encode(snap, store, least_cpu=True)  # the urgent lane takes it over
        else:
            key, _ = encode(snap, store, history=hist if who == "idle" else None,
                            least_cpu=who == "urgent")  # fmt: skip
        written.append((key, expected))
    for key, expected in written:
        assert_same(decode(key, store).objects, expected)


def test_a_damaged_base_that_is_read_back_gives_a_full_object(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects", durable=False)
    hist = DeltaHistory(min_gain=1.0, base_budget=0)
    w = weights(50_000)
    first, _ = encode(Snapshot(objects={"w": w}, rng={}), store, history=hist)
    (base,) = manifest_blobs(first, store) - {first}
    path = store.path(base)
    damaged = bytearray(path.read_bytes())
    damaged[-100] ^= 0xFF  # inside the compressed body: the header still reads
    path.write_bytes(bytes(damaged))
    later = w + 1e-4
    key, _ = encode(Snapshot(objects={"w": later}, rng={}), store, history=hist)
    assert hist.last is not None and hist.last.delta_objects == 0
    infos = [read_info(store, b) for b in manifest_blobs(key, store) - {key}]
    assert [i.depth for i in infos if i is not None] == [0]
    assert torch.equal(decode(key, store).objects["w"], later)


def test_deltas_that_do_not_pay_are_tried_less_and_less(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = _arrays._compress

    def counting(data: Any, itemsize: int) -> Any:
        calls.append(data.nbytes)
        return original(data, itemsize)

    monkeypatch.setattr(_arrays, "_compress", counting)
    hist = DeltaHistory()
    rng = np.random.default_rng(0)
    for _ in range(12):  # a tensor that changes completely, like an Adam moment
        noise = torch.from_numpy(rng.standard_normal(20_000).astype(np.float32))
        encode(Snapshot(objects={"m": noise}, rng={}), store, history=hist)
    assert hist.total.delta_objects == 0
    # One compression per checkpoint for the full object, plus the delta attempts:
    # at checkpoints 2, 4 and 8, each failure doubling the wait (1, 3, 7).
    assert len(calls) == 12 + 3


def test_a_delta_whose_base_was_deleted_is_rewritten(store: LocalObjectStore) -> None:
    hist = DeltaHistory(min_gain=1.0)
    keys = training_run(store, hist, 2)
    (delta,) = [b for b in manifest_blobs(keys[1], store) if read_info(store, b).depth == 1]  # type: ignore[union-attr]
    base = read_info(store, delta).base  # type: ignore[union-attr]
    assert base is not None
    store.delete(base)
    # A new run (no history) meets the same tensor: it must not reuse the broken object.
    w = weights(50_000, seed=1) + weights(50_000, seed=100) * 1e-3
    w = w + weights(50_000, seed=101) * 1e-3
    new = encode(Snapshot(objects={"w": w}, rng={}), store)[0]
    assert read_info(store, delta).depth == 0  # type: ignore[union-attr]
    assert torch.equal(decode(new, store).objects["w"], w)


def test_the_history_keeps_its_own_copy_of_the_base(store: LocalObjectStore) -> None:
    """Snapshot buffers are reused by later snapshots; deltas must not read them."""
    hist = DeltaHistory(min_gain=1.0)
    buffer = weights(20_000)
    first = buffer.clone()
    k1 = encode(Snapshot(objects={"w": buffer}, rng={}), store, history=hist)[0]
    buffer.add_(1e-3)  # the checkpointer reuses the memory for the next snapshot
    second = buffer.clone()
    k2 = encode(Snapshot(objects={"w": buffer}, rng={}), store, history=hist)[0]
    assert hist.last is not None and hist.last.delta_objects == 1
    assert torch.equal(decode(k1, store).objects["w"], first)
    assert torch.equal(decode(k2, store).objects["w"], second)


def test_consecutive_restores_decode_shared_content_once(store: LocalObjectStore) -> None:
    """Replay restores the checkpoints of consecutive iterations: their deltas share a
    keyframe, and a frozen tensor is the same object in each."""
    hist = DeltaHistory(min_gain=1.0)
    w = weights(50_000, seed=1)
    frozen = weights(50_000, seed=2)
    values, keys = [], []
    for epoch in range(5):
        w = w + weights(50_000, seed=100 + epoch) * 1e-3
        values.append(w)
        snap = Snapshot(objects={"w": w, "frozen": frozen}, rng={})
        keys.append(encode(snap, store, history=hist)[0])

    def key_of(t: torch.Tensor) -> str:
        return _arrays.content_key("torch.float32", t.shape, t.numpy().view(np.uint8))

    frozen_key, keyframe = key_of(frozen), key_of(values[0])
    assert {read_info(store, key_of(v)).base for v in values[1:]} == {keyframe}  # type: ignore[union-attr]

    reads: list[str] = []

    class Counting(WrappingStore):
        def get(self, key: str) -> bytes:
            reads.append(key)
            return super().get(key)

    counting = Counting(store)
    for key, value in zip(keys, values, strict=True):
        out = decode(key, counting).objects
        assert torch.equal(out["w"], value) and torch.equal(out["frozen"], frozen)
    assert reads.count(keyframe) == 2  # as itself, then as the first delta's base
    assert reads.count(frozen_key) == 2  # read once is not cached; read twice it is

    # A cached array is the content its key names: restores stay exact even once the
    # file is damaged, and a process without the cache reports the damage.
    path = store.path(keyframe)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert torch.equal(decode(keys[4], store).objects["w"], values[4])
    _arrays.DECODED.clear()
    with pytest.raises(CorruptObjectError):
        decode(keys[4], store)


def test_the_decoded_cache_admits_bounds_and_adds_wrapping() -> None:
    cache = _arrays.DecodedArrays(capacity=3000)
    cache.keep("a", np.zeros(4000, dtype=np.uint8))  # more than the capacity
    assert not cache.copy_to("a", np.empty(4000, dtype=np.uint8))
    b = np.arange(500, dtype=np.uint32)
    cache.keep("b", b.view(np.uint8))  # 2000 bytes
    cache.offer("c", np.full(1000, 7, dtype=np.uint8))  # read once: only remembered
    assert not cache.copy_to("c", np.empty(1000, dtype=np.uint8))
    second = np.full(1000, 7, dtype=np.uint8)
    cache.offer("c", second)  # read twice: a copy is kept; the cache is exactly full
    second[:] = 0  # the caller's array is the caller's
    out = np.empty(1000, dtype=np.uint8)
    assert cache.copy_to("c", out) and (out == 7).all()
    total = np.full(500, 0xFFFFFFFF, dtype=np.uint32)
    assert cache.add_to("b", total)  # b is now the most recently used
    np.testing.assert_array_equal(total, np.arange(500, dtype=np.uint32) - 1)  # wrapped
    assert not cache.add_to("b", np.zeros(250, dtype=np.uint32))  # another size: not b
    cache.keep("d", np.zeros(1000, dtype=np.uint8))  # evicts c, the least recently used
    assert not cache.copy_to("c", out)
    assert cache.copy_to("b", np.empty(2000, dtype=np.uint8))
    assert cache.copy_to("d", out)


# ------------------------------------------------------------------ dedup


def test_unchanged_tensors_are_written_once_across_runs(tmp_path: Path) -> None:
    root = tmp_path / "objects"
    backbone = {f"layer{i}": weights(200_000, seed=i) for i in range(4)}
    sizes = []
    for run in range(2):
        store = LocalObjectStore(root, durable=False)  # each run opens the store itself
        history = DeltaHistory()  # and has its own history
        for epoch in range(3):
            head = {"head": weights(20_000, seed=1000 * run + epoch)}
            snap = Snapshot(objects={"backbone": backbone, "head": head}, rng={})
            encode(snap, store, history=history)
        sizes.append(history.total)
    first, second = sizes
    backbone_objects = 4
    assert first.written_objects == backbone_objects + 3 * 2  # + a head and a manifest each
    assert second.written_objects == 3 * 2  # the backbone was already stored
    assert second.reused_objects == 3 * backbone_objects
    assert second.written_bytes < 0.1 * first.written_bytes
    tensor_files = [p for p in files(LocalObjectStore(root)) if len(p.parent.name + p.name) == 32]
    assert len(tensor_files) == backbone_objects + 6


def test_reusing_an_object_freshens_it_and_its_bases(store: LocalObjectStore) -> None:
    """gc keeps objects written after a running run started; reuse counts as a write."""
    hist = DeltaHistory(min_gain=1.0)
    keys = training_run(store, hist, 2)
    old = time.time() - 10 * 24 * 3600
    for path in files(store):
        os.utime(path, (old, old))
    snap = decode(keys[1], store)
    encode(snap, store)  # another run with the same state: everything is reused
    for blob in manifest_blobs(keys[1], store):
        assert store.path(blob).stat().st_mtime > old + 3600


# ------------------------------------------------------------------ corruption


def big_checkpoint(store: LocalObjectStore) -> tuple[str, str]:
    key, _ = encode(Snapshot(objects={"w": weights(20_000)}, rng={}), store)
    (blob,) = manifest_blobs(key, store)
    return key, blob


@pytest.mark.parametrize("damage", ["flip payload", "flip header", "truncate", "append"])
def test_a_damaged_object_is_named(store: LocalObjectStore, damage: str) -> None:
    key, blob = big_checkpoint(store)
    path = store.path(blob)
    raw = bytearray(path.read_bytes())
    if damage == "flip payload":
        raw[len(raw) // 2] ^= 0x10
    elif damage == "flip header":
        raw[12] ^= 0x01  # inside the key the header carries
    elif damage == "truncate":
        del raw[len(raw) // 2 :]
    else:
        raw += b"\0"
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObjectError, match=blob) as info:
        decode(key, store)
    assert info.value.key == blob
    assert "replay has to execute" in str(info.value)


def test_an_object_under_the_wrong_key_is_caught_by_its_content_hash(
    store: LocalObjectStore,
) -> None:
    key_a, blob_a = big_checkpoint(store)
    key_b, _ = encode(Snapshot(objects={"w": weights(20_000, seed=5)}, rng={}), store)
    (blob_b,) = manifest_blobs(key_b, store)
    # Re-frame b's payload under a's key: a valid frame whose content is not a's.
    payload = bytes(store.get(blob_b))[48:]
    from retrolog.store.objects import frame

    store.delete(blob_a)
    store.put(frame(blob_a, payload))
    with pytest.raises(CorruptObjectError, match="does not hash to its key") as info:
        decode(key_a, store)
    assert info.value.key == blob_a


def test_a_damaged_delta_base_fails_the_delta(store: LocalObjectStore) -> None:
    keys = training_run(store, DeltaHistory(min_gain=1.0), 2)
    needed = manifest_blobs(keys[1], store)
    infos = {b: read_info(store, b) for b in needed}
    (delta,) = [b for b, i in infos.items() if i is not None and i.depth == 1]
    base = infos[delta].base  # type: ignore[union-attr]
    assert base is not None
    path = store.path(base)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObjectError) as info:
        decode(keys[1], store)
    assert info.value.key == base


# ------------------------------------------------------------------ format /1


def test_format_1_manifests_still_decode(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint as retrolog 0.1 wrote it: raw sha256 objects and a /1 manifest.

    It holds a pickle: read once the user says they trust the store's pickles.
    """
    monkeypatch.setenv("RETROLOG_TRUST_PICKLES", "1")
    w = weights(3000)
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    w_blob = store.put(w.numpy().tobytes())
    a_blob = store.put(np.asfortranarray(arr).tobytes(order="F"))
    p_blob = store.put(pickle.dumps({1, 2}))
    assert w_blob == hashlib.sha256(w.numpy().tobytes()).hexdigest()
    doc = {
        "format": "retrolog.snapshot/1",
        "objects": {"$": "dict", "items": [["model", {"$": "odict", "items": [
            ["w", {"$": "tensor", "dtype": "float32", "shape": [3000], "device": "cpu",
                   "blob": w_blob}],
            ["a", {"$": "ndarray", "dtype": "<f8", "shape": [3, 4], "order": "F",
                   "blob": a_blob}],
            ["s", {"$": "pickle", "blob": p_blob}],
            ["b", {"$": "bytes", "b64": base64.b64encode(b"hi").decode()}],
        ], "metadata": {"$": "dict", "items": [["", {"$": "dict", "items": [["version", 1]]}]]}}]]},
        "rng": {"$": "dict", "items": []},
    }  # fmt: skip
    key = store.put(json.dumps(doc).encode())
    out = decode(key, store).objects["model"]
    assert torch.equal(out["w"], w)
    assert np.array_equal(out["a"], arr) and out["a"].flags.f_contiguous
    assert out["s"] == {1, 2} and out["b"] == b"hi"
    assert out._metadata == {"": {"version": 1}}
    assert manifest_blobs(key, store) == {w_blob, a_blob, p_blob}
    # A damaged /1 object is still named.
    store.path(w_blob).write_bytes(b"\0" * 12000)
    with pytest.raises(CorruptObjectError) as info:
        decode(key, store)
    assert info.value.key == w_blob


# ------------------------------------------------------------------ background writer


def test_the_codec_releases_the_gil(store: LocalObjectStore) -> None:
    """The writer thread must not stall training: a thread keeps running meanwhile."""
    big = {f"t{i}": weights(1_000_000, seed=i) for i in range(4)}  # 16 MB of floats
    encode(Snapshot(objects={"warm": weights(5000)}, rng={}), store)  # imports blosc2
    counts = []

    def encode_and_time() -> None:
        started = time.perf_counter()
        encode(Snapshot(objects=big, rng={}), store, history=DeltaHistory())
        counts.append(time.perf_counter() - started)

    thread = threading.Thread(target=encode_and_time)
    ticks = 0
    thread.start()
    while thread.is_alive():
        ticks += 1
        time.sleep(0.001)
    thread.join()
    # With the GIL held for the whole encode, the loop could not tick during it.
    assert ticks > counts[0] * 1000 * 0.2


class _RecordingStore(LocalObjectStore):
    """A local store that notes which thread wrote each array, and can fail the n-th."""

    fail_at: int | None = None

    def __init__(self, root: Path) -> None:
        super().__init__(root, durable=False)
        self.writers: list[str] = []
        self.manifests = 0
        self.events: list[str] = []

    def put_framed(self, key: str, *parts: Any) -> int:
        self.writers.append(threading.current_thread().name)
        self.events.append("array")
        if len(self.writers) == self.fail_at:
            raise StoreError("disk full (simulated)")
        return super().put_framed(key, *parts)

    def put(self, data: bytes) -> str:
        self.manifests += data.startswith(b"{")
        self.events.append("manifest" if data.startswith(b"{") else "raw")
        return super().put(data)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_encoding_thread_writes_the_arrays_then_the_manifest(tmp_path: Path, mode: str) -> None:
    objects = {f"t{i}": weights(200_000, seed=i) for i in range(5)}
    store = _RecordingStore(tmp_path / "objects")
    key, _ = encode(Snapshot(objects=objects, rng={}), store, **MODES[mode])
    assert store.writers == [threading.current_thread().name] * 5
    assert store.events == ["array"] * 5 + ["manifest"]
    assert_same(decode(key, store).objects, objects)


def test_the_least_cpu_encode_stores_arrays_as_they_come(tmp_path: Path) -> None:
    """The urgent lane's encode: no compression, and the same manifest as the idle lane's
    (small arrays inline in both); a later checkpoint references a stored tensor by key."""
    store = _RecordingStore(tmp_path / "objects")
    objects = {
        "w": weights(100_000),  # 400 kB: the idle lane compresses it
        "small": weights(3000),
        "ints": torch.arange(50_000),
    }
    key, nbytes = encode(Snapshot(objects=objects, rng={}), store, least_cpu=True)
    assert_same(decode(key, store).objects, objects)
    infos = [read_info(store, b) for b in manifest_blobs(key, store)]
    assert len(infos) == 2 and all(i is not None and i.codec == _arrays.RAW for i in infos)
    assert nbytes == sum(files(store).values())
    # The idle lane's mode stores the same manifest, and compresses: what least_cpu gives
    # up is bytes, never exactness.
    other = LocalObjectStore(tmp_path / "small", durable=False)
    idle_key, idle_bytes = encode(Snapshot(objects=objects, rng={}), other)
    assert idle_key == key and idle_bytes < nbytes - 0.05 * 400_000

    # The memo's reference to the raw object (a frozen tensor) decodes in a later checkpoint.
    from retrolog.checkpoint.state import SnapshotBuffers, StoredTensor, TensorMemo, snapshot

    buffers = SnapshotBuffers(TensorMemo())
    state = {"m": {"frozen": weights(30_000, seed=3), "trained": weights(30_000, seed=4)}}
    first = snapshot(state, buffers)
    encode(first, store, least_cpu=True)
    buffers.rewind()
    state["m"]["trained"].add_(1.0)
    second = snapshot(state, buffers)
    assert isinstance(second.objects["m"]["frozen"], StoredTensor)
    key2, _ = encode(second, store, least_cpu=True)
    assert_same(decode(key2, store).objects, state)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_small_arrays_live_in_the_manifest_within_a_budget(tmp_path: Path, mode: str) -> None:
    """Arrays the snapshot does not pool (under 64 KiB, never named by its memo) are inline
    until they add up to the budget; each one past it, and every pooled one, is an object."""
    store = _RecordingStore(tmp_path / "objects")
    pooled = codec.SMALL_ARRAY_BYTES + 1  # bytes: the smallest array the memo may name
    objects = {
        "at_pooling": weights(pooled // 4),
        "below_pooling": weights(pooled // 4 - 1),
        **{f"s{i:02d}": weights(4000, seed=i) for i in range(20)},  # 16 kB each
        "tiny": weights(200),
    }
    key, _ = encode(Snapshot(objects=objects, rng={}), store, **MODES[mode])
    assert_same(decode(key, store).objects, objects)
    items = dict(json.loads(store.get(key))["objects"]["items"])
    as_objects = {name for name, node in items.items() if "blob" in node}
    inline = 65_532 + 16_000 * 12  # below_pooling, then s00..s11 fit in 256 KiB
    assert inline <= codec.INLINE_BUDGET_BYTES < inline + 16_000
    assert as_objects == {"at_pooling"} | {f"s{i:02d}" for i in range(12, 20)}
    assert len(manifest_blobs(key, store)) == len(as_objects)  # "tiny" is always inline


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_failed_array_write_stops_the_encode_before_its_manifest(
    tmp_path: Path, mode: str
) -> None:
    store = _RecordingStore(tmp_path / "objects")
    store.fail_at = 5  # the last array
    objects = {f"t{i}": weights(200_000, seed=i) for i in range(5)}
    with pytest.raises(StoreError, match="disk full"):
        encode(Snapshot(objects=objects, rng={}), store, **MODES[mode])
    assert store.manifests == 0  # nothing names the arrays that did land


class _FarStore(_RecordingStore):
    """A store a round trip away that serves several requests at once (as S3 does)."""

    parallel_requests = 4

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lock = threading.Lock()
        self.now = self.most = 0

    def put_framed(self, key: str, *parts: Any) -> int:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.05)  # longer than compressing the next array, even on a busy machine
            return super().put_framed(key, *parts)
        finally:
            with self.lock:
                self.now -= 1
                self.events.append("array done")

    def put(self, data: bytes) -> str:
        assert self.now == 0, "an object was put while arrays were still being written"
        return super().put(data)

    @contextlib.contextmanager
    def _open_view(self, name: str) -> Iterator[memoryview]:  # a read: a request too
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.02)
            with super()._open_view(name) as data:
                yield data
        finally:
            with self.lock:
                self.now -= 1

    def peek(self, key: str, size: int) -> bytes | None:  # "is it stored?": a request too
        with self.lock:
            self.now += 1
            self.most_checks = max(getattr(self, "most_checks", 0), self.now)
        try:
            time.sleep(0.02)
            return super().peek(key, size)
        finally:
            with self.lock:
                self.now -= 1


@pytest.mark.parametrize("mode", sorted(MODES))
def test_on_a_far_store_the_arrays_are_written_together_then_the_manifest(
    tmp_path: Path, mode: str
) -> None:
    objects = {f"t{i}": weights(200_000, seed=i) for i in range(12)}
    store = _FarStore(tmp_path / "objects")
    key, nbytes = encode(Snapshot(objects=objects, rng={}), store, **MODES[mode])
    assert 1 < store.most <= store.parallel_requests
    assert store.events[-1] == "manifest" and store.events.count("array done") == 12
    if mode == "least_cpu":  # no deltas: the existence checks overlap too
        assert store.most_checks > 1
    assert_same(decode(key, store).objects, objects)
    on_disk = sum(store.path(b).stat().st_size for b in manifest_blobs(key, store))
    assert nbytes == on_disk + store.path(key).stat().st_size


@pytest.mark.parametrize("mode", sorted(MODES))
def test_on_a_far_store_large_arrays_are_written_and_read_a_few_at_a_time(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload may join its parts into one buffer and a read holds a whole object: on a
    large model, ten at once would hold ten copies of its largest tensors."""
    monkeypatch.setattr(_arrays, "WRITE_BEHIND_BYTES", 2_000_000)
    monkeypatch.setattr(codec, "WRITE_BEHIND_BYTES", 2_000_000)
    objects = {f"t{i}": weights(200_000, seed=i) for i in range(8)}  # 800 KB each
    store = _FarStore(tmp_path / "objects")
    key, _ = encode(Snapshot(objects=objects, rng={}), store, **MODES[mode])
    assert store.most <= 3  # two beyond the one in hand would pass 2 MB
    store.most = 0
    assert_same(decode(key, store).objects, objects)
    assert store.most == 2  # 2 MB // 800 KB reads at once, not parallel_requests (4)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_on_a_far_store_a_failed_write_stops_the_encode_before_its_manifest(
    tmp_path: Path, mode: str
) -> None:
    store = _FarStore(tmp_path / "objects")
    store.fail_at = 3
    objects = {f"t{i}": weights(200_000, seed=i) for i in range(12)}
    with pytest.raises(StoreError, match="disk full"):
        encode(Snapshot(objects=objects, rng={}), store, **MODES[mode])
    assert store.manifests == 0 and store.now == 0  # nothing left writing the snapshot


def test_checkpointer_records_the_stored_size(store: LocalObjectStore) -> None:
    records: list[CheckpointRecord] = []
    with SynchronousCheckpointer(store, records.append) as ckpt:
        for _ in range(2):
            ckpt.capture(ctx_id=0, loop_name="e", kind="block", objects={"w": weights(50_000)})
    manifest_sizes = [store.path(r.manifest).stat().st_size for r in records]
    shared = manifest_blobs(records[0].manifest, store)
    assert shared == manifest_blobs(records[1].manifest, store)  # same tensor: same object
    assert records[1].nbytes == manifest_sizes[1] + sum(
        store.path(b).stat().st_size for b in shared
    )
    # The RNG states did not change either: only the manifest is new.
    assert ckpt.history.last is not None and ckpt.history.last.written_objects == 1


@pytest.mark.parametrize(
    "how",
    [
        "_arrays._codec()",  # a synchronous checkpoint on the training thread
        # a first import on another thread (the writer's, should preloading have failed)
        "t = threading.Thread(target=_arrays._codec)\nt.start()\nt.join()",
    ],
)
def test_importing_the_codec_leaves_every_random_state_alone(how: str) -> None:
    """Whatever the codec's import draws from, the script's draws must not move."""
    code = (
        "import random, threading\n"
        "import numpy as np, torch\n"
        "random.seed(7); np.random.seed(7); torch.manual_seed(7)\n"
        "from retrolog.checkpoint import _arrays\n"
        f"{how}\n"
        "assert _arrays._codec_module is not None\n"
        "print(random.random(), np.random.random(), torch.rand(1).item())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    assert [float(x) for x in out] == [random.random(), np.random.random(), torch.rand(1).item()]


def test_encode_syncs_the_store_once_the_manifest_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the caller records a checkpoint, every rename it made is synced (durable store)."""
    store = LocalObjectStore(tmp_path / "objects")
    seen: list[tuple[set[Path], set[Path]]] = []
    real_sync = LocalObjectStore.sync

    def sync(self: LocalObjectStore) -> None:
        files = {p for p in self.root.rglob("*") if p.is_file()}
        seen.append((set(self._unsynced), files))
        real_sync(self)

    monkeypatch.setattr(LocalObjectStore, "sync", sync)
    state = {"w": weights(50_000), "b": weights(3_000, seed=1), "i": torch.arange(5000)}
    key, _ = encode(Snapshot(objects={"model": state}, rng={}), store, history=DeltaHistory())
    objects = {store.path(k) for k in manifest_blobs(key, store) | {key}}
    assert len(seen) == 1
    pending, files = seen[0]
    assert objects <= files  # the manifest and every object it names were in place
    assert pending == {p.parent for p in objects}
    assert store._unsynced == set()
