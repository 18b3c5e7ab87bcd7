"""Why torch's TCPStore took ~10 s to connect 256 or 1024 clients (benchmarks/swarm.py) on the
VM these figures come from: not scaling, and not TCPStore's server, but the resolver.

    python -m benchmarks.tcpstore_connect [--clients 64]

Torch looks up the name of the peer of every TCPStore connection, on both ends, for its logs
(``getnameinfo`` without ``NI_NUMERICHOST``). Over loopback the peer is ``::ffff:127.0.0.1``,
which no default hosts file names, so every connect asks DNS; where the resolver drops a
query, the connect waits out the resolver's timeout (5 s). In one run, on the system's
resolver and then with loopback's names in a hosts file (a private mount namespace, see
``benchmarks/common.py``; root only):

* ``--clients`` reverse lookups of ``::ffff:127.0.0.1`` one after another;
* ``--clients`` TCPStore clients connected one after another (no concurrency) to one
  TCPStore server, libuv and classic backends;
* the same number of plain Python sockets to the same address (no lookup: the floor).

Counts what took over 1 s. Writes ``benchmarks/results/tcpstore_connect.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.common import (
    LOCAL_LOOKUPS,
    can_look_up_locally,
    free_port,
    machine,
    reverse_lookup_s,
    with_local_lookups,
    write_result,
)

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


def measure(n: int) -> dict[str, list[float]]:
    return {
        "reverse lookup of ::ffff:127.0.0.1": [reverse_lookup_s() for _ in range(n)],
        "TCPStore client, libuv server": torch_connects(n, libuv=True),
        "TCPStore client, classic server": torch_connects(n, libuv=False),
        "Python socket, same address": socket_connects(n),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "tcpstore_connect.json")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # print one mode's runs as JSON
    args = parser.parse_args(argv)
    if args.inner:
        print(json.dumps(measure(args.clients)))
        return 0
    modes: dict[str, dict[str, list[float]] | None] = {"system resolver": None, "loopback names in a hosts file": None}
    if not os.environ.get(LOCAL_LOOKUPS):
        modes["system resolver"] = measure(args.clients)
    if can_look_up_locally() or os.environ.get(LOCAL_LOOKUPS):
        cmd = [sys.executable, "-m", "benchmarks.tcpstore_connect", "--inner", "--clients", str(args.clients)]
        cmd, env = with_local_lookups(cmd) if not os.environ.get(LOCAL_LOOKUPS) else (cmd, dict(os.environ))
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=True)
        finally:
            if env.get(LOCAL_LOOKUPS) != os.environ.get(LOCAL_LOOKUPS):
                Path(env[LOCAL_LOOKUPS]).unlink(missing_ok=True)
        modes["loopback names in a hosts file"] = json.loads(done.stdout.strip().splitlines()[-1])
    result: dict = {"machine": machine().split(";")[0], "clients": args.clients, "modes": {}}
    for mode, runs in modes.items():
        if runs is None:
            print(f"{mode}: not measured (needs root and unshare)")
            continue
        print(f"{mode}: {args.clients} one after another")
        result["modes"][mode] = {}
        for name, seconds in runs.items():
            slow = [round(s, 2) for s in seconds if s > 1.0]
            result["modes"][mode][name] = {"total_s": sum(seconds), "over_1s": len(slow), "slow_s": slow}
            print(f"  {name:36s} total {sum(seconds):6.2f} s   {len(slow)} over 1 s {slow}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())  # measures both ways itself
