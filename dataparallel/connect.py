"""``connect(url, ...)``: pick the transport by scheme, open it, check the token, get a rank."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .control.channel import ControlChannel
from .control.membership import newcomer
from .control.registry import ChannelURL, resolve

if TYPE_CHECKING:
    from .config import JobConfig

log = logging.getLogger(__name__)

_FROM_CONFIG: Any = object()


def connect(
    url: str | None = None,
    *,
    rank: int | None = _FROM_CONFIG,
    world_size: int | None = None,
    job: str | None = None,
    token: str | None = None,
    timeout: float | None = None,
    elastic: bool | None = None,
) -> ControlChannel:
    """Open a control channel to the job ``job`` at ``url``.

    ``rank=None`` is assigned a free rank, first come first served. Returns once this
    process holds its rank; call :meth:`ControlChannel.rendezvous` to wait for the others.

    Whatever is not passed comes from the configuration (:func:`dataparallel.config.load_config`:
    ``DP_*`` variables set by ``dataparallel launch``, torchrun's variables,
    ``dataparallel.toml``), whichever arguments are given: the token too (``DP_TOKEN``, the
    file's ``token_file``), so a coordinator this call hosts is never less protected than the
    configuration asks. ``url``, ``rank`` and ``world_size`` given stand above the
    configuration as flags do (the configured URL options, ``DP_OPTIONS``, join a ``url``
    given, its own query winning). ``dp.connect()`` in a script works under ``dataparallel
    launch`` and torchrun unchanged. Raises :class:`ConfigError` for a bad URL or setting (the message
    names it and where it came from), :class:`AuthError` for a token that does not match the
    job's, and :class:`ControlError` when the rank is taken or the job is full.

    The settings resolved here travel with the channel (``channel.config``): ``dp.fit`` takes
    from them what its options leave unset, and reads no environment itself.

    ``elastic`` (None: the ``elastic`` setting, ``DP_ELASTIC``): where the job is already
    training elastically (its driver's mark in the job's join queue moves), this process is
    a newcomer, unless it asks for rank 0: the channel returned holds no rank yet (``rank``
    is None) and is only good for :func:`dataparallel.fit`, which waits, as long as that
    job's driver lives, until the driver seats it at an epoch boundary, then trains with the
    job (``rank`` and ``world_size`` given here are not used).
    """
    from .config import NONE, load_config

    # The configuration is read whatever is given: what is not given (the token above all)
    # comes from it, so a DP_TOKEN or token_file is never silently dropped.
    given = {"url": url, "world_size": world_size, "rank": NONE if rank is None else rank}
    if rank is _FROM_CONFIG:
        del given["rank"]
    config = load_config(given, given_by="dp.connect")
    where = config.describe("url") if url is None else None
    url, world_size = config.require("url"), config.require("world_size")
    rank = config.rank
    job = job if job is not None else config.job
    token = token if token is not None else config.token
    timeout = timeout if timeout is not None else config.timeout
    parsed, cls = resolve(url, token, where=where)
    if elastic is None:
        elastic = config.elastic
    with _waiting_notice(parsed, getattr(cls, "SERVICE", "the coordinator")):
        # A follower never hosts the coordinator: it may ask the join queue before it makes a
        # channel of the job's first generation (whose rank and size a newcomer's need not fit).
        if elastic and rank not in (0, None):
            queue = newcomer(parsed, cls, job, token, timeout)
            if queue is not None:
                queue.config = config
                return queue
        channel = _channel(cls, parsed, config, rank=rank, world_size=world_size, job=job, token=token, timeout=timeout)
        try:
            if elastic and rank is None:  # it may host the coordinator: asked once there is one
                queue = newcomer(parsed, cls, job, token, timeout)
                if queue is not None:
                    channel.close()
                    queue.config = config
                    return queue
            channel._join()
            channel.config = config
        except BaseException:
            channel.close()
            raise
    return channel


def observe(
    url: str | None = None,
    *,
    job: str | None = None,
    token: str | None = None,
    timeout: float | None = None,
) -> ControlChannel:
    """A channel to the current run of ``job`` at ``url`` that holds no rank and never joins:
    for reading what the job's ranks publish (:func:`dataparallel.control.status.read_job`,
    behind ``dataparallel status``). It needs the job's token as a rank does (where the
    transport checks tokens itself, it refuses another; elsewhere the core compares it with
    the run's). What is not given comes from the configuration, as for :func:`connect`.
    Raises :class:`ControlError` where the job has no run (it starts none). Close it after use."""
    from .config import load_config
    from .errors import ControlError

    given: dict[str, Any] = {"url": url}
    config = load_config(given, given_by="dp.observe")
    where = config.describe("url") if url is None else None
    url = config.require("url")
    job = job if job is not None else config.job
    token = token if token is not None else config.token
    timeout = timeout if timeout is not None else min(config.timeout, 30.0)
    from .control.relay.node import nodes_job, observe_ranks

    parsed, cls = resolve(url, token, where=where)

    def attached(name: str, ranks_behind_relays: bool) -> ControlChannel:
        """An observer's channel of job ``name`` attached to its current run (for a job whose
        ranks run behind node relays, ``name`` is the relays' job and the ranks' run is under
        their prefix); ControlError where there is none."""
        channel = cls(parsed, rank=None, world_size=0, job=name, token=token, timeout=timeout, serve=False)
        try:
            if not (channel._attach_run() and (not ranks_behind_relays or observe_ranks(channel))):
                raise ControlError(f"job {job!r} has no run at {parsed.shown}: no rank of it has joined")
        except BaseException:
            channel.close()
            raise
        return channel

    with _waiting_notice(parsed, getattr(cls, "SERVICE", "the coordinator")):
        try:
            channel = attached(job, False)
        except ControlError as err:
            if type(err) is not ControlError:  # refused (a token), unreachable, timed out: as it is
                raise
            # No run of that name: a job whose ranks run behind node relays (``launch
            # --relay``) keeps its ranks' keys in the relays' job, which is followed from then on.
            try:
                channel = attached(nodes_job(job), True)
            except ControlError as behind:
                if type(behind) is not ControlError:  # the relays' job is there and refused (a token)
                    raise
                raise err from None
            channel.observed_job = job
        try:
            if not cls.native_auth:
                channel.check_token()  # a read: an observer writes nothing
        except BaseException:
            channel.close()
            raise
    return channel


def reopen(like: ControlChannel, *, rank: int, world_size: int, job: str) -> ControlChannel:
    """A channel to ``job`` as ``rank`` of ``world_size`` on ``like``'s coordinator or store,
    with its URL, token, timeout and settings as :func:`connect` resolved them for ``like``
    (nothing read or parsed again): an elastic job's next generation. Returns once the rank
    is held, as :func:`connect` does."""
    cls = type(like)
    with _waiting_notice(like.url, getattr(cls, "SERVICE", "the coordinator")):
        channel = _channel(
            cls,
            like.url,
            like.config,
            rank=rank,
            world_size=world_size,
            job=job,
            token=like.token,
            timeout=like.timeout,
        )
        try:
            channel._join()
            channel.config = like.config
        except BaseException:
            channel.close()
            raise
    return channel


def _channel(cls: type[ControlChannel], url: ChannelURL, config: JobConfig | None, **kwargs: Any) -> ControlChannel:
    """``cls``'s channel at ``url``, not joined yet. Under torchrun with its agent's store as
    the URL (``config.agent_store``), no worker hosts it, rank 0 included."""
    return cls(url, serve=config is None or not config.agent_store, **kwargs)


#: Seconds between two "still connecting" notices.
NOTICE_EVERY = 5.0
#: Longest a notice's TCP probe of one endpoint waits.
PROBE_TIMEOUT = 2.0
#: Longest the end of a connect waits for the notice thread: it is done at once unless a
#: probe is in flight (then it ends with the probe, saying nothing more).
NOTICE_JOIN = 0.1


@contextlib.contextmanager
def _waiting_notice(url: ChannelURL, service: str) -> Iterator[None]:
    """While the body runs (a connect, which may wait up to its timeout for a coordinator or
    a rank), log every ``NOTICE_EVERY`` seconds what it waits for, with the diagnosis
    ``dataparallel check`` starts with: a TCP probe of each of the URL's endpoints. Nothing is
    logged once the body has ended: a notice is logged under a lock, and only while the body
    runs, and the thread is joined as the body ends (not waiting out a probe in flight, whose
    finding is dropped)."""
    endpoints = [(host, port) for host, port in url.hosts if host and port is not None]
    if not endpoints:  # nothing on the network to wait for
        yield
        return
    done = threading.Event()
    saying = threading.Lock()

    def notify() -> None:
        start = time.monotonic()
        while not done.wait(NOTICE_EVERY):
            from .control.check import tcp_probe

            findings = "; ".join(tcp_probe(host, port, PROBE_TIMEOUT, service)[1] for host, port in endpoints)
            with saying:
                if done.is_set():
                    return
                log.warning(
                    "still connecting to %s after %.0fs: %s (`dataparallel check %s` diagnoses it)",
                    url.shown,
                    time.monotonic() - start,
                    findings,
                    url.shown,
                )

    thread = threading.Thread(target=notify, name="dp-connect-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with saying:  # a notice being logged ends first; none starts after
            done.set()
        thread.join(NOTICE_JOIN)
