"""The state every phase of propagation reads: the two versions aligned, their name scopes,
and what goes in with the statements (today's definitions, the retrolog import).

The phases build on it in order, each a class adding its methods to the one before:
spot.py (where, in the old tree), place.py (the text and the edit), hooks.py (today's
methods and classes carried whole) and propagator.py (all units, then the file)."""

from __future__ import annotations

import ast

from retrolog._replay._align import _Alignment, _Tree
from retrolog._replay._scopes import _scopes
from retrolog._replay.propagate.carry import _Carry
from retrolog._replay.propagate.imports import _plan_import
from retrolog._replay.propagate.source import _loop_name, _Source, _Unit


class _Aligned:
    """One new version aligned with one old version, and the units to place."""

    def __init__(self, new: _Source, old: _Source, units: list[_Unit]) -> None:
        self.new, self.old, self.units = new, old, units
        self.align = _Alignment(
            _Tree(new.tree, {id(unit.root) for unit in units}), _Tree(old.tree, set())
        )
        self.align.run(
            lambda node: _loop_name(node, new.api),
            lambda node: _loop_name(node, old.api),
            lambda call: new.api.function_of(call) == "loop",
            lambda call: old.api.function_of(call) == "loop",
        )
        self.new_scopes, self.old_scopes = _scopes(new.tree), _scopes(old.tree)
        self.votes = self.align.name_votes(self.new_scopes)
        self.present: dict[int, ast.stmt] = {}  # id(unit root) -> the old file's own copy
        self.unit_roots = {id(unit.root) for unit in units}
        self.new_functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for node in ast.walk(new.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.new_functions.setdefault(node.name, []).append(node)
        self.newline = "\r\n" if old.lines and old.lines[0].endswith("\r\n") else "\n"
        self.import_plan = (
            None if old.api.reaches_log() else _plan_import(new, old, self.old_scopes)
        )
        self.carry = _Carry(new, old, self.old_scopes)
        self._classes: set[str] = set()  # today's classes carried whole (not by _Carry)
