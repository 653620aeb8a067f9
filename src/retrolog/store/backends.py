"""Which object store a location names, and the one place a project's store is opened.

A directory path or a ``file://`` URL is a :class:`LocalObjectStore` (no fsspec needed,
and the fastest writes: temp file, fsync, rename, mapped reads). Any other scheme
(``memory://``, ``s3://bucket/prefix``, ``gs://``, a chained ``simplecache::s3://``) is an
:class:`~retrolog.store.fsspec_objects.FsspecObjectStore`, which needs the ``team`` extra.
"""

from __future__ import annotations

import os
import re
import urllib.parse
import urllib.request
from pathlib import Path

from retrolog.errors import StoreError
from retrolog.store.objects import LocalObjectStore, ObjectStore

# A URL's protocol: letters first, then "://" or fsspec's chaining "::". A Windows
# path's drive letter ("C:\\") is neither.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)(?:://|::)")


def open_object_store(location: str | os.PathLike[str], *, durable: bool = True) -> ObjectStore:
    """The object store at ``location``: a directory path or a URL.

    durable: for a local store, whether writes are fsynced (see LocalObjectStore).
    Raises StoreError, saying what to install, when the scheme needs a missing package.
    """
    if isinstance(location, os.PathLike):
        return LocalObjectStore(location, durable=durable)
    match = _SCHEME.match(location)
    if match is None:
        return LocalObjectStore(Path(location).expanduser(), durable=durable)
    if match.group(1).lower() == "file" and match.group(0).endswith("://"):
        return LocalObjectStore(_file_url_path(location), durable=durable)
    from retrolog.store.fsspec_objects import FsspecObjectStore

    return FsspecObjectStore(location)


def object_store_for(store: Path) -> ObjectStore:
    """The object store of the project store directory ``store`` (``ProjectPaths.store``).

    Every part of retrolog that reads or writes checkpoints gets its store here, so
    that the backend is chosen in one place.
    """
    return LocalObjectStore(store / "objects")


def _file_url_path(url: str) -> Path:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise StoreError(
            f"{url} names a file on host {parts.netloc!r}; a file:// URL must name a path on "
            "this machine, as file:///shared/nfs/path (three slashes)."
        )
    return Path(urllib.request.url2pathname(parts.path))
