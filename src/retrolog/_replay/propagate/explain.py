"""The wording of propagation's refusals: the block a statement sits in, what the old
version lacks, and a requested name no statement logs."""

from __future__ import annotations

import ast
import difflib

from retrolog._replay._scopes import _DEFS


def _unknown_names_message(missing: list[str], logged: set[str]) -> str:
    asked = ", ".join(repr(name) for name in missing)
    if not logged:
        return f"The new version logs no {asked}; it has no rl.log() call with a literal name."
    known = ", ".join(sorted(logged))
    message = f"The new version logs no {asked}; the names it logs are: {known}."
    close = difflib.get_close_matches(missing[0], sorted(logged), n=1)
    return message + (f" Did you mean {close[0]!r}?" if close else "")


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
