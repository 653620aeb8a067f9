"""A replay's write-back from its working copy into PostgreSQL (store/transfer.py,
``WriteBack``), run by run: the replay's row first, running; a run written again (its
commit's answer lost) stores nothing twice and keeps its count; the end finishes the
runs left and the replay's row."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from retrolog.store.postgres_metadata import PostgresMetadata
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect
from retrolog.store.transfer import WriteBack, copy_into_sqlite, copy_state

from conftest import Project, read_pg

SCRIPT = """\
import retrolog as rl

for step in rl.loop("step", range(3)):
    rl.log("loss", float(step))
"""


def _replayed(conn: sqlite3.Connection, run_id: str, replay_id: str) -> None:
    """In the working copy, what a replay of ``run_id`` adds: its row, the run's row,
    a backfilled value per step."""
    conn.execute(
        "INSERT INTO replays(replay_id, started_at, names, filename, workers, status)"
        " VALUES (?, ?, ?, 'train.py', 1, 'running')",
        (replay_id, time.time(), json.dumps(["w"])),
    )
    conn.execute(
        "INSERT INTO replay_runs(replay_id, run_id, scan, status, backfilled)"
        " VALUES (?, ?, 'full', 'replayed', 3)",
        (replay_id, run_id),
    )
    for (ctx_id,) in conn.execute(
        "SELECT ctx_id FROM loops WHERE run_id = ? ORDER BY ctx_id", (run_id,)
    ).fetchall():
        conn.execute(
            "INSERT INTO logs(run_id, ctx_id, name, value, value_type, origin, replay_id)"
            " VALUES (?, ?, 'w', ?, 'float', 'backfilled', ?)",
            (run_id, ctx_id, float(ctx_id), replay_id),
        )


def test_each_run_is_written_once_and_the_replay_row_first_then_finished(
    project: Project, pg_store_url: str, tmp_path: Path
) -> None:
    project.write("train.py", SCRIPT)
    for _ in range(2):
        project.run("train.py", RETROLOG_DATABASE_URL=pg_store_url)
    first, second = (str(r) for (r,) in read_pg(pg_store_url, "SELECT run_id FROM runs"))
    metadata = PostgresMetadata(pg_store_url, create=False, origin=tmp_path / "retrolog.db")
    copy = connect(tmp_path / "copy.db")
    try:
        migrate(copy)
        copy_into_sqlite(copy, metadata, None)
        writer = WriteBack(copy, metadata, copy_state(copy, metadata), names=["w"], force=False)
        _replayed(copy, first, "r1")
        copy.execute("INSERT INTO replay_runs(replay_id, run_id, scan, status)"
                     " VALUES ('r1', ?, 'full', 'running')", (second,))  # fmt: skip
        writer.runs([first])
        assert read_pg(pg_store_url, "SELECT status FROM replays") == [("running",)]
        assert read_pg(pg_store_url, "SELECT run_id, backfilled FROM replay_runs") == [(first, 3)]
        # Written again, as when the answer to its commit was lost: nothing twice.
        writer.result.written.clear()
        writer.runs([first])
        assert writer.result.written == {first: 3}
        assert writer.result.already == {first: {}}
        counted = "SELECT count(*) FROM logs WHERE name = 'w'"
        assert read_pg(pg_store_url, counted) == [(3,)]
        # The end: the run not landed yet, then the replay's row as the copy ended it.
        copy.execute("UPDATE replays SET status = 'finished', ended_at = 1.0")
        result = writer.finish()
        assert result.written == {first: 3, second: 0}
        assert read_pg(pg_store_url, "SELECT status, ended_at FROM replays") == [("finished", 1.0)]
        assert read_pg(pg_store_url, counted) == [(3,)]
        assert sorted(read_pg(pg_store_url, "SELECT run_id FROM replay_runs")) == sorted(
            [(first,), (second,)]
        )
    finally:
        copy.close()
        metadata.close()
