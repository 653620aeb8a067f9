"""Persist a Snapshot as a JSON manifest plus one object per tensor or array.

Format ``retrolog.snapshot/2`` (docs/checkpoint-storage.md has the byte
layout and the measurements behind it). Each tensor's and array's content is
an object of its own, keyed by the xxh3-128 of its dtype, shape and bytes, so
a tensor that did not change between checkpoints (a frozen layer, a shared
base model) is stored once, across checkpoints and runs. Float data is
compressed losslessly (byte planes, then zstd) and, given a
:class:`DeltaHistory`, may be stored as a delta against the same tensor in the
run's previous checkpoint (:mod:`retrolog.checkpoint._arrays`).
Manifests of format ``/1`` (raw, sha256-keyed objects) are still read.

The manifest is a JSON tree that gives back exactly the Python structure that
was encoded. A JSON list is a Python list; ints, finite floats, bools, None
and strings are themselves; every JSON object is a tagged node whose ``"$"``
says what it is:

=============  ==============================================================
``tuple``      ``v``: the items
``set``        ``v``: the items (also ``frozenset``)
``complex``    ``v``: the real and imaginary parts
``dict``       ``items``: ``[key, value]`` pairs in order (keys of any type)
``odict``      an OrderedDict: ``items``, and ``metadata`` (a module's
               state_dict keeps per-submodule versions in ``_metadata``)
``float``      nan or +-inf: ``v`` for humans, ``bits`` (IEEE 754, hex) exact
``bytes``      ``b64`` inline, or ``blob`` for long ones (a raw object)
``ndarray``    ``dtype`` (numpy's str form), ``shape``, ``order`` (C or F),
               and the bytes: ``b64`` inline when short, else ``blob``
``npscalar``   ``dtype``, ``b64``: the raw bytes of a numpy scalar
``tensor``     ``dtype``, ``shape``, ``device`` (where it lived), ``b64`` or
               ``blob``, ``requires_grad`` when true; stored contiguous
``sparse_coo`` a sparse COO tensor: ``shape``, ``indices`` and ``values``
               (tensor nodes)
``size``       torch.Size; ``torch_dtype``, ``torch_device``: ``v``
``pickle``     ``blob``: anything else, pickled (a raw object), only when the
               user allows it (RETROLOG_ALLOW_PICKLES=1); read only when the
               reader trusts the store (RETROLOG_TRUST_PICKLES=1)
=============  ==============================================================

A ``blob`` of 32 hex digits is a framed array object (format /2), one of 64
a raw object whose bytes are the value (format /1, and bytes and pickles).
"""

from __future__ import annotations

import base64
import json
import math
import pickle
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from retrolog._config import lookup
from retrolog.checkpoint._arrays import (
    DECODE_THREADS,
    WRITE_BEHIND_BYTES,
    ArrayWriter,
    DeltaHistory,
    EncodeStats,
    Interrupted,
    read_array,
    read_info,
)
from retrolog.checkpoint.state import (
    POOLED_BYTES,
    DeviceTensor,
    Snapshot,
    StoredTensor,
    import_torch,
    loaded_torch,
)
from retrolog.errors import (
    CheckpointTargetError,
    CorruptObjectError,
    StoreError,
    UntrustedPickleError,
)
from retrolog.store.objects import ObjectStore, is_framed_key

__all__ = [
    "FORMAT",
    "DeltaHistory",
    "EncodeStats",
    "Interrupted",
    "decode",
    "encode",
    "manifest_blobs",
]

FORMAT = "retrolog.snapshot/2"
READABLE = ("retrolog.snapshot/1", FORMAT)
INLINE_BYTES = 1024  # values up to this many bytes always live in the manifest
# Arrays below the snapshot's pooling size (the only ones its memo never names by key) live
# in the manifest too, until they add up to INLINE_BUDGET_BYTES: each object costs a write,
# an fsync and a directory entry, far more than base64 of a small array. The budget keeps
# manifests small enough for gc, which reads every kept one (docs/checkpoint-storage.md).
SMALL_ARRAY_BYTES = POOLED_BYTES - 1
INLINE_BUDGET_BYTES = 256 * 1024
PARALLEL_READ_BYTES = 4 << 20  # below this, starting threads costs more than it saves


