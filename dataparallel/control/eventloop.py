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
