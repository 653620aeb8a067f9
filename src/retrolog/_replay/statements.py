"""Where requested log statements sit relative to a script's ``rl.loop`` calls.

Replay's scan level (docs/replay-planning.md) follows from where the requested
``rl.log`` statements sit in the newest code: before the first top-level loop,
after it, in an outer-loop iteration outside its nested loop, or inside the
nested loop. This module answers that from the syntax tree alone, without
running anything.

The analysis walks the module in execution order and follows calls to
functions defined in the same file (plain names, ``self.method()``,
``ClassName()`` and variables assigned from ``ClassName(...)``), so a statement
inside ``train_epoch()`` called from the epoch loop is placed where that call
is. Whenever a statement's place cannot be established it is reported as
:attr:`Position.INNER` with a note: that level executes everything, so the
value is still obtained, only slower. Every rule here errs on the deep side,
because a level that is too shallow would skip the code that logs the value.
"""

from __future__ import annotations

import ast
import difflib
import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from retrolog.errors import UnknownNameError, UsageError

# main() -> train() -> train_epoch() -> helper(): deep enough for training scripts,
# shallow enough that a file calling helpers everywhere is analysed in milliseconds.
MAX_CALL_DEPTH = 4
# Inlining re-walks a function at each call site; past this many visited nodes the
# file is treated as too complex and every statement is placed at INNER (safe).
_NODE_BUDGET = 500_000
# Conventional aliases, used only for a file that never imports retrolog (a snippet).
_DEFAULT_MODULE_ALIASES = frozenset({"rl", "retrolog"})


# Methods a training framework calls once per epoch, outside the epoch's steps (its
# evaluation, its epoch hooks), by name: transformers' TrainerCallback and Trainer,
# Lightning's Callback and LightningModule. The integrations open the epoch context
# around them and end the step loop (the block) before them (docs/integrations.md), so
# a statement there runs at the outer level. Called from the framework, they are never
# reached by this file's own calls.
EPOCH_HOOKS = frozenset(
    {
        # transformers
        "on_epoch_begin",
        "on_epoch_end",
        "on_evaluate",
        "compute_metrics",
        # Lightning
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_validation_start",
        "on_validation_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "validation_step",
    }
)


# Module-level functions a framework takes as arguments and calls once per evaluation.
EPOCH_FUNCTIONS = frozenset({"compute_metrics"})


class Position(enum.Enum):
    """Where a statement runs relative to the script's ``rl.loop`` calls."""

    PREFIX = "prefix"  # before the first top-level loop starts
    SUFFIX = "suffix"  # outside every loop, after a top-level loop
    OUTER = "outer"  # in an outer-loop iteration, outside its nested (block) loop
    INNER = "inner"  # inside the checkpointed block: the nested loop, or a whole iteration

    @property
    def depth(self) -> int:
        """Order from shallow to deep: a run's level is the deepest of its statements."""
        return _DEPTH[self]


_DEPTH = {Position.PREFIX: 0, Position.SUFFIX: 1, Position.OUTER: 2, Position.INNER: 3}


@dataclass(frozen=True)
class StatementSite:
    """One ``rl.log(name, ...)`` statement and where it runs."""

    name: str
    line: int
    position: Position
    loops: tuple[str, ...]  # enclosing loop names, outermost first (through calls too)
    note: str = ""  # how the place was found, e.g. "inside function f, called in loop 'epoch'"


