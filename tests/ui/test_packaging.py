"""The dashboard's chart library ships in the package: the vendored uPlot files are the pinned
npm release's, re-fetching checks both hashes, and a wheel built from the repository's
tracked files serves a working dashboard from a fresh environment."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from retrolog.ui import assets

REPO = Path(__file__).resolve().parents[2]


def test_the_vendored_chart_files_are_the_pinned_release_and_tracked() -> None:
    assert assets.missing() == []
    assert assets.changed() == []
    for package in assets.PACKAGES:
        for name, digest in package.sha256.items():
            assert hashlib.sha256((assets.VENDOR / name).read_bytes()).hexdigest() == digest
    tracked = subprocess.run(
        ["git", "ls-files", "src/retrolog/ui/static/vendor"], cwd=REPO,
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    wanted = {name for p in assets.PACKAGES for name in p.files.values()}
    assert {Path(t).name for t in tracked} == wanted  # a git URL or a clone has them


def tarball(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for member, data in files.items():
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def published(registry: Path, files: dict[str, bytes]) -> assets.Package:
    """The pinned uPlot release as a registry at ``registry`` would serve ``files``."""
    pinned = assets.PACKAGES[0]
    data = tarball(files)
    where = registry / pinned.name / "-" / f"{pinned.name}-{pinned.version}.tgz"
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(data)
    digest = base64.b64encode(hashlib.sha512(data).digest()).decode()
    return dataclasses.replace(pinned, registry=registry.as_uri(), integrity="sha512-" + digest)


def test_fetching_checks_the_tarball_and_every_file_before_installing(tmp_path: Path) -> None:
    pinned = assets.PACKAGES[0]
    release = {m: (assets.VENDOR / name).read_bytes() for m, name in pinned.files.items()}
    good = published(tmp_path / "good", release)
    assets.fetch(packages=(good,), into=tmp_path / "ok")
    for name in pinned.files.values():
        assert (tmp_path / "ok" / name).read_bytes() == (assets.VENDOR / name).read_bytes()

    # A tarball whose integrity hash is right but whose script is not the pinned one.
    script = "package/dist/uPlot.iife.min.js"
    altered = published(tmp_path / "altered", {**release, script: release[script] + b";"})
    with pytest.raises(RuntimeError, match="does not match its pinned sha256"):
        assets.fetch(packages=(altered,), into=tmp_path / "refused")
    assert list((tmp_path / "refused").iterdir()) == []  # nothing was installed

    # A tarball that is not the release the integrity hash names.
    swapped = dataclasses.replace(good, integrity=altered.integrity)
    with pytest.raises(RuntimeError, match="does not match its pinned sha512"):
        assets.fetch(packages=(swapped,), into=tmp_path / "refused")
    assert list((tmp_path / "refused").iterdir()) == []


@pytest.mark.slow
def test_a_wheel_of_the_repository_serves_the_dashboard_from_a_fresh_environment(
    tmp_path: Path, project: Any
) -> None:
    # What `pip install git+URL` builds from: the tracked files only, not this checkout's
    # ignored or untracked ones.
    source = tmp_path / "source"
    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(tmp_path / "dist")],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("retrolog-*.whl")

    # A fresh environment: the wheel's retrolog, and (to save installing them) the
    # dependencies of this one's site-packages, read after its own.
    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    ours = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    theirs = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (Path(ours) / "zz_shared_dependencies.pth").write_text(theirs + "\n")
    where = subprocess.run(
        [str(python), "-c", "import retrolog.ui.assets as a; print(a.VENDOR)"],
        env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(fresh)  # the wheel's files, not this checkout's

    project.write("t.py", "import retrolog as rl\nfor i in rl.loop('step', range(3)):\n"
                  "    rl.log('x', i)\n")  # fmt: skip
    project.run("t.py")
    server = subprocess.Popen(
        [str(fresh / "bin" / "retrolog"), "ui", "--no-browser", "--no-index", "--port", "0"],
        cwd=project.root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stderr is not None
        deadline = time.monotonic() + 60
        base = None
        said: list[str] = []
        while base is None and time.monotonic() < deadline:
            line = server.stderr.readline()
            if not line:
                break
            said.append(line)
            found = re.search(r"(http://[^/\s]+)/\?token=", line)
            base = found.group(1) if found else None
        assert base is not None, "".join(said)
        with urllib.request.urlopen(base + "/", timeout=30) as response:
            page = response.read().decode()
        assert "/static/vendor/uPlot.iife.min.js" in page
        for name, digest in assets.PACKAGES[0].sha256.items():
            with urllib.request.urlopen(f"{base}/static/vendor/{name}", timeout=30) as response:
                assert hashlib.sha256(response.read()).hexdigest() == digest
        with urllib.request.urlopen(base + "/favicon.ico", timeout=30) as response:
            assert response.headers["Content-Type"].startswith("image/svg+xml")
    finally:
        server.terminate()
        server.communicate(timeout=20)
