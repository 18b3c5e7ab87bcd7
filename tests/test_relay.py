"""The node relay end to end: relays (one per simulated node, in this process) joined to a
real job channel, ranks as real processes connecting through ``relay://``; the ranks' calls
pass through, their barriers cross once per node, and torch's gloo initialises and
all-reduces through the relayed store."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import dataparallel as dp
from dataparallel.control.relay.local import Geometry
from dataparallel.control.relay.node import ALL_GATHER, RANKS, NodeRelay, pack
from dataparallel.testing import close_all, free_port, run_all
from dataparallel.testing.linearizability import run_workload
from dataparallel.testing.netproxy import TcpProxy

RANK = textwrap.dedent(
    """
    import json, sys, time
    import dataparallel as dp
    url, rank, world, job, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    out = {}
    with dp.connect(url, rank=rank, world_size=world, job=job, timeout=60) as ch:
        ch.rendezvous()
        if mode == "kv":
            ch.set(f"from/{rank}", b"%d" % rank)
            out["others"] = [ch.get(f"from/{r}", timeout=30).decode() for r in range(world)]
            out["count"] = ch.add("counter", 1)
            ch.barrier("counted")
            out["total"] = ch.add("counter", 0)
            out["won"] = ch.compare_set("prize", b"", b"%d" % rank) == b"%d" % rank
            ch.barrier("prized")
            out["winner"] = ch.get("prize").decode()
            out["bcast"] = ch.broadcast("b", b"hello" if rank == 0 else None).decode()
            out["gathered"] = [v.decode() for v in ch.all_gather("g", b"r%d" % rank)]
            try:
                ch.set("text", b"x")
                ch.add("text", 1)
            except dp.BadMessage as err:
                out["add_on_text"] = type(err).__name__
            big = bytes(range(256)) * 4096  # 1 MiB
            if rank == 1:
                ch.set("big", big)
            out["big"] = ch.get("big", timeout=30) == big
            # The other calls, each through the relay's pass-through.
            mine = [f"own/{rank}/{i}" for i in range(3)]
            ch.multi_set(mine, [b"a", b"b", b"c"])
            out["multi"] = [v.decode() for v in ch.multi_get(mine, timeout=10)]
            ch.append(mine[0], b"+")
            out["appended"] = ch.get(mine[0]).decode()
            out["checked"] = [ch.check(mine), ch.check([*mine, "nobody/set/this"])]
            out["deleted"] = [ch.delete(mine[2]), ch.delete(mine[2])]
            ch.wait(mine[:2], timeout=10)
            out["keys"] = ch.num_keys() > 0
            for i in range(20):
                ch.barrier("loop")
        elif mode == "idle":  # no call of its own: its liveness alone must notice
            print("started", flush=True)
            deadline = time.time() + 60
            while ch.failure is None and time.time() < deadline:
                time.sleep(0.05)
            out["error"] = type(ch.failure).__name__
            out["message"] = str(ch.failure)
            out["at"] = time.time()
            print(json.dumps(out), flush=True)
            sys.exit(0)
        elif mode == "loop":
            print("started", flush=True)
            try:
                for i in range(100000):
                    ch.barrier("loop", timeout=60)
            except dp.ControlError as err:
                out["error"] = type(err).__name__
                out["message"] = str(err)
                out["at"] = time.time()
            print(json.dumps(out), flush=True)
            sys.exit(0)
        elif mode == "leave":  # rank 4 closes without entering the barrier the others wait in
            if rank == 4:
                ch.barrier("before")
                time.sleep(0.5)
            else:
                ch.barrier("before")
                start = time.time()
                try:
                    ch.barrier("never", timeout=60)
                except dp.ControlError as err:
                    out["error"] = type(err).__name__
                    out["message"] = str(err)
                    out["after"] = time.time() - start
            print(json.dumps(out), flush=True)
            sys.exit(0)
        elif mode == "gloo":
            import torch, torch.distributed as dist
            dist.init_process_group("gloo", store=ch.as_store(), rank=rank, world_size=world)
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t)
            out["sum"] = t.item()
            dist.barrier()
            dist.destroy_process_group()
        ch.barrier("end")
    print(json.dumps(out), flush=True)
    """
)


class Nodes:
    """``nodes`` relays, each joined to the job's channel at ``upstream_url`` as one member
    (of ``JOB~nodes``), each serving ``per_node`` ranks."""

    def __init__(
        self,
        tmp_path: Path,
        upstream_url: str,
        nodes: int,
        per_node: int,
        job: str = "j",
        geometry: Geometry | None = None,
    ) -> None:
        self.nodes, self.per_node, self.job = nodes, per_node, job
        self.upstreams = run_all(
            [
                lambda n=n: dp.connect(upstream_url, rank=n, world_size=nodes, job=f"{job}~nodes", timeout=60)
                for n in range(nodes)
            ]
        )
        self.relays = [
            NodeRelay(
                up, tmp_path / f"node{n}", local_ranks=per_node, node_rank=n, nodes=nodes, job=job, geometry=geometry
            )
            for n, up in enumerate(self.upstreams)
        ]

    def url(self, rank: int) -> str:
        return f"relay://{self.relays[rank // self.per_node].path}"

    def start(self, mode: str, options: str = "") -> list[subprocess.Popen]:
        world = self.nodes * self.per_node
        return [
            subprocess.Popen(
                [sys.executable, "-c", RANK, self.url(r) + options, str(r), str(world), self.job, mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]

    def run(self, mode: str, timeout: float = 120) -> list[dict]:
        procs = self.start(mode)
        results = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank {r}: {err[-3000:]}"
            results.append(json.loads(out.splitlines()[-1]))
        return results

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        # Node 0's relay hosts the coordinator: it closes last.
        run_all([lambda u=u: u.close() for u in self.upstreams[1:]])
        self.upstreams[0].close()


def _upstream(kind: str) -> str:
    return f"zmq://127.0.0.1:{free_port()}" if kind == "zmq" else f"memory://relays-{free_port()}"


@pytest.fixture(params=["zmq", "memory"])
def nodes(request, tmp_path):
    """Relays joined over a coordinator (zmq) or over a transport of keys alone (memory, as a
    user's own is: the core keeps its runs, claims and token in keys)."""
    n = Nodes(tmp_path, _upstream(request.param), nodes=2, per_node=3)
    yield n
    n.close()


@pytest.fixture
def zmq_nodes(tmp_path):
    n = Nodes(tmp_path, _upstream("zmq"), nodes=2, per_node=3)
    yield n
    n.close()


def test_ranks_behind_relays_read_write_and_meet_as_one_job(nodes):
    results = nodes.run("kv")
    world = 6
    for out in results:
        assert out["others"] == [str(i) for i in range(world)]
        assert out["total"] == world
        assert out["bcast"] == "hello"
        assert out["gathered"] == [f"r{i}" for i in range(world)]
        assert out["add_on_text"] == "BadMessage"
        assert out["big"] is True
        assert out["multi"] == ["a", "b", "c"] and out["appended"] == "a+"
        assert out["checked"] == [True, False] and out["deleted"] == [True, False] and out["keys"]
    assert sorted(out["count"] for out in results) == list(range(1, world + 1))  # each add applied once
    winners = {out["winner"] for out in results}
    assert len(winners) == 1 and sum(out["won"] for out in results) == 1


def test_the_store_through_relays_is_linearizable_while_batching(nodes, tmp_path):
    """Five client processes behind two relays run the linearizability workload (random
    set, get, check, add, compare_set and delete on three keys): the merged history is
    linearizable, with the relays sending concurrent sets, adds and compare_sets in batches
    (over a coordinator, counted there: fewer requests than writes)."""
    hosted = getattr(nodes.upstreams[0], "_hosted", None)
    before = dict(hosted.served()) if hosted else {}
    urls = [nodes.url(r) for r in range(nodes.nodes * nodes.per_node)]
    report, history = run_workload(
        "", tmp_path / "lin", clients=len(urls) - 1, ops=600, min_seconds=0, rank_urls=urls, job=nodes.job
    )
    assert report.ok, str(report)
    writes = sum(op.op in ("set", "add", "compare_set") for op in history)
    assert writes > 1500, writes
    if hosted is not None:
        after = hosted.served()
        batched = sum(after.get(op, 0) - before.get(op, 0) for op in ("multi_set", "multi_compare_set"))
        single = sum(after.get(op, 0) - before.get(op, 0) for op in ("set", "add", "compare_set"))
        assert batched > 0 and single + batched < writes, (writes, single, batched)


def test_ranks_joining_together_share_their_requests_upstream(tmp_path):
    """A node's ranks that join while their relay's request is in flight go upstream together
    in the next one: with the link to the coordinator stalled while eight ranks of two nodes
    start joining, each relay holds four compare_sets in flight or queued (one and three, or
    four at once), which go in at most two requests once the link flows; the whole join costs
    fewer requests than the ranks' one by one, and every rank holds its own rank. Adds to one
    key, the same way, and a batch of adds refused whole goes again one by one."""
    port = free_port()
    host = dp.connect(f"zmq://127.0.0.1:{port}", rank=0, world_size=1, job="host", timeout=30)
    coordinator = host._hosted
    assert coordinator is not None
    proxy = TcpProxy(port)
    nodes = Nodes(tmp_path, f"zmq://127.0.0.1:{proxy.port}", nodes=2, per_node=4)
    world = 8
    joined: dict[int, dp.ControlChannel] = {}
    try:
        before = dict(coordinator.served())
        proxy.stall()
        threads = [
            threading.Thread(
                target=lambda r=r: joined.__setitem__(r, dp.connect(nodes.url(r), rank=r, world_size=world, job="j")),
                daemon=True,
            )
            for r in range(world)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while any(relay._compare_sets.pending < 4 for relay in nodes.relays):  # in flight or queued
            assert time.monotonic() < deadline, [relay._compare_sets.pending for relay in nodes.relays]
            time.sleep(0.01)
        proxy.resume()
        for t in threads:
            t.join(timeout=60)
        assert sorted(joined) == list(range(world)) and all(joined[r].rank == r for r in joined)
        run_all([lambda c=c: c.rendezvous(timeout=30) for c in joined.values()])
        after = coordinator.served()
        spent = {op: after.get(op, 0) - before.get(op, 0) for op in after}
        spent = {op: n for op, n in spent.items() if n and op not in ("heartbeat", "collect")}
        assert spent.get("multi_compare_set", 0) >= 2, spent  # the queued ones (or all four), on each node
        # One by one: six each (the run pointer, the token, the claim, the heartbeat, the
        # loss report's check, the process record); here typically 22-25 for the eight.
        assert sum(spent.values()) < 6 * world, spent

        # Adds to one key, likewise: each relay's four adds go as one or two adds of their
        # sum, and each rank is answered with its own running total.
        before = dict(coordinator.served())
        proxy.stall()
        totals: dict[int, int] = {}
        adders = [
            threading.Thread(target=lambda r=r: totals.__setitem__(r, joined[r].add("count", 1)), daemon=True)
            for r in range(world)
        ]
        for t in adders:
            t.start()
        while any(relay._adds.pending < 4 for relay in nodes.relays):
            assert time.monotonic() < deadline + 30, [relay._adds.pending for relay in nodes.relays]
            time.sleep(0.01)
        proxy.resume()
        for t in adders:
            t.join(timeout=60)
        assert sorted(totals.values()) == list(range(1, world + 1)), totals
        assert coordinator.served()["add"] - before.get("add", 0) <= 4  # 2 when all four went as one

        # A batch refused whole goes one by one: node 0's adds of 3 to a key at 2**63 - 10 pass
        # the int64 range together; one by one, three of them fit.
        joined[0].add("edge", 2**63 - 10)
        proxy.stall()
        outcomes: dict[int, object] = {}

        def add_three(r: int) -> None:
            try:
                outcomes[r] = joined[r].add("edge", 3)
            except dp.ControlError as err:
                outcomes[r] = type(err).__name__

        adders = [threading.Thread(target=add_three, args=(r,), daemon=True) for r in range(4)]
        for t in adders:
            t.start()
        while nodes.relays[0]._adds.pending < 4:
            assert time.monotonic() < deadline + 60, nodes.relays[0]._adds.pending
            time.sleep(0.01)
        proxy.resume()
        for t in adders:
            t.join(timeout=60)
        assert sorted(map(str, outcomes.values())) == sorted(["BadMessage", *(str(2**63 - k) for k in (7, 4, 1))])
    finally:
        proxy.resume()
        close_all(list(joined.values()))
        nodes.close()
        proxy.close()
        host.close()


def test_ranks_waiting_for_one_key_share_their_relays_read_of_it(tmp_path):
    """Six ranks of two nodes wait for a key rank 0 has yet to write (as for the NCCL unique
    id): at no time does the coordinator hold more than one read of it per relay (one per
    waiting rank, six, without sharing; besides each relay's own read of its ranks' loss
    report); every rank gets the value once written. A rank whose
    wait ends before the read in flight does reads on its own, and returns at its timeout."""
    nodes = Nodes(tmp_path, _upstream("zmq"), nodes=2, per_node=4)
    coordinator = nodes.upstreams[0]._hosted
    world = 8
    channels = run_all([lambda r=r: dp.connect(nodes.url(r), rank=r, world_size=world, job="j") for r in range(world)])
    got: dict[int, bytes | str] = {}

    def read(rank: int, timeout: float) -> None:
        try:
            got[rank] = channels[rank].get("unique-id", timeout=timeout)
        except dp.ControlTimeout:
            got[rank] = "timeout"

    key = RANKS + channels[1]._scoped("unique-id")  # as the relays read it upstream
    try:
        # Each relay parks a read of the run's loss report of its own (a loss published is
        # news at once): counted before, apart from the key's.
        deadline = time.monotonic() + 10
        while coordinator.stats()["parked"] < 2:
            assert time.monotonic() < deadline, coordinator.stats()
            time.sleep(0.01)
        own = [coordinator.stats()["parked"]]
        assert own == [2], own
        readers = [threading.Thread(target=read, args=(r, 30), daemon=True) for r in range(1, world - 1)]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 30
        while [relay._reads.pending(key) for relay in nodes.relays] != [3, 3]:
            assert time.monotonic() < deadline, [relay._reads.pending(key) for relay in nodes.relays]
            time.sleep(0.01)
        parked = []
        for _ in range(150):  # 1.5 s: three of the core's read slices
            parked.append(coordinator.stats()["parked"])
            time.sleep(0.01)
        assert max(parked) == max(own) + 2, parked
        start = time.monotonic()
        read(world - 1, 0.3)  # on node 1, beside three reading together
        assert got.pop(world - 1) == "timeout" and 0.25 < time.monotonic() - start < 2
        channels[0].set("unique-id", b"nccl")
        for t in readers:
            t.join(timeout=30)
        assert got == {r: b"nccl" for r in range(1, world - 1)}
    finally:
        close_all(channels)
        nodes.close()


def _spent(coordinator, before: dict) -> dict:
    """The requests the coordinator served since ``before``, by operation (heartbeats left out)."""
    after = coordinator.served()
    return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0) and op != "heartbeat"}


