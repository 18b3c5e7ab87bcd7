"""etcd-specific behaviour: a server restart and the loss of a cluster member mid-job, and
cleanup of a finished job's keys. Real etcd servers, started here."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
from etcdserver import EtcdServer, cluster_leader, require_etcd, start_cluster
from jobutil import exercise, open_job, spawn

import dataparallel as dp
from dataparallel.control.eventloop import bounded
from dataparallel.testing import close_all, run_all, with_options
from dataparallel.testing.linearizability import Faults, run_workload
from dataparallel.testing.netproxy import TcpProxy

OPTS = {"heartbeat": 0.2, "liveness_timeout": 4}


@pytest.fixture(autouse=True)
def _etcd_available():
    require_etcd()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("down", [0.5, 2.5])
def test_job_carries_on_across_an_etcd_restart(tmp_path, down):
    """etcd stopped for ``down`` seconds and started again with its data: a get waiting all
    along gets the key set after, the job goes on, no rank is lost. The outage (``down`` and
    etcd's start, seconds more on a loaded machine) spans several of the get's slices (a
    second each) and stays well inside the liveness timeout (10 s), past which it would be a
    loss."""
    server = EtcdServer(tmp_path / "data").start().wait_ready()
    try:
        channels = open_job(with_options(server.url + "/restart", **{**OPTS, "liveness_timeout": 10}), 2)
        exercise(channels, "before")
        got: list[bytes | BaseException] = []

        def wait_for_it() -> None:
            try:
                got.append(channels[0].get("after-restart", timeout=30))
            except BaseException as err:
                got.append(err)

        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        server.stop()  # same data dir and ports: the member comes back with its data
        time.sleep(down)
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


@pytest.mark.timeout(120)
def test_calls_failing_together_on_a_dead_member_move_on_once(tmp_path):
    """Calls in flight together when the member they talk to dies move to the next member
    together, once: the client is replaced once (each failing call moving it on by one
    member could bring some back to the dead one)."""
    members = start_cluster(tmp_path, 3)
    try:
        leader = cluster_leader(members)
        followers = [m for m in members if m is not leader]
        # The first member a follower (its death elects nobody), the next one alive.
        order = [followers[0], leader, followers[1]]
        endpoints = ",".join(f"127.0.0.1:{m.client_port}" for m in order)
        with dp.connect(with_options(f"etcd://{endpoints}/failover", **OPTS), rank=0, world_size=1, timeout=30) as ch:
            made: list[int] = []
            new_client = ch._new_client

            def counted():
                made.append(ch._current)
                return new_client()

            ch._new_client = counted
            order[0].stop()
            run_all([partial(ch.set, f"k{i}", b"v") for i in range(12)])
            assert made == [1], f"the client was replaced {len(made)} times, for members {made}"
            assert all(ch.get(f"k{i}", timeout=5) == b"v" for i in range(12))
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


def _events_sent(server: EtcdServer) -> float:
    """etcd's count of the watch events it has sent (``etcd_debugging_mvcc_events_total``,
    counted after a watch's filters), from its own ``/metrics``."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.client_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r"^etcd_debugging_mvcc_events_total (\S+)$", text, re.MULTILINE)
    assert found, "etcd's /metrics has no etcd_debugging_mvcc_events_total"
    return float(found.group(1))


@pytest.mark.timeout(120)
def test_ranks_joining_one_by_one_cost_watch_events_linear_in_the_ranks(tmp_path):
    """Every rank watches the job's alive keys for one that vanishes: a join's put must not
    reach the ranks already there (N ranks joining one after another were N^2/2 events:
    525 for 32), so what etcd sends for a whole job's joins and rendezvous grows as N."""
    server = EtcdServer(tmp_path / "data").start().wait_ready()
    n = 32
    try:
        url = with_options(server.url + "/joins", **OPTS)
        before = _events_sent(server)
        channels = []
        try:
            for rank in range(n):
                channels.append(dp.connect(url, rank=rank, world_size=n, job="joins", timeout=30))
            run_all([partial(c.rendezvous, timeout=60) for c in channels], 90)
            sent = _events_sent(server) - before
        finally:
            close_all(channels)
        # What is left: the rendezvous's release, one event per rank watching it.
        assert sent <= 2 * n, f"{sent:.0f} watch events for {n} ranks joining one by one"
    finally:
        server.stop()


def _requests(server: EtcdServer) -> dict[str, float]:
    """etcd's count of the unary requests it answered, by method (``Range``, ``Txn``, ...),
    from its own ``/metrics``."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.client_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'^grpc_server_handled_total\{grpc_code="OK",grpc_method="(\w+)",[^}]*grpc_type="unary"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


@pytest.mark.timeout(120)
def test_a_rank_joins_in_one_transaction(tmp_path, monkeypatch):
    """A rank's claim, its liveness markers and its host and pid go to etcd in one
    transaction: three requests fewer than the core's way (the claim's read and write, the
    markers, the publication), counted by etcd, for a rank asked for and one assigned."""
    from dataparallel.control.channel import ControlChannel
    from dataparallel.transports.etcd import EtcdChannel

    server = EtcdServer(tmp_path / "data").start().wait_ready()
    url = with_options(server.url + "/once", heartbeat=100, liveness_timeout=400)  # no background traffic
    channels: list[dp.ControlChannel] = []

    def joining(rank: int | None) -> float:
        before = _requests(server)
        channels.append(dp.connect(url, rank=rank, world_size=5, job="once", timeout=30))
        after = _requests(server)
        return sum(after.values()) - sum(before.values())

    try:
        channels.append(dp.connect(url, rank=0, world_size=5, job="once", timeout=30))
        # Assigned first, then asked for: each assigned rank is handed a held rank (0, then 2)
        # before a free one (1, then 3), so both ways pay for one failed claim.
        ours = joining(None), joining(2)
        monkeypatch.setattr(EtcdChannel, "_claim_rank", ControlChannel._claim_rank)
        core = joining(None), joining(4)
        assert [c.rank for c in channels] == [0, 1, 2, 3, 4]
        for what, mine, theirs in zip(["assigned", "asked for"], ours, core, strict=True):
            assert theirs - mine == 3, f"a rank {what}: {mine:.0f} requests, {theirs:.0f} the core's way"
        run_all([partial(c.rendezvous, timeout=30) for c in channels], 60)
        assert channels[0].peer_info(2)["pid"] > 0
    finally:
        close_all(channels[::-1])
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


# ---------------------------------------------------------------------- exactly once, fencing
LONG = {"heartbeat": 10, "liveness_timeout": 30}  # no keep-alive traffic through the proxy meanwhile


@pytest.fixture
def proxied(tmp_path):
    """An etcd server, a TCP proxy in front of it, and a job of two ranks: rank 0 through the
    proxy, rank 1 directly."""
    server = EtcdServer(tmp_path / "data").start().wait_ready()
    proxy = TcpProxy(server.client_port)
    try:
        direct = with_options(f"{server.url}/once", **LONG)
        through = with_options(f"etcd://127.0.0.1:{proxy.port}/once", **LONG)
        channels = run_all(
            [
                lambda: dp.connect(through, rank=0, world_size=2, job="once"),
                lambda: dp.connect(direct, rank=1, world_size=2, job="once"),
            ]
        )
        yield proxy, channels
        close_all(channels)
    finally:
        proxy.close()
        server.stop()


@pytest.mark.timeout(120)
def test_a_mutation_whose_reply_is_lost_is_applied_exactly_once(proxied):
    # etcd commits the call; the proxy swallows its reply and resets the connection; the
    # client sends it again. It must find its own result, not apply the call a second time.
    # (add and delete read the key first: the reply lost is the second request's.)
    proxy, (a, b) = proxied
    a.set("n", b"10")
    for expected in (11, 12, 13):
        proxy.lose_next_reply(skip=1)
        assert a.add("n", 1) == expected
        assert b.get("n") == str(expected).encode()
    a.set("gone", b"x")
    proxy.lose_next_reply(skip=1)
    assert a.delete("gone") is True, "a delete that removed the key reports it, even when retried"
    proxy.lose_next_reply()
    a.set("s", b"1")  # one request: a transaction
    b.set("s", b"2")
    a.add("other", 1)  # a's next call: a retried set would have landed by now
    assert b.get("s") == b"2", "a retried set overwrote a later one"


@pytest.mark.timeout(120)
def test_a_get_blocked_across_a_connection_reset_still_returns_the_value(proxied):
    proxy, (a, b) = proxied
    got: list[object] = []

    def wait() -> None:
        try:
            got.append(a.get("later", timeout=30))
        except Exception as err:  # the assertion shows what escaped
            got.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    proxy.drop_connections()
    time.sleep(0.5)
    b.set("later", b"v")
    waiter.join(timeout=40)
    assert got == [b"v"]


@pytest.mark.timeout(120)
def test_a_rank_whose_lease_expired_is_fenced_and_closes_cleanly(tmp_path):
    server = EtcdServer(tmp_path / "data").start().wait_ready()
    try:
        a, b = open_job(with_options(server.url + "/fence", **OPTS), 2)
        a._run(a._client.revoke_lease(a._lease.id))  # what expiry does to a frozen rank
        with pytest.raises(dp.ChannelClosed, match="declared lost"):
            a.add("n", 1)
        with pytest.raises(dp.ChannelClosed, match="declared lost"):
            a.set("n", b"1")  # fails at once from now on
        a.close()  # no raw client error (lease not found) escapes
        with pytest.raises(dp.PeerLost):
            b.barrier("after", timeout=30)
        b.close()
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_store_is_linearizable_across_an_etcd_kill_and_restart(tmp_path):
    server = EtcdServer(tmp_path / "data").start().wait_ready()

    def restart() -> None:
        server.stop()  # SIGKILL
        server.start().wait_ready()  # same data dir and ports

    try:
        faults = Faults(reset_every=1.5, events=[(1.5, restart)])
        report, _ = run_workload(
            server.url + "/lin",
            tmp_path / "history",
            clients=4,
            ops=1100,
            min_seconds=5,
            faults=faults,
            options=OPTS,
            min_operations=4000,
        )
    finally:
        server.stop()
    assert report.ok, str(report)
    assert report.operations >= 4000


def test_a_call_given_up_leaves_no_error_behind_to_hold_the_channel(tmp_path, caplog):
    """A call whose caller's wait timed out is cancelled; should it end with an error of its
    own instead (a gRPC call's cancellation can come out as a lost connection), that error is
    taken, not left on the task: asyncio logs an error it finds never retrieved with its
    traceback, whose frames hold the channel for as long as the log record lives (a channel
    dropped unclosed was still referenced a minute on)."""
    import asyncio
    import gc
    import logging
    import weakref

    server = EtcdServer(tmp_path / "data").start().wait_ready()
    try:
        ch = dp.connect(with_options(server.url + "/given-up", **OPTS), rank=0, world_size=1, timeout=10)
        try:

            async def refusing_its_cancellation() -> None:
                try:
                    await asyncio.sleep(5)
                except asyncio.CancelledError:
                    raise dp.ChannelClosed("the connection went with the cancellation") from None

            with caplog.at_level(logging.ERROR, logger="asyncio"):
                for call in (refusing_its_cancellation(), bounded(refusing_its_cancellation(), 5)):
                    with pytest.raises(dp.ChannelClosed, match=r"did not answer within 0\.5s"):
                        ch._run(call, 0.5)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and not caplog.records:
                    gc.collect()
                    time.sleep(0.1)
            assert not [r.getMessage() for r in caplog.records]
            gone = weakref.ref(ch)
        finally:
            ch.close()
        del ch
        gc.collect()
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        server.stop()
