"""Where a unit goes: the old counterpart of its nearest matched sibling (after the one
before it, else before the one after it, else the start of the counterpart block), or
why that would be a guess."""

from __future__ import annotations

import ast

from retrolog._replay._align import _inside, _Node
from retrolog._replay._scopes import _DEFS
from retrolog._replay.propagate.aligned import _Aligned
from retrolog._replay.propagate.explain import _FIELD_WORDS, _describe_owner
from retrolog._replay.propagate.records import _Spot
from retrolog._replay.propagate.source import _loop_name, _must_stay_first


class _Spotting(_Aligned):
    """The aligned spot in the old tree."""

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
