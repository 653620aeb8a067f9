"""dataframe(): the wide view over small stores built row by row with SQL."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrolog._query import dataframe as dataframe_module
from retrolog._query.dataframe import dataframe, logged_names, matching_run_ids
from retrolog.errors import QueryError, UnknownNameError
from retrolog.store.schema import migrate
from retrolog.store.sqlite_connection import connect


class Store:
    """A fresh store in a temporary directory, filled the way the runtime fills it."""

    def __init__(self, path: Path) -> None:
        self.conn = connect(path / "retrolog.db")
        migrate(self.conn)
        self._ctx: dict[str, int] = {}

    def run(self, run_id: str, started_at: float, *, filename: str = "train.py") -> None:
        self.conn.execute(
            "INSERT INTO runs (run_id, projid, tstamp, filename, status, started_at, host, pid,"
            " python, argv) VALUES (?, 'proj', ?, ?, 'finished', ?, 'host', 1, '3.11', '[]')",
            (run_id, f"2024-01-01T00:00:{int(started_at):02d}", filename, started_at),
        )
        self._ctx[run_id] = 0

    def loop(self, run_id: str, name: str, iteration: int, parent: int | None = None) -> int:
        """A new iteration context (ctx ids count up in execution order); returns its id."""
        ctx = self._ctx[run_id]
        self._ctx[run_id] += 1
        depth = 0
        if parent is not None:
            depth = (
                1
                + self.conn.execute(
                    "SELECT depth FROM loops WHERE run_id = ? AND ctx_id = ?", (run_id, parent)
                ).fetchone()[0]
            )
        self.conn.execute(
            "INSERT INTO loops (run_id, ctx_id, parent_ctx, name, iteration, depth, t_start)"
            " VALUES (?, ?, ?, ?, ?, ?, 0)",
            (run_id, ctx, parent, name, iteration, depth),
        )
        return ctx

    def log(
        self,
        run_id: str,
        ctx: int | None,
        name: str,
        value: Any,
        value_type: str,
        origin: str = "recorded",
    ) -> None:
        self.conn.execute(
            "INSERT INTO logs (run_id, ctx_id, name, value, value_type, origin)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (run_id, ctx, name, value, value_type, origin),
        )

    def count(self) -> int:
        return int(self.conn.execute("SELECT count(*) FROM logs").fetchone()[0])


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """Two runs of epoch/step training plus a run that logged run-level values only.

    Run "b" started first although its id sorts last. Each training run has two
    epochs of two steps; loss at every step, acc at every epoch, lr and
    test_acc at run level. Oddities: loss logged twice in one step (the second
    counts), a NaN loss, an integral float acc, a backfilled w_norm per epoch.
    """
    s = Store(tmp_path)
    s.run("b", 10.0)
    s.run("a", 20.0)
    s.run("c", 30.0, filename="eval.py")
    for run_id, lr in (("b", 0.01), ("a", 0.001)):
        s.log(run_id, None, "lr", lr, "float")
        for epoch in range(2):
            e = s.loop(run_id, "epoch", epoch)
            for step in range(2):
                st = s.loop(run_id, "step", step, parent=e)
                s.log(run_id, st, "loss", lr * 100 + epoch + step / 10, "float")
            s.log(run_id, e, "acc", 0.5 + epoch / 4, "float")
            s.log(run_id, e, "w_norm", 3.0 + epoch, "float", origin="backfilled")
        s.log(run_id, None, "test_acc", 0.9 if run_id == "b" else 0.8, "float")
    # Step 1 of epoch 0 of run "b" (ctx 2): logged twice, the second value counts.
    s.log("b", 2, "loss", 7.5, "float")
    # Step 0 of epoch 1 of run "a" (ctx 4): NaN, which SQLite keeps as NULL.
    s.conn.execute("UPDATE logs SET value = NULL WHERE run_id = 'a' AND ctx_id = 4")
    s.conn.execute("UPDATE logs SET value = 1.0 WHERE run_id = 'a' AND ctx_id = 3 AND name = 'acc'")
    s.log("c", None, "lr", 0.1, "float")
    s.log("c", None, "test_acc", 0.7, "float")
    return s


def records(frame: pd.DataFrame) -> list[tuple[Any, ...]]:
    """The frame's rows as tuples, with NaN and NA as None, for exact comparison."""
    out = []
    for row in frame.itertuples(index=False):
        out.append(
            tuple(
                None if (v is pd.NA or (isinstance(v, float) and math.isnan(v))) else v for v in row
            )
        )
    return out


