"""What joining a job, an all_gather and a broadcast cost the coordinator, through node
relays and directly.

A shape ``NODESxRANKS`` runs NODES node relays joined to one coordinator (hosted in this
process, which counts the requests it serves by operation) and NODES*RANKS ranks, threads
of this process released together, each connecting through its node's relay (``relay://``),
then running ``--rounds`` all_gathers and broadcasts. Beside it, in the same repeat, as many
ranks connect to the coordinator directly and do the same. Counted for each: the requests
the coordinator served (heartbeats left out) for the join and per collective round, per
rank, and the wall time (the join's from the release to the last rank joined; a round's
median).

    python -m benchmarks.relay_requests --shapes 2x8 8x8 16x8 --kinds zmq grpc --repeats 3

A relay sends the calls that arrive while its last request of their kind is in flight in
the next one (see :mod:`dataparallel.control.relay.node`), so the count depends on how much
the ranks' joins overlap: threads of one interpreter overlap less than processes on their
own cores, so these are upper bounds of a real node's. Writes
``benchmarks/results/relay_requests.json``: per kind and shape, each repeat's counts and
times, and their medians.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import free_port, machine, write_result

RESULTS = Path(__file__).resolve().parent / "results"


def _released(connects: list) -> tuple[list, float]:
    """Run ``connects`` (callables returning a channel) as threads released together: the
    channels and the seconds from the release to the last one's return."""
    go = threading.Event()
    out: list = [None] * len(connects)
    errors: list[str] = []

    def run(i: int) -> None:
        go.wait()
        try:
            out[i] = connects[i]()
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(connects))]
    for t in threads:
        t.start()
    start = time.perf_counter()
    go.set()
    for t in threads:
        t.join(timeout=300)
    took = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    return out, took


def _spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    spent = {op: after.get(op, 0) - before.get(op, 0) for op in after}
    return {op: n for op, n in spent.items() if n and op != "heartbeat"}


COLLECTIVES = {
    "all_gather": lambda ch, i: ch.all_gather(f"ag{i}", b"%d" % ch.rank, timeout=60),
    "broadcast": lambda ch, i: ch.broadcast(f"bc{i}", b"x" if ch.rank == 0 else None, timeout=60),
}


def _collectives(coordinator, channels: list, rounds: int) -> dict:
    """Each collective ``rounds`` times on ``channels`` (all ranks at once): the requests the
    coordinator served per round, by operation, and the median round's time."""
    from dataparallel.testing import run_all

    out = {}
    for name, call in COLLECTIVES.items():
        before, times = coordinator.served(), []
        for i in range(rounds):
            start = time.perf_counter()
            run_all([functools.partial(call, ch, i) for ch in channels])
            times.append(time.perf_counter() - start)
        spent = _spent(before, coordinator.served())
        out[name] = {"requests": sum(spent.values()) / rounds, "by_op": spent, "round_s": statistics.median(times)}
    return out


def measure(kind: str, nodes: int, per_node: int, rounds: int) -> dict:
    """One repeat of one shape: the relayed ranks' join and collectives, and the direct
    ones', on one coordinator."""
    import dataparallel as dp
    from dataparallel.control.relay.node import NodeRelay
    from dataparallel.testing import close_all, run_all

    n = nodes * per_node
    url = f"{kind}://127.0.0.1:{free_port()}"
    host = dp.connect(url, rank=0, world_size=1, job="host", timeout=60)
    coordinator = host._hosted
    assert coordinator is not None, "the coordinator is hosted in this process"
    scratch = tempfile.mkdtemp(prefix="dp-requests-")
    ups = run_all(
        [lambda i=i: dp.connect(url, rank=i, world_size=nodes, job="r~nodes", timeout=60) for i in range(nodes)]
    )
    relays = [
        NodeRelay(up, os.path.join(scratch, str(i)), local_ranks=per_node, node_rank=i, nodes=nodes, job="r")
        for i, up in enumerate(ups)
    ]
    ranks: list = []
    direct: list = []
    try:
        before = coordinator.served()
        paths = [relays[r // per_node].path for r in range(n)]
        ranks, relayed_s = _released(
            [lambda r=r: dp.connect(f"relay://{paths[r]}", rank=r, world_size=n, job="r", timeout=60) for r in range(n)]
        )
        relayed = {"join": {"requests": sum(_spent(before, coordinator.served()).values()), "join_s": relayed_s}}
        run_all([lambda c=c: c.rendezvous(timeout=60) for c in ranks])
        relayed.update(_collectives(coordinator, ranks, rounds))
        before = coordinator.served()
        direct, direct_s = _released(
            [lambda r=r: dp.connect(url, rank=r, world_size=n, job="d", timeout=60) for r in range(n)]
        )
        straight = {"join": {"requests": sum(_spent(before, coordinator.served()).values()), "join_s": direct_s}}
        run_all([lambda c=c: c.rendezvous(timeout=60) for c in direct])
        straight.update(_collectives(coordinator, direct, rounds))
    finally:
        close_all([c for c in ranks + direct if c is not None])
        for relay in relays:
            relay.close()
        close_all(ups)
        host.close()
    return {"relayed": relayed, "direct": straight}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["2x8", "8x8", "16x8"])
    parser.add_argument("--kinds", nargs="+", default=["zmq", "grpc"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each collective per repeat")
    parser.add_argument("--out", type=Path, default=RESULTS / "relay_requests.json")
    args = parser.parse_args(argv)
    from benchmarks.swarm import parse_shape

    command = " ".join(["python -m benchmarks.relay_requests", *(argv if argv is not None else sys.argv[1:])])
    result: dict = {"machine": machine(), "command": command}
    for kind in args.kinds:
        for text in args.shapes:
            nodes, per_node = parse_shape(text)
            runs = [measure(kind, nodes, per_node, args.rounds) for _ in range(args.repeats)]
            n = nodes * per_node
            row: dict = {"repeats": runs}
            for way in ("relayed", "direct"):
                row[way] = {}
                for what in ("join", *COLLECTIVES):
                    requests = statistics.median(r[way][what]["requests"] for r in runs)
                    timing = "join_s" if what == "join" else "round_s"
                    row[way][what] = {
                        "requests": requests,
                        "per_rank": requests / n,
                        "per_node": requests / nodes,
                        timing: statistics.median(r[way][what][timing] for r in runs),
                    }
            result.setdefault(kind, {})[text] = row
            for what in ("join", *COLLECTIVES):
                r, d = row["relayed"][what], row["direct"][what]
                seconds = r.get("join_s", r.get("round_s", 0.0)), d.get("join_s", d.get("round_s", 0.0))
                print(
                    f"{kind:5s} {text:6s} {what:10s} relayed: {r['requests']:7.1f} requests ({r['per_rank']:.2f}/rank) "
                    f"in {seconds[0] * 1e3:6.1f} ms   direct: {d['requests']:7.1f} ({d['per_rank']:.2f}/rank) "
                    f"in {seconds[1] * 1e3:6.1f} ms",
                    flush=True,
                )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
