"""A coordinator that dies — standalone, or inside the rank that hosts it — fails every
client's calls with ChannelClosed within the liveness timeout: zmq and grpc alike."""

from __future__ import annotations

import signal
import time

import pytest
from jobutil import FAST, exercise, expect, open_job, spawn

import dataparallel as dp
from dataparallel.testing import close_all, free_port, run_all, with_options

SCHEMES = ["zmq", "grpc"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_standalone_coordinator_death_fails_clients_fast(scheme):
    port = free_port()
    server = spawn(["-m", "dataparallel", "serve", f"{scheme}://127.0.0.1:{port}"])
    try:
        assert "serving" in server.stdout.readline()
        channels = open_job(with_options(f"{scheme}://127.0.0.1:{port}", **FAST), 2)
        assert not any(c.hosts_coordinator for c in channels)
        exercise(channels, "before")
        server.kill()
        start = time.monotonic()
        errors = run_all([lambda c=c: expect(dp.ChannelClosed, c.barrier, "after", 30) for c in channels])
        elapsed = time.monotonic() - start
        assert elapsed < FAST["liveness_timeout"] + 3, elapsed
        assert all("coordinator" in str(e) for e in errors), errors
        close_all(channels)
    finally:
        server.kill()
        server.communicate(timeout=10)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_death_of_the_hosting_rank_fails_the_others_fast(scheme):
    url = with_options(f"{scheme}://127.0.0.1:{free_port()}", **FAST)
    host = spawn(["-m", "dataparallel.testing.worker", "hold", "--url", url, "--rank", "0", "--world-size", "2"])
    try:
        follower = dp.connect(url, rank=1, world_size=2, timeout=30)
        follower.rendezvous()
        assert '"ready"' in host.stdout.readline()
        host.send_signal(signal.SIGKILL)
        start = time.monotonic()
        err = expect(dp.ChannelClosed, follower.get, "never", 30)
        assert time.monotonic() - start < FAST["liveness_timeout"] + 3
        assert "coordinator" in str(err)
        follower.close()
    finally:
        host.kill()
        host.communicate(timeout=10)
