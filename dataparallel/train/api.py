"""``dp.fit`` and its driver and follower forms: the caller's arguments and the settings
resolved from the channel, as one :class:`~dataparallel.train.spec.FitSpec`, to the trainer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ..control.channel import ControlChannel
from .options import EpochMetrics, FitResult, StepInfo, TrainOptions
from .spec import BatchSource, FitSpec, LossFn, resolve_settings
from .trainer import Trainer


def fit(
    channel: ControlChannel,
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    train_data: Dataset[Any] | BatchSource,
    val_data: Dataset[Any] | BatchSource | None = None,
    *,
    options: TrainOptions | None = None,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    callbacks: Sequence[Callable[[EpochMetrics], None]] = (),
    process_group: dist.ProcessGroup | None = None,
    step_callbacks: Sequence[Callable[[StepInfo], None]] = (),
    extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
) -> FitResult:
    """Train ``model`` data-parallel with every rank of ``channel``'s job; rank 0 drives.

    ``model`` must already be on its device (CUDA -> NCCL, CPU -> gloo); its initial
    parameters are taken from rank 0. ``optimizer`` and ``scheduler`` are factories: the
    optimizer's is called with the DDP parameters, or with the model itself when its first
    parameter is named ``model`` (for parameter groups by module); the scheduler's with the
    optimizer (stepped per epoch, or per optimizer step with ``scheduler_interval="step"``).
    ``callbacks`` run on the driver after each epoch; ``step_callbacks`` on every rank after
    each optimizer step (:class:`StepInfo`). ``extra_state=(save, load)``: ``save()`` is
    stored in each checkpoint, ``load(value)`` is called with it on every rank on resume.

    Batches are ``(inputs, targets)``, each a tensor or a list, tuple or dict of tensors; the
    model's output, of any structure, goes to ``loss_fn(output, targets)``, which returns a
    scalar tensor. If no default process group exists, one is initialised through
    ``channel.as_store()`` (and destroyed at the end); pass ``process_group`` to use your
    own. Blocks until training ends; raises :class:`PeerLost` if a peer dies or hangs.

    The settings ``options`` leave None (``elastic``, ``min_world_size``,
    ``max_world_size``) and the log format come from the channel's configuration
    (``channel.config``, as ``dp.connect`` resolved it; defaults for a channel opened
    otherwise), once, here.
    """
    options = options or TrainOptions()
    spec = FitSpec(
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        train_data=train_data,
        val_data=val_data,
        options=options,
        settings=resolve_settings(options, channel.config),
        scheduler=scheduler,
        callbacks=tuple(callbacks),
        process_group=process_group,
        step_callbacks=tuple(step_callbacks),
        extra_state=extra_state,
    )
    return Trainer(channel, spec).run()


def drive(channel: ControlChannel, *args: Any, **kwargs: Any) -> FitResult:
    """:func:`fit` on rank 0 (the driver). Raises if called on another rank."""
    if channel.rank != 0:
        raise ValueError(f"drive() runs on rank 0; this is rank {channel.rank}: call follow()")
    return fit(channel, *args, **kwargs)


def follow(channel: ControlChannel, *args: Any, **kwargs: Any) -> FitResult:
    """:func:`fit` on a follower (rank > 0): executes the driver's commands."""
    if channel.rank == 0:
        raise ValueError("follow() runs on ranks > 0; rank 0 calls drive()")
    return fit(channel, *args, **kwargs)
