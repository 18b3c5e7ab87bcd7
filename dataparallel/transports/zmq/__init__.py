"""``zmq://HOST:PORT``: the control channel over ZeroMQ, the default on a private network.

Rank 0 (or, with ``rank=None``, the first process to bind the port) hosts the
coordinator (:mod:`.server`) in a background thread; if the port is already served (a
standalone ``dataparallel serve``), every rank is a client. Each thread that calls the
channel gets its own DEALER socket, so a blocked ``get`` never holds up another thread's
call; a heartbeat thread keeps the session alive and notices a silent coordinator.
Requests unanswered for a while are resent with the same id (the coordinator answers each
once), so a connection that drops briefly and reconnects carries on.

Options: ``?curve=1`` encrypts all traffic with CURVE keys derived from the token.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections.abc import Callable

import zmq
import zmq.utils.monitor

from dataparallel.control.coordinator import Coordinator
from dataparallel.control.registry import ChannelURL
from dataparallel.control.remote import Exchange, RemoteChannel, binding
from dataparallel.control.wire import pb, seal, token_key
from dataparallel.errors import AuthError, ChannelClosed, ConfigError, ControlError

from .server import ZmqCoordinatorServer, curve_server_keys


class ZmqChannel(RemoteChannel):
    scheme = "zmq"
    OPTIONS = {"curve": "1 to encrypt traffic with CURVE keys derived from the token (a token is required)"}
    MISMATCH_HINT = "do token and curve match?"

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._curve = url.flag("curve")
        self._frame_key = token_key(self.token)
        host, port = self._coordinator_address(
            lambda: ZmqCoordinatorServer(url.host, url.require_port(), self.token, self._curve).start(),
            busy=(zmq.ZMQError,),
        )
        self._endpoint = f"tcp://{host}:{port}"
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._sockets: dict[int, zmq.Socket] = {}
        # A channel dropped without close (an error path) releases its sockets when it is
        # collected. Left to pyzmq, a garbage cycle's Context would end in term() and wait
        # for ever: the collector clears the Context's weak references to sockets of the
        # same cycle before any finalizer runs, so destroy() finds none to close. The
        # finalizer holds the context and its sockets; it runs once, on close or collection.
        self._release = weakref.finalize(self, _release, self._ctx, self._lock, self._sockets)
        self._resend_after = max(1.0, self.liveness_timeout / 2)
        try:
            self._init_remote()
        except BaseException:
            self._close_transport()
            raise

    @classmethod
    def security(cls, url: ChannelURL, token: str | None) -> str:
        if not token:
            return "no token: anyone who can reach the coordinator can join, read and write any token-less job"
        if url.flag("curve"):
            return "requests and replies signed with the token's key (HMAC-SHA256) and encrypted (CURVE)"
        return (
            "requests and replies signed with the token's key (HMAC-SHA256), not encrypted: keys and values are "
            "readable on the network (add curve=1 to encrypt)"
        )

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        super()._check_options(url, token, serving)
        if url.flag("curve") and not token:
            raise ConfigError(
                f"{url.shown!r}: curve=1 derives its keys from the job token, and there is none: set DP_TOKEN or "
                "--token-file (token= in dp.connect)"
            )
        if url.flag("curve") and not zmq.has("curve"):
            raise ConfigError("this libzmq was built without CURVE support: install pyzmq's wheel, or drop curve=1")

    def _socket(self) -> zmq.Socket:
        ident = threading.get_ident()
        sock = self._sockets.get(ident)
        if sock is None:
            with self._lock:
                if self._ctx.closed:
                    raise ChannelClosed(f"{self!r} is closed")
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                # Starts low and backs off to the max: a coordinator just starting is found fast.
                sock.setsockopt(zmq.RECONNECT_IVL, 10)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                if self._curve:
                    if self.token is None:  # check_url refuses curve=1 without a token
                        raise ConfigError(f"{self.url.shown}: curve=1 needs a token")
                    sock.curve_serverkey = curve_server_keys(self.token)[0]
                    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
                sock.connect(self._endpoint)
                self._sockets[ident] = sock
        return sock

    def _exchange(self, request: pb.Request) -> ZmqExchange:
        try:
            return ZmqExchange(self, self._socket(), request)
        except zmq.ZMQError as err:
            raise ChannelClosed(f"{self!r}: socket closed ({err})") from err

    def _close_transport(self) -> None:
        self._release()
        self._stop_hosting()

    @classmethod
    def diagnose(cls, url: ChannelURL, timeout: float, token: str | None = None) -> list[ControlError]:
        """Read the server's ZMTP greeting: is it ZeroMQ at all, does it use CURVE, and
        does a CURVE handshake with this token's key succeed?"""
        curve = url.flag("curve")
        try:
            mechanism = zmtp_mechanism(url.host, url.require_port(), timeout)
        except OSError:  # refused, unreachable, or no verdict in time (a busy coordinator)
            return []  # the session attempt will say what is wrong
        if mechanism is None:
            return [
                ConfigError(f"{url.host}:{url.port} does not speak ZeroMQ: is it the job's zmq coordinator's port?")
            ]
        if mechanism == b"CURVE" and not curve:
            return [
                ConfigError(
                    "encryption mismatch: the coordinator uses CURVE, the URL does not: add ?curve=1 (and the token)"
                )
            ]
        if mechanism == b"NULL" and curve:
            return [
                ConfigError("encryption mismatch: the URL asks for CURVE, the coordinator is unencrypted: drop curve=1")
            ]
        if curve and token and curve_handshake(url.host, url.require_port(), token, timeout) is False:
            return [
                AuthError(
                    "wrong token: the CURVE handshake fails (the coordinator's key is derived from a different token)"
                )
            ]
        return []

    @classmethod
    def serve(
        cls,
        url: ChannelURL,
        token: str | None,
        ready: Callable[[int], None] = lambda port: None,
        coordinator: Callable[[Coordinator], None] | None = None,
    ) -> None:
        """Run a standalone coordinator until interrupted; ``ready(port)`` once it listens,
        after ``coordinator(it)`` (what ``serve --http`` lists the jobs of)."""
        server = ZmqCoordinatorServer(url.host, url.require_port(), token, url.flag("curve"))
        if coordinator is not None:
            coordinator(server.coordinator)
        ready(server.port)
        try:
            server.serve()
        finally:
            server.stop()


