"""Control-plane latency: our transports side by side with torch's TCPStore and a raw socket floor.

    python -m benchmarks.control_plane                 # N = 2, 4, 8, 16, 32, 64
    python -m benchmarks.control_plane --sizes 2 4 --rounds 50

Measures, in one run, on one machine:

* round trip: one client doing ``get`` of an existing key (one request, one reply) against a
  coordinator in another process — zmq (``dataparallel serve``), tcpstore (our adapter over
  a TCPStore hosted by another process), torch's TCPStore called directly, and a raw Python
  TCP echo (the floor: the least a Python request/reply over loopback can cost);
* what authentication costs: the root key once per process, and sealing and opening a
  request and its reply (HMAC-SHA256) as a share of the zmq and grpc round trips;
* barrier latency for N processes: ``ch.barrier()`` over zmq and grpc (native, one round
  trip per rank) and tcpstore (the core's add+get barrier), against torch's TCPStore store-based
  barrier (add, then the last rank sets a key the others wait on — torch's
  ``_store_based_barrier`` pattern) and torch's native ``Store.barrier``.

Medians over rounds; ratios are to TCPStore in the same run. Prints a table, writes
``benchmarks/results/control_plane.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.common import free_port, machine, percentile, run_main, tree_cpu_s

RESULTS = Path(__file__).resolve().parent / "results"
PAYLOAD = b"x" * 64


def release_together(procs: list[subprocess.Popen], delay: float) -> float:
    """Wait until every worker printed "ready", then send them all one start time ``delay``
    seconds ahead (they wait for it; it is returned): start-up is not counted, and they
    start as one."""
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    start = time.time() + delay
    for p in procs:
        p.stdin.write(f"{start}\n")
        p.stdin.flush()
    return start


# ---------------------------------------------------------------------- servers (subprocesses)
def serve_echo(port: int) -> None:
    srv = socket.create_server(("127.0.0.1", port))
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(65536):
            conn.sendall(data)


def serve_zmq_echo(port: int) -> None:
    """A bare pyzmq ROUTER that sends each message back: what libzmq alone costs a round
    trip (the zmq transport's coordinator is a ROUTER too, its clients DEALERs)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


ECHO_METHOD = "/bench.Echo/Stream"


def serve_grpc_echo(port: int) -> None:
    """A bare grpc.aio server with one bidirectional-stream method that sends each message back
    (bytes in, bytes out, no protobuf): what grpcio alone costs a round trip on one stream, the
    grpc transport's way of talking to its coordinator."""
    import asyncio

    import grpc

    async def echo(requests, context):
        async for message in requests:
            yield message

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(echo)
        service, method = ECHO_METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


def echo_round_trips(kind: str, repeats: int) -> tuple[list[float], dict[str, float]]:
    """µs of each round trip to a bare echo server (``zmq echo``: a DEALER, the way the zmq
    transport's client calls; ``grpc echo``: one grpc.aio stream, awaited on its own event
    loop: no thread hand-off, less than the grpc transport's client can do), and its CPU."""
    port = free_port()
    proc = start_server(kind, port)
    try:
        if kind == "zmq echo":
            import zmq

            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.connect(f"tcp://127.0.0.1:{port}")
            call = lambda: (sock.send(PAYLOAD), sock.recv())  # noqa: E731
            try:
                return time_ops(call, repeats), cpu_per_call(call, repeats, proc)
            finally:
                sock.close(linger=0)
        import asyncio

        import grpc

        async def measure() -> tuple[list[float], dict[str, float]]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = channel.stream_stream(ECHO_METHOD)()

                async def one() -> None:
                    await stream.write(PAYLOAD)
                    await stream.read()

                for _ in range(min(200, repeats)):
                    await one()
                samples = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    await one()
                    samples.append((time.perf_counter() - t) * 1e6)
                client, served = time.process_time(), tree_cpu_s(proc.pid)
                for _ in range(repeats):
                    await one()
                cpu = {
                    "client_us": (time.process_time() - client) / repeats * 1e6,
                    "server_us": (tree_cpu_s(proc.pid) - served) / repeats * 1e6,
                }
                await stream.done_writing()
                return samples, cpu

        return asyncio.run(measure())
    finally:
        proc.kill()


def serve_tcpstore(port: int) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    print("ready", flush=True)
    while store:
        time.sleep(3600)


def _die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphaned etcd


def serve_etcd(port: int) -> None:
    import shutil
    import tempfile

    peer = free_port()
    client = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data:
        etcd = subprocess.Popen(
            [
                shutil.which("etcd") or "etcd",
                "--data-dir",
                data,
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--heartbeat-interval",
                "10",
                "--election-timeout",
                "100",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.3)
        print("ready", flush=True)
        try:
            etcd.wait()
        finally:
            etcd.kill()


def start_server(kind: str, port: int, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
    """``env``, ``cwd``: where the server's package comes from (another revision's tree)."""
    if kind in ("zmq", "grpc"):
        cmd = [sys.executable, "-m", "dataparallel", "serve", f"{kind}://127.0.0.1:{port}"]
    else:
        cmd = [sys.executable, "-m", "benchmarks.control_plane", "--serve", kind.replace(" ", "-"), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd)
    proc.stdout.readline()
    return proc


# ---------------------------------------------------------------------- round trip
def time_ops(op, repeats: int) -> list[float]:
    """µs of each of ``repeats`` calls of ``op`` (after a warm-up)."""
    for _ in range(min(200, repeats)):
        op()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        op()
        samples.append((time.perf_counter() - t) * 1e6)
    return samples


def cpu_per_call(op, repeats: int, server: subprocess.Popen) -> dict[str, float]:
    """µs of CPU one call of ``op`` costs this (client) process and the server's process tree,
    over ``repeats`` calls: where a round trip's time goes when it is CPU, not the network."""
    client, served = time.process_time(), tree_cpu_s(server.pid)
    for _ in range(repeats):
        op()
    return {
        "client_us": (time.process_time() - client) / repeats * 1e6,
        "server_us": (tree_cpu_s(server.pid) - served) / repeats * 1e6,
    }


def p50_p99(samples: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    return (
        {k: statistics.median(v) for k, v in samples.items()},
        {k: percentile(v, 99) for k, v in samples.items()},
    )


def round_trips(
    repeats: int, writes: dict[str, list[float]] | None = None, cpu: dict[str, dict[str, float]] | None = None
) -> dict[str, list[float]]:
    """µs of each get of an existing key, per transport; ``writes`` gets those of a ``set``
    (acknowledged on every transport; torch's own TCPStore set is not), ``cpu`` the CPU a
    get costs each side (:func:`cpu_per_call`)."""
    import torch.distributed as dist

    import dataparallel as dp

    out: dict[str, list[float]] = {}
    port = free_port()
    proc = start_server("echo", port)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out["raw socket"] = time_ops(lambda: (s.sendall(PAYLOAD), s.recv(65536)), repeats)
            if cpu is not None:
                cpu["raw socket"] = cpu_per_call(lambda: (s.sendall(PAYLOAD), s.recv(65536)), repeats, proc)
    finally:
        proc.kill()
    for kind in ("zmq echo", "grpc echo"):
        out[kind], used = echo_round_trips(kind, repeats)
        if cpu is not None:
            cpu[kind] = used
    with dp.connect("memory://rtt", rank=0, world_size=1, job="rtt") as ch:  # in-process: no network
        ch.set("k", PAYLOAD)
        out["memory"] = time_ops(lambda ch=ch: ch.get("k"), repeats)
    for kind in ("zmq", "grpc", "etcd", "tcpstore"):
        port = free_port()
        proc = start_server(kind, port)
        try:
            ch = dp.connect(f"{kind}://127.0.0.1:{port}", rank=1, world_size=2, job="rtt", timeout=30)
            ch.set("k", PAYLOAD)
            out[kind] = time_ops(lambda ch=ch: ch.get("k"), repeats)
            if cpu is not None:
                cpu[kind] = cpu_per_call(lambda ch=ch: ch.get("k"), repeats, proc)
            if writes is not None:
                writes[kind] = time_ops(lambda ch=ch: ch.set("w", PAYLOAD), repeats)
            if kind == "tcpstore":
                raw = dist.TCPStore("127.0.0.1", port, is_master=False)
                raw.set("k", PAYLOAD)
                out["TCPStore (torch)"] = time_ops(lambda raw=raw: raw.get("k"), repeats)
                if cpu is not None:
                    cpu["TCPStore (torch)"] = cpu_per_call(lambda raw=raw: raw.get("k"), repeats, proc)
                if writes is not None:
                    # Unacknowledged: returns once the bytes are in the socket buffer.
                    writes["TCPStore (torch), no ack"] = time_ops(lambda raw=raw: raw.set("w", PAYLOAD), repeats)
            ch.close()
        finally:
            proc.kill()
    return out


def security_cost(repeats: int, rtt: dict[str, float]) -> dict[str, float]:
    """What authentication costs: the token's root key (scrypt, once per process) and, per
    request, the MACs a round trip adds (the client seals its request, the coordinator
    checks it and seals the reply, the client checks that: four HMAC-SHA256 over the encoded
    messages, which are encoded either way), as a share of the measured round trips."""
    import hashlib
    import hmac

    from dataparallel.control.wire import SCRYPT, pb, token_key

    start = time.perf_counter()
    hashlib.scrypt(b"benchmark-token", salt=b"benchmark", dklen=32, maxmem=64 << 20, **SCRYPT)
    kdf_ms = (time.perf_counter() - start) * 1e3
    key = token_key("benchmark-token")
    request = pb.Request(id=7, session=b"s" * 16, get=pb.Get(key="k", timeout=30)).SerializeToString()
    reply = pb.Reply(id=7, value=PAYLOAD).SerializeToString()

    def macs() -> None:
        for body in (request, reply):
            mac = hmac.digest(key, body, "sha256")  # sealed by the sender
            hmac.compare_digest(mac, hmac.digest(key, body, "sha256"))  # checked by the receiver

    mac_us = statistics.median(time_ops(macs, repeats))
    out = {"root_key_ms": kdf_ms, "mac_per_request_us": mac_us}
    for kind in ("zmq", "grpc"):
        out[f"mac_share_of_{kind}_round_trip"] = mac_us / rtt[kind]
    return out


# ---------------------------------------------------------------------- barriers
def barrier_worker(kind: str, port: int, rank: int, n: int, rounds: int) -> None:
    if kind in ("TCPStore add+wait", "TCPStore native"):
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=120)
        )
        if kind == "TCPStore native":

            def barrier(i: int) -> None:
                store.barrier(f"b{i}", n)
        else:

            def barrier(i: int) -> None:
                if store.add(f"b{i}", 1) == n:
                    store.set(f"done{i}", b"1")
                else:
                    store.wait([f"done{i}"])

        barrier(-1)  # everyone is connected
    else:
        import dataparallel as dp

        ch = dp.connect(f"{kind}://127.0.0.1:{port}", rank=rank, world_size=n, job="bench", timeout=120)
        ch.rendezvous()

        def barrier(i: int) -> None:
            ch.barrier("b")

    samples = []
    for i in range(rounds):
        t = time.perf_counter()
        barrier(i)
        samples.append(time.perf_counter() - t)
    barrier(rounds)  # nobody leaves (and takes a hosted server down) while others measure
    if rank == 0:
        kept = [t * 1e3 for t in samples[rounds // 5 :]]  # the first fifth: warm-up
        print(json.dumps({"median_ms": statistics.median(kept), "p99_ms": percentile(kept, 99)}), flush=True)
    if kind not in ("TCPStore add+wait", "TCPStore native"):
        ch.close()


def barrier_latency(kind: str, n: int, rounds: int) -> tuple[float, float]:
    """(median, p99) ms of a barrier of ``n`` processes; NaN when the run failed (its
    workers' errors are on stderr)."""
    port = free_port()
    server = start_server("etcd", port) if kind == "etcd" else None  # the others are hosted by rank 0
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.control_plane",
                "--worker",
                kind,
                "--port",
                str(port),
                "--rank",
                str(r),
                "--n",
                str(n),
                "--rounds",
                str(rounds),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    out = ""
    try:
        out, _ = procs[0].communicate(timeout=300)
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass  # a hung run: reported as failed below
    finally:
        for p in [*procs, *([server] if server else [])]:
            p.kill()
    lines = out.strip().splitlines()
    if not lines:
        print(f"{kind} N={n}: the run failed (see the errors above)", file=sys.stderr)
        return math.nan, math.nan
    measured = json.loads(lines[-1])
    return measured["median_ms"], measured["p99_ms"]


BARRIER_KINDS = ["zmq", "grpc", "etcd", "tcpstore", "TCPStore add+wait", "TCPStore native"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=100, help="barriers timed per size")
    parser.add_argument("--repeats", type=int, default=3000, help="round trips timed per transport")
    parser.add_argument("--out", type=Path, default=None, help="default: results/control_plane.json")
    parser.add_argument(
        "--round-trips-only",
        action="store_true",
        help="only the get and set round trips (written to results/round_trips.json)",
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        {
            "echo": serve_echo,
            "zmq-echo": serve_zmq_echo,
            "grpc-echo": serve_grpc_echo,
            "tcpstore": serve_tcpstore,
            "etcd": serve_etcd,
        }[args.serve](args.port)
        return 0
    if args.worker:
        barrier_worker(args.worker, args.port, args.rank, args.n, args.rounds)
        return 0

    from tqdm import tqdm

    write_samples: dict[str, list[float]] = {}
    cpu: dict[str, dict[str, float]] = {}
    rtt, rtt_p99 = p50_p99(round_trips(args.repeats, write_samples, cpu))
    writes, writes_p99 = p50_p99(write_samples)
    security = security_cost(args.repeats, rtt)
    print(f"round trip (one get of an existing key) and set, median µs of {args.repeats}:")
    for name, us in rtt.items():
        print(
            f"  get {name:28s} p50 {us:8.1f} us  p99 {rtt_p99[name]:8.1f} us"
            f"   {us / rtt['TCPStore (torch)']:5.2f}x TCPStore"
        )
    for name, us in writes.items():
        print(f"  set {name:28s} p50 {us:8.1f} us  p99 {writes_p99[name]:8.1f} us")
    print("CPU per get, µs (this client process; the server's process tree):")
    for name, used in cpu.items():
        print(f"  {name:32s} client {used['client_us']:7.1f}   server {used['server_us']:7.1f}")
    print(
        f"authentication: root key (scrypt) {security['root_key_ms']:.0f} ms once per process; "
        f"the MACs of a request and its reply {security['mac_per_request_us']:.1f} us = "
        f"{100 * security['mac_share_of_zmq_round_trip']:.1f}% of a zmq round trip, "
        f"{100 * security['mac_share_of_grpc_round_trip']:.1f}% of a grpc one"
    )
    result = {
        "machine": machine(),
        "round_trip_us": rtt,
        "round_trip_p99_us": rtt_p99,
        "set_us": writes,
        "set_p99_us": writes_p99,
        "round_trip_cpu_us": cpu,
        "security": security,
    }
    if args.round_trips_only:
        out = args.out or RESULTS / "round_trips.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
        return 0
    args.out = args.out or RESULTS / "control_plane.json"
    barriers: dict[str, dict[int, float]] = {k: {} for k in BARRIER_KINDS}
    barriers_p99: dict[str, dict[int, float]] = {k: {} for k in BARRIER_KINDS}
    with tqdm(total=len(args.sizes) * len(BARRIER_KINDS), desc="barriers", unit="run") as bar:
        for n in args.sizes:
            for kind in BARRIER_KINDS:
                bar.set_postfix_str(f"{kind} N={n}")
                barriers[kind][n], barriers_p99[kind][n] = barrier_latency(kind, n, args.rounds)
                bar.update()

    print(f"\nround trip (one get of an existing key), median of {args.repeats}:")
    floor = rtt["raw socket"]
    for name, us in rtt.items():
        print(f"  {name:18s} {us:8.1f} us   {us / floor:5.2f}x floor   {us / rtt['TCPStore (torch)']:5.2f}x TCPStore")
    print(f"\nbarrier latency (median ms of {args.rounds} rounds; ratio to TCPStore add+wait):")
    print("  N    " + "".join(f"{k:>24s}" for k in BARRIER_KINDS))
    for n in args.sizes:
        base = barriers["TCPStore add+wait"][n]
        cells = "".join(f"{barriers[k][n]:>14.3f} ({barriers[k][n] / base:4.2f}x)" for k in BARRIER_KINDS)
        print(f"  {n:<4d} {cells}")
    print("p99 ms:")
    for n in args.sizes:
        print(f"  {n:<4d} " + "".join(f"{barriers_p99[k][n]:>24.3f}" for k in BARRIER_KINDS))

    result |= {
        "barrier_ms": barriers,
        "barrier_p99_ms": barriers_p99,
        "rounds": args.rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(result["round_trip_us"])
    p99 = result.get("round_trip_p99_us", {})
    left.barh(names, [p99.get(k, 0) for k in names], color="tab:blue", alpha=0.3, label="p99")
    left.barh(names, [result["round_trip_us"][k] for k in names], color="tab:blue", label="median")
    left.set_xlabel("µs")
    left.legend()
    left.set_title("round trip: get of an existing key")
    tails = result.get("barrier_p99_ms", {})
    for i, (kind, series) in enumerate(result["barrier_ms"].items()):
        sizes = sorted(int(n) for n in series)
        color = f"C{i}"
        right.plot(sizes, [_at(series, n) for n in sizes], marker="o", color=color, label=kind)
        if kind in tails:
            right.plot(sizes, [_at(tails[kind], n) for n in sizes], linestyle=":", color=color)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("processes (N)")
    right.set_ylabel("ms per barrier (median; dotted: p99)")
    right.set_title("barrier latency")
    right.legend()
    fig.suptitle(result["machine"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _at(series: dict, n: int) -> float:
    return series[n] if n in series else series[str(n)]  # int keys in a run, str keys from JSON


if __name__ == "__main__":
    run_main("benchmarks.control_plane", main)
