"""How an uncaught exception is stored with a crashed run, and read back for its replay."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from retrolog._replay.crashed import _recorded_line
from retrolog.runtime.crash import Crash


@pytest.mark.parametrize(
    "crash",
    [
        Crash("FloatingPointError", "loss is NaN at epoch 3", "train.py", 25, "train_epoch"),
        Crash("ValueError", "a message [at x.py:3 in f]\nover lines", "src/m.py", 7, "<module>"),
        Crash("KeyboardInterrupt", ""),
        Crash("RuntimeError", "no place recorded"),
    ],
)
def test_a_crash_reads_back_from_its_stored_text(crash: Crash) -> None:
    assert Crash.parse(crash.text()) == crash


def test_text_that_names_no_exception_is_no_crash() -> None:
    assert Crash.parse("the process died without ending the run (killed?)") is None
    assert Crash.parse(None) is None


def test_the_place_is_the_last_frame_in_the_projects_own_code(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("def check(x):\n    return sorted(x, key=len)\n")
    venv = tmp_path / ".venv" / "lib" / "site-packages"
    venv.mkdir(parents=True)
    (venv / "lib_in_project.py").write_text("def call(f, x):\n    return f(x)\n")
    sys.path[:0] = [str(tmp_path), str(venv)]
    try:
        import helpers  # type: ignore[import-not-found]
        import lib_in_project  # type: ignore[import-not-found]

        try:
            lib_in_project.call(helpers.check, [1, 2])  # len(1) raises inside the builtin
        except TypeError:
            crash = Crash.of(*sys.exc_info(), root=tmp_path)  # type: ignore[arg-type]
    finally:
        del sys.path[:2]
        sys.modules.pop("helpers", None)
        sys.modules.pop("lib_in_project", None)
    assert (crash.type, crash.file, crash.line, crash.function) == (
        "TypeError", "helpers.py", 2, "check",
    )  # fmt: skip


def test_a_replayed_line_maps_back_to_the_recorded_version() -> None:
    old = "a\nb\nraise X\nc\n"
    new = "a\nlog(1)\nb\nraise X\nlog(2)\nc\n"
    assert _recorded_line(old, new, 4) == 3
    assert _recorded_line(old, new, 1) == 1
    assert _recorded_line(old, new, 2) is None  # a statement the replay added
    assert _recorded_line(old, new, 6) == 4
