"""``torch.distributed.Store`` over a control channel.

What torch asks of a store (instrumented on torch 2.13, gloo, and 2.11, NCCL): gloo's
init ``set``s each rank's address, then ``wait``s and ``get``s its peers'; NCCL's rank 0
``set``s its unique id and the others ``get`` it; NCCL's watchdog calls ``check`` about
once a second; ``PrefixStore``, ``new_group`` and torch's store-based barriers use
``add``, ``compare_set``, ``delete_key``, ``num_keys`` and ``wait``. Calls arrive from C++
threads concurrently, so everything here is delegated to the (thread-safe) channel without
a lock of its own. Timeouts raise ``torch.distributed.DistStoreError``, as torch expects.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist

from ..errors import ControlTimeout

if TYPE_CHECKING:
    from .channel import ControlChannel

T = TypeVar("T")


class StoreTimeout(dist.DistStoreError, ControlTimeout):
    """A store call timed out: torch's ``DistStoreError`` (its message says "timeout", as
    TCPStore's, HashStore's and FileStore's do) and our :class:`ControlTimeout` at once."""

    def __init__(self, cause: ControlTimeout) -> None:
        ControlTimeout.__init__(self, cause.what, cause.waited, cause.hint)
        text = f"store timeout after {cause.waited:.1f}s waiting for {cause.what}"
        self.args = (f"{text}; {cause.hint}" if cause.hint else text,)


def _seconds(timeout: timedelta | float | None, default: timedelta) -> float:
    if timeout is None:
        timeout = default
    if isinstance(timeout, timedelta):
        return max(timeout.total_seconds(), 1e-3)
    return max(float(timeout), 1e-3)


def _bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _timed(call: Callable[[], T]) -> T:
    try:
        return call()
    except ControlTimeout as err:
        raise StoreTimeout(err) from err


class ChannelStore(dist.Store):
    """A Store whose every operation is a call on ``channel``; keys keep torch's names.

    torch's C++ keeps only the C++ half of a Python store alive: the channel holds this
    object (:meth:`ControlChannel.as_store`) and every clone of it for as long as it lives,
    so that calls from C++ (``PrefixStore.clone()``, NCCL's threads) always find it.
    """

    if TYPE_CHECKING:
        timeout: timedelta  # c10d Store's, which torch's stubs leave out

    def __init__(self, channel: ControlChannel, clones: list[ChannelStore] | None = None) -> None:
        super().__init__()
        self.channel = channel
        self._clones = [] if clones is None else clones
        self.set_timeout(timedelta(seconds=channel.timeout))

    def set(self, key: str, value: str | bytes) -> None:
        self.channel.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        return _timed(lambda: self.channel.get(key, _seconds(None, self.timeout)))

    def add(self, key: str, amount: int) -> int:
        return self.channel.add(key, int(amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.channel.compare_set(key, _bytes(expected), _bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        _timed(lambda: self.channel.wait(keys, _seconds(timeout, self.timeout)))

    def check(self, keys: list[str]) -> bool:
        return self.channel.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.channel.delete(key)

    def num_keys(self) -> int:
        return self.channel.num_keys()

    # torch's C++ calls these by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def has_extended_api(self) -> bool:
        return True

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return _timed(lambda: self.channel.multi_get(keys, _seconds(None, self.timeout)))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.channel.multi_set(list(keys), [_bytes(v) for v in values])

    def append(self, key: str, value: str | bytes) -> None:
        self.channel.append(key, _bytes(value))

    def clone(self) -> ChannelStore:
        # Another handle on the same (thread-safe) channel, with its own timeout; kept
        # referenced here, since the C++ caller holds only its C++ half.
        twin = ChannelStore(self.channel, self._clones)
        twin.set_timeout(self.timeout)
        self._clones.append(twin)
        return twin
