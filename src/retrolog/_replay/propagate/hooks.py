"""Today's methods and classes the old version lacks, carried whole: a method only today's
version has in a class the old one has (a framework's hook), and a new class (a callback
class) with the one statement creating it. Each goes in with the line using it when
today's code uses it, placed like a requested statement."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from retrolog._replay._scopes import _DEFS, _free_names, _scopes, _stored
from retrolog._replay.propagate.explain import _lacks
from retrolog._replay.propagate.place import _Placing, _string_lines
from retrolog._replay.propagate.records import Unplaceable, _Edit, _Hook, _Outcome, _Spot
from retrolog._replay.propagate.source import (
    LogStatement,
    _first_line,
    _log_call,
    _Source,
    _span,
    _Unit,
)


class _CarryingWhole(_Placing):
    """Today's methods (a new callback hook) and classes (a new callback class) the old
    version lacks, carried whole."""

    def _hook_of(self, unit: _Unit) -> _Hook | None:
        """The new method holding a unit, if only today's version has it and it sits
        directly in a class the old version has (the aligned one, else the one of the same
        name): a framework's hook, or a helper today's code calls.
        """
        method: ast.FunctionDef | ast.AsyncFunctionDef | None = None
        for node, _ in self.new.ancestors(unit.root):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                method = node
                break
            if isinstance(node, (ast.ClassDef, ast.Lambda)):
                return None
        if method is None:
            return None
        cls, field, _ = self.new.parents[id(method)]
        if not isinstance(cls, ast.ClassDef) or field != "body":
            return None
        old_class = self._old_class(cls)
        if old_class is None or _method_named(old_class, method.name) is not None:
            return None
        partner = self.align.new.of[id(method)].partner
        if partner is not None and any(partner.ast is stmt for stmt in old_class.body):
            return None  # the old class has it under another name
        return _Hook(method, cls, old_class, [], self._references(method))

    def _method_in(
        self, unit: _Unit, cls: ast.ClassDef | None
    ) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The method of ``cls`` (directly in its body) that holds the unit, if any."""
        if cls is None:
            return None
        for node, _ in self.new.ancestors(unit.root):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                parent = self.new.parents[id(node)]
                return node if parent[0] is cls and parent[1] == "body" else None
        return None

    def _references(self, method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
        """The statements of today's file outside ``method`` that name it (``name(...)``,
        ``x.name(...)``, ``callback=self.name``): what runs it, unless a framework does."""
        found: dict[int, ast.stmt] = {}
        for node in ast.walk(self.new.tree):
            if _names(node, method.name) and not _inside_node(self.new, node, method):
                statement = next(n for n, _ in self.new.ancestors(node) if isinstance(n, ast.stmt))
                found[id(statement)] = statement
        return list(found.values())

    def _old_class(self, cls: ast.ClassDef) -> ast.ClassDef | None:
        """The old version's class for today's ``cls``: the one of the same name, else the
        aligned one, unless today's file has a class of that one's name (then the two are
        different classes the alignment paired for looking alike)."""
        same = [
            node
            for node in ast.walk(self.old.tree)
            if isinstance(node, ast.ClassDef) and node.name == cls.name
        ]
        if same:
            return same[0] if len(same) == 1 else None
        partner = self.align.new.of[id(cls)].partner
        if partner is None or not isinstance(partner.ast, ast.ClassDef):
            return None
        renamed = partner.ast.name
        today = (n for n in ast.walk(self.new.tree) if isinstance(n, ast.ClassDef))
        return None if any(n.name == renamed for n in today) else partner.ast

    def _carry_method(self, hook: _Hook, logs: list[LogStatement]) -> list[_Outcome] | str:
        """The new method inserted whole into the old class, after the old counterpart of
        its nearest preceding method (else before that of the following one, else at the
        end of the class), with the one statement using it if today's code uses it and the
        old version has no statement doing so; or the reason it cannot be."""
        method, old_class = hook.method, hook.old_class
        uses = self._method_use(hook, logs)
        if isinstance(uses, str):
            return uses
        if old_class.body[0].lineno == old_class.lineno:
            return (
                f"it sits in today's method `{method.name}`, which the old version's class "
                f"`{old_class.name}` (line {old_class.lineno}) lacks, and that class is written "
                "on one line, so the method cannot be added to it"
            )
        spot = self._method_spot(hook)
        relation = "after" if spot.after else "before"
        anchor = (
            f"in today's method `{method.name}`, carried into class `{old_class.name}` "
            f"{relation} line {_first_line(spot.stmt)} `{self.old.snippet(spot.stmt)}`"
        )
        text, missing, late = self._definition_text(method, self._top_level(old_class))
        attributes = _attributes_lacking(method, hook.new_class, old_class)
        if missing or late or attributes:
            sets = f"class `{old_class.name}`", [f"`self.{a}`" for a in attributes]
            return (
                f"the old version {_lacks(missing, late, sets)}, which today's method "
                f"`{method.name}` reads (the method would go into class `{old_class.name}` "
                f"{relation} line {_first_line(spot.stmt)} `{self.old.snippet(spot.stmt)}`)"
            )
        body = self._indented(method, text, self.old.indent(old_class.body[0].lineno))
        edit, origin = self._method_edit(hook, spot, body)
        unit = _Unit(method, logs)
        if uses:
            anchor += f", used by the line inserted {uses[0].anchor}"
        carried = _Outcome(
            unit,
            body.strip(),
            anchor,
            edit,
            origin=origin,
            method=(old_class.name, method.name),
        )
        return [carried, *uses]

    def _method_use(self, hook: _Hook, logs: list[LogStatement]) -> list[_Outcome] | str:
        """The statement using a carried method, placed, when today's code uses it and no
        call the old version has already runs it; or why it cannot be placed."""
        method, old_class = hook.method, hook.old_class
        uses: list[_Outcome] = []
        if hook.called:
            what = f"it sits in today's method `{method.name}` of class `{old_class.name}`"
            # A call the old version has too (a loop over callbacks calling each one's
            # hook) already runs an override of that name: nothing more to carry.
            wired = any(
                _names(partner.ast, method.name, inside=False)
                for statement in hook.called
                if (partner := self.align.new.of[id(statement)].partner) is not None
            )
            if not wired:
                used = self._use(what, "method", hook.called, logs)
                if isinstance(used, str):
                    return used
                uses.append(used[0])
        return uses

    def _method_spot(self, hook: _Hook) -> _Spot:
        """Where a carried method goes in the old class: after the old counterpart of its
        nearest preceding method, else before that of the following one, else at the end."""
        method, old_class = hook.method, hook.old_class
        siblings = hook.new_class.body
        index = next(i for i, stmt in enumerate(siblings) if stmt is method)
        spot: _Spot | None = None
        for position in range(index - 1, -1, -1):
            if (found := self._in_old_class(siblings[position], old_class)) is not None:
                spot = _Spot(True, found)
                break
        if spot is None:
            for position in range(index + 1, len(siblings)):
                if (found := self._in_old_class(siblings[position], old_class)) is not None:
                    spot = _Spot(False, found)
                    break
        if spot is None:
            spot = _Spot(True, old_class.body[-1])
        return spot

    def _method_edit(self, hook: _Hook, spot: _Spot, body: str) -> tuple[_Edit, int]:
        """The edit inserting a carried method's text ``body`` at ``spot``, and the new
        file's line its text starts at (its statements' lines follow from it)."""
        first = _first_line(hook.method)
        old_class = hook.old_class
        if spot.after:
            line, origin = spot.stmt.end_lineno or spot.stmt.lineno, first - 1
            inserted = self.newline + body
        else:
            line, origin = _first_line(spot.stmt) - 1, first
            position = next(i for i, stmt in enumerate(old_class.body) if stmt is spot.stmt)
            previous = old_class.body[position - 1] if position else None
            floor = (previous.end_lineno or previous.lineno) - 1 if previous else line - 1
            while line - 1 > floor and self.old.lines[line - 1].strip().startswith("#"):
                line -= 1  # keep a comment that introduces the following method next to it
            inserted = body + self.newline
        return _Edit(line, None, inserted, body.strip()), origin

    def _in_old_class(self, stmt: ast.stmt, old_class: ast.ClassDef) -> ast.stmt | None:
        """The old counterpart of a statement of today's class body, inside ``old_class``."""
        node = self.align.new.of.get(id(stmt))
        match = node.partner if node is not None else None
        if match is not None and any(match.ast is s for s in old_class.body):
            assert isinstance(match.ast, ast.stmt)
            return match.ast
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _method_named(old_class, stmt.name)
        return None

    def _definition_text(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, top: ast.stmt
    ) -> tuple[str, list[str], list[str]]:
        """Today's method or class as it goes into the old file, before the old module-level
        statement ``top`` (decorators and comments included, names mapped, today's helpers
        it reads carried), the names the old version lacks for it and those it binds too
        late."""
        replacements: list[tuple[int, int, int, str]] = []  # (line, start, end, text)
        missing: list[str] = []
        late: list[str] = []

        def replace(name: ast.AST, value: str) -> None:
            first, col, last, end_col = _span(name)
            if first == last:
                start, end = self.new.col(first, col), self.new.col(last, end_col)
                replacements.append((first, start, end, value))

        callee_names: set[int] = set()
        for sub in ast.walk(node):
            call = _log_call(sub, self.new.api)
            if call is None:
                continue
            func = call.func
            callee = self._old_callee(func)
            callee_names.add(id(func.value if isinstance(func, ast.Attribute) else func))
            if callee is None:
                missing.append("`log` from retrolog")
                continue
            root = callee.split(".")[0]
            plan = self.import_plan
            if (plan is None or root != plan.name) and self.old_scopes.lookup(
                root, (10**9, 0), [self.old.tree]
            ) != "ok":
                missing.append(f"`{root}`")
            if callee != self.new.segment(func):
                replace(func, callee)
        for name, at_definition in _definition_reads(node):
            if id(name) in callee_names:
                continue
            if name.id in self.carry.new_bindings:
                carried = self.carry.use(name.id, top)
                if isinstance(carried, list):
                    missing.extend(carried)
                    continue
                if carried is not None:
                    if carried != name.id:
                        replace(name, carried)
                    continue
            mapped = self.new_scopes.old_name(name.id, [self.new.tree], self.votes)
            # Decorators, bases and defaults run when the class is created; bodies when called.
            point = (top.lineno, 0) if at_definition else (10**9, 0)
            state = self.old_scopes.lookup(mapped, point, [self.old.tree])
            shown = f"`{mapped}`" if mapped == name.id else f"`{mapped}` (`{name.id}` here)"
            if state == "missing":
                missing.append(shown)
            elif state == "late":
                late.append(shown)
            if mapped != name.id:
                replace(name, mapped)
        first = _first_line(node)
        lines = [line.rstrip("\r\n") for line in self.new.lines[first - 1 : node.end_lineno]]
        for line, start, end, value in sorted(replacements, reverse=True):
            text = lines[line - first]
            lines[line - first] = text[:start] + value + text[end:]
        return "\n".join(lines), missing, late

    def _indented(self, node: ast.stmt, text: str, indent: str) -> str:
        """``text`` (today's ``node``) re-indented to ``indent``, in the old file's line
        endings, ending with one."""
        new_indent = self.new.indent(node.lineno)
        protected = _string_lines(node)
        out = []
        for number, piece in enumerate(text.split("\n"), start=_first_line(node)):
            if number not in protected and piece.startswith(new_indent):
                piece = indent + piece[len(new_indent) :]
            out.append(piece if piece.strip() or number in protected else "")
        return self.newline.join(out) + self.newline

    # Today's classes the old version lacks (a whole new callback class): carried with the
    # statement that creates it, when that statement is new and can be placed.

    def _new_class_of(self, unit: _Unit) -> ast.ClassDef | None:
        """The module-level class of today's file holding the unit, if the old version has
        no class of that name and binds the name to nothing else."""
        outermost: ast.AST = unit.root
        for node, _ in self.new.ancestors(unit.root):
            if node is self.new.tree:
                break
            outermost = node
        if not isinstance(outermost, ast.ClassDef) or self._old_class(outermost) is not None:
            return None
        return None if outermost.name in self.carry.old_taken else outermost

    def _carry_class(self, cls: ast.ClassDef, logs: list[LogStatement]) -> list[_Outcome] | str:
        """Today's class inserted whole before the old module-level statement where the one
        statement creating it goes, and that statement; or the reason they cannot go."""
        what = f"it sits in today's class `{cls.name}` (line {cls.lineno} of the new version)"
        uses: dict[int, ast.stmt] = {}
        for node in ast.walk(self.new.tree):
            if not (isinstance(node, ast.Name) and node.id == cls.name):
                continue
            if not isinstance(node.ctx, ast.Load) or _inside_node(self.new, node, cls):
                continue
            statement = next(n for n, _ in self.new.ancestors(node) if isinstance(n, ast.stmt))
            uses[id(statement)] = statement
        self._classes.add(cls.name)
        used = self._use(what, "class", list(uses.values()), logs)
        if isinstance(used, str):
            self._classes.discard(cls.name)
            return used
        outcome, spot = used
        top = self._class_spot(cls, self._top_level(spot.stmt))
        where = f"before line {_first_line(top)} `{self.old.snippet(top)}`"
        body, missing, late = self._definition_text(cls, top)
        if missing or late:
            self._classes.discard(cls.name)
            return (
                f"the old version {_lacks(missing, late, ('', []))}, which today's class "
                f"`{cls.name}` reads (it would go {where})"
            )
        inserted = self._indented(cls, body, "") + self.newline * 2
        anchor = f"in today's class `{cls.name}`, carried {where}, created {outcome.anchor}"
        line = _first_line(top) - 1
        index = next(i for i, stmt in enumerate(self.old.tree.body) if stmt is top)
        previous = self.old.tree.body[index - 1] if index else None
        floor = (previous.end_lineno or previous.lineno) if previous else 0
        while line > floor and self.old.lines[line - 1].strip().startswith("#"):
            line -= 1  # keep a comment that introduces the statement next to it
        made = _Edit(line, None, inserted, inserted.strip())
        return [
            _Outcome(
                _Unit(cls, logs),
                inserted.strip(),
                anchor,
                made,
                module_level=True,
                origin=_first_line(cls),
                carried_class=(cls.name, outcome.statement),
            ),
            outcome,
        ]

    def _class_spot(self, cls: ast.ClassDef, last: ast.stmt) -> ast.stmt:
        """The old module-level statement a carried class goes before: the one following
        the old counterpart of the nearest module-level statement preceding the class
        today, where that is no later than ``last`` (holding the statement creating it)."""
        body = self.new.tree.body
        old_body = self.old.tree.body
        for position in range(body.index(cls) - 1, -1, -1):
            node = self.align.new.of.get(id(body[position]))
            match = node.partner if node is not None else None
            found = [
                i for i, stmt in enumerate(old_body) if match is not None and stmt is match.ast
            ]
            if not found:
                continue
            following = found[0] + 1
            if following < len(old_body) and old_body[following].lineno <= last.lineno:
                return old_body[following]
            break
        return last

    def _use(
        self, what: str, kind: str, uses: list[ast.stmt], logs: list[LogStatement]
    ) -> tuple[_Outcome, _Spot] | str:
        """The one statement of today's file that creates a carried class or uses a
        carried method, placed like a requested statement; or why it cannot be."""
        verb = "creates" if kind == "class" else "uses"
        if not uses:
            return (
                f"{what}, which the old version lacks, and today's version never {verb} it, so "
                "carrying it would not run it"
            )
        if len(uses) > 1:
            shown = ", ".join(
                f"line {s.lineno} `{self.new.snippet(s)}`" for s in sorted(uses, key=_first_line)
            )
            return (
                f"{what}, which the old version lacks; today's version {verb} it in {shown}: "
                f"add the {kind} and those lines to the old version by hand"
            )
        (use,) = uses
        # In full: the user is to write this line into the old version.
        shown = f"line {use.lineno} `{' '.join(self.new.segment(use).split())}`"
        partner = self.align.new.of[id(use)].partner
        if partner is not None or not _is_simple(use):
            if partner is not None and isinstance(partner.ast, ast.stmt):
                written = " ".join(self.old.segment(partner.ast).split())
                old_line = f"line {partner.ast.lineno} `{written}`"
                why = f"whose counterpart in the old version, {old_line}, does not"
            else:
                why = "a block that would bring other code with it"
            return (
                f"{what}, which the old version lacks; today's version {verb} it in {shown}, "
                f"{why}; propagation only inserts lines and changes none: add the {kind} and "
                "that line to the old version by hand"
            )
        spot = self._spot(use)
        if isinstance(spot, str):
            return f"{what}, which the old version lacks; {shown}, which {verb} it: {spot}"
        owner = self.old.parents[id(spot.stmt)][0]
        anchor = self._describe(spot, owner)
        unit = _Unit(use, logs)
        text = self._text(unit, spot, anchor)
        if isinstance(text, Unplaceable):
            return f"{what}, which the old version lacks; {shown}, which {verb} it: {text.reason}"
        edit = self._edit(unit, text, spot)
        if isinstance(edit, str):
            return f"{what}, which the old version lacks; {shown}, which {verb} it: {edit}"
        return _Outcome(
            None, edit.statement, anchor, edit, module_level=owner is self.old.tree
        ), spot


def _names(node: ast.AST, name: str, inside: bool = True) -> bool:
    """Whether ``node`` is a reading of ``name`` or ``x.name``; with ``inside=False``,
    whether a statement holds one (not counting the blocks it holds)."""
    if inside:
        return isinstance(node, (ast.Name, ast.Attribute)) and (
            isinstance(node.ctx, ast.Load)
            and (node.id if isinstance(node, ast.Name) else node.attr) == name
        )
    stack = list(ast.iter_child_nodes(node))
    while stack:
        current = stack.pop()
        if isinstance(current, ast.stmt):
            continue
        if _names(current, name):
            return True
        stack.extend(ast.iter_child_nodes(current))
    return False


def _is_simple(stmt: ast.stmt) -> bool:
    """A statement without a block of its own."""
    return not any(
        isinstance(value, list) and value and isinstance(value[0], ast.stmt)
        for _, value in ast.iter_fields(stmt)
    )


def _inside_node(src: _Source, node: ast.AST, container: ast.AST) -> bool:
    return any(ancestor is container for ancestor, _ in src.ancestors(node))


def _method_named(cls: ast.ClassDef, name: str) -> ast.stmt | None:
    """The method ``name`` defined directly in a class body, if any."""
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return stmt
    return None


def _definition_reads(
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
) -> Iterator[tuple[ast.Name, bool]]:
    """The names a method or class reads from outside it, each with whether it is read
    when it is defined (decorators, bases, defaults, annotations, a class body's own
    statements) rather than when a method runs."""
    for decorator in node.decorator_list:
        for name in _free_names(decorator):
            yield name, True
    if isinstance(node, ast.ClassDef):
        for part in [*node.bases, *node.keywords]:
            for name in _free_names(part):
                yield name, True
        local: frozenset[str] = frozenset()
        for statement in node.body:
            if isinstance(statement, _DEFS):
                yield from _definition_reads(statement)
            else:
                for name in _free_names(statement, local):
                    yield name, True
            local |= _stored(statement) | (
                {statement.name} if isinstance(statement, _DEFS) else set()
            )
        return
    for name in _free_names(node.args):
        yield name, True
    if node.returns is not None:
        for name in _free_names(node.returns):
            yield name, True
    arguments = node.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    local = frozenset(a.arg for a in [*every, arguments.vararg, arguments.kwarg] if a is not None)
    local |= _scopes_bound(node)
    for statement in node.body:
        for name in _free_names(statement, local):
            yield name, False


def _scopes_bound(method: ast.FunctionDef | ast.AsyncFunctionDef) -> frozenset[str]:
    """The names a function binds anywhere in its own body (its locals), but not those it
    declares ``global`` or ``nonlocal``."""
    bound = _scopes(ast.Module([method], [])).bindings.get(id(method), {})
    declared = {
        name
        for node in ast.walk(method)
        if isinstance(node, (ast.Global, ast.Nonlocal))
        for name in node.names
    }
    return frozenset(name for name in bound if name not in declared)


def _attributes_set(cls: ast.ClassDef) -> set[str]:
    """The attributes a class defines: its class-level names and the ``self.x = ...`` its
    methods assign (``self`` being each method's first parameter)."""
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, _DEFS):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= _self_stores(stmt)
    return names


def _self_name(method: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    positional = [*method.args.posonlyargs, *method.args.args]
    return positional[0].arg if positional else None


def _self_stores(method: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    me = _self_name(method)
    return {
        node.attr
        for node in ast.walk(method)
        if isinstance(node, ast.Attribute)
        and not isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == me
    }


def _attributes_lacking(
    method: ast.FunctionDef | ast.AsyncFunctionDef, new_class: ast.ClassDef, old_class: ast.ClassDef
) -> list[str]:
    """The ``self.x`` a carried method reads that today's class defines and the old one
    does not. Attributes neither defines come from a base class (a framework's
    ``self.trainer``, ``self.log``) and are taken to be there in both."""
    me = _self_name(method)
    if me is None or any(
        isinstance(d, ast.Name) and d.id == "staticmethod" for d in method.decorator_list
    ):
        return []
    read = [
        node.attr
        for node in ast.walk(method)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == me
    ]
    today = _attributes_set(new_class) - _self_stores(method) - {method.name}
    lacking = today - _attributes_set(old_class)
    return list(dict.fromkeys(name for name in read if name in lacking))
