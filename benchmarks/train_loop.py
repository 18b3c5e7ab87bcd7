"""Epoch time of ``dp.fit`` against a plain torchrun-style DDP loop, same model, data and run.

    python -m benchmarks.train_loop [--nprocs 2] [--epochs 5] [--repeats 3]

Both sides: N processes, gloo on CPU, DistributedSampler, DDP, Adam, the same MLP on the same
synthetic data. The plain loop initialises with ``env://`` (TCPStore) and does nothing else;
``dp.fit`` adds the control plane (epoch command, reports, validation, barrier) over zmq;
a third side is ``dp.fit`` with a checkpoint, whose ranks poll for stop signals every step
(a one-element all-reduce, overlapped with the next step); its last epoch, which writes the
checkpoint, is dropped with epoch 0.
Interleaved repeats; per-epoch time on rank 0, epoch 0 dropped on both sides as warm-up,
median and p99, and where each epoch went: training steps, validation, and what is neither
(the plain loop's end-of-epoch barrier; ``dp.fit``'s command, reports and state sync, from
its ``EpochMetrics``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmarks.common import free_port, machine, percentile, run_main

RESULTS = Path(__file__).resolve().parent / "results"
#: Where an epoch goes, on both sides (see the module docstring).
PARTS = ("train", "val", "control")


def setup() -> tuple[torch.nn.Module, TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 64, generator=g)
    y = (x[:, :8].sum(1) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)
    )
    return model, TensorDataset(x[:7168], y[:7168]), TensorDataset(x[7168:], y[7168:])


def device_for(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def plain(rank: int, world: int, port: int, epochs: int, device: torch.device) -> list[dict]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cuda = device.type == "cuda"
    extra = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120), **extra)
    model, train, val = setup()
    model = model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    times = []
    for epoch in range(epochs):
        started = time.perf_counter()
        sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=0)
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=64, sampler=sampler):
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        trained = time.perf_counter()
        with torch.no_grad():
            for x, y in DataLoader(val, batch_size=64, sampler=range(rank, len(val), world)):
                torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        validated = time.perf_counter()
        dist.barrier()
        done = time.perf_counter()
        times.append(
            {"epoch": epoch, "total": done - started, "train": trained - started, "val": validated - trained}
            | {"control": done - validated}
        )
    dist.destroy_process_group()
    return times


def ours(rank: int, world: int, port: int, epochs: int, device: torch.device, poll: bool = False) -> list[dict]:
    import tempfile

    import dataparallel as dp

    ch = dp.connect(f"zmq://127.0.0.1:{port}", rank=rank, world_size=world, job="bench", timeout=120)
    model, train, val = setup()
    model = model.to(device)
    times: list[dict] = []
    # On the driver: command, training, validation, reports (EpochMetrics says which took what).
    dp.fit(
        ch,
        model,
        torch.nn.functional.cross_entropy,
        lambda p: torch.optim.Adam(p, lr=1e-3),
        train,
        val,
        options=dp.TrainOptions(
            epochs=epochs,
            batch_size=64,
            progress=False,
            checkpoint=os.path.join(tempfile.gettempdir(), f"bench-{port}.ckpt") if poll else None,
            checkpoint_every=epochs,
        ),
        callbacks=[
            lambda m: times.append(
                {"epoch": m.epoch, "total": m.seconds, "train": m.train_seconds, "val": m.val_seconds}
                | {"control": m.control_seconds}
            )
        ],
    )
    ch.close()
    return times


def run(kind: str, world: int, epochs: int, device: str) -> list[dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.train_loop", "--worker", kind, "--port", str(port), "--device", device]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(r), "--nprocs", str(world), "--epochs", str(epochs)], stdout=subprocess.PIPE, text=True
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per process")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        torch.set_num_threads(1)
        device = device_for(args.device, args.rank)
        if args.worker == "plain":
            times = plain(args.rank, args.nprocs, args.port, args.epochs, device)
        else:
            times = ours(args.rank, args.nprocs, args.port, args.epochs, device, poll=args.worker == "poll")
        print(json.dumps(times), flush=True)
        return 0
    from tqdm import tqdm

    sides = {"plain DDP": "plain", "dp.fit": "ours", "dp.fit+stop": "poll"}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for name, kind in sides.items():
            last = args.epochs - 1 if kind == "poll" else args.epochs  # the checkpoint's epoch
            runs[name] += [e for e in run(kind, args.nprocs, args.epochs, args.device) if 0 < e["epoch"] < last]
    epochs = {name: [e["total"] for e in rows] for name, rows in runs.items()}
    parts = {name: {p: statistics.median(e[p] for e in rows) for p in PARTS} for name, rows in runs.items()}
    base = statistics.median(epochs["plain DDP"])
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(
        f"{args.nprocs} processes, {backend}, {args.epochs} epochs x {args.repeats} repeats (epoch 0 dropped on both):"
    )
    for name, times in epochs.items():
        med, p99 = statistics.median(times), percentile(times, 99)
        split = "  ".join(f"{p} {parts[name][p] * 1e3:6.1f}" for p in PARTS)
        print(
            f"  {name:11s} epoch p50 {med * 1e3:7.1f} ms  p99 {p99 * 1e3:7.1f} ms  {med / base:5.3f}x plain DDP"
            f"   ({split} ms)"
        )
    summary = {k: statistics.median(v) for k, v in epochs.items()}
    p99s = {k: percentile(v, 99) for k, v in epochs.items()}
    out = args.out or RESULTS / f"train_loop_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine(),
        "backend": backend,
        "world_size": args.nprocs,
        # epoch_s holds each side's epochs repeat after repeat (epochs - 1 each; dp.fit+stop: epochs - 2)
        "repeats": args.repeats,
        "epochs": args.epochs,
        "epoch_s": epochs,
        "median_s": summary,
        "p99_s": p99s,
        "median_parts_s": parts,
    }
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    run_main("benchmarks.train_loop", main)
