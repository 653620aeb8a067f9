"""Nothing read from a store runs code: planted pickles are refused, and replay stays exact.

Whoever can write a store's files (a colleague's shared store, a project
directory someone sends) plants a payload that creates a marker file when
unpickled, in every place a store's contents are decoded: a manifest node, a
checkpoint's saved locals, and dtype fields that could name object arrays.
Reading them (``rl.restore``, ``retrolog replay``) must not create the marker;
replay executes the affected blocks instead and its values stay exact.
"""

from __future__ import annotations

import json
import pickle
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from retrolog.checkpoint.codec import decode
from retrolog.errors import StoreError, UntrustedPickleError
from retrolog.runtime import frames
from retrolog.store.objects import LocalObjectStore

from conftest import Project, read_db

SCRIPT = """\
import time

import numpy as np
import retrolog as rl

np.random.seed(0)
state = {"w": np.zeros(3)}
with rl.checkpointing(state=state):
    for epoch in rl.loop("epoch", range(3)):
        total = 0.0
        for step in rl.loop("step", range(4)):
            g = np.random.standard_normal(3)
            state["w"] += 0.1 * g
            total += float(g.sum())
            time.sleep(0.04)  # a block worth restoring rather than executing
        rl.log("total", total)
"""

PROBE = SCRIPT.replace(
    '        rl.log("total", total)\n',
    '        rl.log("total", total)\n        rl.log("w0", float(state["w"][0]))\n'
    '        rl.log("mean", total / 4)\n',
)


class _Payload:
    """Unpickling this opens ``path`` for writing: the marker that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _record(project: Project) -> tuple[sqlite3.Connection, LocalObjectStore]:
    project.write("train.py", SCRIPT)
    project.run("train.py")
    store = project.root / ".retrolog"
    return sqlite3.connect(store / "retrolog.db"), LocalObjectStore(store / "objects")


def _plant_manifest(conn: sqlite3.Connection, objects: LocalObjectStore, marker: Path) -> None:
    """Each checkpoint's ``state`` dict gets a pickle node holding the payload."""
    payload = objects.put(pickle.dumps(_Payload(marker)))
    for checkpoint_id, key in conn.execute("SELECT checkpoint_id, manifest FROM checkpoints"):
        doc = json.loads(objects.get(key))
        state = doc["objects"]["items"][0][1]
        state["items"].append(["planted", {"$": "pickle", "blob": payload}])
        planted = objects.put(json.dumps(doc).encode())
        conn.execute(
            "UPDATE checkpoints SET manifest = ? WHERE checkpoint_id = ?", (planted, checkpoint_id)
        )
    conn.commit()


def _replayed_and_fresh(project: Project) -> tuple[dict[Any, Any], dict[Any, Any], str]:
    project.write("train.py", PROBE)
    done = project.cli("replay", "w0,mean", "--yes")
    assert done.returncode == 0, done.stderr
    query = (
        "SELECT g.name, l.iteration, g.value FROM logs g JOIN loops l"
        " ON l.run_id = g.run_id AND l.ctx_id = g.ctx_id WHERE g.name IN ('w0', 'mean')"
    )
    replayed = {(n, i): v for n, i, v in read_db(project.root, query)}
    with tempfile.TemporaryDirectory() as tmp:
        project.run("train.py", RETROLOG_STORE=str(Path(tmp) / "store"))
        conn = sqlite3.connect(Path(tmp) / "store" / "retrolog.db")
        fresh = {(n, i): v for n, i, v in conn.execute(query)}
        conn.close()
    return replayed, fresh, done.stderr


