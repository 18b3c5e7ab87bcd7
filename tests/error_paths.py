"""The usual mistakes and failures on one transport, as a user's script meets them through
the API, each caught and printed as ``SCENARIO: ErrorType: message`` (tests/test_error_output.py
reads the whole output: nothing else may appear).

    python tests/error_paths.py SCHEME [--etcd URL --etcd-pid PID] [--pki DIR]

Scenarios: a wrong port (nothing listens), a wrong token, a refused certificate (grpc with
``--pki``), a lost peer (killed), and last the coordinator gone (killed; for etcd the etcd
server, whose pid is given).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dataparallel as dp
from dataparallel.testing import free_port, with_options

LIVENESS = {"heartbeat": 0.3, "liveness_timeout": 2}


def report(scenario: str, call: Callable[[], Any]) -> None:
    try:
        result = call()
    except dp.ControlError as err:
        print(f"{scenario}: {type(err).__name__}: {err}", flush=True)
        return
    if isinstance(result, dp.ControlChannel):
        result.close()
    print(f"{scenario}: no error", flush=True)


def hold(url: str, rank: int, job: str) -> subprocess.Popen:
    """A rank of a job of two in a process of its own, once connected."""
    argv = [sys.executable, "-m", "dataparallel.testing.worker", "hold", "--url", url, "--rank", str(rank)]
    argv += ["--world-size", "2", "--job", job, "--hold", "120", "--no-rendezvous", "--timeout", "30"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and "ready" in proc.stdout.readline(), "the held rank did not connect"
    return proc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scheme")
    parser.add_argument("--etcd", help="a running etcd's URL")
    parser.add_argument("--etcd-pid", type=int, help="its pid, killed in the last scenario")
    parser.add_argument("--pki", help="a directory of tests/pki.py's certificates (grpc: a refused one)")
    args = parser.parse_args()

    def url(job_server: bool = True) -> str:
        base = args.etcd if args.scheme == "etcd" and job_server else f"{args.scheme}://127.0.0.1:{free_port()}"
        return with_options(base, **LIVENESS)

    def connect(at: str, rank: int, job: str, **kwargs: Any) -> dp.ControlChannel:
        return dp.connect(at, rank=rank, world_size=2, job=job, **{"timeout": 10, **kwargs})

    report("wrong port", lambda: connect(url(job_server=False), 1, "wrong-port", timeout=2))

    at = url()
    with connect(at, 0, "token", token="right"):
        report("wrong token", lambda: connect(at, 1, "token", token="wrong", timeout=3))

    if args.scheme == "grpc" and args.pki:
        pki = Path(args.pki)
        port = free_port()
        files = {"ca": pki / "ca.pem", "cert": pki / "cert.pem", "key": pki / "key.pem"}
        with connect(with_options(f"grpc://127.0.0.1:{port}", tls=1, **files, **LIVENESS), 0, "certificate"):
            rogue = with_options(f"grpc://127.0.0.1:{port}", tls=1, ca=pki / "rogue_ca.pem", **LIVENESS)
            report("refused certificate", lambda: connect(rogue, 1, "certificate", timeout=3))

    at = url()
    with connect(at, 0, "lost") as channel:
        peer = hold(at, 1, "lost")
        peer.kill()
        peer.wait()
        report("lost peer", lambda: channel.barrier("after", timeout=30))

    at = url()
    coordinator = None if args.scheme == "etcd" else hold(at, 0, "gone")
    channel = connect(at, 1, "gone")
    if coordinator is not None:
        coordinator.kill()
        coordinator.wait()
    else:
        os.kill(args.etcd_pid, signal.SIGKILL)
    start = time.monotonic()
    report("coordinator gone", lambda: channel.get("never", timeout=30))
    try:
        channel.close()
    except dp.ControlError:
        pass  # gone with its coordinator
    assert time.monotonic() - start < 30, "the coordinator's loss was not noticed before the call's timeout"
    return 0


if __name__ == "__main__":
    sys.exit(main())
