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
- ``--rdzv-endpoint``: ``HOST[:PORT]``; for ``dp-etcd`` a comma-separated list of members.
- ``--rdzv-conf``: transport options (``curve=1``, ``tls=1``, ``ca=...``, ``liveness_timeout``...)
  go into the channel URL; ``read_timeout`` (seconds > 0, default 60) bounds each call.
- The token comes from ``DP_TOKEN``, else the configuration file's ``token_file``
  (``DP_CONFIG``, else ``./dataparallel.toml``), as for ``dataparallel.connect``, and is checked
  as ``dataparallel.connect`` checks it: an agent with another token, or none, is refused.
  The state is framed (magic, version, generation, length) and signed with a key derived
  from the token: a value the backend did not write, or one written without the token, is a
  ``RendezvousStateError``; so is a state of an older generation than one the agent has seen
  (an earlier state written back: a replay).
- Workers find the rendezvous round in ``DP_RDZV_ROUND``; ``dataparallel.connect()`` in a
  worker names its job after it, so a restarted group never meets the keys of the last one.
- ``--rdzv-conf relay=1``: each agent hosts its node's relay
  (:mod:`dataparallel.launching.relay`), one per rendezvous round, joined upstream as node
  ``GROUP_RANK`` of the round's nodes before the workers start; the workers' channel is the
  relay (``relay://...``), and their control traffic crosses the network once per node. The
  node's ranks are ``GROUP_RANK * nproc-per-node`` on (torchrun's own assignment where every
  node runs as many workers), the count read from torchrun's command line as torchrun reads it.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..config import load_token
from ..control.channel import ControlChannel
from ..control.registry import ChannelURL, resolve
from ..control.wire import MAX_FRAME, purpose_key
from ..errors import AuthError, ControlError

#: ``--rdzv-conf`` keys that torch's dynamic rendezvous (or torchrun itself) reads, and ours
#: (``read_timeout``, ``relay``); every other key is a transport option, validated as in a URL.
TORCH_RDZV_CONF = frozenset(
    {
        "timeout",
        "rank",
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "read_timeout",
        "relay",
    }
)
DEFAULT_PORTS = {"etcd": 2379, "zmq": 29400, "grpc": 29400}
#: Set in the agent (and so in its workers) to the rendezvous round: see ``dataparallel.config``.
ROUND_ENV = "DP_RDZV_ROUND"
#: The rendezvous channel's URL, for the workers (inherited): their ``dp.connect()`` default.
URL_ENV = "DP_RDZV_URL"

#: The stored state: magic, format version, generation (one more than that of the state it
#: replaced), state length, the state, HMAC-SHA256 of the place it is stored at (job and key,
#: not stored) and all before: a state signed for another run or job does not open here.
STATE_MAGIC = b"DPRZ"
STATE_VERSION = 3  # 2: the generation; 3: the place under the MAC
_HEADER = struct.Struct(">4sBQI")
_MAC = 32


def _state_mac(key: bytes, place: bytes, body: bytes) -> bytes:
    mac = hmac.new(key, struct.pack(">I", len(place)) + place, "sha256")
    mac.update(body)
    return mac.digest()


def frame_state(state: bytes, key: bytes, generation: int, place: bytes) -> bytes:
    body = _HEADER.pack(STATE_MAGIC, STATE_VERSION, generation, len(state)) + state
    return body + _state_mac(key, place, body)


def unframe_state(stored: bytes, key: bytes, place: bytes) -> tuple[int, bytes]:
    """The generation and the state inside ``stored``; :class:`RendezvousStateError` if this
    backend (with this token) did not write it at ``place``."""
    if len(stored) < _HEADER.size + _MAC:
        raise RendezvousStateError(f"the stored rendezvous state ({len(stored)} bytes) is not one this backend wrote")
    magic, version, generation, length = _HEADER.unpack_from(stored)
    if magic != STATE_MAGIC or version != STATE_VERSION or length != len(stored) - _HEADER.size - _MAC:
        raise RendezvousStateError(
            f"the stored rendezvous state is not one this backend wrote (magic {magic!r}, version {version}, "
            f"length {length} of {len(stored)} bytes)"
        )
    if not hmac.compare_digest(stored[-_MAC:], _state_mac(key, place, stored[:-_MAC])):
        raise RendezvousStateError(
            "the stored rendezvous state is not signed with this job's token for this run (another token, or "
            "a state of another run or job copied here)"
        )
    return generation, stored[_HEADER.size : -_MAC]


