"""The snapshot codec: exact round trips, one blob per distinct tensor, corruption detected.

Compression, deltas, dedup across runs and format /1 are in test_checkpoint_storage.py.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from retrolog.checkpoint.codec import decode, encode, manifest_blobs
from retrolog.checkpoint.state import DeviceTensor, Snapshot, capture_rng
from retrolog.errors import (
    CheckpointTargetError,
    CorruptObjectError,
    StoreError,
    UntrustedPickleError,
)
from retrolog.store.objects import LocalObjectStore


def assert_same(a: Any, b: Any, where: str = "value") -> None:
    """Equal values of identical types all the way down (nan equals nan, -0.0 is not 0.0)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for (ka, va), kb in zip(a.items(), b, strict=True):
            assert_same(ka, kb, f"{where} key")
            assert_same(va, b[kb], f"{where}[{ka!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device, a.requires_grad) == (
            b.dtype,
            b.shape,
            b.device,
            b.requires_grad,
        ), where
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{where}: bytes differ"
    elif isinstance(a, DeviceTensor):
        assert a.device == b.device, where
        assert_same(a.tensor, b.tensor, f"{where}.tensor")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def roundtrip(value: Any, store: LocalObjectStore) -> Any:
    key, _ = encode(Snapshot(objects={"x": value}, rng={}), store)
    return decode(key, store).objects["x"]


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects", durable=False)


def test_scalars_and_containers(store: LocalObjectStore) -> None:
    value = {
        "ints": [0, -1, 2**70, True, False],
        "floats": [0.0, -0.0, 1.5, 1e-310, math.inf, -math.inf, math.nan, 0.1 + 0.2],
        "none": None,
        "text": "héllo \ud800 wörld",
        "bytes": [b"", b"\x00\xff", bytes(range(256)) * 10],
        "tuple": (1, (2.0, "3"), [4]),
        3: "int key",
        (1, 2): "tuple key",
        None: "none key",
        2.5: "float key",
        "complex": 1 + 2j,
        "od": OrderedDict([("b", 1), ("a", 2)]),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a", (1, 2)}),
    }
    assert_same(roundtrip(value, store), value)


def test_a_value_without_a_data_encoding_is_pickled_only_when_allowed_and_trusted(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = {"fraction": Fraction(1, 3)}
    with pytest.raises(CheckpointTargetError, match=r"RETROLOG_ALLOW_PICKLES=1"):
        roundtrip(value, store)
    monkeypatch.setenv("RETROLOG_ALLOW_PICKLES", "1")
    key, _ = encode(Snapshot(objects=value, rng={}), store)
    with pytest.raises(UntrustedPickleError, match=r"RETROLOG_TRUST_PICKLES=1"):
        decode(key, store)
    monkeypatch.setenv("RETROLOG_TRUST_PICKLES", "1")
    assert_same(decode(key, store).objects, value)


def test_negative_nan_keeps_its_bits(store: LocalObjectStore) -> None:
    neg_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000001))[0]
    assert_same(roundtrip([neg_nan], store), [neg_nan])


@pytest.mark.parametrize(
    "dtype",
    ["float64", "float32", "float16", "int8", "uint16", "int64", "bool", "complex128",
     ">f4", "<U7", "S3", "datetime64[ns]", "timedelta64[s]"],
)  # fmt: skip
def test_numpy_arrays(store: LocalObjectStore, dtype: str) -> None:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 100, size=(3, 4)).astype(dtype)
    for value in (arr, arr.T, arr[:, ::2], arr[0, 0:0], np.asfortranarray(arr), arr[1, 1]):
        out = roundtrip(value, store)
        assert_same(out, value)
    assert roundtrip(np.asfortranarray(arr), store).flags.f_contiguous
    assert roundtrip(arr, store).flags.writeable


def test_numpy_arrays_that_need_pickle(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RETROLOG_ALLOW_PICKLES", "1")
    monkeypatch.setenv("RETROLOG_TRUST_PICKLES", "1")
    structured = np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])
    objects = np.array([{"a": 1}, None], dtype=object)
    out = roundtrip([structured, objects], store)
    assert out[0].dtype == structured.dtype and out[0].tobytes() == structured.tobytes()
    assert out[1].dtype == object and list(out[1]) == [{"a": 1}, None]


def test_numpy_scalars(store: LocalObjectStore) -> None:
    value = [np.float32(1.5), np.int64(-3), np.bool_(True), np.float64("nan"), np.uint8(255)]
    assert_same(roundtrip(value, store), value)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.int8,
     torch.uint8, torch.int32, torch.int64, torch.complex64],
)  # fmt: skip
def test_torch_tensors(store: LocalObjectStore, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(4, 6, generator=gen) * 10).to(dtype)
    for value in (base, base.t(), base[:, ::3], base[0, 0], base[:0], base.unsqueeze(0)):
        assert_same(roundtrip(value, store), value.contiguous())


