"""The public functions stay functions after every subpackage is imported."""

from __future__ import annotations

import importlib
import pkgutil

import retrolog


def test_no_submodule_shadows_a_public_function() -> None:
    for info in pkgutil.walk_packages(retrolog.__path__, prefix="retrolog."):
        importlib.import_module(info.name)
    for name in retrolog.__all__:
        assert callable(getattr(retrolog, name)), name
        assert not isinstance(getattr(retrolog, name), type(retrolog)), name
