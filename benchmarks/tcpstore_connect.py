"""Why torch's TCPStore takes ~10 s to connect 256 or 1024 clients (benchmarks/swarm.py): not
scaling, but stalls of 5 s inside single connects.

    python -m benchmarks.tcpstore_connect [--clients 64]

Connects ``--clients`` TCPStore clients one after another (no concurrency) to one TCPStore
server, libuv and classic backends, and the same number of plain Python sockets to the same
IPv4-mapped address (``::ffff:127.0.0.1``, what torch connects to). Counts connects over
1 s. Writes ``benchmarks/results/tcpstore_connect.json``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.common import free_port, machine

RESULTS = Path(__file__).resolve().parent / "results"


def torch_connects(n: int, libuv: bool) -> list[float]:
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60), use_libuv=libuv
    )
    clients, seconds = [], []
    for _ in range(n):
        t = time.perf_counter()
        clients.append(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)))
        seconds.append(time.perf_counter() - t)
    del clients, server
    return seconds


def socket_connects(n: int) -> list[float]:
    server = socket.socket(socket.AF_INET6)
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::", 0))
    server.listen(4096)
    port = server.getsockname()[1]
    accepted = []
    acceptor = threading.Thread(target=lambda: [accepted.append(server.accept()) for _ in range(n)], daemon=True)
    acceptor.start()
    clients, seconds = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_INET6)
        t = time.perf_counter()
        s.connect(("::ffff:127.0.0.1", port))
        seconds.append(time.perf_counter() - t)
        clients.append(s)
    acceptor.join(timeout=10)
    for s in clients + [conn for conn, _ in accepted]:
        s.close()
    server.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "tcpstore_connect.json")
    args = parser.parse_args(argv)
    runs = {
        "TCPStore client, libuv server": torch_connects(args.clients, libuv=True),
        "TCPStore client, classic server": torch_connects(args.clients, libuv=False),
        "Python socket, same address": socket_connects(args.clients),
    }
    result = {"machine": machine(), "clients": args.clients, "runs": {}}
    print(f"{args.clients} connects, one after another:")
    for name, seconds in runs.items():
        slow = [round(s, 2) for s in seconds if s > 1.0]
        result["runs"][name] = {"total_s": sum(seconds), "over_1s": len(slow), "slow_s": slow}
        print(f"  {name:32s} total {sum(seconds):6.2f} s   {len(slow)} over 1 s {slow}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
