"""Stateful fuzzing of the coordinator at its real limits (the default :class:`CoordinatorLimits`).

A hypothesis state machine opens sessions in a few jobs and sends them every operation, with
request ids in order, out of order, replayed and stale, values from empty to past a job's byte
budget, and time that jumps past timeouts, liveness and idleness. A Python model of every job's
keys, every session's ids and parked requests predicts each reply, including the ones sent later
(a parked get released by a write, a timeout, a lost peer). Invariants hold the coordinator to
its own accounting: reply-cache entries and bytes per session and in all, keys and bytes per job,
parked requests only of open sessions.

It runs in-process against :class:`Coordinator` with a fake clock (many examples), once more
with bulk steps that fill a job to its key limit, the coordinator to its session limit and a
session to its parked-request limit, and a smaller run through a `dataparallel serve` process
with sealed frames (frames at and past the size limit, reconnects), whose RSS stays bounded.
"""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass, field

import pytest
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from jobutil import rss_mb, standalone

from dataparallel.control.coordinator import READ_ONLY, Coordinator, CoordinatorLimits
from dataparallel.control.keyspace import NEXT_RANK, claim_key, peer_key
from dataparallel.control.wire import MAC_SIZE, MAX_FRAME, MAX_WORLD_SIZE, PROTOCOL_VERSION, pb, seal, token_key
from dataparallel.testing import free_port

LIMITS = CoordinatorLimits()  # the real bounds, not shrunk ones
WINDOW = LIMITS.replay_window
MAX_PARKED = LIMITS.max_parked_per_session
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
WEEK = 7 * 86400.0
TOKEN = "fuzz-state-token"
KEY = token_key(TOKEN)

# ---------------------------------------------------------------------- strategies
JOBS = ["j0", "j1", "j2"]
KEYS = ["a", "b", ""]
WORLD_SIZES = [1, 2, 1, 3, MAX_WORLD_SIZE, MAX_WORLD_SIZE + 1, 2, 0]
TIMEOUTS = [0.05, 1.0, WEEK, 30.0, WEEK, 0.0, -1.0, math.nan, WEEK + 1]
NUMERIC = [b"0", b"7", b" 12 ", b"-3", b"+1_000", b"9223372036854775807", b"-9223372036854775808", b"9" * 5000]
BIG_SIZES = [1 << 20, (4 << 20) + 1, 64 << 20, 200 << 20]
_big: dict[int, bytes] = {}


def big(size: int) -> bytes:
    """A value of ``size`` bytes; one shared object for each of the sizes the rules draw, so
    the model holds no second copy."""
    value = _big.get(size)
    if value is None:
        value = bytes([size % 251]) * size
        if size not in BIG_SIZES and size != 32 << 20:  # one size more: the last frame-sized one
            for other in [s for s in _big if s not in BIG_SIZES and s != 32 << 20]:
                del _big[other]
        _big[size] = value
    return value


@st.composite
def values(draw, big_sizes=BIG_SIZES) -> bytes:
    kind = draw(st.integers(0, 15))  # shrinks to small values
    if kind >= 14:
        return big(draw(st.sampled_from(big_sizes)))
    if kind >= 11:
        return draw(st.sampled_from(NUMERIC))
    return draw(st.binary(max_size=6))


amounts = st.sampled_from([1, INT64_MAX, -1, INT64_MIN, 5, INT64_MAX, 0])
ids = st.tuples(st.sampled_from(["next", "next", "jump", "below", "stale", "max"]), st.integers(1, 3 * WINDOW))
keys = st.sampled_from(KEYS)
key_lists = st.lists(keys, max_size=3)


# ---------------------------------------------------------------------- the model
@dataclass(eq=False)
class ParkedModel:
    session: SessionModel
    request_id: int
    kind: str  # get, multi_get, collect
    keys: list[str]
    deadline: float
    route: int
    name: str = ""  # of a collective


@dataclass(eq=False)
class CollectiveModel:
    sources: frozenset[int]
    values: dict[int, bytes] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)
    waiting: dict[int, ParkedModel] = field(default_factory=dict)
    complete: bool = False


@dataclass(eq=False)
class JobModel:
    name: str
    world_size: int
    liveness: float
    kv: dict[str, bytes] = field(default_factory=dict)
    nbytes: int = 0
    ranks: dict[int, SessionModel] = field(default_factory=dict)
    sessions: dict[bytes, SessionModel] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    left: set[int] = field(default_factory=set)
    collectives: dict[str, CollectiveModel] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)  # keys the rules wrote (not a bulk fill)

    def store(self, key: str, value: bytes) -> None:
        self.touched.add(key)
        old = self.kv.get(key)
        self.nbytes += len(value) - (len(old) if old is not None else -len(key))
        self.kv[key] = value

    def delete(self, key: str) -> bool:
        old = self.kv.pop(key, None)
        if old is not None:
            self.nbytes -= len(key) + len(old)
        return old is not None


@dataclass(eq=False)
class SessionModel:
    sid: bytes
    job: JobModel
    route: int
    last_seen: float
    rank: int | None = None
    alive: bool = True
    high: int = -1
    used: set[int] = field(default_factory=set)
    #: First replies of mutations, which the coordinator may answer a resend from.
    replies: dict[int, pb.Reply] = field(default_factory=dict)
    parked: dict[int, ParkedModel] = field(default_factory=dict)
    observer: bool = False  # a hello of world size 0: reads only, follows its job's current run

    def pick_id(self, how: str, n: int) -> int:
        return min(self._pick_id(how, n), 2**64 - 1)

    def _pick_id(self, how: str, n: int) -> int:
        top = max(self.high, 0)
        if how == "next":
            return top + 1
        if how == "jump":
            return top + n
        if how == "below":
            return max(top - n % WINDOW, 0)
        if how == "stale":
            return max(top - WINDOW - n, 0)
        return 2**64 - 1 if n % 7 == 0 else top + 1  # "max": after it the session accepts nothing new


class Bad(Exception):
    """The model expects BAD_MESSAGE (raised in the coordinator: never cached)."""


def reply(request_id: int, status: int = pb.OK, error: str = "", **fields) -> pb.Reply:
    return pb.Reply(id=request_id, status=status, error=error, **fields)


STALE = "stale or replayed"
LOOSE_ARRIVED = "\0"  # marks an expected collect TIMEOUT whose `arrived` depends on sweep order