class ChannelRendezvousBackend(RendezvousBackend):
    """The state of a dynamic rendezvous in one channel key, replaced by ``compare_set``.

    The token of a state is the state's bytes (as in torch's ``c10d`` backend): ``set_state``
    succeeds only if the stored state is still the one the caller read. Each state written
    carries a generation above every one this backend has seen, and a stored state below that
    is refused: whoever can write the store without the token can still write back a state
    signed earlier, and the backend must not go back to it.
    """

    def __init__(self, channel: ControlChannel, run_id: str, name: str) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string")
        self._channel = channel
        self._name = name
        self._key = f"torch.rendezvous.{run_id}.state"
        self._mac_key = purpose_key(channel.token, "rendezvous-state")
        self._place = f"{channel.job}\x00{self._key}".encode()
        self._seen = 0  # the highest generation read or written

    @property
    def name(self) -> str:
        return self._name

    def get_state(self) -> tuple[bytes, Token] | None:
        def read() -> bytes | None:
            if not self._channel.check([self._key]):
                return None
            return self._channel.get(self._key)

        stored = self._call(read)
        return None if stored is None else (self._open(stored), stored)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if len(state) > MAX_FRAME // 2:
            raise RendezvousConnectionError(f"rendezvous state of {len(state)} bytes is too large")
        if token is not None and not isinstance(token, bytes):
            current = self.get_state()  # a token from elsewhere: report the state, change nothing
            return None if current is None else (*current, False)
        framed = frame_state(state, self._mac_key, self._seen + 1, self._place)
        expected = token if token else b""  # b"": only if no state exists yet
        stored = self._call(lambda: self._channel.compare_set(self._key, expected, framed))
        return self._open(stored), stored, stored == framed

    def _open(self, stored: bytes) -> bytes:
        generation, state = unframe_state(stored, self._mac_key, self._place)
        if generation < self._seen:
            raise RendezvousStateError(
                f"the stored rendezvous state is of generation {generation}, older than generation "
                f"{self._seen} which this agent has seen: an earlier state was written back (replayed)"
            )
        self._seen = generation
        return state

    def _call(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except ControlError as err:
            raise RendezvousConnectionError(f"{self._name}: the control channel failed: {err}") from err


def create_rdzv_handler(scheme: str, params: RendezvousParameters) -> RendezvousHandler:
    """A dynamic rendezvous handler over a ``scheme`` channel at ``params.endpoint``."""
    endpoints = [e.strip() for e in params.endpoint.split(",") if e.strip()] or [""]
    if len(endpoints) > 1 and scheme != "etcd":
        raise ValueError(f"dp-{scheme}: --rdzv-endpoint names one coordinator HOST:PORT, got {params.endpoint!r}")
    hosts = []
    for endpoint in endpoints:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORTS.get(scheme, 29400))
        hosts.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    options = {key: str(value) for key, value in params.config.items() if key not in TORCH_RDZV_CONF}
    query = urlencode(sorted(options.items()))  # a password may hold & or %
    token, _ = load_token()  # DP_TOKEN, else the configuration file's token_file
    url, cls = resolve(f"{scheme}://{','.join(hosts)}" + (f"?{query}" if query else ""), token, where="--rdzv-conf")
    read_timeout = _read_timeout(params)
    nprocs = _relay_ranks(params)
    relays = None if nprocs is None else NodeRelays(url, cls, token, nprocs)
    try:
        channel = cls(
            url,
            rank=None,  # the agents are not ranks of the channel: dynamic rendezvous numbers them
            world_size=max(1, params.max_nodes),
            job=f"torchrun.{params.run_id}",
            token=token,
            timeout=read_timeout,
        )
    except AuthError as err:
        if not cls.native_auth:  # refused credentials of the URL's own (etcd's user=/password=)
            raise RendezvousConnectionError(f"dp-{scheme}: {err}") from err
        raise RendezvousConnectionError(
            f"dp-{scheme}: {url.shown} refused this agent's token (DP_TOKEN): {err}"
        ) from err
    except ControlError as err:
        raise RendezvousConnectionError(f"dp-{scheme}: cannot reach {url.shown}: {err}") from err
    try:
        if not channel.native_auth:
            channel.agree_on_token()  # as dp.connect does; the coordinators check it themselves
    except ControlError as err:
        channel.close()
        raise RendezvousConnectionError(
            f"dp-{scheme}: {url.shown}: this agent's token (DP_TOKEN) differs from the job's: {err}"
        ) from err
    backend = ChannelRendezvousBackend(channel, params.run_id, f"dp-{scheme}")
    return ChannelRendezvousHandler(create_handler(channel.as_store(), backend, params), channel, url.raw, relays)


