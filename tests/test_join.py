"""Joining a coordinator-based job is one request after the session's hello: the coordinator
claims the rank, registers it and publishes its process in one step (``Join``), counted by
the coordinator itself, for fixed and assigned ranks alike; what the join wrote reads back
as the key/value calls wrote it before (``peer_info``, the claim keys); a held rank and a
full job are still refused naming the holder. The refusals' wording and timing on every
transport are the conformance suite's (``MembershipTests``)."""

from __future__ import annotations

import pytest

import dataparallel as dp
from dataparallel.control.keyspace import claim_key
from dataparallel.testing import close_all, free_port, run_all

SCHEMES = ["zmq", "grpc"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_join_is_one_request_after_the_hello(scheme):
    n = 6
    url = f"{scheme}://127.0.0.1:{free_port()}"
    host = dp.connect(url, rank=0, world_size=n, job="one", timeout=20)
    coordinator = host._hosted
    assert coordinator is not None
    others: list[dp.ControlChannel] = []
    try:
        before = coordinator.served()
        fixed = run_all([lambda r=r: dp.connect(url, rank=r, world_size=n, job="one", timeout=20) for r in (1, 2)])
        assigned = run_all([lambda: dp.connect(url, world_size=n, job="one", timeout=20)] * (n - 3))
        others = fixed + assigned
        after = coordinator.served()
        spent = {op: after.get(op, 0) - before.get(op, 0) for op in after}
        spent = {op: count for op, count in spent.items() if count and op != "heartbeat"}
        assert spent == {"hello": n - 1, "join": n - 1}, spent
        assert sorted(c.rank for c in [host, *others]) == list(range(n))
        run_all([lambda c=c: c.rendezvous(timeout=20) for c in [host, *others]])
        info = host.peer_info(others[-1].rank)
        assert info is not None and info["pid"] > 0 and info["host"]
        assert host._check([claim_key(r) for r in range(n)])  # as the key/value join left them
    finally:
        close_all(others)
        host.close()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_held_rank_and_a_full_job_are_refused_naming_the_holder(scheme):
    url = f"{scheme}://127.0.0.1:{free_port()}"
    host = dp.connect(url, rank=0, world_size=2, job="held", timeout=20)
    coordinator = host._hosted
    assert coordinator is not None
    other = dp.connect(url, world_size=2, job="held", timeout=20)
    try:
        assert other.rank == 1
        # Refused naming the holder's process, once the connect's timeout (3 s) shows it still held.
        with pytest.raises(dp.ControlError, match=r"rank 1 of job 'held' is already taken by pid \d+ on "):
            dp.connect(url, rank=1, world_size=2, job="held", timeout=3)
        with pytest.raises(dp.ControlError, match=r"job 'held' is full: all 2 ranks are taken"):
            dp.connect(url, world_size=2, job="held", timeout=3)
    finally:
        other.close()
        host.close()