def encode(
    snap: Snapshot,
    store: ObjectStore,
    history: DeltaHistory | None = None,
    *,
    interrupt: Callable[[], bool] | None = None,
    least_cpu: bool = False,
    section: Callable[[], AbstractContextManager[object]] = nullcontext,
) -> tuple[str, int]:
    """Write ``snap`` to ``store``.

    history: the run's :class:`DeltaHistory` (one per checkpointer), which
      lets tensors be stored as deltas against the previous checkpoint and
      records what this encode did in ``history.last``; without it, every
      object is stored in full.
    interrupt: polled before each array; when it returns true, the encode
      stops by raising :class:`Interrupted` before writing the manifest, so
      nothing refers to the objects written so far, and a later encode of the
      same snapshot finds them stored.
    least_cpu: the least CPU per checkpoint, for a write whose CPU is taken
      from training or waited for (the urgent lane): arrays stored
      uncompressed and no deltas; a fifth more bytes than zstd on weights.
      Otherwise (the idle lane) zstd, and deltas given a history. Which
      arrays live in the manifest does not depend on it, so a checkpoint one
      lane started and the other finished references every object either
      wrote, and a state encodes to one manifest whichever lane writes it.
    section: what every torch call of the encode runs inside; a thread other
      than the main one passes its :meth:`ExitGate.section
      <retrolog.checkpoint._exitgate.ExitGate.section>`, so that the
      interpreter never finalizes while it is inside torch.

    Returns the manifest's key and the stored (compressed) size of the
    manifest and of the distinct objects it needs, delta bases included,
    whether or not this call wrote them.
    """
    started = time.perf_counter()
    arrays = ArrayWriter(store, history, interrupt=interrupt, compress=not least_cpu)
    encoder = _Encoder(store, arrays, section)
    try:
        # The top-level dict is built here so errors can name the object at fault.
        items = []
        for name, state in snap.objects.items():
            encoder.name = name
            items.append([name, encoder.value(state, name)])
        encoder.name = None
        doc = {
            "format": FORMAT,
            "objects": {"$": "dict", "items": items},
            "rng": encoder.value(snap.rng, "the RNG states"),
        }
        manifest = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode("ascii")
        arrays.wait_written()
    finally:
        arrays.close()  # an error or an interrupt: no write of the snapshot's memory goes on
    key = store.put(manifest)  # after every object it names
    store.sync()  # before the caller records the checkpoint: no rename left to lose
    nbytes = arrays.finish(len(manifest), encoder.blobs, time.perf_counter() - started)
    return key, nbytes


def decode(key: str, store: ObjectStore) -> Snapshot:
    """Read the Snapshot whose manifest is stored under ``key``."""
    raw = store.get(key)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise StoreError(
            f"Object {key} is not a checkpoint manifest (it is not JSON); pass the manifest "
            "key recorded for the checkpoint, not the key of one of its tensors."
        ) from exc
    if not isinstance(doc, dict) or "format" not in doc:
        raise StoreError(
            f"Object {key} is not a checkpoint manifest; pass the manifest key recorded "
            "for the checkpoint."
        )
    if doc["format"] not in READABLE:
        raise StoreError(
            f"Checkpoint manifest {key} has format {doc['format']!r}, which this version of "
            f"retrolog cannot read (it reads {', '.join(map(repr, READABLE))}); upgrade "
            "retrolog."
        )
    decoder = _Decoder(store, key)
    objects = decoder.value(doc["objects"])
    rng = decoder.value(doc["rng"])
    decoder.fill()
    return Snapshot(objects=objects, rng=rng)


def manifest_blobs(key: str, store: ObjectStore) -> set[str]:
    """The keys of every object the manifest ``key`` needs (for retention and GC).

    That is the objects it references and, for those stored as deltas, their
    bases, transitively. Raises StoreError (CorruptObjectError) when one of
    them is missing or its header is damaged, since then the bases it needs
    cannot be known: a collector must keep everything rather than guess.
    """
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            blob = node.get("blob")
            if isinstance(blob, str):
                found.add(blob)
            for value in node.values():
                walk(value)

    walk(json.loads(store.get(key)))
    pending = [k for k in found if is_framed_key(k)]
    while pending:
        blob = pending.pop()
        info = read_info(store, blob)
        if info is None:
            raise StoreError(
                f"Object {blob}, which checkpoint manifest {key} needs, is not in {store!r}; "
                "the objects it is a delta of cannot be known. The checkpoint cannot be "
                "restored: drop it (retrolog gc with a policy that does not keep it)."
            )
        if info.base is not None and info.base not in found:
            found.add(info.base)
            pending.append(info.base)
    return found


