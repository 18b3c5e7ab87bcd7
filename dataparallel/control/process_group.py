"""``init_process_group(channel)``: torch's process group, rendezvoused through the channel;
``abort_process_group()``: end every collective in flight on it at once."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .channel import ControlChannel
from .netif import interface_towards

log = logging.getLogger(__name__)


def init_process_group(
    channel: ControlChannel,
    backend: str | None = None,
    *,
    device: torch.device | str | None = None,
    timeout: timedelta | float = timedelta(minutes=30),
    **kwargs: Any,
) -> None:
    """``torch.distributed.init_process_group`` with the channel's store, rank and world size.

    ``backend`` defaults to NCCL for a CUDA ``device`` and gloo otherwise. For gloo, when
    ``GLOO_SOCKET_IFNAME`` is unset, the interface that reaches the coordinator is chosen
    (gloo's own choice, the host name's address, falls back to loopback when that address is
    not local, and peers on other hosts could not connect). gloo is also told to fetch its
    peers' addresses with one ``multi_get`` per rank instead of one ``get`` per peer
    (``GLOO_ENABLE_STORE_V2_API=1``, unless set otherwise): N requests at init, not N².
    """
    rank = channel.rank
    if rank is None:
        raise ValueError(f"{channel!r} holds no rank yet: open it with dataparallel.connect")
    device = torch.device(device) if device is not None else None
    if backend is None:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    if "gloo" in backend and not os.environ.get("GLOO_SOCKET_IFNAME"):
        name = interface_towards(channel.url.host, channel.url.port)
        if name is not None:
            log.info("gloo: using interface %s (it reaches %s)", name, channel.url.host)
            os.environ["GLOO_SOCKET_IFNAME"] = name
    if "gloo" in backend:
        os.environ.setdefault("GLOO_ENABLE_STORE_V2_API", "1")
    if device is not None and device.type == "cuda":
        kwargs.setdefault("device_id", device)
    before = _sockets() if "gloo" in backend else {}  # to tell the connections gloo opens
    dist.init_process_group(
        backend,
        store=channel.as_store(),
        rank=rank,
        world_size=channel.world_size,
        timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout),
        **kwargs,
    )
    _gloo.clear()  # a new default group: the groups of the last are gone
    if "gloo" in backend:
        _gloo[dist.group.WORLD] = _made_since(before, channel.url.port)


def new_gloo_group(channel: ControlChannel, timeout: timedelta | float) -> Any:
    """A gloo group of every rank of the default group (called by every rank, as
    ``torch.distributed.new_group``), whose connections :func:`abort_process_group` shuts
    down as it does the default group's (a group beside an NCCL one, for CPU tensors)."""
    before = _sockets()
    group = dist.new_group(
        backend="gloo", timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    )
    _gloo[group] = _made_since(before, channel.url.port)
    return group


def _made_since(before: dict[int, str], control_port: int | None) -> dict[int, str]:
    """The connections to peers opened since ``before`` (not the control plane's)."""
    made = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}
    return {fd: link for fd, link in made.items() if _peer_connection(fd, control_port)}


# The connections gloo opened for the groups made here since the last init_process_group: {group: {fd: link}}.
_gloo: dict[Any, dict[int, str]] = {}


def abort_process_group(group: Any = None) -> None:
    """End every collective in flight on ``group`` (the default group when None), at once, on
    every rank of this process: called when a peer is known lost, so that no rank waits for
    one that will never come. The group is of no further use; destroy it.

    ``ProcessGroup.abort()`` does it for NCCL. gloo's abort leaves a collective waiting for
    a peer that is frozen or cut off (its connection stays open) until the group's timeout;
    so for a group made by :func:`init_process_group` or :func:`new_gloo_group` the TCP connections gloo opened are
    also shut down, which ends its collectives with gloo's "connection closed" error (as
    when a peer dies). gloo's listening socket is left alone: gloo ends the process if its
    ``accept`` fails."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        return
    with contextlib.suppress(Exception):
        group.abort()
    for fd, link in _gloo.pop(group, {}).items():
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == link:  # still gloo's (an fd number is reused)
                _with_socket(fd, lambda s: s.shutdown(socket.SHUT_RDWR))


def _sockets() -> dict[int, str]:
    """This process's socket file descriptors and their ``socket:[INODE]`` links (empty where
    ``/proc`` is not there)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:"):
                    found[int(name)] = link
    return found


def _with_socket(fd: int, use: Any) -> Any:
    """``use(socket)`` on a socket object over ``fd`` that does not take the fd over."""
    sock = socket.socket(fileno=fd)
    try:
        return use(sock)
    finally:
        sock.detach()


def _peer_connection(fd: int, control_port: int | None) -> bool:
    """A connected TCP socket that is not the control plane's (which uses ``control_port`` at
    one end): one of gloo's connections to a peer."""

    def check(sock: socket.socket) -> bool:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        return control_port not in (sock.getsockname()[1], sock.getpeername()[1])

    try:
        return _with_socket(fd, check)
    except OSError:
        return False
