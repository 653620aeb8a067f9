"""Which object store a location names, and the one place a project's store is opened.

A directory path or a ``file://`` URL is a :class:`LocalObjectStore` (no fsspec needed,
and the fastest writes: temp file, fsync, rename, mapped reads). Any other scheme
(``memory://``, ``s3://bucket/prefix``, ``gs://``, a chained ``simplecache::s3://``) is an
:class:`~retrolog.store.fsspec_objects.FsspecObjectStore`, which needs the ``team`` extra;
``local:///path`` is a local directory through fsspec. ``RETROLOG_OBJECTS_URL`` puts a
project's objects at such a location instead of ``objects/`` in its store.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path

from retrolog._config import lookup
from retrolog.errors import StoreError
from retrolog.store.objects import LocalObjectStore, ObjectStore

OBJECTS_URL_ENV = "RETROLOG_OBJECTS_URL"

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


def objects_location(store: Path) -> str:
    """Where the objects of the project store directory ``store`` live.

    The ``objects_url`` setting (``RETROLOG_OBJECTS_URL``, or the project's settings
    files: retrolog/_config.py) when set (a path or any URL :func:`open_object_store`
    takes), else ``objects/`` inside the store.
    """
    return (lookup(OBJECTS_URL_ENV) or "").strip() or str(store / "objects")


def object_store_for(store: Path, location: str | None = None) -> ObjectStore:
    """The object store of the project store directory ``store`` (``ProjectPaths.store``).

    Every part of retrolog that reads or writes checkpoints gets its store here, so
    that the backend is chosen in one place.
    location: where the objects are, when the caller was told (a replay worker gets
        its coordinator's, since workers do not inherit ``RETROLOG_`` variables);
        default :func:`objects_location`.
    """
    if location is None and not (lookup(OBJECTS_URL_ENV) or "").strip():
        return LocalObjectStore(store / "objects")
    return open_object_store(location or objects_location(store))


def _file_url_path(url: str) -> Path:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise StoreError(
            f"{url} names a file on host {parts.netloc!r}; a file:// URL must name a path on "
            "this machine, as file:///shared/nfs/path (three slashes)."
        )
    from urllib.request import url2pathname  # imports http.client and more: only here

    return Path(url2pathname(parts.path))
