"""Name scopes of a Python file: which names each scope binds, and which a statement reads.

Propagation (see propagate/) needs both to carry a log statement into an older
version of a file: the names a statement reads (:func:`_free_names`) are renamed
to the old file's, then each must be bound at the point where the statement goes
(:meth:`_Scopes.lookup`), or the statement is refused with that reason. Python's
rules as far as they matter here: functions, lambdas, classes and comprehensions
open scopes; decorators, defaults and bases run in the enclosing one; a class
body does not enclose its methods; ``from x import *`` may bind anything.
"""

from __future__ import annotations

import ast
import builtins
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_SCOPES = (ast.Module, *_DEFS, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
# Singletons in CPython's ast (one shared object per operator), so never nodes of their
# own: the alignment puts them into their parent's label instead (see _align.py).
_OPERATORS = (ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)
_BLOCK_ITEMS = (ast.stmt, ast.excepthandler, ast.match_case)
_BUILTINS = frozenset(dir(builtins)) | {"__file__", "__builtins__"}


@dataclass
class _Scopes:
    """Where each scope of a file binds each name: for the is-it-defined check and renames."""

    bindings: dict[int, dict[str, tuple[int, int]]]  # id(scope) -> name -> first binding
    starred: set[int]  # scopes with ``from x import *``: anything may be bound there
    scope_of: dict[int, ast.AST]  # id(Name or arg node) -> the scope it belongs to

    def lookup(self, name: str, point: tuple[int, int], chain: list[ast.AST]) -> str:
        """Whether ``name`` is bound at ``point``: "ok", "late" (only after it) or "missing".

        chain: the scopes enclosing the point, innermost first.
        """
        for depth, scope in enumerate(chain):
            if depth > 0 and isinstance(scope, ast.ClassDef):
                continue  # class bodies do not enclose their methods
            if id(scope) in self.starred:
                return "ok"  # ``import *`` can bind anything: nothing to check against
            bound = self.bindings.get(id(scope), {}).get(name)
            if bound is None:
                continue
            # In its own scope a name must be bound before the point (a local bound later
            # is an UnboundLocalError); enclosing scopes are complete by the time it runs.
            return "late" if depth == 0 and bound >= point else "ok"
        return "ok" if name in _BUILTINS else "missing"

    def old_name(
        self, name: str, chain: Sequence[ast.AST], votes: Mapping[tuple[int, str], Counter[str]]
    ) -> str:
        """The old file's name for a new name: the majority of its mapped occurrences.

        Asked of the new file's scopes. chain: the new statement's scopes, innermost
        first, ending with the module (votes from the innermost scope that has any
        win, else the module's). votes: per (scope, new name), the old names its
        occurrences are aligned with (``_Alignment.name_votes``).

        A rename is only believed when the new file no longer binds the old name in
        the scope that binds the new one: if that scope has both, they are two
        variables that the alignment merely paired.
        """
        for scope in (chain[0], chain[-1]):
            counts = votes.get((id(scope), name))
            if not counts:
                continue
            best, count = counts.most_common(1)[0]
            if counts.get(name, 0) >= count:
                return name
            tables = [self.bindings.get(id(s), {}) for s in chain]
            home = next((table for table in tables if name in table), tables[0])
            return name if best in home else best
        return name


def _scopes(tree: ast.Module) -> _Scopes:
    result = _Scopes({}, set(), {})
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        table = result.bindings.setdefault(id(scope), {})
        position = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))

        def bind(
            name: str, table: dict[str, tuple[int, int]] = table, at: tuple[int, int] = position
        ) -> None:
            if name not in table or at < table[name]:
                table[name] = at

        inner = node if isinstance(node, (*_DEFS, ast.Lambda, *_COMPREHENSIONS)) else scope
        if isinstance(node, _DEFS):
            bind(node.name)
        if isinstance(node, _FUNCTIONS):
            own = result.bindings.setdefault(id(node), {})
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            for arg in [*every, arguments.vararg, arguments.kwarg]:
                if arg is not None:
                    own.setdefault(arg.arg, position)
                    result.scope_of[id(arg)] = node
        if isinstance(node, ast.Name):
            result.scope_of[id(node)] = scope
            if not isinstance(node.ctx, ast.Load):
                bind(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    result.starred.add(id(scope))
                else:
                    bind(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bind(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bind(node.rest)
        for field, child in _children(node):
            # Decorators, defaults and bases run in the enclosing scope; bodies in their own.
            in_body = field == "body" or isinstance(node, _COMPREHENSIONS)
            stack.append((child, inner if in_body else scope))
    return result


def _free_names(node: ast.AST, bound: frozenset[str] = frozenset()) -> Iterator[ast.Name]:
    """The names a statement reads before binding them itself (in execution order)."""
    if isinstance(node, ast.Name):
        if isinstance(node.ctx, ast.Load) and node.id not in bound:
            yield node
        return
    if isinstance(node, ast.Lambda):
        arguments = node.args
        yield from _free_names(arguments, bound)
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        params = {a.arg for a in [*every, arguments.vararg, arguments.kwarg] if a is not None}
        yield from _free_names(node.body, bound | params)
        return
    if isinstance(node, _COMPREHENSIONS):
        inner = bound
        for generator in node.generators:
            yield from _free_names(generator.iter, inner)
            inner = inner | _stored(generator.target)
            for condition in generator.ifs:
                yield from _free_names(condition, inner)
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for part in parts:
            yield from _free_names(part, inner)
        return
    if isinstance(node, ast.ExceptHandler) and node.name:
        bound = bound | {node.name}
    fields = list(ast.iter_fields(node))
    blocks = [v for _, v in fields if isinstance(v, list) and v and isinstance(v[0], _BLOCK_ITEMS)]
    headers = [(f, v) for f, v in fields if not any(v is b for b in blocks)]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        headers.sort(key=lambda item: item[0] != "iter")  # ``for x in f(x)`` reads x first
    parts = [i for _, v in headers for i in (v if isinstance(v, list) else [v])]
    for part in parts:
        if isinstance(part, ast.AST):
            yield from _free_names(part, bound)
    if not blocks:
        return  # a simple statement binds its targets only after evaluating them
    for part in parts:
        if isinstance(part, ast.AST):
            bound = bound | _stored(part)
    for block in blocks:
        local = bound
        for statement in block:
            yield from _free_names(statement, local)
            local = local | _stored(statement)


def _stored(node: ast.AST) -> frozenset[str]:
    """The names a target (or a whole statement) binds."""
    return frozenset(
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
    )


def _children(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """A node's child nodes with the field each sits in, leaving out operator singletons."""
    for field, value in ast.iter_fields(node):
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, ast.AST) and not isinstance(item, _OPERATORS):
                yield field, item