def test_a_gather_through_relays_reads_all_its_values_together(tmp_path):
    """An all_gather and a gather of eight ranks behind two relays. The all_gather crosses
    the network once per node: counted at the coordinator, one collect per node a round and
    nothing else (a direct channel's ranks: a collect each). The gather's destination reads
    the values it waits for in one multi_get a slice, not a get per value. The results, and
    a broadcast's, are every rank's."""
    nodes = Nodes(tmp_path, _upstream("zmq"), nodes=2, per_node=4)
    coordinator = nodes.upstreams[0]._hosted
    world = 8
    channels = run_all([lambda r=r: dp.connect(nodes.url(r), rank=r, world_size=world, job="j") for r in range(world)])
    try:
        run_all([lambda c=c: c.rendezvous(timeout=30) for c in channels])
        everyone = [b"%d" % r for r in range(world)]
        before = dict(coordinator.served())
        for round_ in range(3):
            values = [b"%d.%d" % (round_, r) for r in range(world)]
            gathered = run_all([lambda c=c, v=values: c.all_gather("ag", v[c.rank], timeout=30) for c in channels])
            assert gathered == [values] * world
        spent = _spent(coordinator, before)  # (the relays' liveness ticks: a multi_set, a check, a parked get)
        assert spent.get("collect") == 3 * 2 and not {"set", "add", "multi_get", "delete_many"} & set(spent), spent
        before = dict(coordinator.served())
        gathered = run_all([lambda c=c: c.gather("g", b"%d" % c.rank, dst=5, timeout=30) for c in channels])
        assert gathered == [None] * 5 + [everyone] + [None] * 2
        spent = _spent(coordinator, before)
        assert spent.get("get", 0) == 0 and spent.get("multi_get", 0) >= 1, spent
        sent = run_all(
            [lambda c=c: c.broadcast("b", b"x" if c.rank == 3 else None, src=3, timeout=30) for c in channels]
        )
        assert sent == [b"x"] * world
    finally:
        close_all(channels)
        nodes.close()


