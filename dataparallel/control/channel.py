"""The control channel: the one interface the training loop talks to its peers through.

A transport implements a handful of primitives (the ``_``-prefixed hooks below); the core
builds on them the public calls, their timeouts and error messages, rank assignment, the
job-token check, liveness and the collectives (:mod:`dataparallel.control.collectives`), so every
transport behaves the same and a new one stays small.
"""

from __future__ import annotations

import abc
import hmac
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import AuthError, BadMessage, ChannelClosed, ConfigError, ControlError, ControlTimeout, PeerLost
from .collectives import Collectives, Departure, Needs, _value
from .keyspace import NEXT_RANK, RESERVED_PREFIX, claim_key, peer_key
from .liveness import _CLOSED as _CLOSED_BEAT
from .liveness import _HB as _HB_KEY
from .liveness import _LOST as _LOST_KEY
from .liveness import Liveness, ReadUnanswered, StoreHeartbeats
from .registry import ChannelURL
from .status import RankStatus
from .wire import MAX_WORLD_SIZE, purpose_key

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..config import JobConfig

T = TypeVar("T")
log = logging.getLogger(__name__)

#: The job's run pointer (see ControlChannel._enter_run); the runs' keys live below it.
_RUN = f"{RESERVED_PREFIX}run"

#: Query-string options every transport accepts, with their meaning.
COMMON_OPTIONS = {
    "heartbeat": "seconds between liveness heartbeats (default 1.0)",
    "liveness_timeout": "seconds without a heartbeat before a peer is declared lost (default 10.0)",
}


