"""One-line integrations with training frameworks (docs/integrations.md).

Each framework's module is imported only when it is used: ``import retrolog`` imports
no framework. ``autolog`` patches the frameworks installed so that an unmodified
script records.
"""

from __future__ import annotations

import importlib.util

_PATCHED: set[str] = set()


def autolog() -> None:
    """Record every transformers ``Trainer`` and Lightning ``Trainer`` made from now on,
    with no other change.

    Each Trainer gets its framework's ``RetrologCallback``
    (:mod:`retrolog.integrations.transformers`, :mod:`retrolog.integrations.lightning`)
    unless one was passed. Call it before the Trainer is made; calling it again does
    nothing. Frameworks that are not installed are left alone.
    """
    if "transformers" not in _PATCHED and importlib.util.find_spec("transformers") is not None:
        from retrolog.integrations.transformers import patch_trainer

        patch_trainer()
        _PATCHED.add("transformers")

    if "lightning" not in _PATCHED and importlib.util.find_spec("lightning") is not None:
        from retrolog.integrations.lightning import patch_trainer as patch_lightning

        patch_lightning()
        _PATCHED.add("lightning")
