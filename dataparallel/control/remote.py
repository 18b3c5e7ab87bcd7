"""The client side of every coordinator-based transport.

:class:`RemoteChannel` implements all channel hooks, the native collectives (one round
trip per rank through the coordinator's ``Collect``), liveness and departures in terms of
one request loop, :meth:`RemoteChannel._call` (deadline, resends with the same id, a
channel broken in the background, the message when no reply comes, and a diagnosis of
misconfiguration while the session opens), and turns reply statuses into the error
family. A transport (ZeroMQ, gRPC) supplies one request in flight, an :class:`Exchange`
(``_exchange``), its ``_close_transport``, and, when it hosts the coordinator in-process,
the server (``_coordinator_address``).
"""

from __future__ import annotations

import abc
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from ..errors import AuthError, BadMessage, ChannelClosed, ConfigError, ControlError, ControlTimeout, PeerLeft, PeerLost
from . import procinfo
from .channel import ControlChannel
from .coordinator import Coordinator
from .liveness import Liveness, LostPeer
from .registry import ChannelURL
from .wire import PROTOCOL_VERSION, Misdirected, open_frame, pb

log = logging.getLogger(__name__)

#: How a request's wait is shared with the coordinator: a waiting request (a get, a collective)
#: is parked there up to this much (at most a tenth of the wait) shorter than the caller waits,
#: and the client gives up on any reply this long after the caller's wait: time for the
#: coordinator's TIMEOUT answer to arrive first, so a key still missing is a ControlTimeout and
#: a coordinator gone silent a ChannelClosed. No call outlasts its timeout by more than this.
REPLY_GRACE = 0.25
#: Longest a waiting caller goes without looking at the channel's state.
POLL_SLICE = 0.25
#: While a session opens: unanswered for this long, look at the server for a
#: misconfiguration (TLS, encryption, token), and again this often.
PROBE_AFTER = 1.0
PROBE_EVERY = 2.0


class Exchange(abc.ABC):
    """One request in flight on a transport's connection.

    The transport sends it when made and resends it (always with the same id: the
    coordinator applies a request once and answers resends from its cache) whenever it
    sees fit, e.g. after a reconnect. ``reason`` keeps why the last attempt failed, for the
    message the request loop gives when no reply comes.
    """

    reason: str = ""

    @abc.abstractmethod
    def poll(self, wait: float) -> pb.Reply | None:
        """Wait up to ``wait`` seconds for the reply; None if none came. Raises
        :class:`AuthError` when the coordinator refuses the token, another
        :class:`ControlError` for a failure that resending cannot mend."""

    def cancel(self) -> None:  # noqa: B027 - most exchanges hold nothing to release
        """Give up on the request (called once, whatever happened)."""


class CoordinatorLiveness(Liveness):
    """Liveness of the coordinator-based transports.

    The coordinator watches the session of every registered rank (any message is a sign of
    life), answers every parked request of the job with ``PEER_LOST`` as soon as one goes
    silent for ``liveness_timeout``, and reports the loss in its heartbeat replies. This
    side keeps its session alive with a heartbeat every ``heartbeat`` seconds from the
    moment the session opens, and notices a coordinator that has gone silent.
    """

    interrupts_blocked_calls: ClassVar[bool] = True
    carries_writes: ClassVar[bool] = True  # inside the heartbeat request itself

    def __init__(self, channel: RemoteChannel) -> None:
        super().__init__()
        self._ch = channel
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="dp-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, announce: bool) -> None:
        # The departure itself is the session's ``leave`` (sent by the channel's _close).
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._ch.heartbeat_interval + 2.0)

    def await_departures(self, grace: float) -> None:
        coordinator = self._ch._hosted
        deadline = time.monotonic() + grace
        while coordinator is not None and time.monotonic() < deadline:
            if coordinator.job_members(self._ch.job) <= {self._ch.rank}:
                return
            time.sleep(0.02)

    def note(self, lost: pb.LostPeer) -> None:
        """Record a loss the coordinator reported."""
        self._record(LostPeer(lost.rank, lost.last_seen or None, lost.reason))

    def _heartbeat_loop(self) -> None:
        ch = self._ch
        last_answer = time.monotonic()
        while not self._stopping.wait(ch.heartbeat_interval):
            session = ch._session
            with self._carrying:  # the writes it carries are in flight until the reply
                carried = self._riders()
                beat = pb.Heartbeat(set=[pb.KeyValue(key=key, value=value) for key, value in carried])
                try:
                    request = pb.Request(id=next(ch._ids), session=session, heartbeat=beat)
                    reply = ch._call(request, ch.heartbeat_interval)
                except ControlError as err:
                    if self._stopping.is_set():
                        return
                    silent = time.monotonic() - last_answer
                    if isinstance(err, AuthError) or silent > ch.liveness_timeout:
                        ch._fail(ChannelClosed(f"coordinator at {ch.url.shown} silent for {silent:.1f}s: {err}"))
                        return
                    continue
                last_answer = time.monotonic()
                if reply.status == pb.CLOSED and session == ch._session:  # not a session left for another run
                    ch._fail(_session_closed(ch.rank, "a heartbeat", reply.error))
                    return
                if reply.HasField("lost"):
                    self.note(reply.lost)
                if carried and not reply.flag and reply.status == pb.OK:
                    # A coordinator that predates carried writes: they go back to their writer.
                    log.info("rank %s: the coordinator applies no writes a heartbeat carries", ch.rank)
                    self._writes = None
                elif reply.status != pb.OK and carried:
                    log.debug("rank %s: a heartbeat's writes refused: %s", ch.rank, reply.error)


