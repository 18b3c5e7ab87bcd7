import time

import pytest

from dataparallel.testing import ChannelConformance, free_port
from dataparallel.testing.conformance import FAST_LIVENESS, close_all, run_all, with_options
from dataparallel.transports.tcpstore import TCPStoreChannel


class TestTCPStoreChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self):
        return f"tcpstore://127.0.0.1:{free_port()}"


@pytest.mark.timeout(60)
def test_a_slow_new_connection_delays_the_join_and_never_costs_a_rank(monkeypatch):
    """TCPStore opens one connection per thread, and a new one now and then takes 5 s (torch
    looks the peer's address up in DNS; a dropped query waits out the resolver's timeout).
    The liveness thread's connection is made while joining: a slow one delays connect, and
    never lets a heartbeat lapse past a 2 s liveness timeout mid-job."""
    import dataparallel as dp

    made: dict[int, int] = {}
    real_clone = TCPStoreChannel._clone

    def slow_clone(self, within):
        made[self.rank] = made.get(self.rank, 0) + 1
        if self.rank == 1 and made[1] > 1:  # rank 1's connections after its first: the DNS stall
            time.sleep(3.0)
        return real_clone(self, within)

    monkeypatch.setattr(TCPStoreChannel, "_clone", slow_clone)
    url = with_options(f"tcpstore://127.0.0.1:{free_port()}", **FAST_LIVENESS)
    channels = run_all([lambda r=r: dp.connect(url, rank=r, world_size=2, job="slow", timeout=30) for r in range(2)])
    try:
        assert all(n >= 2 for n in made.values()), made  # the liveness threads' connections: at connect
        run_all([lambda c=c: c.barrier("after", timeout=20) for c in channels])
        time.sleep(3.0)  # past the liveness timeout, with every connection made
        run_all([lambda c=c: c.barrier("later", timeout=20) for c in channels])
        assert [c._liveness.lost() for c in channels] == [[], []]
    finally:
        close_all(channels)


@pytest.mark.timeout(60)
def test_a_write_whose_connection_breaks_after_it_left_is_never_sent_again():
    """set, multi_set and append have no reply in TCPStore's protocol: the channel follows each
    with a check on the same connection. When the connection breaks after the write's bytes
    left (a reset seen only by the check's send: "Broken pipe"), the server may have applied
    it: the channel reports ChannelClosed and does not send it again (an append applied twice
    here, and a set applied again after another client's write, broke linearizability)."""
    import threading

    import torch.distributed as dist

    import dataparallel as dp

    ch = dp.connect(f"tcpstore://127.0.0.1:{free_port()}", rank=0, world_size=1, job="twice", timeout=10)
    try:
        ch.append("k", b"a")
        real = ch._client()

        class BreaksAfterTheWrite:
            def __getattr__(self, name):
                return getattr(real, name)

            def check(self, keys):
                raise dist.DistNetworkError("Broken pipe")  # the reset, seen after the append went out

        ch._clients[threading.current_thread()] = (BreaksAfterTheWrite(), set())
        with pytest.raises(dp.ChannelClosed, match="may have been applied"):
            ch.append("k", b"b")
        assert ch.get("k", timeout=5) == b"ab"  # applied once, on a new connection's read
    finally:
        ch.close()
