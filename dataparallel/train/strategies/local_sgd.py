"""``strategy="local_sgd"``: every rank steps its own optimizer on its own gradients; the
parameters (and floating-point buffers) are averaged every ``sync_every`` optimizer steps,
with the optimizer's state too at every epoch's end."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from .synchronous import SynchronousSteps


class LocalSGD(SynchronousSteps):
    """The bare module's forward (no gradient all-reduce); the averages are the collectives,
    so the ranks poll for stop signals at them, and need equal batch counts."""

    name = "local_sgd"

    def forward_module(self) -> torch.nn.Module:
        module: torch.nn.Module = self.t.ddp.module
        return module

    def no_sync(self, boundary: bool) -> contextlib.AbstractContextManager[Any]:
        return self.t.ddp.no_sync()

    def check_even(self, uneven: bool) -> None:
        if uneven:
            raise ValueError(
                "strategy='local_sgd' needs the same number of batches on every rank (its averages are "
                "collectives every rank makes): train on a Dataset with DistributedSampler or a sampler with "
                "equal shards"
            )

    def after_step(self) -> bool:
        averaged = self.t.global_step % self.t.opts.sync_every == 0
        if averaged:
            self._average(optimizer=False)
        return averaged

    def poll_due(self, averaged: bool) -> bool:
        return averaged

    def end_epoch(self) -> None:
        self._average(optimizer=True)

    def _average(self, optimizer: bool) -> None:
        """Average the parameters and floating-point buffers over the ranks (one all-reduce,
        torch's ``model_averaging``), with ``optimizer`` the optimizer's floating-point state
        too (momentum, Adam's moments). Integer buffers and state (step counts) are the same
        on every rank already."""
        t = self.t
        module = t.ddp.module
        tensors = [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]
        if optimizer:
            for state in t.optimizer.state.values():
                tensors += [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
        if t.pg is None:
            raise RuntimeError("local SGD averages over the job's process group, which is not set up yet")
        average_parameters(iter(tensors), t.pg)
