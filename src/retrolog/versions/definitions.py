"""What defines a logged value: the lineage key of each ``rl.log`` name in a file.

A value logged under a name is defined by the statement that logs it and by
the code that statement calls or reads, not by the rest of the file. Its
*definition* is that code in a canonical form, and its *key* a hash of the
definition (after LIMA's lineage-keyed reuse: identical work has identical
keys, changed work a different one)::

    log('w_norm', weight_norm(net))              the statement, as ast.unparse prints it
    def weight_norm(model):                      each project function it calls,
        return sum(p.norm() for p in ...)        transitively, docstrings left out
    SCALE = 2.0                                  each module-level constant it reads

Formatting and comments do not change the key (the text is regenerated from
the syntax tree), nor does the spelling of ``log`` (``rl.log``,
``retrolog.log``, ``log``), nor where the statement sits (a statement moved
into ``main()`` keeps its key). Names bound to run state (a model, a loader,
a local variable) stay names: what they hold is the run's data, not part of
the definition. Names imported from a module of the project are followed into
that module when ``read`` can give its source; imports from libraries count by
their import line (``import torch``), not by the library's code.

Where the definition cannot be resolved statically, the key is made coarser
and says why (:attr:`Definition.coarse`): a name logged by a computed name, a
name no statement of the file logs (logged from another module), a ``from x
import *`` of a module it cannot read. A coarse key covers the whole file, so a
change anywhere in it counts as a change of the definition.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

__all__ = [
    "Binding",
    "Definition",
    "canonical",
    "definitions",
    "global_reads",
    "key_of",
    "module_bindings",
    "rename_globals",
]

# Lineage keys are short hashes of definitions: 64 bits tell apart any definitions a
# project will ever have, and stay readable in a table.
KEY_CHARS = 16
_BUILTINS = frozenset(dir(builtins)) | {"__file__", "__name__", "__builtins__"}
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DEFS = (*_FUNCTIONS, ast.ClassDef)
_SCOPE_NODES = (*_DEFS, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
# Module-level values simple enough to be part of a definition (SCALE = 2.0).
_CONSTANT_NODES = (
    ast.Constant,
    ast.UnaryOp,
    ast.BinOp,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.unaryop,
    ast.operator,
    ast.expr_context,
)
# How far calls are followed into a project's functions and modules.
_MAX_DEPENDENCIES = 200

Reader = Callable[[str], "str | None"]


@dataclass(frozen=True)
class Definition:
    """What defines the values a file logs under one name."""

    name: str
    key: str  # KEY_CHARS hex digits of a hash of ``text``
    text: str  # the canonical definition: statements, then dependencies
    lines: tuple[int, ...]  # where the file logs the name (empty for a coarse key)
    dependencies: tuple[str, ...] = ()  # the functions and constants it includes, by name
    coarse: str | None = None  # why the key covers more than the statement, if it does


def key_of(text: str) -> str:
    """The lineage key of a definition's canonical text."""
    return hashlib.blake2b(text.encode(), digest_size=KEY_CHARS // 2).hexdigest()


def definitions(
    source: str,
    names: Iterable[str] | None = None,
    *,
    filename: str = "<script>",
    read: Reader | None = None,
    rename: Mapping[str, str] | None = None,
) -> dict[str, Definition]:
    """The definition of each name ``source`` logs (or of ``names``).

    read: gives the source of a project module by its path relative to the
        file's directory (``"utils.py"``, ``"pkg/__init__.py"``), or None; without
        it imports are not followed.
    rename: names to write differently (an older version's ``net`` as today's
        ``model``; a definition propagation carried in under ``_retrolog_f`` as
        ``f``), so that a name that differs only in spelling does not change the key.
    Raises SyntaxError (or ValueError for NUL bytes) when the source does not parse.
    """
    module = _Module.parse(source, filename, read)
    wanted = list(dict.fromkeys(names)) if names is not None else module.logged_names()
    return {name: module.definition(name, dict(rename or {})) for name in wanted}


# -- one module ---------------------------------------------------------------------------


@dataclass
class Binding:
    """What a module-level name is bound to."""

    kind: str  # "def", "class", "import", "constant", "state"
    nodes: list[ast.stmt] = field(default_factory=list)
    module: str | None = None  # for an import: the module it comes from
    attribute: str | None = None  # for ``from m import a``: a


class _Module:
    def __init__(self, tree: ast.Module, source: str, filename: str, read: Reader | None):
        self.tree = tree
        self.source = source
        self.filename = filename
        self.read = read
        self.aliases, self.direct = _retrolog_names(tree)
        self.bindings: dict[str, Binding] = {}
        self.starred: list[str] = []  # modules imported with *
        self.methods: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self._index()
        self._imported: dict[str, _Module | None] = {}

    @classmethod
    def parse(cls, source: str, filename: str, read: Reader | None) -> _Module:
        return cls(ast.parse(source, filename=filename), source, filename, read)

    def _index(self) -> None:
        for stmt in _module_level(self.tree.body):
            if isinstance(stmt, _DEFS):
                kind = "class" if isinstance(stmt, ast.ClassDef) else "def"
                self.bindings[stmt.name] = Binding(kind, [stmt])
                if isinstance(stmt, ast.ClassDef):
                    for item in stmt.body:
                        if isinstance(item, _FUNCTIONS):
                            self.methods.setdefault(item.name, []).append(item)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    module = alias.name if alias.asname else alias.name.split(".")[0]
                    self.bindings[bound] = Binding("import", [stmt], module=module)
            elif isinstance(stmt, ast.ImportFrom):
                module = "." * stmt.level + (stmt.module or "")
                for alias in stmt.names:
                    if alias.name == "*":
                        self.starred.append(module)
                        continue
                    self.bindings[alias.asname or alias.name] = Binding(
                        "import", [stmt], module=module, attribute=alias.name
                    )
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                constant = stmt.value is not None and _is_constant(stmt.value)
                for target in targets:
                    for name in _stored_names(target):
                        previous = self.bindings.get(name)
                        if previous is not None and previous.kind == "constant" and constant:
                            previous.nodes.append(stmt)  # SCALE = 2; SCALE *= 3
                        else:
                            kind = (
                                "constant" if constant and isinstance(target, ast.Name) else "state"
                            )
                            self.bindings[name] = Binding(kind, [stmt])
            else:
                for node in ast.walk(stmt):  # for-loop targets, with-targets, walrus...
                    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                        self.bindings.setdefault(node.id, Binding("state"))

    # .. the logged names

    def log_calls(self) -> Iterator[tuple[str | None, ast.Call, list[ast.AST]]]:
        """Each log call with its literal name (None when computed) and enclosing scopes."""
        stack: list[tuple[ast.AST, list[ast.AST]]] = [(self.tree, [])]
        while stack:
            node, scopes = stack.pop()
            if isinstance(node, ast.Call) and self._is_log(node):
                yield _literal_name(node), node, scopes
            inner = [*scopes, node] if isinstance(node, _SCOPE_NODES) else scopes
            for child in ast.iter_child_nodes(node):
                stack.append((child, inner))

    def _is_log(self, call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            return func.attr == "log" and func.value.id in self.aliases
        return isinstance(func, ast.Name) and self.direct.get(func.id) == "log"

    def logged_names(self) -> list[str]:
        found = sorted(
            (call.lineno, call.col_offset, name)
            for name, call, _ in self.log_calls()
            if name is not None
        )
        return list(dict.fromkeys(name for *_, name in found))

    def definition(self, name: str, rename: dict[str, str]) -> Definition:
        calls = sorted(
            ((call, scopes) for logged, call, scopes in self.log_calls() if logged == name),
            key=lambda item: (item[0].lineno, item[0].col_offset),
        )
        computed = any(logged is None for logged, _, _ in self.log_calls())
        if not calls:
            why = f"no statement of {self.filename} logs {name!r} by that literal name"
            if computed:
                why += " (it logs names it computes)"
            return self._coarse(name, why)
        resolver = _Resolver(self, rename)
        parts = []
        for call, scopes in calls:
            value = _value_of(call)
            if value is None:
                parts.append(f"log({name!r})")
                continue
            parts.append(f"log({name!r}, {resolver.expression(value, scopes)})")
        text = "\n".join(parts)
        if resolver.dependencies:
            text += "\n\n" + "\n\n".join(resolver.dependencies.values())
        if resolver.unresolved:
            why = "; ".join(resolver.unresolved)
            return self._coarse(name, why, lines=tuple(call.lineno for call, _ in calls))
        return Definition(
            name,
            key_of(text),
            text,
            tuple(call.lineno for call, _ in calls),
            tuple(resolver.dependencies),
        )

    def _coarse(self, name: str, why: str, lines: tuple[int, ...] = ()) -> Definition:
        text = f"file {self.filename}\n{ast.dump(self.tree)}"
        return Definition(name, key_of(text), text, lines, (), f"{why}: keyed by the whole file")

    # .. imported project modules

    def imported(self, module: str) -> _Module | None:
        """The project module ``module`` names, parsed, if ``read`` has it."""
        if module in self._imported:
            return self._imported[module]
        found = None
        if self.read is not None and module and not module.startswith("."):
            path = module.replace(".", "/")
            for candidate in (f"{path}.py", f"{path}/__init__.py"):
                text = self.read(candidate)
                if text is None:
                    continue
                try:
                    found = _Module.parse(text, candidate, self.read)
                except (SyntaxError, ValueError):
                    found = None
                break
        self._imported[module] = found
        return found


class _Resolver:
    """Writes a statement's value canonically and collects what it depends on."""

    def __init__(self, module: _Module, rename: dict[str, str]) -> None:
        self.module = module
        self.rename = rename
        self.dependencies: dict[str, str] = {}  # qualified name -> canonical source
        self.unresolved: list[str] = []
        self._seen: set[str] = set()

    def expression(self, value: ast.expr, scopes: list[ast.AST]) -> str:
        local = _locals_of(scopes)
        for name in _loads(value):
            if name.id not in local:
                self._resolve(self.module, name.id)
        for sub in ast.walk(value):
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load):
                self._method(self.module, sub.attr)
        return ast.unparse(_renamed(value, self.rename))

    def _resolve(self, module: _Module, name: str) -> None:
        qualified = name if module is self.module else f"{module.filename}:{name}"
        if qualified in self._seen or (name in _BUILTINS and name not in module.bindings):
            return
        self._seen.add(qualified)
        if len(self._seen) > _MAX_DEPENDENCIES:
            self.unresolved.append(f"more than {_MAX_DEPENDENCIES} functions to follow")
            return
        binding = module.bindings.get(name)
        if binding is None:
            if module.starred:
                for starred in module.starred:
                    other = module.imported(starred)
                    if other is not None and name in other.bindings:
                        self._resolve(other, name)
                        return
                self.unresolved.append(
                    f"{name!r} may come from `from {module.starred[0]} import *`, which "
                    "cannot be read"
                )
            return  # not bound anywhere: a NameError at run time, not a definition
        if binding.kind == "state":
            return  # a model, a loader: the run's data
        if binding.kind == "import":
            self._import(module, binding, qualified)
            return
        shown = self.rename.get(qualified, qualified)
        if binding.kind == "constant":
            self.dependencies[shown] = "\n".join(
                ast.unparse(rename_globals(stmt, self.rename)) for stmt in binding.nodes
            )
            return
        (definition,) = binding.nodes
        assert isinstance(definition, _DEFS)
        self.dependencies[shown] = canonical(rename_globals(definition, self.rename))
        self._follow(module, definition)

    def _follow(self, module: _Module, definition: ast.AST) -> None:
        """The module-level names a function or class body reads, and the methods it calls."""
        inner = _locals_of([definition]) if isinstance(definition, _FUNCTIONS) else set()
        for node in ast.walk(definition):
            if isinstance(node, _SCOPE_NODES) and node is not definition:
                inner |= _locals_of([node])
        for node in ast.walk(definition):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id not in inner:
                    self._resolve(module, node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                self._method(module, node.attr)

    def _method(self, module: _Module, attribute: str) -> None:
        """``obj.norm()`` on an object of unknown type: the module's methods of that name."""
        for method in module.methods.get(attribute, []):
            qualified = f"{module.filename}:method {attribute}@{method.lineno}"
            if qualified in self._seen:
                continue
            self._seen.add(qualified)
            self.dependencies[qualified] = ast.unparse(_without_docstrings(method))
            self._follow(module, method)

    def _import(self, module: _Module, binding: Binding, qualified: str) -> None:
        (statement,) = binding.nodes[:1]
        other = module.imported(binding.module or "")
        if other is None:
            # A library, or a module it cannot read: the import line is what defines it.
            self.dependencies[qualified] = ast.unparse(statement)
            return
        if binding.attribute is not None:
            self._resolve(other, binding.attribute)
        else:
            self.dependencies[qualified] = ast.unparse(statement)


# -- for propagation: carrying today's definitions into an old version ---------------------


def module_bindings(tree: ast.Module) -> dict[str, Binding]:
    """What each module-level name is bound to: a def, a class, an import, a constant, state."""
    return _Module(tree, "", "<module>", None).bindings


def canonical(node: ast.AST) -> str:
    """A def, class or statement as its definition text (unparsed, without docstrings)."""
    return ast.unparse(_without_docstrings(node))


def global_reads(node: ast.AST) -> set[str]:
    """The names a module-level def, class or statement reads from the module's scope."""
    if isinstance(node, _DEFS):
        inner = _locals_of([node]) if isinstance(node, _FUNCTIONS) else set()
        for sub in ast.walk(node):
            if isinstance(sub, _SCOPE_NODES) and sub is not node:
                inner |= _locals_of([sub])
        found = {
            sub.id
            for sub in ast.walk(node)
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in inner
        }
        return found - {node.name}
    value = getattr(node, "value", None)
    return {name.id for name in _loads(value)} if isinstance(value, ast.AST) else set()


def rename_globals(node: ast.AST, mapping: Mapping[str, str]) -> ast.AST:
    """A copy of a module-level def, class or statement with module names renamed.

    Only names read from (or, for the def itself, bound in) the module's scope
    change; a parameter or local of the same name stays.
    """
    import copy

    node = copy.deepcopy(node)
    reads = global_reads(node)
    if isinstance(node, _DEFS):
        reads.add(node.name)  # a recursive call
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in mapping and sub.id in reads:
            sub.id = mapping[sub.id]
    if isinstance(node, _DEFS) and node.name in mapping:
        node.name = mapping[node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name) and sub.id in mapping:
                    sub.id = mapping[sub.id]
    return node


# -- helpers ------------------------------------------------------------------------------


def _retrolog_names(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    aliases: set[str] = set()
    direct: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "retrolog":
                    aliases.add(alias.asname or "retrolog")
        elif isinstance(node, ast.ImportFrom) and node.module == "retrolog" and node.level == 0:
            for alias in node.names:
                if alias.name in ("log", "*"):
                    direct[alias.asname or "log"] = "log"
    if not aliases and not direct:
        aliases = {"rl", "retrolog"}  # a snippet that never imports retrolog
    return aliases, direct


def _literal_name(call: ast.Call) -> str | None:
    arg: ast.expr | None = call.args[0] if call.args else None
    if arg is None:
        arg = next((k.value for k in call.keywords if k.arg == "name"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _value_of(call: ast.Call) -> ast.expr | None:
    if len(call.args) >= 2:
        return call.args[1]
    return next((k.value for k in call.keywords if k.arg == "value"), None)


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that bind module names: the body, and inside top-level if/try/with."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.AsyncWith)):
            for field_name in ("body", "orelse", "finalbody", "handlers"):
                for item in getattr(stmt, field_name, []):
                    if isinstance(item, ast.ExceptHandler):
                        yield from _module_level(item.body)
                    elif isinstance(item, ast.stmt):
                        yield from _module_level([item])


def _stored_names(target: ast.AST) -> Iterator[str]:
    for node in ast.walk(target):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            yield node.id


def _is_constant(value: ast.AST) -> bool:
    return all(isinstance(node, _CONSTANT_NODES) for node in ast.walk(value))


def _loads(node: ast.AST) -> Iterator[ast.Name]:
    """The names an expression reads, leaving out those its comprehensions and lambdas bind."""
    bound: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.comprehension):
            bound |= set(_stored_names(sub.target))
        elif isinstance(sub, ast.Lambda):
            arguments = sub.args
            every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            bound |= {a.arg for a in [*every, arguments.vararg, arguments.kwarg] if a is not None}
        elif isinstance(sub, ast.NamedExpr):
            bound |= set(_stored_names(sub.target))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in bound:
            yield sub


def _locals_of(scopes: list[ast.AST]) -> set[str]:
    """Names bound in the enclosing function scopes (parameters, assignments, loops...)."""
    names: set[str] = set()
    for scope in scopes:
        if isinstance(scope, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            for generator in scope.generators:
                names |= set(_stored_names(generator.target))
            continue
        if not isinstance(scope, (*_FUNCTIONS, ast.Lambda)):
            continue
        arguments = scope.args
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        names |= {a.arg for a in [*every, arguments.vararg, arguments.kwarg] if a is not None}
        body = scope.body if isinstance(scope.body, list) else [scope.body]
        globals_: set[str] = set()
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Global):
                    globals_ |= set(node.names)
                elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                    names.add(node.id)
                elif isinstance(node, _DEFS):
                    names.add(node.name)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names |= {a.asname or a.name.split(".")[0] for a in node.names}
        names -= globals_
    return names


def _renamed(node: ast.AST, rename: Mapping[str, str]) -> ast.AST:
    if not rename:
        return node

    class Rename(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.Name:
            return ast.copy_location(ast.Name(rename.get(name.id, name.id), name.ctx), name)

    import copy

    return Rename().visit(copy.deepcopy(node))


def _without_docstrings(node: ast.AST) -> ast.AST:
    """A copy of a def or class without docstrings: they do not change what it computes."""
    import copy

    node = copy.deepcopy(node)
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (
            isinstance(sub, _DEFS)
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            sub.body = body[1:] or [ast.Pass()]
    return node
