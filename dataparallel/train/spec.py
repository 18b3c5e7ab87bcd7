"""What one ``dp.fit`` call trains, resolved once: :class:`FitSpec` (the caller's model,
data, factories and callbacks, its options, the settings resolved from the channel's
configuration) goes from ``fit`` to the trainer whole; nothing below reads a setting again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from .options import EpochMetrics, StepInfo, TrainOptions, check_settings

if TYPE_CHECKING:
    from ..config import JobConfig

Batch = Any
LossFn = Callable[[Any, Any], torch.Tensor]  # (model output, targets) -> scalar loss
BatchSource = Callable[[int, int, int], Iterable[Batch]]


@dataclass(frozen=True)
class Settings:
    """The job's settings the training follows, each from the options where they give it,
    else from the channel's configuration (``channel.config``), else the default."""

    elastic: bool = False
    min_world_size: int = 1
    #: None: the world size the job started with.
    max_world_size: int | None = None
    #: ``"json"``: the epoch's and step's lines are JSON objects (``--log-format json``).
    log_format: str = "text"


def resolve_settings(options: TrainOptions, config: JobConfig | None) -> Settings:
    """The :class:`Settings` for ``options`` on a channel configured by ``config`` (None: a
    channel opened without ``dp.connect``: the defaults), checked as a whole."""
    elastic = options.elastic if options.elastic is not None else bool(config is not None and config.elastic)
    fewest = options.min_world_size
    if fewest is None:
        fewest = (config.min_world_size if config is not None else None) or 1
    most = options.max_world_size
    if most is None and config is not None:
        most = config.max_world_size
    check_settings(options, elastic, fewest, most)
    return Settings(elastic, fewest, most, config.log_format if config is not None else "text")


@dataclass(frozen=True)
class FitSpec:
    """One ``fit`` call's inputs, as the trainer takes them (see :func:`dataparallel.fit`)."""

    model: torch.nn.Module
    loss_fn: LossFn
    optimizer: Callable[[Any], torch.optim.Optimizer]
    train_data: Dataset[Any] | BatchSource
    val_data: Dataset[Any] | BatchSource | None
    options: TrainOptions
    settings: Settings
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    callbacks: Sequence[Callable[[EpochMetrics], None]] = ()
    process_group: dist.ProcessGroup | None = None
    step_callbacks: Sequence[Callable[[StepInfo], None]] = ()
    extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