def test_an_all_gather_asked_again_after_its_reply_was_lost_gets_the_same_outcome(tmp_path):
    """A rank whose reply from its relay was lost on the way (it waited past its bound) asks
    again for the same round, its value with it: it is given the round's outcome again at
    once, and the relay does not enter the round upstream a second time (with one rank a
    node, its asking again would otherwise be a new round of the name upstream, a round
    ahead of the other nodes, whose next round would then meet the wrong one)."""
    nodes = Nodes(tmp_path, _upstream("zmq"), nodes=2, per_node=1)
    coordinator = nodes.upstreams[0]._hosted
    channels = run_all([lambda r=r: dp.connect(nodes.url(r), rank=r, world_size=2, job="j") for r in range(2)])
    try:
        run_all([lambda c=c: c.rendezvous(timeout=30) for c in channels])
        gathered = run_all([lambda c=c: c.all_gather("ag", b"%d" % c.rank, timeout=30) for c in channels])
        assert gathered == [[b"0", b"1"]] * 2
        before = dict(coordinator.served())
        # Round 0 again, as RelayedChannel.all_gather's first look sends it: (round, timeout,
        # first value wanted), the wait, the name, the value, and that it gives its value.
        asked = pack(struct.pack("<qdq", 0, 30.0, 0), struct.pack("<d", 2.0), b"ag", b"0", b"\x01")
        start = time.monotonic()
        again = channels[0]._read(ALL_GATHER, asked, 2.0)
        assert time.monotonic() - start < 1.0, "the round's outcome is given again at once"
        assert again[0] == b"\x01" and again[2:] == [b"0", b"1"], again
        assert _spent(coordinator, before).get("collect", 0) == 0, "the round did not go upstream again"
        gathered = run_all([lambda c=c: c.all_gather("ag", b"next%d" % c.rank, timeout=30) for c in channels])
        assert gathered == [[b"next0", b"next1"]] * 2
    finally:
        close_all(channels)
        nodes.close()


