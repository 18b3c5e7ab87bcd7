"""OpenSSH's sshd in every host namespace of a :class:`netns.PrivateNetwork`, with keys made
for the test: a host key, a user key that the servers accept, another that they refuse, and
a known-hosts file, so that ``ssh`` runs in strict, non-interactive mode as users run it.

    with SshHosts(net, tmp_path) as ssh:
        ssh.options        # ['IdentityFile=...', 'UserKnownHostsFile=...', ...] for --ssh-option

Needs root and ``/usr/sbin/sshd`` (Debian's openssh-server); :func:`require_sshd` skips
without it, and fails under CI, which installs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from netns import PrivateNetwork

SSHD = "/usr/sbin/sshd"


def require_sshd() -> None:
    if Path(SSHD).exists() and shutil.which("ssh-keygen") and shutil.which("ssh"):
        return
    reason = "OpenSSH's sshd and ssh are not installed (apt-get install openssh-server openssh-client)"
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"the ssh launcher's tests must run in CI: {reason}")
    pytest.skip(reason)


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=30)
    return path.with_suffix(".pub").read_text().strip()


class SshHosts:
    def __init__(self, net: PrivateNetwork, directory: Path) -> None:
        self.net, self.dir = net, directory
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> SshHosts:
        self.dir.mkdir(parents=True, exist_ok=True)
        host_key = _keygen(self.dir / "host_key")
        user_key = _keygen(self.dir / "user_key")
        _keygen(self.dir / "stranger_key")  # a key no server accepts
        (self.dir / "authorized_keys").write_text(user_key + "\n")
        addresses = [self.net.address(h) for h in range(1, self.net.hosts + 1)]
        (self.dir / "known_hosts").write_text("".join(f"{a} {host_key}\n" for a in addresses))
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        try:
            for host, address in enumerate(addresses, 1):
                config = self.dir / f"sshd_{host}.conf"
                config.write_text(
                    f"ListenAddress {address}\nPort 22\nHostKey {self.dir / 'host_key'}\n"
                    f"PidFile {self.dir / f'sshd_{host}.pid'}\nAuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
                    "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                    "PermitRootLogin prohibit-password\nLogLevel ERROR\nMaxStartups 100\n"
                )
                with open(self.dir / f"sshd_{host}.log", "ab") as log:  # the port probes below get logged
                    self.procs.append(
                        self.net.popen(host, [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
                    )
            for host, address in enumerate(addresses, 1):
                self.net.wait_listening(host, address, 22)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def options(self, key: str = "user_key") -> list[str]:
        """``--ssh-option`` values for a client that uses ``key`` and trusts only the test's hosts."""
        pairs = [
            f"IdentityFile={self.dir / key}",
            "IdentitiesOnly=yes",
            f"UserKnownHostsFile={self.dir / 'known_hosts'}",
            "GlobalKnownHostsFile=/dev/null",
            "StrictHostKeyChecking=yes",
        ]
        return [arg for pair in pairs for arg in ("--ssh-option", pair)]
