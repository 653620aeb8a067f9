"""How logged values are kept: JSON-able values as they are, everything else as text.

``log()`` passes float, int, str, bool and None straight to the writer (the
hot path). Anything else goes through :func:`normalize` at the call, because
the object may change or hold large memory (a tensor with its autograd graph)
by the time the writer thread sees it.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

# Values of these exact types skip normalize(): log()'s hot path, typed by SQLite's typeof().
FAST_TYPES = frozenset({float, int, str})
# Loop items of these types are kept as the loop's value.
PLAIN_TYPES = frozenset({float, int, str, bool, type(None)})

MAX_ARRAY_ELEMENTS = 100_000
"""Arrays and tensors up to this many elements are stored exactly, as JSON."""
MAX_CONTAINER_ITEMS = 10_000
"""Lists, tuples and dicts up to this many items are stored exactly, as JSON."""

_warned: set[str] = set()  # names already warned about, once per process
_TOP = object()  # the logged value itself, not an item inside it


class DeferredJSON:
    """A copy of an array taken at log time, turned into JSON by the writer thread.

    The copy is a memcpy; the conversion to text (a hundred thousand floats take tens
    of milliseconds) happens off the training thread, mostly while torch's kernels,
    which release the GIL, are running.
    """

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def encode(self) -> tuple[str, str]:
        """The (stored value, value_type): JSON, or a note if the array has no JSON form."""
        try:
            return json.dumps(_finite(self.array.tolist())), "json"
        except Exception as exc:  # on the writer thread: a failure here would stop recording
            return f"<not stored: an array of {self.array.dtype} with no JSON form ({exc})>", "text"


class Typed:
    """A value that was converted at log time, with the type name the store records."""

    __slots__ = ("kind", "value")

    def __init__(self, value: Any, kind: str) -> None:
        self.value = value
        self.kind = kind


def normalize(value: Any, *, name: str = "", defer: bool = False, path: str = "") -> Any:
    """Turn a non-plain value into a plain one, or a :class:`Typed` json/text value.

    Arrays and tensors of up to :data:`MAX_ARRAY_ELEMENTS` elements, and lists, tuples
    and dicts of up to :data:`MAX_CONTAINER_ITEMS` items, become JSON (with ``defer``,
    an array is copied now and encoded by the writer: :class:`DeferredJSON`). Larger
    ones are not stored: a short text says what was left out, and a warning (once per
    name) says what to log instead. Deciding that costs nothing: their size is read,
    never their content.

    path: where ``value`` sits inside the value logged as ``name`` (``['grads'][0]``),
    for the warning about a large array nested in a dict or list.
    """
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
    if size is not None and hasattr(value, "tolist"):
        if size > MAX_ARRAY_ELEMENTS:
            return _too_large(value, size, MAX_ARRAY_ELEMENTS, "elements", name, path)
        if defer:
            copied = _array_copy(value)
            if copied is not None:
                return DeferredJSON(copied)
        try:
            return Typed(json.dumps(_finite(value.tolist())), "json")
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(value, (list, tuple, dict)):
        if len(value) > MAX_CONTAINER_ITEMS:
            return _too_large(value, len(value), MAX_CONTAINER_ITEMS, "items", name, path)
        try:
            return Typed(json.dumps(_finite(value, name, path)), "json")
        except (TypeError, ValueError, RecursionError):  # not JSON, a cycle, nested too deep
            pass
    return Typed(printable(value), "text")


def printable(value: Any) -> str:
    """``str(value)``, or a note naming its type when its ``str`` and ``repr`` fail.

    rl.log must not raise in the user's training loop over how a value prints.
    """
    for show in (str, repr):
        try:
            return show(value)
        except Exception:  # a user's __str__ may raise anything; RecursionError too
            continue
    return f"<unprintable {type(value).__module__}.{type(value).__qualname__}>"


def _array_copy(value: Any) -> Any:
    """A numpy copy of an array or tensor whose tolist() gives the same values, else None."""
    import numpy as np

    try:
        if isinstance(value, np.ndarray):
            return None if value.dtype.hasobject else value.copy()
        detach = getattr(value, "detach", None)
        if callable(detach):  # a torch tensor (bfloat16 and the like have no numpy form)
            return detach().cpu().numpy().copy()
    except (TypeError, RuntimeError, ValueError):
        return None
    return None


def _too_large(value: Any, size: int, limit: int, unit: str, name: str, path: str = "") -> Typed:
    kind = type(value).__name__
    shape = getattr(value, "shape", None)
    what = f"a {kind}" + (f" of shape {tuple(shape)}" if shape is not None else "")
    text = f"<not stored: {what} with {size:,} {unit}, over rl.log's limit of {limit:,}>"
    if name + path not in _warned:
        _warned.add(name + path)
        import warnings

        from retrolog.errors import RetrologWarning

        shown = f"{name!r}" + (f" at {path}" if path else "")
        warnings.warn(
            f"retrolog: {shown} was logged as {what} with {size:,} {unit}, more than rl.log "
            f"stores ({limit:,}); it is recorded as a note saying so, not as its values. Log "
            "a summary instead (its mean, norm, a histogram with np.histogram), or keep the "
            "whole value in a file or in the objects rl.checkpointing saves.",
            RetrologWarning,
            stacklevel=_callers_level(),
        )
    return Typed(text, "text")


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside retrolog, for a warning raised here:
    the script's line, however deep in a nested value the warning was found."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("retrolog"):
        frame = frame.f_back
        level += 1
    return level


def normalize_scalar(value: Any) -> Any:
    if type(value) in PLAIN_TYPES:
        return value
    return normalize(value)


def slow_path(value: Any, *, name: str = "", defer: bool = False) -> tuple[Any, str]:
    """The (SQLite value, value_type) of a value that is not a float, int or str.

    With ``defer``, the SQLite value may be a :class:`DeferredJSON` the writer encodes.
    """
    if type(value) in PLAIN_TYPES:
        return storage_form(value)
    normalized = normalize(value, name=name, defer=defer)
    if type(normalized) is DeferredJSON:
        return normalized, "json"
    return storage_form(normalized)


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


def _finite(obj: Any, name: str = "", path: str = "", key: Any = _TOP) -> Any:
    """JSON has no NaN/Infinity; keep them as strings so the document stays standard.

    name, path, key: the logged name, and where ``obj`` sits in its value (its parent's
    path, and its key or index there), for the warning about a large nested array; the
    path is spelled out only for a container or a value that is not plain.
    """
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        here = path if key is _TOP else f"{path}[{key!r}]"
        return {
            k if isinstance(k, str) else printable(k): _finite(v, name, here, k)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        here = path if key is _TOP else f"{path}[{key!r}]"
        return [_finite(v, name, here, i) for i, v in enumerate(obj)]
    if type(obj) not in PLAIN_TYPES:
        here = path if key is _TOP else f"{path}[{key!r}]"
        normalized = normalize(obj, name=name, path=here)
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
    return printable(value), "text"
