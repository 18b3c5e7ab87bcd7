"""The coordinator's own cost as a job grows: per barrier arrival and per liveness sweep, for
N sessions of one job, with no transport (requests handed to :class:`Coordinator` in-process,
so only its state machine is timed). Side by side in the same run: the same measurement of a
baseline revision, checked out into a temporary git worktree and run in its own process.

    python -m benchmarks.coordinator_scale --sizes 32 1024 4096 12288 --baseline 1922a2d

Writes ``benchmarks/results/coordinator_scale.json``: per revision, per N, the median over
``--rounds`` barriers of (time for all N arrivals) / N in microseconds, and the median sweep
in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def measure(sizes: list[int], rounds: int) -> dict[str, dict[str, float]]:
    import dataparallel
    from dataparallel.control.coordinator import Coordinator

    print(f"  (the package in {Path(dataparallel.__file__).parent})", file=sys.stderr, flush=True)
    from dataparallel.control.wire import PROTOCOL_VERSION, pb

    out: dict[str, dict[str, float]] = {}
    for n in sizes:
        coord = Coordinator(lambda route, reply: None)
        sessions = []
        for rank in range(n):
            hello = pb.Hello(protocol=PROTOCOL_VERSION, job="j", world_size=n, nonce=os.urandom(16),
                             liveness_timeout=60.0, host="h", pid=1, heartbeat=1.0)  # fmt: skip
            session = coord.handle(rank, pb.Request(id=1, hello=hello)).session
            coord.handle(rank, pb.Request(id=2, session=session, register=pb.Register(rank=rank)))
            sessions.append(session)
        per_arrival, sweeps = [], []
        for i in range(rounds):
            collect = pb.Collect(name=f"barrier/b/{i}", want=True, timeout=30.0)
            t0 = time.perf_counter()
            for rank, session in enumerate(sessions):
                coord.handle(rank, pb.Request(id=3 + i, session=session, collect=collect))
            per_arrival.append((time.perf_counter() - t0) / n * 1e6)
            t0 = time.perf_counter()
            coord.sweep()
            sweeps.append((time.perf_counter() - t0) * 1e3)
        out[str(n)] = {"arrival_us": statistics.median(per_arrival), "sweep_ms": statistics.median(sweeps)}
        print(f"  N={n}: {out[str(n)]['arrival_us']:.1f} us per arrival, sweep {out[str(n)]['sweep_ms']:.2f} ms",
              file=sys.stderr, flush=True)  # fmt: skip
    return out


def at_revision(rev: str, sizes: list[int], rounds: int) -> dict[str, dict[str, float]]:
    """The same measurement with the package as it was at ``rev`` (its own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}  # its package, this file's measurement
            args = [sys.executable, __file__, "--worker", "--rounds", str(rounds), "--sizes", *map(str, sizes)]
            done = subprocess.run(args, env=env, cwd=tmp, stdout=subprocess.PIPE, text=True, timeout=3600, check=True)
            return json.loads(done.stdout)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 1024, 4096, 12288])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision measured the same way, in the same run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "coordinator_scale.json")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.sizes, args.rounds)))
        return
    from benchmarks.common import machine

    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip() or "this tree"  # fmt: skip
    result: dict[str, object] = {"machine": machine(), "rounds": args.rounds, "revisions": {}}
    revisions: dict[str, object] = {}
    if args.baseline:
        print(f"baseline {args.baseline}:", file=sys.stderr, flush=True)
        revisions[f"baseline {args.baseline}"] = at_revision(args.baseline, args.sizes, args.rounds)
    print(f"this tree ({head} + working changes):", file=sys.stderr, flush=True)
    revisions["this tree"] = measure(args.sizes, args.rounds)
    result["revisions"] = revisions
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
