"""Hostile input beyond tests/test_hostile.py: the etcd transport against a real etcd (keys of
any text, values at and past etcd's size bounds, jobs whose names and prefixes nest), the
torchrun backends' signed rendezvous state (forged and replayed), and a zmq coordinator served
with CURVE, attacked by clients that know its public key but not the token, or not even the key."""

from __future__ import annotations

import os
import pickle
import threading
import time
import uuid

import pytest
import zmq
import zmq.utils.monitor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jobutil import Bystander, exercise, mutate, open_job, rss_mb, standalone
from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError

import dataparallel as dp
from dataparallel.control.channel import RESERVED_PREFIX
from dataparallel.control.registry import parse_url
from dataparallel.control.wire import MAC_SIZE, PROTOCOL_VERSION, open_frame, pb, purpose_key, seal, token_key
from dataparallel.launching.torchrun import ROUND_ENV, create_rdzv_handler, frame_state
from dataparallel.testing import close_all, free_port, run_all, with_options
from dataparallel.transports.etcd import EtcdChannel
from dataparallel.transports.zmq.server import curve_server_keys

TOKEN = "hostile-token"
OPTS = {"heartbeat": 0.2, "liveness_timeout": 4}
FEW = {"deadline": None, "database": None, "derandomize": True, "suppress_health_check": list(HealthCheck)}


# ---------------------------------------------------------------------- etcd: keys and values
SPECIAL_KEYS = [
    "\x00",
    "a\x00b",
    "/",
    "//",
    "..",
    "../..",
    "../../other-job/__dp/token",
    "/dataparallel//victim/run/k",
    "\\",
    "\n\r\t",
    "\ufeff",
    "\U0010ffff",
    "é/../ü",
    "__dp",
    "__dp\x00/claim/0",
    "_" * 100_000,
]
text_keys = st.one_of(
    st.sampled_from(SPECIAL_KEYS),
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=64),
).filter(lambda k: not k.startswith(RESERVED_PREFIX))


@pytest.mark.timeout(120)
def test_etcd_keys_of_any_text_round_trip_and_stay_inside_the_job(etcd):
    url = with_options(etcd.url + "/keys", **OPTS)
    with (
        dp.connect(url, rank=0, world_size=1, job="keys", token=TOKEN, timeout=20) as ch,
        dp.connect(url, rank=0, world_size=1, job="neighbour", token=TOKEN, timeout=20) as neighbour,
    ):
        neighbour.set("k", b"neighbour's")
        base, theirs = ch.num_keys(), neighbour.num_keys()

        @settings(max_examples=100, **FEW)
        @given(text_keys, st.binary(max_size=2048))
        def round_trip(key, value):
            ch.set(key, value)
            assert ch.get(key, timeout=5) == value
            assert ch.check([key]) and ch.multi_get([key, key], timeout=5) == [value, value]
            assert ch.num_keys() == base + 1
            assert not neighbour.check([key]) or key == "k"
            assert ch.delete(key) and not ch.check([key]) and not ch.delete(key)
            assert ch.num_keys() == base

        round_trip()
        assert neighbour.get("k", timeout=5) == b"neighbour's" and neighbour.num_keys() == theirs


