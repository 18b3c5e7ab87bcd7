"""Driver + followers in separate processes: rendezvous over a control channel, then a gloo
process group initialised through it, and an all-reduce.

    python examples/allreduce_demo.py --nprocs 3                 # zmq on a free local port
    dataparallel launch --nprocs 3 --url tcpstore://127.0.0.1:29500 examples/allreduce_demo.py
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

import dataparallel as dp
from dataparallel.launching import in_worker, relaunch


def worker() -> None:
    ch = dp.connect(timeout=60)  # URL, rank and world size from the launcher's environment
    world_size = ch.world_size
    start = time.perf_counter()
    ch.rendezvous()
    dp.init_process_group(ch, timeout=60)
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
    parser.add_argument("--nprocs", type=int, default=3, help="processes to start when run by hand")
    args = parser.parse_args()
    if in_worker():
        worker()
        return 0
    return relaunch(__file__, [], nprocs=args.nprocs)


if __name__ == "__main__":
    sys.exit(main())
