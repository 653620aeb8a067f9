"""The installed modules a run lists for replay's fork server (runtime/modules.py)."""

from __future__ import annotations

import types
from pathlib import Path

from retrolog.runtime.modules import decode, installed, valid_name

from conftest import Project, read_db

# A script that imports multiprocessing, as every torch script does (torch imports it):
# multiprocessing names the script's module ``__mp_main__`` as well as ``__main__``.
SCRIPT = """\
import multiprocessing
import sys

import retrolog as rl

assert sys.modules["__mp_main__"] is sys.modules["__main__"]
for epoch in rl.loop("epoch", range(1)):
    rl.log("x", epoch)
"""


def test_the_script_is_never_listed_under_another_name(project: Project) -> None:
    """The writer may list the items after the script has ended, when CPython has
    already deleted ``__main__.__file__``: the alias must still be told apart. (It was
    stored whenever the writer listed late, in short runs or behind a busy machine's
    training, so two runs of one script could store different sets.)"""
    project.write("train.py", SCRIPT)
    for _ in range(4):
        project.run("train.py")
    digests = {d for (d,) in read_db(project.root, "SELECT modules FROM runs")}
    assert len(digests) == 1 and None not in digests
    ((blob,),) = read_db(project.root, "SELECT names FROM module_sets")
    names = decode(blob)
    assert names is not None and "xxhash" in names  # installed, imported by retrolog
    assert not [n for n in names if n.partition(".")[0] in ("__main__", "__mp_main__", "train")]


def test_an_alias_of_the_script_without_its_file_is_left_out(tmp_path: Path) -> None:
    script = types.ModuleType("__main__")  # as at the script's end: no __file__
    installed_module = types.ModuleType("somepkg")
    installed_module.__file__ = "/usr/lib/python3/site-packages/somepkg/__init__.py"
    local = types.ModuleType("models")
    local.__file__ = str(tmp_path / "models.py")
    items = [
        ("__main__", script),
        ("somepkg", installed_module),
        ("__mp_main__", script),
        ("helpers", script),  # any other name for the same module object
        ("models", local),
        ("json", types.ModuleType("json")),
    ]
    assert installed(items, tmp_path) == ["somepkg"]
    assert installed(iter(items), tmp_path) == ["somepkg"]  # any iterable, read once


def test_a_stored_set_naming_the_script_never_makes_a_fork_server_import_it() -> None:
    assert not valid_name("__mp_main__")
    assert not valid_name("__main__")
    assert not valid_name("pkg.__mp_main__")
    assert valid_name("torch._dynamo")
