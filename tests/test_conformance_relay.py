"""The conformance suite through node relays: every rank, and every
channel that holds no rank, a ``relay+SCHEME://`` channel behind a relay of the farm
(:mod:`dataparallel.testing.relayfarm`, two ranks a node) joined to the transport under test.
The linearizability workload through relays, under faults, is ``RelayTests`` in every
transport's own suite."""

import itertools

import pytest
from etcdserver import silenced_server

import dataparallel as dp
from dataparallel.testing import RelayedConformance, close_all, free_port, run_all
from dataparallel.testing.relayfarm import FarmChannel, running

_names = itertools.count()


@pytest.fixture
def relay_farm():
    with running() as farm:
        yield farm


class TestRelayedMemory(RelayedConformance):
    @pytest.fixture
    def upstream_url(self):
        return f"memory://relayed-{next(_names)}"


class TestRelayedZmq(RelayedConformance):
    @pytest.fixture
    def upstream_url(self):
        return f"zmq://127.0.0.1:{free_port()}"


class TestRelayedGrpc(RelayedConformance):
    @pytest.fixture
    def upstream_url(self):
        return f"grpc://127.0.0.1:{free_port()}"


class TestRelayedTCPStore(RelayedConformance):
    @pytest.fixture
    def upstream_url(self):
        return f"tcpstore://127.0.0.1:{free_port()}"


class TestRelayedEtcd(RelayedConformance):
    @pytest.fixture
    def upstream_url(self, etcd, tmp_path):
        self.scratch = tmp_path
        return f"{etcd.url}/relayed{next(_names)}"

    def upstream_server(self, upstream_url):
        """etcd's store is no rank's: a server of its own, for the timeout tests to freeze or kill."""
        return silenced_server(self.scratch / f"silenced{next(_names)}")


def test_the_farm_puts_every_two_ranks_behind_a_relay_of_their_own(relay_farm):
    """What the classes above rely on: a ``relay+`` rank is a relayed channel, two ranks a
    node, each node's relay joined upstream as one member; ranks of different nodes meet and
    read each other's writes, which land upstream under the ranks' prefix."""
    url = "relay+" + f"memory://farm-{next(_names)}"
    channels = run_all([lambda r=r: dp.connect(url, rank=r, world_size=5, job="farmed", timeout=30) for r in range(5)])
    try:
        assert all(type(c) is FarmChannel for c in channels)
        paths = [c.url.path for c in channels]
        assert paths[0] == paths[1] != paths[2] == paths[3] != paths[4] != paths[0]
        run_all([c.rendezvous for c in channels])
        channels[4].set("from-4", b"x")
        assert channels[0].get("from-4", timeout=5) == b"x"
        upstream = relay_farm.upstream_of(url[len("relay+") :], "farmed", 5, None, node=2)
        assert upstream.world_size == 3 and upstream.rank == 2 and upstream.job == "farmed~nodes"
    finally:
        close_all(channels)


def test_a_timed_out_barrier_counts_the_ranks_of_every_node(relay_farm):
    """A barrier timed out behind relays says how many ranks had arrived, as a direct
    channel's does, the other nodes' ranks included: a node whose ranks have all arrived
    (crossing) and a node where some have (published once the barrier lasted a supervision
    tick). Four ranks as two nodes of two; ranks 0, 1 and 2 arrive, rank 3 never does."""
    from concurrent.futures import ThreadPoolExecutor

    url = "relay+" + f"memory://counted-{next(_names)}?heartbeat=0.2&liveness_timeout=10"
    channels = run_all([lambda r=r: dp.connect(url, rank=r, world_size=4, job="counted", timeout=30) for r in range(4)])
    try:
        run_all([c.rendezvous for c in channels])
        with ThreadPoolExecutor(2) as pool:
            others = [pool.submit(channels[r].barrier, "partial", 3.0) for r in (1, 2)]
            with pytest.raises(dp.ControlTimeout, match="3/4 ranks had arrived"):
                channels[0].barrier("partial", timeout=1.5)
            for other in others:
                with pytest.raises(dp.ControlTimeout, match="3/4 ranks had arrived"):
                    other.result(timeout=10)
    finally:
        close_all(channels)
