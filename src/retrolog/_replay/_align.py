"""Match the syntax trees of two versions of a file, GumTree-style.

Falleri et al., "Fine-grained and accurate source code differencing" (ASE 2014),
adapted to Python's :mod:`ast` for propagation (see propagate.py): ``rl.loop``
loops with the same name first, as anchors; then identical subtrees top-down,
largest first; then statements and blocks bottom-up by their share of matched
descendants; then a recovery pass inside matched blocks. The result is a partial
one-to-one mapping, each :class:`_Node`'s ``partner``, and what propagation reads
off it: the old names a new name was aligned with, the old statements a call to
a newly extracted function stands for. Where a statement goes is decided in
propagate.py, not here.
"""

from __future__ import annotations

import ast
import difflib
import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping

from retrolog._replay._scopes import _BLOCK_ITEMS, _DEFS, _children, _Scopes

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

    def run(self, new_loop: _LoopName, old_loop: _LoopName) -> None:
        # GumTree maps the roots last; mapping them first lets top-level candidates
        # use "same parent" when duplicates are resolved.
        self._link(self.new.root, self.old.root)
        self._anchor_loops(new_loop, old_loop)
        self._top_down()
        self._bottom_up()
        for node in self.new.nodes:
            if node.partner is not None and node.hash != node.partner.hash:
                self._recover(node, node.partner)

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
            if best is not None:
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
                for p, q in pairs:
                    self._link(p, q)
                    stack.append((p, q))

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
        return max(2 * common / total, self._dice(p, q))

    def _bag(self, node: _Node, tree: _Tree) -> Counter[tuple[str, str]]:
        """The labelled tokens of a subtree: names, constants, attributes, operators.

        Only labelled ones: on a small statement the unlabelled structure (Expr,
        Call) would outweigh the identifiers that say what the statement does.
        """
        if id(node) not in self._tokens:
            bag = Counter((n.kind, n.label) for n in tree.subtree(node) if n.label)
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

    def inlined(
        self,
        stmt: ast.stmt,
        container: _Node,
        field: str,
        functions: Mapping[str, list[ast.FunctionDef | ast.AsyncFunctionDef]],
    ) -> list[ast.stmt]:
        """Old statements of the block that a new statement's call stands for.

        When a train step is extracted into ``def train_epoch()``, the new call
        ``train_epoch(...)`` has no counterpart, but the function's body maps onto
        the old inline code: the call stands for those old statements, so a
        statement after the call goes after them.

        container, field: the old block, as the old counterpart of the new
        statement's parent and the field holding the statement.
        functions: the new file's functions by name.
        """
        old_block: dict[int, ast.stmt] = {}
        seen: set[int] = set()
        pending = [stmt]
        while pending:
            node = pending.pop()
            for call in ast.walk(node):
                if not isinstance(call, ast.Call):
                    continue
                func = call.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                for definition in functions.get(name or "", []):
                    if id(definition) in seen:
                        continue
                    seen.add(id(definition))
                    pending.extend(definition.body)
                    for item in self.new.subtree(self.new.of[id(definition)]):
                        if item.partner is not None and isinstance(item.ast, ast.stmt):
                            top = _block_level(item.partner, container, field)
                            if top is not None and isinstance(top.ast, ast.stmt):
                                old_block[top.index] = top.ast
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
