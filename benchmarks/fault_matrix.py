"""Does a look at a running job name the rank that went wrong, and why, within 5 s?

    python -m benchmarks.fault_matrix [--kinds zmq grpc etcd] [--trials 20] [--faults ...]

Needs root (network namespaces) and, for etcd, the ``etcd`` binary. Four ranks of ``dp.fit``
(gloo on CPU, steps of about 20 ms: 15 ms of it a sleep that stands for a GPU's compute)
train on three hosts of a private network (:class:`~dataparallel.testing.netns.PrivateNetwork`):
ranks 0 and 1 on host 1, rank 2 on host 2, rank 3 on host 3; the coordinator (``dataparallel
serve``) or etcd on host 4, and an observer there (:func:`dataparallel.observe` and
:func:`~dataparallel.control.status.read_job` with a :class:`JobWatch`, five looks a second,
as ``dataparallel top`` looks) whose views this harness reads. Faults, one at a time, on a
rank that changes from trial to trial:

  sigstop    the rank's process is stopped (SIGSTOP; SIGCONT after)     -> named silent (or lost)
  slow       the rank's own work per step takes 1.3x as long             -> named a straggler
  data       the rank's data loader blocks                               -> named behind, in data
  partition  a host's link goes down (hosts 2, 3 and 1 in turn)          -> its ranks named silent (or lost)
  kill       the rank's process is killed (a fresh job each trial)       -> named lost (or silent)
  loop       the rank spins in a Python loop inside its forward          -> named behind, in forward

A trial passes when, within 5 s of the fault, the observer names every rank the fault hit
with its cause, and names no other rank (a stall or a straggler) before. The faults of one
job are interleaved trial by trial; between trials the job is left to become healthy again
(every rank running and stepping, no stall, no straggler). Writes ``--out`` (default
``benchmarks/results/fault_matrix.json``): per transport and fault, the trials' detection
times and outcomes, and the verdict against the target (19 of 20 or better).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, run_main, write_result

RESULTS = Path(__file__).resolve().parent / "results"
FAULTS = ("sigstop", "slow", "data", "partition", "kill", "loop")
#: Where each rank runs (host number on the private network); host 4 holds the coordinator
#: (or etcd) and the observer.
HOST_OF_RANK = (1, 1, 2, 3)
SERVER_HOST = 4
WORLD = 4
WITHIN = 5.0  # seconds: the target
WATCH_FOR = 8.0  # seconds a trial watches before it gives up
COMPUTE = 0.015  # seconds of a step's forward that stand for a GPU's compute
SLOWER = 1.3


# ---------------------------------------------------------------------- one rank
def worker(url: str, rank: int, job: str, control: Path) -> None:
    import torch

    import dataparallel as dp

    torch.set_num_threads(1)
    fault_file = control / f"fault-{rank}"

    def fault() -> str:
        try:
            return fault_file.read_text().strip()
        except FileNotFoundError:
            return ""

    ch = dp.connect(url, rank=rank, world_size=WORLD, job=job, timeout=60)
    slow_by: list[float] = []  # the extra seconds a slowed step takes (set when slowing starts)

    class Faulty(torch.nn.Module):
        """A linear model whose forward takes :data:`COMPUTE` seconds, or spins, or is slowed."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inner = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            what = fault()
            if what == "loop":  # a Python loop that does not end until told (at most a minute)
                deadline = time.monotonic() + 60
                while fault() == "loop" and time.monotonic() < deadline:
                    sum(range(20_000))
            extra = 0.0
            if what == "slow":
                own = None if slow_by else ch.status.own_time()
                if own:  # 0.3x the rank's own time per step as it was before
                    slow_by.append((SLOWER - 1.0) * own)
                extra = slow_by[0] if slow_by else 0.0
            else:
                slow_by.clear()
            time.sleep(COMPUTE + extra)
            return self.inner(x)

    class Data(torch.utils.data.Dataset):
        """Synthetic samples; a read blocks while the rank's fault is ``data`` (at most a minute)."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1)
            self.x = torch.randn(WORLD * 16 * 400, 8, generator=g)
            self.y = self.x.sum(1, keepdim=True)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            deadline = time.monotonic() + 60
            while fault() == "data" and time.monotonic() < deadline:
                time.sleep(0.02)
            return self.x[i], self.y[i]

    print("joined", flush=True)
    dp.fit(
        ch,
        Faulty(),
        torch.nn.functional.mse_loss,
        lambda p: torch.optim.SGD(p, lr=0.01),
        Data(),
        options=dp.TrainOptions(epochs=10_000, batch_size=16, progress=False, collective_timeout=300),
    )


# ---------------------------------------------------------------------- the observer
def observe(url: str, job: str) -> None:
    """Print what each look at ``job`` shows, one JSON line a look, five looks a second."""
    import dataparallel as dp
    from dataparallel.control.status import JobWatch, read_job
    from dataparallel.errors import ControlError

    channel = None
    watch = JobWatch()
    while True:
        started = time.time()
        try:
            if channel is None or channel.failure is not None:
                if channel is not None:
                    channel.close()
                channel = dp.observe(url, job=job, timeout=5)
            view = read_job(channel, world_size=WORLD, watch=watch)
            line: dict[str, Any] = {
                "t": started,
                "stalls": [{"rank": s["rank"], "phase": s["phase"], "cause": s["cause"]} for s in view["stalls"]],
                "stragglers": [{"rank": s["rank"], "cause": s["cause"]} for s in view["stragglers"]],
                "ranks": {
                    r["rank"]: [r["state"], r["step"], r["pid"], r["phase"], r["own_s"], r.get("scores")]
                    for r in view["ranks"]
                },
            }
        except ControlError as err:
            line = {"t": started, "error": str(err)}
        print(json.dumps(line), flush=True)
        time.sleep(max(0.0, 0.2 - (time.time() - started)))


# ---------------------------------------------------------------------- the harness
class Job:
    """Four ranks of one job on the private network, the observer's views as they come."""

    def __init__(self, net: Any, url: str, job: str, control: Path) -> None:
        self.net, self.url, self.job, self.control = net, url, job, control
        for rank in range(WORLD):
            (control / f"fault-{rank}").unlink(missing_ok=True)
        me = [sys.executable, "-m", "benchmarks.fault_matrix"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
        env["OMP_NUM_THREADS"] = "1"
        self.workers = [
            net.popen(
                HOST_OF_RANK[rank],
                [*me, "--worker", url, "--rank", str(rank), "--job", job, "--control", str(control)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                cwd=Path(__file__).resolve().parents[1],
            )
            for rank in range(WORLD)
        ]
        self.observer = net.popen(
            SERVER_HOST,
            [*me, "--observe", url, "--job", job],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
        self.looks: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.observer.stdout is not None
        for line in self.observer.stdout:
            with contextlib.suppress(ValueError):
                self.looks.append(json.loads(line))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.workers)

    def healthy(self, within: float) -> bool:
        """Wait until every rank runs and steps, with no stall and no straggler, for two
        seconds of looks; False after ``within`` seconds."""
        deadline = time.monotonic() + within
        good_since: dict[str, Any] | None = None  # the first good look of the current good stretch
        seen = len(self.looks)
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.2)
            new, seen = self.looks[seen:], len(self.looks)
            for look in new:
                ranks = look.get("ranks") or {}
                ok = (
                    "error" not in look
                    and len(ranks) == WORLD
                    and all(v[0] == "running" and v[1] is not None for v in ranks.values())
                    and not look["stalls"]
                    and not look["stragglers"]
                )
                good_since = (good_since or look) if ok else None
                if good_since is not None and look["t"] - good_since["t"] >= 2.0:
                    before = good_since["ranks"]
                    if all(v[1] > before[r][1] for r, v in ranks.items()):  # every rank stepped meanwhile
                        return True
        return False

    def pid(self, rank: int) -> int:
        return self.workers[rank].pid

    def set_fault(self, rank: int, what: str) -> None:
        path = self.control / f"fault-{rank}"
        if what:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(what)
            tmp.replace(path)
        else:
            path.unlink(missing_ok=True)

    def watch(self, since: float, hit: set[int], fault: str) -> dict[str, Any]:
        """The first look after ``since`` naming every rank of ``hit`` as ``fault`` does, within
        :data:`WATCH_FOR` seconds; and the other ranks named before it."""
        wrong: set[int] = set()
        said: list[str] = []  # what named the others
        trace: list[list[Any]] = []  # what each look saw of the hit ranks (kept where late)
        seen = 0
        deadline = time.monotonic() + WATCH_FOR
        while time.monotonic() < deadline:
            time.sleep(0.05)
            new, seen = self.looks[seen:], len(self.looks)
            for look in new:
                if look["t"] < since or "error" in look:
                    continue
                named = _named(look, fault)
                ranks = look.get("ranks") or {}
                trace.append([round(look["t"] - since, 2), *(ranks.get(str(r)) for r in sorted(hit))])
                others = {r for r in _all_named(look) if r not in hit}
                if others - wrong:
                    said += _causes(look, others - wrong)
                wrong |= others
                if hit <= named:
                    seconds = round(look["t"] - since, 3)
                    return {
                        "seconds": seconds,
                        "wrong": sorted(wrong),
                        "wrong_causes": said,
                        "cause": _causes(look, hit),
                        **({"trace": trace} if seconds > WITHIN or wrong else {}),
                    }
        return {"seconds": None, "wrong": sorted(wrong), "wrong_causes": said, "cause": None, "trace": trace}

    def close(self) -> None:
        for p in [*self.workers, self.observer]:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def errors(self) -> str:
        out = []
        for rank, p in enumerate(self.workers):
            if p.poll() is not None and p.stderr is not None:
                out.append(f"rank {rank} exit {p.returncode}: {p.stderr.read().decode(errors='replace')[-600:]}")
        return "\n".join(out)


def _named(look: dict[str, Any], fault: str) -> set[int]:
    """The ranks ``look`` names with the cause ``fault`` makes."""
    if fault in ("sigstop", "partition", "kill"):  # silent, or lost where its loss was declared
        return {s["rank"] for s in look["stalls"] if s["cause"].startswith(("silent", "lost"))}
    if fault == "slow":
        return {s["rank"] for s in look["stragglers"]}
    phase = {"data": "data", "loop": "forward"}[fault]
    return {s["rank"] for s in look["stalls"] if s["phase"] == phase and not s["cause"].startswith("silent")}


def _all_named(look: dict[str, Any]) -> set[int]:
    return {s["rank"] for s in look["stalls"]} | {s["rank"] for s in look["stragglers"]}


def _causes(look: dict[str, Any], hit: set[int]) -> list[str]:
    return [f"rank {s['rank']}: {s['cause']}" for s in [*look["stalls"], *look["stragglers"]] if s["rank"] in hit]


def _target(fault: str, trial: int) -> tuple[set[int], int | None]:
    """The ranks a trial's fault hits, and the host it cuts off (partition)."""
    if fault == "partition":
        host = (2, 3, 1)[trial % 3]
        return {r for r, h in enumerate(HOST_OF_RANK) if h == host}, host
    return {(trial + 1) % WORLD}, None


def _inject(job: Job, fault: str, hit: set[int], host: int | None) -> None:
    for rank in hit:
        if fault == "sigstop":
            os.kill(job.pid(rank), signal.SIGSTOP)
        elif fault == "kill":
            os.kill(job.pid(rank), signal.SIGKILL)
        elif fault in ("slow", "data", "loop"):
            job.set_fault(rank, fault)
    if host is not None:
        job.net.cut(host)


def _clear(job: Job, fault: str, hit: set[int], host: int | None) -> None:
    if host is not None:
        job.net.heal(host)
    for rank in hit:
        if fault == "sigstop":
            with contextlib.suppress(ProcessLookupError):
                os.kill(job.pid(rank), signal.SIGCONT)
        elif fault in ("slow", "data", "loop"):
            job.set_fault(rank, "")


class Server:
    """The transport's server on host 4: ``dataparallel serve`` for zmq and grpc, etcd."""

    def __init__(self, net: Any, kind: str, scratch: Path) -> None:
        address = net.address(SERVER_HOST)
        self.etcd = None
        if kind == "etcd":
            from dataparallel.testing.etcd import EtcdServer

            self.etcd = EtcdServer(scratch / "etcd", host=address, wrap=net.command(SERVER_HOST, [])).start()
            port = self.etcd.client_port
            self.proc = self.etcd.proc
        else:
            port = 29500
            self.proc = net.popen(
                SERVER_HOST,
                [sys.executable, "-m", "dataparallel", "serve", f"{kind}://{address}:{port}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        net.wait_listening(1, address, port)
        # A partition lasts up to WATCH_FOR seconds: liveness must outlast it, or the job ends.
        self.url = f"{kind}://{address}:{port}?liveness_timeout=30"

    def close(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
        elif self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def run_kind(net: Any, kind: str, faults: list[str], trials: int, scratch: Path, bar: Any) -> dict[str, Any]:
    control = scratch / f"control-{kind}"
    control.mkdir(parents=True, exist_ok=True)
    server = Server(net, kind, scratch)
    results: dict[str, list[dict[str, Any]]] = {f: [] for f in faults}
    restarts = 0
    job: Job | None = None
    try:
        for trial in range(trials):
            for fault in faults:
                fresh = fault == "kill" or job is None or not job.alive()
                if fresh:
                    if job is not None:
                        restarts += not job.alive() and fault != "kill"
                        job.close()
                    job = Job(net, server.url, f"faults-{kind}-{trial}-{fault}", control)
                assert job is not None
                if not job.healthy(within=90 if fresh else 60):
                    results[fault].append({"trial": trial, "seconds": None, "wrong": [], "note": "job not healthy"})
                    job.close()
                    job = None
                    bar.update()
                    continue
                hit, host = _target(fault, trial)
                at = time.time()
                _inject(job, fault, hit, host)
                try:
                    seen = job.watch(at, hit, fault)
                finally:
                    _clear(job, fault, hit, host)
                ok = seen["seconds"] is not None and seen["seconds"] <= WITHIN and not seen["wrong"]
                results[fault].append({"trial": trial, "ranks": sorted(hit), **seen, "ok": ok})
                bar.set_postfix_str(f"{kind} {fault}: {seen['seconds']}")
                bar.update()
                if fault == "kill":
                    job.close()
                    job = None
    finally:
        if job is not None:
            job.close()
        server.close()
    summary = {}
    for fault, rows in results.items():
        times = [r["seconds"] for r in rows if r.get("ok")]
        passed = sum(bool(r.get("ok")) for r in rows)
        summary[fault] = {
            "trials": rows,
            "passed": passed,
            "of": len(rows),
            "median_s": round(statistics.median(times), 3) if times else None,
            "max_s": max(times) if times else None,
            "verdict": "met" if len(rows) >= 20 and passed >= len(rows) * 19 / 20 else "missed" if rows else "-",
        }
    return {"faults": summary, "job_restarts_after_a_fault": restarts}


def table(result: dict[str, Any]) -> str:
    kinds = list(result["kinds"])
    lines = ["| fault | " + " | ".join(kinds) + " |", "| --- |" + " --- |" * len(kinds)]
    for fault in result["faults"]:
        cells = []
        for kind in kinds:
            f = result["kinds"][kind]["faults"].get(fault)
            if f is None:
                cells.append("-")
                continue
            cells.append(f"{f['passed']}/{f['of']}, median {f['median_s']} s, max {f['max_s']} s")
        lines.append(f"| {fault} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=["zmq", "grpc", "etcd"], choices=["zmq", "grpc", "etcd"])
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "fault_matrix.json")
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--observe", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--control", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rank, args.job, args.control)
        return 0
    if args.observe:
        observe(args.observe, args.job)
        return 0
    from tqdm import tqdm

    from dataparallel.testing.netns import PrivateNetwork, netns_unavailable

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # ended as Ctrl-C is: namespaces deleted
    why = netns_unavailable()
    if why is not None:
        print(f"fault_matrix needs network namespaces: {why}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "machine": machine(),
        "world_size": WORLD,
        "hosts": {"ranks": list(HOST_OF_RANK), "server and observer": SERVER_HOST},
        "target": f"every hit rank named with its cause within {WITHIN:g} s, no other named first, "
        "in at least 19 of 20 trials",
        "faults": args.faults,
        "kinds": {},
    }
    with tempfile.TemporaryDirectory() as tmp, PrivateNetwork(hosts=SERVER_HOST) as net:
        with tqdm(total=len(args.kinds) * len(args.faults) * args.trials, desc="trials") as bar:
            for kind in args.kinds:
                result["kinds"][kind] = run_kind(net, kind, args.faults, args.trials, Path(tmp) / kind, bar)
                write_result(args.out, result)
    print(table(result))
    return 0


if __name__ == "__main__":
    run_main("benchmarks.fault_matrix", main)
