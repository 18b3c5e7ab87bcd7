"""gRPC-specific behaviour: TLS with certificates made here, tokens, hostile calls
(coordinator death: test_coordinator_death.py). Every wait is bounded."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from jobutil import exercise, grpc_stream, open_job
from pki import make_pki, tls_url

import dataparallel as dp
from dataparallel.control.wire import MAC_SIZE, open_frame, pb, seal
from dataparallel.testing import close_all, free_port, with_options
from dataparallel.transports.grpc import frame_key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.timeout(120)
def test_tls_job_works_and_mismatches_fail_clearly(pki):
    port = free_port()
    channels = open_job(tls_url(port, pki, mtls=1), 2, token="t")
    try:
        exercise(channels, "over-tls")
        plain = f"grpc://127.0.0.1:{port}"
        # Each misconfiguration fails in seconds with the default timeout (300 s), typed and
        # naming the fix: the session's opening looks at the server when it goes unanswered.
        misconfigured = [
            (plain, dp.ConfigError, "speaks TLS, the URL does not: add tls=1"),
            (with_options(plain, tls=1, ca=pki["rogue_ca"]), dp.AuthError, "does not verify against ca="),
            # mtls=1 on the server: a client certificate from another CA is refused.
            (
                with_options(plain, tls=1, ca=pki["ca"], cert=pki["rogue_cert"], key=pki["rogue_key"]),
                dp.AuthError,
                "refuses this client's certificate",
            ),
            (tls_url(port, pki), dp.AuthError, "token"),
        ]
        for url, error, message in misconfigured:
            start = time.monotonic()
            token = "wrong" if error is dp.AuthError and message == "token" else "t"
            with pytest.raises(error, match=message):
                dp.connect(url, rank=1, world_size=2, job="x", token=token)
            assert time.monotonic() - start < 8, f"{url}: the misconfiguration took {time.monotonic() - start:.1f}s"
        exercise(channels, "still-fine")
    finally:
        close_all(channels)


def test_tls_options_are_validated(tmp_path):
    with pytest.raises(dp.ConfigError, match="cert= and key="):
        dp.connect(f"grpc://127.0.0.1:{free_port()}?tls=1", rank=0, world_size=1, timeout=2)
    with pytest.raises(dp.ConfigError, match="cannot read"):
        dp.connect(f"grpc://127.0.0.1:{free_port()}?tls=1&ca={tmp_path}/none.pem", rank=1, world_size=2, timeout=2)


def test_wrong_or_missing_token_is_refused_and_the_job_carries_on():
    url = f"grpc://127.0.0.1:{free_port()}"
    channels = open_job(url, 2, token="right")
    try:
        for token in ("wrong", None):
            with pytest.raises(dp.AuthError, match="token"):
                dp.connect(url, rank=1, world_size=2, job="other", token=token, timeout=5)
        exercise(channels, "after-bad-token")
    finally:
        close_all(channels)


def test_a_stream_the_path_ends_with_internal_is_resumed_not_fatal():
    """gRPC's core ends a stream with INTERNAL where the connection under it breaks in some
    ways (a reset mid-frame: "Internal error from Core"; an RST_STREAM from a proxy), not only
    UNAVAILABLE: that is a broken path, and the channel resumes on a new stream as it does
    after a reset. A gRPC proxy in front of the coordinator ends the first two streams with
    INTERNAL after their first request, then forwards."""
    from concurrent import futures

    from dataparallel.control.v1 import control_pb2_grpc

    url = f"grpc://127.0.0.1:{free_port()}"
    host = dp.connect(url, rank=0, world_size=2, job="resumed", timeout=20)
    upstream = grpc.insecure_channel(f"127.0.0.1:{host.port}")
    ended: list[int] = []

    class Proxy(control_pb2_grpc.ControlServiceServicer):
        def Stream(self, request_iterator, context):  # noqa: N802 (the service's name)
            if len(ended) < 2:
                next(request_iterator, None)
                ended.append(1)
                context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
            call = control_pb2_grpc.ControlServiceStub(upstream).Stream(request_iterator)
            context.add_callback(call.cancel)
            yield from call

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    control_pb2_grpc.add_ControlServiceServicer_to_server(Proxy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with dp.connect(f"grpc://127.0.0.1:{port}", rank=1, world_size=2, job=host.job, timeout=20) as through:
            exercise([host, through], "through-a-path-that-ended-two-streams")
        assert len(ended) == 2
    finally:
        server.stop(0)
        upstream.close()
        close_all([host])


def test_hostile_calls_get_errors_and_the_job_carries_on():
    url = f"grpc://127.0.0.1:{free_port()}"
    channels = open_job(url, 2, token="t")
    key = frame_key("t")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{channels[0].port}") as raw:

            def reply_to(body: bytes) -> pb.Reply:
                [reply] = grpc_stream(raw, [body])
                return open_frame(key, pb.Frame.FromString(reply).sealed, pb.Reply)

            for garbage in (b"\x0a\x7f" + os.urandom(8), b"\xff" * 64):  # not a Frame: truncated, bad tag
                with pytest.raises(grpc.RpcError) as info:
                    grpc_stream(raw, [garbage])
                assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), info.value
            for sealed in (b"", os.urandom(512), b"\xff" * 64):  # a Frame, but no sealed request
                assert reply_to(pb.Frame(sealed=sealed).SerializeToString()).status in (pb.AUTH_FAILED, pb.BAD_MESSAGE)
            forged = pb.Request(id=9, session=b"forged", set=pb.KeyValue(key="x", value=b"y"))
            assert reply_to(pb.Frame(sealed=seal(key, forged)).SerializeToString()).status == pb.CLOSED
            unsealed = pb.Frame(sealed=bytes(MAC_SIZE) + forged.SerializeToString()).SerializeToString()
            assert reply_to(unsealed).status == pb.AUTH_FAILED  # no token
            with pytest.raises(grpc.RpcError) as info:
                grpc_stream(raw, [b"\x00" * (65 << 20)], timeout=10)  # over the size limit
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        exercise(channels, "after-hostile")
    finally:
        close_all(channels)


def test_the_served_port_probe_refuses_only_a_port_in_use(monkeypatch):
    """The probe that keeps gRPC's bind from logging says "served" for a port in use and for
    nothing else: a host without IPv6 (socket(AF_INET6) refused) still hosts on the wildcard,
    and its IPv4 listener is still seen there."""
    import errno
    import socket

    from dataparallel.transports.grpc.server import _refuse_a_served_port

    real_socket = socket.socket

    def no_ipv6(family=socket.AF_INET, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)

    port = free_port()
    for address in (f"127.0.0.1:{port}", f"[::]:{port}"):
        _refuse_a_served_port(address)  # free: no error
    with real_socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", port))
        held.listen()
        for address in (f"127.0.0.1:{port}", f"[::]:{port}"):
            with pytest.raises(OSError) as served:
                _refuse_a_served_port(address)
            assert served.value.errno == errno.EADDRINUSE
        monkeypatch.setattr(socket, "socket", no_ipv6)
        with pytest.raises(OSError) as served:
            _refuse_a_served_port(f"[::]:{port}")
        assert served.value.errno == errno.EADDRINUSE
    _refuse_a_served_port(f"[::]:{port}")  # no IPv6, port free: no error, gRPC binds