class ControlChannel(Collectives, abc.ABC):
    """A job's low-throughput control channel: a small key/value space shared by its ranks.

    Values are ``bytes``; keys are ``str`` and are private to the channel's ``job``. All
    calls are thread-safe. Every blocking call takes ``timeout`` in seconds (``None`` means
    the channel's default, the ``timeout`` given to :func:`dataparallel.connect`) and raises
    :class:`ControlTimeout` when it expires, :class:`PeerLost` as soon as a peer is declared
    lost, and :class:`ChannelClosed` once the channel is closed or its coordinator is gone.

    **Writing a transport.** This docstring and those of the hooks below are the whole
    contract; ``examples/custom_transport/dp_fsdir.py`` (a shared directory) and
    ``examples/sqlite_transport/dp_sqlite.py`` (an SQLite file) are complete transports.
    Subclass, implement the eight abstract hooks (``_set``, ``_get``, ``_add``,
    ``_compare_set``, ``_delete``, ``_check``, ``_num_keys``, ``_close``); the core builds on
    them the public calls, their timeouts and messages, rank assignment, the token check,
    liveness, the collectives and :meth:`as_store`.

    *Class attributes.* ``scheme``: the URL scheme (informational: the entry point's name is
    what maps a scheme to the class). ``URL_FORM``: the URL's shape for messages, ``{scheme}``
    filled in (default ``"{scheme}://HOST:PORT"``; a file store says
    ``"{scheme}:///ABSOLUTE/PATH"``). ``URL_HOST``: whether the URL names a host (True, the
    default: one is required; False: one is refused, the URL is ``scheme:///ABSOLUTE/PATH``).
    ``OPTIONS``: the query-string options the transport accepts, ``{name: meaning}``; with
    ``heartbeat`` and ``liveness_timeout`` (:data:`COMMON_OPTIONS`) they are the only ones: any
    other is refused with a :class:`ConfigError` listing the allowed ones and their meanings.
    Flags, each explained where it is defined: ``fences_lost_members``,
    ``survives_connection_loss``, ``notices_exits``, ``survives_frozen_writers``, ``native_auth``, ``liveness_poll``,
    ``CLOSE_GRACE``; and the property :attr:`hosts_coordinator`.

    *The URL* reaches the transport as a :class:`~dataparallel.ChannelURL`: ``url.hosts``
    (``(host, port or None)`` pairs; ``url.host``/``url.port`` are the first),
    ``url.path`` (as given, leading ``/`` kept: ``sqlite:///srv/s.db`` has no host and the
    path ``/srv/s.db``; ``""`` when there is none), ``url.options`` (name -> str), and helpers
    that raise a ConfigError naming the URL: ``url.flag(name)`` (1/0, absent is False),
    ``url.seconds(name, default)`` (> 0), ``url.file(name)`` (a file's bytes, None if absent),
    ``url.require_port()``; ``url.shown`` is the URL for messages (password masked). Before
    the transport sees it, every entry point (``connect``, ``dataparallel serve``/``check``/
    ``launch``, the torchrun backends) has checked the host against ``URL_HOST``, the option
    names against ``OPTIONS``, the common options' values and that a token is None or
    non-empty, then called the classmethod :meth:`_check_options` for the rest.

    *The constructor* is ``__init__(self, url: ChannelURL, **kwargs)`` and calls
    ``super().__init__(url, **kwargs)`` first, passing every keyword through (``rank``,
    ``world_size``, ``job``, ``token``, ``timeout``, ``serve``). Validated and set then:
    ``self.url``; ``self.rank`` (an int in ``0..world_size-1``, or None until the core's join
    assigns one: hooks called while joining see None); ``self.world_size`` (0, with no rank,
    for a channel that only reads a job of any size and never joins: :func:`dataparallel.observe`'s;
    a transport whose server checks the job's size lets such a channel in without creating
    the job); ``self.job``
    (non-empty text without ``/`` or NUL: namespace the keys by it); ``self.token`` (None or
    non-empty); ``self.timeout`` (seconds > 0); ``self.may_host`` (the ``serve`` argument:
    False: never host a coordinator in this process); ``self.heartbeat_interval``, ``self.liveness_timeout``.
    Then connect: every hook must work once ``__init__`` returns. Raise :class:`ChannelClosed`
    if the store cannot be reached within ``self.timeout`` (:class:`AuthError` if it refuses
    the credentials), releasing what was opened: nothing calls ``_close`` for a constructor
    that raised. ``dp.connect`` then joins through the hooks; ``dataparallel check`` and the
    torchrun backends use a channel without joining, and any channel may be closed unjoined.

    *Every hook* follows these rules:

    - Keys are non-empty ``str`` that encode as UTF-8 and may hold any character, ``/``
      included; the core's own bookkeeping keys start with ``__dp/`` and go through the
      same hooks. Values are ``bytes``, possibly empty, of up to megabytes (the suite stores
      1 MiB).
    - Any hook may be called from many threads at once (the caller's, the liveness thread,
      torch's C++ callers through :meth:`as_store`), ``_close`` included while others are in
      flight: all must be thread-safe. Each is atomic and linearizable across every process
      and host of the job, not only this process's threads: ``_add`` and ``_compare_set``
      read and write as one step, no ``_set`` or ``_delete`` lands inside one, and once a
      write returns every rank's next read sees it. A write applied twice (a call re-sent
      after its reply was lost) breaks that: apply it once or raise ChannelClosed.
    - Only :class:`ControlError` subclasses may escape (``_add``'s ValueError aside):
      :class:`ChannelClosed` (the store is gone or unusable, the channel closed or fenced),
      :class:`AuthError` (credentials refused), :class:`ControlTimeout` (the store did not
      answer in time), :class:`BadMessage` (a malformed reply). Translate the library's
      errors in one place. ``PeerLost``, the public calls' timeouts and messages are the core's.
    - Only ``_get`` and ``_multi_get`` wait for keys; the others return once the store has
      answered, and raise rather than hang when it does not (the liveness thread calls them).
      A hook that blocks on the store bounds each call by ``self._call_bound(bound)``, its
      own bound cut to what is left of the collective its thread is in (its timeout and
      0.25 s more, shared by all its calls), and of ``close``.
      A ``_get`` or ``_multi_get`` that got no answer within its bound (a store restarting or
      failing over) may raise :class:`ReadUnanswered`: the wait goes on while its time lasts,
      and ends in ChannelClosed, never ControlTimeout (a key's absence was not seen), if the
      last read went unanswered.

    *Optional hooks*, each with a default in the core built on the eight: ``_multi_get``,
    ``_multi_set``, ``_compare_set_many``, ``_delete_many``, ``_append`` (override to save
    round trips or to append in one atomic step), ``_claim_rank`` (claim a rank and publish
    its process: one request on a coordinator), ``_claimed`` (the rank is held),
    ``_new_liveness`` (how lost peers are noticed), ``_held_state``, and the classmethods
    ``_check_options``, ``diagnose`` and ``security``; the property
    :attr:`hosts_coordinator`. The collectives ``barrier``, ``broadcast``,
    ``gather`` and ``all_gather`` (:mod:`dataparallel.control.collectives`; ``rendezvous`` is a
    barrier) may be overridden with native ones keeping their signatures and semantics: call
    ``self._usable()`` first, number rounds with ``self._next_seq(kind, name)``, leave no
    state behind (the suite checks :meth:`_held_state`). A transport with native
    collectives also tells its waiting ranks when a rank closed without entering a round
    (``PeerLeft``, checked by the suite): it overrides ``_depart`` (what a closing rank
    records; the core's writes ``__dp/departure/RANK``) and ``_raise_if_departed`` (what a
    waiting rank checks between slices), or its server answers the waiters itself, as the
    coordinator does. A classmethod ``serve(url, token, ready)`` gives ``dataparallel serve``
    a standalone coordinator (calling ``ready(port)`` once listening). A fatal condition
    noticed in the background (the server gone) is reported with
    ``self._fail(ChannelClosed(...))``: every later call raises it.

    *Runs.* A job's state belongs to a run, the ranks that joined it together: a rerun under
    the same job name after a crash must not see what the crashed run left (claimed ranks,
    half-done collectives, keys). By default the core handles it with the hooks above: a run
    pointer (``__dp/run``) names the current run, every key the core passes to a hook lies
    under it, and a run whose ranks have all closed or been silent for the liveness timeout
    gives way to a fresh one (so a transport needs nothing for this; the dead run's keys stay
    in the store, unread). A transport whose server knows when a run's ranks are gone
    (sessions, leases) starts runs itself and overrides :meth:`_enter_run` and
    :meth:`_run_state`, as ``RemoteChannel`` and ``etcd`` do.

    *Testing.* Register the scheme in the package's ``pyproject.toml``::

        [project.entry-points."dataparallel.transports"]
        mine = "my_module:MyChannel"

    and install it (``pip install -e .``): the conformance suite starts real rank processes
    (``python -m dataparallel.testing.worker``) that find the scheme through that entry point,
    so :func:`~dataparallel.register_transport` (this process only) is not enough for it. Then
    subclass :class:`dataparallel.testing.ChannelConformance` (it needs pytest and
    pytest-timeout) with a ``channel_url`` fixture returning a fresh, isolated store per test:
    ``f"mine://127.0.0.1:{free_port()}"`` for one the test's rank 0 hosts, or with pytest's
    ``tmp_path`` for one on a path (``f"mine://{tmp_path}/store"``). Set
    ``cross_process = False`` when ranks can only be threads of one process (``memory://``).
    """

    #: Whether a rank declared lost is fenced: once the others have been told, the transport
    #: refuses its writes (ChannelClosed), so a frozen rank that resumes cannot act on stale
    #: state. Without it (a store with no sessions, such as TCPStore) the rank only learns it
    #: was declared lost on its next liveness tick, and writes it makes before that land.
    #: The conformance suite checks whichever is declared.
    fences_lost_members: ClassVar[bool] = False
    #: Whether a call whose connection drops is re-sent and still applied exactly once (request
    #: ids, result records), so a collective rides out a connection reset. Without it (TCPStore)
    #: a write whose reply was lost raises ChannelClosed: it may or may not have been applied.
    #: The conformance suite resets connections under barriers only where this is declared.
    survives_connection_loss: ClassVar[bool] = False
    #: Whether a peer that exits (killed, crashed) is noticed when its connections close,
    #: not when its heartbeats are missed: within a second where the peer shares the
    #: coordinator's machine and PID namespace, whatever ``liveness_timeout`` (a frozen or
    #: cut-off peer, whose connections stay open, is still noticed after it). The conformance
    #: suite holds a transport that declares it to that bound.
    notices_exits: ClassVar[bool] = False
    #: Whether a rank frozen in the middle of a write (SIGSTOP, a paused VM: holding whatever
    #: lock or transaction it had reached) leaves the others' writes free. Without it (a store
    #: with one write lock, such as a SQLite file) their writes wait for it up to their timeout,
    #: then raise ControlTimeout. The conformance suite holds each transport to what it declares.
    survives_frozen_writers: ClassVar[bool] = False

    #: URL scheme this class serves (informational; the registry maps schemes to classes).
    scheme: ClassVar[str] = ""
    #: The shape of this transport's URL, shown in every message about a malformed one
    #: (``{scheme}`` is filled in): e.g. ``"{scheme}:///ABSOLUTE/PATH"`` for a file store.
    URL_FORM: ClassVar[str] = "{scheme}://HOST:PORT"
    #: Whether the URL names hosts: True (one is required), False (``scheme:///PATH``: a host
    #: is refused). Ports, path and their values are the transport's to check
    #: (:meth:`_check_options`, :meth:`ChannelURL.require_port`).
    URL_HOST: ClassVar[bool] = True
    #: Extra query-string options this transport accepts: name -> meaning.
    OPTIONS: ClassVar[dict[str, str]] = {}
    #: True when the transport checks the token itself and refuses a wrong or missing one
    #: with AuthError (in seconds, whatever the timeout). False: the core checks that every
    #: rank of the job has the same token when it joins (a MAC under ``__dp/token``); the
    #: store itself stays open to anyone who reaches it.
    native_auth: ClassVar[bool] = False
    #: Longest single ``_get``/``_multi_get`` the core asks for while liveness runs: how soon
    #: a lost peer interrupts a blocked call (unless the liveness kind interrupts blocked
    #: calls itself). Transports whose timed-out waits are costly may raise it (tcpstore: 5).
    liveness_poll: ClassVar[float] = 0.5
    #: Seconds a healthy store may leave every request unanswered, beyond which the default
    #: liveness (:class:`~dataparallel.control.liveness.StoreHeartbeats`) takes it for gone, on top of
    #: ``liveness_timeout`` (tcpstore: 5, torch's server looks each new client up in DNS first).
    store_stall: ClassVar[float] = 0.0
    #: Longest ``close`` waits, where :attr:`hosts_coordinator`, for the other ranks to close
    #: or be lost (at most ``self.timeout``).
    CLOSE_GRACE: ClassVar[float] = 10.0

    def __init__(
        self,
        url: ChannelURL,
        *,
        rank: int | None,
        world_size: int,
        job: str = "default",
        token: str | None = None,
        timeout: float = 300.0,
        serve: bool = True,
    ) -> None:
        self._observer = observer = world_size == 0 and rank is None  # dp.observe's: no rank, never joins
        if not isinstance(world_size, int) or not (observer or 1 <= world_size <= MAX_WORLD_SIZE):
            raise ConfigError(f"world_size must be an integer in 1..{MAX_WORLD_SIZE}, got {world_size!r}")
        if rank is not None and (not isinstance(rank, int) or not 0 <= rank < world_size):
            raise ConfigError(f"rank must be an integer in 0..{world_size - 1} or None, got {rank!r}")
        if not job or not isinstance(job, str) or "/" in job or "\x00" in job or not _utf8(job):
            raise ConfigError(f"job must be a non-empty string of text without '/' or NUL, got {job!r}")
        if not timeout or timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.url = url
        self.rank: int | None = rank
        self.world_size = world_size
        self.job = job
        self.token = token
        self.timeout = float(timeout)
        #: False: never host the job's coordinator in this process, only connect to one (the
        #: ``serve`` argument; ``serve`` itself names a transport's standalone coordinator).
        self.may_host = serve
        type(self).check_url(url, token)
        self.heartbeat_interval = url.seconds("heartbeat", 1.0)
        self.liveness_timeout = url.seconds("liveness_timeout", 10.0)
        self._closed = False
        self._close_by: float | None = None  # when close() must be done, once it has begun
        self._close_lock = threading.Lock()
        self._call_by = threading.local()  # a thread's collective's deadline (_by_deadline)
        self._broken: ControlError | None = None
        self._liveness: Liveness | None = None
        self._store: dist.Store | None = None
        self._status: RankStatus | None = None
        self._seq_lock = threading.Lock()
        self._seq: dict[tuple[str, str], int] = {}
        self._departed: dict[int, Departure] = {}  # ranks that closed: how far they went
        #: Where the current run's keys live (the core's runs; "" where the transport has its own).
        self._run_prefix = ""
        self._run_id = b""
        #: An observer's of a job behind node relays: where in this channel's key space (the
        #: relays' job's) the job's ranks keep their runs (see :meth:`_reattach`); "" else.
        self._ranks_under = ""
        #: The job whose ranks this channel is one of or observes: ``job``, but for an
        #: observer of a job behind node relays, whose channel is the relays' job's.
        self.observed_job = job
        #: What this process saw of the current run's ranks while judging it: rank -> (heartbeat
        #: value, monotonic time first seen), and the ranks seen alive.
        self._run_seen: dict[int, tuple[bytes | None, float]] = {}
        self._run_alive: dict[int, float] = {}
        self._run_first: dict[int, float] = {}
        self._run_verdict = ""
        #: The job's settings as ``dp.connect`` resolved them, once (flags and arguments, the
        #: ``DP_*`` environment, ``dataparallel.toml``): what ``dp.fit`` falls back on for
        #: what its options leave unset (``elastic``, world size bounds, log format). None for
        #: a channel opened without ``dp.connect``: the settings' defaults.
        self.config: JobConfig | None = None

    @classmethod
    def check_url(cls, url: ChannelURL, token: str | None = None, *, serving: bool = False) -> None:
        """Validate ``url``'s options for this transport, as every entry point does before it
        acts (``connect``, ``dataparallel serve``, ``check`` and ``launch``, the torchrun
        backends): an unknown option, a malformed value, a setting without the material it
        needs (``curve=1`` without a token, certificates without ``tls=1``...) or an empty
        token is a :class:`ConfigError` that says what to add. ``serving``: this process is
        about to host a coordinator (``dataparallel serve``)."""
        form = cls.url_form(url)
        if cls.URL_HOST and not url.hosts:
            raise ConfigError(f"{url.shown!r}: missing host (expected {form})")
        if not cls.URL_HOST and url.hosts:
            raise ConfigError(f"{url.shown!r}: {url.scheme}:// names no host, got {url.host!r} (expected {form})")
        allowed = {**COMMON_OPTIONS, **cls.OPTIONS}
        unknown = sorted(set(url.options) - set(allowed))
        if unknown:
            listing = "; ".join(f"{k}: {v}" for k, v in sorted(allowed.items()))
            raise ConfigError(f"{url.shown!r}: unknown option(s) {', '.join(unknown)}; allowed: {listing}")
        for name in COMMON_OPTIONS:
            url.seconds(name, 1.0)
        if token is not None and not token:
            raise ConfigError("the job token is empty: give a token (DP_TOKEN, --token-file) or none at all")
        cls._check_options(url, token, serving)

    @classmethod
    def url_form(cls, url: ChannelURL | None = None) -> str:
        """:attr:`URL_FORM` with the scheme filled in, for messages."""
        return cls.URL_FORM.format(scheme=url.scheme if url is not None else cls.scheme)

    @classmethod
    def security(cls, url: ChannelURL, token: str | None) -> str:
        """One line for ``dataparallel check`` and ``dataparallel serve``: what this URL
        authenticates and encrypts, and what is left to the network (docs/howto/security.md,
        "Threat model"). Optional hook; the default says what ``native_auth`` implies."""
        if cls.native_auth:
            return "authenticated by the transport"
        return (
            f"no authentication on {cls.scheme}:// itself: anyone who can reach it can read and write every "
            "job's keys; the token is only compared between ranks (use it on a network you trust)"
        )

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        """Optional hook of :meth:`check_url`, run by every entry point before it connects,
        after the core's own checks: check the rest of the URL (ports, path, number of
        hosts) and the values of this transport's ``OPTIONS`` (combinations, files that must
        be readable). Raise :class:`ConfigError` naming the fix, with :meth:`url_form`
        (``f"{url.shown!r}: no path (expected {cls.url_form(url)})"``). ``serving``: this
        process is about to host a coordinator (``dataparallel serve``). Default: nothing."""

    # ------------------------------------------------------------------ transport hooks
    # The rules every hook follows (keys, values, threads, atomicity, errors) are in the
    # class docstring.
    @abc.abstractmethod
    def _set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, creating or overwriting it. Once this returns, every
        rank's ``_get``/``_check`` sees the value, and a ``_get`` waiting for the key returns it."""

    @abc.abstractmethod
    def _get(self, key: str, timeout: float) -> bytes | None:
        """Return the value of ``key``, waiting up to ``timeout`` seconds (always > 0, from a
        few microseconds up to a call's whole budget) for some rank to create it; None if it
        still does not exist then. Return as soon as the key exists: a write while waiting releases it.

        The core waits in slices: a blocked ``get`` (and every collective) calls this again
        and again with at most :attr:`liveness_poll` seconds (0.5 by default) while liveness
        runs, and looks for lost peers in between; before the rank joins, on a channel that
        never joins, or where the liveness kind interrupts blocked calls itself, it passes
        the whole remaining timeout. A wait cut short by :meth:`_close` may return None or
        raise ChannelClosed."""

    @abc.abstractmethod
    def _add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` (any int, negative included) to the decimal integer
        stored at ``key`` (a missing key counts as 0), store the result as ASCII digits
        (``str(n).encode()``: ``_get`` reads ``b"7"``) and return it. Raise ValueError, and
        change nothing, when the value there is not a decimal integer (the core reports it as
        :class:`BadMessage`). Releases a ``_get`` waiting for the key, like ``_set``."""

    @abc.abstractmethod
    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Atomically store ``desired`` if the value at ``key`` equals ``expected``, a missing
        key matching ``b""``; return the value stored afterwards (TCPStore's semantics):

        - key missing, ``expected == b""``: create it with ``desired``, return ``desired``;
        - key missing, ``expected`` non-empty: create nothing, return ``expected``;
        - key present and equal to ``expected``: store ``desired``, return ``desired``;
        - key present and different: change nothing, return its value.

        The core's rank claims, token check and append lock depend on exactly one of many
        concurrent callers winning."""

    @abc.abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove ``key``; return True if it existed. Afterwards the key is missing to every
        hook (``_add`` starts again from 0, ``_compare_set`` matches ``b""``)."""

    @abc.abstractmethod
    def _check(self, keys: Sequence[str]) -> bool:
        """True if every key in ``keys`` exists (True for none). Never blocks: one look."""

    @abc.abstractmethod
    def _num_keys(self) -> int:
        """How many keys this job holds, the core's ``__dp/`` keys included. (The suite only
        checks that creating and deleting a key moves it by one; a store that cannot count
        one job's keys alone may count more, as ``tcpstore://`` does.)"""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the connection. Called by :meth:`close` after liveness has stopped (its
        last ``_set``, announcing the departure, came before), on a joined channel or not.
        Other threads may be inside hooks meanwhile, and may call one after: those end with
        ChannelClosed (or, for a waiting ``_get``, None), never a library's error or a hang.
        Two threads closing at once may both get here: tolerate a second call."""

    # Optional hooks: the core's defaults build them on the ones above; a transport that
    # can do better (one round trip, a server-side atomic append) overrides them.
    def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        """The values of ``keys`` (non-empty, duplicates possible) in order, waiting up to
        ``timeout`` seconds until every one exists; None if some still does not. Sliced like
        :meth:`_get`. Default: one ``_get`` per key under one deadline."""
        deadline = time.monotonic() + timeout
        values = []
        for key in keys:
            value = self._get(key, max(deadline - time.monotonic(), 1e-3))
            if value is None:
                return None
            values.append(value)
        return values

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Set every ``(key, value)`` of ``items`` (non-empty). Default: one ``_set`` each
        (so another rank may see some set and not others); override for one round trip."""
        for key, value in items:
            self._set(key, value)

    def _compare_set_many(self, items: Sequence[tuple[str, bytes, bytes]]) -> list[bytes]:
        """Each ``(key, expected, desired)`` of ``items`` (non-empty) as its own
        ``_compare_set``, in order (each on its own, not all or none): what each returned.
        Default: one ``_compare_set`` each; override for one round trip (a node relay sends
        its ranks' concurrent compare_sets so)."""
        return [self._compare_set(key, expected, desired) for key, expected, desired in items]

    def _delete_many(self, keys: Sequence[str]) -> int:
        """Delete each of ``keys`` (each on its own, not all or none): how many existed.
        Default: one ``_delete`` each; override for one round trip (the core's gathers clean
        up a round's keys through it)."""
        return sum(self._delete(key) for key in keys)

    def _append(self, key: str, value: bytes) -> None:
        """Atomically append ``value`` to the bytes at ``key`` (a missing key counts as
        empty and is created); concurrent appends all land, each rank's in its order.

        Default: read and write under a lock key ``__dp/lock/KEY`` taken with
        ``_compare_set`` and a unique owner, so a lost race is never taken for a success
        (comparing the bytes written would be fooled by another rank writing the same bytes).
        Three more round trips, and a rank that dies holding the lock blocks that key's
        appends until their timeout: a transport that can append in one atomic step should."""
        lock = f"{RESERVED_PREFIX}lock/{key}"
        me = uuid.uuid4().hex.encode()
        start = time.monotonic()
        pause = 0.001
        while self._compare_set(lock, b"", me) != me:
            waited = time.monotonic() - start
            self._raise_if_failed(f"append to key {key!r}")
            if waited > self.timeout:
                raise ControlTimeout(f"the append lock of key {key!r}", waited, "another rank holds it")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        try:
            current = self._get(key, 1e-3) if self._check([key]) else None
            self._set(key, (current or b"") + value)
        finally:
            self._delete(lock)

    # ------------------------------------------------------------------ primitives
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwriting), releasing every ``get`` waiting on it."""
        self._writable_here()
        self._set(self._scoped(_writable(key)), _value(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, blocking until some rank sets it."""
        self._usable()
        return self._await(self._scoped(_key(key)), timeout, f"key {key!r}")

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (missing = 0); return
        the new value. The value reads back as ASCII digits, as in torch's TCPStore."""
        self._writable_here()
        if not isinstance(amount, int):
            raise TypeError(f"amount must be an int, got {type(amount).__name__}")
        name = self._scoped(_writable(key))
        try:
            return self._add(name, amount)
        except ValueError as err:  # a transport's _add found no number there
            raise BadMessage(f"add({key!r}): the value there is not a decimal integer ({err})") from None

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Atomically set ``desired`` if the current value equals ``expected`` (a missing key
        matches ``b""``). Returns the value stored afterwards; for a missing key and a
        non-empty ``expected``, returns ``expected`` and creates nothing (TCPStore semantics)."""
        self._writable_here()
        return self._compare_set(self._scoped(_writable(key)), _value(expected), _value(desired))

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""
        self._writable_here()
        return self._delete(self._scoped(_writable(key)))

    def check(self, keys: Iterable[str]) -> bool:
        """True if every key exists; never blocks."""
        self._usable()
        return self._check([self._scoped(_key(k)) for k in keys])

    def num_keys(self) -> int:
        """Number of keys held for this job (core bookkeeping keys included)."""
        self._usable()
        return self._num_keys()

    def _held_state(self) -> int:
        """Entries the job's state holds (keys, and whatever else the transport keeps for the
        job, such as a coordinator's open collectives): what must not grow as a job runs. The
        suite reads it on the channel that :attr:`hosts_coordinator` (else rank 0) around
        repeated collectives. Default: :meth:`_num_keys`."""
        return self._num_keys()

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key exists; one deadline covers them all."""
        self._usable()
        deadline = time.monotonic() + self._budget(timeout)
        for key in keys:
            self._await(self._scoped(_key(key)), max(deadline - time.monotonic(), 1e-3), f"key {key!r}")

    def multi_get(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys``, in order, blocking until every one exists (one deadline;
        one round trip when they do, on every built-in transport)."""
        self._usable()
        names = [_key(k) for k in keys]
        if not names:
            return []
        wanted = [self._scoped(k) for k in names]
        what = f"keys {names[:3]!r}{' ...' if len(names) > 3 else ''}"
        return self._await_with(lambda slice_: self._multi_get(wanted, slice_), timeout, what)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Set ``keys[i]`` to ``values[i]`` for every i (one round trip on every built-in
        transport), releasing the ``get``s waiting on them."""
        self._writable_here()
        if isinstance(keys, str) or len(keys) != len(values):
            raise TypeError(f"multi_set needs equal-length sequences of keys and values, got {keys!r}")
        items = [(self._scoped(_writable(k)), _value(v)) for k, v in zip(keys, values, strict=True)]
        if items:
            self._multi_set(items)

    def append(self, key: str, value: bytes) -> None:
        """Atomically append ``value`` to the bytes at ``key`` (a missing key is created)."""
        self._writable_here()
        self._append(self._scoped(_writable(key)), _value(value))

    def close(self) -> None:
        """Leave the job: stop heartbeats (peers see a clean departure, not a loss) and
        release the connection. Idempotent, and safe from several threads at once (one
        closes; the others return once it has). Returns within the channel's timeout: the
        departure's calls get what is left of it (:meth:`_left_to_close`)."""
        with self._close_lock:
            if self._closed:
                return
            self._close_by = time.monotonic() + self.timeout
            if self.hosts_coordinator and self._broken is None:
                # Peers may still be reading their last replies: give them time to leave.
                self._await_departures(min(self.timeout, self.CLOSE_GRACE))
            self._closed = True
            if self._liveness is not None and self._broken is None:
                try:
                    self._depart()
                except ControlError as err:  # leaving anyway; the coordinator may be gone
                    log.debug("could not record the departure: %s", err)
            if self._status is not None:  # its last record says the rank closed
                self._status.stop(last_phase="closed" if self._broken is None else None)
            if self._liveness is not None:
                self._liveness.stop(announce=self._broken is None)
            self._close()

    def _left_to_close(self, at_least: float = 0.0) -> float | None:
        """Once ``close`` has begun, the seconds left of its timeout (at least ``at_least``):
        a transport bounds its departure's calls by it, liveness its last wait. None before."""
        if self._close_by is None:
            return None
        return max(self._close_by - time.monotonic(), at_least)

    def _await_departures(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the other ranks to close or be lost."""
        if self._liveness is not None:
            self._liveness.await_departures(grace)

    def _claimed(self) -> None:
        """Called once by the default :meth:`_claim_rank`, when ``dp.connect`` has claimed
        ``self.rank`` for this process and before liveness starts: a transport may register
        the rank (with a session, a lease). Default: nothing."""

    @property
    def hosts_coordinator(self) -> bool:
        """True when this process serves the job's state (closing it ends the job): its
        ``close`` first waits up to :attr:`CLOSE_GRACE` for the others to leave, and the suite
        closes it last. Default: False (the state lives elsewhere: a server, a file)."""
        return False

    @classmethod
    def diagnose(cls, url: ChannelURL, timeout: float, token: str | None = None) -> Sequence[ControlError | str]:
        """Problems a look at the server at ``url`` reveals before any request (a protocol,
        TLS or encryption mismatch, a certificate or token that does not fit), each a
        :class:`ConfigError` or :class:`AuthError` whose message names the fix (a plain
        string counts as a ConfigError). Used by ``dataparallel check``, and by the
        coordinator-based transports while a session opens unanswered, so that a
        misconfiguration fails in seconds rather than at the timeout. Optional hook.
        Default: none."""
        return []

    def __enter__(self) -> ControlChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url.shown} job={self.job!r} rank={self.rank}/{self.world_size}>"

    # ------------------------------------------------------------------ waiting
    def _budget(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        return float(timeout)

    def _await(self, key: str, timeout: float | None, what: str, hint: Any = None, needs: Needs | None = None) -> bytes:
        """Block for ``key``, checking liveness between slices; ``what`` and ``hint()``
        (called only on timeout) make the error message; ``needs``: the collective round
        the key waits for (a rank that closed without entering it ends the wait)."""
        return self._await_with(lambda slice_: self._get(key, slice_), timeout, what, hint, needs)

    def _await_with(
        self,
        fetch: Callable[[float], T | None],
        timeout: float | None,
        what: str,
        hint: Any = None,
        needs: Needs | None = None,
    ) -> T:
        """Call ``fetch(seconds)`` (a blocking read returning None on timeout) until it
        returns a value, in slices between which a lost peer or a closed channel raises,
        and, with ``needs``, a departed rank that never entered the round (PeerLeft)."""
        start = time.monotonic()
        deadline = start + self._budget(timeout)
        unanswered: ReadUnanswered | None = None  # the last read's, if it got no answer
        while True:
            self._raise_if_failed(what)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if unanswered is not None:
                    raise ChannelClosed(f"{what}: {unanswered}") from None
                waited = time.monotonic() - start
                raise ControlTimeout(f"{what} (job {self.job!r}, rank {self.rank})", waited, hint() if hint else "")
            poll = remaining
            if needs is not None or (self._liveness is not None and not self._liveness.interrupts_blocked_calls):
                poll = min(remaining, self.liveness_poll)
            try:
                value = fetch(poll)
            except ReadUnanswered as err:
                unanswered = err
                continue
            unanswered = None
            if value is not None:
                return value
            if needs is not None:
                self._raise_if_departed(needs, what)

    def _usable(self) -> None:
        if self._closed:
            raise ChannelClosed(f"{self!r} is closed")
        if self._broken is not None:  # the coordinator is gone: every call says so at once
            raise self._broken

    def _writable_here(self) -> None:
        """``_usable``, for the public writes: an observer's channel (:func:`dataparallel.observe`)
        reads only."""
        self._usable()
        if self._observer:
            raise ConfigError(f"{self!r} observes job {self.job!r}: it reads only (open a rank's channel to write)")

    def _raise_if_failed(self, what: str) -> None:
        self._usable()
        if self._broken is not None:
            raise self._broken
        if self._liveness is not None:
            lost = self._liveness.first_lost()
            if lost is not None:
                raise PeerLost(lost.rank, lost.last_seen, lost.reason, during=what)

    @property
    def failure(self) -> ControlError | None:
        """The fatal condition noticed in the background (the coordinator gone), if any."""
        return self._broken

    def _fail(self, error: ControlError) -> None:
        """Record a fatal condition noticed in the background (coordinator gone)."""
        if self._broken is None:
            self._broken = error

    def fail_with(self, error: ControlError) -> None:
        """End this channel with ``error``: every later call raises it, and so does a call
        blocked in it at its next look. For a watcher outside the channel that knows its
        coordinator or peer is gone (an elastic newcomer's, whose driver stopped marking
        its job running)."""
        self._fail(error)

    def reserved(self, area: str) -> ReservedKeys:
        """The core's own keys under ``__dp/AREA/`` in this channel's job and run, for a
        protocol the core builds on a channel (:mod:`dataparallel.control.membership`)."""
        return ReservedKeys(self, area)

    # ------------------------------------------------------------------ membership
    # A job's state belongs to a *run*: the ranks that joined it together. A later run of the
    # same job name (a rerun after a crash) starts clean once every rank of the previous one
    # is gone (closed, or silent for the liveness timeout), whatever that run left behind.
    # Transports with their own runs (a coordinator drops a job with its last session; etcd
    # binds the run to a lease) override _enter_run and _run_state; for the others the core
    # keeps each run's keys under a prefix of its own, named by the job's run pointer.

    def _scoped(self, key: str) -> str:
        """``key`` inside the current run (the core's calls to the hooks all go through it)."""
        return self._run_prefix + key

    def _attach_run(self) -> bool:
        """Attach this channel, which holds no rank and will not join, to the job's current
        run for reading (:func:`dataparallel.observe`), starting none: False where the job has
        no run. Default: the run the run pointer names. A transport whose server keeps runs
        itself (sessions, leases) overrides it; the coordinator-based ones and ``etcd`` are
        attached once connected."""
        return self._attach_core_run()

    def _attach_core_run(self, under: str = "") -> bool:
        """Attach to the run the core's run pointer names, the pointer and the run's keys
        kept under ``under`` in this channel's key space ("": the job's own; a node relay's
        ranks keep theirs under its prefix, :func:`~dataparallel.control.relay.node.observe_ranks`):
        False where there is none."""
        pointer = under + _RUN
        if not self._check([pointer]):
            return False
        current = self._get(pointer, self.timeout)
        if current is None:
            return False
        self._run_id = current
        self._run_prefix = f"{under}{_RUN}/{current.decode(errors='replace')}/"
        return True

    def _reattach(self) -> bool:
        """Attach this channel, which holds no rank, to its job's current run again (each look
        of an observer follows a rerun): the transport's :meth:`_attach_run`, then, where the
        job's ranks run behind node relays (:attr:`_ranks_under`), their own run under the
        relays' prefix. False where there is none."""
        if not self._attach_run():
            return False
        return not self._ranks_under or self._attach_core_run(self._ranks_under)

    def _enter_run(self, retry: bool) -> None:
        """Attach to the job's current run, or start one (called by the core before the rank
        is claimed). ``retry``: claiming in the run attached to last time conflicted, and the
        core waits for that run to end: look again. A transport whose server knows when a
        run's ranks are gone (sessions, leases) overrides this and :meth:`_run_state`.

        Default: the run pointer ``__dp/run`` names the run; its keys live under
        ``__dp/run/ID/``. A run that :meth:`_run_state` found over is replaced (atomically,
        with ``_compare_set``: one rank replaces it, the others follow)."""
        fresh = uuid.uuid4().hex[:16].encode()
        expected = self._run_id if retry and self._run_verdict == "over" else b""
        current = self._compare_set(_RUN, expected, fresh)
        if current != self._run_id:
            self._run_seen, self._run_alive, self._run_first = {}, {}, {}
        self._run_id = current
        self._run_prefix = f"{_RUN}/{current.decode(errors='replace')}/"
        self._run_verdict = ""

    def _run_state(self, holder: int | None) -> tuple[str, str] | None:
        """Judge the current run after a conflict over rank ``holder`` (None: the job was
        full): ``"alive"`` (the holder, or with None every rank that joined, showed life),
        ``"over"`` (a rank of it was declared lost, or all its ranks closed or stayed silent
        for the liveness timeout) or ``"unknown"`` (not yet), with what was seen, for the
        message; None where the transport ends dead runs itself. Looks at the run's heartbeat
        counters; repeated calls watch them move, by this process's clock."""
        if self._check([self._scoped(_LOST_KEY)]):
            return "over", "a rank of it was declared lost"
        now = time.monotonic()
        present: list[int] = []
        closed: set[int] = set()
        silent: dict[int, float] = {}
        for rank in range(self.world_size):
            if not self._check([self._scoped(claim_key(rank))]):
                continue
            beat = self._scoped(f"{_HB_KEY}{rank}")
            value = self._get(beat, 1e-3) if self._check([beat]) else None
            if value == _CLOSED_BEAT:
                closed.add(rank)
                continue
            present.append(rank)
            seen = self._run_seen.get(rank)
            first = self._run_first.setdefault(rank, now)
            if seen is None or seen[0] != value:
                # Life is a beat seen more than two intervals after the first look: one
                # already on its way then (a node relay carries its ranks' beats upstream up
                # to a tick late) is no proof that the holder still beats.
                if seen is not None and now - first > 2 * self.heartbeat_interval:
                    self._run_alive[rank] = now
                self._run_seen[rank] = (value, now)
            else:
                silent[rank] = now - seen[1]
        # A holder that closed left a run that may go on without it: then that run is the one.
        wanted = present if holder is None or holder in closed else [holder]
        if wanted and all(r in self._run_alive for r in wanted):
            if holder in closed:
                return "alive", f"it left its run, which goes on without it{self._who(wanted)}: a rank cannot rejoin"
            who = "it is" if holder is not None else "all its ranks are"
            return "alive", f"{who} alive (heartbeats seen){self._who(wanted)}"
        if all(silent.get(r, 0.0) > self.liveness_timeout for r in present):
            return "over", "its ranks closed or fell silent"
        quiet = {r: t for r, t in silent.items() if r in wanted}
        about = ", ".join(f"rank {r} silent for {t:.0f}s" for r, t in sorted(quiet.items())) or "not yet seen to beat"
        others = sorted(set(self._run_alive) - set(wanted))
        live = f"; rank(s) {', '.join(map(str, others))} of its run are alive{self._who(others)}" if others else ""
        return "unknown", f"{about}{live}"

    def _who(self, ranks: Sequence[int]) -> str:
        infos = [self.peer_info(r) for r in ranks[:3]]
        shown = [f"pid {i.get('pid')} on {i.get('host')}" for i in infos if i]
        return f" ({'; '.join(shown)})" if shown else ""

    def _join(self) -> None:
        """Enter the job's current run, check the token and claim a rank (assigning one if
        ``rank`` is None). A rank (or a full job) held by a run whose ranks are all gone is
        no conflict: once they have been silent for the liveness timeout the run gives way to
        a fresh one. One held by a live rank is refused, saying so."""
        self._enter_run(retry=False)
        start = None  # the first conflict: what is judged is what is seen from then on
        settle = self.liveness_timeout + 2 * self.heartbeat_interval + 2.0
        pause = min(0.5, self.heartbeat_interval / 2)
        while True:
            conflict = self._try_join()
            if conflict is None:
                break
            error, message, patient, holder = conflict
            start = time.monotonic() if start is None else start
            state = self._run_state(holder)
            self._run_verdict = state[0] if state else ""
            waited = time.monotonic() - start
            if state is not None and state[0] == "alive":
                raise error(f"{message}; {state[1]}")
            if state is None and not patient:
                raise error(message)
            if waited >= min(settle, self.timeout):
                if state is not None:
                    how = (
                        f"its run is not over after {waited:.0f}s ({state[1]}): stop that run's processes "
                        "(the next run then starts clean) or use another job name"
                    )
                elif waited >= settle:
                    how = (
                        f"still held after {waited:.0f}s, longer than a dead holder keeps it (the liveness timeout, "
                        f"{self.liveness_timeout:g}s): it is alive"
                    )
                else:
                    how = (
                        f"still held when this channel's timeout ran out ({waited:.0f}s); a dead holder gives it up "
                        f"within the liveness timeout ({self.liveness_timeout:g}s): retry with a longer timeout"
                    )
                raise error(f"{message}; {how}")
            time.sleep(pause if self._run_verdict != "over" else 0)
            self._enter_run(retry=True)
        # Joined: from here until close() this rank watches and is watched.
        self._start_liveness()

    def _try_join(self) -> tuple[type[ControlError], str, bool, int | None] | None:
        """Check the token and claim the rank in the current run: None when done, else the
        error to raise, why, whether waiting for the run to end may help, and the rank held
        (None: all of them)."""
        if not self.native_auth and not self._token_agrees():
            return AuthError, self._token_differs, False, None
        me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}".encode()
        wanted = self.rank
        peer = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}).encode()
        rank, owner = self._claim_rank(wanted, me, peer)
        if rank is not None:
            self.rank = rank
            return None
        if wanted is None:
            return ControlError, f"job {self.job!r} is full: all {self.world_size} ranks are taken", True, None
        why = (
            f"rank {wanted} of job {self.job!r} is already taken by {owner.decode(errors='replace')}; "
            "give each process its own rank, or rank=None to be assigned one"
        )
        return ControlError, why, True, wanted

    def _claim_rank(self, rank: int | None, claimant: bytes, peer: bytes) -> tuple[int | None, bytes]:
        """Claim ``rank`` (None: the next one not handed out) in the current run for
        ``claimant``, tell the transport (:meth:`_claimed`) and publish ``peer`` (host and
        pid, JSON) for :meth:`peer_info`: ``(rank, b"")`` once done, else ``(None, holder)``
        (``holder`` empty: every rank is taken). A transport may do it all in one request, as
        the coordinator-based ones do. Default: ``_compare_set`` on the rank's claim key (the
        ranks ``_add`` hands out, in turn, with None), then ``_claimed`` and ``_set``."""
        if rank is None:
            while True:
                rank = self._add(self._scoped(NEXT_RANK), 1) - 1
                if rank >= self.world_size:
                    return None, b""
                if self._compare_set(self._scoped(claim_key(rank)), b"", claimant) == claimant:
                    break
        else:
            owner = self._compare_set(self._scoped(claim_key(rank)), b"", claimant)
            if owner != claimant:
                return None, owner
        self.rank = rank
        self._claimed()
        self._set(self._scoped(peer_key(rank)), peer)
        return rank, b""

    def agree_on_token(self) -> None:
        """Raise :class:`AuthError` unless this process's token is the one the job's run was
        started with: what joining checks, for a channel that holds no rank and never joins
        (the torchrun backends', an elastic job's join queue)."""
        if not self._token_agrees():
            raise AuthError(self._token_differs)

    @property
    def _token_differs(self) -> str:
        return f"job {self.observed_job!r}: this process's token differs from the one the job was started with"

    def check_token(self) -> None:
        """Raise :class:`AuthError` unless this process's token is the one the job's run was
        started with, writing nothing (an observer's check, :func:`dataparallel.observe`):
        :class:`ControlError` where the run has no token check yet (no rank has joined)."""
        key, digest = self._token_check()
        if not self._check([key]):
            raise ControlError(
                f"job {self.observed_job!r}: no rank of its run has joined yet (nothing to compare the token with)"
            )
        if not hmac.compare_digest(self._get(key, self.timeout) or b"", digest):
            raise AuthError(self._token_differs)

    def _token_agrees(self) -> bool:
        """Whether this process's token is the one the run was started with.

        Not authentication (the store itself is open): it stops a misconfigured process from
        joining a job started with another token. A MAC of the job name under the token's own
        key: the store is readable by anyone who reaches it, and a plain hash of the token
        there could be brute-forced offline."""
        key, digest = self._token_check()
        return self._compare_set(key, b"", digest) == digest

    def _token_check(self) -> tuple[str, bytes]:
        """Where the run keeps its token check, and what this process's token makes of it (over
        the name of the job whose ranks started the run: an observer of a job behind node
        relays reads it in the relays' job)."""
        job = self.observed_job.encode()
        digest = hmac.digest(purpose_key(self.token, "token-check"), job, "sha256").hex().encode()
        return self._scoped(f"{RESERVED_PREFIX}token"), digest

    def peer_info(self, rank: int) -> dict[str, Any] | None:
        """What a rank published at rendezvous (host, pid), or None if not (yet) known."""
        key = self._scoped(peer_key(rank))
        try:
            if not self._check([key]):
                return None
            raw = self._get(key, 1.0)
        except ControlError:
            return None
        return json.loads(raw) if raw else None

    def _new_liveness(self) -> Liveness:
        """The hook through which a transport picks how lost peers are noticed (see
        :mod:`dataparallel.control.liveness`, the whole contract): made and started once the rank has
        joined (a transport may call ``_start_liveness()`` earlier, as the coordinator-based
        ones do with their session), stopped by ``close``. Default: :class:`StoreHeartbeats`,
        heartbeats through the channel's own keys (``_add``, ``_check``, ``_get``,
        ``_compare_set``, ``_set`` from a daemon thread), which works on any transport that
        implements the hooks."""
        return StoreHeartbeats(self, self.heartbeat_interval, self.liveness_timeout)

    def _start_liveness(self) -> None:
        """Start watching (idempotent): the core calls it once the rank has joined."""
        if self._liveness is None:
            liveness = self._new_liveness()
            liveness.start()
            self._liveness = liveness

    def _carry_on_heartbeats(self, writes: Callable[[], list[tuple[str, bytes]]] | None, within: float = 2.0) -> bool:
        """Have this rank's heartbeats carry ``writes()`` (None: no longer, a beat in flight
        waited for ``within`` seconds at most); False where they cannot (not joined yet, or a
        kind that carries nothing):
        :meth:`Liveness.carry <dataparallel.control.liveness.Liveness.carry>`."""
        liveness = self._liveness
        return liveness is not None and liveness.carry(writes, within)

    def _carried_by_heartbeats(self) -> bool:
        """Whether this rank's heartbeats carry writes now (a kind may give them back)."""
        liveness = self._liveness
        return liveness is not None and liveness.carrying

    @property
    def status(self) -> RankStatus:
        """What this rank says it is doing (:mod:`dataparallel.control.status`): its phase,
        epoch and step, published for ``dataparallel status`` once
        :meth:`RankStatus.publish` is called (``dp.fit`` does)."""
        if self._status is None:
            self._status = RankStatus(self)
        return self._status

    def lost_peers(self) -> dict[int, PeerLost]:
        """Peers declared lost so far (watching starts when this rank has joined)."""
        if self._liveness is None:
            return {}
        return {p.rank: PeerLost(p.rank, p.last_seen, p.reason) for p in self._liveness.lost()}

    # ------------------------------------------------------------------ torch
    def as_store(self) -> dist.Store:
        """A ``torch.distributed.Store`` over this channel (one per channel, kept alive by it),
        for ``init_process_group(backend, store=ch.as_store(), rank=ch.rank, world_size=...)``."""
        if self._store is None:
            from .store import ChannelStore

            self._store = ChannelStore(self)
        return self._store

    def _next_seq(self, kind: str, name: str) -> int:
        with self._seq_lock:
            seq = self._seq.get((kind, name), 0)
            self._seq[(kind, name)] = seq + 1
            return seq


def _key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty str, got {key!r}")
    if not _utf8(key):
        raise ConfigError(f"key {key!r} holds a lone surrogate: keys travel as UTF-8, which cannot encode it")
    return key


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (a ``str`` may hold lone surrogates, which do not)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _writable(key: str) -> str:
    """``key``, if the public primitives may write or delete it."""
    if _key(key).startswith(RESERVED_PREFIX):
        raise ConfigError(
            f"key {key!r} is reserved: keys under {RESERVED_PREFIX!r} hold the channel's own state "
            "(ranks, liveness, collectives) and cannot be written or deleted through the public calls"
        )
    return key


class ReservedKeys:
    """Keys of the core's own, ``__dp/AREA/NAME``, in one channel's job and run.

    For protocols that must still work after a loss: unlike the public calls, these do not
    raise a lost peer or the channel's failure (a survivor writes and reads them to agree on
    who carries on), and they never block longer than ``get``'s timeout. Users' keys may not
    start with ``__dp/``: the public calls refuse them, so the two never meet.
    """

    def __init__(self, channel: ControlChannel, area: str) -> None:
        self._channel = channel
        self._prefix = f"{RESERVED_PREFIX}{area}/"

    def _key(self, name: str) -> str:
        return self._channel._scoped(self._prefix + name)

    def set(self, name: str, value: bytes) -> None:
        self._channel._set(self._key(name), value)

    def get(self, name: str, timeout: float | None = None) -> bytes | None:
        """The value of ``name``, waiting up to ``timeout`` (the channel's) for it; None if absent then."""
        return self._channel._get(self._key(name), self._channel.timeout if timeout is None else timeout)

    def check(self, name: str) -> bool:
        """Whether ``name`` is set, without waiting."""
        return self._channel._check([self._key(name)])

    def compare_set(self, name: str, expected: bytes, desired: bytes) -> bytes:
        """As :meth:`ControlChannel.compare_set`: ``desired`` where ``name`` holds ``expected``
        (b"" for absent); returns what ``name`` holds afterwards."""
        return self._channel._compare_set(self._key(name), expected, desired)