def test_torch_values(store: LocalObjectStore) -> None:
    value = {
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "grad": torch.ones(2, requires_grad=True),
        "conj": torch.tensor([1 + 2j]).conj(),
        "sparse": torch.eye(3).to_sparse(),
        "on_gpu": DeviceTensor(torch.arange(3.0), "cuda:1"),
    }
    out = roundtrip(value, store)
    assert_same(out["size"], value["size"])
    assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu")
    assert_same(out["grad"], value["grad"].detach().requires_grad_(True))
    assert torch.equal(out["conj"], torch.tensor([1 - 2j]))
    assert torch.equal(out["sparse"].to_dense(), torch.eye(3))
    assert_same(out["on_gpu"], value["on_gpu"])


def test_rng_states_round_trip(store: LocalObjectStore) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    rng = capture_rng()
    key, _ = encode(Snapshot(objects={}, rng=rng), store)
    out = decode(key, store).rng
    assert_same(out, rng)
    assert type(out["random"][1]) is tuple and len(out["random"][1]) == 625


def test_unpicklable_leaf_names_the_object(store: LocalObjectStore) -> None:
    snap = Snapshot(objects={"scheduler": {"lr_lambda": lambda epoch: 0.9**epoch}}, rng={})
    with pytest.raises(CheckpointTargetError, match=r"scheduler\['lr_lambda'\]") as info:
        encode(snap, store)
    assert info.value.name == "scheduler"


def stored_size(store: LocalObjectStore, keys: set[str]) -> int:
    return sum(store.path(k).stat().st_size for k in keys)


def test_identical_tensors_are_stored_once(store: LocalObjectStore) -> None:
    # Both at least 64 KiB: smaller arrays live in the manifest (test_small_values_...).
    frozen = torch.randn(128, 128)
    snaps = [
        Snapshot(objects={"model": {"frozen": frozen.clone(), "head": torch.randn(16384)}}, rng={})
        for _ in range(2)
    ]
    (k1, n1), (k2, n2) = (encode(s, store) for s in snaps)
    blobs1, blobs2 = manifest_blobs(k1, store), manifest_blobs(k2, store)
    shared = blobs1 & blobs2
    assert len(shared) == 1  # the frozen layer; the heads differ
    files = [p for p in store.root.rglob("*") if p.is_file()]
    assert len(files) == len(blobs1 | blobs2 | {k1, k2}) == 5
    # nbytes is what is stored (compressed), whether or not this encode wrote it.
    assert n1 == stored_size(store, blobs1 | {k1}) and n2 == stored_size(store, blobs2 | {k2})
    assert n1 < 128 * 128 * 4 + 16384 * 4


def test_same_tensor_twice_in_one_snapshot_counts_once(store: LocalObjectStore) -> None:
    t = torch.zeros(20_000)
    key, nbytes = encode(Snapshot(objects={"a": [t, t.clone()]}, rng={}), store)
    (blob,) = manifest_blobs(key, store)
    assert nbytes == stored_size(store, {key, blob})


def test_small_values_live_in_the_manifest(store: LocalObjectStore) -> None:
    key, _ = encode(Snapshot(objects={"a": [torch.ones(8), np.arange(3.0)]}, rng={}), store)
    assert manifest_blobs(key, store) == set()
    assert [p for p in store.root.rglob("*") if p.is_file()] == [store.path(key)]


def test_corrupt_blob_is_detected_on_decode(store: LocalObjectStore) -> None:
    key, _ = encode(Snapshot(objects={"w": torch.randn(20_000)}, rng={}), store)
    (blob,) = manifest_blobs(key, store)
    path = store.path(blob)
    raw = bytearray(path.read_bytes())
    raw[17] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptObjectError) as info:
        decode(key, store)
    assert info.value.key == blob


def test_decode_refuses_a_blob_key(store: LocalObjectStore) -> None:
    key, _ = encode(Snapshot(objects={"w": np.zeros(10_000)}, rng={}), store)
    (blob,) = manifest_blobs(key, store)
    with pytest.raises(StoreError, match="not a checkpoint manifest"):
        decode(blob, store)


def test_manifest_is_plain_json(store: LocalObjectStore) -> None:
    key, _ = encode(Snapshot(objects={"d": {"a": math.nan}}, rng={}), store)
    doc = json.loads(store.get(key))  # strict JSON: no NaN literal
    assert doc["format"] == "retrolog.snapshot/2"
    assert "NaN" not in store.get(key).decode()


# ------------------------------------------------------------------ property test

_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.binary(max_size=2048)
    | hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.int16, np.uint8, np.bool_]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    )
)
_keys = st.text(max_size=6) | st.integers(-5, 5)
_trees = st.recursive(
    _leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(_keys, children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=_trees)
def test_arbitrary_trees_round_trip(tmp_path_factory: pytest.TempPathFactory, tree: Any) -> None:
    store = LocalObjectStore(tmp_path_factory.mktemp("objects"), durable=False)
    assert_same(roundtrip(tree, store), tree)