def test_a_gather_too_large_for_one_reply_reads_its_values_one_by_one(tmp_path):
    """Values that together pass a rank's slot (16 KiB here, 8 MiB by default) but each fit
    it: an all_gather's ranks are given them in parts, each as much as the slot holds; a
    gather's destination, whose one multi_get's reply the relay refuses, reads them one by
    one."""
    nodes = Nodes(tmp_path, _upstream("zmq"), nodes=2, per_node=2, geometry=Geometry(slots=4, slot_bytes=16384))
    world = 4
    channels = run_all([lambda r=r: dp.connect(nodes.url(r), rank=r, world_size=world, job="j") for r in range(world)])
    try:
        values = [bytes([r]) * 6000 for r in range(world)]
        gathered = run_all([lambda c=c: c.all_gather("big", values[c.rank], timeout=30) for c in channels])
        assert gathered == [values] * world
        gathered = run_all([lambda c=c: c.gather("big", values[c.rank], dst=1, timeout=30) for c in channels])
        assert gathered == [None, values, None, None]
    finally:
        close_all(channels)
        nodes.close()


def test_a_barrier_crosses_the_network_once_per_node(zmq_nodes):
    """Counted at the coordinator: of the barriers' and the all_gather's collects, one per
    node, not one per rank."""
    nodes = zmq_nodes
    coordinator = nodes.upstreams[0]._hosted  # node 0's relay hosts it
    before = dict(coordinator.served())
    nodes.run("kv")
    after = coordinator.served()
    collects = after.get("collect", 0) - before.get("collect", 0)
    # rendezvous, counted, prized, 20 loops, end: 24 barriers, and one all_gather, each one
    # collect per node (the broadcast passes through the core's key/value steps).
    assert collects == 25 * 2, collects  # a direct channel's ranks: 25 * 6


def test_a_job_of_one_node_meets_in_shared_memory_alone(tmp_path):
    """With one node the relay's ranks meeting is the barrier (and their values, the
    all_gather): no collect reaches the coordinator, and every barrier still holds (the kv
    run's counts and prizes agree, its all_gather has every rank's value)."""
    nodes = Nodes(tmp_path, _upstream("zmq"), nodes=1, per_node=3)
    try:
        coordinator = nodes.upstreams[0]._hosted
        before = dict(coordinator.served())
        results = nodes.run("kv")
        assert [out["total"] for out in results] == [3] * 3 and sum(out["won"] for out in results) == 1
        assert [out["gathered"] for out in results] == [["r0", "r1", "r2"]] * 3
        assert coordinator.served().get("collect", 0) == before.get("collect", 0)
    finally:
        nodes.close()


def test_gloo_initialises_and_all_reduces_through_the_relays(nodes):
    results = nodes.run("gloo")
    assert [out["sum"] for out in results] == [21.0] * 6


def test_a_rank_that_was_given_another_job_or_size_is_refused(nodes):
    from dataparallel.errors import ConfigError

    with pytest.raises(ConfigError, match="world size 5, the relay's job has 6"):
        dp.connect(nodes.url(0), rank=0, world_size=5, job="j", timeout=10)
    with pytest.raises(ConfigError, match="job 'k', the relay's is 'j'"):
        dp.connect(nodes.url(0), rank=0, world_size=6, job="k", timeout=10)
    with pytest.raises(ConfigError, match=r"not one of this node's, 3\.\.5"):
        dp.connect(nodes.url(3), rank=0, world_size=6, job="j", timeout=10)


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_rank_killed_or_frozen_behind_a_relay_is_peer_lost_to_every_other_rank(nodes, how):
    """Killed or frozen (SIGSTOP) in the middle of barriers: every other rank, on its node and
    the other, raises PeerLost naming it, noticed by its relay, which watches its ranks (no
    rank watches another's heartbeats through the relays). Killed: the relay sees its process
    end and reports the loss where the run's ranks read losses, where every other relay's
    parked read of it returns at once; with a liveness timeout of 10 s, every rank is told
    on its next tick (0.2 s), within a second. Frozen: its beats
    in shared memory stop, and the relay reports it once they have for the liveness timeout
    (2 s there): within that, a tick or two, and margin."""
    options = "?heartbeat=0.2&liveness_timeout=" + ("10" if how == "killed" else "2")
    procs = nodes.start("loop", options)
    victim = 4  # on node 1
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()[-3000:]
        time.sleep(1.0)
        procs[victim].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        stopped = time.time()
        for r, p in enumerate(procs):
            if r == victim:
                continue
            out, err = p.communicate(timeout=60)
            got = json.loads(out.splitlines()[-1])
            assert got.get("error") == "PeerLost" and "peer rank 4 lost" in got["message"], (r, got, err[-2000:])
            assert "noticed by node 1's relay" in got["message"], got["message"]
            print(f"rank {r} told in {got['at'] - stopped:.3f}s")
            if how == "killed":
                assert got["at"] - stopped < 1.0, (r, got["at"] - stopped)
            else:
                assert "no heartbeat for" in got["message"], got["message"]
                assert got["at"] - stopped < 2.0 + 3.0, (r, got["at"] - stopped)
    finally:
        procs[victim].send_signal(signal.SIGCONT)
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_a_rank_that_closed_without_entering_a_barrier_ends_it_behind_a_relay(nodes):
    """As on a direct channel: a rank that closed cleanly without entering a barrier ends it
    at once for every other rank, on its node and the other, with PeerLeft naming it (not a
    timeout a minute later)."""
    results = nodes.run("leave")
    for r, out in enumerate(results):
        if r == 4:
            continue
        assert out.get("error") == "PeerLeft" and "rank 4" in out["message"], (r, out)
        # It left half a second after the barrier before; the others are told within a
        # liveness poll (a second) of it, and some margin.
        assert out["after"] < 0.5 + 1.0 + 3.0, (r, out)


