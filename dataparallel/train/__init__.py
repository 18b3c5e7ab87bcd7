"""Data-parallel training over a control channel: ``dp.fit`` (:mod:`.api`), its options and
results (:mod:`.options`), the trainer (:mod:`.trainer`) and its concerns (strategies,
elastic generations, checkpoints, stop signals, the watchdog, reports)."""

from .api import drive, fit, follow
from .options import EpochMetrics, FitResult, Regroup, StepInfo, TrainOptions

__all__ = ["EpochMetrics", "FitResult", "Regroup", "StepInfo", "TrainOptions", "drive", "fit", "follow"]
