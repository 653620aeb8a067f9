"""Match the syntax trees of two versions of a file, GumTree-style.

Falleri et al., "Fine-grained and accurate source code differencing" (ASE 2014),
adapted to Python's :mod:`ast` for propagation (see propagate/): ``rl.loop``
loops with the same name first, as anchors; then identical subtrees top-down,
largest first; then statements and blocks bottom-up by their share of matched
descendants; then a recovery pass inside matched blocks. Training-script
histories move loops between module level, functions and methods, change
signatures and wrappers and predate ``rl.loop``, so a few phases are added
(docs/propagation.md lists them): the only call of a function both versions
define, loops by what they iterate over, loops by the votes of their kept
statements, and more pairing rules in recovery. The result is a partial
one-to-one mapping, each :class:`_Node`'s ``partner``, and what propagation reads
off it: the old names a new name was aligned with, the old statements a new
statement without counterpart stands for. Where a statement goes is decided in
propagate/spot.py, not here.
"""

from __future__ import annotations

import ast
import difflib
import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping

from retrolog._replay._scopes import _BLOCK_ITEMS, _BUILTINS, _DEFS, _children, _Scopes

# GumTree's defaults: subtrees lower than MIN_HEIGHT (a bare name or constant) are
# too common to match on their own and are left to their parents' phases; a
# container matches when more than MIN_DICE of its matched descendants agree.
MIN_HEIGHT = 2
MIN_DICE = 0.5
# Recovery pairs leftover statements of one kind whose labelled tokens overlap this
# much: ``model = Net()`` with ``net = Net()`` (0.5), ``lr = 0.01`` with ``lr = 0.02``
# (0.5), but not ``x = 1`` with ``y = 2`` (0) nor ``f(net, opt)`` with ``net.train()``.
MIN_SIMILARITY = 0.5

# The name of the ``rl.loop`` a node iterates over, if it is such a loop: one per version,
# since the two files may import retrolog differently.
_LoopName = Callable[[ast.AST], str | None]
# Whether a call is ``rl.loop(...)`` (however the version imports it).
_IsLoopCall = Callable[[ast.Call], bool]
# Builtins that only decorate what a loop iterates over: ``for i, x in enumerate(xs)``
# walks the same data as ``for x in xs``, and so do ``zip(xs, ys)`` and ``iter(xs)``; so
# does ``tqdm(xs)`` however it is imported. (Not ``reversed`` or ``sorted``: they change the
# order, so the loop is another loop.)
_ITERATION_WRAPPERS = frozenset({"enumerate", "zip", "iter"})
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_FUNCTION_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
# Blocks the sole-pair rule of recovery may pair (see _Alignment._sole_pairs).
_COMPOUND = (*_LOOPS, ast.If, ast.With, ast.AsyncWith, ast.Try)


def _never(call: ast.Call) -> bool:
    return False


def _label(node: ast.AST) -> str:
    """The value part of a node, next to its kind: an identifier, a constant, an operator."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant):
        return repr(node.value)
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.keyword):
        return node.arg or "**"
    if isinstance(node, ast.alias):
        return f"{node.name} as {node.asname}"
    if isinstance(node, ast.ImportFrom):
        return "." * node.level + (node.module or "")
    if isinstance(node, (ast.BinOp, ast.AugAssign, ast.UnaryOp, ast.BoolOp)):
        return type(node.op).__name__
    if isinstance(node, ast.Compare):
        return " ".join(type(op).__name__ for op in node.ops)
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return ",".join(node.names)
    name = getattr(node, "name", None)
    return name if isinstance(name, str) else ""


class _Node:
    """A syntax tree node as GumTree sees it: kind, label, shape hash and partner."""

    __slots__ = (
        "ast",
        "children",
        "field",
        "hash",
        "height",
        "holes",
        "index",
        "kind",
        "label",
        "parent",
        "partner",
        "pre",
        "size",
    )

    def __init__(self, node: ast.AST, field: str, parent: _Node | None, pre: int) -> None:
        self.ast = node
        self.kind = type(node).__name__
        self.label = _label(node)
        self.field = field
        self.parent = parent
        self.pre = pre
        self.index = len(parent.children) if parent is not None else 0
        self.children: list[_Node] = []
        self.holes: set[int] = set()  # child indexes a skipped (requested) statement preceded
        self.partner: _Node | None = None
        self.size = self.height = self.hash = 0


class _Tree:
    """A file's syntax tree in pre-order, minus the skipped statements."""

    def __init__(self, root: ast.AST, skip: set[int]) -> None:
        self.nodes: list[_Node] = []
        self.of: dict[int, _Node] = {}
        stack: list[tuple[ast.AST, _Node | None, str]] = [(root, None, "")]
        while stack:  # iterative: a long chain of ``a + b + ...`` must not hit the recursion limit
            node, parent, field = stack.pop()
            item = _Node(node, field, parent, len(self.nodes))
            self.nodes.append(item)
            self.of[id(node)] = item
            if parent is not None:
                parent.children.append(item)
            kids: list[tuple[str, ast.AST]] = []
            for f, child in _children(node):
                if id(child) in skip:
                    item.holes.add(len(kids))
                else:
                    kids.append((f, child))
            stack.extend((child, item, f) for f, child in reversed(kids))
        for item in reversed(self.nodes):
            item.size = 1 + sum(c.size for c in item.children)
            item.height = 1 + max((c.height for c in item.children), default=0)
            item.hash = hash((item.kind, item.label, tuple(c.hash for c in item.children)))
        self.root = self.nodes[0]

    def subtree(self, node: _Node) -> list[_Node]:
        return self.nodes[node.pre : node.pre + node.size]


