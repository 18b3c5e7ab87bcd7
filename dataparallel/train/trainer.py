"""The distributed training loop: one driver (rank 0) decides, followers obey.

Per epoch: the driver broadcasts a command over the control channel -> every rank trains
on its shard as the strategy says (:mod:`dataparallel.train.strategies`) -> every rank
validates its shard with the bare module (no collectives) -> each rank reports (loss sum,
samples, batches, its RNG state) to the driver over the channel -> the driver aggregates,
calls callbacks, checkpoints, decides (next epoch or stop) and the next command is the
barrier.

Uneven data: a ``Dataset`` is sharded by ``DistributedSampler`` (which pads shards to equal
length, so every rank runs the same number of steps); a per-rank batch source (a callable
``(epoch, rank, world_size) -> iterable of batches``) may yield different counts per rank,
and runs under torch's ``Join`` so no rank blocks in an all-reduce its peers never make.

Failure: the watchdog (:mod:`~dataparallel.train.watchdog`) aborts the process group when a
peer is lost, and the loop raises :class:`PeerLost` naming the rank and the epoch; with
``elastic`` the survivors regroup instead (:mod:`~dataparallel.train.elastic`). Stop signals:
:mod:`~dataparallel.train.preemption`; checkpoints and resume:
:mod:`~dataparallel.train.checkpoint`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sized
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..control.channel import ControlChannel
from ..control.process_group import init_process_group
from ..control.status import record_event
from ..errors import ControlError, PeerLost, Preempted
from .checkpoint import Checkpoints
from .data import count, first_parameter, hits, to_device
from .elastic import ElasticState
from .options import FitResult
from .position import EpochPosition, Sums, padded, rng_state
from .preemption import StopSignals
from .reports import Reports
from .spec import Batch, BatchSource, FitSpec
from .strategies import STRATEGIES
from .watchdog import Watchdog, explain

if TYPE_CHECKING:
    from ..control.status_http import StatusServer

log = logging.getLogger(__name__)


class Trainer:
    """One rank's ``fit``: the state every concern works on (channel, rank, model, optimizer,
    history, where in the epoch), and the epochs' orchestration."""

    def __init__(self, channel: ControlChannel, spec: FitSpec) -> None:
        self.spec = spec
        self.opts = spec.options
        self.settings = spec.settings
        self.elastic = ElasticState(self)
        channel = self.elastic.take_seat(channel)  # a newcomer's join queue: the seat it is given
        self.ch: ControlChannel = channel
        if channel.rank is None:
            raise ValueError(f"{channel!r} holds no rank: open it with dataparallel.connect")
        self.rank: int = channel.rank
        self.world: int = channel.world_size
        self.model = spec.model
        self.loss_fn = spec.loss_fn
        self.train_data, self.val_data = spec.train_data, spec.val_data
        self.global_step = 0
        self.device = next(self.model.parameters()).device
        self._own_pg = False
        self.pg = spec.process_group
        self.ddp: DistributedDataParallel  # the model, wrapped by the strategy (Strategy.wrap)
        self.epoch = -1  # the epoch being trained (for messages)
        self.told_uneven = False
        self.ran_uneven = False  # the last epoch's ranks had different batch counts (under Join)
        #: The per-rank batch and accumulation in use (``keep_global_batch`` changes them with the world).
        self.batch_size, self.grad_accum = self.opts.batch_size, self.opts.grad_accum
        #: Where this rank takes up the next epoch it trains (a resume, a regroup mid-epoch):
        #: its sums so far, the batches of its shard to skip, the RNG state to take once the
        #: loader has started (:meth:`EpochPosition.of_rank`). None: the epoch's start.
        self.resume_at: EpochPosition | None = None
        #: The samples left of the current epoch, where it goes on mid-way on another number of
        #: ranks (a regroup, a resume): every rank takes its share of them. None: the sampler's.
        self.base: list[int] | None = None
        self.poll_stride = 1  # optimizer steps between stop polls (the driver's choice, per epoch)
        self.elastic.begin(channel)
        self.watchdog = Watchdog(self)
        self.stops = StopSignals(self)
        self.reports = Reports(self, self.settings.log_format)
        self.checkpoints = Checkpoints(self)
        self.strategy = STRATEGIES[self.opts.strategy](self)
        self.history = FitResult()
        self.status_server: StatusServer | None = None  # the driver's, with status_http

    # ------------------------------------------------------------------ setup
    def publish_status(self) -> None:
        """Publish what this rank is doing on the job's channel (:mod:`dataparallel.control.status`);
        again on each channel an elastic regroup moves it to."""
        status = self.ch.status
        status.device = str(self.device)
        status.at(step=self.global_step)
        if status.publishing:
            return
        status.publish()
        record_event(self.ch, "join", f"rank {self.rank} of {self.world}: pid {os.getpid()}, {self.device}")

    def _serve_status(self) -> None:
        """On the driver, with ``status_http``: serve the job's view over HTTP."""
        if self.rank != 0 or self.opts.status_http is None or self.status_server is not None:
            return
        from ..control.status import JobWatch, read_job
        from ..control.status_http import StatusServer, parse_address

        watch = JobWatch()  # ages on this process's clock
        look = lambda: read_job(self.ch, world_size=self.world, watch=watch)  # noqa: E731 (the channel of the moment)
        self.status_server = StatusServer(look, parse_address(self.opts.status_http), self.ch.token).start()
        log.warning("job %r: status served at %s (/, /status.json, /metrics)", self.ch.job, self.status_server.url)

    def _setup(self) -> None:
        self.publish_status()
        self._serve_status()
        self.ch.status.enter("rendezvous")
        if self.settings.elastic:
            self.elastic.check()
        # A newcomer's members wait for it as long as this (then carry on without it).
        self.ch.rendezvous(timeout=self.elastic.grow_timeout() if self.elastic.admission is not None else None)
        # After the rendezvous: a rank whose first batch fails ends (with its coordinator, on
        # rank 0) only once every rank has joined, so where every rank's fails (the same model
        # and loss), each reports that cause itself rather than a coordinator gone.
        self.ch.status.enter("setup")
        self._preflight()
        if self.pg is None:
            if not dist.is_initialized():
                init_process_group(self.ch, device=self.device, timeout=self.opts.collective_timeout)
                self._own_pg = True
            self.pg = dist.group.WORLD
        self.strategy.wrap()
        make = self.spec.optimizer
        self.optimizer = make(self.ddp.module if first_parameter(make) == "model" else self.ddp.parameters())
        self.scheduler = self.spec.scheduler(self.optimizer) if self.spec.scheduler else None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.opts.amp == "fp16")
        self.strategy.start()
        self.history = FitResult()
        self.start_epoch = 0
        self.best = (float("inf"), -1)  # (val loss, epoch)
        self.watchdog.start()

    def reshards(self) -> bool:
        """Whether an epoch can go on mid-way on another number of ranks (every rank's shard of
        one order the loop knows: a ``Dataset``, the default sampler, a strategy that trains
        such shards)."""
        return isinstance(self.train_data, Dataset) and self.opts.sampler is None and self.strategy.reshards()

    # ------------------------------------------------------------------ the loop
    def run(self) -> FitResult:
        started = time.monotonic()
        self.stops.catch()
        stopped = False
        try:
            self._setup()
            self.elastic.open_queue()
            epoch: int | None = None
            failure: PeerLost | None = None
            regrouped_from: ControlChannel | None = None  # the channel the last regroup left
            while True:
                try:
                    if failure is not None:  # (a loss during a regroup is regrouped from too)
                        lost, failure = failure, None
                        epoch = self.elastic.regroup(lost)
                    if epoch is None and self.elastic.admission is not None:
                        epoch = self.elastic.joined(started)
                    if epoch is None:
                        self.checkpoints.resume()
                        epoch = self.start_epoch
                    self._epochs(epoch)
                    break
                except Preempted:
                    stopped = True
                    raise
                except (RuntimeError, ControlError) as err:
                    explained = explain(self, err, self.epoch)
                    if not isinstance(explained, PeerLost) or not self.elastic.can_regroup(explained):
                        raise explained from err
                    if self.ch is regrouped_from:  # the regroup itself gave up (too few left)
                        raise explained from err
                    failure, regrouped_from = explained, self.ch
        except KeyboardInterrupt as err:
            if self.watchdog.verdict is None:
                self.strategy.failed(err)
                self.ch.status.failed(err)
                raise
            # The job stalled on this rank: its watchdog interrupted it where it stood.
            self.watchdog.await_verdict_seen()
            self.strategy.failed(self.watchdog.verdict)
            self.ch.status.failed(self.watchdog.verdict)
            raise self.watchdog.verdict from None
        except BaseException as err:
            self.strategy.failed(err)
            if not isinstance(err, Preempted):  # an agreed stop is no failure: the rank closes
                self.ch.status.failed(err)
            raise
        finally:
            try:
                self.watchdog.stop()  # first: nothing interrupts this thread once it returns
            except KeyboardInterrupt:
                if self.watchdog.verdict is None:  # the user's Ctrl-C, not the stall's interrupt
                    raise
            if self.status_server is not None:
                self.status_server.close()
                self.status_server = None
            self.stops.release(stopped)
            self.elastic.close_queue()
            if self._own_pg and self.watchdog.lost is None:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            self.elastic.close()
        self.history.rank = self.rank
        return self.history

    def _epochs(self, epoch: int) -> None:
        """Train from ``epoch`` until the driver says stop, then meet at the end."""
        while True:
            started = time.perf_counter()
            with self.ch.status.phase("command"):  # the driver's broadcast
                command = self._command(epoch)
            if command["cmd"] == "stop":
                self.history.stopped_early = command.get("early", False)
                break
            if command["cmd"] == "grow":
                self.elastic.grow(command)
                continue
            epoch = self.epoch = command["epoch"]
            if self.settings.elastic:
                position = None
                if self.resume_at is not None and self.reshards():
                    # The epoch goes on mid-way, every rank from the same point: its sums so far.
                    mine = self.resume_at
                    position = self.elastic.position(mine.batches, mine.sums, rng=mine.rng)
                self.elastic.keep(epoch, position)
                if self.resume_at is not None and position is None:
                    log.warning("rank %d: epoch %d goes on mid-way: no state to regroup from", self.rank, epoch)
                    self.elastic.snapshot = None
            stamps = [started, time.perf_counter()]
            lr = self.optimizer.param_groups[0]["lr"]  # at the epoch's first step
            self.ch.status.at(epoch=epoch)
            self.ch.status.enter("train")  # a strategy that steps in lockstep says which part of a step
            train = self.strategy.train_epoch(epoch)
            self.strategy.end_epoch()
            if self.stops.stopped_at is not None:
                self.stops.stop_here(epoch, self.stops.stopped_at, train)
            self.base = None
            stamps.append(time.perf_counter())
            with self.ch.status.phase("validation"):
                val = self._validate(epoch)
            stamps.append(time.perf_counter())
            if self.scheduler is not None and self.opts.scheduler_interval == "epoch":
                self.scheduler.step()
            with self.ch.status.phase("report"):  # the epoch's reports meet at the driver
                self._report(epoch, train, val, lr, stamps)
            epoch += 1
        self.ch.status.enter("barrier dp-fit-end")
        self.ch.barrier("dp-fit-end", timeout=self.opts.collective_timeout)
        self.ch.status.enter("done")

    def _command(self, next_epoch: int) -> dict[str, Any]:
        payload = None
        if self.rank == 0:
            stop = next_epoch >= self.opts.epochs or self._should_stop_early()
            mine = {"cmd": "train", "epoch": next_epoch, "poll_every": self.stops.poll_every()}
            if not stop:
                mine = self.elastic.admit(next_epoch) or mine
            payload = json.dumps({"cmd": "stop", "early": self._should_stop_early()} if stop else mine).encode()
        command: dict[str, Any] = json.loads(
            self.ch.broadcast("dp-command", payload, timeout=self.opts.collective_timeout)
        )
        self.poll_stride = command.get("poll_every", 1)
        return command

    def _should_stop_early(self) -> bool:
        patience = self.opts.patience
        if patience is None or not self.history.epochs or self.history.last.val_loss is None:
            return False
        return self.history.last.epoch - self.best[1] >= patience

    # ------------------------------------------------------------------ batches and steps
    def batches(
        self, data: Dataset[Any] | BatchSource, epoch: int, train: bool, among: int | None = None
    ) -> Iterable[Batch]:
        """This rank's batches of ``epoch``; for training, its share among the first ``among``
        ranks (default: all; under ``async_ps`` the workers)."""
        among = among or self.world
        if callable(data) and not isinstance(data, Dataset):
            return data(epoch, self.rank, among if train else self.world)
        sampler: Iterable[int]
        if train and self.base is not None:  # the epoch goes on mid-way: the samples left
            sampler = padded(self.base, self.world)[self.rank :: self.world]
        elif train:
            make = self.opts.sampler or DistributedSampler
            sampler = make(data, num_replicas=among, rank=self.rank, shuffle=self.opts.shuffle, seed=self.opts.seed)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
        else:
            # Validation needs no collectives: shard exactly, without the padding duplicates.
            if not isinstance(data, Sized):
                raise TypeError(f"the validation Dataset has no length (len()): {type(data).__name__}")
            sampler = range(self.rank, len(data), self.world)
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, **self.opts.loader_options)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.opts.amp is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.opts.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def uneven(self, epoch: int, batches: Iterable[Batch]) -> bool:
        """Whether ranks may have different numbers of batches this epoch: a batch source may;
        a user's sampler may (asked: the ranks compare lengths); DistributedSampler never."""
        if not isinstance(self.train_data, Dataset):
            return True
        if self.opts.sampler is None:
            return False
        try:
            mine = len(batches) if isinstance(batches, Sized) else -1
        except TypeError:  # a sampler without a length: unknown, so uneven
            mine = -1
        timeout = self.opts.collective_timeout
        counts = [int(c) for c in self.ch.all_gather(f"dp-batches-{epoch}", str(mine).encode(), timeout=timeout)]
        uneven = len(set(counts)) > 1 or -1 in counts
        if uneven and self.rank == 0 and not self.told_uneven:
            self.told_uneven = True
            log.warning(
                "the sampler gives the ranks different numbers of batches (%s): such epochs train under Join, "
                "which costs a collective per step",
                counts,
            )
        return uneven

    def step(self, epoch: int, batch: int, loss: torch.Tensor) -> None:
        """An optimizer step (gradients clipped, scaled as ``amp`` says), the scheduler's where
        it steps per step, then :meth:`stepped`."""
        if self.opts.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), self.opts.clip_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self.opts.scheduler_interval == "step":
            self.scheduler.step()
        self.global_step += 1
        self.stepped(epoch, batch, loss, lr)

    def stepped(self, epoch: int, batch: int, loss: torch.Tensor, lr: float) -> None:
        """After an optimizer step (``global_step`` counts it): the step callbacks, the log line."""
        self.reports.stepped(epoch, batch, loss, lr)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def _validate(self, epoch: int) -> tuple[float, int, int, int]:
        if self.val_data is None:
            return 0.0, 0, 0, 0
        module = self.ddp.module
        module.eval()
        loss_sum, samples, correct = 0.0, 0, 0
        classified = 0
        for batch in self.batches(self.val_data, epoch, train=False):
            out, loss, y = self._evaluate(module, batch)
            n = count(y)
            loss_sum += float(loss) * n
            samples += n
            scored = hits(out, y)
            if scored is not None:
                correct += scored
                classified += n
        return loss_sum, samples, correct, classified

    def _evaluate(self, module: torch.nn.Module, batch: Batch) -> tuple[Any, torch.Tensor, Any]:
        """(output, loss, targets on the device) of one ``(inputs, targets)`` batch."""
        x, y = batch
        x, y = to_device(x, self.device), to_device(y, self.device)
        with self.autocast():
            out = module(x)
            return out, self.loss_fn(out, y), y

    @torch.no_grad()
    def _preflight(self) -> None:
        """One training and one validation batch through the model and ``loss_fn`` right after
        the rendezvous, so that a model or loss that cannot take the data fails in seconds,
        not after an epoch. Changes nothing: eval mode, no gradients, RNG states restored."""
        module, epoch = self.model, 0
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        try:
            module.eval()
            for what, data, train in (("training", self.train_data, True), ("validation", self.val_data, False)):
                if data is None:
                    continue
                first = next(iter(self.batches(data, epoch, train=train)), None)
                if first is None:
                    continue
                try:
                    out, loss, y = self._evaluate(module, first)
                    float(loss)
                    hits(out, y)
                except Exception as err:
                    message = (
                        f"rank {self.rank}: the first {what} batch failed before training started (batches "
                        f"are (inputs, targets); loss_fn(model(inputs), targets) must give a scalar tensor): "
                        f"{type(err).__name__}: {err}"
                    )
                    try:
                        wrapped = type(err)(message)  # the same type, for callers that catch it
                    except Exception:
                        wrapped = RuntimeError(message)
                    raise wrapped from err
        finally:
            module.train()
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    # ------------------------------------------------------------------ an epoch's end
    def _report(
        self, epoch: int, train: Sums, val: tuple[float, int, int, int], lr: float, stamps: list[float]
    ) -> None:
        """Every rank's loss sums and counts to every rank (each keeps the same history);
        the RNG states only to the driver, and only when it writes a checkpoint."""
        mine = {"train": train, "val": val}
        timeout = self.opts.collective_timeout
        reports = self.ch.all_gather(f"dp-report-{epoch}", json.dumps(mine).encode(), timeout=timeout)
        rng_states = None
        if self.checkpoints.due(epoch):
            rng_states = self.ch.gather(f"dp-rng-{epoch}", rng_state().encode(), dst=0, timeout=timeout)
        parsed = [json.loads(r) for r in reports]
        if self.ran_uneven:
            self.sync_after_join([p["train"][2] for p in parsed])
        metrics = self.reports.metrics(epoch, parsed, lr, [*stamps, time.perf_counter()])
        self.history.epochs.append(metrics)
        if metrics.val_loss is not None and metrics.val_loss < self.best[0]:
            self.best = (metrics.val_loss, epoch)
        if self.rank == 0:
            self.reports.print_epoch(metrics)
            for callback in self.spec.callbacks:
                callback(metrics)
            if rng_states is not None:
                self.checkpoints.save(epoch, [state.decode() for state in rng_states])

    def sync_after_join(self, batches: list[int]) -> None:
        """After an epoch of uneven batch counts, Join gave every rank the parameters of the
        rank that stepped last, but a rank that ran out early skipped the optimizer steps of
        the others' extra batches: its momentum (and loss-scaler) state is behind, and the
        replicas would drift apart from the next step on. Copy that state from the rank with
        the most batches (the one a single process would match)."""
        if len(set(batches)) <= 1:
            return
        source = batches.index(max(batches))
        # The scheduler and the step count too: stepped per optimizer step, they are behind as well.
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        mine = (self.optimizer.state_dict(), self.scaler.state_dict(), scheduler, self.global_step)
        box: list[Any] = [mine] if self.rank == source else [None]
        dist.broadcast_object_list(box, group=self.pg, group_src=source)
        if self.rank != source:
            optimizer_state, scaler_state, scheduler_state, self.global_step = box[0]
            self.optimizer.load_state_dict(optimizer_state)
            self.scaler.load_state_dict(scaler_state)
            if self.scheduler is not None:
                self.scheduler.load_state_dict(scheduler_state)
