"""Rendezvous + ``init_process_group("gloo")`` time for N processes, per transport, against
torch's own ``init_process_group(init_method="tcp://...")`` (a TCPStore) in the same run.

    python -m benchmarks.rendezvous --sizes 2 4 8 16 --repeats 3

All N processes import torch first and wait for a common start signal; the time is from
the signal until the last rank has its process group (and passed one gloo barrier), so
interpreter start-up is not counted. Median over repeats. Writes
``benchmarks/results/rendezvous.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ["zmq", "grpc", "etcd", "tcpstore", "torch tcp://"]
WORKER = [sys.executable, "-m", "benchmarks.rendezvous", "--worker"]


def worker(kind: str, port: int, rank: int, n: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import dataparallel as dp
    from dataparallel.control.registry import transport_class

    if kind != "torch tcp://":
        transport_class(kind)  # imported before the clock starts, as torch's store is
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    start = float(sys.stdin.readline())  # the common start time
    while time.time() < start:
        time.sleep(0.0005)
    if kind == "torch tcp://":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timedelta(seconds=120)
        )
        ch = None
    else:
        ch = dp.connect(f"{kind}://127.0.0.1:{port}", rank=rank, world_size=n, job="rdzv", timeout=120)
        ch.rendezvous()
        dp.init_process_group(ch, timeout=120)
    dist.barrier()
    done = time.time()
    print(json.dumps({"seconds": done - start}), flush=True)
    dist.destroy_process_group()
    if ch is not None:
        ch.close()


def measure(kind: str, n: int) -> float:
    from benchmarks.common import free_port
    from benchmarks.control_plane import release_together, start_server

    port = free_port()
    server = start_server("etcd", port) if kind == "etcd" else None
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [*WORKER, kind, "--port", str(port), "--rank", str(r), "--n", str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(n)
    ]
    try:
        release_together(procs, 0.2)
        times = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])["seconds"] for p in procs]
    finally:
        for p in [*procs, *([server] if server else [])]:
            p.kill()
    return max(times)


def run(sizes: list[int], repeats: int, kinds: list[str] = KINDS) -> tuple[dict, dict]:
    """(median ms, p99 ms) per kind and N."""
    from tqdm import tqdm

    from benchmarks.common import percentile

    out: dict[str, dict[int, float]] = {k: {} for k in kinds}
    tails: dict[str, dict[int, float]] = {k: {} for k in kinds}
    with tqdm(total=len(sizes) * len(kinds) * repeats, desc="rendezvous+init", unit="run") as bar:
        for n in sizes:
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(repeats):  # interleaved, so drift hits every kind alike
                for kind in kinds:
                    bar.set_postfix_str(f"{kind} N={n}")
                    samples[kind].append(measure(kind, n) * 1e3)
                    bar.update()
            for kind in kinds:
                out[kind][n] = statistics.median(samples[kind])
                tails[kind][n] = percentile(samples[kind], 99)
    return out, tails


def report(result: dict[str, dict[int, float]]) -> None:
    print("\nrendezvous + init_process_group('gloo') + one barrier, ms (median; ratio to torch tcp://):")
    print("  N    " + "".join(f"{k:>22s}" for k in result))
    for n in result["torch tcp://"]:
        base = result["torch tcp://"][n]
        print(f"  {n:<4d} " + "".join(f"{result[k][n]:>12.1f} ({result[k][n] / base:4.2f}x)" for k in result))


def plot(result: dict[str, dict[int, float]], tails: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, values in result.items():
        sizes = sorted(values)
        line = ax.plot(sizes, [values[n] for n in sizes], marker="o", label=kind)[0]
        ax.plot(sizes, [tails[kind][n] for n in sizes], linestyle=":", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("processes N")
    ax.set_ylabel("rendezvous + gloo init, ms (dotted: p99)")
    ax.set_title("time to a ready gloo process group")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "rendezvous.json")
    parser.add_argument("--kinds", nargs="+", default=KINDS, help="default: all (torch tcp:// is always run)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.port, args.rank, args.n)
        return 0
    kinds = [k for k in args.kinds if k != "torch tcp://"] + ["torch tcp://"]
    result, tails = run(args.sizes, args.repeats, kinds)
    report(result)
    from benchmarks.common import machine

    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"machine": machine(), "ms": result, "p99_ms": tails, "repeats": args.repeats}
    args.out.write_text(json.dumps(summary, indent=2))
    plot(result, tails, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    from benchmarks.common import run_main

    run_main("benchmarks.rendezvous", main)
