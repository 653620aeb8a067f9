"""Reads their caller gave up on (store/cancel.py), through ``Project.cancellation()``:
a statement running in another thread stops at ``cancel()``, and no read starts after it."""

from __future__ import annotations

import threading
import time

import pytest

import retrolog
from retrolog.errors import ReadCancelled

from conftest import Project

ENDLESS = (
    "lr > (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c)"
)


@pytest.fixture
def store(project: Project) -> retrolog.Project:
    project.write("train.py", "import retrolog as rl\n\nrl.log('lr', rl.arg('lr', 0.1))\n")
    project.run("train.py")
    return retrolog.Project(project.root)


def test_cancel_stops_a_read_in_another_thread_and_every_later_one(
    store: retrolog.Project,
) -> None:
    cancellation = store.cancellation()
    raised: list[BaseException] = []

    def read() -> None:
        with cancellation.active():
            try:
                store.table(where=ENDLESS)
            except BaseException as exc:
                raised.append(exc)

    store.table(where="lr > 0")  # imports done, as in a dashboard that has answered once
    worker = threading.Thread(target=read)
    worker.start()
    deadline = time.monotonic() + 30
    while not cancellation._interrupts and time.monotonic() < deadline:
        time.sleep(0.01)  # until the worker's connection is open
    time.sleep(0.5)
    assert worker.is_alive()  # the endless predicate runs
    cancellation.cancel()
    worker.join(timeout=30)  # a busy machine may take seconds; the predicate never ends
    assert not worker.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], ReadCancelled)
    # Stopped while it ran: SQLite reports the interrupted statement.
    assert "interrupted" in repr(raised[0].__cause__) or "interrupted" in repr(
        raised[0].__cause__.__context__
    ), repr(raised[0].__cause__)
    with cancellation.active(), pytest.raises(ReadCancelled):
        store.names()
    # Outside it, and under another cancellation, reads go on.
    assert store.names() == ["lr"]
    with store.cancellation().active():
        assert store.table()["total"] == 1


def test_a_cancel_between_statements_stops_the_next_one(store: retrolog.Project) -> None:
    """interrupt() stops only a running statement: one begun after it on the same
    connection is stopped by the progress handler."""
    cancellation = store.cancellation()
    endless = (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    )
    start = time.monotonic()
    with (
        pytest.raises(ReadCancelled),
        cancellation.active(),
        store._portable() as conn,
    ):
        assert conn.execute("SELECT count(*) FROM runs").fetchone() == (1,)
        cancellation.cancel()
        start = time.monotonic()
        conn.execute(endless).fetchone()
    assert time.monotonic() - start < 1.0
