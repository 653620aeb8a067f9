"""Hands-free recording: a script's training loops found from its syntax tree, and rewritten.

``retrolog run train.py`` records a script that never calls ``rl.loop`` or
``rl.checkpointing``. This module reads the script's syntax tree without running it:

- a *training loop* is an outermost ``for`` whose body holds a nested ``for``, lexically or
  in a function of the same file it calls (``def train(): for batch in ...``), and whose
  body calls a method of a name bound before it (``optimizer.step()``): a loop that only
  computes from what it was given (building a data set) has no training state and runs
  as it is;
- its nested ``for`` loops (in the body, or in the same-file functions it calls) become
  ``rl.loop`` too: the first ``"step"``, the others named after their iterable;
- the objects to checkpoint are the names bound before the loop that the loop reads, or
  that the same-file functions it calls read as globals; which of them can be checkpointed
  is decided when the loop starts (:func:`checkpoint_objects`), from their values;
- the plain variables the loop assigns are listed: the checkpoint's plain-locals capture
  (runtime/frames.py) carries them.

Where the analysis cannot know what a loop changes it says so and the loop is executed,
never restored: an outermost ``while`` (its end depends on what runs inside), a loop over
a generator the script defines, a called function that declares ``global`` or
``nonlocal`` names, and (decided at the loop's start) a closure or an object without
``state_dict`` that the loop calls a method of or assigns into.

The rewrite keeps every node's line and column, and the code is compiled with the file's
own name: tracebacks, propagation and replay refer to the user's file, which is never
written to.
"""

from __future__ import annotations

import ast
import copy
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# The name the rewritten code calls through (retrolog's hands-free helpers); a dunder name
# no script uses.
HELPER = "__retrolog_handsfree__"
# main() -> train() -> train_epoch() -> helper(): as deep as statements.py follows calls.
MAX_CALL_DEPTH = 4


@dataclass
class InnerLoop:
    """A nested ``for`` that becomes ``rl.loop(name, ...)``."""

    line: int
    name: str
    function: str | None  # the same-file function it is in, None for the loop's own body


@dataclass
class TrainingLoop:
    """An outermost ``for`` with a nested one: ``rl.checkpointing`` + ``rl.loop``."""

    index: int
    line: int
    name: str
    function: str | None  # the function it is in, None at module level
    inner: list[InnerLoop] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)  # names bound before it that it reads
    mutated: list[str] = field(default_factory=list)  # of those: method called, assigned into
    in_place: list[str] = field(default_factory=list)  # of those: assigned into, x.add_()
    plain: list[str] = field(default_factory=list)  # variables the loop assigns
    uncertain: list[str] = field(default_factory=list)  # why it is executed, not restored

    @property
    def restorable(self) -> bool:
        return not self.uncertain


@dataclass
class Analysis:
    """What :func:`analyse` found in one script."""

    filename: str
    loops: list[TrainingLoop] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # loops left as they are, and why

    def as_record(self) -> dict[str, Any]:
        """The inference as a run records it (JSON-ready)."""
        return {
            "loops": [
                {
                    "line": loop.line,
                    "name": loop.name,
                    "function": loop.function,
                    "inner": [{"line": i.line, "name": i.name} for i in loop.inner],
                    "plain": loop.plain,
                    "uncertain": loop.uncertain,
                }
                for loop in self.loops
            ],
            "notes": list(self.notes),
        }


# -- analysis --------------------------------------------------------------------------


