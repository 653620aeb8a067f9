"""Insert log statements from the newest version of a script into an older version.

A user adds ``rl.log("w_norm", weight_norm(net))`` to today's train.py and asks
for its values in runs recorded weeks ago. Each run replays in its own code
version, so the statement must go into the *old* file at the place that
corresponds to where it sits in the new one. :func:`propagate` does that:

1. find the requested statements in the new file (:func:`find_log_statements`);
2. align the two syntax trees GumTree-style (Falleri et al., "Fine-grained and
   accurate source code differencing", ASE 2014): ``rl.loop("name", ...)``
   loops first, as anchors; then identical subtrees top-down, largest first;
   then statements and blocks bottom-up by their share of matched descendants;
   then a recovery pass inside matched blocks; with additions for loops that
   moved, changed wrappers or predate ``rl.loop`` (see _align.py);
3. insert each statement after the old counterpart of its nearest matched
   preceding sibling (else before the following one, else at the start of the
   counterpart block), refusing where rewritten neighbours make that a guess; a
   statement in a method or class only today's version has (a framework's hook,
   a callback class) takes that method or class into the old version whole;
4. rename identifiers through the alignment (``model`` in the new file is
   ``net`` in the old one) and refuse, with a reason, when a name the statement
   reads is not defined at that point of the old file;
5. add ``import retrolog as rl`` to an old file from before retrolog was
   adopted, which never imported it.

The trees are the standard library's :mod:`ast`: edits are whole lines inserted
at statement boundaries, so everything else in the old file (comments,
formatting, line endings) stays byte-identical without a concrete syntax tree.
Step 2 lives in _align.py, the scope analysis behind step 4 in _scopes.py; this
module reads the versions, places, renames and edits. See docs/propagation.md
for the rules and a table of cases.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from retrolog._replay._align import MIN_DICE as MIN_DICE
from retrolog._replay._align import MIN_HEIGHT as MIN_HEIGHT
from retrolog._replay._align import MIN_SIMILARITY as MIN_SIMILARITY
from retrolog._replay._align import _Alignment, _inside, _Node, _Tree
from retrolog._replay._scopes import (
    _BUILTINS as _BUILTIN_NAMES,
)
from retrolog._replay._scopes import (
    _DEFS,
    _OPERATORS,
    _SCOPES,
    _free_names,
    _scopes,
    _stored,
)
from retrolog.versions.definitions import (
    Binding,
    canonical,
    global_reads,
    module_bindings,
    rename_globals,
)

__all__ = [
    "AddedImport",
    "LogStatement",
    "Placement",
    "Propagation",
    "Unplaceable",
    "find_log_statements",
    "propagate",
    "renames",
]

# Compound statements copied whole when they hold nothing but requested log
# statements, as in ``if step % 100 == 0: rl.log("grad", g)``.
_COPYABLE = (ast.If, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor)
# Lines as Python's tokenizer sees them; str.splitlines also splits on form feeds.
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")
_BLANK = " \t\f"
# For a file that never imports retrolog (a snippet), as in replay/statements.py.
_DEFAULT_MODULES = ("rl", "retrolog")
_T = TypeVar("_T")


@dataclass(frozen=True)
class LogStatement:
    """A statement that logs a literal name: ``rl.log("loss", v)`` or ``x = rl.log("x", v)``."""

    name: str
    line: int
    end_line: int
    source: str  # the statement's text as written
    loops: tuple[str, ...]  # lexically enclosing rl.loop names, outermost first


@dataclass(frozen=True)
class Placement:
    """A requested statement that now sits in the propagated old file."""

    name: str  # the log name
    statement: str  # the statement's source as inserted (identifiers mapped)
    line: int  # 1-based line in the propagated old file where it now sits
    anchor: str  # where, in the old file's own line numbers


@dataclass(frozen=True)
class Unplaceable:
    """A requested statement that could not be put into the old file, and why.

    The reason names the statement (as written in the new file, with its line there) and
    what the old version lacks.
    """

    name: str
    reason: str


@dataclass(frozen=True)
class AddedImport:
    """The retrolog import propagation added to an old file that did not import it."""

    statement: str  # e.g. ``import retrolog as rl``
    line: int  # 1-based line in the propagated file


@dataclass(frozen=True)
class Propagation:
    """The old file with the requested statements inserted, and what happened to each."""

    source: str
    placements: tuple[Placement, ...]
    problems: tuple[Unplaceable, ...]
    # Set when the old version never imported retrolog (history from before it was adopted):
    # the statements need ``log``, so the import went in with them.
    added_import: AddedImport | None = None
    # Today's functions, classes, constants and imports the statements use, put into the
    # old file because it lacks them or has them otherwise: (today's name, name there).
    carried: tuple[tuple[str, str], ...] = ()
    # Today's methods that hold placed statements, put whole into the old version's class
    # because it lacks them (a new callback hook): (class name there, method name).
    methods: tuple[tuple[str, str], ...] = ()
    # Today's classes that hold placed statements, put whole into the old version because it
    # lacks them, with the statement creating each, inserted too: (class name, statement).
    classes: tuple[tuple[str, str], ...] = ()

    def diff(self, old_source: str, filename: str) -> str:
        """Unified diff from the old file to the propagated one."""
        return "".join(
            difflib.unified_diff(
                _lines(old_source),
                _lines(self.source),
                fromfile=f"a/{filename}",
                tofile=f"b/{filename}",
            )
        )


def find_log_statements(
    source: str, names: Sequence[str] | None = None
) -> dict[str, list[LogStatement]]:
    """Which statements of ``source`` log which literal names.

    names: the names asked for; None means every name the file logs.

    Returns, per name (in the order asked, else in order of first appearance),
    its statements ordered by line. Raises ValueError when the source does not
    parse or a requested name is not logged by any statement.
    """
    found = _requested(_parse(source, "new"), names)
    result: dict[str, list[LogStatement]] = {}
    for statement, _ in found:
        result.setdefault(statement.name, []).append(statement)
    if names is None:
        return result
    return {name: result[name] for name in dict.fromkeys(names)}


def propagate(new_source: str, old_source: str, names: Sequence[str]) -> Propagation:
    """Insert the statements of ``new_source`` that log ``names`` into ``old_source``.

    Each statement goes to the place aligned with where it sits in the new file,
    with identifiers renamed to the old file's. A statement that cannot be placed
    without guessing is left out and reported in ``problems``; one the old file
    already has at that place is reported as placed, at its existing line.
    Raises ValueError when the new source does not parse or does not log a name.
    """
    new = _parse(new_source, "new")
    found = _requested(new, names)
    try:
        old = _parse(old_source, "old")
    except ValueError as exc:
        problems = tuple(Unplaceable(s.name, str(exc)) for s, _ in found)
        return Propagation(old_source, (), problems)
    return _Propagator(new, old, _units(new, found)).run()


def renames(new_source: str, old_source: str) -> dict[str, str]:
    """The old file's names for variables today's file calls otherwise (old -> new).

    As propagation reads them off the alignment (``net`` then, ``model`` now), for
    comparing an old statement's definition with today's. Empty when either file
    does not parse; a name two new names claim is left out.
    """
    try:
        new, old = _parse(new_source, "new"), _parse(old_source, "old")
    except ValueError:
        return {}
    align = _Alignment(_Tree(new.tree, set()), _Tree(old.tree, set()))
    align.run(
        lambda node: _loop_name(node, new.api),
        lambda node: _loop_name(node, old.api),
        lambda call: new.api.function_of(call) == "loop",
        lambda call: old.api.function_of(call) == "loop",
    )
    scopes = _scopes(new.tree)
    mapping: dict[str, str] = {}
    claimed: set[str] = set()
    for (scope_id, name), counts in align.name_votes(scopes).items():
        best, count = counts.most_common(1)[0]
        if best == name or counts.get(name, 0) >= count:
            continue
        if best in scopes.bindings.get(scope_id, {}):
            continue  # today's file has both: two variables the alignment paired
        if best in mapping and mapping[best] != name:
            claimed.add(best)
        mapping[best] = name
    return {old_name: new_name for old_name, new_name in mapping.items() if old_name not in claimed}


# --- Reading a version -----------------------------------------------------------------


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


def _unknown_names_message(missing: list[str], logged: set[str]) -> str:
    asked = ", ".join(repr(name) for name in missing)
    if not logged:
        return f"The new version logs no {asked}; it has no rl.log() call with a literal name."
    known = ", ".join(sorted(logged))
    message = f"The new version logs no {asked}; the names it logs are: {known}."
    close = difflib.get_close_matches(missing[0], sorted(logged), n=1)
    return message + (f" Did you mean {close[0]!r}?" if close else "")


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


@dataclass
class _Spot:
    """Where a unit goes in the old file: after or before an old statement."""

    after: bool
    stmt: ast.stmt
    start_of: ast.AST | None = None  # the block's owner, when placed at a block start


@dataclass
class _Edit:
    """Text to insert: whole lines before old line ``line``, or a splice at ``col``."""

    line: int  # 0-based index into the old lines
    col: int | None  # character column of an in-line splice; None for whole lines
    text: str
    statement: str  # the unit's text as inserted, without the first line's indentation


@dataclass
class _Outcome:
    """A unit that is in the propagated file: inserted by ``edit``, or already there."""

    unit: _Unit | None  # None: the retrolog import
    statement: str
    anchor: str
    edit: _Edit | None = None  # None: the old file already has it
    existing_line: int = 0  # 0-based old line of the existing statement
    module_level: bool = False  # inserted into the module's own body
    # A carried method: the new file's line the inserted text starts at (its statements'
    # lines follow from it), and the class and method names.
    origin: int = 0
    method: tuple[str, str] | None = None
    carried_class: tuple[str, str] | None = None  # (name, the statement creating it)


@dataclass
class _Hook:
    """A method only today's version has, in a class the old version has: carried whole."""

    method: ast.FunctionDef | ast.AsyncFunctionDef
    new_class: ast.ClassDef
    old_class: ast.ClassDef
    units: list[_Unit]
    called: list[ast.stmt]  # today's statements naming it (calling it, passing it on)


