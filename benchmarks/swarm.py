"""Many lightweight ranks: rendezvous + barriers for N = 256 and 1024 ranks, run as threads
in a few processes, each thread a real channel (its own connection, session, heartbeats)
against one standalone coordinator (``dataparallel serve``), one etcd, or one TCPStore.

    python -m benchmarks.swarm --sizes 256 1024 --procs 4
    python -m benchmarks.swarm --sizes 1024 --kinds zmq grpc --baseline e87e4ff --repeats 3
    python -m benchmarks.swarm --shapes 16x8 128x8 --kinds zmq grpc "TCPStore add+wait"

With ``--shapes NODESxRANKS ...``, our transports run as nodes: each node a real node relay
(:class:`~dataparallel.control.relay.node.NodeRelay`) joined upstream as one member of NODES,
and its RANKS ranks real ``relay://`` channels through its local leg (shared memory), the
relays objects and the ranks threads of the same few processes. A node's relay joins upstream
after the start signal, as its launcher would just before starting its ranks: the rendezvous
time is the whole job's start-up. TCPStore runs the same number of ranks as before, each its
own client. Results under each kind, then the shape (``"128x8"``), in
``benchmarks/results/swarm_shapes.json`` (and ``.png``) unless ``--out`` says otherwise.

With ``--baseline REV``, each of our transports is also measured as it was at git revision
``REV`` (checked out into a temporary worktree; its coordinator and ranks run that tree's
package), interleaved with this tree's runs, ``--repeats`` times each: results under
``"KIND @REV"``, each the median of its repeats, the repeats kept.

Times, from a common start signal: connect + ``rendezvous()`` of all N ranks (the last
rank's finish), then the median of ``--barriers`` barriers. The baseline is torch's TCPStore
with its clients in threads the same way (connect, then add+wait barriers). Each process
imports its transport's module before the start signal, as TCPStore's side imports
``torch.distributed``: the rendezvous counts connecting, not importing. Writes
``benchmarks/results/swarm.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
KINDS = ["zmq", "grpc", "etcd", "TCPStore add+wait"]
WORKER = [sys.executable, "-m", "benchmarks.swarm", "--worker"]


def worker(kind: str, port: int, ranks: list[int], n: int, barriers: int, options: str) -> None:
    import dataparallel as dp
    from dataparallel.control.registry import transport_class

    if kind.startswith("TCPStore"):
        import torch.distributed as dist
    else:  # imported before the clock starts, as TCPStore's module is
        transport_class(kind)
    results: dict[int, dict] = {}
    errors: list[str] = []
    go = threading.Event()

    def rank_main(rank: int) -> None:
        try:
            go.wait()
            t0 = time.time()
            if kind.startswith("TCPStore"):
                store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))

                def barrier(i: int) -> None:
                    if store.add(f"b{i}", 1) == n:
                        store.set(f"done{i}", b"1")
                    else:
                        store.wait([f"done{i}"])

                barrier(-1)  # the rendezvous: everyone is connected
                ch = None
            else:
                url = f"{kind}://127.0.0.1:{port}" + (f"?{options}" if options else "")
                ch = dp.connect(url, rank=rank, world_size=n, job="swarm", timeout=300)
                ch.rendezvous()

                def barrier(i: int) -> None:
                    ch.barrier("b")

            ready = time.time()
            samples = []
            for i in range(barriers):
                t = time.perf_counter()
                barrier(i)
                samples.append(time.perf_counter() - t)
            barrier(barriers)  # nobody leaves while others measure
            results[rank] = {"start": t0, "ready": ready, "barriers": samples}
            if ch is not None:
                ch.close()
        except Exception as err:  # reported to the parent, which fails the run
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in ranks]
    _run_released(threads, go, results, errors)


def shape_worker(
    kind: str, port: int, nodes: list[int], shape: tuple[int, int], barriers: int, options: str, ranks_as: str
) -> None:
    """This process's share of a NODESxRANKS job: for each of ``nodes``, a relay joined
    upstream and its ranks through it (see the module docstring): each rank a thread with a
    ``relay://`` channel, or (``ranks_as="objects"``) the node's ranks as local-leg clients
    of one thread, which arrives for each of them and waits for each release."""
    import dataparallel as dp
    from benchmarks.common import timed
    from dataparallel.control.registry import transport_class
    from dataparallel.control.relay.local import LocalClient
    from dataparallel.control.relay.node import NodeRelay

    transport_class(kind)  # imported before the clock starts, as TCPStore's module is

    total, per_node = shape
    n = total * per_node
    results: dict[int, dict] = {}
    errors: list[str] = []
    go = threading.Event()
    scratch = tempfile.mkdtemp(prefix="dp-swarm-")

    def rank_main(path: str, rank: int, t0: float) -> None:
        try:
            ch = dp.connect(f"relay://{path}", rank=rank, world_size=n, job="swarm", timeout=300)
            ch.rendezvous()
            ready = time.time()
            samples = timed(lambda: ch.barrier("b"), barriers)
            ch.barrier("b")  # nobody leaves while others measure
            results[rank] = {"start": t0, "ready": ready, "barriers": samples}
            ch.close()
        except Exception as err:  # reported to the parent, which fails the run
            errors.append(f"rank {rank}: {type(err).__name__}: {err}")

    def node_as_objects(path: str, node: int, t0: float) -> None:
        clients = [LocalClient(path, node * per_node + i, timeout=300) for i in range(per_node)]

        def barrier() -> None:
            generations = [c.arrive("b", 300) for c in clients]
            deadline = time.monotonic() + 300
            for c, generation in zip(clients, generations, strict=True):
                while c.released(generation, 1.0) is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"node {node}: barrier not released in 300 s")

        barrier()  # every node's ranks have arrived: the job's start-up
        ready = time.time()
        samples = timed(barrier, barriers)
        barrier()  # nobody leaves while others measure
        for i, c in enumerate(clients):
            results[node * per_node + i] = {"start": t0, "ready": ready, "barriers": samples}
            c.close()

    def node_main(node: int) -> None:
        try:
            go.wait()
            t0 = time.time()
            url = f"{kind}://127.0.0.1:{port}" + (f"?{options}" if options else "")
            up = dp.connect(url, rank=node, world_size=total, job="swarm~nodes", timeout=300)
            relay = NodeRelay(
                up, os.path.join(scratch, str(node)), local_ranks=per_node, node_rank=node, nodes=total, job="swarm"
            )
        except Exception as err:
            errors.append(f"node {node}: {type(err).__name__}: {err}")
            return
        if ranks_as == "objects":
            try:
                node_as_objects(relay.path, node, t0)
            except Exception as err:
                errors.append(f"node {node}'s ranks: {type(err).__name__}: {err}")
            relay.close()
            up.close()
            return
        ranks = [
            threading.Thread(target=rank_main, args=(relay.path, node * per_node + i, t0), daemon=True)
            for i in range(per_node)
        ]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(timeout=600)
        relay.close()
        up.close()

    threads = [threading.Thread(target=node_main, args=(node,), daemon=True) for node in nodes]
    _run_released(threads, go, results, errors)


def _run_released(threads: list[threading.Thread], go: threading.Event, results: dict, errors: list[str]) -> None:
    """A worker's threads started, "ready" said, released together at the start time the
    parent sends (they wait on ``go``), joined, and what they recorded printed as one line."""
    for t in threads:
        t.start()
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    while time.time() < start:
        time.sleep(0.0005)
    go.set()
    for t in threads:
        t.join(timeout=600)
    print(json.dumps({"results": results, "errors": errors}), flush=True)


def parse_shape(text: str) -> tuple[int, int]:
    """``"128x8"``: (nodes, ranks per node)."""
    nodes, _, per_node = text.partition("x")
    try:
        shape = int(nodes), int(per_node)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is NODESxRANKS, e.g. 128x8") from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one node of one rank")
    return shape


def _ranks(share: list[int]) -> str:
    return ",".join(map(str, share))


def start_coordinator(kind: str, port: int, tree: Path | None = None) -> subprocess.Popen | None:
    from benchmarks.control_plane import start_server

    env, cwd = _at(tree)
    return start_server("tcpstore" if kind.startswith("TCPStore") else kind, port, env, cwd)


def _at(tree: Path | None) -> tuple[dict[str, str], str | None]:
    """The environment and working directory of a process that runs ``tree``'s package and
    benchmarks (None: this checkout's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tree is None:
        return env, None
    return {**env, "PYTHONPATH": str(tree)}, str(tree)


@contextlib.contextmanager
def revision(rev: str) -> Iterator[Path]:
    """``rev`` checked out into a temporary git worktree, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def measure(
    kind: str,
    n: int,
    procs: int,
    barriers: int,
    cap: float = 300.0,
    options: str = "",
    tree: Path | None = None,
    shape: tuple[int, int] | None = None,
    ranks_as: str = "threads",
) -> dict:
    """One run of ``n`` ranks (as ``shape``'s nodes, where given: then ``n`` is theirs)."""
    from benchmarks.common import free_port, percentile
    from benchmarks.control_plane import release_together

    port = free_port()
    server = start_coordinator(kind, port, tree)
    members = n if shape is None else shape[0]  # what the worker processes share: ranks, or nodes
    shares = [list(range(p, members, procs)) for p in range(procs) if p < members]
    common = ["--port", str(port), "--n", str(n), "--barriers", str(barriers), "--options", options]
    if shape is not None:
        common += ["--shape", f"{shape[0]}x{shape[1]}", "--ranks-as", ranks_as]
    env, cwd = _at(tree)
    workers = [
        subprocess.Popen(
            [*WORKER, kind, *common, "--ranks", _ranks(share)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        for share in shares
    ]
    try:
        start = release_together(workers, 0.3)
        merged: dict[str, dict] = {}
        errors: list[str] = []
        deadline = time.monotonic() + cap
        for w in workers:
            try:
                lines = w.communicate(timeout=max(deadline - time.monotonic(), 1))[0].strip().splitlines()
            except subprocess.TimeoutExpired:
                return {"error": f"not finished within {cap:g} s (stopped)", "errors": 1}
            if not lines:
                return {"error": f"a worker process died (exit code {w.returncode})", "errors": 1}
            out = json.loads(lines[-1])
            merged.update(out["results"])
            errors += out["errors"]
    finally:
        for p in [*workers, *([server] if server else [])]:
            p.kill()
    if errors or len(merged) != n:
        return {"error": (errors or [f"only {len(merged)} of {n} ranks finished"])[0], "errors": len(errors)}
    rendezvous = max(r["ready"] for r in merged.values()) - start
    # A barrier completes for everyone at once: its time is the slowest rank's, per round.
    rounds = [max(r["barriers"][i] for r in merged.values()) for i in range(barriers)]
    ms = [r * 1e3 for r in rounds]
    return {"rendezvous_s": rendezvous, "barrier_ms": statistics.median(ms), "barrier_p99_ms": percentile(ms, 99)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        help="NODESxRANKS: our transports through node relays (instead of --sizes; TCPStore with NODES*RANKS ranks)",
    )
    parser.add_argument("--procs", type=int, default=4, help="processes the ranks are spread over")
    parser.add_argument("--barriers", type=int, default=10)
    parser.add_argument("--kinds", nargs="+", default=KINDS)
    parser.add_argument("--cap", type=float, default=300, help="seconds a run may take before it is stopped")
    parser.add_argument("--out", type=Path, help="default: results/swarm.json (with --shapes: swarm_shapes.json)")
    parser.add_argument(
        "--options",
        default="",
        help="URL options of our channels, e.g. heartbeat=5&liveness_timeout=60 (default: none, the defaults: "
        "a heartbeat a second, lost after 10 s)",
    )
    parser.add_argument("--baseline", help="a git revision whose transports are measured too, in the same run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each kind and size (the median is kept)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=parse_shape, help=argparse.SUPPRESS)
    parser.add_argument(
        "--ranks-as",
        choices=["threads", "objects"],
        default="threads",
        help="with --shapes: each rank a thread with a relay:// channel, or a node's ranks local-leg clients of one "
        "thread (no rank joins the job itself: the relays' start-up and barriers alone)",
    )
    args = parser.parse_args(argv)
    if args.worker:
        share = [int(r) for r in args.ranks.split(",")]
        if args.shape is not None:
            shape_worker(args.worker, args.port, share, args.shape, args.barriers, args.options, args.ranks_as)
        else:
            worker(args.worker, args.port, share, args.n, args.barriers, args.options)
        return 0
    if args.out is None:
        args.out = RESULTS / ("swarm_shapes.json" if args.shapes else "swarm.json")
    if args.shapes and args.baseline:
        parser.error("--shapes measures this tree only (no --baseline)")
    from tqdm import tqdm

    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(revision(args.baseline)) if args.baseline else None
        runs = [(kind, None) for kind in args.kinds]
        if tree is not None:
            runs += [(kind, tree) for kind in args.kinds if not kind.startswith("TCPStore")]
        result: dict[str, dict[int | str, dict]] = {_name(k, t, args.baseline): {} for k, t in runs}
        # A size N, or a shape: (its key, its rank count, the shape our transports run as).
        cases: list[tuple[int | str, int, tuple[int, int] | None]] = (
            [(f"{a}x{b}", a * b, (a, b)) for a, b in args.shapes] if args.shapes else [(n, n, None) for n in args.sizes]
        )
        with tqdm(total=len(cases) * len(runs) * args.repeats, desc="swarm", unit="run") as bar:
            for key, n, shape in cases:
                repeats: dict[str, list[dict]] = {_name(k, t, args.baseline): [] for k, t in runs}
                for _ in range(args.repeats):  # interleaved: a drift of the machine touches every kind alike
                    for kind, at in runs:
                        name = _name(kind, at, args.baseline)
                        bar.set_postfix_str(f"{name} {key}")
                        as_nodes = None if kind.startswith("TCPStore") else shape
                        repeats[name].append(
                            measure(
                                kind, n, args.procs, args.barriers, args.cap, args.options, at, as_nodes, args.ranks_as
                            )
                        )
                        bar.update()
                for name, runs_of in repeats.items():
                    result[name][key] = _median_of(runs_of)
    report(result)
    from benchmarks.common import machine

    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "command": "python -m benchmarks.swarm " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "procs": args.procs,
        "layout": (
            (
                "our transports as NODES node relays (objects) and NODES*RANKS relay:// ranks (threads), "
                if args.ranks_as == "threads"
                else "our transports as NODES node relays (objects), each node's RANKS ranks local-leg clients of "
                "one thread (no rank joins the job: the relays' start-up and barriers), "
            )
            + "TCPStore as NODES*RANKS clients (threads)"
            if args.shapes
            else "every rank a thread with a real channel"
        ),
        "options": args.options or "defaults",
        "repeats": args.repeats,
        "baseline": args.baseline,
        "result": result,
    }
    args.out.write_text(json.dumps(summary, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def _name(kind: str, tree: Path | None, rev: str | None) -> str:
    return kind if tree is None else f"{kind} @{rev}"


def _median_of(runs: list[dict]) -> dict:
    """The repeats' medians (any failed repeat fails the whole), the repeats kept."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    if len(runs) == 1:
        return runs[0]
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    out["repeats"] = runs
    return out


def _rank_count(key: int | str) -> int:
    """A result's rank count: its size, or its shape's NODES*RANKS."""
    if isinstance(key, str) and "x" in key:
        nodes, per_node = parse_shape(key)
        return nodes * per_node
    return int(key)


def _label(key: int | str) -> str:
    return f"N={key}" if str(key).isdigit() else str(key)


def report(result: dict[str, dict[int | str, dict]]) -> None:
    print("\nlightweight ranks (N of them, or NODESxRANKS): rendezvous of all (s) and barrier (median ms):")
    for kind, by_n in result.items():
        for n, r in by_n.items():
            if "error" in r:
                print(f"  {kind:20s} {_label(n):9s} FAILED: {r['error']}")
            else:
                rdzv, barrier, tail = r["rendezvous_s"], r["barrier_ms"], r.get("barrier_p99_ms", float("nan"))
                print(
                    f"  {kind:20s} {_label(n):9s} rendezvous {rdzv:7.2f} s   barrier p50 {barrier:8.1f} ms"
                    f"  p99 {tail:8.1f} ms"
                )


def plot(result: dict[str, dict[int | str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any("error" not in r for by_n in result.values() for r in by_n.values()):
        return  # every run failed: nothing to draw (the table says why)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind, by_n in result.items():
        ok = {_rank_count(n): r for n, r in by_n.items() if "error" not in r}
        sizes = sorted(ok)
        axes[0].plot(sizes, [ok[n]["rendezvous_s"] for n in sizes], marker="o", label=kind)
        line = axes[1].plot(sizes, [ok[n]["barrier_ms"] for n in sizes], marker="o", label=kind)[0]
        tails = [ok[n].get("barrier_p99_ms") for n in sizes]
        if all(t is not None for t in tails):
            axes[1].plot(sizes, tails, linestyle=":", color=line.get_color())
    for ax, label in zip(axes, ["rendezvous of all ranks, s", "barrier, ms (median; dotted: p99)"], strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (threads)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("many lightweight ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    from benchmarks.common import run_main

    run_main("benchmarks.swarm", main)