class ZmqExchange(Exchange):
    """A request on this thread's DEALER socket: resent while no connection takes it, and
    after ``resend_after`` seconds unanswered (a reconnect may have lost it)."""

    def __init__(self, channel: ZmqChannel, sock: zmq.Socket, request: pb.Request) -> None:
        self._ch, self._sock, self._id, self._binding = channel, sock, request.id, binding(request)
        self._frame = seal(channel._frame_key, request)
        self._resend_at = 0.0
        self._send()

    def _send(self) -> None:
        if _try_send(self._sock, self._frame):
            self._resend_at = time.monotonic() + self._ch._resend_after
        else:
            self.reason = "no connection to the coordinator yet"
            self._resend_at = time.monotonic() + 0.01

    def poll(self, wait: float) -> pb.Reply | None:
        try:
            end = time.monotonic() + wait
            while True:
                now = time.monotonic()
                if now >= self._resend_at:
                    self._send()  # the coordinator answers a resent id only once
                left = min(end, self._resend_at) - now
                if self._sock.poll(int(1000 * max(left, 0)) + 1):
                    reply = self._ch._reply_to(self._sock.recv(), self._id, self._binding)
                    if reply is not None:
                        return reply
                    continue  # a late answer to a request this thread gave up on, or a refused frame
                if time.monotonic() >= end:
                    return None
        except zmq.ZMQError as err:
            raise ChannelClosed(f"{self._ch!r}: socket closed ({err})") from err


def zmtp_mechanism(host: str, port: int, timeout: float) -> bytes | None:
    """The security mechanism in the ZMTP 3 greeting of the peer at host:port (``b"NULL"``,
    ``b"CURVE"``...), or None if it does not answer with a ZMTP greeting. Raises
    :class:`TimeoutError` if the peer says nothing that rules ZeroMQ out within ``timeout``
    (a coordinator too busy or stopped to answer yet is not another server)."""
    # Signature and major version only: the peer answers with its whole greeting, and a
    # mechanism of ours that it does not share would make it hang up first.
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(b"\xff" + bytes(8) + b"\x7f\x03")
        got = b""
        deadline = time.monotonic() + timeout
        hung_up = False
        while len(got) < 64 and time.monotonic() < deadline:
            try:
                chunk = s.recv(64 - len(got))
            except TimeoutError:
                break
            if not chunk:
                hung_up = True
                break
            got += chunk
    if len(got) < 32 and not hung_up and (not got or (got[0] == 0xFF and (len(got) < 10 or got[9] == 0x7F))):
        raise TimeoutError(f"{host}:{port} sent {len(got)} bytes of a ZMTP greeting within {timeout:g}s")
    if len(got) < 32 or got[0] != 0xFF or got[9] != 0x7F:
        return None
    return got[12:32].rstrip(b"\0")


def curve_handshake(host: str, port: int, token: str, timeout: float) -> bool | None:
    """Whether a CURVE handshake with the server key derived from ``token`` succeeds; None
    if the server neither completes nor refuses it within ``timeout``."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = curve_server_keys(token)[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://{host}:{port}")
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                break
            event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return True
            if event == zmq.EVENT_DISCONNECTED:
                return False  # the server hung up on our HELLO
        return None  # no verdict: a busy server is not a wrong token
    finally:
        ctx.destroy(linger=0)


def _release(ctx: zmq.Context, lock: threading.Lock, sockets: dict[int, zmq.Socket]) -> None:
    with lock:
        ctx.destroy(linger=0)
        sockets.clear()


def _try_send(sock: zmq.Socket, frame: bytes) -> bool:
    """Queue ``frame`` without blocking; False while no connection is ready to take it
    (coordinator not up yet, reconnecting, or a failed CURVE handshake)."""
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
