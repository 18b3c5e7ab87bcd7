"""The strategies ``TrainOptions.strategy`` names: a new one is a module with a
:class:`Strategy` subclass and one line here."""

from __future__ import annotations

from .async_ps import AsyncPS
from .base import Strategy
from .ddp import DDP
from .local_sgd import LocalSGD

#: ``TrainOptions.strategy`` -> its class.
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, LocalSGD, AsyncPS)}

__all__ = ["DDP", "STRATEGIES", "AsyncPS", "LocalSGD", "Strategy"]
