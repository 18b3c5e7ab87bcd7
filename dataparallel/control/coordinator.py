"""The coordinator's state machine, independent of how requests arrive.

A server-hosted transport (ZeroMQ, gRPC) hands each sealed request frame to
:meth:`Coordinator.handle_frame` (or a decoded :class:`Request` to :meth:`Coordinator.handle`)
with an opaque *route* (how to reach the sender), seals and sends the returned
:class:`Reply`, or — when it is None because the request is parked (a ``get`` of a missing
key, a collective still incomplete) — lets the coordinator call ``send(route, reply)``
later. The transport calls :meth:`Coordinator.sweep` at least as
often as the returned delay asks, to expire parked requests and declare silent ranks lost.

A transport that can tell which connection a request came in on passes it as ``conn`` and
calls :meth:`Coordinator.connection_closed` when that connection ends. A rank whose every
connection has closed is declared lost at once if its process is seen to have exited (the
coordinator shares its kernel and PID namespace: :mod:`dataparallel.control.procinfo`; while it
is seen alive, a reset is waited out up to ``liveness_timeout``), else once it has not come
back within a grace of a heartbeat and a second: a killed peer is noticed in well under a
second on one machine and in about two across machines, while a frozen or cut off peer,
whose connections stay open, is noticed after ``liveness_timeout`` as before.

All of it is guarded by one lock; nothing under it blocks. Per job the coordinator keeps a
:class:`KeySpace`, the sessions that speak for each rank, parked requests and collectives.
A resent request (same session and id, e.g. after a reconnect) is answered once: from the
reply cache if it completed, by re-routing if it is still parked.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import AuthError, BadMessage
from . import procinfo
from .keyspace import NEXT_RANK, KeySpace, claim_key, peer_key
from .wire import MAX_WORLD_SIZE, PROTOCOL_VERSION, Misdirected, open_frame, pb

log = logging.getLogger(__name__)

#: How a transport reaches a request's sender (a ZeroMQ identity, a gRPC stream...): the
#: coordinator only hands it back to the transport's ``send``.
R = TypeVar("R", bound=Hashable)

#: Operations that change nothing: a resend is served again instead of from the reply cache.
READ_ONLY = frozenset({"get", "multi_get", "check", "num_keys"})
#: What an observer's session (a hello of world size 0: dp.observe) may ask: reads, and to live.
OBSERVER_OPS = READ_ONLY | {"heartbeat", "leave"}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Longest gap between sweeps: a newly parked request's timeout fires at most this late.
SWEEP_INTERVAL = 0.1


@dataclass(frozen=True)
class CoordinatorLimits:
    """Bounds that keep a coordinator's memory bounded whatever its clients send: a request
    that would pass one fails (``FAILED``, saying which); the job and everyone else carry on."""

    #: Keys one job may hold.
    max_job_keys: int = 1_000_000
    #: Bytes of keys and values one job may hold.
    max_job_bytes: int = 256 << 20
    #: Sessions open at once, over all jobs.
    max_sessions: int = 65_536
    #: Requests one session may have waiting (parked gets, open collectives) at once.
    max_parked_per_session: int = 4_096
    #: Seconds of silence after which a session that never claimed a rank is dropped.
    idle_session_timeout: float = 60.0
    #: Replies of mutations a session's resends are answered from (exactly once), at most
    #: this many and this many bytes per session, and this many bytes over all sessions.
    reply_cache_entries: int = 256
    #: ... and beyond ``reply_cache_entries``, up to this many replies a session had in the
    #: last two liveness timeouts of its job: a resend comes within a reconnect (waited out up
    #: to the liveness timeout) and a resend interval (at most half of it), and a session that
    #: carries many callers (a node relay's, a rank's threads) has more than
    #: ``reply_cache_entries`` replies in that time (its resend would be refused as applied
    #: already, the call's outcome lost to its caller).
    reply_cache_recent_entries: int = 4_096
    reply_cache_session_bytes: int = 4 << 20
    reply_cache_bytes: int = 256 << 20
    #: Request ids within this distance below a session's highest are checked one by one
    #: (each applied once); older ids are refused as stale or replayed.
    replay_window: int = 16_384

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"CoordinatorLimits.{name} must be > 0, got {value!r}")


@dataclass(eq=False)
class Session:
    id: bytes
    job: Job
    host: str
    pid: int
    last_seen: float
    rank: int | None = None
    replies: OrderedDict[int, pb.Reply] = field(default_factory=OrderedDict)
    #: When each of ``replies`` was cached.
    reply_at: dict[int, float] = field(default_factory=dict)
    reply_bytes: int = 0
    parked: dict[int, Parked] = field(default_factory=dict)
    #: The hello's nonce: a resent hello (its reply lost) gets this session again, not another.
    nonce: bytes = b""
    #: Highest request id accepted, and the ids accepted within the replay window below it.
    high: int = -1
    seen: set[int] = field(default_factory=set)
    #: The connections its requests came in on (where the transport says), and since when it
    #: has had none; whether its pid is one this process can check; its heartbeat interval.
    conns: set[Hashable] = field(default_factory=set)
    dropped_at: float | None = None
    local: bool = False
    heartbeat: float = 1.0
    #: An observer's (a hello of world size 0): reads only, follows its job's current run, and
    #: keeps no job alive (a job ends with its last other session).
    observer: bool = False

    def accept(self, request_id: int, window: int) -> bool:
        """True the first time ``request_id`` is offered; False for a resend or a replay."""
        if request_id <= self.high - window or request_id in self.seen:
            return False
        self.seen.add(request_id)
        if request_id > self.high:
            self.high = request_id
            if len(self.seen) > 2 * window:  # prune, amortised O(1)
                self.seen = {i for i in self.seen if i > request_id - window}
        return True


@dataclass(eq=False)
class Parked(Generic[R]):
    """A request waiting for a key or a collective; answered once, by whichever comes first."""

    session: Session
    route: R  # the socket/stream the request (or its latest resend) came from
    request_id: int
    deadline: float
    on_timeout: Callable[[], pb.Reply]
    release: Callable[[], object] = lambda: None  # withdraws it from what it waits on
    done: bool = False
    remember: bool = True  # False for a read: a resend after the answer reads again


@dataclass(eq=False)
class Collective:
    """One named round. Its bookkeeping is O(1) per arrival, whatever the world size: the ranks
    it waits for are counted down (``pending``), never recomputed as a set difference."""

    sources: frozenset[int] | None  # None: every rank of the job
    pending: int  # sources that have not arrived
    values: dict[int, bytes] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)
    waiting: dict[int, Parked] = field(default_factory=dict)
    complete: bool = False

    def is_source(self, rank: int) -> bool:
        return self.sources is None or rank in self.sources

    def arrive(self, rank: int) -> None:
        self.arrived.add(rank)
        if self.is_source(rank):
            self.pending -= 1

    def withdraw(self, rank: int) -> None:
        if rank in self.arrived:
            self.arrived.discard(rank)
            if self.is_source(rank):
                self.pending += 1


@dataclass(eq=False)
class Job:
    name: str
    world_size: int
    liveness_timeout: float
    space: KeySpace = field(default_factory=KeySpace)
    ranks: dict[int, Session] = field(default_factory=dict)
    sessions: set[Session] = field(default_factory=set)
    lost: dict[int, pb.LostPeer] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    collectives: dict[str, Collective] = field(default_factory=dict)


class Coordinator(Generic[R]):
    """Serves any number of jobs; see the module docstring for the contract."""

    def __init__(
        self,
        send: Callable[[R, pb.Reply], None],
        clock: Callable[[], float] = time.monotonic,
        limits: CoordinatorLimits | None = None,
        *,
        judges_own_stalls: bool = True,
    ) -> None:
        self.limits = limits or CoordinatorLimits()
        self._send = send
        self._clock = clock
        #: A gap between sweeps (every tenth of a second) longer than a job's liveness timeout
        #: is this process's stall (frozen with its node), not its ranks' silence: their
        #: silence counts from the sweep after it. (Not half of it, as a rank's own heartbeats
        #: judge: a coordinator busy serving a flood between two sweeps must not pass for
        #: stalled and hide a loss.) False for a caller whose clock jumps on purpose.
        self._judges_own_stalls = judges_own_stalls
        self._swept = clock()
        self._lock = threading.RLock()
        self._jobs: dict[str, Job] = {}
        self._sessions: dict[bytes, Session] = {}
        self._by_nonce: dict[bytes, Session] = {}
        self._parked: set[Parked[R]] = set()
        #: Every session's cached replies, oldest first: (session, request id) -> bytes.
        self._cached: OrderedDict[tuple[bytes, int], int] = OrderedDict()
        self._cached_bytes = 0
        self._conns: dict[Hashable, set[Session]] = {}  # connection -> sessions heard on it
        #: Requests served, by operation (a resend counted once per arrival).
        self._served: Counter[str] = Counter()

    # ------------------------------------------------------------------ entry points
    def handle_frame(self, route: R, key: bytes, frame: bytes, conn: Hashable = None) -> pb.Reply | None:
        """Serve one sealed request (:func:`dataparallel.control.wire.seal` with ``key``): a frame that
        fails its MAC is answered ``AUTH_FAILED``, one that does not parse ``BAD_MESSAGE``.
        ``conn``: the connection it came in on (see :meth:`connection_closed`), if known."""
        try:
            request = open_frame(key, frame, pb.Request)
        except Misdirected:
            return None  # a reply sent back to us: no client waits for an answer to it
        except AuthError as err:
            return pb.Reply(status=pb.AUTH_FAILED, error=str(err))
        except BadMessage as err:
            return pb.Reply(status=pb.BAD_MESSAGE, error=str(err))
        return self.handle(route, request, conn)

    def handle(self, route: R, request: pb.Request, conn: Hashable = None) -> pb.Reply | None:
        """Serve one authenticated request; never raises for bad input (it becomes a reply)."""
        with self._lock:
            try:
                reply = self._dispatch(route, request, conn)
            except BadMessage as err:
                reply = _reply(request.id, pb.BAD_MESSAGE, str(err))
            except Exception as err:  # a bug must not take the coordinator down
                log.exception("coordinator failed on a request")
                reply = _reply(request.id, pb.FAILED, f"coordinator error: {err}")
            if reply is not None:
                reply.answers = request.hello.nonce if request.HasField("hello") else request.session
            return reply

    def sweep(self) -> float:
        """Expire parked requests, declare silent ranks lost, drop idle sessions; return the
        seconds until the next sweep is needed."""
        with self._lock:
            now = self._clock()
            gap, self._swept = now - self._swept, now
            for parked in [p for p in self._parked if p.deadline <= now]:
                self._finish(parked, parked.on_timeout())
            # Ended runs that still have sessions are watched too (they are no longer _jobs').
            for job in {*self._jobs.values(), *(s.job for s in self._sessions.values())}:
                if self._judges_own_stalls and gap > job.liveness_timeout:
                    for session in job.sessions:
                        session.last_seen = max(session.last_seen, now)
                        if session.dropped_at is not None:
                            session.dropped_at = max(session.dropped_at, now)
                self._watch(job, now)
            next_deadline = min((p.deadline for p in self._parked), default=now + SWEEP_INTERVAL)
            return max(0.0, min(next_deadline - now, SWEEP_INTERVAL))

    def connection_closed(self, conn: Hashable) -> None:
        """Connection ``conn`` ended: a rank left with none is judged at once (its process
        exited?) and on every sweep after (did it come back within the grace?)."""
        with self._lock:
            dropped = self._conns.pop(conn, set())
            now = self._clock()
            for session in dropped:
                session.conns.discard(conn)
                if not session.conns and session.dropped_at is None:
                    session.dropped_at = now
            for job in {s.job for s in dropped if s.dropped_at is not None}:
                self._watch(job, now)

    def job_members(self, job: str) -> set[int]:
        """Ranks of ``job`` still registered (neither left nor lost)."""
        with self._lock:
            state = self._jobs.get(job)
            return set(state.ranks) if state else set()

    def job_state(self, job: str) -> int:
        """Entries ``job`` holds here: keys, open collectives and parked requests."""
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                return 0
            parked = sum(1 for p in self._parked if p.session.job is state)
            return state.space.num_keys() + len(state.collectives) + parked

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "jobs": len(self._jobs),
                "sessions": len(self._sessions),
                "parked": len(self._parked),
                "keys": sum(j.space.num_keys() for j in self._jobs.values()),
            }

    def job_names(self) -> list[str]:
        """The jobs that have a run here now (what ``dataparallel serve --http`` lists)."""
        with self._lock:
            return sorted(self._jobs)

    def served(self) -> dict[str, int]:
        """Requests that reached this coordinator since it started, by operation (``hello``,
        ``join``, ``collect``, ...; one that failed to open or parse is not counted)."""
        with self._lock:
            return dict(self._served)

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, route: R, request: pb.Request, conn: Hashable) -> pb.Reply | None:
        op = request.WhichOneof("op")
        self._served[op or "none"] += 1
        if op == "hello":
            reply = self._hello(route, request)
            session = self._sessions.get(reply.session)
            if session is not None and conn is not None:
                self._attach(session, conn)
            return reply
        session = self._sessions.get(request.session)
        if session is None:
            return _reply(request.id, pb.CLOSED, "unknown session: say hello first (or the coordinator restarted)")
        # A resend is answered as the first time, and applied never again. It does not count
        # as a sign of life: a replayed frame must not keep a dead rank alive.
        cached = session.replies.get(request.id)
        if cached is not None:
            return cached
        parked = session.parked.get(request.id)
        if parked is not None:
            parked.route = route  # perhaps over a new connection: answer there
            return None
        fresh = session.accept(request.id, self.limits.replay_window)
        if not fresh and op not in READ_ONLY:
            return _reply(
                request.id,
                pb.BAD_MESSAGE,
                f"request id {request.id} is stale or replayed (applied already; its reply is no longer held)",
            )
        if fresh:
            session.last_seen = self._clock()
            if conn is not None:
                self._attach(session, conn)
        handler = self._HANDLERS.get(op)
        if handler is None:
            return _reply(request.id, pb.BAD_MESSAGE, f"unknown operation {op!r}")
        if session.observer:
            refused = self._observed(session, op, request.id)
            if refused is not None:
                self._remember(session, refused)
                return refused
        answer = handler(self, session, request, route)
        if answer is not None and op != "heartbeat" and op not in READ_ONLY:
            self._remember(session, answer)
        return answer

    def _observed(self, s: Session, op: str, request_id: int) -> pb.Reply | None:
        """An observer's request: refused unless it reads (or heartbeats, or leaves); a read
        goes to the job's current run, which the session follows from one run to the next."""
        if op not in OBSERVER_OPS:
            return _reply(request_id, pb.FAILED, f"an observer's session reads only: {op} refused")
        current = self._jobs.get(s.job.name)
        if current is not None and current is not s.job:
            s.job.sessions.discard(s)
            s.job = current
            current.sessions.add(s)
        return None

    def _hello(self, route: R, request: pb.Request) -> pb.Reply:
        hello = request.hello
        if hello.protocol != PROTOCOL_VERSION:
            raise BadMessage(
                f"protocol {hello.protocol} is not spoken here (this coordinator speaks {PROTOCOL_VERSION})"
            )
        if not hello.job or not 0 <= hello.world_size <= MAX_WORLD_SIZE or not 0 < hello.liveness_timeout < 1e6:
            raise BadMessage(f"hello needs a job name, 0 <= world_size <= {MAX_WORLD_SIZE} and a liveness timeout > 0")
        nonce = hello.nonce[:64]
        again = self._by_nonce.get(nonce) if nonce else None
        if again is not None and again.job.name == hello.job:
            again.last_seen = self._clock()
            return _reply(request.id, session=again.id)  # a resend: one hello, one session
        job = self._jobs.get(hello.job)
        if hello.world_size == 0:  # an observer (dp.observe): reads a job that exists, creates none
            if job is None:
                return _reply(request.id, pb.FAILED, f"job {hello.job!r} has no run here: no rank of it has joined")
        elif job is None or job.lost:
            # A run that lost a rank is over: its sessions keep it until they go; a new one starts.
            job = self._jobs[hello.job] = Job(hello.job, hello.world_size, hello.liveness_timeout)
        elif job.world_size != hello.world_size:
            raise BadMessage(f"job {hello.job!r} has world size {job.world_size}, this process said {hello.world_size}")
        if len(self._sessions) >= self.limits.max_sessions:
            if not job.sessions and self._jobs.get(hello.job) is job:
                del self._jobs[hello.job]
            return _reply(request.id, pb.FAILED, f"coordinator full: {self.limits.max_sessions} sessions open")
        session = Session(os.urandom(16), job, hello.host[:256], hello.pid, self._clock(), nonce=nonce)
        session.observer = hello.world_size == 0
        session.local = procinfo.same_pids(hello.boot_id, hello.pid_namespace)
        if 0 < hello.heartbeat < hello.liveness_timeout:
            session.heartbeat = hello.heartbeat
        self._sessions[session.id] = session
        if session.nonce:
            self._by_nonce[session.nonce] = session
        job.sessions.add(session)
        return _reply(request.id, session=session.id)

    # ------------------------------------------------------------------ key/value
    def _set(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        full = self._over_budget(s.job, r.set.key, len(r.set.value))
        if full:
            return _reply(r.id, pb.FAILED, full)
        s.job.space.set(r.set.key, r.set.value)
        return _reply(r.id)

    def _get(self, s: Session, r: pb.Request, route: R) -> pb.Reply | None:
        key, job = r.get.key, s.job
        value = job.space.get(key)
        if value is not None:
            return _reply(r.id, value=value)
        if job.lost:
            return self._lost_reply(r.id, job)
        crowded = self._crowded(s, r.id)
        if crowded is not None:
            return crowded
        deadline = self._clock() + _timeout(r.get.timeout)
        parked = Parked(s, route, r.id, deadline, lambda: _reply(r.id, pb.TIMEOUT), remember=False)

        def release(value: bytes) -> None:
            self._finish(parked, _reply(r.id, value=value))

        value = job.space.get_or_park(key, release)
        if value is not None:
            return _reply(r.id, value=value)
        parked.release = lambda: job.space.unpark(key, release)
        self._park(parked)
        return None

    def _add(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        key, amount = r.add.key, r.add.amount
        full = self._over_budget(s.job, key, 20)  # an int64 in decimal
        if full:
            return _reply(r.id, pb.FAILED, full)
        # The reply carries an int64: a sum past it is refused before it is stored, not after.
        current = s.job.space.get(key)
        try:
            total = int(b"0" if current is None else current) + amount
        except ValueError:
            total = 0  # not a decimal integer: space.add says so
        if not INT64_MIN <= total <= INT64_MAX:
            raise BadMessage(f"add({key!r}, {amount}): the sum {total} is out of the int64 range")
        return _reply(r.id, number=s.job.space.add(key, amount))

    def _compare_set(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        cs = r.compare_set
        full = self._over_budget(s.job, cs.key, len(cs.desired))
        if full:
            return _reply(r.id, pb.FAILED, full)
        return _reply(r.id, value=s.job.space.compare_set(cs.key, cs.expected, cs.desired))

    def _multi_compare_set(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        items = list(r.multi_compare_set.items)
        space = s.job.space
        size = sum(len(cs.key) + len(cs.desired) for cs in items)
        full = self._over_budget(s.job, "", size, new_keys=len({cs.key for cs in items if cs.key not in space}))
        if full:
            return _reply(r.id, pb.FAILED, full)
        return _reply(r.id, values=[space.compare_set(cs.key, cs.expected, cs.desired) for cs in items])

    def _delete_many(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        space = s.job.space
        return _reply(r.id, number=sum(space.delete(key) for key in r.delete_many.keys))

    def _delete(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        return _reply(r.id, flag=s.job.space.delete(r.delete.key))

    def _multi_get(self, s: Session, r: pb.Request, route: R) -> pb.Reply | None:
        keys, job = list(r.multi_get.keys), s.job
        if not keys:
            return _reply(r.id)
        values = job.space.multi_get(keys)
        if None not in values:
            return _reply(r.id, values=values)
        if job.lost:
            return self._lost_reply(r.id, job)
        crowded = self._crowded(s, r.id)
        if crowded is not None:
            return crowded
        deadline = self._clock() + _timeout(r.multi_get.timeout)
        parked = Parked(s, route, r.id, deadline, lambda: _reply(r.id, pb.TIMEOUT), remember=False)

        def look(_value: bytes = b"") -> bool:
            # Parked on one missing key at a time; each release looks at all of them again.
            while True:
                values = job.space.multi_get(keys)
                if None not in values:
                    self._finish(parked, _reply(r.id, values=values))
                    return True
                missing = keys[values.index(None)]
                if job.space.get_or_park(missing, look) is None:
                    parked.release = functools.partial(job.space.unpark, missing, look)
                    return False

        if not look():
            self._park(parked)
        return None

    def _multi_set(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        items = [(kv.key, kv.value) for kv in r.multi_set.items]
        full = self._over_budget(s.job, "", sum(len(k) + len(v) for k, v in items), new_keys=len({k for k, _ in items}))
        if full:
            return _reply(r.id, pb.FAILED, full)
        s.job.space.multi_set(items)
        return _reply(r.id)

    def _append(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        full = self._over_budget(s.job, r.append.key, len(r.append.value))
        if full:
            return _reply(r.id, pb.FAILED, full)
        s.job.space.append(r.append.key, r.append.value)
        return _reply(r.id)

    def _check(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        return _reply(r.id, flag=s.job.space.check(r.check.keys))

    def _num_keys(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        return _reply(r.id, number=s.job.space.num_keys())

    # ------------------------------------------------------------------ membership
    def _register(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        rank, job = r.register.rank, s.job
        if rank >= job.world_size:
            raise BadMessage(f"rank {rank} out of range for world size {job.world_size}")
        holder = job.ranks.get(rank)
        if holder is not None and holder is not s:
            return _reply(r.id, pb.FAILED, f"rank {rank} is already registered by pid {holder.pid} on {holder.host}")
        self._take(s, rank)
        return _reply(r.id)

    def _join(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        """Claim, register and publish in one step, with the keys a rank joining through
        key/value calls would write (``keyspace.claim_key``, ``NEXT_RANK``, ``peer_key``)."""
        join, job = r.join, s.job
        if s.rank is not None:
            raise BadMessage(f"this session holds rank {s.rank} already")
        if not join.claimant:
            raise BadMessage("join needs a claimant")
        if not join.assign and join.rank >= job.world_size:
            raise BadMessage(f"rank {join.rank} out of range for world size {job.world_size}")
        if job.lost:  # its ranks are being told; the next hello starts the next run
            return _reply(r.id, flag=False, refusal=pb.RUN_OVER)
        if not join.assign:
            rank = join.rank
            refused = self._claim(job, rank, join, r.id)
            if refused is not None:
                return refused
        else:
            while True:
                full = self._over_budget(job, NEXT_RANK, 20)  # an int64 in decimal
                if full:
                    return _reply(r.id, pb.FAILED, full)
                rank = job.space.add(NEXT_RANK, 1) - 1
                if rank >= job.world_size:
                    return _reply(r.id, flag=False, refusal=pb.HELD)
                refused = self._claim(job, rank, join, r.id)
                if refused is None:
                    break
                if refused.status != pb.OK:
                    return refused
        self._take(s, rank)
        job.space.set(peer_key(rank), join.peer)
        return _reply(r.id, flag=True, number=rank)

    def _claim(self, job: Job, rank: int, join: pb.Join, request_id: int) -> pb.Reply | None:
        """Claim ``rank`` for ``join``'s claimant, or the reply that refuses it (within the
        job's bounds: only the keys that are new count)."""
        holder = job.ranks.get(rank)
        if holder is not None:  # its claim's holder, or a session registered without one
            return _reply(request_id, flag=False, refusal=pb.HELD, value=f"pid {holder.pid} on {holder.host}".encode())
        owner = job.space.get(claim_key(rank))
        if rank in job.left:
            return _reply(request_id, flag=False, refusal=pb.LEFT, value=owner or b"")
        if owner:
            return _reply(request_id, flag=False, refusal=pb.HELD, value=owner)
        new = (owner is None) + (peer_key(rank) not in job.space)
        size = len(claim_key(rank)) + len(join.claimant) + len(peer_key(rank)) + len(join.peer)
        full = self._over_budget(job, "", size, new)
        if full:
            return _reply(request_id, pb.FAILED, full)
        job.space.set(claim_key(rank), join.claimant)
        return None

    @staticmethod
    def _take(s: Session, rank: int) -> None:
        s.rank = rank
        s.job.ranks[rank] = s
        s.job.left.discard(rank)

    def _heartbeat(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        # The writes that ride on it first, each as a Set, up to the first refused (an
        # observer's: it reads only; one past the job's bounds); `flag` says this coordinator
        # applies them (one that predates them does not set it), `number` how many it did.
        applied, refused = 0, ""
        for item in r.heartbeat.set:
            if s.observer:
                refused = "an observer's session reads only: a heartbeat's writes refused"
            else:
                refused = self._over_budget(s.job, item.key, len(item.value)) or ""
            if refused:
                break
            s.job.space.set(item.key, item.value)
            applied += 1
        # Losses are news to the run's ranks only: a session still joining moves on to a new
        # run. Told whatever became of the writes.
        if s.job.lost and s.rank is not None:
            reply = self._lost_reply(r.id, s.job, status=pb.OK)
            reply.error, reply.number, reply.flag = refused, applied, True
            return reply
        return _reply(r.id, pb.FAILED if refused else pb.OK, refused, number=applied, flag=True)

    def _leave(self, s: Session, r: pb.Request, route: R) -> pb.Reply:
        job = s.job
        for parked in list(s.parked.values()):
            self._finish(parked, _reply(parked.request_id, pb.CLOSED, "session left"), send=False)
        if s.rank is not None and job.ranks.get(s.rank) is s:
            del job.ranks[s.rank]
            job.left.add(s.rank)
            self._fail_collectives_without(job, s.rank)
        self._drop_session(s)
        return _reply(r.id)

    def _attach(self, session: Session, conn: Hashable) -> None:
        if conn not in session.conns:
            session.conns.add(conn)
            self._conns.setdefault(conn, set()).add(session)
        session.dropped_at = None

    def _drop_session(self, s: Session) -> None:
        self._sessions.pop(s.id, None)
        for conn in s.conns:
            sessions = self._conns.get(conn)
            if sessions is not None:
                sessions.discard(s)
                if not sessions:
                    del self._conns[conn]
        s.conns = set()
        if self._by_nonce.get(s.nonce) is s:
            del self._by_nonce[s.nonce]
        for request_id in list(s.replies):
            self._forget(s, request_id)
        job = s.job
        job.sessions.discard(s)
        if self._jobs.get(job.name) is job and all(other.observer for other in job.sessions):
            del self._jobs[job.name]  # last one out (observers aside): a later job of the same name starts clean

    # ------------------------------------------------------------------ collectives
    def _collect(self, s: Session, r: pb.Request, route: R) -> pb.Reply | None:
        c, job = r.collect, s.job
        if s.rank is None:
            return _reply(r.id, pb.FAILED, "collectives need a registered rank")
        sources = frozenset(c.sources) if c.sources else None
        if sources is not None and max(sources) >= job.world_size:
            raise BadMessage(f"collective {c.name!r}: source ranks {sorted(sources)} out of range")
        if sources is not None and len(sources) == job.world_size:
            sources = None  # every rank, named one by one
        state = job.collectives.get(c.name)
        crowded = state is None and len(job.collectives) >= self.limits.max_parked_per_session
        if crowded or len(s.parked) >= self.limits.max_parked_per_session:
            return _reply(r.id, pb.FAILED, f"job {job.name!r}: too many collectives open at once")
        wait = _timeout(c.timeout) if c.want else 0.0  # checked before anything changes
        if state is None:
            count = job.world_size if sources is None else len(sources)
            state = job.collectives[c.name] = Collective(sources, count)
        elif state.sources != sources:
            raise BadMessage(f"collective {c.name!r}: ranks disagree on its sources")
        if s.rank in state.arrived:
            raise BadMessage(f"rank {s.rank} entered collective {c.name!r} twice")
        if job.lost and not state.complete and c.want:
            return self._lost_reply(r.id, job)
        # A rank that left never arrives: a round it has not entered can never complete. The
        # ranks that left are few; the round's sources may be every rank.
        gone = (
            [g for g in sorted(job.left) if g != s.rank and g not in state.arrived and state.is_source(g)]
            if c.want and not state.complete and job.left
            else []
        )
        if gone:
            if not state.arrived:
                del job.collectives[c.name]
            return _left_reply(r.id, gone[0])
        state.arrive(s.rank)
        if c.has_value:
            state.values[s.rank] = c.value
        reply: pb.Reply | None = _reply(r.id)
        if c.want and not state.complete:
            rank = s.rank

            def on_timeout() -> pb.Reply:
                arrived = sorted(state.arrived)
                missing = sorted(set(range(job.world_size)) - state.arrived)
                # Withdraw this rank so a retry of the same name starts clean.
                state.withdraw(rank)
                state.values.pop(rank, None)
                if not state.arrived:
                    job.collectives.pop(c.name, None)
                note = f"{len(arrived)}/{job.world_size} ranks had arrived; missing ranks {missing}"
                timeout = _reply(r.id, pb.TIMEOUT, note)
                timeout.arrived.extend(arrived)
                return timeout

            parked = Parked(s, route, r.id, self._clock() + wait, on_timeout)
            parked.release = lambda: state.waiting.pop(rank, None)
            state.waiting[rank] = parked
            self._park(parked)
            reply = None
        elif c.want:
            reply = self._collected(r.id, state, job)
        if not state.complete and state.pending == 0:
            state.complete = True
            for parked in list(state.waiting.values()):
                self._finish(parked, self._collected(parked.request_id, state, job))
        if state.complete and len(state.arrived) == job.world_size:
            del job.collectives[c.name]
        return reply

    def _fail_collectives_without(self, job: Job, rank: int) -> None:
        """``rank`` left: every open collective it had to enter and had not is over, and the
        ranks waiting in it are told at once (a later arrival is refused in ``_collect``)."""
        for name, state in list(job.collectives.items()):
            if not state.complete and state.is_source(rank) and rank not in state.arrived:
                del job.collectives[name]
                for parked in list(state.waiting.values()):
                    self._finish(parked, _left_reply(parked.request_id, rank))

    @staticmethod
    def _collected(request_id: int, state: Collective, job: Job) -> pb.Reply:
        reply = _reply(request_id)
        if state.values:  # a barrier carries none: do not send N empty values to N ranks
            reply.values.extend(state.values.get(rank, b"") for rank in range(job.world_size))
        return reply

    # ------------------------------------------------------------------ parking, liveness
    def _park(self, parked: Parked) -> None:
        parked.session.parked[parked.request_id] = parked
        self._parked.add(parked)

    def _finish(self, parked: Parked, reply: pb.Reply, send: bool = True) -> None:
        if parked.done:
            return
        parked.done = True
        parked.release()
        # Its release closes over the job and over itself: a cycle that, left in place, holds an
        # ended job's keys and values until the garbage collector's next full pass.
        parked.release = _withdrawn
        self._parked.discard(parked)
        session = parked.session
        session.parked.pop(parked.request_id, None)
        reply.answers = session.id
        if parked.remember:
            self._remember(session, reply)
        if send:
            self._send(parked.route, reply)

    def _remember(self, session: Session, reply: pb.Reply) -> None:
        """Cache ``reply`` for resends, evicting the oldest past the limits (the newest reply
        of a session always stays; see :class:`CoordinatorLimits` for how long one is held)."""
        if self._sessions.get(session.id) is not session:
            return  # it left or was dropped (its leave, or a parked request failed after): no resends to answer
        size = reply.ByteSize()
        now = self._clock()
        session.replies[reply.id] = reply
        session.reply_at[reply.id] = now
        session.reply_bytes += size
        self._cached[(session.id, reply.id)] = size
        self._cached_bytes += size
        limits = self.limits
        recent = now - 2 * session.job.liveness_timeout
        while len(session.replies) > 1:
            oldest = next(iter(session.replies))
            over = len(session.replies) > limits.reply_cache_entries and (
                session.reply_at[oldest] < recent or len(session.replies) > limits.reply_cache_recent_entries
            )
            if not over and session.reply_bytes <= limits.reply_cache_session_bytes:
                break
            self._forget(session, oldest)
        while self._cached_bytes > limits.reply_cache_bytes and len(self._cached) > 1:
            session_id, request_id = next(iter(self._cached))
            owner = self._sessions.get(session_id)
            if owner is None or (owner is session and len(session.replies) == 1):
                break  # only this session's newest reply is left
            self._forget(owner, request_id)

    def _forget(self, session: Session, request_id: int) -> None:
        reply = session.replies.pop(request_id, None)
        session.reply_at.pop(request_id, None)
        size = self._cached.pop((session.id, request_id), 0)
        if reply is not None:
            session.reply_bytes -= size
            self._cached_bytes -= size

    def _watch(self, job: Job, now: float) -> None:
        for rank, session in list(job.ranks.items()):
            if rank in job.lost:
                continue
            # Every session, ten times a second: nothing here is built for a rank that is fine.
            silent = now - session.last_seen
            reason = None
            if silent > job.liveness_timeout:
                reason = f"no message for {silent:.1f}s (liveness timeout {job.liveness_timeout:g}s)"
            elif session.dropped_at is not None:
                grace = min(job.liveness_timeout, session.heartbeat + 1.0)
                if session.local:
                    # Its pid tells: exited is lost now; alive, its connections were reset and
                    # it reconnects (however slowly a loaded machine lets it): the liveness
                    # timeout still bounds a process that stays away.
                    if procinfo.exited(session.pid):
                        reason = "its process exited (its connections closed)"
                elif now - session.dropped_at > grace:
                    reason = f"its connections closed and it did not come back within {grace:g}s"
            if reason is not None:
                reason = f"{reason}; it ran as pid {session.pid} on {session.host}"
                job.lost[rank] = pb.LostPeer(rank=rank, last_seen=time.time() - silent, reason=reason)
                log.warning("job %r: rank %d lost: %s", job.name, rank, reason)
                del job.ranks[rank]
                self._drop_session(session)
                self._fail_parked(job)
        # A session with requests waiting is not idle (they hold it, and count against its limit,
        # until answered or timed out); dropped with them, they would outlive every bound.
        for session in [s for s in job.sessions if s.rank is None and not s.parked]:
            if now - session.last_seen > max(self.limits.idle_session_timeout, 3 * job.liveness_timeout):
                self._drop_session(session)

    def _fail_parked(self, job: Job) -> None:
        for parked in [p for p in self._parked if p.session.job is job]:
            self._finish(parked, self._lost_reply(parked.request_id, job))

    @staticmethod
    def _lost_reply(request_id: int, job: Job, status: pb.Status = pb.PEER_LOST) -> pb.Reply:
        first = next(iter(job.lost.values()))
        reply = _reply(request_id, status, first.reason if status == pb.PEER_LOST else "")
        reply.lost.CopyFrom(first)
        return reply

    def _crowded(self, s: Session, request_id: int) -> pb.Reply | None:
        """The refusal of one more waiting request of ``s``, or None while it may wait."""
        if len(s.parked) < self.limits.max_parked_per_session:
            return None
        limit = self.limits.max_parked_per_session
        return _reply(request_id, pb.FAILED, f"{limit} requests of this session are waiting already")

    def _over_budget(self, job: Job, key: str, size: int, new_keys: int = 1) -> str | None:
        """Why writing ``size`` bytes at ``key`` (or, with ``new_keys``, at that many keys) would
        take ``job`` past its bounds, or None."""
        space = job.space
        if (not key or key not in space) and space.num_keys() + new_keys > self.limits.max_job_keys:
            return f"job {job.name!r} holds {self.limits.max_job_keys} keys, the most a job may hold"
        if space.nbytes() + len(key) + size > self.limits.max_job_bytes:
            return f"job {job.name!r} would hold more than {self.limits.max_job_bytes} bytes of keys and values"
        return None

    _HANDLERS: dict[str, Callable[[Coordinator[Any], Session, pb.Request, Any], pb.Reply | None]] = {
        "set": _set,
        "get": _get,
        "add": _add,
        "compare_set": _compare_set,
        "multi_compare_set": _multi_compare_set,
        "delete": _delete,
        "delete_many": _delete_many,
        "multi_get": _multi_get,
        "multi_set": _multi_set,
        "append": _append,
        "check": _check,
        "num_keys": _num_keys,
        "collect": _collect,
        "register": _register,
        "join": _join,
        "heartbeat": _heartbeat,
        "leave": _leave,
    }


def _withdrawn() -> None:
    pass


def _reply(request_id: int, status: pb.Status = pb.OK, error: str = "", **fields: Any) -> pb.Reply:
    return pb.Reply(id=request_id, status=status, error=error, **fields)


def _left_reply(request_id: int, rank: int) -> pb.Reply:
    reason = f"rank {rank} closed its channel without entering this collective"
    reply = _reply(request_id, pb.PEER_LEFT, reason)
    reply.lost.CopyFrom(pb.LostPeer(rank=rank, last_seen=time.time(), reason=reason))
    return reply


def _timeout(seconds: float) -> float:
    if not 0 < seconds <= 7 * 86400:
        raise BadMessage(f"timeout {seconds!r} out of range (0, 1 week]")
    return seconds
