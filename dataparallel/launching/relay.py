"""A node relay hosted by the node's launcher (``dataparallel launch --relay``, or torchrun's
agent with ``--rdzv-conf relay=1``: :mod:`.torchrun`).

The launcher joins the job's channel as the node (rank ``node_rank`` of ``nodes``, job
``JOB~nodes``: on node 0 that serves the coordinator where the URL says rank 0 does) before
any worker starts, and serves the node's workers through a
:class:`~dataparallel.control.relay.node.NodeRelay` in a fresh directory of its own (mode
0700); each worker is given ``relay:///DIR/relay.sock`` as its URL. The relay lives in the
launcher, never in a worker: a worker's death takes no neighbour's channel with it. One relay
per attempt of the worker group, as the workers' job name is (a restarted group meets none of
the failed group's state); the coordinator, where node 0 hosts it, lives as long as the
launcher (:class:`RelayHost`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..config import JobConfig
from ..connect import connect
from ..control.registry import mask_url
from .supervisor import Log

if TYPE_CHECKING:
    from ..control.channel import ControlChannel


class RelayHost:
    """The node's part of a relayed job for the launcher's whole life: it joins the job's
    channel as the node (job ``JOB~launchers``; on node 0 that hosts the coordinator where
    the URL says rank 0 does, so the coordinator outlives every attempt of the worker group,
    as torchrun's agent keeps its store) and gives each attempt a relay (:meth:`attempt`).
    Closing it on node 0 waits, within the channel's close grace, for the other nodes to leave."""

    def __init__(self, config: JobConfig, url: str, *, nprocs: int, world: int, first_rank: int, log: Log) -> None:
        self.config, self.url, self.log = config, url, log
        self.nprocs, self.world, self.first_rank = nprocs, world, first_rank
        print(
            f"[launch] joining the job as node {config.node_rank} of {config.nodes} (its relay's channel)",
            file=log,
            flush=True,
        )
        self._launchers = self._join(f"{config.job}~launchers")

    def _join(self, job: str, timeout: float | None = None) -> ControlChannel:
        """The job's channel as this node, in ``job``, its calls bounded by ``timeout`` (default:
        the job's)."""
        c = self.config
        return connect(
            self.url,
            rank=c.node_rank,
            world_size=c.nodes,
            job=job,
            token=c.token,
            timeout=c.timeout if timeout is None else timeout,
            elastic=False,
        )

    def close(self) -> None:
        self._launchers.close()

    def __enter__(self) -> RelayHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def attempt(self, job: str) -> Iterator[str]:
        """The node's relay for the workers' job ``job`` (:func:`hosted_relay`); yields the URL
        its workers connect to."""
        from ..control.relay.node import upstream_timeout

        c = self.config
        with hosted_relay(
            functools.partial(self._join, timeout=upstream_timeout(c.timeout)),
            job,
            node_rank=c.node_rank,
            nodes=c.nodes,
            nprocs=self.nprocs,
            first_rank=self.first_rank,
            world=self.world,
            shown=mask_url(self.url),
            log=self.log,
        ) as url:
            yield url


@contextlib.contextmanager
def hosted_relay(
    join: Callable[[str], ControlChannel],
    job: str,
    *,
    node_rank: int,
    nodes: int,
    nprocs: int,
    first_rank: int,
    world: int,
    shown: str,
    log: Log,
    prefix: str = "[launch] ",
) -> Iterator[str]:
    """A node relay for ranks ``first_rank`` .. ``first_rank + nprocs - 1`` of the workers' job
    ``job`` (``world`` ranks), in a fresh directory of mode 0700, joined upstream as node
    ``node_rank`` of ``nodes`` by ``join(job~nodes)`` (a channel of the job's transport at
    ``shown``, its URL as it may be shown); yields the URL its workers connect to. Leaving
    closes the relay, then its channel, and removes the directory. Hosted by a node's
    launcher: ``dataparallel launch --relay`` (:class:`RelayHost`) and torchrun's agent
    (``--rdzv-conf relay=1``, :mod:`.torchrun`)."""
    from ..control.relay.node import NodeRelay, nodes_job

    with contextlib.ExitStack() as stack:  # closed in reverse: the relay, its channel, its directory
        directory = _relay_directory()
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        upstream = join(nodes_job(job))
        stack.callback(upstream.close)
        relay = NodeRelay(
            upstream,
            directory,
            local_ranks=nprocs,
            node_rank=node_rank,
            nodes=nodes,
            job=job,
            first_rank=first_rank,
            world_size=world,
        )
        stack.callback(relay.close)
        print(
            f"{prefix}node relay for ranks {first_rank}..{first_rank + nprocs - 1} at {relay.path} "
            f"(node {node_rank} of {nodes} on {shown})",
            file=log,
            flush=True,
        )
        yield f"relay://{relay.path}"


def _relay_directory() -> str:
    """A fresh directory of mode 0700 for the relay's socket: under the temporary directory,
    or under /tmp where that one's path would make the socket's too long for a Unix socket
    (108 bytes; an HPC node's TMPDIR can be long)."""
    base = tempfile.gettempdir()
    if len(os.path.join(base, "dp-relay-XXXXXXXX", "relay.sock")) > 100 and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix="dp-relay-", dir=base)
