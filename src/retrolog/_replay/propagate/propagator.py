"""One new version's units placed into one old version: each placed, or carried whole with
its method or class, or refused with its reason; then today's definitions and the retrolog
import they need, and the propagated file."""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any, TypeVar

from retrolog._replay.propagate.hooks import _CarryingWhole
from retrolog._replay.propagate.imports import _import_outcome
from retrolog._replay.propagate.records import (
    AddedImport,
    Placement,
    Propagation,
    Unplaceable,
    _Hook,
    _Outcome,
)
from retrolog._replay.propagate.source import LogStatement, _lines

_T = TypeVar("_T")


class _Propagator(_CarryingWhole):
    """Places the units of one new version into one old version."""

    def run(self) -> Propagation:
        outcomes: list[_Outcome] = []
        problems: list[Unplaceable] = []
        for logs, done in self._place_units():
            if isinstance(done, str):
                problems.extend(
                    Unplaceable(log.name, f"{self._quote(log)}: {done}") for log in logs
                )
            else:
                outcomes.extend(done if isinstance(done, list) else [done])
        carried = self.carry.outcome(self.newline)
        if carried is not None:
            outcomes.insert(0, carried)  # before the statements that use it
        added = None
        if self.import_plan is not None and any(o.edit is not None for o in outcomes):
            added = _import_outcome(self.import_plan, self.old, self.newline, outcomes)
            outcomes.insert(0, added)  # first among insertions at the same line
        source, lines = self._apply(outcomes)
        imported = AddedImport(added.statement, lines[id(added)]) if added is not None else None
        methods = tuple(o.method for o in outcomes if o.method is not None)
        made = tuple(o.carried_class for o in outcomes if o.carried_class is not None)
        return Propagation(
            source,
            _placements(outcomes, lines),
            tuple(problems),
            imported,
            self.carry.carried_names(),
            methods,
            made,
        )

    def _place_units(self) -> list[tuple[list[LogStatement], _Outcome | list[_Outcome] | str]]:
        """Each unit's outcome (or the reason it has none), with the log statements it
        holds: placed where it aligns, else carried with its method or class."""
        hooks: dict[int, _Hook] = {}
        classes: dict[int, tuple[ast.ClassDef, list[LogStatement]]] = {}
        placed: list[tuple[list[LogStatement], _Outcome | list[_Outcome] | str]] = []
        for unit in self.units:
            hook = self._hook_of(unit)
            cls = self._new_class_of(unit) if hook is None else None
            # A new method today's code uses may hold code moved from the old version's
            # other methods or functions: placed there if it can be, else carried with the
            # line using it. One only a framework calls (a hook) is carried at once: its
            # statements run when the framework calls it, not where similar code ran.
            if hook is not None:
                used = bool(hook.called)
            else:
                method = self._method_in(unit, cls)
                used = method is None or bool(self._references(method))
            result = self._attempt(self._place, unit) if used else ""
            if hook is not None and isinstance(result, str):
                hooks.setdefault(id(hook.method), hook).units.append(unit)
            elif cls is not None and isinstance(result, str):
                classes.setdefault(id(cls), (cls, []))[1].extend(unit.logs)
            else:
                placed.append((unit.logs, result))
        for hook in hooks.values():
            logs = sorted((log for unit in hook.units for log in unit.logs), key=lambda x: x.line)
            placed.append((logs, self._attempt(self._carry_method, hook, logs)))
        for cls, logs in classes.values():
            placed.append((logs, self._attempt(self._carry_class, cls, logs)))
        return placed

    def _attempt(self, place: Callable[..., _T | str], *args: Any) -> _T | str:
        """``place(*args)``, forgetting today's definitions it meant to carry if it fails."""
        before = self.carry.state()
        result = place(*args)
        if isinstance(result, str):
            self.carry.restore(before)
        return result

    @staticmethod
    def _quote(log: LogStatement) -> str:
        text = log.source.splitlines()[0].strip() if log.source.strip() else log.name
        if len(text) > 60:
            text = text[:59] + "…"
        return f"`{text}` (line {log.line} of the new version)"


def _placements(outcomes: list[_Outcome], lines: dict[int, int]) -> tuple[Placement, ...]:
    """Where each requested statement sits in the propagated file (``lines``: each
    outcome's first line there)."""
    placements = []
    for outcome in outcomes:
        if outcome.unit is None:
            continue
        for log in outcome.unit.logs:
            statement = outcome.statement
            if outcome.edit is None:
                line = lines[id(outcome)]
            elif outcome.origin:
                line = lines[id(outcome)] + log.line - outcome.origin
                inserted = _lines(outcome.edit.text)[log.line - outcome.origin :]
                statement = "".join(inserted[: log.end_line - log.line + 1]).strip()
            else:
                line = lines[id(outcome)] + log.line - outcome.unit.root.lineno
            placements.append(Placement(log.name, statement, line, outcome.anchor))
    return tuple(placements)
