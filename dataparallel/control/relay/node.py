"""The node relay: one process per node speaks for its ranks to the job's channel.

The relay holds ``upstream``, a channel of any transport (a user's own included) on which
it is one member: rank ``node_rank`` of ``nodes`` (under a job of the caller's choosing, say
``JOB~nodes``). The ranks' keys go under a prefix of their own in that channel's key space
(:data:`RANKS`), so that their claims, runs and heartbeats never meet the relays'. Its
node's ranks reach
it through the local leg (:mod:`.local`) with a :class:`~dataparallel.transports.relay.RelayedChannel`
each, and through it:

- **key/value operations pass through**: each rank's hook call (``_set``, ``_get``, ``_add``,
  ...) becomes the same hook call on ``upstream``, made while the rank waits and answered with
  the upstream's answer or error: nothing is acknowledged locally, so what a rank reads and
  writes is exactly what a directly connected rank would (linearizable, applied once, as the
  upstream transport guarantees its own calls);
- **a barrier crosses the network once per node**: the node's ranks meet in the local leg
  (no request each), the relay enters the same barrier once on ``upstream`` among the
  ``nodes`` relays, and releases its ranks with the outcome, error included; a job of one
  node does not cross at all (its ranks meeting is the barrier).

Not yet aggregated (each rank's requests pass through one by one, so they are correct but
cost what a directly connected rank's cost): joining, heartbeats, broadcast and the gathers.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ...errors import BadMessage, ControlError
from ..liveness import loss_report
from .local import ERROR, OK, Call, Geometry, LocalServer, error_bytes

if TYPE_CHECKING:
    from ..channel import ControlChannel

log = logging.getLogger(__name__)

#: Where the ranks' keys live in the relays' channel.
RANKS = "ranks/"

#: The pass-through operations' numbers on the local leg.
SET, GET, ADD, COMPARE_SET, DELETE, CHECK, NUM_KEYS, MULTI_GET, MULTI_SET, APPEND = range(1, 11)
#: A rank's registration of where its loss is reported (its run's loss key), and its
#: withdrawal when it closes (a clean departure is no loss).
WATCH, UNWATCH = 11, 12


def pack(*fields: bytes) -> bytes:
    """Fields as ``count, (length, bytes)...`` (little-endian u32s): the pass-through's framing."""
    out = [struct.pack("<I", len(fields))]
    for field in fields:
        out.append(struct.pack("<I", len(field)))
        out.append(field)
    return b"".join(out)


def unpack(data: bytes) -> list[bytes]:
    """The fields :func:`pack` framed; BadMessage for anything else."""
    try:
        (count,) = struct.unpack_from("<I", data)
        at, fields = 4, []
        for _ in range(count):
            (length,) = struct.unpack_from("<I", data, at)
            at += 4
            if at + length > len(data):
                raise BadMessage("relay: a field runs past its frame")
            fields.append(data[at : at + length])
            at += length
    except struct.error as err:
        raise BadMessage(f"relay: a malformed frame ({err})") from None
    if at != len(data):
        raise BadMessage("relay: bytes after a frame's fields")
    return fields


def _text(field: bytes) -> str:
    """A rank's key, under the ranks' prefix."""
    return RANKS + field.decode("utf-8", errors="surrogatepass")


def _float(field: bytes) -> float:
    return struct.unpack("<d", field)[0]


def _int(field: bytes) -> int:
    return struct.unpack("<q", field)[0]


#: Seconds a relayed read's upstream wait ends before the rank's (at most a tenth of it):
#: the answer crosses back within the rank's bound, as a coordinator's does (remote.server_wait).
READ_GRACE = 0.25


def upstream_wait(timeout: float) -> float:
    """How long the relay's upstream read waits for a rank's read of ``timeout`` seconds."""
    return max(timeout - min(READ_GRACE, timeout / 10), 1e-3)


def _serve_op(up: ControlChannel, op: int, f: list[bytes]) -> bytes:
    """One pass-through operation on ``up``'s hooks, its answer framed."""
    if op == SET:
        up._set(_text(f[0]), f[1])
        return b""
    if op == GET:
        value = up._get(_text(f[0]), upstream_wait(_float(f[1])))
        return pack() if value is None else pack(value)
    if op == ADD:
        return struct.pack("<q", up._add(_text(f[0]), _int(f[1])))
    if op == COMPARE_SET:
        return up._compare_set(_text(f[0]), f[1], f[2])
    if op == DELETE:
        return b"\x01" if up._delete(_text(f[0])) else b"\x00"
    if op == CHECK:
        return b"\x01" if up._check([_text(k) for k in f]) else b"\x00"
    if op == NUM_KEYS:
        return struct.pack("<q", up._num_keys())
    if op == MULTI_GET:
        values = up._multi_get([_text(k) for k in f[1:]], upstream_wait(_float(f[0])))
        return pack() if values is None else pack(b"", *values)  # a leading field: found
    if op == MULTI_SET:
        up._multi_set([(_text(f[i]), f[i + 1]) for i in range(0, len(f), 2)])
        return b""
    if op == APPEND:
        up._append(_text(f[0]), f[1])
        return b""
    raise BadMessage(f"relay: no operation {op}")


