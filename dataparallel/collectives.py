"""Collectives built once on the channel primitives.

Every rank must call a collective with the same ``name`` in the same order (as with MPI);
the channel keeps a per-name sequence number so a name can be reused round after round.
Keys are cleaned up by the last rank through, so a long job does not grow the key space.
A transport may override any of these to save round trips; the conformance suite proves
the override equivalent. After a collective raises, its name is in an undefined state:
use a new name (or a new channel) to retry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ControlError

if TYPE_CHECKING:
    from .channel import ControlChannel

_C = "__dp/c/"


class Collectives:
    """Mixin of :class:`~dataparallel.ControlChannel`: rendezvous, barrier, broadcast, gather."""

    def rendezvous(self: ControlChannel, timeout: float | None = None) -> None:
        """Block until all ``world_size`` ranks have connected.

        Liveness does not wait for it: each rank is watched from the moment it joined.
        """
        self.barrier("__rendezvous", timeout=timeout)

    def barrier(self: ControlChannel, name: str = "barrier", timeout: float | None = None) -> None:
        """Block until every rank has entered barrier ``name`` for this round.

        Two round trips per rank (add, then get); reusable forever.
        """
        self._usable()
        base = self._scoped(f"{_C}barrier/{name}")
        arrived = self._add(f"{base}/count", 1)
        round_, position = divmod(arrived - 1, self.world_size)
        done = f"{base}/done/{round_}"
        if position == self.world_size - 1:
            self._set(done, b"1")
            if round_:
                # Everyone has left the previous round: they are all in this one.
                self._delete(f"{base}/done/{round_ - 1}")
            return

        def progress() -> str:
            try:
                now = int(self._get(f"{base}/count", 1.0) or b"0") - round_ * self.world_size
            except (ControlError, ValueError):
                return ""
            return f"{min(now, self.world_size)}/{self.world_size} ranks had arrived"

        self._await(done, timeout, f"barrier {name!r} round {round_}", progress)

    def broadcast(
        self: ControlChannel,
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
        base = self._scoped(f"{_C}bcast/{name}/{self._next_seq('bcast', name)}")
        if self.rank == src:
            if value is None:
                raise TypeError(f"broadcast {name!r}: rank {src} is the source and must pass a value")
            if self.world_size > 1:
                self._set(f"{base}/value", _value(value))
            return bytes(value)
        got = self._await(f"{base}/value", timeout, f"broadcast {name!r} from rank {src}")
        if self._add(f"{base}/acks", 1) == self.world_size - 1:
            self._delete(f"{base}/value")
            self._delete(f"{base}/acks")
        return got

    def gather(
        self: ControlChannel, name: str, value: bytes, dst: int = 0, timeout: float | None = None
    ) -> list[bytes] | None:
        """Collect every rank's ``value`` on ``dst`` (a list indexed by rank); None elsewhere.

        Only ``dst`` blocks.
        """
        self._usable()
        self._check_rank(dst, "dst")
        base = self._scoped(f"{_C}gather/{name}/{self._next_seq('gather', name)}")
        if self.rank != dst:
            self._set(f"{base}/{self.rank}", _value(value))
            return None
        out = []
        for rank in range(self.world_size):
            if rank == dst:
                out.append(_value(value))
                continue
            out.append(self._await(f"{base}/{rank}", timeout, f"gather {name!r}: value of rank {rank}"))
            self._delete(f"{base}/{rank}")
        return out

    def all_gather(self: ControlChannel, name: str, value: bytes, timeout: float | None = None) -> list[bytes]:
        """Every rank's ``value`` on every rank, as a list indexed by rank."""
        self._usable()
        base = self._scoped(f"{_C}allgather/{name}/{self._next_seq('allgather', name)}")
        self._set(f"{base}/{self.rank}", _value(value))
        out = [
            self._await(f"{base}/{rank}", timeout, f"all_gather {name!r}: value of rank {rank}")
            for rank in range(self.world_size)
        ]
        if self._add(f"{base}/read", 1) == self.world_size:
            for rank in range(self.world_size):
                self._delete(f"{base}/{rank}")
            self._delete(f"{base}/read")
        return out

    def _check_rank(self: ControlChannel, rank: int, what: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} must be a rank in 0..{self.world_size - 1}, got {rank!r}")


def _value(value: bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"value must be bytes, got {type(value).__name__} (encode str values first)")
