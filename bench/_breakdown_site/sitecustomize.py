"""Timeline probe for replay workers (bench/replay_breakdown.py puts this on PYTHONPATH).

Python imports ``sitecustomize`` at start-up, before the script: this one wraps
the replay worker runtime (``ReplayRun``) to note when the process started, when
the script first called retrolog, when each loop and iteration started and ended,
and how long each checkpoint restore took, then writes that timeline as JSON into
``$REPLAY_BREAKDOWN_DIR`` when the worker finishes. It changes no behaviour.

A worker forked from a fork server never imports ``sitecustomize`` itself: the
server did, with no spec in its environment. So the wrappers are installed
whenever ``$REPLAY_BREAKDOWN_DIR`` is set, and a worker's timeline starts when it
constructs its ``ReplayRun``: its spec, pid and start are read then. A forked
worker's process start is its fork, and it has no interpreter start-up
(``site`` = ``process_start``, ``forked`` true).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_SITE_AT = time.time()
_SITE_PID = os.getpid()
_OUT = os.environ.get("REPLAY_BREAKDOWN_DIR")


def _process_start() -> float | None:
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22 of stat(5): clock ticks since boot
        # Not /proc/stat's btime: it is truncated to the second, an error of up to 1 s.
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since
    except (OSError, ValueError, IndexError):
        return None


def _install(replay: Any) -> None:

    timeline: dict[str, Any] = {"loops": [], "restores": []}
    written = False

    def dump() -> None:
        nonlocal written
        if written or _OUT is None:
            return
        written = True
        timeline["dumped"] = time.time()
        try:
            import torch  # noqa: F401  (already imported by the script if it uses torch)

            timeline["torch_threads"] = __import__("torch").get_num_threads()
        except ImportError:
            pass
        path = Path(_OUT) / f"{os.getpid()}.json"
        path.write_text(json.dumps(timeline))

    original_init = replay.ReplayRun.__init__
    original_loop = replay.ReplayRun.loop
    original_restore = replay.ReplayRun._restore_checkpoint
    original_finish = replay.ReplayRun.finish
    original_commit = replay.ReplayRun.commit

    def init(self: Any, spec: Any) -> None:
        init_start = time.time()
        forked = os.getpid() != _SITE_PID
        start = _process_start()
        timeline.update(
            spec=os.environ.get("RETROLOG_REPLAY_SPEC"),
            pid=os.getpid(),
            process_start=start,
            site=start if forked and start is not None else _SITE_AT,
            forked=forked,
            init_start=init_start,
        )
        original_init(self, spec)
        timeline["init_end"] = time.time()

    def loop(self: Any, name: str, iterable: Any) -> Any:
        event: dict[str, Any] = {"name": name, "depth": len(self._stack), "next": []}
        timeline["loops"].append(event)
        generator = original_loop(self, name, iterable)
        calls = event["next"]
        try:
            while True:
                # Noted before the call: a worker may finish (os._exit) inside it.
                call = [time.time(), None]
                calls.append(call)
                try:
                    item = next(generator)
                except StopIteration:
                    call[1] = time.time()
                    break
                call[1] = time.time()
                yield item
        finally:
            event["end"] = time.time()
            generator.close()

    def restore(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        result = original_restore(self, *args, **kwargs)
        timeline["restores"].append([started, time.time()])
        return result

    def finish(self: Any) -> None:
        timeline["finish"] = time.time()
        dump()
        original_finish(self)

    def commit(self: Any, *args: Any, **kwargs: Any) -> None:
        timeline.setdefault("commit", time.time())
        original_commit(self, *args, **kwargs)
        dump()

    replay.ReplayRun.__init__ = init  # type: ignore[method-assign]
    replay.ReplayRun.loop = loop  # type: ignore[method-assign]
    replay.ReplayRun._restore_checkpoint = restore  # type: ignore[method-assign]
    replay.ReplayRun.finish = finish  # type: ignore[method-assign]
    replay.ReplayRun.commit = commit  # type: ignore[method-assign]


def _install_record(run: Any) -> None:
    """In a recording process: when Run.__init__ (code capture, store) ran, and the first loop."""

    timeline: dict[str, Any] = {"process_start": _process_start(), "site": _SITE_AT}
    original_init = run.Run.__init__
    original_loop = run.Run.loop

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        timeline["init_start"] = time.time()
        original_init(self, *args, **kwargs)
        timeline["init_end"] = time.time()
        timeline["run_id"] = self.run_id

    def loop(self: Any, name: str, iterable: Any) -> Any:
        if "first_loop" not in timeline:
            timeline["first_loop"] = time.time()
            assert _OUT is not None
            (Path(_OUT) / f"record-{os.getpid()}.json").write_text(json.dumps(timeline))
        return original_loop(self, name, iterable)

    run.Run.__init__ = init  # type: ignore[method-assign]
    run.Run.loop = loop  # type: ignore[method-assign]


class _AfterLoad:
    """Calls ``then(module)`` once a module of ``modules`` has loaded, whoever imports it.

    Nothing of retrolog is imported here: a fork server imports this file at its start,
    and a worker forked from it must import retrolog itself, with its spec set (at
    import retrolog takes ``--kwargs`` out of ``sys.argv``, before the script's argparse).
    """

    def __init__(self, modules: dict[str, Any]) -> None:
        self.modules = modules

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        then = self.modules.pop(name, None)
        if then is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def run_then(module: Any) -> None:
            exec_module(module)
            then(module)

        loader.exec_module = run_then
        return spec


if _OUT:
    sys.meta_path.insert(
        0,
        _AfterLoad(
            {"retrolog.runtime.replay_worker": _install, "retrolog.runtime.run": _install_record}
        ),
    )
