"""`dataparallel check`: latency when all is well, and a diagnosis for each usual mistake:
nothing listening, wrong token, TLS or CURVE mismatch, untrusted certificate, etcd down.
Real coordinators (hosted by a rank of a real job) and a real etcd."""

from __future__ import annotations

import subprocess
import sys

import pytest
from etcdserver import EtcdServer, require_etcd
from pki import make_pki, tls_url

import dataparallel as dp
from dataparallel.control.check import check
from dataparallel.testing import free_port, with_options


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _hosted(url: str, token: str | None = None) -> dp.ControlChannel:
    return dp.connect(url, rank=0, world_size=1, job="checked", token=token, timeout=30)


def _problem(url: str, token: str | None = None) -> str:
    report = check(url, token=token, timeout=3, rounds=5)
    assert not report.ok, report.render()
    return report.problem


@pytest.mark.timeout(120)
def test_zmq(tmp_path):
    port = free_port()
    url = f"zmq://127.0.0.1:{port}"
    with _hosted(url, token="right"):
        report = check(url, token="right", timeout=3, rounds=10)
        assert report.ok, report.render()
        assert len(report.round_trips_ms) == 10 and "token accepted by the coordinator" in report.render()
        assert "wrong token" in _problem(url, token="wrong")
        assert "the URL asks for CURVE, the coordinator is unencrypted: drop curve=1" in _problem(
            url + "?curve=1", token="right"
        )
    curve = f"zmq://127.0.0.1:{free_port()}?curve=1"
    with _hosted(curve, token="right"):
        assert check(curve, token="right", timeout=3, rounds=3).ok
        assert "the coordinator uses CURVE, the URL does not: add ?curve=1" in _problem(curve.split("?")[0], "right")
        assert "wrong token: the CURVE handshake fails" in _problem(curve, token="wrong")
    assert f"nothing listening on 127.0.0.1:{port} (connection refused)" in _problem(url)


@pytest.mark.timeout(120)
def test_grpc_tls_and_tokens(pki):
    plain = f"grpc://127.0.0.1:{free_port()}"
    with _hosted(plain, token="right"):
        assert check(plain, token="right", timeout=3, rounds=3).ok
        assert "wrong token" in _problem(plain, token="wrong")
        assert "speaks plaintext, the URL asks for TLS: drop tls=1" in _problem(
            with_options(plain, tls=1, ca=pki["ca"]), "right"
        )
        assert "does not speak ZeroMQ" in _problem(plain.replace("grpc", "zmq"), "right")
    port = free_port()
    secure = tls_url(port, pki)
    with _hosted(secure, token="right"):
        client = with_options(f"grpc://127.0.0.1:{port}", tls=1, ca=pki["ca"])
        assert check(client, token="right", timeout=3, rounds=3).ok
        assert "speaks TLS, the URL does not: add tls=1&ca=CA.pem" in _problem(f"grpc://127.0.0.1:{port}", "right")
        rogue = with_options(f"grpc://127.0.0.1:{port}", tls=1, ca=pki["rogue_ca"])
        assert "does not verify against ca=" in _problem(rogue, "right")


@pytest.mark.timeout(120)
def test_etcd_up_and_down(tmp_path):
    require_etcd()
    server = EtcdServer(tmp_path / "etcd").start().wait_ready()
    try:
        report = check(server.url, timeout=5, rounds=5)
        assert report.ok, report.render()
        assert "etcd has no server-side token" in report.render()
    finally:
        server.stop()
    assert f"nothing listening on 127.0.0.1:{server.client_port} (connection refused): is etcd running there?" in (
        _problem(server.url)
    )


def test_tcpstore_and_cli_exit_codes():
    url = f"tcpstore://127.0.0.1:{free_port()}"
    with _hosted(url):
        run = subprocess.run(
            [sys.executable, "-m", "dataparallel", "check", url, "--rounds", "3"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "round trip over 3 requests" in run.stdout and run.stdout.rstrip().endswith("OK")
    cli = [sys.executable, "-m", "dataparallel", "check"]
    run = subprocess.run([*cli, url, "--timeout", "2"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "PROBLEM: nothing listening" in run.stdout
    bad = subprocess.run([*cli, "nosuch://h:1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown transport scheme 'nosuch'" in bad.stderr  # a usage error
