"""Reading a version of the file for propagation: how it refers to retrolog, the parse
with its parent index and exact source text, and the requested log statements (with the
new ``if``/``for``/``with`` blocks holding only them) that propagation copies."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from retrolog._replay._scopes import _DEFS, _OPERATORS
from retrolog._replay.propagate.explain import _unknown_names_message

# Compound statements copied whole when they hold nothing but requested log
# statements, as in ``if step % 100 == 0: rl.log("grad", g)``.
_COPYABLE = (ast.If, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor)
# Lines as Python's tokenizer sees them; str.splitlines also splits on form feeds.
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")
_BLANK = " \t\f"
# For a file that never imports retrolog (a snippet), as in replay/statements.py.
_DEFAULT_MODULES = ("rl", "retrolog")


@dataclass(frozen=True)
class LogStatement:
    """A statement that logs a literal name: ``rl.log("loss", v)`` or ``x = rl.log("x", v)``."""

    name: str
    line: int
    end_line: int
    source: str  # the statement's text as written
    loops: tuple[str, ...]  # lexically enclosing rl.loop names, outermost first


@dataclass
class _Api:
    """How one file refers to retrolog: module aliases, and names imported from it."""

    modules: list[str]
    functions: dict[str, str]  # local name -> retrolog function, e.g. {"log": "log"}
    imported: bool = True  # False: the file never imports retrolog; modules are a guess

    def reaches_log(self) -> bool:
        """True if the file imports retrolog in a way that reaches ``log``."""
        return self.imported and bool(
            self.modules or any(target == "log" for target in self.functions.values())
        )

    def function_of(self, node: ast.AST) -> str | None:
        """The retrolog function a call invokes (``rl.log(...)`` -> "log"), if any."""
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            return func.attr if func.value.id in self.modules else None
        return self.functions.get(func.id) if isinstance(func, ast.Name) else None


def _api_of(tree: ast.Module) -> _Api:
    api = _Api([], {})
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "retrolog" or (
                    alias.name.startswith("retrolog.") and alias.asname is None
                ):
                    api.modules.append(alias.asname or "retrolog")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "retrolog":
            for alias in node.names:
                if alias.name == "*":
                    api.functions.update(log="log", loop="loop")
                else:
                    api.functions[alias.asname or alias.name] = alias.name
    if not api.modules and not api.functions:
        api.modules.extend(_DEFAULT_MODULES)
        api.imported = False
    return api


@dataclass
class _Source:
    """One parsed version of the file and the indexes the passes need."""

    text: str
    lines: list[str]
    tree: ast.Module
    api: _Api
    parents: dict[int, tuple[ast.AST, str, int]]  # id(node) -> (parent, field, index)

    def col(self, lineno: int, byte_col: int) -> int:
        """A character column from ast's UTF-8 byte offset."""
        line = self.lines[lineno - 1]
        return byte_col if line.isascii() else len(line.encode()[:byte_col].decode())

    def offset_in(self, node: ast.AST, lineno: int, byte_col: int) -> int:
        """Where (lineno, byte_col) falls in the text of ``node`` (see :meth:`segment`)."""
        first, col, _, _ = _span(node)
        if lineno == first:
            return self.col(lineno, byte_col) - self.col(first, col)
        before = len(self.lines[first - 1]) - self.col(first, col)
        before += sum(len(line) for line in self.lines[first : lineno - 1])
        return before + self.col(lineno, byte_col)

    def segment(self, node: ast.AST) -> str:
        """The exact source text of a node."""
        first, col, last, end_col = _span(node)
        if first == last:
            return self.lines[first - 1][self.col(first, col) : self.col(last, end_col)]
        head = self.lines[first - 1][self.col(first, col) :]
        middle = "".join(self.lines[first : last - 1])
        return head + middle + self.lines[last - 1][: self.col(last, end_col)]

    def indent(self, lineno: int) -> str:
        line = self.lines[lineno - 1]
        return line[: len(line) - len(line.lstrip(_BLANK))]

    def starts_line(self, node: ast.stmt) -> bool:
        """True if nothing but indentation precedes the statement on its first line."""
        if getattr(node, "decorator_list", None):
            return True  # a decorator always starts its line
        return self.col(node.lineno, node.col_offset) == len(self.indent(node.lineno))

    def ancestors(self, node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
        """The node's ancestors, innermost first, each with the field leading down."""
        while (entry := self.parents.get(id(node))) is not None:
            node, field, _ = entry
            yield node, field

    def snippet(self, node: ast.stmt) -> str:
        text = self.segment(node).splitlines()[0].strip()
        return text if len(text) <= 50 else text[:49] + "…"


def _lines(text: str) -> list[str]:
    return _LINE.findall(text)


def _span(node: ast.AST) -> tuple[int, int, int, int]:
    lineno, col = getattr(node, "lineno", None), getattr(node, "col_offset", None)
    end, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if lineno is None or col is None or end is None or end_col is None:
        raise ValueError(f"{type(node).__name__} carries no position")
    return lineno, col, end, end_col


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", None) or []
    return min([node.lineno, *(d.lineno for d in decorators)])


def _parse(text: str, which: str) -> _Source:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:  # ValueError: source with null bytes
        raise ValueError(f"the {which} version does not parse: {exc}") from exc
    parents: dict[int, tuple[ast.AST, str, int]] = {}
    for node in ast.walk(tree):
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                for index, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        parents[id(item)] = (node, field, index)
            elif isinstance(value, ast.AST) and not isinstance(value, _OPERATORS):
                parents[id(value)] = (node, field, -1)
    return _Source(text, _lines(text), tree, _api_of(tree), parents)


def _literal_name(call: ast.Call) -> str | None:
    """The name a ``log``/``loop`` call is given as a string literal, if it is one."""
    arg = call.args[0] if call.args else None
    if arg is None:
        arg = next((k.value for k in call.keywords if k.arg == "name"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _log_call(stmt: ast.AST, api: _Api) -> ast.Call | None:
    """The ``log`` call a statement consists of (``rl.log(..)``, ``x = rl.log(..)``)."""
    if not isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign)):
        return None
    value = stmt.value
    return value if isinstance(value, ast.Call) and api.function_of(value) == "log" else None


def _loop_name(node: ast.AST, api: _Api) -> str | None:
    """The name of the ``rl.loop`` a for statement iterates over (also via ``enumerate``)."""
    if not isinstance(node, (ast.For, ast.AsyncFor)):
        return None
    for sub in ast.walk(node.iter):
        if isinstance(sub, ast.Call) and api.function_of(sub) == "loop":
            return _literal_name(sub)
    return None


def _requested(src: _Source, names: Sequence[str] | None) -> list[tuple[LogStatement, ast.stmt]]:
    """The log statements of ``src`` for ``names`` (all when None), in file order."""
    found: list[tuple[LogStatement, ast.stmt]] = []
    for node in ast.walk(src.tree):
        call = _log_call(node, src.api)
        name = _literal_name(call) if call is not None else None
        if name is None or not isinstance(node, ast.stmt):
            continue
        loops = [
            loop
            for parent, field in src.ancestors(node)
            if field == "body" and (loop := _loop_name(parent, src.api)) is not None
        ]
        statement = LogStatement(
            name, node.lineno, node.end_lineno or node.lineno, src.segment(node), tuple(loops[::-1])
        )
        found.append((statement, node))
    found.sort(key=lambda item: (item[0].line, item[1].col_offset))
    if names is None:
        return found
    logged = {statement.name for statement, _ in found}
    missing = [name for name in dict.fromkeys(names) if name not in logged]
    if missing:
        raise ValueError(_unknown_names_message(missing, logged))
    wanted = set(names)
    return [item for item in found if item[0].name in wanted]


@dataclass
class _Unit:
    """What gets copied: a log statement, or a new ``if``/``for``/``with`` holding only them."""

    root: ast.stmt
    logs: list[LogStatement]


def _units(new: _Source, found: list[tuple[LogStatement, ast.stmt]]) -> list[_Unit]:
    requested = {id(node) for _, node in found}

    def only_requested(block: ast.stmt) -> bool:
        return all(
            id(s) in requested or isinstance(s, _COPYABLE)
            for s in ast.walk(block)
            if isinstance(s, ast.stmt) and s is not block
        )

    units: dict[int, _Unit] = {}
    for statement, node in found:
        root: ast.stmt = node
        for parent, _ in new.ancestors(node):
            if not isinstance(parent, _COPYABLE) or _loop_name(parent, new.api) is not None:
                break
            if not only_requested(parent):
                break
            root = parent
        units.setdefault(id(root), _Unit(root, [])).logs.append(statement)
    return list(units.values())


def _must_stay_first(stmt: ast.stmt, index: int, owner: ast.AST) -> bool:
    if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
        return True
    is_docstring = (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )
    return index == 0 and is_docstring and isinstance(owner, (ast.Module, *_DEFS))