class _Alignment:
    """A one-to-one mapping between the nodes of the new and the old tree."""

    def __init__(self, new: _Tree, old: _Tree) -> None:
        self.new, self.old = new, old
        self._tokens: dict[int, Counter[tuple[str, str]]] = {}
        self._keys: dict[int, int | None] = {}
        # Functions both versions define: a call to one is the same call whatever its
        # arguments became (``train(epoch)`` -> ``train(args, model, device, ...)``).
        defined = [
            {n.ast.name for n in tree.nodes if isinstance(n.ast, _FUNCTION_DEFS)}
            for tree in (new, old)
        ]
        self.shared_functions = defined[0] & defined[1]
        self._is_loop_call: tuple[_IsLoopCall, _IsLoopCall] = (_never, _never)

    def run(
        self,
        new_loop: _LoopName,
        old_loop: _LoopName,
        new_loop_call: _IsLoopCall = _never,
        old_loop_call: _IsLoopCall = _never,
    ) -> None:
        self._is_loop_call = (new_loop_call, old_loop_call)
        # GumTree maps the roots last; mapping them first lets top-level candidates
        # use "same parent" when duplicates are resolved.
        self._link(self.new.root, self.old.root)
        self._anchor_loops(new_loop, old_loop)
        self._anchor_classes()
        self._top_down()
        self._anchor_calls()
        self._match_loop_headers()
        self._bottom_up()
        self._bottom_up_loops()
        for node in self.new.nodes:
            if node.partner is not None and node.hash != node.partner.hash:
                self._recover(node, node.partner)
        # Recovery maps functions by name, which tells repeated loop headers apart.
        for a, b in self._match_loop_headers():
            self._recover(a, b)

    def _link(self, a: _Node, b: _Node) -> None:
        a.partner, b.partner = b, a

    def _link_subtrees(self, a: _Node, b: _Node) -> None:
        for x, y in zip(self.new.subtree(a), self.old.subtree(b), strict=True):
            if x.partner is None and y.partner is None:
                self._link(x, y)

    def _anchor_loops(self, new_loop: _LoopName, old_loop: _LoopName) -> None:
        """``rl.loop("step", ...)`` loops with the same name match, whatever their bodies."""
        loops: tuple[dict[str, list[_Node]], dict[str, list[_Node]]] = ({}, {})
        for tree, loop_name, found in (
            (self.new, new_loop, loops[0]),
            (self.old, old_loop, loops[1]),
        ):
            for node in tree.nodes:
                if (name := loop_name(node.ast)) is not None:
                    found.setdefault(name, []).append(node)
        for name, ours in loops[0].items():
            theirs = loops[1].get(name, [])
            if len(ours) != len(theirs):
                continue  # several same-named loops with different counts: let the tree decide
            for a, b in zip(ours, theirs, strict=True):
                self._link(a, b)
                if a.hash == b.hash:
                    self._link_subtrees(a, b)

    def _anchor_classes(self) -> None:
        """Classes keep their identity by name, and so do their methods (an addition to
        GumTree).

        A class defined once in each version is the same class, however its body
        changed; so is a method of the same name in it. Without this, a new callback
        class whose hook repeats the old version of another class's hook would take that
        hook's place, and the statement added to the changed one would find none.
        """
        classes: tuple[dict[str, list[_Node]], dict[str, list[_Node]]] = (
            defaultdict(list),
            defaultdict(list),
        )
        for side, tree in enumerate((self.new, self.old)):
            for node in tree.nodes:
                if isinstance(node.ast, ast.ClassDef):
                    classes[side][node.ast.name].append(node)
        for name, ours in classes[0].items():
            theirs = classes[1].get(name, [])
            if len(ours) != 1 or len(theirs) != 1:
                continue
            pairs = [(ours[0], theirs[0])]
            if ours[0].hash != theirs[0].hash:
                methods = [_methods(node) for node in (ours[0], theirs[0])]
                pairs += [(m, methods[1][n]) for n, m in methods[0].items() if n in methods[1]]
            for a, b in pairs:
                if a.partner is None and b.partner is None:
                    self._link(a, b)
                    if a.hash == b.hash:
                        self._link_subtrees(a, b)

    def loop_key(self, node: _Node) -> int | None:
        """What a loop walks over, as a structural hash: its iterable without wrappers.

        ``for batch, (x, y) in enumerate(rl.loop("step", loader))`` and ``for x, y in
        loader`` both walk ``loader``; the loop variables are left out, so a renamed one
        does not matter. A ``while`` loop is keyed by its condition.
        """
        if id(node) in self._keys:
            return self._keys[id(node)]
        key: int | None = None
        if isinstance(node.ast, _LOOPS):
            field = "test" if isinstance(node.ast, ast.While) else "iter"
            head = next((c for c in node.children if c.field == field), None)
            is_loop_call = self._is_loop_call[0 if self._tree_of(node) is self.new else 1]
            while head is not None and isinstance(head.ast, ast.Call):
                inner = _wrapped_iterable(head, is_loop_call)
                if inner is None:
                    break
                head = inner
            if head is not None:
                key = hash((node.kind, head.hash))
        self._keys[id(node)] = key
        return key

    def _match_loop_headers(self) -> list[tuple[_Node, _Node]]:
        """Loops that walk the same thing match, wherever they moved (an addition to GumTree).

        A loop wrapped in ``rl.loop`` today and bare in a version from before retrolog was
        adopted, or moved from module level into ``def main()``, keeps its header. Loops
        are taken outermost first; a header found once among the unmapped loops of each
        version pairs at once, and a repeated one (``for p in model.parameters()``) pairs
        when it occurs once inside the counterpart of its nearest mapped ancestor. Either
        way not when most of its mapped body lies in another loop. Returns the new pairs.
        """
        groups: tuple[dict[int, list[_Node]], dict[int, list[_Node]]] = (
            defaultdict(list),
            defaultdict(list),
        )
        for side, tree in enumerate((self.new, self.old)):
            for node in tree.nodes:
                if node.partner is None and isinstance(node.ast, _LOOPS):
                    key = self.loop_key(node)
                    if key is not None:
                        groups[side][key].append(node)
        linked = []
        for node in self.new.nodes:  # pre-order: an outer loop pairs before its inner ones
            key = self.loop_key(node) if isinstance(node.ast, _LOOPS) else None
            if key is None or node.partner is not None or key not in groups[1]:
                continue
            ours = [n for n in groups[0][key] if n.partner is None]
            theirs = [n for n in groups[1][key] if n.partner is None]
            if len(ours) != 1 or len(theirs) != 1:
                ancestor = _mapped_ancestor(node)
                if ancestor is None or ancestor.partner is None:
                    continue
                ours = [n for n in ours if _within(n, ancestor)]
                theirs = [n for n in theirs if _within(n, ancestor.partner)]
            if len(ours) != 1 or len(theirs) != 1 or self._body_elsewhere(node, theirs[0]):
                continue
            if self._weak_key(node) and self._dice(node, theirs[0]) == 0:
                continue  # ``while True`` alone says nothing: its body must agree a little
            self._link(node, theirs[0])
            linked.append((node, theirs[0]))
        return linked

    def _weak_key(self, node: _Node) -> bool:
        """True if a loop's header names nothing of the script's own (``while True``,
        ``for _ in range(3)``): many loops could have it."""
        field = "test" if isinstance(node.ast, ast.While) else "iter"
        head = next((c for c in node.children if c.field == field), None)
        if head is None:
            return True
        names = {n.label for n in self._tree_of(node).subtree(head) if n.kind == "Name"}
        return names <= _BUILTINS

    def _tree_of(self, node: _Node) -> _Tree:
        return self.new if self.new.of.get(id(node.ast)) is node else self.old

    def _anchor_calls(self) -> None:
        """A function's only call in each version is the same call (an addition to GumTree).

        Functions keep their identity by name (see recovery), so the one statement that
        calls ``train`` in each version is the same statement, whatever its arguments
        became: ``train(epoch)`` and ``train(args, model, device, loader, optimizer,
        epoch)``. This gives the loops around such calls evidence to pair on.
        """
        calls: tuple[dict[str, list[_Node]], dict[str, list[_Node]]] = (
            defaultdict(list),
            defaultdict(list),
        )
        for side, tree in enumerate((self.new, self.old)):
            for node in tree.nodes:
                callee = _called_function(node.ast)
                if callee is not None and self._shared(callee):
                    calls[side][callee].append(node)
        for callee, ours in calls[0].items():
            theirs = calls[1].get(callee, [])
            if len(ours) == len(theirs) == 1:
                a, b = ours[0], theirs[0]
                if a.partner is None and b.partner is None and a.kind == b.kind:
                    self._link(a, b)
                    self._recover(a, b)

    def _body_elsewhere(self, a: _Node, b: _Node) -> bool:
        """True if most of ``a``'s mapped descendants lie in an old node other than ``b``."""
        best = self._best_container(a)
        return best is not None and best[0] is not b

    def _best_container(self, node: _Node) -> tuple[_Node, float] | None:
        """The unmapped old node of ``node``'s kind holding most of its mapped descendants.

        Only one whose dice exceeds MIN_DICE (GumTree's bottom-up rule) is returned.
        """
        counts: Counter[int] = Counter()
        for descendant in self.new.subtree(node)[1:]:
            ancestor = descendant.partner.parent if descendant.partner else None
            while ancestor is not None:
                if ancestor.kind == node.kind and ancestor.partner is None:
                    counts[ancestor.pre] += 1
                ancestor = ancestor.parent
        best, best_key = None, (MIN_DICE, False)
        for pre, common in counts.items():
            candidate = self.old.nodes[pre]
            dice = 2 * common / (node.size + candidate.size - 2)
            key = (dice, candidate.label == node.label)
            if key > best_key:
                best, best_key = candidate, key
        return (best, best_key[0]) if best is not None else None

    def _top_down(self) -> None:
        """GumTree phase 1: isomorphic subtrees, tallest first; unique pairs at once."""
        heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = (
            [(-self.new.root.height, 0)],
            [(-self.old.root.height, 0)],
        )
        trees = (self.new, self.old)
        ambiguous: list[list[tuple[_Node, _Node]]] = []

        def pop_level(side: int) -> list[_Node]:
            heap, height, level = heaps[side], heaps[side][0][0], []
            while heap and heap[0][0] == height:
                level.append(trees[side].nodes[heapq.heappop(heap)[1]])
            return level

        def open_(side: int, node: _Node) -> None:
            for child in node.children:
                heapq.heappush(heaps[side], (-child.height, child.pre))

        while heaps[0] and heaps[1]:
            heights = (-heaps[0][0][0], -heaps[1][0][0])
            if max(heights) < MIN_HEIGHT:
                break
            if heights[0] != heights[1]:
                side = 0 if heights[0] > heights[1] else 1
                for node in pop_level(side):
                    open_(side, node)
                continue
            groups: tuple[dict[int, list[_Node]], dict[int, list[_Node]]] = ({}, {})
            for side in (0, 1):
                for node in pop_level(side):
                    if node.partner is None:
                        groups[side].setdefault(node.hash, []).append(node)
                    elif node.partner.hash == node.hash:  # an anchor whose bodies agree
                        pair = (node, node.partner) if side == 0 else (node.partner, node)
                        self._link_subtrees(*pair)
                    else:
                        open_(side, node)
            for digest, ours in groups[0].items():
                theirs = groups[1].get(digest)
                if theirs is None:
                    continue
                if len(ours) == len(theirs) == 1:
                    self._link_subtrees(ours[0], theirs[0])
                else:
                    ambiguous.append([(a, b) for a in ours for b in theirs])
            for side in (0, 1):
                for digest, nodes in groups[side].items():
                    if digest not in groups[1 - side]:
                        for node in nodes:
                            open_(side, node)
        # Duplicates inside blocks already mapped (the module, the loop anchors) are
        # paired in order first, as a line diff would; GumTree's parent-dice ranking
        # only settles what order cannot.
        for node in self.new.nodes:
            if node.partner is not None and node.hash != node.partner.hash:
                self._align_in_order(node, node.partner)
        for pairs in ambiguous:
            self._resolve(pairs)

    def _align_in_order(self, x: _Node, y: _Node) -> None:
        """Link identical children of two linked nodes along their longest common subsequence."""
        for field, ours in _by_field(x).items():
            theirs = _by_field(y).get(field)
            if not theirs:
                continue
            if x.holes:
                pairs = _weighted_lcs(ours, theirs, x.holes)
            else:
                matcher = difflib.SequenceMatcher(
                    None, [c.hash for c in ours], [c.hash for c in theirs], autojunk=False
                )
                pairs = [
                    (ours[i + k], theirs[j + k])
                    for i, j, size in matcher.get_matching_blocks()
                    for k in range(size)
                ]
            for p, q in pairs:
                if p.partner is None and q.partner is None:
                    self._link_subtrees(p, q)

    def _resolve(self, pairs: list[tuple[_Node, _Node]]) -> None:
        """Pick among duplicates: same parent, then parents' dice (GumTree), then neighbours."""
        dice_cache: dict[tuple[int, int], float] = {}

        def score(pair: tuple[_Node, _Node]) -> tuple[bool, float, int, int, int, int]:
            a, b = pair
            pa, pb = a.parent, b.parent
            if pa is None or pb is None:
                return (False, 0.0, 0, 0, -a.pre, -b.pre)
            key = (pa.pre, pb.pre)
            if key not in dice_cache:
                dice_cache[key] = self._dice(pa, pb)
            context = 0
            for step in (-1, 1):
                i, j = a.index + step, b.index + step
                if 0 <= i < len(pa.children) and 0 <= j < len(pb.children):
                    context += pa.children[i].partner is pb.children[j]
            from_end = (len(pa.children) - a.index) - (len(pb.children) - b.index)
            distance = min(abs(a.index - b.index), abs(from_end))
            return (pa.partner is pb, dice_cache[key], context, -distance, -a.pre, -b.pre)

        # Ranked once, as GumTree does: rescoring after every link is quadratic in the
        # group, and groups of repeated small expressions (``(x, y)``) can be large.
        for a, b in sorted(pairs, key=score, reverse=True):
            if a.partner is None and b.partner is None:
                self._link_subtrees(a, b)

    def _dice(self, a: _Node, b: _Node) -> float:
        """Share of the two nodes' descendants that are mapped onto each other."""
        if a.size + b.size <= 2:
            return 0.0
        end = b.pre + b.size
        common = sum(
            1
            for d in self.new.subtree(a)[1:]
            if d.partner is not None and b.pre < d.partner.pre < end
        )
        return 2 * common / (a.size + b.size - 2)

    def _bottom_up(self) -> None:
        """GumTree phase 2: a statement or block maps where most of its descendants went."""
        for node in reversed(self.new.nodes):  # children before parents
            if node.partner is not None or not node.children:
                continue
            if not isinstance(node.ast, _BLOCK_ITEMS):
                continue  # expressions are mapped by recovery, inside their statements
            found = self._best_container(node)
            if found is not None:
                self._link(node, found[0])
                self._recover(node, found[0])

    def _bottom_up_loops(self) -> None:
        """Loops whose evidence all agrees pair below GumTree's dice threshold (an addition).

        A loop rewritten around a few kept statements (``for i in range(0, n, bs)`` with
        ``optimizer.step()`` inside, today ``for x, y in enumerate(loader)``) shares too
        little to pass MIN_DICE. Each mapped statement of a loop's body votes for the
        innermost loop its counterpart sits in; two loops of one kind pair when each holds
        a strict majority of the other's votes.
        """
        for node in reversed(self.new.nodes):  # inner loops first
            if node.partner is not None or not isinstance(node.ast, _LOOPS):
                continue
            best = _elected(node)
            if best is None or best.partner is not None or best.kind != node.kind:
                continue
            if _elected(best) is node:
                self._link(node, best)
                self._recover(node, best)

    def _recover(self, a: _Node, b: _Node) -> None:
        """GumTree's recovery, simplified: pair leftover children by kind and similarity."""
        stack = [(a, b)]
        while stack:
            x, y = stack.pop()
            self._align_in_order(x, y)
            theirs = _by_field(y)
            for field, xs in _by_field(x).items():
                ys = theirs.get(field)
                if not ys:
                    continue
                if len(xs) == len(ys) and not isinstance(xs[0].ast, _BLOCK_ITEMS):
                    # Same-shaped expression slots: position is the evidence (targets, args).
                    pairs = [
                        (p, q)
                        for p, q in zip(xs, ys, strict=True)
                        if p.partner is None and q.partner is None and p.kind == q.kind
                    ]
                else:
                    pairs = self._similar_pairs(xs, ys)
                    pairs += self._sole_pairs(xs, ys, pairs)
                    pairs += self._same_call_pairs(xs, ys, pairs)
                for p, q in pairs:
                    self._link(p, q)
                    stack.append((p, q))

    def _same_call_pairs(
        self, xs: list[_Node], ys: list[_Node], taken: list[tuple[_Node, _Node]]
    ) -> list[tuple[_Node, _Node]]:
        """Leftover statements making the same call, whether or not its result is kept.

        An addition to GumTree's recovery: ``optimizer.step()`` and ``loss =
        optimizer.step(closure)`` differ in kind (an expression statement, an
        assignment) but make the same call. Paired only when the callee occurs once
        among the leftovers of each side, so repeated calls such as ``print`` stay apart.
        """
        used = {id(node) for pair in taken for node in pair}
        calls: tuple[dict[str, list[_Node]], dict[str, list[_Node]]] = (
            defaultdict(list),
            defaultdict(list),
        )
        for side, nodes in enumerate((xs, ys)):
            for node in nodes:
                if node.partner is None and id(node) not in used:
                    callee = _called_function(node.ast)
                    if callee is not None:
                        calls[side][callee].append(node)
        return [
            (ours[0], calls[1][callee][0])
            for callee, ours in calls[0].items()
            if len(ours) == len(calls[1].get(callee, [])) == 1
        ]

    def _sole_pairs(
        self, xs: list[_Node], ys: list[_Node], taken: list[tuple[_Node, _Node]]
    ) -> list[tuple[_Node, _Node]]:
        """Leftover blocks of one kind inside mapped parents, paired when the evidence agrees.

        An addition to GumTree's recovery, for loops and the like whose headers and bodies
        both changed (``for i in range(0, n, bs)`` -> ``for x, y in enumerate(loader)``).
        Loops pair by what they walk (:meth:`loop_key`) when that is unique on both sides;
        otherwise the only block of its kind left on each side pairs with the only one on
        the other, provided at least one of its descendants is already mapped into it.
        """
        used = {id(node) for pair in taken for node in pair}

        def left(nodes: list[_Node]) -> dict[str, list[_Node]]:
            kinds: dict[str, list[_Node]] = defaultdict(list)
            for node in nodes:
                free = node.partner is None and id(node) not in used
                if free and node.children and isinstance(node.ast, _COMPOUND):
                    kinds[node.kind].append(node)
            return kinds

        ours, theirs = left(xs), left(ys)
        pairs = []
        for kind, candidates in ours.items():
            others = theirs.get(kind, [])
            by_key: dict[int | None, list[_Node]] = defaultdict(list)
            for other in others:
                by_key[self.loop_key(other)].append(other)
            for p in candidates:
                key = self.loop_key(p)
                same = by_key.get(key, []) if key is not None else []
                mine = [c for c in candidates if self.loop_key(c) == key] if same else []
                if len(same) == len(mine) == 1:
                    pairs.append((p, same[0]))
                elif len(candidates) == len(others) == 1 and self._dice(p, others[0]) > 0:
                    pairs.append((p, others[0]))
        return pairs

    def _similar_pairs(self, xs: list[_Node], ys: list[_Node]) -> list[tuple[_Node, _Node]]:
        scored = []
        for p in xs:
            for q in ys:
                if p.partner is None and q.partner is None and p.kind == q.kind:
                    similarity = self._similarity(p, q)
                    if similarity >= MIN_SIMILARITY:
                        scored.append((similarity, -abs(p.index - q.index), -p.pre, -q.pre, p, q))
        scored.sort(key=lambda item: item[:4], reverse=True)
        taken: set[int] = set()
        pairs = []
        for *_, p, q in scored:
            if id(p) not in taken and id(q) not in taken:
                taken.update((id(p), id(q)))
                pairs.append((p, q))
        return pairs

    def _similarity(self, p: _Node, q: _Node) -> float:
        if isinstance(p.ast, _DEFS) and p.label == q.label:
            return 1.0  # a function keeps its identity through any rewrite of its body
        ours, theirs = self._bag(p, self.new), self._bag(q, self.old)
        total = sum(ours.values()) + sum(theirs.values())
        if total == 0:
            return 1.0  # ``pass``, ``break``: nothing but their kind, which agrees
        common = sum((ours & theirs).values())
        similarity = max(2 * common / total, self._dice(p, q))
        callee = _called_function(p.ast)
        if callee is not None and callee == _called_function(q.ast) and self._shared(callee):
            # The same function of the file, called with other arguments: as a function
            # keeps its identity, so does a call to it (an addition).
            return MIN_SIMILARITY + similarity * (1 - MIN_SIMILARITY)
        return similarity

    def _shared(self, callee: str) -> bool:
        """True if ``callee`` (``train``, ``self.train``) names a function both versions define."""
        return callee.split(".")[-1] in self.shared_functions

    def _bag(self, node: _Node, tree: _Tree) -> Counter[tuple[str, str]]:
        """The labelled tokens of a subtree: names, constants, attributes, operators.

        Only labelled ones: on a small statement the unlabelled structure (Expr,
        Call) would outweigh the identifiers that say what the statement does. An
        attribute of ``self`` counts as a plain name: code moved into a method keeps its
        variables as the instance's (``self.opt.step()`` is ``opt.step()``).
        """
        if id(node) not in self._tokens:
            bag: Counter[tuple[str, str]] = Counter()
            for n in tree.subtree(node):
                if n.kind == "Attribute" and n.children and _is_self(n.children[0]):
                    bag["Name", n.label] += 1
                elif n.label and not (_is_self(n) and n.field == "value"):
                    bag[n.kind, n.label] += 1
            self._tokens[id(node)] = bag
        return self._tokens[id(node)]

    def name_votes(self, scopes: _Scopes) -> dict[tuple[int, str], Counter[str]]:
        """For each (new scope, new name): the old names its mapped occurrences got."""
        votes: dict[tuple[int, str], Counter[str]] = defaultdict(Counter)
        for node in self.new.nodes:
            partner = node.partner
            if partner is None or partner.kind != node.kind:
                continue
            if isinstance(node.ast, (ast.Name, ast.arg)):
                scope = scopes.scope_of.get(id(node.ast))
                votes[(id(scope), node.label)][partner.label] += 1
        return votes

    def stands_for(
        self,
        stmt: ast.stmt,
        container: _Node,
        field: str,
        functions: Mapping[str, list[ast.FunctionDef | ast.AsyncFunctionDef]],
    ) -> list[ast.stmt]:
        """Old statements of the block that a new statement without counterpart stands for.

        A new block wrapping old code (``if args.use_optimizer: optimizer.step() else:
        <the old update loop>``) stands for the old statements its own statements map
        to. And when a train step is extracted into ``def train_epoch()``, the new call
        ``train_epoch(...)`` has no counterpart, but the function's body maps onto the
        old inline code: the call stands for those old statements. Either way a
        statement after the new one goes after them.

        container, field: the old block, as the old counterpart of the new
        statement's parent and the field holding the statement.
        functions: the new file's functions by name.
        """
        old_block: dict[int, ast.stmt] = {}
        own = self.new.of.get(id(stmt))
        if own is None:
            return []  # a requested statement: not in the tree, it stands for nothing old
        for item in self.new.subtree(own)[1:]:
            if item.partner is not None and isinstance(item.ast, ast.stmt):
                top = _block_level(item.partner, container, field)
                if top is not None and isinstance(top.ast, ast.stmt):
                    old_block[top.index] = top.ast
        seen: set[int] = set()
        pending = [stmt]
        while pending:
            node = pending.pop()
            for call in ast.walk(node):
                key = _call_key(call) if isinstance(call, ast.Call) else None
                if key is None:
                    continue
                for definition in functions.get(key[0], []):
                    parent = self.new.of[id(definition)].parent
                    is_method = parent is not None and parent.kind == "ClassDef"
                    if id(definition) in seen or is_method != key[1]:
                        continue
                    seen.add(id(definition))
                    pending.extend(definition.body)
                    for item in self.new.subtree(self.new.of[id(definition)]):
                        if item.partner is not None and isinstance(item.ast, ast.stmt):
                            top = _block_level(item.partner, container, field)
                            if top is not None and isinstance(top.ast, ast.stmt):
                                old_block[top.index] = top.ast
        if not old_block:
            # The other way round: the old version had the code in a function that the
            # block calls (``train_epoch(...)``), today it is inline; the call stands for it.
            called: set[tuple[str, bool]] = set()  # (name, is a method)
            for item in self.new.subtree(own):
                if item.partner is not None and isinstance(item.ast, ast.stmt):
                    function = _enclosing_function(item.partner)
                    if function is not None and function.parent is not None:
                        called.add((function.label, function.parent.kind == "ClassDef"))
            for index, old in enumerate(getattr(container.ast, field, [])):
                for call in ast.walk(old):
                    if isinstance(call, ast.Call) and _call_key(call) in called:
                        old_block[index] = old
        return [old_block[index] for index in sorted(old_block)]


