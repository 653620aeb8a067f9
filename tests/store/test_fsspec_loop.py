"""What the HTTP client leaves behind on fsspec's event loop when a store stops mid-request
stays off the training script's stderr; the loop's other errors are reported as before."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from retrolog.store.fsspec_objects import quiet_orphaned_unreachable

aiohttp = pytest.importorskip("aiohttp")


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _orphan(loop: asyncio.AbstractEventLoop, exc: BaseException) -> None:
    """A task that fails with ``exc`` and that nothing awaits, as aiohttp's body writer is
    when the server goes away; asyncio reports it once the task is collected."""

    async def fail() -> None:
        raise exc

    task = loop.create_task(fail())
    loop.run_until_complete(asyncio.sleep(0))
    assert task.done()
    del task
    gc.collect()


def _reported(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().splitlines()[0] for r in caplog.records if r.name == "asyncio"]


def test_a_connection_reset_left_in_an_orphaned_task_is_not_printed(
    loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    _orphan(loop, aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
    assert _reported(caplog) == ["Task exception was never retrieved"]  # asyncio's default
    caplog.clear()
    quiet_orphaned_unreachable(loop)
    _orphan(loop, aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
    _orphan(loop, ConnectionRefusedError(111, "Connection refused"))
    assert _reported(caplog) == []


def test_other_errors_on_the_shared_loop_still_reach_the_handler_before(
    loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    quiet_orphaned_unreachable(loop)
    _orphan(loop, ValueError("a bug in someone's coroutine"))
    assert _reported(caplog) == ["Task exception was never retrieved"]

    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    quiet_orphaned_unreachable(loop)
    quiet_orphaned_unreachable(loop)  # once per loop: the second call changes nothing
    _orphan(loop, KeyError("x"))
    _orphan(loop, aiohttp.ClientConnectionResetError("reset"))
    assert [type(c["exception"]) for c in seen] == [KeyError]


def test_an_s3_store_quiets_its_loop() -> None:
    pytest.importorskip("s3fs")
    from retrolog.store.fsspec_objects import FsspecObjectStore

    store = FsspecObjectStore("s3://no-such-bucket/prefix")  # no request is made
    handler = store.fs.loop.get_exception_handler()
    assert getattr(handler, "_retrolog", False)
