"""What every benchmark shares: the machine a result was measured on, a free port, percentiles."""

from __future__ import annotations

import math
import os
import platform
import socket


def machine() -> str:
    """The machine a result was measured on, for the result files."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank): with fewer than 100 samples, p99 is the largest."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
