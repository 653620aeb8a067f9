"""Capture and restore the live state a checkpoint is made of, in memory.

A :class:`Snapshot` is an independent deep copy of the named objects' state
plus the RNG states. :func:`restore`
puts it back *into the same live objects*: a module keeps its parameter
tensors, an optimizer stays the object the training loop holds, so code after
a skipped block sees exactly what it saw during record: replay is exact only
if a restored block leaves the same objects in the same state.

torch is never imported here unless the caller already did (a tensor can only
exist once torch is imported) or a snapshot to restore holds torch state.
"""

from __future__ import annotations

import copy
import importlib
import random
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from retrolog.checkpoint.lazy_types import is_tensor, loaded_torch
from retrolog.errors import CheckpointTargetError, RetrologWarning

ACCEPTED = (
    "objects with state_dict() and load_state_dict() methods (torch modules, optimizers, "
    "LR schedulers, GradScaler), torch tensors, numpy arrays, dicts and lists "
    "(all restored in place), random.Random instances and numpy Generators"
)

# Values that cannot change after the snapshot, so sharing them is a copy.
_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None))


@dataclass
class Snapshot:
    """The state of named objects and of the RNGs at one moment, independent of them."""

    objects: dict[str, Any] = field(default_factory=dict)  # name -> copied state
    rng: dict[str, Any] = field(default_factory=dict)  # generator name -> copied state


@dataclass(frozen=True)
class StoredTensor:
    """A large CPU tensor found unchanged since an earlier snapshot: its key, not a copy.

    ``key`` is the content key (:func:`~retrolog.checkpoint._arrays.content_key`)
    of the tensor's dtype, shape and bytes at the snapshot, an object an
    earlier snapshot of the same checkpointer stored (snapshots are written
    in order). ``source`` is the live tensor, for its dtype and shape only:
    training may change its bytes while the writer works. Only
    :func:`snapshot` with a :class:`TensorMemo` makes these.
    """

    key: str
    source: Any  # the live torch.Tensor (detached), CPU and contiguous


@dataclass(frozen=True)
class DeviceTensor:
    """A CPU copy of a tensor that lived on another device, which it returns to on restore."""

    tensor: Any  # torch.Tensor on the CPU
    device: str  # e.g. "cuda:0"


# ---------------------------------------------------------------- torch helpers


def import_torch(why: str) -> ModuleType:
    """Import torch because ``why`` needs it; a clear error if it is not installed."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise CheckpointTargetError(
            f"{why} needs torch, which is not installed in this environment; "
            "install it (pip install 'retrolog[torch]') to load this checkpoint."
        ) from exc


def _is_torch_immutable(value: object) -> bool:
    torch = loaded_torch()
    return torch is not None and isinstance(value, torch.Size | torch.dtype | torch.device)


# ---------------------------------------------------------------- targets


def _kind(obj: object) -> str | None:
    """How ``obj``'s state is captured and restored, or None if it cannot be."""
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return "state_dict"
    if is_tensor(obj):
        return "tensor"
    if isinstance(obj, np.ndarray):
        return "ndarray"
    if isinstance(obj, dict):
        return "dict"
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return "random"  # SystemRandom reads the OS entropy pool and has no state
    if isinstance(obj, np.random.Generator | np.random.BitGenerator):
        return "np_generator"
    return None


