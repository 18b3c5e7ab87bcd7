"""dataparallel: data-parallel PyTorch training over a pluggable control channel.

import dataparallel as dp
ch = dp.connect("tcpstore://127.0.0.1:29500", rank=r, world_size=n)  # or dp.connect(): from config
ch.rendezvous()
dp.init_process_group(ch)  # torch.distributed through the channel's store
"""

from typing import Any

from .connect import connect, observe
from .control.channel import ControlChannel
from .control.keyspace import KeySpace
from .control.registry import ChannelURL, known_schemes, parse_url, register_transport
from .control.status import RankStatus, read_job
from .errors import (
    AuthError,
    BadMessage,
    ChannelClosed,
    ConfigError,
    ControlError,
    ControlTimeout,
    PeerLeft,
    PeerLost,
    Preempted,
    Stalled,
)
from .version import __version__ as __version__

# The training loop imports torch: load it on first use, so that `dataparallel serve`
# and transports that do not need torch stay light.
_LAZY = {
    "fit": "train",
    "drive": "train",
    "follow": "train",
    "TrainOptions": "train",
    "EpochMetrics": "train",
    "StepInfo": "train",
    "FitResult": "train",
    "Regroup": "train",
    "Replicas": "train.replicas",
    "init_process_group": "control.process_group",
    "abort_process_group": "control.process_group",
    "launch": "launching.launcher",
    "in_worker": "config.environments",
    "relaunch": "launching.launcher",
    "load_config": "config",
    "JobConfig": "config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'dataparallel' has no attribute {name!r}")


__all__ = [
    "AuthError",
    "BadMessage",
    "ChannelClosed",
    "ChannelURL",
    "ConfigError",
    "ControlChannel",
    "ControlError",
    "ControlTimeout",
    "EpochMetrics",
    "FitResult",
    "JobConfig",
    "KeySpace",
    "PeerLeft",
    "PeerLost",
    "Preempted",
    "RankStatus",
    "Regroup",
    "Replicas",
    "Stalled",
    "StepInfo",
    "TrainOptions",
    "abort_process_group",
    "connect",
    "drive",
    "fit",
    "follow",
    "in_worker",
    "init_process_group",
    "known_schemes",
    "launch",
    "load_config",
    "observe",
    "parse_url",
    "read_job",
    "register_transport",
    "relaunch",
]
