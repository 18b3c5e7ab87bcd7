"""Stop signals (preemption): with a checkpoint set, SIGTERM or SIGUSR1 (``stop_signals``)
stops training at a step the ranks agree on, the driver checkpoints there, and every rank
raises :class:`Preempted`.

The ranks agree through a one-element all-reduce of their signal flags, started after a
step and read after the next (it overlaps the computation), every ``poll_stride`` optimizer
steps (the driver's choice, about ``STOP_POLL_SECONDS`` of steps)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..control.status import record_event
from ..errors import Preempted
from .position import EpochPosition, Sums, rng_state

if TYPE_CHECKING:
    from .trainer import Trainer

#: About how often (seconds of training) the ranks poll for a stop signal: the most a stop
#: waits for the ranks to agree, besides a step.
STOP_POLL_SECONDS = 0.2
#: The most steps between two polls, whatever the last epoch's step time said.
MAX_POLL_STRIDE = 64
#: A stop signal repeated within this many seconds is the same stop (delivered twice, by
#: srun to every process of a step and by a launcher forwarding it); later, it acts at once.
REPEAT_SECONDS = 5.0


class StopSignals:
    """One rank's stop signals: the handlers, the polls, the stop."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.signalled: int | None = None  # a stop signal this process received
        self.agreed_signal = 0  # the signal the ranks agreed to stop for
        self.stopped_at: int | None = None  # batches of the epoch done when the ranks agreed to stop
        self._poll: tuple[torch.Tensor, Any] | None = None  # the all-reduce of the ranks' stop flags
        self._previous: dict[int, Any] = {}  # the handlers replaced

    def polls(self) -> bool:
        """Whether the ranks poll for stop signals: the same answer on every rank (options
        only), whether or not this one could install handlers."""
        return self.t.opts.checkpoint is not None and bool(self.t.opts.stop_signals)

    def catch(self) -> None:
        """Install the stop signals' handlers (main thread only)."""
        if not self.polls() or threading.current_thread() is not threading.main_thread():
            return

        first: list[float] = []
        previous = self._previous

        def stop(signum: int, frame: object) -> None:
            if self.signalled is None:
                self.signalled = signum
                first.append(time.monotonic())
            elif time.monotonic() - first[0] > REPEAT_SECONDS:  # insisted on: act as it would have
                handler = previous.get(signum)
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
                os.kill(os.getpid(), signum)
            # else the same stop again (srun signals every process of a step, and dataparallel
            # launch forwards what it got): nothing more to do

        for sig in (signal.Signals[name] for name in self.t.opts.stop_signals):
            previous[sig] = signal.signal(sig, stop)

    def release(self, stopped: bool) -> None:
        """Put the previous handlers back; a signal caught but not acted on (``stopped``:
        acted on) acts now, as it would have."""
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set from C
        if self.signalled is not None and not stopped:
            os.kill(os.getpid(), self.signalled)

    def poll_every(self) -> int:
        """Optimizer steps between stop polls, chosen by the driver for every rank: about
        ``STOP_POLL_SECONDS`` of the last epoch's steps (each poll is an all-reduce: on tiny
        CPU steps, one per step would cost ~10%), every step before any epoch is measured."""
        history = self.t.history
        if not history.epochs:
            return 1
        last = history.last
        steps = max(1, min(last.train_batches_per_rank) // self.t.grad_accum)
        return max(1, min(MAX_POLL_STRIDE, int(STOP_POLL_SECONDS / max(last.train_seconds / steps, 1e-9))))

    def start_epoch(self) -> None:
        self._poll, self.stopped_at = None, None

    def agreed(self, last: bool = False) -> bool:
        """Whether some rank had been signalled by the previous poll (every rank gets the same
        answer, the maximum of the flags); if not, the next poll starts in the background, and
        at the epoch's ``last`` step it is read at once (a signal late in an epoch stops it
        before its validation)."""
        stop = self._read()
        if not stop:
            t = self.t
            flag = torch.tensor([self.signalled or 0], device=t.device)
            self._poll = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=t.pg, async_op=True))
            if last:
                stop = self._read()
        return stop

    def _read(self) -> bool:
        """The pending poll's answer: the highest signal number any rank got (0: none), kept as
        the signal every rank stops for (so that every rank exits with the same code)."""
        if self._poll is None:
            return False
        flag, work = self._poll
        self._poll = None
        work.wait()
        agreed = int(flag.item())
        if agreed:
            self.agreed_signal = agreed
        return agreed > 0

    def stop_here(self, epoch: int, batches: int, train: Sums) -> None:
        """The ranks agreed to stop after ``batches`` batches of ``epoch``: the driver writes
        the checkpoint there, with every rank's RNG state and partial sums, then every rank
        raises :class:`Preempted`."""
        t = self.t
        timeout = t.opts.collective_timeout
        mine = json.dumps({"rng": rng_state(), "train": list(train)}).encode()
        parsed = [json.loads(p) for p in t.ch.all_gather(f"dp-stop-{epoch}", mine, timeout=timeout)]
        # An epoch of uneven batch counts stopped at its end: its optimizer state as the report syncs it.
        if t.ran_uneven:
            t.sync_after_join([p["train"][2] for p in parsed])
        if t.rank == 0:
            position = EpochPosition(
                epoch=epoch,
                batches=batches,
                world=t.world,
                batch=t.batch_size,
                base=t.base,  # the epoch went on mid-way: its samples left then
                train=tuple(tuple(p["train"]) for p in parsed),
                layout=t.strategy.data_layout(),
            )
            t.checkpoints.save(epoch - 1, [p["rng"] for p in parsed], position)
        t.ch.barrier(f"dp-stopped-{epoch}", timeout=timeout)  # no rank ends before the file is there
        stopped = Preempted(self.agreed_signal or signal.SIGTERM, epoch, batches, str(t.opts.checkpoint))
        if t.rank == 0:
            record_event(t.ch, "stop", str(stopped))
        if t.rank == 0:
            print(f"dataparallel: {stopped}", file=sys.stderr, flush=True)
        raise stopped
