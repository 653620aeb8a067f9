"""A unit placed at its spot: its text with the old file's names (or what the old version
lacks for it), the edit that inserts it (whole lines, or a splice into a line holding
several statements), and every edit applied to the old text."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Sequence

from retrolog._replay._scopes import _SCOPES, _free_names
from retrolog._replay.propagate.explain import _join
from retrolog._replay.propagate.records import Unplaceable, _Edit, _Outcome, _Spot
from retrolog._replay.propagate.source import (
    _LINE,
    _first_line,
    _lines,
    _literal_name,
    _log_call,
    _span,
    _Unit,
)
from retrolog._replay.propagate.spot import _Spotting


class _Placing(_Spotting):
    """Where (spot.py), then what: the unit's text with the old file's names, then how: the
    text edit."""

    def _place(self, unit: _Unit) -> _Outcome | str:
        """The unit's outcome, or the reason it cannot be placed."""
        spot = self._spot(unit.root)
        if isinstance(spot, str):
            return spot
        owner, field, _ = self.old.parents[id(spot.stmt)]
        anchor = self._describe(spot, owner)
        if len(unit.logs) == 1:
            for existing in getattr(owner, field):
                call = _log_call(existing, self.old.api)
                if call is not None and _literal_name(call) == unit.logs[0].name:
                    self.present[id(unit.root)] = existing
                    present = self.old.segment(existing)
                    return _Outcome(unit, present, anchor, existing_line=existing.lineno - 1)
        text = self._text(unit, spot, anchor)
        if isinstance(text, Unplaceable):
            return text.reason
        edit = self._edit(unit, text, spot)
        if isinstance(edit, str):
            return edit
        return _Outcome(unit, edit.statement, anchor, edit, module_level=owner is self.old.tree)

    # What: the unit's text with the old file's names.

    def _text(self, unit: _Unit, spot: _Spot, anchor: str) -> str | Unplaceable:
        point = (
            (spot.stmt.end_lineno or spot.stmt.lineno, spot.stmt.end_col_offset or 0)
            if spot.after
            else (spot.stmt.lineno, spot.stmt.col_offset)
        )
        chain = self._old_scopes_at(spot.stmt)
        new_chain = [node for node, _ in self.new.ancestors(unit.root) if isinstance(node, _SCOPES)]
        replacements: list[tuple[int, int, str]] = []  # (start, end, text) in the unit's text
        missing: list[str] = []
        late: list[str] = []

        def check(name: str, shown: str) -> None:
            if self.import_plan is not None and name == self.import_plan.name:
                return  # bound by the import that goes in with the statement
            state = self.old_scopes.lookup(name, point, chain)
            if state == "missing":
                missing.append(shown)
            elif state == "late":
                late.append(shown)

        callee_names: set[int] = set()
        for node in ast.walk(unit.root):
            call = _log_call(node, self.new.api)
            if call is None:
                continue
            func = call.func
            callee = self._old_callee(func)
            root_name = func.value if isinstance(func, ast.Attribute) else func
            callee_names.add(id(root_name))
            if callee is None:
                missing.append("`log` from retrolog")
                continue
            check(callee.split(".")[0], f"`{callee.split('.')[0]}`")
            if callee != self.new.segment(func):
                start = self.new.offset_in(unit.root, *_span(func)[:2])
                end = self.new.offset_in(unit.root, *_span(func)[2:])
                replacements.append((start, end, callee))
        top = self._top_level(spot.stmt)
        for name in _free_names(unit.root):
            if id(name) in callee_names or name.id in self._classes:
                continue  # a class carried whole goes in with the statement creating it
            if self._module_level_in_new(name.id, new_chain):
                carried = self.carry.use(name.id, top)
                if isinstance(carried, list):
                    missing.extend(carried)
                    continue
                if carried is not None:  # today's definition goes in with the statement
                    if carried != name.id:
                        start = self.new.offset_in(unit.root, name.lineno, name.col_offset)
                        replacements.append((start, start + len(name.id), carried))
                    continue
            mapped = self.new_scopes.old_name(name.id, new_chain, self.votes)
            shown = f"`{mapped}`" if mapped == name.id else f"`{mapped}` (`{name.id}` here)"
            check(mapped, shown)
            if mapped != name.id:
                start = self.new.offset_in(unit.root, name.lineno, name.col_offset)
                replacements.append((start, start + len(name.id), mapped))
        if missing or late:
            parts = [f"has no {_join(missing)}"] if missing else []
            if late:
                parts.append(f"binds {_join(late)} only after that point")
            reason = f"the old version {' and '.join(parts)} (the statement would go {anchor})"
            return Unplaceable(unit.logs[0].name, reason)
        text = self.new.segment(unit.root)
        for start, end, value in sorted(replacements, reverse=True):
            text = text[:start] + value + text[end:]
        return text

    def _module_level_in_new(self, name: str, chain: Sequence[ast.AST]) -> bool:
        """Whether ``name`` read by today's statement is one of today's module-level names."""
        for scope in chain:
            if isinstance(scope, ast.Module):
                return name in self.carry.new_bindings
            if isinstance(scope, ast.ClassDef):
                continue
            if name in self.new_scopes.bindings.get(id(scope), {}):
                return False
        return name in self.carry.new_bindings

    def _top_level(self, stmt: ast.stmt) -> ast.stmt:
        """The statement of the old module's body that holds ``stmt``."""
        node: ast.AST = stmt
        while (entry := self.old.parents.get(id(node))) is not None and entry[
            0
        ] is not self.old.tree:
            node = entry[0]
        assert isinstance(node, ast.stmt)
        return node

    def _old_callee(self, func: ast.expr) -> str | None:
        """How the old file spells ``log``, preferring the new file's spelling."""
        if self.import_plan is not None:
            return self.import_plan.callee
        api = self.old.api
        spelled = self.new.segment(func)
        logs = [name for name, target in api.functions.items() if target == "log"]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id in api.modules:
                return spelled
        elif isinstance(func, ast.Name) and func.id in logs:
            return spelled
        if api.modules:
            return f"{api.modules[0]}.log"
        return logs[0] if logs else None

    def _old_scopes_at(self, stmt: ast.stmt) -> list[ast.AST]:
        return [node for node, _ in self.old.ancestors(stmt) if isinstance(node, _SCOPES)]

    # How: the text edit.

    def _edit(self, unit: _Unit, text: str, spot: _Spot) -> _Edit | str:
        stmt = spot.stmt
        owner, field, index = self.old.parents[id(stmt)]
        block: list[ast.stmt] = getattr(owner, field)
        if spot.after:
            following = block[index + 1] if index + 1 < len(block) else None
            end = stmt.end_lineno or stmt.lineno
            own_line = following is None or _first_line(following) > end
            if self.old.starts_line(stmt) and own_line:
                return self._lines_edit(unit, text, end, self.old.indent(stmt.lineno))
            col = self.old.col(end, stmt.end_col_offset or 0)
            return self._splice(unit, text, end - 1, col, "; ", "")
        if self.old.starts_line(stmt):
            line = _first_line(stmt)
            # Keep a comment that introduces the statement next to it.
            floor = (block[index - 1].end_lineno or 0) if index > 0 else line - 1
            indent = self.old.indent(line)
            while line - 1 > floor and self.old.lines[line - 2].strip().startswith("#"):
                if self.old.indent(line - 1) != indent:
                    break
                line -= 1
            return self._lines_edit(unit, text, line - 1, indent)
        col = self.old.col(stmt.lineno, stmt.col_offset)
        return self._splice(unit, text, stmt.lineno - 1, col, "", "; ")

    def _lines_edit(self, unit: _Unit, text: str, line: int, indent: str) -> _Edit:
        """Whole lines before old line ``line`` (0-based), re-indented to the old block."""
        new_indent = self.new.indent(unit.root.lineno)
        protected = _string_lines(unit.root)
        out = []
        pieces = [piece.rstrip("\r\n") for piece in _lines(text)]
        for number, piece in enumerate(pieces, start=unit.root.lineno):
            if number == unit.root.lineno:
                out.append(indent + piece)
            elif number not in protected and piece.startswith(new_indent):
                out.append(indent + piece[len(new_indent) :])
            else:
                out.append(piece)
        inserted = self.newline.join(out)
        return _Edit(line, None, inserted + self.newline, inserted[len(indent) :])

    def _splice(
        self, unit: _Unit, text: str, line: int, col: int, before: str, after: str
    ) -> _Edit | str:
        if not isinstance(unit.root, (ast.Expr, ast.Assign, ast.AnnAssign)):
            return (
                f"line {line + 1} of the old version holds several statements, and a block "
                "cannot be spliced into it"
            )
        return _Edit(line, col, before + text + after, text)

    def _apply(self, outcomes: list[_Outcome]) -> tuple[str, dict[int, int]]:
        """The propagated text, and each outcome's 1-based line in it."""
        whole: dict[int, list[_Outcome]] = defaultdict(list)
        spliced: dict[int, list[_Outcome]] = defaultdict(list)
        for outcome in outcomes:
            edit = outcome.edit
            if edit is not None:
                (whole if edit.col is None else spliced)[edit.line].append(outcome)
        lines = list(self.old.lines)
        if whole.get(len(lines)) and lines and not lines[-1].endswith(("\n", "\r")):
            lines[-1] += self.newline  # inserting after a last line that has no newline
        pieces: list[str] = []
        where: dict[int, int] = {}
        current = 1
        existing: dict[int, list[_Outcome]] = defaultdict(list)
        for outcome in outcomes:
            if outcome.edit is None:
                existing[outcome.existing_line].append(outcome)
        for number in range(len(lines) + 1):
            for outcome in whole.get(number, []):
                assert outcome.edit is not None
                where[id(outcome)] = current
                pieces.append(outcome.edit.text)
                current += _count_newlines(outcome.edit.text)
            if number == len(lines):
                break
            line, cut, parts = lines[number], 0, []
            splices = [(o.edit.col or 0, o.edit.text, o) for o in spliced.get(number, []) if o.edit]
            for col, text, outcome in sorted(splices, key=lambda item: item[0]):
                parts.append(line[cut:col])
                cut = col
                where[id(outcome)] = current + _count_newlines("".join(parts))
                parts.append(text)
            parts.append(line[cut:])
            for outcome in existing.get(number, []):
                where[id(outcome)] = current
            joined = "".join(parts)
            pieces.append(joined)
            current += _count_newlines(joined)
        return "".join(pieces), where


def _count_newlines(text: str) -> int:
    """How many line breaks ``text`` holds (``\r\n`` counts once)."""
    return len(_LINE.findall(text)) - (0 if text.endswith(("\n", "\r")) else bool(text))


def _string_lines(node: ast.AST) -> set[int]:
    """Lines that continue a multi-line string: re-indenting them would change a value."""
    lines: set[int] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Constant, ast.JoinedStr)) and sub.end_lineno:
            lines.update(range(sub.lineno + 1, sub.end_lineno + 1))
    return lines