@dataclass(frozen=True)
class _ImportPlan:
    """How an old file that never imported retrolog gets ``log``: the import and the callee."""

    statement: str  # ``import retrolog as rl``
    callee: str  # ``rl.log``
    name: str  # the name the import binds


class _Carry:
    """Today's definitions the requested statements use, and which must go into the old file.

    A statement that calls today's ``weight_norm`` must compute with today's
    ``weight_norm`` in an old version too: otherwise a changed helper would leave
    the replayed values (and their lineage) the old definition's. A function,
    class, constant or import of today's module that the old module lacks, or
    binds to something else, goes in before the old module-level statement that
    holds the placement, under its own name when the old module does not bind
    that name, else under ``_retrolog_<name>`` (so the old code keeps calling its
    own). One that is the same in both (the same text, using the same things) is
    used as it is. What a carried definition reads besides other carried ones
    (``torch``, ``model``) must exist in the old module before that point.
    """

    _KINDS = ("def", "class", "constant", "import")

    def __init__(self, new: _Source, old: _Source, old_scopes: Any) -> None:
        self.new, self.old, self.old_scopes = new, old, old_scopes
        self.new_bindings = {
            name: b for name, b in module_bindings(new.tree).items() if b.kind in self._KINDS
        }
        self.old_bindings = module_bindings(old.tree)
        self.old_taken = {n for table in old_scopes.bindings.values() for n in table} | {
            n.id for n in ast.walk(old.tree) if isinstance(n, ast.Name)
        }
        self._decided: dict[str, bool] = {}
        self._aliases: dict[str, str] = {}
        self.needed: set[str] = set()
        self.before: ast.stmt | None = None  # the earliest old top-level statement served

    def use(self, name: str, top: ast.stmt) -> str | list[str] | None:
        """The name today's ``name`` has in the old file once carried, None when the old
        file's own is the same, or what is missing for it (a list of phrases)."""
        if not self._carried(name, set()):
            return None
        missing = self._check(name, top, set())
        if missing:
            return missing
        self._need(name)
        if self.before is None or top.lineno < self.before.lineno:
            self.before = top
        return self.alias(name)

    def _carried(self, name: str, visiting: set[str]) -> bool:
        if name in self._decided:
            return self._decided[name]
        if name in visiting:
            return False  # a cycle decides nothing more
        visiting.add(name)
        new, old = self.new_bindings[name], self.old_bindings.get(name)
        if new.kind == "constant" and old is not None:
            # A module constant the old file binds is the run's configuration (a width, a
            # batch size), whatever today's value: the run computed with its own.
            self._decided[name] = False
            return False
        same = old is not None and old.kind == new.kind and self._text(new) == self._text(old)
        if same and new.kind != "import":
            same = not any(
                self._carried(dep, visiting) for dep in self._reads(new) if dep in self.new_bindings
            )
        self._decided[name] = not same
        return not same

    def _reads(self, binding: Binding) -> set[str]:
        found: set[str] = set()
        if binding.kind == "import":
            return found
        for node in binding.nodes:
            found |= global_reads(node)
        return found - _BUILTIN_NAMES

    def _text(self, binding: Binding) -> str:
        if binding.kind == "import":
            return repr((binding.module, binding.attribute))
        return "\n".join(canonical(node) for node in binding.nodes)

    def _check(self, name: str, top: ast.stmt, seen: set[str]) -> list[str]:
        """What a carried definition reads that the old module lacks at ``top``."""
        if name in seen:
            return []
        seen.add(name)
        missing = []
        for dep in sorted(self._reads(self.new_bindings[name])):
            if dep in self.new_bindings and self._carried(dep, set()):
                missing += self._check(dep, top, seen)
                continue
            state = self.old_scopes.lookup(dep, (top.lineno, 0), [self.old.tree])
            if state != "ok":
                missing.append(f"`{dep}` (today's `{name}` reads it)")
        return missing

    def _need(self, name: str) -> None:
        if name in self.needed:
            return
        self.needed.add(name)
        for dep in self._reads(self.new_bindings[name]):
            if dep in self.new_bindings and self._carried(dep, set()):
                self._need(dep)

    def alias(self, name: str) -> str:
        if name not in self._aliases:
            if name not in self.old_bindings and name not in self.old_taken:
                alias = name
            else:
                alias, counter = f"_retrolog_{name}", 1
                while alias in self.old_taken or alias in self._aliases.values():
                    counter += 1
                    alias = f"_retrolog_{name}{counter}"
            self._aliases[name] = alias
        return self._aliases[name]

    def state(self) -> tuple[set[str], ast.stmt | None]:
        """What is to be carried so far: to go back to when a placement is refused."""
        return set(self.needed), self.before

    def restore(self, state: tuple[set[str], ast.stmt | None]) -> None:
        self.needed, self.before = set(state[0]), state[1]

    def carried_names(self) -> tuple[tuple[str, str], ...]:
        return tuple((name, self.alias(name)) for name in sorted(self.needed))

    def outcome(self, newline: str) -> _Outcome | None:
        """The carried definitions as one insertion, in today's order, or None."""
        if not self.needed or self.before is None:
            return None
        mapping = {name: self.alias(name) for name in self.needed if self.alias(name) != name}
        items: list[tuple[int, str]] = []
        for name in self.needed:
            binding = self.new_bindings[name]
            for node in binding.nodes:
                items.append((node.lineno, self._definition(name, node, binding, mapping)))
        texts = list(dict.fromkeys(text for _, text in sorted(items)))
        body = (newline * 2).join(text.replace("\n", newline) for text in texts)
        text = "# today's definitions the replayed statements use (retrolog)" + newline
        text += body + newline + newline
        line = _first_line(self.before) - 1
        edit = _Edit(line, None, text, text.strip())
        return _Outcome(None, text.strip(), "at module level", edit, module_level=True)

    def _definition(
        self, name: str, node: ast.stmt, binding: Binding, mapping: dict[str, str]
    ) -> str:
        if binding.kind == "import":
            alias = self.alias(name)
            if binding.attribute is not None:
                module = binding.module or ""
                level = len(module) - len(module.lstrip("."))
                imported = ast.ImportFrom(
                    module.lstrip(".") or None, [ast.alias(binding.attribute, alias)], level
                )
                return ast.unparse(imported)
            module = binding.module or name
            return ast.unparse(ast.Import([ast.alias(module, None if alias == module else alias)]))
        if binding.kind in ("def", "class"):
            return canonical(rename_globals(node, mapping))
        return ast.unparse(rename_globals(node, mapping))


