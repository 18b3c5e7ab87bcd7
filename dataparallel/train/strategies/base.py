"""What a way of keeping the replicas in agreement (``TrainOptions.strategy``) does for the
trainer: wrap the model, train an epoch, end it, say how an epoch's batches are split and
whether an epoch can go on resharded, explain a failure of its own.

A strategy is made once per ``fit``, from the name in the options (the registry in
:mod:`dataparallel.train.strategies`), with the trainer whose state it works on: the trainer
owns the model, optimizer, scheduler, process group and channel; the strategy decides how a
step uses them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from torch.nn.parallel import DistributedDataParallel

from ..position import Sums

if TYPE_CHECKING:
    from ..options import TrainOptions
    from ..trainer import Trainer


class Strategy(ABC):
    """One strategy, for one ``fit`` on one rank (``trainer``: that rank's trainer)."""

    #: The name ``TrainOptions.strategy`` gives it.
    name: ClassVar[str]

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    @classmethod  # noqa: B027 (a hook: nothing by default)
    def check(cls, options: TrainOptions, elastic: bool | None) -> None:
        """Raise :class:`ValueError` for ``options`` this strategy cannot honour (``elastic``:
        as resolved, or as the options give it, None where they leave it to the channel)."""

    def wrap(self) -> None:
        """Wrap the trainer's model for this process group (``trainer.ddp``; after a regroup
        too). DistributedDataParallel for every strategy: its construction gives every rank
        rank 0's parameters and buffers, and its ``module`` is the bare model."""
        t = self.t
        ids = [t.device.index] if t.device.type == "cuda" else None
        t.ddp = DistributedDataParallel(t.model, device_ids=ids, process_group=t.pg)

    def start(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """Once the optimizer and scheduler exist, before the first epoch."""

    @abstractmethod
    def train_epoch(self, epoch: int) -> Sums:
        """Train ``epoch`` on this rank (from ``trainer.resume_at`` where it is set); this
        rank's (loss sum, samples, batches). Where the ranks agreed to stop (a stop signal),
        ``trainer.stops.stopped_at`` says after how many batches."""

    def end_epoch(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """After ``train_epoch`` (stopped or not), before validation and the checkpoint: make
        every replica the same where the epoch left them apart."""

    def reshards(self) -> bool:
        """Whether the strategy trains each rank's shard of the one order the loop knows (the
        default sampler's), so that an epoch can go on mid-way on another number of ranks."""
        return False

    def data_layout(self) -> tuple[str, int]:
        """How an epoch's batches are split: ``("shares", N)``, each of N ranks its shard, or
        ``("handed", B)``, handed out in one order, B samples a batch."""
        return ("shares", self.t.world)

    def explain(self, err: Exception) -> Exception | None:
        """A failure of this strategy's exchanges as the error that caused it (None: not known here)."""
        return None

    def failed(self, err: BaseException) -> None:  # noqa: B027 (a hook: nothing by default)
        """This rank failed with ``err``: tell the peers that wait on it without a collective."""

    def abort(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """A peer is lost: abort the groups of this strategy's own beside the job's."""

    def figures(self) -> tuple[int | None, int]:
        """The last epoch's (largest staleness, reads held back), for its metrics."""
        return None, 0
