"""A stored checkpoint as the file ``torch.save`` writes, for ``torch.load(weights_only=True)``.

What a user downloads from the dashboard or writes with ``retrolog checkpoint export``:
a dict of the checkpoint's named objects, each as the checkpoint holds it (a module's or
optimizer's state_dict, a tensor, a dict of plain values). The checkpoint is decoded by
retrolog's own reader (:mod:`retrolog.checkpoint.codec`), which builds only data; a
checkpoint that holds a pickle is refused, whatever the reader's trust setting, so nothing
read from the store runs. The file holds only what torch's ``weights_only`` loader accepts:
numpy arrays become tensors of the same dtype and shape (that loader refuses numpy
objects), numpy scalars their Python values, frozensets sets, and a tensor that lived on
another device is written from its CPU copy.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import IO, Any

import numpy as np

from retrolog.checkpoint.codec import decode
from retrolog.checkpoint.state import DeviceTensor, import_torch
from retrolog.errors import CheckpointTargetError, StoreError
from retrolog.store.objects import ObjectStore

__all__ = ["export_torch", "holds_pickle"]

NEEDS_TORCH = (
    "Writing a checkpoint as a torch.save file needs torch, which is not installed in the "
    "environment retrolog runs in here (for a dashboard download: the environment of "
    "`retrolog ui`). Install it there (pip install 'retrolog[torch]') and try again."
)


def holds_pickle(node: Any) -> bool:
    """Whether a manifest's JSON tree (or part of it) has a pickled object."""
    if isinstance(node, list):
        return any(holds_pickle(item) for item in node)
    if isinstance(node, dict):
        return node.get("$") == "pickle" or any(holds_pickle(v) for v in node.values())
    return False


def export_torch(store: ObjectStore, manifest: str, out: IO[bytes], where: str) -> list[str]:
    """Write the checkpoint ``manifest`` to ``out`` as ``torch.save`` does; the names of the
    objects written. ``where`` names the checkpoint in error messages."""
    try:
        import_torch("Exporting a checkpoint")
    except CheckpointTargetError as exc:
        raise CheckpointTargetError(NEEDS_TORCH) from exc
    import torch

    try:
        doc = json.loads(store.get(manifest))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StoreError(f"The {where} has a manifest that is not JSON ({manifest}).") from exc
    if holds_pickle(doc):
        raise CheckpointTargetError(
            f"The {where} holds a pickled object, which cannot be written as a file "
            "torch.load(..., weights_only=True) reads, and retrolog never unpickles what it "
            "reads from the store to convert it. Restore it in Python instead "
            "(rl.restore(run, at=..., name=obj) with RETROLOG_TRUST_PICKLES=1 if you trust "
            "the store)."
        )
    snap = decode(manifest, store)
    payload = {
        name: _loadable(value, f"{where}, object {name!r}") for name, value in snap.objects.items()
    }
    torch.save(payload, out)
    return list(payload)


def _loadable(value: Any, where: str) -> Any:
    """``value`` with only what torch's weights_only loader reads (see the module's note)."""
    t = type(value)
    if t is dict:
        return {k: _loadable(v, where) for k, v in value.items()}
    if t is OrderedDict:
        out: OrderedDict[Any, Any] = OrderedDict((k, _loadable(v, where)) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if t is list:
        return [_loadable(v, where) for v in value]
    if t is tuple:
        return tuple(_loadable(v, where) for v in value)
    if t is frozenset:
        return set(value)
    if t is DeviceTensor:
        return value.tensor
    if isinstance(value, np.ndarray):
        return _array_tensor(value, where)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _array_tensor(array: np.ndarray[Any, Any], where: str) -> Any:
    import torch

    try:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("=")))
    except TypeError as exc:
        raise CheckpointTargetError(
            f"The {where} holds a numpy array of dtype {array.dtype}, which torch has no "
            "tensor type for, so it cannot go into a file torch.load(..., weights_only=True) "
            "reads. Restore it in Python instead (rl.restore)."
        ) from exc