def test_ranks_of_a_node_in_different_barriers_are_told(tmp_path):
    """Two ranks of one node enter barriers of different names: both are told, typed, at once."""
    up = dp.connect(f"memory://relay-{free_port()}", rank=0, world_size=1, job="one~nodes", timeout=20)
    relay = NodeRelay(up, tmp_path / "node", local_ranks=2, node_rank=0, nodes=1, job="one")
    try:
        url = f"relay://{relay.path}"
        chans = run_all([lambda r=r: dp.connect(url, rank=r, world_size=2, job="one", timeout=20) for r in (0, 1)])
        errors = run_all([lambda c=c: _error_of(lambda: c.barrier(f"mine/{c.rank}", timeout=20)) for c in chans])
        assert [type(e).__name__ for e in errors] == ["BadMessage", "BadMessage"], errors
        assert all("node 0 entered different barriers" in str(e) for e in errors)
        run_all([lambda c=c: c.close() for c in chans])
    finally:
        relay.close()
        up.close()


def _error_of(call) -> BaseException | None:
    try:
        call()
    except BaseException as err:
        return err
    return None


def test_a_relay_url_names_its_socket_and_is_not_served():
    from dataparallel.control.registry import parse_url
    from dataparallel.errors import ConfigError
    from dataparallel.transports.relay import RelayedChannel

    with pytest.raises(ConfigError, match="names no host"):
        dp.connect("relay://somehost/x.sock", rank=0, world_size=1, timeout=5)
    with pytest.raises(ConfigError, match="no socket path"):
        dp.connect("relay://", rank=0, world_size=1, timeout=5)
    with pytest.raises(ConfigError, match="hosted by its node's launcher"):
        RelayedChannel.check_url(parse_url("relay:///tmp/r.sock"), serving=True)
    assert "this machine only" in RelayedChannel.security(parse_url("relay:///tmp/r.sock"), None)


