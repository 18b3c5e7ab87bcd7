"""``memory://NAME``: an in-process channel, for single-process use and tests.

Every channel opened with the same NAME and job in one process shares one
:class:`~dataparallel.control.keyspace.KeySpace`; ranks are threads. The space is dropped when its
last channel closes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from dataparallel.control.channel import ControlChannel
from dataparallel.control.keyspace import KeySpace
from dataparallel.control.registry import ChannelURL
from dataparallel.errors import ConfigError

_lock = threading.Lock()
_spaces: dict[tuple[str, str], tuple[KeySpace, int]] = {}


def _acquire(name: str, job: str) -> KeySpace:
    with _lock:
        space, users = _spaces.get((name, job), (None, 0))
        space = space or KeySpace()
        _spaces[(name, job)] = (space, users + 1)
        return space


def _release(name: str, job: str) -> None:
    with _lock:
        space, users = _spaces[(name, job)]
        if users <= 1:
            del _spaces[(name, job)]
        else:
            _spaces[(name, job)] = (space, users - 1)


class MemoryChannel(ControlChannel):
    scheme = "memory"
    URL_FORM = "{scheme}://NAME"
    survives_frozen_writers = True  # each call holds the space's lock only while it runs

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        if url.port is not None or len(url.hosts) != 1 or url.path:
            raise ConfigError(f"{url.shown!r}: expected {cls.url_form(url)}")

    @classmethod
    def security(cls, url: ChannelURL, token: str | None) -> str:
        return "in-process: nothing travels over a network"

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._name = url.host
        self._space = _acquire(self._name, self.job)

    def _set(self, key: str, value: bytes) -> None:
        self._space.set(key, value)

    def _get(self, key: str, timeout: float) -> bytes | None:
        ready = threading.Event()
        box: list[bytes] = []

        def release(value: bytes) -> None:
            box.append(value)
            ready.set()

        value = self._space.get_or_park(key, release)
        if value is not None:
            return value
        if ready.wait(timeout) or not self._space.unpark(key, release):
            ready.wait()  # released between the timeout and the unpark: the value is coming
            return box[0]
        return None

    def _add(self, key: str, amount: int) -> int:
        return self._space.add(key, amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._space.compare_set(key, expected, desired)

    def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        deadline = time.monotonic() + timeout
        while True:
            values = self._space.multi_get(keys)
            present = [value for value in values if value is not None]
            if len(present) == len(values):
                return present
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._get(keys[values.index(None)], remaining) is None:
                return None

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        self._space.multi_set(items)

    def _append(self, key: str, value: bytes) -> None:
        self._space.append(key, value)

    def _delete(self, key: str) -> bool:
        return self._space.delete(key)

    def _check(self, keys: Sequence[str]) -> bool:
        return self._space.check(keys)

    def _num_keys(self) -> int:
        return self._space.num_keys()

    def _close(self) -> None:
        _release(self._name, self.job)