class _Propagator:
    """Places the units of one new version into one old version."""

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
        self.import_plan = None if old.api.reaches_log() else self._plan_import()
        self.carry = _Carry(new, old, self.old_scopes)
        self._classes: set[str] = set()  # today's classes carried whole (not by _Carry)

    def run(self) -> Propagation:
        outcomes: list[_Outcome] = []
        problems: list[Unplaceable] = []
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
        for logs, done in placed:
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
            added = self._import_outcome(outcomes)
            outcomes.insert(0, added)  # first among insertions at the same line
        source, lines = self._apply(outcomes)
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
        imported = AddedImport(added.statement, lines[id(added)]) if added is not None else None
        methods = tuple(o.method for o in outcomes if o.method is not None)
        made = tuple(o.carried_class for o in outcomes if o.carried_class is not None)
        return Propagation(
            source,
            tuple(placements),
            tuple(problems),
            imported,
            self.carry.carried_names(),
            methods,
            made,
        )

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

    # The retrolog import, for history from before retrolog was adopted.

    def _plan_import(self) -> _ImportPlan:
        """The import to add so that the old file reaches ``log``, spelled like the new file.

        A name the old file already binds in any scope (``rl = 0.1``, ``import rl``), or
        reads without binding it (it may come from ``from config import *``), is left
        alone: the import takes the next free one of ``retrolog``, ``_retrolog``, ...
        """
        taken = {name for table in self.old_scopes.bindings.values() for name in table}
        taken.update(n.id for n in ast.walk(self.old.tree) if isinstance(n, ast.Name))
        wanted: list[tuple[str, str, str]] = []  # (name, statement, callee)
        new_api = self.new.api
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

    def _import_outcome(self, outcomes: list[_Outcome]) -> _Outcome:
        """The import's edit: after the module's leading imports, before anything placed."""
        assert self.import_plan is not None
        body = self.old.tree.body
        leading = 0
        while leading < len(body) and (
            isinstance(body[leading], (ast.Import, ast.ImportFrom))
            or _must_stay_first(body[leading], leading, self.old.tree)
        ):
            leading += 1
        if leading:
            last = body[leading - 1]
            line = last.end_lineno or last.lineno
        else:
            # Before the first statement itself, not above the comments leading to it: the
            # first lines may be a shebang or an encoding declaration.
            line = _first_line(body[0]) - 1 if body else len(self.old.lines)
        for outcome in outcomes:
            if outcome.module_level and outcome.edit is not None:
                line = min(line, outcome.edit.line)  # a statement placed among the imports
        text = self.import_plan.statement
        edit = _Edit(line, None, text + self.newline, text)
        return _Outcome(None, text, "at module level", edit, module_level=True)

    # Today's methods the old version's classes lack (a new callback hook): carried whole.

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
        if old_class.body[0].lineno == old_class.lineno:
            return (
                f"it sits in today's method `{method.name}`, which the old version's class "
                f"`{old_class.name}` (line {old_class.lineno}) lacks, and that class is written "
                "on one line, so the method cannot be added to it"
            )
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
        first = _first_line(method)
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
        edit = _Edit(line, None, inserted, body.strip())
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

    # Where: the aligned spot in the old tree.

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

    def _spot(self, root: ast.stmt) -> _Spot | str:
        parent, field, index = self.new.parents[id(root)]
        siblings: list[ast.stmt] = getattr(parent, field)
        container = self.align.new.of[id(parent)].partner
        if container is None and not _is_transparent(parent):
            return (
                f"it sits in the {_describe_owner(parent, field)} at line "
                f"{getattr(parent, 'lineno', 0)} of the new version, which has no counterpart "
                "in the old version"
            )

        def counterpart(stmt: ast.stmt) -> ast.stmt | None:
            if id(stmt) in self.present:  # a requested statement the old file already has
                match: _Node | None = self.align.old.of[id(self.present[id(stmt)])]
            else:
                node = self.align.new.of.get(id(stmt))
                match = node.partner if node is not None else None
            if match is None or not isinstance(match.ast, ast.stmt):
                return None
            if container is not None and not _inside(match, container, field):
                return None  # mapped into some other block: no evidence for this one
            return match.ast

        def counterparts(stmt: ast.stmt) -> list[ast.stmt]:
            match = counterpart(stmt)
            if match is not None:
                return [match]
            if container is None:
                return []
            return self.align.stands_for(stmt, container, field, self.new_functions)

        for position in range(index - 1, -1, -1):
            if found := counterparts(siblings[position]):
                skipped = self._real(siblings[position + 1 : index])
                if skipped and self._unmapped_beside(found[-1], after=True):
                    return self._rewritten(skipped, found[-1], after=True)
                return _Spot(True, found[-1])
        for position in range(index + 1, len(siblings)):
            if found := counterparts(siblings[position]):
                skipped = self._real(siblings[index + 1 : position])
                if skipped and self._unmapped_beside(found[0], after=False):
                    return self._rewritten(skipped, found[0], after=False)
                return _Spot(False, found[0])
        if container is None:
            return (
                f"none of the statements around it in the {_describe_owner(parent, field)} "
                "exist in the old version"
            )
        if not all(id(sibling) in self.unit_roots for sibling in siblings[:index]):
            # Code precedes it in the new block and none of it is in the old one: the old
            # block may hold that code rewritten, so its start would be a guess.
            return (
                f"none of the statements around it in the {_describe_owner(parent, field)} "
                f"exist in the old version's {_describe_owner(container.ast, field)} at line "
                f"{getattr(container.ast, 'lineno', 0)}"
            )
        block = getattr(container.ast, field, None)
        if not block:
            return (
                f"the old version's {_describe_owner(container.ast, 'body')} at line "
                f"{getattr(container.ast, 'lineno', 0)} has no `{_FIELD_WORDS.get(field, field)}` "
                "block to put it in"
            )
        # A module docstring, a function docstring and __future__ imports must stay first.
        skip = 0
        while skip < len(block) and _must_stay_first(block[skip], skip, container.ast):
            skip += 1
        if skip:
            return _Spot(True, block[skip - 1], container.ast)
        return _Spot(False, block[0], container.ast)

    def _real(self, statements: list[ast.stmt]) -> list[ast.stmt]:
        """The statements that are not requested ones."""
        return [s for s in statements if id(s) not in self.unit_roots]

    def _unmapped_beside(self, stmt: ast.stmt, after: bool) -> bool:
        """True if the old statement next to ``stmt`` (after or before it) has no counterpart."""
        owner, field, index = self.old.parents[id(stmt)]
        block: list[ast.stmt] = getattr(owner, field)
        neighbour = index + 1 if after else index - 1
        if not 0 <= neighbour < len(block):
            return False
        return self.align.old.of[id(block[neighbour])].partner is None

    def _rewritten(self, skipped: list[ast.stmt], anchor: ast.stmt, after: bool) -> str:
        # New code stands between the statement and its anchor, and old code without a
        # counterpart stands next to the anchor: the one may be the other rewritten, and
        # then the statement belongs beyond it. Which, the alignment cannot tell.
        near = skipped[-1] if after else skipped[0]
        relation, side = ("follows", "followed") if after else ("precedes", "preceded")
        return (
            f"it {relation} line {near.lineno} `{self.new.snippet(near)}` of the new version, "
            f"which has no counterpart; in the old version line {anchor.lineno} "
            f"`{self.old.snippet(anchor)}` is {side} by code that has none either, and as "
            "the one may be the other rewritten, its place among them is not known"
        )

    def _describe(self, spot: _Spot, owner: ast.AST) -> str:
        if spot.start_of is not None and not spot.after:
            start = spot.start_of
            where = f"at the start of the block of line {getattr(start, 'lineno', 1)}"
            if isinstance(start, ast.stmt):
                where += f" `{self.old.snippet(start)}`"
        else:
            relation = "after" if spot.after else "before"
            where = f"{relation} line {spot.stmt.lineno} `{self.old.snippet(spot.stmt)}`"
        context = " at module level"
        for node in [owner, *(node for node, _ in self.old.ancestors(owner))]:
            loop = _loop_name(node, self.old.api)
            if loop is not None:
                context = f' in loop "{loop}"'
                break
            if isinstance(node, _DEFS):
                context = f" in function `{node.name}`"
                break
        return where + context

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


