"""Per-run summaries (``run_summaries``) equal a scan of the values they summarize.

After a recording, after a replay's backfill (SQLite) or write-back (PostgreSQL), after
a forced replay that replaces backfilled values, and after migration 11 fills them for
a store that has values but no summaries. The scan here is written independently of
store/summaries.py: per (run, context, name) the newest recorded record counts, else
the newest backfilled one; every run-level record counts.
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrolog.store import postgres_metadata as postgres
from retrolog.store.schema import migrate

from conftest import Project, read_pg

# Names that take every path of the writer's incremental update: one value per step
# (added), two in one context ("twice": summarized again), a run-level value given twice,
# a NaN, text, a bool, an epoch-level name whose contexts are numbered below the steps'.
SCRIPT = """\
import math
import numpy as np
import retrolog as rl

lr = rl.arg("lr", 0.1)
w = np.zeros(8)
rl.log("note", "start")
with rl.checkpointing(w=w):
    for epoch in rl.loop("epoch", range(3)):
        for step in rl.loop("step", range(40)):
            w += lr * (step % 7)
            rl.log("loss", float(w.sum()) / (step + 1) if step != 5 else math.nan)
            rl.log("twice", step * 1.0)
            rl.log("twice", -step * 1.0)
            rl.log("flag", step % 2 == 0)
            rl.log("steps", step)
        rl.log("acc", float(epoch) / 3 + lr)
        # HINDSIGHT
rl.log("done", "end")
rl.log("final", 1.5)
rl.log("final", -2.5)
"""
STATEMENT = 'rl.log("w_sum", float(w.sum()))'
FIELDS = ("n_values", "n_numbers", "total", "smallest", "largest", "first_ctx", "last_ctx")


def expected(rows: list[tuple[Any, ...]]) -> dict[tuple[str, str], tuple[Any, ...]]:
    """(name, run) -> FIELDS, from (log_id, run_id, ctx_id, name, value_type, origin, number)
    rows; number is None for text and NaN."""
    counting: dict[tuple[str, str, Any], tuple[Any, ...]] = {}
    loose: list[tuple[Any, ...]] = []
    for row in sorted(rows):
        _, run_id, ctx, name, _, origin, _ = row
        if ctx is None:
            loose.append(row)
            continue
        key = (name, run_id, ctx)
        held = counting.get(key)
        if held is None or (origin == "recorded") >= (held[5] == "recorded"):
            counting[key] = row
    found: dict[tuple[str, str], list[tuple[Any, ...]]] = {}
    for row in [*counting.values(), *loose]:
        found.setdefault((row[3], row[1]), []).append(row)
    summaries = {}
    for key, chosen in found.items():
        numbers = [
            float(r[6])
            for r in chosen
            if r[4] in ("float", "int", "bool") and r[6] is not None and not math.isnan(r[6])
        ]
        contexts = [r[2] for r in chosen if r[2] is not None]
        summaries[key] = (
            len(chosen), len(numbers), math.fsum(numbers) if numbers else None,
            min(numbers, default=None), max(numbers, default=None),
            min(contexts, default=None), max(contexts, default=None),
        )  # fmt: skip
    return summaries


def same(
    stored: dict[tuple[str, str], tuple[Any, ...]], scanned: dict[tuple[str, str], tuple[Any, ...]]
) -> None:
    assert stored.keys() == scanned.keys()
    for key, want in scanned.items():
        got = stored[key]
        assert got[:2] == want[:2] and got[3:] == want[3:], (key, got, want)
        assert (got[2] is None) == (want[2] is None), (key, got, want)
        if want[2] is not None:
            assert math.isclose(got[2], want[2], rel_tol=1e-9, abs_tol=1e-9), (key, got, want)


def sqlite_state(database: Path) -> tuple[dict[Any, Any], dict[Any, Any]]:
    conn = sqlite3.connect(database)
    try:
        stored = {
            (r[0], r[1]): r[2:]
            for r in conn.execute(f"SELECT name, run_id, {', '.join(FIELDS)} FROM run_summaries")
        }
        rows = conn.execute(
            "SELECT log_id, run_id, ctx_id, name, value_type, origin,"
            " CASE WHEN typeof(value) IN ('integer', 'real') THEN value END FROM logs"
        ).fetchall()
    finally:
        conn.close()
    return stored, expected(rows)


def pg_state(url: str) -> tuple[dict[Any, Any], dict[Any, Any]]:
    stored = {
        (str(r[0]), str(r[1])): r[2:]
        for r in read_pg(url, f"SELECT name, run_id, {', '.join(FIELDS)} FROM run_summaries")
    }
    rows = read_pg(
        url,
        "SELECT log_id, run_id, ctx_id, name, value_type, origin,"
        " COALESCE(value_float, value_int) FROM logs",
    )
    return stored, expected(rows)


def check_table(root: Path) -> None:
    """The runs table's aggregates, read from the summaries, against what the script logs."""
    from retrolog import Project as Store

    columns = ["acc:first", "acc", "acc:mean", "acc:count", "twice:min", "twice:max",
               "note", "final:count", "loss:count", "flag:mean"]  # fmt: skip
    table = Store(root).table(columns=columns, sort="acc:mean", descending=False)
    assert [round(r["args"]["lr"], 6) for r in table["rows"]] == [0.1, 0.3]
    for row in table["rows"]:
        lr = row["args"]["lr"]
        assert math.isclose(row["acc:first"], lr) and math.isclose(row["acc:last"], 2 / 3 + lr)
        assert math.isclose(row["acc:mean"], 1 / 3 + lr) and row["acc:count"] == 3
        # The second value of each step's context counts: -step.
        assert row["twice:min"] == -39 and row["twice:max"] == 0
        assert row["note:last"] == "start" and row["final:count"] == 2
        assert row["loss:count"] == 120 and row["flag:mean"] == 0.5


