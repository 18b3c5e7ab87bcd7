"""Helpers shared by the transport-specific tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dataparallel as dp
from dataparallel.testing import run_all

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


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
