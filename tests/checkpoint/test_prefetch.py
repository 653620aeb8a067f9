"""The replay worker's prefetcher: checkpoints decoded ahead, in order, on another thread."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from retrolog.checkpoint.codec import decode, encode
from retrolog.checkpoint.prefetch import Prefetcher
from retrolog.checkpoint.state import Snapshot
from retrolog.errors import StoreError
from retrolog.store.objects import LocalObjectStore


class _Recording(LocalObjectStore):
    """A real store that notes which thread read each object, and can be slow."""

    def __init__(self, root: Path, delay: float = 0.0) -> None:
        super().__init__(root, durable=False)
        self.delay = delay
        self.threads: set[str] = set()
        self.reads: list[str] = []

    def get(self, key: str) -> bytes:
        self.threads.add(threading.current_thread().name)
        self.reads.append(key)
        if self.delay:
            time.sleep(self.delay)
        return super().get(key)


def _checkpoints(store: LocalObjectStore, n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [
        encode(Snapshot(objects={"w": rng.standard_normal(1000), "i": i}, rng={}), store)[0]
        for i in range(n)
    ]


def _same(a: Snapshot, b: Snapshot) -> bool:
    return a.objects["i"] == b.objects["i"] and np.array_equal(a.objects["w"], b.objects["w"])


def test_checkpoints_are_decoded_off_the_worker_thread_and_equal_a_direct_decode(
    tmp_path: Path,
) -> None:
    store = _Recording(tmp_path / "objects")
    keys = _checkpoints(store, 5)
    reference = [decode(k, store) for k in keys]
    store.threads.clear()
    prefetch = Prefetcher(store, keys)
    prefetch.start()
    for key, expected in zip(keys, reference, strict=True):
        time.sleep(0.02)  # the code between two restores
        assert _same(prefetch.take(key), expected)
        prefetch.release()
    assert store.threads == {"retrolog-prefetch"}
    assert prefetch.decode_seconds > 0


def test_the_wait_is_shorter_than_the_decode_when_code_runs_between_restores(
    tmp_path: Path,
) -> None:
    store = _Recording(tmp_path / "objects", delay=0.05)
    keys = _checkpoints(store, 4)
    prefetch = Prefetcher(store, keys)
    prefetch.start()
    for key in keys:
        time.sleep(0.3)  # longer than a decode: each one is ready when it is taken
        prefetch.take(key)
        prefetch.release()
    assert prefetch.wait_seconds < 0.1 < prefetch.decode_seconds


def test_an_unreadable_checkpoint_raises_on_take_and_the_rest_still_come(
    tmp_path: Path,
) -> None:
    store = LocalObjectStore(tmp_path / "objects", durable=False)
    keys = _checkpoints(store, 4)
    reference = [decode(k, store) for k in keys]
    path = store.path(keys[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    prefetch = Prefetcher(store, keys)
    prefetch.start()
    assert _same(prefetch.take(keys[0]), reference[0])
    with pytest.raises(StoreError):
        prefetch.take(keys[1])
    with pytest.raises(StoreError):  # asked again (the worker tries once more): same answer
        prefetch.take(keys[1])
    assert _same(prefetch.take(keys[2]), reference[2])
    assert _same(prefetch.take(keys[3]), reference[3])


@pytest.mark.parametrize("seed", range(20))
def test_any_order_of_takes_gets_the_right_checkpoint_and_never_hangs(
    tmp_path: Path, seed: int
) -> None:
    """Skips, repeats, a checkpoint that was not announced, racing the thread's end."""
    chooser = random.Random(seed)
    store = LocalObjectStore(tmp_path / "objects", durable=False)
    keys = _checkpoints(store, 6)
    reference = dict(zip(keys, (decode(k, store) for k in keys), strict=True))
    announced = keys[:5]  # keys[5] is restored without having been announced
    prefetch = Prefetcher(store, announced, ahead=chooser.choice([1, 2]))
    prefetch.start()
    position = 0
    takes = []
    while position < len(keys):
        takes.append(keys[position])
        if chooser.random() < 0.2:
            takes.append(keys[position])  # restored again
        position += chooser.choice([1, 1, 2])  # sometimes a block is executed instead
    done = threading.Event()
    results: list[bool] = []

    def worker() -> None:
        for key in takes:
            if chooser.random() < 0.5:
                time.sleep(chooser.random() * 0.01)
            results.append(_same(prefetch.take(key), reference[key]))
            if chooser.random() < 0.8:  # a worker releases each; a missed one must not hang
                prefetch.release()
        done.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert done.wait(30), f"take() hung on {takes}"
    assert results == [True] * len(takes)