class NodeRelays:
    """The agent's node relay (``--rdzv-conf relay=1``): one for each rendezvous round, for
    the ``nprocs`` workers the agent starts in it, closed when the next round starts or the
    agent ends."""

    def __init__(self, url: ChannelURL, cls: type[ControlChannel], token: str | None, nprocs: int) -> None:
        from ..config import load_config

        self.url, self.cls, self.token, self.nprocs = url, cls, token, nprocs
        # The settings the relay takes from the configuration, as dataparallel.connect() in a
        # worker reads them (the file, DP_*), and from nothing else of the agent's own
        # environment: what torchrun sets for its workers (RANK...) is not yet set, or stale.
        env = {k: os.environ[k] for k in ("DP_CONFIG", "DP_JOB", "DP_TIMEOUT", "DP_ELASTIC") if k in os.environ}
        config = load_config(env=env)
        if config.elastic:
            raise ValueError(
                f"relay=1 (from --rdzv-conf) and {config.describe('elastic')} together: a node relay serves a "
                "fixed set of ranks (torchrun's own --nnodes MIN:MAX resizes the job between rounds)"
            )
        self.job, self.timeout = config.job, config.timeout  # the workers' job before its round
        self._round: contextlib.ExitStack | None = None
        # Closed before the interpreter joins executor threads at its exit (an agent ended by
        # a signal does not shut its handler down, and a relay's thread may wait upstream in
        # a barrier until its timeout); atexit would run only after that join.
        threading._register_atexit(self.close)  # type: ignore[attr-defined]

    def _join(self, job: str) -> ControlChannel:
        """The relay's channel: node ``self._node`` of ``self._nodes`` in ``job``, made as
        the handler's own is (not through dataparallel.connect, which would read the
        agent's whole environment)."""
        from ..control.relay.node import upstream_timeout

        channel = self.cls(
            self.url,
            rank=self._node,
            world_size=self._nodes,
            job=job,
            token=self.token,
            timeout=upstream_timeout(self.timeout),
        )
        try:
            if not channel.native_auth:
                channel.agree_on_token()
            channel._join()
        except BaseException:
            channel.close()
            raise
        return channel

    def start(self, round_: int, node_rank: int, nodes: int) -> str:
        """Round ``round_``'s relay, this agent being node ``node_rank`` of ``nodes``; the
        last round's closed first. Returns the URL the workers connect to."""
        from .relay import hosted_relay

        self.close()
        self._node, self._nodes = node_rank, nodes
        stack = contextlib.ExitStack()
        url = stack.enter_context(
            hosted_relay(
                self._join,
                f"{self.job}.round{round_}",
                node_rank=node_rank,
                nodes=nodes,
                nprocs=self.nprocs,
                first_rank=node_rank * self.nprocs,
                world=nodes * self.nprocs,
                shown=self.url.shown,
                log=sys.stderr,
                prefix="[dataparallel] ",
            )
        )
        self._round = stack
        return url

    def close(self) -> None:
        stack, self._round = self._round, None
        if stack is not None:
            stack.close()


class ChannelRendezvousHandler(RendezvousHandler):
    """torch's dynamic rendezvous handler over a channel's backend, which also tells the
    workers which round they belong to and which channel is theirs, and keeps the channel
    open (and hosting, if it does) as long as it lives. Everything else is torch's."""

    def __init__(
        self, inner: DynamicRendezvousHandler, channel: ControlChannel, url: str, relays: NodeRelays | None = None
    ) -> None:
        self.inner, self.channel, self._url, self._relays = inner, channel, url, relays

    def next_rendezvous(self) -> RendezvousInfo:
        # The round is the same on every node, unlike TORCHELASTIC_RESTART_COUNT (a node whose
        # workers did not fail restarts them without counting). Workers inherit the agent's
        # environment.
        info = self.inner.next_rendezvous()
        holder = getattr(self.inner, "_state_holder", None)
        state = getattr(holder, "state", None)
        url = self._url
        if self._relays is not None:
            if state is None:
                raise RendezvousStateError("relay=1: torch's rendezvous handler no longer says its round")
            try:
                url = self._relays.start(state.round, info.rank, info.world_size)
            except ControlError as err:
                raise RendezvousConnectionError(f"the node relay could not join the job: {err}") from err
        os.environ[URL_ENV] = url  # and which channel: their dp.connect()'s default
        if state is not None:
            os.environ[ROUND_ENV] = str(state.round)
        return info

    def get_backend(self) -> str:
        return self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        if self._relays is not None:
            self._relays.close()
        return self.inner.shutdown()


def _relay_ranks(params: RendezvousParameters) -> int | None:
    """With ``relay=1`` in ``--rdzv-conf``: how many workers the agent starts on its node (its
    ``--nproc-per-node``, read from torchrun's command line by torchrun's own parser); None
    without a relay."""
    raw = str(params.config.get("relay", "0")).strip().lower()
    if raw in ("0", "false", "no", "off", ""):
        return None
    if raw not in ("1", "true", "yes", "on"):
        raise ValueError(f"relay (from --rdzv-conf) is 1 or 0, got {params.config.get('relay')!r}")
    import torch.distributed.run as run

    command = os.path.basename(sys.argv[0])
    if command != "torchrun" and os.path.realpath(sys.argv[0]) != os.path.realpath(run.__file__):
        raise ValueError(
            f"relay=1 (from --rdzv-conf) reads the workers per node from torchrun's --nproc-per-node: this "
            f"agent was not started by torchrun ({sys.argv[0]!r})"
        )
    args = run.get_args_parser().parse_args(sys.argv[1:])
    return run.determine_local_world_size(args.nproc_per_node)


def _read_timeout(params: RendezvousParameters) -> float:
    raw = params.config.get("read_timeout")
    if raw is None:
        return 60.0
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"read_timeout (from --rdzv-conf) must be a number of seconds > 0, got {raw!r}")
    return value
