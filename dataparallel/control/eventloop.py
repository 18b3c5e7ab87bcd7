"""The process's event loop for transports' asyncio clients (``grpc.aio``, aetcd).

One loop thread serves every channel of a process: a process running hundreds of ranks as
threads would otherwise run a loop thread (or two gRPC threads) per rank, and on a few cores
their contention for the interpreter starves heartbeats long enough for live ranks to be
declared lost. Coroutines scheduled here must not block: a slow step holds up every channel
of the process (run blocking work with ``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None


def client_loop() -> asyncio.AbstractEventLoop:
    """The loop, started on first use (a forked child starts its own)."""
    global _loop
    with _lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="dp-event-loop", daemon=True).start()
            _loop = (os.getpid(), loop)
        return _loop[1]


async def outcome(coro: Awaitable[T]) -> tuple[T | None, Exception | None]:
    """``(result, None)`` or ``(None, error)`` of ``coro``: how a transport's ``_run``
    submits a call, so that the task never ends with an error. A call given up (its caller's
    wait timed out, and its task was cancelled) may still end with an error of its own rather
    than cancelled (a gRPC call's cancellation can come out as a lost connection): left on
    the task, asyncio would log it as never retrieved, with a traceback whose frames hold the
    channel for as long as the log record lives."""
    try:
        return await coro, None
    except Exception as err:
        return None, err


def submit(coro: Awaitable[T], loop: asyncio.AbstractEventLoop) -> Future[tuple[T | None, Exception | None]]:
    """Run ``coro`` on ``loop`` from another thread, as its :func:`outcome`: the future's
    result is ``(result, error)``, and cancelling the future never leaves an error behind."""
    return asyncio.run_coroutine_threadsafe(outcome(coro), loop)


async def bounded(coro: Awaitable[T], seconds: float) -> T:
    """``asyncio.wait_for(coro, seconds)``, never leaving an error unretrieved (see
    :func:`outcome`): when the wait ends first, wait_for cancels ``coro``'s task and awaits
    it, but an error that task ends with instead of a cancellation is not read by wait_for;
    a callback reads it."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(_retrieve)
    return await asyncio.wait_for(task, seconds)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
