"""Private networks for multi-host tests (:mod:`dataparallel.testing.netns`), and the check
that skips a test where namespaces cannot be made (and fails it under CI, where they must work)."""

from __future__ import annotations

import os

import pytest

from dataparallel.testing.netns import SUBNET, PrivateNetwork, netns_unavailable

__all__ = ["SUBNET", "PrivateNetwork", "netns_unavailable", "require_netns"]


def require_netns() -> None:
    reason = netns_unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"multi-host tests must run in CI: {reason}")
    pytest.skip(reason)
