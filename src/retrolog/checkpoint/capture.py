"""The checkpoint interface the runtime calls where a block ends.

The runtime hands a :class:`Checkpointer` the named objects at the end of a
block (or of the outer loop) and learns about the finished checkpoint through
a sink, which receives a :class:`CheckpointRecord` only once every object the
manifest references is written. :class:`SynchronousCheckpointer` does all of
it on the calling thread; the background materializer
(background.py) replaces it behind the same two methods, which
is why ``capture`` returns only the calling thread's cost (what the adaptive
rule sees) and ``close`` is the only flush: every checkpoint a capture
took is written by the time it returns.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

from retrolog.checkpoint.codec import DeltaHistory, decode, encode
from retrolog.checkpoint.state import Snapshot, restore, snapshot
from retrolog.errors import StoreError
from retrolog.store.objects import ObjectStore

KINDS = ("block", "end")  # a block's end state; the state after the outermost loop


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint that is completely written, as the metadata store records it."""

    ctx_id: int | None  # the outer-loop iteration context; None for the end checkpoint
    loop_name: str  # name of the outermost loop
    kind: str  # "block" or "end"
    manifest: str  # object key of the manifest
    nbytes: int  # manifest plus the distinct objects it references
    capture_seconds: float  # main-thread time spent taking the snapshot
    write_seconds: float  # time spent encoding and writing
    created_at: float  # time.time() when the capture began
    writer_cpu_seconds: float | None = None  # CPU time the writer spent (None: not measured)
    frame_locals: bytes | None = None  # the script's small locals (runtime/frames.py)
    # Of writer_cpu_seconds, what was spent at training's priority (a background
    # writer's urgent lane), and that lane's wall seconds on it: while it writes it
    # competes with CPU-bound training for the cores and the GIL.
    urgent_cpu_seconds: float = 0.0
    urgent_seconds: float = 0.0
    # Wall seconds a background writer's idle-priority lane spent on it (None: no such lane).
    idle_seconds: float | None = None


class Checkpointer(abc.ABC):
    """Takes checkpoints of named objects and reports each one once it is written."""

    @abc.abstractmethod
    def capture(
        self,
        *,
        ctx_id: int | None,
        loop_name: str,
        kind: str,
        objects: Mapping[str, object],
        frame_locals: bytes | None = None,
        due_in: float | None = None,
    ) -> float:
        """Checkpoint the current state of ``objects`` and the RNGs.

        The state is the one at the moment of the call, even if the writing
        finishes later; once called, the checkpoint is written (or the failure
        raised). ``frame_locals`` is stored with it as it is. ``due_in``: seconds
        within which a background writer should have written it. Returns the
        seconds the calling thread spent.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Finish: every checkpoint in flight is written and reported before this returns."""

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SynchronousCheckpointer(Checkpointer):
    """Snapshots, encodes and writes each checkpoint on the calling thread."""

    def __init__(self, store: ObjectStore, sink: Callable[[CheckpointRecord], None]) -> None:
        self.store = store
        self.sink = sink
        self.history = DeltaHistory()  # lets each checkpoint be written as deltas on the last
        self._closed = False

    def capture(
        self,
        *,
        ctx_id: int | None,
        loop_name: str,
        kind: str,
        objects: Mapping[str, object],
        frame_locals: bytes | None = None,
        due_in: float | None = None,
    ) -> float:
        """Write a checkpoint of ``objects`` now, then report it to the sink (``due_in``: moot)."""
        if self._closed:
            raise StoreError("This checkpointer is closed; create a new one to checkpoint again.")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        created_at = time.time()
        start = time.perf_counter()
        snap = snapshot(objects)
        captured = time.perf_counter()
        manifest, nbytes = encode(snap, self.store, history=self.history)
        written = time.perf_counter()
        self.sink(
            CheckpointRecord(
                ctx_id=ctx_id,
                loop_name=loop_name,
                kind=kind,
                manifest=manifest,
                nbytes=nbytes,
                capture_seconds=captured - start,
                write_seconds=written - captured,
                created_at=created_at,
                frame_locals=frame_locals,
            )
        )
        return written - start

    def close(self) -> None:
        """Nothing is ever in flight here; later captures are refused."""
        self._closed = True


def load_checkpoint(store: ObjectStore, manifest: str) -> Snapshot:
    """Read the checkpoint whose manifest key is ``manifest``."""
    return decode(manifest, store)


def forget_decoded() -> None:
    """Empty this process's cache of decoded arrays, so the next load decodes every array
    (what a measurement of decode time needs)."""
    from retrolog.checkpoint._arrays import DECODED

    DECODED.clear()


def restore_checkpoint(objects: Mapping[str, object], store: ObjectStore, manifest: str) -> None:
    """Put the checkpoint ``manifest`` back into the live ``objects`` and the RNGs, in place."""
    restore(objects, load_checkpoint(store, manifest))
