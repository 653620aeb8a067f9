"""The replay worker's write guard on its own: which paths are the user's, and what it does.

The guard is called as the audit hook would call it, without installing it (a hook
cannot be removed). The replayed scripts of tests/replay/test_replay_isolation.py
run it for real.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from retrolog.runtime.isolation import _Guard


def _layout(tmp_path: Path) -> tuple[_Guard, Path, Path, Path]:
    """A project whose ``out`` links to a scratch directory, and a checkout linking it back."""
    project, scratch, checkout = tmp_path / "proj", tmp_path / "scratch", tmp_path / "checkout"
    for directory in (project / ".retrolog", scratch / "out" / "sub", checkout):
        directory.mkdir(parents=True)
    (scratch / "out" / "result.txt").write_text("the user's")
    (project / "out").symlink_to(scratch / "out")
    (checkout / "out").symlink_to(project / "out")  # as the checkout links it
    return _Guard(checkout, project, [project / ".retrolog"]), project, scratch, checkout


def _write(guard: _Guard, path: Path | str) -> None:
    guard("open", (str(path), "w", os.O_WRONLY | os.O_CREAT | os.O_TRUNC))


def test_a_write_through_a_link_to_a_scratch_directory_gets_a_private_copy(
    tmp_path: Path,
) -> None:
    guard, _, scratch, checkout = _layout(tmp_path)
    _write(guard, checkout / "out" / "result.txt")
    mine = checkout / "out" / "result.txt"
    assert not (checkout / "out").is_symlink() and not mine.is_symlink()
    assert mine.read_text() == "the user's"
    assert (checkout / "out" / "sub").resolve() == scratch / "out" / "sub"  # still readable
    mine.write_text("the replay's")
    assert (scratch / "out" / "result.txt").read_text() == "the user's"


def test_dotdot_after_a_link_into_the_project_is_refused(tmp_path: Path) -> None:
    # The system takes `..` after out/sub from where out/sub leads: the user's out/.
    guard, _, scratch, checkout = _layout(tmp_path)
    with pytest.raises(PermissionError, match="never changes your files"):
        _write(guard, f"{checkout}/out/sub/../result.txt")
    assert (scratch / "out" / "result.txt").read_text() == "the user's"


def test_an_absolute_path_through_the_projects_link_is_refused(tmp_path: Path) -> None:
    guard, project, _, _ = _layout(tmp_path)
    with pytest.raises(PermissionError, match="never changes your files"):
        _write(guard, project / "out" / "result.txt")


def test_writes_below_the_store_and_outside_the_project_are_left_alone(tmp_path: Path) -> None:
    guard, project, _, checkout = _layout(tmp_path)
    _write(guard, project / ".retrolog" / "worker.json")
    _write(guard, tmp_path / "elsewhere.txt")
    assert (checkout / "out").is_symlink()  # nothing was copied
