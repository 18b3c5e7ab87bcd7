"""What saying what each rank does costs a training step: ``dp.fit`` as it is (each rank's
phases, step times and split kept, its record published every second) against ``dp.fit``
with that bookkeeping and publishing taken out, same model, data, processes and run.

    python -m benchmarks.status_overhead [--nprocs 2] [--epochs 24] [--repeats 4]

N processes, gloo on CPU, the MLP and data of ``benchmarks.train_loop`` (56 steps of batch 64
per rank and epoch with 2 ranks), over zmq. Within each run the epochs alternate: some
as ``dp.fit`` is, the others with the bookkeeping taken out on every rank (the heartbeats
carry no record then), so each pair of neighbouring epochs compares the two in the
same processes, in blocks of four (on, off, off, on) so that a drift within a block or an
effect of the epoch before counts against both sides alike. The driver's training time per
epoch (``EpochMetrics.train_seconds``; the first block dropped as warm-up); the geometric
mean of the pairs' ratios and its 95% interval (``log_ratio_interval``: the plain mean of
ratios this noisy overstates them by about 1%), held to the target (at most 1.01: 1% of a step);
beside it, the same ratio of the CPU seconds all ranks' processes spent over the same
epochs' training (every thread: what the status costs as work, not as waiting), and of the
ranks' training threads alone (where the status's bookkeeping runs; gloo's threads' noise
left out). Also
what each part costs measured alone (a phase change, five a step; a step's end; the record
made for a heartbeat, one a second) and their share of a step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import free_port, log_ratio_interval, machine, run_main, verdict, write_result
from benchmarks.train_loop import setup

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 1.01


#: What ``--off`` may take out: a step's bookkeeping (its phases and its end), the publishing
#: (the record a heartbeat carries, or that the publishing thread writes where none does).
PARTS = {"steps": ("enter", "step_done", "step_started"), "publish": ("_write", "_riding")}
#: What a part returns on the off side: ``enter`` the phase left, ``_riding`` the writes.
OFF_RETURNS: dict[str, object] = {"_riding": []}


def worker(
    rank: int,
    world: int,
    port: int,
    epochs: int,
    same: bool = False,
    off: tuple[str, ...] = tuple(PARTS),
    batch: int = 64,
) -> dict[str, list[float]]:
    import dataparallel as dp
    from dataparallel.control.status import RankStatus

    kept = {name: getattr(RankStatus, name) for part in off for name in PARTS[part]}
    original_at = RankStatus.at
    on = [True]

    def at(self: RankStatus, epoch: int | None = None, step: int | None = None) -> None:
        if epoch is not None:  # every rank at the same epoch: blocks of on, off, off, on
            on[0] = same or epoch % 4 in (0, 3)
        if on[0]:
            original_at(self, epoch, step)

    def switched(name: str):
        def call(self: RankStatus, *args, **kwargs):
            return kept[name](self, *args, **kwargs) if on[0] else OFF_RETURNS.get(name, "")

        return call

    RankStatus.at = at  # type: ignore[method-assign]
    for name in kept:
        setattr(RankStatus, name, switched(name))
    # The process's CPU seconds (every thread: training, heartbeats, in rank 0 the
    # coordinator) over each epoch's training: from its first ``at(epoch=...)`` to its
    # ``epoch end``.
    cpu: list[float] = []
    began = [0.0]
    # And the training thread's own (``dp.fit`` trains on the thread that calls it, where
    # ``at`` and ``enter`` are called): the status's bookkeeping alone, without the noise of
    # gloo's threads.
    main_cpu: list[float] = []
    main_began = [0.0]
    marked_at, marked_enter = RankStatus.at, RankStatus.enter

    def cpu_now() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def at_marked(self: RankStatus, epoch: int | None = None, step: int | None = None) -> None:
        if epoch is not None and len(cpu) == epoch and not began[0]:
            began[0] = cpu_now()
            main_began[0] = time.thread_time()
        marked_at(self, epoch, step)

    def enter_marked(self: RankStatus, phase: str) -> str:
        if phase == "epoch end" and began[0]:
            main_cpu.append(time.thread_time() - main_began[0])
            cpu.append(cpu_now() - began[0])
            began[0] = 0.0
        return marked_enter(self, phase)

    RankStatus.at = at_marked  # type: ignore[method-assign]
    RankStatus.enter = enter_marked  # type: ignore[method-assign]
    ch = dp.connect(f"zmq://127.0.0.1:{port}", rank=rank, world_size=world, job="bench", timeout=120)
    model, train, val = setup()
    seconds: list[float] = []
    dp.fit(
        ch,
        model,
        torch.nn.functional.cross_entropy,
        lambda p: torch.optim.Adam(p, lr=1e-3),
        train,
        val,
        options=dp.TrainOptions(epochs=epochs, batch_size=batch, progress=False),
        callbacks=[lambda m: seconds.append(m.train_seconds)],
    )
    ch.close()
    return {"seconds": seconds, "cpu": cpu, "main_cpu": main_cpu}


def run(
    world: int, epochs: int, same: bool = False, off: tuple[str, ...] = tuple(PARTS), batch: int = 64
) -> tuple[list[tuple[float, float]], list[tuple[float, float]], list[tuple[float, float]]]:
    """One run's (on, off) pairs of neighbouring epochs, two a block of four (on, off, off,
    on), the first block dropped: of the driver's training seconds, of the CPU seconds all
    ranks' processes spent over the same epochs' training, and of their training threads'."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.status_overhead", "--worker", "--port", str(port)]
    cmd += ["--nprocs", str(world), "--epochs", str(epochs), *(["--same"] if same else [])]
    cmd += ["--off", *off, "--batch", str(batch)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    seconds = outs[0]["seconds"]
    cpu = [sum(epoch) for epoch in zip(*(out["cpu"] for out in outs), strict=True)]
    main_cpu = [sum(epoch) for epoch in zip(*(out["main_cpu"] for out in outs), strict=True)]
    pairs, cpu_pairs, main_pairs = [], [], []
    for i in range(4, len(seconds) - 3, 4):
        pairs += [(seconds[i], seconds[i + 1]), (seconds[i + 3], seconds[i + 2])]
        cpu_pairs += [(cpu[i], cpu[i + 1]), (cpu[i + 3], cpu[i + 2])]
        main_pairs += [(main_cpu[i], main_cpu[i + 1]), (main_cpu[i + 3], main_cpu[i + 2])]
    return pairs, cpu_pairs, main_pairs


def parts_cost(rounds: int = 100_000) -> dict[str, float]:
    """Seconds, measured alone: one phase change (``RankStatus.enter``), one step's end
    (``step_done``), and one publish of a rank's record over zmq as its heartbeat carries it
    (the record and its JSON; once a second per rank), and as a ``set`` of its own (where
    no heartbeat carries it)."""
    import dataparallel as dp

    ch = dp.connect(f"zmq://127.0.0.1:{free_port()}", rank=0, world_size=1, job="bench", timeout=10)
    try:
        status = ch.status
        names = ("data", "forward", "backward", "optimizer")
        started = time.perf_counter()
        for i in range(rounds):
            status.enter(names[i % 4])
        enter = (time.perf_counter() - started) / rounds
        started = time.perf_counter()
        for i in range(rounds):
            status.step_done(i)
        step_done = (time.perf_counter() - started) / rounds
        started = time.perf_counter()
        for _ in range(1000):
            status._riding()
        carried = (time.perf_counter() - started) / 1000
        started = time.perf_counter()
        for _ in range(1000):
            status._write()
        apart = (time.perf_counter() - started) / 1000
        return {"phase_change_s": enter, "step_done_s": step_done, "publish_s": carried, "publish_apart_s": apart}
    finally:
        ch.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "status_overhead.json")
    parser.add_argument(
        "--pairs-from",
        type=Path,
        help="take the epochs of an earlier result file (its pairs, in order) instead of running; parts measured again",
    )
    parser.add_argument(
        "--same",
        action="store_true",
        help="both sides as dp.fit is (status on): what the comparison finds where there is nothing to find",
    )
    parser.add_argument(
        "--off",
        nargs="+",
        choices=list(PARTS),
        default=list(PARTS),
        help="what the off side takes out: a step's bookkeeping, the publishing, or both (default)",
    )
    parser.add_argument("--batch", type=int, default=64, help="samples per step and rank (default 64)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        torch.set_num_threads(1)
        out = worker(args.rank, args.nprocs, args.port, args.epochs, args.same, tuple(args.off), args.batch)
        print(json.dumps(out), flush=True)
        return 0
    from tqdm import tqdm

    pairs: list[tuple[float, float]] = []
    cpu_pairs: list[tuple[float, float]] = []
    main_pairs: list[tuple[float, float]] = []
    if args.pairs_from is not None:
        earlier = json.loads(args.pairs_from.read_text())
        sides = earlier["train_s_per_epoch"]
        pairs = list(zip(sides["status on"], sides["status off"], strict=True))
        cpu_sides = earlier.get("cpu_s_per_epoch") or {"status on": [], "status off": []}
        cpu_pairs = list(zip(cpu_sides["status on"], cpu_sides["status off"], strict=True))
        main_sides = earlier.get("training_thread_cpu_s_per_epoch") or {"status on": [], "status off": []}
        main_pairs = list(zip(main_sides["status on"], main_sides["status off"], strict=True))
        args.nprocs, args.epochs, args.repeats = earlier["world_size"], earlier["epochs"], earlier["runs"]
        args.same = str(earlier.get("sides", "")).startswith("both")
        args.off, args.batch = earlier.get("taken_out") or list(PARTS), earlier.get("batch", 64)
    for _ in tqdm(range(0 if args.pairs_from else args.repeats), desc="runs"):
        got, got_cpu, got_main = run(args.nprocs, args.epochs, args.same, tuple(args.off), args.batch)
        pairs += got
        cpu_pairs += got_cpu
        main_pairs += got_main
    sides = {"status on": [on for on, _ in pairs], "status off": [off for _, off in pairs]}
    cpu_sides = {"status on": [on for on, _ in cpu_pairs], "status off": [off for _, off in cpu_pairs]}
    interval = log_ratio_interval(pairs)
    cpu_interval = log_ratio_interval(cpu_pairs) if cpu_pairs else None
    main_sides = {"status on": [on for on, _ in main_pairs], "status off": [off for _, off in main_pairs]}
    main_interval = log_ratio_interval(main_pairs) if main_pairs else None
    parts = parts_cost()
    steps = -(-7168 // (args.batch * args.nprocs))
    step_s = statistics.median(sides["status off"]) / steps
    # What the parts add to a step: five phase changes and a step's end, and a second's publish
    # spread over the steps of a second.
    added = (5 * parts["phase_change_s"] + parts["step_done_s"]) / step_s + parts["publish_s"] / 1.0
    print(f"{args.nprocs} processes, gloo, {args.repeats} runs of {args.epochs} epochs: {len(pairs)} pairs of epochs")
    for name, values in sides.items():
        med = statistics.median(values)
        print(f"  {name:10s} training per epoch {med * 1e3:7.1f} ms ({med / steps * 1e3:.2f} ms a step)")
    if interval is not None:
        mean, low, high = interval
        held = (
            "an A/A comparison: 1 where the method is fair"
            if args.same
            else f"target <= {TARGET}: {verdict(interval, TARGET)}"
        )
        print(f"  on/off: {mean:.4f} (95% {low:.4f}..{high:.4f}); {held}")
    if cpu_interval is not None:
        mean, low, high = cpu_interval
        print(f"  CPU of all ranks' processes over the same epochs, on/off: {mean:.4f} (95% {low:.4f}..{high:.4f})")
    if main_interval is not None:
        mean, low, high = main_interval
        print(f"  CPU of the ranks' training threads, on/off: {mean:.4f} (95% {low:.4f}..{high:.4f})")
    print(
        f"  alone: a phase change {parts['phase_change_s'] * 1e9:.0f} ns (five a step), a step's end "
        f"{parts['step_done_s'] * 1e9:.0f} ns, a publish {parts['publish_s'] * 1e6:.0f} us on a heartbeat "
        f"({parts['publish_apart_s'] * 1e6:.0f} us as a set of its own; one a second): "
        f"{added * 100:.3f}% of a {step_s * 1e3:.2f} ms step"
    )
    write_result(
        args.out,
        {
            "machine": machine(),
            "backend": "gloo",
            "world_size": args.nprocs,
            "sides": "both on (an A/A comparison)" if args.same else "status on against off",
            "taken_out": [] if args.same else args.off,
            "batch": args.batch,
            "epochs": args.epochs,
            "runs": args.repeats,
            "pairs": len(pairs),
            "steps_per_epoch": steps,
            "train_s_per_epoch": sides,
            "ratio_on_off_geometric": None
            if interval is None
            else dict(zip(("mean", "low", "high"), interval, strict=True)),
            "cpu_s_per_epoch": cpu_sides if cpu_pairs else None,
            "cpu_ratio_on_off_geometric": None
            if cpu_interval is None
            else dict(zip(("mean", "low", "high"), cpu_interval, strict=True)),
            "training_thread_cpu_s_per_epoch": main_sides if main_pairs else None,
            "training_thread_cpu_ratio_on_off_geometric": None
            if main_interval is None
            else dict(zip(("mean", "low", "high"), main_interval, strict=True)),
            "target": TARGET,
            "verdict": None if args.same else verdict(interval, TARGET),
            "parts_s": parts,
            "parts_share_of_step": added,
        },
    )
    return 0


if __name__ == "__main__":
    run_main("benchmarks.status_overhead", main)