# --- Placing -------------------------------------------------------------------------


def _weighted_lcs(
    ours: list[_Node], theirs: list[_Node], holes: set[int]
) -> list[tuple[_Node, _Node]]:
    """A longest common subsequence of identical subtrees that keeps the holes' neighbours.

    Where several alignments are equally long (``b; <stmt>; b; a`` against
    ``b; a``: which ``b`` was deleted?), prefer the one that maps the statement
    just before a requested statement, then the one just after: those are what
    it will be placed by.
    """
    big = 3 * len(holes) + 1  # more than all bonuses together: length comes first

    def weight(node: _Node) -> int:
        return big + 2 * (node.index + 1 in holes) + (node.index in holes)

    n, m = len(ours), len(theirs)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below = best[i], best[i + 1]
        for j in range(m - 1, -1, -1):
            value = max(below[j], row[j + 1])
            if ours[i].hash == theirs[j].hash:
                value = max(value, weight(ours[i]) + below[j + 1])
            row[j] = value
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if ours[i].hash == theirs[j].hash and best[i][j] == weight(ours[i]) + best[i + 1][j + 1]:
            pairs.append((ours[i], theirs[j]))
            i, j = i + 1, j + 1
        elif best[i][j] == best[i + 1][j]:
            i += 1
        else:
            j += 1
    return pairs


