"""etcd-specific behaviour: a server restart and the loss of a cluster member mid-job, and
cleanup of a finished job's keys. Real etcd servers, started here."""

from __future__ import annotations

import threading
import time

import pytest
from etcdserver import EtcdServer, require_etcd, start_cluster
from jobutil import exercise, open_job, spawn

import dataparallel as dp
from dataparallel.testing import close_all, with_options

OPTS = {"heartbeat": 0.2, "liveness_timeout": 4}


@pytest.fixture(autouse=True)
def _etcd_available():
    require_etcd()


@pytest.mark.timeout(120)
def test_job_carries_on_across_an_etcd_restart(tmp_path):
    server = EtcdServer(tmp_path / "data").start().wait_ready()
    try:
        channels = open_job(with_options(server.url + "/restart", **OPTS), 2)
        exercise(channels, "before")
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(channels[0].get("after-restart", timeout=30)))
        waiter.start()
        server.stop()  # same data dir and ports: the member comes back with its data
        time.sleep(0.5)
        server.start().wait_ready()
        channels[1].set("after-restart", b"yes")
        waiter.join(timeout=30)
        assert got == [b"yes"]
        exercise(channels, "after")
        assert channels[0].lost_peers() == {}
        close_all(channels)
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_job_carries_on_when_a_cluster_member_dies(tmp_path):
    members = start_cluster(tmp_path, 3)
    try:
        endpoints = ",".join(f"127.0.0.1:{m.client_port}" for m in members)
        channels = open_job(with_options(f"etcd://{endpoints}/cluster", **OPTS), 2)
        exercise(channels, "three-members")
        members[0].stop()  # the member every client talks to first
        exercise(channels, "two-members")
        assert channels[0].lost_peers() == {}
        close_all(channels)
    finally:
        for m in members:
            m.stop()


@pytest.mark.timeout(60)
def test_finished_job_leaves_no_keys_and_a_rerun_starts_clean(tmp_path):
    server = EtcdServer(tmp_path / "data").start().wait_ready()
    try:
        url = with_options(server.url + "/clean", **OPTS)
        for _ in range(2):  # the same job name twice: the second sees nothing of the first
            channels = open_job(url, 2, job="same")
            assert channels[0].check(["__dp/claim/0", "__dp/claim/1"])
            channels[0].set("data", b"x")
            close_all(channels)
        with dp.connect(url, rank=0, world_size=1, job="probe") as probe:
            assert probe.num_keys() > 0  # its own claim
        import asyncio

        import aetcd

        async def count() -> int:
            client = aetcd.Client(host="127.0.0.1", port=server.client_port)
            found = await client.get_prefix(b"/clean/")
            await client.close()
            return len(found)

        assert asyncio.run(count()) == 0
    finally:
        server.stop()


@pytest.mark.timeout(90)
def test_a_crashed_job_does_not_block_a_rerun_of_the_same_name(tmp_path):
    server = EtcdServer(tmp_path / "data").start().wait_ready()
    url = with_options(server.url + "/crash", heartbeat=0.2, liveness_timeout=2)
    crashed = spawn(
        [
            "-m",
            "dataparallel.testing.worker",
            "hold",
            "--url",
            url,
            "--rank",
            "0",
            "--world-size",
            "1",
            "--job",
            "again",
        ]
    )
    try:
        assert '"ready"' in crashed.stdout.readline()
        crashed.kill()  # no close: its claim on rank 0 stays until its lease expires
        crashed.communicate(timeout=10)
        time.sleep(2 + 1.5)
        with dp.connect(url, rank=0, world_size=1, job="again", timeout=10) as rerun:
            rerun.rendezvous()
            rerun.set("k", b"v")
    finally:
        crashed.kill()
        server.stop()
