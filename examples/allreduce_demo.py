"""Driver + followers in separate processes: rendezvous over a control channel, then a gloo
process group initialised through it, and an all-reduce.

    python examples/allreduce_demo.py --nprocs 3                 # zmq on a free local port
    python examples/allreduce_demo.py --nprocs 3 --transport tcpstore://127.0.0.1:29500
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from local_job import free_zmq_url, run_ranks

import dataparallel as dp


def worker(url: str, rank: int, world_size: int) -> None:
    ch = dp.connect(url, rank=rank, world_size=world_size, job="allreduce-demo", timeout=60)
    start = time.perf_counter()
    ch.rendezvous()
    dist.init_process_group(
        "gloo", store=ch.as_store(), rank=ch.rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    ready = time.perf_counter() - start
    value = torch.arange(4, dtype=torch.float64) * (ch.rank + 1)
    dist.all_reduce(value)
    expected = torch.arange(4, dtype=torch.float64) * sum(range(1, world_size + 1))
    assert torch.equal(value, expected), (value, expected)
    reports = ch.gather("report", f"rank {ch.rank}: ok, group ready in {ready * 1e3:.0f} ms".encode())
    if ch.rank == 0:
        print(f"driver: all_reduce over {world_size} processes = {value.tolist()} (expected {expected.tolist()})")
        for line in reports:
            print("  " + line.decode())
    dist.destroy_process_group()
    ch.barrier("done")
    ch.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=3)
    parser.add_argument("--transport", default=None, help="channel URL (default: zmq on a free local port)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.transport, args.rank, args.nprocs)
        return 0
    url = args.transport or free_zmq_url()
    print(f"starting {args.nprocs} processes on {url}")
    return run_ranks(__file__, args.nprocs, url)


if __name__ == "__main__":
    sys.exit(main())
