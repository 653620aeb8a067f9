"""The dashboard's third-party front-end files: uPlot's, vendored from its pinned npm release.

The page draws its charts with uPlot (MIT; fast canvas time series with zoom,
cursor and log scales). Its files are kept in the repository
(``static/vendor/``, with its licence) and ship in the package, so any install
(a wheel, a git URL, an editable clone) serves a working dashboard, offline,
never from a CDN. Each file's sha256 is pinned here beside the release's npm
integrity hash: ``python -m retrolog.ui.assets --force`` downloads the release
from the npm registry, checks the tarball against the integrity hash and each
file against its pin, and only then replaces the vendored copies (the way to
move to a new release: change the version and both hashes). The tests check
the vendored files against the pins.
"""

from __future__ import annotations

import base64
import hashlib
import io
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VENDOR = Path(__file__).parent / "static" / "vendor"


@dataclass(frozen=True)
class Package:
    """One npm package release: where it is, its registry hash, the files we take."""

    name: str
    version: str
    integrity: str  # the registry's "dist.integrity": algorithm-base64digest
    files: dict[str, str]  # path in the tarball -> file name in VENDOR
    sha256: dict[str, str]  # file name in VENDOR -> its sha256 in that release
    registry: str = "https://registry.npmjs.org"

    @property
    def tarball(self) -> str:
        return f"{self.registry}/{self.name}/-/{self.name}-{self.version}.tgz"


PACKAGES = (
    Package(
        name="uplot",
        version="1.6.32",
        integrity="sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm"
        "/ep3tOkyTxpiQIw==",
        files={
            "package/dist/uPlot.iife.min.js": "uPlot.iife.min.js",
            "package/dist/uPlot.min.css": "uPlot.min.css",
            "package/LICENSE": "uPlot.LICENSE",
        },
        sha256={
            "uPlot.iife.min.js": "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
            "uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
            "uPlot.LICENSE": "8f989229699b4fe2f1a0432d0e9edc338a8a911e250e2d1b01ecd770a5f5b1bd",
        },
    ),
)


def missing() -> list[str]:
    """The vendored files not in place (empty when the dashboard can be served)."""
    return [name for p in PACKAGES for name in p.files.values() if not (VENDOR / name).is_file()]


def changed() -> list[str]:
    """The vendored files whose bytes are not their pinned release's (empty when all are)."""
    return [
        name
        for p in PACKAGES
        for name, digest in p.sha256.items()
        if (VENDOR / name).is_file()
        and hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() != digest
    ]


def fetch(
    timeout: float = 60.0, packages: tuple[Package, ...] = PACKAGES, into: Path = VENDOR
) -> None:
    """Download every pinned package, verify the tarball and each file against their pinned
    hashes, and only then put the files in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for package in packages:
        with urllib.request.urlopen(package.tarball, timeout=timeout) as response:
            data = response.read()
        algorithm, _, expected = package.integrity.partition("-")
        digest = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
        if digest != expected:
            raise RuntimeError(
                f"{package.name} {package.version} from {package.tarball} does not match its "
                f"pinned {algorithm} hash; nothing was installed. Check the registry (or a proxy "
                "in between)."
            )
        found: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            for member, target in package.files.items():
                extracted = archive.extractfile(member)
                if extracted is None:
                    raise RuntimeError(f"{package.name} {package.version} has no {member}")
                found[target] = extracted.read()
                if hashlib.sha256(found[target]).hexdigest() != package.sha256.get(target):
                    raise RuntimeError(
                        f"{member} of {package.name} {package.version} does not match its "
                        "pinned sha256; nothing was installed."
                    )
        for target, content in found.items():
            tmp = into / (target + ".tmp")
            tmp.write_bytes(content)
            tmp.replace(into / target)


def main() -> None:
    """``python -m retrolog.ui.assets``: fetch what is missing or not the pinned release's
    (``--force``: everything)."""
    if "--force" not in sys.argv[1:] and not missing() and not changed():
        return
    try:
        fetch()
    except (OSError, RuntimeError) as exc:
        sys.exit(
            f"Could not fetch the dashboard's chart library from the npm registry ({exc}). "
            "`retrolog ui` needs it; rerun `python -m retrolog.ui.assets` with network access "
            "to registry.npmjs.org."
        )
    print(f"dashboard assets in {VENDOR}", file=sys.stderr)


if __name__ == "__main__":
    main()