@pytest.mark.timeout(60)
def test_etcd_a_key_or_job_utf8_cannot_encode_is_a_config_error(etcd):
    url = with_options(etcd.url + "/surrogates", **OPTS)
    for job in ("\ud800", "a/b", "a\x00b", ""):
        with pytest.raises(dp.ConfigError, match="job must be"):
            dp.connect(url, rank=0, world_size=1, job=job, token=TOKEN, timeout=10)
    with dp.connect(url, rank=0, world_size=1, job="surrogates", token=TOKEN, timeout=20) as ch:
        bad = "k\udcff"
        calls = [
            lambda: ch.set(bad, b"v"),
            lambda: ch.get(bad, timeout=1),
            lambda: ch.check(["ok", bad]),
            lambda: ch.delete(bad),
            lambda: ch.add(bad, 1),
            lambda: ch.compare_set(bad, b"", b"v"),
            lambda: ch.append(bad, b"v"),
            lambda: ch.multi_get(["ok", bad], timeout=1),
            lambda: ch.multi_set(["ok", bad], [b"1", b"2"]),
        ]
        for call in calls:
            with pytest.raises(dp.ConfigError, match="lone surrogate"):
                call()
        assert not ch.check(["ok"]), "a multi_set with one bad key wrote the others"
        with pytest.raises(dp.ConfigError, match="reserved"):
            ch.set(f"{RESERVED_PREFIX}token", b"mine")
        ch.set("after", b"1")
        assert ch.get("after", timeout=5) == b"1"


#: etcd's default --max-request-bytes: one request (a transaction with its puts) up to 1.5 MiB.
MAX_REQUEST = 3 << 19