class NodeRelay:
    """Serves ``local_ranks`` ranks of node ``node_rank`` (ranks ``first_rank`` on, by default
    ``node_rank * local_ranks``, of ``world_size``, by default ``nodes * local_ranks``: nodes
    of different sizes give both) through the local leg in ``directory``, speaking for them on
    ``upstream``, a channel joined as rank ``node_rank`` of ``nodes`` (see the module
    docstring). ``on_gone(rank, how)``: told when a local rank's process ends or closes (its
    job rank)."""

    def __init__(
        self,
        upstream: ControlChannel,
        directory: str | os.PathLike[str],
        *,
        local_ranks: int,
        node_rank: int,
        nodes: int,
        job: str,
        geometry: Geometry | None = None,
        on_gone: Callable[[int, str], None] | None = None,
        first_rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.upstream = upstream
        self.local_ranks, self.node_rank, self.nodes = local_ranks, node_rank, nodes
        self.first_rank = node_rank * local_ranks if first_rank is None else first_rank
        self.world_size = nodes * local_ranks if world_size is None else world_size
        if not 0 <= self.first_rank <= self.world_size - local_ranks:
            last = self.first_rank + local_ranks - 1
            raise ValueError(f"ranks {self.first_rank}..{last} do not fit a world of {self.world_size}")
        self._on_gone = on_gone
        geometry = geometry or Geometry()
        # A thread for every call that can be in flight (each slot of each rank may wait in a
        # get); the node's barriers cross one at a time, in order, on a thread of their own.
        self._pool = ThreadPoolExecutor(max_workers=local_ranks * geometry.slots, thread_name_prefix="dp-relay")
        self._crossing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-relay-barrier")
        # Loss reports on a thread of their own: never queued behind the ranks' waiting reads.
        self._reporting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dp-relay-loss")
        # Local rank -> its run's loss key in the upstream's key space; read and written on the
        # local leg's loop thread alone (it calls _handle and _gone).
        self._watched: dict[int, str] = {}
        info = {"job": job, "world_size": self.world_size, "node_rank": node_rank, "nodes": nodes}
        self.server = LocalServer(
            directory,
            local_ranks,
            self._handle,
            self._gone,
            geometry,
            self._barrier,
            first_rank=self.first_rank,
            info=info,
        )
        self.path = self.server.path

    def close(self) -> None:
        self.server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._crossing.shutdown(wait=False, cancel_futures=True)
        self._reporting.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> NodeRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ serving
    def _handle(self, call: Call) -> None:
        if call.op in (WATCH, UNWATCH):
            try:
                fields = unpack(call.payload)
                if call.op == WATCH:
                    self._watched[call.rank] = _text(fields[0])
                else:
                    self._watched.pop(call.rank, None)
            except (BadMessage, IndexError) as err:
                call.fail(BadMessage(f"relay: a bad watch request ({err})"))
            else:
                call.reply(b"")
            return
        self._pool.submit(self._serve, call)

    def _serve(self, call: Call) -> None:
        try:
            reply = _serve_op(self.upstream, call.op, unpack(call.payload))
        except (ControlError, ValueError) as err:  # ValueError: _add on a value that is no number
            call.fail(err)
        except Exception as err:  # a transport's bug: the rank gets an error, the relay goes on
            log.exception("relay: operation %d of rank %d failed", call.op, self.first_rank + call.rank)
            call.fail(ControlError(f"relay: {type(err).__name__}: {err}"))
        else:
            call.reply(reply)

    def _barrier(self, generation: int, name: bytes | None, timeout: float) -> None:
        if name is None:
            error = BadMessage(f"the ranks of node {self.node_rank} entered different barriers")
            self.server.release(generation, ERROR, error_bytes(error))
            return
        if self.nodes == 1:  # the node is the whole job: its ranks have all met
            self.server.release(generation, OK)
            return
        text = name.decode("utf-8", errors="surrogatepass")
        self._crossing.submit(self._cross, generation, text, timeout if timeout > 0 else None)

    def _cross(self, generation: int, name: str, timeout: float | None) -> None:
        try:
            self.upstream.barrier(name, timeout=timeout)
        except ControlError as err:
            self.server.release(generation, ERROR, error_bytes(err))
        except Exception as err:
            log.exception("relay: barrier %r failed", name)
            self.server.release(generation, ERROR, error_bytes(ControlError(f"relay: {type(err).__name__}: {err}")))
        else:
            self.server.release(generation, OK)

    def _gone(self, local: int, how: str) -> None:
        rank = self.first_rank + local
        log.info("relay: rank %d (local %d) %s", rank, local, how)
        key = self._watched.pop(local, None)
        if key is not None:  # it had joined its job and not closed: a loss, reported at once
            pid = self.server.pid_of(local)
            self._reporting.submit(self._report_loss, rank, key, f"{how} (pid {pid} on this node)")
        if self._on_gone is not None:
            self._on_gone(rank, how)

    def _report_loss(self, rank: int, key: str, how: str) -> None:
        """Publish rank's loss where its run's ranks read losses (first report wins): every
        rank of the job raises PeerLost on its liveness's next tick, without waiting out the
        liveness timeout."""
        report = loss_report(rank, time.time(), how, f"node {self.node_rank}'s relay")
        try:
            self.upstream._compare_set(key, b"", report)
        except Exception as err:  # the heartbeats still tell, within the liveness timeout
            log.warning("relay: could not report rank %d lost: %s", rank, err)