def test_wide_view_of_step_epoch_and_run_level_names(store: Store) -> None:
    frame = dataframe(store.conn, ["loss", "acc", "lr"])
    assert list(frame.columns) == [
        "projid",
        "run_id",
        "tstamp",
        "filename",
        "epoch",
        "step",
        "loss",
        "acc",
        "lr",
    ]
    assert records(frame) == [
        ("proj", "b", "2024-01-01T00:00:10", "train.py", 0, None, None, 0.5, 0.01),
        ("proj", "b", "2024-01-01T00:00:10", "train.py", 0, 0, 1.0, None, 0.01),
        ("proj", "b", "2024-01-01T00:00:10", "train.py", 0, 1, 7.5, None, 0.01),
        ("proj", "b", "2024-01-01T00:00:10", "train.py", 1, None, None, 0.75, 0.01),
        ("proj", "b", "2024-01-01T00:00:10", "train.py", 1, 0, 2.0, None, 0.01),
        ("proj", "b", "2024-01-01T00:00:10", "train.py", 1, 1, 2.1, None, 0.01),
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 0, None, None, 0.5, 0.001),
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 0, 0, 0.1, None, 0.001),
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 0, 1, 0.2, None, 0.001),
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 1, None, None, 1.0, 0.001),
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 1, 0, None, None, 0.001),
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 1, 1, 1.2000000000000002, None, 0.001),
        ("proj", "c", "2024-01-01T00:00:30", "eval.py", None, None, None, None, 0.1),
    ]


def test_column_dtypes_follow_the_logged_types(store: Store) -> None:
    frame = dataframe(store.conn, ["loss", "acc", "lr"])
    assert dict(frame.dtypes) == {
        "projid": np.dtype(object),
        "run_id": np.dtype(object),
        "tstamp": np.dtype(object),
        "filename": np.dtype(object),
        "epoch": pd.Int64Dtype(),
        "step": pd.Int64Dtype(),
        "loss": np.dtype("float64"),
        "acc": np.dtype("float64"),
        "lr": np.dtype("float64"),
    }
    # A NaN stays a float NaN; an integral float stays a float.
    loss = frame.loc[(frame.run_id == "a") & (frame.epoch == 1) & (frame.step == 0), "loss"]
    assert math.isnan(loss.item())
    acc = frame.loc[(frame.run_id == "a") & (frame.epoch == 1) & frame.step.isna(), "acc"]
    assert acc.item() == 1.0 and isinstance(acc.item(), float)


def test_run_level_names_alone_give_one_row_per_run(store: Store) -> None:
    frame = dataframe(store.conn, ["test_acc", "lr"])
    assert list(frame.columns) == ["projid", "run_id", "tstamp", "filename", "test_acc", "lr"]
    assert records(frame) == [
        ("proj", "b", "2024-01-01T00:00:10", "train.py", 0.9, 0.01),
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 0.8, 0.001),
        ("proj", "c", "2024-01-01T00:00:30", "eval.py", 0.7, 0.1),
    ]


def test_run_level_values_are_broadcast_to_every_row_of_their_run(store: Store) -> None:
    frame = dataframe(store.conn, ["acc", "test_acc"])
    assert list(frame.columns) == [
        "projid",
        "run_id",
        "tstamp",
        "filename",
        "epoch",
        "acc",
        "test_acc",
    ]
    assert [(r[1], r[4], r[5], r[6]) for r in records(frame)] == [
        ("b", 0, 0.5, 0.9),
        ("b", 1, 0.75, 0.9),
        ("a", 0, 0.5, 0.8),
        ("a", 1, 1.0, 0.8),
        ("c", None, None, 0.7),
    ]
    assert frame.epoch.dtype == pd.Int64Dtype()


def test_a_run_without_any_requested_name_is_absent(store: Store) -> None:
    frame = dataframe(store.conn, ["w_norm"])
    assert list(frame.run_id) == ["b", "b", "a", "a"]
    assert list(frame.columns) == ["projid", "run_id", "tstamp", "filename", "epoch", "w_norm"]