def _type_name(obj: object) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def validate_targets(objects: Mapping[str, object]) -> None:
    """Raise CheckpointTargetError unless every named object's state can be captured in place."""
    for name, obj in objects.items():
        if not isinstance(name, str):
            raise CheckpointTargetError(
                f"checkpointing() names its objects with strings, got {name!r} "
                f"({_type_name(name)}); pass them as keyword arguments, e.g. "
                "checkpointing(model=net, optimizer=opt).",
                name=str(name),
            )
        kind = _kind(obj)
        if kind is None:
            has_one = [
                m for m in ("state_dict", "load_state_dict") if callable(getattr(obj, m, None))
            ]
            detail = (
                f" It has {has_one[0]}() but not the other method of the pair." if has_one else ""
            )
            raise CheckpointTargetError(
                f"checkpointing() cannot save {name!r}: it is a {_type_name(obj)}, and a "
                "checkpoint is restored in place into the live object, which this type does "
                f"not allow.{detail} Accepted are {ACCEPTED}. Keep the value in a dict "
                f"(e.g. state = {{{name!r}: ...}}) and pass the dict, or wrap it in an object "
                "with state_dict() and load_state_dict() methods.",
                name=name,
            )
        if kind == "ndarray" and not obj.flags.writeable:  # type: ignore[attr-defined]
            raise CheckpointTargetError(
                f"checkpointing() cannot save {name!r}: the numpy array is read-only, so a "
                "checkpoint could not be restored into it. Pass a writeable array "
                "(e.g. arr.copy()) and use that one in training.",
                name=name,
            )


# ---------------------------------------------------------------- copying

POOLED_BYTES = 64 * 1024  # smaller tensors are cloned: a lookup would cost more than it saves


@dataclass
class _MemoEntry:
    key: str | None = None  # content key at the last snapshot that hashed this position
    fails: int = 0  # hashes in a row that found it changed
    skip: int = 0  # snapshots still to copy it without hashing (backing off)


class TensorMemo:
    """Which large CPU tensors did not change since the last snapshot, by traversal position.

    A frozen backbone, an embedding table that is not trained, a buffer that
    never moves: copying them at every checkpoint costs the training thread a
    memcpy each time for nothing, while hashing them in place (xxh3, about 5x
    faster than the copy) proves them unchanged, and the snapshot then holds
    their key (:class:`StoredTensor`). A tensor found changed is copied
    without hashing for the next 1, 3, 7, then 15 snapshots (exponential back
    off), so trained weights pay the hash rarely. One memo serves every
    :class:`SnapshotBuffers` of a checkpointer.
    """

    def __init__(self) -> None:
        self._entries: list[_MemoEntry] = []
        self._next = 0

    def rewind(self) -> None:
        """Start from the first position again (one snapshot per rewind)."""
        self._next = 0

    def unchanged(self, tensor: Any) -> str | None:
        """The key of ``tensor`` (next position) if it did not change, else None (copy it)."""
        from retrolog.checkpoint._arrays import content_key

        index = self._next
        self._next += 1
        if index == len(self._entries):
            self._entries.append(_MemoEntry())
        entry = self._entries[index]
        if entry.skip > 0:
            entry.skip -= 1
            return None
        dtype = str(tensor.dtype).removeprefix("torch.")
        key = content_key("torch." + dtype, tuple(tensor.shape), _bytes_view(tensor))
        if key == entry.key:
            entry.fails = 0
            return key
        if entry.key is not None:
            entry.fails += 1
            entry.skip = min(2**entry.fails - 1, 15)
        entry.key = key
        return None


class SnapshotBuffers:
    """Reusable host memory for the large tensors of one snapshot, in traversal order.

    Copying the state into memory that was already touched costs a memcpy;
    copying into fresh memory also pays a page fault per 4 KiB (the thread
    design's 64 ms vs the shared-memory slot's 28 ms for 82 MB in
    docs/materialization.md). A checkpointer keeps one of these per snapshot
    it may hold at once and hands it to :func:`snapshot`; the snapshot's
    tensors then *are* these buffers, so the holder must not reuse them until
    the snapshot has been written. Buffers are matched by position, shape and
    dtype, so a state that changes shape just allocates anew.
    """

    def __init__(self, memo: TensorMemo | None = None) -> None:
        self._buffers: list[Any] = []
        self._next = 0
        self.memo = memo  # shared by a checkpointer's buffers: unchanged tensors are not copied

    def __len__(self) -> int:
        return len(self._buffers)

    def rewind(self) -> None:
        """Start filling from the first buffer again (one snapshot per rewind)."""
        self._next = 0
        if self.memo is not None:
            self.memo.rewind()

    def skip(self) -> None:
        """Leave this position's buffer as it is (its tensor was not copied)."""
        self._next += 1

    def like(self, source: Any, pin: bool) -> Any:
        """A CPU tensor with ``source``'s shape and dtype, reused when one is at this position."""
        torch = import_torch("Copying a tensor")
        index = self._next
        self._next += 1
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.shape == source.shape and buffer.dtype == source.dtype:
                return buffer
        # Pinned host memory makes the device-to-host copy a DMA transfer.
        buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer


def freeze(value: Any, buffers: SnapshotBuffers | None = None) -> Any:
    """A deep copy of ``value`` that later training cannot change.

    Tensors are detached and copied (to the CPU, remembering their device;
    into ``buffers`` when given), arrays copied, containers rebuilt with the
    same types; other leaves are deep-copied.
    """
    t = type(value)
    if t in _IMMUTABLE:
        return value
    if t is dict:
        return {k: freeze(v, buffers) for k, v in value.items()}
    if t is list:
        return [freeze(v, buffers) for v in value]
    if t is tuple:
        return tuple(freeze(v, buffers) for v in value)
    if t is OrderedDict:
        # A module's state_dict is an OrderedDict whose _metadata carries the
        # per-submodule versions that load_state_dict uses to upgrade old formats.
        out: OrderedDict[Any, Any] = OrderedDict((k, freeze(v, buffers)) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out
    if t is np.ndarray:
        return value.copy()
    if isinstance(value, np.generic):
        return value
    if is_tensor(value):
        return _freeze_tensor(value, buffers)
    if t is DeviceTensor:
        return DeviceTensor(freeze(value.tensor, buffers), value.device)
    if _is_torch_immutable(value):
        return value
    return copy.deepcopy(value)


def _freeze_tensor(tensor: Any, buffers: SnapshotBuffers | None) -> Any:
    detached = tensor.detach()
    on_cpu = detached.device.type == "cpu"
    if (
        buffers is None
        or tensor.requires_grad  # a buffer that requires grad cannot be copied into again
        or detached.layout is not _torch_strided()
        or detached.is_quantized
        or detached.numel() * detached.element_size() < POOLED_BYTES
    ):
        saved = _copy_on_this_thread(detached) if on_cpu else None
        if saved is None:
            saved = detached.to("cpu", copy=True)
        if tensor.requires_grad:
            saved.requires_grad_(True)
    else:
        if on_cpu and buffers.memo is not None and detached.is_contiguous():
            key = buffers.memo.unchanged(detached)
            if key is not None:
                buffers.skip()
                return StoredTensor(key, detached)
        saved = buffers.like(detached, pin=not on_cpu)
        if on_cpu and detached.is_contiguous():
            # One memcpy on this thread: torch's copy_ may fan out to its thread
            # pool, which on a busy machine was measured far slower than one thread.
            np.copyto(_bytes_view(saved), _bytes_view(detached))
        else:
            saved.copy_(detached)
    if not on_cpu:
        return DeviceTensor(saved, str(detached.device))
    return saved


# Elements below which torch runs an operation on the calling thread (at::internal::GRAIN_SIZE).
TORCH_GRAIN_SIZE = 32768


def _copy_on_this_thread(tensor: Any) -> Any:
    """A copy of a CPU tensor made by one memcpy on the calling thread, or None.

    torch's own copy fans out to its intra-op thread pool above a size. Called from
    a thread other than training's (a replay worker's prefetcher thawing the next
    checkpoint), that starts a second OpenMP team beside training's: on 2 cores the
    demo's first executed epoch after a restore ran 2.6x slower (1.13 s against 0.43 s).
    """
    if (
        tensor.numel() < TORCH_GRAIN_SIZE  # torch copies it on this thread anyway
        or tensor.layout is not _torch_strided()
        or tensor.is_quantized
        or not tensor.is_contiguous()
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return None
    torch = import_torch("Copying a tensor")
    copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    np.copyto(_bytes_view(copy), _bytes_view(tensor))
    return copy


def _torch_strided() -> Any:
    torch = loaded_torch()
    return None if torch is None else torch.strided


def _bytes_view(tensor: Any) -> np.ndarray[Any, Any]:
    """The bytes of a contiguous CPU tensor as a flat uint8 numpy array (no copy)."""
    torch = import_torch("Copying a tensor")
    return tensor.reshape(-1).view(torch.uint8).numpy()


def thaw(value: Any) -> Any:
    """A fresh copy of frozen ``value`` ready to hand to live code.

    Restoring from a copy keeps the snapshot intact (an optimizer's
    load_state_dict keeps the tensors it is given and updates them in place),
    so one snapshot can be restored any number of times.
    """
    t = type(value)
    if t is DeviceTensor:
        return _to_device(value.tensor, value.device)
    if t is dict:
        return {k: thaw(v) for k, v in value.items()}
    if t is list:
        return [thaw(v) for v in value]
    if t is tuple:
        return tuple(thaw(v) for v in value)
    if t is OrderedDict:
        out: OrderedDict[Any, Any] = OrderedDict((k, thaw(v)) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out
    return freeze(value)


def _to_device(tensor: Any, device: str) -> Any:
    try:
        moved = tensor.to(device, copy=True)
    except (RuntimeError, AssertionError) as exc:
        # torch raises AssertionError ("Torch not compiled with CUDA enabled") or
        # RuntimeError for a device this machine does not have.
        raise CheckpointTargetError(
            f"The checkpoint holds a tensor that lived on {device}, which this machine "
            f"cannot use ({exc}). Restore it on a machine with that device."
        ) from exc
    if tensor.requires_grad:
        moved = moved.detach().requires_grad_(True)
    return moved


# ---------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """The states of python's random, numpy's global generator and torch's generators.

    torch's are included only if torch is already imported: a process that
    has not imported it has drawn nothing from it.
    """
    rng: dict[str, Any] = {
        "random": random.getstate(),
        "numpy": freeze(np.random.get_state()),
    }
    torch = loaded_torch()
    if torch is not None:
        rng["torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            rng["torch_cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Put back RNG states taken by :func:`capture_rng`."""
    if "random" in rng:
        random.setstate(rng["random"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "torch" in rng or "torch_cuda" in rng:
        # The script drew from torch during record, so it will again: import
        # torch now rather than let it start from its default seed later.
        torch = import_torch("Restoring torch's random number generator state")
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "torch_cuda" in rng:
            _restore_cuda_rng(torch, rng["torch_cuda"])


def _restore_cuda_rng(torch: ModuleType, states: list[Any]) -> None:
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < len(states):
        warnings.warn(
            f"The checkpoint holds the CUDA random state of {len(states)} device(s) but "
            f"this machine has {available}; only those are restored, so values drawn on "
            "the other GPUs will differ from the recorded run.",
            RetrologWarning,
            stacklevel=3,
        )
    for index, state in enumerate(states[:available]):
        torch.cuda.set_rng_state(state, index)


# ---------------------------------------------------------------- snapshot / restore


def _capture_one(obj: object, kind: str, buffers: SnapshotBuffers | None) -> Any:
    if kind == "state_dict":
        return freeze(obj.state_dict(), buffers)  # type: ignore[attr-defined]
    if kind == "random":
        return obj.getstate()  # type: ignore[attr-defined]
    if kind == "np_generator":
        bit_generator = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        return freeze(bit_generator.state)  # type: ignore[attr-defined]
    return freeze(obj, buffers)


def snapshot(objects: Mapping[str, object], buffers: SnapshotBuffers | None = None) -> Snapshot:
    """Copy the state of ``objects`` and of the RNGs as it is now.

    buffers: reusable memory for the copies of large tensors (see
    :class:`SnapshotBuffers`); the snapshot then shares it.
    """
    validate_targets(objects)
    if buffers is not None:
        buffers.rewind()
    captured = {name: _capture_one(obj, _kind(obj) or "", buffers) for name, obj in objects.items()}
    return Snapshot(objects=captured, rng=capture_rng())


def restore(objects: Mapping[str, object], snap: Snapshot, *, thawed: bool = False) -> None:
    """Put ``snap`` back into the live ``objects`` in place, and the RNG states.

    thawed: ``snap.objects`` is already a copy made with :func:`thaw` that nothing else
        holds (a replay worker's prefetcher makes it off the worker's thread), so it is
        handed to the objects as it is instead of copied again.
    """
    validate_targets(objects)
    missing = [n for n in snap.objects if n not in objects]
    extra = [n for n in objects if n not in snap.objects]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the checkpoint has {_names(missing)} that were not passed")
        if extra:
            parts.append(f"{_names(extra)} were passed but are not in the checkpoint")
        raise CheckpointTargetError(
            f"The objects to restore do not match the checkpoint: {'; '.join(parts)}. "
            f"The checkpoint holds {_names(list(snap.objects)) or 'no objects'}; pass "
            "checkpointing() the same names as the run that wrote it.",
            name=(missing + extra)[0],
        )
    for name, obj in objects.items():
        _restore_one(name, obj, snap.objects[name], thawed)
    restore_rng(snap.rng)


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _mismatch(name: str, live: str, saved: str) -> CheckpointTargetError:
    return CheckpointTargetError(
        f"Cannot restore {name!r}: the live object is {live} but the checkpoint holds {saved}. "
        "Restore into an object of the same kind, shape and dtype as the one checkpointed.",
        name=name,
    )


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray) or is_tensor(value):
        return f"a {_type_name(value)} of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, DeviceTensor):
        return f"{_describe(value.tensor)} from {value.device}"
    return f"a {_type_name(value)}"


def _as_is(value: Any) -> Any:
    return value


def _restore_one(name: str, obj: Any, saved: Any, thawed: bool = False) -> None:
    kind = _kind(obj)
    own = _as_is if thawed else thaw
    if kind == "state_dict":
        try:
            obj.load_state_dict(own(saved))
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise CheckpointTargetError(
                f"Cannot restore {name!r} ({_type_name(obj)}): its load_state_dict() "
                f"rejected the checkpoint: {exc}. The object no longer matches the one "
                "checkpointed (changed architecture, parameter groups or class?).",
                name=name,
            ) from exc
    elif kind == "tensor":
        tensor = saved.tensor if isinstance(saved, DeviceTensor) else saved
        if not is_tensor(tensor) or tensor.shape != obj.shape or tensor.dtype != obj.dtype:
            raise _mismatch(name, _describe(obj), _describe(saved))
        torch = import_torch("Restoring a tensor")
        with torch.no_grad():
            obj.copy_(tensor)
    elif kind == "ndarray":
        if (
            not isinstance(saved, np.ndarray)
            or saved.shape != obj.shape
            or saved.dtype != obj.dtype
        ):
            raise _mismatch(name, _describe(obj), _describe(saved))
        obj[...] = saved
    elif kind == "dict":
        if not isinstance(saved, dict):
            raise _mismatch(name, "a dict", _describe(saved))
        obj.clear()
        obj.update(own(saved))
    elif kind == "list":
        if not isinstance(saved, list):
            raise _mismatch(name, "a list", _describe(saved))
        obj[:] = own(saved)
    elif kind == "random":
        try:
            obj.setstate(saved)
        except (TypeError, ValueError) as exc:
            raise _mismatch(name, "a random.Random", _describe(saved)) from exc
    elif kind == "np_generator":
        bit_generator = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        try:
            bit_generator.state = own(saved)
        except (TypeError, ValueError, KeyError) as exc:
            raise _mismatch(name, f"a {_type_name(bit_generator)}", _describe(saved)) from exc
