"""No module reaches into another package's private names.

A package's names with a leading underscore (``checkpoint._arrays``, ``_api._helper``) are
its own to change; what another package needs is public in its package. Packages are the
layers of tests/test_layers.py (``store``, ``checkpoint``, ..., and each top-level module
such as ``_api``). Read from the source's import statements, including those inside
functions, and from attributes read on an imported name (``module._name``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import retrolog

SOURCE = Path(retrolog.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reach_ins(path: Path, own: str) -> list[str]:
    """``path``'s uses of private names of packages other than ``own``."""
    found = []
    bound: dict[str, str] = {}  # local name -> what it names in another package
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "retrolog":
                continue
            if len(parts) == 1:  # from retrolog import _api: a layer, by its own name
                for alias in node.names:
                    if alias.name != own:
                        bound[alias.asname or alias.name] = f"retrolog.{alias.name}"
                continue
            if parts[1] == own:
                continue
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if any(_private(p) for p in parts[2:]) or _private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                bound[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != "retrolog" or len(parts) < 2 or parts[1] == own:
                    continue
                if any(_private(p) for p in parts[2:]):
                    found.append(f"line {node.lineno}: import {alias.name}")
                if alias.asname:
                    bound[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"line {node.lineno}: {bound[base.id]}.{node.attr}")
    return found


def layer(path: Path) -> str:
    rel = path.relative_to(SOURCE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_no_module_uses_another_packages_private_names() -> None:
    wrong = []
    for path in sorted(SOURCE.rglob("*.py")):
        for use in reach_ins(path, layer(path)):
            wrong.append(f"{path.relative_to(SOURCE)} {use}")
    assert not wrong, (
        "private names used across packages (make them public in their package, or move "
        "them):\n" + "\n".join(wrong)
    )


def test_the_check_sees_each_kind_of_reach_in(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from retrolog import _api\n"
        "from retrolog.store import paths\n"
        "def f():\n"
        "    from retrolog.checkpoint._arrays import DECODED\n"
        "    from retrolog._api import _project\n"
        "    import retrolog.checkpoint._loaded\n"
        "    from retrolog.store.paths import locate\n"
        "    return paths._escape, _api.log, _api._active\n"
    )
    assert reach_ins(module, "runtime") == [
        "line 4: from retrolog.checkpoint._arrays import DECODED",
        "line 5: from retrolog._api import _project",
        "line 6: import retrolog.checkpoint._loaded",
        "line 8: retrolog.store.paths._escape",
        "line 8: retrolog._api._active",
    ]
    assert reach_ins(module, "checkpoint") == [
        "line 5: from retrolog._api import _project",
        "line 8: retrolog.store.paths._escape",
        "line 8: retrolog._api._active",
    ]
