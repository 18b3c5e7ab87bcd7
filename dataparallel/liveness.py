"""Store-based liveness for transports that have none of their own.

Each rank bumps a heartbeat counter every ``interval`` seconds. Rank 0 watches every
peer; the others watch rank 0. A watched counter that has not moved for ``timeout``
seconds (by the watcher's own clock, so hosts need no synchronised clocks) declares the
peer lost and publishes it under ``__dp/lost`` (first report wins), where every rank reads
it on its next tick. Blocked calls then raise :class:`PeerLost` (see
``ControlChannel._await``). A rank that closes its channel writes ``closed`` instead: a
clean departure, not a loss.

Cost per tick: one write per rank, plus two reads per watched peer.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ChannelClosed

if TYPE_CHECKING:
    from .channel import ControlChannel

log = logging.getLogger(__name__)

_HB = "__dp/hb/"
_LOST = "__dp/lost"
_CLOSED = b"closed"


@dataclass(frozen=True)
class LostPeer:
    rank: int
    last_seen: float | None  # wall clock (time.time()) of the last heartbeat seen
    reason: str


class Liveness:
    """Heartbeat publisher and watcher for one rank of one channel (one daemon thread)."""

    def __init__(self, channel: ControlChannel, interval: float, timeout: float) -> None:
        self._ch = channel
        self._interval = interval
        self._timeout = timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dp-liveness-r{channel.rank}", daemon=True)
        self._lost: dict[int, LostPeer] = {}
        self._left: set[int] = set()
        # rank -> (last counter value, monotonic time it changed, wall time it changed)
        self._seen: dict[int, tuple[bytes | None, float, float | None]] = {}

    def start(self) -> None:
        self._beat()
        now = time.monotonic()
        for rank in self._watched():
            self._seen[rank] = (None, now, None)
        self._thread.start()

    def stop(self, announce: bool) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._interval * 4)
        if announce:
            try:
                self._ch._set(f"{_HB}{self._ch.rank}", _CLOSED)
            except Exception as err:  # leaving anyway; the coordinator may be gone
                log.debug("could not announce departure: %s", err)

    def await_departures(self, grace: float) -> None:
        """Wait up to ``grace`` seconds until every other rank has closed or been lost."""
        deadline = time.monotonic() + grace
        others = [r for r in range(self._ch.world_size) if r != self._ch.rank]
        while time.monotonic() < deadline:
            gone = set(self._lost)
            for rank in others:
                key = f"{_HB}{rank}"
                try:
                    if rank not in gone and self._ch._check([key]) and self._ch._get(key, 1.0) == _CLOSED:
                        gone.add(rank)
                except Exception:
                    return
            if gone.issuperset(others):
                return
            time.sleep(min(0.05, self._interval))

    def first_lost(self) -> LostPeer | None:
        lost = self._lost  # read without a lock: a dict swap or insert is atomic
        return next(iter(lost.values()), None) if lost else None

    def lost(self) -> list[LostPeer]:
        return list(self._lost.values())

    def left(self) -> set[int]:
        return set(self._left)

    # ------------------------------------------------------------------ background
    def _watched(self) -> list[int]:
        if self._ch.rank == 0:
            return list(range(1, self._ch.world_size))
        return [0]

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
                self._watch()
                self._read_reports()
            except Exception as err:
                if self._stop.is_set():
                    return
                self._ch._fail(ChannelClosed(f"lost contact with the coordinator of job {self._ch.job!r}: {err}"))
                return

    def _beat(self) -> None:
        self._ch._add(f"{_HB}{self._ch.rank}", 1)

    def _watch(self) -> None:
        now = time.monotonic()
        for rank, (last, changed, wall) in list(self._seen.items()):
            if rank in self._lost or rank in self._left:
                continue
            key = f"{_HB}{rank}"
            value = self._ch._get(key, self._interval) if self._ch._check([key]) else None
            if value == _CLOSED:
                self._left.add(rank)
            elif value is not None and value != last:
                self._seen[rank] = (value, now, time.time())
            elif now - changed > self._timeout:
                self._declare(
                    rank, wall, f"no heartbeat for {now - changed:.1f}s (liveness timeout {self._timeout:g}s)"
                )

    def _declare(self, rank: int, last_seen: float | None, reason: str) -> None:
        info = self._ch.peer_info(rank)
        if info:
            reason = f"{reason}; it ran as pid {info.get('pid')} on {info.get('host')}"
        report = json.dumps({"rank": rank, "last_seen": last_seen, "reason": reason, "by": self._ch.rank})
        self._ch._compare_set(_LOST, b"", report.encode())
        self._read_reports()

    def _read_reports(self) -> None:
        if not self._ch._check([_LOST]):
            return
        raw = self._ch._get(_LOST, self._interval)
        if not raw:
            return
        report = json.loads(raw)
        rank = int(report["rank"])
        if rank not in self._lost:
            reason = report["reason"]
            if report.get("by") != self._ch.rank:
                reason = f"{reason} (noticed by rank {report.get('by')})"
            self._lost = {**self._lost, rank: LostPeer(rank, report.get("last_seen"), reason)}
            log.warning("job %r: peer rank %d lost: %s", self._ch.job, rank, reason)
