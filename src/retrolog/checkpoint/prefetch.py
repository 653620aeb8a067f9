"""Reading and decoding a replay worker's next checkpoint while it runs the code before it.

A worker knows from its spec which checkpoints it will restore, in order. One
background thread reads and decodes them (object files, decompression, delta
bases, tensors, and the copy the live objects will own), at most ``ahead``
beyond the one the worker last released, so a restore on the worker's critical
path is handing decoded state to the live objects (``load_state_dict``). The
first one is decoded while the script's own start (data, model) runs; each later
one while the code between two restores (an evaluation, a scheduler step) runs.

The worker calls :meth:`Prefetcher.release` once a restore is over, and only then
does the thread decode further. Decoding is mostly Python (the manifest, small
arrays, the walk of the state), so a decode running during the restore takes the
GIL from it in 5 ms turns: with torch on every core (its default), that made a
restore on the critical path 2.2x torch.load's time (bench_replay
``--torch-threads default``).

Errors are the restore's: a missing or corrupt object raises StoreError from
:meth:`Prefetcher.take`, and the worker executes that block instead, as it
would without prefetching. Only this thread decodes while it runs (the cache of
decoded delta bases is not shared between threads), so a checkpoint that was
not announced is decoded by ``take`` under the same lock.

The thread's decodes call torch, so each runs inside an :class:`ExitGate`
section, and :meth:`Prefetcher.close` (also registered to run at exit) waits
for the one going on: a worker that runs its script to the end finalizes the
interpreter, which must not happen while this thread is inside torch.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from retrolog.checkpoint._exitgate import ExitGate
from retrolog.checkpoint.state import Snapshot, thaw
from retrolog.store.objects import ObjectStore

# How long close() waits for the thread to end once no decode is going on.
JOIN_SECONDS = 2.0


class Prefetcher:
    """Decodes ``manifests`` in order in a daemon thread, ``ahead`` beyond the last taken."""

    def __init__(self, store: ObjectStore, manifests: Sequence[str], ahead: int = 1) -> None:
        self._store = store
        self._order = list(dict.fromkeys(manifests))
        self._index = {m: i for i, m in enumerate(self._order)}
        self._ahead = max(ahead, 1)
        self._taken = -1  # index of the last manifest taken
        self._released = -1  # index of the last manifest whose restore is over
        self._finished = -1  # the thread is done with every manifest up to this index
        self._done: dict[str, tuple[Snapshot | None, BaseException | None]] = {}
        self._changed = threading.Condition()
        self._decoding = threading.Lock()
        self._stop = False
        self._exited = False
        self.decode_seconds = 0.0  # in the background thread
        self.wait_seconds = 0.0  # what take() waited for it
        self._thread: threading.Thread | None = None
        self._gate = ExitGate()

    def start(self) -> None:
        if self._thread is None and self._order:
            self._thread = threading.Thread(target=self._run, name="retrolog-prefetch", daemon=True)
            atexit.register(self.close)
            self._thread.start()

    def _run(self) -> None:
        try:
            for i, manifest in enumerate(self._order):
                with self._changed:
                    # Up to the one being taken (it is needed now), and ``ahead`` beyond
                    # the last one released.
                    while not self._stop and i > max(self._taken, self._released + self._ahead):
                        self._changed.wait()
                    if self._stop:
                        return
                    if i < self._taken:  # the worker went past it (it executed that block)
                        self._finished = i
                        continue
                result = self._decode(manifest, gated=True)
                with self._changed:
                    self._done[manifest] = result
                    self._finished = i
                    self._changed.notify_all()
        finally:
            with self._changed:
                self._exited = True
                self._changed.notify_all()

    def _decode(
        self, manifest: str, *, gated: bool = False
    ) -> tuple[Snapshot | None, BaseException | None]:
        """Decode ``manifest``; ``gated``: on the prefetch thread, inside the exit gate."""
        from retrolog.checkpoint.capture import load_checkpoint

        started = time.perf_counter()
        try:
            with self._gate.section() if gated else contextlib.nullcontext():
                with self._decoding:
                    snapshot = load_checkpoint(self._store, manifest)
                # The copy the live objects will own, made here too: the worker's thread
                # only hands it over (restore(..., thawed=True)).
                return Snapshot(objects=thaw(snapshot.objects), rng=snapshot.rng), None
        except Exception as exc:  # raised again by take(), on the worker's thread
            return None, exc
        finally:
            self.decode_seconds += time.perf_counter() - started

    def take(self, manifest: str) -> Snapshot:
        """The decoded checkpoint, its objects a thawed copy for ``restore(..., thawed=True)``.

        Waits for it if need be; raises what decoding raised.
        """
        index = self._index.get(manifest)
        if index is None or self._thread is None:
            snapshot, error = self._decode(manifest)
        else:
            started = time.perf_counter()
            with self._changed:
                self._taken = max(self._taken, index)
                for earlier in self._order[:index]:  # not restored after all: not kept
                    self._done.pop(earlier, None)
                self._changed.notify_all()
                # Not yet decoded: wait. Already taken once (a block restored again after
                # its first restore failed): decoded again below, on this thread.
                while manifest not in self._done and index > self._finished and not self._exited:
                    self._changed.wait()
                found = self._done.pop(manifest, None)
            self.wait_seconds += time.perf_counter() - started
            snapshot, error = found if found is not None else self._decode(manifest)
        if error is not None:
            raise error
        assert snapshot is not None
        return snapshot

    def release(self) -> None:
        """The restore of the checkpoint last taken is over: decode the next ones now."""
        with self._changed:
            if self._released < self._taken:
                self._released = self._taken
                self._changed.notify_all()

    def close(self) -> None:
        """Stop decoding ahead; waits for a decode going on to leave torch (see the module)."""
        with self._changed:
            self._stop = True
            self._done.clear()
            self._changed.notify_all()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._gate.close()
            self._thread.join(timeout=JOIN_SECONDS)  # it stops before its next decode
            atexit.unregister(self.close)

    def figures(self) -> dict[str, Any]:
        return {"decode_seconds": self.decode_seconds, "wait_seconds": self.wait_seconds}
