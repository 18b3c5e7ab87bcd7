"""Which network interface reaches the job's coordinator.

gloo binds to the address its host name resolves to, and falls back to loopback when that
address is not local, as on hosts in a private network namespace or with a stale
``/etc/hosts``: peers on other machines then cannot connect. The interface this process
uses to reach the coordinator (or etcd) is one every peer can reach as well.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def source_address(host: str, port: int | None) -> str | None:
    """The local IPv4 address that packets to ``host`` leave from (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_with(address: str) -> str | None:
    """The name of the interface that holds the IPv4 ``address`` (Linux)."""
    wanted = socket.inet_aton(address)
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                info = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
        if info[20:24] == wanted:
            return name
    return None


def interface_towards(host: str, port: int | None = None) -> str | None:
    """The interface to reach ``host`` on, or None when that is loopback or unknown."""
    address = source_address(host, port)
    if address is None or ipaddress.ip_address(address).is_loopback:
        return None
    return interface_with(address)
