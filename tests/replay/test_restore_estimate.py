"""The replay's restore estimate: what one restore costs, not what opening a store costs."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from retrolog._replay import replayer
from retrolog.checkpoint.codec import encode, manifest_blobs
from retrolog.checkpoint.state import Snapshot
from retrolog.store import backends
from retrolog.store.objects import ForwardingStore, ObjectStore
from retrolog.store.paths import ProjectPaths

CONNECT_SECONDS = 0.5


class FirstRequestOpens(ForwardingStore):
    """A remote store's first request, which opens its connection (on S3, many times what
    a small checkpoint's read takes), and fast reads after it."""

    reads = 0

    def get(self, key: str) -> bytes:
        type(self).reads += 1
        if type(self).reads == 1:
            time.sleep(CONNECT_SECONDS)
        return self.inner.get(key)


class OnePreemption(FirstRequestOpens):
    """A busy machine: the process is off the CPU for 30 ms in the middle of one read."""

    def get(self, key: str) -> bytes:
        type(self).reads += 1
        if type(self).reads == 2:  # the first timed read
            time.sleep(0.03)
        return self.inner.get(key)


def _one_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: type[FirstRequestOpens], floats: int
) -> float:
    """The estimated seconds to restore a checkpoint of ``floats`` float64s read through
    ``store``."""
    monkeypatch.setattr(store, "reads", 0)
    store_dir = tmp_path / ".retrolog"
    local = backends.open_object_store(store_dir / "objects")
    key, _ = encode(Snapshot(objects={"w": np.arange(float(floats))}, rng={}), local)

    def opened(root: Path, location: str | None = None) -> ObjectStore:
        return store(backends.open_object_store(root / "objects"))

    monkeypatch.setattr(backends, "object_store_for", opened)
    paths = ProjectPaths(root=tmp_path, store=store_dir, in_git=False)
    profile = SimpleNamespace(block_checkpoints={0: key}, end_checkpoint=None)
    per_byte = replayer._restore_seconds_per_byte(paths, [profile])
    assert store.reads > 1 and per_byte is not None
    read = len(local.get(key)) + sum(len(local.get(blob)) for blob in manifest_blobs(key, local))
    return per_byte * read


def test_the_restore_estimate_leaves_out_opening_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 32 KB checkpoint on a store whose first request takes 0.5 s: the estimate is the
    read, so a block of a third of a second is restored rather than executed."""
    estimate = _one_restore(tmp_path, monkeypatch, FirstRequestOpens, 4096)
    assert estimate < CONNECT_SECONDS / 5, f"{estimate:.3f}s for one restore"


def test_one_preemption_does_not_make_every_restore_look_dear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint read takes well under a millisecond from the page cache; one timing
    caught by a preemption would price every restore at 30 ms, more than the short blocks
    of a small model take to run."""
    estimate = _one_restore(tmp_path, monkeypatch, OnePreemption, 256)
    assert estimate < 0.01, f"{estimate:.4f}s for one restore"
