"""A third-party control channel: ``fsdir:///ABSOLUTE/DIR``.

Ranks share a directory (a local disk, or NFS between hosts): one file per key, written
atomically (temp file + rename), with ``add``/``compare_set`` under an ``flock``. It is
deliberately plain, to show what a transport must provide: five primitives, ``_get``
with a timeout, and ``_close``. Everything else (ranks, token check, liveness,
collectives, the torch Store) comes from the core.

Register it in your package's ``pyproject.toml``::

    [project.entry-points."dataparallel.transports"]
    fsdir = "dp_fsdir:FsDirChannel"
"""

from __future__ import annotations

import base64
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from dataparallel import ChannelURL, ConfigError, ControlChannel


class FsDirChannel(ControlChannel):
    scheme = "fsdir"
    URL_FORM = "{scheme}:///ABSOLUTE/DIR"
    URL_HOST = False  # a directory on this machine (or a shared mount): no host in the URL
    OPTIONS = {"poll": "seconds between checks of a missing key (default 0.002, backing off to 0.05)"}

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._dir = Path(url.path) / self.job
        self._dir.mkdir(parents=True, exist_ok=True)
        self._poll = url.seconds("poll", 0.002)

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        if not url.path:
            raise ConfigError(f"{url.shown!r}: no directory given (expected {cls.url_form(url)})")
        url.seconds("poll", 0.002)

    def _path(self, key: str) -> Path:
        return self._dir / base64.urlsafe_b64encode(key.encode()).decode()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._dir / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _write(self, key: str, value: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, self._path(key))

    # Every write takes the lock, not only add and compare_set: a set or delete landing between
    # an add's read and its write would be lost (the conformance suite's linearizability
    # check catches exactly that).
    def _set(self, key: str, value: bytes) -> None:
        with self._locked():
            self._write(key, value)

    def _get(self, key: str, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        pause = self._poll
        while True:
            value = self._read(key)
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def _add(self, key: str, amount: int) -> int:
        with self._locked():
            value = int(self._read(key) or b"0") + amount
            self._write(key, str(value).encode())
            return value

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked():
            current = self._read(key)
            if current is None and expected:
                return expected
            if current is not None and current != expected:
                return current
            self._write(key, desired)
            return desired

    def _delete(self, key: str) -> bool:
        with self._locked():
            try:
                self._path(key).unlink()
                return True
            except FileNotFoundError:
                return False

    def _check(self, keys: Sequence[str]) -> bool:
        return all(self._path(k).exists() for k in keys)

    def _num_keys(self) -> int:
        return sum(1 for p in self._dir.iterdir() if not p.name.startswith("."))

    def _close(self) -> None:
        pass
