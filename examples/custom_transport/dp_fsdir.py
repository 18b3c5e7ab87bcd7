"""A third-party control channel: ``fsdir:///ABSOLUTE/DIR``.

Ranks share a directory (a local disk, or NFS between hosts). It is deliberately plain, to
show what a transport must provide: five primitives, ``_get`` with a timeout, and
``_close``. Everything else (ranks, token check, liveness, collectives, the torch Store)
comes from the core.

Each key is a folder of numbered versions. A write reads the latest version ``n``, writes
its value to a temporary file and ``link``s it as version ``n + 1``: the link fails if that
version exists, so of two writers racing for it one wins and the other reads again and
retries. Every write is thus atomic and linearizable (``add`` and ``compare_set`` too)
without a lock: a rank frozen in the middle of a write (SIGSTOP, a paused VM) blocks no one,
and when it resumes its stale write fails on the version the others have moved past. (With
an ``flock``, every other rank would hang behind a frozen holder.) No version is ever
removed, since a removed version's number could be taken again by a writer that read before
it went; they are kept in folders of a thousand, so a read lists at most two short folders.
One small file per write: fine for a demonstration, not for a long job on a busy key.

Register it in your package's ``pyproject.toml``::

    [project.entry-points."dataparallel.transports"]
    fsdir = "dp_fsdir:FsDirChannel"
"""

from __future__ import annotations

import base64
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dataparallel import ChannelURL, ConfigError, ControlChannel

DELETED = b""  # a version file holds b"=" and the value, or nothing for a deletion
BLOCK = 1000  # versions per folder


class FsDirChannel(ControlChannel):
    scheme = "fsdir"
    URL_FORM = "{scheme}:///ABSOLUTE/DIR"
    URL_HOST = False  # a directory on this machine (or a shared mount): no host in the URL
    survives_frozen_writers = True  # no lock: a stale write fails on the version it raced for
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

    def _folder(self, key: str) -> Path:
        return self._dir / ("k" + base64.urlsafe_b64encode(key.encode()).decode())

    @staticmethod
    def _latest(folder: Path) -> tuple[int, bytes | None]:
        """A key's latest version and its value (None: never written, or deleted)."""
        try:
            blocks = sorted((int(name) for name in os.listdir(folder) if name.isdigit()), reverse=True)
        except FileNotFoundError:
            return 0, None
        for block in blocks[:2]:  # the newest folder is empty only until its first version lands
            versions = [int(name) for name in os.listdir(folder / str(block)) if name.isdigit()]
            if versions:
                latest = max(versions)
                data = (folder / str(block) / str(latest)).read_bytes()
                return latest, (data[1:] if data else None)
        return 0, None

    def _update(self, key: str, change: Callable[[bytes | None], bytes | None]) -> tuple[bytes | None, bytes | None]:
        """Apply ``change`` to the current value as one atomic step: returns (before, after).
        ``change`` returning the value unchanged writes nothing; None deletes."""
        folder = self._folder(key)
        while True:
            version, before = self._latest(folder)
            after = change(before)
            if after == before:
                return before, after
            block = folder / str((version + 1) // BLOCK)
            block.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(DELETED if after is None else b"=" + after)
                self._claim(tmp, block / str(version + 1))
            except FileExistsError:
                continue  # another write took this version first: read it and try again
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return before, after

    @staticmethod
    def _claim(written: str, version: Path) -> None:
        """Make ``written`` the key's ``version``, the write's one atomic step: FileExistsError
        where another write took that version first."""
        os.link(written, version)

    def _set(self, key: str, value: bytes) -> None:
        self._update(key, lambda _: value)

    def _get(self, key: str, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        pause = self._poll
        while True:
            value = self._latest(self._folder(key))[1]
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)

    def _add(self, key: str, amount: int) -> int:
        _, after = self._update(key, lambda value: str(int(value or b"0") + amount).encode())
        assert after is not None
        return int(after)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        def swap(current: bytes | None) -> bytes | None:
            if current is None:
                return None if expected else desired  # absent: only an empty expectation sets it
            return desired if current == expected else current

        _, after = self._update(key, swap)
        if after is None:  # absent, and a value was expected: torch's store answers the expectation
            return expected
        return after

    def _delete(self, key: str) -> bool:
        before, _ = self._update(key, lambda _: None)
        return before is not None

    def _check(self, keys: Sequence[str]) -> bool:
        return all(self._latest(self._folder(k))[1] is not None for k in keys)

    def _num_keys(self) -> int:
        return sum(1 for p in self._dir.iterdir() if p.name.startswith("k") and self._latest(p)[1] is not None)

    def _close(self) -> None:
        pass
