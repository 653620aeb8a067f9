"""How logged values are kept: JSON-able values as they are, everything else as text.

``log()`` passes float, int, str, bool and None straight to the writer (the
hot path). Anything else goes through :func:`normalize` at the call, because
the object may change or hold large memory (a tensor with its autograd graph)
by the time the writer thread sees it.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Values of these exact types skip normalize(): log()'s hot path, typed by SQLite's typeof().
FAST_TYPES = frozenset({float, int, str})
# Loop items of these types are kept as the loop's value.
PLAIN_TYPES = frozenset({float, int, str, bool, type(None)})

_MAX_LIST_ELEMENTS = 10_000


class Typed:
    """A value that was converted at log time, with the type name the store records."""

    __slots__ = ("kind", "value")

    def __init__(self, value: Any, kind: str) -> None:
        self.value = value
        self.kind = kind


def normalize(value: Any) -> Any:
    """Turn a non-plain value into a plain one, or a :class:`Typed` json/text value."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):  # int subclasses (IntEnum), numpy ints are handled below
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    size = _element_count(value)
    if size == 1 and hasattr(value, "item"):
        # numpy scalars, 0-d or 1-element arrays and tensors: users log `loss` as often as
        # `loss.item()`, and the number is what they mean.
        try:
            return normalize_scalar(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    if size is not None and size <= _MAX_LIST_ELEMENTS and hasattr(value, "tolist"):
        try:
            return Typed(json.dumps(_finite(value.tolist())), "json")
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(value, (list, tuple, dict)):
        try:
            return Typed(json.dumps(_finite(value)), "json")
        except (TypeError, ValueError):
            pass
    return Typed(str(value), "text")


def normalize_scalar(value: Any) -> Any:
    if type(value) in PLAIN_TYPES:
        return value
    return normalize(value)


def slow_path(value: Any) -> tuple[Any, str]:
    """The (SQLite value, value_type) of a value that is not a float, int or str."""
    return storage_form(value if type(value) in PLAIN_TYPES else normalize(value))


def _element_count(value: Any) -> int | None:
    numel = getattr(value, "numel", None)
    if callable(numel):  # torch.Tensor
        try:
            return int(numel())
        except (TypeError, RuntimeError):
            return None
    size = getattr(value, "size", None)
    if isinstance(size, int):  # numpy arrays and scalars
        return size
    return None


def _finite(obj: Any) -> Any:
    """JSON has no NaN/Infinity; keep them as strings so the document stays standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if type(obj) not in PLAIN_TYPES:
        normalized = normalize(obj)
        if isinstance(normalized, Typed):
            return normalized.value if normalized.kind == "text" else json.loads(normalized.value)
        return normalized
    return obj


def storage_form(value: Any) -> tuple[Any, str]:
    """The (SQLite value, value_type) pair for a value that passed through log()."""
    t = type(value)
    if t is float:
        return value, "float"  # NaN becomes NULL in SQLite; value_type keeps it a float
    if t is bool:
        return int(value), "bool"
    if t is int:
        if -(2**63) <= value < 2**63:
            return value, "int"
        return str(value), "text"
    if t is str:
        return value, "str"
    if value is None:
        return None, "none"
    if t is Typed:
        return value.value, value.kind
    return str(value), "text"
