"""How a channel notices that a peer died, froze or was cut off: one interface, three kinds.

The contract, the same on every transport: a rank is watched from the moment it has
joined its job (``dp.connect`` returned) until it closes its channel. A watched rank that
is killed, frozen or cut off for ``liveness_timeout`` seconds is declared lost, and every
blocked call on every other rank raises :class:`~dataparallel.PeerLost` within a bounded
time after that, whether or not ``rendezvous()`` has happened. A rank that closes is a
clean departure, never a loss. A rank that has not joined yet is not watched: waiting for
it is bounded by the caller's timeout alone.

A transport picks its kind of :class:`Liveness` through one hook,
:meth:`ControlChannel._new_liveness() <dataparallel.ControlChannel._new_liveness>`:

- :class:`StoreHeartbeats` (the default, here): heartbeats through the channel's own keys,
  for transports that have nothing better (``memory``, ``tcpstore``, users' own).
- ``CoordinatorLiveness`` (:mod:`dataparallel.control.remote`): the coordinator watches the
  sessions of ``zmq`` and ``grpc`` and reports losses in its replies.
- ``LeaseLiveness`` (``etcd``): one etcd lease per rank and a watch on lease-bound keys.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ChannelClosed, ControlError

if TYPE_CHECKING:
    from .channel import ControlChannel

log = logging.getLogger(__name__)

_HB = "__dp/hb/"
_LOST = "__dp/lost"
_CLOSED = b"closed"


def with_process(reason: str, info: dict[str, Any]) -> str:
    """A loss's ``reason`` naming the process the rank ran as (its peer record: host, pid)."""
    return f"{reason}; it ran as pid {info.get('pid')} on {info.get('host')}"


def loss_report(rank: int, last_seen: float | None, reason: str, by: int | str | None) -> bytes:
    """A loss as :class:`StoreHeartbeats` publishes it under the run's ``__dp/lost`` (first
    report wins; every rank reads it on its next tick): ``by`` the rank that noticed, or
    what did (a node relay, which sees its ranks' processes end)."""
    return json.dumps({"rank": rank, "last_seen": last_seen, "reason": reason, "by": by}).encode()


def loss_key(channel: ControlChannel) -> str:
    """Where ``channel``'s run keeps its loss report (a hook-level key)."""
    return channel._scoped(_LOST)


def heartbeat_key(channel: ControlChannel, rank: int) -> str:
    """Where ``rank`` of ``channel``'s run beats (a hook-level key): what the core's
    membership reads to tell a live holder of a rank from a gone one."""
    return channel._scoped(f"{_HB}{rank}")


class ReadUnanswered(ChannelClosed):
    """A transport's ``_get`` or ``_multi_get`` got no answer within its bound (the store
    restarting or failing over, a slow link): the core's wait reads again while its time
    lasts (see :class:`~dataparallel.control.channel.ControlChannel`, which names it too).
    Defined here, below the channel, because the heartbeats read as well."""


@dataclass(frozen=True)
class LostPeer:
    rank: int
    last_seen: float | None  # wall clock (time.time()) of the last sign of life seen
    reason: str


