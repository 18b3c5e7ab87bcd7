"""``brokenfs:///ABSOLUTE/DIR``: the example ``fsdir`` transport made atomic only within a process.

Its ``flock`` is replaced by one ``threading.Lock`` per process (threads take turns, processes
do not) and every write waits a moment after the read it follows, so processes reliably race.
The bug ``tests/test_conformance_teeth.py`` plants: a transport written and tested with
threads only would not notice it. Importable where ``examples/custom_transport`` is on the path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dp_fsdir import FsDirChannel

_process_lock = threading.Lock()


class ThreadLockedFsDirChannel(FsDirChannel):
    scheme = "brokenfs"
    PAUSE = 0.002

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with _process_lock:
            yield

    def _write(self, key: str, value: bytes) -> None:
        time.sleep(self.PAUSE)  # between an add's or compare_set's read and its write
        super()._write(key, value)
