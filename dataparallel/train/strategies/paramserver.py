"""Asynchronous data parallelism through parameter servers (``TrainOptions(strategy="async_ps")``).

The job's last ``ps_ranks`` ranks are *servers*: each holds a shard of the model's
parameters (whole tensors, balanced by size) and applies the gradients pushed to it with
the job's own optimizer; the other ranks are *workers*: each computes a gradient on its
batch, pushes it to every server and reads the parameters back, never waiting for another
worker. A worker's parameters are a few updates old by the time its gradient is applied:
that staleness is bounded. Tensor traffic is ``torch.distributed`` point-to-point on CPU
tensors over the job's process group (gloo; a CUDA model's tensors are copied), never the
control channel.

The protocol, per epoch (one message to a server is a header then, for a push, the gradient
of its shard; every answer is a header then the shard's parameters):

- a worker asks every server to *read* (``PULL``), trains on what the first server handed
  it, *pushes* its gradient (``PUSH``: applied at once), asks to read again, and so on;
  ``DONE`` when it has no more batches;
- the first server decides when a read is answered. The *staleness* of an update is the
  number of updates a server applied between the worker's read and that update. Every
  worker with a read out may push once before any other, so a read is answered only when
  ``outstanding + max(version - read of each outstanding) <= max_staleness`` (the worst case
  of every read out, this one included): the worker too far ahead waits for the slow one's
  update. The other servers answer a read once they have applied as many updates as the
  first had when it answered (a worker pushes to them before it pushes to the first, so
  those updates are on their way): a read there is at least as new as the first server's,
  and as many pushes at most land before the update, so the bound holds on every shard;
- the first server also hands out the epoch's batches (``grad_accum`` at a time) in its
  answers, so a fast worker trains more of them than a slow one: the epoch ends when its
  batches are done, not when the slowest worker's share is. A stop (a worker's flag) ends
  the handing out; every batch handed out is trained, so the count handed out is where the
  epoch stopped.

A server serves one request at a time, whole (gradient applied, answer sent), in the order
they came; a thread per worker only receives that worker's headers (a receive from one
rank ends with an error when that rank is lost, or when the group is aborted after a loss;
a receive from any rank would not). Buffers are allocated once per server (fresh large tensors per
message cost page faults: ~5x the time of a reused one here).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

PULL, PUSH, DONE = 0, 1, 2
STOP = 1  # a header flag: the sender was signalled to stop; no more batches are handed out
HEADER = (
    4  # int64 elements: (kind, flags, version to wait for, 0) asked; (version, first batch, batches, stopped) answered
)
TAG_ASK, TAG_GRAD, TAG_ANSWER, TAG_PARAMS = 701, 702, 703, 704


@dataclass(frozen=True)
class Layout:
    """Which ranks serve, which parameters (indices into ``module.parameters()``) each holds."""

    world: int
    servers: list[int]  # ranks, the first one decides the reads and hands out the batches
    owned: list[list[int]]  # per server

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], world: int, ps_ranks: int) -> Layout:
        if not 1 <= ps_ranks < world:
            raise ValueError(
                f"strategy='async_ps' needs 1 <= ps_ranks < world size ({world} ranks, ps_ranks={ps_ranks}): "
                "at least one worker beside the servers"
            )
        servers = list(range(world - ps_ranks, world))
        owned: list[list[int]] = [[] for _ in servers]
        load = [0] * len(servers)
        for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):  # largest first
            lightest = load.index(min(load))
            owned[lightest].append(index)
            load[lightest] += params[index].numel()
        return cls(world, servers, [sorted(o) for o in owned])

    @property
    def workers(self) -> list[int]:
        return list(range(self.servers[0]))

    def server_index(self, rank: int) -> int | None:
        return rank - self.servers[0] if rank >= self.servers[0] else None


def _flat_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtype = tensors[0].dtype if tensors else torch.float32
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _Shard:
    """One server's parameters as one flat CPU buffer (copied in and out)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.buffer = torch.zeros(sum(self.sizes), dtype=_flat_dtype(self.params))

    def gather(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """``tensors`` (one per parameter; None: zeros) into the buffer."""
        offset = 0
        for t, n in zip(tensors, self.sizes, strict=True):
            part = self.buffer[offset : offset + n]
            if t is None:
                part.zero_()
            else:
                part.copy_(t.detach().reshape(-1))
            offset += n
        return self.buffer

    def scatter(self, into: Sequence[torch.Tensor]) -> None:
        offset = 0
        with torch.no_grad():
            for t, n in zip(into, self.sizes, strict=True):
                t.copy_(self.buffer[offset : offset + n].view_as(t))
                offset += n


@dataclass
class Handout:
    """The epoch's batches, handed out by the first server in order: ``next`` of ``total``."""

    next: int
    total: int
    per_step: int
    stopped: bool = False

    def take(self) -> tuple[int, int]:
        if self.stopped or self.next >= self.total:
            return self.next, 0
        first, count = self.next, min(self.per_step, self.total - self.next)
        self.next += count
        return first, count


@dataclass
class Served:
    """What a server did in an epoch."""

    updates: int = 0
    staleness: int = 0  # the largest, over its updates
    held_back: int = 0  # reads answered later than asked, to keep the bound (first server only)
    handed: int | None = None  # batches handed out (first server only)
    stopped: bool = False


class Server:
    """Serves one epoch at a time: applies pushed gradients to its shard with ``optimizer``
    (which may hold every parameter: only this shard's get gradients, so only they move),
    answers reads."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: Layout,
        rank: int,
        optimizer: torch.optim.Optimizer,
        after_update: Callable[[], None],
        max_staleness: int,
        group: Any = None,
        alive: Callable[[], None] = lambda: None,
        timeout: float = 300.0,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        """``alive()`` raises once a peer is known lost (checked while no request comes);
        ``timeout``: the longest wait for a request; ``stopping()``: whether this process was
        signalled to stop (the first server then hands out no more batches)."""
        index = layout.server_index(rank)
        if index is None:
            raise ValueError(f"rank {rank} is not a server of {layout}")
        self.first = index == 0
        self.indices = layout.owned[index]  # into ``params``
        self.owned = [params[i] for i in self.indices]
        self.shard = _Shard(self.owned)
        self.grads = torch.zeros_like(self.shard.buffer)
        self.layout, self.optimizer, self.after_update = layout, optimizer, after_update
        self.max_staleness, self.group = max_staleness, group
        self.alive, self.timeout, self.stopping = alive, timeout, stopping
        self.version = 0

    def serve(self, version: int, handout: Handout | None) -> Served:
        """Until every worker said ``DONE``; ``version``: updates applied before this epoch."""
        self.version = version
        served = Served()
        outstanding: dict[int, int] = {}  # worker -> the version it read
        waiting: deque[tuple[int, int]] = deque()  # workers asking to read, in order; the version each waits for
        held: set[int] = set()  # those not answered at once
        done: set[int] = set()
        requests: queue.Queue[tuple[int, int, int, int] | BaseException] = queue.Queue()
        for worker in self.layout.workers:
            threading.Thread(target=self._listen, args=(worker, requests), daemon=True, name="dp-ps-listen").start()
        while len(done) < len(self.layout.workers):
            request = self._next(requests)
            src, kind, flags, after = request
            if handout is not None and (flags & STOP or self.stopping()):
                handout.stopped = True
            if kind == DONE:
                outstanding.pop(src, None)
                done.add(src)
            elif kind == PUSH:
                dist.recv(self.grads, src=src, group=self.group, tag=TAG_GRAD)
                read = outstanding.pop(src, self.version)
                served.staleness = max(served.staleness, self.version - read)
                self._apply()
                served.updates += 1
            if kind == PULL or (kind == PUSH and self.first):  # a push to the first server asks to read too
                waiting.append((src, after))
            while waiting and self._may_answer(outstanding, waiting[0][1]):
                worker, _ = waiting.popleft()
                if worker in held:
                    held.discard(worker)
                    served.held_back += 1
                self._answer(worker, handout)
                outstanding[worker] = self.version
            held.update(worker for worker, _ in waiting)
        if handout is not None:
            served.handed, served.stopped = handout.next, handout.stopped
        return served

    def _listen(self, worker: int, requests: queue.Queue[tuple[int, int, int, int] | BaseException]) -> None:
        """One worker's requests (headers), in order, until it is done: a receive from one rank
        each (one from any rank would not end when a peer is lost and the group aborted)."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        try:
            while True:
                dist.recv(header, src=worker, group=self.group, tag=TAG_ASK)
                kind, flags, after = int(header[0]), int(header[1]), int(header[2])
                requests.put((worker, kind, flags, after))
                if kind == DONE:
                    return
        except BaseException as err:  # handed to the serving thread, which raises it
            requests.put(err)

    def _next(self, requests: queue.Queue[tuple[int, int, int, int] | BaseException]) -> tuple[int, int, int, int]:
        """The next request from any worker, raising once a peer is lost or after ``timeout``."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                request = requests.get(timeout=0.1)
            except queue.Empty:
                self.alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"parameter server: no request from any worker in {self.timeout:g}s") from None
                continue
            if isinstance(request, BaseException):
                self.alive()  # a lost peer explains it better
                raise request
            return request

    def _may_answer(self, outstanding: dict[int, int], after: int) -> bool:
        """Whether the next read in line may be answered now: on the first server, within the
        bound; on the others, once ``after`` updates (the first server's, at its answer) are in."""
        if not self.first:
            return self.version >= after
        oldest = max((self.version - read for read in outstanding.values()), default=0)
        return len(outstanding) + oldest <= self.max_staleness

    def _apply(self) -> None:
        offset = 0
        for p, n in zip(self.owned, self.shard.sizes, strict=True):
            p.grad = self.grads[offset : offset + n].view_as(p).to(p.device, p.dtype)
            offset += n
        self.optimizer.step()
        for p in self.owned:
            p.grad = None
        self.version += 1
        self.after_update()

    def _answer(self, worker: int, handout: Handout | None) -> None:
        first, count = handout.take() if handout is not None else (0, 0)
        stopped = int(handout.stopped) if handout is not None else 0
        answer = torch.tensor([self.version, first, count, stopped], dtype=torch.int64)
        dist.send(answer, dst=worker, group=self.group, tag=TAG_ANSWER)
        dist.send(self.shard.gather(self.owned), dst=worker, group=self.group, tag=TAG_PARAMS)


@dataclass
class Answer:
    version: int
    first: int  # the first batch handed out (dynamic batches)
    count: int  # how many (0: none left)
    stopped: bool


@dataclass
class Client:
    """A worker's side: pushes its gradients to the servers, reads their shards back into
    ``params``."""

    params: Sequence[torch.Tensor]
    layout: Layout
    group: Any = None
    shards: list[_Shard] = field(init=False)

    def __post_init__(self) -> None:
        self.shards = [_Shard([self.params[i] for i in owned]) for owned in self.layout.owned]
        self._header = torch.zeros(HEADER, dtype=torch.int64)

    def read(self, stop: bool = False) -> Answer:
        """Ask every server for its shard (the first answers when the bound allows)."""
        return self._exchange(PULL, stop)

    def push(self, stop: bool = False) -> Answer:
        """The parameters' gradients to the servers, then a read."""
        return self._exchange(PUSH, stop)

    def done(self) -> None:
        for server in self.layout.servers:
            self._ask(server, DONE, False)

    def _ask(self, server: int, kind: int, stop: bool, after: int = 0) -> None:
        self._header.copy_(torch.tensor([kind, STOP if stop else 0, after, 0]))
        dist.send(self._header, dst=server, group=self.group, tag=TAG_ASK)

    def _exchange(self, kind: int, stop: bool) -> Answer:
        servers = self.layout.servers
        if kind == PUSH:  # every shard's gradient, the first server's last: they apply them at once
            for index in [*range(1, len(servers)), 0]:
                shard, owned = self.shards[index], self.layout.owned[index]
                self._ask(servers[index], PUSH, stop)
                grads = shard.gather([self.params[i].grad for i in owned])
                dist.send(grads, dst=servers[index], group=self.group, tag=TAG_GRAD)
        else:
            self._ask(servers[0], PULL, stop)
        # The first server answers when the bound allows (a push to it asks to read); the
        # others are asked once it has, for a read at least as new as its.
        answer = self._receive(0)
        for index in range(1, len(servers)):
            self._ask(servers[index], PULL, stop, after=answer.version)
            self._receive(index)
        for p in self.params:
            p.grad = None
        return answer

    def _receive(self, index: int) -> Answer:
        server, shard = self.layout.servers[index], self.shards[index]
        answer = torch.zeros(HEADER, dtype=torch.int64)
        dist.recv(answer, src=server, group=self.group, tag=TAG_ANSWER)
        dist.recv(shard.buffer, src=server, group=self.group, tag=TAG_PARAMS)
        shard.scatter([self.params[i] for i in self.layout.owned[index]])
        version, first, count, stopped = (int(v) for v in answer)
        return Answer(version, first, count, bool(stopped))


def default_staleness(workers: int) -> int:
    """The bound when none is given: 4 per worker (a worker 3x slower than the others is not
    waited for; at equal speeds the updates are about ``workers - 1`` old)."""
    return 4 * workers