class Liveness(abc.ABC):
    """One channel's view of which peers are lost.

    Made by the channel's ``_new_liveness()`` and started once, when the rank has joined
    (an implementation may be started earlier by its transport, e.g. with the session).
    ``first_lost`` and ``lost`` never block: the core calls them between the slices of
    every blocked call. Implementations record losses with :meth:`_record`.
    """

    #: True when the transport's own blocked calls raise PeerLost as soon as a peer is lost
    #: (a coordinator answers parked requests); otherwise the core waits in slices of the
    #: channel's ``liveness_poll`` seconds and checks :meth:`first_lost` between them.
    interrupts_blocked_calls: ClassVar[bool] = False
    #: True when this kind's heartbeats carry a rank's small periodic writes (:meth:`carry`):
    #: inside the heartbeat's own request, or as one more write of the same tick.
    carries_writes: ClassVar[bool] = False

    def __init__(self) -> None:
        self._lost: dict[int, LostPeer] = {}
        self._writes: Callable[[], list[tuple[str, bytes]]] | None = None
        self._carrying = threading.Lock()  # held while a beat's writes are made or in flight

    def carry(self, writes: Callable[[], list[tuple[str, bytes]]] | None, within: float = 2.0) -> bool:
        """From now on, each heartbeat also writes what ``writes()`` returns ((key, value)
        pairs of hook-level keys, each written as ``_set`` writes it); None: no longer. What
        a rank publishes of itself rides on the heartbeats this way (one request or one tick a
        heartbeat instead of two). A beat whose writes are in flight ends first (waited for
        ``within`` seconds at most), so that a write the caller makes next is never overtaken
        by an older one. False where this kind cannot carry them: the caller then writes them
        itself."""
        if not self.carries_writes:
            return False
        held = self._carrying.acquire(timeout=within)
        try:
            self._writes = writes
        finally:
            if held:
                self._carrying.release()
        return True

    @property
    def carrying(self) -> bool:
        """Whether the heartbeats carry writes now (:meth:`carry`); a kind may give them back
        (a coordinator that predates carried writes): their writer then makes them itself."""
        return self._writes is not None

    def _riders(self) -> list[tuple[str, bytes]]:
        """What this heartbeat carries (nothing where ``writes()`` fails: never the beat's
        failure)."""
        writes = self._writes
        if writes is None:
            return []
        try:
            return writes()
        except Exception as err:
            log.debug("a heartbeat's writes not made: %s", err)
            return []

    def _write_riders(self, write: Callable[[str, bytes], None]) -> None:
        """This tick's writes, made one ``write`` (a ``_set``, bounded as the tick needs) each,
        where the heartbeat itself cannot hold them (their failure is not the beat's: the
        next tick judges the store)."""
        with self._carrying:
            for key, value in self._riders():
                try:
                    write(key, value)
                except Exception as err:
                    log.debug("a heartbeat's write of %r not made: %s", key, err)
                    return

    @abc.abstractmethod
    def start(self) -> None:
        """Begin watching (and, where the kind needs it, being watched). Called once."""

    @abc.abstractmethod
    def stop(self, announce: bool) -> None:
        """Stop watching. ``announce``: tell the others this is a clean departure."""

    def await_departures(self, grace: float) -> None:
        """On the rank whose exit ends the job's state (the coordinator's host): wait up to
        ``grace`` seconds for the other joined ranks to close or be lost. Default: no wait."""
        del grace  # nothing outlives this rank in the default kind

    def first_lost(self) -> LostPeer | None:
        lost = self._lost  # read without a lock: _record swaps the dict whole
        return next(iter(lost.values()), None) if lost else None

    def lost(self) -> list[LostPeer]:
        return list(self._lost.values())

    def left(self) -> set[int]:
        """The peers seen leaving cleanly, where this kind watches for it (else empty)."""
        return set()

    def _record(self, peer: LostPeer) -> bool:
        """Note ``peer`` as lost (first report wins); True if it was news."""
        if peer.rank in self._lost:
            return False
        self._lost = {**self._lost, peer.rank: peer}
        return True


