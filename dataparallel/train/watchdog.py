"""The watchdog every rank runs while it trains, and what a failure means.

A thread watches the channel's liveness: when a peer is lost it aborts the process group so
that no rank sits in a collective for a peer that will never come (the training then fails,
and :func:`explain` names the lost rank). It also notes when this process itself stood still
(SIGSTOP, a starved machine) longer than the liveness timeout: its peers have given it up."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..control.process_group import abort_process_group
from ..errors import ChannelClosed, ControlError, PeerLeft, PeerLost

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger(__name__)


class Watchdog:
    """One rank's watchdog, started again for every generation of an elastic job."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.lost: PeerLost | None = None  # the peer the channel declared lost
        self.stalled = 0.0  # the longest this process stood still (stopped, or starved), seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.lost = None
        self.stalled = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dp-train-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:  # no abort() may run while the group is destroyed
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        t = self.t
        last = time.monotonic()
        while not self._stop.wait(0.2):
            now = time.monotonic()
            if now - last > t.ch.liveness_timeout:
                self.stalled = max(self.stalled, now - last)
            last = now
            lost = t.ch.lost_peers()
            if lost:
                self.lost = next(iter(lost.values()))
                log.error("rank %d: %s; aborting the process group", t.rank, self.lost)
                abort_process_group(t.pg)
                t.strategy.abort()
                return


def explain(t: Trainer, err: Exception, epoch: int) -> Exception:
    """Turn a collective failure caused by a lost peer into PeerLost naming it (waiting up to
    a liveness timeout for the channel to tell); a process that stood still, or a coordinator
    gone, into :class:`ChannelClosed` saying so; anything else is ``err`` itself."""
    if isinstance(err, PeerLeft):  # not a loss: that rank closed its channel
        return err
    if isinstance(err, PeerLost):
        return PeerLost(err.rank, err.last_seen, err.reason, during=f"epoch {epoch}")
    own = t.strategy.explain(err)
    if own is not None:
        return own
    watchdog = t.watchdog
    deadline = time.monotonic() + t.ch.liveness_timeout + 2 * t.ch.heartbeat_interval + 1
    while watchdog.lost is None and not t.ch.lost_peers() and time.monotonic() < deadline:
        if isinstance(err, ChannelClosed) or t.ch.failure is not None:
            break
        time.sleep(0.1)
    lost = watchdog.lost or next(iter(t.ch.lost_peers().values()), None)
    if lost is not None:
        return PeerLost(lost.rank, lost.last_seen, lost.reason, during=f"epoch {epoch}")
    if watchdog.stalled:
        return ChannelClosed(
            f"rank {t.rank} stood still for {watchdog.stalled:.1f}s, longer than the liveness timeout "
            f"({t.ch.liveness_timeout:g}s): its peers have gone on without it "
            f"(noticed in epoch {epoch} as: {err})"
        )
    if t.ch.failure is not None and not isinstance(err, ControlError):
        # The coordinator went away with the rank that hosted it (or on its own).
        return ChannelClosed(f"{t.ch.failure} (noticed in epoch {epoch} as: {err})")
    return err