def _elected(loop: _Node) -> _Node | None:
    """The loop on the other side holding a strict majority of ``loop``'s mapped statements.

    Each mapped statement of the loop's body votes for the innermost loop around its
    counterpart, or for none when that is outside any loop. A nested loop does not vote:
    where it went says little about the loop around it, since training steps are often
    extracted into a function called from the loop.
    """
    votes: Counter[int] = Counter()
    by_id: dict[int, _Node] = {}
    cast = 0
    for item in loop.children:
        if item.partner is None or not isinstance(item.ast, ast.stmt):
            continue
        if isinstance(item.ast, _LOOPS):
            continue
        cast += 1
        other = _innermost_loop(item.partner)
        if other is not None:
            votes[id(other)] += 1
            by_id[id(other)] = other
    ranked = votes.most_common(1)
    if not ranked or 2 * ranked[0][1] <= cast:
        return None
    return by_id[ranked[0][0]]


def _innermost_loop(node: _Node) -> _Node | None:
    ancestor = node.parent
    while ancestor is not None and not isinstance(ancestor.ast, _LOOPS):
        ancestor = ancestor.parent
    return ancestor


def _enclosing_function(node: _Node) -> _Node | None:
    ancestor = node.parent
    while ancestor is not None and not isinstance(ancestor.ast, _FUNCTION_DEFS):
        ancestor = ancestor.parent
    return ancestor


