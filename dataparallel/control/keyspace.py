"""An in-memory key/value space with per-key parked waiters.

The state a coordinator keeps for one job: the in-process ``memory://`` transport uses it
directly, and server-hosted transports keep one per job. A blocked ``get`` parks a
callback on its key and is released by the ``set`` (or ``add``/``compare_set``) that
creates it, so a write wakes only the waiters of that key, not everyone (O(1) per waiter,
not O(N) per write).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from ..errors import BadMessage

Waiter = Callable[[bytes], object]  # told the value; what it returns is not used

#: Keys the core uses for its own bookkeeping live under this prefix (a run's, on the
#: transports that keep runs in their keys): the claims and peers below, heartbeats, the run.
RESERVED_PREFIX = "__dp/"
#: The counter ``rank=None`` joins draw their rank from.
NEXT_RANK = f"{RESERVED_PREFIX}next_rank"


def claim_key(rank: int) -> str:
    """The key whose value names the process that claimed ``rank`` (set once, from empty)."""
    return f"{RESERVED_PREFIX}claim/{rank}"


def peer_key(rank: int) -> str:
    """The key where ``rank``'s process published its host and pid (JSON) when it joined."""
    return f"{RESERVED_PREFIX}peer/{rank}"


class KeySpace:
    """Thread-safe map ``str -> bytes``; all operations are atomic.

    Waiters are called outside the lock, on the writer's thread, with the new value; they
    must be quick (set an event, enqueue a reply).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._parked: dict[str, list[Waiter]] = {}
        self._bytes = 0  # keys' and values' lengths, summed

    def _store(self, key: str, value: bytes) -> None:
        old = self._data.get(key)
        self._bytes += len(value) - (len(old) if old is not None else -len(key))
        self._data[key] = value

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._store(key, value)
            waiters = self._parked.pop(key, None)
        _release(waiters, value)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def get_or_park(self, key: str, waiter: Waiter) -> bytes | None:
        """Return the value if ``key`` exists, else park ``waiter`` on it and return None."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self._parked.setdefault(key, []).append(waiter)
            return value

    def unpark(self, key: str, waiter: Waiter) -> bool:
        """Withdraw a parked waiter (its wait timed out); False if it was already released."""
        with self._lock:
            waiters = self._parked.get(key)
            if not waiters or waiter not in waiters:
                return False
            waiters.remove(waiter)
            if not waiters:
                del self._parked[key]
            return True

    def add(self, key: str, amount: int) -> int:
        """Add to the decimal integer at ``key`` (created as 0); return the new value."""
        with self._lock:
            old = self._data.get(key, b"0")
            try:
                value = int(old) + amount
            except ValueError:
                raise BadMessage(f"add({key!r}): current value {old[:32]!r} is not a decimal integer") from None
            encoded = str(value).encode()
            self._store(key, encoded)
            waiters = self._parked.pop(key, None)
        _release(waiters, encoded)
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's semantics: set ``desired`` if the value equals ``expected`` (a missing key
        matches only an empty ``expected``); return the value now stored, or ``expected``
        when the key is missing and was not created."""
        with self._lock:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected
            elif current != expected:
                return current
            self._store(key, desired)
            waiters = self._parked.pop(key, None)
        _release(waiters, desired)
        return desired

    def append(self, key: str, tail: bytes) -> bytes:
        """Append ``tail`` to the value at ``key`` (created empty); return the new value."""
        with self._lock:
            value = self._data.get(key, b"") + tail
            self._store(key, value)
            waiters = self._parked.pop(key, None)
        _release(waiters, value)
        return value

    def multi_set(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Set every ``(key, value)`` at once (no reader sees some and not others)."""
        items = list(items)
        released = []
        with self._lock:
            for key, value in items:
                self._store(key, value)
            # Waiters see each key's value after the whole write (a key given twice: its last).
            for key in dict.fromkeys(k for k, _ in items):
                released.append((self._parked.pop(key, None), self._data[key]))
        for waiters, value in released:
            _release(waiters, value)

    def multi_get(self, keys: Iterable[str]) -> list[bytes | None]:
        """The values of ``keys`` at one instant (None for a missing key)."""
        with self._lock:
            return [self._data.get(k) for k in keys]

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(key) + len(old)
            return old is not None

    def check(self, keys: Iterable[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        with self._lock:
            return len(self._data)

    def nbytes(self) -> int:
        """Total length of keys and values held."""
        with self._lock:
            return self._bytes

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def parked_count(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._parked.values())


def _release(waiters: list[Waiter] | None, value: bytes) -> None:
    for waiter in waiters or ():
        waiter(value)