def test_recorded_value_wins_over_backfilled_and_newest_over_older(store: Store) -> None:
    e = 0  # epoch 0 of run "b"
    store.log("b", e, "acc", 0.25, "float", origin="backfilled")  # newer, but backfilled
    store.log("b", e, "w_norm", 9.0, "float", origin="backfilled")  # newer backfilled wins
    store.log("b", e, "w_norm", 8.0, "float", origin="backfilled")
    frame = dataframe(store.conn, ["acc", "w_norm"])
    first = frame.iloc[0]
    assert (first.run_id, first.epoch, first.acc, first.w_norm) == ("b", 0, 0.5, 8.0)
    assert len(frame) == 4


def test_values_of_every_type_get_their_dtype(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.run("r", 1.0)
    rows = [s.loop("r", "epoch", i) for i in range(3)]
    cells: dict[str, list[tuple[Any, str]]] = {
        "f": [(1.5, "float"), (2.0, "float"), (None, "float")],
        "i": [(1, "int"), (None, "none"), (3, "int")],
        "mix": [(1, "int"), (2.5, "float"), (None, "none")],
        "b": [(1, "bool"), (0, "bool"), (None, "none")],
        "s": [("x", "str"), ("<obj>", "text"), (None, "none")],
        "j": [("[1, 2]", "json"), ('{"a": null}', "json"), (None, "none")],
        "n": [(None, "none"), (None, "none"), (None, "none")],
        "odd": [("[3]", "json"), ("[3]", "str"), (1, "bool")],
    }
    for name, values in cells.items():
        for ctx, (value, kind) in zip(rows, values, strict=True):
            s.log("r", ctx, name, value, kind)
    frame = dataframe(s.conn, list(cells))
    assert {name: str(frame[name].dtype) for name in cells} == {
        "f": "float64",
        "i": "Int64",
        "mix": "float64",
        "b": "boolean",
        "s": "object",
        "j": "object",
        "n": "object",
        "odd": "object",
    }
    assert frame.f.tolist()[:2] == [1.5, 2.0] and math.isnan(frame.f[2])
    assert frame.i.tolist() == [1, pd.NA, 3]
    assert frame.mix.tolist()[:2] == [1.0, 2.5]
    assert frame.b.tolist() == [True, False, pd.NA]
    assert frame.s.tolist() == ["x", "<obj>", None]
    assert frame.j.tolist() == [[1, 2], {"a": None}, None]
    assert frame.n.tolist() == [None, None, None]
    # Mixed types that share a Python class are decoded cell by cell.
    assert frame.odd.tolist() == [[3], "[3]", True]
    assert type(frame.s[0]) is str and type(frame.odd[2]) is bool


def test_where_filters_on_requested_columns_and_dimensions(store: Store) -> None:
    frame = dataframe(store.conn, ["loss", "acc"], where="epoch = 1 AND step IS NOT NULL")
    assert [(r[1], r[4], r[5], r[6]) for r in records(frame)] == [
        ("b", 1, 0, 2.0),
        ("b", 1, 1, 2.1),
        ("a", 1, 0, None),
        ("a", 1, 1, 1.2000000000000002),
    ]
    assert records(dataframe(store.conn, ["acc"], where="run_id = 'a' AND acc > 0.6")) == [
        ("proj", "a", "2024-01-01T00:00:20", "train.py", 1, 1.0)
    ]


def test_where_may_use_names_that_are_not_requested(store: Store) -> None:
    frame = dataframe(store.conn, ["acc"], where="lr > 0.005")
    assert list(frame.columns) == ["projid", "run_id", "tstamp", "filename", "epoch", "acc"]
    assert [(r[1], r[4], r[5]) for r in records(frame)] == [("b", 0, 0.5), ("b", 1, 0.75)]
    # A loop-level one, double-quoted (SQLite would read an unknown quoted name as a string).
    frame = dataframe(store.conn, ["acc"], where='"w_norm" > 3.5 AND test_acc < 0.85')
    assert [(r[1], r[4], r[5]) for r in records(frame)] == [("a", 1, 1.0)]


def test_where_on_a_name_logged_twice_uses_the_value_that_counts(store: Store) -> None:
    store.log("b", 0, "w_norm", 0.1, "float", origin="backfilled")  # replaces 3.0 in epoch 0
    frame = dataframe(store.conn, ["acc"], where="w_norm > 2")
    assert [(r[1], r[4]) for r in records(frame)] == [("b", 1), ("a", 0), ("a", 1)]


@pytest.mark.parametrize(
    ("where", "complaint"),
    [
        ("lr >", 'near ")": syntax error'),
        ("nope > 1", "no such column: nope"),
        ('"nope" = 1', '"nope"'),
        ("1; DELETE FROM logs", 'near ";": syntax error'),
        ("acc > 0) UNION SELECT 1, 2, 3 --", 'near ")": syntax error'),
        ("lr > 0.005 AND epoch = ?", "bindings"),
    ],
)
def test_a_bad_where_is_a_query_error_that_quotes_it(
    store: Store, where: str, complaint: str
) -> None:
    before = store.count()
    with pytest.raises(QueryError) as info:
        dataframe(store.conn, ["acc"], where=where)
    message = str(info.value)
    assert repr(where) in message
    assert complaint in message
    assert "columns projid, run_id, tstamp, filename, epoch, step, acc" in message
    assert "logged name (acc, loss, lr, test_acc, w_norm)" in message
    assert info.value.sql == where
    assert store.count() == before


def test_a_where_that_writes_is_refused_and_changes_nothing(store: Store) -> None:
    before = store.count()
    with pytest.raises(QueryError, match="read-only"):
        dataframe(store.conn, ["acc"], where="acc > (SELECT load_extension('x'))")
    # The connection is usable for writing again afterwards (no authorizer left behind).
    store.log("b", None, "later", 1, "int")
    assert store.count() == before + 1
    assert not store.conn.in_transaction


def test_unknown_name_suggests_the_closest_logged_one(store: Store) -> None:
    with pytest.raises(UnknownNameError) as info:
        dataframe(store.conn, ["acc", "acuracy"])
    assert str(info.value) == (
        "No run logged 'acuracy'; the names logged in this store are: "
        "acc, loss, lr, test_acc, w_norm. Did you mean 'acc'?"
    )
    assert info.value.name == "acuracy"


def test_no_names_or_an_empty_store_is_a_clear_error(tmp_path: Path) -> None:
    s = Store(tmp_path)
    with pytest.raises(QueryError, match="at least one log name"):
        dataframe(s.conn, [])
    with pytest.raises(UnknownNameError, match="holds no logged values yet"):
        dataframe(s.conn, ["loss"])


def test_a_name_that_is_also_a_loop_name_is_refused(store: Store) -> None:
    store.log("b", 0, "epoch", 0, "int")
    with pytest.raises(QueryError, match="'epoch' would share its column"):
        dataframe(store.conn, ["epoch", "acc"])


def test_logged_names_are_sorted_and_distinct(store: Store) -> None:
    assert logged_names(store.conn) == ["acc", "loss", "lr", "test_acc", "w_norm"]


def test_a_name_logged_in_and_outside_loops_keeps_its_loop_values(store: Store) -> None:
    store.log("b", None, "acc", 0.99, "float")  # a final acc after training
    frame = dataframe(store.conn, ["acc"])
    assert [(r[1], r[4], r[5]) for r in records(frame)] == [
        ("b", 0, 0.5),
        ("b", 1, 0.75),
        ("a", 0, 0.5),
        ("a", 1, 1.0),
    ]
    frame = dataframe(store.conn, ["loss", "acc"], where="run_id = 'b' AND step = 0")
    assert [(r[4], r[7]) for r in records(frame)] == [(0, 0.99), (1, 0.99)]


def test_dimensions_follow_depth_then_first_occurrence(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.run("r", 1.0)
    e = s.loop("r", "epoch", 0)
    b = s.loop("r", "batch", 0, parent=e)
    m = s.loop("r", "micro", 0, parent=b)
    s.log("r", m, "loss", 1.0, "float")
    v = s.loop("r", "val", 0, parent=e)
    s.log("r", v, "val_loss", 2.0, "float")
    s.log("r", e, "acc", 0.5, "float")
    s.loop("r", "unused", 0)  # a loop with no requested value does not become a column
    frame = dataframe(s.conn, ["loss", "val_loss", "acc"])
    assert list(frame.columns)[4:] == ["epoch", "batch", "val", "micro", "loss", "val_loss", "acc"]
    assert [r[4:] for r in records(frame)] == [
        (0, None, None, None, None, None, 0.5),  # the epoch context, opened first
        (0, 0, None, 0, 1.0, None, None),  # the micro context: epoch, batch and micro
        (0, None, 0, None, None, 2.0, None),  # the val context
    ]


def test_loop_names_kept_between_calls_follow_new_runs_and_running_ones(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.run("r", 1.0)
    s.log("r", s.loop("r", "epoch", 0), "acc", 0.5, "float")
    assert list(dataframe(s.conn, ["acc"]).columns)[4:] == ["epoch", "acc"]
    s.run("s", 2.0)  # a run that ended since: its loop is a new column
    s.log("s", s.loop("s", "phase", 0), "acc", 0.7, "float")
    assert list(dataframe(s.conn, ["acc"]).columns)[4:] == ["epoch", "phase", "acc"]
    s.conn.execute("UPDATE runs SET status = 'running' WHERE run_id = 's'")
    for _ in range(2):  # while a run records, its new loops show at once
        s.log("s", s.loop("s", "stage", 0), "acc", 0.9, "float")
        assert list(dataframe(s.conn, ["acc"]).columns)[4:] == ["epoch", "phase", "stage", "acc"]


def test_the_callers_transaction_is_left_alone(store: Store) -> None:
    store.conn.execute("BEGIN")
    dataframe(store.conn, ["acc"])
    assert store.conn.in_transaction
    store.conn.execute("COMMIT")


def test_the_view_reads_a_read_only_connection(store: Store, tmp_path: Path) -> None:
    reader = connect(tmp_path / "retrolog.db", readonly=True)
    assert len(dataframe(reader, ["loss", "acc", "lr"])) == 13


# A reference for the property test: the view computed record by record in Python.


@dataclass
class Record:
    run: str
    ctx: int | None
    name: str
    value: float | int | None
    kind: str
    origin: str


def reference(
    runs: list[tuple[str, float]],
    loops: dict[str, list[tuple[int, int | None, str, int]]],
    logs: list[Record],
    names: list[str],
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Dimension columns and rows (run, dims..., values...) the view should have."""
    chosen: dict[tuple[str, int | None, str], Record] = {}
    for rec in logs:  # in log_id order
        key = (rec.run, rec.ctx, rec.name)
        old = chosen.get(key)
        if old is None or (rec.origin == "recorded") >= (old.origin == "recorded"):
            chosen[key] = rec
    rows: list[tuple[str, dict[str, int], dict[str, Any]]] = []
    for run_id, _ in sorted(runs, key=lambda r: (r[1], r[0])):
        by_ctx = {c[0]: c for c in loops.get(run_id, [])}
        run_level = {n: chosen[(run_id, None, n)] for n in names if (run_id, None, n) in chosen}
        contexts = sorted(
            {ctx for (r, ctx, n) in chosen if r == run_id and ctx is not None and n in names}
        )
        for ctx in contexts:
            dims: dict[str, int] = {}
            walk: int | None = ctx
            while walk is not None:
                _, parent, loop_name, iteration = by_ctx[walk]
                dims.setdefault(loop_name, iteration)
                walk = parent
            values = {n: run_level[n] for n in run_level}
            values.update(
                {n: chosen[(run_id, ctx, n)] for n in names if (run_id, ctx, n) in chosen}
            )
            rows.append((run_id, dims, values))
        if not contexts and run_level:
            rows.append((run_id, {}, dict(run_level)))
    # Loop names by depth, then first occurrence in (run_id, ctx_id) order.
    first: dict[str, tuple[int, int]] = {}
    scanned = [(run_id, c) for run_id in sorted(loops) for c in sorted(loops[run_id])]
    for position, (run_id, (ctx, _, loop_name, _)) in enumerate(scanned):
        key = (depth_of(loops[run_id], ctx), position)
        first[loop_name] = min(first.get(loop_name, key), key)
    used = {d for _, dims, _ in rows for d in dims}
    dim_names = sorted((n for n in first if n in used), key=lambda n: first[n])
    table = []
    for run_id, dims, values in rows:
        cells = tuple(dims.get(d) for d in dim_names)
        table.append((run_id, *cells, *(_cell(values.get(n)) for n in names)))
    return dim_names, table


def depth_of(contexts: list[tuple[int, int | None, str, int]], ctx: int) -> int:
    """How many contexts enclose ``ctx`` (contexts are listed by ctx id)."""
    parent = contexts[ctx][1]
    return 0 if parent is None else 1 + depth_of(contexts, parent)


def _cell(rec: Record | None) -> Any:
    if rec is None or rec.value is None:
        return None
    return float(rec.value)


@st.composite
def stores(draw: st.DrawFn) -> tuple[Any, ...]:
    """Random runs with nested loops and records: duplicates, backfills, run-level values."""
    runs = [(f"r{k}", draw(st.floats(0, 100))) for k in range(draw(st.integers(1, 3)))]
    loops: dict[str, list[tuple[int, int | None, str, int]]] = {}
    logs: list[Record] = []
    for run_id, _ in runs:
        contexts: list[tuple[int, int | None, str, int]] = []
        open_: list[int] = []  # the enclosing contexts, innermost last
        for _ in range(draw(st.integers(0, 8))):
            depth = draw(st.integers(0, min(len(open_), 2)))
            open_ = open_[:depth]
            parent = open_[-1] if open_ else None
            name = ["epoch", "step", "micro"][depth] if draw(st.booleans()) else f"l{depth}"
            siblings = sum(1 for c in contexts if c[1] == parent and c[2] == name)
            contexts.append((len(contexts), parent, name, siblings))
            open_.append(len(contexts) - 1)
        loops[run_id] = contexts
        for _ in range(draw(st.integers(0, 12))):
            ctx = draw(st.sampled_from([None, *range(len(contexts))]))
            name = draw(st.sampled_from(["x", "y", "z"]))
            value = draw(st.none() | st.floats(-1e6, 1e6, allow_nan=False))
            origin = draw(st.sampled_from(["recorded", "recorded", "backfilled"]))
            logs.append(Record(run_id, ctx, name, value, "float", origin))
    draw(st.randoms()).shuffle(logs)  # log_ids interleave runs
    names = draw(st.lists(st.sampled_from(["x", "y", "z"]), min_size=1, max_size=3, unique=True))
    return runs, loops, logs, names


@settings(max_examples=150, deadline=None)
@given(stores())
def test_view_matches_a_record_by_record_reference(case: tuple[Any, ...]) -> None:
    runs, loops, logs, names = case
    with tempfile.TemporaryDirectory() as tmp:
        s = Store(Path(tmp))
        for run_id, started_at in runs:
            s.run(run_id, started_at)
        for run_id, contexts in loops.items():
            for ctx, parent, loop_name, iteration in contexts:
                s.conn.execute(
                    "INSERT INTO loops (run_id, ctx_id, parent_ctx, name, iteration, depth,"
                    " t_start) VALUES (?, ?, ?, ?, ?, ?, 0)",
                    (run_id, ctx, parent, loop_name, iteration, depth_of(contexts, ctx)),
                )
        for rec in logs:
            s.log(rec.run, rec.ctx, rec.name, rec.value, rec.kind, rec.origin)
        logged = {rec.name for rec in logs}
        if not set(names) <= logged:
            with pytest.raises(UnknownNameError):
                dataframe(s.conn, names)
            return
        # Both ways of finding the rows: walking every loop context, and from the values.
        frames = []
        for sparse in (False, True):
            with mock.patch.object(dataframe_module, "_sparse", lambda *_, sparse=sparse: sparse):
                frames.append(dataframe(s.conn, names))
                # What a predicate chooses is the runs of the view's rows that pass it.
                where = f"{names[0]} > 0 OR {names[-1]} IS NULL"
                chosen = set(dataframe(s.conn, names, where)["run_id"])
                assert matching_run_ids(s.conn, names, where) == chosen
        s.conn.close()
    dim_names, expected = reference(runs, loops, logs, names)
    for frame in frames:
        assert list(frame.columns) == ["projid", "run_id", "tstamp", "filename", *dim_names, *names]
        got = [(r[1], *r[4:]) for r in records(frame)]
        assert got == expected


def test_an_empty_view_keeps_the_requested_columns_and_their_dtypes(store: Store) -> None:
    frame = dataframe(store.conn, ["loss", "acc", "lr"], where="epoch > 5")
    assert len(frame) == 0
    assert list(frame.columns) == ["projid", "run_id", "tstamp", "filename", "loss", "acc", "lr"]
    assert [str(t) for t in frame.dtypes] == ["object"] * 4 + ["float64"] * 3


def test_names_that_need_quoting_and_a_lone_string(store: Store) -> None:
    store.log("a", 0, "val/acc", 0.25, "float")
    store.log("a", 0, "it's", "yes", "str")
    frame = dataframe(store.conn, ["val/acc", "it's"], where='"val/acc" < 0.5')
    assert records(frame) == [("proj", "a", "2024-01-01T00:00:20", "train.py", 0, 0.25, "yes")]
    assert list(dataframe(store.conn, "test_acc", where="  ").test_acc) == [0.9, 0.8, 0.7]
