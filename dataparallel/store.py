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

from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from .errors import ControlTimeout

if TYPE_CHECKING:
    from .channel import ControlChannel


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


class ChannelStore(dist.Store):
    """A Store whose every operation is a call on ``channel``; keys keep torch's names.

    Keep a reference for the whole job (:meth:`ControlChannel.as_store` does): torch does
    not, and later use would find the object gone.
    """

    def __init__(self, channel: ControlChannel) -> None:
        super().__init__()
        self.channel = channel
        self.set_timeout(timedelta(seconds=channel.timeout))

    def set(self, key: str, value: str | bytes) -> None:
        self.channel.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        try:
            return self.channel.get(key, _seconds(None, self.timeout))
        except ControlTimeout as err:
            raise dist.DistStoreError(str(err)) from err

    def add(self, key: str, amount: int) -> int:
        return self.channel.add(key, int(amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.channel.compare_set(key, _bytes(expected), _bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        try:
            self.channel.wait(keys, _seconds(timeout, self.timeout))
        except ControlTimeout as err:
            raise dist.DistStoreError(str(err)) from err

    def check(self, keys: list[str]) -> bool:
        return self.channel.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.channel.delete(key)

    def num_keys(self) -> int:
        return self.channel.num_keys()

    # torch's C++ calls these by their C++ names.
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def append(self, key: str, value: str | bytes) -> None:
        """Append to ``key`` (created if missing) atomically, by compare-and-set retries."""
        tail = _bytes(value)
        current = self.channel.get(key, 1.0) if self.channel.check([key]) else b""
        while True:
            found = self.channel.compare_set(key, current, current + tail)
            if found == current + tail:
                return
            current = found

    def clone(self) -> ChannelStore:
        # The channel is thread-safe and shared; a clone is another handle on it.
        twin = ChannelStore(self.channel)
        twin.set_timeout(self.timeout)
        return twin