def _scope_nodes(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Nodes of a body in this scope: not into nested functions, classes or lambdas."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _bound(node: ast.AST) -> set[str]:
    """Names a target binds."""
    return {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _called_functions(
    body: list[ast.stmt], functions: Mapping[str, ast.FunctionDef], depth: int = 0
) -> list[ast.FunctionDef]:
    """Same-file functions the body calls by name, transitively, in call order."""
    found: list[ast.FunctionDef] = []
    for node in _scope_nodes(body):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            target = functions.get(node.func.id)
            if target is not None and target not in found:
                found.append(target)
                if depth < MAX_CALL_DEPTH:
                    for deeper in _called_functions(target.body, functions, depth + 1):
                        if deeper not in found:
                            found.append(deeper)
    return found


def _fors(body: list[ast.stmt]) -> list[ast.For]:
    return [n for n in _scope_nodes(body) if isinstance(n, ast.For)]


def _has_yield(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _scope_nodes(fn.body))


def _iterable_name(node: ast.expr) -> str | None:
    """``train_loader`` for ``train_loader``, ``enumerate(train_loader)``, ``tqdm(...)``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call) and node.args:
        return _iterable_name(node.args[0])
    return None


def _loop_var(node: ast.For) -> str | None:
    return node.target.id if isinstance(node.target, ast.Name) else None


def _free_reads(fn: ast.FunctionDef) -> set[str]:
    """Names a function reads that it does not bind: its globals (or its closure's)."""
    local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    reads: set[str] = set()
    for node in _scope_nodes(fn.body):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Store):
                local.add(node.id)
            else:
                reads.add(node.id)
    return reads - local


def _receivers(body: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """Names whose method the body calls, and names it changes in place: assigned into
    (``x[i] = ``, ``x.a =``) or given an in-place method (torch's ``x.add_(...)``)."""
    called: set[str] = set()
    stored: set[str] = set()
    for node in _scope_nodes(body):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
        ):
            called.add(node.func.value.id)
            if node.func.attr.endswith("_") and not node.func.attr.startswith("_"):
                stored.add(node.func.value.id)
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            base = node.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                stored.add(base.id)
    return called, stored


class _Analyser:
    def __init__(self, tree: ast.Module, filename: str) -> None:
        self.tree = tree
        self.analysis = Analysis(filename)
        self.functions: dict[str, ast.FunctionDef] = {
            n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)
        }
        self.imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    self.imported.add((alias.asname or alias.name).split(".")[0])
        self.inner_at: dict[int, InnerLoop] = {}  # id(For node) -> its inner loop
        self.outer_at: dict[int, TrainingLoop] = {}
        self.inner_names: set[str] = set()

    def instrumented(self) -> bool:
        """Whether the script already calls ``rl.loop`` or ``rl.checkpointing``."""
        aliases: set[str] = set()
        direct: set[str] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name == "retrolog"}
            elif isinstance(node, ast.ImportFrom) and node.module == "retrolog":
                direct |= {
                    a.asname or a.name for a in node.names if a.name in ("loop", "checkpointing")
                }
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in direct:
                return True
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("loop", "checkpointing")
                and isinstance(func.value, ast.Name)
                and func.value.id in aliases
            ):
                return True
        return False

    def run(self) -> Analysis:
        if self.instrumented():
            self.analysis.notes.append(
                f"{self.analysis.filename} already calls rl.loop or rl.checkpointing: it runs "
                "as it is, nothing inferred."
            )
            return self.analysis
        self.scope(self.tree.body, None)
        for fn in self.functions.values():
            self.scope(fn.body, fn)
        return self.analysis

    def where(self, line: int) -> str:
        return f"{self.analysis.filename}:{line}"

    def scope(self, body: list[ast.stmt], fn: ast.FunctionDef | None) -> None:
        """The outermost loops of one scope (module or function), in source order."""
        stack: list[ast.AST] = list(reversed(body))
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(node, ast.While) and self.holds_loop(node.body):
                self.analysis.notes.append(
                    f"{self.where(node.lineno)}: a while loop with a nested loop: how often it "
                    "runs depends on what happens inside it (a callback, a condition), so "
                    "it is executed, not restored."
                )
                continue
            if isinstance(node, ast.For) and id(node) not in self.inner_at:
                if self.holds_loop(node.body):
                    self.training_loop(node, body, fn)
                continue  # its own nested loops are not outermost
            stack.extend(reversed(list(ast.iter_child_nodes(node))))

    def holds_loop(self, body: list[ast.stmt]) -> bool:
        if any(isinstance(n, (ast.For, ast.While)) for n in _scope_nodes(body)):
            return True
        return any(_fors(f.body) for f in _called_functions(body, self.functions))

    def training_loop(
        self, node: ast.For, body: list[ast.stmt], fn: ast.FunctionDef | None
    ) -> None:
        called_fns = _called_functions(node.body, self.functions)
        method_receivers, stored = _receivers(node.body)
        before = self.bound_before(node, body, fn)
        reads = {
            n.id
            for n in _scope_nodes(node.body)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        }
        for called in called_fns:
            free = _free_reads(called)
            reads |= free
            more_called, more_stored = _receivers(called.body)
            # A callee's parameters are the caller's objects (train(model, optimizer)):
            # their methods count as the loop's, read through the call's arguments.
            method_receivers |= more_called & free
            stored |= more_stored & free
            changed = more_called | more_stored
            method_receivers |= self.arguments_to(called, changed, node.body, called_fns)
        module_level = set(self.functions) | self.imported
        candidates = sorted((reads & before) - module_level - {HELPER})
        if not (method_receivers & before) - module_level:
            self.analysis.notes.append(
                f"{self.where(node.lineno)}: a loop with a nested loop that calls no method of an "
                "object made before it (no training state to keep): executed as it is."
            )
            return
        name = _loop_var(node) or "epoch"
        loop = TrainingLoop(
            index=len(self.analysis.loops),
            line=node.lineno,
            name=name,
            function=fn.name if fn else None,
            candidates=candidates,
            mutated=sorted(((method_receivers | stored) & before) - module_level),
            in_place=sorted((stored & before) - module_level),
            plain=sorted(_bound(ast.Module(body=node.body, type_ignores=[])) - {name}
                         - {_loop_var(node) or ""}),
        )  # fmt: skip
        self.note_uncertainties(loop, node, called_fns)
        self.name_inner_loops(loop, node, called_fns)
        self.outer_at[id(node)] = loop
        self.analysis.loops.append(loop)

    def note_uncertainties(
        self, loop: TrainingLoop, node: ast.For, called_fns: list[ast.FunctionDef]
    ) -> None:
        """What the loop's checkpoints may not hold: a generator it iterates or calls, a
        callee assigning global or nonlocal names."""
        if isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Name):
            gen = self.functions.get(node.iter.func.id)
            if gen is not None and _has_yield(gen):
                loop.uncertain.append(
                    f"it iterates the generator {gen.name}() defined in the script, whose state a "
                    "checkpoint cannot hold"
                )
        for called in called_fns:
            declared = [
                n for n in _scope_nodes(called.body) if isinstance(n, (ast.Global, ast.Nonlocal))
            ]
            if declared:
                kind = "global" if isinstance(declared[0], ast.Global) else "nonlocal"
                loop.uncertain.append(
                    f"{called.name}() (line {called.lineno}), which it calls, assigns the "
                    f"{kind} name(s) {', '.join(declared[0].names)}"
                )
            if _has_yield(called):
                loop.uncertain.append(
                    f"it calls the generator {called.name}() (line {called.lineno}), whose state "
                    "a checkpoint cannot hold"
                )

    def name_inner_loops(
        self, loop: TrainingLoop, node: ast.For, called_fns: list[ast.FunctionDef]
    ) -> None:
        """The loop's nested loops (its own and its callees' outermost ones), each named
        once for the whole script: "step" first, then by what it iterates."""
        name = loop.name
        # Nested loops: first "step", then by their iterable, in call order.
        nested: list[tuple[ast.For, str | None]] = [(f, None) for f in _fors(node.body)]
        for called in called_fns:
            outermost = [
                f for f in _fors(called.body)
                if not any(f in _fors(g.body) for g in _fors(called.body) if g is not f)
            ]  # fmt: skip
            nested.extend((f, called.name) for f in outermost)
        direct_inner = [
            f for f in _fors(node.body)
            if not any(f in _fors(g.body) for g in _fors(node.body) if g is not f)
        ]  # fmt: skip
        nested = [(f, owner) for f, owner in nested if owner is not None or f in direct_inner]
        for f, owner in nested:
            if id(f) in self.inner_at:
                loop.inner.append(self.inner_at[id(f)])
                continue
            base = (
                "step"
                if not self.inner_names
                else (_iterable_name(f.iter) or _loop_var(f) or "loop")
            )
            label, k = base, 2
            while label in self.inner_names or label == name:
                label, k = f"{base}{k}", k + 1
            self.inner_names.add(label)
            inner = InnerLoop(f.lineno, label, owner)
            self.inner_at[id(f)] = inner
            loop.inner.append(inner)

    def arguments_to(
        self,
        fn: ast.FunctionDef,
        changed: set[str],
        body: list[ast.stmt],
        called: list[ast.FunctionDef],
    ) -> set[str]:
        """The names passed to ``fn()`` (from the loop's body or the functions it calls) as
        the parameters in ``changed``: the caller's objects the callee changes."""
        params = [a.arg for a in fn.args.args]
        passed: set[str] = set()
        for part in [body, *(f.body for f in called)]:
            for n in _scope_nodes(part):
                if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
                    continue
                if n.func.id != fn.name:
                    continue
                pairs = list(zip(params, n.args, strict=False)) + [
                    (k.arg, k.value) for k in n.keywords
                ]
                passed |= {a.id for p, a in pairs if p in changed and isinstance(a, ast.Name)}
        return passed

    def bound_before(
        self, node: ast.For, body: list[ast.stmt], fn: ast.FunctionDef | None
    ) -> set[str]:
        """Names bound in the loop's scope before it (and the module's, for a function)."""
        names: set[str] = set()
        if fn is not None:
            names |= {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        for sub in _scope_nodes(body):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names |= {sub.id} if sub.lineno < node.lineno else set()
        if fn is not None:  # globals bound anywhere at module level before main() runs
            for stmt in self.tree.body:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.With)):
                    names |= _bound(stmt)
        return names


