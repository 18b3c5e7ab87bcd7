"""Collectives built once on the channel primitives.

Every rank must call a collective with the same ``name`` in the same order (as with MPI);
the channel keeps a per-name sequence number so a name can be reused round after round.
Keys are cleaned up by the last rank through, so a long job does not grow the key space.
A transport may override any of these to save round trips; the conformance suite proves
the override equivalent. After a collective raises, its name is in an undefined state:
use a new name (or a new channel) to retry.

A rank that closes its channel leaves a record of how far it went in every collective
(``__dp/departure/RANK``, its rank appended to ``__dp/departed``). A rank waiting in a
collective that needs a departed rank which never entered that round raises
:class:`~dataparallel.PeerLeft` within a slice, instead of waiting out its timeout.
Transports with collectives of their own see departures in their own way and override
:meth:`Collectives._depart`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ControlError, PeerLeft

log = logging.getLogger(__name__)

_C = "__dp/c/"
_DEPARTED = "__dp/departed"
_DEPARTURE = "__dp/departure/"
#: Most (kind, name) rounds a departure record lists (the latest used); a collective whose
#: name a partial record leaves out is waited for as before.
MAX_RECORDED = 4096
#: Seconds past a collective's deadline its store calls may still take, all of them together
#: (a write a barrier or a broadcast makes after its wait used its timeout: its count, an
#: acknowledgement): the time a live store takes to answer, well inside the half-second a
#: call may overrun its timeout.
CALL_GRACE = 0.25


@dataclass(frozen=True)
class Needs:
    """What a wait needs to complete: each of ``ranks`` entering round ``seq`` of the
    collective ``kind``/``name`` (``what`` names it in messages). ``ranks`` may be a
    ``range`` (the whole job: the waiting rank, which has not departed, among them), so that
    a wait of many ranks costs nothing to describe."""

    kind: str
    name: str
    seq: int
    ranks: Collection[int]
    what: str


@dataclass(frozen=True)
class Departure:
    """How far a departed rank went: rounds entered per (kind, name)."""

    entered: dict[tuple[str, str], int]
    partial: bool  # more names than MAX_RECORDED: those left out are unknown

    def missed(self, needs: Needs) -> bool:
        entered = self.entered.get((needs.kind, needs.name))
        if entered is None:
            return not self.partial
        return entered <= needs.seq


class Collectives:
    """Mixin of :class:`~dataparallel.ControlChannel`: rendezvous, barrier, broadcast, gather."""

    if TYPE_CHECKING:  # what the mixin uses of ControlChannel (declared for the type checker only)
        rank: int | None
        world_size: int
        _seq: dict[tuple[str, str], int]
        _seq_lock: threading.Lock
        _departed: dict[int, Departure]
        _call_by: threading.local

        def _left_to_close(self, at_least: float = 0.0) -> float | None: ...
        def _usable(self) -> None: ...
        def _budget(self, timeout: float | None) -> float: ...
        def _next_seq(self, kind: str, name: str) -> int: ...
        def _scoped(self, key: str) -> str: ...
        def _set(self, key: str, value: bytes) -> None: ...
        def _get(self, key: str, timeout: float) -> bytes | None: ...
        def _add(self, key: str, amount: int) -> int: ...
        def _append(self, key: str, value: bytes) -> None: ...
        def _check(self, keys: Sequence[str]) -> bool: ...
        def _delete(self, key: str) -> bool: ...
        def _delete_many(self, keys: Sequence[str]) -> int: ...
        def _await(
            self, key: str, timeout: float | None, what: str, hint: Any = None, needs: Needs | None = None
        ) -> bytes: ...
        def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None: ...
        def _await_with(
            self,
            fetch: Callable[[float], list[bytes] | None],
            timeout: float | None,
            what: str,
            hint: Any = None,
            needs: Needs | None = None,
        ) -> list[bytes]: ...

    @contextlib.contextmanager
    def _by_deadline(self, seconds: float) -> Iterator[float]:
        """The deadline ``seconds`` from now (``time.monotonic()``), for a collective's waits;
        the store calls this thread makes meanwhile (its writes, reads and departure checks)
        end by it and :data:`CALL_GRACE`, or by an earlier end a caller already set
        (:meth:`_call_bound`): a collective keeps its own timeout, not the channel's,
        whatever its calls wait for."""
        outer = getattr(self._call_by, "end", None)
        deadline = time.monotonic() + seconds
        end = deadline + CALL_GRACE
        self._call_by.end = end if outer is None else min(outer, end)
        try:
            yield deadline
        finally:
            self._call_by.end = outer

    def _call_bound(self, bound: float) -> float:
        """The seconds a transport gives one blocking store call whose own bound is
        ``bound`` (the channel's timeout, or a read's wait): no more than what is left of the
        collective this thread is in (its timeout and :data:`CALL_GRACE`), nor of close's
        timeout once close has begun. A transport's hooks bound each blocking call by it."""
        end = getattr(self._call_by, "end", None)
        if end is not None:
            bound = min(bound, max(end - time.monotonic(), 0.01))
        closing = self._left_to_close(at_least=0.05)
        return bound if closing is None else min(bound, closing)

    @staticmethod
    def _left(deadline: float) -> float:
        """What is left of ``deadline`` for a collective's wait (a wait at its deadline still
        looks once)."""
        return max(deadline - time.monotonic(), 1e-3)

    def _tidy(self, what: str, clean: Callable[[], object]) -> None:
        """A collective's clean-up once its result is in hand (a count of readers, its keys
        deleted): a store that does not answer it in time leaves the keys behind (the run's
        own, gone with it) rather than fail a collective that completed."""
        try:
            clean()
        except ControlError as err:
            log.debug("%s: clean-up left undone: %s", what, err)

    def rendezvous(self, timeout: float | None = None) -> None:
        """Block until all ``world_size`` ranks have connected.

        Liveness does not wait for it: each rank is watched from the moment it joined.
        """
        self.barrier("__rendezvous", timeout=timeout)

    def barrier(self, name: str = "barrier", timeout: float | None = None) -> None:
        """Block until every rank has entered barrier ``name`` for this round.

        Two round trips per rank (add, then get); reusable forever.
        """
        self._usable()
        with self._by_deadline(self._budget(timeout)) as deadline:
            self._barrier(name, deadline)

    def _barrier(self, name: str, deadline: float) -> None:
        seq = self._next_seq("barrier", name)
        base = self._scoped(f"{_C}barrier/{name}")
        arrived = self._add(f"{base}/count", 1)
        round_, position = divmod(arrived - 1, self.world_size)
        done = f"{base}/done/{round_}"
        if position == self.world_size - 1:
            self._set(done, b"1")
            if round_:
                # Everyone has left the previous round: they are all in this one.
                self._tidy(f"barrier {name!r} round {round_}", lambda: self._delete(f"{base}/done/{round_ - 1}"))
            return

        def progress() -> str:
            try:
                now = int(self._get(f"{base}/count", 1.0) or b"0") - round_ * self.world_size
            except (ControlError, ValueError):
                return ""
            return f"{min(now, self.world_size)}/{self.world_size} ranks had arrived"

        what = f"barrier {name!r} round {round_}"
        needs = Needs("barrier", name, seq, range(self.world_size), what)
        self._await(done, self._left(deadline), what, progress, needs)

    def broadcast(
        self,
        name: str,
        value: bytes | None = None,
        src: int = 0,
        timeout: float | None = None,
    ) -> bytes:
        """Return ``src``'s ``value`` on every rank (``value`` is ignored elsewhere).

        ``src`` returns at once; the others block until it has published.
        """
        self._usable()
        self._check_rank(src, "src")
        with self._by_deadline(self._budget(timeout)) as deadline:
            return self._broadcast(name, value, src, deadline)

    def _broadcast(self, name: str, value: bytes | None, src: int, deadline: float) -> bytes:
        seq = self._next_seq("bcast", name)
        base = self._scoped(f"{_C}bcast/{name}/{seq}")
        if self.rank == src:
            if value is None:
                raise TypeError(f"broadcast {name!r}: rank {src} is the source and must pass a value")
            if self.world_size > 1:
                self._set(f"{base}/value", _value(value))
            return bytes(value)
        what = f"broadcast {name!r} from rank {src}"
        got = self._await(
            f"{base}/value", self._left(deadline), what, needs=Needs("bcast", name, seq, (src,), f"{what} round {seq}")
        )

        def acknowledge() -> None:
            if self._add(f"{base}/acks", 1) == self.world_size - 1:
                self._delete_many([f"{base}/value", f"{base}/acks"])

        self._tidy(what, acknowledge)
        return got

    def gather(self, name: str, value: bytes, dst: int = 0, timeout: float | None = None) -> list[bytes] | None:
        """Collect every rank's ``value`` on ``dst`` (a list indexed by rank); None elsewhere.

        Only ``dst`` blocks.
        """
        self._usable()
        self._check_rank(dst, "dst")
        with self._by_deadline(self._budget(timeout)) as deadline:
            return self._gather(name, value, dst, deadline)

    def _gather(self, name: str, value: bytes, dst: int, deadline: float) -> list[bytes] | None:
        seq = self._next_seq("gather", name)
        base = self._scoped(f"{_C}gather/{name}/{seq}")
        if self.rank != dst:
            self._set(f"{base}/{self.rank}", _value(value))
            return None
        others = [rank for rank in range(self.world_size) if rank != dst]
        got = self._await_values(base, others, "gather", name, seq, self._left(deadline)) if others else []
        if others:
            self._tidy(f"gather {name!r} round {seq}", lambda: self._delete_many([f"{base}/{rank}" for rank in others]))
        got.insert(dst, _value(value))
        return got

    def all_gather(self, name: str, value: bytes, timeout: float | None = None) -> list[bytes]:
        """Every rank's ``value`` on every rank, as a list indexed by rank."""
        self._usable()
        with self._by_deadline(self._budget(timeout)) as deadline:
            return self._all_gather(name, value, deadline)

    def _all_gather(self, name: str, value: bytes, deadline: float) -> list[bytes]:
        seq = self._next_seq("allgather", name)
        base = self._scoped(f"{_C}allgather/{name}/{seq}")
        self._set(f"{base}/{self.rank}", _value(value))
        out = self._await_values(base, range(self.world_size), "allgather", name, seq, self._left(deadline))

        def read() -> None:
            if self._add(f"{base}/read", 1) == self.world_size:
                self._delete_many([*(f"{base}/{rank}" for rank in range(self.world_size)), f"{base}/read"])

        self._tidy(f"all_gather {name!r} round {seq}", read)
        return out

    def _await_values(
        self, base: str, ranks: Sequence[int], kind: str, name: str, seq: int, timeout: float | None
    ) -> list[bytes]:
        """The values ``ranks`` wrote under ``base`` for round ``seq`` of a gather, read
        together (one ``_multi_get`` a slice, so a transport or node relay that reads many
        keys in one request does), waiting for the missing ones; on timeout, the message
        names them."""
        keys = [f"{base}/{rank}" for rank in ranks]
        shown = "all_gather" if kind == "allgather" else kind
        what = f"{shown} {name!r} round {seq}"

        def missing() -> str:
            absent: list[int] = []
            try:
                for rank, key in zip(ranks, keys, strict=True):
                    if not self._check([key]):
                        absent.append(rank)
                        if len(absent) > 8:
                            break
            except ControlError:
                return ""
            listed = ", ".join(map(str, absent[:8])) + (" and more" if len(absent) > 8 else "")
            return f"no value yet from rank(s) {listed}" if absent else ""

        return self._await_with(
            lambda slice_: self._multi_get(keys, slice_), timeout, what, missing, Needs(kind, name, seq, ranks, what)
        )

    # ------------------------------------------------------------------ departures
    def _depart(self) -> None:
        """Called by ``close`` (a clean departure): record how far this rank went in every
        collective, so that a rank waiting in one this rank never entered fails at once."""
        with self._seq_lock:
            counts = list(self._seq.items())
        record = {"entered": [[k, n, c] for (k, n), c in counts[-MAX_RECORDED:]], "partial": len(counts) > MAX_RECORDED}
        self._set(self._scoped(f"{_DEPARTURE}{self.rank}"), json.dumps(record).encode())
        self._append(self._scoped(_DEPARTED), f"{self.rank},".encode())

    def _departures(self) -> dict[int, Departure]:
        """The departure records of the ranks that have closed (read again only when the
        list of departed ranks grew)."""
        key = self._scoped(_DEPARTED)
        raw = self._get(key, 1e-3) if self._check([key]) else None
        ranks = {int(r) for r in (raw or b"").decode().split(",") if r}
        for rank in ranks - set(self._departed):
            record = json.loads(self._get(self._scoped(f"{_DEPARTURE}{rank}"), 1.0) or b"{}")
            entered = {(k, n): c for k, n, c in record.get("entered", [])}
            self._departed[rank] = Departure(entered, bool(record.get("partial")))
        return self._departed

    def _raise_if_departed(self, needs: Needs, during: str) -> None:
        """PeerLeft if a rank ``needs`` names has closed without entering its round."""
        departed = self._departures()
        for rank in sorted(departed):
            if rank in needs.ranks and departed[rank].missed(needs):
                raise PeerLeft(rank, needs.what, during)

    def _check_rank(self, rank: int, what: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} must be a rank in 0..{self.world_size - 1}, got {rank!r}")


def _value(value: bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"value must be bytes, got {type(value).__name__} (encode str values first)")
