"""gRPC-specific behaviour: TLS with certificates made here, tokens, hostile calls
(coordinator death: test_coordinator_death.py). Every wait is bounded."""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from jobutil import exercise, open_job

import dataparallel as dp
from dataparallel.testing import close_all, free_port, with_options
from dataparallel.wire import pb


def _cert(name: str, issuer_key, issuer_name, key, *, ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        ).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a certificate it signed (for 127.0.0.1), and a certificate from another CA."""
    d = tmp_path_factory.mktemp("pki")
    files = {}
    for prefix in ("", "rogue_"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{prefix}test CA")])
        ca = _cert(f"{prefix}test CA", ca_key, ca_name, ca_key, ca=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert("127.0.0.1", ca_key, ca_name, key)
        for name, data in (
            ("ca", ca.public_bytes(serialization.Encoding.PEM)),
            ("cert", cert.public_bytes(serialization.Encoding.PEM)),
            ("key", _pem_key(key)),
        ):
            path = d / f"{prefix}{name}.pem"
            path.write_bytes(data)
            files[f"{prefix}{name}"] = path
    return files


def tls_url(port: int, pki: dict[str, Path], prefix: str = "", **extra) -> str:
    opts = {"tls": 1, "ca": pki[f"{prefix}ca"], "cert": pki[f"{prefix}cert"], "key": pki[f"{prefix}key"], **extra}
    return with_options(f"grpc://127.0.0.1:{port}", **opts)


@pytest.mark.timeout(120)
def test_tls_job_works_and_mismatches_fail_clearly(pki):
    port = free_port()
    channels = open_job(tls_url(port, pki, mtls=1), 2, token="t")
    try:
        exercise(channels, "over-tls")
        plain = f"grpc://127.0.0.1:{port}"
        with pytest.raises(dp.ChannelClosed, match="Socket closed"):
            dp.connect(plain, rank=1, world_size=2, job="x", token="t", timeout=1.5)  # plaintext to TLS
        with pytest.raises(dp.ChannelClosed, match="CERTIFICATE_VERIFY_FAILED"):
            # A server certificate this client does not trust.
            dp.connect(
                with_options(plain, tls=1, ca=pki["rogue_ca"]), rank=1, world_size=2, job="x", token="t", timeout=1.5
            )
        with pytest.raises(dp.ChannelClosed):
            # mtls=1 on the server: a client certificate from another CA is refused.
            dp.connect(
                tls_url(port, pki, "rogue_").replace(str(pki["rogue_ca"]), str(pki["ca"])),
                rank=1,
                world_size=2,
                job="x",
                token="t",
                timeout=1.5,
            )
        with pytest.raises(dp.AuthError):
            dp.connect(tls_url(port, pki), rank=1, world_size=2, job="x", token="wrong", timeout=5)
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


def test_hostile_calls_get_errors_and_the_job_carries_on():
    url = f"grpc://127.0.0.1:{free_port()}"
    channels = open_job(url, 2, token="t")
    try:
        metadata = channels[0]._metadata
        with grpc.insecure_channel(f"127.0.0.1:{channels[0].port}") as raw:
            call = raw.unary_unary(
                "/dataparallel.control.v1.ControlService/Call",
                request_serializer=lambda b: b,
                response_deserializer=pb.Reply.FromString,
            )
            for garbage in (os.urandom(512), b"\xff" * 64, b""):
                try:
                    reply = call(garbage, metadata=metadata, timeout=5)
                    assert reply.status in (pb.CLOSED, pb.BAD_MESSAGE), reply
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), err
            forged = pb.Request(id=9, session=b"forged", set=pb.KeyValue(key="x", value=b"y")).SerializeToString()
            assert call(forged, metadata=metadata, timeout=5).status == pb.CLOSED
            with pytest.raises(grpc.RpcError) as info:
                call(forged, timeout=5)  # no token
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                call(b"\x00" * (65 << 20), metadata=metadata, timeout=10)  # over the size limit
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        exercise(channels, "after-hostile")
    finally:
        close_all(channels)