def analyse(source: str, filename: str) -> Analysis:
    """The training loops, their candidate objects and plain variables, and what is uncertain."""
    return _Analyser(ast.parse(source, filename), filename).run()


# -- the rewrite -----------------------------------------------------------------------


def _helper(attr: str, node: ast.AST) -> ast.Attribute:
    return ast.Attribute(value=ast.Name(id=HELPER, ctx=ast.Load()), attr=attr, ctx=ast.Load())


class _Rewriter(ast.NodeTransformer):
    def __init__(self, analyser: _Analyser) -> None:
        self.analyser = analyser

    def visit_For(self, node: ast.For) -> Any:
        self.generic_visit(node)
        inner = self.analyser.inner_at.get(id(node))
        outer = self.analyser.outer_at.get(id(node))
        label = inner.name if inner else outer.name if outer else None
        if label is None:
            return node
        node.iter = ast.copy_location(
            ast.Call(
                func=_helper("loop", node), args=[ast.Constant(label), node.iter], keywords=[]
            ),
            node.iter,
        )
        if outer is None:
            return node
        scope_call = ast.Call(
            func=_helper("checkpointing", node),
            args=[
                ast.Constant(outer.index),
                ast.Call(func=ast.Name(id="locals", ctx=ast.Load()), args=[], keywords=[]),
                ast.Call(func=ast.Name(id="globals", ctx=ast.Load()), args=[], keywords=[]),
            ],
            keywords=[],
        )
        wrapped = ast.With(items=[ast.withitem(context_expr=scope_call)], body=[node])
        return ast.copy_location(wrapped, node)


