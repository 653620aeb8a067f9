"""Two replays of the same runs at once: each value is stored once, and each replay's
report says how many it stored and which replay stored the rest. On the embedded store,
and on PostgreSQL, where (as from two machines) each coordinator replays on its own
working copy and their values meet in the database under a lock per run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from training_scripts import NUMPY_TRAIN

from conftest import Project, read_db, read_pg

pytestmark = pytest.mark.slow

# A replay held at its confirmation until the test lets it go: both have planned, so both
# replay every run, before either stores a value.
GATED_REPLAY = """\
import sys
import time
from pathlib import Path

import retrolog

ready, go = Path(sys.argv[1]), Path(sys.argv[2])


def confirm(plan):
    ready.touch()
    while not go.exists():
        time.sleep(0.05)
    return True


print(retrolog.Project().replay("w_sum", confirm=confirm).replay_id)
"""


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.services)]
)
def test_two_replays_at_once_each_report_what_they_stored(
    project: Project, tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("pg_store_url") if backend == "postgresql" else None
    settings = {} if url is None else {"RETROLOG_DATABASE_URL": url}

    def rows(sql: str) -> list[tuple[object, ...]]:
        return read_db(project.root, sql) if url is None else read_pg(url, sql)

    project.write("train.py", NUMPY_TRAIN)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    for seed in ("1", "2"):
        project.run("train.py", "--kwargs", f"seed={seed}", **settings)
    score = '        rl.log("score", float(w[:10].sum()))\n'
    project.write(
        "train.py", NUMPY_TRAIN.replace(score, score + '        rl.log("w_sum", float(w.sum()))\n')
    )
    (tmp_path / "gated.py").write_text(GATED_REPLAY)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "gated.py"), str(tmp_path / f"ready{i}"), str(go)],
            cwd=project.root,
            env=project.env(**settings),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
        (tmp_path / f"ready{i}").exists() for i in range(2)
    ):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    go.touch()
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs

    values = rows("SELECT run_id, ctx_id, count(*) FROM logs WHERE name = 'w_sum' GROUP BY 1, 2")
    assert len(values) == 8 and all(count == 1 for _, _, count in values), values
    ids = [out.strip().splitlines()[-1] for out, _ in outputs]
    stored = dict(rows("SELECT replay_id, sum(backfilled) FROM replay_runs GROUP BY replay_id"))
    assert sum(int(str(n)) for n in stored.values()) == 8, stored
    for (_, err), mine, other in ((outputs[0], *ids), (outputs[1], *reversed(ids))):
        said = " ".join(err.split())
        added = int(str(stored[mine]))
        assert f"Replayed 2 run(s); backfilled {added} value(s)" in said, said
        if added < 8:
            assert f", {8 - added} already backfilled by replay {other} (kept)." in said, said