def check_reply(actual: pb.Reply | None, expected: pb.Reply | None, what: str) -> None:
    if expected is None:
        assert actual is None, f"{what}: expected no reply yet (parked), got {actual}"
        return
    assert actual is not None, f"{what}: expected {expected}, got no reply"
    assert actual.id == expected.id, f"{what}: reply id {actual.id}, expected {expected.id}"
    assert actual.status == expected.status, (
        f"{what}: status {pb.Status.Name(actual.status)} ({actual.error!r}), expected {pb.Status.Name(expected.status)}"
        f" ({expected.error!r})"
    )
    if expected.error and expected.error != LOOSE_ARRIVED:
        assert expected.error in actual.error, f"{what}: error {actual.error!r} does not say {expected.error!r}"
    if expected.status == pb.PEER_LOST or expected.HasField("lost"):
        assert actual.lost.rank == expected.lost.rank, f"{what}: lost {actual.lost}, expected {expected.lost}"
    if expected.status == pb.TIMEOUT and expected.error == LOOSE_ARRIVED:
        assert set(actual.arrived) <= set(expected.arrived), f"{what}: arrived {list(actual.arrived)}"
    for name in ("value", "number", "flag", "refusal"):
        assert getattr(actual, name) == getattr(expected, name), (
            f"{what}: {name} {_short(getattr(actual, name))}, expected {_short(getattr(expected, name))}"
        )
    assert list(actual.values) == list(expected.values), f"{what}: values {_short(list(actual.values))}"
    if expected.session:
        assert actual.session, f"{what}: no session in the hello reply"


def _short(x) -> str:
    text = repr(x)
    return text if len(text) < 200 else f"{text[:200]}... ({len(text)} chars)"


# ---------------------------------------------------------------------- drivers
class InProcess:
    """Drives :class:`Coordinator` directly, with a fake clock."""

    wire = False

    def __init__(self) -> None:
        self.now = 1000.0
        self.sent: list[tuple[int, pb.Reply]] = []
        self.coordinator = Coordinator(  # its clock jumps between sweeps on purpose
            lambda route, r: self.sent.append((route, r)), clock=lambda: self.now, judges_own_stalls=False
        )

    def call(self, route: int, request: pb.Request, wait: float = 0.0) -> pb.Reply | None:
        return self.coordinator.handle(route, request)

    def take_sent(self) -> list[tuple[int, pb.Reply]]:
        sent, self.sent = self.sent, []
        return sent

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.coordinator.sweep()

    def cached(self, sid: bytes, request_id: int) -> bool | None:
        session = self.coordinator._sessions.get(sid)
        return session is not None and request_id in session.replies

    def close(self) -> None:
        pass


class OverZmq:
    """Sealed frames to a `dataparallel serve` process, one DEALER socket per route."""

    wire = True

    def __init__(self, port: int) -> None:
        self.address = f"tcp://127.0.0.1:{port}"
        self.ctx = zmq.Context.instance()
        self.sockets: dict[int, zmq.Socket] = {}
        self.inbox: list[tuple[int, pb.Reply]] = []

    def socket(self, route: int) -> zmq.Socket:
        sock = self.sockets.get(route)
        if sock is None:
            sock = self.sockets[route] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
        return sock

    def send_raw(self, route: int, frame: bytes) -> None:
        self.socket(route).send(frame)

    def receive(self, route: int, match, wait: float) -> pb.Reply | None:
        sock = self.socket(route)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
            frame = sock.recv()
            assert len(frame) >= MAC_SIZE and seal(KEY, pb.Reply.FromString(frame[MAC_SIZE:])) == frame
            got = pb.Reply.FromString(frame[MAC_SIZE:])
            if match(got):
                return got
            self.inbox.append((route, got))
        return None

    def call(self, route: int, request: pb.Request, wait: float = 10.0) -> pb.Reply | None:
        self.send_raw(route, seal(KEY, request))
        return self.receive(route, lambda r: r.id == request.id, wait)

    def take_sent(self) -> list[tuple[int, pb.Reply]]:
        for route, sock in self.sockets.items():
            while sock.poll(0):
                self.inbox.append((route, pb.Reply.FromString(sock.recv()[MAC_SIZE:])))
        sent, self.inbox = self.inbox, []
        return sent

    def cached(self, sid: bytes, request_id: int) -> bool | None:
        return None  # not visible from outside: a resend may be answered either way

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)


