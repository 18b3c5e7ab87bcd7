"""One validation of a URL's options for every entry point: ``dp.connect``, ``dataparallel
serve``, ``check`` and ``launch``, and the torchrun backends. A misspelt option, a setting
without the material it needs or an empty token is a ConfigError that says what to add,
in seconds, before anything is served or started; nothing quietly runs with less security
than the URL asked for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pki import make_pki
from torch.distributed.elastic.rendezvous import RendezvousParameters

import dataparallel as dp
from dataparallel.control.check import check
from dataparallel.launching.torchrun import create_rdzv_handler
from dataparallel.testing import free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _cases(pki: dict[str, Path]) -> list[tuple[str, str | None, str]]:
    """(URL, token, what the error must say) for each misconfiguration."""
    port = free_port()
    ca, cert, key = pki["ca"], pki["cert"], pki["key"]
    return [
        (f"zmq://127.0.0.1:{port}?crve=1", "t", "unknown option"),
        (f"zmq://127.0.0.1:{port}?curve=1", None, "curve=1 derives its keys from the job token"),
        (f"zmq://127.0.0.1:{port}?curve=maybe", "t", "curve must be 1 or 0"),
        (f"zmq://127.0.0.1:{port}?liveness_timeout=0", "t", "liveness_timeout='0' must be a number of seconds"),
        (f"zmq://127.0.0.1:{port}", "", "token is empty"),
        (f"zmq://127.0.0.1:{port}/path", "t", "expected zmq://HOST:PORT"),
        (f"grpc://127.0.0.1:{port}?ca={ca}", "t", "ca= takes effect only with tls=1: add tls=1"),
        (f"grpc://127.0.0.1:{port}?tls=1&cert={cert}", "t", "cert= and key= go together"),
        (f"grpc://127.0.0.1:{port}?tls=1&ca=/nonexistent/ca.pem", "t", "cannot read ca='/nonexistent/ca.pem'"),
        (f"grpc://127.0.0.1:{port}?tls=1&mtls=1&ca={ca}&cert={cert}", "t", "cert= and key= go together"),
        (f"etcd://127.0.0.1:{port}?password=x", "t", "password= without user=: add user="),
        (f"etcd://127.0.0.1:{port}?ca={ca}&key={key}", "t", "cert= and key= go together"),
        (f"tcpstore://127.0.0.1:{port}?curve=1", "t", "unknown option"),
    ]


def test_connect_refuses_each_misconfiguration_at_once(pki):
    for url, token, said in _cases(pki):
        start = time.monotonic()
        with pytest.raises(dp.ConfigError, match=_re(said)):
            dp.connect(url, rank=0, world_size=1, token=token, timeout=60)
        assert time.monotonic() - start < 5, url


def test_check_reports_each_misconfiguration(pki):
    for url, token, said in _cases(pki):
        report = check(url, token=token, timeout=2, rounds=1)
        assert not report.ok and said in report.problem, (url, report.render())


def test_torchrun_backends_refuse_each_misconfiguration(pki, monkeypatch):
    for url, token, said in _cases(pki):
        scheme, rest = url.split("://", 1)
        if scheme not in ("zmq", "grpc", "etcd") or "/" in rest.split("?")[0]:
            continue  # no dp- backend (tcpstore is torch's own c10d); torchrun has no URL path
        endpoint, _, query = rest.partition("?")
        conf = dict(item.split("=", 1) for item in query.split("&") if item)
        if token is None:
            monkeypatch.delenv("DP_TOKEN", raising=False)
        else:
            monkeypatch.setenv("DP_TOKEN", token)
        if token == "":
            continue  # torchrun reads DP_TOKEN, where empty means unset
        params = RendezvousParameters(f"dp-{scheme}", endpoint, "opts", 1, 1, **conf)
        with pytest.raises(dp.ConfigError, match=_re(said)) as info:
            create_rdzv_handler(scheme, params)
        assert "--rdzv-conf" in str(info.value)


def test_torchrun_keys_of_its_own_are_not_transport_options():
    params = RendezvousParameters(
        "dp-zmq", f"127.0.0.1:{free_port()}", "opts", 1, 1, join_timeout=30, last_call_timeout=1, read_timeout="5"
    )
    handler = create_rdzv_handler("zmq", params)
    handler.shutdown()


def _cli(*args: str, token: str | None = "t", timeout: float = 20) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    if token is not None:
        env["DP_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "dataparallel", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(120)
def test_serve_refuses_each_misconfiguration_before_it_listens(pki):
    port = free_port()
    cases = [
        (f"zmq://127.0.0.1:{port}?crve=1", "t", "unknown option(s) crve"),
        (f"zmq://127.0.0.1:{port}?curve=1", None, "curve=1 derives its keys from the job token"),
        (f"grpc://127.0.0.1:{port}?tls=1", "t", "tls=1 needs cert= and key="),
        (
            f"grpc://127.0.0.1:{port}?tls=1&mtls=1&cert={pki['cert']}&key={pki['key']}",
            "t",
            "mtls=1 needs ca=",
        ),
        (f"grpc://127.0.0.1:{port}?cert={pki['cert']}&key={pki['key']}", "t", "add tls=1"),
    ]
    for url, token, said in cases:
        done = _cli("serve", url, token=token)
        assert done.returncode == 2, (url, done.stdout, done.stderr)
        assert said in done.stderr, (url, done.stderr)
        assert "serving" not in done.stdout


@pytest.mark.timeout(60)
def test_launch_refuses_a_misconfigured_url_before_starting_workers(tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    done = _cli("launch", "--nprocs", "1", "--url", f"zmq://127.0.0.1:{free_port()}?crve=1", str(script))
    assert done.returncode == 2, done.stderr
    assert "url (from --url)" in done.stderr and "unknown option(s) crve" in done.stderr
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_serve_and_check_say_what_is_authenticated_and_encrypted():
    """The threat model, per URL, in the tools' own output: tcpstore has no authentication."""
    port = free_port()
    with dp.connect(f"tcpstore://127.0.0.1:{port}", rank=0, world_size=1, job="open", timeout=30):
        report = check(f"tcpstore://127.0.0.1:{port}", timeout=3, rounds=1)
    assert any("no authentication on tcpstore://" in line for line in report.lines), report.render()
    port = free_port()
    with dp.connect(f"zmq://127.0.0.1:{port}?curve=1", rank=0, world_size=1, job="sealed", token="t", timeout=30):
        report = check(f"zmq://127.0.0.1:{port}?curve=1", token="t", timeout=3, rounds=1)
    assert report.ok, report.render()
    assert any("signed with the token's key" in line and "encrypted (CURVE)" in line for line in report.lines)
    serving = subprocess.Popen(
        [sys.executable, "-m", "dataparallel", "serve", f"grpc://127.0.0.1:{free_port()}"],
        env={**os.environ, "DP_TOKEN": "t"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "serving" in serving.stdout.readline()
        assert "not encrypted" in serving.stdout.readline()
    finally:
        serving.kill()
        serving.wait(timeout=10)


def _re(text: str) -> str:
    import re

    return re.escape(text)
