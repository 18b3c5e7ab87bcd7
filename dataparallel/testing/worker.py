"""Rank processes for the conformance suite: ``python -m dataparallel.testing.worker ROLE ...``.

Each role connects with the given URL (so the transport is found through the registry,
entry points included), does its part, prints one JSON line to stdout and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import dataparallel as dp


def _gloo(ch: dp.ControlChannel, args: argparse.Namespace) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .conformance import _count_multi_gets

    counted = _count_multi_gets([ch])

    dist.init_process_group(
        "gloo", store=ch.as_store(), rank=ch.rank, world_size=ch.world_size, timeout=timedelta(seconds=60)
    )
    try:
        summed = torch.tensor([float(ch.rank + 1), 2.0**ch.rank])
        dist.all_reduce(summed)
        shared = torch.full((3,), float(ch.rank))
        dist.broadcast(shared, src=ch.world_size - 1)
        dist.barrier()
        gathered: list[object] = [None] * ch.world_size
        dist.all_gather_object(gathered, {"rank": ch.rank, "pid": os.getpid()})
        # A second group exercises the store again after init (new_group uses it).
        group = dist.new_group(list(range(ch.world_size)))
        again = torch.ones(1)
        dist.all_reduce(again, group=group)
        return {
            "rank": ch.rank,
            "sum": summed.tolist(),
            "broadcast": shared.tolist(),
            "gathered": [g["rank"] for g in gathered],
            "group_sum": again.item(),
            "multi_gets": counted[ch.rank],
        }
    finally:
        dist.destroy_process_group()


def _hold(ch: dp.ControlChannel, args: argparse.Namespace) -> dict:
    print(json.dumps({"ready": ch.rank}), flush=True)
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:  # until killed or stopped by the test
        time.sleep(0.05)
    return {"rank": ch.rank, "held": args.hold}


def _write(ch: dp.ControlChannel, args: argparse.Namespace) -> dict:
    """Write every 50 ms until a write fails (the rank was frozen, declared lost, resumed)."""
    print(json.dumps({"ready": ch.rank}), flush=True)
    last_write = None
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:
        try:
            ch.set(f"writer/{ch.rank}", str(time.monotonic()).encode())
            last_write = time.monotonic()
        except dp.ControlError as err:
            return {
                "rank": ch.rank,
                "error": type(err).__name__,
                "message": str(err),
                "last_write": last_write,
                "failed_at": time.monotonic(),
            }
        time.sleep(0.05)
    return {"rank": ch.rank, "error": None, "last_write": last_write}


def timed_barriers(ch: dp.ControlChannel, rounds: int, timeout: float) -> dict:
    """``rounds`` barriers, each one's entry and exit time recorded (one clock per machine)."""
    times = []
    for _ in range(rounds):
        entered = time.monotonic()
        ch.barrier("rounds", timeout=timeout)
        times.append((entered, time.monotonic()))
    return {"rank": ch.rank, "times": times}


def _barriers(ch: dp.ControlChannel, args: argparse.Namespace) -> dict:
    return timed_barriers(ch, args.rounds, args.timeout)


ROLES = {"barriers": _barriers, "gloo": _gloo, "hold": _hold, "write": _write}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--url", required=True)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--job", default="default")
    parser.add_argument("--token", default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--hold", type=float, default=60.0, help="seconds the hold role stays")
    parser.add_argument("--rounds", type=int, default=50, help="barriers the barriers role makes")
    parser.add_argument("--no-rendezvous", action="store_true", help="start the role right after connect")
    args = parser.parse_args(argv)
    ch = dp.connect(
        args.url, rank=args.rank, world_size=args.world_size, job=args.job, token=args.token, timeout=args.timeout
    )
    try:
        if not args.no_rendezvous:
            ch.rendezvous()
        result = ROLES[args.role](ch, args)
        if args.role == "gloo":
            ch.barrier("__worker_done")  # rank 0 may host the coordinator: leave together
    finally:
        try:
            ch.close()
        except dp.ControlError:
            pass  # cut off (the write role's end): the others already know
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
