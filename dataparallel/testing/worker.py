"""Rank processes for the conformance suite: ``python -m dataparallel.testing.worker ROLE ...``.

Each role connects with the given URL (so the transport is found through the registry,
entry points included), does its part, prints one JSON line to stdout and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dataparallel as dp


def _gloo(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .common import count_multi_gets, held_rank

    counted = count_multi_gets([ch])
    rank = held_rank(ch)

    dist.init_process_group(
        "gloo", store=ch.as_store(), rank=rank, world_size=ch.world_size, timeout=timedelta(seconds=60)
    )
    try:
        summed = torch.tensor([float(rank + 1), 2.0**rank])
        dist.all_reduce(summed)
        shared = torch.full((3,), float(rank))
        dist.broadcast(shared, src=ch.world_size - 1)
        dist.barrier()
        gathered: list[dict[str, int]] = [{} for _ in range(ch.world_size)]  # each replaced by a rank's dict
        dist.all_gather_object(gathered, {"rank": rank, "pid": os.getpid()})
        # A second group exercises the store again after init (new_group uses it).
        group = dist.new_group(list(range(ch.world_size)))
        again = torch.ones(1)
        dist.all_reduce(again, group=group)
        return {
            "rank": rank,
            "sum": summed.tolist(),
            "broadcast": shared.tolist(),
            "gathered": [g["rank"] for g in gathered],
            "group_sum": again.item(),
            "multi_gets": counted[rank],
        }
    finally:
        dist.destroy_process_group()


def _hold(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    print(json.dumps({"ready": ch.rank, "hosts": ch.hosts_coordinator}), flush=True)
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline:  # until killed or stopped by the test
        time.sleep(0.05)
    return {"rank": ch.rank, "held": args.hold}


def _write(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    """Write every 50 ms until a write fails (the rank was frozen, declared lost, resumed)."""
    print(json.dumps({"ready": ch.rank}), flush=True)
    last_write: float | None = None
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


def _busy_adds(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    """Add 1 to ``--key`` as fast as it can until ``{key}/stop`` is set: the rank the tests
    freeze at whatever point of a write it has reached."""
    print(json.dumps({"ready": ch.rank}), flush=True)
    adds = 0
    deadline = time.monotonic() + args.hold
    while time.monotonic() < deadline and not ch.check([f"{args.key}/stop"]):
        ch.add(args.key, 1)
        adds += 1
    return {"rank": ch.rank, "adds": adds}


def timed_barriers(ch: dp.ControlChannel, rounds: int, timeout: float) -> dict[str, Any]:
    """``rounds`` barriers, each one's entry and exit time recorded (one clock per machine)."""
    times: list[tuple[float, float]] = []
    for _ in range(rounds):
        entered = time.monotonic()
        ch.barrier("rounds", timeout=timeout)
        times.append((entered, time.monotonic()))
    return {"rank": ch.rank, "times": times}


def _barriers(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    return timed_barriers(ch, args.rounds, args.timeout)


#: Keys of the contenders' start line (see :func:`start_line`).
READY_KEY = "start-line/ready/{rank}"
GO_KEY = "start-line/go"


def start_line(ch: dp.ControlChannel, timeout: float) -> float:
    """Say this rank is ready, then wait for the wall-clock instant the test sets at
    :data:`GO_KEY` once every contender is ready. Only ``set`` and ``get``: a broken ``add``
    or ``compare_set`` (what the contenders test) cannot hang it, as it would a barrier."""
    ch.set(READY_KEY.format(rank=ch.rank), str(os.getpid()).encode())
    return float(ch.get(GO_KEY, timeout=timeout))


def contend(work: Callable[[int], Any], threads: int, start_at: float, timeout: float) -> list[Any]:
    """``work(thread_index)`` on ``threads`` threads, all released at ``start_at``
    (``time.time()``: one clock for every process on this machine); the results in order."""
    gate = threading.Barrier(threads, timeout=timeout)

    def run(index: int) -> Any:
        gate.wait()
        time.sleep(max(0.0, start_at - time.time()))
        return work(index)

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(run, i) for i in range(threads)]
        return [f.result(timeout=timeout) for f in futures]


