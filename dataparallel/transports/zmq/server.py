"""The ZeroMQ coordinator: a ROUTER socket in front of a :class:`Coordinator`, on one thread.

Hosted in-process by rank 0 (or the first ``rank=None`` process to bind the port), or run
standalone by ``dataparallel serve zmq://HOST:PORT``. A frame that fails its MAC gets an
``AUTH_FAILED`` reply, one that does not parse a ``BAD_MESSAGE`` reply; either way the
coordinator carries on serving everyone else. Each request's connection is its file
descriptor (``ZMQ_SRCFD``), and a socket monitor reports each one that closes, so the
coordinator notices a client process that died without waiting for its heartbeats to stop.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import zmq
import zmq.utils.monitor
from zmq.utils import z85

from dataparallel.control.coordinator import Coordinator, CoordinatorLimits
from dataparallel.control.wire import MAC_SIZE, MAX_FRAME, pb, purpose_key, seal, token_key

log = logging.getLogger(__name__)


def curve_server_keys(token: str) -> tuple[bytes, bytes]:
    """The coordinator's CURVE key pair (public, secret), derived from the job token, so
    that clients that know the token know the server's public key without distribution."""
    secret = z85.encode(purpose_key(token, "curve-server"))
    return zmq.curve_public(secret), secret


#: Pending connections the coordinator's listening socket holds (capped by the kernel).
LISTEN_BACKLOG = 4096


class ZmqCoordinatorServer:
    """Binds ``tcp://HOST:PORT`` and serves until :meth:`stop` (or forever in :meth:`serve`)."""

    def __init__(
        self, host: str, port: int, token: str | None, curve: bool = False, limits: CoordinatorLimits | None = None
    ) -> None:
        self._key = token_key(token)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its route
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME + MAC_SIZE)  # larger: connection dropped
        # Thousands of peers connect at once when a large job starts: libzmq's default listen
        # backlog of 100 drops their SYNs into the kernel's retry back-off (12,288 hellos took
        # 31 s). The kernel caps this at net.core.somaxconn; gRPC's core asks for that already.
        self._sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        if curve:
            self._sock.curve_server = True
            self._sock.curve_secretkey = curve_server_keys(token or "")[1]
        try:
            self._sock.bind(f"tcp://{_bind_host(host)}:{port}")
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self.port = int(self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.coordinator = Coordinator(self._send, limits=limits)
        self._wake_address = f"inproc://dp-wake-{uuid.uuid4().hex}"
        self._wake = self._ctx.socket(zmq.PULL)
        self._wake.bind(self._wake_address)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ZmqCoordinatorServer:
        self._thread = threading.Thread(target=self.serve, name="dp-zmq-coordinator", daemon=True)
        self._thread.start()
        return self

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        next_sweep = 0.0
        try:
            while not self._stopped.is_set():
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + self.coordinator.sweep()
                events = dict(poller.poll(max(1, int((next_sweep - now) * 1000))))
                if self._wake in events:
                    break
                if self._sock in events:
                    self._drain()
                if self._monitor in events:
                    self._closed_connections()
        finally:
            self._ctx.destroy(linger=0)

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            waker = self._ctx.socket(zmq.PUSH)
        except zmq.ZMQError:
            return  # the loop has exited and closed the context already
        try:
            waker.connect(self._wake_address)
            waker.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the loop is exiting on its own
        finally:
            waker.close(linger=0)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _drain(self) -> None:
        # Serve everything already queued before sweeping again.
        for _ in range(10_000):
            events = self._sock.getsockopt(zmq.EVENTS)
            if not (isinstance(events, int) and events & zmq.POLLIN):
                return
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            route = frames[0].bytes
            if len(frames) != 2:
                self._send(route, pb.Reply(status=pb.BAD_MESSAGE, error=f"expected 1 frame, got {len(frames) - 1}"))
                continue
            conn = _connection(frames[1])
            reply = self.coordinator.handle_frame(route, self._key, frames[1].bytes, conn)
            if reply is not None:
                self._send(route, reply)

    def _closed_connections(self) -> None:
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.coordinator.connection_closed(event["value"])

    def _send(self, route: bytes, reply: pb.Reply) -> None:
        try:
            self._sock.send_multipart([route, seal(self._key, reply)], zmq.NOBLOCK)
        except zmq.Again:
            log.debug("reply to %r dropped: peer queue full", route)
        except zmq.ZMQError as err:  # the peer is gone; it will resend or be declared lost
            log.debug("reply to %r dropped: %s", route, err)


def _connection(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection ``frame`` came in on, or None where libzmq does not
    say (it refuses ``ZMQ_SRCFD`` for some messages, an empty one among them)."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None


def _bind_host(host: str) -> str:
    return "*" if host in ("0.0.0.0", "*", "") else host