def test_the_next_checkpoint_is_decoded_after_the_restore_not_during_it(
    tmp_path: Path,
) -> None:
    """A decode is mostly Python: run during a restore, it would take the GIL from it."""
    store = _Recording(tmp_path / "objects")
    keys = _checkpoints(store, 3)
    store.reads.clear()
    prefetch = Prefetcher(store, keys, ahead=1)
    prefetch.start()
    prefetch.take(keys[0])  # decoded while the script started
    time.sleep(0.3)  # the restore: long enough for any decode to have begun
    assert keys[1] not in store.reads
    prefetch.release()
    deadline = time.monotonic() + 10
    while keys[1] not in store.reads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keys[1] in store.reads, "released, the next checkpoint was not decoded ahead"
    time.sleep(0.2)
    assert keys[2] not in store.reads  # one ahead, no more
    assert prefetch.wait_seconds < 0.5
    prefetch.close()


def test_taking_a_later_checkpoint_first_does_not_wait_for_one_that_is_never_decoded(
    tmp_path: Path,
) -> None:
    """The worker executed block 0 instead of restoring it, and asks for block 1 first."""
    store = LocalObjectStore(tmp_path / "objects", durable=False)
    keys = _checkpoints(store, 2)  # block 1 is the last: nothing wakes the worker later
    reference = decode(keys[1], store)
    prefetch = Prefetcher(store, keys, ahead=1)
    prefetch.start()
    time.sleep(0.2)  # block 0 is decoded; the thread waits to be allowed to go on
    done = threading.Event()
    found: list[Snapshot] = []

    def worker() -> None:
        found.append(prefetch.take(keys[1]))
        done.set()

    threading.Thread(target=worker, daemon=True).start()
    assert done.wait(10), "take() waited for a checkpoint the thread skipped"
    assert _same(found[0], reference)


# The prefetch thread spends its time inside torch (a matmul before each decoded
# checkpoint is copied), and the worker's script ends meanwhile. Without the exit gate the
# interpreter finalizes with the thread inside torch, and the process aborts ("terminate
# called without an active exception", status -6).
IN_TORCH_AT_EXIT = """\
import sys
import time
import torch
from retrolog.checkpoint import prefetch
from retrolog.checkpoint.codec import encode
from retrolog.checkpoint.state import Snapshot
from retrolog.store.objects import LocalObjectStore

store = LocalObjectStore(sys.argv[1], durable=False)
snaps = [Snapshot(objects={"w": torch.randn(1000) + i}, rng={}) for i in range(10)]
keys = [encode(snap, store)[0] for snap in snaps]
big = torch.randn(1500, 1500)
thaw = prefetch.thaw


def slow(value):
    torch.mm(big, big)
    return thaw(value)


prefetch.thaw = slow
ahead = prefetch.Prefetcher(store, keys, ahead=10)
ahead.start()
time.sleep(0.3)
print("done", flush=True)
"""


def test_a_worker_ending_while_the_prefetcher_is_inside_torch_exits_cleanly(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(IN_TORCH_AT_EXIT)
    for _ in range(2):  # without the gate, each aborts
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "objects")],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0 and "terminate" not in done.stderr, done.stderr
        assert done.stdout == "done\n"


THAW_OFF_THE_TRAINING_THREAD = """\
import os, threading, torch
from retrolog.checkpoint.state import thaw
torch.set_num_threads(2)  # the unit under test: a second thread beside a 2-thread pool
weights = torch.randn(1024, 1024)
(weights @ weights).sum()  # training's OpenMP team exists
def tasks():
    return len(os.listdir("/proc/self/task"))
out = {}
def prefetch():
    out["before"] = tasks()
    out["copy"] = thaw({"w": weights})["w"]
    out["after"] = tasks()
thread = threading.Thread(target=prefetch)
thread.start()
thread.join()
copy = out["copy"]
assert torch.equal(copy, weights) and copy.data_ptr() != weights.data_ptr()
print(out["before"], out["after"])
"""


def test_thawing_on_the_prefetch_thread_starts_no_second_thread_team() -> None:
    """torch's copy of a large tensor fans out to its OpenMP pool; called from the
    prefetcher's thread it started a second team beside training's, and on 2 cores a
    replay's first executed epoch after a restore ran 2.6x slower. The thaw is one
    memcpy on the calling thread: the process gains no thread."""
    out = subprocess.run(
        [sys.executable, "-c", THAW_OFF_THE_TRAINING_THREAD],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert after == before, (before, after)