@pytest.mark.timeout(120)
def test_etcd_values_past_the_request_bound_are_a_bad_message_and_the_job_carries_on(etcd):
    a, b = open_job(with_options(etcd.url + "/sizes", **OPTS), 2, token=TOKEN, job="sizes")
    try:
        under = os.urandom(MAX_REQUEST - 8192)  # room for the key and the exactly-once record
        a.set("under", under)
        assert b.get("under", timeout=10) == under
        assert b.num_keys() == a.num_keys()

        def refused(call, *args) -> None:
            start = time.monotonic()
            with pytest.raises(dp.BadMessage, match="max-request-bytes"):
                call(*args)
            assert time.monotonic() - start < 5, f"{call.__name__} took {time.monotonic() - start:.1f}s to fail"

        @settings(max_examples=12, **FEW)
        @given(st.integers(MAX_REQUEST - 4096, MAX_REQUEST + (4 << 20)))
        def around_the_bound(size):
            try:
                a.set("edge", bytes(size))
            except dp.BadMessage:
                assert size > MAX_REQUEST - 1024, f"a value of {size} bytes was refused"
                return
            assert size < MAX_REQUEST, f"a value of {size} bytes was taken"
            assert len(b.get("edge", timeout=10)) == size

        around_the_bound()
        refused(a.set, "over", bytes(MAX_REQUEST))
        refused(a.set, "k" * MAX_REQUEST, b"v")
        refused(a.append, "under", bytes(16384))  # what it would write, under + the tail, is over
        refused(a.compare_set, "over", b"", bytes(MAX_REQUEST))
        refused(a.multi_set, ["m1", "m2"], [bytes(MAX_REQUEST // 2)] * 2)
        refused(a.set, "huge", bytes(8 << 20))  # past gRPC's own limit too: refused before etcd reads it
        # The replies: three values that each fit, read together, pass the client's 4 MiB.
        a.multi_set(["r1", "r2"], [under[:100]] * 2)
        a.set("r3", under)
        a.set("r4", under)
        refused(b.multi_get, ["r3", "r4", "under"])
        assert not any(b.check([k]) for k in ("over", "m1", "m2", "huge")), "a refused write left something"
        assert b.get("under", timeout=10) == under, "a refused append changed the value"
        assert b.multi_get(["r1", "r2", "r3"], timeout=10) == [under[:100]] * 2 + [under]
        exercise([a, b], "after-sizes")
        run_all([lambda c=c: c.barrier("after-sizes", timeout=20) for c in (a, b)])
    finally:
        close_all([a, b])


# ---------------------------------------------------------------------- etcd: jobs that nest
@pytest.mark.timeout(120)
def test_etcd_jobs_whose_names_and_prefixes_nest_neither_see_nor_disturb_each_other(etcd):
    """Job ``job`` of prefix ``nest``, ``job2`` beside it, and ``x`` of prefix ``nest/job`` (whose
    keys once lay under job's, so that starting job wiped them): the other two run barriers
    while ``job`` starts, writes the same key names, deletes them and ends."""
    url = with_options(etcd.url + "/nest", **OPTS)
    nested = with_options(etcd.url + "/nest/job", **OPTS)
    others = {"job2": open_job(url, 2, token=TOKEN, job="job2"), "x": open_job(nested, 2, token=TOKEN, job="x")}
    try:
        for name, channels in others.items():
            channels[0].set("shared", name.encode())
            channels[1].add("counter", 1)

        def life_of_job() -> None:  # starts, writes the same names, deletes, ends
            mine = open_job(url, 2, token=TOKEN, job="job")
            assert not mine[0].check(["shared"]) and mine[0].add("counter", 5) == 5
            mine[0].set("shared", b"job")
            mine[1].delete("counter")
            exercise(mine, "job")
            close_all(mine)  # the last one out deletes the job's keys

        errors: list[BaseException] = []
        stop = threading.Event()

        def rounds(ch: dp.ControlChannel) -> None:
            try:
                i = 0
                while ch.broadcast("go", b"0" if stop.is_set() else b"1", src=0, timeout=30) == b"1":
                    ch.barrier(f"round{i}", timeout=30)
                    assert ch.get("shared", timeout=5) == ch.job.encode()
                    i += 1
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=rounds, args=(c,)) for cs in others.values() for c in cs]
        for t in threads:
            t.start()
        try:
            life_of_job()
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not errors, errors
        counts = {name: channels[0].num_keys() for name, channels in others.items()}
        life_of_job()  # again, with the others at rest: they count the same keys after it
        for name, channels in others.items():
            assert channels[1].get("shared", timeout=5) == name.encode()
            assert channels[0].add("counter", 0) == 1
            assert channels[0].num_keys() == counts[name], f"job {name}'s keys changed"
            exercise(channels, "after")
    finally:
        close_all([c for cs in others.values() for c in cs])


# ---------------------------------------------------------------------- torchrun: the rendezvous state
class _Payload:
    """What a forged state would run, were its pickle ever loaded."""

    def __reduce__(self):
        return (exec, ("import os; os.environ['DP_HOSTILE_PWNED'] = '1'",))


@pytest.fixture
def rendezvous(etcd, monkeypatch):
    """A dp-etcd rendezvous handler of one node (DP_TOKEN set), and an intruder: a channel to
    the same job that reaches etcd but holds no token (it opens the job's keys without joining)."""
    monkeypatch.setenv("DP_TOKEN", TOKEN)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.delenv("DP_HOSTILE_PWNED", raising=False)
    # The handler sets it in this process: recorded here (set, then removed) so it is undone after.
    monkeypatch.setenv(ROUND_ENV, "")
    monkeypatch.delenv(ROUND_ENV)
    endpoint = f"127.0.0.1:{etcd.client_port}"
    run_id = f"rdzv{free_port()}"
    params = RendezvousParameters("dp-etcd", endpoint, run_id, 1, 1, read_timeout="10", join_timeout="30")
    handler = create_rdzv_handler("etcd", params)
    intruder = EtcdChannel(
        parse_url(f"etcd://{endpoint}"), rank=None, world_size=1, job=f"torchrun.{run_id}", token=None, timeout=10
    )
    try:
        yield handler, intruder, f"torch.rendezvous.{run_id}.state"
    finally:
        intruder.close()
        handler.shutdown()
        handler.channel.close()


@pytest.mark.timeout(120)
def test_a_forged_rendezvous_state_is_refused_and_never_loaded(rendezvous):
    handler, intruder, key = rendezvous
    wrong_key = purpose_key("not-the-token", "rendezvous-state")
    place = f"{intruder.job}\x00{key}".encode()
    forged = [
        b"garbage",
        bytes(200),
        frame_state(pickle.dumps(_Payload()), wrong_key, 2**63, place),  # another token's signature
        frame_state(pickle.dumps(_Payload()), wrong_key, 1, place)[:-MAC_SIZE] + bytes(MAC_SIZE),
    ]
    for state in forged:
        intruder.set(key, state)
        with pytest.raises(RendezvousStateError, match=r"not one this backend wrote|not signed"):
            handler.next_rendezvous()
        assert "DP_HOSTILE_PWNED" not in os.environ, "a forged state was unpickled"
    intruder.delete(key)
    info = handler.next_rendezvous()  # the store cleaned up: the rendezvous goes ahead
    assert (info.rank, info.world_size) == (0, 1)


@pytest.mark.timeout(120)
def test_a_genuine_rendezvous_state_of_another_run_is_refused(rendezvous, etcd):
    """The intruder copies a state signed with the job's token for another run (another run
    id, the same token) into this run's key: it must not open here."""
    handler, intruder, key = rendezvous
    other_run = f"rdzv{free_port()}"
    params = RendezvousParameters(
        "dp-etcd", f"127.0.0.1:{etcd.client_port}", other_run, 1, 1, read_timeout="10", join_timeout="30"
    )
    other = create_rdzv_handler("etcd", params)
    try:
        other.next_rendezvous()
        genuine = other.channel.get(f"torch.rendezvous.{other_run}.state", timeout=5)
    finally:
        other.shutdown()
        other.channel.close()
    intruder.set(key, genuine)
    with pytest.raises(RendezvousStateError, match="another run or job"):
        handler.next_rendezvous()


@pytest.mark.timeout(120)
def test_a_replayed_older_rendezvous_state_is_refused(rendezvous):
    """The intruder keeps a genuine state (signed with the token) and writes it back after the
    rendezvous has moved on: the agent must not go back to it."""
    handler, intruder, key = rendezvous
    handler.next_rendezvous()
    old = intruder.get(key, timeout=5)
    handler.next_rendezvous()
    holder = handler.inner._state_holder
    newer = holder.state.round
    assert intruder.get(key, timeout=5) != old
    intruder.set(key, old)
    time.sleep(1.1)  # past the state holder's cache
    with pytest.raises(RendezvousStateError, match="replayed"):
        handler.num_nodes_waiting()
    with pytest.raises(RendezvousStateError, match="replayed"):
        handler.next_rendezvous()
    assert holder.state.round == newer, "the agent went back to the replayed round"


# ---------------------------------------------------------------------- zmq with CURVE
@pytest.fixture
def curve_served():
    port = free_port()
    url = f"zmq://127.0.0.1:{port}?curve=1"
    with standalone(url, TOKEN) as proc:
        yield url, port, proc


def _dealer(ctx: zmq.Context, port: int, server_key: bytes | None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connecting to the coordinator (with CURVE and a fresh client key when
    ``server_key`` is given, in plain text otherwise), and a monitor of its handshake."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    # An endpoint of its own: pyzmq's default names it by the socket's descriptor, which the
    # next socket reuses while the closed one's monitor may still hold the name.
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED, addr=f"inproc://monitor-{uuid.uuid4().hex}"
    )
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock, monitor


def _handshake(monitor: zmq.Socket, timeout: float = 3.0, expected: bool = False) -> bool:
    """Whether the monitored socket completes a CURVE handshake within ``timeout``. One that
    should (``expected``) is waited for across a reconnect (libzmq's own, on a loaded machine)
    and longer; one that should not fails at its first disconnect."""
    deadline = time.monotonic() + (max(timeout, 15.0) if expected else timeout)
    while (left := deadline - time.monotonic()) > 0 and monitor.poll(int(left * 1000) + 1):
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return True
        if event == zmq.EVENT_DISCONNECTED and not expected:
            return False
    return False


def forged_requests() -> st.SearchStrategy[pb.Request]:
    """Requests of every kind an intruder would like to send (it cannot sign them)."""
    name = st.text(max_size=16)
    ops = st.one_of(
        st.builds(
            lambda j, w: {"hello": pb.Hello(protocol=PROTOCOL_VERSION, job=j, world_size=w)}, name, st.integers(1, 8)
        ),
        st.builds(lambda k, v: {"set": pb.KeyValue(key=k, value=v)}, name, st.binary(max_size=256)),
        st.builds(lambda k: {"get": pb.Get(key=k, timeout=1)}, name),
        st.builds(lambda k, a: {"add": pb.Add(key=k, amount=a)}, name, st.integers(-(2**63), 2**63 - 1)),
        st.builds(lambda k: {"delete": pb.Key(key=k)}, name),
        st.builds(lambda r: {"register": pb.Register(rank=r)}, st.integers(0, 8)),
        st.builds(
            lambda k, v: {"heartbeat": pb.Heartbeat(set=[pb.KeyValue(key=k, value=v)])}, name, st.binary(max_size=64)
        ),
    )
    return st.builds(
        lambda i, s, op: pb.Request(id=i, session=s, **op), st.integers(0, 2**64 - 1), st.binary(max_size=32), ops
    )


@pytest.mark.timeout(180)
def test_a_curve_coordinator_under_attack_without_the_token_serves_its_jobs(curve_served):
    """An intruder that knows the coordinator's public key but not the token completes the
    CURVE handshake (any client key is accepted) and sends random, forged and mutated frames:
    every one is answered AUTH_FAILED or BAD_MESSAGE, none is applied. One without the key,
    in plain text or with a wrong server key, gets no handshake and no answer at all. The
    coordinator lives, its memory stays bounded, and a job on it runs throughout undisturbed."""
    url, port, proc = curve_served
    with Bystander(url, TOKEN) as bystander:
        ctx = zmq.Context()
        try:
            for server_key in (None, curve_server_keys("not-the-token")[0]):
                sock, monitor = _dealer(ctx, port, server_key)
                assert not _handshake(monitor), f"a handshake succeeded with server key {server_key!r}"
                try:
                    sock.send(b"x" * 64, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no connection to queue it on: fine
                assert not sock.poll(500), "an intruder without the server key got an answer"
                sock.close()
                monitor.close()

            sock, monitor = _dealer(ctx, port, curve_server_keys(TOKEN)[0])
            assert _handshake(monitor, expected=True), "the CURVE handshake with the right server key failed"
            replies: dict[int, int] = {}
            real_key = token_key(TOKEN)

            def receive(wait_ms: int) -> None:
                while sock.poll(wait_ms):
                    status = open_frame(real_key, sock.recv(), pb.Reply).status
                    replies[status] = replies.get(status, 0) + 1

            def send(frames: list[bytes]) -> None:
                sock.send_multipart(frames)
                receive(0)

            wrong = token_key("not-the-token")
            before = rss_mb(proc.pid)

            @settings(max_examples=300, **FEW)
            @given(st.lists(st.binary(max_size=4096), min_size=1, max_size=4))
            def random_frames(frames):
                send(frames)

            @settings(max_examples=300, **FEW)
            @given(forged_requests())
            def forged(request):
                send([seal(wrong, request)])
                send([request.SerializeToString()])

            @settings(max_examples=300, **FEW)
            @given(forged_requests(), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8), st.booleans())
            def mutated(request, at, junk, cut):
                send([mutate(seal(wrong, request), at, junk, cut)])

            for run in (random_frames, forged, mutated):
                run()
                assert proc.poll() is None, f"the coordinator died during {run.__name__}"
            receive(500)
            assert replies.get(pb.AUTH_FAILED, 0) > 100, replies  # the frames did reach the MAC check
            assert set(replies) <= {pb.AUTH_FAILED, pb.BAD_MESSAGE}, f"an unsigned frame was served: {replies}"
            sock.close()
            monitor.close()
            grown = rss_mb(proc.pid) - before
            assert grown < 100, f"coordinator RSS grew by {grown:.0f} MB under attack"
        finally:
            ctx.destroy(linger=0)
        bystander.finish()
    assert proc.poll() is None