def count_adds(ch: dp.ControlChannel, key: str, times: int) -> list[int]:
    """``add(key, 1)`` ``times`` times; what each returned."""
    return [ch.add(key, 1) for _ in range(times)]


def claim_rounds(ch: dp.ControlChannel, prefix: str, me: str, rounds: int) -> list[str]:
    """``compare_set(prefix + str(i), b"", me)`` for each round ``i``; what each returned."""
    return [ch.compare_set(f"{prefix}{i}", b"", me.encode()).decode(errors="replace") for i in range(rounds)]


def contender_name(rank: int | None, thread: int) -> str:
    return f"rank{rank}/pid{os.getpid()}/thread{thread}"


def _adds(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    start_at = start_line(ch, args.timeout)
    values = contend(lambda _: count_adds(ch, args.key, args.rounds), args.threads, start_at, args.timeout)
    return {"rank": ch.rank, "pid": os.getpid(), "values": values}


def _compare_set(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    start_at = start_line(ch, args.timeout)

    def work(thread: int) -> dict[str, Any]:
        me = contender_name(ch.rank, thread)
        return {"contender": me, "got": claim_rounds(ch, args.key, me, args.rounds)}

    return {"rank": ch.rank, "pid": os.getpid(), "contenders": contend(work, args.threads, start_at, args.timeout)}


def leave_state(ch: dp.ControlChannel) -> None:
    """What a job leaves behind when it dies mid-run: a key of its own, and (every rank but
    the last) a barrier entered that never completes."""
    import contextlib
    import threading

    ch.set(f"leftover/{ch.rank}", b"from the crashed run")
    if ch.rank != ch.world_size - 1:

        def enter() -> None:
            with contextlib.suppress(dp.ControlError):  # cut short by the crash
                ch.barrier("unfinished", timeout=300)

        threading.Thread(target=enter, daemon=True).start()
        time.sleep(0.3)  # in the barrier before the test kills it


def _crash_mid_run(ch: dp.ControlChannel, args: argparse.Namespace) -> dict[str, Any]:
    leave_state(ch)
    return _hold(ch, args)


ROLES = {
    "adds": _adds,
    "crash-mid-run": _crash_mid_run,
    "barriers": _barriers,
    "busy-adds": _busy_adds,
    "compare-set": _compare_set,
    "gloo": _gloo,
    "hold": _hold,
    "write": _write,
}
#: The exit status of a worker whose connect raised a ControlError.
CONNECT_FAILED = 3
#: Roles that wait at their own start line instead of the rendezvous (a barrier, built on
#: ``add``: the primitive they test).
OWN_START_LINE = {"adds", "compare-set"}


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
    parser.add_argument(
        "--rounds", type=int, default=50, help="barriers, adds per thread, compare_set rounds the roles make"
    )
    parser.add_argument("--threads", type=int, default=4, help="threads of the adds and compare-set roles")
    parser.add_argument("--key", default="contended", help="the key (prefix) the adds and compare-set roles use")
    parser.add_argument("--no-rendezvous", action="store_true", help="start the role right after connect")
    args = parser.parse_args(argv)
    from .relayfarm import register_if_farmed

    register_if_farmed()
    try:
        ch = dp.connect(
            args.url, rank=args.rank, world_size=args.world_size, job=args.job, token=args.token, timeout=args.timeout
        )
    except dp.ControlError as err:
        print(json.dumps({"connect_failed": f"{type(err).__name__}: {err}"}), flush=True)
        return CONNECT_FAILED
    try:
        if not args.no_rendezvous and args.role not in OWN_START_LINE:
            ch.rendezvous()
        result = ROLES[args.role](ch, args)
        if args.role == "gloo":
            ch.barrier("__worker_done")  # rank 0 may host the coordinator: leave together
    except Exception:
        # Said before the channel closes: its departure fails the others' collectives, and a
        # test may kill this process as soon as it sees that.
        traceback.print_exc()
        sys.stderr.flush()
        result = None
    finally:
        try:
            ch.close()
        except dp.ControlError:
            pass  # cut off (the write role's end): the others already know
    if result is None:
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
