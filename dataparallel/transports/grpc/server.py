"""The gRPC coordinator: an asyncio gRPC server in front of a :class:`Coordinator`.

Each client channel keeps one bidirectional ``Stream`` open and sends sealed request frames
on it; the replies go back on the same stream, sealed (:mod:`dataparallel.control.wire`, the same
frames as ZeroMQ's, under the gRPC frame key), in the order requests complete. A request
proves knowledge of the token without sending it, and a replayed one is the coordinator's to
refuse (one answer per session and id). The stream is the coordinator's route: a parked
request (a ``get`` of a missing key, an incomplete collective) costs no thread and no task,
and its reply is written to the stream its latest copy came in on; once a stream ends, replies
routed to it are dropped (the client resends on its next stream). The coordinator runs on the
event loop's thread only (requests, parked replies and the periodic sweep), so nothing races
inside it. The stream is also the connection the coordinator watches: when it ends, the
coordinator is told, so a client process that died is noticed without waiting for its
heartbeats to stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import socket
import threading
from collections.abc import Callable

import grpc

from dataparallel.control.coordinator import Coordinator, CoordinatorLimits
from dataparallel.control.eventloop import client_loop
from dataparallel.control.v1 import control_pb2_grpc
from dataparallel.control.wire import MAC_SIZE, MAX_FRAME, pb, seal

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


class _Stream:
    """One client's stream, the coordinator's route to it: writes replies one at a time, in
    the order they are given, until the stream ends."""

    __slots__ = ("_context", "_key", "_lock", "_writes")

    def __init__(self, context: grpc.aio.ServicerContext, key: bytes) -> None:
        self._context: grpc.aio.ServicerContext | None = context
        self._key = key
        self._lock = asyncio.Lock()
        self._writes: set[asyncio.Task] = set()

    async def write(self, reply: pb.Reply) -> None:
        async with self._lock:
            if self._context is None:
                return
            try:
                await self._context.write(pb.Frame(sealed=seal(self._key, reply)))
            except Exception as err:  # the stream ended meanwhile; the client resends on its next one
                log.debug("reply %d dropped: %s", reply.id, err)
                self.end()

    def deliver(self, reply: pb.Reply) -> None:
        """A parked request's reply (called by the coordinator, on the event loop's thread)."""
        if self._context is not None:
            task = asyncio.ensure_future(self.write(reply))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    def end(self) -> None:
        # Parked requests routed here may outlive the stream (until answered, re-routed by a
        # resend, or timed out): they keep this small object, not the call.
        self._context = None


class _Servicer(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, coordinator: Coordinator, key: bytes) -> None:
        self._coordinator = coordinator
        self._key = key

    async def Stream(self, frames: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        stream = _Stream(context, self._key)
        try:
            while (frame := await context.read()) is not grpc.aio.EOF:
                reply = self._coordinator.handle_frame(stream, self._key, frame.sealed, stream)
                if reply is not None:
                    await stream.write(reply)
        finally:
            stream.end()
            self._coordinator.connection_closed(stream)


def _refuse_a_served_port(address: str) -> None:
    """Raise EADDRINUSE where something already listens on ``address`` (``HOST:PORT``).

    gRPC's C core logs a port it cannot bind as an error line of its own (``add_port.cc ...
    Address already in use``), which would reach the terminal of every ``rank=None`` process
    that finds the coordinator hosted already: the expected case. A plain socket bound the way
    gRPC binds (SO_REUSEADDR, no SO_REUSEPORT) answers the same question silently; gRPC's own
    bind still decides a race between two processes that both pass this probe."""
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # gRPC's bind reports the address
    if host == "::":
        # gRPC binds the wildcard dual-stack, or IPv4 alone where the host has no IPv6.
        infos += socket.getaddrinfo("0.0.0.0", int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, where in dict.fromkeys(infos):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and host == "::":
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # as gRPC binds [::]
                probe.bind(where)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise OSError(errno.EADDRINUSE, f"cannot bind {address}: already served") from None
            # Any other refusal (no IPv6 on this host, an address not ours) is gRPC's to report.


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
        self.coordinator = Coordinator(_Stream.deliver, limits=limits)
        self._key = key
        self._credentials = credentials
        self._address = f"{'[::]' if host in ('0.0.0.0', '*', '') else host}:{port}"
        # The process's one event loop, which its gRPC clients share: grpc.aio binds every loop
        # that ever ran it, and one closed under it (a server's own, at stop) makes it complain.
        self._loop = client_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self._running: concurrent.futures.Future | None = None
        self.port = 0
        self._on_ready: Callable[[int], None] | None = None

    def start(self, timeout: float = 10.0) -> GrpcCoordinatorServer:
        self._running = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        if not self._ready.wait(timeout):
            raise RuntimeError(f"gRPC coordinator on {self._address} did not start within {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def serve(self, ready: Callable[[int], None] | None = None) -> None:
        """Run until interrupted (blocking the calling thread); ``ready(port)`` once it listens."""
        self._on_ready = ready
        self.start()
        running = self._running
        if running is None:
            raise RuntimeError("the gRPC server did not start")
        try:
            running.result()
        finally:
            self.stop()

    def stop(self) -> None:
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._running is not None:
            try:
                self._running.result(timeout=5)
            except Exception:  # stopped anyway: what it raised was reported to start()
                pass

    async def _run(self) -> None:
        try:
            await self._main()
        except BaseException as err:  # reported to start(); a bound port is the usual one
            self._error = err
            self._ready.set()

    async def _main(self) -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        control_pb2_grpc.add_ControlServiceServicer_to_server(_Servicer(self.coordinator, self._key), server)
        _refuse_a_served_port(self._address)
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
