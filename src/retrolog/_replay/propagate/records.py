"""What propagation returns (a :class:`Propagation` with its placements and refusals), and
the records its phases pass on: where a unit goes, the text edit, and what came of it."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass

from retrolog._replay.propagate.source import _lines, _Unit


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