def test_a_pickle_planted_in_a_manifest_runs_nothing(project: Project, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    conn, objects = _record(project)
    _plant_manifest(conn, objects, marker)
    ((key,),) = conn.execute("SELECT manifest FROM checkpoints LIMIT 1").fetchall()
    conn.close()

    with pytest.raises(UntrustedPickleError, match="RETROLOG_TRUST_PICKLES=1"):
        decode(key, objects)
    assert not marker.exists()
    restored = project.run(
        "-c",
        "import numpy as np, retrolog as rl\n"
        "rl.restore(rl.dataframe('total').run_id[0], state={'w': np.zeros(3)})\n",
        check=False,
    )
    assert restored.returncode != 0 and "RETROLOG_TRUST_PICKLES" in restored.stderr
    assert not marker.exists()

    replayed, fresh, report = _replayed_and_fresh(project)
    assert not marker.exists()
    assert replayed == fresh and len(fresh) == 6
    assert "pickle" in report  # each refused checkpoint is named, its code was executed


def test_a_pickle_planted_as_saved_locals_runs_nothing(project: Project, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    conn, _ = _record(project)
    blob = pickle.dumps({"values": {"total": _Payload(marker)}, "not_captured": []})
    conn.execute("UPDATE checkpoints SET frame_locals = ?", (blob,))
    conn.commit()
    conn.close()
    with pytest.raises(UntrustedPickleError):
        frames.load(blob)
    assert not marker.exists()

    replayed, fresh, report = _replayed_and_fresh(project)
    assert not marker.exists()
    assert replayed == fresh and len(fresh) == 6
    assert "saved locals" in report


@pytest.mark.parametrize(
    "node",
    [
        {"$": "ndarray", "dtype": "|O", "shape": [2], "order": "C", "b64": "AAAAAAAAAAA="},
        {"$": "npscalar", "dtype": "|O", "b64": "AAAAAAAAAAA="},
        {"$": "ndarray", "dtype": "not a dtype", "shape": [1], "order": "C", "b64": ""},
    ],
    ids=["object-array", "object-scalar", "bad-dtype"],
)
def test_a_manifest_naming_object_dtypes_is_refused_cleanly(
    tmp_path: Path, node: dict[str, Any]
) -> None:
    objects = LocalObjectStore(tmp_path / "objects")
    doc = {
        "format": "retrolog.snapshot/2",
        "objects": {"$": "dict", "items": [["state", {"$": "dict", "items": [["x", node]]}]]},
        "rng": {"$": "dict", "items": []},
    }
    with pytest.raises(StoreError):
        decode(objects.put(json.dumps(doc).encode()), objects)


@pytest.mark.parametrize(
    "values",
    [
        {"x": {"$": "npscalar", "dtype": "|O", "b64": "AAAAAAAAAAA="}},
        {"x": {"$": "tensor", "dtype": "load", "shape": [1], "b64": ""}},
        {"x": {"$": "nonsense"}},
    ],
    ids=["object-scalar", "torch-function-as-dtype", "unknown-node"],
)
def test_saved_locals_naming_anything_but_data_are_refused(values: dict[str, Any]) -> None:
    blob = b"RLF1" + json.dumps({"values": values, "not_captured": []}).encode()
    with pytest.raises(StoreError):
        frames.load(blob)


def test_saved_locals_round_trip_as_data() -> None:
    torch = pytest.importorskip("torch")
    values = {
        "n": 3, "x": 1.5, "nan": float("nan"), "s": "text", "b": b"\x00\x01", "none": None,
        "flag": True, "c": 1 + 2j, "np": np.float32(2.5), "t": torch.arange(6.0).view(2, 3),
        "half": torch.ones(3, dtype=torch.bfloat16), "items": [1, (2, "3"), {4}],
        "d": {1: "a", ("k", 2): [0.25]},
    }  # fmt: skip
    doc = frames._dump(
        {"values": {k: frames._encode(v) for k, v in values.items()}, "not_captured": ["big"]}
    )
    loaded, missing = frames.load(doc)
    assert missing == ["big"]
    assert set(loaded) == set(values)
    for name, value in values.items():
        got = loaded[name]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value)
        elif name == "nan":
            assert got != got
        else:
            assert got == value and type(got) is type(value), name
