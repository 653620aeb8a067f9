"""The script's local variables a skipped block or iteration would have set.

Replay skips a block by restoring its checkpoint: the named objects and the
RNG states. Code after the block often reads plain variables the block set,
too: ``total += loss.item()`` in the step loop, then
``rl.log("train_loss", total / n)`` after it; ``best = max(best, acc)`` in an
iteration; ``epoch`` after the outer loop. Restoring only the objects would
leave those at what they were before the block, and the hindsight value read
from them would be wrong. So a checkpoint also carries the small, plain local
variables of the frame that runs the loop, and replay writes them back into
that frame where it skips:

==========================  ========================  ==============================
checkpoint                  frame                     variables captured
==========================  ========================  ==============================
nested block                the one running the       rebound since the block's loop
                            nested loop               started, plus small containers
whole-iteration block       the one running the       rebound since the iteration
                            outer loop                started, plus small containers
end                         the one running the       rebound since the outer loop
                            outer loop                started, plus small containers
==========================  ========================  ==============================

"Small and plain" means numbers, strings, bools, None, numpy scalars, tensors
(detached copies), and lists, tuples, dicts and sets of those with at most
:data:`MAX_ITEMS` items in all, taken smallest first while they fit in
:data:`MAX_FRAME_BYTES` together: a language model's hidden state carried from
epoch to epoch (2 x 20 x 128 floats) fits beside the counters and running
sums, where a batch of images does not. Capture runs on the training thread at
each checkpoint, so the budget is small; a statement that reads a name left
out makes replay execute that block instead of restoring it. Containers are captured whether or
not they were rebound, because ``losses.append(...)`` changes one in place.
Anything else (an iterator, a module, what does not fit) is listed by name as
not captured, so a replay can tell the user which values it could not
restore. The objects named in
``checkpointing`` are skipped: the checkpoint restores those in place, and this
module adds their public plain attributes (:func:`capture_attrs`, below).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import math
import pickle
import struct
import sys
import sysconfig
import types
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from retrolog.checkpoint.lazy_types import is_tensor, numpy_scalar_types
from retrolog.errors import StoreError, UntrustedPickleError

MAX_ITEMS = 10_000
MAX_FRAME_BYTES = 128 << 10  # the captured values of one frame, together (see below)
MAX_ENCODED_BYTES = 3 << 20  # a safety net: more than this, nothing is captured, all listed

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)
_LIBRARY_DIRS = tuple(
    {str(Path(p).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")
     if (p := sysconfig.get_paths().get(k))}
)  # fmt: skip
_PLAIN = (int, float, complex, bool, str, bytes, type(None))
_MISSING = object()


def script_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The innermost frame at or above ``frame`` that runs the user's code, not a library's.

    A loop may be driven through a wrapper (``tqdm(rl.loop(...))``): its frame is skipped,
    as are retrolog's own.
    """
    while frame is not None:
        if is_script_file(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def is_script_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's, not retrolog's, a library's or Python's."""
    return not (
        filename.startswith(_PACKAGE_DIR)
        or filename.startswith(_LIBRARY_DIRS)
        or "site-packages" in filename
        or filename.startswith("<frozen")
    )


def local_ids(frame: types.FrameType | None) -> dict[str, Any]:
    """The identity of every local of ``frame`` now, to tell later which were rebound.

    Not bare ``id()``s: an object freed after its name was rebound can leave its
    address to a new object, which then has the old id, and a rebound local (a
    step's ``loss`` tensor) would pass for unchanged and be left out of the
    checkpoint. Each local is held by a weak reference where it takes one (tensors,
    arrays, most objects: nothing is kept alive), else by a strong one (numbers,
    strings, tuples: small, or alive anyway); lists, dicts and sets are captured
    whether rebound or not.
    """
    if frame is None:
        return {}
    found: dict[str, Any] = {}
    for name, value in frame.f_locals.items():
        if type(value) in (list, dict, set):
            continue
        try:
            found[name] = weakref.ref(value)
        except TypeError:
            found[name] = _Strong(value)
    return found


class _Strong:
    """A local that takes no weak reference, held as it was."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


def _rebound(before: Mapping[str, Any], name: str, value: Any) -> bool:
    held = before.get(name)
    return held is None or held() is not value


def capture(
    frame: types.FrameType | None,
    before: Mapping[str, Any],
    skip_ids: frozenset[int],
    objects: Mapping[str, object] | None = None,
    attrs_before: Mapping[tuple[str, str], Any] | None = None,
) -> bytes | None:
    """The encoded small locals of ``frame`` rebound since ``before`` (and small containers).

    Returns None when there is no frame and no named object has plain attributes; else
    ``{"values": {name: value}, "not_captured": [names]}`` in a data-only encoding (JSON,
    see :func:`load`), with ``"attrs"`` and ``"attrs_not_captured"`` when ``objects``
    (the named objects) have plain attributes (:func:`capture_attrs`).
    """
    attrs: dict[str, dict[str, Any]] = {}
    blocked: list[list[str]] = []
    if objects:
        attrs, blocked = capture_attrs(objects, attrs_before or {})
    doc = _capture_locals(frame, before, skip_ids)
    if doc is None:
        if not attrs and not blocked:
            return None
        doc = {"values": {}, "not_captured": []}
    if attrs or blocked:
        doc["attrs"] = attrs
        doc["attrs_not_captured"] = blocked
    blob = _dump(doc)
    if len(blob) > MAX_ENCODED_BYTES:
        doc["values"], doc["not_captured"] = {}, sorted(doc["values"]) + doc["not_captured"]
        blob = _dump(doc)
    return blob


def _capture_locals(
    frame: types.FrameType | None, before: Mapping[str, Any], skip_ids: frozenset[int]
) -> dict[str, Any] | None:
    if frame is None:
        return None
    values: dict[str, Any] = {}
    not_captured: list[str] = []
    wanted: list[tuple[int, str, Any]] = []
    for name, value in frame.f_locals.items():
        if name.startswith("__") or id(value) in skip_ids:
            continue
        if isinstance(
            value, types.ModuleType | types.FunctionType | type | types.BuiltinFunctionType
        ):
            continue
        rebound = _rebound(before, name, value)
        container = type(value) in (list, dict, set)
        if not (rebound or container):
            continue
        size = _size(value, [MAX_ITEMS])
        if size is None or size > MAX_FRAME_BYTES:
            if rebound:
                not_captured.append(name)
            continue
        wanted.append((size, name, value))
    room = MAX_FRAME_BYTES
    for size, name, value in sorted(wanted, key=lambda w: w[0]):
        copied = _small_copy(value) if size <= room else _MISSING
        if copied is _MISSING:
            not_captured.append(name)
            continue
        room -= size
        values[name] = copied
    encoded: dict[str, Any] = {}
    for name, value in values.items():
        try:
            encoded[name] = _encode(value)
        except _NotData:  # a tensor subclass or numpy scalar of an odd type: listed instead
            not_captured.append(name)
    return {"values": encoded, "not_captured": not_captured}


def _size(value: Any, budget: list[int]) -> int | None:
    """About how many bytes a copy of ``value`` takes, or None if it is not small and plain."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    t = type(value)
    if t in (str, bytes):
        return 16 + len(value)
    if t in _PLAIN:
        return 16
    if isinstance(value, numpy_scalar_types()) and not value.dtype.hasobject:
        return 16 + value.nbytes
    if t in (list, tuple, set, dict):
        items = value.items() if t is dict else ((v,) for v in value)
        total = 16
        for item in items:
            for part in item:
                size = _size(part, budget)
                if size is None:
                    return None
                total += 8 + size
        return total
    if is_tensor(value) and value.layout is not None:
        return 64 + value.numel() * value.element_size()
    return None


def _small_copy(value: Any) -> Any:
    """A copy of ``value``, which :func:`_size` found small and plain; _MISSING if it fails."""
    t = type(value)
    if t in _PLAIN or isinstance(value, numpy_scalar_types()):
        return value
    if t in (list, tuple, set):
        items = [_small_copy(v) for v in value]
        if any(v is _MISSING for v in items):
            return _MISSING
        return t(items)
    if t is dict:
        out = {}
        for k, v in value.items():
            key, item = _small_copy(k), _small_copy(v)
            if key is _MISSING or item is _MISSING:
                return _MISSING
            out[key] = item
        return out
    try:
        return value.detach().clone()
    except RuntimeError:
        return _MISSING


def load(blob: bytes | None) -> tuple[dict[str, Any], list[str]]:
    """The values and the not-captured names from a blob :func:`capture` made.

    Data only: JSON whose tagged nodes name one of a fixed set of plain types, never a
    class or function. A blob an older retrolog pickled is read only when the user
    trusts the store's pickles (:func:`retrolog.checkpoint.codec.pickles_trusted`);
    else :class:`UntrustedPickleError`, and replay executes that block instead.
    """
    if not blob:
        return {}, []
    if blob.startswith(_MAGIC):
        try:
            doc = json.loads(blob[len(_MAGIC) :])
            values = {str(k): _decode(v) for k, v in doc["values"].items()}
            return values, [str(n) for n in doc["not_captured"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError(f"a checkpoint's saved locals cannot be decoded: {exc}") from exc
    from retrolog.checkpoint.codec import pickles_trusted

    if not pickles_trusted():
        raise UntrustedPickleError(
            "its saved locals were written by an older retrolog as a pickle, which can run "
            "code when read; set RETROLOG_TRUST_PICKLES=1 if you trust this store"
        )
    doc = pickle.loads(blob)
    return dict(doc.get("values", {})), list(doc.get("not_captured", []))


# -- the data-only encoding of captured locals ---------------------------------------

_MAGIC = b"RLF1"  # followed by UTF-8 JSON


class _NotData(Exception):
    """A value the encoding does not have a node for."""


def _dump(doc: dict[str, Any]) -> bytes:
    return _MAGIC + json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _encode(value: Any) -> Any:
    """A JSON node for ``value`` (a copy :func:`_small_copy` made)."""
    t = type(value)
    if value is None or t in (bool, int, str):
        return value
    if t is float:
        if math.isfinite(value):
            return value
        return {"$": "float", "bits": struct.pack(">d", value).hex()}
    if t is complex:
        return {"$": "complex", "v": [_encode(value.real), _encode(value.imag)]}
    if t is bytes:
        return {"$": "bytes", "b64": base64.b64encode(value).decode()}
    if t is list:
        return [_encode(v) for v in value]
    if t in (tuple, set):
        return {"$": t.__name__, "v": [_encode(v) for v in value]}
    if t is dict:
        return {"$": "dict", "items": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, numpy_scalar_types()) and _plain_dtype(value.dtype):
        return {"$": "npscalar", "dtype": value.dtype.str, "b64": _b64(value.tobytes())}
    if is_tensor(value) and type(value).__name__ == "Tensor":
        dense = value.detach().cpu().contiguous()
        if dense.numel() <= 1:
            dense = dense.clone()
        try:
            raw = dense.reshape(-1).view(_torch().uint8).numpy().tobytes()
        except (RuntimeError, TypeError) as exc:  # a dtype without a byte view
            raise _NotData from exc
        return {
            "$": "tensor",
            "dtype": str(dense.dtype).removeprefix("torch."),
            "shape": list(dense.shape),
            "b64": _b64(raw),
        }
    raise _NotData


def _decode(node: Any) -> Any:
    if isinstance(node, list):
        return [_decode(v) for v in node]
    if not isinstance(node, dict):
        return node
    tag = node["$"]
    if tag == "float":
        return struct.unpack(">d", bytes.fromhex(node["bits"]))[0]
    if tag == "complex":
        return complex(*(_decode(v) for v in node["v"]))
    if tag == "bytes":
        return base64.b64decode(node["b64"])
    if tag == "tuple":
        return tuple(_decode(v) for v in node["v"])
    if tag == "set":
        return {_decode(v) for v in node["v"]}
    if tag == "dict":
        return {_decode(k): _decode(v) for k, v in node["items"]}
    if tag == "npscalar":
        import numpy as np

        dtype = np.dtype(node["dtype"])
        if not _plain_dtype(dtype):
            raise ValueError(f"numpy dtype {node['dtype']!r} is not plain data")
        return np.frombuffer(base64.b64decode(node["b64"]), dtype=dtype)[0]
    if tag == "tensor":
        torch = _torch()
        torch_dtype = getattr(torch, str(node["dtype"]), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"{node['dtype']!r} is not a torch dtype")
        shape = [int(n) for n in node["shape"]]
        raw = bytearray(base64.b64decode(node["b64"]))
        out = torch.empty(shape, dtype=torch_dtype)
        if len(raw) != out.numel() * out.element_size():
            raise ValueError("a tensor's bytes do not match its shape and dtype")
        if raw:
            out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))
        return out
    raise ValueError(f"unknown node {tag!r}")


def _plain_dtype(dtype: Any) -> bool:
    return dtype.kind in "biufcmMSU" and not dtype.hasobject


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _torch() -> Any:
    import torch

    return torch


def restore(frame: types.FrameType | None, values: Mapping[str, Any]) -> None:
    """Write ``values`` into the locals of ``frame``: containers in place where they exist."""
    if frame is None or not values:
        return
    live = frame.f_locals
    assignments: dict[str, Any] = {}
    for name, saved in values.items():
        current = live.get(name, _MISSING)
        # In place, so other references to the same list or dict see the restored content.
        if type(current) is list and type(saved) is list:
            current[:] = saved
        elif type(current) in (dict, set) and type(saved) is type(current):
            current.clear()
            current.update(saved)
        else:
            assignments[name] = saved
    if not assignments:
        return
    if frame.f_code.co_flags & 0x1 == 0 or frame.f_locals is frame.f_globals:
        # A module or class body: its locals are a real dict.
        frame.f_locals.update(assignments)
        return
    _write_fast_locals(frame, assignments)


def _write_fast_locals(frame: types.FrameType, assignments: Mapping[str, Any]) -> None:
    """Assign function locals: a write-through proxy from 3.13 (PEP 667), else LocalsToFast."""
    if sys.version_info >= (3, 13):
        for name, value in assignments.items():
            frame.f_locals[name] = value
        return
    locals_dict = frame.f_locals  # the frame's cached dict; LocalsToFast copies it back
    locals_dict.update(assignments)
    with contextlib.suppress(AttributeError):
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


# -- the plain attributes of the named objects -----------------------------------------
#
# A module's state_dict holds its parameters and buffers, not what the script keeps on it
# besides (``model.rewards.append(r)`` in the step loop, read by the update after it).
# Restoring only the state_dict would leave those as they were before the skipped block.
# So a checkpoint also carries the named objects' public plain attributes, in the same
# data-only encoding as the locals; one that changed in the block and cannot be carried
# (tensors with autograd history, arbitrary objects, too large) is listed, and replay
# executes that block instead of restoring it.

MAX_ATTR_BYTES = 128 << 10  # the captured attributes of one checkpoint, together
# What torch keeps in an optimizer's __dict__ that its state_dict already holds.
_OPTIMIZER_STATE = frozenset({"state", "param_groups", "defaults"})


def _attr_names(obj: object) -> list[str]:
    """The public plain attributes of a named torch module or optimizer, else none.

    Names starting with an underscore are torch's machinery (hooks, the parameter and
    module registries); ``training`` is set by ``train()``/``eval()`` on every
    submodule alike. Other objects are restored by their own state_dict alone.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    if isinstance(obj, torch.nn.Module):
        skip: frozenset[str] = frozenset({"training"})
    elif isinstance(obj, torch.optim.Optimizer):
        skip = _OPTIMIZER_STATE
    else:
        return []
    found = getattr(obj, "__dict__", {})
    return [n for n in found if not n.startswith("_") and n not in skip]


def _is_structure(value: Any) -> bool:
    """A parameter, a module, or a container of only those: the object's own structure,
    which its state_dict restores in place (a copy would break the sharing)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    kinds = (torch.nn.Parameter, torch.nn.Module)
    if isinstance(value, kinds):
        return True
    if type(value) in (list, tuple) and value:
        return all(isinstance(v, kinds) for v in value)
    if type(value) is dict and value:
        return all(isinstance(v, kinds) for v in value.values())
    return False


class _Shallow:
    """An attribute's value at a block's start, and its items (held, so no id is reused)."""

    __slots__ = ("items", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        t = type(value)
        self.items: list[Any] | None = None
        if t in (list, tuple, set) or isinstance(value, tuple):
            self.items = list(value)
        elif isinstance(value, dict):
            self.items = [x for kv in value.items() for x in kv]

    def same(self, value: Any) -> bool:
        if value is not self.value:
            return False
        if self.items is None:
            return True
        now = _Shallow(value).items or []
        return len(now) == len(self.items) and all(
            a is b for a, b in zip(now, self.items, strict=True)
        )


def attr_ids(objects: Mapping[str, object]) -> dict[tuple[str, str], Any]:
    """The named objects' plain attributes as a block starts, to tell later which changed."""
    found: dict[tuple[str, str], Any] = {}
    for name, obj in objects.items():
        for attr in _attr_names(obj):
            found[(name, attr)] = _Shallow(getattr(obj, attr, None))
    return found


def capture_attrs(
    objects: Mapping[str, object], before: Mapping[tuple[str, str], Any]
) -> tuple[dict[str, dict[str, Any]], list[list[str]]]:
    """The encoded plain attributes of ``objects``, and ``[object, attribute, why]`` of
    those that changed since ``before`` but cannot be carried.

    Every attribute that fits is captured, changed or not: an in-place change deep
    inside (a tensor's ``add_``, a nested list) is not seen by the comparison. One that
    does not fit and is the same object with the same items as at ``before`` is left
    out: restoring leaves it as it is, which is as training left it.
    """
    wanted: list[tuple[int, str, str, Any]] = []
    blocked: list[list[str]] = []
    for name, obj in objects.items():
        for attr in _attr_names(obj):
            value = getattr(obj, attr, None)
            if _is_structure(value) or isinstance(
                value, types.ModuleType | types.FunctionType | types.MethodType | type
            ):
                continue
            held = before.get((name, attr))
            changed = held is None or not held.same(value)
            why = _not_data(value)
            size = None if why else _size(value, [MAX_ITEMS])
            if size is None or size > MAX_ATTR_BYTES:
                if changed:
                    blocked.append([name, attr, why or _too_large(size)])
                continue
            wanted.append((size, name, attr, value))
    attrs: dict[str, dict[str, Any]] = {}
    room = MAX_ATTR_BYTES
    for size, name, attr, value in sorted(wanted, key=lambda w: w[0]):
        copied = _small_copy(value) if size <= room else _MISSING
        try:
            node = _MISSING if copied is _MISSING else _encode(copied)
        except _NotData:
            node = _MISSING
        if node is _MISSING:
            held = before.get((name, attr))
            if held is None or not held.same(value):
                blocked.append([name, attr, _too_large(size)])
            continue
        room -= size
        attrs.setdefault(name, {})[attr] = node
    return attrs, blocked


def _too_large(size: int | None) -> str:
    if size is None:
        return f"it holds more than {MAX_ITEMS} items or a value that is not plain data"
    return f"it is larger than the {MAX_ATTR_BYTES >> 10} KiB a checkpoint carries"


def _not_data(value: Any, budget: list[int] | None = None) -> str | None:
    """Why ``value`` cannot be carried as data, for the reasons :func:`_size` does not
    tell: tensors with autograd history, instances of other classes."""
    budget = budget if budget is not None else [MAX_ITEMS]
    budget[0] -= 1
    if budget[0] < 0:
        return None  # _size reports the count
    t = type(value)
    if isinstance(value, list | tuple | set | frozenset | dict):
        items = (x for kv in value.items() for x in kv) if isinstance(value, dict) else value
        inner = next((w for v in items if (w := _not_data(v, budget))), None)
        if inner is not None or t in (list, tuple, set, dict):
            return inner
    elif is_tensor(value):
        if value.requires_grad:
            return (
                "it holds tensors that carry autograd history (requires_grad), which a "
                "checkpoint cannot hold: the code after the block would backpropagate "
                "through them"
            )
        return None
    if t in _PLAIN or isinstance(value, numpy_scalar_types()):
        return None
    return f"it holds a {t.__module__}.{t.__qualname__}, which is not plain data"


def load_attrs(blob: bytes | None) -> tuple[dict[str, dict[str, Any]], list[list[str]]]:
    """The attributes and the ``[object, attribute, why]`` not captured, from :func:`capture`."""
    if not blob or not blob.startswith(_MAGIC):
        return {}, []
    try:
        doc = json.loads(blob[len(_MAGIC) :])
        attrs = {
            str(name): {str(a): _decode(v) for a, v in values.items()}
            for name, values in doc.get("attrs", {}).items()
        }
        blocked = [[str(x) for x in item] for item in doc.get("attrs_not_captured", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreError(f"a checkpoint's saved attributes cannot be decoded: {exc}") from exc
    return attrs, blocked


def describe_blocked(blocked: list[list[str]]) -> str:
    """``model.saved_actions (why)``, for the plan and the report."""
    return "; ".join(f"{name}.{attr} ({why})" for name, attr, why in blocked)


def restore_attrs(objects: Mapping[str, object], attrs: Mapping[str, Mapping[str, Any]]) -> None:
    """Set the named objects' attributes to the captured values: containers in place."""
    for name, values in attrs.items():
        obj = objects.get(name)
        if obj is None:
            continue
        for attr, saved in values.items():
            current: Any = getattr(obj, attr, _MISSING)
            if type(current) is list and type(saved) is list:
                current[:] = saved
            elif type(current) in (dict, set) and type(saved) is type(current):
                current.clear()
                current.update(saved)
            else:
                setattr(obj, attr, saved)
