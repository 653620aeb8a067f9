"""The order of a replay worker's restore: the next checkpoint is decoded only after it.

A replay worker restores a checkpoint in steps: the objects' state (decoded ahead by
the prefetcher), then the script's frame locals, then the optimizers' step marks.
Releasing the prefetcher lets its thread decode the next checkpoint, which is mostly
Python and takes the GIL; a thread that wants the GIL back waits up to the switch
interval (5 ms) for it. So the release must come after every step of the restore,
never between them, and must still come when a step fails.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from retrolog.runtime import frames
from retrolog.runtime import replay_worker as replay_runtime
from retrolog.runtime.replay_worker import ReplayRun


class SpyPrefetcher:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def take(self, manifest: str) -> object:
        self.calls.append(f"take {manifest}")
        return object()

    def release(self) -> None:
        self.calls.append("release")


def bare_runtime(calls: list[str]) -> ReplayRun:
    """A ReplayRun with only what _restore_checkpoint reads (no spec, no store)."""
    runtime = ReplayRun.__new__(ReplayRun)
    runtime._prefetch = SpyPrefetcher(calls)
    runtime._frame_locals = {}
    runtime._reads = set()
    runtime._fallbacks = []
    runtime._restore_seconds = 0.0
    runtime._restored = 0
    runtime._checkpoint_at = []
    runtime._last_checkpoint = None
    runtime._restored_where = []
    runtime.spec = SimpleNamespace(end_checkpoint=None, block_checkpoints={})  # type: ignore[assignment]
    runtime.values = []  # type: ignore[assignment]
    runtime.events = []  # type: ignore[assignment]
    return runtime


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(
        "retrolog.checkpoint.state.restore",
        lambda objects, snap, thawed=False: seen.append("objects"),
    )
    monkeypatch.setattr(frames, "restore", lambda frame, values: seen.append("frame locals"))
    monkeypatch.setattr(
        replay_runtime, "_mark_optimizers_stepped", lambda objects: seen.append("step marks")
    )
    return seen


def scope() -> Any:
    return SimpleNamespace(objects={})  # the checkpointing() block's named objects


def test_the_prefetcher_is_released_after_every_step_of_the_restore(calls: list[str]) -> None:
    runtime = bare_runtime(calls)
    assert runtime._restore_checkpoint("m1", scope(), None, ("epoch", 0))
    assert calls == ["take m1", "objects", "frame locals", "step marks", "release"]
    assert runtime._restored == 1 and runtime._last_checkpoint == "m1"


def test_the_prefetcher_is_released_when_a_step_of_the_restore_fails(
    calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(frame: object, values: object) -> None:
        calls.append("frame locals")
        raise RuntimeError("frame locals could not be written")

    monkeypatch.setattr(frames, "restore", broken)
    runtime = bare_runtime(calls)
    with pytest.raises(RuntimeError):
        runtime._restore_checkpoint("m1", scope(), None, ("epoch", 0))
    assert calls == ["take m1", "objects", "frame locals", "release"]
