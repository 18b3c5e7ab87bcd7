"""The node relay: one process per node speaks for its ranks to the job's channel.

The relay holds ``upstream``, a channel of any transport (a user's own included) on which
it is one member: rank ``node_rank`` of ``nodes`` (under a job of the caller's choosing, say
``JOB~nodes``). The ranks' keys go under a prefix of their own in that channel's key space
(:data:`RANKS`), so that their claims, runs and heartbeats never meet the relays'. Its
node's ranks reach
it through the local leg (:mod:`.local`) with a :class:`~dataparallel.transports.relay.RelayedChannel`
each, and through it:

- **key/value operations pass through**: each rank's hook call (``_set``, ``_get``, ``_add``,
  ...) becomes the same hook call on ``upstream``, made while the rank waits and answered with
  the upstream's answer or error: nothing is acknowledged locally, so what a rank reads and
  writes is exactly what a directly connected rank would (linearizable, applied once, as the
  upstream transport guarantees its own calls);
- **a barrier crosses the network once per node**: the node's ranks meet in the local leg
  (no request each), the relay enters the same barrier once on ``upstream`` among the
  ``nodes`` relays, and releases its ranks with the outcome, error included; a job of one
  node does not cross at all (its ranks meeting is the barrier);
- **an all_gather crosses the network once per node**: each rank hands its value to the
  relay (:data:`ALL_GATHER`), and once every rank of the node has, the relay enters the
  same all_gather once on ``upstream`` with the node's values (the first rank and the values,
  framed) and hands each rank every rank's values, error included; a job of one node does
  not cross at all. A rank that closed without entering, or was lost, ends its peers' waits
  as on a direct channel (the ranks' own departure records and liveness, read between the
  slices of their waits).

- **liveness by supervision**: a rank beats in shared memory, not upstream; the relay sees
  its ranks' processes end (at once) and their beats stop (a frozen rank, after the rank's
  liveness timeout), and reports such a rank lost where its run's ranks read losses; once a
  tick it writes the heartbeat keys of its live ranks upstream in one request (what the
  core's membership reads to tell a live holder of a rank from a gone one), each rank's
  only when the rank beat in shared memory since (a frozen rank's key stands still upstream
  as a frozen direct rank's does); and a node whose
  relay is lost upstream (the relays' own liveness) is reported lost by the others, as its
  first rank, naming the node's ranks. A rank it declares lost is cut off first: every later
  call of its channel is refused (ChannelClosed, "declared lost"; the same process joining
  again is a new member, as it is a new session upstream), and its loss is published
  once none of its writes is in flight, so no write of a lost rank lands after the others
  were told (a frozen rank that resumes fails on its next call or liveness tick).

  The relay also reads the run's loss report once a tick for all its ranks and answers each
  rank's read from it, with its age (the rank judges its store by when it last answered).

- **concurrent writes share a request**: the ``_set``, ``_add``, ``_compare_set`` and watch
  calls that arrive while the relay's last request of their kind is in flight wait for it
  and go upstream together in the next one (``_multi_set``; one ``_add`` of their sum per
  key, each answered with its own running total; ``_compare_set_many``, identical
  compare_sets, as every rank's token check, as one). Each call is still answered with its
  own outcome only once that request was answered, and the request is sent after every call
  it carries arrived, so each call takes effect within its own interval (linearizable, as
  one by one). A lone call goes at once, as before; the busier the upstream, the larger the
  batches. Joining is such calls (the run pointer, the token check, the rank's claim, its
  heartbeat and its process record), so a node's ranks joining together cost a few
  requests, not a few per rank.

- **reads of one key share a request**: ranks reading a key (or the same keys in one
  ``_multi_get``) while the relay's read of it is in flight (a key waited for: the NCCL
  unique id, a peer's address, a gather's values) are answered by its next read of it, one
  for all of them, made after every one of them arrived and within the shortest of their
  waits (a rank whose own wait lasts longer is read for again). So a node's broadcast (the
  core's, on keys) costs a few requests per node, not per rank.

Not yet aggregated (each rank's requests pass through one by one, so they are correct but
cost what a directly connected rank's cost): the other reads (``_check``, ``_num_keys``),
deletes (a gather's clean-up of a round is one ``_delete_many``) and appends. A gather to
one rank stays the core's, on keys: its other ranks return once their value is written
upstream, which a relay holding it for its node would only pretend.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from ...errors import BadMessage, ChannelClosed, ConfigError, ControlError, ControlTimeout, PeerLost
from ..liveness import ReadUnanswered, loss_report
from .local import ERROR, OK, Call, Geometry, LocalServer, error_bytes, fatal

if TYPE_CHECKING:
    from ..channel import ControlChannel

log = logging.getLogger(__name__)

K = TypeVar("K")  # what a shared read reads: a key, or a tuple of keys
V = TypeVar("V")  # what it finds

#: Where the ranks' keys live in the relays' channel.
RANKS = "ranks/"


def nodes_job(job: str) -> str:
    """The job a job's node relays join upstream as its nodes (the ranks' keys live there,
    under :data:`RANKS`)."""
    return f"{job}~nodes"


def observe_ranks(channel: ControlChannel) -> bool:
    """Point ``channel``, an observer's of :func:`nodes_job` (``dp.observe``'s, attached to
    the relays' run), at the current run of the ranks its relays serve, which it then follows
    on each look: False where the relays serve no run of ranks."""
    channel._ranks_under = RANKS
    return channel._attach_core_run(RANKS)


#: The pass-through operations' numbers on the local leg.
SET, GET, ADD, COMPARE_SET, DELETE, CHECK, NUM_KEYS, MULTI_GET, MULTI_SET, APPEND = range(1, 11)
#: A rank's registration of where its loss is reported (its run's loss key), its heartbeat
#: key, its process record's key, its liveness (interval and timeout) and that record; and
#: its withdrawal when it closes (a clean departure is no loss).
WATCH, UNWATCH = 11, 12
#: A watched rank's read of its run's loss report, answered from the relay's read of it
#: (once a tick for the node) with that read's age: the rank judges its store by it.
LOSS = 13
#: Deletes of several keys in one request (``_delete_many``).
DELETE_MANY = 14
#: How many ranks of the job had arrived at a rank's barrier (generation, name): for the
#: message of a barrier that timed out, as a direct channel's says.
PROGRESS = 15
#: A rank's part of an all_gather (round, timeout, the wait, name, its value, the first value
#: it wants back), answered with every rank's values from that one on (as many as its slot
#: holds) once the node's one upstream all_gather is back, or after the wait with which of
#: the node's ranks have given none yet (:meth:`NodeRelay._all_gather`).
ALL_GATHER = 16

#: The operations only a seated rank makes (a guest, holding no rank, makes none of them).
SEATED = frozenset({WATCH, UNWATCH, LOSS, PROGRESS, ALL_GATHER})

#: The operations that write: a rank declared lost has none of them in flight when its loss
#: is published (see :meth:`NodeRelay._lose`).
WRITES = frozenset({SET, ADD, COMPARE_SET, DELETE, DELETE_MANY, MULTI_SET, APPEND, WATCH})

#: The upstream channel's properties its ranks' channels take on (told in the hello): its
#: fencing of a lost member (a whole node lost is fenced only where the upstream fences the
#: relay's session; a rank the relay declares lost it fences itself), its re-sent calls on a
#: lost connection, the stall its store may take.
UPSTREAM_FLAGS = ("fences_lost_members", "survives_connection_loss", "store_stall")

#: Where each relay says, in the relays' own key space, which ranks are its node's.
NODE_RANKS = "node-ranks/"
#: Where each relay says how many of its ranks are in the barrier under way (``ROUND COUNT
#: NAME``), once that barrier has lasted a supervision tick: what a timed-out barrier's
#: message counts for the other nodes. One key a node, overwritten: a barrier shorter than a
#: tick (nearly all) writes nothing.
ARRIVALS = "arrivals/"
#: Seconds a relay's parked read of its ranks' loss report waits upstream at a time, and
#: the longest its process's exit waits for one still parked (see :func:`_settle_at_exit`).
LOSS_WAIT = 2.0

#: The relays of this process (their threads that park reads upstream).
_relays: weakref.WeakSet[NodeRelay] = weakref.WeakSet()


@atexit.register
def _settle_at_exit() -> None:
    """As the process exits, every relay's parked read is let end (within :data:`LOSS_WAIT`)
    and waited for: a daemon thread that comes back out of a store's native call while the
    interpreter finalizes aborts the process ("terminate called without an active
    exception", as torch's TCPStore client does)."""
    relays = list(_relays)
    for relay in relays:
        relay._stopping.set()
        relay._watches_changed.set()
        relay._retick.set()
    deadline = time.monotonic() + LOSS_WAIT + 1.0
    for relay in relays:
        relay._loss_thread.join(max(deadline - time.monotonic(), 0.0))


#: Seconds a barrier's message may spend reading the other nodes' arrivals.
PROGRESS_WITHIN = 0.25
#: Generations handed on whose name and round the relay keeps (a rank's count asked for
#: after its barrier was crossed).
ROUNDS_KEPT = 16


@dataclass(frozen=True)
class Watched:
    """A joined local rank the relay speaks for: where its run reads losses, its heartbeat
    key (both in the upstream's key space), and its liveness; and, written with its first
    beat, its process record (key and value)."""

    loss_key: str
    heartbeat_key: str
    interval: float
    timeout: float
    peer: tuple[str, bytes]


def pack(*fields: bytes) -> bytes:
    """Fields as ``count, (length, bytes)...`` (little-endian u32s): the pass-through's framing."""
    out = [struct.pack("<I", len(fields))]
    for field in fields:
        out.append(struct.pack("<I", len(field)))
        out.append(field)
    return b"".join(out)


def unpack(data: bytes) -> list[bytes]:
    """The fields :func:`pack` framed; BadMessage for anything else."""
    try:
        (count,) = struct.unpack_from("<I", data)
        at, fields = 4, []
        for _ in range(count):
            (length,) = struct.unpack_from("<I", data, at)
            at += 4
            if at + length > len(data):
                raise BadMessage("relay: a field runs past its frame")
            fields.append(data[at : at + length])
            at += length
    except struct.error as err:
        raise BadMessage(f"relay: a malformed frame ({err})") from None
    if at != len(data):
        raise BadMessage("relay: bytes after a frame's fields")
    return fields


def _text(field: bytes) -> str:
    """A rank's key, under the ranks' prefix."""
    return RANKS + field.decode("utf-8", errors="surrogatepass")


def _float(field: bytes) -> float:
    return struct.unpack("<d", field)[0]


def _int(field: bytes) -> int:
    return struct.unpack("<q", field)[0]


#: Seconds a relayed read's upstream wait ends before the rank's (at most a quarter of it):
#: the answer crosses back within the rank's bound, as a coordinator's does (remote.server_wait);
#: the rank reads again while its own wait lasts, so ending early loses nothing. (A tenth left
#: a loaded machine's upstream reply and hop 0.3 s for a half-second read: too little.)
READ_GRACE = 0.25


def arrived_hint(total: int, world_size: int, complete: bool) -> str:
    """A relayed barrier's count for its timeout's message, as a direct channel's gives it;
    ``complete``: every node's count was read in time (else it is at least that many)."""
    shown = f"{min(total, world_size)}/{world_size} ranks had arrived"
    return shown if complete else f"{shown} at least (not every node's count was read in time)"


def upstream_wait(timeout: float) -> float:
    """How long the relay's upstream read waits for a rank's read of ``timeout`` seconds."""
    return max(timeout - min(READ_GRACE, timeout / 4), 1e-3)


def upstream_timeout(timeout: float) -> float:
    """The timeout a node relay's upstream channel is joined with, for a job whose ranks'
    is ``timeout``: its calls end as its relayed reads do (:func:`upstream_wait`), a little
    before the ranks' own, so that its answer (the upstream's error, where the store is gone
    or frozen) reaches a rank within the rank's bound rather than its silence at the end of it."""
    return upstream_wait(timeout)


def unanswered_as_such(
    upstream: ControlChannel, read: Callable[[K, float], V | None]
) -> Callable[[K, float], V | None]:
    """``read``, an upstream waiting read, with a ChannelClosed the upstream gives for a read
    its store left unanswered within its bound (the upstream itself not failed, the read
    waited: a store frozen or slow for a moment) raised as :class:`ReadUnanswered`, which the rank's wait
    reads again while its time lasts. A transport may give either (the hooks' contract);
    zmq's and grpc's give ChannelClosed. The rank's wait is in slices (its liveness is the
    relay's), so, passed on as such, a store that paused for a slice would end a rank's get
    or broadcast at once, where a direct rank's single wait rides the pause out."""

    def waiting(key: K, wait: float) -> V | None:
        start = time.monotonic()
        try:
            return read(key, wait)
        except ReadUnanswered:
            raise
        except ChannelClosed as err:
            # Only a read that waited (most of) its time: one refused at once is no silence.
            if upstream.failure is not None or upstream._closed or time.monotonic() - start < 0.75 * wait:
                raise
            raise ReadUnanswered(f"the store left the node relay's read unanswered ({err})") from None

    return waiting


class Batched:
    """Items of one kind served ``serve(batch)`` by batch: an item that arrives while a batch
    is being served waits for the next, which holds every item that arrived meanwhile; an
    item arriving when none is being served starts one at once (on ``pool``). ``serve``
    answers every item of its batch."""

    def __init__(self, pool: ThreadPoolExecutor, serve: Callable[[list], None]) -> None:
        self._pool, self._serve = pool, serve
        self._lock = threading.Lock()
        self._waiting: list = []
        self._serving = 0  # items in the batch being served
        self._busy = False

    @property
    def pending(self) -> int:
        """Items being served or waiting for the next batch."""
        with self._lock:
            return self._serving + len(self._waiting)

    def submit(self, item: object) -> None:
        with self._lock:
            self._waiting.append(item)
            if self._busy:
                return
            self._busy = True
        self._pool.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                batch, self._waiting = self._waiting, []
                self._serving = len(batch)
                if not batch:
                    self._busy = False
                    return
            try:
                self._serve(batch)
            except Exception:  # a bug (serve answers its batch's errors): the next batch goes on
                log.exception("relay: serving a batch of %d failed", len(batch))


class SharedReads(Generic[K, V]):
    """Reads of one key (or one list of keys), each ``(call, deadline)``: the first goes
    upstream at once; those that arrive while a read of the key is in flight wait for the
    next one, which serves them all, waiting in the store up to the earliest of their
    deadlines (see the module docstring). A read whose deadline comes before the one in
    flight ends goes on its own (it would otherwise outwait its own timeout).
    ``read(key, wait)``: what was found, or None once ``wait`` passed; ``answer(found)``:
    the reply to each call (``pack()`` when nothing was found)."""

    def __init__(
        self, pool: ThreadPoolExecutor, read: Callable[[K, float], V | None], answer: Callable[[V], bytes]
    ) -> None:
        self._pool, self._read, self._answer = pool, read, answer
        self._lock = threading.Lock()
        # A key being read -> when that read ends at the latest, and the next read's calls.
        self._reading: dict[K, tuple[float, list[tuple[Call, float]]]] = {}
        self._serving: dict[K, int] = {}  # a key being read -> the calls of that read

    def pending(self, key: K) -> int:
        """Reads of ``key`` being served together or waiting for its next read."""
        with self._lock:
            return self._serving.get(key, 0) + len(self._reading.get(key, (0.0, []))[1])

    def submit(self, call: Call, key: K, deadline: float) -> None:
        with self._lock:
            reading = self._reading.get(key)
            if reading is None:
                self._reading[key] = (deadline, [(call, deadline)])
            elif deadline >= reading[0]:
                reading[1].append((call, deadline))
                return
        if reading is None:
            self._pool.submit(self._drain, key)
        else:
            self._pool.submit(self._alone, key, call, deadline)

    def _alone(self, key: K, call: Call, deadline: float) -> None:
        again = [(call, deadline)]
        while again:
            again = self._serve(key, again)

    def _drain(self, key: K) -> None:
        while True:
            with self._lock:
                batch = self._reading[key][1]
                self._serving[key] = len(batch)
                if not batch:
                    del self._reading[key], self._serving[key]
                    return
                self._reading[key] = (min(deadline for _, deadline in batch), [])
            try:
                again = self._serve(key, batch)
            except Exception as err:  # a bug: every call told, and the key's reads go on
                _fail_all([call for call, _ in batch], f"a read of {key!r}", err)
                again = []
            with self._lock:
                self._reading[key][1][:0] = again

    def _serve(self, key: K, batch: list[tuple[Call, float]]) -> list[tuple[Call, float]]:
        """One read for ``batch``: its calls answered, but those whose own wait goes on after
        the read found nothing (returned)."""
        calls = [call for call, _ in batch]
        wait = max(min(deadline for _, deadline in batch) - time.monotonic(), 1e-3)
        try:
            value = self._read(key, wait)
        except Exception as err:
            _fail_all(calls, f"a read of {key!r}", err)
            return []
        if value is not None:
            reply = self._answer(value)
            for call in calls:
                call.reply(reply)
            return []
        now, again = time.monotonic(), []
        for call, deadline in batch:
            if deadline - now > 1e-3:
                again.append((call, deadline))
            else:
                call.reply(pack())
        return again


def _fail_all(calls: list[Call], what: str, err: Exception) -> None:
    """Fail ``calls`` with ``err``: a ControlError (or a ValueError: ``_add`` on a value that
    is no number) as itself; anything else is a transport's bug: logged, each call told, and
    the relay goes on."""
    if not isinstance(err, (ControlError, ValueError)):
        log.error("relay: %s failed", what, exc_info=err)
        err = ControlError(f"relay: {type(err).__name__}: {err}")
    for call in calls:
        call.fail(err)


def _refused(err: Exception) -> bool:
    """Whether ``err`` refuses a request whole (a bound, a malformed value): nothing of it
    was applied. Not a timeout or a lost connection, after which it may have been."""
    if isinstance(err, (BadMessage, ValueError)):
        return True
    return type(err) is ControlError


def _answer_batch(
    calls: list[Call], what: str, together: Callable[[], list[bytes]], alone: Callable[[int], bytes]
) -> None:
    """Answer ``calls`` from ``together()``, their one request; if that request was refused
    whole (:func:`_refused`: a bound that the batch passed, or one call's bad value), each
    call goes on its own (``alone(i)``), so that each gets the answer it would have got
    alone."""
    try:
        replies = together()
    except Exception as err:
        if len(calls) > 1 and _refused(err):
            for i, call in enumerate(calls):
                _answer_all([call], what, functools.partial(lambda i: [alone(i)], i))
            return
        _fail_all(calls, what, err)
    else:
        for call, reply in zip(calls, replies, strict=True):
            call.reply(reply)


def _answer_all(calls: list[Call], what: str, work: Callable[[], list[bytes]]) -> None:
    """Answer ``calls`` with what ``work()`` returns, one reply each, or every one with its
    error (:func:`_fail_all`)."""
    try:
        replies = work()
    except Exception as err:
        _fail_all(calls, what, err)
    else:
        for call, reply in zip(calls, replies, strict=True):
            call.reply(reply)


def _answered(call: Call, serve: Callable[[Call], None]) -> None:
    """``serve(call)`` on a pool's thread; a bug in it fails the call rather than leave its
    rank waiting out its timeout (a pool's task's exception is otherwise kept unseen)."""
    try:
        serve(call)
    except Exception as err:
        log.exception("relay: serving operation %d failed", call.op)
        if not call._done:
            call.fail(ControlError(f"the node relay failed: {type(err).__name__}: {err}"))


def _serve_op(up: ControlChannel, op: int, f: list[bytes]) -> bytes:
    """One pass-through operation on ``up``'s hooks, its answer framed (sets,
    adds, compare_sets, gets and multi_gets are served in batches: :class:`NodeRelay`)."""
    if op == DELETE:
        return b"\x01" if up._delete(_text(f[0])) else b"\x00"
    if op == DELETE_MANY:
        return struct.pack("<q", up._delete_many([_text(k) for k in f]))
    if op == CHECK:
        return b"\x01" if up._check([_text(k) for k in f]) else b"\x00"
    if op == NUM_KEYS:
        return struct.pack("<q", up._num_keys())
    if op == MULTI_SET:
        up._multi_set([(_text(f[i]), f[i + 1]) for i in range(0, len(f), 2)])
        return b""
    if op == APPEND:
        up._append(_text(f[0]), f[1])
        return b""
    raise BadMessage(f"relay: no operation {op}")


class _Gather:
    """One round of an all_gather on this node: the values its ranks gave (local rank ->
    value), the longest of their timeouts, and once the round is over its outcome (every
    rank's values, or the error) and when it ended."""

    __slots__ = ("created", "done", "ended", "error", "everyone", "started", "timeout", "values")

    def __init__(self) -> None:
        self.values: dict[int, bytes] = {}
        self.timeout = 0.0
        self.created = time.monotonic()
        self.started = False
        self.done = threading.Event()
        self.everyone: list[bytes] = []  # the outcome: every rank's value, by rank
        self.error: bytes | None = None  # or its error
        self.ended: float | None = None


#: Seconds an all_gather round is kept once it ended: a rank whose reply was lost on the way
#: (it waited past its bound) asks again, and is given the same outcome (never a round
#: started again: the upstream's rounds of a name are counted).
GATHER_ENDED_KEPT = 30.0
#: Seconds past its timeout a round that never started upstream (a rank of the node never
#: entered it) is kept before it is dropped.
GATHER_KEPT = 60.0


class NodeRelay:
    """Serves ``local_ranks`` ranks of node ``node_rank`` (ranks ``first_rank`` on, by default
    ``node_rank * local_ranks``, of ``world_size``, by default ``nodes * local_ranks``: nodes
    of different sizes give both) through the local leg in ``directory``, speaking for them on
    ``upstream``, a channel joined as rank ``node_rank`` of ``nodes`` (see the module
    docstring), best with the timeout :func:`upstream_timeout` gives for the ranks' own (as
    the launchers' relays and the test farm's are). ``on_gone(rank, how)``: told when a
    local rank's process ends or closes (its job rank)."""

    def __init__(
        self,
        upstream: ControlChannel,
        directory: str | os.PathLike[str],
        *,
        local_ranks: int,
        node_rank: int,
        nodes: int,
        job: str,
        geometry: Geometry | None = None,
        on_gone: Callable[[int, str], None] | None = None,
        first_rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.upstream = upstream
        self.local_ranks, self.node_rank, self.nodes = local_ranks, node_rank, nodes
        self.first_rank = node_rank * local_ranks if first_rank is None else first_rank
        self.world_size = nodes * local_ranks if world_size is None else world_size
        if not 0 <= self.first_rank <= self.world_size - local_ranks:
            last = self.first_rank + local_ranks - 1
            raise ValueError(f"ranks {self.first_rank}..{last} do not fit a world of {self.world_size}")
        self._on_gone = on_gone
        self.job = job
        self._by = f"node {node_rank}'s relay"
        # A rank declared lost, (local rank, member) -> the error its calls get from then on
        # and its loss report (what its own loss reads answer); and each member's writes in
        # flight. A member is one joined connection (Call.incarnation): the rank's process
        # joining again (its new channel, a rerun of its job) is another.
        self._fenced: dict[tuple[int | None, int], tuple[ChannelClosed, bytes]] = {}
        self._writing: dict[tuple[int | None, int], int] = {}
        self._written = threading.Condition()
        geometry = geometry or Geometry()
        # A thread for every call that can be in flight (each slot of each rank may wait in a
        # get); the node's barriers cross one at a time, in order, on a thread of their own.
        # Threads are made as calls need them; two processes' worth more for guests (an agent's
        # channel, an observer), whose waiting reads must not take the ranks' threads.
        self._pool = ThreadPoolExecutor(max_workers=(local_ranks + 2) * geometry.slots, thread_name_prefix="dp-relay")
        self._crossing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-relay-barrier")
        self._last_crossing: Future[None] | None = None  # the latest crossing handed to it
        # Loss reports on a thread of their own: never queued behind the ranks' waiting reads.
        self._reporting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-relay-loss")
        # All_gather rounds, (the ranks' run, name, round) -> _Gather, and their upstream
        # calls (rounds of several names may wait upstream at once, started in any order).
        self._gathers: dict[tuple[str | None, str, int], _Gather] = {}
        self._gathers_lock = threading.Lock()
        self._gather_threads = (local_ranks + 2) * geometry.slots  # as many as its calls in flight
        self._gathering = ThreadPoolExecutor(max_workers=self._gather_threads, thread_name_prefix="dp-relay-gather")
        # Local rank -> what the relay watches and beats for it (under _watch_lock); a beat
        # being written upstream holds _beating, which a rank's withdrawal waits for (so that
        # no beat of the relay's lands after the rank's own departure mark).
        self._watched: dict[int, Watched] = {}
        self._carried: dict[int, float] = {}  # local rank -> its beat in shared memory last carried upstream
        self._watch_lock = threading.Lock()
        self._beating = threading.Lock()
        self._ticks = 0
        self._nodes_lost: set[int] = set()
        self._ranks_of: dict[int, tuple[int, int]] = {}  # node -> (first rank, count), as read
        # Barriers: each name's rounds handed on so far, the name and round of the last
        # generations handed on, those being crossed, and the arrivals this node last
        # published (name, round, count written).
        self._rounds: dict[str, int] = {}
        # The ranks' run their barriers belong to (its loss key, which names the run; set by
        # their watches) and its tag in the barriers' names upstream: the relays' own run
        # outlives the ranks' runs (a crashed run left barriers half-crossed upstream), and a
        # new run's barriers meet none of them. Crossings of a run given up: their executors.
        self._run: str | None = None
        self._run_tag = ""
        self._runs_left: set[str] = set()
        self._given_up: list[tuple[ThreadPoolExecutor, Future[None]]] = []
        self._round_of: dict[int, tuple[str, int]] = {}
        self._crossing_now: set[int] = set()
        self._marked: tuple[str, int, int | None] | None = None
        # Loss key -> (its report, b"" for none, and when it was read): the node's one read.
        self._reports: dict[str, tuple[bytes, float]] = {}
        self._started = time.monotonic()
        # When supervision last looked, and since when it has looked without a gap: a rank's
        # silence counts from then at most (the relay's own stall is nobody's silence).
        self._looked = self._resumed = self._started
        self._slept = 1.0  # the judge's current period (a second while no rank is watched)
        self._stopping = threading.Event()
        self._watches_changed = threading.Event()
        self._retick = threading.Event()  # a rank's watch: the ticks take its interval at once
        # The ranks' concurrent writes and watches, a request per batch (module docstring).
        self._sets = Batched(self._pool, self._serve_sets)
        self._compare_sets = Batched(self._pool, self._serve_compare_sets)
        self._adds = Batched(self._pool, self._serve_adds)
        self._watches = Batched(self._pool, self._serve_watches)
        self._reads: SharedReads[str, bytes] = SharedReads(
            self._pool, unanswered_as_such(upstream, upstream._get), pack
        )
        self._multi_reads: SharedReads[tuple[str, ...], list[bytes]] = SharedReads(
            self._pool,
            unanswered_as_such(upstream, lambda keys, wait: upstream._multi_get(list(keys), wait)),
            lambda values: pack(b"", *values),
        )
        info = {
            "job": job,
            "world_size": self.world_size,
            "node_rank": node_rank,
            "nodes": nodes,
            # What the ranks' calls get from the upstream, which they pass through.
            **{flag: getattr(upstream, flag) for flag in UPSTREAM_FLAGS},
        }
        self.server = LocalServer(
            directory,
            local_ranks,
            self._handle,
            self._gone,
            geometry,
            self._barrier,
            first_rank=self.first_rank,
            info=info,
            may_replace=lambda local, incarnation: (local, incarnation) in self._fenced,
        )
        self.path = self.server.path
        # Which ranks are this node's, for the other relays to name them should it be lost.
        upstream._set(f"{NODE_RANKS}{node_rank}", f"{self.first_rank},{local_ranks}".encode())
        self._beat_thread = threading.Thread(target=self._supervise, name="dp-relay-beat", daemon=True)
        self._beat_thread.start()
        # The ranks' silence is judged apart from the upstream's work (a slow store delays
        # no frozen rank's report, nor passes for the relay's own stall).
        self._judge_thread = threading.Thread(target=self._judging, name="dp-relay-judge", daemon=True)
        self._judge_thread.start()
        # A loss another node publishes, told to this node's ranks the moment it is (a read
        # parked upstream), not at the next tick's read.
        self._loss_thread = threading.Thread(target=self._awaiting_losses, name="dp-relay-losses", daemon=True)
        _relays.add(self)
        self._loss_thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._watches_changed.set()
        self._retick.set()
        self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._crossing.shutdown(wait=False, cancel_futures=True)
        for given_up, _ in self._given_up:
            given_up.shutdown(wait=False, cancel_futures=True)
        self._reporting.shutdown(wait=False, cancel_futures=True)
        self._gathering.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> NodeRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ serving
    def _handle(self, call: Call) -> None:
        fenced = self._fenced.get((call.rank, call.incarnation))
        if fenced is not None:  # declared lost: cut off, as a coordinator drops a lost rank's session
            if call.op == LOSS:
                call.reply(pack(fenced[1], struct.pack("<d", 0.0)))  # its own loss: it fails on reading it
            else:
                call.fail(fenced[0])
            return
        if call.rank is None and call.op in SEATED:
            call.fail(ConfigError(f"operation {call.op} is a rank's: this process holds no seat at {self._by}"))
            return
        broken = self.upstream.failure
        if broken is not None:  # the node's channel ended (its coordinator gone, the node lost): so do its ranks'
            call.fail(self._upstream_ended(broken))
            return
        if call.op in WRITES:
            self._count_write(call)
        if call.op in (WATCH, SET, COMPARE_SET, GET, MULTI_GET, ADD):
            try:
                fields = unpack(call.payload)
                if call.op == MULTI_GET:
                    deadline = time.monotonic() + upstream_wait(_float(fields[0]))
                    self._multi_reads.submit(call, tuple(_text(k) for k in fields[1:]), deadline)
                elif call.op == ADD:
                    key, amount = fields
                    self._adds.submit((call, _text(key), _int(amount)))
                elif call.op == GET:
                    key, timeout = fields
                    self._reads.submit(call, _text(key), time.monotonic() + upstream_wait(_float(timeout)))
                elif call.op == WATCH:
                    loss, beat, peer, liveness, record = fields
                    interval, timeout = struct.unpack("<dd", liveness)
                    watched = Watched(_text(loss), _text(beat), interval, timeout, (_text(peer), record))
                    self._enter_run(watched.loss_key)
                    self._watches.submit((call, watched))
                elif call.op == SET:
                    key, value = fields
                    self._sets.submit((call, _text(key), value))
                else:
                    key, expected, desired = fields
                    self._compare_sets.submit((call, (_text(key), expected, desired)))
            except (BadMessage, ValueError, struct.error) as err:  # ValueError: too few or many fields
                call.fail(BadMessage(f"relay: a bad request ({err})"))
            return
        if call.op == UNWATCH:
            self._pool.submit(_answered, call, self._unwatch)
            return
        if call.op == LOSS:
            self._answer_loss(call)
            return
        if call.op == PROGRESS:
            self._pool.submit(_answered, call, self._progress)
            return
        if call.op == ALL_GATHER:
            self._all_gather(call)
            return
        self._pool.submit(_answered, call, self._serve)

    def _serve_watches(self, batch: list[tuple[Call, Watched]]) -> None:
        """Ranks joined: beat for them at once (a process claiming one of their ranks
        meanwhile sees it alive), with their process records, in one request, then on every
        tick; their run's loss report read once, unless a rank of the same run read it
        already."""
        calls = [call for call, _ in batch]

        def watch() -> list[bytes]:
            with self._beating:
                value = self._beat_value()
                self.upstream._multi_set([item for _, w in batch for item in ((w.heartbeat_key, value), w.peer)])
                for key in {w.loss_key for _, w in batch}:
                    if key not in self._reports:
                        self._read_report(key)
                with self._watch_lock:
                    for call, watched in batch:
                        self._watched[call.seat] = watched
            self._watches_changed.set()
            self._retick.set()
            return [b""] * len(batch)

        _answer_all(calls, "watching joined ranks", watch)
        # A rank whose process ended while its watch was being served found nothing to
        # report then (_gone): it is reported now.
        alive = self.server.members()
        for call, _ in batch:
            if call.seat not in alive:
                with self._watch_lock:
                    watched = self._watched.pop(call.seat, None)
                if watched is not None:  # not reported by _gone, which came first
                    how = f"its process ended while it joined (pid {self.server.pid_of(call.seat)} on this node)"
                    self._lose(call.seat, watched.loss_key, how)

    def _serve_sets(self, batch: list[tuple[Call, str, bytes]]) -> None:
        """One ``_set``, or for several one ``_multi_set`` (a key set twice: the later value,
        as the two sets one after the other would leave it)."""
        calls = [call for call, _, _ in batch]
        items = list({key: value for _, key, value in batch}.items())

        def write() -> list[bytes]:
            if len(items) == 1:
                self.upstream._set(*items[0])
            else:
                self.upstream._multi_set(items)
            return [b""] * len(batch)

        def alone(i: int) -> bytes:
            self.upstream._set(batch[i][1], batch[i][2])
            return b""

        _answer_batch(calls, f"{len(batch)} set(s)", write, alone)

    def _serve_adds(self, batch: list[tuple[Call, str, int]]) -> None:
        """One ``_add`` per key of the batch, of its adds' sum, each add answered with the
        total it would have left applied one after the other in arrival order (the sum's
        result less the amounts after it). Adds of both signs to one key go one by one:
        their running totals need not stay between the first and the last, so one of them
        could pass the int64 range where their sum does not; a sum refused (past that
        range) is sent again as its adds one by one (:func:`_answer_batch`)."""
        by_key: dict[str, list[tuple[Call, int]]] = {}
        for call, key, amount in batch:
            by_key.setdefault(key, []).append((call, amount))
        for key, adds in by_key.items():
            mixed = min(a for _, a in adds) < 0 < max(a for _, a in adds)
            for group in [[add] for add in adds] if mixed else [adds]:
                what = f"{len(group)} add(s) to {key!r}"
                together = functools.partial(self._add_together, key, group)
                _answer_batch(
                    [call for call, _ in group], what, together, functools.partial(self._add_alone, key, group)
                )

    def _add_alone(self, key: str, adds: list[tuple[Call, int]], i: int) -> bytes:
        return struct.pack("<q", self.upstream._add(key, adds[i][1]))

    def _add_together(self, key: str, adds: list[tuple[Call, int]]) -> list[bytes]:
        total = sum(amount for _, amount in adds)
        running, out = self.upstream._add(key, total) - total, []
        for _, amount in adds:
            running += amount
            out.append(struct.pack("<q", running))
        return out

    def _serve_compare_sets(self, batch: list[tuple[Call, tuple[str, bytes, bytes]]]) -> None:
        """One ``_compare_set``, or for several one ``_compare_set_many`` in arrival order;
        identical ones go once and share the answer (the second, right after the first, would
        return what the first did)."""
        calls = [call for call, _ in batch]
        distinct = list(dict.fromkeys(item for _, item in batch))

        def swap() -> list[bytes]:
            if len(distinct) == 1:
                results = {distinct[0]: self.upstream._compare_set(*distinct[0])}
            else:
                results = dict(zip(distinct, self.upstream._compare_set_many(distinct), strict=True))
            return [results[item] for _, item in batch]

        def alone(i: int) -> bytes:
            return self.upstream._compare_set(*batch[i][1])

        _answer_batch(calls, f"{len(batch)} compare_set(s)", swap, alone)

    def _unwatch(self, call: Call) -> None:
        """A rank leaves cleanly: no more beats for it, none still being written (its own
        departure mark comes after this reply), and its end is no loss."""
        with self._watch_lock:
            self._watched.pop(call.seat, None)
        with self._beating:
            pass
        call.reply(b"")

    def _answer_loss(self, call: Call) -> None:
        with self._watch_lock:
            watched = self._watched.get(call.seat)
        if watched is None:
            call.fail(BadMessage("relay: a loss report read by a rank that is not watched"))
            return
        now = time.monotonic()
        report, read = self._reports.get(watched.loss_key, (b"", self._started))
        # Time the relay itself was stalled is not the store's silence (its judge may not
        # have looked since it woke: then it has just woken).
        awake = now if self._stalled(now) else self._resumed
        call.reply(pack(report, struct.pack("<d", now - max(read, awake))))

    def _beat_value(self) -> bytes:
        self._ticks += 1
        return b"%d" % self._ticks

    def _serve(self, call: Call) -> None:
        who = "a guest (no rank)" if call.rank is None else f"rank {self.first_rank + call.rank}"
        what = f"operation {call.op} of {who}"
        _answer_all([call], what, lambda: [_serve_op(self.upstream, call.op, unpack(call.payload))])

    def _barrier(self, generation: int, name: bytes | None, timeout: float) -> None:
        broken = self.upstream.failure
        if broken is not None:
            self.server.release(generation, ERROR, error_bytes(self._upstream_ended(broken)))
            return
        if name is None:
            error = BadMessage(f"the ranks of node {self.node_rank} entered different barriers")
            self.server.release(generation, ERROR, error_bytes(error))
            return
        if self.nodes == 1:  # the node is the whole job: its ranks have all met
            self.server.release(generation, OK)
            return
        own = name.decode("utf-8", errors="surrogatepass")
        text = self._upstream_name(own)
        round_ = self._rounds.get(text, 0)
        self._rounds[text] = round_ + 1
        self._round_of[generation] = (text, round_)
        self._round_of.pop(generation - ROUNDS_KEPT, None)
        self._crossing_now.add(generation)
        self._last_crossing = self._crossing.submit(
            self._cross, generation, text, own, timeout if timeout > 0 else None
        )

    def _as_told(self, err: ControlError) -> ControlError:
        """An upstream collective's error as the node's ranks are told it: where the relay's
        own channel failed meanwhile (its coordinator gone), that failure, fatal to their
        channels (:meth:`_upstream_ended`), else the error itself."""
        broken = self.upstream.failure
        if broken is None or getattr(err, "fatal", False):
            return err
        return self._upstream_ended(broken)

    def _upstream_name(self, name: str) -> str:
        """A barrier's name upstream: the ranks' name, tagged with their run."""
        return f"{name}@{self._run_tag}" if self._run_tag else name

    def _enter_run(self, loss_key: str) -> None:
        """A rank watched for the run whose losses are kept at ``loss_key``: where that is a
        new run of the ranks' job (the last one crashed, or ended, and this relay outlived
        it), the last run's barriers are over. One still crossing upstream (its node's ranks
        all arrived, another node's never will) is given up: its ranks (of a run that is over:
        gone, cut off, or told of a loss) are released with ChannelClosed, which ends their
        channels, its crossing thread left to end with its timeout or the relay's channel,
        and the new run's barriers cross on a thread of their own, under names of their own,
        counting rounds from the first. Called on the local leg's thread,
        as the barriers are handed on, so no barrier of the new run is handed before. Runs
        only move forward: a late watch for a run the relay has left (a process that joined
        the crashed run before the next one began) changes nothing here."""
        if loss_key == self._run or loss_key in self._runs_left:
            return
        before, self._run = self._run, loss_key
        self._run_tag = hashlib.blake2s(loss_key.encode(), digest_size=4).hexdigest()
        if before is None:
            return
        self._runs_left.add(before)
        stale = sorted(self._crossing_now)
        self._given_up = [(pool, last) for pool, last in self._given_up if not last.done()]
        if stale and self._last_crossing is not None:
            self._given_up.append((self._crossing, self._last_crossing))
            self._crossing.shutdown(wait=False, cancel_futures=True)
            self._crossing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-relay-barrier")
        self._rounds.clear()
        self._round_of.clear()
        self._crossing_now.clear()
        self._marked = None
        # Their ranks' channels end with it: their run is over.
        over = fatal(ChannelClosed(f"a new run of job {self.job!r} began at {self._by}: this barrier's run is over"))
        for generation in stale:
            self.server.release(generation, ERROR, error_bytes(over))
        # Its all_gathers too: their ranks are told, and the new run's go upstream on threads
        # of their own (the last run's may wait there until their timeout).
        with self._gathers_lock:
            left = [(k, g) for k, g in self._gathers.items() if k[0] == before]
            for k, _ in left:
                del self._gathers[k]
        gone = error_bytes(
            fatal(ChannelClosed(f"a new run of job {self.job!r} began at {self._by}: this all_gather's run is over"))
        )
        for _, gather in left:
            if not gather.done.is_set():
                gather.error = gone
                gather.ended = time.monotonic()
                gather.done.set()
        if any(g.started for _, g in left):
            self._gathering.shutdown(wait=False, cancel_futures=True)
            self._gathering = ThreadPoolExecutor(max_workers=self._gather_threads, thread_name_prefix="dp-relay-gather")

    def _cross(self, generation: int, name: str, shown: str, timeout: float | None) -> None:
        """Cross barrier ``generation`` upstream as ``name`` (``shown``: the ranks' own name,
        for their errors)."""
        try:
            self.upstream.barrier(name, timeout=timeout)
        except PeerLost as err:  # a node, among the relays: its ranks, to the ranks
            self.server.release(generation, ERROR, error_bytes(self._node_lost(err)))
        except ControlTimeout as err:  # counted in ranks, as the ranks' own timeout's message is
            total, complete = self._arrived(generation, name)
            timeout_ = ControlTimeout(f"barrier {shown!r}", err.waited, arrived_hint(total, self.world_size, complete))
            self.server.release(generation, ERROR, error_bytes(timeout_))
        except ControlError as err:
            self.server.release(generation, ERROR, error_bytes(self._as_told(err)))
        except Exception as err:
            log.exception("relay: barrier %r failed", name)
            self.server.release(generation, ERROR, error_bytes(ControlError(f"relay: {type(err).__name__}: {err}")))
        else:
            self.server.release(generation, OK)
        finally:
            self._crossing_now.discard(generation)

    def _arrived(self, generation: int, name: str) -> tuple[int, bool]:
        """How many ranks of the job had arrived at this node's barrier ``generation``
        (``name``, as upstream): this node's, from its ranks' areas, and the other nodes',
        from what they published (:data:`ARRIVALS`) for the same round; and whether every
        node's count was read within :data:`PROGRESS_WITHIN`."""
        total = self.server.reached(generation)
        if self.nodes == 1:
            return total, True
        handed = self._round_of.get(generation)  # None: still gathering on this node
        round_ = handed[1] if handed is not None else self._rounds.get(name, 0)
        deadline, complete = time.monotonic() + PROGRESS_WITHIN, True
        for node in range(self.nodes):
            if node == self.node_rank:
                continue
            if time.monotonic() > deadline:
                return total, False
            key = f"{ARRIVALS}{node}"
            try:
                raw = self.upstream._get(key, 0.05) if self.upstream._check([key]) else None
                if raw:
                    their_round, count, their_name = raw.split(b" ", 2)
                    if their_name.decode("utf-8", errors="surrogatepass") == name and int(their_round) == round_:
                        total += int(count)
            except (ControlError, ValueError):
                complete = False
        return total, complete

    def _progress(self, call: Call) -> None:
        def count() -> list[bytes]:
            generation_field, name = unpack(call.payload)
            text = self._upstream_name(name.decode("utf-8", errors="surrogatepass"))
            total, complete = self._arrived(_int(generation_field), text)
            return [struct.pack("<q?", total, complete)]

        _answer_all([call], "a barrier's count", count)

    # ------------------------------------------------------------------ all_gather
    def _all_gather(self, call: Call) -> None:
        """A rank's part of all_gather round ``seq`` of ``name`` (on the local leg's thread:
        never blocks): its value taken (again: a rank re-sends it until it is answered,
        and the first is kept), the node's upstream all_gather started once every rank of
        the node has given one, and the rank answered with the outcome, at once or when it
        comes within the rank's wait, else with the node's ranks that gave none yet."""
        try:
            head, wait, name, value, gives = unpack(call.payload)
            seq, timeout, start_at = struct.unpack("<qdq", head)
            (wait_s,) = struct.unpack("<d", wait)
            text = name.decode("utf-8", errors="surrogatepass")
        except (BadMessage, ValueError, struct.error) as err:
            call.fail(BadMessage(f"relay: a bad all_gather ({err})"))
            return
        local = call.seat
        now = time.monotonic()
        with self._gathers_lock:
            key = (self._run, text, seq)
            gather = self._gathers.get(key)
            if gather is None:
                self._prune_gathers(now)
                gather = self._gathers[key] = _Gather()
            if gives == b"\x01" and local not in gather.values:
                gather.values[local] = value
                gather.timeout = max(gather.timeout, timeout)
            start = not gather.started and len(gather.values) == self.local_ranks
            if start:
                gather.started = True
        if start:
            self._gathering.submit(self._gather_upstream, key, gather, text)
        if gather.done.is_set():
            self._give_outcome(call, key, gather, start_at)
            return
        self._pool.submit(_answered, call, lambda c: self._await_outcome(c, key, gather, wait_s, start_at))

    def _await_outcome(
        self, call: Call, key: tuple[str | None, str, int], gather: _Gather, wait: float, start_at: int
    ) -> None:
        if gather.done.wait(upstream_wait(wait)):
            self._give_outcome(call, key, gather, start_at)
            return
        with self._gathers_lock:
            missing = [self.first_rank + r for r in range(self.local_ranks) if r not in gather.values]
        call.reply(pack(b"\x00", *(struct.pack("<q", r) for r in missing)))

    def _give_outcome(self, call: Call, key: tuple[str | None, str, int], gather: _Gather, start_at: int) -> None:
        """Answer ``call`` with the round's outcome: its error, or the values from rank
        ``start_at`` on, as many as the rank's slot holds (at least one: a value larger than
        the slot is refused as any reply is). The round stays for :data:`GATHER_ENDED_KEPT`:
        a reply may be lost on its way, and the rank asks again."""
        end = start_at
        if gather.error is None:
            room = self.server.geometry.slot_bytes - 29  # less the reply's framing and head
            while end < len(gather.everyone) and (end == start_at or room >= 4 + len(gather.everyone[end])):
                room -= 4 + len(gather.everyone[end])
                end += 1
        if gather.error is not None:
            call._answer(ERROR, gather.error)
        else:
            head = struct.pack("<qq", start_at, len(gather.everyone))
            call.reply(pack(b"\x01", head, *gather.everyone[start_at:end]))

    def _prune_gathers(self, now: float) -> None:
        """Drop (under the lock) the rounds that ended :data:`GATHER_ENDED_KEPT` ago, and those
        that never started upstream and never will (a rank of the node never entered, past
        the longest timeout and :data:`GATHER_KEPT`); a round waiting upstream stays."""

        def stale(g: _Gather) -> bool:
            if g.ended is not None:
                return now - g.ended > GATHER_ENDED_KEPT
            return not g.started and now - g.created > g.timeout + GATHER_KEPT

        for k in [k for k, g in self._gathers.items() if stale(g)]:
            del self._gathers[k]

    def _gather_upstream(self, key: tuple[str | None, str, int], gather: _Gather, name: str) -> None:
        """The node's all_gather upstream, once its ranks have all given their values (all
        of them ranks of the job: every node's values are framed with its first rank, so
        nodes of different sizes place theirs); the outcome is told to the node's ranks."""
        try:
            broken = self.upstream.failure
            if broken is not None:
                raise self._upstream_ended(broken)
            mine = [gather.values[r] for r in range(self.local_ranks)]
            if self.nodes == 1:  # the node is the whole job
                values: list[bytes | None] = list(mine)
            else:
                framed = pack(struct.pack("<q", self.first_rank), *mine)
                parts = self.upstream.all_gather(self._upstream_name(name), framed, timeout=gather.timeout or None)
                values = [None] * self.world_size
                for part in parts:
                    first_field, *theirs = unpack(part)
                    (first,) = struct.unpack("<q", first_field)
                    if first < 0 or first + len(theirs) > self.world_size:
                        raise BadMessage(f"relay: a node's all_gather values for ranks {first}.. do not fit the job")
                    values[first : first + len(theirs)] = theirs
            everyone = [v for v in values if v is not None]
            if len(everyone) != self.world_size:
                raise BadMessage(f"relay: all_gather {name!r}: the nodes' values do not cover the job's ranks")
            if not gather.done.is_set():  # (a new run may have given it up meanwhile)
                gather.everyone = everyone
        except PeerLost as err:  # a node, among the relays: its ranks, to the ranks
            gather.error = gather.error or error_bytes(self._node_lost(err))
        except ControlTimeout as err:  # the ranks' own waits end first, with their own message
            gather.error = gather.error or error_bytes(ControlTimeout(f"all_gather {name!r}", err.waited, ""))
        except ControlError as err:
            gather.error = gather.error or error_bytes(self._as_told(err))
        except Exception as err:
            log.exception("relay: all_gather %r failed", name)
            gather.error = gather.error or error_bytes(ControlError(f"relay: {type(err).__name__}: {err}"))
        finally:
            gather.ended = gather.ended or time.monotonic()
            gather.done.set()

    def _mark_arrivals(self) -> None:
        """Publish how many of this node's ranks are in the barrier under way, once it has
        lasted a tick (and again when that count changes): see :data:`ARRIVALS`."""
        crossing = max(self._crossing_now, default=None)
        handed = None if crossing is None else self._round_of.get(crossing)  # a new run may clear it meanwhile
        if handed is not None:
            name, round_ = handed
            count = self.local_ranks
        else:
            under_way = self.server.under_way()
            if under_way is None:
                self._marked = None
                return
            _, count, raw = under_way
            name = self._upstream_name(raw.decode("utf-8", errors="surrogatepass"))
            round_ = self._rounds.get(name, 0)
        marked = self._marked
        if marked is None or marked[:2] != (name, round_):
            self._marked = (name, round_, None)  # seen once: published if it lasts till the next tick
            return
        if marked[2] != count:
            self.upstream._set(
                f"{ARRIVALS}{self.node_rank}",
                b"%d %d " % (round_, count) + name.encode("utf-8", errors="surrogatepass"),
            )
            self._marked = (name, round_, count)

    def _gone(self, local: int, how: str) -> None:
        rank = self.first_rank + local
        log.info("relay: rank %d (local %d) %s", rank, local, how)
        with self._watch_lock:
            watched = self._watched.pop(local, None)
        if watched is not None:  # it had joined its job and not closed: a loss, reported at once
            self._lose(local, watched.loss_key, f"{how} (pid {self.server.pid_of(local)} on this node)")
        if self._on_gone is not None:
            self._on_gone(rank, how)

    def _count_write(self, call: Call) -> None:
        writer = (call.rank, call.incarnation)
        with self._written:
            self._writing[writer] = self._writing.get(writer, 0) + 1

        def done() -> None:
            with self._written:
                left = self._writing[writer] - 1
                if left:
                    self._writing[writer] = left
                else:
                    del self._writing[writer]
                    self._written.notify_all()

        call.after = done

    def _lose(self, local: int, key: str, how: str) -> None:
        """Local rank ``local`` is lost (its process ended, or its beats stopped): fence it
        (every later call of its channel refused with ChannelClosed, and its own loss read
        answered with its loss, on which it fails), then publish its loss once none of its
        writes is in flight: no write of its lands after the others are told."""
        rank, incarnation = self.first_rank + local, self.server.incarnation_of(local)
        report = loss_report(rank, time.time(), how, self._by)
        writer = None
        if incarnation is not None:
            writer = (local, incarnation)
            error = fatal(
                ChannelClosed(f"rank {rank} of job {self.job!r} was declared lost: {how} (noticed by {self._by})")
            )
            self._fenced[writer] = (error, report)
        self._reporting.submit(self._publish_loss, rank, key, report, writer)

    def _upstream_ended(self, broken: ControlError) -> ControlError:
        """What every call of a rank gets once the relay's own channel has failed (its
        coordinator gone, the node declared lost): the same failure, naming the relay, marked
        fatal (the rank's channel fails on it, as a directly connected rank's fails on its
        coordinator's end). Never blocks (the local leg's thread calls it)."""
        error = type(broken).__new__(type(broken))
        Exception.__init__(error, f"{self._by}'s channel failed: {broken}")
        error.__dict__.update(broken.__dict__)
        return fatal(error)

    def _report_loss(self, rank: int, key: str, how: str) -> None:
        """Publish rank's loss (a rank of another node) where its run's ranks read losses."""
        self._publish_loss(rank, key, loss_report(rank, time.time(), how, self._by))

    def _publish_loss(self, rank: int, key: str, report: bytes, writer: tuple[int, int] | None = None) -> None:
        """Publish rank's loss where its run's ranks read losses (first report wins): every
        rank of the job raises PeerLost on its liveness's next tick, without waiting out the
        liveness timeout. ``writer``: the fenced local rank and process whose writes in
        flight are answered first (each within the upstream's timeout)."""
        if writer is not None:
            with self._written:
                self._written.wait_for(lambda: writer not in self._writing, timeout=self.upstream.timeout + 1.0)
        try:
            current = self.upstream._compare_set(key, b"", report)
        except Exception as err:  # the guard of every rank tells, within the liveness timeout
            log.warning("relay: could not report rank %d lost: %s", rank, err)
        else:
            self._reports[key] = (current, time.monotonic())  # this node's ranks: on their next tick

    # ------------------------------------------------------------------ supervision
    def _supervise(self) -> None:
        """Once a tick (the shortest heartbeat interval of the watched ranks, a second while
        none): report a node the relays' own liveness lost, read the run's loss report, and
        write the live ranks' heartbeats upstream in one request. A rank's watch starts the
        next tick at once (the first may come a second after the relay started, when it
        watched no rank; a rank whose liveness timeout is a second must not wait for it)."""
        while True:
            self._retick.wait(self._period())
            self._retick.clear()
            if self._stopping.is_set():
                return
            try:
                self._tick()
            except Exception as err:  # the upstream failing: the ranks' own reads say so
                log.debug("relay: supervision tick failed: %s", err)

    def _judging(self) -> None:
        """Once a tick: report a rank whose beats stopped for its liveness timeout (frozen)."""
        while not self._stopping.wait(self._slept):
            try:
                self._judge()
            except Exception:  # a bug: logged, and supervision goes on
                log.exception("relay: judging the ranks' heartbeats failed")

    def _period(self) -> float:
        with self._watch_lock:
            intervals = [w.interval for w in self._watched.values()]
        return min(intervals, default=1.0)

    def _stalled(self, now: float) -> bool:
        """Whether the relay's judge has not looked for longer than its ticks allow: its
        process stalled (a whole node paused, say), or it has just woken from that."""
        with self._watch_lock:
            timeouts = [w.timeout for w in self._watched.values()]
        return bool(timeouts) and now - self._looked > max(2 * self._slept, min(timeouts) / 2)

    def _judge(self) -> None:
        with self._watch_lock:
            watched = dict(self._watched)
        now = time.monotonic()
        if self._stalled(now):
            # The relay could not look for a while: its ranks are judged on time it could see
            # them beat.
            self._resumed = now
        self._looked = now
        self._slept = self._period()  # what the judge sleeps next, and _stalled allows for
        for local, w in watched.items():
            silent = self.server.silent(local)
            if silent is None or min(silent, now - self._resumed) <= w.timeout:
                continue
            with self._watch_lock:
                if self._watched.get(local) is not w:
                    continue  # gone or withdrawn meanwhile
                del self._watched[local]
            rank = self.first_rank + local
            pid = self.server.pid_of(local)
            how = f"no heartbeat for {silent:.1f}s (liveness timeout {w.timeout:g}s; pid {pid} on this node)"
            log.info("relay: rank %d (local %d): %s", rank, local, how)
            self._lose(local, w.loss_key, how)

    def _tick(self) -> None:
        if self.nodes > 1:
            try:
                self._mark_arrivals()
            except ControlError as err:
                log.debug("relay: publishing the barrier's arrivals failed: %s", err)
        with self._watch_lock:
            keys = {w.loss_key for w in self._watched.values()}
        try:
            self._report_lost_nodes(keys)
            for key in keys:
                self._read_report(key)  # a failed read ages the last one: the ranks' guard decides
        except ControlError as err:
            log.debug("relay: reading the job's losses failed: %s", err)
        with self._beating:
            # Only a rank that beat in shared memory since its last beat carried upstream:
            # its heartbeat key upstream moves as long as the rank itself does (a rerun of its
            # job judges its run by those keys, as it does a direct rank's, and must not see a
            # frozen rank alive until the relay gives it up).
            with self._watch_lock:
                watched = list(self._watched.items())
            fresh = []
            for local, w in watched:
                beat = self.server.last_beat(local)
                if beat is not None and beat != self._carried.get(local):
                    fresh.append((local, w.heartbeat_key, beat))
            if fresh:
                value = self._beat_value()
                self.upstream._multi_set([(key, value) for _, key, _ in fresh])
                for local, _, beat in fresh:
                    self._carried[local] = beat

    def _read_report(self, key: str) -> None:
        """Read the run's loss report for the node's ranks (kept once read: the first report
        of a run is its report)."""
        known = self._reports.get(key)
        if known is not None and known[0]:
            self._reports[key] = (known[0], time.monotonic())
            return
        report = self.upstream._get(key, 0.5) if self.upstream._check([key]) else None
        self._keep_report(key, report)

    def _keep_report(self, key: str, report: bytes | None) -> None:
        """What a read of the run's loss report found, now (a report once read is kept: an
        empty read finishing after another read found one does not hide it)."""
        known = self._reports.get(key)
        self._reports[key] = (report or (known[0] if known is not None else b""), time.monotonic())

    def _awaiting_losses(self) -> None:
        """While ranks are watched: a read of their run's loss report parked upstream
        (:data:`LOSS_WAIT` at a time), answered the moment some relay or rank publishes one;
        the node's ranks read it on their next tick (the tick's own read stays: it is what
        tells the ranks their store still answers)."""
        while not self._stopping.is_set():
            with self._watch_lock:
                keys = sorted({w.loss_key for w in self._watched.values()})
            pending = [key for key in keys if not self._reports.get(key, (b"", 0.0))[0]]
            if not pending:
                self._watches_changed.wait(self._period())  # a rank's watch wakes it at once
                self._watches_changed.clear()
                continue
            try:
                found = self.upstream._get(pending[0], LOSS_WAIT)
            except ControlError as err:  # the upstream failing: the ticks' reads tell the ranks
                log.debug("relay: waiting for a loss report failed: %s", err)
                self._stopping.wait(self._period())
                continue
            except Exception:  # a bug: logged, and the ticks' reads go on
                log.exception("relay: waiting for a loss report failed")
                self._stopping.wait(self._period())
                continue
            if found:
                self._keep_report(pending[0], found)

    def _report_lost_nodes(self, loss_keys: set[str]) -> None:
        """A node the relays' liveness declared lost: its ranks are gone with it, reported
        as its first rank (the first report of a run wins, as every loss's)."""
        for node, lost in self.upstream.lost_peers().items():
            if node in self._nodes_lost or not loss_keys:
                continue
            self._nodes_lost.add(node)
            ranks = self._node_lost(lost)
            if ranks is lost:
                continue  # which ranks it held is unknown (logged)
            for key in loss_keys:
                self._reporting.submit(self._report_loss, ranks.rank, key, ranks.reason)

    def _node_lost(self, lost: PeerLost) -> PeerLost:
        """``lost`` (a node, among the relays) as its ranks' loss: its first rank, the reason
        naming the node and its ranks (``lost`` itself where they cannot be read)."""
        node = lost.rank
        if node not in self._ranks_of:
            try:
                raw = self.upstream._get(f"{NODE_RANKS}{node}", 1.0)
                first, count = (int(x) for x in (raw or b"").split(b","))
            except (ControlError, ValueError) as err:
                log.warning("relay: node %d lost, but which ranks it held is unknown: %s", node, err)
                return lost
            self._ranks_of[node] = (first, count)
        first, count = self._ranks_of[node]
        reason = f"node {node}'s relay lost (ranks {first}..{first + count - 1}): {lost.reason}"
        return PeerLost(first, lost.last_seen, reason, during=lost.during)
