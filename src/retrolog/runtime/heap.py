"""The heap that exists when training starts, kept out of Python's full collections.

By the first loop a training process holds the whole of torch's (and Lightning's or
transformers') objects: hundreds of thousands of containers, alive to the end. The
checkpoints a run takes make containers that live a while (snapshots, encoded state),
and once enough have survived Python starts a full collection, which walks every one of
those objects: about 0.2 s with Lightning loaded, holding the global interpreter lock.
It runs on whichever thread allocated last, often the checkpoint writer's idle-priority
lane, so training waits for it, and longer when that lane is off the CPU.

So at the first loop the objects that exist are frozen (:func:`gc.freeze`): collections
no longer scan them, and everything made from then on is collected as before. At the
run's end they are handed back (:func:`gc.unfreeze`), so a notebook that trains again,
or a script that goes on, collects whatever became garbage meanwhile. A process that
froze its heap itself is left as it is.
"""

from __future__ import annotations

import gc


class HeapFreeze:
    """Freeze the heap at :meth:`start`, give it back at :meth:`stop`; once each."""

    __slots__ = ("frozen",)

    def __init__(self) -> None:
        self.frozen = False

    def start(self) -> None:
        if self.frozen or gc.get_freeze_count():
            return  # frozen already, by us or by the process itself
        gc.freeze()
        self.frozen = True

    def stop(self) -> None:
        if self.frozen:
            self.frozen = False
            gc.unfreeze()