class RemoteChannel(ControlChannel, abc.ABC):
    native_auth: ClassVar[bool] = True
    fences_lost_members: ClassVar[bool] = True  # the coordinator drops a lost rank's session
    survives_connection_loss: ClassVar[bool] = True  # resent with the same id, answered once
    notices_exits: ClassVar[bool] = True  # the server tells the coordinator of closed connections
    survives_frozen_writers: ClassVar[bool] = True  # a request is applied whole by the coordinator

    def _init_remote(self) -> None:
        """Call from the transport's ``__init__`` once it can ``_call``: opens the session."""
        self._ids = itertools.count(1)
        self._session = b""
        self._refusal: pb.Refusal | None = None  # why the last join was refused
        self._hello()
        # The session needs its heartbeats from now on, before the rank has joined.
        self._start_liveness()

    def _hello(self) -> None:
        hello = pb.Hello(
            protocol=PROTOCOL_VERSION,
            job=self.job,
            world_size=self.world_size,
            nonce=os.urandom(16),
            liveness_timeout=self.liveness_timeout,
            host=socket.gethostname(),
            pid=os.getpid(),
            boot_id=procinfo.identity()[0],
            pid_namespace=procinfo.identity()[1],
            heartbeat=self.heartbeat_interval,
        )
        reply = self._request(pb.Request(hello=hello), self.timeout, "hello")
        self._session = reply.session

    # The coordinator's job is the run: it ends when its last session leaves or is dropped, or
    # once a rank of it is declared lost, and the next hello for that job name starts a new one.
    def _enter_run(self, retry: bool) -> None:
        if retry:  # the session opened in __init__ is the first attempt's
            old = self._session
            self._hello()
            self._leave(old)

    def _attach_run(self) -> bool:
        return True  # the session opened in __init__ is in the job's current run

    def _run_state(self, holder: int | None) -> tuple[str, str] | None:
        # What the coordinator said when it refused the join; a rank held by a session it
        # still serves is waited for (it gives the rank up when it is declared lost).
        if self._refusal == pb.LEFT:
            return "alive", "it left its run, which goes on without it: a rank cannot rejoin"
        if self._refusal == pb.RUN_OVER:
            return "over", "a rank of it was declared lost"
        return None

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        url.require_port()
        if len(url.hosts) != 1 or url.path:
            raise ConfigError(f"{url.shown!r}: expected {cls.url_form(url)} (one coordinator)")

    def _new_liveness(self) -> CoordinatorLiveness:
        return CoordinatorLiveness(self)

    # ------------------------------------------------------------------ transport
    #: Said when no reply comes: which settings must agree between client and coordinator.
    MISMATCH_HINT: ClassVar[str] = "does the token match?"

    @abc.abstractmethod
    def _exchange(self, request: pb.Request) -> Exchange:
        """Send ``request``: the :class:`Exchange` that waits for its reply. Thread-safe;
        concurrent requests must not wait on each other."""

    @abc.abstractmethod
    def _close_transport(self) -> None: ...

    #: The key that seals this transport's frames (:func:`dataparallel.control.wire.seal`), set by
    #: the transport from the token before ``_init_remote``: requests and replies alike.
    _frame_key: bytes = b""

    def _open_reply(self, frame: bytes) -> pb.Reply:
        """A reply frame, verified: :class:`AuthError` if it is not sealed with this job's key
        (the coordinator was started with another token, or something else answers),
        :class:`~dataparallel.control.wire.Misdirected` if it is a request sealed with it."""
        host, port = self._address
        try:
            return open_frame(self._frame_key, frame, pb.Reply)
        except Misdirected:
            raise
        except AuthError:
            raise AuthError(
                f"the coordinator at {host}:{port} does not know this job's token (its reply is not "
                "signed with ours): the token differs from the one the coordinator was started with"
            ) from None
        except BadMessage as err:
            raise BadMessage(f"garbled reply from the coordinator at {host}:{port}: {err}") from None

    def _reply_to(self, frame: bytes, request_id: int, binding: bytes) -> pb.Reply | None:
        """``frame`` as the reply to this channel's request ``request_id`` whose binding (see
        :func:`binding`) is ``binding``; None for a late reply to another of its requests,
        or for a frame refused (:meth:`_refuse`). Raises as :meth:`_open_reply`."""
        try:
            reply = self._open_reply(frame)
        except Misdirected as err:
            self._refuse(str(err))
            return None
        if reply.id != request_id:
            return None
        if reply.answers != binding:
            self._refuse(f"a reply to request {reply.id} of another session, run or job (replayed)")
            return None
        return reply

    #: Frames sealed with this job's key that this channel's requests refused: a request of
    #: its own bounced back to it, or a reply bound to another session, run or job (replayed).
    #: Each is dropped, and the request it reached waits on for its true reply.
    refused_frames: int = 0

    def _refuse(self, what: str) -> None:
        with _refused_lock:
            self.refused_frames += 1
            count = self.refused_frames
        host, port = self._address
        log.log(
            logging.WARNING if count == 1 else logging.DEBUG,
            "refused a frame from %s:%s that is not a reply to the request it reached: %s (%d so far; someone on the "
            "path bounces or replays traffic signed with this job's token); waiting on for the true reply",
            host,
            port,
            what,
            count,
        )

    #: The coordinator server this process hosts, if any (``.coordinator``, ``.port``, ``.stop()``).
    _server: Any = None
    #: (host, port) this client connects to.
    _address: tuple[str, int] = ("", 0)

    def _coordinator_address(self, start: Callable[[], Any], busy: tuple[type[BaseException], ...]) -> tuple[str, int]:
        """Where to send requests, after hosting the coordinator here if this process should.

        Rank 0 (or, with ``rank=None``, the first process to bind) hosts the coordinator
        in-process by calling ``start()``; if the port is already served (``dataparallel
        serve``, or another job's rank 0: ``start`` raised one of ``busy``) it stays a client.
        A wildcard host (``0.0.0.0``) is reached over loopback."""
        url = self.url
        port = url.require_port()
        if self.rank in (None, 0) and self.may_host:
            try:
                self._server = start()
                port = self._server.port
            except busy:
                self._server = None
        host = "127.0.0.1" if url.host in ("0.0.0.0", "*") else url.host
        self._address = (host, port)
        return self._address

    @property
    def port(self) -> int:
        """The coordinator's port (the one bound, when this process hosts it on port 0)."""
        return self._address[1]

    def _call(self, request: pb.Request, timeout: float, shown: float | None = None) -> pb.Reply:
        """Send ``request`` and return its reply within ``timeout`` seconds (``shown``: the
        caller's timeout, for the message when none comes).

        Raises :class:`ChannelClosed` if no reply comes in time (or the channel broke in the
        background, except for heartbeats and the leave), :class:`AuthError` if the
        coordinator refuses the token, and while the session opens, a :class:`ConfigError`
        or :class:`AuthError` naming the fix as soon as the server shows a misconfiguration
        (TLS, encryption, token), whatever ``timeout`` is."""
        control = request.WhichOneof("op") in ("heartbeat", "leave")
        start = time.monotonic()
        deadline = start + timeout
        probe_at = start + PROBE_AFTER if request.WhichOneof("op") == "hello" else math.inf
        exchange = self._exchange(request)
        try:
            while True:
                if self._broken is not None and not control:
                    raise self._broken
                now = time.monotonic()
                if now >= deadline:
                    raise ChannelClosed(self._no_reply(timeout if shown is None else shown, exchange.reason))
                if now >= probe_at:
                    self._raise_misconfiguration(min(PROBE_EVERY, deadline - now))
                    probe_at = time.monotonic() + PROBE_EVERY
                reply = exchange.poll(max(min(POLL_SLICE, deadline - now, probe_at - now), 0.0))
                if reply is not None:
                    return reply
        finally:
            exchange.cancel()

    def _no_reply(self, timeout: float, reason: str) -> str:
        host, port = self._address
        last = f"; last error: {reason}" if reason else ""
        return (
            f"no reply from the coordinator at {host}:{port} within {timeout:.1f}s "
            f"(is rank 0 / `dataparallel serve` running? {self.MISMATCH_HINT}){last}"
        )

    def _raise_misconfiguration(self, within: float) -> None:
        problems = _diagnosis(type(self), self.url, self.token, within)
        if problems:
            problem = problems[0]
            if isinstance(problem, ControlError):
                raise problem
            raise ConfigError(f"cannot open a session with the coordinator at {self.url.shown}: {problem}")

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
        start = time.monotonic()
        reply = self._call(request, wait + REPLY_GRACE, shown=wait)
        if reply.status == pb.OK:
            return reply
        return self._raise(reply, what, time.monotonic() - start)

    def _raise(self, reply: pb.Reply, what: str, waited: float) -> pb.Reply:
        status, error = reply.status, reply.error
        if status == pb.TIMEOUT:
            raise ControlTimeout(what, waited, error)
        if status == pb.PEER_LOST:
            lost = reply.lost
            if isinstance(self._liveness, CoordinatorLiveness):
                self._liveness.note(lost)
            raise PeerLost(lost.rank, lost.last_seen or None, lost.reason, during=what)
        if status == pb.PEER_LEFT:  # not a loss: the channel goes on, this collective cannot
            raise PeerLeft(reply.lost.rank, what, what)
        if status == pb.AUTH_FAILED:
            raise AuthError(f"coordinator refused {what}: {error}")
        if status == pb.BAD_MESSAGE:
            raise BadMessage(f"coordinator refused {what}: {error}")
        if status == pb.CLOSED:
            # The session is gone for good: this rank was declared lost (frozen or cut off past
            # the liveness timeout) and fenced, or the coordinator restarted. Every later call
            # says so at once.
            broken = _session_closed(self.rank, what, error)
            self._fail(broken)
            raise broken
        raise ControlError(f"{what} failed: {error}")

    def _short(self, what: str, **op) -> pb.Reply:
        """A request the coordinator answers at once."""
        return self._request(pb.Request(**op), self.timeout, what)

    # ------------------------------------------------------------------ hooks
    def _set(self, key: str, value: bytes) -> None:
        self._short(f"set {key!r}", set=pb.KeyValue(key=key, value=value))

    def _get(self, key: str, timeout: float) -> bytes | None:
        try:
            get = pb.Get(key=key, timeout=_parked(timeout))
            return self._request(pb.Request(get=get), timeout, f"key {key!r}").value
        except ControlTimeout:
            return None

    def _add(self, key: str, amount: int) -> int:
        return self._short(f"add {key!r}", add=pb.Add(key=key, amount=amount)).number

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        op = pb.CompareSet(key=key, expected=expected, desired=desired)
        return self._short(f"compare_set {key!r}", compare_set=op).value

    def _compare_set_many(self, items: Sequence[tuple[str, bytes, bytes]]) -> list[bytes]:
        op = pb.MultiCompareSet(items=[pb.CompareSet(key=k, expected=e, desired=d) for k, e, d in items])
        values = list(self._short(f"compare_set of {len(items)} keys", multi_compare_set=op).values)
        if len(values) != len(items):
            raise BadMessage(f"{len(values)} values for {len(items)} compare_sets")
        return values

    def _delete(self, key: str) -> bool:
        return self._short(f"delete {key!r}", delete=pb.Key(key=key)).flag

    def _delete_many(self, keys: Sequence[str]) -> int:
        return self._short(f"delete of {len(keys)} keys", delete_many=pb.Keys(keys=keys)).number

    def _check(self, keys: Sequence[str]) -> bool:
        return self._short("check", check=pb.Keys(keys=keys)).flag

    def _held_state(self) -> int:
        hosted = self._hosted
        return hosted.job_state(self.job) if hosted is not None else self._num_keys()

    def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        request = pb.Request(multi_get=pb.MultiGet(keys=keys, timeout=_parked(timeout)))
        try:
            return list(self._request(request, timeout, f"keys {list(keys[:3])!r}").values)
        except ControlTimeout:
            return None

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        op = pb.MultiSet(items=[pb.KeyValue(key=k, value=v) for k, v in items])
        self._short(f"multi_set of {len(items)} keys", multi_set=op)

    def _append(self, key: str, value: bytes) -> None:
        self._short(f"append to {key!r}", append=pb.KeyValue(key=key, value=value))

    def _num_keys(self) -> int:
        return self._short("num_keys", num_keys=pb.Empty()).number

    def _claim_rank(self, rank: int | None, claimant: bytes, peer: bytes) -> tuple[int | None, bytes]:
        """One request: the coordinator claims, registers and publishes at once. A run that
        lost a rank takes no one: the next hello starts the next run, joined at once."""
        op = pb.Join(assign=rank is None, rank=rank or 0, claimant=claimant, peer=peer)
        what = "join" if rank is None else f"join as rank {rank}"
        for _ in range(3):
            reply = self._request(pb.Request(join=op), self.timeout, what)
            if reply.flag:
                return int(reply.number), b""
            if reply.refusal != pb.RUN_OVER:
                break
            self._enter_run(retry=True)
        self._refusal = reply.refusal
        return None, reply.value

    def _close(self) -> None:
        self._leave(self._session)
        self._close_transport()

    def _leave(self, session: bytes) -> None:
        if session and self._broken is None:
            closing = self._left_to_close(at_least=0.05)  # not past close's timeout
            wait = 2.0 if closing is None else min(2.0, closing)
            try:
                self._call(pb.Request(id=next(self._ids), session=session, leave=pb.Empty()), wait)
            except ControlError:
                pass  # leaving anyway

    # ------------------------------------------------------------------ collectives
    def _depart(self) -> None:
        """Nothing to record: the coordinator sees the session leave and ends the collectives
        that needed this rank (``PEER_LEFT``)."""

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
        op = pb.Collect(name=name, sources=sources, want=want, timeout=_parked(budget))
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
        own = None
        if self.rank == src:
            if value is None:
                raise TypeError(f"broadcast {name!r}: rank {src} is the source and must pass a value")
            own = bytes(value)
            if self.world_size == 1:
                return own
        got = self._collect(
            f"bcast/{name}/{seq}",
            f"broadcast {name!r} from rank {src}",
            timeout,
            want=own is None,
            value=None if own is None else _bytes(own),
            sources=[src],
        )
        return got[src] if own is None else own

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


