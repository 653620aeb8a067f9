"""What every benchmark shares: results heads, spreads, git, FlorDB's venv, PostgreSQL schemas.

The benchmarks are modules of the ``bench`` package, run from the repository root with
the project's venv, e.g. ``python -m bench.bench_log``; each imports its helpers from
here. A results file begins with :class:`Measured`'s head (what ran, when, where, under
which load, which retrolog source), and reports repetitions with :func:`spread`.
"""

from __future__ import annotations

import compileall
import datetime as dt
import hashlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
FLORDB_VENV = BENCH_DIR / ".venv-flordb"
FLORDB_VERSION = "4.0.1"

GIT_ENV = {
    # The machine may have no git identity, and user config (hooks, signing) must not
    # change what is measured.
    "GIT_AUTHOR_NAME": "retrolog bench",
    "GIT_AUTHOR_EMAIL": "bench@retrolog.invalid",
    "GIT_COMMITTER_NAME": "retrolog bench",
    "GIT_COMMITTER_EMAIL": "bench@retrolog.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def conditions(
    name: str,
    started: float,
    load_before: Any,
    load_after: Any,
    reps: int,
    retrolog_version: str,
    source: Any,
    source_after: Any,
) -> dict[str, Any]:
    """The head of a results file: what ran, when, where, and under which load."""
    return {
        "benchmark": name,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "repetitions": reps,
        "retrolog_version": retrolog_version,
        "retrolog_source": source,
        "retrolog_source_changed_during_run": source_after.get("sha256") != source.get("sha256"),
    }


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and the samples: how every result file reports repetitions."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "samples": values,
    }


class Measured:
    """A benchmark's run, for its results head: ``with Measured(name, reps) as m: ...``
    (or ``m = Measured(name, reps).start()``), then ``m.head()`` is :func:`conditions` of
    what ran, including the load and whether the measured source changed meanwhile."""

    def __init__(self, name: str, reps: int) -> None:
        self.name, self.reps = name, reps
        self.finished = False

    def start(self) -> Measured:
        self.started = time.time()
        self.load_before = os.getloadavg()
        self.source = source_fingerprint()
        return self

    def finish(self) -> None:
        self.load_after = os.getloadavg()
        self.source_after = source_fingerprint()
        self.finished = True
        before, after = self.source.get("sha256"), self.source_after.get("sha256")
        if after != before:
            # Other people edit the package while a benchmark runs; figures from two
            # versions mix.
            print(
                "warning: retrolog's source changed while the benchmark ran "
                f"({before} -> {after}); run it again.",
                file=sys.stderr,
            )

    def __enter__(self) -> Measured:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def head(self, retrolog_version: str | None = None) -> dict[str, Any]:
        """The results head; finishes the measurement first if nothing did."""
        if not self.finished:
            self.finish()
        if retrolog_version is None:
            import retrolog

            retrolog_version = retrolog.__version__
        return conditions(
            self.name,
            self.started,
            self.load_before,
            self.load_after,
            self.reps,
            retrolog_version,
            self.source,
            self.source_after,
        )


def source_fingerprint() -> dict[str, Any]:
    """Which retrolog code is measured: its directory, git commit and a hash of its files.

    Also byte-compiles the package first, as ``pip install`` does for an installed wheel:
    an editable install in a shell with PYTHONDONTWRITEBYTECODE set (as the benchmarks'
    children are) would otherwise compile every retrolog module in every process, about
    20 ms inside a recorded run's span that no user pays.
    """
    spec = importlib.util.find_spec("retrolog")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return {}
    package = Path(spec.origin).parent
    compiled = compileall.compile_dir(package, quiet=1)
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    found: dict[str, Any] = {
        "path": str(package),
        "sha256": digest.hexdigest()[:16],
        "byte_compiled": bool(compiled),
    }
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True, check=False
    )
    if head.returncode == 0:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "."],
            cwd=package,
            capture_output=True,
            text=True,
            check=False,
        )
        found["commit"] = head.stdout.strip()
        found["uncommitted_changes"] = bool(dirty.stdout.strip())
    return found


def git(cwd: Path, env: dict[str, str], *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class BenchError(Exception):
    """A measurement that could not be taken or did not check out."""


# -- the FlorDB venv ---------------------------------------------------------------------


def flordb_python() -> tuple[Path | None, str]:
    """The FlorDB venv's interpreter, created and installed if needed; else (None, reason)."""
    python = FLORDB_VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if installed_version(python) == FLORDB_VERSION:
        return python, f"flordb {FLORDB_VERSION} in {FLORDB_VENV}"
    print(f"creating {FLORDB_VENV} with flordb=={FLORDB_VERSION} ...", file=sys.stderr)
    try:
        if not python.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(FLORDB_VENV)],
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
            )
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", f"flordb=={FLORDB_VERSION}"],
            check=True,
            capture_output=True,
            text=True,
            timeout=900,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        errors = [line for line in detail.splitlines() if line.startswith("ERROR")]
        detail = "\n".join(errors) or detail  # pip's index warnings are not the reason
        return None, f"could not install flordb=={FLORDB_VERSION}: {tail(detail)}"
    if installed_version(python) != FLORDB_VERSION:
        return None, f"flordb=={FLORDB_VERSION} did not install into {FLORDB_VENV}"
    return python, f"flordb {FLORDB_VERSION} in {FLORDB_VENV}"


def installed_version(python: Path) -> str | None:
    # Read from package metadata: importing flordb needs a git repository and has side
    # effects (stdout capture, a database in the working directory).
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('flordb'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() if out.returncode == 0 else None


# -- PostgreSQL -------------------------------------------------------------------------


def fresh_schema(database_url: str) -> str:
    """``database_url`` with a new schema first in its search path."""
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    parts = urllib.parse.urlsplit(database_url)
    option = "options=" + urllib.parse.quote(f"-c search_path={schema}")
    query = f"{parts.query}&{option}" if parts.query else option
    return urllib.parse.urlunsplit(parts._replace(query=query))


def drop_schema(schema_url: str) -> None:
    import psycopg

    schema = urllib.parse.unquote(schema_url).rsplit("search_path=", 1)[1].split("&")[0]
    with psycopg.connect(schema_url, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")


def test_database_url() -> str | None:
    """The loopback PostgreSQL server scripts/services.sh starts, if it runs."""
    found = os.environ.get("RETROLOG_TEST_DATABASE_URL", "").strip()
    services = BENCH_DIR.parent / ".services" / "env"
    if not found and services.exists():
        for line in services.read_text().splitlines():
            name, _, value = line.partition("=")
            if name == "RETROLOG_TEST_DATABASE_URL":
                found = value.strip()
    return found or None
