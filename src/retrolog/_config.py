"""Settings in one place: environment variables over the project's files over defaults.

Every setting has an environment variable (``RETROLOG_...``) and a key that
two files may set, for a project whose members want the same settings
without exporting them in every shell (docs/configuration.md)::

    <project root>/pyproject.toml      [tool.retrolog]   committed: the team's settings
    <store>/config.toml                (top level)       this checkout's own

The environment wins over both files, and ``config.toml`` over
``pyproject.toml``; ``rl.configure(...)`` wins over all of them for the
settings it takes. ``store`` itself can only come from the environment or from
``pyproject.toml``, since ``config.toml`` lives in the store. A few settings
are read from the environment alone, because a file in a repository someone
clones must not decide them (``trust_pickles``: reading a pickle can run any
code).

:func:`use` is called when a project is located (``store.paths.locate``): it
reads each of the two files once and keeps their values for :func:`lookup`, which the
readers of the settings call instead of ``os.environ``. Nothing is written to
the process's environment. ``retrolog config`` shows every setting, its value
and where it came from, with any password in a URL masked: credentials are
never printed, and no setting is ever written to the store.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrolog.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PYPROJECT = "pyproject.toml"
STORE_FILE = "config.toml"


@dataclass(frozen=True)
class Setting:
    """One setting: its key in the files, its environment variable, and what it means."""

    key: str
    env: str
    default: str  # as shown by `retrolog config`
    help: str
    in_files: bool = True  # False: read from the environment alone
    secret: bool = False  # a URL that may hold a password: masked when shown


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "store",
        "RETROLOG_STORE",
        "<project root>/.retrolog",
        "the directory of the store (a relative path in pyproject.toml is from the project root)",
    ),
    Setting(
        "database_url",
        "RETROLOG_DATABASE_URL",
        "<store>/retrolog.db (embedded SQLite)",
        "where runs' metadata lives: unset for the embedded SQLite store, or a PostgreSQL URL "
        "such as postgresql://user@host/dbname (the team extra; every command reads it)",
        secret=True,
    ),
    Setting(
        "objects_url",
        "RETROLOG_OBJECTS_URL",
        "<store>/objects",
        "where checkpoint objects live: a directory, file:///path, or an fsspec URL such as "
        "s3://bucket/prefix (the team extra)",
        secret=True,
    ),
    Setting(
        "objects_timeout",
        "RETROLOG_OBJECTS_TIMEOUT",
        "60",
        "seconds a request to a remote object store may go unanswered, retried meanwhile, "
        "before it is given up (0: wait for ever; a write also gets a second per MiB)",
    ),
    Setting(
        "overhead_tolerance",
        "RETROLOG_OVERHEAD_TOLERANCE",
        "0.0667 (1/15)",
        "the share of training time the adaptive checkpoint rule may spend",
    ),
    Setting(
        "checkpoints",
        "RETROLOG_CHECKPOINTS",
        "adaptive",
        "'adaptive' (as often as the tolerance allows) or 'every' block",
    ),
    Setting(
        "max_in_flight",
        "RETROLOG_MAX_IN_FLIGHT",
        "2",
        "snapshots the background checkpoint writer holds in memory at once",
    ),
    Setting(
        "when_full",
        "RETROLOG_WHEN_FULL",
        "skip ('wait' with checkpoints = 'every')",
        "a block end that finds the writer full: 'skip' it (after waiting as long as the "
        "overhead tolerance allows) or 'wait' for it",
    ),
    Setting(
        "restore_ratio",
        "RETROLOG_RESTORE_RATIO",
        "learned from past replays (1.0 before any)",
        "restore time over materialize time, in the adaptive rule",
    ),
    Setting(
        "max_file_bytes",
        "RETROLOG_MAX_FILE_BYTES",
        "2097152 (2 MiB)",
        "untracked files larger than this are left out of a run's code version",
    ),
    Setting(
        "query_timeout",
        "RETROLOG_QUERY_TIMEOUT",
        "120",
        "seconds a query or where may run (0: no limit)",
    ),
    Setting(
        "query_memory_mb",
        "RETROLOG_QUERY_MEMORY_MB",
        "1024",
        "MB a query may grow the process by (0: no limit)",
    ),
    Setting(
        "progress",
        "RETROLOG_PROGRESS",
        "1 (shown on a terminal)",
        "0 turns off the progress bars",
    ),
    Setting(
        "forkserver",
        "RETROLOG_FORKSERVER",
        "1 (on Linux)",
        "0 starts every replay worker as a new interpreter",
    ),
    Setting(
        "executor",
        "RETROLOG_EXECUTOR",
        "local",
        "where replay runs its workers: 'local' processes, or 'ray' tasks on a Ray cluster "
        "(the ray extra; docs/replay-on-ray.md)",
    ),
    Setting(
        "ray_address",
        "RAY_ADDRESS",
        "(none)",
        "the Ray cluster for executor 'ray': HOST:PORT of its head, or 'auto' (Ray's own variable)",
    ),
    Setting(
        "allow_pickles",
        "RETROLOG_ALLOW_PICKLES",
        "0",
        "1 lets checkpoints store objects retrolog cannot encode as data, as pickles",
    ),
    Setting(
        "trust_pickles",
        "RETROLOG_TRUST_PICKLES",
        "0",
        "1 lets retrolog read pickles from the store, which can run code (environment only)",
        in_files=False,
    ),
    Setting(
        "debug",
        "RETROLOG_DEBUG",
        "0",
        "1 shows a traceback under an error's message",
        in_files=False,
    ),
)
BY_KEY = {s.key: s for s in SETTINGS}
BY_ENV = {s.env: s for s in SETTINGS}


@dataclass(frozen=True)
class Resolved:
    """A setting's value in effect and where it came from."""

    setting: Setting
    value: str | None  # None: not set anywhere, so the default applies
    source: str  # "environment", a file's path, or "default"

    def shown(self) -> str:
        """The value as `retrolog config` prints it: a URL's password masked."""
        if self.value is None:
            return self.setting.default
        return mask(self.value) if self.setting.secret else self.value