def binding(request: pb.Request) -> bytes:
    """What a reply to ``request`` must carry in ``answers``: the request's session, or for a
    hello (which has none yet) its nonce, fresh for every hello."""
    return request.hello.nonce if request.HasField("hello") else request.session


_refused_lock = threading.Lock()
_probes_lock = threading.Lock()
_probes: dict[tuple, tuple[threading.Lock, list[float], list]] = {}


def _diagnosis(cls: type[RemoteChannel], url: ChannelURL, token: str | None, within: float) -> list:
    """``cls.diagnose(url)``, looked at once per ``PROBE_EVERY`` seconds by a whole process:
    hundreds of ranks of one process whose sessions open slowly (a loaded coordinator) would
    otherwise each probe it every few seconds, and their probes load it further. A probe
    waits at most ``within`` seconds (what is left of the caller's timeout)."""
    with _probes_lock:
        lock, when, found = _probes.setdefault((cls, url.raw, token), (threading.Lock(), [-math.inf], []))
    with lock:  # one probe at a time; the others take its finding
        if time.monotonic() - when[0] >= PROBE_EVERY:
            found[:] = cls.diagnose(url, max(within, 0.05), token)
            when[0] = time.monotonic()
        return list(found)


def _parked(wait: float) -> float:
    """How long the coordinator parks a request the caller waits ``wait`` seconds for: less,
    by up to :data:`REPLY_GRACE`, so that its TIMEOUT answer comes back within the wait."""
    return max(wait - min(REPLY_GRACE, wait / 10), 1e-3)


def _bytes(value: bytes) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    return bytes(value)


def _session_closed(rank: int | None, what: str, error: str) -> ChannelClosed:
    """The coordinator answered CLOSED (to a call, or to the heartbeat, whichever saw it
    first): the session is gone for good."""
    return ChannelClosed(
        f"coordinator closed the session during {what}: {error} (rank {rank} was declared lost and cut off, "
        "or the coordinator restarted)"
    )
