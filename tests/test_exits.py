"""A peer that exits is noticed when its connections close (zmq and grpc alike): at once where
the coordinator can see its pid, after a short grace where it cannot (another machine or PID
namespace), never for a connection that comes back, and not faster than the liveness timeout
for a peer whose connections stay open."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from jobutil import expect

import dataparallel as dp
from dataparallel.control import procinfo
from dataparallel.control.coordinator import Coordinator
from dataparallel.control.wire import PROTOCOL_VERSION, pb
from dataparallel.testing import close_all, free_port, run_all, with_options

SCHEMES = ["zmq", "grpc"]
LIVENESS = {"heartbeat": 0.5, "liveness_timeout": 6}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _member(co: Coordinator, rank: int, conn: object, pid: int, local: bool) -> bytes:
    """A session of rank ``rank`` heard on ``conn``, from a process whose pid the coordinator
    can (``local``) or cannot check."""
    boot_id, namespace = procinfo.identity() if local else ("another-machine", 1)
    hello = pb.Hello(
        protocol=PROTOCOL_VERSION,
        job="j",
        world_size=3,
        nonce=os.urandom(8),
        liveness_timeout=LIVENESS["liveness_timeout"],
        host="h",
        pid=pid,
        boot_id=boot_id,
        pid_namespace=namespace,
        heartbeat=LIVENESS["heartbeat"],
    )
    session = co.handle(conn, pb.Request(id=1, hello=hello), conn).session
    assert co.handle(conn, pb.Request(id=2, session=session, register=pb.Register(rank=rank)), conn).status == pb.OK
    return session


def _heartbeat(co: Coordinator, session: bytes, request_id: int, conn: object) -> None:
    co.handle(conn, pb.Request(id=request_id, session=session, heartbeat=pb.Heartbeat()), conn)


def test_the_coordinator_judges_closed_connections_by_pid_or_by_grace_or_by_liveness():
    clock = Clock()
    co = Coordinator(lambda route, reply: None, clock=clock, judges_own_stalls=False)  # the clock jumps
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: the pid no longer exists
    me = _member(co, 0, "c0", os.getpid(), local=True)
    _member(co, 1, "c1", gone.pid, local=True)
    remote = _member(co, 2, "c2", 4242, local=False)
    _heartbeat(co, remote, 3, "c2b")  # a second connection of rank 2

    co.connection_closed("c1")  # its process has exited: lost at once
    assert co.job_members("j") == {0, 2}
    co.connection_closed("c2")  # one of two connections: nothing to judge
    clock.now += 5
    _heartbeat(co, remote, 4, "c2b")
    _heartbeat(co, me, 3, "c0")
    co.sweep()
    assert co.job_members("j") == {0, 2}

    co.connection_closed("c2b")  # its last connection, pid not checkable: the grace applies
    grace = LIVENESS["heartbeat"] + 1.0
    clock.now += grace - 0.1
    co.sweep()
    assert co.job_members("j") == {0, 2}
    _heartbeat(co, remote, 5, "c2c")  # it came back on a new connection in time
    clock.now += 1.0
    co.sweep()
    assert co.job_members("j") == {0, 2}

    # Alive (this process, its pid seen): its connections were reset, and however long a
    # loaded machine makes it take to come back, it is waited for, up to the liveness timeout.
    co.connection_closed("c0")
    clock.now += grace + 1.0
    _heartbeat(co, remote, 6, "c2c")
    co.sweep()
    assert co.job_members("j") == {0, 2}
    clock.now += LIVENESS["liveness_timeout"] - grace  # silent past the liveness timeout
    _heartbeat(co, remote, 7, "c2c")
    co.sweep()
    assert co.job_members("j") == {2}


def _hold(url: str, rank: int, *prefix: str) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, "-m", "dataparallel.testing.worker", "hold", "--url", url]
    cmd += ["--rank", str(rank), "--world-size", "3", "--job", "exits", "--hold", "60"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lost_after_kill(url: str, victim: subprocess.Popen, pid: int) -> tuple[float, dp.PeerLost]:
    channels = run_all([lambda r=r: dp.connect(url, rank=r, world_size=3, job="exits", timeout=30) for r in (0, 1)])
    try:
        run_all([lambda c=c: c.rendezvous(timeout=30) for c in channels])
        assert '"ready"' in victim.stdout.readline(), victim.stderr.read()[-2000:]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        errors = run_all([lambda c=c: expect(dp.PeerLost, c.barrier, "after", 30) for c in channels])
        return time.monotonic() - start, errors[0]
    finally:
        close_all(channels)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_peer_killed_in_another_pid_namespace_is_lost_after_the_grace(scheme):
    """Where the coordinator cannot see the peer's pid (another machine; here another PID
    namespace, which needs root), a peer whose connections all closed is lost once it has
    not come back within a heartbeat and a second: long before the liveness timeout."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    url = with_options(f"{scheme}://127.0.0.1:{free_port()}", **LIVENESS)
    victim = _hold(url, 2, "unshare", "--pid", "--fork", "--kill-child")
    try:
        time.sleep(0.5)
        inner = subprocess.run(["pgrep", "-P", str(victim.pid)], capture_output=True, text=True).stdout.split()
        elapsed, err = _lost_after_kill(url, victim, int(inner[0]) if inner else victim.pid)
    finally:
        victim.kill()
        victim.communicate(timeout=10)
    grace = LIVENESS["heartbeat"] + 1.0
    assert err.rank == 2 and "did not come back within" in str(err), str(err)
    assert grace - 0.2 < elapsed < grace + 1.5, f"{elapsed:.2f}s"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_frozen_peer_keeps_its_connections_and_is_lost_after_the_liveness_timeout(scheme):
    url = with_options(f"{scheme}://127.0.0.1:{free_port()}", **LIVENESS)
    victim = _hold(url, 2)
    try:
        channels = run_all([lambda r=r: dp.connect(url, rank=r, world_size=3, job="exits", timeout=30) for r in (0, 1)])
        try:
            run_all([lambda c=c: c.rendezvous(timeout=30) for c in channels])
            assert '"ready"' in victim.stdout.readline()
            os.kill(victim.pid, signal.SIGSTOP)
            start = time.monotonic()
            errors = run_all([lambda c=c: expect(dp.PeerLost, c.barrier, "after", 30) for c in channels])
            elapsed = time.monotonic() - start
        finally:
            close_all(channels)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
        victim.kill()
        victim.communicate(timeout=10)
    assert "no message for" in str(errors[0]), str(errors[0])
    assert LIVENESS["liveness_timeout"] - 1 < elapsed < LIVENESS["liveness_timeout"] + 3, f"{elapsed:.2f}s"
