"""The gRPC coordinator: an asyncio gRPC server in front of a :class:`Coordinator`.

Every request is one unary ``Call`` carrying a sealed request frame, answered with a sealed
reply (:mod:`dataparallel.wire`, the same frames as ZeroMQ's, under the gRPC frame key): a
call proves knowledge of the token without sending it, and a replayed call is the
coordinator's to refuse (one answer per session and id). A parked request is an awaited future, not a thread,
so thousands of blocked ``get``s and barriers cost no threads. The coordinator runs on the
event loop's thread only (requests and the periodic sweep), so nothing races inside it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import grpc

from dataparallel.control.v1 import control_pb2_grpc
from dataparallel.coordinator import Coordinator, CoordinatorLimits
from dataparallel.wire import MAC_SIZE, MAX_FRAME, pb, seal

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME + MAC_SIZE),
    ("grpc.max_send_message_length", MAX_FRAME + MAC_SIZE),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.so_reuseport", 0),  # a second coordinator on a served port must fail to bind
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # A client that starts before the coordinator listens retries within 50 ms, not gRPC's
    # default first back-off of 1 s (rank 0 usually starts with everyone else).
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


class _Servicer(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, coordinator: Coordinator, key: bytes) -> None:
        self._coordinator = coordinator
        self._key = key

    async def Call(self, frame: pb.Frame, context: grpc.aio.ServicerContext) -> pb.Frame:  # noqa: N802
        route = asyncio.get_running_loop().create_future()
        reply = self._coordinator.handle_frame(route, self._key, frame.sealed)
        if reply is None:
            reply = await route
        return pb.Frame(sealed=seal(self._key, reply))


def _deliver(route: asyncio.Future, reply: pb.Reply) -> None:
    if not route.done():  # the call may have been cancelled (client gone or resent elsewhere)
        route.set_result(reply)


class GrpcCoordinatorServer:
    """Serves ``HOST:PORT`` (TLS when ``credentials`` is given) until :meth:`stop`."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes,
        credentials: grpc.ServerCredentials | None,
        limits: CoordinatorLimits | None = None,
    ) -> None:
        self.coordinator = Coordinator(_deliver, limits=limits)
        self._key = key
        self._credentials = credentials
        self._address = f"{'[::]' if host in ('0.0.0.0', '*', '') else host}:{port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self.port = 0
        self._on_ready: Callable[[int], None] | None = None
        self._thread = threading.Thread(target=self._run, name="dp-grpc-coordinator", daemon=True)

    def start(self, timeout: float = 10.0) -> GrpcCoordinatorServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"gRPC coordinator on {self._address} did not start within {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def serve(self, ready: Callable[[int], None] | None = None) -> None:
        """Run in the calling thread until interrupted; ``ready(port)`` once it listens."""
        self._on_ready = ready
        self._run()

    def stop(self) -> None:
        if self._stopping is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as err:  # reported to start(); a bound port is the usual one
            self._error = err
            self._ready.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        control_pb2_grpc.add_ControlServiceServicer_to_server(_Servicer(self.coordinator, self._key), server)
        if self._credentials is None:
            self.port = server.add_insecure_port(self._address)
        else:
            self.port = server.add_secure_port(self._address, self._credentials)
        if not self.port:
            raise OSError(f"cannot bind {self._address}")
        await server.start()
        self._stopping = asyncio.Event()
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready(self.port)
        sweeper = asyncio.ensure_future(self._sweep())
        try:
            await self._stopping.wait()
        finally:
            sweeper.cancel()
            await server.stop(grace=0.5)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.coordinator.sweep())
