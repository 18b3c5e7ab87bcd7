"""An expected condition ends in the library's one typed line, with nothing on the way: no
line of torch's or gRPC's C++ log (``[E... socket.cpp:1028]``, ``I... ssl_transport_security.cc``),
no C++ stack (``frame #0: c10::Error::Error``), no Python traceback. Through the API on every
network transport (tests/error_paths.py: a wrong port, a wrong token, a refused certificate,
a lost peer, the coordinator gone) and through the CLI (``check``, ``serve``), in real
processes against real coordinators and a real etcd."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from etcdserver import EtcdServer, require_etcd
from pki import make_pki

from dataparallel.testing import free_port

SCRIPT = Path(__file__).with_name("error_paths.py")
#: A line of a C++ log: glog's and c10's prefix (severity, date, time, [thread,] file:line]).
NATIVE_LOG = re.compile(r"^\[?[IWEF]\d{4} [\d:.]+ +(?:\d+ )?[\w./-]+\.(?:cpp|cc|c|h|hpp):\d+\]", re.MULTILINE)


def assert_plain(output: str) -> None:
    """Nothing but the library's own lines."""
    assert "frame #" not in output, output
    assert not NATIVE_LOG.search(output), output
    assert "Traceback (most recent call last)" not in output, output


def test_what_is_caught_as_noise_is_what_torch_and_grpc_print():
    torch_lines = (
        "[E1127 20:49:01.253717954 socket.cpp:1028] [c10d] The client socket has timed out\n"
        "[W1127 20:49:01.254419221 TCPStore.cpp:340] [c10d] TCP client failed to connect\n"
    )
    grpc_line = "I1127 20:56:36.284966   15007 ssl_transport_security.cc:2563] Handshake failed\n"
    for noise in (
        *torch_lines.splitlines(),
        grpc_line,
        "frame #0: c10::Error::Error(",
        "Traceback (most recent call last):",
    ):
        with pytest.raises(AssertionError):
            assert_plain(f"one line\n{noise}\n")
    assert_plain("wrong port: ChannelClosed: no TCPStore reachable at 127.0.0.1:1 within 2s: timed out\n")


def _paths(*args: str) -> dict[str, str]:
    run = subprocess.run(
        [sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240
    )
    assert run.returncode == 0, run.stdout[-4000:]
    assert_plain(run.stdout)
    said = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    return said


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["zmq", "grpc", "tcpstore", "etcd"])
def test_each_error_path_of_the_api_is_one_line(scheme, tmp_path):
    args = [scheme]
    server = None
    if scheme == "etcd":
        require_etcd()
        server = EtcdServer(tmp_path / "etcd").start().wait_ready()
        assert server.proc is not None
        args += ["--etcd", server.url, "--etcd-pid", str(server.proc.pid)]
    if scheme == "grpc":
        make_pki(tmp_path)
        args += ["--pki", str(tmp_path)]
    try:
        said = _paths(*args)
    finally:
        if server is not None:
            server.stop()
    expected = {"wrong port", "wrong token", "lost peer", "coordinator gone"} | (
        {"refused certificate"} if scheme == "grpc" else set()
    )
    assert expected <= said.keys(), said
    for scenario in expected:
        assert said[scenario].split(":")[0] in ("ChannelClosed", "AuthError", "PeerLost", "ControlTimeout"), said
    assert said["lost peer"].startswith("PeerLost: "), said


def _cli(*argv: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "dataparallel", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert_plain(run.stdout)
    return run


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["zmq", "grpc", "tcpstore"])
def test_check_says_nothing_listens_in_its_own_words(scheme):
    run = _cli("check", f"{scheme}://127.0.0.1:{free_port()}", "--timeout", "2")
    assert run.returncode == 1 and "PROBLEM: nothing listening" in run.stdout, run.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["zmq", "grpc"])
def test_serve_on_a_taken_port_is_one_line(scheme):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = _cli("serve", f"{scheme}://127.0.0.1:{port}")
    assert run.returncode == 1, run.stdout
    assert run.stdout.strip() == (
        f"dataparallel: ControlError: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another coordinator, or another program: choose another port)"
    )


@pytest.mark.timeout(120)
def test_launch_of_the_main_job_at_a_wrong_port_is_one_line():
    """README's main job started by hand as node 1 of a job whose coordinator is not there."""
    script = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
    url = f"tcpstore://127.0.0.1:{free_port()}"
    run = _cli(
        "launch", "--url", url, "--nodes", "2", "--node-rank", "1", "--nprocs", "1", "--timeout", "2", str(script)
    )
    assert run.returncode == 1, run.stdout
    assert "[rank 1] dataparallel: ChannelClosed: no TCPStore reachable at 127.0.0.1:" in run.stdout, run.stdout
