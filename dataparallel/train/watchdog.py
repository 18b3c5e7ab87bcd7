"""The watchdog every rank runs while it trains, and what a failure means.

A thread watches the channel's liveness: when a peer is lost it aborts the process group so
that no rank sits in a collective for a peer that will never come (the training then fails,
and :func:`explain` names the lost rank). It also notes when this process itself stood still
(SIGSTOP, a starved machine) longer than the liveness timeout: its peers have given it up.

With ``TrainOptions.stall_timeout``, the driver's watchdog also reads every rank's status
once a second and, once a stall (:func:`~dataparallel.control.status.diagnose`) has lasted
that long, records its verdict under the job's reserved key ``__dp/stall/verdict``; every
rank's watchdog looks for it as often, aborts the process group when it is there, and the
rank it names dumps its Python stacks into the channel (and the job's event log) and is
interrupted where it stands: ``fit`` raises :class:`~dataparallel.Stalled`."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from ..control.process_group import abort_process_group
from ..control.status import JobWatch, read_job, record_event
from ..errors import ChannelClosed, ControlError, PeerLeft, PeerLost, Stalled

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger(__name__)


class Watchdog:
    """One rank's watchdog, started again for every generation of an elastic job."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.lost: PeerLost | None = None  # the peer the channel declared lost
        self.stalled = 0.0  # the longest this process stood still (stopped, or starved), seconds
        self.verdict: Stalled | None = None  # the job's stall, as the driver named it (stall_timeout)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._judge: threading.Thread | None = None
        # Held while this rank may be interrupted (inside fit's loop, the watchdog running).
        self._interrupt_lock = threading.Lock()
        self._interruptible = False
        self._losses_recorded: set[tuple[str, int]] = set()  # the peers whose loss the event log holds

    def start(self) -> None:
        self.lost = None
        self.stalled = 0.0
        self.verdict = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop,), name="dp-train-watchdog", daemon=True)
        self._thread.start()
        self._judge = None
        opts = self.t.opts
        # The driver looks at the job (stalls and stragglers into its event log); with
        # stall_timeout every rank also looks for the driver's verdict.
        if opts.stall_timeout is not None or self.t.rank == 0:
            self._judge = threading.Thread(
                target=self._judge_stalls, args=(self._stop,), name="dp-train-stalls", daemon=True
            )
            self._judge.start()
        with self._interrupt_lock:
            self._interruptible = True

    def stop(self) -> None:
        """Stop watching. From its return on, nothing interrupts this rank's main thread."""
        with self._interrupt_lock:
            self._interruptible = False
        self._stop.set()
        for thread in (self._thread, self._judge):
            if thread is not None:  # no abort() may run while the group is destroyed
                thread.join(timeout=5)

    def _watch(self, stop: threading.Event) -> None:
        # ``stop`` is this thread's own: one that outlived its stop's join never runs on next
        # to the next generation's.
        t = self.t
        last = time.monotonic()
        while not stop.wait(0.2):
            now = time.monotonic()
            if now - last > t.ch.liveness_timeout:
                self.stalled = max(self.stalled, now - last)
            last = now
            if self.verdict is not None:
                return
            lost = t.ch.lost_peers()
            if lost:
                self.lost = next(iter(lost.values()))
                log.error("rank %d: %s; aborting the process group", t.rank, self.lost)
                abort_process_group(t.pg)
                t.strategy.abort()
                self.record_loss(self.lost)
                return

    def record_loss(self, lost: PeerLost) -> None:
        """On the driver, the loss of ``lost`` in the job's event log (once a peer)."""
        key = (self.t.ch.job, lost.rank)  # an elastic job's generations number their ranks anew
        if self.t.rank == 0 and key not in self._losses_recorded:
            self._losses_recorded.add(key)
            record_event(self.t.ch, "loss", str(lost), rank=lost.rank)

    def _judge_stalls(self, stop: threading.Event) -> None:
        """With ``stall_timeout``, once a second: the driver names a stall that has lasted that
        long (measured on its own clock: :class:`~dataparallel.control.status.JobWatch`); every
        rank acts on the verdict once it is there (the process group aborted, the named rank
        interrupted). The driver also records in the job's event log, once each, every stall
        it sees (a rank gone silent, a rank others wait for past the stall threshold) and each
        rank that becomes a straggler (every :data:`STRAGGLERS_LOOK` seconds without
        ``stall_timeout``)."""
        watch = JobWatch()
        every = STALL_LOOK if self.t.opts.stall_timeout is not None else STRAGGLERS_LOOK
        slow: set[int] = set()
        stalled: set[tuple[int, str]] = set()
        said = False
        while not stop.wait(every):
            if self.lost is not None:
                return
            try:
                if self._judged(watch, slow, stalled):
                    return
            except Exception as err:  # a store that does not answer is the liveness thread's to judge
                (log.debug if said else log.warning)("rank %d: the job's stalls not judged: %s", self.t.rank, err)
                said = True

    def _judged(self, watch: JobWatch, slow: set[int], stalled: set[tuple[int, str]]) -> bool:
        t = self.t
        timeout = t.opts.stall_timeout
        verdicts = t.ch.reserved("stall")
        if t.rank == 0 and (timeout is None or not verdicts.check("verdict")):
            view = read_job(t.ch, world_size=t.world, watch=watch, events=False)
            for straggler in view["stragglers"]:
                if straggler["rank"] not in slow:
                    record_event(t.ch, "straggler", straggler["cause"], rank=straggler["rank"])
            slow.clear()
            slow.update(s["rank"] for s in view["stragglers"])
            seen = {_stall_key(s) for s in view["stalls"]}
            for stall in view["stalls"]:  # once a stall: logged as it begins, again only once it ended
                if _stall_key(stall) not in stalled:
                    record_event(t.ch, "stall", stall["cause"], rank=stall["rank"])
            stalled.clear()
            stalled.update(seen)
            for stall in view["stalls"]:  # the silent first, then the furthest behind
                if stall["cause"].startswith("silent") and t.settings.elastic:
                    continue  # a rank gone silent is for liveness to declare lost: the others regroup
                if timeout is not None and (stall.get("for_s") or 0.0) >= timeout:
                    said = json.dumps({k: stall.get(k) for k in ("rank", "phase", "cause")}).encode()
                    if verdicts.compare_set("verdict", b"", said) == said:
                        record_event(t.ch, "verdict", f"{stall['cause']} (stall_timeout {timeout:g}s)", stall["rank"])
                    break
        if timeout is None:
            return False
        raw = verdicts.get("verdict", timeout=STALL_LOOK) if verdicts.check("verdict") else None
        if not raw:
            return False
        said = json.loads(raw)
        verdict = Stalled(int(said["rank"]), said.get("phase"), str(said.get("cause")), timeout)
        if verdict.rank == t.rank and self._interruptible:  # where it stands, for the job's log
            try:
                t.ch.status.dump_stacks("stall verdict")
            except Exception as err:
                log.info("rank %d: stacks not dumped: %s", t.rank, err)
        with self._interrupt_lock:
            if not self._interruptible:  # fit is ending already
                return True
            self.verdict = verdict
            with contextlib.suppress(ControlError):
                verdicts.set(f"seen/{t.rank}", b"1")  # the driver holds the job's state until all saw it
            log.error("rank %d: %s; aborting the process group", t.rank, verdict)
            abort_process_group(t.pg)
            t.strategy.abort()
            # The rank the others wait for is stuck where they cannot reach it: interrupt it
            # there (its main thread, between two Python instructions), unless SIGINT is not
            # Python's own (ignored, or a stop signal's: then its launcher ends it).
            if verdict.rank == t.rank and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                # A signal, not interrupt_main(): it ends a blocking call (a sleep, a wait) too.
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return True

    def stall_to_raise(self) -> Stalled | None:
        """The job's stall, where this rank is to raise it (no loss was declared, which wins),
        once the driver has waited for every rank to see it; else None."""
        if self.verdict is None or self.lost is not None or self.t.ch.lost_peers():
            return None
        self.await_verdict_seen()
        return self.verdict

    def await_verdict_seen(self) -> None:
        """On the driver, before it ends with the job's stall: wait (at most
        :data:`STALL_SEEN_WITHIN`) until every rank has seen the verdict, so that none is left
        waiting where the driver's end takes the job's coordinator with it."""
        t = self.t
        if t.rank != 0:
            return
        verdicts = t.ch.reserved("stall")
        deadline = time.monotonic() + STALL_SEEN_WITHIN
        others = set(range(1, t.world))
        while others and time.monotonic() < deadline:
            try:
                others = {r for r in others if not verdicts.check(f"seen/{r}")}
            except ControlError:
                return
            time.sleep(0.05)


