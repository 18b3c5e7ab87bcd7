"""Helpers shared by the transport-specific tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

import dataparallel as dp
from dataparallel.testing import close_all, run_all

FAST = {"heartbeat": 0.2, "liveness_timeout": 2}


def open_job(url: str, n: int, **kwargs) -> list[dp.ControlChannel]:
    """Connect ranks 0..n-1 concurrently and rendezvous them."""
    kwargs.setdefault("timeout", 20)
    channels = run_all([lambda r=r: dp.connect(url, rank=r, world_size=n, **kwargs) for r in range(n)])
    run_all([lambda c=c: c.rendezvous() for c in channels])
    return channels


def exercise(channels: list[dp.ControlChannel], tag: str) -> None:
    """The job still works: a broadcast, and a set seen by another rank."""
    got = run_all([lambda c=c: c.broadcast(tag, tag.encode() if c.rank == 0 else None, timeout=10) for c in channels])
    assert got == [tag.encode()] * len(channels)
    channels[-1].set(tag, b"ok")
    assert channels[0].get(tag, timeout=5) == b"ok"


def expect(kind: type[Exception], fn, *args) -> Exception:
    with pytest.raises(kind) as info:
        fn(*args)
    return info.value


@contextlib.contextmanager
def standalone(url: str, token: str | None) -> Iterator[subprocess.Popen]:
    """A coordinator served by ``dataparallel serve URL`` in a process of its own (so that its
    liveness and memory can be watched), killed at the end."""
    env = {k: v for k, v in os.environ.items() if k != "DP_TOKEN"} | ({"DP_TOKEN": token} if token else {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataparallel", "serve", url], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert "serving" in proc.stdout.readline()
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def mutate(frame: bytes, at: int, junk: bytes, cut: bool) -> bytes:
    """``frame`` with ``junk`` written over it at ``at`` (or spliced in, dropping the rest, if ``cut``)."""
    at %= max(len(frame), 1)
    return frame[:at] + junk + (b"" if cut else frame[at + len(junk) :])


class Bystander:
    """A legitimate two-rank job doing barriers and set/get for as long as an attack lasts."""

    def __init__(self, url: str, token: str | None, job: str = "bystander") -> None:
        self.channels = open_job(url, 2, token=token, job=job)
        self.rounds = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in self.channels]
        for t in self._threads:
            t.start()

    def _run(self, ch: dp.ControlChannel) -> None:
        i = 0
        try:
            while True:
                ch.set(f"r{ch.rank}/{i}", str(i).encode())
                assert ch.get(f"r{1 - ch.rank}/{i}", timeout=30) == str(i).encode()
                stop = ch.broadcast("stop", b"1" if self._stop.is_set() else b"0", src=0, timeout=30) == b"1"
                ch.barrier("round", timeout=30)
                i += 1
                if ch.rank == 0:
                    self.rounds = i
                if stop:
                    return
        except BaseException as err:
            self.errors.append(err)

    def __enter__(self) -> Bystander:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.abandon()

    def abandon(self) -> None:
        """Stop and close without checking anything (the test failed): no thread or channel of
        the job is left behind to disturb the tests that follow."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=40)  # a round's calls are bounded by 30 s
        for ch in self.channels:
            with contextlib.suppress(dp.ControlError):
                ch.close()

    def finish(self) -> None:
        """Stop, check that no round failed and that the job still works, and close it."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        assert not self.errors, self.errors
        assert self.rounds > 0
        exercise(self.channels, "after-attack")
        close_all(self.channels)


GRPC_STREAM = "/dataparallel.control.v1.ControlService/Stream"


def grpc_stream(channel, bodies: list[bytes], timeout: float = 5) -> list[bytes]:
    """Send ``bodies`` (serialized ``Frame``s, or anything else) on one gRPC ``Stream`` of a
    ``grpc.Channel`` and half-close it: the serialized ``Frame``s the coordinator answers before
    it ends the stream (a parked request's reply never comes)."""
    return list(channel.stream_stream(GRPC_STREAM)(iter(bodies), timeout=timeout))


def grpc_call(channel, sealed: bytes, timeout: float = 5) -> bytes:
    """One sealed request on a gRPC stream of its own: its sealed reply."""
    from dataparallel.control.wire import pb

    [reply] = grpc_stream(channel, [pb.Frame(sealed=sealed).SerializeToString()], timeout)
    return pb.Frame.FromString(reply).sealed


def digits_under(launcher: list[str], cwd, **env: str) -> None:
    """examples/train_digits.py for 2 epochs on 3 processes started by a cluster launcher
    (``launcher`` the command before the script, e.g. ``["srun", "-n", "3"]``), with no flag
    of ours: only the launcher's environment (``env`` added, one thread per rank as
    ``dataparallel launch`` would set, no ``DP_*`` or other launcher's variables of this
    process). The job must run to its end over zmq."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "train_digits.py")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DP_", "SLURM_", "OMPI_", "PMI"))}
    run = subprocess.run(
        [*launcher, sys.executable, script, "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=170,
        env={**clean, "OMP_NUM_THREADS": "1", **env},
        cwd=cwd,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "driver: 2 epochs on 3 processes over zmq" in out, out[-3000:]
