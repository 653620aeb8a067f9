"""One-line integrations with training frameworks (docs/integrations.md).

Each framework's module is imported only when it is used: ``import retrolog`` imports
no framework. ``autolog`` patches the frameworks installed so that an unmodified
script records.
"""

from __future__ import annotations

import importlib.util

_PATCHED: set[str] = set()


def autolog() -> None:
    """Record every transformers ``Trainer`` made from now on, with no other change.

    Each Trainer gets a :class:`~retrolog.integrations.transformers.RetrologCallback`
    (unless one was passed). Call it before the Trainer is made; calling it again
    does nothing. Frameworks that are not installed are left alone.
    """
    if "transformers" not in _PATCHED and importlib.util.find_spec("transformers") is not None:
        from retrolog.integrations.transformers import patch_trainer

        patch_trainer()
        _PATCHED.add("transformers")
