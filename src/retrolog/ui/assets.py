"""The dashboard's third-party front-end files, fetched from the npm registry at build time.

The page draws its charts with uPlot (MIT; fast canvas time series with zoom,
cursor and log scales). It is not kept in this repository: `scripts/setup.sh`
runs ``python -m retrolog.ui.assets``, which downloads the pinned release from
the npm registry, checks it against the registry's sha512 integrity hash and
copies its files next to ours (``static/vendor/``, ignored by git). At run
time the page loads only files the package holds, never a CDN: it works
offline.
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

    @property
    def tarball(self) -> str:
        return f"https://registry.npmjs.org/{self.name}/-/{self.name}-{self.version}.tgz"


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
    ),
)


def missing() -> list[str]:
    """The vendored files not in place (empty when the dashboard can be served)."""
    return [name for p in PACKAGES for name in p.files.values() if not (VENDOR / name).is_file()]


def fetch(timeout: float = 60.0) -> None:
    """Download, verify and unpack every pinned package's files into VENDOR."""
    VENDOR.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
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
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            for member, target in package.files.items():
                extracted = archive.extractfile(member)
                if extracted is None:
                    raise RuntimeError(f"{package.name} {package.version} has no {member}")
                tmp = VENDOR / (target + ".tmp")
                tmp.write_bytes(extracted.read())
                tmp.replace(VENDOR / target)


def main() -> None:
    """``python -m retrolog.ui.assets``: fetch what is missing (``--force``: everything)."""
    if "--force" not in sys.argv[1:] and not missing():
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
