"""What joining a job costs the coordinator, through node relays and directly.

A shape ``NODESxRANKS`` runs NODES node relays joined to one coordinator (hosted in this
process, which counts the requests it serves by operation) and NODES*RANKS ranks, threads
of this process released together, each connecting through its node's relay (``relay://``).
Beside it, in the same run, as many ranks connect to the coordinator directly. Counted for
each: the requests the ranks' joins cost the coordinator (heartbeats left out), per rank,
and the wall time from the release to the last rank joined.

    python -m benchmarks.relay_join --shapes 2x8 8x8 16x8 --kinds zmq grpc --repeats 3

A relay sends the calls that arrive while its last request of their kind is in flight in
the next one (see :mod:`dataparallel.control.relay.node`), so the count depends on how much
the ranks' joins overlap: threads of one interpreter overlap less than processes on their
own cores, so these are upper bounds of a real node's. Writes
``benchmarks/results/relay_join.json``: per kind and shape, each repeat's counts and time,
and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import free_port, machine

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
    return {op: n for op, n in spent.items() if n and op not in ("heartbeat", "collect")}


def measure(kind: str, nodes: int, per_node: int) -> dict:
    """One repeat of one shape: the relayed join and the direct one, on one coordinator."""
    import dataparallel as dp
    from dataparallel.control.relay.node import NodeRelay
    from dataparallel.testing import close_all, run_all

    n = nodes * per_node
    url = f"{kind}://127.0.0.1:{free_port()}"
    host = dp.connect(url, rank=0, world_size=1, job="host", timeout=60)
    coordinator = host._hosted
    assert coordinator is not None, "the coordinator is hosted in this process"
    scratch = tempfile.mkdtemp(prefix="dp-join-")
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
        relayed = _spent(before, coordinator.served())
        before = coordinator.served()
        direct, direct_s = _released(
            [lambda r=r: dp.connect(url, rank=r, world_size=n, job="d", timeout=60) for r in range(n)]
        )
        straight = _spent(before, coordinator.served())
    finally:
        close_all([c for c in ranks + direct if c is not None])
        for relay in relays:
            relay.close()
        close_all(ups)
        host.close()
    return {
        "relayed": {"requests": sum(relayed.values()), "by_op": relayed, "join_s": relayed_s},
        "direct": {"requests": sum(straight.values()), "by_op": straight, "join_s": direct_s},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["2x8", "8x8", "16x8"])
    parser.add_argument("--kinds", nargs="+", default=["zmq", "grpc"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "relay_join.json")
    args = parser.parse_args(argv)
    from benchmarks.swarm import parse_shape

    result: dict = {"machine": machine(), "command": " ".join(["python -m benchmarks.relay_join", *sys.argv[1:]])}
    for kind in args.kinds:
        for text in args.shapes:
            nodes, per_node = parse_shape(text)
            runs = [measure(kind, nodes, per_node) for _ in range(args.repeats)]
            n = nodes * per_node
            row = {"repeats": runs}
            for way in ("relayed", "direct"):
                requests = statistics.median(r[way]["requests"] for r in runs)
                row[way] = {
                    "requests": requests,
                    "per_rank": requests / n,
                    "per_node": requests / nodes,
                    "join_s": statistics.median(r[way]["join_s"] for r in runs),
                }
            result.setdefault(kind, {})[text] = row
            r, d = row["relayed"], row["direct"]
            print(
                f"{kind:5s} {text:6s} relayed: {r['requests']:6.0f} requests ({r['per_rank']:.2f}/rank, "
                f"{r['per_node']:.1f}/node) in {r['join_s'] * 1e3:6.0f} ms   direct: {d['requests']:6.0f} "
                f"({d['per_rank']:.2f}/rank) in {d['join_s'] * 1e3:6.0f} ms",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