RELAY_HOST = textwrap.dedent(
    """
    import sys, time
    import dataparallel as dp
    from dataparallel.control.relay.node import NodeRelay
    up = dp.connect(sys.argv[1], rank=0, world_size=1, job="silenced~nodes", timeout=30)
    relay = NodeRelay(up, sys.argv[2], local_ranks=2, node_rank=0, nodes=1, job="silenced")
    print(relay.path, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(120)
def test_every_call_through_a_relay_keeps_its_timeout_when_the_relay_freezes_or_dies(tmp_path):
    """The conformance suite's timeout check with the relay as what fails: two relays, each
    in a process of its own (as a launcher hosts it) with a rank joined through it with
    ``timeout=T``; one relay frozen (SIGSTOP), one killed. Every blocking call on each rank,
    all started at that moment, returns or raises a ControlError within T plus the suite's
    slack, and so does ``close`` after them; a wait for keys through the frozen relay ends in
    ChannelClosed (nothing answered it), not a ControlTimeout."""
    from dataparallel.testing.conformance import TimeoutTests

    check = TimeoutTests()
    t = check.PROMISE
    hosts = [
        subprocess.Popen(
            [sys.executable, "-c", RELAY_HOST, f"memory://relay-host-{n}", str(tmp_path / f"node{n}")],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        paths = [h.stdout.readline().strip() for h in hosts]
        assert all(paths), paths
        channels = run_all(
            [lambda p=p: dp.connect(f"relay://{p}", rank=1, world_size=2, job="silenced", timeout=t) for p in paths]
        )
        hosts[0].send_signal(signal.SIGSTOP)
        hosts[1].send_signal(signal.SIGKILL)
        conditions = ["relay frozen", "relay killed"]
        calls = {
            f"{cond}: {name}": call
            for cond, ch in zip(conditions, channels, strict=True)
            for name, call in check._timed_calls(ch, cond.replace(" ", "-")).items()
        }
        timings = check._time_all(calls, check.PROMISE)
        closes = {f"{c}: close": ch.close for c, ch in zip(conditions, channels, strict=True)}
        timings.update(check._time_all(closes, check.PROMISE))
        check._check_bounds(timings, "the node relay frozen or killed")
        # Through a silent relay no key's absence was seen: a wait for keys ends closed (its
        # reads unanswered), never timed out, as a direct rank's whose coordinator froze.
        for name in ("get", "wait", "multi_get"):
            err = timings[f"relay frozen: {name}"].err
            assert isinstance(err, dp.ChannelClosed), f"relay frozen: {name}: {err!r}"
    finally:
        for h in hosts:
            h.send_signal(signal.SIGCONT)
            h.kill()
            h.wait(timeout=10)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda ch: ch.all_gather("never", b"v", timeout=3), id="all_gather"),
        pytest.param(lambda ch: ch.broadcast("never", src=1, timeout=3), id="broadcast"),
        pytest.param(lambda ch: ch.gather("never", b"v", dst=0, timeout=3), id="gather"),
        pytest.param(lambda ch: ch.barrier("never", timeout=3), id="barrier"),
    ],
)
def test_a_collective_keeps_its_timeout_when_the_store_behind_the_relay_freezes(tmp_path, call):
    """A rank's collective (timeout 3 s, its channel's 60 s) waiting for another node whose
    rank never comes, the coordinator frozen (SIGSTOP) behind the relays: the checks the rank
    makes between its looks (for a departed rank: reads that pass through to the frozen
    store) end by the collective's deadline, so the call raises a ControlError within its own
    timeout and the slack, not the channel's 60 s. (The waits themselves: the relay answers
    an all_gather's or barrier's looks itself; a broadcast's or gather's reads go upstream,
    and the relay answers each within its slice, unanswered, so the rank reads again until its
    deadline and then raises ChannelClosed, as a direct rank whose coordinator froze does.)"""
    from jobutil import standalone

    url = f"zmq://127.0.0.1:{free_port()}"
    with standalone(url, None) as server:
        nodes = Nodes(tmp_path, url, nodes=2, per_node=1)
        try:
            ch = dp.connect(nodes.url(0), rank=0, world_size=2, job="j", timeout=60)
            server.send_signal(signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(dp.ControlError):
                call(ch)
            took = time.monotonic() - start
            assert took < 3 + 1.5, f"took {took:.1f}s with timeout=3"
        finally:
            server.send_signal(signal.SIGCONT)
            nodes.close()


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda ch: ch.broadcast("never", src=1, timeout=2), id="broadcast"),
        pytest.param(lambda ch: ch.gather("never", b"v", dst=0, timeout=2), id="gather"),
        pytest.param(lambda ch: ch.get("never", timeout=2), id="get"),
    ],
)
def test_the_checks_between_a_waits_looks_end_by_its_deadline(tmp_path, call):
    """A relayed rank's wait for a rank that never comes (timeout 2 s, the channel's 20 s),
    whose looks the store answers, but whose departure check between them (a read of the
    job's departures, passed through the relay) the store holds: the check ends by the
    wait's deadline, so the call raises within its timeout and the slack, not the channel's
    20 s (a barrier's and an all_gather's were bounded so already)."""
    up = dp.connect(f"memory://relay-{free_port()}", rank=0, world_size=1, job="held~nodes", timeout=20)
    relay = NodeRelay(up, tmp_path / "node", local_ranks=2, node_rank=0, nodes=1, job="held")
    check, release = up._check, threading.Event()

    def held(keys):
        if any("__dp/departed" in k for k in keys):
            release.wait(25)  # the store holding the read (until the test ends)
        return check(keys)

    up._check = held
    try:
        ch = dp.connect(f"relay://{relay.path}", rank=0, world_size=2, job="held", timeout=20)
        start = time.monotonic()
        with pytest.raises(dp.ControlError):
            call(ch)
        took = time.monotonic() - start
        assert took < 2 + 0.5, f"took {took:.1f}s with timeout=2"
        ch.close()
    finally:
        release.set()
        relay.close()
        up.close()


def test_an_upstream_timeout_passes_through_as_itself(tmp_path):
    """An upstream call that answers with a ControlTimeout reaches the rank as that error,
    at once: only the relay's own silence is a closed channel."""
    from dataparallel.errors import ControlTimeout

    up = dp.connect(f"memory://relay-{free_port()}", rank=0, world_size=1, job="slow~nodes", timeout=20)
    relay = NodeRelay(up, tmp_path / "node", local_ranks=1, node_rank=0, nodes=1, job="slow")
    try:
        ch = dp.connect(f"relay://{relay.path}", rank=0, world_size=1, job="slow", timeout=20)

        def timed_out(key: str, value: bytes) -> None:
            raise ControlTimeout(f"set {key!r} upstream", 0.1)

        up._set = timed_out  # the upstream's next set times out, as a frozen store's would
        start = time.monotonic()
        with pytest.raises(ControlTimeout, match="upstream"):
            ch.set("k", b"v")
        assert time.monotonic() - start < 5.0
        assert ch.failure is None
        ch.close()
    finally:
        relay.close()
        up.close()


def test_the_ranks_liveness_crosses_once_per_node_per_tick(zmq_nodes):
    """Counted at the coordinator while the ranks loop in barriers: no rank beats upstream
    (no add, no read of another rank's heartbeat) or reads its run's loss report there; each
    relay writes its live ranks' heartbeats in one request a tick and reads the report once a
    tick for all of them (a check, and a get once there is a report)."""
    nodes = zmq_nodes
    coordinator = nodes.upstreams[0]._hosted
    interval, window = 0.2, 3.0
    procs = nodes.start("loop", f"?heartbeat={interval}&liveness_timeout=10")
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()[-3000:]
        time.sleep(1.0)
        before = dict(coordinator.served())
        time.sleep(window)
        after = coordinator.served()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    served = {op: after.get(op, 0) - before.get(op, 0) for op in after}
    ticks = window / interval
    assert served.get("add", 0) == 0, served  # a direct rank adds to its heartbeat every tick
    # One write and one read a tick per relay (two relays), give or take a tick; six direct
    # ranks read the report six times a tick, and a direct rank 0 every peer's heartbeat too.
    assert 2 * (ticks - 3) <= served.get("multi_set", 0) <= 2 * (ticks + 3), served
    assert served.get("check", 0) + served.get("get", 0) <= 2 * (ticks + 3), served


RELAY_NODE = textwrap.dedent(
    """
    import sys, time
    import dataparallel as dp
    from dataparallel.control.relay.node import NodeRelay
    url, node, nodes, per_node, job, directory = sys.argv[1:7]
    node, nodes, per_node = int(node), int(nodes), int(per_node)
    up = dp.connect(url, rank=node, world_size=nodes, job=job + "~nodes", timeout=30)
    relay = NodeRelay(up, directory, local_ranks=per_node, node_rank=node, nodes=nodes, job=job)
    print(relay.path, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(120)
def test_a_whole_node_paused_past_the_liveness_timeout_goes_on_when_it_resumes(tmp_path):
    """A job of one node whose relay and ranks are all stopped together (SIGSTOP: a paused VM,
    say) for longer than the ranks' liveness timeout (2 s) goes on when they resume: nobody
    was silent while the relay could look, so nobody is reported lost (one of the ranks
    frozen alone is: the frozen test above)."""
    url = f"zmq://127.0.0.1:{free_port()}?heartbeat=0.2&liveness_timeout=2"
    relay = subprocess.Popen(
        [sys.executable, "-c", RELAY_NODE, url, "0", "1", "3", "j", str(tmp_path / "node0")],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs: list[subprocess.Popen] = []
    try:
        path = relay.stdout.readline().strip()
        assert path, "the relay did not start"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    RANK,
                    f"relay://{path}?heartbeat=0.2&liveness_timeout=2",
                    str(r),
                    "3",
                    "j",
                    "loop",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(3)
        ]
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()[-3000:]
        time.sleep(0.5)
        node = [relay, *procs]
        for p in node:
            p.send_signal(signal.SIGSTOP)
        time.sleep(3.5)
        for p in node:
            p.send_signal(signal.SIGCONT)
        time.sleep(4.0)  # two liveness timeouts: a loss would have ended the ranks' barriers
        ended = {r: p.stdout.read() if p.poll() is not None else None for r, p in enumerate(procs)}
        assert all(out is None for out in ended.values()), ended
    finally:
        for p in [*procs, relay]:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(timeout=10)


@pytest.mark.timeout(180)
def test_a_node_lost_with_its_relay_is_peer_lost_to_the_other_nodes_ranks(tmp_path):
    """A node's relay process killed (its ranks lose their relay with it): the other node's
    ranks raise PeerLost naming the lost node's first rank and its ranks, whether they learn
    it from their barrier (the relays' barrier ends with the node's loss) or from the loss
    report a relay publishes once the relays' own liveness declared the node lost; within
    the relays' liveness timeout (2 s) and margin."""
    url = f"zmq://127.0.0.1:{free_port()}?heartbeat=0.2&liveness_timeout=2"
    host = subprocess.Popen(
        [sys.executable, "-c", RELAY_NODE, url, "1", "2", "2", "j", str(tmp_path / "node1")],
        stdout=subprocess.PIPE,
        text=True,
    )
    up = dp.connect(url, rank=0, world_size=2, job="j~nodes", timeout=30)  # hosts the coordinator
    relay = NodeRelay(up, tmp_path / "node0", local_ranks=2, node_rank=0, nodes=2, job="j")
    procs: list[subprocess.Popen] = []
    try:
        remote = host.stdout.readline().strip()
        assert remote, "node 1's relay did not start"
        paths = [str(relay.path), str(relay.path), remote, remote]
        options = "?heartbeat=0.2&liveness_timeout=10"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, f"relay://{p}{options}", str(r), "4", "j", "loop"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r, p in enumerate(paths)
        ]
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()[-3000:]
        time.sleep(1.0)
        host.send_signal(signal.SIGKILL)
        killed = time.time()
        for r in (0, 1):
            out, err = procs[r].communicate(timeout=60)
            got = json.loads(out.splitlines()[-1])
            assert got.get("error") == "PeerLost", (r, got, err[-2000:])
            assert "peer rank 2 lost" in got["message"] and "node 1's relay lost (ranks 2..3)" in got["message"], got
            assert got["at"] - killed < 2.0 + 3.0, (r, got["at"] - killed)
    finally:
        host.kill()
        host.wait(timeout=10)
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        relay.close()
        up.close()


def test_a_guest_passes_through_but_makes_no_rank_s_call(tmp_path):
    """A process without a seat at the relay (an observer, a rank=None not yet seated) reads
    and writes through it as a rank does, but a rank's own calls (its watch, its loss
    reads, a barrier's count) are refused: nobody watches a guest."""
    from dataparallel.control.relay.local import LocalClient
    from dataparallel.control.relay.node import LOSS, SET, WATCH, pack

    nodes = Nodes(tmp_path, f"memory://guest-{free_port()}", nodes=1, per_node=1)
    try:
        with LocalClient(nodes.relays[0].path, None, timeout=10) as guest:
            assert guest.local_rank is None
            guest.call(SET, pack(b"from-a-guest", b"x"), timeout=5)
            assert nodes.upstreams[0]._get(RANKS + "from-a-guest", 1.0) == b"x"
            for op in (WATCH, LOSS):
                with pytest.raises(dp.ConfigError, match="holds no seat"):
                    guest.call(op, pack(), timeout=5)
    finally:
        nodes.close()


@pytest.mark.timeout(60)
def test_a_ranks_waiting_reads_never_hold_up_its_other_calls(tmp_path):
    """A rank with more reads waiting for their keys than it has slots at the relay: a write
    from another thread goes through at once (a slot is kept free of waiting reads), and its
    liveness, reading through the relay each tick, never takes the wait for a dead store
    (0.2 s heartbeats, a 1 s liveness timeout, reads of 4 s)."""
    fast = "?heartbeat=0.2&liveness_timeout=1"
    nodes = Nodes(tmp_path, f"memory://waiting-{free_port()}{fast}", nodes=1, per_node=1)
    ch = dp.connect(nodes.url(0) + fast, rank=0, world_size=1, job=nodes.job, timeout=30)
    try:
        slots = ch._local.geometry.slots
        outcomes: list[BaseException | None] = []

        def read(i: int) -> None:
            try:
                ch.get(f"never/{i}", timeout=4)
            except dp.ControlError as err:
                outcomes.append(err)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(slots + 2)]
        for t in readers:
            t.start()
        time.sleep(0.5)
        start = time.monotonic()
        ch.set("written", b"meanwhile")
        assert time.monotonic() - start < 0.5, f"a write waited {time.monotonic() - start:.2f}s behind waiting reads"
        time.sleep(2.0)  # twice the liveness timeout
        assert ch.failure is None, ch.failure
        for t in readers:
            t.join(10)
        assert len(outcomes) == slots + 2 and all(isinstance(e, dp.ControlTimeout) for e in outcomes), outcomes
        assert ch.get("written", timeout=1) == b"meanwhile"
    finally:
        ch.close()
        nodes.close()


