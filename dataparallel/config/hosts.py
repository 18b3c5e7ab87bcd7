"""The hosts of a job started over ssh: ``hosts = "h1:2,h2:2"`` or a host file as DeepSpeed
and Open MPI write it, checked and placed (the first host runs the coordinator)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .environments import DEFAULT_PORT

#: Where the coordinator's host came from when the hosts placed it (the first of them).
PLACED = "the first of the hosts"


def parse_hosts(text: str, where: str) -> list[tuple[str, int | None]]:
    """``h1:2,user@h2:4,h3`` as (host, slots) pairs (slots None where not given); an IPv6
    address in brackets, ``[fd00::1]:2``."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, slots = item, None
        head, sep, tail = item.rpartition(":")
        if sep and tail.isdigit() and (not head.count(":") or head.endswith("]")):
            host, slots = head, int(tail)
        out.append(_host_entry(host, slots, f"{item!r} (from {where})"))
    if not out:
        raise ConfigError(f"hosts (from {where}) names no host")
    return out


def read_hostfile(path: str | os.PathLike, where: str) -> list[tuple[str, int | None]]:
    """A host file as DeepSpeed and Open MPI write it: one host a line, ``HOST slots=N`` (or
    ``HOST:N``, or ``HOST`` alone), ``#`` starting a comment."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"cannot read the host file {str(path)!r} (from {where}): {err.strerror}") from None
    out = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        at = f"{path}:{number}"
        slots = [w for w in words[1:] if w.startswith("slots=")]
        if len(words) - 1 != len(slots) or len(slots) > 1:
            raise ConfigError(f"{at}: expected 'HOST slots=N', got {line.strip()!r}")
        if slots:
            count = slots[0].removeprefix("slots=")
            if not count.isdigit():
                raise ConfigError(f"{at}: slots must be a whole number, got {count!r}")
            out.append(_host_entry(words[0], int(count), at))
        else:
            out += parse_hosts(words[0], at)
    if not out:
        raise ConfigError(f"the host file {str(path)!r} (from {where}) names no host")
    return out


def _host_entry(host: str, slots: int | None, where: str) -> tuple[str, int | None]:
    if not host or host.startswith("-") or any(c.isspace() or c in "'\"`$;&|<>" for c in host):
        raise ConfigError(f"{where}: {host!r} is not a host name")
    if slots is not None and slots < 1:
        raise ConfigError(f"{where}: slots must be >= 1, got {slots}")
    return host, slots


def address_of(host: str) -> str:
    """The network address in an ssh destination: ``user@node1`` -> ``node1``, ``[fd00::1]`` -> ``fd00::1``."""
    return host.rpartition("@")[2].strip("[]")


def place_hosts(values: dict[str, Any], origin: dict[str, str]) -> None:
    """``hosts`` or ``hostfile`` as ``__hosts``; the first host hosts the coordinator unless
    the configuration says otherwise (``__cluster``, as a cluster launcher places rank 0)."""
    if "rank" in values:  # a rank: its launcher placed it (the hosts are that launcher's business)
        values.pop("hosts", None)
        values.pop("hostfile", None)
        return
    if "hosts" in values and "hostfile" in values:
        raise ConfigError(f"both {origin['hosts']} and {origin['hostfile']} name the job's hosts: give one")
    if "hosts" in values:
        hosts = parse_hosts(values["hosts"], origin["hosts"])
    elif "hostfile" in values:
        hosts = read_hostfile(values["hostfile"], origin["hostfile"])
    else:
        return
    for name in ("nodes", "node_rank"):
        if name in values:
            where = origin.get("hosts") or origin["hostfile"]
            raise ConfigError(f"{name} (from {origin[name]}) and the hosts (from {where}) both place nodes: give one")
    seen: dict[str, str] = {}
    for host, _ in hosts:
        address = address_of(host)
        if address in seen:
            raise ConfigError(
                f"{address} is named twice in the hosts ({seen[address]!r} and {host!r}): give each "
                "host once, with all its slots (two launchers on one host would share its GPUs and local ranks)"
            )
        seen[address] = host
    values["__hosts"] = tuple(hosts)
    values["nodes"] = len(hosts)
    origin["nodes"] = origin.get("hosts") or origin["hostfile"]
    if "__cluster" not in values:
        first = address_of(hosts[0][0])
        values["__cluster"] = {
            "launcher": "ssh",
            "host": first,
            "port": DEFAULT_PORT,
            "where": PLACED,
        }