def record(project: Project, **env: str) -> None:
    project.write("train.py", SCRIPT)
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "train")
    for lr in ("0.1", "0.3"):
        project.run("train.py", "--kwargs", f"lr={lr}", **env)
    project.write("train.py", SCRIPT.replace("# HINDSIGHT", STATEMENT))


def replay(project: Project, *extra: str, **env: str) -> None:
    done = project.cli("replay", "w_sum", "--yes", *extra, **env)
    assert done.returncode == 0, done.stderr


def test_summaries_are_a_scan_of_the_values_after_recording_and_replay(project: Project) -> None:
    database = project.root / ".retrolog" / "retrolog.db"
    record(project)
    stored, scanned = sqlite_state(database)
    names = {"loss", "twice", "flag", "note", "done", "final", "acc"}
    assert {name for name, _ in scanned} >= names
    same(stored, scanned)
    check_table(project.root)
    replay(project)
    stored, scanned = sqlite_state(database)
    assert sum(1 for name, _ in scanned if name == "w_sum") == 2
    same(stored, scanned)
    replay(project, "--force")
    same(*sqlite_state(database))


def test_migration_11_summarizes_the_values_a_store_holds(project: Project) -> None:
    database = project.root / ".retrolog" / "retrolog.db"
    record(project)
    conn = sqlite3.connect(database, isolation_level=None)
    conn.execute("DROP TABLE run_summaries")
    conn.execute("DELETE FROM migrations WHERE version = 11")
    migrate(conn)
    conn.close()
    stored, scanned = sqlite_state(database)
    assert stored and scanned
    same(stored, scanned)


