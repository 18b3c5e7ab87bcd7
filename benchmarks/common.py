"""What every benchmark shares: the machine a result was measured on, a free port, percentiles,
and one resolver set-up for every run (:func:`run_main`)."""

from __future__ import annotations

import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: Set (to the hosts file's path) in a run whose loopback reverse lookups are answered locally.
LOCAL_LOOKUPS = "DP_BENCH_LOOPBACK_HOSTS"
#: Loopback's addresses as a TCPStore peer sees them; ``::ffff:127.0.0.1`` is in no default hosts file.
LOOPBACK_NAMES = "::ffff:127.0.0.1 localhost-v4mapped\n::1 localhost-v6\n"


def machine() -> str:
    """The machine a result was measured on, and how its loopback names were looked up."""
    lookups = "loopback names from a hosts file" if os.environ.get(LOCAL_LOOKUPS) else "system resolver"
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; {lookups}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank): with fewer than 100 samples, p99 is the largest."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its live descendants
    (Linux ``/proc``; the coordinator of ``etcd`` is a child of the benchmark's server)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue  # gone in between
    return total


def reverse_lookup_s(address: str = "::ffff:127.0.0.1") -> float:
    """Seconds one reverse lookup of ``address`` takes (what torch does for every TCPStore
    connection, on both ends, to name the peer in its logs)."""
    start = time.perf_counter()
    try:
        socket.getnameinfo((address, 0, 0, 0), 0)
    except OSError:
        pass
    return time.perf_counter() - start


def run_main(module: str, main: Callable[[], int]) -> None:
    """Run a benchmark's ``main``; with ``--local-lookups``, re-executed in a private mount
    namespace whose ``/etc/hosts`` also names loopback's addresses (:func:`with_local_lookups`).

    Torch's TCPStore looks up the name of each peer address when it connects and when it
    accepts (``getnameinfo`` without ``NI_NUMERICHOST``). Over loopback the peer is
    ``::ffff:127.0.0.1``, which no default hosts file names, so every connect asks DNS;
    where the resolver drops a query (on the VM these figures come from, one in ~25 back
    to back: ``python -m benchmarks.tcpstore_connect``) that connect waits out the
    resolver's 5 s timeout. Many connects at once (``swarm``) then measure the resolver,
    not TCPStore: ``--local-lookups`` removes the stalls (root and ``unshare`` needed;
    nothing outside the benchmark changes). It is not the default: with instant lookups,
    TCPStore-based initialisation of freshly started processes (``rendezvous``: torch's
    ``tcp://`` and our ``tcpstore``) took ~0.5 s instead of ~20 ms at N=4 here, for a reason
    not found yet. Every result file's ``machine`` says which way it ran."""
    if "--local-lookups" not in sys.argv or os.environ.get(LOCAL_LOOKUPS):
        if "--local-lookups" in sys.argv:
            sys.argv.remove("--local-lookups")
        sys.exit(main())
    sys.argv.remove("--local-lookups")
    if not can_look_up_locally():
        sys.exit("--local-lookups needs root and unshare (a private mount namespace)")
    cmd, env = with_local_lookups([sys.executable, "-m", module, *sys.argv[1:]])
    try:
        sys.exit(subprocess.call(cmd, env=env))
    finally:
        Path(env[LOCAL_LOOKUPS]).unlink(missing_ok=True)


def with_local_lookups(cmd: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``cmd`` in a private mount namespace whose
    ``/etc/hosts`` is the machine's plus names for loopback's addresses (see :func:`run_main`;
    needs :func:`can_look_up_locally`). The namespace, and with it the bind mount, ends with
    the command; the hosts file (in ``$TMPDIR``, named in the environment) is the caller's
    to delete."""
    hosts = Path(tempfile.gettempdir()) / f"dp-bench-hosts-{os.getpid()}"
    hosts.write_text(Path("/etc/hosts").read_text() + "\n" + LOOPBACK_NAMES)
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "--mount", "sh", "-c", script, str(hosts), *cmd], {**os.environ, LOCAL_LOOKUPS: str(hosts)}


def can_look_up_locally() -> bool:
    """Whether :func:`with_local_lookups` can work here (root, ``unshare``, bind mounts)."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"], capture_output=True, timeout=30
    )
    return probe.returncode == 0
