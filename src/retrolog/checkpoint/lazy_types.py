"""What the process has imported already, looked up without importing it.

Kept apart from checkpoint/state.py, which needs numpy, so that modules imported
with ``import retrolog`` (runtime/frames.py) can tell a tensor or a numpy scalar
without importing torch or numpy: a process that never imported them holds none.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


def loaded_torch() -> ModuleType | None:
    """torch if the process has imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a torch.Tensor, without importing torch."""
    torch = loaded_torch()
    return torch is not None and isinstance(value, torch.Tensor)


def numpy_scalar_types() -> Any:
    """numpy.generic if the process has imported numpy, else () (no isinstance matches).

    Typed Any: what passes ``isinstance`` with it has numpy's scalar attributes.
    """
    numpy = sys.modules.get("numpy")
    generic = getattr(numpy, "generic", None) if numpy is not None else None
    return generic if isinstance(generic, type) else ()
