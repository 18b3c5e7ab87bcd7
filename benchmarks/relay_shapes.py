"""A barrier through node relays, by node shape, against torch's TCPStore in the same run.

A shape ``NODESxRANKS`` runs NODES relay processes (each joined to the job's channel as one
member, hosting the local leg its ranks reach through shared memory) and NODES*RANKS rank
processes connecting with ``relay://``; each rank enters ``--rounds`` barriers after a
rendezvous. Beside it, as a repeat's other half (the order alternating), the same number of
processes run TCPStore add+wait barriers (each adds to a counter, the last sets a key, all
wait for it). Every rank and relay is its own process on this one machine, so the figures
include what NODES relays and NODES*RANKS ranks cost together on its cores.

    python -m benchmarks.relay_shapes --shapes 4x8 1x32 --kinds zmq grpc etcd --repeats 5

Writes ``benchmarks/results/relay_shapes.json``: per kind, per shape, the median barrier
(ms, process 0's, the first fifth of rounds left out as warm-up) of every repeat, the
TCPStore figure of the same repeat, the mean per-repeat ratio with its 95% interval, and the
verdict against the target for that shape (met only when the whole interval lies within it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import free_port, machine, percentile, ratio_interval, timed, verdict, write_result
from benchmarks.control_plane import barrier_latency, start_server

RESULTS = Path(__file__).resolve().parent / "results"

#: Targets: the barrier's ratio to TCPStore add+wait, at most (a shape of one node: 0.5x).
TARGETS = {"zmq": 1.0, "grpc": 2.0, "etcd": 5.0}
ONE_NODE_TARGET = 0.5


def node_main(kind: str, port: int, node: int, nodes: int, per_node: int, directory: str) -> None:
    """One node's relay: joined upstream, serving its ranks until stdin closes."""
    import dataparallel as dp
    from dataparallel.control.relay.node import NodeRelay

    up = dp.connect(f"{kind}://127.0.0.1:{port}", rank=node, world_size=nodes, job="bench~nodes", timeout=120)
    relay = NodeRelay(up, directory, local_ranks=per_node, node_rank=node, nodes=nodes, job="bench")
    print(f"ready {relay.path}", flush=True)
    sys.stdin.read()
    relay.close()
    up.close()


def rank_main(path: str, rank: int, n: int, rounds: int) -> None:
    import dataparallel as dp

    ch = dp.connect(f"relay://{path}", rank=rank, world_size=n, job="bench", timeout=120)
    ch.rendezvous()
    samples = timed(lambda: ch.barrier("b"), rounds)
    ch.barrier("end")  # nobody leaves while others measure
    if rank == 0:
        kept = [t * 1e3 for t in samples[rounds // 5 :]]
        print(json.dumps({"median_ms": statistics.median(kept), "p99_ms": percentile(kept, 99)}), flush=True)
    ch.close()


def relayed_barrier(kind: str, nodes: int, per_node: int, rounds: int) -> float:
    """Median ms of a barrier of ``nodes * per_node`` ranks behind ``nodes`` relays; NaN if the run failed."""
    port = free_port()
    server = start_server("etcd", port) if kind == "etcd" else None  # zmq/grpc: node 0's relay hosts it
    me = [sys.executable, "-m", "benchmarks.relay_shapes"]
    relays: list[subprocess.Popen] = []
    ranks: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as scratch:
        try:
            for node in range(nodes):
                where = ["--port", str(port), "--index", str(node), "--nodes", str(nodes)]
                relays.append(
                    subprocess.Popen(
                        [*me, "--node", kind, *where, "--per-node", str(per_node), "--dir", f"{scratch}/node{node}"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            paths = []
            for relay in relays:
                line = relay.stdout.readline().split()
                if not line or line[0] != "ready":
                    raise RuntimeError("a relay did not start")
                paths.append(line[1])
            n = nodes * per_node
            size = ["--n", str(n), "--rounds", str(rounds)]
            for rank in range(n):
                ranks.append(
                    subprocess.Popen(
                        [*me, "--rank-worker", paths[rank // per_node], "--index", str(rank), *size],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            out, _ = ranks[0].communicate(timeout=600)
            for p in ranks[1:]:
                p.wait(timeout=60)
        except (subprocess.TimeoutExpired, RuntimeError) as err:
            print(f"{kind} {nodes}x{per_node}: {err}", file=sys.stderr)
            out = ""
        finally:
            for p in ranks:
                p.kill()
            for relay in relays[1:] + relays[:1]:  # node 0's (the coordinator's host) last
                try:
                    relay.communicate(input="", timeout=30)
                except (subprocess.TimeoutExpired, OSError):
                    relay.kill()
            if server is not None:
                server.kill()
    lines = out.strip().splitlines()
    return json.loads(lines[-1])["median_ms"] if lines else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4x8", "1x32"])
    parser.add_argument("--kinds", nargs="+", default=["zmq", "grpc", "etcd"])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "relay_shapes.json")
    parser.add_argument("--node", help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--per-node", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:
        node_main(args.node, args.port, args.index, args.nodes, args.per_node, args.dir)
        return
    if args.rank_worker:
        rank_main(args.rank_worker, args.index, args.n, args.rounds)
        return

    result: dict = {
        "command": "python -m benchmarks.relay_shapes " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "baseline": "TCPStore add+wait, the same number of processes, the same repeat",
        "kinds": {},
    }
    for shape in args.shapes:
        nodes, per_node = (int(x) for x in shape.split("x"))
        n = nodes * per_node
        for kind in args.kinds:
            pairs: list[tuple[float, float]] = []
            for r in range(args.repeats):
                halves = ["ours", "store"] if r % 2 == 0 else ["store", "ours"]
                got: dict[str, float] = {}
                for half in halves:
                    if half == "ours":
                        got[half] = relayed_barrier(kind, nodes, per_node, args.rounds)
                    else:
                        got[half] = barrier_latency("TCPStore add+wait", n, args.rounds)[0]
                pairs.append((got["ours"], got["store"]))
                print(
                    f"  {kind} {shape} repeat {r + 1}/{args.repeats}: {got['ours']:.3f} ms, "
                    f"TCPStore {got['store']:.3f} ms",
                    file=sys.stderr,
                    flush=True,
                )
            good = [(a, b) for a, b in pairs if not (math.isnan(a) or math.isnan(b))]
            interval = ratio_interval(good)
            target = ONE_NODE_TARGET if nodes == 1 else TARGETS.get(kind, math.inf)
            entry = {
                "barrier_ms": [a for a, _ in pairs],
                "tcpstore_ms": [b for _, b in pairs],
                "median_ms": statistics.median([a for a, _ in good]) if good else math.nan,
                "tcpstore_median_ms": statistics.median([b for _, b in good]) if good else math.nan,
                "ratio": interval[0] if interval else None,
                "ratio_95": [interval[1], interval[2]] if interval else None,
                "target_at_most": target,
                "verdict": verdict(interval, target),
            }
            result["kinds"].setdefault(kind, {})[shape] = entry
            shown = f"{interval[0]:.2f}x [{interval[1]:.2f}, {interval[2]:.2f}]" if interval else "n/a"
            print(f"{kind} {shape}: {entry['median_ms']:.3f} ms vs TCPStore {entry['tcpstore_median_ms']:.3f} ms, "
                  f"ratio {shown}, target <= {target}x: {entry['verdict']}", flush=True)  # fmt: skip
    write_result(args.out, result)


if __name__ == "__main__":
    main()