def instrument(source: str, filename: str) -> tuple[ast.Module, Analysis]:
    """The script's syntax tree rewritten to the instrumented API, and the analysis."""
    tree = ast.parse(source, filename)
    analyser = _Analyser(tree, filename)
    analysis = analyser.run()
    rewritten = _Rewriter(analyser).visit(tree)
    ast.fix_missing_locations(rewritten)
    return rewritten, analysis


def compile_script(source: str, filename: str) -> tuple[types.CodeType, Analysis]:
    """The rewritten script compiled under its own file name (its lines kept)."""
    tree, analysis = instrument(source, filename)
    return compile(tree, filename, "exec", dont_inherit=True), analysis


def instrumented_text(source: str, filename: str) -> str:
    """The rewritten script as source, for the analyses that read ``rl.loop`` calls."""
    tree, _ = instrument(source, filename)
    tree = copy.deepcopy(tree)
    tree.body.insert(0, ast.Import(names=[ast.alias(name="retrolog", asname=HELPER)]))
    return ast.unparse(ast.fix_missing_locations(tree))


# -- at the loop's start ---------------------------------------------------------------


def checkpoint_objects(
    loop: TrainingLoop, values: Mapping[str, Any], accepts: Any
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The objects to checkpoint, notes on the left-out ones, and reasons not to restore.

    values: the loop's scope (its locals over the module's globals) as the loop starts.
    accepts(obj): whether a checkpoint can hold and restore ``obj`` in place.
    """
    objects: dict[str, Any] = {}
    notes: list[str] = []
    uncertain: list[str] = []
    mutated = set(loop.mutated)
    for name in loop.candidates:
        if name not in values:
            continue
        value = values[name]
        if isinstance(value, (types.ModuleType, type)) or value is None:
            continue
        if isinstance(value, (types.FunctionType, types.MethodType)):
            fn = getattr(value, "__func__", value)
            cells = [c for c in (fn.__closure__ or ()) if _holds_state(c)]
            if cells:
                uncertain.append(f"{name}() keeps state in a closure")
            continue
        has_state = callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)
        )
        if has_state:
            objects[name] = value
        elif name in mutated:
            if isinstance(value, (int, float, str, bytes, bool, tuple, frozenset)):
                continue  # immutable: its methods change nothing
            array = hasattr(value, "dtype") and hasattr(value, "shape")
            if array and name not in loop.in_place:
                continue  # x.float(), x.sum(): an array's other methods make new arrays
            if accepts(value):
                objects[name] = value
            else:
                uncertain.append(
                    f"{name} ({type(value).__name__}) has no state_dict() and the loop changes it"
                )
        elif isinstance(value, (int, float, str, bool)):
            continue
    return objects, notes, uncertain


def _holds_state(cell: Any) -> bool:
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    # Even an int: ``nonlocal count; count += 1`` rebinds the cell, which no checkpoint holds.
    return not isinstance(value, (types.FunctionType, types.ModuleType, type))


# -- --explain -------------------------------------------------------------------------


def explain(analysis: Analysis) -> str:
    """What ``retrolog run --explain`` prints."""
    lines: list[str] = []
    f = analysis.filename
    if not analysis.loops:
        lines.append(f"{f}: no training loop found (a for loop holding a nested for loop).")
    for loop in analysis.loops:
        where = f" in {loop.function}()" if loop.function else ""
        lines.append(f"training loop {f}:{loop.line}{where}: rl.loop({loop.name!r})")
        for inner in loop.inner:
            inside = f" in {inner.function}()" if inner.function else ""
            lines.append(f"  nested loop {f}:{inner.line}{inside}: rl.loop({inner.name!r})")
        names = ", ".join(loop.candidates) or "none"
        lines.append(
            f"  objects: those of {names} that have state_dict()/load_state_dict() when the "
            "loop starts"
        )
        changed = ", ".join(loop.mutated) or "none"
        lines.append(f"  changed by the loop (method called or assigned into): {changed}")
        lines.append(f"  plain variables it assigns: {', '.join(loop.plain) or 'none'}")
        for why in loop.uncertain:
            lines.append(f"  uncertain: {why}; this loop is executed in replay, not restored")
    for note in analysis.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
