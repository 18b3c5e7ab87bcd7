"""The etcd channel's own collectives: barrier (and so rendezvous), broadcast, gather and
all_gather without the core's compare-and-swap counters, which ranks arriving together retry
(O(N²) transactions).

A round of a collective (``kind``, ``name``, ``seq``: the core's per-name sequence number):

- Each rank that contributes puts its own arrival key, ``__dp/arrive/ROUND/RANK`` (its value,
  or empty), in a transaction that also counts the round's arrival keys: no two ranks write
  the same key, so none retries, and the one whose put completes the count learns it from
  its own reply. That rank puts the round's release key, ``__dp/release/ROUND``.
- The others wait for the release key on one watch per channel (:class:`ReleaseWatch`) on
  the release prefix, opened once: no read or watch per round, one event per rank.
- Every write goes through the channel's exactly-once records (bound to the rank's lease, so
  a rank declared lost is fenced). A transaction whose reply was lost is found applied; the
  count it carried is then read again, and a rank that finds the round complete releases it
  too (a second put of the same release key changes nothing: it is guarded by the rank's
  own arrival key, which outlives the round's readers).

Cleanup, which never takes a key a slower rank still needs:

- barrier: a rank entering round ``seq`` has seen round ``seq-1`` released, so it deletes its
  arrival key of ``seq-1`` in its arrival transaction; the rank that releases ``seq`` deletes
  the release key of ``seq-1`` (all ranks have entered ``seq``: all have left ``seq-1``).
- all_gather: the values are read after the release, so a rank deletes its key of ``seq-2``
  (a rank entering ``seq`` knows all have entered ``seq-1``, so all have left ``seq-2``).
- gather: ``dst`` deletes the round once it has read it; broadcast: the reader whose
  acknowledgement completes the count deletes the value and the acknowledgements.

So a name reused round after round holds at most two rounds of keys, and the last rank out
deletes the job's keys as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast
from urllib.parse import quote

import aetcd

from dataparallel.control.collectives import Needs, _value
from dataparallel.control.eventloop import submit
from dataparallel.errors import ControlError, ControlTimeout, PeerLeft

from .client import Count

if TYPE_CHECKING:
    from dataparallel.control.liveness import Liveness

    from . import EtcdChannel
    from .client import EtcdClient

T = TypeVar("T")

_ARRIVE = "__dp/arrive/"
_RELEASE = "__dp/release/"


class Interrupted(Exception):
    """A wait for a release was cut short: a peer was lost or the channel broke."""


def _seen(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class ReleaseWatch:
    """The release keys (``__dp/release/``) as this channel has seen them: one etcd watch for
    all of the channel's collectives. The view is the prefix read at one revision plus every
    event after it, so :meth:`wait` finds a key put at any time before or after it was
    called. A watch broken by a lost connection (or a renewed auth token) is read and opened
    again. Runs on the channel's event loop."""

    def __init__(self, channel: EtcdChannel) -> None:
        self._ch = channel
        self._seen: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, list[asyncio.Future[bytes]]] = {}
        self._opened: asyncio.Future[None] | None = None
        self._follower: asyncio.Future[None] | None = None
        self._watch: Any = None

    async def wait(self, key: bytes) -> bytes:
        """The value of ``key`` once it has been put. Raises :class:`Interrupted` when
        :meth:`interrupt` is called meanwhile."""
        if self._opened is None or (self._opened.done() and self._opened.exception() is not None):
            self._opened = asyncio.ensure_future(self._open())
            # Its error is read by the next wait; if every waiter was cancelled meanwhile, it
            # counts as seen (asyncio would log it as an exception never retrieved).
            self._opened.add_done_callback(_seen)
        await asyncio.shield(self._opened)  # one opening, shared by concurrent waiters
        if key in self._seen:
            return self._seen[key]
        waiter: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(waiter)
        try:
            return await waiter
        finally:
            waiting = self._waiters.get(key)
            if waiting is not None and waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del self._waiters[key]

    def interrupt(self) -> None:
        """Wake every waiter with :class:`Interrupted` (it then looks at why)."""
        for waiting in self._waiters.values():
            for waiter in waiting:
                if not waiter.done():
                    waiter.set_exception(Interrupted())

    async def cancel(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
        if self._watch is not None:
            await self._watch.cancel()

    async def _open(self) -> None:
        watch = await self._read_and_watch()
        self._follower = asyncio.ensure_future(self._follow(watch))

    async def _read_and_watch(self) -> Any:
        ch = self._ch
        prefix = ch._k(_RELEASE)  # under the run's root, known once the channel has opened
        found = await ch._call("get_prefix", prefix)
        self._seen = {kv.key: kv.value for kv in found}
        for key, value in self._seen.items():
            self._release(key, value)
        self._watch = await ch._call(
            "watch", prefix, range_end=_prefix_end(prefix), start_revision=found.header.revision + 1
        )
        return self._watch

    def _release(self, key: bytes, value: bytes) -> None:
        for waiter in self._waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(value)

    async def _follow(self, watch: Any) -> None:
        stop = self._ch._stop
        while not stop.is_set():
            try:
                async for event in watch:
                    key = event.kv.key
                    if event.kind == aetcd.rtypes.EventKind.PUT:
                        self._seen[key] = event.kv.value
                        self._release(key, event.kv.value)
                    else:
                        self._seen.pop(key, None)
            except Exception:
                if stop.is_set():
                    return
                await asyncio.sleep(0.1)
            while not stop.is_set():  # the watch ended with its connection: read, watch again
                try:
                    watch = await self._read_and_watch()
                    break
                except Exception:
                    await asyncio.sleep(0.5)


class EtcdCollectives:
    """Mixin of :class:`~transports.etcd.EtcdChannel`: the collectives described above."""

    if TYPE_CHECKING:  # what the mixin uses of EtcdChannel (declared for the type checker only)
        rank: int | None
        world_size: int
        job: str
        liveness_poll: ClassVar[float]
        _loop: asyncio.AbstractEventLoop
        _releases: ReleaseWatch
        _liveness: Liveness | None

        @property
        def _etcd(self) -> EtcdClient: ...
        def _k(self, key: str) -> bytes: ...
        def _usable(self) -> None: ...
        def _check_rank(self, rank: int, what: str) -> None: ...
        def _next_seq(self, kind: str, name: str) -> int: ...
        def _budget(self, timeout: float | None) -> float: ...
        def _raise_if_failed(self, what: str) -> None: ...
        def _translate(self, err: BaseException, what: str) -> ControlError: ...
        def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T: ...
        async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...
        async def _once(self, ops: Any, guard: Any = (), result: bytes = b"") -> tuple[bool, bytes]: ...
        async def _commit(self, ops: Any, guard: Any = (), result: bytes = b"", reads: Any = ()) -> Any: ...

    def _round(self, kind: str, name: str, seq: int) -> str:
        # Quoted, so that no name's rounds lie under another's ("a/0" vs "a", round 0).
        return f"{kind}/{quote(name, safe='', errors='surrogatepass')}/{seq}"

    def _arrivals(self, round_: str) -> bytes:
        return self._k(f"{_ARRIVE}{round_}/")

    def _release_key(self, round_: str) -> bytes:
        return self._k(f"{_RELEASE}{round_}")

    # ------------------------------------------------------------------ steps (on the loop)
    async def _arrive(self, round_: str, value: bytes, expected: int, forget: str | None = None) -> bool:
        """Put this rank's arrival key of ``round_`` (deleting its key of round ``forget``),
        exactly once. True if the round then held ``expected`` arrivals."""
        prefix = self._arrivals(round_)
        mine = prefix + str(self.rank).encode()
        stale = [] if forget is None else [self._arrivals(forget) + str(self.rank).encode()]
        count = Count(prefix, _prefix_end(prefix))

        def ops(txn: Any) -> list[Any]:
            return [txn.put(mine, value), *(txn.delete(k) for k in stale)]

        reads = await self._commit(ops, reads=[count])
        if reads is None:  # applied by an attempt whose reply was lost: count again
            _, reads = await self._call("transaction", compare=[], success=[count], failure=[])
        return reads[0] >= expected

    async def _release(self, round_: str, value: bytes = b"", forget: str | None = None) -> None:
        """Put the release key of ``round_`` (deleting that of round ``forget``), exactly
        once, unless the round was cleaned up already (this rank's arrival key is gone)."""
        mine = self._arrivals(round_) + str(self.rank).encode()
        key = self._release_key(round_)
        stale = [] if forget is None else [self._release_key(forget)]
        txn = self._etcd.transactions
        await self._once(lambda txn: [txn.put(key, value), *(txn.delete(k) for k in stale)], [txn.version(mine) > 0])

    async def _arrive_and_release(
        self, round_: str, value: bytes, expected: int, forget: str | None, release_forget: str | None
    ) -> bool:
        complete = await self._arrive(round_, value, expected, forget)
        if complete:
            await self._release(round_, forget=release_forget)
        return complete

    async def _remove_round(self, round_: str) -> None:
        prefix = self._arrivals(round_)
        key = self._release_key(round_)
        await self._once(lambda txn: [txn.delete(prefix, _prefix_end(prefix)), txn.delete(key)])

    async def _values(self, round_: str) -> dict[int, bytes]:
        prefix = self._arrivals(round_)
        found = await self._call("get_prefix", prefix)
        return {int(kv.key[len(prefix) :]): kv.value for kv in found}

    async def _arrived(self, round_: str) -> set[int]:
        prefix = self._arrivals(round_)
        found = await self._call("get_prefix", prefix, keys_only=True)
        return {int(kv.key[len(prefix) :]) for kv in found}

    # ------------------------------------------------------------------ waiting (caller's thread)
    def _block(
        self,
        work: Coroutine[Any, Any, T],
        deadline: float,
        what: str,
        hint: _Arrivals | None = None,
        needs: Needs | None = None,
    ) -> T:
        """Run ``work`` (a collective's steps, whose only wait is for a release key) on the
        loop; PeerLost as soon as a peer is declared lost (the loss interrupts the wait),
        PeerLeft within a slice once a rank ``needs`` names has left without arriving,
        ControlTimeout at ``deadline`` (``hint`` says who had arrived)."""
        start = time.monotonic()
        try:
            self._raise_if_failed(what)  # a peer already lost: do not even arrive
        except ControlError:
            work.close()
            raise
        future = submit(work, self._loop)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    future.cancel()
                    detail = hint.text() if hint is not None else ""
                    waited = time.monotonic() - start
                    raise ControlTimeout(f"{what} (job {self.job!r}, rank {self.rank})", waited, detail)
                slice_ = min(remaining, self.liveness_poll)
                if hint is not None:
                    if remaining <= HINT_LEAD:
                        hint.read_early()
                    else:
                        slice_ = min(slice_, remaining - HINT_LEAD)  # wake to read it early
                try:
                    # The slices only bound a stall: a loss or a broken channel interrupts the wait.
                    value, error = future.result(timeout=slice_)
                    if error is not None:
                        raise error
                    return cast(T, value)
                except Interrupted:  # only ever after a loss was recorded or the channel broke
                    self._raise_if_failed(what)
                    raise ControlError(f"{what} (job {self.job!r}, rank {self.rank}) was interrupted") from None
                except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before 3.11
                    self._raise_if_failed(what)
                    if needs is not None:
                        self._raise_if_departed(needs, what)
                except ControlError:
                    raise
                except Exception as err:
                    raise self._translate(err, what) from err
        finally:
            future.cancel()
            if hint is not None:
                hint.cancel()

    def _depart(self) -> None:
        """Nothing to record: a departure is this rank's left key (written by ``_leave``),
        which the others' lease watches see, and its arrival keys say how far it went."""

    def _raise_if_departed(self, needs: Needs, during: str) -> None:
        """PeerLeft if a rank ``needs`` names has left (seen by the lease watch) without
        arriving in the round, which is not complete (arrivals read before the release key:
        a round still open when the release was read was open when its arrivals were)."""
        left = [rank for rank in sorted(self._liveness.left()) if rank in needs.ranks] if self._liveness else []
        if not left:
            return
        round_ = self._round(needs.kind, needs.name, needs.seq)
        arrived = self._run(self._arrived(round_), 5.0)
        if self._run(self._call("get", self._release_key(round_)), 5.0) is not None:
            return
        for rank in left:
            if rank not in arrived:
                raise PeerLeft(rank, needs.what, during)

    def _who_arrived(self, round_: str, expected: list[int]) -> _Arrivals:
        return _Arrivals(self._loop, lambda: self._arrived(round_), expected)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + self._budget(timeout)

    # ------------------------------------------------------------------ the collectives
    def barrier(self, name: str = "barrier", timeout: float | None = None) -> None:
        """Block until every rank has entered barrier ``name`` for this round: one transaction
        per rank, one more for the release, one watch event for each waiting rank."""
        self._usable()
        seq = self._next_seq("barrier", name)
        deadline = self._deadline(timeout)
        if self.world_size == 1:
            return
        round_ = self._round("barrier", name, seq)
        previous = self._round("barrier", name, seq - 1) if seq else None
        release = self._release_key(round_)
        n = self.world_size

        async def steps() -> None:
            if not await self._arrive_and_release(round_, b"", n, previous, previous):
                await self._releases.wait(release)

        what = f"barrier {name!r} round {seq}"
        needs = Needs("barrier", name, seq, range(n), what)
        self._block(steps(), deadline, what, self._who_arrived(round_, list(range(n))), needs)

    def all_gather(self, name: str, value: bytes, timeout: float | None = None) -> list[bytes]:
        """Every rank's ``value`` on every rank, as a list indexed by rank."""
        self._usable()
        value = _value(value)
        seq = self._next_seq("allgather", name)
        deadline = self._deadline(timeout)
        if self.world_size == 1:
            return [value]
        round_ = self._round("allgather", name, seq)
        older = self._round("allgather", name, seq - 2) if seq >= 2 else None
        previous = self._round("allgather", name, seq - 1) if seq else None
        release = self._release_key(round_)
        n = self.world_size

        async def steps() -> dict[int, bytes]:
            if not await self._arrive_and_release(round_, value, n, older, previous):
                await self._releases.wait(release)
            return await self._values(round_)

        what = f"all_gather {name!r} round {seq}"
        needs = Needs("allgather", name, seq, range(n), what)
        values = self._block(steps(), deadline, what, self._who_arrived(round_, list(range(n))), needs)
        return _by_rank(values, n, what)

    def gather(self, name: str, value: bytes, dst: int = 0, timeout: float | None = None) -> list[bytes] | None:
        """Collect every rank's ``value`` on ``dst`` (a list indexed by rank); None elsewhere.
        Only ``dst`` blocks."""
        self._usable()
        self._check_rank(dst, "dst")
        value = _value(value)
        seq = self._next_seq("gather", name)
        deadline = self._deadline(timeout)
        n = self.world_size
        round_ = self._round("gather", name, seq)
        if self.rank != dst:
            self._run(self._arrive_and_release(round_, value, n - 1, None, None), timeout)
            return None
        if n == 1:
            return [value]
        release = self._release_key(round_)

        async def steps() -> dict[int, bytes]:
            await self._releases.wait(release)
            values = await self._values(round_)
            await self._remove_round(round_)
            return values

        what = f"gather {name!r} round {seq}"
        others = [r for r in range(n) if r != dst]
        needs = Needs("gather", name, seq, tuple(others), what)
        values = self._block(steps(), deadline, what, self._who_arrived(round_, others), needs)
        values[dst] = value
        return _by_rank(values, n, what)

    def broadcast(self, name: str, value: bytes | None = None, src: int = 0, timeout: float | None = None) -> bytes:
        """Return ``src``'s ``value`` on every rank; ``src`` returns at once, the others block
        until it has published."""
        self._usable()
        self._check_rank(src, "src")
        seq = self._next_seq("bcast", name)
        deadline = self._deadline(timeout)
        round_ = self._round("bcast", name, seq)
        release = self._release_key(round_)
        if self.rank == src:
            if value is None:
                raise TypeError(f"broadcast {name!r}: rank {src} is the source and must pass a value")
            value = _value(value)
            if self.world_size > 1:
                self._run(self._once(lambda txn: [txn.put(release, value)]), timeout)
            return value

        async def steps() -> bytes:
            got = await self._releases.wait(release)
            if await self._arrive(round_, b"", self.world_size - 1):  # the last to read it cleans up
                await self._remove_round(round_)
            return got

        what = f"broadcast {name!r} from rank {src}"
        return self._block(steps(), deadline, what, needs=Needs("bcast", name, seq, (src,), f"{what} round {seq}"))


#: Who had arrived, for a timed-out collective's message: read this long before its deadline,
#: in the background, and again at the deadline, whose answer is waited for at most
#: ``HINT_WITHIN`` (the latest answer in hand is the one shown). Both come out of the slack a
#: timeout allows: a collective that no etcd answers any longer ends ``HINT_WITHIN`` after
#: its deadline, not a read's timeout after it.
HINT_LEAD = 0.3
HINT_WITHIN = 0.1


class _Arrivals:
    """The ranks that had arrived in a round, for a timed-out collective's message (see
    :data:`HINT_LEAD`): an arrival in the last moments is shown where the read at the deadline
    comes back in time; else the early read's count; else none."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        read: Callable[[], Coroutine[Any, Any, set[int]]],
        expected: list[int],
    ) -> None:
        self._loop, self._read, self._expected = loop, read, expected
        self._reads: list[concurrent.futures.Future[tuple[set[int] | None, Exception | None]]] = []

    def read_early(self) -> None:
        if not self._reads:
            self._reads.append(submit(self._read(), self._loop))

    def text(self) -> str:
        late = submit(self._read(), self._loop)
        self._reads.append(late)
        concurrent.futures.wait([late], timeout=HINT_WITHIN)
        for read in reversed(self._reads):
            if read.done() and not read.cancelled() and read.result()[1] is None:
                arrived = read.result()[0] or set()
                missing = [r for r in self._expected if r not in arrived]
                shown = f"{missing[:16]}" + (f" and {len(missing) - 16} more" if len(missing) > 16 else "")
                came = len(self._expected) - len(missing)
                return f"{came}/{len(self._expected)} ranks had arrived; missing ranks {shown}"
        return ""

    def cancel(self) -> None:
        for read in self._reads:
            read.cancel()


def _by_rank(values: dict[int, bytes], n: int, what: str) -> list[bytes]:
    missing = [r for r in range(n) if r not in values]
    if missing:  # the round's keys were removed under it: only a misuse of names does that
        raise ControlError(f"{what}: the values of ranks {missing} are gone (a name used by two collectives at once?)")
    return [values[r] for r in range(n)]


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])