@pytest.mark.timeout(120)
def test_a_relays_channel_ending_ends_its_ranks_channels_at_their_next_call_or_tick(tmp_path):
    """Node 0's relay's own channel fails (as when its coordinator is gone, or the node was
    declared lost): its ranks, idle, fail with that failure, naming the relay, within a
    liveness tick or two (0.2 s heartbeats), not at their liveness timeout (2 s); a rank's
    call fails at once, as a directly connected rank's does on its coordinator's end. The
    other node's ranks go on."""
    fast = "?heartbeat=0.2&liveness_timeout=2"
    nodes = Nodes(tmp_path, f"memory://ended-{free_port()}{fast}", nodes=2, per_node=2)
    procs = nodes.start("idle", fast)
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "started", p.stderr.read()[-3000:]
        ended = time.time()
        nodes.upstreams[0].fail_with(dp.ChannelClosed("its coordinator is gone (the test's)"))
        for r, p in enumerate(procs[:2]):
            out, err = p.communicate(timeout=60)
            got = json.loads(out.splitlines()[-1])
            assert got["error"] == "ChannelClosed", (r, got, err[-2000:])
            assert "node 0's relay's channel failed: its coordinator is gone (the test's)" in got["message"], got
            assert got["at"] - ended < 1.0, (r, got["at"] - ended, got)
        assert all(p.poll() is None for p in procs[2:]), "node 1's ranks ended with node 0's relay's channel"
        with pytest.raises(dp.ChannelClosed, match="node 0's relay's channel failed"):
            dp.connect(nodes.url(0), rank=0, world_size=4, job=nodes.job, timeout=5).close()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
        nodes.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective", ["barrier", "all_gather"])