ALLOW_PICKLES_ENV = "RETROLOG_ALLOW_PICKLES"
TRUST_PICKLES_ENV = "RETROLOG_TRUST_PICKLES"


def _env_flag(name: str) -> bool:
    return (lookup(name) or "").strip().lower() in ("1", "true", "yes", "on")


def pickles_allowed() -> bool:
    """Whether the user lets checkpoints keep what has no data encoding as a pickle."""
    return _env_flag(ALLOW_PICKLES_ENV)


def pickles_trusted() -> bool:
    """Whether the user trusts this store's pickles enough to unpickle them (run their code)."""
    return _env_flag(TRUST_PICKLES_ENV)


_INT = {int}


def _simple_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether an array of ``dtype`` is exactly its raw bytes plus ``dtype.str``."""
    return not dtype.hasobject and dtype.fields is None and dtype.itemsize > 0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class _Encoder:
    """Turns a snapshot tree into JSON-able nodes, writing blobs as it goes."""

    def __init__(
        self,
        store: ObjectStore,
        arrays: ArrayWriter,
        section: Callable[[], AbstractContextManager[object]] = nullcontext,
    ) -> None:
        self.store = store
        self.arrays = arrays
        self.section = section  # around torch calls: see encode()
        self.inline_budget = INLINE_BUDGET_BYTES  # bytes of small arrays still to inline
        self.torch: Any = None  # imported at the first tensor
        self.blobs: dict[str, int] = {}  # raw object key -> size, each counted once
        self.name: str | None = None  # the snapshot object being encoded, for errors

    def blob(self, data: bytes) -> str:
        key = self.store.put(data)
        self.blobs[key] = len(data)
        return key

    def value(self, v: Any, path: str) -> Any:
        t = type(v)
        if v is None or t is bool or t is str or t is int:
            return v
        if t is float:
            if math.isfinite(v):
                return v
            text = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
            return {"$": "float", "v": text, "bits": struct.pack(">d", v).hex()}
        if t is list or t is tuple:
            if set(map(type, v)) <= _INT:  # ints are themselves: an RNG state's 625 words
                items = list(v)
            else:
                items = [self.value(x, f"{path}[{i}]") for i, x in enumerate(v)]
            return items if t is list else {"$": "tuple", "v": items}
        if t is dict or t is OrderedDict:
            items = [
                [self.value(k, f"{path} key {k!r}"), self.value(x, f"{path}[{k!r}]")]
                for k, x in v.items()
            ]
            if t is dict:
                return {"$": "dict", "items": items}
            node: dict[str, Any] = {"$": "odict", "items": items}
            metadata = getattr(v, "_metadata", None)
            if metadata is not None:
                node["metadata"] = self.value(metadata, f"{path}._metadata")
            return node
        if t is set or t is frozenset:
            items = [self.value(x, f"{path} item") for x in v]
            return {"$": t.__name__, "v": items}
        if t is complex:
            return {"$": "complex", "v": [self.value(v.real, path), self.value(v.imag, path)]}
        if t is bytes:
            if len(v) <= INLINE_BYTES:
                return {"$": "bytes", "b64": _b64(v)}
            return {"$": "bytes", "blob": self.blob(v)}
        if t is np.ndarray and _simple_dtype(v.dtype):
            fortran = v.flags.f_contiguous and not v.flags.c_contiguous
            order = "F" if fortran else "C"
            # A view when the array is contiguous in that order, a copy otherwise.
            flat = v.ravel(order=order).view(np.uint8)
            node = {"$": "ndarray", "dtype": v.dtype.str, "shape": list(v.shape), "order": order}
            is_float = v.dtype.kind == "f" and v.dtype.itemsize in (2, 4, 8)
            return self.content(
                node, path, "numpy." + v.dtype.str, flat, v.dtype.itemsize, is_float
            )
        if isinstance(v, np.generic) and _simple_dtype(v.dtype):
            return {"$": "npscalar", "dtype": v.dtype.str, "b64": _b64(v.tobytes())}
        if t is StoredTensor:
            return self.tensor(v.source, path, known=v.key)
        if t is DeviceTensor:
            node = self.tensor(v.tensor, path)
            if node.get("$") == "tensor":
                node["device"] = v.device
                return node
            return self.pickled(v, path)
        torch = loaded_torch()
        if torch is not None:
            if t is torch.Tensor:
                return self.tensor(v, path)
            if t is torch.Size:
                return {"$": "size", "v": list(v)}
            if t is torch.dtype:
                return {"$": "torch_dtype", "v": str(v).removeprefix("torch.")}
            if t is torch.device:
                return {"$": "torch_device", "v": str(v)}
        return self.pickled(v, path)

    def tensor(self, v: Any, path: str, known: str | None = None) -> dict[str, Any]:
        """The node of tensor ``v``; ``known``: its key, when it is stored already."""
        torch = self.torch
        if torch is None:
            torch = self.torch = import_torch("Encoding a tensor")
        if v.layout == torch.sparse_coo and known is None:
            with self.section():
                v = v.coalesce()
                indices, values = v._indices(), v._values()
            return {
                "$": "sparse_coo",
                "shape": list(v.shape),
                "indices": self.tensor(indices, f"{path} indices"),
                "values": self.tensor(values, f"{path} values"),
            }
        if v.layout != torch.strided or v.is_quantized:
            return self.pickled(v, path)
        # The torch calls only: the bytes are hashed, compressed and written outside.
        with self.section():
            dense = v.detach().resolve_conj().resolve_neg()
            device = str(dense.device)
            if dense.device.type != "cpu":
                dense = dense.cpu()
            dense = dense.contiguous()
            if dense.numel() <= 1:
                # contiguous() leaves the strides of an empty or one-element tensor as
                # they were, which the byte view below refuses; a clone resets them.
                dense = dense.clone(memory_format=torch.contiguous_format)
            try:
                flat = dense.reshape(-1).view(torch.uint8).numpy()  # the tensor's own memory
            except (RuntimeError, TypeError):  # a dtype without a byte view
                flat = None
            dtype = str(dense.dtype).removeprefix("torch.")
            shape = list(dense.shape)
            itemsize = dense.element_size()
            is_float = dense.is_floating_point() and itemsize in (2, 4, 8)
        if flat is None:
            return self.pickled(v, path)
        node: dict[str, Any] = {"$": "tensor", "dtype": dtype, "shape": shape, "device": device}
        if known is not None:
            node["blob"] = self.arrays.put_stored(path, known, flat.nbytes)
            return node
        self.content(node, path, "torch." + dtype, flat, itemsize, is_float)
        if v.requires_grad:
            node["requires_grad"] = True
        return node

    def content(
        self,
        node: dict[str, Any],
        path: str,
        dtype: str,
        flat: np.ndarray[Any, Any],
        itemsize: int,
        is_float: bool,
    ) -> dict[str, Any]:
        """Add the bytes ``flat`` of an array or tensor to ``node``: inline, or as an object."""
        nbytes = flat.nbytes
        if nbytes <= INLINE_BYTES or (nbytes <= SMALL_ARRAY_BYTES and nbytes <= self.inline_budget):
            if nbytes > INLINE_BYTES:
                self.inline_budget -= nbytes
            node["b64"] = _b64(flat.tobytes())
        else:
            node["blob"] = self.arrays.put(path, dtype, node["shape"], flat, itemsize, is_float)
        return node

    def pickled(self, v: Any, path: str) -> dict[str, Any]:
        if not pickles_allowed():
            raise CheckpointTargetError(
                f"Cannot store {path} in a checkpoint: it is a {type(v).__module__}."
                f"{type(v).__qualname__}, which checkpoints hold only as data (numbers, "
                "strings, lists, dicts, tuples, arrays, tensors). It could be kept as a "
                "pickle, but reading a pickle can run any code it names, so retrolog makes "
                f"one only when you allow it: set {ALLOW_PICKLES_ENV}=1 when recording "
                f"(whoever restores or replays it must then set {TRUST_PICKLES_ENV}=1), or "
                "keep such values out of state_dict().",
                name=self.name,
            )
        try:
            with self.section():  # reducing a torch object calls into torch
                data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Interrupted:
            raise
        except Exception as exc:  # pickle raises many types (PicklingError, TypeError, ...)
            raise CheckpointTargetError(
                f"Cannot store {path} in a checkpoint: it is a {type(v).__module__}."
                f"{type(v).__qualname__}, which is not a type checkpoints encode natively "
                f"and cannot be pickled ({exc}). Keep such values out of state_dict() or "
                "convert them to plain data (numbers, strings, lists, dicts, arrays, tensors).",
                name=self.name,
            ) from exc
        return {"$": "pickle", "blob": self.blob(data)}


class _Decoder:
    """Turns manifest nodes back into Python values, reading each blob once."""

    def __init__(self, store: ObjectStore, manifest: str) -> None:
        self.store = store
        self.manifest = manifest
        self.cache: dict[str, bytes] = {}
        # Array objects are read after the tree is built, several at a time: the
        # reads, decompression and hashing release the GIL.
        self.first: dict[str, np.ndarray[Any, Any]] = {}  # key -> memory it is read into
        self.jobs: list[tuple[str, str, list[int], np.ndarray[Any, Any]]] = []
        self.copies: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []

    def fill(self) -> None:
        """Read every array object the built tree is waiting for."""
        jobs, self.jobs = self.jobs, []
        total = sum(out.nbytes for *_, out in jobs)
        threads = DECODE_THREADS if total >= PARALLEL_READ_BYTES else 1
        # A remote store waits a round trip per object, whatever its size: overlap them,
        # as many as hold WRITE_BEHIND_BYTES of the largest (each read is a whole buffer).
        largest = max((out.nbytes for *_, out in jobs), default=0)
        remote = min(self.store.parallel_requests, max(1, WRITE_BEHIND_BYTES // max(largest, 1)))
        threads = max(threads, remote)
        if len(jobs) > 1 and threads > 1:
            with ThreadPoolExecutor(
                min(threads, len(jobs)), thread_name_prefix="retrolog-restore"
            ) as pool:
                list(pool.map(lambda job: read_array(self.store, *job), jobs))
        else:
            for job in jobs:
                read_array(self.store, *job)
        for source, out in self.copies:
            out[:] = source
        self.copies = []

    def blob(self, key: str) -> bytes:
        data = self.cache.get(key)
        if data is None:
            data = self.cache[key] = self.store.get(key)
        return data

    def value(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.value(x) for x in node]
        if not isinstance(node, dict):
            return node
        tag = node.get("$")
        if tag == "dict":
            return {self.value(k): self.value(x) for k, x in node["items"]}
        if tag == "tuple":
            return tuple(self.value(x) for x in node["v"])
        if tag == "float":
            return struct.unpack(">d", bytes.fromhex(node["bits"]))[0]
        if tag in ("set", "frozenset"):
            items = [self.value(x) for x in node["v"]]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "complex":
            real, imag = (self.value(x) for x in node["v"])
            return complex(real, imag)
        if tag == "odict":
            out: OrderedDict[Any, Any] = OrderedDict(
                (self.value(k), self.value(x)) for k, x in node["items"]
            )
            if "metadata" in node:
                out._metadata = self.value(node["metadata"])  # type: ignore[attr-defined]
            return out
        if tag == "bytes":
            return self.blob(node["blob"]) if "blob" in node else base64.b64decode(node["b64"])
        if tag == "ndarray":
            return self.ndarray(node)
        if tag == "npscalar":
            return np.frombuffer(
                base64.b64decode(node["b64"]), dtype=self.data_dtype(node["dtype"])
            )[0]
        if tag == "tensor":
            return self.tensor(node)
        if tag == "pickle":
            return self.unpickle(node["blob"])
        if tag == "sparse_coo":
            torch = import_torch("Loading a checkpoint with sparse tensors")
            indices, values = self.tensor(node["indices"]), self.tensor(node["values"])
            if isinstance(indices, DeviceTensor) or isinstance(values, DeviceTensor):
                raise self.corrupt("a sparse tensor's parts are not on the CPU", self.manifest)
            self.fill()  # the parts' bytes, before they are put together
            # Checked: indices out of range would otherwise be memory errors later.
            return torch.sparse_coo_tensor(
                indices, values, node["shape"], check_invariants=True
            ).coalesce()
        if tag in ("size", "torch_dtype", "torch_device"):
            torch = import_torch("Loading a checkpoint with torch values")
            if tag == "size":
                return torch.Size(node["v"])
            if tag == "torch_device":
                return torch.device(node["v"])
            return self.torch_dtype(torch, node["v"])
        raise StoreError(
            f"Checkpoint manifest {self.manifest} has a node tagged {tag!r}, which this version "
            "of retrolog does not know; it was written by a newer retrolog, upgrade to read it."
        )

    def corrupt(self, what: str, key: str) -> CorruptObjectError:
        return CorruptObjectError(
            f"Checkpoint manifest {self.manifest} does not match its object {key}: {what}. "
            "The checkpoint cannot be restored; replay has to execute its blocks instead.",
            key=key,
        )

    def content(self, node: dict[str, Any], dtype: str, out: np.ndarray[Any, Any]) -> None:
        """Fill ``out`` (uint8, the value's memory) with the bytes ``node`` holds."""
        if "b64" in node:
            raw: Any = base64.b64decode(node["b64"])
            where = "the manifest"
        else:
            key = node["blob"]
            where = f"object {key}"
            if is_framed_key(key):
                first = self.first.get(key)
                if first is not None and first.nbytes == out.nbytes:
                    self.copies.append((first, out))
                else:
                    self.first[key] = out
                    self.jobs.append((key, dtype, node["shape"], out))
                return
            raw = self.blob(key)
        if len(raw) != out.nbytes:
            raise self.corrupt(
                f"a value of shape {tuple(node['shape'])} and dtype {node['dtype']} needs "
                f"{out.nbytes} bytes, {where} holds {len(raw)}",
                node.get("blob", self.manifest),
            )
        if out.nbytes:
            out[:] = np.frombuffer(raw, dtype=np.uint8)

    def data_dtype(self, text: Any) -> np.dtype[Any]:
        """A numpy dtype that is plain bytes (never object): what a manifest may name."""
        try:
            dtype = np.dtype(str(text))
        except TypeError as exc:
            raise self.corrupt(f"{text!r} is not a numpy dtype", self.manifest) from exc
        if not _simple_dtype(dtype):
            raise self.corrupt(f"numpy dtype {text!r} is not plain data", self.manifest)
        return dtype

    def ndarray(self, node: dict[str, Any]) -> np.ndarray[Any, Any]:
        dtype = self.data_dtype(node["dtype"])
        order = node.get("order", "C")
        arr = np.empty(node["shape"], dtype=dtype, order=order)
        self.content(node, "numpy." + node["dtype"], arr.ravel(order=order).view(np.uint8))
        return arr

    def torch_dtype(self, torch: Any, name: str) -> Any:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise StoreError(
                f"Checkpoint manifest {self.manifest} holds torch dtype {name!r}, which this "
                f"torch ({torch.__version__}) does not have; load it with the torch it was "
                "written with."
            )
        return dtype

    def tensor(self, node: dict[str, Any]) -> Any:
        torch = import_torch("Loading a checkpoint with torch tensors")
        dtype = self.torch_dtype(torch, node["dtype"])
        tensor = torch.empty(node["shape"], dtype=dtype)
        self.content(node, "torch." + node["dtype"], tensor.reshape(-1).view(torch.uint8).numpy())
        if node.get("requires_grad"):
            tensor.requires_grad_(True)
        device = node.get("device", "cpu")
        return tensor if device == "cpu" else DeviceTensor(tensor, device)

    def unpickle(self, key: str) -> Any:
        if not pickles_trusted():
            raise UntrustedPickleError(
                f"Checkpoint manifest {self.manifest} holds a pickled object ({key}). "
                "Reading a pickle can run any code it names, and whoever can write this "
                "store could have put one there, so retrolog does not unpickle unless you "
                f"trust the store: set {TRUST_PICKLES_ENV}=1 to restore it. Replay executes "
                "such a checkpoint's code instead of restoring it."
            )
        try:
            return pickle.loads(self.blob(key))
        except Exception as exc:  # unpickling can raise anything a class's __setstate__ raises
            raise StoreError(
                f"Cannot unpickle object {key} of checkpoint manifest {self.manifest}: {exc}. "
                "A class it holds may have been renamed or its module may not be importable "
                "here; load it with the code version that wrote it."
            ) from exc