def _call_key(call: ast.Call) -> tuple[str, bool] | None:
    """``(name, False)`` for ``f(...)``, ``(name, True)`` for a method call ``x.f(...)``.

    So that ``model.train()`` is not taken for a call to a module's ``def train``.
    """
    func = call.func
    if isinstance(func, ast.Name):
        return func.id, False
    if isinstance(func, ast.Attribute):
        return func.attr, True
    return None


def _is_self(node: _Node) -> bool:
    return node.kind == "Name" and node.label == "self"


def _mapped_ancestor(node: _Node) -> _Node | None:
    ancestor = node.parent
    while ancestor is not None and ancestor.partner is None:
        ancestor = ancestor.parent
    return ancestor


def _within(node: _Node, container: _Node) -> bool:
    return container.pre < node.pre < container.pre + container.size


def _called_function(stmt: ast.AST) -> str | None:
    """The callee of a statement that is a call (``train(...)``, ``acc = test(...)``).

    ``self.`` is left out: a function that became a method is called the same.
    """
    value = getattr(stmt, "value", None)
    if not isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Return)):
        return None
    if isinstance(value, ast.Await):
        value = value.value
    if not isinstance(value, ast.Call):
        return None
    parts = []
    func: ast.expr = value.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    if func.id != "self" or not parts:
        parts.append(func.id)
    return ".".join(reversed(parts))


