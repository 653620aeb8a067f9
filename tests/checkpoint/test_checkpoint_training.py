"""Checkpoints of real training state: exact round trips through the store, bit-exact replay."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from retrolog.checkpoint import state as state_module
from retrolog.checkpoint.capture import (
    CheckpointRecord,
    SynchronousCheckpointer,
    load_checkpoint,
    restore_checkpoint,
)
from retrolog.checkpoint.codec import decode, encode
from retrolog.checkpoint.state import restore, snapshot
from retrolog.store.objects import LocalObjectStore

N, D = 64, 6


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects", durable=False)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny ops on a busy machine: one thread is ~30x faster than an
    # oversubscribed OpenMP pool.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_training(
    optimizer: str = "adam", *, scaler_enabled: bool = False
) -> tuple[dict[str, Any], Callable[[], float]]:
    """A small seeded model with dropout, batch norm, a scheduler and a shuffled dataset."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    data = torch.randn(N, D)
    target = (data.sum(dim=1, keepdim=True) > 0).float()
    net = nn.Sequential(
        nn.Linear(D, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1)
    )
    opt: torch.optim.Optimizer
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=1e-4)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7)
    step_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled, init_scale=2.0**4)
    progress: dict[str, Any] = {"step": 0, "seen": []}
    noise = np.zeros(D, dtype=np.float32)

    def step() -> float:
        # Draws from every RNG: numpy and random pick the batch, torch draws dropout.
        idx = np.random.permutation(N)[:16]
        if random.random() < 0.5:
            idx = idx[::-1].copy()
        noise[:] = np.random.standard_normal(D).astype(np.float32) * 0.01
        x = data[torch.from_numpy(idx)] + torch.from_numpy(noise)
        net.train()
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(net(x), target[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        step_sched.step()
        progress["step"] += 1
        progress["seen"].append(int(idx[0]))
        return loss.item()

    objects = {
        "model": net,
        "optimizer": opt,
        "scheduler": sched,
        "step_scheduler": step_sched,
        "scaler": scaler,
        "progress": progress,
        "noise": noise,
    }
    return objects, step


def params_of(objects: dict[str, Any]) -> list[torch.Tensor]:
    net = objects["model"]
    return [t.detach().clone() for t in [*net.parameters(), *net.buffers()]]


def run(step: Callable[[], float], objects: dict[str, Any], m: int) -> tuple[list[float], list]:
    losses = [step() for _ in range(m)]
    return losses, params_of(objects)


@pytest.mark.parametrize(
    ("optimizer", "scaler_enabled"), [("adam", False), ("sgd", False), ("adam", True)]
)
def test_replay_from_a_checkpoint_is_bit_exact(
    store: LocalObjectStore, optimizer: str, scaler_enabled: bool
) -> None:
    objects, step = make_training(optimizer, scaler_enabled=scaler_enabled)
    for _ in range(5):
        step()
    records: list[CheckpointRecord] = []
    with SynchronousCheckpointer(store, records.append) as ckpt:
        ckpt.capture(ctx_id=5, loop_name="epoch", kind="block", objects=objects)
    state_after_k = {k: v for k, v in objects["progress"].items()}
    losses1, params1 = run(step, objects, 6)
    lr1 = objects["optimizer"].param_groups[0]["lr"]
    scale1 = objects["scaler"].get_scale()

    ids = {name: id(obj) for name, obj in objects.items()}
    param_ids = [id(p) for p in objects["model"].parameters()]
    restore_checkpoint(objects, store, records[0].manifest)
    assert {name: id(obj) for name, obj in objects.items()} == ids
    assert [id(p) for p in objects["model"].parameters()] == param_ids
    assert objects["progress"]["step"] == state_after_k["step"] == 5
    losses2, params2 = run(step, objects, 6)

    assert losses1 == losses2
    assert all(torch.equal(a, b) for a, b in zip(params1, params2, strict=True))
    assert objects["optimizer"].param_groups[0]["lr"] == lr1
    assert objects["scaler"].get_scale() == scale1


def test_replay_without_the_rng_states_diverges(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control for the test above: the RNG states are what makes it pass.
    objects, step = make_training()
    for _ in range(5):
        step()
    key, _ = encode(snapshot(objects), store)
    losses1, _ = run(step, objects, 3)
    monkeypatch.setattr(state_module, "restore_rng", lambda rng: None)
    restore_checkpoint(objects, store, key)
    losses2, _ = run(step, objects, 3)
    assert losses1 != losses2


def test_checkpoint_record(store: LocalObjectStore) -> None:
    objects, step = make_training()
    step()
    records: list[CheckpointRecord] = []
    ckpt = SynchronousCheckpointer(store, records.append)
    ckpt.capture(ctx_id=None, loop_name="epoch", kind="end", objects=objects)
    ckpt.close()
    (record,) = records
    assert (record.ctx_id, record.loop_name, record.kind) == (None, "epoch", "end")
    assert store.has(record.manifest)
    assert record.nbytes > sum(t.numel() * 4 for t in objects["model"].parameters())
    assert record.capture_seconds >= 0 and record.write_seconds >= 0 and record.created_at > 0
    snap = load_checkpoint(store, record.manifest)
    assert set(snap.objects) == set(objects)
    with pytest.raises(ValueError, match="kind"):
        SynchronousCheckpointer(store, records.append).capture(
            ctx_id=1, loop_name="epoch", kind="middle", objects=objects
        )


def test_sink_sees_a_record_only_after_everything_is_written(store: LocalObjectStore) -> None:
    objects, _ = make_training()
    seen: list[bool] = []

    def sink(record: CheckpointRecord) -> None:
        # Everything the manifest names is readable when the record arrives.
        seen.append(load_checkpoint(store, record.manifest) is not None)

    SynchronousCheckpointer(store, sink).capture(
        ctx_id=0, loop_name="epoch", kind="block", objects=objects
    )
    assert seen == [True]


def state_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(state_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def test_each_kind_of_state_round_trips_exactly(store: LocalObjectStore) -> None:
    objects, step = make_training(scaler_enabled=True)
    for _ in range(3):
        step()
    objects["arrays"] = {
        1: np.arange(5, dtype=np.int16),
        2: [np.ones((2, 2), dtype=np.float16), [np.array([True, False])]],
        "nested": [[1, 2.5, None, "x"], (3, 4)],
    }
    snap = snapshot(objects)
    key, _ = encode(snap, store)
    back = decode(key, store)
    for name in objects:
        assert state_equal(back.objects[name], snap.objects[name]), name
    assert back.objects["model"]._metadata == snap.objects["model"]._metadata
    assert isinstance(back.objects["optimizer"]["state"], dict)
    assert all(type(k) is int for k in back.objects["optimizer"]["state"])
    assert state_equal(back.rng, snap.rng)

    # Restoring the decoded snapshot gives the live objects exactly the captured state.
    before = {name: snapshot({name: obj}).objects[name] for name, obj in objects.items()}
    step()
    restore(objects, back)
    after = {name: snapshot({name: obj}).objects[name] for name, obj in objects.items()}
    for name in objects:
        assert state_equal(after[name], before[name]), name
