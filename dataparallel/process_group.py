"""``init_process_group(channel)``: torch's process group, rendezvoused through the channel."""

from __future__ import annotations

import logging
import os
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
    if channel.rank is None:
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
    dist.init_process_group(
        backend,
        store=channel.as_store(),
        rank=channel.rank,
        world_size=channel.world_size,
        timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout),
        **kwargs,
    )