def locate_statements(
    source: str, names: Sequence[str], filename: str = "<script>"
) -> dict[str, list[StatementSite]]:
    """Find each requested log statement in ``source`` and where it runs.

    names: the log names asked for; each must be logged by a statement whose
        first argument is that string literal.
    filename: used in error messages.

    Returns, per name in the order asked, its statements ordered by line (a
    name may be logged in several places). Raises UsageError when the source
    does not parse and UnknownNameError for a name the file never logs.
    """
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        where = f"line {exc.lineno}" if exc.lineno is not None else "an unknown line"
        raise UsageError(
            f"Cannot parse {filename}: {exc.msg} at {where}. Fix the syntax error, "
            "then ask for the values again."
        ) from exc
    except ValueError as exc:  # a NUL byte in the source (3.11 raises ValueError for it)
        raise UsageError(f"Cannot parse {filename}: {exc}.") from exc
    module = _Module(tree)
    _check_names(module, names, filename)
    walker = _Walker(module)
    try:
        walker.run(tree)
        complete = True
    except _TooComplex:
        complete = False
    result: dict[str, list[StatementSite]] = {}
    for name in dict.fromkeys(names):
        sites = []
        for call in module.log_calls_named(name):
            if complete:
                sites.append(_site(module, walker, name, call))
            else:
                sites.append(
                    StatementSite(
                        name,
                        call.lineno,
                        Position.INNER,
                        (),
                        "could not resolve: the file calls its functions in too many ways "
                        "to follow; every block is executed",
                    )
                )
        result[name] = sorted(sites, key=lambda s: s.line)
    return result


