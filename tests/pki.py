"""Certificates made for the tests: a CA, a certificate it signed for 127.0.0.1, and the
same from a second, untrusted ("rogue") CA."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dataparallel.testing import with_options


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


def make_pki(d: Path) -> dict[str, Path]:
    """PEM files in ``d``: ca, cert, key and rogue_ca, rogue_cert, rogue_key."""
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
