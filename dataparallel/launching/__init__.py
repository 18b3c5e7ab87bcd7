"""Launching a job's processes: a node's workers under one supervisor (``dataparallel launch``),
a whole job over ssh, torchrun's rendezvous backends."""

from ..config.environments import in_worker
from .launcher import launch, relaunch

__all__ = ["in_worker", "launch", "relaunch"]