def _is_transparent(node: ast.AST) -> bool:
    """Containers code is commonly moved into: a function, or ``if __name__ == "__main__"``.

    A statement inside a new one of these is placed by its neighbours alone, so a
    train step extracted into ``def train_epoch()`` still finds its old place.
    """
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _must_stay_first(stmt: ast.stmt, index: int, owner: ast.AST) -> bool:
    if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
        return True
    is_docstring = (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )
    return index == 0 and is_docstring and isinstance(owner, (ast.Module, *_DEFS))


_FIELD_WORDS = {"orelse": "else", "finalbody": "finally", "handlers": "except", "body": "body"}
_KIND_WORDS = {
    "If": "`if` block",
    "For": "`for` loop",
    "AsyncFor": "`async for` loop",
    "While": "`while` loop",
    "With": "`with` block",
    "AsyncWith": "`async with` block",
    "Try": "`try` block",
    "TryStar": "`try` block",
    "ExceptHandler": "`except` clause",
    "match_case": "`case` clause",
    "Match": "`match` statement",
}


def _describe_owner(node: ast.AST, field: str) -> str:
    if isinstance(node, _DEFS):
        word = "class" if isinstance(node, ast.ClassDef) else "function"
        return f"{word} `{node.name}`"
    if isinstance(node, ast.Module):
        return "the module"
    kind = _KIND_WORDS.get(type(node).__name__, f"`{type(node).__name__}`")
    return kind if field == "body" else f"`{_FIELD_WORDS.get(field, field)}` part of the {kind}"


def _lacks(missing: list[str], late: list[str], sets: tuple[str, list[str]]) -> str:
    """What the old version lacks, as in "has no `x` and binds `y` only after the class"."""
    parts = [f"has no {_join(missing)}"] if missing else []
    if late:
        parts.append(f"binds {_join(late)} only after that point")
    if sets[1]:
        parts.append(f"sets no {_join(sets[1])} in {sets[0]}")
    return " and ".join(parts)


def _join(items: list[str]) -> str:
    unique = list(dict.fromkeys(items))
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " or " + unique[-1]
