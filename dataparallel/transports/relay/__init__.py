"""``relay:///PATH/relay.sock``: a rank's channel through its node's relay
(:class:`~dataparallel.control.relay.node.NodeRelay`), which its launcher hosts.

The rank joins the relay's local leg (shared memory and eventfds; the socket at PATH is only
for joining) as the job rank it was given; every hook passes through to the relay's own
channel, and a barrier (``rendezvous`` included) is met by the node's ranks in shared memory
and crosses the network once per node, as an ``all_gather`` does (the node's ranks hand their
values to the relay, which enters it upstream once with the node's). The relay says the
job's name and size; a rank that was given others is refused.

A channel that holds no rank (an observer, ``dp.observe``; ``rank=None`` until it is
assigned one; a torchrun agent's) joins as a guest, whose calls pass through the same way;
``rank=None`` is assigned the lowest free rank of the node (its seat), then claims it as a
given rank does. A rank whose seat is held by a live process joins as a guest too: its
claim then fails naming the holder, as a directly connected rank's does.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from dataparallel.control.channel import ControlChannel, ReadUnanswered
from dataparallel.control.collectives import Needs, _value
from dataparallel.control.keyspace import claim_key, peer_key
from dataparallel.control.liveness import LostPeer, StoreHeartbeats, heartbeat_key, loss_key
from dataparallel.control.registry import ChannelURL
from dataparallel.control.relay.local import OVER_SLOT, LocalClient, NoReply, SlotsBusy, barrier_name
from dataparallel.control.relay.node import (
    ADD,
    ALL_GATHER,
    APPEND,
    CHECK,
    COMPARE_SET,
    DELETE,
    DELETE_MANY,
    GET,
    LOSS,
    MULTI_GET,
    MULTI_SET,
    NUM_KEYS,
    PROGRESS,
    SET,
    UNWATCH,
    UPSTREAM_FLAGS,
    WATCH,
    arrived_hint,
    pack,
    unpack,
)
from dataparallel.errors import BadMessage, ChannelClosed, ConfigError, ControlError, ControlTimeout

#: Seconds a call waits for the relay beyond what its own operation may take (the relay's
#: upstream call ends a little before: node.upstream_timeout, upstream_wait): what a direct
#: client's reply grace is, so a call through a frozen relay keeps the timeout's bound as a
#: frozen coordinator's does.
_SLACK = 0.25
#: A timed-out barrier's count (its message's) is asked of the relay for this long at most,
#: and never past this long after the barrier's deadline: a frozen relay's silence must not
#: push the timeout past its promise (the deadline and half a second).
_HINT_WITHIN, _HINT_BY = 0.3, 0.3


T = TypeVar("T")


class _Crowded(ReadUnanswered):
    """A read the rank's other calls left no slot for, for its whole bound: the relay was not
    asked (not its silence)."""


def _key(key: str) -> bytes:
    return key.encode("utf-8", errors="surrogatepass")


class RelayedChannel(ControlChannel):
    scheme = "relay"
    URL_FORM = "{scheme}:///PATH/relay.sock"
    URL_HOST = False
    #: The relay sees its ranks' processes end (a pidfd each) and reports them at once.
    notices_exits = True
    #: A frozen rank holds nothing of the others': its calls are the relay's to make.
    survives_frozen_writers = True
    # fences_lost_members, survives_connection_loss, store_stall: the upstream's, from the
    # relay's hello (UPSTREAM_FLAGS).

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        if not url.path.startswith("/"):
            raise ConfigError(f"{url.shown!r}: no socket path (expected {cls.url_form(url)})")
        if serving:
            raise ConfigError(f"{url.shown!r}: a relay is hosted by its node's launcher, not served")

    @classmethod
    def security(cls, url: ChannelURL, token: str | None) -> str:
        return "this machine only: the relay admits processes of its own user (checked by the kernel)"

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._barriers = threading.Lock()
        self._within = threading.local()  # .deadline: the wait this thread's calls are made for
        self._watched = False
        self._local = self._join_relay(url.path)

    def _join_relay(self, path: str) -> LocalClient:
        """The local leg of the relay at ``path``, its job and size checked against this
        channel's, the upstream's flags taken on."""
        local = LocalClient(path, self.rank, timeout=self.timeout)
        info = local.info
        problems = []
        if self.world_size and info.get("world_size") != self.world_size:  # an observer's is 0: any
            problems.append(f"world size {self.world_size}, the relay's job has {info.get('world_size')}")
        if info.get("job") != self.job:
            problems.append(f"job {self.job!r}, the relay's is {info.get('job')!r}")
        if problems:
            local.close()
            who = "a channel that holds no rank" if self.rank is None else f"rank {self.rank}"
            raise ConfigError(f"{self.url.shown!r}: {who} was given " + "; ".join(problems))
        for flag in UPSTREAM_FLAGS:  # the upstream's, which every call passes through
            if flag in info:
                setattr(self, flag, type(getattr(self, flag))(info[flag]))
        return local

    def _call(self, op: int, payload: bytes, waits: float | None = None) -> bytes:
        """``op`` through the relay, answered within the channel's timeout, or for a waiting
        read within ``waits`` (the relay's upstream read answers a little before: see
        :func:`~dataparallel.control.relay.node.upstream_wait`), plus :data:`_SLACK`; while
        closing, within what is left of close's. No answer in time: the relay is frozen or
        cut off, as a coordinator that stopped answering is (ChannelClosed; a waiting read's is
        ReadUnanswered, see :meth:`_read`)."""
        bound = (self.timeout if waits is None else waits) + _SLACK
        within = getattr(self._within, "deadline", None)
        if within is not None:  # a call a barrier's wait makes (its departure check): within the barrier's bound
            bound = min(bound, max(within - time.monotonic(), 0.05))
        if waits is None:  # within the core's collective this call is part of (a waiting read's wait is)
            bound = self._call_bound(bound)
        else:
            closing = self._left_to_close(at_least=0.05)
            bound = bound if closing is None else min(bound, closing)
        try:
            return self._local.call(
                op,
                payload,
                timeout=bound,
                waiting=None if waits is None else min(waits, bound),
                answer=min(_SLACK, bound / 2),
            )
        except NoReply as err:
            if waits is not None:
                raise
            if within is not None:  # the barrier's wait goes on (and ends at its deadline)
                raise ReadUnanswered(f"node relay: no answer within {bound:.2f}s ({err})") from None
            raise ChannelClosed(f"node relay: no answer within {bound:.2f}s ({err})") from None
        except ControlError as err:
            # The relay declared this rank lost, or its own channel ended: this one ends too.
            if getattr(err, "fatal", False) and not self._closed:
                self._fail(err)
            raise

    # ------------------------------------------------------------------ hooks
    def _set(self, key: str, value: bytes) -> None:
        self._call(SET, pack(_key(key), value))

    def _read(self, op: int, payload: bytes, timeout: float) -> list[bytes]:
        """A waiting read: the relay's silence past its bound is an unanswered read (the core
        reads again while its wait lasts), never a timeout of the key's wait; so is a read
        the rank's other calls left no slot for (:class:`_Crowded`), which a wait's look
        takes as a look that saw nothing (:meth:`_await_with`)."""
        try:
            return unpack(self._call(op, payload, waits=timeout))
        except SlotsBusy as err:
            raise _Crowded(f"node relay: {err}") from None
        except NoReply as err:
            raise ReadUnanswered(f"node relay: {err}") from None

    def _get(self, key: str, timeout: float) -> bytes | None:
        found = self._read(GET, pack(_key(key), struct.pack("<d", timeout)), timeout)
        return found[0] if found else None

    def _add(self, key: str, amount: int) -> int:
        return struct.unpack("<q", self._call(ADD, pack(_key(key), struct.pack("<q", amount))))[0]

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(COMPARE_SET, pack(_key(key), expected, desired))

    def _delete(self, key: str) -> bool:
        return self._call(DELETE, pack(_key(key))) == b"\x01"

    def _delete_many(self, keys: Sequence[str]) -> int:
        return struct.unpack("<q", self._call(DELETE_MANY, pack(*(_key(k) for k in keys))))[0]

    def _check(self, keys: Sequence[str]) -> bool:
        return self._call(CHECK, pack(*(_key(k) for k in keys))) == b"\x01"

    def _num_keys(self) -> int:
        return struct.unpack("<q", self._call(NUM_KEYS, pack()))[0]

    def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        payload = pack(struct.pack("<d", timeout), *(_key(k) for k in keys))
        try:
            found = self._read(MULTI_GET, payload, timeout)
        except BadMessage as err:
            if OVER_SLOT not in str(err) or len(keys) == 1:
                raise
            return super()._multi_get(keys, timeout)  # values too large together: one by one
        if not found:
            return None
        if len(found) != len(keys) + 1:
            raise BadMessage(f"relay: {len(found) - 1} values for {len(keys)} keys")
        return found[1:]

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        self._call(MULTI_SET, pack(*(field for key, value in items for field in (_key(key), value))))

    def _append(self, key: str, value: bytes) -> None:
        self._call(APPEND, pack(_key(key), value))

    def _claim_rank(self, rank: int | None, claimant: bytes, peer: bytes) -> tuple[int | None, bytes]:
        # As the core's, but the seat at the relay comes first (a rank=None is the node's
        # lowest free seat's rank: the local leg hands seats out; a rank claimed is then
        # never left claimed by a process without a seat), and the rank's process record
        # travels with its watch (one request).
        if rank is None:
            rank = self._seat(None)
            if rank is None:
                return None, b""  # every seat of the node is held by a live process
        elif self._local.local_rank is None and self._seat(rank) is None:
            # Its seat is held by a live process: the holder the run knows is named (and the
            # core judges whether it lives), or, where this run has none, that process.
            key = self._scoped(claim_key(rank))
            owner = self._get(key, 1e-3) if self._check([key]) else None
            return None, owner or f"a live process holding rank {rank}'s seat at its node's relay".encode()
        owner = self._compare_set(self._scoped(claim_key(rank)), b"", claimant)
        if owner != claimant:
            return None, owner
        self.rank = rank
        self._watch(self._scoped(peer_key(rank)), peer)
        return rank, b""

    def _seat(self, rank: int | None) -> int | None:
        """The local leg's seat for ``rank`` (None: the lowest free one), as :meth:`LocalClient.seat`."""
        try:
            return self._local.seat(rank, self.timeout + _SLACK)
        except NoReply as err:
            raise ChannelClosed(f"node relay: no answer to a seat request ({err})") from None

    def _watch(self, peer_key: str, peer: bytes) -> None:
        # The relay speaks for this rank's liveness: told where this run's losses are
        # reported and where it beats, it beats upstream for it while it beats in shared
        # memory, and reports its loss (its process ended: at once; its beats stopped: after
        # the liveness timeout). It writes the rank's first beat and its process record
        # together.
        assert self.rank is not None
        liveness = struct.pack("<dd", self.heartbeat_interval, self.liveness_timeout)
        keys = (loss_key(self), heartbeat_key(self, self.rank), peer_key)
        self._call(WATCH, pack(*(_key(k) for k in keys), liveness, peer))
        self._watched = True

    def _fail(self, error: ControlError) -> None:
        super()._fail(error)
        local = getattr(self, "_local", None)
        if local is not None:
            local.interrupt()  # a barrier waiting in shared memory raises it now, not a slice later

    def _new_liveness(self) -> StoreHeartbeats:
        return RelayedHeartbeats(self, self.heartbeat_interval, self.liveness_timeout)

    def _depart(self) -> None:
        self._unwatch()  # first: a clean departure is no loss, even if this process ends in it
        super()._depart()

    def _unwatch(self) -> None:
        if self._watched:
            self._watched = False
            try:
                self._call(UNWATCH, pack())
            except ControlError:
                pass  # the relay is gone or frozen: nothing to report from there either

    def _close(self) -> None:
        if self._broken is None:
            self._unwatch()
        # What is left of close's timeout, but 0.2 s at least (a woken use ends in less; the
        # descriptors are otherwise left open for the rest of the process).
        self._local.close(self._left_to_close(at_least=0.2) or 5.0)

    # ------------------------------------------------------------------ collectives
    def _await_with(
        self,
        fetch: Callable[[float], T | None],
        timeout: float | None,
        what: str,
        hint: Any = None,
        needs: Needs | None = None,
    ) -> T:
        """As every channel's, with the calls the wait makes between its looks (its departure
        check) bounded by its deadline, and those of its timeout's message by
        :data:`_HINT_BY` past it, as a barrier's and an all_gather's are (they set the bound
        themselves): a read the store holds then keeps the caller no longer than its timeout.
        The looks keep their own slices' bounds; a look the rank's other calls left no slot
        for saw nothing (the wait looks again while it lasts, and ends in a ControlTimeout as
        a direct rank's does), where any other read takes it as unanswered."""
        if getattr(self._within, "deadline", None) is not None:
            return super()._await_with(fetch, timeout, what, hint, needs)
        deadline = time.monotonic() + self._budget(timeout)

        def look(slice_: float) -> T | None:
            self._within.deadline = None
            try:
                return fetch(slice_)
            except _Crowded:
                return None
            finally:
                self._within.deadline = deadline

        def hinted() -> str:
            self._within.deadline = deadline + _HINT_BY
            return hint()

        self._within.deadline = deadline
        try:
            return super()._await_with(look, timeout, what, hinted if hint else None, needs)
        finally:
            self._within.deadline = None

    def _raise_if_departed(self, needs: Needs, during: str) -> None:
        # A departure check the relay left unanswered within its slice is asked again at the
        # next one: a busy relay is no closed channel (a frozen one ends the barrier at its
        # deadline).
        try:
            super()._raise_if_departed(needs, during)
        except ReadUnanswered:
            pass

    def barrier(self, name: str = "barrier", timeout: float | None = None) -> None:
        """As every channel's barrier; the node's ranks meet in shared memory and their relay
        enters the barrier once for them. Every rank enters its barriers in the same order
        (the collectives' contract); here a second thread's barrier waits for the first's,
        within its own timeout."""
        self._usable()
        if self._local.local_rank is None:
            raise ConfigError(f"barrier {name!r}: this channel holds no rank (a relay's barriers are its ranks')")
        budget = self._budget(timeout)
        deadline = time.monotonic() + budget
        if not self._barriers.acquire(timeout=budget):
            raise ControlTimeout(f"barrier {name!r} (this rank's previous barrier still waits)", budget)
        try:
            seq = self._next_seq("barrier", name)
            left = max(deadline - time.monotonic(), 1e-3)
            what = f"barrier {name!r} round {seq}"
            try:
                generation = self._local.arrive(name, left)

                def progress() -> str:  # a timed-out barrier's count, from the relay
                    within = min(_HINT_WITHIN, deadline + _HINT_BY - time.monotonic())
                    if within < 0.02:
                        return ""
                    payload = pack(struct.pack("<q", generation), barrier_name(name))
                    try:
                        total, complete = struct.unpack("<q?", self._local.call(PROGRESS, payload, timeout=within))
                    except (ControlError, NoReply, struct.error):
                        return ""  # a frozen or busy relay: the timeout without its count
                    return arrived_hint(total, self.world_size, complete)

                # In slices, between which a lost peer (the core's liveness) or a rank that
                # closed without entering this round (its departure record) ends the wait.
                wait = lambda slice_: self._local.released(generation, slice_)  # noqa: E731
                self._within.deadline = deadline
                try:
                    self._await_with(
                        wait,
                        left,
                        f"barrier {name!r}",
                        progress,
                        needs=Needs("barrier", name, seq, range(self.world_size), what),
                    )
                finally:
                    self._within.deadline = None
            except ControlError as err:
                if getattr(err, "fatal", False) and not self._closed:
                    self._fail(err)
                raise
        finally:
            self._barriers.release()

    def all_gather(self, name: str, value: bytes, timeout: float | None = None) -> list[bytes]:
        """As every channel's all_gather; the node's ranks hand their values to their relay,
        which enters the all_gather upstream once for them and hands each rank every rank's
        values (or the outcome's error). The rank waits in slices, between which a lost peer
        (the core's liveness) or a rank that closed without entering this round (its
        departure record) ends the wait, as on a direct channel."""
        self._usable()
        if self._local.local_rank is None:
            raise ConfigError(f"all_gather {name!r}: this channel holds no rank (a relay's collectives are its ranks')")
        mine = _value(value)
        budget = self._budget(timeout)
        deadline = time.monotonic() + budget
        seq = self._next_seq("allgather", name)
        what = f"all_gather {name!r} round {seq}"
        label = _key(name)
        gives = True  # the value goes with each look until the relay has answered one
        absent: list[int] | None = None  # the node's ranks that gave none yet, as last told
        got: list[bytes] = []  # the values given so far (as many as a slot holds a reply)

        def fetch(slice_: float) -> list[bytes] | None:
            nonlocal gives, absent
            while True:
                head, wait = struct.pack("<qdq", seq, budget, len(got)), struct.pack("<d", slice_)
                payload = pack(head, wait, label, mine, b"\x01") if gives else pack(head, wait, label, b"", b"\x00")
                self._within.deadline = None  # its own wait's bound (a slice): never cut short
                try:
                    found = self._read(ALL_GATHER, payload, slice_)
                except _Crowded:
                    return None  # not asked this slice (the value still to give, if it was)
                finally:
                    self._within.deadline = deadline
                gives = False
                if not found or found[0] != b"\x01":
                    absent = [struct.unpack("<q", r)[0] for r in found[1:]]
                    return None
                start, total = struct.unpack("<qq", found[1])
                if start != len(got) or total != self.world_size or len(found) < 3:
                    raise BadMessage(f"{what}: the relay gave values {start}.. of {total} for {self.world_size} ranks")
                got.extend(found[2:])
                if len(got) >= total:
                    return got[:total]

        def missing() -> str:  # from the relay's last answer: no request after the deadline
            if absent is None:
                return ""
            if not absent:
                return "every rank of this node gave its value; another node's ranks have not"
            listed = ", ".join(map(str, absent[:8])) + (" and more" if len(absent) > 8 else "")
            return f"no value yet from rank(s) {listed}"

        # The calls the wait makes between slices (its departure check) end by its deadline,
        # as a barrier's do: a relay frozen then holds the caller no longer than its timeout.
        self._within.deadline = deadline
        try:
            return self._await_with(
                fetch, budget, what, missing, needs=Needs("allgather", name, seq, range(self.world_size), what)
            )
        except ControlError as err:
            if getattr(err, "fatal", False) and not self._closed:
                self._fail(err)
            raise
        finally:
            self._within.deadline = None


