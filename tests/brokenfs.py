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
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dp_fsdir import FsDirChannel

_process_lock = threading.Lock()


class ThreadLockedFsDirChannel(FsDirChannel):
    scheme = "brokenfs"
    PAUSE = 0.002

    def _update(self, key: str, change: Callable[[bytes | None], bytes | None]) -> tuple[bytes | None, bytes | None]:
        with _process_lock:
            return super()._update(key, change)

    @classmethod
    def _claim(cls, written: str, version: Path) -> None:
        time.sleep(cls.PAUSE)  # between an add's or compare_set's read and its write
        os.replace(written, version)  # over another process's version, if it took it
