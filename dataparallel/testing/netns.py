"""Private networks for multi-host tests and benchmarks: Linux network namespaces joined by
veth pairs to a bridge that lives in a namespace of its own (the host's own network is never
touched).

    with PrivateNetwork(hosts=3) as net:        # 10.77.0.1 .. 10.77.0.3
        proc = net.popen(1, [sys.executable, "-c", "..."])
        net.cut(2); net.heal(2)                 # link down / up: a partition of host 2

Needs root (CAP_NET_ADMIN) and iproute2 (:func:`netns_unavailable` says why not). Namespaces
are deleted on exit, on failure too, and by an atexit hook should the interpreter die first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from typing import Any

SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be created here, or None if they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"dpprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class PrivateNetwork:
    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        self.tag = uuid.uuid4().hex[:5]
        self.switch = f"dp{self.tag}sw"
        self.procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []

    def ns(self, host: int) -> str:
        return f"dp{self.tag}h{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host}"

    def _veth(self, host: int) -> tuple[str, str]:
        return f"dp{self.tag}h{host}a", f"dp{self.tag}h{host}b"  # host side, switch side

    def __enter__(self) -> PrivateNetwork:
        atexit.register(self.close)
        try:
            self._add_ns(self.switch)
            self._in(self.switch, "link", "add", "br0", "type", "bridge")
            self._in(self.switch, "link", "set", "br0", "up")
            for host in range(1, self.hosts + 1):
                ns, (inside, outside) = self.ns(host), self._veth(host)
                self._add_ns(ns)
                _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "netns", self.switch)
                self._in(self.switch, "link", "set", outside, "master", "br0")
                self._in(self.switch, "link", "set", outside, "up")
                self._in(ns, "addr", "add", f"{self.address(host)}/24", "dev", inside)
                self._in(ns, "link", "set", inside, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        self._in(name, "link", "set", "lo", "up")

    def _in(self, ns: str, *args: str) -> None:
        _ip("-n", ns, *args)

    def interface(self, host: int) -> str:
        return self._veth(host)[0]

    def cut(self, host: int) -> None:
        """Partition ``host``: its link to the switch goes down."""
        self._in(self.switch, "link", "set", self._veth(host)[1], "down")

    def heal(self, host: int) -> None:
        self._in(self.switch, "link", "set", self._veth(host)[1], "up")

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def popen(self, host: int, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: int, argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def wait_listening(self, host: int, address: str, port: int, timeout: float = 20.0) -> None:
        """Wait until ``address:port`` accepts connections as seen from ``host``."""
        probe = (
            "import socket, sys, time\n"
            f"deadline = time.monotonic() + {timeout}\n"
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            f"        socket.create_connection(({address!r}, {port}), timeout=0.5).close(); sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.1)\n"
            "sys.exit(1)\n"
        )
        done = self.run(host, [sys.executable, "-c", probe], timeout=timeout + 10)
        if done.returncode != 0:
            raise RuntimeError(f"{address}:{port} not reachable from host {host} within {timeout}s")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs.clear()
        for name in reversed(self._made):
            # Deleting a namespace removes its veth ends; retry while its processes exit.
            for _ in range(20):
                if _ip("netns", "del", name, check=False).returncode == 0:
                    break
                time.sleep(0.1)
        self._made.clear()