def test_a_relays_channel_failing_under_a_crossing_collective_ends_its_ranks_channel_with_it(tmp_path, collective):
    """A rank waits in a barrier or all_gather its relay has taken upstream (the other node's
    rank never comes) when the relay's own channel fails: the rank's call ends with that
    failure, naming the relay, and its channel has failed with it at once, as a directly
    connected rank's fails on its coordinator's end (not at its next call or liveness tick:
    its heartbeats here are 5 s apart). An upstream collective's own error (its time out)
    is not fatal; the relay's end is."""
    slow = "?heartbeat=5&liveness_timeout=30"
    nodes = Nodes(tmp_path, f"memory://crossing-{free_port()}", nodes=2, per_node=1)
    try:
        ch = dp.connect(nodes.url(0) + slow, rank=0, world_size=2, job=nodes.job, timeout=30)
        other = dp.connect(nodes.url(1) + slow, rank=1, world_size=2, job=nodes.job, timeout=30)
        call = {
            "barrier": lambda: ch.barrier("crossing", timeout=20),
            "all_gather": lambda: ch.all_gather("crossing", b"v", timeout=20),
        }
        box: list[BaseException | None] = []

        def waits() -> None:
            try:
                call[collective]()
                box.append(None)
            except BaseException as err:
                box.append(err)

        t = threading.Thread(target=waits, daemon=True)
        t.start()
        time.sleep(1.0)  # the node's one rank has arrived: its relay waits upstream
        assert not box, box
        ended = time.monotonic()
        nodes.upstreams[0].fail_with(dp.ChannelClosed("its coordinator is gone (the test's)"))
        t.join(timeout=10)
        took = time.monotonic() - ended
        failure = ch.failure  # looked at once the call ended, before any liveness tick
        assert box and isinstance(box[0], dp.ChannelClosed), box
        assert "node 0's relay's channel failed: its coordinator is gone (the test's)" in str(box[0]), box
        assert took < 3.0, took
        assert failure is not None, "the rank's channel went on after its relay's channel failed"
        close_all([ch, other])
    finally:
        nodes.close()


@pytest.mark.timeout(120)
def test_idle_ranks_behind_relays_notice_their_store_gone_within_the_liveness_timeout(tmp_path):
    """The job's coordinator killed while the ranks make no call of their own: each rank's
    liveness fails its channel with ChannelClosed within its liveness timeout (2 s there), a
    tick or two and margin, as a directly connected rank's does. (A relay answers a rank's
    read of its loss report from the node's one read a tick, saying how old that read is:
    the rank judges its store by it.)"""
    from jobutil import standalone

    port = free_port()
    fast = "?heartbeat=0.2&liveness_timeout=2"
    with standalone(f"zmq://127.0.0.1:{port}", None) as coordinator:
        nodes = Nodes(tmp_path, f"zmq://127.0.0.1:{port}{fast}", nodes=2, per_node=2)
        procs = nodes.start("idle", fast)
        try:
            for p in procs:
                assert p.stdout.readline().strip() == "started", p.stderr.read()[-3000:]
            time.sleep(1.0)
            coordinator.kill()
            killed = time.time()
            for r, p in enumerate(procs):
                out, err = p.communicate(timeout=60)
                got = json.loads(out.splitlines()[-1])
                assert got["error"] == "ChannelClosed", (r, got, err[-2000:])
                # Whichever tells first: the ranks' reads, or the relay's channel ending.
                told = ("the node relay has had no answer from the store for", "relay's channel failed")
                assert any(t in got["message"] for t in told), got
                assert got["at"] - killed < 2.0 + 3.0, (r, got["at"] - killed, got)
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=10)
            for relay in nodes.relays:
                relay.close()
            for up in nodes.upstreams:
                up._fail(dp.ChannelClosed("the test's coordinator is gone"))
                up.close()
