"""``brokenfs:///ABSOLUTE/DIR``: the example ``fsdir`` transport made atomic only within a process.

Its writes replace a key's next version (``os.replace``) instead of ``link``ing it, which
fails where another process took that version first: so two processes that read the same
version both "win", and one write is lost. One ``threading.Lock`` per process keeps its threads
taking turns (processes do not), and every write waits a moment after the read it follows, so
processes reliably race. The bug ``tests/test_conformance_teeth.py`` plants: a transport
written and tested with threads only would not notice it. Importable where
``examples/custom_transport`` is on the path.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable

from dp_fsdir import BLOCK, DELETED, FsDirChannel

_process_lock = threading.Lock()


class ThreadLockedFsDirChannel(FsDirChannel):
    scheme = "brokenfs"
    PAUSE = 0.002

    def _update(self, key: str, change: Callable[[bytes | None], bytes | None]) -> tuple[bytes | None, bytes | None]:
        folder = self._folder(key)
        with _process_lock:
            version, before = self._latest(folder)
            after = change(before)
            if after == before:
                return before, after
            time.sleep(self.PAUSE)  # between an add's or compare_set's read and its write
            block = folder / str((version + 1) // BLOCK)
            block.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(DELETED if after is None else b"=" + after)
            os.replace(tmp, block / str(version + 1))  # over another process's version, if it took it
            return before, after
