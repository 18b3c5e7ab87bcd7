"""Our channels as torchrun rendezvous backends: ``dp-etcd``, ``dp-zmq``, ``dp-grpc``.

    torchrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend dp-etcd \\
             --rdzv-endpoint etcd1:2379 --rdzv-id job42 train.py

torch finds the handlers through the ``torchrun.handlers`` entry-point group (see
``torch.distributed.elastic.rendezvous.registry``). Each is torch's own *dynamic* rendezvous
(elastic membership between ``min`` and ``max`` nodes, keep-alive heartbeats, re-rendezvous
when a worker group restarts, closing) over a backend that keeps the rendezvous state in our
channel with ``compare_set``, the same way torch's ``c10d`` backend does with a TCPStore. With
``dp-etcd`` that gives torchrun an etcd v3 rendezvous (its own etcd backends speak v2 only).

- ``dp-zmq``/``dp-grpc``: the agent that can bind the endpoint hosts the coordinator (as
  torch's ``c10d`` backend hosts its TCPStore); the others connect to it.
- ``--rdzv-conf``: transport options (``curve=1``, ``tls=1``, ``ca=...``, ``liveness_timeout``...)
  go into the channel URL; ``read_timeout`` (seconds, default 60) bounds each call.
- The token comes from ``DP_TOKEN``.
- Workers find the rendezvous round in ``DP_RDZV_ROUND``; ``dataparallel.connect()`` in a
  worker names its job after it, so a restarted group never meets the keys of the last one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from .channel import COMMON_OPTIONS, ControlChannel
from .errors import ControlError
from .registry import parse_url, transport_class
from .wire import MAX_FRAME

DEFAULT_PORTS = {"etcd": 2379, "zmq": 29400, "grpc": 29400}
#: Set in the agent (and so in its workers) to the rendezvous round: see ``dataparallel.config``.
ROUND_ENV = "DP_RDZV_ROUND"


class ChannelRendezvousBackend(RendezvousBackend):
    """The state of a dynamic rendezvous in one channel key, replaced by ``compare_set``.

    The token of a state is the state's bytes (as in torch's ``c10d`` backend): ``set_state``
    succeeds only if the stored state is still the one the caller read.
    """

    def __init__(self, channel: ControlChannel, run_id: str, name: str) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string")
        self._channel = channel
        self._name = name
        self._key = f"torch.rendezvous.{run_id}.state"

    @property
    def name(self) -> str:
        return self._name

    def get_state(self) -> tuple[bytes, Token] | None:
        def read() -> bytes | None:
            if not self._channel.check([self._key]):
                return None
            return self._channel.get(self._key)

        state = self._call(read)
        return None if state is None else (state, state)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if len(state) > MAX_FRAME // 2:
            raise RendezvousConnectionError(f"rendezvous state of {len(state)} bytes is too large")
        if token is not None and not isinstance(token, bytes):
            current = self.get_state()  # a token from elsewhere: report the state, change nothing
            return None if current is None else (*current, False)
        expected = token if token else b""  # b"": only if no state exists yet
        current = self._call(lambda: self._channel.compare_set(self._key, expected, state))
        return current, current, current == state

    def _call(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except ControlError as err:
            raise RendezvousConnectionError(f"{self._name}: the control channel failed: {err}") from err


def create_rdzv_handler(scheme: str, params: RendezvousParameters) -> RendezvousHandler:
    """A dynamic rendezvous handler over a ``scheme`` channel at ``params.endpoint``."""
    cls = transport_class(scheme)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORTS.get(scheme, 29400))
    allowed = {**COMMON_OPTIONS, **cls.OPTIONS}
    options = {key: str(value) for key, value in params.config.items() if key in allowed}
    query = "&".join(f"{key}={value}" for key, value in sorted(options.items()))
    host = f"[{host}]" if ":" in host else host
    url = parse_url(f"{scheme}://{host}:{port}" + (f"?{query}" if query else ""))
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    try:
        channel = cls(
            url,
            rank=None,  # the agents are not ranks of the channel: dynamic rendezvous numbers them
            world_size=max(1, params.max_nodes),
            job=f"torchrun.{params.run_id}",
            token=os.environ.get("DP_TOKEN") or None,
            timeout=float(read_timeout),
        )
    except ControlError as err:
        raise RendezvousConnectionError(f"dp-{scheme}: cannot reach {url.raw}: {err}") from err
    backend = ChannelRendezvousBackend(channel, params.run_id, f"dp-{scheme}")
    handler = create_handler(channel.as_store(), backend, params)
    handler._dp_channel = channel  # kept alive (and hosting, if it does) as long as the handler
    inner = handler.next_rendezvous

    def next_rendezvous():
        # Tell the workers which round they belong to: the same on every node, unlike
        # TORCHELASTIC_RESTART_COUNT (a node whose workers did not fail restarts them
        # without counting). Workers inherit the agent's environment.
        info = inner()
        holder = getattr(handler, "_state_holder", None)
        state = getattr(holder, "state", None)
        if state is not None:
            os.environ[ROUND_ENV] = str(state.round)
        return info

    handler.next_rendezvous = next_rendezvous
    return handler


def _creator(scheme: str) -> Callable[[RendezvousParameters], RendezvousHandler]:
    def create(params: RendezvousParameters) -> RendezvousHandler:
        return create_rdzv_handler(scheme, params)

    return create


# Entry points of the ``torchrun.handlers`` group: torch calls each to get a handler factory.
def etcd_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return _creator("etcd")


def zmq_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return _creator("zmq")


def grpc_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return _creator("grpc")
