"""``connect(url, ...)``: pick the transport by scheme, open it, check the token, get a rank."""

from __future__ import annotations

from .channel import ControlChannel
from .registry import parse_url, transport_class


def connect(
    url: str,
    *,
    rank: int | None = None,
    world_size: int,
    job: str = "default",
    token: str | None = None,
    timeout: float = 300.0,
) -> ControlChannel:
    """Open a control channel to the job ``job`` at ``url``.

    ``rank=None`` is assigned a free rank, first come first served. Returns once this
    process holds its rank; call :meth:`ControlChannel.rendezvous` to wait for the others.
    Raises :class:`ConfigError` for a bad URL or argument (the message lists known
    schemes/options), :class:`AuthError` for a token that does not match the job's, and
    :class:`ControlError` when the rank is taken or the job is full.
    """
    parsed = parse_url(url)
    cls = transport_class(parsed.scheme)
    channel = cls(parsed, rank=rank, world_size=world_size, job=job, token=token, timeout=timeout)
    try:
        channel._join()
    except BaseException:
        channel.close()
        raise
    return channel
