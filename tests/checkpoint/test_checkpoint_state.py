"""In-memory snapshots: which targets are accepted, independence, restore in place."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from retrolog.checkpoint.state import (
    capture_rng,
    restore,
    restore_rng,
    snapshot,
    validate_targets,
)
from retrolog.errors import CheckpointTargetError


class Counter:
    """A user object with the state_dict protocol."""

    def __init__(self) -> None:
        self.n = 0
        self.history: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]
        self.history = state["history"]


class HalfProtocol:
    def state_dict(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (3, "int"),
        ("abc", "str"),
        (object(), "object"),
        ((1, 2), "tuple"),
        (random.SystemRandom(), "SystemRandom"),
        (HalfProtocol(), "HalfProtocol"),
    ],
)
def test_validate_rejects_unsupported_targets(value: object, type_name: str) -> None:
    with pytest.raises(CheckpointTargetError) as info:
        validate_targets({"model": nn.Linear(1, 1), "epoch_count": value})
    message = str(info.value)
    assert info.value.name == "epoch_count"
    assert "'epoch_count'" in message and type_name in message
    assert "state_dict()" in message and "numpy arrays" in message  # what is accepted
    assert "wrap it" in message  # what to do
    assert "\n" not in message


def test_validate_explains_half_of_the_protocol() -> None:
    with pytest.raises(CheckpointTargetError, match=r"has state_dict\(\) but not the other"):
        validate_targets({"thing": HalfProtocol()})


def test_validate_rejects_read_only_arrays_and_non_str_names() -> None:
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(CheckpointTargetError, match="read-only"):
        validate_targets({"arr": frozen})
    with pytest.raises(CheckpointTargetError, match="keyword arguments"):
        validate_targets({1: []})  # type: ignore[dict-item]


def test_validate_accepts_supported_targets() -> None:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    validate_targets(
        {
            "net": net,
            "opt": opt,
            "sched": torch.optim.lr_scheduler.StepLR(opt, 2),
            "scaler": torch.amp.GradScaler("cpu"),
            "t": torch.zeros(2),
            "a": np.zeros(2),
            "d": {},
            "l": [],
            "od": OrderedDict(),
            "counter": Counter(),
            "r": random.Random(0),
            "g": np.random.default_rng(0),
        }
    )


def test_snapshot_is_independent_of_later_changes() -> None:
    net = nn.Linear(3, 2)
    arr = np.arange(4.0)
    tensor = torch.ones(2)
    state = {"best": [1.0, {"epoch": 1}], "t": torch.zeros(2)}
    history = [[1], np.zeros(2)]
    counter = Counter()
    objects = {"net": net, "arr": arr, "t": tensor, "state": state, "hist": history, "c": counter}
    snap = snapshot(objects)
    weight = net.weight.detach().clone()

    with torch.no_grad():
        net.weight.add_(1.0)
    arr += 1
    tensor.mul_(5)
    state["best"][1]["epoch"] = 9
    state["t"].add_(3)
    history[0].append(2)
    history[1][0] = 7
    counter.history.append(1)
    random.random()

    assert torch.equal(snap.objects["net"]["weight"], weight)
    assert np.array_equal(snap.objects["arr"], np.arange(4.0))
    assert torch.equal(snap.objects["t"], torch.ones(2))
    assert snap.objects["state"]["best"][1] == {"epoch": 1}
    assert torch.equal(snap.objects["state"]["t"], torch.zeros(2))
    assert snap.objects["hist"][0] == [1] and snap.objects["hist"][1][0] == 0
    assert snap.objects["c"]["history"] == []


def test_restore_is_in_place_and_repeatable() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    arr = np.arange(6.0).reshape(2, 3)
    tensor = torch.zeros(3, requires_grad=True)
    state: dict[str, Any] = {"best": 0.5}
    hist: list[Any] = [1, 2]
    gen = np.random.default_rng(5)
    objects = {"net": net, "opt": opt, "arr": arr, "t": tensor, "s": state, "h": hist, "g": gen}

    def train_step() -> None:
        opt.zero_grad()
        net(torch.randn(5, 3)).sum().backward()
        opt.step()

    train_step()
    snap = snapshot(objects)
    expected_params = [p.detach().clone() for p in net.parameters()]
    expected_moments = [opt.state[p]["exp_avg"].clone() for p in net.parameters()]
    expected_draw = gen.random()
    param_ids = [id(p) for p in net.parameters()]
    data_ptrs = [p.data_ptr() for p in net.parameters()]

    for _ in range(2):  # restoring must not consume the snapshot
        train_step()
        arr *= 2
        with torch.no_grad():
            tensor.add_(1)
        state["extra"] = 1
        hist.append(3)
        gen.random()

        restore(objects, snap)
        assert [id(p) for p in net.parameters()] == param_ids
        assert [p.data_ptr() for p in net.parameters()] == data_ptrs
        assert all(
            a is b for a, b in zip(opt.param_groups[0]["params"], net.parameters(), strict=True)
        )
        for p, e, m in zip(net.parameters(), expected_params, expected_moments, strict=True):
            assert torch.equal(p, e)
            assert torch.equal(opt.state[p]["exp_avg"], m)  # training did not alter the snapshot
        assert np.array_equal(arr, np.arange(6.0).reshape(2, 3))
        assert torch.equal(tensor, torch.zeros(3)) and tensor.requires_grad
        assert state == {"best": 0.5} and hist == [1, 2]
        assert gen.random() == expected_draw
        assert objects["opt"] is opt and objects["s"] is state and objects["h"] is hist


def test_restore_mismatches_are_clear_errors() -> None:
    snap = snapshot({"a": np.zeros(3), "b": []})
    with pytest.raises(CheckpointTargetError, match=r"'b'.* not passed"):
        restore({"a": np.zeros(3)}, snap)
    with pytest.raises(CheckpointTargetError, match=r"'c' were passed but are not in"):
        restore({"a": np.zeros(3), "b": [], "c": []}, snap)
    with pytest.raises(CheckpointTargetError, match=r"shape \(4,\)") as info:
        restore({"a": np.zeros(4), "b": []}, snap)
    assert info.value.name == "a"
    with pytest.raises(CheckpointTargetError, match="dtype int64"):
        restore({"a": np.zeros(3, dtype=np.int64), "b": []}, snap)
    with pytest.raises(CheckpointTargetError, match="a list"):
        restore({"a": np.zeros(3), "b": {}}, snap)


def test_restore_into_a_changed_model_is_a_clear_error() -> None:
    snap = snapshot({"net": nn.Linear(3, 2)})
    with pytest.raises(CheckpointTargetError, match=r"'net'.*load_state_dict\(\) rejected"):
        restore({"net": nn.Linear(3, 5)}, snap)


def test_rng_capture_and_restore() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    rng = capture_rng()
    first = (random.random(), np.random.random(), torch.rand(3), np.random.standard_normal())
    restore_rng(rng)
    second = (random.random(), np.random.random(), torch.rand(3), np.random.standard_normal())
    assert first[0] == second[0] and first[1] == second[1] and first[3] == second[3]
    assert torch.equal(first[2], second[2])


def test_core_does_not_import_torch(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import retrolog.checkpoint.capture as capture
        from retrolog.store.objects import LocalObjectStore

        store = LocalObjectStore(sys.argv[1])
        records = []
        objects = {"arr": np.arange(3.0), "d": {1: "a"}, "l": [1.5]}
        with capture.SynchronousCheckpointer(store, records.append) as ckpt:
            ckpt.capture(ctx_id=1, loop_name="epoch", kind="block", objects=objects)
        objects["arr"] += 1
        capture.restore_checkpoint(objects, store, records[0].manifest)
        assert objects["arr"].tolist() == [0.0, 1.0, 2.0]
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "objects"], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