class RelayedHeartbeats(StoreHeartbeats):
    """A relayed rank's liveness: it beats in the node's shared memory, and its relay watches
    it (its process, its beats), beats upstream for it and reports its loss (see
    :mod:`dataparallel.control.relay.node`); no rank watches another's heartbeat key. Each
    tick the rank reads its run's loss report from its relay, which reads it upstream once a
    tick for its node, and the guard fails the channel when the relay, or the store behind
    it, has answered none of those reads for the liveness timeout. Closing, it marks its
    departure as every rank does."""

    #: Not here: the beat stays in the node's shared memory, where a write carried upstream
    #: in its tick would hold it up behind the store (and the relay would give the rank up);
    #: what the rank publishes goes on its own thread.
    carries_writes = False

    def __init__(self, channel: RelayedChannel, interval: float, timeout: float) -> None:
        super().__init__(channel, interval, timeout)
        self._relayed = channel
        self._local = channel._local

    def _beat(self) -> None:
        self._local.beat()

    def _record(self, peer: LostPeer) -> bool:
        news = super()._record(peer)
        if news:  # a barrier waiting in shared memory raises PeerLost now, not a slice later
            self._local.interrupt()
        return news

    def _watched(self) -> list[int]:
        return []  # the relays watch

    def _fetch_report(self) -> bytes | None:
        # The relay reads the run's report upstream once a tick for all its ranks and answers
        # from that read, with its age: the store was last heard from then (the guard fails
        # the channel once that is the liveness timeout ago).
        report, age = unpack(self._relayed._call(LOSS, b""))
        self._answered()
        (seconds,) = struct.unpack("<d", age)
        self._last_ok -= seconds  # when the store itself last answered
        if seconds > 2 * self._interval:  # what the guard says, should the silence last
            self._last_error = ChannelClosed(f"the node relay has had no answer from the store for {seconds:.1f}s")
        return report or None