def _check_names(module: _Module, names: Sequence[str], filename: str) -> None:
    logged = sorted(module.logged_names())
    for name in names:
        if name in logged:
            continue
        if logged:
            known = f"the names it logs are: {', '.join(logged)}."
        else:
            known = "it has no rl.log statement with a literal name."
        close = difflib.get_close_matches(name, logged, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        dynamic = (
            f" ({module.dynamic_names} rl.log call(s) with a computed name cannot be matched.)"
            if module.dynamic_names
            else ""
        )
        raise UnknownNameError(
            f"{filename} has no rl.log({name!r}, ...) statement; {known}{hint}{dynamic} "
            "Add the statement to the newest code, then ask again.",
            name=name,
        )


# -- the module's functions, classes and retrolog calls ---------------------------------


@dataclass(eq=False)
class _Function:
    """A function or method defined in the module, with what its body does lexically."""

    node: ast.FunctionDef | ast.AsyncFunctionDef
    qualname: str
    cls: _Class | None  # the class it is a method of
    parent: _Function | None  # the enclosing function, for nested defs
    local_defs: dict[str, _Function] = field(default_factory=dict)
    calls: list[ast.Call] = field(default_factory=list)  # calls in its own body
    log_calls: list[ast.Call] = field(default_factory=list)
    has_loop: bool = False  # an rl.loop in its own body

    def method_scope(self) -> _Class | None:
        """The class whose ``self`` is visible here (nested defs see their method's)."""
        fn: _Function | None = self
        while fn is not None:
            if fn.cls is not None:
                return fn.cls
            fn = fn.parent
        return None


@dataclass(eq=False)
class _Class:
    node: ast.ClassDef
    methods: dict[str, _Function] = field(default_factory=dict)


class _Module:
    """An index of the module: retrolog aliases, definitions, log calls and loops."""

    def __init__(self, tree: ast.Module) -> None:
        self.module_aliases: set[str] = set()
        self.direct: dict[str, str] = {}  # local name -> retrolog function ("log", "loop")
        self._collect_imports(tree)
        self.functions: dict[str, _Function] = {}  # module-level functions
        self.classes: dict[str, _Class] = {}  # module-level classes
        self.all_functions: list[_Function] = []
        self.owner: dict[int, _Function | None] = {}  # id(log call) -> enclosing function
        self.in_lambda: set[int] = set()  # ids of log calls inside a lambda
        self.log_calls: list[tuple[str | None, ast.Call]] = []
        self.dynamic_names = 0
        self.drives_events = False  # the file calls rl.begin
        self._index_body(tree.body, owner=None, cls=None, in_lambda=False)
        self.instances = self._instance_classes(tree)
        self.escaping = self._escaping_functions(tree)

    # .. retrolog names

    def _collect_imports(self, tree: ast.Module) -> None:
        found = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "retrolog":
                        self.module_aliases.add(alias.asname or "retrolog")
                        found = True
            elif isinstance(node, ast.ImportFrom) and node.module == "retrolog":
                found = True
                for alias in node.names:
                    if alias.name in ("log", "loop", "begin"):
                        self.direct[alias.asname or alias.name] = alias.name
        if not found:
            self.module_aliases.update(_DEFAULT_MODULE_ALIASES)

    def api_call(self, node: ast.AST) -> str | None:
        """``"log"`` or ``"loop"`` when ``node`` calls that retrolog function, else None."""
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        if isinstance(func, ast.Name):
            return self.direct.get(func.id)
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in self.module_aliases
            and func.attr in ("log", "loop", "begin")
        ):
            return func.attr
        return None

    def loop_name(self, iterable: ast.AST) -> str | None:
        """The loop's name when ``iterable`` is (or wraps, as enumerate does) an rl.loop call."""
        for node in _walk_expression(iterable):
            if self.api_call(node) == "loop":
                assert isinstance(node, ast.Call)
                return _literal_name(node) or "?"
        return None

    # .. lexical index

    def _index_body(
        self,
        nodes: Iterable[ast.AST],
        *,
        owner: _Function | None,
        cls: _Class | None,
        in_lambda: bool,
    ) -> None:
        for node in nodes:
            self._index(node, owner=owner, cls=cls, in_lambda=in_lambda)

    def _index(
        self, node: ast.AST, *, owner: _Function | None, cls: _Class | None, in_lambda: bool
    ) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            prefix = owner.qualname + "." if owner else (cls.node.name + "." if cls else "")
            fn = _Function(node, prefix + node.name, cls=cls, parent=owner)
            self.all_functions.append(fn)
            if cls is not None:
                cls.methods[node.name] = fn
            elif owner is not None:
                owner.local_defs[node.name] = fn
            else:
                self.functions[node.name] = fn
            # Decorators and defaults run where the def is, the body where it is called.
            outside = [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]
            self._index_body(
                (n for n in outside if n is not None), owner=owner, cls=None, in_lambda=in_lambda
            )
            self._index_body(node.body, owner=fn, cls=None, in_lambda=False)
            return
        if isinstance(node, ast.ClassDef):
            klass = _Class(node)
            if owner is None and cls is None:
                self.classes[node.name] = klass
            self._index_body(node.body, owner=owner, cls=klass, in_lambda=in_lambda)
            return
        if isinstance(node, ast.Lambda):
            in_lambda = True
        if isinstance(node, ast.Call):
            kind = self.api_call(node)
            if kind == "log":
                name = _literal_name(node)
                if name is None:
                    self.dynamic_names += 1
                self.log_calls.append((name, node))
                self.owner[id(node)] = owner
                if in_lambda:
                    self.in_lambda.add(id(node))
                if owner is not None:
                    owner.log_calls.append(node)
            elif kind == "loop":
                if owner is not None:
                    owner.has_loop = True
            elif kind == "begin":
                self.drives_events = True
            elif owner is not None:
                owner.calls.append(node)
        for child in ast.iter_child_nodes(node):
            self._index(child, owner=owner, cls=cls, in_lambda=in_lambda)

    def _instance_classes(self, tree: ast.Module) -> dict[str, _Class]:
        """Variables bound only to ``ClassName(...)`` of one module class, anywhere."""
        seen: dict[str, _Class | None] = {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign | ast.AnnAssign):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            klass = None
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id in self.classes
            ):
                klass = self.classes[value.func.id]
            for target in targets:
                if isinstance(target, ast.Name):
                    if target.id in seen and seen[target.id] is not klass:
                        klass_or_none = None  # bound to different things: unknown
                    else:
                        klass_or_none = klass
                    seen[target.id] = klass_or_none
        return {name: klass for name, klass in seen.items() if klass is not None}

    def _escaping_functions(self, tree: ast.Module) -> list[_Function]:
        """Functions used other than by a call (a callback, a value): where they run is unknown."""
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        # A name also bound as a variable (``for step in ...``) is most likely that variable.
        variables = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
        } | {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)}
        referenced: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in called:
                continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id not in variables:
                    referenced.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                referenced.add(node.attr)
        return [fn for fn in self.all_functions if fn.node.name in referenced]

    # .. queries

    def logged_names(self) -> set[str]:
        return {name for name, _ in self.log_calls if name is not None}

    def log_calls_named(self, name: str) -> list[ast.Call]:
        return [call for logged, call in self.log_calls if logged == name]

    def resolve(self, call: ast.Call, scope: _Function | None) -> _Function | None:
        """The module function ``call`` runs, when it can be told from the source."""
        func = call.func
        if isinstance(func, ast.Name):
            fn = scope
            while fn is not None:
                if func.id in fn.local_defs:
                    return fn.local_defs[func.id]
                fn = fn.parent
            if func.id in self.functions:
                return self.functions[func.id]
            if func.id in self.classes:
                return self._method(self.classes[func.id], "__init__")
            return None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            klass: _Class | None = None
            if owner in ("self", "cls") and scope is not None:
                klass = scope.method_scope()
            elif owner in self.classes:
                klass = self.classes[owner]
            elif owner in self.instances:
                klass = self.instances[owner]
            if klass is not None:
                return self._method(klass, func.attr)
        return None

    def _method(self, klass: _Class, name: str, depth: int = 0) -> _Function | None:
        if name in klass.methods:
            return klass.methods[name]
        if depth > 8:
            return None
        for base in klass.node.bases:
            if isinstance(base, ast.Name) and base.id in self.classes:
                found = self._method(self.classes[base.id], name, depth + 1)
                if found is not None:
                    return found
        return None

    def reachable(self, start: Iterable[_Function]) -> list[_Function]:
        """``start`` and every module function they can call, through any chain."""
        seen: dict[int, _Function] = {}
        stack = list(start)
        while stack:
            fn = stack.pop()
            if id(fn) in seen:
                continue
            seen[id(fn)] = fn
            for call in fn.calls:
                callee = self.resolve(call, fn)
                if callee is not None:
                    stack.append(callee)
        return list(seen.values())


