"""``in_order``: the bounded, ordered fan-out behind ObjectStore.put_all and get_all."""

from __future__ import annotations

import threading
import time

import pytest

from retrolog.store import objects
from retrolog.store.objects import in_order


class Calls:
    """A call that takes a while and records how many ran at once and which started."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.started: list[int] = []
        self.fail_at = fail_at

    def __call__(self, item: int) -> int:
        with self.lock:
            self.started.append(item)
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.01 if item != self.fail_at else 0.03)
            if item == self.fail_at:
                raise OSError(f"item {item} failed")
            return item * 10
        finally:
            with self.lock:
                self.now -= 1


def test_results_come_in_order_with_several_calls_at_once() -> None:
    calls = Calls()
    assert list(in_order(calls, range(40), 4)) == [i * 10 for i in range(40)]
    assert 1 < calls.most <= 4


def test_one_worker_calls_one_at_a_time_on_this_thread() -> None:
    seen: list[str] = []
    out = list(in_order(lambda i: seen.append(threading.current_thread().name) or i, range(5), 1))
    assert out == list(range(5)) and set(seen) == {threading.current_thread().name}


def test_a_failure_is_raised_in_its_turn_and_later_items_are_not_started() -> None:
    calls = Calls(fail_at=5)
    results = in_order(calls, range(100), 3)
    got = []
    with pytest.raises(OSError, match="item 5 failed"):
        for value in results:
            got.append(value)
    assert got == [0, 10, 20, 30, 40]
    # What was queued behind the failure (at most 2 x workers) is all that ever started.
    assert max(calls.started) < 5 + 2 * 3 + 1 and calls.now == 0


def test_items_read_ahead_are_bounded_by_count_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "IN_FLIGHT_BYTES", 100)
    drawn: list[int] = []

    def items() -> object:
        for i in range(50):
            drawn.append(i)
            yield b"x" * 40  # 40 bytes: at most two, then a third waits for room

    results = in_order(len, items(), 8, size=len)  # type: ignore[arg-type]
    assert next(results) == 40
    assert len(drawn) <= 4  # not 2 x 8 = 16: the byte budget holds it back
    results.close()


def test_closing_early_leaves_no_call_running() -> None:
    calls = Calls()
    results = in_order(calls, range(100), 4)
    assert next(results) == 0
    results.close()
    assert calls.now == 0 and len(calls.started) <= 1 + 2 * 4


def test_leaving_a_batch_tells_its_calls_still_waiting_to_give_up() -> None:
    """A store that does not answer must not hold the caller who left (Ctrl-C, a failure)
    for its requests' timeouts: the pool is joined on the way out."""
    gave_up: list[int] = []
    started: list[int] = []

    def waits(item: int) -> int:
        started.append(item)
        if item == 0:
            return item
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if objects.requests_abandoned():
                gave_up.append(item)
                raise RuntimeError("abandoned")
            time.sleep(0.01)
        return item

    assert not objects.requests_abandoned()  # outside a batch: never
    batch = in_order(waits, range(4), workers=4)
    assert next(batch) == 0
    # Every call is waiting before the caller leaves (on a busy machine a pool thread can
    # start late; a call that never started is cancelled, not told to give up).
    deadline = time.monotonic() + 30
    while len(started) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    began = time.monotonic()
    batch.close()
    assert time.monotonic() - began < 5
    assert sorted(gave_up) == [1, 2, 3]
