"""Benchmark: what copying a run's code version into the object store adds at run start.

Run from the repository root with the project's venv:

    .venv/bin/python -m bench.bench_code_export  # ~1 min -> bench/results/code_export.json
    .venv/bin/python -m bench.bench_code_export --reps 9
    .venv/bin/python -m bench.bench_code_export --objects-url s3://bucket/prefix  # objects on S3

The project is this repository's own tree (``git archive HEAD``, ~200 files),
committed in a fresh temporary repository with a fresh store. Three cases, each
a real ``Run`` start (capture, then the code export) in this process:

- first: an empty store: every file is read from git and put;
- same: the same tree again: the memo names its manifest, nothing is copied;
- edited: one file changed: only its bytes are read and put;
- materialize: what a replay worker with no clone does: the first run's files
  read back from the objects and written into a fresh cache repository by
  ``git fast-import`` (timed as "background copy"; no run is started).

Per case, the **training-thread cost** of the export (what ``Run.__init__`` spends
in ``_start_code_export``: the memo, one query, maybe a thread start), the
**background copy** (the export thread's wall time until the manifest is
named), and the capture itself for scale. Medians with min and max; each
repetition checks that the run's row names a manifest whose tree is the run's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IDENTITY = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@localhost",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@localhost",
}


def _project(where: Path) -> Path:
    project = where / "proj"
    project.mkdir()
    archive = subprocess.run(
        ["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x"], cwd=project, input=archive, check=True)
    env = {**os.environ, **IDENTITY}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tree"]):
        subprocess.run(["git", *args], cwd=project, env=env, check=True)
    return project


def _one(project: Path, store: Path) -> dict[str, float]:
    """Start (and end) one run in ``project``; the export's costs in ms."""
    from retrolog.runtime import run as run_module
    from retrolog.store.paths import locate

    os.environ["RETROLOG_STORE"] = str(store)
    os.chdir(project)
    paths = locate(project)
    spent: list[float] = []
    original = run_module._start_code_export

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    run_module._start_code_export = timed  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        run = run_module.Run(paths, ["train.py"], str(project / "README.md"))
        start_total = time.perf_counter() - started
        export = run._code_export
        copied = 0.0  # from the run's start until its manifest is known
        if export is not None:
            export.thread.join()
            copied = time.perf_counter() - started
        run.commit()
    finally:
        run_module._start_code_export = original  # type: ignore[assignment]
    conn = sqlite3.connect(store / "retrolog.db")
    tree, manifest = conn.execute(
        "SELECT code_tree, code_manifest FROM runs WHERE run_id = ?", (run.run_id,)
    ).fetchone()
    conn.close()
    from retrolog.store.backends import object_store_for
    from retrolog.versions.portable import load_manifest

    assert manifest and load_manifest(object_store_for(store), manifest).tree == tree
    return {
        "training_thread_ms": spent[0] * 1000,
        "background_copy_ms": copied * 1000,
        "run_start_ms": start_total * 1000,
    }


def _materialize(store: Path, tmp: Path) -> dict[str, float]:
    """Import the first run's code from the objects into a fresh cache; its time in ms."""
    from retrolog.store.backends import object_store_for
    from retrolog.versions.portable import import_manifest, load_manifest

    conn = sqlite3.connect(store / "retrolog.db")
    run_id, tree, key = conn.execute(
        "SELECT run_id, code_tree, code_manifest FROM runs ORDER BY started_at LIMIT 1"
    ).fetchone()
    conn.close()
    objects = object_store_for(store)
    cache = tmp / f"cache-{time.time_ns()}.git"
    subprocess.run(["git", "init", "-q", "--bare", str(cache)], check=True)
    started = time.perf_counter()
    manifest = load_manifest(objects, key)
    import_manifest(cache, manifest, objects, tree=tree, run_id=run_id, manifest_key=key)
    seconds = time.perf_counter() - started
    return {"training_thread_ms": 0.0, "background_copy_ms": seconds * 1000, "run_start_ms": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--objects-url", default="", help="put the objects there (fsspec URL)")
    args = parser.parse_args()
    if args.objects_url:
        os.environ["RETROLOG_OBJECTS_URL"] = args.objects_url
    cases: dict[str, list[dict[str, float]]] = {
        "first": [], "same": [], "edited": [], "materialize": [],
    }  # fmt: skip
    files = 0
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            project = _project(Path(tmp))
            files = len(subprocess.run(
                ["git", "ls-files"], cwd=project, capture_output=True, text=True, check=True
            ).stdout.splitlines())  # fmt: skip
            store = Path(tmp) / "store"
            if args.objects_url:  # a fresh prefix per repetition: "first" starts empty
                os.environ["RETROLOG_OBJECTS_URL"] = (
                    f"{args.objects_url.rstrip('/')}/{rep}-{time.time_ns()}"
                )
            cases["first"].append(_one(project, store))
            cases["same"].append(_one(project, store))
            with (project / "README.md").open("a") as f:
                f.write(f"\nedit {rep}\n")
            cases["edited"].append(_one(project, store))
            cases["materialize"].append(_materialize(store, Path(tmp)))
    os.chdir(ROOT)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{files} files; medians (min-max) over {args.reps} repetitions, in ms")
    print(f"{'case':8} {'training thread':>22} {'background copy':>22} {'run start':>22}")
    for case, rows in cases.items():
        summary[case] = {}
        cells = []
        for figure in ("training_thread_ms", "background_copy_ms", "run_start_ms"):
            values = [r[figure] for r in rows]
            summary[case][figure] = {
                "median": statistics.median(values), "min": min(values), "max": max(values),
            }  # fmt: skip
            cells.append(f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"{case:8} " + " ".join(f"{c:>22}" for c in cells))
    name = "code_export_url.json" if args.objects_url else "code_export.json"
    results = ROOT / "bench" / "results" / name
    results.write_text(
        json.dumps(
            {
                "files": files,
                "reps": args.reps,
                "objects": "url" if args.objects_url else "local",
                "cases": summary,
                "python": platform.python_version(),
                "cores": os.cpu_count(),
                "load": os.getloadavg(),
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "argv": sys.argv,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
