"""torchrun's entry points (the ``torchrun.handlers`` group): ``--rdzv-backend dp-etcd``,
``dp-zmq``, ``dp-grpc``.

Apart from :mod:`.torchrun` on purpose: that module imports torch's rendezvous package,
whose first import loads every entry point of the group, ours included; an entry point
inside the module being imported would be found half-initialised (torch logged a
traceback for each, whenever a script imported the backends before torchrun had).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

Factory = Callable[["RendezvousParameters"], "RendezvousHandler"]


def _creator(scheme: str) -> Factory:
    def create(params: RendezvousParameters) -> RendezvousHandler:
        from .torchrun import create_rdzv_handler

        return create_rdzv_handler(scheme, params)

    return create


def etcd_handler() -> Factory:
    return _creator("etcd")


def zmq_handler() -> Factory:
    return _creator("zmq")


def grpc_handler() -> Factory:
    return _creator("grpc")
