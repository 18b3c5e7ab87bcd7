"""``strategy="async_ps"``: the job's last ``ps_ranks`` ranks serve the parameters, the
others train and push their gradients, each as it comes (the wire side:
:mod:`dataparallel.train.strategies.paramserver`). At an epoch's end every rank takes the
servers' parameters and optimizer state, so that validation and checkpoints see one replica."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Sized
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ...control.process_group import abort_process_group, new_gloo_group
from ...errors import ChannelClosed, ControlError, ControlTimeout, PeerLeft, PeerLost, Preempted
from ..data import count, on_cpu, to_device
from ..position import Sums, order, set_rng_state
from . import paramserver
from .base import Strategy

if TYPE_CHECKING:
    from ..options import TrainOptions
    from ..trainer import Trainer

#: The key a rank that fails on an error of its own sets ("RANK why").
PS_FAILED = "dp-ps-failed"


class AsyncPS(Strategy):
    """This rank's side: a server of its shard (with the job's optimizer and scheduler) or a
    worker's client. The tensors go over a gloo group on the CPU (a new one where the job's
    is NCCL: gloo receives from any rank)."""

    name = "async_ps"

    @classmethod
    def check(cls, options: TrainOptions, elastic: bool | None) -> None:
        if elastic or options.amp == "fp16":
            raise ValueError(
                "strategy='async_ps' works without elastic (a lost worker or server ends the job with PeerLost) "
                "and without amp='fp16' (the servers' optimizer steps take no loss scale): "
                f"elastic={elastic!r}, amp={options.amp!r}"
            )

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.side: paramserver.Server | paramserver.Client | None = None
        self.group: Any = None  # the group its tensors go over (gloo)
        self.params: list[torch.Tensor] = []  # the parameters the servers hold, in their numbering
        self.buffers_at_start: list[torch.Tensor] = []  # the module's buffers at the epoch's start
        self.served: list[dict[str, Any]] = []  # the servers' figures of the last epoch (every rank's)

    def start(self) -> None:
        t = self.t
        params = self.params = self._trainable()  # the servers' numbering, fixed for the run
        layout = paramserver.Layout.of(params, t.world, t.opts.ps_ranks)
        group = t.pg
        if dist.get_backend(t.pg) != "gloo":
            group = new_gloo_group(t.ch, t.opts.collective_timeout)
        self.group = group
        if layout.server_index(t.rank) is None:
            self.side = paramserver.Client(params, layout, group)
            return
        bound = t.opts.max_staleness
        if bound is None:
            bound = paramserver.default_staleness(len(layout.workers))
        scheduler = t.scheduler if t.opts.scheduler_interval == "step" else None
        self.side = paramserver.Server(
            params,
            layout,
            t.rank,
            t.optimizer,
            scheduler.step if scheduler else lambda: None,
            bound,
            group,
            alive=self._alive,
            timeout=t.opts.collective_timeout,
            stopping=lambda: t.stops.signalled is not None,
        )

    # ------------------------------------------------------------------ failures
    def explain(self, err: Exception) -> Exception | None:
        """A peer that failed on its own ended this one's exchange with it."""
        with contextlib.suppress(ControlError):
            return self._failed_peer()
        return None

    def failed(self, err: BaseException) -> None:
        """This rank's own failure, for the peers that wait on it without a collective (a
        server for its requests, a worker for the servers): best effort."""
        if self.side is None or isinstance(err, (PeerLost, ChannelClosed, Preempted)):
            return  # (not this rank's own failure, or the others know already)
        t = self.t
        with contextlib.suppress(Exception):
            t.ch.compare_set(PS_FAILED, b"", f"{t.rank} {type(err).__name__}: {err}"[:500].encode())

    def abort(self) -> None:
        if self.group is not None and self.group is not self.t.pg:
            abort_process_group(self.group)

    def _alive(self) -> None:
        """Raises once the watchdog has found a peer lost (explained as PeerLost by the loop),
        or once a peer said it failed on an error of its own (PeerLeft: it will not come,
        though it may have closed its channel cleanly, which no heartbeat shows)."""
        t = self.t
        if t.watchdog.lost is not None:
            raise RuntimeError(f"rank {t.rank}: {t.watchdog.lost}")
        failed = self._failed_peer()
        if failed is not None:
            raise failed

    def _failed_peer(self) -> PeerLeft | None:
        """The peer that said it failed, if one did."""
        t = self.t
        if not t.ch.check([PS_FAILED]):
            return None
        rank, _, why = t.ch.get(PS_FAILED).decode().partition(" ")
        return PeerLeft(int(rank), f"async_ps epoch {t.epoch}: it failed ({why})", f"epoch {t.epoch}")

    # ------------------------------------------------------------------ layout
    def _trainable(self) -> list[torch.Tensor]:
        """The parameters the servers hold: the optimizer's that take gradients, in its order."""
        return [p for group in self.t.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def data_layout(self) -> tuple[str, int]:
        if self._hands_out():
            return ("handed", self.t.batch_size)
        if self.side is None:
            raise RuntimeError("async_ps: no side before start()")
        return ("shares", len(self.side.layout.workers))

    def _hands_out(self) -> bool:
        """Whether the first server hands the epoch's batches out (a map-style ``Dataset``, the
        default sampler) rather than each worker training its own share (a batch source, a
        sampler)."""
        data = self.t.train_data
        return isinstance(data, Dataset) and isinstance(data, Sized) and self.t.opts.sampler is None

    def figures(self) -> tuple[int | None, int]:
        served = self.served
        return (max(s["staleness"] for s in served) if served else None), sum(s["held_back"] for s in served)

    # ------------------------------------------------------------------ an epoch
    def train_epoch(self, epoch: int) -> Sums:
        """Workers train and push, servers serve; then every rank waits for the servers to be
        done (on the control channel, as long as every peer lives: a worker done early waits
        for the slowest one's last batches) and takes their parameters and optimizer state
        (collectives)."""
        t = self.t
        t.ddp.train()
        train, start, rng = (0.0, 0, 0), 0, None
        if t.resume_at is not None:  # resumed mid-epoch (a stop signal's checkpoint)
            train, start, rng = t.resume_at.sums, t.resume_at.batches, t.resume_at.rng
            t.resume_at = None
        t.stops.stopped_at = None
        self.buffers_at_start = [b.detach().cpu().clone() for b in t.ddp.module.buffers()]
        served_key = f"dp-ps-served-{epoch}"
        if isinstance(self.side, paramserver.Server):
            if rng is not None:
                set_rng_state(rng)
            handout = None
            if self.side.first:
                total = self._handout_size() if self._hands_out() else 0
                handout = paramserver.Handout(start, total, t.grad_accum)
            served = self.side.serve(t.global_step, handout)
            mine: dict[str, Any] | None = {"served": asdict(served), **self._shard_state()}
            if self.side.first:
                t.ch.set(served_key, b"1")
        else:
            train = self._work(epoch, start, train, rng)
            mine = None
        self._await_key(served_key)
        handed = self._settle(mine, train[2] if isinstance(self.side, paramserver.Client) else 0)
        if t.stops.polls() and t.stops.agreed(last=True):
            t.stops.stopped_at = handed if self._hands_out() else train[2]
        return train

    def _await_key(self, key: str) -> None:
        """Until ``key`` is set on the channel, as long as no peer is lost (a slow peer is
        waited for; a lost one raises, explained as PeerLost)."""
        while True:
            self._alive()
            try:
                self.t.ch.wait([key], timeout=1.0)
                return
            except ControlTimeout:
                continue

    def _handout_size(self) -> int:
        """How many batches the first server hands out in an epoch (``drop_last`` as the
        ``loader_options`` say)."""
        t = self.t
        samples = len(t.train_data)  # type: ignore[arg-type]
        if t.opts.loader_options.get("drop_last"):
            return samples // t.batch_size
        return -(-samples // t.batch_size)

    def _work(self, epoch: int, start: int, sums: Sums, rng: str | None) -> Sums:
        """A worker's epoch: read, train on the batches handed out (or on its share), push,
        read... ``start``: the batches of the epoch done before (handed out, or of its share);
        ``rng``: the RNG state to take once the batches have started."""
        t, client = self.t, self.side
        if not isinstance(client, paramserver.Client):
            raise RuntimeError("a server does not train")
        module, k = t.ddp.module, t.grad_accum
        loss_sum, samples, n_batches = sums
        bar = t.reports.open_bar(epoch, None)
        batch_order: list[int] = []
        shares = None
        if self._hands_out():
            batch_order = order(t.train_data, epoch, 1, None, t.opts.shuffle, t.opts.seed)
        else:
            workers = len(client.layout.workers)
            shares = iter(t.batches(t.train_data, epoch, True, workers))
            for _ in itertools.islice(shares, start):  # this worker's batches before a stop
                pass
        if rng is not None:
            set_rng_state(rng)  # after the loader's start, which draws from it
        answer = client.read(stop=t.stops.signalled is not None)
        batch = start - 1  # the last batch trained (of the epoch, or of this worker's share)
        while True:
            group: Iterable[tuple[int, Any]]
            if shares is None:
                handed = range(answer.first, answer.first + answer.count)
                group = ((b, self._fetch(batch_order, b)) for b in handed)
            else:
                group = zip(itertools.count(batch + 1), itertools.islice(shares, 0 if answer.stopped else k))
            loss = None
            for b, (x, y) in group:
                batch = b
                x, y = to_device(x, t.device), to_device(y, t.device)
                with t.autocast():
                    loss = t.loss_fn(module(x), y)
                (loss / k).backward()
                n = count(y)
                loss_sum, samples, n_batches = loss_sum + float(loss.detach()) * n, samples + n, n_batches + 1
                if bar is not None:
                    bar.update()
            if loss is None:  # nothing handed out, or this worker's share done
                break
            if t.opts.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), t.opts.clip_grad_norm)
            lr = t.optimizer.param_groups[0]["lr"]
            answer = client.push(stop=t.stops.signalled is not None)
            t.global_step = answer.version
            t.stepped(epoch, batch, loss, lr)
        client.done()
        t.reports.close_bar()
        return loss_sum, samples, n_batches

    def _fetch(self, batch_order: list[int], batch: int) -> Any:
        """Batch number ``batch`` of the epoch's order (a map-style Dataset's), read and
        collated in this process (``collate_fn`` from ``loader_options``; loader processes
        are not used for batches handed out one by one)."""
        from torch.utils.data import default_collate

        t = self.t
        collate = t.opts.loader_options.get("collate_fn") or default_collate
        dataset: Any = t.train_data
        return collate([dataset[i] for i in batch_order[batch * t.batch_size : (batch + 1) * t.batch_size]])

    # ------------------------------------------------------------------ an epoch's end
    def _shard_state(self) -> dict[str, Any]:
        """A server's shard at an epoch's end: its parameters, their optimizer state (indexed
        as the optimizer indexes them), the scheduler, the updates applied."""
        server, t = self.side, self.t
        if not isinstance(server, paramserver.Server):
            raise RuntimeError("only a server has a shard")
        params = self.params
        index = self._indices()
        state = t.optimizer.state_dict()
        mine = {index[id(p)] for p in server.owned}
        return {
            "params": {i: on_cpu(params[i].detach()) for i in server.indices},
            "state": {i: on_cpu(v) for i, v in state["state"].items() if i in mine},
            "groups": state["param_groups"],
            "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
            "version": server.version,
        }

    def _indices(self) -> dict[int, int]:
        """The optimizer's index of each parameter (by ``id``), as its ``state_dict`` numbers them."""
        flat = (p for group in self.t.optimizer.param_groups for p in group["params"])
        return {id(p): i for i, p in enumerate(flat)}

    def _settle(self, mine: dict[str, Any] | None, trained: int) -> int:
        """The end of an async epoch, on every rank: the servers' parameters, optimizer state,
        scheduler and update count everywhere; the module's buffers (batch-norm statistics)
        from the workers, weighted by the batches each trained this epoch (``trained``: this
        rank's), integer ones (batch counts) advanced by every worker's steps. Returns the
        batches handed out."""
        t = self.t
        shards: list[Any] = [None] * t.world
        dist.all_gather_object(shards, mine, group=self.group)
        shards = [s for s in shards if s is not None]
        params = self.params
        merged = dict(t.optimizer.state_dict()["state"])  # a frozen parameter's state stays
        with torch.no_grad():
            for shard in shards:
                for i, value in shard["params"].items():
                    params[i].copy_(value)
                merged.update(shard["state"])
        t.optimizer.load_state_dict({"state": merged, "param_groups": shards[0]["groups"]})
        if t.scheduler is not None and shards[0]["scheduler"] is not None:
            t.scheduler.load_state_dict(shards[0]["scheduler"])
        t.global_step = int(shards[0]["version"])
        self._settle_buffers(trained)
        self.served = [shard["served"] for shard in shards]
        return int(self.served[0]["handed"] or 0)

    def _settle_buffers(self, trained: int) -> None:
        """Every rank's buffers: floating-point ones the workers' average weighted by their
        batches this epoch, integer ones the epoch's start plus every worker's increments
        (servers and idle workers add nothing)."""
        buffers = list(self.t.ddp.module.buffers())
        if not buffers:
            return
        weight = torch.tensor([float(trained)], dtype=torch.float64)
        dist.all_reduce(weight, group=self.group)
        with torch.no_grad():
            for b, start in zip(buffers, self.buffers_at_start, strict=True):
                mine = b.detach().cpu()
                if b.is_floating_point():
                    total = mine.double() * trained
                    dist.all_reduce(total, group=self.group)
                    if weight.item() > 0:
                        b.copy_((total / weight.item()).to(b.dtype))
                else:
                    total = mine - start
                    dist.all_reduce(total, group=self.group)
                    b.copy_(start + total)
