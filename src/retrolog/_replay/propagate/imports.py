"""The retrolog import an old file gets when it never imported retrolog (history from
before retrolog was adopted): which name it binds, spelled like today's file, and where it
goes."""

from __future__ import annotations

import ast

from retrolog._replay._scopes import _Scopes
from retrolog._replay.propagate.records import _Edit, _ImportPlan, _Outcome
from retrolog._replay.propagate.source import _first_line, _must_stay_first, _Source


def _plan_import(new: _Source, old: _Source, old_scopes: _Scopes) -> _ImportPlan:
    """The import to add so that the old file reaches ``log``, spelled like the new file.

    A name the old file already binds in any scope (``rl = 0.1``, ``import rl``), or
    reads without binding it (it may come from ``from config import *``), is left
    alone: the import takes the next free one of ``retrolog``, ``_retrolog``, ...
    """
    taken = {name for table in old_scopes.bindings.values() for name in table}
    taken.update(n.id for n in ast.walk(old.tree) if isinstance(n, ast.Name))
    wanted: list[tuple[str, str, str]] = []  # (name, statement, callee)
    new_api = new.api
    for name, target in new_api.functions.items():
        if target == "log" and new_api.imported:
            statement = "from retrolog import log" + (f" as {name}" if name != "log" else "")
            wanted.append((name, statement, name))
    for module in new_api.modules if new_api.imported else []:
        statement = "import retrolog" + (f" as {module}" if module != "retrolog" else "")
        wanted.append((module, statement, f"{module}.log"))
    # A file logging through a snippet-style ``rl.log`` without importing prefers rl too.
    wanted.append(("rl", "import retrolog as rl", "rl.log"))
    wanted.append(("retrolog", "import retrolog", "retrolog.log"))
    counter = 1
    while not any(name not in taken for name, _, _ in wanted):
        alias = "_retrolog" + (str(counter) if counter > 1 else "")
        wanted.append((alias, f"import retrolog as {alias}", f"{alias}.log"))
        counter += 1
    name, statement, callee = next(item for item in wanted if item[0] not in taken)
    return _ImportPlan(statement, callee, name)


def _import_outcome(
    plan: _ImportPlan, old: _Source, newline: str, outcomes: list[_Outcome]
) -> _Outcome:
    """The import's edit: after the module's leading imports, before anything placed."""
    body = old.tree.body
    leading = 0
    while leading < len(body) and (
        isinstance(body[leading], (ast.Import, ast.ImportFrom))
        or _must_stay_first(body[leading], leading, old.tree)
    ):
        leading += 1
    if leading:
        last = body[leading - 1]
        line = last.end_lineno or last.lineno
    else:
        # Before the first statement itself, not above the comments leading to it: the
        # first lines may be a shebang or an encoding declaration.
        line = _first_line(body[0]) - 1 if body else len(old.lines)
    for outcome in outcomes:
        if outcome.module_level and outcome.edit is not None:
            line = min(line, outcome.edit.line)  # a statement placed among the imports
    text = plan.statement
    edit = _Edit(line, None, text + newline, text)
    return _Outcome(None, text, "at module level", edit, module_level=True)
