"""Node relays started on demand, for running the conformance suite's ranks through them.

A test's ranks connect to ``relay+SCHEME://...``: the URL of the channel under test with
``relay+`` before its scheme. Such a rank (a :class:`FarmChannel`) asks the farm, a server
in the test's process (its Unix socket's path in :data:`ENV`, which the suite's worker
processes inherit), for its node's relay, and joins it as a ``relay://`` rank does. The farm
keeps one set of relays per job, world size, token and upstream URL: :data:`PER_NODE` ranks a
node (so every world of three or more spans nodes and shares one), node ``n`` a
:class:`~dataparallel.control.relay.node.NodeRelay` joined to the upstream URL as rank ``n``
of ``JOB~nodes``, each started when the first of its ranks asks. The relays live in the
test's process, as a launcher's do beside its workers: a rank killed or frozen takes no relay
with it. Where rank 0 (or a rank=None) of a job would host the transport's coordinator, the
farm does when such a rank asks, with a channel of its own (``~farm``, open until the farm
closes), as the rank would have; relays only connect, so a rank 1 asking alone waits for a
coordinator as a directly connected one does.

Written here rather than reusing the launcher: a launcher starts a node's relay before its
workers, for one job it knows; the suite's tests start jobs of every size and name from
threads and processes alike, so the relays have to come when their ranks do.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import socketserver
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dataparallel as dp
from dataparallel import errors
from dataparallel.control.channel import COMMON_OPTIONS
from dataparallel.control.registry import ChannelURL, parse_url, register_transport, resolve, transport_class
from dataparallel.control.relay.node import NodeRelay, nodes_job, upstream_timeout
from dataparallel.errors import ConfigError, ControlError
from dataparallel.transports.relay import RelayedChannel

#: The environment variable that holds the farm's socket path.
ENV = "DP_TEST_RELAY_FARM"
#: The environment variable that holds the scheme under test (a user's own, say).
SCHEMES_ENV = "DP_TEST_RELAY_SCHEME"
#: A node's ranks.
PER_NODE = 2
#: The transports a farm's URL may put behind relays (``relay+SCHEME``), and any other
#: registered through :func:`register`.
SCHEMES = ("memory", "zmq", "grpc", "tcpstore", "etcd")
PREFIX = "relay+"


def nodes_of(world_size: int) -> int:
    """How many nodes of :data:`PER_NODE` ranks a job of ``world_size`` ranks spans."""
    return -(-world_size // PER_NODE)


def register(*schemes: str) -> None:
    """Make ``relay+SCHEME`` a :class:`FarmChannel` for each of ``schemes`` (default
    :data:`SCHEMES`), in this process."""
    for scheme in schemes or SCHEMES:
        register_transport(PREFIX + scheme, FarmChannel)


@contextlib.contextmanager
def running(scheme: str | None = None) -> Iterator[RelayFarm]:
    """A farm for the length of the block, found by this process's children (:data:`ENV`),
    with ``relay+`` URLs registered for the built-ins and ``scheme`` (a user's own, say)."""
    schemes = {*SCHEMES, *([scheme] if scheme else [])}
    register(*schemes)
    farm = RelayFarm()
    saved = {name: os.environ.get(name) for name in (ENV, SCHEMES_ENV)}
    os.environ[ENV] = farm.path
    if scheme:
        os.environ[SCHEMES_ENV] = scheme
    try:
        yield farm
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        farm.close()


def register_if_farmed() -> None:
    """:func:`register`, in a process started under a farm (:data:`ENV` set), for the
    built-ins and the scheme under test (:data:`SCHEMES_ENV`): the suite's worker processes
    call it before they connect."""
    if os.environ.get(ENV):
        register(*{*SCHEMES, *filter(None, [os.environ.get(SCHEMES_ENV)])})


def split(url: ChannelURL) -> tuple[str, str]:
    """``relay+SCHEME://...``'s upstream URL (without the channel options every transport
    takes: those are the rank's) and the rank's ``relay://`` options' query."""
    base = url.raw[len(PREFIX) :].partition("?")[0]
    own = {k: v for k, v in url.options.items() if k in COMMON_OPTIONS}
    upstream = {k: v for k, v in url.options.items() if k not in COMMON_OPTIONS}
    tail = "&".join(f"{k}={v}" for k, v in upstream.items())
    return base + (f"?{tail}" if tail else ""), "&".join(f"{k}={v}" for k, v in own.items())


class FarmChannel(RelayedChannel):
    """A rank behind its node's relay in the farm (the module docstring)."""

    scheme = "relay+"
    URL_FORM = "relay+SCHEME://... (a channel URL behind node relays of the test's relay farm)"
    URL_HOST = False

    @classmethod
    def check_url(cls, url: ChannelURL, token: str | None = None, *, serving: bool = False) -> None:
        if not url.scheme.startswith(PREFIX):  # the relay's own URL
            RelayedChannel.check_url(url, token, serving=serving)
            return
        if serving:
            raise ConfigError(f"{url.shown!r}: a relayed rank serves nothing")
        upstream, _ = split(url)
        parsed = parse_url(upstream)
        transport_class(parsed.scheme).check_url(parsed, token)
        for name in COMMON_OPTIONS:
            url.seconds(name, 1.0)

    def __init__(self, url: ChannelURL, **kwargs: Any) -> None:
        self._asked: dict[str, Any] | None = None
        self._node = 0
        if not url.scheme.startswith(PREFIX):  # the relay's own URL, as RelayedChannel's
            super().__init__(url, **kwargs)
            return
        upstream, query = split(url)
        asked = {
            "upstream": upstream,
            "job": kwargs.get("job", "default"),
            "world_size": kwargs["world_size"],
            "token": kwargs.get("token"),
            "timeout": float(kwargs.get("timeout", 300.0)),
        }
        rank = kwargs.get("rank")
        path = ask(**asked, rank=rank)  # rank None: node 0's relay (or an observer's: any of the job's)
        if rank is None and kwargs["world_size"]:
            self._asked = asked  # where _claim_rank looks for a free seat, node by node
        kwargs["serve"] = False
        super().__init__(parse_url(f"relay://{path}" + (f"?{query}" if query else "")), **kwargs)

    def _claim_rank(self, rank: int | None, claimant: bytes, peer: bytes) -> tuple[int | None, bytes]:
        # rank=None: the first node's relay with a free seat (a relay hands out its own
        # node's seats only), as a launcher's process would be the one of a node with room.
        if rank is not None or self._asked is None or self._local.local_rank is not None:
            return super()._claim_rank(rank, claimant, peer)
        got: tuple[int | None, bytes] = (None, b"")
        for node in range(nodes_of(self.world_size)):
            if node != self._node:
                path = ask(**self._asked, rank=None, node=node)
                moved = self._join_relay(path)
                self._local, old = moved, self._local
                old.close()
                self._node = node
            got = super()._claim_rank(None, claimant, peer)
            if self._local.local_rank is not None:
                return got
        return got  # every node's seats held: the core judges the job full


def ask(**request: Any) -> str:
    """The farm's relay for a rank (its socket's path), or the farm's error raised as its type."""
    path = os.environ.get(ENV)
    if not path:
        raise ConfigError(f"relay+ URLs need a relay farm ({ENV} unset)")
    timeout = request["timeout"] + 5.0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            with sock.makefile("rb") as reply:
                answer = json.loads(reply.readline() or b"{}")
        except (OSError, ValueError) as err:
            raise errors.ChannelClosed(f"relay farm at {path}: {err}") from None
    if "path" in answer:
        return str(answer["path"])
    kind = getattr(errors, str(answer.get("type")), None)
    message = str(answer.get("message", "the relay farm gave no answer"))
    if isinstance(kind, type) and issubclass(kind, ControlError):
        try:
            raise kind(message)
        except TypeError:
            pass  # an error whose constructor takes more than a message
    raise ControlError(message)


def _joined(url: str, **kwargs: Any) -> dp.ControlChannel:
    """A channel joined at ``url`` that never hosts the coordinator (a relay only connects,
    waiting for it within its timeout, as a rank other than 0 does)."""
    parsed, cls = resolve(url, kwargs.get("token"))
    channel = cls(parsed, serve=False, **kwargs)
    try:
        channel._join()
    except BaseException:
        channel.close()
        raise
    return channel


class _Node:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.upstream: dp.ControlChannel | None = None
        self.relay: NodeRelay | None = None


class _Server(socketserver.ThreadingUnixStreamServer):
    request_queue_size = 512  # ranks of many jobs ask at once (a full backlog: EAGAIN)


class RelayFarm:
    """The farm: serves :func:`ask` on a Unix socket (:attr:`path`) until :meth:`close`, which
    closes every relay it started and its upstream channel."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="dpfarm"))  # short: a socket's path is at most 107 bytes
        self.path = str(self._dir / "farm.sock")
        self._lock = threading.Lock()
        self._nodes: dict[tuple[Any, ...], _Node] = {}
        self._hosts: dict[str, _Node] = {}  # upstream URL -> the channel that hosted (or found) its coordinator
        self._closed = False
        farm = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    request = json.loads(self.rfile.readline())
                    answer: dict[str, Any] = {"path": farm.relay_path(**request)}
                except Exception as err:  # told to the rank, as its own error
                    answer = {"type": type(err).__name__, "message": str(err)}
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        self._server = _Server(self.path, Handler)
        self._server.daemon_threads = True
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="relay-farm", daemon=True)
        self._thread.start()

    def relay_path(
        self,
        *,
        upstream: str,
        job: str,
        world_size: int,
        rank: int | None,
        token: str | None,
        timeout: float,
        node: int | None = None,
    ) -> str:
        """The socket of the relay of ``rank``'s node (with None, of node ``node``, by
        default 0), started if it was not; an observer's (``world_size`` 0): that of any
        relay of the job's, whatever its token (the channel checks it), starting none."""
        if not world_size:
            with self._lock:
                for (up, of, *_), entry in self._nodes.items():
                    if (up, of) == (upstream, job) and entry.relay is not None:
                        return str(entry.relay.path)
            raise ControlError(f"job {job!r} has no run at {upstream}: no relay of it in the farm")
        nodes = nodes_of(world_size)
        node = (node or 0) if rank is None else rank // PER_NODE
        if not 0 <= node < nodes:
            raise ConfigError(f"node {node} of {nodes}")
        if rank in (0, None):
            self._host(upstream, token, timeout)
        key = (upstream, job, world_size, token, node)
        with self._lock:
            if self._closed:
                raise errors.ChannelClosed("the relay farm is closed")
            entry = self._nodes.setdefault(key, _Node())
            index = len(self._nodes)
        with entry.lock:  # close() takes it too: a relay being started is closed once it is
            if self._closed:
                raise errors.ChannelClosed("the relay farm is closed")
            if entry.relay is None:
                up = _joined(
                    upstream,
                    rank=node,
                    world_size=nodes,
                    job=nodes_job(job),
                    token=token,
                    timeout=upstream_timeout(timeout),
                )
                try:
                    relay = NodeRelay(
                        up,
                        self._dir / f"r{index}",
                        local_ranks=min(PER_NODE, world_size - node * PER_NODE),
                        node_rank=node,
                        nodes=nodes,
                        job=job,
                        first_rank=node * PER_NODE,
                        world_size=world_size,
                    )
                except BaseException:
                    up.close()
                    raise
                entry.upstream, entry.relay = up, relay
            return str(entry.relay.path)

    def _host(self, upstream: str, token: str | None, timeout: float) -> None:
        """Host ``upstream``'s coordinator where a rank 0 of it would (its port free), once."""
        with self._lock:
            if self._closed:
                raise errors.ChannelClosed("the relay farm is closed")
            entry = self._hosts.setdefault(upstream, _Node())
        with entry.lock:
            if entry.upstream is None and not self._closed:
                entry.upstream = dp.connect(upstream, rank=0, world_size=1, job="~farm", token=token, timeout=timeout)

    def upstream_of(
        self, upstream: str, job: str, world_size: int, token: str | None, *, node: int
    ) -> dp.ControlChannel:
        """Node ``node``'s upstream channel in the relays of that job (KeyError: none started)."""
        channel = self._nodes[(upstream, job, world_size, token, node)].upstream
        if channel is None:
            raise KeyError(node)
        return channel

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries = list(self._nodes.items())
        self._server.shutdown()
        self._server.server_close()
        for _, entry in entries:
            with entry.lock:  # a relay being started: once it is
                if entry.relay is not None:
                    entry.relay.close()
        # The hosts' channels, which may serve the coordinators the others use, close last.
        with self._lock:
            hosts = list(self._hosts.values())
        for entry in [e for _, e in entries] + hosts:
            with entry.lock:
                if entry.upstream is not None:
                    try:
                        entry.upstream.close()
                    except ControlError:
                        pass
        shutil.rmtree(self._dir, ignore_errors=True)
