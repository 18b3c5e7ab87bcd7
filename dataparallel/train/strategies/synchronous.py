"""The step loop of the strategies whose ranks step together (``"ddp"``, ``"local_sgd"``):
every rank trains its shard batch by batch, steps its optimizer every ``grad_accum``
batches, and polls for stop signals; a subclass says what a step syncs."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
from torch.distributed.algorithms.join import Join

from ..data import count, to_device, with_last
from ..position import Sums, set_rng_state
from .base import Strategy


class SynchronousSteps(Strategy):
    """Every rank's optimizer steps at the same batches (ranks with different batch counts
    train under torch's ``Join``, where the strategy allows them)."""

    def forward_module(self) -> torch.nn.Module:
        """What the batches go through (DDP: its all-reduce of the gradients)."""
        return self.t.ddp

    def no_sync(self, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of a batch's forward and backward (``boundary``: an optimizer step follows)."""
        return contextlib.nullcontext() if boundary else self.t.ddp.no_sync()

    def check_even(self, uneven: bool) -> None:
        """Raise where the ranks' batch counts may differ and this strategy cannot train so."""

    def after_step(self) -> bool:
        """After an optimizer step: whether the replicas were made the same (local SGD's averages)."""
        return False

    def poll_due(self, averaged: bool) -> bool:
        """Whether the ranks poll for a stop signal after this step."""
        return self.t.global_step % self.t.poll_stride == 0

    def train_epoch(self, epoch: int) -> Sums:
        t = self.t
        t.ddp.train()
        batches = t.batches(t.train_data, epoch, train=True)
        k = t.grad_accum
        loss_sum, samples, n_batches = 0.0, 0, 0
        uneven = t.ran_uneven = t.uneven(epoch, batches)
        self.check_even(uneven)
        bar = t.reports.open_bar(epoch, batches)
        forward = self.forward_module()
        batches, skip = iter(batches), 0
        if t.resume_at is not None:  # resumed mid-epoch (a stop signal's checkpoint, a regroup)
            loss_sum, samples, n_batches = t.resume_at.sums
            skip = t.resume_at.batches  # this rank's batches before the stop
            for _ in itertools.islice(batches, skip):
                pass
            set_rng_state(t.resume_at.rng)  # after the loader's start, which draws from it
            t.resume_at = None
            if bar is not None:
                bar.update(skip)
        done = skip  # batches of this rank's shard (of the samples left, where the epoch goes on mid-way)
        every = t.opts.snapshot_every if t.settings.elastic and t.reshards() else None
        stops = t.stops
        polling = stops.polls() and not uneven  # under Join the ranks' collectives differ: at its end
        stops.start_epoch()
        status = t.ch.status  # what `dataparallel status` shows of this rank: phase, step, split
        status.at(epoch=epoch)
        status.enter("data")
        status.step_started()
        # Join shadows the all-reduces of ranks that ran out of batches (uneven counts).
        with Join([t.ddp], enable=uneven):
            for i, ((x, y), last) in enumerate(with_last(batches), start=skip):
                status.enter("forward")
                n_batches, done = n_batches + 1, i + 1
                x, y = to_device(x, t.device), to_device(y, t.device)
                boundary = (i + 1) % k == 0 or last
                with self.no_sync(boundary):
                    with t.autocast():
                        loss = t.loss_fn(forward(x), y)
                    status.enter("backward")  # with DDP's gradient all-reduce, at a boundary
                    t.scaler.scale(loss / k).backward()
                averaged = False
                if boundary:
                    status.enter("optimizer")
                    t.step(epoch, i, loss)
                    averaged = self.after_step()
                    status.step_done(t.global_step)
                n = count(y)
                loss_sum += float(loss.detach()) * n
                samples += n
                if bar is not None:
                    bar.update()
                if every and boundary and not last and t.global_step % every == 0:
                    t.elastic.keep(epoch, t.elastic.position(i + 1, (loss_sum, samples, n_batches)))
                if polling and boundary and self.poll_due(averaged) and stops.agreed():
                    stops.stopped_at = i + 1
                    break
                status.enter("data")
        status.enter("epoch end")
        if stops.polls() and stops.stopped_at is None and stops.agreed(last=True):
            stops.stopped_at = done  # agreed at the epoch's end: stop before validating
        t.reports.close_bar()
        return loss_sum, samples, n_batches
