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
Step 2 lives in _replay/_align.py, the scope analysis behind step 4 in
_replay/_scopes.py. This package's modules, in the order a propagation uses them:

- source.py: a version read (its retrolog names, the requested statements);
- aligned.py: the two versions aligned, the state the phases below read;
- spot.py: where a unit goes in the old tree (step 3);
- place.py: its text with the old file's names, and the edit (steps 3 and 4);
- carry.py: today's helpers the statements use, carried into the old file;
- hooks.py: today's methods and classes the old version lacks, carried whole;
- imports.py: the retrolog import for an old file without one (step 5);
- propagator.py: every unit of one version, then the propagated file;
- records.py: what propagation returns; explain.py: the wording of its refusals.

See docs/propagation.md for the rules and a table of cases.
"""

from __future__ import annotations

from collections.abc import Sequence

from retrolog._replay._align import MIN_DICE as MIN_DICE
from retrolog._replay._align import MIN_HEIGHT as MIN_HEIGHT
from retrolog._replay._align import MIN_SIMILARITY as MIN_SIMILARITY
from retrolog._replay._align import _Alignment, _Tree
from retrolog._replay._scopes import _scopes
from retrolog._replay.propagate.propagator import _Propagator
from retrolog._replay.propagate.records import (
    AddedImport,
    Placement,
    Propagation,
    Unplaceable,
)
from retrolog._replay.propagate.source import (
    LogStatement,
    _loop_name,
    _parse,
    _requested,
    _units,
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
