"""Which kernel and PID namespace a process runs in, and whether a pid there has exited.

A coordinator that shares both with a client (the same machine, the same container) can
check the client's pid when its connections close: a process that exited is a loss at
once, not after a reconnect grace or the liveness timeout. Elsewhere (another machine,
another PID namespace, no ``/proc``) the identity is empty and nothing is concluded.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def identity() -> tuple[str, int]:
    """(kernel boot id, inode of this process's PID namespace), or ("", 0) where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return boot_id, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return "", 0


def same_pids(boot_id: str, pid_namespace: int) -> bool:
    """True if pids sent with this identity name processes this process can see."""
    mine = identity()
    return bool(boot_id) and mine[0] != "" and (boot_id, pid_namespace) == mine


def exited(pid: int) -> bool:
    """True if ``pid`` (in this process's PID namespace) has exited: gone, or a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return not os.path.exists(f"/proc/{pid}")
    return state in ("Z", "X")


def catches(pid: int, signum: int) -> bool:
    """True if ``pid`` (in this PID namespace) has a handler of its own for ``signum`` now
    (``SigCgt`` in ``/proc/PID/status``): a signal whose default would end it does not."""
    if pid <= 1:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
