"""The import clock (runtime/import_clock.py): what a recording's prefix spent importing
installed packages after its first retrolog call, which a forked replay worker skips."""

from __future__ import annotations

import importlib
import importlib._bootstrap as bootstrap
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from retrolog.runtime.import_clock import ImportClock

from conftest import Project, read_db

SLOW = "import time\ntime.sleep({seconds})\n"


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for packages made up by a test; they are unloaded after."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        del sys.modules[name]


def package(where: Path, name: str, seconds: float, body: str = "") -> None:
    (where / name).mkdir(parents=True)
    (where / name / "__init__.py").write_text(SLOW.format(seconds=seconds) + body)


def test_it_times_installed_packages_loaded_on_its_thread_only(site: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    package(site, "slowpkg", 0.3, body="from slowpkg import inner\n")
    (site / "slowpkg" / "inner.py").write_text(SLOW.format(seconds=0.1))  # nested: in its time
    package(site, "otherpkg", 0.2)
    package(site, "threadpkg", 0.3)
    package(project, "ownpkg", 0.3)  # the project's own code: a worker imports it too
    sys.path.insert(0, str(project))
    clock = ImportClock(project)
    original = bootstrap._find_and_load
    try:
        clock.start()
        import json  # noqa: F401  (the standard library: loaded or not, never counted)

        importlib.import_module("slowpkg")
        __import__("otherpkg")
        import slowpkg  # noqa: F401  (already loaded: nothing to time)

        other = threading.Thread(target=importlib.import_module, args=("threadpkg",))
        other.start()
        other.join()
        importlib.import_module("ownpkg")
        seconds = clock.stop()
    finally:
        sys.path.remove(str(project))
    assert bootstrap._find_and_load is original
    assert seconds is not None and 0.6 <= seconds < 0.6 + 0.25, seconds
    assert "threadpkg" in sys.modules and "ownpkg" in sys.modules


def test_an_import_that_fails_fails_as_before(site: Path, tmp_path: Path) -> None:
    (site / "brokenpkg").mkdir()
    (site / "brokenpkg" / "__init__.py").write_text("raise ValueError('bad install')\n")
    clock = ImportClock(tmp_path)
    clock.start()
    try:
        with pytest.raises(ValueError, match="bad install"):
            importlib.import_module("brokenpkg")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("no_such_package_anywhere")
        package(site, "fine", 0.0)
        assert importlib.import_module("fine").__name__ == "fine"
    finally:
        clock.stop()


def test_a_later_wrapper_is_left_in_place_and_ours_passes_through(
    site: Path, tmp_path: Path
) -> None:
    original = bootstrap._find_and_load
    clock = ImportClock(tmp_path)
    clock.start()
    ours = bootstrap._find_and_load
    seen: list[str] = []

    def theirs(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(name)
        return ours(name, *args, **kwargs)

    bootstrap._find_and_load = theirs
    try:
        assert clock.stop() == 0.0
        assert bootstrap._find_and_load is theirs  # not ours to take back
        package(site, "afterwards", 0.05)
        started = time.perf_counter()
        importlib.import_module("afterwards")
        assert time.perf_counter() - started >= 0.05
        assert seen == ["afterwards"]
    finally:
        bootstrap._find_and_load = original


def test_a_recording_keeps_what_its_prefix_spent_importing(
    project: Project, tmp_path: Path
) -> None:
    """Imports after the first retrolog call (as torch.optim imports torch._dynamo) are in the
    profile's late_imports; those before it, the loop's and the project's own are not."""
    site = tmp_path / "site"
    site.mkdir()
    package(site, "early", 0.2)
    package(site, "late", 0.4)
    package(site, "inloop", 0.3)
    package(project.root, "mine", 0.3)
    project.write(
        "train.py",
        """
        import early
        import retrolog as rl

        lr = rl.arg("lr", 0.1)
        import late
        import mine
        for epoch in rl.loop("epoch", range(2)):
            import inloop
        """,
    )
    project.run("train.py", PYTHONPATH=str(site))
    phases = dict(
        read_db(project.root, "SELECT phase, seconds FROM profile WHERE phase != 'iteration'")
    )
    assert 0.4 <= float(phases["late_imports"]) < 0.4 + 0.25, phases  # type: ignore[arg-type]
    assert float(phases["prefix"]) >= 0.2 + 0.4 + 0.3  # type: ignore[arg-type]


def test_a_run_with_no_loop_leaves_importlib_as_it_was(project: Project) -> None:
    project.write(
        "train.py",
        textwrap.dedent(
            """
            import importlib._bootstrap as bootstrap
            import retrolog as rl

            before = bootstrap._find_and_load
            rl.log("x", 1.0)
            assert bootstrap._find_and_load is not before  # timing the prefix's imports
            rl.commit()
            assert bootstrap._find_and_load.__name__ == "_find_and_load"
            assert "retrolog" not in bootstrap._find_and_load.__module__
            print("importlib restored")
            """
        ),
    )
    out = project.run("train.py")
    assert "importlib restored" in out.stdout
