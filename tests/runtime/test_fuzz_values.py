"""Fuzzing ``rl.log``: any value, any name, and the run goes on and reads back.

Hypothesis draws values of every shape a script could log (numbers of any size,
NaN and infinities, text with lone surrogates and control characters, bytes,
nested containers, numpy arrays and scalars of many dtypes, objects whose
``str()`` fails, cycles). Each is logged with ``rl.log`` into one real run, then
read back with ``dataframe``. The properties: ``rl.log`` never raises and
returns at once, the writer never fails, and what docs/api.md promises to keep
exactly (numbers, strings, bools, None, JSON-able containers) reads back equal.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import retrolog as rl
import retrolog._api as api
from retrolog._query.dataframe import dataframe
from retrolog.runtime.run import Run, Status
from retrolog.store.paths import locate, storable_text

from conftest import Project

pytestmark = pytest.mark.filterwarnings("ignore::retrolog.errors.RetrologWarning")


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str for you")

    __repr__ = __str__


def _cycle() -> list[Any]:
    loop: list[Any] = [1.0]
    loop.append(loop)
    return loop


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats()
    | any_text
    | st.binary(max_size=20)
)
containers = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(any_text, inner, max_size=4)
    ),
    max_leaves=12,
)
arrays = hnp.arrays(
    st.sampled_from(["float64", "float32", "int64", "uint8", "bool", "complex64", "float16"]),
    hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
)
numpy_scalars = hnp.from_dtype(np.dtype("float32")) | hnp.from_dtype(np.dtype("int16"))
values = containers | arrays | numpy_scalars


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("fuzz") / "proj"
    root.mkdir()
    project = Project(root)
    project.git("init", "--quiet", "--initial-branch=main")
    project.write("train.py", "import retrolog as rl\n")
    project.git("add", "-A")
    project.git("commit", "--quiet", "-m", "initial")
    active = Run(locate(root), ["train.py"], str(root / "train.py"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api, "_active", active)  # rl.log's user-facing path, into this run
        yield active
    active.commit(Status.FINISHED)


_names = itertools.count()


def _read_back(run: Run, name: str) -> Any:
    assert run.writer.flush(timeout=30), "the writer did not commit within 30 s"
    assert run.writer.failure is None, run.writer.failure
    conn = sqlite3.connect(run.paths.database)
    try:
        frame = dataframe(conn, [name], f"run_id = '{run.run_id}'")
    finally:
        conn.close()
    assert len(frame) == 1
    return frame[storable_text(name)].iloc[0]  # a name UTF-8 cannot hold is kept escaped


def _plain(value: Any) -> bool:
    """Whether docs/api.md promises ``value`` back exactly (strings that UTF-8 can hold)."""
    if value is None or isinstance(value, (bool, float)):
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    if isinstance(value, str):
        return _utf8(value)
    return False


def _same_kind(back: Any, value: Any) -> bool:
    """A column's numpy scalar counts as the Python type it holds (bool stays bool)."""
    kinds = {bool: (bool, np.bool_), int: (int, np.integer), float: (float, np.floating)}
    expected = kinds.get(type(value), (type(value),))
    return isinstance(back, expected) and (type(value) is bool or not isinstance(back, bool))


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_form(value: Any) -> Any:
    """What a container reads back as: JSON of it, NaN and infinities as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_json_form(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_form(v) for k, v in value.items()}
    return value


def _jsonable(value: Any, depth: int = 0) -> bool:
    if depth > 50:  # a cycle, or nested deeper than anyone logs: kept as text
        return False
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(
            isinstance(k, str) and _utf8(k) and _jsonable(v, depth + 1) for k, v in value.items()
        )
    return _plain(value) and not isinstance(value, bytes)


def _check(run: Run, value: Any, odd_name: bool) -> None:
    name = f"v{next(_names)}" + ("\ud800\x1b[2J" if odd_name else "")
    # The work rl.log does on the training thread is small whatever the value (CPU time: a
    # busy machine may take the core away for longer), and it never waits for long. The
    # collector is off while it runs: a full collection that its allocations happen to
    # start walks the whole process's heap, which in a pytest worker that has imported
    # torch and transformers took 0.6 s, a cost of the heap, not of rl.log.
    collecting = gc.isenabled()
    gc.disable()
    try:
        started, started_cpu = time.perf_counter(), time.thread_time()
        assert rl.log(name, value) is value
        spent = time.thread_time() - started_cpu
    finally:
        if collecting:
            gc.enable()
    assert spent < 0.5
    assert time.perf_counter() - started < 5
    back = _read_back(run, name)
    if isinstance(value, float) and math.isnan(value):
        assert isinstance(back, float) and math.isnan(back)
    elif value is None:
        assert back is None or pd.isna(back), back
    elif _plain(value):
        assert back == value and _same_kind(back, value), (value, back)
    elif isinstance(value, (list, tuple, dict)) and _jsonable(value):
        assert back == _json_form(value), (value, back)
    elif isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        # One element is logged as the number it holds (as loss tensors are meant).
        stored = np.asarray(back, dtype=value.dtype)
        assert np.array_equal(stored.ravel(), value.ravel(), equal_nan=True), (value, back)
        assert value.size == 1 or stored.shape == value.shape
    else:
        assert back is not None  # kept as something: text, JSON or a note


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(value=values, odd_name=st.booleans())
@example(value=2**64, odd_name=False)
@example(value=-(2**200), odd_name=False)
@example(value="\ud800 lone surrogate", odd_name=True)
@example(value=[1, "\udfff"], odd_name=False)
@example(value=np.array(["a", None], dtype=object), odd_name=False)
def test_any_value_is_logged_and_reads_back(run: Run, value: Any, odd_name: bool) -> None:
    _check(run, value, odd_name)


# Outside hypothesis, which would print them if a test failed, and they do not print.
@pytest.mark.parametrize(
    "make", [_cycle, lambda: _deep(5000), Unprintable, lambda: {Unprintable(): 1.0}]
)
def test_values_that_cannot_be_printed_are_kept_as_a_note(run: Run, make: Any) -> None:
    _check(run, make(), odd_name=False)


def test_a_run_that_logged_everything_ends_finished(run: Run) -> None:
    rl.log("last", 1.0)
    assert _read_back(run, "last") == 1.0
    conn = sqlite3.connect(Path(run.paths.database))
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        conn.close()
    assert json.dumps(run.writer.latest, default=str)  # the progress bar's view is printable


def test_loop_names_and_items_sqlite_refuses_are_kept(run: Run) -> None:
    items = [2**70, "\udfff", 1.5]
    assert list(rl.loop("odd\ud800", items)) == items
    assert run.writer.flush(timeout=30) and run.writer.failure is None
    conn = sqlite3.connect(run.paths.database)
    try:
        rows = conn.execute(
            "SELECT name, value FROM loops WHERE run_id = ? AND name LIKE 'odd%'"
            " ORDER BY iteration",
            (run.run_id,),
        ).fetchall()
    finally:
        conn.close()
    assert rows == [("odd\\ud800", str(2**70)), ("odd\\ud800", "\\udfff"), ("odd\\ud800", 1.5)]
