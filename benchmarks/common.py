"""What every benchmark shares: the machine a result was measured on, a free port, percentiles,
one resolver set-up for every run (:func:`run_main`), and when a target counts as met
(:func:`verdict`, :func:`ratio_interval`, :func:`quantile_verdict`)."""

from __future__ import annotations

import json
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


def write_result(path: Path, result: dict) -> None:
    """``result`` as JSON at ``path`` (its folder made), and a line saying so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


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


#: Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; a df between two
#: entries takes the smaller one's (wider) value, beyond the last the normal's.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip

#: A target's verdicts: "met" only where the 95% interval lies within it, "missed" where it
#: lies wholly outside, "not established" otherwise (or with no repeats to take one from).
MET, MISSED, UNKNOWN = "met", "missed", "not established"


def timed(call: Callable[[], object], rounds: int) -> list[float]:
    """Seconds each of ``rounds`` calls of ``call`` took."""
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return samples


def _t_interval(values: list[float]) -> tuple[float, float, float] | None:
    """The mean of ``values`` and its two-sided 95% t interval; None with fewer than 2."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in values) / (n - 1))
    t = T_975[max(df for df in T_975 if df <= n - 1)] if n - 1 <= 30 else 1.96
    half = t * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def ratio_interval(pairs: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """The mean of per-repeat ratios ``a / b`` (each repeat measured both sides, interleaved)
    and its two-sided 95% t interval: (mean, low, high). None with fewer than 2 repeats."""
    return _t_interval([a / b for a, b in pairs])


def log_ratio_interval(pairs: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """The geometric mean of per-pair ratios ``a / b`` and its two-sided 95% t interval
    (of the mean of ``log(a / b)``, taken back): (mean, low, high). Where both sides carry
    the same multiplicative noise, the plain mean of ratios overstates the ratio by about
    half the variance of their logarithm (for epochs of 3 ms steps on 2 cores, about 1%); the
    geometric mean does not. None with fewer than 2 pairs."""
    logs = _t_interval([math.log(a / b) for a, b in pairs])
    return None if logs is None else (math.exp(logs[0]), math.exp(logs[1]), math.exp(logs[2]))


def verdict(interval: tuple[float, float, float] | None, limit: float, at_most: bool = True) -> str:
    """Whether a 95% interval lies within ``<= limit`` (``at_most``) or ``>= limit``."""
    if interval is None:
        return UNKNOWN
    _, low, high = interval
    inside, outside = (high <= limit, low > limit) if at_most else (low >= limit, high < limit)
    return MET if inside else MISSED if outside else UNKNOWN


def _tail(n: int, k: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q)."""
    return sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k, n + 1))


def quantile_verdict(samples: list[float], limit: float, q: float = 0.99) -> str:
    """Whether the ``q`` quantile of what ``samples`` were drawn from is ``<= limit``, at 95%
    (one-sided, exact binomial): met only where so few samples lie above ``limit`` that more
    than ``1 - q`` of the distribution above it is unlikely (no sample above needs >= 299 for
    p99), missed where so many do that ``1 - q`` or less is unlikely."""
    n, above = len(samples), sum(s > limit for s in samples)
    share = 1 - q
    if above and _tail(n, above, share) < 0.05:
        return MISSED
    if 1 - _tail(n, above + 1, share) < 0.05:  # P(X <= above) at a share of exactly 1 - q
        return MET
    return UNKNOWN


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
