"""Time to recovery after a follower is killed mid-epoch: elastic training against the restart path.

    python -m benchmarks.elastic --trials 20                 # zmq, grpc, tcpstore, etcd
    python -m benchmarks.elastic --transports zmq --trials 5

Each trial runs a 3-rank job under ``dataparallel launch`` (a small MLP, 2 epochs of 24
steps, a checkpoint after every epoch); rank 2 SIGKILLs itself at step 5 of epoch 1 and
writes the time. Recovery is the time from that kill to the survivors' first completed
optimizer step of the redone epoch (rank 0's clock, the same machine; a step the victim had
already joined before it died does not count):

- ``elastic``: ``launch --elastic`` with ``TrainOptions(elastic=True)``: the survivors regroup
  in the same processes and redo epoch 1 from its in-memory start.
- ``restart``: ``launch --max-restarts 1``: the launcher stops the group, starts all three
  again, and they resume from the checkpoint file written after epoch 0.

Liveness is the default (``heartbeat=1``, ``liveness_timeout=10``): tcpstore and etcd notice
the kill by missed heartbeats or an expired lease; zmq and grpc by the closed connections.
Writes ``benchmarks/results/elastic.json`` (every sample, p50 and p99 per transport and path)
and ``elastic.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import free_port, machine, percentile, run_main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
TRANSPORTS = ["zmq", "grpc", "tcpstore", "etcd"]
KILL_AT = (1, 5)  # epoch, batch


# ---------------------------------------------------------------------- the job (a worker)
def worker(out: Path) -> None:
    """One rank; elastic when launched with ``--elastic`` (``DP_ELASTIC``, which
    ``TrainOptions`` reads)."""
    import torch
    from torch.utils.data import TensorDataset

    import dataparallel as dp

    ch = dp.connect()
    attempt = int(os.environ.get("DP_RESTART_COUNT", "0"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(144, 16, generator=g)
    data = TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    steps: list[tuple[float, int, int]] = []

    def on_step(info: dp.StepInfo) -> None:
        time.sleep(0.02)  # a step that takes some time, as real ones do
        steps.append((time.time(), info.epoch, info.batch))
        if attempt == 0 and ch.rank == 2 and (info.epoch, info.batch) == KILL_AT:
            (out / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    options = dp.TrainOptions(epochs=2, batch_size=2, progress=False, checkpoint=str(out / "ckpt.pt"), resume=True)
    dp.fit(ch, model, torch.nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01), data,
           options=options, step_callbacks=[on_step])  # fmt: skip
    if ch.rank == 0:
        (out / f"steps.{attempt}.json").write_text(json.dumps(steps))
    ch.close()


# ---------------------------------------------------------------------- trials
def url_for(transport: str, etcd_port: int | None) -> str:
    if transport == "etcd":
        return f"etcd://127.0.0.1:{etcd_port}"
    return f"{transport}://127.0.0.1:{free_port()}"


def trial(transport: str, path: str, etcd_port: int | None) -> float | None:
    """Seconds from the kill to rank 0's first step after it, or None if the job failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        flags = ["--elastic"] if path == "elastic" else ["--max-restarts", "1"]
        url, job = url_for(transport, etcd_port), f"bench-{time.monotonic_ns()}"
        cmd = [sys.executable, "-m", "dataparallel", "launch", "--nprocs", "3", "--url", url, "--job", job, *flags,
               "-m", "benchmarks.elastic", "--", "--worker", str(out)]  # fmt: skip
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
        killed = out / "killed"
        if run.returncode != 0 or not killed.exists():
            print(f"  {transport} {path}: failed (exit {run.returncode})\n{run.stderr[-2000:]}", flush=True)
            return None
        at = float(killed.read_text())
        steps = [step for f in sorted(out.glob("steps.*.json")) for step in json.loads(f.read_text())]
        # The redone epoch's first step (the kill came later in that epoch's first pass).
        redone = [t for t, epoch, batch in steps if t > at and (epoch, batch) == (KILL_AT[0], 0)]
        return min(redone) - at if redone else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", nargs="+", default=TRANSPORTS, choices=TRANSPORTS)
    parser.add_argument("--trials", type=int, default=20, help="kills per transport for the elastic path")
    parser.add_argument(
        "--heartbeat-trials",
        type=int,
        default=None,
        help="kills for the elastic path where losses wait for missed heartbeats (tcpstore, etcd; default --trials)",
    )
    parser.add_argument("--restart-trials", type=int, default=5, help="kills per transport for the restart path")
    parser.add_argument("--out", type=Path, default=RESULTS / "elastic.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    from tqdm import tqdm

    from benchmarks.control_plane import start_server

    results: dict = {"machine": machine(), "kill_at": KILL_AT, "samples": {}, "summary": {}}
    for transport in args.transports:
        etcd_port = free_port() if transport == "etcd" else None
        server = start_server("etcd", etcd_port) if etcd_port else None
        try:
            elastic_trials = args.trials
            if transport in ("tcpstore", "etcd") and args.heartbeat_trials is not None:
                elastic_trials = args.heartbeat_trials
            for path, trials in (("elastic", elastic_trials), ("restart", args.restart_trials)):
                samples = [
                    trial(transport, path, etcd_port)
                    for _ in tqdm(range(trials), desc=f"{transport} {path}", unit="kill", leave=False)
                ]
                ok = [s for s in samples if s is not None]
                results["samples"][f"{transport} {path}"] = samples
                results["summary"][f"{transport} {path}"] = {
                    "trials": trials,
                    "failed": trials - len(ok),
                    "p50_s": percentile(ok, 50) if ok else None,
                    "p99_s": percentile(ok, 99) if ok else None,
                }
                print(f"{transport:8s} {path:8s} {results['summary'][f'{transport} {path}']}", flush=True)
        finally:
            if server is not None:
                server.kill()
                server.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["samples"])
    data = [[s for s in results["samples"][n] if s is not None] or [float("nan")] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.boxplot(data, orientation="horizontal", tick_labels=names, whis=(0, 100))
    ax.set_xscale("log")
    ax.set_xlabel("seconds from SIGKILL of a follower to the survivors' next step (log)")
    ax.set_title(f"Recovery: elastic regroup vs restart + checkpoint ({results['machine'].split(';')[0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    run_main("benchmarks.elastic", main)
