"""NCCL through our control channel, on whatever GPUs this machine has (not runnable in CI).

    python -m benchmarks.gpu_nccl [--transports zmq grpc tcpstore] [--steps 200] [--out DIR]

For each transport, in separate processes (one per GPU; with one GPU, one process):

* initialise ``init_process_group("nccl", store=ch.as_store(), device_id=...)`` and record
  every Store call torch makes (which methods, how often: NCCL's watchdog ``check``);
* check all_reduce / broadcast / barrier results;
* measure all-reduce bus bandwidth vs message size;
* run a DDP training loop (MLP, bf16 autocast) and compare its throughput with the same
  loop on a process group initialised the plain torchrun way (``env://``, TCPStore).

Writes ``gpu_nccl.json`` (and prints a table).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.common import free_port, run_main


def instrument_store_calls() -> collections.Counter:
    from dataparallel.control.store import ChannelStore

    calls: collections.Counter = collections.Counter()
    for name in (
        "set",
        "get",
        "add",
        "compare_set",
        "wait",
        "check",
        "delete_key",
        "num_keys",
        "multi_get",
        "multi_set",
        "append",
        "clone",
    ):
        original = getattr(ChannelStore, name)

        def traced(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(ChannelStore, name, traced)
    return calls


def train(model_steps: int, device) -> float:
    """DDP training throughput (samples/s) on the current default process group."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.GELU(),
        torch.nn.Linear(4096, 10),
    ).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(512, 1024, device=device)
    y = torch.randint(0, 10, (512,), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(model_steps):
        step()
    torch.cuda.synchronize()
    return model_steps * x.shape[0] / (time.perf_counter() - t)


def allreduce_bandwidth(world: int, device) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    out = {}
    for size in (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 27):
        t = torch.ones(size // 4, device=device)
        for _ in range(5):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        samples = []
        for _ in range(20):
            s = time.perf_counter()
            dist.all_reduce(t)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - s)
        sec = statistics.median(samples)
        bus = size * 2 * (world - 1) / world / sec / 1e9 if world > 1 else size / sec / 1e9
        out[str(size)] = round(bus, 2)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = args.rank, args.world
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    result: dict = {"rank": rank, "transport": args.transport, "device": torch.cuda.get_device_name(device)}
    if args.transport == "plain":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(world))
        t = time.perf_counter()
        dist.init_process_group("nccl", init_method="env://", device_id=device, timeout=timedelta(seconds=120))
        result["init_s"] = time.perf_counter() - t
    else:
        import dataparallel as dp

        calls = instrument_store_calls()
        t = time.perf_counter()
        ch = dp.connect(
            f"{args.transport}://127.0.0.1:{args.port}", rank=rank, world_size=world, job="gpu", timeout=120
        )
        ch.rendezvous()
        dp.init_process_group(ch, "nccl", device=device, timeout=120)
        value = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(value)
        torch.cuda.synchronize()
        result["init_s"] = time.perf_counter() - t
        shared = torch.full((2,), float(rank), device=device)
        dist.broadcast(shared, src=world - 1)
        dist.barrier()
        result["all_reduce_ok"] = value.tolist() == [float(sum(range(1, world + 1)))] * 4
        result["broadcast_ok"] = shared.tolist() == [float(world - 1)] * 2
    result["allreduce_busbw_GBps"] = allreduce_bandwidth(world, device)
    result["train_samples_per_s"] = train(args.steps, device)
    if args.transport != "plain":
        time.sleep(2.5)  # let NCCL's watchdog poll the store a few times
        result["store_calls"] = dict(calls)
    dist.destroy_process_group()
    if args.transport != "plain":
        ch.barrier("done")
        ch.close()
    print("RESULT " + json.dumps(result), flush=True)


def run(transport: str, world: int, steps: int) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.gpu_nccl", "--worker", "--transport", transport, "--port", str(port)]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(r), "--world", str(world), "--steps", str(steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=400)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            print(out[-4000:])
            raise SystemExit(f"{transport}: rank failed with exit code {p.returncode}")
        results.append(json.loads(lines[-1][7:]))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", nargs="+", default=["zmq", "grpc", "tcpstore"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per transport")
    parser.add_argument("--world", type=int, default=None, help="processes (default: one per GPU)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    world = args.world or torch.cuda.device_count()
    report: dict = {"torch": torch.__version__, "gpus": torch.cuda.device_count(), "world": world, "runs": {}}
    kinds = ["plain", *args.transports]
    for _ in range(args.repeats):  # interleaved, so drift hits every transport alike
        for transport in kinds:
            report["runs"].setdefault(transport, []).append(run(transport, world, args.steps))

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_nccl.json").write_text(json.dumps(report, indent=2))

    def throughput(transport: str) -> float:
        return statistics.median(sum(r["train_samples_per_s"] for r in ranks) for ranks in report["runs"][transport])

    base = throughput("plain")
    print(f"torch {torch.__version__}, {world} process(es) on {report['runs']['plain'][0][0]['device']}")
    print(f"{'transport':10s} {'init s':>8s} {'train samples/s':>16s} {'vs plain DDP':>13s}  store calls (rank 0)")
    for transport in kinds:
        runs = report["runs"][transport]
        tput = throughput(transport)
        init = statistics.median(ranks[0]["init_s"] for ranks in runs)
        ok = all(r.get("all_reduce_ok", True) and r.get("broadcast_ok", True) for ranks in runs for r in ranks)
        calls = runs[-1][0].get("store_calls", "-")
        print(f"{transport:10s} {init:8.3f} {tput:16.0f} {tput / base:12.3f}x  {calls} {'' if ok else 'WRONG RESULT'}")
    report["summary"] = {k: {"samples_per_s": throughput(k), "ratio_to_plain": throughput(k) / base} for k in kinds}
    what = "bus bandwidth" if world > 1 else "algorithm bandwidth (one rank: a local reduction)"
    print(f"all-reduce {what} GB/s by bytes (rank 0, last run):")
    for transport in kinds:
        print(f"  {transport:10s} {report['runs'][transport][-1][0]['allreduce_busbw_GBps']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_nccl.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    run_main("benchmarks.gpu_nccl", main)
