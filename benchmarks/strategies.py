"""Throughput of the training strategies with and without a straggler: DDP, local SGD and
asynchronous parameter servers.

    python -m benchmarks.strategies                   # 4 ranks, 3 repeats per case
    python -m benchmarks.strategies --repeats 1

Each job runs 4 training ranks under ``dataparallel launch`` (zmq): a small MLP, 3 epochs of
40 optimizer steps of 16 samples per rank (DDP's count; ``async_ps`` hands the same 160
batches out to whichever worker asks, and runs a fifth process, the parameter server). A
step's compute is simulated by a sleep of ``STEP_S`` on every rank (on top of the MLP's own
few hundred microseconds), so that four ranks on a two-core machine measure waiting on each
other, not the CPU they share. Cases:

- ``none``: every rank takes ``STEP_S`` per step;
- ``fixed``: rank 3 is slowed 2x on every step (a slower machine);
- ``random``: on each step one rank, drawn at random, is slowed 2x (stragglers that move:
  noisy neighbours, garbage collection, a contended disk): the draw for a rank's n-th step
  is the same on every rank, so under DDP exactly one rank is slow per step.

Strategies: ``ddp`` (gradients averaged every step: every step waits for the slowest
rank), ``local_sgd`` with ``sync_every=8`` (ranks wait for each other every 8 steps and
at the end of an epoch) and ``async_ps`` (4 workers and 1 server, the default
``max_staleness``: a worker waits for its reads, and for a slower worker only at the
bound). Throughput is the samples of epochs 1 and 2 (epoch 0 warms up)
over their wall time, on rank 0, median of the repeats. Writes
``benchmarks/results/strategies.json`` and ``strategies.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import free_port, machine, run_main

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
STEP_S = 0.02
RANKS, BATCH, STEPS, EPOCHS = 4, 16, 40, 3
CASES = ["none", "fixed", "random"]
STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "local_sgd (sync_every=8)": {"strategy": "local_sgd", "sync_every": 8},
    "async_ps (4 workers + 1 server)": {"strategy": "async_ps"},
}


def processes(strategy: dict) -> int:
    return RANKS + (1 if strategy["strategy"] == "async_ps" else 0)  # + the parameter server


def slowed(case: str, rank: int, step: int) -> bool:
    if case == "fixed":
        return rank == RANKS - 1
    if case == "random":
        return random.Random(step).randrange(RANKS) == rank  # the same draw on every rank
    return False


# ---------------------------------------------------------------------- the job (a worker)
def worker(out: Path, case: str, strategy: dict) -> None:
    import torch
    from torch.utils.data import TensorDataset

    import dataparallel as dp

    ch = dp.connect()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(RANKS * BATCH * STEPS, 32, generator=g)
    data = TensorDataset(x, x @ torch.randn(32, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    seen: dict = {}
    steps = [0]  # this rank's own (async_ps: StepInfo.step counts every worker's updates)

    def on_step(info: dp.StepInfo) -> None:
        steps[0] += 1
        time.sleep(STEP_S * (2 if slowed(case, info.rank, steps[0]) else 1))

    def on_epoch(m: dp.EpochMetrics) -> None:
        seen[m.epoch] = (time.perf_counter(), m.train_samples)

    options = dp.TrainOptions(epochs=EPOCHS, batch_size=BATCH, progress=False, shuffle=False, **strategy)
    dp.fit(ch, model, torch.nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), data,
           options=options, step_callbacks=[on_step], callbacks=[on_epoch])  # fmt: skip
    if ch.rank == 0:
        (t0, _), (_, n1), (t2, n2) = seen[0], seen[1], seen[2]
        (out / "result.json").write_text(json.dumps({"samples_per_s": (n1 + n2) / (t2 - t0)}))
    ch.close()


def job(case: str, strategy: str) -> float | None:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"zmq://127.0.0.1:{free_port()}"
        spec = json.dumps({"out": tmp, "case": case, "strategy": STRATEGIES[strategy]})
        nprocs = processes(STRATEGIES[strategy])
        cmd = [sys.executable, "-m", "dataparallel", "launch", "--nprocs", str(nprocs), "--url", url,
               "-m", "benchmarks.strategies", "--", "--worker", spec]  # fmt: skip
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        result = Path(tmp) / "result.json"
        if run.returncode != 0 or not result.exists():
            print(f"  {strategy} {case}: failed (exit {run.returncode})\n{run.stderr[-2000:]}", flush=True)
            return None
        return json.loads(result.read_text())["samples_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "strategies.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        spec = json.loads(args.worker)
        worker(Path(spec["out"]), spec["case"], spec["strategy"])
        return 0
    from tqdm import tqdm

    results: dict = {"machine": machine(), "ranks": RANKS, "step_s": STEP_S, "samples": {}, "median": {}}
    runs = [(case, strategy) for case in CASES for strategy in STRATEGIES for _ in range(args.repeats)]
    for case, strategy in tqdm(runs, desc="strategies", unit="job"):
        results["samples"].setdefault(case, {}).setdefault(strategy, []).append(job(case, strategy))
    for case, by_strategy in results["samples"].items():
        medians = {
            s: statistics.median([v for v in vals if v is not None] or [float("nan")])
            for s, vals in by_strategy.items()
        }
        results["median"][case] = {s: {"samples_per_s": m, "x_ddp": m / medians["ddp"]} for s, m in medians.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    plot(results, args.out.with_suffix(".png"))
    return 0


def table(results: dict) -> str:
    names = list(STRATEGIES)
    lines = ["| straggler | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for case, by in results["median"].items():
        cells = [f"{by[n]['samples_per_s']:.0f} samples/s ({by[n]['x_ddp']:.2f}x)" for n in names]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases, names = list(results["median"]), list(STRATEGIES)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [results["median"][c][name]["samples_per_s"] for c in cases]
        bars = ax.bar([x + i * width for x in range(len(cases))], values, width, label=name)
        ratios = [results["median"][c][name]["x_ddp"] for c in cases]
        ax.bar_label(bars, [f"{r:.2f}x" for r in ratios], fontsize=7)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cases))], [f"straggler: {c}" for c in cases])
    ax.set_ylabel("samples/s (4 training ranks)")
    ax.set_title(f"Strategies, one rank slowed 2x ({results['machine'].split(';')[0]})", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(names), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    run_main("benchmarks.strategies", main)
