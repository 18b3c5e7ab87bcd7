"""Keys derived from the job token: slow to guess offline, one per purpose, none usable for
another purpose (against real zmq and gRPC coordinators)."""

from __future__ import annotations

import hashlib
from concurrent import futures

import grpc
import pytest
import zmq
from jobutil import grpc_call, open_job

import dataparallel as dp
from dataparallel.control.wire import (
    PROTOCOL_VERSION,
    PURPOSES,
    SCRYPT,
    open_frame,
    pb,
    purpose_key,
    root_key,
    seal,
    token_key,
)
from dataparallel.testing import close_all, free_port


def test_the_root_key_is_scrypt_with_the_documented_parameters():
    expected = hashlib.scrypt(b"s3cret", salt=b"dataparallel/control/v1", dklen=32, maxmem=64 << 20, **SCRYPT)
    assert root_key("s3cret") == expected
    assert SCRYPT["n"] >= 1 << 15 and SCRYPT["r"] >= 8  # ~0.1 s and 32 MiB a guess
    # Not the old single fast hash.
    assert token_key("s3cret") != hashlib.sha256(b"dataparallel/control/v1\x00s3cret").digest()


def test_one_key_per_purpose():
    keys = {purpose_key("s3cret", p) for p in PURPOSES}
    assert len(keys) == len(PURPOSES)
    assert root_key("s3cret") not in keys
    assert purpose_key("other", "frame-mac") != purpose_key("s3cret", "frame-mac")
    with pytest.raises(ValueError, match="purpose"):
        purpose_key("s3cret", "anything")


def _hello(job: str = "x") -> pb.Request:
    return pb.Request(id=1, hello=pb.Hello(protocol=PROTOCOL_VERSION, job=job, world_size=2, liveness_timeout=5))


@pytest.mark.timeout(60)
def test_the_zmq_and_grpc_frame_keys_do_not_stand_in_for_each_other():
    token = "s3cret"
    zmq_key, grpc_key = purpose_key(token, "frame-mac"), purpose_key(token, "grpc-frame-mac")
    assert zmq_key == token_key(token) and zmq_key != grpc_key
    # zmq: a frame sealed with the gRPC key is refused (the reply is sealed with the zmq key).
    zmq_job = open_job(f"zmq://127.0.0.1:{free_port()}", 2, token=token)
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{zmq_job[0].port}")
        sock.send(seal(grpc_key, _hello()))
        assert sock.poll(5000), "no reply"
        assert open_frame(zmq_key, sock.recv(), pb.Reply).status == pb.AUTH_FAILED
        sock.close()
    finally:
        close_all(zmq_job)
    # gRPC: a request sealed with the zmq key, or with the root key itself, is refused.
    grpc_job = open_job(f"grpc://127.0.0.1:{free_port()}", 2, token=token)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_job[0].port}") as raw:
            for key in (zmq_key, root_key(token)):
                reply = grpc_call(raw, seal(key, _hello()))
                assert open_frame(grpc_key, reply, pb.Reply).status == pb.AUTH_FAILED
            genuine = grpc_call(raw, seal(grpc_key, _hello()))
            assert open_frame(grpc_key, genuine, pb.Reply).status == pb.OK
    finally:
        close_all(grpc_job)


@pytest.mark.timeout(60)
def test_a_grpc_call_sends_no_credential_and_cannot_be_altered():
    """What a passive observer of a gRPC call sees: no key, no token, no bearer value in
    the metadata; and a captured call altered in flight is refused."""
    token = "s3cret"
    seen: list[tuple[dict, bytes]] = []

    def record(frames, context: grpc.ServicerContext):
        seen.append((dict(context.invocation_metadata()), next(frames)))
        context.abort(grpc.StatusCode.UNAVAILABLE, "recorded")
        yield b""  # a stream handler; never reached

    eavesdropper = grpc.server(futures.ThreadPoolExecutor(4))
    handler = grpc.stream_stream_rpc_method_handler(record)  # raw bytes in, nothing out
    eavesdropper.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("dataparallel.control.v1.ControlService", {"Stream": handler})]
    )
    port = eavesdropper.add_insecure_port("127.0.0.1:0")
    eavesdropper.start()
    try:
        with pytest.raises(dp.ControlError):
            dp.connect(f"grpc://127.0.0.1:{port}", rank=1, world_size=2, token=token, timeout=2)
    finally:
        eavesdropper.stop(0)
    assert seen, "the client made no call"
    secrets = [token.encode(), root_key(token)] + [purpose_key(token, p) for p in PURPOSES]
    for metadata, frame in seen:
        assert set(metadata) <= {"user-agent", "grpc-accept-encoding", "grpc-timeout"}, metadata
        sent = frame + repr(metadata).encode()
        for secret in secrets:
            assert secret not in sent and secret.hex().encode() not in sent
    # The captured call, altered (another job's name, same MAC), is refused by the real coordinator.
    captured = pb.Frame.FromString(seen[0][1]).sealed
    altered = captured.replace(b"default", b"defauLt")
    assert altered != captured
    grpc_job = open_job(f"grpc://127.0.0.1:{free_port()}", 2, token=token)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_job[0].port}") as raw:
            reply = grpc_call(raw, altered)
            assert open_frame(purpose_key(token, "grpc-frame-mac"), reply, pb.Reply).status == pb.AUTH_FAILED
    finally:
        close_all(grpc_job)


def test_the_root_key_is_computed_once_however_many_threads_ask(monkeypatch):
    """Ranks that are threads of one process (and a coordinator beside them) share one scrypt:
    32 threads computing it at once took seconds of CPU before any rank could connect."""
    from concurrent.futures import ThreadPoolExecutor

    from dataparallel.control import wire

    calls, scrypt = [], hashlib.scrypt

    def counted(*args, **kwargs):
        calls.append(args)
        return scrypt(*args, **kwargs)

    monkeypatch.setattr(wire.hashlib, "scrypt", counted)
    with ThreadPoolExecutor(16) as pool:
        keys = set(pool.map(lambda _: root_key("asked-by-many-threads"), range(32)))
    assert len(keys) == 1 and len(calls) == 1
