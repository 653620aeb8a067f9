"""Today's module-level definitions (functions, classes, constants, imports) that the
requested statements use, carried into the old file when it lacks them or has them
otherwise, under a name that leaves the old code calling its own."""

from __future__ import annotations

import ast
from typing import Any

from retrolog._replay._scopes import _BUILTINS as _BUILTIN_NAMES
from retrolog._replay.propagate.records import _Edit, _Outcome
from retrolog._replay.propagate.source import _first_line, _Source
from retrolog.versions.definitions import (
    Binding,
    canonical,
    global_reads,
    module_bindings,
    rename_globals,
)


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