def test_summaries_on_postgresql_after_recording_and_write_back(
    project: Project, pg_store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(project, RETROLOG_DATABASE_URL=pg_store_url)
    same(*pg_state(pg_store_url))
    monkeypatch.setenv("RETROLOG_DATABASE_URL", pg_store_url)
    check_table(project.root)
    replay(project, RETROLOG_DATABASE_URL=pg_store_url)
    stored, scanned = pg_state(pg_store_url)
    assert sum(1 for name, _ in scanned if name == "w_sum") == 2
    same(stored, scanned)
    replay(project, "--force", RETROLOG_DATABASE_URL=pg_store_url)
    same(*pg_state(pg_store_url))
    # Migration 11 on a database that has values and no summaries.
    conn = postgres.connect(pg_store_url)
    conn.execute("DROP TABLE run_summaries")
    conn.execute("DROP TABLE series_blocks")
    conn.execute("DROP INDEX logs_not_recorded")
    conn.execute("DELETE FROM migrations WHERE version >= 11")
    assert postgres.migrate(conn) == postgres.SCHEMA_VERSION
    conn.close()
    same(*pg_state(pg_store_url))


# -- the record sink's arithmetic, batch by batch ---------------------------------------------


def sink_state(database: Path, run_id: str) -> tuple[dict[Any, Any], dict[Any, Any]]:
    stored, scanned = sqlite_state(database)
    return (
        {k: v for k, v in stored.items() if k[1] == run_id},
        {k: v for k, v in scanned.items() if k[1] == run_id},
    )


def new_sink(tmp_path: Path) -> tuple[Path, Any]:
    from retrolog.store.records import SqliteRecordSink
    from retrolog.store.sqlite_connection import connect

    database = tmp_path / "retrolog.db"
    conn = connect(database)
    migrate(conn)
    conn.close()
    return database, SqliteRecordSink(database)


# A batch of (ctx, name, value): the contexts of each name never go back, and a batch
# often goes on in the context the one before ended in (values logged at every batch
# inside one epoch), so the sink's arithmetic takes every path: a new context, the last
# one reopened with its value the smallest, the largest or neither, NaNs and text there.
# Few distinct values, so that the replaced value is often the smallest or the largest.
values_of = st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, -1, 0, 3, math.nan, "text"])
streams = st.lists(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 2), values_of), max_size=12),
    min_size=1,
    max_size=10,
)


@settings(max_examples=150, deadline=None)
@given(batches=streams)
def test_the_sinks_arithmetic_equals_a_scan_after_every_batch(
    tmp_path_factory: pytest.TempPathFactory, batches: list[list[tuple[str, int, Any]]]
) -> None:
    from retrolog.store.records import RecordBatch

    database, sink = new_sink(tmp_path_factory.mktemp("sink"))
    contexts = {"a": 1, "b": 1}
    try:
        for batch in batches:
            values = []
            for name, step, value in batch:
                contexts[name] += step  # 0: the same context again
                values.append((contexts[name], name, value))
            sink.write("r", RecordBatch(values=values))
            same(*sink_state(database, "r"))
    finally:
        sink.close()


def test_values_logged_in_one_context_batch_after_batch_are_added_not_rescanned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every batch inside one epoch: each batch's values replace the one that counted in
    # that context. Summarizing the name from its values each time made a long epoch's
    # writer quadratic (20,000 values took minutes to commit).
    from retrolog.store import summaries
    from retrolog.store.records import RecordBatch

    scans: list[str] = []
    recompute = summaries.recompute

    def counted(cursor: Any, run_id: str, names: Any, **kwargs: Any) -> None:
        scans.extend(names or ["*"])
        recompute(cursor, run_id, names, **kwargs)

    monkeypatch.setattr(summaries, "recompute", counted)
    database, sink = new_sink(tmp_path)
    try:
        falling = [float(100 - i) for i in range(400)]
        rising = [float(i) for i in range(400)]
        for at in range(0, 400, 40):  # ten batches, all in context 7
            values = [(7, "loss", v) for v in falling[at : at + 40]]
            values += [(7, "acc", v) for v in rising[at : at + 40]]
            sink.write("r", RecordBatch(values=values))
        same(*sink_state(database, "r"))
        assert scans == []
        # The next context, whose value is the smallest, then replaced by one above it:
        # the smallest is then one of the other contexts', and the name is summarized
        # from its values.
        sink.write("r", RecordBatch(values=[(8, "loss", -1000.0)]))
        assert scans == []
        sink.write("r", RecordBatch(values=[(8, "loss", 50.0)]))
        assert scans == ["loss"]
        same(*sink_state(database, "r"))
    finally:
        sink.close()
