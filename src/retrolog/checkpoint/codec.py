"""Persist a Snapshot as a JSON manifest plus one object per tensor or array.

Each tensor's and array's raw bytes are an object of their own, named by their
sha256, so a tensor that did not change between checkpoints (a frozen layer,
a shared base model) is stored once ("Checkpoint storage" in DESIGN.md). The
manifest is a JSON tree that gives back exactly the Python structure that was
encoded. A JSON list is a Python list; ints, finite floats, bools, None and
strings are themselves; every JSON object is a tagged node whose ``"$"`` says
what it is:

=============  ==============================================================
``tuple``      ``v``: the items
``dict``       ``items``: ``[key, value]`` pairs in order (keys of any type)
``odict``      an OrderedDict: ``items``, and ``metadata`` (a module's
               state_dict keeps per-submodule versions in ``_metadata``)
``float``      nan or +-inf: ``v`` for humans, ``bits`` (IEEE 754, hex) exact
``bytes``      ``b64`` inline, or ``blob`` for long ones
``ndarray``    ``dtype`` (numpy's str form), ``shape``, ``order`` (C or F),
               ``blob``: the raw bytes
``npscalar``   ``dtype``, ``b64``: the raw bytes of a numpy scalar
``tensor``     ``dtype``, ``shape``, ``device`` (where it lived), ``blob``,
               ``requires_grad`` when true; stored contiguous, on the CPU
``size``       torch.Size; ``torch_dtype``, ``torch_device``: ``v``
``pickle``     ``blob``: anything else, pickled
=============  ==============================================================
"""

from __future__ import annotations

import base64
import json
import math
import pickle
import struct
from collections import OrderedDict
from typing import Any

import numpy as np

from retrolog.checkpoint.state import DeviceTensor, Snapshot, import_torch, loaded_torch
from retrolog.errors import CheckpointTargetError, CorruptObjectError, StoreError
from retrolog.store.objects import ObjectStore

FORMAT = "retrolog.snapshot/1"
INLINE_BYTES = 1024  # bytes values up to this size live in the manifest, longer ones in a blob


def encode(snap: Snapshot, store: ObjectStore) -> tuple[str, int]:
    """Write ``snap`` to ``store``.

    Returns the manifest's key and the total size of the manifest and of the
    distinct objects it references (whether or not they were already stored).
    """
    encoder = _Encoder(store)
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
    key = store.put(manifest)
    return key, len(manifest) + sum(encoder.blobs.values())


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
    if doc["format"] != FORMAT:
        raise StoreError(
            f"Checkpoint manifest {key} has format {doc['format']!r}, which this version of "
            f"retrolog cannot read (it reads {FORMAT!r}); upgrade retrolog."
        )
    decoder = _Decoder(store, key)
    objects = decoder.value(doc["objects"])
    rng = decoder.value(doc["rng"])
    return Snapshot(objects=objects, rng=rng)


def manifest_blobs(key: str, store: ObjectStore) -> set[str]:
    """The keys of the objects the manifest ``key`` references (for retention and GC)."""
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
    return found


def _simple_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether an array of ``dtype`` is exactly its raw bytes plus ``dtype.str``."""
    return not dtype.hasobject and dtype.fields is None and dtype.itemsize > 0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class _Encoder:
    """Turns a snapshot tree into JSON-able nodes, writing blobs as it goes."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.blobs: dict[str, int] = {}  # key -> size, each distinct object counted once
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
        if t is list:
            return [self.value(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if t is tuple:
            return {"$": "tuple", "v": [self.value(x, f"{path}[{i}]") for i, x in enumerate(v)]}
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
        if t is bytes:
            if len(v) <= INLINE_BYTES:
                return {"$": "bytes", "b64": _b64(v)}
            return {"$": "bytes", "blob": self.blob(v)}
        if t is np.ndarray and _simple_dtype(v.dtype):
            fortran = v.flags.f_contiguous and not v.flags.c_contiguous
            return {
                "$": "ndarray",
                "dtype": v.dtype.str,
                "shape": list(v.shape),
                "order": "F" if fortran else "C",
                "blob": self.blob(v.tobytes(order="F" if fortran else "C")),
            }
        if isinstance(v, np.generic) and _simple_dtype(v.dtype):
            return {"$": "npscalar", "dtype": v.dtype.str, "b64": _b64(v.tobytes())}
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

    def tensor(self, v: Any, path: str) -> dict[str, Any]:
        torch = import_torch("Encoding a tensor")
        if v.layout != torch.strided or v.is_quantized:
            return self.pickled(v, path)
        dense = v.detach().resolve_conj().resolve_neg()
        device = str(dense.device)
        if dense.device.type != "cpu":
            dense = dense.cpu()
        dense = dense.contiguous()
        try:
            raw = dense.reshape(-1).view(torch.uint8).numpy().tobytes()
        except (RuntimeError, TypeError):  # a dtype without a byte view
            return self.pickled(v, path)
        node: dict[str, Any] = {
            "$": "tensor",
            "dtype": str(dense.dtype).removeprefix("torch."),
            "shape": list(dense.shape),
            "device": device,
            "blob": self.blob(raw),
        }
        if v.requires_grad:
            node["requires_grad"] = True
        return node

    def pickled(self, v: Any, path: str) -> dict[str, Any]:
        try:
            data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
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
            return np.frombuffer(base64.b64decode(node["b64"]), dtype=np.dtype(node["dtype"]))[0]
        if tag == "tensor":
            return self.tensor(node)
        if tag == "pickle":
            return self.unpickle(node["blob"])
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

    def ndarray(self, node: dict[str, Any]) -> np.ndarray[Any, Any]:
        dtype = np.dtype(node["dtype"])
        order = node.get("order", "C")
        arr = np.empty(node["shape"], dtype=dtype, order=order)
        raw = self.blob(node["blob"])
        if len(raw) != arr.nbytes:
            raise self.corrupt(
                f"an array of shape {tuple(arr.shape)} and dtype {dtype} needs {arr.nbytes} "
                f"bytes, the object has {len(raw)}",
                node["blob"],
            )
        if arr.size:
            arr[...] = np.frombuffer(raw, dtype=dtype).reshape(arr.shape, order=order)
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
        raw = self.blob(node["blob"])
        nbytes = tensor.numel() * tensor.element_size()
        if len(raw) != nbytes:
            raise self.corrupt(
                f"a tensor of shape {tuple(tensor.shape)} and dtype {dtype} needs {nbytes} "
                f"bytes, the object has {len(raw)}",
                node["blob"],
            )
        if nbytes:
            tensor.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(raw, dtype=np.uint8)
        if node.get("requires_grad"):
            tensor.requires_grad_(True)
        device = node.get("device", "cpu")
        return tensor if device == "cpu" else DeviceTensor(tensor, device)

    def unpickle(self, key: str) -> Any:
        try:
            return pickle.loads(self.blob(key))
        except Exception as exc:  # unpickling can raise anything a class's __setstate__ raises
            raise StoreError(
                f"Cannot unpickle object {key} of checkpoint manifest {self.manifest}: {exc}. "
                "A class it holds may have been renamed or its module may not be importable "
                "here; load it with the code version that wrote it."
            ) from exc
