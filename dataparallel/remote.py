"""The client side of every coordinator-based transport.

:class:`RemoteChannel` implements all channel hooks, the native collectives (one round
trip per rank through the coordinator's ``Collect``), liveness and departures in terms of
one abstract call, :meth:`RemoteChannel._call` (send a request, return its reply), and
turns reply statuses into the error family. A transport (ZeroMQ, gRPC) supplies the
connection: ``_call``, ``_open_session`` plumbing and ``_close_transport``; and, when it
hosts the coordinator in-process, ``_hosted`` (the :class:`Coordinator`).
"""

from __future__ import annotations

import abc
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from .channel import ControlChannel
from .coordinator import Coordinator
from .errors import AuthError, BadMessage, ChannelClosed, ControlError, ControlTimeout, PeerLost
from .wire import PROTOCOL_VERSION, pb

#: Extra seconds a client waits beyond the coordinator's own deadline before giving up on it.
REPLY_GRACE = 5.0


class RemoteChannel(ControlChannel, abc.ABC):
    native_liveness: ClassVar[bool] = True
    native_auth: ClassVar[bool] = True

    def _init_remote(self) -> None:
        """Call from the transport's ``__init__`` once it can ``_call``: opens the session."""
        self._ids = itertools.count(1)
        self._session = b""
        self._lost: dict[int, PeerLost] = {}
        self._stopping = threading.Event()
        hello = pb.Hello(
            protocol=PROTOCOL_VERSION,
            job=self.job,
            world_size=self.world_size,
            nonce=os.urandom(16),
            liveness_timeout=self.liveness_timeout,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        reply = self._request(pb.Request(hello=hello), self.timeout, "hello")
        self._session = reply.session
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, name="dp-heartbeat", daemon=True)
        self._heartbeats.start()

    # ------------------------------------------------------------------ transport
    @abc.abstractmethod
    def _call(self, request: pb.Request, timeout: float) -> pb.Reply:
        """Send ``request`` and return its reply within ``timeout`` seconds; raise
        :class:`ChannelClosed` if the coordinator cannot be reached, :class:`AuthError`
        if it rejects the token. Thread-safe; concurrent calls must not wait on each other."""

    @abc.abstractmethod
    def _close_transport(self) -> None: ...

    #: The coordinator server this process hosts, if any (``.coordinator``, ``.port``, ``.stop()``).
    _server: Any = None

    def _host_unless_served(self, start: Callable[[], Any], port: int, busy: tuple[type[BaseException], ...]) -> int:
        """Rank 0 (or, with ``rank=None``, the first process to bind) hosts the coordinator
        in-process; if the port is already served (``dataparallel serve``, or another job's
        rank 0) it stays a client. Returns the port to connect to."""
        if self.rank in (None, 0) and self.serve:
            try:
                self._server = start()
                return self._server.port
            except busy:
                self._server = None
        return port

    def _stop_hosting(self) -> None:
        if self._server is not None:
            self._server.stop()

    @property
    def _hosted(self) -> Coordinator | None:
        """The in-process coordinator, when this rank hosts it."""
        return self._server.coordinator if self._server is not None else None

    @property
    def hosts_coordinator(self) -> bool:
        return self._hosted is not None

    # ------------------------------------------------------------------ requests
    def _request(self, request: pb.Request, wait: float, what: str) -> pb.Reply:
        request.id = next(self._ids)
        request.session = self._session
        reply = self._call(request, wait + REPLY_GRACE)
        if reply.status == pb.OK:
            return reply
        return self._raise(reply, what)

    def _raise(self, reply: pb.Reply, what: str) -> pb.Reply:
        status, error = reply.status, reply.error
        if status == pb.TIMEOUT:
            raise ControlTimeout(what, 0.0, error)
        if status == pb.PEER_LOST:
            lost = reply.lost
            err = PeerLost(lost.rank, lost.last_seen or None, lost.reason, during=what)
            self._lost.setdefault(lost.rank, err)
            raise err
        if status == pb.AUTH_FAILED:
            raise AuthError(f"coordinator refused {what}: {error}")
        if status == pb.BAD_MESSAGE:
            raise BadMessage(f"coordinator refused {what}: {error}")
        if status == pb.CLOSED:
            raise ChannelClosed(f"coordinator closed the session during {what}: {error}")
        raise ControlError(f"{what} failed: {error}")

    def _short(self, what: str, **op) -> pb.Reply:
        """A request the coordinator answers at once."""
        return self._request(pb.Request(**op), self.timeout, what)

    # ------------------------------------------------------------------ hooks
    def _set(self, key: str, value: bytes) -> None:
        self._short(f"set {key!r}", set=pb.KeyValue(key=key, value=value))

    def _get(self, key: str, timeout: float) -> bytes | None:
        try:
            return self._request(pb.Request(get=pb.Get(key=key, timeout=timeout)), timeout, f"key {key!r}").value
        except ControlTimeout:
            return None

    def _add(self, key: str, amount: int) -> int:
        return self._short(f"add {key!r}", add=pb.Add(key=key, amount=amount)).number

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        op = pb.CompareSet(key=key, expected=expected, desired=desired)
        return self._short(f"compare_set {key!r}", compare_set=op).value

    def _delete(self, key: str) -> bool:
        return self._short(f"delete {key!r}", delete=pb.Key(key=key)).flag

    def _check(self, keys: Sequence[str]) -> bool:
        return self._short("check", check=pb.Keys(keys=keys)).flag

    def _num_keys(self) -> int:
        return self._short("num_keys", num_keys=pb.Empty()).number

    def _claimed(self) -> None:
        self._short(f"register rank {self.rank}", register=pb.Register(rank=self.rank))

    def _close(self) -> None:
        self._stopping.set()
        if self._session and self._broken is None:
            try:
                self._call(pb.Request(id=next(self._ids), session=self._session, leave=pb.Empty()), 2.0)
            except ControlError:
                pass  # leaving anyway
        heartbeats = getattr(self, "_heartbeats", None)
        if heartbeats is not None and heartbeats is not threading.current_thread():
            heartbeats.join(timeout=self.heartbeat_interval + 2.0)
        self._close_transport()

    # ------------------------------------------------------------------ liveness
    def lost_peers(self) -> dict[int, PeerLost]:
        return dict(self._lost)

    def _start_liveness(self) -> None:
        pass  # the coordinator watches every registered rank from the moment it registers

    def _heartbeat_loop(self) -> None:
        last_answer = time.monotonic()
        while not self._stopping.wait(self.heartbeat_interval):
            try:
                reply = self._call(
                    pb.Request(id=next(self._ids), session=self._session, heartbeat=pb.Empty()),
                    self.heartbeat_interval,
                )
            except ControlError as err:
                if self._stopping.is_set():
                    return
                silent = time.monotonic() - last_answer
                if isinstance(err, AuthError) or silent > self.liveness_timeout:
                    self._fail(ChannelClosed(f"coordinator at {self.url.raw} silent for {silent:.1f}s: {err}"))
                    return
                continue
            last_answer = time.monotonic()
            if reply.status == pb.CLOSED:
                self._fail(ChannelClosed(f"coordinator dropped this session: {reply.error}"))
                return
            if reply.HasField("lost"):
                lost = reply.lost
                self._lost.setdefault(lost.rank, PeerLost(lost.rank, lost.last_seen or None, lost.reason))

    def _raise_if_failed(self, what: str) -> None:
        super()._raise_if_failed(what)
        if self._lost:
            first = next(iter(self._lost.values()))
            raise PeerLost(first.rank, first.last_seen, first.reason, during=what)

    def _await_departures(self, grace: float) -> None:
        coordinator = self._hosted
        deadline = time.monotonic() + grace
        while coordinator is not None and time.monotonic() < deadline:
            if coordinator.job_members(self.job) <= {self.rank}:
                return
            time.sleep(0.02)

    # ------------------------------------------------------------------ collectives
    def _collect(
        self,
        name: str,
        what: str,
        timeout: float | None,
        *,
        want: bool,
        value: bytes | None = None,
        sources: Sequence[int] = (),
    ) -> list[bytes]:
        self._raise_if_failed(what)
        budget = self._budget(timeout)
        op = pb.Collect(name=name, sources=sources, want=want, timeout=budget)
        if value is not None:
            op.has_value, op.value = True, value
        start = time.monotonic()
        try:
            return list(self._request(pb.Request(collect=op), budget, what).values)
        except ControlTimeout as err:
            raise ControlTimeout(
                f"{what} (job {self.job!r}, rank {self.rank})", time.monotonic() - start, err.hint
            ) from None

    def barrier(self, name: str = "barrier", timeout: float | None = None) -> None:
        self._usable()
        seq = self._next_seq("barrier", name)
        self._collect(f"barrier/{name}/{seq}", f"barrier {name!r} round {seq}", timeout, want=True)

    def broadcast(self, name: str, value: bytes | None = None, src: int = 0, timeout: float | None = None) -> bytes:
        self._usable()
        self._check_rank(src, "src")
        seq = self._next_seq("bcast", name)
        mine = self.rank == src
        if mine and value is None:
            raise TypeError(f"broadcast {name!r}: rank {src} is the source and must pass a value")
        if self.world_size == 1:
            return bytes(value)
        got = self._collect(
            f"bcast/{name}/{seq}",
            f"broadcast {name!r} from rank {src}",
            timeout,
            want=not mine,
            value=_bytes(value) if mine else None,
            sources=[src],
        )
        return bytes(value) if mine else got[src]

    def gather(self, name: str, value: bytes, dst: int = 0, timeout: float | None = None) -> list[bytes] | None:
        self._usable()
        self._check_rank(dst, "dst")
        seq = self._next_seq("gather", name)
        got = self._collect(
            f"gather/{name}/{seq}", f"gather {name!r}", timeout, want=self.rank == dst, value=_bytes(value)
        )
        return got if self.rank == dst else None

    def all_gather(self, name: str, value: bytes, timeout: float | None = None) -> list[bytes]:
        self._usable()
        seq = self._next_seq("allgather", name)
        return self._collect(f"allgather/{name}/{seq}", f"all_gather {name!r}", timeout, want=True, value=_bytes(value))


def _bytes(value: bytes) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    return bytes(value)
