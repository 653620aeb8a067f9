"""The installed modules a run had imported when training started, for fast replay start-up.

A replay worker repeats its script's start: the interpreter, ``import torch``
(1.7 s here) and the modules torch imports lazily later (``torch._dynamo`` at
the first optimizer: 1.8 s more). A fork server that has imported them once
hands every worker a process where they are already loaded
(_replay/forkserver.py). Which ones to import is what the run itself
imported: at its first top-level loop the run lists ``sys.modules``, keeps the
installed ones (not the project's own, not the standard library's, not
retrolog), and the writer stores the list once per distinct list
(``module_sets``, keyed by its digest; ``runs.modules`` names it), about 10 KB
compressed for a torch script.

A list read back from a store only ever names modules to import: the fork
server imports a name only if it is a dotted identifier under a top-level
package that the replayed script itself imports (:func:`decode` checks the
names; the replayer filters by package), so a tampered store cannot make a
replay import anything the script would not.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Most names a set may hold, and its largest decompressed size: a torch script has
# about 1,700 names and 52 KB.
MAX_NAMES = 50_000
MAX_BYTES = 4 << 20

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
# Top-level names of the standard library and the built-in modules.
STDLIB: frozenset[str] = frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(
    sys.builtin_module_names
)


def valid_name(name: object) -> bool:
    """A dotted module name that may be imported by a fork server."""
    return (
        isinstance(name, str)
        and len(name) <= 300
        and _NAME.match(name) is not None
        and not {"__main__", "__mp_main__"} & set(name.split("."))
    )


def installed(items: Iterable[tuple[str, Any]], root: Path) -> list[str]:
    """The names in ``items`` (``sys.modules`` items, in import order) of installed modules.

    Left out: the standard library (cheap, and always there), retrolog (a worker
    must import it itself: it reads its spec at import), ``__main__``, modules
    whose file is in the project (``root``: their code is the run's version, which
    differs from replay to replay), the script itself under any other name, and
    anything that is not a module with a name :func:`valid_name` accepts.
    """
    root_text = str(root.resolve())
    items = list(items)
    # The script under another name (multiprocessing's ``__mp_main__``), told by identity:
    # once the script has ended, CPython has deleted ``__main__.__file__``, and a writer
    # listing the items after that would not see it as the project's.
    script = next((module for name, module in items if name == "__main__"), None)
    names: list[str] = []
    for name, module in items:
        top = name.partition(".")[0]
        if top in STDLIB or top == "retrolog" or not valid_name(name):
            continue
        if script is not None and module is script:
            continue
        try:
            namespace = vars(module)
        except TypeError:  # not a module: some packages put other objects in sys.modules
            continue
        path = namespace.get("__file__")
        if isinstance(path, str) and _under(path, root_text):
            continue
        names.append(name)
    return _canonical(names)


def _canonical(names: list[str]) -> list[str]:
    """Packages in the order they were first imported, each one's modules sorted.

    The order across packages can matter (which OpenMP runtime loads first); within
    a package it varies from run to run (set iteration), and sorting it gives runs
    of the same script the same list, stored once.
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.partition(".")[0], []).append(name)
    return [name for group in groups.values() for name in sorted(group)]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def encode(names: list[str]) -> tuple[str, bytes]:
    """(digest, compressed JSON) of a list of names: the key and value of ``module_sets``."""
    text = json.dumps(names, separators=(",", ":")).encode()
    return hashlib.sha256(text).hexdigest()[:32], zlib.compress(text, 6)


def decode(blob: bytes | None) -> list[str] | None:
    """The names stored by :func:`encode`; None when the blob is not such a list.

    Decompressed with a bound (a store is untrusted input), and every name checked.
    """
    if not isinstance(blob, bytes | bytearray | memoryview):
        return None
    try:
        inflater = zlib.decompressobj()
        text = inflater.decompress(bytes(blob), MAX_BYTES)
        if inflater.unconsumed_tail:
            return None
        names = json.loads(text)
    except (zlib.error, ValueError, RecursionError):
        return None
    if not isinstance(names, list) or len(names) > MAX_NAMES:
        return None
    return [name for name in names if valid_name(name)]
