"""Hostile input and load against real coordinators (a standalone `dataparallel serve`
process, so that its liveness and memory can be watched): fuzzed frames and requests
(hypothesis), replays, limits on what one job may hold, hundreds of clients at once, and two
jobs with the same key names on one coordinator. The coordinator never crashes, its memory
stays bounded, and a legitimate job running alongside is not disturbed."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jobutil import Bystander, exercise, mutate, open_job, rss_mb, standalone
from pki import make_pki, tls_url

import dataparallel as dp
from dataparallel.control.coordinator import CoordinatorLimits
from dataparallel.control.registry import parse_url
from dataparallel.control.v1 import control_pb2_grpc
from dataparallel.control.wire import (
    MAC_SIZE,
    MAX_WORLD_SIZE,
    PROTOCOL_VERSION,
    open_frame,
    pb,
    purpose_key,
    seal,
    token_key,
)
from dataparallel.testing import close_all, free_port, run_all, with_options
from dataparallel.transports.zmq.server import ZmqCoordinatorServer

TOKEN = "fuzz-token"
KEY = token_key(TOKEN)
GRPC_KEY = purpose_key(TOKEN, "grpc-frame-mac")


@pytest.fixture(params=["zmq", "grpc"])
def served(request, tmp_path_factory):
    """A standalone coordinator: ``zmq``, ``grpc``, or (where asked for) ``grpc+tls``, which
    attackers reach through TLS: they trust its CA but have no token. (A CURVE coordinator
    under attack: test_hostile_more.py.)"""
    scheme = request.param.split("+")[0]
    if request.param == "grpc+tls":
        url = tls_url(free_port(), make_pki(tmp_path_factory.mktemp("pki")))
    else:
        url = f"{scheme}://127.0.0.1:{free_port()}"
    with standalone(url, TOKEN) as proc:
        yield scheme, url, proc


# ---------------------------------------------------------------------- strategies
keys = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e-9, 0.05, 1e300]))


def requests(session: bytes) -> st.SearchStrategy[pb.Request]:
    ops = st.one_of(
        st.builds(lambda k, v: {"set": pb.KeyValue(key=k, value=v)}, keys, st.binary(max_size=2048)),
        st.builds(lambda k, t: {"get": pb.Get(key=k, timeout=t)}, keys, floats),
        st.builds(lambda k, a: {"add": pb.Add(key=k, amount=a)}, keys, st.integers(-(2**63), 2**63 - 1)),
        st.builds(
            lambda k, e, d: {"compare_set": pb.CompareSet(key=k, expected=e, desired=d)},
            keys,
            st.binary(max_size=16),
            st.binary(max_size=16),
        ),
        st.builds(lambda k: {"delete": pb.Key(key=k)}, keys),
        st.builds(lambda ks: {"check": pb.Keys(keys=ks)}, st.lists(keys, max_size=5)),
        st.just({"num_keys": pb.Empty()}),
        st.builds(lambda ks, t: {"multi_get": pb.MultiGet(keys=ks, timeout=t)}, st.lists(keys, max_size=5), floats),
        st.builds(
            lambda kv: {"multi_set": pb.MultiSet(items=[pb.KeyValue(key=k, value=v) for k, v in kv])},
            st.lists(st.tuples(keys, st.binary(max_size=256)), max_size=5),
        ),
        st.builds(
            lambda items: {
                "multi_compare_set": pb.MultiCompareSet(
                    items=[pb.CompareSet(key=k, expected=e, desired=d) for k, e, d in items]
                )
            },
            st.lists(st.tuples(keys, st.binary(max_size=16), st.binary(max_size=256)), max_size=5),
        ),
        st.builds(lambda ks: {"delete_many": pb.Keys(keys=ks)}, st.lists(keys, max_size=5)),
        st.builds(lambda k, v: {"append": pb.KeyValue(key=k, value=v)}, keys, st.binary(max_size=2048)),
        st.builds(
            lambda kv: {"heartbeat": pb.Heartbeat(set=[pb.KeyValue(key=k, value=v) for k, v in kv])},
            st.lists(st.tuples(keys, st.binary(max_size=256)), max_size=3),
        ),
        st.builds(lambda r: {"register": pb.Register(rank=r)}, st.integers(0, 2**32 - 1)),
        st.builds(
            lambda n, src, want, v, t: {
                "collect": pb.Collect(
                    name=n, sources=src, want=want, has_value=v is not None, value=v or b"", timeout=t
                )
            },
            keys,
            st.lists(st.integers(0, 2**32 - 1), max_size=4),
            st.booleans(),
            st.one_of(st.none(), st.binary(max_size=64)),
            floats,
        ),
        st.builds(
            lambda p, j, w, lt: {"hello": pb.Hello(protocol=p, job=j, world_size=w, liveness_timeout=lt)},
            st.integers(0, 3),
            keys,
            st.integers(0, 2**32 - 1),
            floats,
        ),
    )
    sessions = st.sampled_from([session, b"", b"forged-session!!"]) | st.binary(max_size=32)
    return st.builds(lambda i, s, op: pb.Request(id=i, session=s, **op), st.integers(0, 2**64 - 1), sessions, ops)


# ---------------------------------------------------------------------- transports
class ZmqAttacker:
    def __init__(self, url: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("tcp://" + url.split("://", 1)[1])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)
        self.drain()

    def send(self, request: pb.Request) -> None:
        self.send_frames([seal(KEY, request)])

    def call(self, request: pb.Request) -> pb.Reply:
        self.drain()
        self.sock.send(seal(KEY, request))
        while self.sock.poll(5000):
            reply = pb.Reply.FromString(self.sock.recv()[MAC_SIZE:])
            if reply.id == request.id:
                return reply
        raise AssertionError("no reply")

    def drain(self) -> None:
        while self.sock.poll(0):
            self.sock.recv()

    def close(self) -> None:
        self.sock.close()


class GrpcAttacker:
    """Sends frames (as a ``Frame``'s ``sealed`` field) on a ``Stream`` of its own, as a client
    does; a thread reads the replies. A stream the coordinator ends is opened again."""

    def __init__(self, url: str) -> None:
        parsed = parse_url(url)
        target = f"{parsed.host}:{parsed.port}"
        if parsed.flag("tls"):  # an attacker who trusts the server's CA but has no token
            self.channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(root_certificates=parsed.file("ca"))
            )
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = control_pb2_grpc.ControlServiceStub(self.channel)
        self.replies: queue.SimpleQueue = queue.SimpleQueue()
        self._open()

    def _open(self) -> None:
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        call = self.stub.Stream(iter(self.outbox.get, None))
        threading.Thread(target=self._read, args=(call,), daemon=True).start()

    def _read(self, call) -> None:
        try:
            for frame in call:
                self.replies.put(frame.sealed)
        except grpc.RpcError as err:
            self.replies.put(err)

    def _next(self, timeout: float) -> bytes | None:
        try:
            got = self.replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(got, grpc.RpcError):
            assert got.code() != grpc.StatusCode.UNAVAILABLE, "the coordinator went away"
            self._open()  # refused or malformed: fine, on a stream of its own
            return None
        return got

    def send_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.outbox.put(pb.Frame(sealed=frame))
        self.drain()

    def send(self, request: pb.Request) -> None:
        self.send_frames([seal(GRPC_KEY, request)])

    def call(self, request: pb.Request) -> pb.Reply:
        self.drain()
        self.outbox.put(pb.Frame(sealed=seal(GRPC_KEY, request)))
        deadline = time.monotonic() + 5
        while (left := deadline - time.monotonic()) > 0:
            got = self._next(left)
            if got is not None and (reply := open_frame(GRPC_KEY, got, pb.Reply)).id == request.id:
                return reply
        raise AssertionError("no reply")

    def drain(self) -> None:
        while not self.replies.empty():
            self._next(0)

    def close(self) -> None:
        self.outbox.put(None)
        self.channel.close()


def attacker_for(scheme: str, url: str):
    return ZmqAttacker(url) if scheme == "zmq" else GrpcAttacker(url)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("served", ["zmq", "grpc", "grpc+tls"], indirect=True)
def test_fuzzed_input_neither_crashes_the_coordinator_nor_disturbs_a_job(served):
    scheme, url, proc = served
    with Bystander(url, TOKEN) as bystander:
        attacker = attacker_for(scheme, url)
        try:
            hello = pb.Request(
                id=1, hello=pb.Hello(protocol=PROTOCOL_VERSION, job="fuzz", world_size=4, liveness_timeout=30)
            )
            session = attacker.call(hello).session
            assert session
            before = rss_mb(proc.pid)
            fuzz = settings(
                max_examples=300,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
            )

            @fuzz
            @given(st.lists(st.binary(max_size=4096), min_size=1, max_size=4))
            def random_frames(frames):
                attacker.send_frames(frames)

            @fuzz
            @given(requests(session), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8), st.booleans())
            def mutated_frames(request, at, junk, cut):
                framed = seal(KEY if scheme == "zmq" else GRPC_KEY, request)
                attacker.send_frames([mutate(framed, at, junk, cut)])

            @fuzz
            @given(requests(session))
            def signed_requests(request):
                attacker.send(request)

            for run in (random_frames, mutated_frames, signed_requests):
                run()
                assert proc.poll() is None, f"the coordinator died during {run.__name__}"
            # Replays: a signed request sent again is answered from the reply cache, not applied twice.
            # On a session of its own: the fuzzed ids above reach 2**64 - 1, past which a session
            # accepts nothing new. Ids no fuzzed request is likely to have: a late reply to one (a
            # parked get timing out) must not pass for the answer.
            session = attacker.call(pb.Request(id=10**12 - 1, hello=hello.hello)).session
            add = pb.Request(id=10**12, session=session, add=pb.Add(key="replayed", amount=5))
            first, again = attacker.call(add), attacker.call(add)
            assert first.status == pb.OK and first.number == 5 and again.number == 5
            check = pb.Request(id=10**12 + 1, session=session, get=pb.Get(key="replayed", timeout=1))
            assert attacker.call(check).value == b"5"
            grown = rss_mb(proc.pid) - before
            assert grown < 100, f"coordinator RSS grew by {grown:.0f} MB under fuzzing"
        finally:
            attacker.close()
        bystander.finish()
    assert proc.poll() is None


@pytest.mark.timeout(120)
def test_a_job_cannot_exhaust_the_coordinator():
    """Limits on keys, bytes and waiting requests per job: the write that would pass one fails
    with a message that says which, and the job (and the coordinator) carry on."""
    limits = CoordinatorLimits(max_job_keys=200, max_job_bytes=64 << 10, max_parked_per_session=8)
    server = ZmqCoordinatorServer("127.0.0.1", free_port(), None, limits=limits).start()
    channels = open_job(f"zmq://127.0.0.1:{server.port}", 2, job="greedy")  # served by the limited coordinator
    try:
        ch = channels[1]
        with pytest.raises(dp.ControlError, match="holds 200 keys, the most a job may hold"):
            for i in range(1000):
                ch.set(f"k{i}", b"v")
        with pytest.raises(dp.ControlError, match="would hold more than 65536 bytes of keys and values"):
            ch.set("k0", b"x" * (64 << 10))
        for i in range(150):
            ch.delete(f"k{i}")
        ended: dict[int, BaseException | None] = {}
        waiting = [
            threading.Thread(target=_parked_get, args=(ch, f"never{i}", ended, i), daemon=True) for i in range(8)
        ]
        for t in waiting:
            t.start()
        time.sleep(1.0)
        with pytest.raises(dp.ControlError, match="requests of this session are waiting already"):
            ch._request(pb.Request(get=pb.Get(key="one-too-many", timeout=5)), 5, "get")
        for t in waiting:
            t.join(timeout=30)
        assert len(ended) == 8, f"parked gets still waiting: {sorted(set(range(8)) - ended.keys())}"
        for i, err in ended.items():
            # The coordinator's TIMEOUT answer, or (where it comes later than REPLY_GRACE after
            # the wait: a loaded machine) the client's "no reply": both end the get in bounds.
            late = isinstance(err, dp.ChannelClosed) and "no reply from the coordinator" in str(err)
            assert isinstance(err, dp.ControlTimeout) or late, f"parked get {i} ended with {err!r}"
        exercise(channels, "after-limits")
    finally:
        close_all(channels)
        server.stop()


def _parked_get(ch: dp.ControlChannel, key: str, ended: dict[int, BaseException | None], i: int) -> None:
    """Get a key nobody sets (parked at the coordinator); what the get ended with goes in ``ended``."""
    try:
        ch.get(key, timeout=3)
    except BaseException as err:
        ended[i] = err
    else:
        ended[i] = None


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("scheme", "ranks"), [("zmq", 200), ("grpc", 100)])
def test_hundreds_of_clients_and_two_jobs_with_the_same_keys(scheme, ranks):
    """Load: ``ranks`` clients (threads, each its own connection and session) in two jobs of
    the same key names on one coordinator: rendezvous, barriers, adds and set/get for a
    bounded number of rounds; no error, exact results, nothing seen across jobs."""
    url = f"{scheme}://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "dataparallel", "serve", url], stdout=subprocess.PIPE, text=True)
    assert "serving" in proc.stdout.readline()
    half = ranks // 2
    rounds = 5
    try:
        jobs = {
            name: [
                lambda r=r, name=name: dp.connect(
                    url + "?liveness_timeout=60&heartbeat=5", rank=r, world_size=half, job=name, timeout=120
                )
                for r in range(half)
            ]
            for name in ("A", "B")
        }
        opened = run_all([fn for fns in jobs.values() for fn in fns], timeout=240)

        def work(ch: dp.ControlChannel) -> tuple[int, list[bytes]]:
            ch.rendezvous()
            for i in range(rounds):
                ch.add("counter", ch.rank + 1)
                ch.set(f"mine/{ch.rank}", f"{ch.job}:{ch.rank}:{i}".encode())
                ch.barrier("round")
                got = ch.get(f"mine/{(ch.rank + 1) % ch.world_size}")
                assert got == f"{ch.job}:{(ch.rank + 1) % ch.world_size}:{i}".encode(), got
                ch.barrier("read")
            total = ch.add("counter", 0)
            return total, ch.all_gather("who", ch.job.encode())

        results = run_all([lambda c=c: work(c) for c in opened], timeout=240)
        expected = rounds * half * (half + 1) // 2  # each job's own adds, and no one else's
        for ch, (total, names) in zip(opened, results, strict=True):
            assert total == expected
            assert set(names) == {ch.job.encode()}
        close_all(opened)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------- a member gone bad
# The attacker below holds the token: it can sign anything, so only the coordinator's own
# bookkeeping stands between a replayed frame and a second application.


def _hello(attacker, job: str, world_size: int = 1, liveness_timeout: float = 30.0) -> bytes:
    hello = pb.Hello(protocol=PROTOCOL_VERSION, job=job, world_size=world_size, liveness_timeout=liveness_timeout)
    reply = attacker.call(pb.Request(id=1, hello=hello))
    assert reply.status == pb.OK and reply.session, reply
    return reply.session


def _adder(attacker, session: bytes) -> Callable[[int, str], pb.Reply]:
    """``add(request_id, key)``: an add of 1 to ``key`` as request ``request_id`` of ``session``."""

    def add(request_id: int, key: str) -> pb.Reply:
        return attacker.call(pb.Request(id=request_id, session=session, add=pb.Add(key=key, amount=1)))

    return add


@pytest.mark.timeout(120)
def test_a_replayed_request_is_never_applied_twice(served):
    """A request parked, then answered late, once made evicted ids below it acceptable again:
    park id 100, apply id 200, roll the reply cache past both, replay id 200. (A liveness
    timeout of 0.5 s: replies are held past the entry count for two of them.)"""
    scheme, url, _proc = served
    attacker = attacker_for(scheme, url)
    try:
        session = _hello(attacker, "replay", liveness_timeout=0.5)
        add = _adder(attacker, session)

        attacker.send(pb.Request(id=100, session=session, get=pb.Get(key="missing", timeout=1.0)))
        assert add(200, "counter").number == 1
        for request_id in range(201, 201 + 300):  # the reply of id 200 leaves the cache
            add(request_id, "filler")
        time.sleep(1.5)  # id 100 times out: answered (and once cached) late
        for request_id in range(600, 600 + 255):  # now id 100 is the oldest reply held
            add(request_id, "filler")
        replayed = add(200, "counter")
        assert replayed.status == pb.BAD_MESSAGE and "replayed" in replayed.error, replayed
        read = attacker.call(pb.Request(id=10_000, session=session, get=pb.Get(key="counter", timeout=1)))
        assert read.value == b"1", "the replayed add was applied again"
        assert add(100_000, "filler").status == pb.OK  # far above: id 200 is now below the window
        assert add(200, "counter").status == pb.BAD_MESSAGE
    finally:
        attacker.close()


@pytest.mark.timeout(120)
def test_a_resend_after_many_other_writes_of_its_session_gets_its_own_reply(served):
    """A session that carries many callers (a node relay's, a rank's threads) can apply more
    than ``reply_cache_entries`` writes while one of its replies is lost on a reset: its
    resend, a second later, is answered with that reply (applied once), not refused as
    replayed with the call's outcome lost."""
    scheme, url, _proc = served
    attacker = attacker_for(scheme, url)
    try:
        session = _hello(attacker, "many", liveness_timeout=10.0)
        add = _adder(attacker, session)

        assert add(10, "counter").number == 1
        for request_id in range(11, 11 + 1000):  # the other callers' writes meanwhile
            assert add(request_id, "filler").status == pb.OK
        resent = add(10, "counter")
        assert resent.status == pb.OK and resent.number == 1, resent
        read = attacker.call(pb.Request(id=5000, session=session, get=pb.Get(key="counter", timeout=1)))
        assert read.value == b"1", "the resent add was applied again"
        for request_id in range(6000, 6000 + CoordinatorLimits().reply_cache_recent_entries):
            add(request_id, "filler")  # past the most held, however recent
        refused = add(10, "counter")
        assert refused.status == pb.BAD_MESSAGE and "no longer held" in refused.error, refused
    finally:
        attacker.close()


@pytest.mark.timeout(120)
def test_a_replayed_heartbeat_does_not_keep_a_dead_rank_alive(served):
    scheme, url, _proc = served
    live = with_options(url, liveness_timeout=2, heartbeat=0.2)
    attacker = attacker_for(scheme, url)
    try:
        session = _hello(attacker, "zombie", world_size=2, liveness_timeout=2.0)
        assert attacker.call(pb.Request(id=2, session=session, register=pb.Register(rank=1))).status == pb.OK
        heartbeat = pb.Request(id=3, session=session, heartbeat=pb.Heartbeat())
        assert attacker.call(heartbeat).status == pb.OK
        with dp.connect(live, rank=0, world_size=2, job="zombie", token=TOKEN, timeout=30) as ch:
            stop = threading.Event()

            def replay() -> None:  # rank 1 is gone; its captured heartbeat frame keeps coming
                while not stop.wait(0.3):
                    attacker.send(heartbeat)

            replayer = threading.Thread(target=replay, daemon=True)
            replayer.start()
            start = time.monotonic()
            try:
                with pytest.raises(dp.PeerLost) as info:
                    ch.barrier("wait-for-1", timeout=20)
            finally:
                stop.set()
                replayer.join(timeout=10)
            assert info.value.rank == 1
            assert time.monotonic() - start < 8, "the replayed heartbeats delayed the loss"
    finally:
        attacker.close()


@pytest.mark.timeout(180)
def test_reply_cache_is_bounded_in_bytes(served):
    """Reads are not cached (a resend reads again); cached replies of writes are bounded in
    bytes per session: a 1 MiB value read and compared 300 times does not grow the coordinator
    by 300 MiB."""
    scheme, url, proc = served
    attacker = attacker_for(scheme, url)
    try:
        session = _hello(attacker, "hoard")
        big = os.urandom(1 << 20)
        assert attacker.call(pb.Request(id=2, session=session, set=pb.KeyValue(key="big", value=big))).status == pb.OK
        before = rss_mb(proc.pid)
        for i in range(300):
            got = attacker.call(pb.Request(id=10 + i, session=session, get=pb.Get(key="big", timeout=1)))
            assert got.value == big
        for i in range(300):  # a failing compare_set answers with the 1 MiB current value
            op = pb.CompareSet(key="big", expected=b"nope", desired=b"x")
            assert attacker.call(pb.Request(id=1000 + i, session=session, compare_set=op)).value == big
        grown = rss_mb(proc.pid) - before
        assert grown < 64, f"coordinator RSS grew by {grown:.0f} MB"
    finally:
        attacker.close()


def test_world_size_is_bounded(served):
    scheme, url, _proc = served
    attacker = attacker_for(scheme, url)
    try:
        hello = pb.Hello(protocol=PROTOCOL_VERSION, job="huge", world_size=2**32 - 1, liveness_timeout=5)
        reply = attacker.call(pb.Request(id=1, hello=hello))
        assert reply.status == pb.BAD_MESSAGE and "world_size" in reply.error
    finally:
        attacker.close()
    with pytest.raises(dp.ConfigError, match="world_size"):
        dp.connect(url, rank=0, world_size=MAX_WORLD_SIZE + 1, token=TOKEN, timeout=5)


@pytest.mark.parametrize("scheme", ["zmq", "grpc", "tcpstore"])
def test_a_hosted_coordinator_listens_with_room_for_a_large_job(scheme):
    """Thousands of peers connect at once when a large job starts; a listen backlog of
    libzmq's default 100 sent 12,288 of them into the kernel's SYN retry back-off (31 s to say
    hello). The socket's backlog, as the kernel reports it (``ss``'s Send-Q of a listener)."""
    port = free_port()
    host = dp.connect(f"{scheme}://127.0.0.1:{port}", rank=0, world_size=2, job="j", timeout=20)
    try:
        out = subprocess.run(
            ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.split()
        assert out[0] == "LISTEN", out
        with open("/proc/sys/net/core/somaxconn") as f:
            assert int(out[2]) >= min(4096, int(f.read())), out
    finally:
        host.close()
