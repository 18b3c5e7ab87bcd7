"""ZeroMQ-specific behaviour beyond the conformance suite: security, hostile frames,
reconnects (coordinator death: test_coordinator_death.py). Every wait is bounded."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import zmq
from jobutil import exercise, open_job, spawn

import dataparallel as dp
from dataparallel.control.wire import MAC_SIZE, MAX_FRAME, PROTOCOL_VERSION, pb, seal, token_key
from dataparallel.testing import close_all, free_port, run_all, with_options
from dataparallel.testing.netproxy import TcpProxy
from dataparallel.transports.zmq import ZmqChannel, curve_handshake, zmtp_mechanism


def raw_dealer(port: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def reply_to(sock: zmq.Socket, frames: list[bytes], key: bytes) -> pb.Reply | None:
    sock.send_multipart(frames)
    if not sock.poll(3000):
        return None
    raw = sock.recv()
    reply = pb.Reply()
    reply.ParseFromString(raw[MAC_SIZE:])
    return reply


def test_wrong_token_is_refused_and_the_job_carries_on():
    url = f"zmq://127.0.0.1:{free_port()}"
    host = dp.connect(url, rank=0, world_size=2, job="j", token="right", timeout=20)
    try:
        with pytest.raises(dp.AuthError, match="token"):
            dp.connect(url, rank=1, world_size=2, job="j", token="wrong", timeout=5)
        with pytest.raises(dp.AuthError):
            dp.connect(url, rank=1, world_size=2, job="j", timeout=5)  # no token at all
        follower = dp.connect(url, rank=1, world_size=2, job="j", token="right", timeout=20)
        channels = [host, follower]
        run_all([lambda c=c: c.rendezvous() for c in channels])
        exercise(channels, "after-bad-token")
    finally:
        close_all([c for c in (locals().get("follower"), host) if c is not None])


def test_garbage_frames_get_error_replies_and_the_job_carries_on():
    url = f"zmq://127.0.0.1:{free_port()}"
    channels = open_job(url, 2, token="t")
    key = token_key("t")
    try:
        sock = raw_dealer(channels[0].port)
        cases = [
            ([b""], pb.BAD_MESSAGE),  # shorter than a MAC
            ([os.urandom(1000)], pb.AUTH_FAILED),  # random bytes: MAC fails
            ([b"a", b"b", b"c"], pb.BAD_MESSAGE),  # too many frames
            ([seal(key, pb.Request(id=1))], pb.CLOSED),  # no session
            ([_mac(key, b"\xff\xff\xff\x0f garbage")], pb.BAD_MESSAGE),  # signed, not protobuf
            ([seal(key, pb.Request(id=2, session=b"forged", set=pb.KeyValue(key="x", value=b"y")))], pb.CLOSED),
        ]
        for frames, status in cases:
            reply = reply_to(sock, frames, key)
            assert reply is not None and reply.status == status, (frames[0][:40], reply)
        # A session with hostile requests: unknown op, out-of-range timeout, duplicate collective.
        hello = pb.Request(id=1, hello=pb.Hello(protocol=PROTOCOL_VERSION, job="j2", world_size=2, liveness_timeout=5))
        session = reply_to(sock, [seal(key, hello)], key).session
        for request in (
            pb.Request(id=2, session=session),  # no op set
            pb.Request(id=3, session=session, get=pb.Get(key="k", timeout=-1)),
            pb.Request(id=4, session=session, hello=pb.Hello(protocol=99, job="j2", world_size=2)),
            pb.Request(id=5, session=session, register=pb.Register(rank=7)),
        ):
            assert reply_to(sock, [seal(key, request)], key).status == pb.BAD_MESSAGE, request
        # Raw non-ZMTP bytes on the port: zmq drops that connection.
        import socket

        with socket.create_connection(("127.0.0.1", channels[0].port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(4096))
        sock.close()
        exercise(channels, "after-garbage")
    finally:
        close_all(channels)


def _mac(key: bytes, body: bytes) -> bytes:
    """``body`` sealed as a request (the request direction under the MAC), whatever it holds."""
    import hmac

    from dataparallel.control.wire import DIRECTIONS

    return hmac.digest(key, DIRECTIONS[pb.Request] + body, "sha256") + body


@pytest.mark.timeout(60)
def test_oversized_frame_drops_only_that_connection():
    url = f"zmq://127.0.0.1:{free_port()}"
    channels = open_job(url, 2)
    try:
        sock = raw_dealer(channels[0].port)
        sock.send(b"\0" * (MAX_FRAME + MAC_SIZE + 1))
        assert not sock.poll(1000), "an oversized frame must not be answered"
        sock.close()
        exercise(channels, "after-oversize")
    finally:
        close_all(channels)


@pytest.mark.timeout(90)
def test_curve_encrypts_traffic_and_needs_the_same_token():
    port = free_port()
    secret = b"SECRET-PAYLOAD-0123456789"
    for curve in (False, True):
        url = f"zmq://127.0.0.1:{port}" + ("?curve=1" if curve else "")
        host = dp.connect(url, rank=0, world_size=2, token="tok", timeout=20)
        proxy = TcpProxy(host.port)
        try:
            via_proxy = url.replace(str(port), str(proxy.port))
            follower = dp.connect(via_proxy, rank=1, world_size=2, token="tok", timeout=20)
            follower.set("k", secret)
            assert host.get("k", timeout=5) == secret
            assert (secret in proxy.captured) is (not curve), "CURVE must hide the payload; plain must not"
            if curve:  # with the default timeout (300 s): typed errors naming the fix, in seconds
                misconfigured = [
                    (f"zmq://127.0.0.1:{port}", "tok", dp.ConfigError, "encryption mismatch.*add \\?curve=1"),
                    (f"zmq://127.0.0.1:{port}?curve=1", "other", dp.AuthError, "wrong token"),
                ]
                for bad, token, error, message in misconfigured:
                    start = time.monotonic()
                    with pytest.raises(error, match=message):
                        dp.connect(bad, rank=1, world_size=2, job="intruder", token=token)
                    assert time.monotonic() - start < 8, f"{bad}: took {time.monotonic() - start:.1f}s"
            close_all([follower, host])
        finally:
            proxy.close()
            host.close()
    with pytest.raises(dp.ConfigError, match="token"):
        dp.connect(f"zmq://127.0.0.1:{free_port()}?curve=1", rank=0, world_size=1)


@pytest.mark.timeout(90)
def test_dropped_connection_reconnects_and_parked_get_completes():
    url = with_options(f"zmq://127.0.0.1:{free_port()}", heartbeat=0.2, liveness_timeout=4)
    host = dp.connect(url, rank=0, world_size=2, timeout=20)
    proxy = TcpProxy(host.port)
    follower = dp.connect(url.replace(str(host.port), str(proxy.port)), rank=1, world_size=2, timeout=20)
    try:
        run_all([lambda c=c: c.rendezvous() for c in (host, follower)])
        result: list[bytes] = []
        waiter = threading.Thread(target=lambda: result.append(follower.get("late", timeout=30)))
        waiter.start()
        time.sleep(0.3)
        proxy.drop_connections()  # the parked get's connection is gone
        host.set("late", b"arrived")
        waiter.join(timeout=20)
        assert result == [b"arrived"]
        assert follower.add("n", 1) == 1 and host.add("n", 1) == 2, "no request applied twice"
        run_all([lambda c=c: c.barrier("still", timeout=10) for c in (host, follower)])
        assert host.lost_peers() == {} and follower.lost_peers() == {}
    finally:
        close_all([follower, host])
        proxy.close()


def test_a_silent_client_does_not_disturb_the_job():
    url = f"zmq://127.0.0.1:{free_port()}"
    channels = open_job(url, 2)
    try:
        idle = [socket.create_connection(("127.0.0.1", channels[0].port), timeout=5) for _ in range(20)]
        exercise(channels, "with-idle-clients")
        for s in idle:
            s.close()
    finally:
        close_all(channels)


@pytest.mark.timeout(120)
def test_a_frozen_coordinator_is_waited_for_not_diagnosed_as_misconfigured(monkeypatch):
    """A coordinator too starved (or stopped) to say its ZMTP greeting for a while is slow,
    not another server on the port: the hello's misconfiguration probes find nothing, and
    the hello is answered once it runs again."""
    port = free_port()
    monkeypatch.setenv("DP_TOKEN", "t")
    server = spawn(["-m", "dataparallel", "serve", f"zmq://127.0.0.1:{port}?curve=1"])
    try:
        assert "serving" in server.stdout.readline()
        found: list[list] = []
        diagnose = ZmqChannel.diagnose.__func__

        def probe(cls, url, timeout, token=None):
            found.append(diagnose(cls, url, timeout, token))
            if len(found) == 2:  # two probes have met the frozen coordinator (each timed out)
                os.kill(server.pid, signal.SIGCONT)
            return found[-1]

        monkeypatch.setattr(ZmqChannel, "diagnose", classmethod(probe))
        os.kill(server.pid, signal.SIGSTOP)
        ch = dp.connect(f"zmq://127.0.0.1:{port}?curve=1", rank=0, world_size=1, token="t", timeout=60)
        ch.close()
        assert len(found) >= 2 and not any(found), found
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.communicate(timeout=10)


def test_a_silent_port_gives_no_verdict_on_the_greeting_or_the_curve_handshake():
    # What a frozen coordinator's port looks like: the kernel accepts, nothing is said.
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    try:
        with pytest.raises(TimeoutError):
            zmtp_mechanism("127.0.0.1", port, 0.3)
        assert curve_handshake("127.0.0.1", port, "t", 0.3) is None
    finally:
        silent.close()