# The values the located project's files set, by environment variable (see use()).
_file_values: dict[str, tuple[str, str]] = {}


def mask(value: str) -> str:
    """``value`` with a URL's password replaced by ``***``: in ``user:password@`` and
    in a ``password=`` parameter (libpq takes one in a PostgreSQL URL's query)."""
    value = re.sub(r"(?<=://)([^:/@\s]*):[^@/\s]*@", r"\1:***@", value)
    return re.sub(r"([?&]password=)[^&\s]*", r"\1***", value, flags=re.IGNORECASE)


def _text(value: Any, key: str, path: Path) -> str:
    """A TOML value as the text its environment variable would hold."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise UsageError(
        f"{path}: the setting {key!r} must be a string, a number or true/false, not "
        f"{type(value).__name__} {value!r}. `retrolog config` lists the settings."
    )


def read_file(path: Path, table: str | None) -> dict[str, str]:
    """The settings ``path`` sets (in ``[tool.retrolog]`` when ``table``), by key.

    A missing file, or a pyproject.toml without the table, sets nothing. A file
    that is not TOML, an unknown key and a key that files may not set are
    UsageErrors that name the file and what to do.
    """
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return {}
    except OSError as exc:
        raise UsageError(f"Cannot read the settings file {path}: {exc}.") from exc
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"{path} is not valid TOML ({exc}); fix it, or remove it to use the defaults. "
            "docs/configuration.md shows the format."
        ) from exc
    where = f"{path}"
    if table is not None:
        doc = doc.get("tool", {}).get(table, {})
        where = f"{path} [tool.{table}]"
        if not isinstance(doc, dict):
            raise UsageError(f"{where} must be a table of settings, like `[tool.{table}]`.")
    found: dict[str, str] = {}
    for key, value in doc.items():
        setting = BY_KEY.get(key)
        if setting is None:
            raise UsageError(
                f"{where} sets {key!r}, which is not a retrolog setting; the settings are: "
                f"{', '.join(BY_KEY)}. `retrolog config` shows them with their values."
            )
        if not setting.in_files:
            raise UsageError(
                f"{where} sets {key!r}, which only the environment variable {setting.env} "
                "can set: a file in a repository someone clones must not decide it. Remove "
                f"it from the file and export {setting.env} where you want it."
            )
        if key == "store" and table is None:
            raise UsageError(
                f"{where} sets 'store', but that file lives in the store itself; set it in "
                f"pyproject.toml's [tool.retrolog] or in the environment ({setting.env})."
            )
        found[key] = _text(value, key, path)
    return found


def load(
    root: Path, default_store: Path, environ: Mapping[str, str] | None = None
) -> tuple[Path, dict[str, tuple[str, str]]]:
    """The project's store directory and what its two files set, each file read once.

    The store is the environment's ``RETROLOG_STORE``, else ``store`` in ``root``'s
    pyproject.toml (relative to ``root``), else ``default_store``. The values map an
    environment variable to (value, the file that set it); config.toml wins.
    """
    env = os.environ if environ is None else environ
    pyproject = root / PYPROJECT
    from_pyproject = read_file(pyproject, "retrolog")
    override = env.get(BY_KEY["store"].env, "").strip()
    if override:
        store = Path(override).expanduser().resolve()
    elif from_pyproject.get("store"):
        store = (root / Path(from_pyproject["store"]).expanduser()).resolve()
    else:
        store = default_store
    values = {BY_KEY[key].env: (value, str(pyproject)) for key, value in from_pyproject.items()}
    for key, value in read_file(store / STORE_FILE, None).items():
        values[BY_KEY[key].env] = (value, str(store / STORE_FILE))
    return store, values


def use(root: Path, default_store: Path) -> Path:
    """Take the settings of the project at ``root`` for :func:`lookup`; its store directory
    (see :func:`load`)."""
    global _file_values
    store, _file_values = load(root, default_store)
    return store


def lookup(env: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of the setting whose environment variable is ``env``: set, or from a file.

    None when neither sets it (the reader applies its default). Settings read
    from the environment alone ignore the files.
    """
    source = os.environ if environ is None else environ
    value = source.get(env)
    if value is not None and value.strip():
        return value
    setting = BY_ENV.get(env)
    if setting is None or not setting.in_files or environ is not None:
        return None
    found = _file_values.get(env)
    return found[0] if found else None


def resolve(
    root: Path, default_store: Path, environ: Mapping[str, str] | None = None
) -> list[Resolved]:
    """Every setting's value and source for the project at ``root``, as `retrolog config` shows."""
    env = os.environ if environ is None else environ
    store, files = load(root, default_store, env)
    resolved = []
    for setting in SETTINGS:
        value = env.get(setting.env, "").strip()
        if value:
            resolved.append(Resolved(setting, value, f"environment ({setting.env})"))
        elif setting.in_files and setting.env in files:
            text, path = files[setting.env]
            shown = str(store) if setting.key == "store" else text  # the path it resolves to
            resolved.append(Resolved(setting, shown, path))
        else:
            resolved.append(Resolved(setting, None, "default"))
    return resolved