class StoreHeartbeats(Liveness):
    """Heartbeats through the channel's keys (one daemon thread per rank).

    Each rank bumps ``__dp/hb/RANK`` every ``interval`` seconds from the moment it joins.
    Rank 0 watches every peer; the others watch rank 0. A rank is watched once its counter
    exists (it has joined); a counter that has not moved for ``timeout`` seconds, by the
    watcher's own clock (hosts need no synchronised clocks), declares the peer lost and
    publishes it under ``__dp/lost`` (first report wins), where every rank reads it on its
    next tick. A rank that closes writes ``closed`` instead: a clean departure.

    A second thread guards the first: when the store has answered none of its requests for
    ``timeout`` seconds (plus the transport's ``store_stall``), failing or blocked (a frozen
    coordinator: TCPStore's client waits for a reply without a bound), the channel fails
    with ChannelClosed, whose ``_fail`` releases the blocked calls.

    Cost per tick: one write per rank, plus two reads per watched peer, plus the writes the
    beat carries (:meth:`~Liveness.carry`: a rank's status record), made after the look.
    """

    carries_writes = True

    def __init__(self, channel: ControlChannel, interval: float, timeout: float) -> None:
        super().__init__()
        self._ch = channel
        self._interval = interval
        self._timeout = timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dp-liveness-r{channel.rank}", daemon=True)
        self._left: set[int] = set()
        # rank -> (last counter value, monotonic time it changed, wall time it changed);
        # a rank enters once its counter exists, i.e. once it has joined.
        self._seen: dict[int, tuple[bytes, float, float]] = {}
        self._last_watch = time.monotonic()  # when _watch last looked
        self._ready = threading.Event()  # set after the thread's first tick
        self._first_error: BaseException | None = None
        self._last_ok = time.monotonic()  # when the store last answered a request of a tick
        self._failing_since: float | None = None  # when the ticks began to fail, if they do
        self._last_error: BaseException | None = None  # why, if they do
        self._guard_thread = threading.Thread(
            target=self._guard, name=f"dp-liveness-guard-r{channel.rank}", daemon=True
        )

    @property
    def _me(self) -> int:
        """This rank (heartbeats start once the channel has joined the job and holds one)."""
        if self._ch.rank is None:
            raise ControlError(f"{self._ch!r} beats before it holds a rank")
        return self._ch.rank

    def start(self) -> None:
        """Start the thread and wait for its first tick. Even alone a rank beats: a later
        process claiming its rank must see it is alive. The first tick runs in the thread, so
        the connection it opens on a transport with one per thread (``tcpstore``: a new one
        can take seconds, e.g. torch's reverse DNS lookup of the peer) is made while joining,
        not mid-job, where it would outlast a short liveness timeout."""
        self._thread.start()
        if not self._ready.wait(self._ch.timeout):
            self._stop.set()
            raise ChannelClosed(f"job {self._ch.job!r}: no first heartbeat within {self._ch.timeout:g}s")
        if self._first_error is not None:
            raise self._first_error
        self._last_ok = time.monotonic()
        self._guard_thread.start()

    def stop(self, announce: bool) -> None:
        self._stop.set()
        left = self._ch._left_to_close()
        for thread in (self._thread, self._guard_thread):
            if thread.is_alive() and threading.current_thread() is not thread:
                # Not past close's timeout: a beat in flight to a store gone silent ends on its own.
                thread.join(timeout=self._interval * 4 if left is None else min(self._interval * 4, left))
        if announce:
            try:
                self._ch._set(self._key(_HB, self._me), _CLOSED)
            except Exception as err:  # leaving anyway; the coordinator may be gone
                log.debug("could not announce departure: %s", err)

    def await_departures(self, grace: float) -> None:
        """Wait up to ``grace`` seconds until every other joined rank has closed or been lost
        (a rank that never joined is not waited for)."""
        deadline = time.monotonic() + grace
        others = [r for r in range(self._ch.world_size) if r != self._ch.rank]
        while time.monotonic() < deadline:
            gone = set(self._lost)
            for rank in others:
                key = self._key(_HB, rank)
                try:
                    if rank not in gone and (not self._ch._check([key]) or self._ch._get(key, 1.0) == _CLOSED):
                        gone.add(rank)
                except Exception:
                    return
            if gone.issuperset(others):
                return
            time.sleep(min(0.05, self._interval))

    def _key(self, name: str, rank: int | str = "") -> str:
        return self._ch._scoped(f"{name}{rank}")

    def left(self) -> set[int]:
        return set(self._left)

    # ------------------------------------------------------------------ background
    def _watched(self) -> list[int]:
        if self._ch.rank == 0:
            return list(range(1, self._ch.world_size))
        return [0]

    def _run(self) -> None:
        try:
            self._first_tick()
        except BaseException as err:  # start() raises it in the joining thread
            self._first_error = err
            return
        finally:
            self._ready.set()
        # A failed tick (a connection reset: the transport reconnects on the next call) is
        # retried; the guard decides when the store has been unanswered for too long.
        while not self._stop.wait(self._interval):
            if self._ch.failure is not None:
                return
            try:
                self._beat()
                self._watch()
                self._read_reports()
                self._failing_since = None
            except Exception as err:
                self._last_error = err
                self._failing_since = self._failing_since or time.monotonic()
                continue
            self._write_riders(self._ch._set)  # after the beat and the look

    def _first_tick(self) -> None:
        """The first beat and look, while joining: a read the store left unanswered within
        its bound (a busy relay or store) is read again, as long as the channel's timeout
        lasts (what start() waits), as every other wait of the core does."""
        deadline = time.monotonic() + self._ch.timeout
        while True:
            try:
                self._beat()
                self._watch()
                return
            except ReadUnanswered:
                if self._stop.is_set() or time.monotonic() >= deadline:
                    raise

    def _answered(self) -> None:
        """A request of a tick was answered: the store is there."""
        self._last_ok = time.monotonic()
        self._last_error = None

    def _guard(self) -> None:
        """Fail the channel once the store has answered no request of a tick for the liveness
        timeout (failing, or blocked: a frozen coordinator); where the channel hosts the
        coordinator (it cannot be frozen while this runs), once ticks have failed for it."""
        period = min(self._interval, self._timeout / 4)
        awake = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - awake > self._timeout / 2:
                # This process stalled (frozen, or starved): the gap is nobody's silence. If the
                # others gave this rank up meanwhile, the next tick reads it and says so.
                self._last_ok = now
                self._failing_since = self._failing_since and now
            awake = now
            if self._stop.is_set() or self._ch.failure is not None:
                return
            since = self._failing_since if self._ch.hosts_coordinator else self._last_ok
            quiet = 0.0 if since is None else now - since
            if quiet > self._timeout + self._ch.store_stall:
                why = self._last_error or "a heartbeat is still waiting for its reply"
                self._ch._fail(
                    ChannelClosed(
                        f"lost contact with the coordinator of job {self._ch.job!r}: no answer for "
                        f"{quiet:.1f}s (liveness timeout {self._timeout:g}s): {why}"
                    )
                )
                return

    def _beat(self) -> None:
        self._ch._add(self._key(_HB, self._me), 1)
        self._answered()

    def _watch(self) -> None:
        now = time.monotonic()
        if now - self._last_watch > max(self._timeout / 2, 2 * self._interval):
            # This watcher could not look for a while (its process stalled, or the store did:
            # torch's TCPStore server stops answering while it looks a new client up in DNS).
            # A peer is judged on time this watcher could see it: the gap is nobody's silence.
            self._seen = {rank: (value, now, wall) for rank, (value, _, wall) in self._seen.items()}
        self._last_watch = now
        for rank in self._watched():
            if rank in self._lost or rank in self._left:
                continue
            key = self._key(_HB, rank)
            value = self._ch._get(key, self._interval) if self._ch._check([key]) else None
            self._answered()
            seen = self._seen.get(rank)
            if value == _CLOSED:
                self._left.add(rank)
            elif value is not None and (seen is None or value != seen[0]):
                self._seen[rank] = (value, now, time.time())
            elif seen is not None and now - seen[1] > self._timeout:
                self._declare(
                    rank, seen[2], f"no heartbeat for {now - seen[1]:.1f}s (liveness timeout {self._timeout:g}s)"
                )

    def _declare(self, rank: int, last_seen: float | None, reason: str) -> None:
        info = self._ch.peer_info(rank)
        if info:
            reason = with_process(reason, info)
        self._ch._compare_set(self._key(_LOST), b"", loss_report(rank, last_seen, reason, self._ch.rank))
        self._read_reports()  # the first loss published is everyone's first_lost()
        self._record(LostPeer(rank, last_seen, reason))  # later ones count here (lost(), departures)

    def _fetch_report(self) -> bytes | None:
        """The run's loss report, if there is one (read through the channel's keys)."""
        if not self._ch._check([self._key(_LOST)]):
            return None
        return self._ch._get(self._key(_LOST), self._interval)

    def _read_reports(self) -> None:
        raw = self._fetch_report()
        if not raw:
            return
        report = json.loads(raw)
        rank = int(report["rank"])
        reason = report["reason"]
        by = report.get("by")
        if isinstance(by, str):
            reason = f"{reason} (noticed by {by})"
        elif by != self._ch.rank:
            reason = f"{reason} (noticed by rank {by})"
        if rank == self._ch.rank:  # resumed after the others gave this rank up
            self._ch._fail(ChannelClosed(f"rank {rank} of job {self._ch.job!r} was declared lost: {reason}"))
            return
        if self._record(LostPeer(rank, report.get("last_seen"), reason)):
            log.warning("job %r: peer rank %d lost: %s", self._ch.job, rank, reason)