def _stall_key(stall: dict[str, Any]) -> tuple[int, str]:
    """What makes a stall the same one from look to look: its rank, and silence or the phase."""
    cause = str(stall["cause"])
    return int(stall["rank"]), cause.split(":")[0] if cause.startswith(("silent", "lost", "failed")) else str(
        stall["phase"]
    )


#: Seconds between two looks for a stall (stall_timeout), and the longest the driver waits for
#: every rank to have seen its verdict; between two looks for stragglers without stall_timeout.
STALL_LOOK, STALL_SEEN_WITHIN, STRAGGLERS_LOOK = 1.0, 5.0, 5.0


def explain(t: Trainer, err: Exception, epoch: int) -> Exception:
    """Turn a collective failure caused by a lost peer into PeerLost naming it (waiting up to
    a liveness timeout for the channel to tell); a process that stood still, or a coordinator
    gone, into :class:`ChannelClosed` saying so; anything else is ``err`` itself."""
    stalled = t.watchdog.stall_to_raise()  # the job stalled: what failed is its consequence
    if stalled is not None:
        return stalled
    if isinstance(err, PeerLeft):  # not a loss: that rank closed its channel
        return err
    if isinstance(err, PeerLost):
        t.watchdog.record_loss(err)
        return PeerLost(err.rank, err.last_seen, err.reason, during=f"epoch {epoch}")
    own = t.strategy.explain(err)
    if own is not None:
        return own
    watchdog = t.watchdog
    deadline = time.monotonic() + t.ch.liveness_timeout + 2 * t.ch.heartbeat_interval + 1
    while watchdog.lost is None and not t.ch.lost_peers() and time.monotonic() < deadline:
        if isinstance(err, ChannelClosed) or t.ch.failure is not None or watchdog.verdict is not None:
            break
        time.sleep(0.1)
    stalled = watchdog.stall_to_raise()  # another rank's abort, for the stall, came first
    if stalled is not None:
        return stalled
    lost = watchdog.lost or next(iter(t.ch.lost_peers().values()), None)
    if lost is not None:
        watchdog.record_loss(lost)
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