def _methods(node: _Node) -> dict[str, _Node]:
    """A class's methods by name, leaving out names it defines more than once (a
    property's getter and setter)."""
    found: dict[str, list[_Node]] = defaultdict(list)
    for child in node.children:
        if child.field == "body" and isinstance(child.ast, _FUNCTION_DEFS):
            found[child.ast.name].append(child)
    return {name: nodes[0] for name, nodes in found.items() if len(nodes) == 1}


def _wrapped_iterable(call: _Node, is_loop_call: _IsLoopCall) -> _Node | None:
    """What a wrapper call such as ``enumerate(xs)`` or ``rl.loop("step", xs)`` iterates over."""
    node = call.ast
    assert isinstance(node, ast.Call)
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if is_loop_call(node):
        position = 1  # rl.loop(name, iterable)
    elif (isinstance(func, ast.Name) and name in _ITERATION_WRAPPERS) or name == "tqdm":
        position = 0
    else:
        return None
    args = [child for child in call.children if child.field == "args"]
    if len(args) > position and not isinstance(args[position].ast, ast.Starred):
        return args[position]
    for keyword in call.children:
        if keyword.field == "keywords" and keyword.label == "iterable" and keyword.children:
            return keyword.children[0]
    return None


def _by_field(node: _Node) -> dict[str, list[_Node]]:
    fields: dict[str, list[_Node]] = defaultdict(list)
    for child in node.children:
        fields[child.field].append(child)
    return fields


def _block_level(node: _Node, container: _Node, field: str) -> _Node | None:
    """The ancestor-or-self of ``node`` that is a statement of ``container``'s ``field`` block."""
    while node.parent is not None:
        if node.parent is container:
            return node if node.field == field else None
        node = node.parent
    return None


def _inside(node: _Node, container: _Node, field: str) -> bool:
    """True if ``node`` lies within ``container``'s ``field`` block (at any depth)."""
    while node.parent is not None:
        if node.parent is container:
            return node.field == field
        node = node.parent
    return False
