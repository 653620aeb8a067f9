"""docs/architecture.md stays true: its module map lists every module of the package and
nothing else, and its layer diagram and rank table agree with tests/test_layers.py's ranks."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import retrolog

SOURCE = Path(retrolog.__file__).parent
DOC = Path(__file__).parents[1] / "docs" / "architecture.md"


def _layer_ranks() -> dict[str, int]:
    """tests/test_layers.py's ``RANKS``: the one place the ranks are written."""
    spec = importlib.util.spec_from_file_location(
        "_layer_check", Path(__file__).with_name("test_layers.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.RANKS)


RANKS = _layer_ranks()


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def listed_modules(text: str) -> set[str]:
    """The module map's modules, as paths under src/retrolog.

    A row's first cell names modules in backticks: a path (``_replay/plan.py``), or a file
    name beside the previous one (``_replay/propagate.py``, ``_align.py``); a package's row
    (``**store/**``) stands for its ``__init__.py``."""
    found = set()
    for line in _section(text, "Modules").splitlines():
        if not line.startswith("| ") or line.startswith("| module") or line.startswith("|---"):
            continue
        cell = line.split("|")[1]
        package = re.fullmatch(r"\s*\*\*(\S+)/\*\*\s*", cell)
        if package:
            found.add(f"{package.group(1)}/__init__.py")
            continue
        directory = ""
        for name in re.findall(r"`([^`]+)`", cell):
            name = name.removeprefix("retrolog/")
            if not name.endswith(".py"):
                continue
            if "/" in name:
                directory = name.rsplit("/", 1)[0] + "/"
                found.add(name)
            else:
                found.add(directory + name)
    return found


def test_the_module_map_lists_every_module_and_only_those() -> None:
    listed = listed_modules(DOC.read_text())
    present = {path.relative_to(SOURCE).as_posix() for path in SOURCE.rglob("*.py")}
    assert not present - listed, (
        f"modules missing from docs/architecture.md's module map: {sorted(present - listed)}"
    )
    assert not listed - present, (
        f"docs/architecture.md lists modules that do not exist: {sorted(listed - present)}"
    )


def test_the_diagram_and_the_rank_table_agree_with_the_layer_check() -> None:
    text = DOC.read_text()
    table = {}
    for rank, names in re.findall(r"^\| (\d+) \| (.+?) \|$", text, flags=re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", names):
            table[name] = int(rank)
    assert table == RANKS, "docs/architecture.md's rank table differs from tests/test_layers.py"
    diagram = text[text.index("```") + 3 : text.index("```", text.index("```") + 3)]
    drawn = {}
    for rank, row in re.findall(r"^\s*(\d+)\s+([^│]+)", diagram, flags=re.MULTILINE):
        for name in RANKS:
            if re.search(rf"(?<![\w/.]){re.escape(name)}(?![\w])", row):
                drawn.setdefault(name, int(rank))
    assert drawn == RANKS, "docs/architecture.md's diagram differs from its rank table"


def test_the_map_reader_follows_a_file_name_to_its_directory() -> None:
    text = (
        "## Modules\n\n| module | job | note |\n|---|---|---|\n"
        "| **store/** | x | |\n| `_replay/propagate.py`, `_align.py` | x | |\n"
        "| `retrolog/__init__.py` | x | |\n| `ui/static/` | x | |\n"
    )
    assert listed_modules("\n" + text) == {
        "store/__init__.py",
        "_replay/propagate.py",
        "_replay/_align.py",
        "__init__.py",
    }
