"""The package's layers point one way (docs/architecture.md): each module imports only
from layers below its own, from its own package, and from ``errors``. Read from the
source's import statements, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import retrolog

SOURCE = Path(retrolog.__file__).parent

# Rank per top-level package or module: a module may import only lower ranks (and its own
# package, and errors). The UI goes through Project alone, as the CLI and the API do.
RANKS = {
    "errors": 0,
    "_config": 0,
    "store": 1,
    "versions": 2,
    "checkpoint": 2,
    "runtime": 3,
    "_query": 3,
    "_replay": 4,
    "_gc": 4,
    "_migrate": 4,
    "_project": 5,
    "_api": 6,
    "_restore": 7,
    "_handsfree": 7,
    "ui": 8,
    "integrations": 8,
    "cli": 9,
    "__init__": 10,
    "__main__": 10,
}


def imports(path: Path) -> set[str]:
    """The retrolog top-level packages and modules ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "retrolog" and len(parts) > 1:
                found.add(parts[1])
    return found


def layer(path: Path) -> str:
    rel = path.relative_to(SOURCE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_module_imports_only_below_its_layer() -> None:
    wrong = []
    modules = sorted(SOURCE.rglob("*.py"))
    assert len(modules) > 40
    for path in modules:
        own = layer(path)
        assert own in RANKS, f"{path}: add its layer to RANKS (and to docs/architecture.md)"
        for target in imports(path) - {own, "errors"}:
            if RANKS.get(target, 99) >= RANKS[own]:
                wrong.append(f"{path.relative_to(SOURCE)} imports retrolog.{target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_ui_goes_through_project_alone() -> None:
    for path in sorted((SOURCE / "ui").rglob("*.py")):
        assert imports(path) <= {"_project", "errors", "ui"}, path


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from retrolog._query.runs import matching_runs\n")
    assert imports(module) == {"_query"}


def store_imports(path: Path) -> set[str]:
    """The modules of retrolog.store that ``path`` imports (inside functions and under
    TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "retrolog.store":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("retrolog.store."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("retrolog.store."):
                    found.add(alias.name.split(".")[2])
    return found


def test_the_store_modules_import_one_way() -> None:
    # The metadata seam (metastore) names its backends in a registry, imported by name
    # when one is opened; the backends import the seam, never the other way round.
    graph = {
        path.stem: store_imports(path) - {path.stem}
        for path in sorted((SOURCE / "store").glob("*.py"))
    }
    assert {"metastore", "sqlite_metadata", "postgres_metadata"} <= graph.keys()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "an import cycle in retrolog.store: " + " -> ".join(
            (*path[path.index(module) :], module)
        )
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