def framed(request: pb.Request, size: int) -> bytes:
    """Give ``request`` (a set) the value that makes its sealed frame ``size`` bytes long."""
    request.set.value = b""
    empty, inner = MAC_SIZE + request.ByteSize(), request.set.ByteSize()

    def varint(n: int) -> int:
        return max(1, (n.bit_length() + 6) // 7)

    def length(n: int) -> int:  # the value's tag, length and bytes, and the longer length of `set`
        grown = 1 + varint(n) + n
        return empty + grown + varint(inner + grown) - varint(inner)

    request.set.value = big(next(n for n in range(size - empty - 16, size) if length(n) == size))
    frame = seal(KEY, request)
    assert len(frame) == size, len(frame)
    return frame


# ---------------------------------------------------------------------- the machine
class CoordinatorMachine(RuleBasedStateMachine):
    """Every reply checked against the model; the coordinator's accounting checked after each step."""

    sessions = Bundle("sessions")
    sent = Bundle("sent")

    def __init__(self, driver=None, job_prefix: str = "") -> None:
        super().__init__()
        self.driver = driver or InProcess()
        self.prefix = job_prefix
        self.now = 1000.0
        self.jobs: dict[str, JobModel] = {}
        self.live: dict[bytes, SessionModel] = {}
        self.routes = 0
        self.expected: dict[tuple[int, int], tuple[pb.Reply, SessionModel, bool]] = {}
        self.watched: list[SessionModel] = []  # the sessions the rules opened

    # ------------------------------------------------------------------ plumbing
    def new_route(self) -> int:
        self.routes += 1
        return self.routes

    def send(self, s: SessionModel, request: pb.Request, route: int | None = None) -> pb.Reply | None:
        """Send ``request`` on ``s``, check the reply and everything sent meanwhile against the model."""
        route = s.route if route is None else route
        request.session = s.sid
        op = request.WhichOneof("op")
        cached = self.driver.cached(s.sid, request.id) if s.alive else False
        either = None
        try:
            expected, cacheable = self.model(s, request, route, cached)
        except Bad as err:
            expected, cacheable = reply(request.id, pb.BAD_MESSAGE, str(err)), False
        if isinstance(expected, tuple):  # the coordinator may or may not hold it still
            either, expected = expected
        if self.driver.wire and expected is None:  # parked: over the wire, wait for its timeout
            del s.parked[request.id]  # nothing else runs meanwhile: it times out
            actual = self.driver.call(route, request, wait=10.0)
            check_reply(actual, reply(request.id, pb.TIMEOUT), op)
            self.check_sent()
            return actual
        actual = self.driver.call(route, request)
        if either is not None and actual is not None and actual.status == pb.BAD_MESSAGE:
            assert STALE in actual.error, actual
            s.replies.pop(request.id, None)  # evicted: it will not come back
        else:
            check_reply(actual, expected, f"{op} id {request.id}")
        if either is not None and actual is not None and actual.status != pb.BAD_MESSAGE:
            assert actual == either, f"a resend of {op} id {request.id} got {actual}, first answered {either}"
        if cacheable and s.alive and actual is not None:
            s.replies[request.id] = actual
        self.check_sent()
        return actual

    def check_sent(self) -> None:
        got = {(route, r.id): r for route, r in self.driver.take_sent()}
        expected, self.expected = self.expected, {}
        assert set(got) == set(expected), (
            f"replies sent later: got {sorted(got)}, expected {sorted(expected)}: {list(got.values())[:3]}"
        )
        for k, (want, s, cacheable) in expected.items():
            check_reply(got[k], want, f"later reply {k}")
            if cacheable and s.alive:
                s.replies[want.id] = got[k]

    def later(self, parked: ParkedModel, answer: pb.Reply, send: bool = True) -> None:
        """``parked`` is answered now (sent to its latest route, unless ``send`` is False)."""
        s = parked.session
        del s.parked[parked.request_id]
        if parked.kind == "collect":
            state = s.job.collectives.get(parked.name)
            if state is not None and state.waiting.get(s.rank) is parked:
                del state.waiting[s.rank]
        if send:
            self.expected[(parked.route, parked.request_id)] = (answer, s, parked.kind == "collect")

    def job_of(self, name: str) -> str:
        return self.prefix + name

    # ------------------------------------------------------------------ model of dispatch
    def model(self, s: SessionModel, r: pb.Request, route: int, cached: bool | None):
        """(expected reply or None if parked, whether the coordinator caches it); raises Bad."""
        op = r.WhichOneof("op")
        if not s.alive:
            return reply(r.id, pb.CLOSED, "unknown session"), False
        if r.id in s.replies and cached is not False:
            first = s.replies[r.id]
            return ((first, first) if cached is None else first), False
        assert not cached, f"the coordinator holds a reply for id {r.id}, which the model never saw cached"
        if r.id in s.parked:
            s.parked[r.id].route = route
            return None, False
        fresh = r.id > s.high - WINDOW and r.id not in s.used
        if not fresh and op not in READ_ONLY:
            return reply(r.id, pb.BAD_MESSAGE, STALE), False
        if fresh:
            s.used.add(r.id)
            s.high = max(s.high, r.id)
            s.last_seen = self.now
        if s.observer:
            if op not in READ_ONLY and op not in ("heartbeat", "leave"):
                return reply(r.id, pb.FAILED, "reads only"), True
            current = self.jobs.get(s.job.name)
            if current is not None and current is not s.job:  # the job's next run: followed
                s.job.sessions.pop(s.sid, None)
                s.job = current
                current.sessions[s.sid] = s
        answer = getattr(self, "m_" + op)(s, r, route)
        cacheable = op not in READ_ONLY and op != "heartbeat" and s.alive
        return answer, cacheable

    def over_budget(self, job: JobModel, key: str, size: int, new_keys: int = 1) -> str | None:
        """What the refusal says, if writing ``size`` bytes at ``key`` passes a limit of ``job``."""
        if (not key or key not in job.kv) and len(job.kv) + new_keys > LIMITS.max_job_keys:
            return f"holds {LIMITS.max_job_keys} keys, the most a job may hold"
        if job.nbytes + len(key) + size > LIMITS.max_job_bytes:
            return f"would hold more than {LIMITS.max_job_bytes} bytes of keys and values"
        return None

    def written(self, job: JobModel) -> None:
        """Release the parked reads of ``job`` whose keys all exist now."""
        for s in list(job.sessions.values()):
            for p in list(s.parked.values()):
                if p.kind == "collect" or any(k not in job.kv for k in p.keys):
                    continue
                if p.kind == "get":
                    self.later(p, reply(p.request_id, value=job.kv[p.keys[0]]))
                else:
                    self.later(p, reply(p.request_id, values=[job.kv[k] for k in p.keys]))

    def lost_reply(self, request_id: int, job: JobModel, status: int = pb.PEER_LOST) -> pb.Reply:
        answer = reply(request_id, status)
        answer.lost.rank = job.lost[0]
        return answer

    @staticmethod
    def left_reply(request_id: int, rank: int) -> pb.Reply:
        answer = reply(request_id, pb.PEER_LEFT)
        answer.lost.rank = rank
        return answer

    def park(self, s: SessionModel, r: pb.Request, route: int, kind: str, keys: list[str], timeout: float) -> None:
        if not 0 < timeout <= WEEK:
            raise Bad("out of range")
        s.parked[r.id] = ParkedModel(s, r.id, kind, keys, self.now + timeout, route)

    def full(self, r: pb.Request, what: str) -> pb.Reply:
        return reply(r.id, pb.FAILED, what)

    # ------------------------------------------------------------------ model of each operation
    def m_set(self, s, r, route):
        if full := self.over_budget(s.job, r.set.key, len(r.set.value)):
            return self.full(r, full)
        s.job.store(r.set.key, r.set.value)
        self.written(s.job)
        return reply(r.id)

    def m_get(self, s, r, route):
        job, key = s.job, r.get.key
        if key in job.kv:
            return reply(r.id, value=job.kv[key])
        if job.lost:
            return self.lost_reply(r.id, job)
        if len(s.parked) >= MAX_PARKED:
            return self.full(r, "waiting already")
        self.park(s, r, route, "get", [key], r.get.timeout)
        return None

    def m_add(self, s, r, route):
        job, key = s.job, r.add.key
        if full := self.over_budget(job, key, 20):
            return self.full(r, full)
        try:
            total = int(job.kv.get(key, b"0")) + r.add.amount
        except ValueError:
            raise Bad("not a decimal integer") from None
        if not INT64_MIN <= total <= INT64_MAX:
            raise Bad("out of the int64 range")
        job.store(key, str(total).encode())
        self.written(job)
        return reply(r.id, number=total)

    def m_compare_set(self, s, r, route):
        job, cs = s.job, r.compare_set
        if full := self.over_budget(job, cs.key, len(cs.desired)):
            return self.full(r, full)
        current = job.kv.get(cs.key)
        if current is None and cs.expected:
            return reply(r.id, value=cs.expected)
        if current is not None and current != cs.expected:
            return reply(r.id, value=current)
        job.store(cs.key, cs.desired)
        self.written(job)
        return reply(r.id, value=cs.desired)

    def m_delete(self, s, r, route):
        return reply(r.id, flag=s.job.delete(r.delete.key))

    def m_check(self, s, r, route):
        return reply(r.id, flag=all(k in s.job.kv for k in r.check.keys))

    def m_num_keys(self, s, r, route):
        return reply(r.id, number=len(s.job.kv))

    def m_multi_get(self, s, r, route):
        job, keys = s.job, list(r.multi_get.keys)
        if not keys:
            return reply(r.id)
        if all(k in job.kv for k in keys):
            return reply(r.id, values=[job.kv[k] for k in keys])
        if job.lost:
            return self.lost_reply(r.id, job)
        if len(s.parked) >= MAX_PARKED:
            return self.full(r, "waiting already")
        self.park(s, r, route, "multi_get", keys, r.multi_get.timeout)
        return None

    def m_multi_set(self, s, r, route):
        items = [(kv.key, kv.value) for kv in r.multi_set.items]
        size = sum(len(k) + len(v) for k, v in items)
        if full := self.over_budget(s.job, "", size, new_keys=len({k for k, _ in items})):
            return self.full(r, full)
        for k, v in items:
            s.job.store(k, v)
        self.written(s.job)
        return reply(r.id)

    def m_append(self, s, r, route):
        job, key = s.job, r.append.key
        if full := self.over_budget(job, key, len(r.append.value)):
            return self.full(r, full)
        job.store(key, job.kv.get(key, b"") + r.append.value)
        self.written(job)
        return reply(r.id)

    def m_register(self, s, r, route):
        rank, job = r.register.rank, s.job
        if rank >= job.world_size:
            raise Bad("out of range")
        holder = job.ranks.get(rank)
        if holder is not None and holder is not s:
            return self.full(r, "already registered")
        s.rank = rank
        job.ranks[rank] = s
        job.left.discard(rank)
        return reply(r.id)

    def m_join(self, s, r, route):
        j, job = r.join, s.job
        if s.rank is not None:
            raise Bad("holds rank")
        if not j.claimant:
            raise Bad("needs a claimant")
        if not j.assign and j.rank >= job.world_size:
            raise Bad("out of range")
        if job.lost:
            return reply(r.id, flag=False, refusal=pb.RUN_OVER)

        def claim(rank: int) -> pb.Reply | None:
            holder = job.ranks.get(rank)
            if holder is not None:
                return reply(r.id, flag=False, refusal=pb.HELD, value=b"pid 1 on ")  # every hello here: pid 1, no host
            owner = job.kv.get(claim_key(rank))
            if rank in job.left:
                return reply(r.id, flag=False, refusal=pb.LEFT, value=owner or b"")
            if owner:
                return reply(r.id, flag=False, refusal=pb.HELD, value=owner)
            new = (owner is None) + (peer_key(rank) not in job.kv)
            size = len(claim_key(rank)) + len(j.claimant) + len(peer_key(rank)) + len(j.peer)
            if full := self.over_budget(job, "", size, new_keys=new):
                return self.full(r, full)
            job.store(claim_key(rank), j.claimant)
            return None

        if not j.assign:
            rank = j.rank
            if (refused := claim(rank)) is not None:
                return refused
        else:
            while True:
                if full := self.over_budget(job, NEXT_RANK, 20):
                    self.written(job)
                    return self.full(r, full)
                rank = int(job.kv.get(NEXT_RANK, b"0"))
                job.store(NEXT_RANK, str(rank + 1).encode())
                if rank >= job.world_size:
                    self.written(job)
                    return reply(r.id, flag=False, refusal=pb.HELD)
                refused = claim(rank)
                if refused is None:
                    break
                if refused.status != pb.OK:
                    self.written(job)
                    return refused
        s.rank = rank
        job.ranks[rank] = s
        job.left.discard(rank)
        job.store(peer_key(rank), j.peer)
        self.written(job)
        return reply(r.id, flag=True, number=rank)

    def m_heartbeat(self, s, r, route):
        applied, refused = 0, ""
        for item in r.heartbeat.set:  # the writes it carries, each a set, up to the first refused
            refused = "reads only" if s.observer else self.over_budget(s.job, item.key, len(item.value)) or ""
            if refused:
                break
            s.job.store(item.key, item.value)
            applied += 1
        if applied:
            self.written(s.job)
        if s.job.lost:
            answer = self.lost_reply(r.id, s.job, pb.OK)
            answer.error, answer.number, answer.flag = refused, applied, True
            return answer
        return reply(r.id, pb.FAILED if refused else pb.OK, refused, number=applied, flag=True)

    def m_leave(self, s, r, route):
        for p in list(s.parked.values()):
            self.later(p, reply(p.request_id, pb.CLOSED), send=False)
        job = s.job
        if s.rank is not None and job.ranks.get(s.rank) is s:
            del job.ranks[s.rank]
            job.left.add(s.rank)
            # The collectives it never entered are over: their waiting ranks are told it left.
            for name, state in list(job.collectives.items()):
                if not state.complete and s.rank in state.sources and s.rank not in state.arrived:
                    del job.collectives[name]
                    for p in list(state.waiting.values()):
                        self.later(p, self.left_reply(p.request_id, s.rank))
        self.drop(s)
        return reply(r.id)

    def m_collect(self, s, r, route):
        c, job = r.collect, s.job
        if s.rank is None:
            return self.full(r, "registered rank")
        sources = frozenset(c.sources) or frozenset(range(job.world_size))
        if max(sources) >= job.world_size:
            raise Bad("out of range")
        state = job.collectives.get(c.name)
        if (state is None and len(job.collectives) >= MAX_PARKED) or len(s.parked) >= MAX_PARKED:
            return self.full(r, "too many collectives")
        if c.want and not 0 < c.timeout <= WEEK:
            raise Bad("out of range")
        if state is None:
            state = job.collectives[c.name] = CollectiveModel(sources)
        elif state.sources != sources:
            raise Bad("disagree on its sources")
        if s.rank in state.arrived:
            raise Bad("twice")
        if job.lost and not state.complete and c.want:
            return self.lost_reply(r.id, job)
        if c.want and not state.complete and (sources - state.arrived - {s.rank}) & job.left:
            if not state.arrived:
                del job.collectives[c.name]
            return self.left_reply(r.id, min((sources - state.arrived - {s.rank}) & job.left))
        rank = s.rank
        state.arrived.add(rank)
        if c.has_value:
            state.values[rank] = c.value
        answer = reply(r.id)
        if c.want and not state.complete:
            parked = ParkedModel(s, r.id, "collect", [], self.now + c.timeout, route, c.name)
            s.parked[r.id] = state.waiting[rank] = parked
            answer = None
        elif c.want:
            answer = self.collected(r.id, state, job)
        if not state.complete and sources <= state.arrived:
            state.complete = True
            for p in list(state.waiting.values()):
                self.later(p, self.collected(p.request_id, state, job))
        if state.complete and len(state.arrived) == job.world_size:
            del job.collectives[c.name]
        return answer

    @staticmethod
    def collected(request_id: int, state: CollectiveModel, job: JobModel) -> pb.Reply:
        values = [state.values.get(rank, b"") for rank in range(job.world_size)] if state.values else []
        return reply(request_id, values=values)

    def drop(self, s: SessionModel) -> None:
        s.alive = False
        self.live.pop(s.sid, None)
        s.job.sessions.pop(s.sid, None)
        if self.jobs.get(s.job.name) is s.job and all(o.observer for o in s.job.sessions.values()):
            del self.jobs[s.job.name]

    def sweep(self) -> None:
        """The model of :meth:`Coordinator.sweep` at ``self.now``."""
        for s in list(self.live.values()):
            for p in [p for p in s.parked.values() if p.deadline <= self.now]:
                if p.kind != "collect":
                    self.later(p, reply(p.request_id, pb.TIMEOUT))
                    continue
                job = s.job
                state = job.collectives[p.name]
                timeout = reply(p.request_id, pb.TIMEOUT, LOOSE_ARRIVED, arrived=sorted(state.arrived))
                state.arrived.discard(s.rank)
                state.values.pop(s.rank, None)
                self.later(p, timeout)
                if not state.arrived:
                    del job.collectives[p.name]
        for job in list(self.jobs.values()):
            for rank, s in list(job.ranks.items()):
                if rank not in job.lost and self.now - s.last_seen > job.liveness:
                    job.lost.append(rank)
                    del job.ranks[rank]
                    self.drop(s)
                    for other in [*job.sessions.values(), s]:
                        for p in list(other.parked.values()):
                            self.later(p, self.lost_reply(p.request_id, job))
            idle = max(LIMITS.idle_session_timeout, 3 * job.liveness)
            for s in list(job.sessions.values()):
                # A session with requests waiting is not idle: it is dropped once they are answered.
                if s.rank is None and self.now - s.last_seen > idle and not s.parked:
                    self.drop(s)

    # ------------------------------------------------------------------ rules: sessions
    @rule(
        target=sessions,
        job=st.sampled_from(JOBS),
        world_size=st.sampled_from(WORLD_SIZES),
        liveness=st.sampled_from([0.5, 5.0, 30.0, 5.0, 0.0]),
        protocol=st.sampled_from([PROTOCOL_VERSION] * 5 + [PROTOCOL_VERSION - 1]),
        rank=st.sampled_from([None, None, 0, 1]),
    )
    def hello(self, job, world_size, liveness, protocol, rank=None):
        """A new session; with ``rank``, it joins as that rank at once, as a rank does."""
        name = self.job_of(job)
        if self.driver.wire and liveness:
            liveness = 1000.0  # real time: nobody is lost or idle during the run
        hello = pb.Hello(protocol=protocol, job=name, world_size=world_size, liveness_timeout=liveness, pid=1)
        request = pb.Request(id=7, hello=hello)
        state = self.jobs.get(name)
        route = self.new_route()
        actual = self.driver.call(route, request)
        if (
            protocol != PROTOCOL_VERSION
            or not 0 <= world_size <= MAX_WORLD_SIZE
            or not 0 < liveness < 1e6
            or (state is not None and world_size and state.world_size != world_size)
        ):
            check_reply(actual, reply(7, pb.BAD_MESSAGE), "hello")
            return multiple()
        if world_size == 0 and state is None:  # an observer's: it reads a job, creates none
            check_reply(actual, reply(7, pb.FAILED, "has no run here"), "hello")
            return multiple()
        if len(self.live) >= LIMITS.max_sessions:
            check_reply(actual, reply(7, pb.FAILED, "coordinator full"), "hello")
            return multiple()
        check_reply(actual, reply(7, session=b"x"), "hello")
        if state is None:
            state = self.jobs[name] = JobModel(name, world_size, liveness)
        s = SessionModel(actual.session, state, route, self.now, observer=world_size == 0)
        state.sessions[s.sid] = self.live[s.sid] = s
        self.watched.append(s)
        self.check_sent()
        if rank is not None:
            join = pb.Join(rank=rank, claimant=b"host:%d:%d" % (rank, len(self.live)), peer=b"{}")
            self.send(s, pb.Request(id=s.pick_id("next", 1), join=join))
        return s

    @rule(s=sessions, how=ids, items=st.lists(st.tuples(keys, values()), max_size=2))
    def heartbeat(self, s, how, items):
        carried = [pb.KeyValue(key=k, value=self.fit(v)) for k, v in items]
        self.send(s, pb.Request(id=self.pick_id(s, how), heartbeat=pb.Heartbeat(set=carried)))

    @rule(s=sessions, how=ids)
    def leave(self, s, how):
        self.send(s, pb.Request(id=self.pick_id(s, how), leave=pb.Empty()))

    @rule(data=st.binary(min_size=0, max_size=20), op=st.sampled_from(["num_keys", "heartbeat", "leave"]))
    def unknown_session(self, data, op):
        request = pb.Request(id=1, session=data, **{op: pb.Heartbeat() if op == "heartbeat" else pb.Empty()})
        if data in self.live:
            return
        check_reply(self.driver.call(self.new_route(), request), reply(1, pb.CLOSED, "unknown session"), op)

    # ------------------------------------------------------------------ rules: keys and values
    @rule(target=sent, s=sessions, how=ids, key=keys, value=values())
    def set(self, s, how, key, value):
        return self._op(s, how, set=pb.KeyValue(key=key, value=self.fit(value)))

    @rule(target=sent, s=sessions, how=ids, key=keys, timeout=st.sampled_from(TIMEOUTS))
    def get(self, s, how, key, timeout):
        return self._op(s, how, get=pb.Get(key=key, timeout=self.short(timeout)))

    @rule(target=sent, s=sessions, how=ids, key=keys, amount=amounts, times=st.integers(1, 3))
    def add(self, s, how, key, amount, times):
        """The same amount added ``times`` times, each a new request (a counter many ranks bump)."""
        for _ in range(times - 1):
            self._op(s, how, add=pb.Add(key=key, amount=amount))
            how = ("next", 1)
        return self._op(s, how, add=pb.Add(key=key, amount=amount))

    @rule(target=sent, s=sessions, how=ids, key=keys, expected=values(), desired=values())
    def compare_set(self, s, how, key, expected, desired):
        return self._op(
            s, how, compare_set=pb.CompareSet(key=key, expected=self.fit(expected), desired=self.fit(desired))
        )

    @rule(target=sent, s=sessions, how=ids, key=keys)
    def delete(self, s, how, key):
        return self._op(s, how, delete=pb.Key(key=key))

    @rule(target=sent, s=sessions, how=ids, names=key_lists)
    def check(self, s, how, names):
        return self._op(s, how, check=pb.Keys(keys=names))

    @rule(target=sent, s=sessions, how=ids)
    def num_keys(self, s, how):
        return self._op(s, how, num_keys=pb.Empty())

    @rule(target=sent, s=sessions, how=ids, names=key_lists, timeout=st.sampled_from(TIMEOUTS))
    def multi_get(self, s, how, names, timeout):
        return self._op(s, how, multi_get=pb.MultiGet(keys=names, timeout=self.short(timeout)))

    @rule(target=sent, s=sessions, how=ids, items=st.lists(st.tuples(keys, values()), max_size=3))
    def multi_set(self, s, how, items):
        return self._op(
            s, how, multi_set=pb.MultiSet(items=[pb.KeyValue(key=k, value=self.fit(v, 1 << 20)) for k, v in items])
        )

    @rule(target=sent, s=sessions, how=ids, key=keys, value=values())
    def append(self, s, how, key, value):
        return self._op(s, how, append=pb.KeyValue(key=key, value=self.fit(value)))

    def pick_id(self, s: SessionModel, how: tuple[str, int]) -> int:
        # Over the wire every session must be able to leave at the end, freeing its job on the
        # shared server: none takes the last id.
        return s.pick_id("next" if self.driver.wire and how[0] == "max" else how[0], how[1])

    def fit(self, value: bytes, most: int = 32 << 20) -> bytes:
        """Over the wire a value must fit in a frame (past it, see ``oversized_frame``)."""
        return big(most) if self.driver.wire and len(value) > most else value

    def short(self, timeout: float) -> float:
        """Over the wire a parked read waits in real time: keep valid timeouts short."""
        return 0.05 if self.driver.wire and 0 < timeout <= WEEK else timeout

    def _op(self, s: SessionModel, how, **op) -> tuple[SessionModel, pb.Request]:
        request = pb.Request(id=self.pick_id(s, how), **op)
        self.send(s, request)
        return s, request

    # ------------------------------------------------------------------ rules: resends
    @rule(earlier=sent, new_route=st.booleans())
    def resend(self, earlier, new_route):
        """The same request again (a resend after a reconnect, or a replayed frame): answered
        as the first time, or refused as stale; never applied twice."""
        s, request = earlier
        route = s.route
        if new_route:
            route = s.route = self.new_route()
        self.send(s, pb.Request.FromString(request.SerializeToString()), route)

    # ------------------------------------------------------------------ rules: membership, time
    @rule(target=sent, s=sessions, how=ids, rank=st.integers(0, 3))
    def register(self, s, how, rank):
        return self._op(s, how, register=pb.Register(rank=rank))

    @rule(
        target=sent,
        s=sessions,
        how=ids,
        assign=st.booleans(),
        rank=st.integers(0, 3),
        claimant=st.sampled_from([b"", b"host:1:a", b"host:2:b"]),
        peer=st.sampled_from([b"", b'{"pid": 1}']),
    )
    def join(self, s, how, assign, rank, claimant, peer):
        return self._op(s, how, join=pb.Join(assign=assign, rank=rank, claimant=claimant, peer=peer))

    @precondition(lambda self: not self.driver.wire)
    @rule(
        target=sent,
        s=sessions,
        how=ids,
        name=st.sampled_from(["c0", "c1"]),
        sources=st.sampled_from([[], [], [0], [0, 1], [5]]),
        want=st.booleans(),
        value=st.none() | values(),
        timeout=st.sampled_from(TIMEOUTS),
    )
    def collect(self, s, how, name, sources, want, value, timeout):
        if s.job.world_size > 8:
            return multiple()  # a reply holds one value per rank
        op = pb.Collect(
            name=name, sources=sources, want=want, has_value=value is not None, value=value or b"", timeout=timeout
        )
        return self._op(s, how, collect=op)

    @precondition(lambda self: not self.driver.wire)
    @rule(seconds=st.sampled_from([0.01, 0.6, 61.0, 1.5, 6.0, 31.0, 100.0]))
    def advance(self, seconds):
        self.now += seconds
        self.sweep()
        self.driver.advance(seconds)
        self.check_sent()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def state_matches_the_model(self):
        if self.driver.wire:
            return
        coordinator = self.driver.coordinator
        assert len(coordinator._sessions) == len(self.live), "open sessions differ from the model"
        assert all(coordinator._sessions.get(s.sid) is not None for s in self.watched if s.alive)
        if len(self.live) < 10_000:
            assert set(coordinator._sessions) == set(self.live), "open sessions differ from the model"
        assert set(coordinator._jobs) == set(self.jobs), "jobs differ from the model"
        for name, job in self.jobs.items():
            space = coordinator._jobs[name].space
            if len(job.kv) < 10_000:
                assert space._data == job.kv, f"job {name!r}: keys and values differ from the model"
            else:  # filled in bulk: the keys the rules wrote, and how many there are
                assert len(space._data) == len(job.kv)
                assert {k: space._data.get(k) for k in job.touched} == {k: job.kv.get(k) for k in job.touched}
            assert space.nbytes() == job.nbytes
            assert sorted(coordinator._jobs[name].ranks) == sorted(job.ranks)
            assert set(coordinator._jobs[name].collectives) == set(job.collectives)
        for s in self.watched:
            if s.alive:
                assert set(coordinator._sessions[s.sid].parked) == set(s.parked)

    @invariant()
    def memory_is_bounded_by_the_coordinators_accounting(self):
        if self.driver.wire:
            return
        c = self.driver.coordinator
        live = c._sessions
        # Sessions that hold anything (with tens of thousands open, the idle ones are skipped).
        busy = {sid for sid, _ in c._cached} | {p.session.id for p in c._parked} | {s.sid for s in self.watched}
        sessions = list(live.values()) if len(live) < 10_000 else [live[i] for i in busy if i in live]
        # Every cached reply belongs to an open session, and the byte counts add up.
        held = {(s.id, request_id) for s in sessions for request_id in s.replies}
        leaked = set(c._cached) - held
        assert not leaked, f"{len(leaked)} cached replies of sessions no longer open: {sorted(leaked)[:3]}"
        assert set(c._cached) == held
        assert c._cached_bytes == sum(c._cached.values())
        assert c._cached_bytes <= LIMITS.reply_cache_bytes or len(c._cached) <= 1, (
            f"reply cache holds {c._cached_bytes} bytes in {len(c._cached)} replies"
        )
        for s in sessions:
            assert s.reply_bytes == sum(c._cached[(s.id, i)] for i in s.replies)
            # Past reply_cache_entries only replies of the last two liveness timeouts (evicted
            # as the next one comes), and never past reply_cache_recent_entries.
            assert len(s.replies) <= LIMITS.reply_cache_recent_entries or len(s.replies) == 1
            assert s.reply_at.keys() == s.replies.keys()
            assert s.reply_bytes <= LIMITS.reply_cache_session_bytes or len(s.replies) == 1
            assert len(s.seen) <= 2 * WINDOW + 1
            assert len(s.parked) <= MAX_PARKED
        # Parked requests are those of open sessions, each waiting once.
        orphans = [p for p in c._parked if live.get(p.session.id) is not p.session]
        assert not orphans, f"{len(orphans)} parked requests of sessions no longer open (ids {orphans[0].request_id})"
        assert c._parked == {p for s in sessions for p in s.parked.values()}
        assert len(live) <= LIMITS.max_sessions
        for job in c._jobs.values():
            assert job.sessions, f"job {job.name!r} is held with no session"
            assert job.space.num_keys() <= LIMITS.max_job_keys
            assert job.space.nbytes() <= LIMITS.max_job_bytes
            assert len(job.collectives) <= MAX_PARKED
            reads = sum(1 for p in c._parked if p.session.job is job and not p.remember)
            assert job.space.parked_count() == reads, "a key holds waiters of requests no longer parked"

    def teardown(self):
        self.driver.close()


# ---------------------------------------------------------------------- bulk steps at the limits
class AtTheLimits(CoordinatorMachine):
    """Starts each run at the limits: a job a few keys short of its key limit, the coordinator a
    session or two short of its session limit, a session a request short of its parked limit
    (each in one request or one loop); the rules then push past them."""

    @initialize(
        target=CoordinatorMachine.sessions,
        spare_keys=st.sampled_from([0, 1, 2]),
        spare_sessions=st.sampled_from([0, 1, 2]),
        spare_parked=st.sampled_from([0, 1]),
    )
    def at_the_limits(self, spare_keys, spare_sessions, spare_parked):
        s = self.hello(job="j0", world_size=2, liveness=30.0, protocol=PROTOCOL_VERSION)
        # Keys straight into the job's space (a million through one request takes seconds); the
        # rules then go past the limit with real requests.
        fill = {f"f{i}": b"" for i in range(LIMITS.max_job_keys - spare_keys)}
        space = self.driver.coordinator._jobs[s.job.name].space
        space._data.update(fill)
        space._bytes += sum(map(len, fill))
        s.job.kv.update(fill)
        s.job.nbytes = space.nbytes()
        handle = self.driver.coordinator.handle
        for i in range(MAX_PARKED - spare_parked):
            request = pb.Request(id=1 + i, session=s.sid, get=pb.Get(key="never", timeout=WEEK))
            assert self.model(s, request, s.route, False) == (None, False)
            assert handle(s.route, request) is None
        name = self.job_of("filler")
        hello = pb.Request(id=1, hello=pb.Hello(protocol=PROTOCOL_VERSION, job=name, world_size=4, liveness_timeout=1))
        job = self.jobs[name] = JobModel(name, 4, 1.0)
        for _ in range(LIMITS.max_sessions - len(self.live) - spare_sessions):
            answer = handle(0, hello)
            assert answer.status == pb.OK, answer
            filler = SessionModel(answer.session, job, 0, self.now)
            job.sessions[filler.sid] = self.live[filler.sid] = filler
        for _ in range(spare_sessions + 1):  # the last one finds the coordinator full
            self.hello(job="j1", world_size=1, liveness=30.0, protocol=PROTOCOL_VERSION)
        assert len(self.live) == LIMITS.max_sessions
        return s


# ---------------------------------------------------------------------- sequences found
def _leave(m: CoordinatorMachine) -> None:
    s = m.hello(job="j0", liveness=0.5, protocol=PROTOCOL_VERSION, world_size=1)
    m.leave(s=s, how=("next", 1))


def _lost_while_collecting(m: CoordinatorMachine) -> None:
    s = m.hello(job="j0", liveness=0.5, protocol=PROTOCOL_VERSION, world_size=2, rank=0)
    m.collect(s=s, how=("next", 1), name="c0", sources=[], want=True, value=None, timeout=WEEK)
    m.advance(seconds=1.5)


def _idle_while_parked(m: CoordinatorMachine) -> None:
    s = m.hello(job="j0", liveness=0.5, protocol=PROTOCOL_VERSION, world_size=1)
    m.multi_get(s=s, how=("next", 1), names=["a"], timeout=WEEK)
    m.advance(seconds=61.0)


def _collect_with_a_bad_timeout(m: CoordinatorMachine) -> None:
    s = m.hello(job="j0", liveness=0.5, protocol=PROTOCOL_VERSION, world_size=1, rank=0)
    m.collect(s=s, how=("next", 1), name="c0", sources=[], want=True, value=None, timeout=0.0)


def _add_past_int64(m: CoordinatorMachine) -> None:
    s = m.hello(job="j0", liveness=0.5, protocol=PROTOCOL_VERSION, world_size=1)
    m.add(s=s, how=("next", 1), key="a", amount=INT64_MAX, times=2)


def _multi_set_twice_to_a_waited_key(m: CoordinatorMachine) -> None:
    s = m.hello(job="j0", liveness=0.5, protocol=PROTOCOL_VERSION, world_size=1)
    m.get(s=s, how=("next", 1), key="", timeout=0.05)
    m.multi_set(s=s, how=("next", 1), items=[("", b""), ("", b"0")])


FOUND = {
    "a left session's reply stays cached": _leave,
    "a lost rank's parked collect is cached after its session closed": _lost_while_collecting,
    "an idle session is dropped with its requests still parked": _idle_while_parked,
    "a collect with a bad timeout is refused but half applied": _collect_with_a_bad_timeout,
    "an add past int64 is stored, then answered FAILED": _add_past_int64,
    "a multi_set writing a waited key twice released its get with the first value": _multi_set_twice_to_a_waited_key,
}


@pytest.mark.parametrize("name", list(FOUND))
def test_sequences_the_machine_found(name):
    """The shortest failing runs the machine found (each failed before its fix), kept whatever
    the search draws later."""
    machine = CoordinatorMachine()
    FOUND[name](machine)
    machine.state_matches_the_model()
    machine.memory_is_bounded_by_the_coordinators_accounting()
    machine.teardown()


# ---------------------------------------------------------------------- runs
def fuzz_settings(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
        report_multiple_bugs=False,
    )


@pytest.mark.timeout(300)
def test_coordinator_state_machine_in_process():
    run_state_machine_as_test(CoordinatorMachine, settings=fuzz_settings(120, 40))


@pytest.mark.timeout(300)
def test_coordinator_state_machine_at_its_limits():
    run_state_machine_as_test(AtTheLimits, settings=fuzz_settings(3, 25))


class OverTheWire(CoordinatorMachine):
    """The same machine through a `dataparallel serve` process, with frames at and past
    the frame limit; its RSS stays bounded."""

    server: subprocess.Popen
    port: int
    examples = 0
    headroom = math.inf

    def __init__(self) -> None:
        OverTheWire.examples += 1
        super().__init__(OverZmq(self.port), job_prefix=f"x{OverTheWire.examples}-")

    @rule(s=CoordinatorMachine.sessions, past=st.sampled_from([1, MAC_SIZE + 1]))
    def oversized_frame(self, s, past):
        """A frame just past the limit is refused (BAD_MESSAGE); one past what the socket
        takes drops the connection. Neither is applied; the session carries on."""
        request = pb.Request(id=s.pick_id("next", 1), session=s.sid, set=pb.KeyValue(key="huge"))
        frame = framed(request, MAX_FRAME + past)
        self.driver.send_raw(s.route, frame)
        answer = self.driver.receive(s.route, lambda r: True, 3.0 if past == 1 else 0.5)
        if past == 1:
            assert answer is not None and answer.status == pb.BAD_MESSAGE and "exceeds the limit" in answer.error
        else:
            assert answer is None, answer
            s.route = self.new_route()  # the connection was dropped: carry on over a new one

    @rule(s=CoordinatorMachine.sessions)
    def fill_job_bytes(self, s):
        """Values of a whole frame each, until the job's byte budget refuses one."""
        if not s.alive or s.job.nbytes > LIMITS.max_job_bytes // 2:
            return
        for i in range(8):
            request = pb.Request(id=s.pick_id("next", 1), session=s.sid, set=pb.KeyValue(key=f"w{i}"))
            framed(request, MAX_FRAME)
            answer = self.send(s, request)
            if answer.status == pb.FAILED:
                return
        raise AssertionError("a job took more than its byte budget")

    @invariant()
    def server_is_alive_and_its_memory_bounded(self):
        assert self.server.poll() is None, "the coordinator died"
        rss = rss_mb(self.server.pid)
        # What the jobs hold (the model knows to the byte), the reply cache's bound, and the
        # copies of one frame in flight (socket buffer, received bytes, body, parsed message, value).
        held = sum(job.nbytes for job in self.jobs.values())
        bound = self.baseline + (held + LIMITS.reply_cache_bytes + 6 * MAX_FRAME) / 2**20
        assert rss < bound, f"coordinator RSS {rss:.0f} MB over its bound of {bound:.0f} MB"
        OverTheWire.headroom = min(OverTheWire.headroom, bound - rss)

    def teardown(self):
        for s in list(self.live.values()):  # free the server for the next example
            answer = self.send(s, pb.Request(id=s.pick_id("next", 1), leave=pb.Empty()))
            assert answer.status == pb.OK, answer
        super().teardown()
        # Every job ended: what they held is given back.
        rss = rss_mb(self.server.pid)
        assert rss < self.baseline + 128, (
            f"coordinator RSS {rss:.0f} MB with no job open (it began at {self.baseline:.0f})"
        )


@pytest.fixture
def served():
    port = free_port()
    with standalone(f"zmq://127.0.0.1:{port}", TOKEN) as proc:
        yield proc, port


@pytest.mark.timeout(300)
def test_coordinator_state_machine_over_zmq(served):
    OverTheWire.server, OverTheWire.port = served
    OverTheWire.baseline = rss_mb(OverTheWire.server.pid)
    run_state_machine_as_test(OverTheWire, settings=fuzz_settings(6, 25))


def test_a_resent_hello_gets_its_session_again_and_leaves_nothing_behind():
    """A hello whose reply was lost is resent with its nonce: it gets the same session, so
    when the rank leaves no orphan session keeps the job (and its keys) alive."""
    from dataparallel.control.coordinator import Coordinator

    coordinator = Coordinator(lambda route, reply: None)
    hello = pb.Hello(protocol=PROTOCOL_VERSION, job="j", world_size=1, liveness_timeout=5, nonce=b"n" * 16)
    first = coordinator.handle("a", pb.Request(id=1, hello=hello))
    again = coordinator.handle("b", pb.Request(id=1, hello=hello))  # another connection, same hello
    assert first.status == again.status == pb.OK and first.session == again.session
    other = pb.Hello(protocol=PROTOCOL_VERSION, job="j", world_size=1, liveness_timeout=5, nonce=b"m" * 16)
    second = coordinator.handle("c", pb.Request(id=1, hello=other))
    assert second.session != first.session
    for session in (first.session, second.session):
        assert coordinator.handle("a", pb.Request(id=2, session=session, leave=pb.Empty())).status == pb.OK
    assert not coordinator._jobs and not coordinator._sessions and not coordinator._by_nonce