def names_read(source: str, names: Sequence[str]) -> set[str]:
    """The variables the ``log`` calls of ``names`` in ``source`` read from before them.

    A replay worker does not restore a checkpoint that lacks one of them (a large
    local the block rebound): the statement would read what the variable held
    before the block. It executes that block instead. A name the code assigns
    between the last loop before the statement and the statement itself (``fake =
    netG(noise)`` after the step loop) is not one: it is set anew either way.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    wanted = set(names)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "log"
            and _literal_name(node) in wanted
        ):
            continue
        reads: set[str] = set()
        for argument in [*node.args[1:], *(k.value for k in node.keywords if k.arg != "name")]:
            reads.update(
                n.id
                for n in _walk_expression(argument)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            )
        found |= reads - _assigned_since_last_loop(node, parents)
    return found


_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.Module)


def _assigned_since_last_loop(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> set[str]:
    """Names plainly assigned by the statements that run after the last loop before
    ``node`` and before it, in its function (an augmented assignment reads first)."""
    assigned: set[str] = set()
    child = node
    parent = parents.get(child)
    while parent is not None and not isinstance(parent, _SCOPES):
        for part in ("body", "orelse", "finalbody"):
            seq = getattr(parent, part, None)
            if isinstance(seq, list) and child in seq:
                for before in reversed(seq[: seq.index(child)]):
                    if isinstance(before, _LOOPS):
                        return assigned
                    if isinstance(before, ast.stmt):
                        assigned |= _stored(before)
                break
        if isinstance(parent, _LOOPS):
            return assigned  # the statement is inside a loop's body: that loop comes first
        child, parent = parent, parents.get(parent)
    return assigned


def _stored(statement: ast.stmt) -> set[str]:
    """Names a statement binds outright (not through ``+=``, not in nested scopes or loops)."""
    found: set[str] = set()
    stack: list[ast.AST] = [statement]
    while stack:
        current = stack.pop()
        if isinstance(current, ast.AugAssign) or (
            current is not statement and isinstance(current, (*_SCOPES, *_LOOPS))
        ):
            continue
        if isinstance(current, ast.Name) and isinstance(current.ctx, ast.Store):
            found.add(current.id)
        stack.extend(ast.iter_child_nodes(current))
    return found


def _literal_name(call: ast.Call) -> str | None:
    """The call's name argument when it is a string literal (first positional or name=)."""
    arg: ast.expr | None = call.args[0] if call.args else None
    if arg is None:
        arg = next((k.value for k in call.keywords if k.arg == "name"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _walk_expression(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of an expression, not descending into lambdas (their body runs later)."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if not isinstance(current, ast.Lambda):
            stack.extend(ast.iter_child_nodes(current))


# -- the walk in execution order -------------------------------------------------------


class _TooComplex(Exception):
    """The walk exceeded its node budget."""


@dataclass(frozen=True)
class _Loop:
    name: str
    body: tuple[ast.AST, ...]  # what runs inside one iteration
    scope: _Function | None  # where the body's calls resolve


@dataclass(frozen=True)
class _Context:
    loops: tuple[_Loop, ...] = ()
    scope: _Function | None = None
    calls: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (function, loops at its call site)

    def inside(self, loop: _Loop) -> _Context:
        return _Context((*self.loops, loop), self.scope, self.calls)

    def loop_names(self) -> tuple[str, ...]:
        return tuple(loop.name for loop in self.loops)


@dataclass(frozen=True)
class _Candidate:
    position: Position
    loops: tuple[str, ...]
    note: str


class _Walker:
    """Walks the module in execution order, recording where each log call can run."""

    def __init__(self, module: _Module) -> None:
        self.module = module
        self.after_top_loop = False  # a top-level loop has run before the current node
        self.candidates: dict[int, list[_Candidate]] = {}
        self._budget = _NODE_BUDGET
        self._nested_cache: dict[int, bool] = {}

    def run(self, tree: ast.Module) -> None:
        self.statements(tree.body, _Context())
        # Functions passed around (callbacks) may run anywhere: their statements go deep,
        # except in a framework's epoch hook (compute_metrics=...), which runs once per epoch.
        for root in self.module.escaping:
            for fn in self.module.reachable([root]):
                for call in fn.log_calls:
                    if _is_epoch_hook(root):
                        self.add(call, _epoch_hook(root))
                        continue
                    self.add(
                        call,
                        _Candidate(
                            Position.INNER,
                            (),
                            f"could not resolve: {fn.qualname} is passed around as a value "
                            "(a callback?), so where it runs is unknown; every block is "
                            "executed",
                        ),
                    )
        # A framework's epoch hooks (a callback's on_epoch_end), and what they call.
        hooks = [fn for fn in self.module.all_functions if _is_epoch_hook(fn)]
        for hook in hooks:
            for fn in self.module.reachable([hook]):
                for call in fn.log_calls:
                    self.add(call, _epoch_hook(hook))
        if self.module.drives_events:
            # rl.begin opens loops this walk does not see: a statement it placed outside
            # every rl.loop may run inside an event-driven loop's block.
            for candidates in self.candidates.values():
                for i, candidate in enumerate(candidates):
                    if candidate.position in (Position.PREFIX, Position.SUFFIX):
                        candidates[i] = _Candidate(
                            Position.INNER,
                            candidate.loops,
                            "could not resolve: this file opens loops with rl.begin, "
                            "which are not followed here; every block is executed",
                        )

    def add(self, call: ast.Call, candidate: _Candidate) -> None:
        self.candidates.setdefault(id(call), []).append(candidate)

    def _tick(self) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise _TooComplex

    # .. statements

    def statements(self, body: Iterable[ast.stmt], ctx: _Context) -> None:
        for stmt in body:
            self.statement(stmt, ctx)

    def statement(self, node: ast.stmt, ctx: _Context) -> None:
        self._tick()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return  # its body runs where it is called
        if isinstance(node, ast.ClassDef):
            self.statements(node.body, ctx)  # a class body runs at definition
            return
        if isinstance(node, ast.For | ast.AsyncFor):
            self.expression(node.iter, ctx)
            name = self.module.loop_name(node.iter)
            if name is None:
                self.repeated(node.body, ctx)
            else:
                self.statements(node.body, ctx.inside(_Loop(name, tuple(node.body), ctx.scope)))
                if not ctx.loops:
                    self.after_top_loop = True
            self.statements(node.orelse, ctx)
            return
        if isinstance(node, ast.While):
            self.expression(node.test, ctx)
            self.repeated(node.body, ctx)
            self.statements(node.orelse, ctx)
            return
        if isinstance(node, ast.If):
            # Both branches, in order: a loop in either makes what follows "after a loop".
            self.expression(node.test, ctx)
            self.statements(node.body, ctx)
            self.statements(node.orelse, ctx)
            return
        if isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                self.expression(item.context_expr, ctx)
            self.statements(node.body, ctx)
            return
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":  # except* is 3.11+
            tried = cast(ast.Try, node)
            self.statements(tried.body, ctx)
            for handler in tried.handlers:
                self.statements(handler.body, ctx)
            self.statements(tried.orelse, ctx)
            self.statements(tried.finalbody, ctx)
            return
        if isinstance(node, ast.Match):
            self.expression(node.subject, ctx)
            for case in node.cases:
                if case.guard is not None:
                    self.expression(case.guard, ctx)
                self.statements(case.body, ctx)
            return
        for child in ast.iter_child_nodes(node):
            self.expression(child, ctx)

    def repeated(self, body: list[ast.stmt], ctx: _Context) -> None:
        """A plain loop's body; its second iteration follows any top-level loop in the first."""
        before = self.after_top_loop
        self.statements(body, ctx)
        if not ctx.loops and not before and self.after_top_loop:
            self.statements(body, ctx)

    # .. expressions

    def expression(self, node: ast.AST, ctx: _Context) -> None:
        self._tick()
        if isinstance(node, ast.Lambda):
            return  # runs wherever it is called: left unresolved unless reached otherwise
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            self.comprehension(node, ctx)
            return
        if isinstance(node, ast.Call):
            for child in ast.iter_child_nodes(node):
                self.expression(child, ctx)
            kind = self.module.api_call(node)
            if kind == "log":
                self.add(node, self.place(ctx))
            elif kind is None:
                callee = self.module.resolve(node, ctx.scope)
                if callee is not None:
                    self.call(callee, ctx)
            return
        for child in ast.iter_child_nodes(node):
            self.expression(child, ctx)

    def comprehension(
        self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp, ctx: _Context
    ) -> None:
        parts: tuple[ast.AST, ...] = (
            (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,)
        )
        inner = ctx
        for i, gen in enumerate(node.generators):
            self.expression(gen.iter, inner)
            name = self.module.loop_name(gen.iter)
            if name is not None:
                body = (*node.generators[i + 1 :], *parts)
                inner = inner.inside(_Loop(name, tuple(body), ctx.scope))
            for cond in gen.ifs:
                self.expression(cond, inner)
        for part in parts:
            self.expression(part, inner)
        if inner is not ctx and not ctx.loops:
            self.after_top_loop = True

    def call(self, callee: _Function, ctx: _Context) -> None:
        on_path = any(name == callee.qualname for name, _ in ctx.calls)
        if on_path or len(ctx.calls) >= MAX_CALL_DEPTH:
            why = (
                f"{callee.qualname} calls itself"
                if on_path
                else f"{callee.qualname} is reached through more than {MAX_CALL_DEPTH} calls"
            )
            for fn in self.module.reachable([callee]):
                for log_call in fn.log_calls:
                    self.add(
                        log_call,
                        _Candidate(
                            Position.INNER,
                            ctx.loop_names(),
                            f"could not resolve: {why}; every block is executed",
                        ),
                    )
            return
        inner = _Context(ctx.loops, callee, (*ctx.calls, (callee.qualname, ctx.loop_names())))
        self.statements(callee.node.body, inner)

    # .. positions

    def place(self, ctx: _Context) -> _Candidate:
        """Where a log call reached with ``ctx`` runs."""
        loops = ctx.loop_names()
        note = _call_note(ctx)
        if not loops:
            position = Position.SUFFIX if self.after_top_loop else Position.PREFIX
            return _Candidate(position, loops, note)
        if len(loops) >= 2:
            return _Candidate(Position.INNER, loops, note)
        if self.has_nested_loop(ctx.loops[0]):
            return _Candidate(Position.OUTER, loops, note)
        # No nested loop: the whole iteration is the checkpointed block.
        why = f"loop {loops[0]!r} has no nested rl.loop, so each iteration is the block"
        return _Candidate(Position.INNER, loops, f"{note}; {why}" if note else why)

    def has_nested_loop(self, loop: _Loop) -> bool:
        """Whether an rl.loop runs inside ``loop``'s iterations, directly or through calls."""
        key = id(loop.body[0]) if loop.body else id(loop)
        if key not in self._nested_cache:
            self._nested_cache[key] = self._contains_loop(loop)
        return self._nested_cache[key]

    def _contains_loop(self, loop: _Loop) -> bool:
        callees = []
        for top in loop.body:
            for node in _walk_lexical(top):
                if self.module.api_call(node) == "loop":
                    return True
                if isinstance(node, ast.Call):
                    callee = self.module.resolve(node, loop.scope)
                    if callee is not None:
                        callees.append(callee)
        return any(fn.has_loop for fn in self.module.reachable(callees))


def _is_epoch_hook(fn: _Function) -> bool:
    """A method named as a framework's epoch hook, or a ``compute_metrics`` function (which
    transformers' Trainer takes as an argument and calls at each evaluation)."""
    name = fn.node.name
    if fn.method_scope() is not None:
        return name in EPOCH_HOOKS
    return name in EPOCH_FUNCTIONS and fn.parent is None


def _epoch_hook(hook: _Function) -> _Candidate:
    return _Candidate(
        Position.OUTER,
        (),
        f"inside {hook.qualname}, which the framework runs once per epoch, outside its steps",
    )


def _walk_lexical(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes under ``node`` that run with it: not inside nested defs or lambdas."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        for child in ast.iter_child_nodes(current):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                stack.append(child)


def _call_note(ctx: _Context) -> str:
    if not ctx.calls:
        return ""
    function, loops_at_call = ctx.calls[-1]
    where = f"called in loop {loops_at_call[-1]!r}" if loops_at_call else "called outside loops"
    via = f" (via {' -> '.join(name for name, _ in ctx.calls[:-1])})" if len(ctx.calls) > 1 else ""
    return f"inside function {function}, {where}{via}"


def _site(module: _Module, walker: _Walker, name: str, call: ast.Call) -> StatementSite:
    candidates = walker.candidates.get(id(call))
    if not candidates:
        owner = module.owner.get(id(call))
        if id(call) in module.in_lambda:
            why = "it is inside a lambda"
        elif owner is not None:
            why = (
                f"it is inside function {owner.qualname}, which is never called in a way "
                "this file shows (only through an object or from another module?)"
            )
        else:
            why = "it is never reached"
        return StatementSite(
            name,
            call.lineno,
            Position.INNER,
            (),
            f"could not resolve: {why}; every block is executed",
        )
    deepest = max(candidates, key=lambda c: c.position.depth)
    note = deepest.note
    paths = {(c.position, c.loops, c.note) for c in candidates}
    if len(paths) > 1:
        extra = f"reached {len(paths)} ways; the deepest decides"
        note = f"{note}; {extra}" if note else extra
    return StatementSite(name, call.lineno, deepest.position, deepest.loops, note)
