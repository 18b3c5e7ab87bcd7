"""A real etcd server for tests and benchmarks, on 127.0.0.1 (or a private network's address)
with free ports and a temporary data dir: the ``etcd`` binary on ``PATH`` (Debian's
``etcd-server``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One member; ``cluster`` lists every member's ``name=peer_url`` for a multi-member cluster."""

    def __init__(
        self,
        data_dir: Path,
        name: str = "t",
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
        args: Sequence[str] = (),
        https: bool = False,
    ) -> None:
        """``host``: the address to serve on; ``wrap``: a command prefix (``ip netns exec NS``);
        ``args``: more etcd flags (certificates, ``--auth-token-ttl``); ``https``: clients
        speak TLS (give the certificates in ``args``)."""
        self.data_dir = data_dir
        self.name = name
        self.host = host
        self.wrap = list(wrap)
        self.args = list(args)
        self.client_scheme = "https" if https else "http"
        if host == "127.0.0.1":
            self.client_port, self.peer_port = _free_port(), _free_port()
        else:  # a private namespace of its own: the standard ports are free
            self.client_port, self.peer_port = 2379, 2380
        self.cluster: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.proc_code: int | None = None
        self.log = data_dir.with_name(f"{data_dir.name}.log")

    @property
    def peer(self) -> str:
        return f"{self.name}=http://{self.host}:{self.peer_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.client_port}"

    def start(self) -> EtcdServer:
        client = f"{self.client_scheme}://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            *self.wrap,
            etcd_binary() or "etcd",
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.cluster or self.peer,
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
            *self.args,
        ]
        self.log = self.data_dir.with_name(f"{self.data_dir.name}.log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:  # what it says, for a start that fails
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        return self

    def wait_ready(self) -> EtcdServer:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                said = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
                self.stop()
                raise EtcdExited(f"etcd exited with {self.proc_code} at start: {said}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    time.sleep(0.3)  # serving once the port answers and the member elects itself
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("etcd did not start within 20 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc_code = self.proc.wait(timeout=10)
            self.proc = None


class EtcdExited(RuntimeError):
    """An etcd member ended at its start (a port taken between choosing and binding it)."""


def start_cluster(root: Path, n: int, tries: int = 3) -> list[EtcdServer]:
    """``n`` members on 127.0.0.1, on fresh ports; started again on other ports (and data
    directories) where a member ends at its start."""
    for attempt in range(tries):
        members = [EtcdServer(root / f"a{attempt}" / f"m{i}", name=f"m{i}") for i in range(n)]
        cluster = ",".join(m.peer for m in members)
        for m in members:
            m.cluster = cluster
            m.start()
        try:
            return [m.wait_ready() for m in members]
        except EtcdExited:
            for m in members:
                m.stop()
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def cluster_leader(members: list[EtcdServer]) -> EtcdServer:
    """The member that is leader, asked over etcd's HTTP status endpoint of each member."""
    import json
    import urllib.request

    for m in members:
        with urllib.request.urlopen(f"http://127.0.0.1:{m.client_port}/v3/maintenance/status", data=b"{}") as r:
            status = json.loads(r.read())
        if status["leader"] == status["header"]["member_id"]:
            return m
    raise AssertionError("no leader")
