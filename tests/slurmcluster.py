"""A one-node Slurm cluster for the tests: Debian's slurm-wlm (slurmctld, slurmd) and munge,
started as root in a temporary directory with ports and a munge socket of their own, so it
never meets a cluster the machine may have. ``.ci/run`` installs the packages."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from dataparallel.testing import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    for name in (*DAEMONS, "srun", "scontrol"):
        if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists():
            return f"{name} is not installed (apt-get install slurm-wlm)"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users: it needs root"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.socket"
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """What a client (srun, scontrol) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        for name in ("state", "spool", "munge"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (self.root / "munge").chmod(0o700)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=dptest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SlurmdParameters=config_overrides",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN",
                    f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        munge = self.root / "munge"
        self._spawn(
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ]
        )
        self._wait(lambda: self.munge_socket.exists(), "munged")
        self._spawn([_which("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn([_which("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(self._idle, "the node to come up")
        return self

    def _spawn(self, argv: list[str]) -> None:
        with open(self.root / f"{Path(argv[0]).name}.out", "wb") as log:  # the daemon keeps its own copy
            self.procs.append(
                subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
            )

    def _idle(self) -> bool:
        run = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env={**os.environ, **self.env}, timeout=10
        )
        return run.returncode == 0 and run.stdout.strip() == "idle"

    def _wait(self, ready, what: str, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}): {self._logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}: {self._logs()}")
            time.sleep(0.2)

    def _logs(self) -> str:
        return " | ".join(p.read_text(errors="replace")[-800:] for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
