"""Keys derived from the job token: slow to guess offline, one per purpose, none usable for
another purpose (against real zmq and gRPC coordinators)."""

from __future__ import annotations

import hashlib
import hmac

import grpc
import pytest
import zmq
from jobutil import open_job

from dataparallel.control.v1 import control_pb2_grpc
from dataparallel.testing import close_all, free_port
from dataparallel.transports.grpc.server import TOKEN_HEADER
from dataparallel.wire import PROTOCOL_VERSION, PURPOSES, SCRYPT, open_frame, pb, purpose_key, root_key, seal, token_key


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


@pytest.mark.timeout(60)
def test_the_grpc_credential_cannot_sign_zmq_frames_and_the_frame_key_is_no_grpc_credential():
    token = "s3cret"
    # zmq: a frame signed with what gRPC sends on the wire is refused.
    zmq_job = open_job(f"zmq://127.0.0.1:{free_port()}", 2, token=token)
    try:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{zmq_job[0].port}")
        hello = pb.Request(id=1, hello=pb.Hello(protocol=PROTOCOL_VERSION, job="x", world_size=2, liveness_timeout=5))
        sock.send(seal(purpose_key(token, "grpc-credential"), hello))
        assert sock.poll(5000), "no reply"
        reply = open_frame(token_key(token), sock.recv(), pb.Reply)  # replies are signed with the real key
        assert reply.status == pb.AUTH_FAILED
        sock.close()
    finally:
        close_all(zmq_job)
    # gRPC: the zmq frame key (what gRPC used to send) is not a gRPC credential.
    grpc_job = open_job(f"grpc://127.0.0.1:{free_port()}", 2, token=token)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_job[0].port}") as raw:
            stub = control_pb2_grpc.ControlServiceStub(raw)
            for credential in (token_key(token).hex(), hmac.digest(root_key(token), b"x", "sha256").hex()):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Call(pb.Request(id=1, hello=hello.hello), timeout=5, metadata=((TOKEN_HEADER, credential),))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        close_all(grpc_job)
