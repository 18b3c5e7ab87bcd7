"""The node relay's local leg against torch's TCPStore, side by side in one run: a barrier
among N processes of one machine, through the relay's shared memory and eventfds
(:mod:`dataparallel.control.relay.local`: each rank adds to the node's arrivals eventfd; the
relay, once every rank's generation has reached the barrier, rings each rank's bell)
and through TCPStore (each process adds to a counter, the last sets a key, all wait for it).

    python -m benchmarks.relay_local --sizes 8 32 --rounds 300 --repeats 5

Writes ``benchmarks/results/relay_local.json``: per N, per kind, the median over ``--repeats``
runs of the mean barrier time in milliseconds (each run ``--rounds`` barriers after a warm-up,
timed by process 0), every run's figure, and the ratio to TCPStore. The two kinds alternate
within each repeat. This times the local leg alone: what a node's ranks pay to meet before
their relay's one upstream request.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.common import write_result

RESULTS = Path(__file__).resolve().parent / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay_rank(path: str, rank: int, rounds: int, out: mp.SimpleQueue) -> None:
    from dataparallel.control.relay.local import LocalClient

    with LocalClient(path, rank) as client:
        for _ in range(3):
            client.barrier("warm-up", timeout=60)
        start = time.perf_counter()
        for i in range(rounds):
            client.barrier(f"b/{i}", timeout=60)
        if rank == 0:
            out.put((time.perf_counter() - start) / rounds * 1e3)


def relay_barrier(n: int, rounds: int) -> float:
    from dataparallel.control.relay.local import Call, LocalServer

    def refuse(call: Call) -> None:
        call.fail(RuntimeError("no calls in this benchmark"))

    # The relay's default barrier handler releases each generation as soon as every rank reached it.
    with tempfile.TemporaryDirectory() as d, LocalServer(Path(d) / "relay", n, refuse) as server:
        return _run(n, _relay_rank, (str(server.path),), rounds)


def _store_rank(port: int, n: int, rank: int, rounds: int, out: mp.SimpleQueue) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=120), wait_for_workers=True)

    def barrier(i: int) -> None:
        if store.add(f"arrived/{i}", 1) == n:
            store.set(f"done/{i}", b"1")
        store.wait([f"done/{i}"])

    for i in range(3):
        barrier(-1 - i)
    start = time.perf_counter()
    for i in range(rounds):
        barrier(i)
    if rank == 0:
        out.put((time.perf_counter() - start) / rounds * 1e3)
    # Rank 0 hosts the server: it leaves once every other rank has said it is done.
    if rank == 0:
        while store.add("left", 0) < n - 1:
            time.sleep(0.01)
    else:
        store.add("left", 1)


def store_barrier(n: int, rounds: int) -> float:
    return _run(n, _store_rank, (_free_port(), n), rounds)


def _run(n: int, target, head: tuple, rounds: int) -> float:
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(*head, rank, rounds, out)) for rank in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return out.get()


KINDS = {"relay local leg": relay_barrier, "TCPStore add+wait": store_barrier}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "relay_local.json")
    args = parser.parse_args()
    import torch.distributed  # noqa: F401 - imported once, before the ranks are forked

    result: dict = {
        "command": "python -m benchmarks.relay_local " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "sizes": {},
    }
    for n in args.sizes:
        runs: dict[str, list[float]] = {k: [] for k in KINDS}
        for r in range(args.repeats):
            order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))
            for kind in order:
                runs[kind].append(KINDS[kind](n, args.rounds))
                print(
                    f"  N={n} repeat {r + 1}/{args.repeats} {kind}: {runs[kind][-1]:.3f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        medians = {k: statistics.median(v) for k, v in runs.items()}
        result["sizes"][str(n)] = {
            "barrier_ms": medians,
            "runs_ms": runs,
            "ratio_to_tcpstore": medians["relay local leg"] / medians["TCPStore add+wait"],
        }
        print(
            f"N={n}: relay local leg {medians['relay local leg']:.3f} ms, TCPStore add+wait "
            f"{medians['TCPStore add+wait']:.3f} ms, ratio {result['sizes'][str(n)]['ratio_to_tcpstore']:.2f}",
            flush=True,
        )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
