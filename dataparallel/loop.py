"""The distributed training loop: one driver (rank 0) decides, followers obey.

Per epoch: the driver broadcasts a command over the control channel -> every rank trains
on its shard (DistributedDataParallel syncs gradients over gloo/NCCL, initialised through
``channel.as_store()``) -> every rank validates its shard with the bare module (no
collectives) -> each rank reports (loss sum, samples, batches, its RNG state) to the
driver over the channel -> the driver aggregates, calls callbacks, checkpoints, decides
(next epoch or stop) and the next command is the barrier.

Uneven data: a ``Dataset`` is sharded by ``DistributedSampler`` (which pads shards to equal
length, so every rank runs the same number of steps); a per-rank batch source (a callable
``(epoch, rank, world_size) -> iterable of batches``) may yield different counts per rank,
and runs under torch's ``Join`` so no rank blocks in an all-reduce its peers never make.

Failure: a watchdog thread on every rank watches the channel's liveness; when a peer is
lost it aborts the process group so that no rank sits in a collective, and the loop
raises :class:`PeerLost` naming the rank and the epoch. With ``elastic=True`` a lost
follower does not end the job: every rank keeps the state of the current epoch's start in
memory, and the survivors move to a new generation of the job (:mod:`dataparallel.control.membership`:
a new channel and process group over the survivors), restore that state and redo the epoch
on the smaller group, resharded; no process restarts and no file is read.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import inspect
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from . import checkpoint, paramserver
from .config import env_setting
from .control import membership as elastic
from .control.channel import ControlChannel
from .control.process_group import abort_process_group, init_process_group, new_gloo_group
from .errors import ChannelClosed, ControlError, ControlTimeout, PeerLeft, PeerLost, Preempted

log = logging.getLogger(__name__)

Batch = Any
#: About how often (seconds of training) the ranks poll for a stop signal: the most a stop
#: waits for the ranks to agree, besides a step.
STOP_POLL_SECONDS = 0.2
#: The most steps between two polls, whatever the last epoch's step time said.
MAX_POLL_STRIDE = 64
#: A stop signal repeated within this many seconds is the same stop (delivered twice, by
#: srun to every process of a step and by a launcher forwarding it); later, it acts at once.
REPEAT_SECONDS = 5.0
#: Under ``strategy="async_ps"``: the key a rank that fails on an error of its own sets ("RANK why").
PS_FAILED = "dp-ps-failed"
LossFn = Callable[[Any, Any], torch.Tensor]  # (model output, targets) -> scalar loss
BatchSource = Callable[[int, int, int], Iterable[Batch]]


@dataclass
class TrainOptions:
    """How to train. ``batch_size`` is per rank (the global batch is ``batch_size * world_size``
    per optimizer step, times ``grad_accum``)."""

    epochs: int = 1
    batch_size: int = 32
    grad_accum: int = 1
    amp: str | None = None  # "bf16" or "fp16" (fp16 uses a GradScaler)
    clip_grad_norm: float | None = None
    shuffle: bool = True
    seed: int = 0
    patience: int | None = None  # stop after this many epochs without a better validation loss
    #: What rank 0 writes after every epoch: a path, or a filesystem URL (``s3://``, ``gs://``,
    #: ``memory://``... through fsspec, where its package is installed).
    checkpoint: str | os.PathLike[str] | None = None
    resume: bool = False  # continue from ``checkpoint`` if it exists
    checkpoint_every: int = 1  # epochs between checkpoints; the last epoch's is always written
    scheduler_interval: str = "epoch"  # when the scheduler steps: "epoch", or "step" (every optimizer step)
    log_every: int | None = None  # rank 0 prints epoch, step, loss and lr every N optimizer steps
    #: More ``DataLoader`` arguments for ``Dataset`` inputs: ``num_workers``, ``pin_memory``,
    #: ``persistent_workers``, ``collate_fn``, ``prefetch_factor``... (not ``batch_size``,
    #: ``shuffle`` or ``sampler``: those are the loop's).
    loader_options: dict[str, Any] = field(default_factory=dict)
    #: The training ``Dataset``'s sampler, called every epoch as ``sampler(dataset,
    #: num_replicas=W, rank=r, shuffle=shuffle, seed=seed)`` (``DistributedSampler``'s
    #: signature: a subclass of it can be given as is), then ``set_epoch(epoch)`` where it has
    #: one. Default: ``DistributedSampler``. Ranks whose samplers give different numbers of
    #: batches train that epoch under ``Join`` (said once; it costs a collective per step).
    sampler: Callable[..., Any] | None = None
    collective_timeout: float = 300.0
    #: The driver prints one line per epoch (loss, accuracy, samples, seconds), with a tqdm bar
    #: during the epoch on a terminal (none in a log). False: neither; print your own from a
    #: callback.
    progress: bool = True
    #: Survive a lost rank without a restart: the survivors (at least ``min_world_size``)
    #: regroup as a new generation of the job and redo the current epoch from its start (or
    #: the last snapshot, ``snapshot_every``; kept in memory on every rank). The driver's
    #: loss ends the job where the coordinator goes with it (zmq, grpc, tcpstore hosted by
    #: rank 0); where it outlives it (etcd, ``dataparallel serve``) the lowest surviving rank
    #: drives on. ``fit`` must own the process group (no ``process_group=``). None: the
    #: ``elastic`` setting (``DP_ELASTIC``, as ``dataparallel launch --elastic`` sets it),
    #: else False. Newcomers (processes
    #: started later with the same settings, or a lost one started again) are admitted at
    #: epoch boundaries, up to ``max_world_size``.
    elastic: bool | None = None
    #: The fewest ranks an elastic job carries on with. None: the ``min_world_size`` setting
    #: (``DP_MIN_WORLD_SIZE``, or ``world_size = "MIN:MAX"`` in the file), else 1.
    min_world_size: int | None = None
    #: The most ranks an elastic job grows to by admitting newcomers. None: the
    #: ``max_world_size`` setting, else the world size it started with (lost ranks may be
    #: replaced, no more).
    max_world_size: int | None = None
    #: When an elastic job's world size changes: False keeps the per-rank batch (the global
    #: batch, and so the gradient noise, follows the world size; the learning rate is not
    #: rescaled). True keeps the global batch of the job's start (``batch_size`` x
    #: ``grad_accum`` x its world size): each rank's share is split into the fewest
    #: accumulation steps whose batches are at most ``batch_size`` (a batch source's batches
    #: are its own: only the accumulation changes there); a share that does not divide
    #: evenly is rounded down, said in the log.
    keep_global_batch: bool = False
    #: Elastic: besides each epoch's start, keep the state every this many optimizer steps
    #: (in memory, every rank: a copy of model and optimizer state, one all-reduce of the
    #: epoch's loss sums and one all-gather of every rank's RNG state), so that a loss redoes
    #: only the steps since then: the samples of the epoch not yet trained are resharded over
    #: the survivors. Needs a ``Dataset`` with the default sampler and ``strategy="ddp"``;
    #: elsewhere the epoch's start is kept. None: at epoch starts only.
    snapshot_every: int | None = None
    #: How the replicas agree. ``"ddp"``: gradients are averaged every optimizer step
    #: (DistributedDataParallel). ``"local_sgd"``: every rank steps its own optimizer on its
    #: own gradients, no collective per step; the parameters (and floating-point buffers) are
    #: averaged every ``sync_every`` optimizer steps, and parameters, buffers and optimizer
    #: state at the end of every epoch, so that validation, checkpoints and elastic
    #: snapshots see one replica. ``sync_every=1`` with SGD (momentum included) trains as
    #: ``"ddp"`` does; larger values trade staleness for fewer waits on a slow rank. Needs
    #: equal batch counts on every rank (a ``Dataset`` with ``DistributedSampler``, or a
    #: sampler with equal shards). ``"async_ps"``: the last ``ps_ranks`` ranks are parameter
    #: servers, holding the parameters sharded and applying the gradients the other ranks
    #: (workers) push, each as it comes, with the optimizer; a worker reads the parameters
    #: back after each push and never waits for another worker, except to keep
    #: ``max_staleness``. A ``Dataset`` (default sampler) is handed out batch by batch, so a
    #: fast worker trains more of an epoch than a slow one; a batch source or a sampler gives
    #: each worker its share. Servers validate as workers do (every rank has the same
    #: parameters at an epoch's end). Not with ``elastic`` or ``amp="fp16"``
    #: (:mod:`dataparallel.paramserver`).
    strategy: str = "ddp"
    sync_every: int = 8
    #: ``"async_ps"``: how many ranks (the job's last) are parameter servers.
    ps_ranks: int = 1
    #: ``"async_ps"``: the most updates a server applies between a worker's read of the
    #: parameters and the update from the gradient it computed on them; a worker that would
    #: make a slower one's gradient staler waits for it. 0: one worker at a time (sequential
    #: SGD). None: 4 per worker.
    max_staleness: int | None = None
    #: With ``checkpoint`` set, these signals stop training at a step boundary instead of
    #: killing the process: SIGTERM as Slurm sends it before it preempts a job or its time
    #: runs out (and as ``dataparallel launch`` forwards it), SIGUSR1 as ``sbatch
    #: --signal=USR1@120`` sends it. The ranks agree on the step (a one-element all-reduce
    #: about every 0.2 s of steps, started after one step and read after the next, so it
    #: overlaps the computation; under local SGD at its averaging steps), the driver writes the
    #: checkpoint there (the position in the epoch, every rank's RNG state and partial loss
    #: sums with it) and every rank raises :class:`Preempted` (exit code 128 + the signal).
    #: Started again with ``resume=True`` on as many ranks, the job continues from that step
    #: and ends exactly as an uninterrupted run would; on another number of ranks it goes on
    #: from that step with the epoch's samples left resharded (a ``Dataset``, the default
    #: sampler, ``"ddp"``; otherwise from the start of that epoch). The same signal again
    #: within 5 s is the same stop; later, it acts at once. Empty: signals act as they would.
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("epochs, batch_size and grad_accum must be >= 1")
        if self.amp not in (None, "bf16", "fp16"):
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {self.amp!r}")
        if self.resume and self.checkpoint is None:
            raise ValueError("resume=True needs checkpoint=PATH")
        if self.checkpoint is not None:
            checkpoint.check(self.checkpoint)  # an unknown scheme fails here, not after an epoch
        if self.checkpoint_every < 1 or (self.log_every is not None and self.log_every < 1):
            raise ValueError("checkpoint_every and log_every must be >= 1")
        if self.scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {self.scheduler_interval!r}")
        if self.elastic is None:
            self.elastic = bool(env_setting("elastic"))
        if self.min_world_size is None:
            self.min_world_size = env_setting("min_world_size") or 1
        if self.max_world_size is None:
            self.max_world_size = env_setting("max_world_size")
        if self.min_world_size < 1:
            raise ValueError(f"min_world_size must be >= 1, got {self.min_world_size!r}")
        if self.max_world_size is not None and self.max_world_size < self.min_world_size:
            raise ValueError(
                f"max_world_size ({self.max_world_size!r}) must be >= min_world_size ({self.min_world_size!r})"
            )
        if self.strategy not in ("ddp", "local_sgd", "async_ps"):
            raise ValueError(f"strategy must be 'ddp', 'local_sgd' or 'async_ps', got {self.strategy!r}")
        if self.ps_ranks < 1 or (self.max_staleness is not None and self.max_staleness < 0):
            raise ValueError(f"ps_ranks must be >= 1 and max_staleness >= 0 or None, got {self.ps_ranks!r}, "
                             f"{self.max_staleness!r}")  # fmt: skip
        if self.strategy == "async_ps" and (self.elastic or self.amp == "fp16"):
            raise ValueError(
                "strategy='async_ps' works without elastic (a lost worker or server ends the job with PeerLost) "
                "and without amp='fp16' (the servers' optimizer steps take no loss scale): "
                f"elastic={self.elastic!r}, amp={self.amp!r}"
            )
        for name in self.stop_signals:
            if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"stop_signals: {name!r} is not a signal that can be caught (e.g. 'SIGTERM')")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 or None, got {self.snapshot_every!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every!r}")
        reserved = {"batch_size", "shuffle", "sampler", "batch_sampler"} & set(self.loader_options)
        if reserved:
            raise ValueError(f"loader_options may not set {', '.join(sorted(reserved))}: the loop sets them")


@dataclass
class EpochMetrics:
    """One epoch's metrics as every rank's history has them (``FitResult.epochs``): the
    losses are means over every rank's samples, the accuracy over every rank's validation
    samples (None where the outputs are not class scores), the times the driver's."""

    epoch: int
    train_loss: float
    train_samples: int
    train_batches: int
    val_loss: float | None = None
    val_samples: int = 0
    val_accuracy: float | None = None
    lr: float | None = None  # the first parameter group's, at the epoch's first step
    seconds: float = 0.0  # the epoch on the driver: training, validation and control plane
    #: Where the driver's epoch went: its training steps (gradient all-reduce included), its
    #: validation, and the control plane (the epoch's command, its reports, any state sync).
    train_seconds: float = 0.0
    val_seconds: float = 0.0
    control_seconds: float = 0.0
    #: Batches each rank trained on (``train_batches`` is their sum).
    train_batches_per_rank: list[int] = field(default_factory=list)
    world_size: int = 0  # ranks that trained this epoch
    #: ``strategy="async_ps"``: the largest staleness of an update this epoch (updates a server
    #: applied between a worker's read and that worker's update), and how many reads the
    #: first server held back to keep ``max_staleness`` (a worker waited for a slower one).
    staleness: int | None = None
    held_back: int = 0


@dataclass(frozen=True)
class Regroup:
    """An elastic job moved to a new generation: it lost ranks, or admitted newcomers (see
    ``TrainOptions.elastic``)."""

    epoch: int  # the epoch redone by the survivors, or the first the newcomers train
    lost: list[int]  # ranks of the previous generation left behind
    world_size: int  # ranks in the new generation
    generation: int
    seconds: float  # from the failure (or the admission) to the new group's being ready
    joined: list[int] = field(default_factory=list)  # the newcomers' ranks in the new generation


@dataclass(frozen=True)
class StepInfo:
    """What a step callback gets, on every rank, after each optimizer step."""

    epoch: int
    step: int  # optimizer steps since the run began (resumes included), this one counted
    batch: int  # index of the last batch of this step within the epoch
    loss: float  # the loss of that batch, on this rank
    lr: float  # the first parameter group's learning rate used by this step
    rank: int


@dataclass
class FitResult:
    """Per-epoch metrics (the driver's aggregate; followers get the same)."""

    epochs: list[EpochMetrics] = field(default_factory=list)
    stopped_early: bool = False
    regroups: list[Regroup] = field(default_factory=list)
    #: This process's rank in the job's last generation: 0 where it drove the job at its end
    #: (in an elastic job that lost its driver, another process than the channel's rank 0).
    rank: int = 0

    @property
    def last(self) -> EpochMetrics:
        return self.epochs[-1]


def fit(
    channel: ControlChannel,
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    train_data: Dataset[Any] | BatchSource,
    val_data: Dataset[Any] | BatchSource | None = None,
    *,
    options: TrainOptions | None = None,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    callbacks: Sequence[Callable[[EpochMetrics], None]] = (),
    process_group: dist.ProcessGroup | None = None,
    step_callbacks: Sequence[Callable[[StepInfo], None]] = (),
    extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
) -> FitResult:
    """Train ``model`` data-parallel with every rank of ``channel``'s job; rank 0 drives.

    ``model`` must already be on its device (CUDA -> NCCL, CPU -> gloo); its initial
    parameters are taken from rank 0. ``optimizer`` and ``scheduler`` are factories: the
    optimizer's is called with the DDP parameters, or with the model itself when its first
    parameter is named ``model`` (for parameter groups by module); the scheduler's with the
    optimizer (stepped per epoch, or per optimizer step with ``scheduler_interval="step"``).
    ``callbacks`` run on the driver after each epoch; ``step_callbacks`` on every rank after
    each optimizer step (:class:`StepInfo`). ``extra_state=(save, load)``: ``save()`` is
    stored in each checkpoint, ``load(value)`` is called with it on every rank on resume.

    Batches are ``(inputs, targets)``, each a tensor or a list, tuple or dict of tensors; the
    model's output, of any structure, goes to ``loss_fn(output, targets)``, which returns a
    scalar tensor. If no default process group exists, one is initialised through
    ``channel.as_store()`` (and destroyed at the end); pass ``process_group`` to use your
    own. Blocks until training ends; raises :class:`PeerLost` if a peer dies or hangs.
    """
    return _Trainer(
        channel,
        model,
        loss_fn,
        optimizer,
        train_data,
        val_data,
        options or TrainOptions(),
        scheduler,
        callbacks,
        process_group,
        step_callbacks,
        extra_state,
    ).run()


def drive(channel: ControlChannel, *args: Any, **kwargs: Any) -> FitResult:
    """:func:`fit` on rank 0 (the driver). Raises if called on another rank."""
    if channel.rank != 0:
        raise ValueError(f"drive() runs on rank 0; this is rank {channel.rank}: call follow()")
    return fit(channel, *args, **kwargs)


def follow(channel: ControlChannel, *args: Any, **kwargs: Any) -> FitResult:
    """:func:`fit` on a follower (rank > 0): executes the driver's commands."""
    if channel.rank == 0:
        raise ValueError("follow() runs on ranks > 0; rank 0 calls drive()")
    return fit(channel, *args, **kwargs)


class _Trainer:
    def __init__(
        self,
        channel: ControlChannel,
        model: torch.nn.Module,
        loss_fn: LossFn,
        optimizer: Callable[[Any], torch.optim.Optimizer],
        train_data: Dataset[Any] | BatchSource,
        val_data: Dataset[Any] | BatchSource | None,
        options: TrainOptions,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None,
        callbacks: Sequence[Callable[[EpochMetrics], None]],
        pg: dist.ProcessGroup | None,
        step_callbacks: Sequence[Callable[[StepInfo], None]] = (),
        extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
    ) -> None:
        self._opened: list[ControlChannel] = []  # the generations' channels this loop opened
        #: A newcomer's seat in a running elastic job (its channel from ``dp.connect`` is to the
        #: job's join queue): waited for here, before anything else.
        self._admission: elastic.Admission | None = None
        if channel._newcomer_of is not None:
            channel = self._take_seat(channel)
        self.ch: ControlChannel = channel
        if channel.rank is None:
            raise ValueError(f"{channel!r} holds no rank: open it with dataparallel.connect")
        self.rank: int = channel.rank
        self.world: int = channel.world_size
        self.opts: TrainOptions = options
        self.model = model
        self.loss_fn = loss_fn
        self.train_data, self.val_data = train_data, val_data
        self.callbacks = callbacks
        self.step_callbacks = step_callbacks
        self.extra_state = extra_state
        self.global_step = 0
        self.device = next(model.parameters()).device
        self._own_pg = False
        self.pg = pg
        self._make_optimizer = optimizer
        self._make_scheduler = scheduler
        self._lost: PeerLost | None = None
        self._stalled = 0.0  # the longest this process stood still (stopped, or starved), seconds
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._bar: Any = None  # the driver's progress bar during an epoch
        self._told_uneven = False
        self._ran_uneven = False  # the last epoch's ranks had different batch counts (under Join)
        # Output to a log, not a terminal: no progress bar, only the epoch's line ("text", or
        # "json" as `dataparallel launch --log-format json` asks). None: a bar, then the line.
        self._lines: str | None = "json" if env_setting("log_format") == "json" else None
        if self._lines is None and not sys.stderr.isatty():
            self._lines = "text"
        self.generation = self._admission.generation if self._admission is not None else 0
        self._job = self._admission.job if self._admission is not None else channel.job  # generation 0's name
        self._queue: elastic.JoinQueue | None = None  # the driver's, for newcomers (elastic)
        self._first_world = channel.world_size if self._admission is None else self._admission.after
        self._max_world = options.max_world_size or channel.world_size
        #: The per-rank batch and accumulation in use (``keep_global_batch`` changes them with the world).
        self.batch_size, self.grad_accum = options.batch_size, options.grad_accum
        self._base_world = channel.world_size  # the job's first (a newcomer gets the driver's)
        self._snapshot: dict[str, Any] | None = None  # the current epoch's start (elastic)
        self._epoch = -1  # the epoch being trained (for messages)
        self._signalled: int | None = None  # a stop signal this process received
        self._agreed_signal = 0  # the signal the ranks agreed to stop for
        self._stop_poll: tuple[torch.Tensor, Any] | None = None  # the all-reduce of the ranks' stop flags
        self._stopped_at: int | None = None  # batches of the epoch done when the ranks agreed to stop
        #: Where a resumed epoch starts: this rank's sums so far (train), the batches of its
        #: shard to skip, the RNG state to take once the loader has started.
        self._partial: dict[str, Any] | None = None
        #: The samples left of the current epoch, where it goes on mid-way on another number of
        #: ranks (a regroup, a resume): every rank takes its share of them. None: the sampler's.
        self._base: list[int] | None = None
        self._poll_stride = 1  # optimizer steps between stop polls (the driver's choice, per epoch)
        #: ``strategy="async_ps"``: this rank's side (a server or a worker's client), the
        #: servers' figures of the last epoch (every rank has them), batches handed out in it.
        self._ps: paramserver.Server | paramserver.Client | None = None
        self._ps_group: Any = None  # the group its tensors go over (gloo)
        self._ps_params: list[torch.Tensor] = []  # the parameters the servers hold, in their numbering
        self._buffers_at_start: list[torch.Tensor] = []  # the module's buffers at the epoch's start
        self._served: list[dict[str, Any]] = []

    def _take_seat(self, queue: ControlChannel) -> ControlChannel:
        """A newcomer: wait in the join queue until the driver seats it, then join that
        generation (its channel is closed when training ends)."""
        job = queue._newcomer_of or queue.job
        admission = elastic.await_admission(queue, job)
        log.warning(
            "admitted to job %r as rank %d of %d (generation %d)",
            job, admission.rank, admission.world_size, admission.generation,
        )  # fmt: skip
        self._admission = admission
        return self._open_generation(queue, job, admission.generation, admission.rank, admission.world_size)

    def _open_generation(self, like: ControlChannel, job: str, generation: int, rank: int, size: int) -> ControlChannel:
        """A channel to ``job``'s ``generation`` as ``rank`` of ``size``, on ``like``'s
        coordinator or store with its token (closed when training ends)."""
        from .connect import connect

        new = connect(
            like.url.raw,
            rank=rank,
            world_size=size,
            job=elastic.generation_job(job, generation),
            token=like.token,
            timeout=like.timeout,
            elastic=False,
        )
        self._opened.append(new)
        return new

    def _form_group(self, new: ControlChannel, generation: int) -> None:
        """The process group of a new generation once its ranks have met, watched from the
        start (a rank lost while it forms is noticed, not waited for), DDP around the model."""
        self._meet(new, generation)
        init_process_group(new, device=self.device, timeout=self.opts.collective_timeout)
        self.pg = dist.group.WORLD
        self._start_watchdog()
        self._wrap()

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        if self.opts.elastic and (self.pg is not None or dist.is_initialized()):
            raise ValueError(
                "elastic training makes its own process groups: pass no process_group= and initialise none"
            )
        if self.opts.elastic and self.opts.max_world_size is not None and self.opts.max_world_size < self._first_world:
            raise ValueError(f"max_world_size={self.opts.max_world_size} is below the job's {self._first_world} ranks")
        if self.opts.elastic and self.ch.url.port == 0:
            raise ValueError(f"elastic training needs the coordinator at a fixed port: {self.ch.url.shown}")
        # A newcomer's members wait for it as long as this (then carry on without it).
        self.ch.rendezvous(timeout=self._grow_timeout() if self._admission is not None else None)
        # After the rendezvous: a rank whose first batch fails ends (with its coordinator, on
        # rank 0) only once every rank has joined, so where every rank's fails (the same model
        # and loss), each reports that cause itself rather than a coordinator gone.
        self._preflight()
        if self.pg is None:
            if not dist.is_initialized():
                init_process_group(self.ch, device=self.device, timeout=self.opts.collective_timeout)
                self._own_pg = True
            self.pg = dist.group.WORLD
        self._wrap()
        self.optimizer = self._make_optimizer(
            self.ddp.module if _first_parameter(self._make_optimizer) == "model" else self.ddp.parameters()
        )
        self.scheduler = self._make_scheduler(self.optimizer) if self._make_scheduler else None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.opts.amp == "fp16")
        if self.opts.strategy == "async_ps":
            self._ps = self._async_side()
        self.history = FitResult()
        self.start_epoch = 0
        self.best = (float("inf"), -1)  # (val loss, epoch)
        self._start_watchdog()

    def _wrap(self) -> None:
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=ids, process_group=self.pg)
        if self.opts.strategy == "ddp":
            self._lay_out_buckets()

    def _lay_out_buckets(self) -> None:
        """One training step's forward and backward through DDP before training, changing
        nothing, so that every step of a run uses the same gradient buckets. DDP lays its
        buckets out again after its first backward (in the order the gradients became ready),
        and an all-reduce over three or more ranks adds each element in an order that depends
        on its place in its bucket: a resumed run (or a regrouped one), whose first step would
        use the first layout where the uninterrupted run used the second, would differ in the
        last bits. Train mode (every parameter a step uses gets its gradient), the RNG states
        and the buffers (batch-norm statistics) restored, the gradients dropped, no optimizer
        step; skipped on every rank unless every rank has a first batch."""
        module = self.ddp.module
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            try:
                first = next(iter(self._batches(self.train_data, 0, train=True)), None)
                everyone = torch.tensor([0 if first is None else 1], device=self.device)
                dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.pg)
                if first is None or not everyone.item():
                    return
                x, y = _to(first[0], self.device), _to(first[1], self.device)
                with self._autocast():
                    loss = self.loss_fn(self.ddp(x), y)
                loss.float().backward()
            finally:
                self.ddp.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for name, b in module.named_buffers():
                        b.copy_(buffers[name])

    def _start_watchdog(self) -> None:
        self._lost = None
        self._stalled = 0.0
        self._stop_watch = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="dp-train-watchdog", daemon=True)
        self._watcher.start()

    def _stop_watchdog(self) -> None:
        self._stop_watch.set()
        if self._watcher is not None:  # no abort() may run while the group is destroyed
            self._watcher.join(timeout=5)

    def _watch(self) -> None:
        """Abort the process group when the channel declares a peer lost, so that no rank
        waits in a collective for a peer that will never come. It also notes when this process
        itself stood still (SIGSTOP, a starved machine) for longer than the liveness timeout:
        its peers have given it up by then, which explains its next collective failing."""
        last = time.monotonic()
        while not self._stop_watch.wait(0.2):
            now = time.monotonic()
            if now - last > self.ch.liveness_timeout:
                self._stalled = max(self._stalled, now - last)
            last = now
            lost = self.ch.lost_peers()
            if lost:
                self._lost = next(iter(lost.values()))
                log.error("rank %d: %s; aborting the process group", self.rank, self._lost)
                abort_process_group(self.pg)
                if self._ps_group is not None and self._ps_group is not self.pg:
                    abort_process_group(self._ps_group)
                return

    # ------------------------------------------------------------------ the loop
    def run(self) -> FitResult:
        self._started = time.monotonic()
        caught = self._catch_stop_signals()
        stopped = False
        try:
            self._setup()
            if self.opts.elastic and self.rank == 0:  # after the rendezvous: no first rank finds it marked
                self._queue = elastic.JoinQueue(self.ch, self._job)
            epoch: int | None = None
            failure: PeerLost | None = None
            regrouped_from: ControlChannel | None = None  # the channel the last regroup left
            while True:
                try:
                    if failure is not None:  # (a loss during a regroup is regrouped from too)
                        lost, failure = failure, None
                        epoch = self._regroup(lost)
                    if epoch is None and self._admission is not None:
                        epoch = self._share_state(self._admission.after)
                        joined = list(range(self._admission.after, self.world))
                        seconds = time.monotonic() - self._started
                        self.history.regroups.append(Regroup(epoch, [], self.world, self.generation, seconds, joined))
                    if epoch is None:
                        self._maybe_resume()
                        epoch = self.start_epoch
                    self._epochs(epoch)
                    break
                except Preempted:
                    stopped = True
                    raise
                except (RuntimeError, ControlError) as err:
                    explained = self._explain(err, self._epoch)
                    if not isinstance(explained, PeerLost) or not self._can_regroup(explained):
                        raise explained from err
                    if self.ch is regrouped_from:  # the regroup itself gave up (too few left)
                        raise explained from err
                    failure, regrouped_from = explained, self.ch
        except BaseException as err:
            self._say_failed(err)
            raise
        finally:
            for signum, handler in caught.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set from C
            if self._signalled is not None and not stopped:
                os.kill(os.getpid(), self._signalled)  # caught but not acted on: it acts now, as it would have
            self._stop_watchdog()
            self._close_queue()
            if self._own_pg and self._lost is None:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            for channel in reversed(self._opened):
                channel.close()
        self.history.rank = self.rank
        return self.history

    def _epochs(self, epoch: int) -> None:
        """Train from ``epoch`` until the driver says stop, then meet at the end."""
        while True:
            started = time.perf_counter()
            command = self._command(epoch)
            if command["cmd"] == "stop":
                self.history.stopped_early = command.get("early", False)
                break
            if command["cmd"] == "grow":
                self._grow(command)
                continue
            epoch = self._epoch = command["epoch"]
            if self.opts.elastic:
                position = None
                if self._partial is not None and self._reshards():
                    # The epoch goes on mid-way, every rank from the same point: its sums so far.
                    partial = self._partial
                    position = self._position(partial["skip"], partial["train"], rng=partial["rng"])
                self._keep(epoch, position)
                if self._partial is not None and position is None:
                    log.warning("rank %d: epoch %d goes on mid-way: no state to regroup from", self.rank, epoch)
                    self._snapshot = None
            stamps = [started, time.perf_counter()]
            lr = self.optimizer.param_groups[0]["lr"]  # at the epoch's first step
            train = self._train_epoch(epoch)
            if self._stopped_at is not None:
                self._stop_here(epoch, self._stopped_at, train)
            self._base = None
            stamps.append(time.perf_counter())
            val = self._validate(epoch)
            stamps.append(time.perf_counter())
            if self.scheduler is not None and self.opts.scheduler_interval == "epoch":
                self.scheduler.step()
            self._report(epoch, train, val, lr, stamps)
            epoch += 1
        self.ch.barrier("dp-fit-end", timeout=self.opts.collective_timeout)

    # ------------------------------------------------------------------ elastic
    def _can_regroup(self, failure: PeerLost) -> bool:
        """A rank lost (not one that left) in an elastic job that has state to go back to. The
        driver too: where the coordinator or store outlives it (etcd, ``dataparallel serve``),
        the lowest surviving rank drives the next generation; where it does not, the channel
        fails with it and the survivors' regroup with it."""
        return bool(self.opts.elastic) and not isinstance(failure, PeerLeft) and self._snapshot is not None

    def _reshards(self) -> bool:
        """Whether an epoch can go on mid-way on another number of ranks (every rank's shard of
        one order the loop knows: a ``Dataset``, the default sampler, DDP)."""
        return isinstance(self.train_data, Dataset) and self.opts.sampler is None and self.opts.strategy == "ddp"

    def _keep(self, epoch: int, position: dict[str, Any] | None) -> None:
        """Keep the state now as the one a regroup goes back to (``position``: where in
        ``epoch``; None: its start), with every rank's RNG state there, by rank (what a
        checkpoint written there holds). The collectives these need come first (a loss there
        leaves the last snapshot in place); the old copy goes before the new one is made."""
        rngs = self._every_rng(position["rng"] if position is not None else _rng_state())
        self._snapshot = None
        self._snapshot = self._state_now(epoch)
        self._snapshot["rngs"] = rngs
        if position is not None:
            self._snapshot["position"] = position

    def _every_rng(self, mine: str) -> list[str]:
        """Every rank's RNG state (``mine``: this rank's, encoded), by rank: one all-gather
        (a CPU generator's state has the same size on every rank)."""
        raw = torch.frombuffer(bytearray(base64.b64decode(mine)), dtype=torch.uint8).to(self.device)
        every = [torch.empty_like(raw) for _ in range(self.world)]
        dist.all_gather(every, raw, group=self.pg)
        return [base64.b64encode(state.cpu().numpy().tobytes()).decode() for state in every]

    def _position(self, batches: int, sums: Any, rng: str | None = None) -> dict[str, Any]:
        """Where the current epoch is, after ``batches`` batches of every rank's shard (since
        it last went on mid-way): what goes on from there needs. ``sums``: this rank's
        (loss sum, samples, batches), summed over the ranks (an all-reduce: every rank has the
        totals, for whichever is rank 0 next). ``rng``: the RNG state to take once the loader
        has started (default: this process's now)."""
        summed = torch.tensor(list(sums), dtype=torch.float64, device=self.device)
        dist.all_reduce(summed, group=self.pg)
        total = summed.tolist()
        return {
            "batches": batches,
            "world": self.world,
            "batch": self.batch_size,
            "base": self._base,
            "train": [float(total[0]), int(total[1]), int(total[2])],
            "rng": rng or _rng_state(),
        }

    def _go_on_from(self, epoch: int, position: dict[str, Any], rng: str) -> None:
        """Make the next training of ``epoch`` go on from ``position`` on this generation's
        ranks: the samples not yet trained, resharded; the epoch's sums so far on rank 0."""
        done = position["batches"] * position["batch"] * position["world"]
        self._base = self._order(epoch, position["world"], position["base"])[done:]
        train = position["train"] if self.rank == 0 else [0.0, 0, 0]
        self._partial = {"train": tuple(train), "skip": 0, "rng": rng}

    def _order(self, epoch: int, world: int, base: list[int] | None) -> list[int]:
        """The order in which ``world`` ranks train ``epoch``'s samples: rank r takes every
        world-th from r (the default sampler's shards, interleaved, or ``base`` padded)."""
        if base is not None:
            return _padded(base, world)
        if not isinstance(self.train_data, Dataset):
            raise TypeError("only a Dataset's epoch can go on mid-way")
        shards = []
        for rank in range(world):
            sampler: DistributedSampler[Any] = DistributedSampler(
                self.train_data, num_replicas=world, rank=rank, shuffle=self.opts.shuffle, seed=self.opts.seed
            )
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        return [shard[j] for j in range(len(shards[0])) for shard in shards]

    def _state_now(self, epoch: int) -> dict[str, Any]:
        """What an epoch redone from its start needs, copied (it stays in memory, every rank)."""
        return {
            "epoch": epoch,
            "model": {k: v.detach().clone() for k, v in self.ddp.module.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
            "scaler": copy.deepcopy(self.scaler.state_dict()),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "step": self.global_step,
            "epochs": len(self.history.epochs),
            "best": self.best,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # kept intact for another loss in the same epoch
        self.ddp.module.load_state_dict(state["model"])
        self.ddp.module.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.global_step = state["step"]
        del self.history.epochs[state["epochs"] :]
        self.best = state["best"]

    def _regroup(self, failure: PeerLost) -> int:
        """Carry on without the lost ranks: agree on the survivors through the old channel,
        open the next generation's channel and process group, go back to the state of the
        current epoch's start (or its last snapshot). Returns the epoch to redo. New rank r
        takes the RNG state old rank r had there, as a job resumed on the survivors from a
        checkpoint written there gives rank r the saved state of rank r (not the survivor's
        own: where rank 0 or a middle rank is lost, the survivors' ranks move down)."""

        started = time.monotonic()
        log.warning("rank %d: %s; regrouping without it", self.rank, failure)
        self._stop_watchdog()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        old, settle = self.ch, self.ch.liveness_timeout + 2 * self.ch.heartbeat_interval
        members, generation = elastic.survivors(old, self.generation + 1, settle)
        lost = sorted(set(range(old.world_size)) - set(members))
        fewest = self.opts.min_world_size or 1
        if len(members) < fewest:
            reason = f"{failure.reason}; {len(members)} rank(s) left, fewer than min_world_size={fewest}"
            raise PeerLost(failure.rank, failure.last_seen, reason, during=failure.during)
        rank = members.index(self.rank)
        new = self._open_generation(old, self._job, generation, rank, len(members))
        self.ch, self.rank, self.world, self.generation = new, rank, new.world_size, generation
        if self.rank == 0 and self.opts.elastic and self._queue is None:  # the driver was lost: this one drives
            self._queue = elastic.JoinQueue(new, self._job, take_over=True)
        snapshot = self._snapshot
        if snapshot is None:  # _can_regroup saw one
            raise failure
        self._restore(snapshot)
        rng = snapshot["rngs"][self.rank]
        _set_rng_state(rng)
        self._resize()
        self._base, self._partial = None, None
        position = snapshot.get("position")
        if position is not None:  # kept mid-epoch: only the samples not yet trained are left
            self._go_on_from(int(snapshot["epoch"]), position, rng)
        self._form_group(new, generation)
        epoch = int(snapshot["epoch"])
        seconds = time.monotonic() - started
        self.history.regroups.append(Regroup(epoch, lost, len(members), generation, seconds))
        where = f"the start of epoch {epoch}"
        if self._base is not None:
            where = (
                f"epoch {epoch} after {position['batches'] if position else 0} batches ({len(self._base)} samples left)"
            )
        log.warning(
            "rank %d (was %d): generation %d carries on with %d ranks without rank(s) %s, from %s (regrouped in %.2fs)",
            self.rank, old.rank, generation, len(members), lost, where, seconds,
        )  # fmt: skip
        return epoch

    def _grow(self, command: dict[str, Any]) -> None:
        """Move to the generation the driver seated newcomers in (``command``): every member
        keeps its rank, the newcomers take the ranks after them; a new channel and process
        group, and the driver's state to the newcomers. Where a newcomer does not come, the
        members regroup without it (as after a loss, from this epoch boundary)."""
        started, epoch = time.monotonic(), command["epoch"]
        self._keep(epoch, None)  # what a failed admission goes back to
        self._stop_watchdog()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        old, generation, size = self.ch, command["generation"], command["world_size"]
        new = self._open_generation(old, self._job, generation, self.rank, size)
        self.ch, self.world, self.generation = new, size, generation
        self._resize()
        self._form_group(new, generation)
        self._share_state(old.world_size, epoch)
        seconds = time.monotonic() - started
        joined = list(range(old.world_size, size))
        self.history.regroups.append(Regroup(epoch, [], size, generation, seconds, joined))
        if self.rank == 0:
            log.warning(
                "generation %d: newcomer(s) %s joined; %d ranks from epoch %d (in %.2fs)",
                generation, joined, size, epoch, seconds,
            )  # fmt: skip

    def _resize(self) -> None:
        """With ``keep_global_batch``: the per-rank batch and accumulation that keep the job's
        first global batch on this generation's world size."""
        if not self.opts.keep_global_batch:
            return
        first = self.opts.batch_size * self.opts.grad_accum * self._base_world
        share = first // self.world
        if callable(self.train_data) and not isinstance(self.train_data, Dataset):
            # The batches are the source's: only the number accumulated per step can change.
            self.grad_accum = max(1, round(first / (self.opts.batch_size * self.world)))
            kept = self.opts.batch_size * self.grad_accum * self.world
        else:
            k = -(-share // self.opts.batch_size)  # the fewest steps of at most batch_size
            while share % k:
                k += 1
            self.batch_size, self.grad_accum = share // k, k
            kept = share * self.world
        how = "kept" if kept == first else f"not divisible: {kept} instead of"
        log.warning(
            "rank %d: %d ranks: batch %d x %d accumulated per rank, global batch %s %d",
            self.rank, self.world, self.batch_size, self.grad_accum, how, first,
        )  # fmt: skip

    def _close_queue(self) -> None:
        if self._queue is not None:
            queue, self._queue = self._queue, None
            queue.close()

    def _grow_timeout(self) -> float:
        """How long a new generation's rendezvous waits for its ranks (newcomers included)."""
        return min(self.ch.timeout, max(30.0, 3 * self.ch.liveness_timeout))

    def _meet(self, new: ControlChannel, generation: int) -> None:
        """Every rank of a new generation at its rendezvous, within :meth:`_grow_timeout`: one
        that never comes (it died since it was counted in) is a loss, which the others regroup
        from (it never joined, so no heartbeat of its would ever go missing)."""
        try:
            new.rendezvous(timeout=self._grow_timeout())
        except ControlError as err:
            missing = [r for r in range(new.world_size) if new.peer_info(r) is None] or [new.world_size - 1]
            why = f"rank(s) {missing} did not join generation {generation}: {err}"
            raise PeerLost(missing[0], None, why) from err

    def _share_state(self, after: int, epoch: int = 0) -> int:
        """The driver's state to the newcomers (the ranks from ``after`` on) of a grown group,
        on every rank of it (collectives); returns the epoch to train. A newcomer takes the RNG
        state of rank ``rank % after``, as a job resumed on more ranks does."""
        state: dict[str, Any] = {}
        if self.rank == 0:  # on the CPU: unpickled on the device it was pickled from
            state = _on_cpu({**self._state_now(epoch), "cuda_rng": None})
            state["history"] = self.history
            state["base_world"] = self._base_world
            state["extra"] = self.extra_state[0]() if self.extra_state is not None else None
        box: list[Any] = [state]
        device = self.device if self.device.type == "cuda" else None
        dist.broadcast_object_list(box, src=0, group=self.pg, device=device)
        rngs: list[Any] = [None] * self.world
        dist.all_gather_object(rngs, _rng_state(), group=self.pg)
        state = box[0]
        if self.rank < after:
            return int(state["epoch"])
        self.history = state["history"]
        self._base_world = state["base_world"]
        self._resize()
        self._restore(state)
        _set_rng_state(rngs[self.rank % after])
        if self.extra_state is not None and state["extra"] is not None:
            self.extra_state[1](state["extra"])
        return int(state["epoch"])

    def _admit(self, next_epoch: int) -> dict[str, Any] | None:
        """On the driver, at an epoch boundary: seat the newcomers waiting in the join queue
        (up to ``max_world_size``) in the next generation; the command that moves there."""
        if self._queue is None or self._partial is not None or self._base is not None:
            return None  # (an epoch going on mid-way: its shards are the members')
        if not self._queue.alive:  # its newcomers have given up waiting
            self._close_queue()
            return None
        try:
            waiting = self._queue.waiting()
            room = self._max_world - self.world
            if not waiting or room <= 0:
                return None
            generation = max(self.generation, elastic.promised(self.ch)) + 1
            elastic.promise(self.ch, generation)
            seated = self._queue.seat(waiting[:room], generation, self.world, settle=self.ch.liveness_timeout)
        except ControlError as err:  # the queue is a convenience: training goes on without it
            log.warning("driver: the join queue failed (%s); no more newcomers are admitted", err)
            self._close_queue()
            return None
        if not seated:
            return None
        return {"cmd": "grow", "epoch": next_epoch, "generation": generation, "world_size": self.world + len(seated)}

    def _command(self, next_epoch: int) -> dict[str, Any]:
        payload = None
        if self.rank == 0:
            stop = next_epoch >= self.opts.epochs or self._should_stop_early()
            mine = {"cmd": "train", "epoch": next_epoch, "poll_every": self._poll_every()}
            if not stop:
                mine = self._admit(next_epoch) or mine
            payload = json.dumps({"cmd": "stop", "early": self._should_stop_early()} if stop else mine).encode()
        command: dict[str, Any] = json.loads(
            self.ch.broadcast("dp-command", payload, timeout=self.opts.collective_timeout)
        )
        self._poll_stride = command.get("poll_every", 1)
        return command

    def _poll_every(self) -> int:
        """Optimizer steps between stop polls, chosen by the driver for every rank: about
        ``STOP_POLL_SECONDS`` of the last epoch's steps (each poll is an all-reduce: on tiny
        CPU steps, one per step would cost ~10%), every step before any epoch is measured."""
        if not self.history.epochs:
            return 1
        last = self.history.last
        steps = max(1, min(last.train_batches_per_rank) // self.grad_accum)
        return max(1, min(MAX_POLL_STRIDE, int(STOP_POLL_SECONDS / max(last.train_seconds / steps, 1e-9))))

    def _should_stop_early(self) -> bool:
        patience = self.opts.patience
        if patience is None or not self.history.epochs or self.history.last.val_loss is None:
            return False
        return self.history.last.epoch - self.best[1] >= patience

    def _explain(self, err: Exception, epoch: int) -> Exception:
        """Turn a collective failure caused by a lost peer into PeerLost naming it."""
        if isinstance(err, PeerLeft):  # not a loss: that rank closed its channel
            return err
        if isinstance(err, PeerLost):
            return PeerLost(err.rank, err.last_seen, err.reason, during=f"epoch {epoch}")
        if self._ps is not None:  # a peer that failed on its own ended this one's exchange with it
            with contextlib.suppress(ControlError):
                failed = self._failed_peer()
                if failed is not None:
                    return failed
        deadline = time.monotonic() + self.ch.liveness_timeout + 2 * self.ch.heartbeat_interval + 1
        while self._lost is None and not self.ch.lost_peers() and time.monotonic() < deadline:
            if isinstance(err, ChannelClosed) or self.ch.failure is not None:
                break
            time.sleep(0.1)
        lost = self._lost or next(iter(self.ch.lost_peers().values()), None)
        if lost is not None:
            return PeerLost(lost.rank, lost.last_seen, lost.reason, during=f"epoch {epoch}")
        if self._stalled:
            return ChannelClosed(
                f"rank {self.rank} stood still for {self._stalled:.1f}s, longer than the liveness timeout "
                f"({self.ch.liveness_timeout:g}s): its peers have gone on without it "
                f"(noticed in epoch {epoch} as: {err})"
            )
        if self.ch.failure is not None and not isinstance(err, ControlError):
            # The coordinator went away with the rank that hosted it (or on its own).
            return ChannelClosed(f"{self.ch.failure} (noticed in epoch {epoch} as: {err})")
        return err

    # ------------------------------------------------------------------ epochs
    def _batches(
        self, data: Dataset[Any] | BatchSource, epoch: int, train: bool, among: int | None = None
    ) -> Iterable[Batch]:
        """This rank's batches of ``epoch``; for training, its share among the first ``among``
        ranks (default: all; under ``async_ps`` the workers)."""
        among = among or self.world
        if callable(data) and not isinstance(data, Dataset):
            return data(epoch, self.rank, among if train else self.world)
        sampler: Iterable[int]
        if train and self._base is not None:  # the epoch goes on mid-way: the samples left
            sampler = _padded(self._base, self.world)[self.rank :: self.world]
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

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.opts.amp is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.opts.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _train_epoch(self, epoch: int) -> tuple[float, int, int]:
        if self._ps is not None:
            return self._train_async(epoch)
        self.ddp.train()
        batches = self._batches(self.train_data, epoch, train=True)
        k = self.grad_accum
        loss_sum, samples, count = 0.0, 0, 0
        uneven = self._ran_uneven = self._uneven(epoch, batches)
        local = self.opts.strategy == "local_sgd"
        if local and uneven:
            raise ValueError(
                "strategy='local_sgd' needs the same number of batches on every rank (its averages are "
                "collectives every rank makes): train on a Dataset with DistributedSampler or a sampler with "
                "equal shards"
            )
        bar = None
        if self.rank == 0 and self.opts.progress and self._lines is None:
            from tqdm import tqdm

            total = len(batches) if isinstance(batches, Sized) else None
            bar = tqdm(total=total, desc=f"epoch {epoch}", unit="batch", leave=False)
        self._bar = bar
        # Local SGD runs the bare module: no DDP forward, so no gradient all-reduce.
        forward = self.ddp.module if local else self.ddp
        batches, skip = iter(batches), 0
        if self._partial is not None:  # resumed mid-epoch (a stop signal's checkpoint, a regroup)
            loss_sum, samples, count = self._partial["train"]
            skip = self._partial["skip"]  # this rank's batches before the stop
            for _ in itertools.islice(batches, skip):
                pass
            _set_rng_state(self._partial["rng"])  # after the loader's start, which draws from it
            self._partial = None
            if bar is not None:
                bar.update(skip)
        done = skip  # batches of this rank's shard (of the samples left, where the epoch goes on mid-way)
        every = self.opts.snapshot_every if self.opts.elastic and self._reshards() else None
        polling = self._polls_stop() and not uneven  # under Join the ranks' collectives differ: at its end
        self._stop_poll, self._stopped_at = None, None
        # Join shadows the all-reduces of ranks that ran out of batches (uneven counts).
        with Join([self.ddp], enable=uneven):
            for i, ((x, y), last) in enumerate(_with_last(batches), start=skip):
                count, done = count + 1, i + 1
                x, y = _to(x, self.device), _to(y, self.device)
                boundary = (i + 1) % k == 0 or last
                sync = contextlib.nullcontext() if boundary and not local else self.ddp.no_sync()
                with sync:
                    with self._autocast():
                        loss = self.loss_fn(forward(x), y)
                    self.scaler.scale(loss / k).backward()
                averaged = False
                if boundary:
                    self._step(epoch, i, loss)
                    averaged = local and self.global_step % self.opts.sync_every == 0
                    if averaged:
                        self._average(optimizer=False)
                n = _count(y)
                loss_sum += float(loss.detach()) * n
                samples += n
                if bar is not None:
                    bar.update()
                if every and boundary and not last and self.global_step % every == 0:
                    self._keep(epoch, self._position(i + 1, (loss_sum, samples, count)))
                due = averaged if local else self.global_step % self._poll_stride == 0
                if polling and boundary and due and self._agreed_to_stop():
                    self._stopped_at = i + 1
                    break
        if self._polls_stop() and self._stopped_at is None and self._agreed_to_stop(last=True):
            self._stopped_at = done  # agreed at the epoch's end: stop before validating
        if bar is not None:
            bar.close()
        self._bar = None
        if local:
            self._average(optimizer=True)
        return loss_sum, samples, count

    # ------------------------------------------------------------------ stop signals
    def _polls_stop(self) -> bool:
        """Whether the ranks poll for stop signals: the same answer on every rank (options
        only), whether or not this one could install handlers."""
        return self.opts.checkpoint is not None and bool(self.opts.stop_signals)

    def _catch_stop_signals(self) -> dict[int, Any]:
        """Install the stop signals' handlers (main thread only); the previous handlers."""
        if not self._polls_stop() or threading.current_thread() is not threading.main_thread():
            return {}

        first: list[float] = []
        previous: dict[int, Any] = {}

        def stop(signum: int, frame: object) -> None:
            if self._signalled is None:
                self._signalled = signum
                first.append(time.monotonic())
            elif time.monotonic() - first[0] > REPEAT_SECONDS:  # insisted on: act as it would have
                handler = previous.get(signum)
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
                os.kill(os.getpid(), signum)
            # else the same stop again (srun signals every process of a step, and dataparallel
            # launch forwards what it got): nothing more to do

        for sig in (signal.Signals[name] for name in self.opts.stop_signals):
            previous[sig] = signal.signal(sig, stop)
        return previous

    def _agreed_to_stop(self, last: bool = False) -> bool:
        """Whether some rank had been signalled by the previous poll (every rank gets the same
        answer, the maximum of the flags); if not, the next poll starts in the background, and
        at the epoch's ``last`` step it is read at once (a signal late in an epoch stops it
        before its validation)."""
        stop = self._read_poll()
        if not stop:
            flag = torch.tensor([self._signalled or 0], device=self.device)
            self._stop_poll = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg, async_op=True))
            if last:
                stop = self._read_poll()
        return stop

    def _read_poll(self) -> bool:
        """The pending poll's answer: the highest signal number any rank got (0: none), kept as
        the signal every rank stops for (so that every rank exits with the same code)."""
        if self._stop_poll is None:
            return False
        flag, work = self._stop_poll
        self._stop_poll = None
        work.wait()
        agreed = int(flag.item())
        if agreed:
            self._agreed_signal = agreed
        return agreed > 0

    def _stop_here(self, epoch: int, batches: int, train: tuple[float, int, int]) -> None:
        """The ranks agreed to stop after ``batches`` batches of ``epoch``: the driver writes
        the checkpoint there, with every rank's RNG state and partial sums, then every rank
        raises :class:`Preempted`."""
        timeout = self.opts.collective_timeout
        mine = json.dumps({"rng": _rng_state(), "train": list(train)}).encode()
        parsed = [json.loads(p) for p in self.ch.all_gather(f"dp-stop-{epoch}", mine, timeout=timeout)]
        # An epoch of uneven batch counts stopped at its end: its optimizer state as _report syncs it.
        if self._ran_uneven:
            self._sync_after_join([p["train"][2] for p in parsed])
        if self.rank == 0:
            partial = {
                "epoch": epoch,
                "batches": batches,
                "train": [p["train"] for p in parsed],
                "base": self._base,  # the epoch went on mid-way: its samples left then
                "batch": self.batch_size,
                # How the epoch's batches were split: ["handed", batch size] (async_ps: the first
                # server handed them out in one order, its first ``batches`` are done, whoever
                # trained them) or ["shares", ranks sharing them] (each rank its shard).
                "layout": self._data_layout(),
            }
            self._save(epoch - 1, [p["rng"] for p in parsed], partial=partial)
        self.ch.barrier(f"dp-stopped-{epoch}", timeout=timeout)  # no rank ends before the file is there
        stopped = Preempted(self._agreed_signal or signal.SIGTERM, epoch, batches, str(self.opts.checkpoint))
        if self.rank == 0:
            print(f"dataparallel: {stopped}", file=sys.stderr, flush=True)
        raise stopped

    def _average(self, optimizer: bool) -> None:
        """Local SGD: average the parameters and floating-point buffers over the ranks (one
        all-reduce, torch's ``model_averaging``), with ``optimizer`` the optimizer's
        floating-point state too (momentum, Adam's moments). Integer buffers and state
        (step counts) are the same on every rank already."""
        module = self.ddp.module
        tensors = [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]
        if optimizer:
            for state in self.optimizer.state.values():
                tensors += [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
        if self.pg is None:
            raise RuntimeError("local SGD averages over the job's process group, which is not set up yet")
        average_parameters(iter(tensors), self.pg)

    # ------------------------------------------------------------------ async_ps
    def _async_side(self) -> paramserver.Server | paramserver.Client:
        """This rank's part under ``strategy="async_ps"``: a server of its shard (with the
        job's optimizer and scheduler) or a worker's client. The tensors go over a gloo group
        on the CPU (a new one where the job's is NCCL: gloo receives from any rank)."""
        params = self._ps_params = self._trainable()  # the servers' numbering, fixed for the run
        layout = paramserver.Layout.of(params, self.world, self.opts.ps_ranks)
        group = self.pg
        if dist.get_backend(self.pg) != "gloo":
            group = new_gloo_group(self.ch, self.opts.collective_timeout)
        self._ps_group = group
        if layout.server_index(self.rank) is None:
            return paramserver.Client(params, layout, group)
        bound = self.opts.max_staleness
        if bound is None:
            bound = paramserver.default_staleness(len(layout.workers))
        scheduler = self.scheduler if self.opts.scheduler_interval == "step" else None
        return paramserver.Server(
            params,
            layout,
            self.rank,
            self.optimizer,
            scheduler.step if scheduler else lambda: None,
            bound,
            group,
            alive=self._alive,
            timeout=self.opts.collective_timeout,
            stopping=lambda: self._signalled is not None,
        )

    def _alive(self) -> None:
        """Raises once the watchdog has found a peer lost (explained as PeerLost by the loop),
        or once a peer said it failed on an error of its own (PeerLeft: it will not come,
        though it may have closed its channel cleanly, which no heartbeat shows)."""
        if self._lost is not None:
            raise RuntimeError(f"rank {self.rank}: {self._lost}")
        failed = self._failed_peer()
        if failed is not None:
            raise failed

    def _failed_peer(self) -> PeerLeft | None:
        """The peer that said it failed (async_ps), if one did."""
        if not self.ch.check([PS_FAILED]):
            return None
        rank, _, why = self.ch.get(PS_FAILED).decode().partition(" ")
        return PeerLeft(int(rank), f"async_ps epoch {self._epoch}: it failed ({why})", f"epoch {self._epoch}")

    def _say_failed(self, err: BaseException) -> None:
        """Under async_ps, this rank's own failure, for the peers that wait on it without a
        collective (a server for its requests, a worker for the servers): best effort."""
        if self._ps is None or isinstance(err, (PeerLost, ChannelClosed, Preempted)):
            return  # (not this rank's own failure, or the others know already)
        with contextlib.suppress(Exception):
            self.ch.compare_set(PS_FAILED, b"", f"{self.rank} {type(err).__name__}: {err}"[:500].encode())

    def _trainable(self) -> list[torch.Tensor]:
        """The parameters the servers hold: the optimizer's that take gradients, in its order."""
        return [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]

    def _data_layout(self) -> list[Any]:
        """How an epoch's batches are split: handed out (``async_ps``, a ``Dataset``), or
        shares among the ranks that train (all, or the workers)."""
        if self._ps is not None and self._hands_out():
            return ["handed", self.batch_size]
        workers = self._ps.layout.workers if self._ps is not None else range(self.world)
        return ["shares", len(workers)]

    def _hands_out(self) -> bool:
        """Whether the first server hands the epoch's batches out (a map-style ``Dataset``, the
        default sampler) rather than each worker training its own share (a batch source, a
        sampler)."""
        return isinstance(self.train_data, Dataset) and isinstance(self.train_data, Sized) and self.opts.sampler is None

    def _train_async(self, epoch: int) -> tuple[float, int, int]:
        """One epoch of ``strategy="async_ps"``: workers train and push, servers serve; then
        every rank waits for the servers to be done (on the control channel, as long as every
        peer lives: a worker done early waits for the slowest one's last batches) and takes
        their parameters and optimizer state (collectives)."""
        self.ddp.train()
        train, start, rng = (0.0, 0, 0), 0, None
        if self._partial is not None:  # resumed mid-epoch (a stop signal's checkpoint)
            train, start, rng = self._partial["train"], self._partial["skip"], self._partial["rng"]
            self._partial = None
        self._stopped_at = None
        self._buffers_at_start = [b.detach().cpu().clone() for b in self.ddp.module.buffers()]
        served_key = f"dp-ps-served-{epoch}"
        if isinstance(self._ps, paramserver.Server):
            if rng is not None:
                _set_rng_state(rng)
            handout = None
            if self._ps.first:
                total = self._handout_size() if self._hands_out() else 0
                handout = paramserver.Handout(start, total, self.grad_accum)
            served = self._ps.serve(self.global_step, handout)
            mine: dict[str, Any] | None = {"served": asdict(served), **self._shard_state()}
            if self._ps.first:
                self.ch.set(served_key, b"1")
        else:
            train = self._work(epoch, start, train, rng)
            mine = None
        self._await_key(served_key)
        handed = self._settle(mine, train[2] if isinstance(self._ps, paramserver.Client) else 0)
        if self._polls_stop() and self._agreed_to_stop(last=True):
            self._stopped_at = handed if self._hands_out() else train[2]
        return train

    def _await_key(self, key: str) -> None:
        """Until ``key`` is set on the channel, as long as no peer is lost (a slow peer is
        waited for; a lost one raises, explained as PeerLost)."""
        while True:
            self._alive()
            try:
                self.ch.wait([key], timeout=1.0)
                return
            except ControlTimeout:
                continue

    def _handout_size(self) -> int:
        """How many batches the first server hands out in an epoch (``drop_last`` as the
        ``loader_options`` say)."""
        samples = len(self.train_data)  # type: ignore[arg-type]
        if self.opts.loader_options.get("drop_last"):
            return samples // self.batch_size
        return -(-samples // self.batch_size)

    def _work(self, epoch: int, start: int, sums: tuple[float, int, int], rng: str | None) -> tuple[float, int, int]:
        """A worker's epoch: read, train on the batches handed out (or on its share), push,
        read... ``start``: the batches of the epoch done before (handed out, or of its share);
        ``rng``: the RNG state to take once the batches have started."""
        client = self._ps
        if not isinstance(client, paramserver.Client):
            raise RuntimeError("a server does not train")
        module, k = self.ddp.module, self.grad_accum
        loss_sum, samples, count = sums
        bar = None
        if self.rank == 0 and self.opts.progress and self._lines is None:
            from tqdm import tqdm

            bar = tqdm(desc=f"epoch {epoch}", unit="batch", leave=False)
        self._bar = bar
        order: list[int] = []
        shares = None
        if self._hands_out():
            order = self._order(epoch, 1, None)
        else:
            workers = len(client.layout.workers)
            shares = iter(self._batches(self.train_data, epoch, True, workers))
            for _ in itertools.islice(shares, start):  # this worker's batches before a stop
                pass
        if rng is not None:
            _set_rng_state(rng)  # after the loader's start, which draws from it
        answer = client.read(stop=self._signalled is not None)
        batch = start - 1  # the last batch trained (of the epoch, or of this worker's share)
        while True:
            group: Iterable[tuple[int, Batch]]
            if shares is None:
                handed = range(answer.first, answer.first + answer.count)
                group = ((b, self._fetch(order, b)) for b in handed)
            else:
                group = zip(itertools.count(batch + 1), itertools.islice(shares, 0 if answer.stopped else k))
            loss = None
            for b, (x, y) in group:
                batch = b
                x, y = _to(x, self.device), _to(y, self.device)
                with self._autocast():
                    loss = self.loss_fn(module(x), y)
                (loss / k).backward()
                n = _count(y)
                loss_sum, samples, count = loss_sum + float(loss.detach()) * n, samples + n, count + 1
                if bar is not None:
                    bar.update()
            if loss is None:  # nothing handed out, or this worker's share done
                break
            if self.opts.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), self.opts.clip_grad_norm)
            lr = self.optimizer.param_groups[0]["lr"]
            answer = client.push(stop=self._signalled is not None)
            self.global_step = answer.version
            self._stepped(epoch, batch, loss, lr)
        client.done()
        if bar is not None:
            bar.close()
        self._bar = None
        return loss_sum, samples, count

    def _fetch(self, order: list[int], batch: int) -> Batch:
        """Batch number ``batch`` of the epoch's ``order`` (a map-style Dataset's), read and
        collated in this process (``collate_fn`` from ``loader_options``; loader processes
        are not used for batches handed out one by one)."""
        from torch.utils.data import default_collate

        collate = self.opts.loader_options.get("collate_fn") or default_collate
        dataset: Any = self.train_data
        return collate([dataset[i] for i in order[batch * self.batch_size : (batch + 1) * self.batch_size]])

    def _shard_state(self) -> dict[str, Any]:
        """A server's shard at an epoch's end: its parameters, their optimizer state (indexed
        as the optimizer indexes them), the scheduler, the updates applied."""
        server = self._ps
        if not isinstance(server, paramserver.Server):
            raise RuntimeError("only a server has a shard")
        params = self._ps_params
        index = self._ps_indices()
        state = self.optimizer.state_dict()
        mine = {index[id(p)] for p in server.owned}
        return {
            "params": {i: _on_cpu(params[i].detach()) for i in server.indices},
            "state": {i: _on_cpu(v) for i, v in state["state"].items() if i in mine},
            "groups": state["param_groups"],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "version": server.version,
        }

    def _ps_indices(self) -> dict[int, int]:
        """The optimizer's index of each parameter (by ``id``), as its ``state_dict`` numbers them."""
        flat = (p for group in self.optimizer.param_groups for p in group["params"])
        return {id(p): i for i, p in enumerate(flat)}

    def _settle(self, mine: dict[str, Any] | None, trained: int) -> int:
        """The end of an async epoch, on every rank: the servers' parameters, optimizer state,
        scheduler and update count everywhere; the module's buffers (batch-norm statistics)
        from the workers, weighted by the batches each trained this epoch (``trained``: this
        rank's), integer ones (batch counts) advanced by every worker's steps. Returns the
        batches handed out."""
        shards: list[Any] = [None] * self.world
        dist.all_gather_object(shards, mine, group=self._ps_group)
        shards = [s for s in shards if s is not None]
        params = self._ps_params
        merged = dict(self.optimizer.state_dict()["state"])  # a frozen parameter's state stays
        with torch.no_grad():
            for shard in shards:
                for i, value in shard["params"].items():
                    params[i].copy_(value)
                merged.update(shard["state"])
        self.optimizer.load_state_dict({"state": merged, "param_groups": shards[0]["groups"]})
        if self.scheduler is not None and shards[0]["scheduler"] is not None:
            self.scheduler.load_state_dict(shards[0]["scheduler"])
        self.global_step = int(shards[0]["version"])
        self._settle_buffers(trained)
        self._served = [shard["served"] for shard in shards]
        return int(self._served[0]["handed"] or 0)

    def _settle_buffers(self, trained: int) -> None:
        """Every rank's buffers: floating-point ones the workers' average weighted by their
        batches this epoch, integer ones the epoch's start plus every worker's increments
        (servers and idle workers add nothing)."""
        buffers = list(self.ddp.module.buffers())
        if not buffers:
            return
        weight = torch.tensor([float(trained)], dtype=torch.float64)
        dist.all_reduce(weight, group=self._ps_group)
        with torch.no_grad():
            for b, start in zip(buffers, self._buffers_at_start, strict=True):
                mine = b.detach().cpu()
                if b.is_floating_point():
                    total = mine.double() * trained
                    dist.all_reduce(total, group=self._ps_group)
                    if weight.item() > 0:
                        b.copy_((total / weight.item()).to(b.dtype))
                else:
                    total = mine - start
                    dist.all_reduce(total, group=self._ps_group)
                    b.copy_(start + total)

    def _uneven(self, epoch: int, batches: Iterable[Batch]) -> bool:
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
        if uneven and self.rank == 0 and not self._told_uneven:
            self._told_uneven = True
            log.warning(
                "the sampler gives the ranks different numbers of batches (%s): such epochs train under Join, "
                "which costs a collective per step",
                counts,
            )
        return uneven

    def _step(self, epoch: int, batch: int, loss: torch.Tensor) -> None:
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
        self._stepped(epoch, batch, loss, lr)

    def _stepped(self, epoch: int, batch: int, loss: torch.Tensor, lr: float) -> None:
        """After an optimizer step (``global_step`` counts it): the step callbacks, the log line."""
        every = self.opts.log_every
        log_now = every is not None and self.rank == 0 and self.global_step % every == 0
        if not (self.step_callbacks or log_now):
            return
        info = StepInfo(epoch, self.global_step, batch, float(loss.detach()), lr, self.rank)
        for callback in self.step_callbacks:
            callback(info)
        if log_now:
            line = f"epoch {epoch} step {info.step} loss {info.loss:.4f} lr {lr:.3g}"
            if self._lines == "json":
                line = json.dumps({"event": "step", **asdict(info)})
            if self._bar is not None:
                self._bar.write(line)
            else:
                print(line, flush=True)

    @torch.no_grad()
    def _validate(self, epoch: int) -> tuple[float, int, int, int]:
        if self.val_data is None:
            return 0.0, 0, 0, 0
        module = self.ddp.module
        module.eval()
        loss_sum, samples, correct = 0.0, 0, 0
        classified = 0
        for batch in self._batches(self.val_data, epoch, train=False):
            out, loss, y = self._evaluate(module, batch)
            n = _count(y)
            loss_sum += float(loss) * n
            samples += n
            hits = _hits(out, y)
            if hits is not None:
                correct += hits
                classified += n
        return loss_sum, samples, correct, classified

    def _evaluate(self, module: torch.nn.Module, batch: Batch) -> tuple[Any, torch.Tensor, Any]:
        """(output, loss, targets on the device) of one ``(inputs, targets)`` batch."""
        x, y = batch
        x, y = _to(x, self.device), _to(y, self.device)
        with self._autocast():
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
                first = next(iter(self._batches(data, epoch, train=train)), None)
                if first is None:
                    continue
                try:
                    out, loss, y = self._evaluate(module, first)
                    float(loss)
                    _hits(out, y)
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

    # ------------------------------------------------------------------ reports, checkpoints
    def _report(
        self,
        epoch: int,
        train: tuple[float, int, int],
        val: tuple[float, int, int, int],
        lr: float,
        stamps: list[float],
    ) -> None:
        """Every rank's loss sums and counts to every rank (each keeps the same history);
        the RNG states only to the driver, and only when it writes a checkpoint."""
        mine = {"train": train, "val": val}
        timeout = self.opts.collective_timeout
        reports = self.ch.all_gather(f"dp-report-{epoch}", json.dumps(mine).encode(), timeout=timeout)
        rng_states = None
        if self._checkpoints(epoch):
            rng_states = self.ch.gather(f"dp-rng-{epoch}", _rng_state().encode(), dst=0, timeout=timeout)
        parsed = [json.loads(r) for r in reports]
        if self._ran_uneven:
            self._sync_after_join([p["train"][2] for p in parsed])
        command, trained, validated, reported = stamps[1], stamps[2], stamps[3], time.perf_counter()
        t_loss, t_n, t_b = (sum(p["train"][i] for p in parsed) for i in range(3))
        v_loss, v_n, v_correct, v_classified = (sum(p["val"][i] for p in parsed) for i in range(4))
        metrics = EpochMetrics(
            epoch=epoch,
            train_loss=t_loss / max(t_n, 1),
            train_samples=t_n,
            train_batches=t_b,
            train_batches_per_rank=[p["train"][2] for p in parsed],
            world_size=self.world,
            staleness=max(s["staleness"] for s in self._served) if self._served else None,
            held_back=sum(s["held_back"] for s in self._served),
            val_loss=v_loss / v_n if v_n else None,
            val_samples=v_n,
            val_accuracy=v_correct / v_classified if v_classified else None,
            lr=lr,
            seconds=reported - stamps[0],
            train_seconds=trained - command,
            val_seconds=validated - trained,
            control_seconds=(command - stamps[0]) + (reported - validated),
        )
        self.history.epochs.append(metrics)
        if metrics.val_loss is not None and metrics.val_loss < self.best[0]:
            self.best = (metrics.val_loss, epoch)
        if self.rank == 0:
            self._print_epoch(metrics)
            for callback in self.callbacks:
                callback(metrics)
            if rng_states is not None:
                self._save(epoch, [state.decode() for state in rng_states])

    def _print_epoch(self, m: EpochMetrics) -> None:
        """The epoch's one line (JSON under ``DP_LOG_FORMAT=json``): on a terminal where the
        epoch's bar was (it leaves none), in a log in its place (a file would get every redraw)."""
        if self._lines == "json":
            print(json.dumps({"event": "epoch", **asdict(m)}), flush=True)
        elif self.opts.progress:
            val = "" if m.val_loss is None else f", val loss {m.val_loss:.4f}"
            accuracy = "" if m.val_accuracy is None else f", val accuracy {m.val_accuracy:.1%}"
            print(
                f"epoch {m.epoch}: train loss {m.train_loss:.4f}{val}{accuracy}, {m.train_samples} samples "
                f"on {m.world_size} ranks, {m.seconds:.1f}s",
                flush=True,
            )

    def _sync_after_join(self, batches: list[int]) -> None:
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

    def _checkpoints(self, epoch: int) -> bool:
        """Whether ``epoch`` ends with a checkpoint: every ``checkpoint_every`` epochs and the last."""
        every = self.opts.checkpoint_every
        return self.opts.checkpoint is not None and ((epoch + 1) % every == 0 or epoch == self.opts.epochs - 1)

    def _target(self) -> str | os.PathLike[str]:
        """Where the checkpoint goes (only asked where ``checkpoint`` is set)."""
        if self.opts.checkpoint is None:
            raise ValueError("no checkpoint: set TrainOptions(checkpoint=PATH)")
        return self.opts.checkpoint

    def _save(self, epoch: int, rng_states: list[str], partial: dict[str, Any] | None = None) -> None:
        state = {
            "epoch": epoch,
            "model": self.ddp.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "rng": rng_states,
            "world_size": self.world,
            "history": [asdict(m) for m in self.history.epochs],
            "best": self.best,
            "options": {"seed": self.opts.seed, "batch_size": self.opts.batch_size},
            "step": self.global_step,
            "extra": self.extra_state[0]() if self.extra_state is not None else None,
            "partial": partial,  # a stop signal's: the epoch after ``epoch``, that far in
        }
        checkpoint.save_atomically(state, self._target())

    def _maybe_resume(self) -> None:
        if not self.opts.resume:
            return
        state = None
        if self.rank == 0:
            state = checkpoint.load(self._target())
        if state is not None and state["world_size"] != self.world:
            log.warning(
                "resuming from %s, written by %d ranks, with %d: the data is resharded "
                "(model, optimizer, scheduler and scaler are the same on every rank); rank r takes the RNG "
                "state of saved rank r mod %d",
                self.opts.checkpoint,
                state["world_size"],
                self.world,
                state["world_size"],
            )
        box = [state]
        dist.broadcast_object_list(
            box, src=0, group=self.pg, device=self.device if self.device.type == "cuda" else None
        )
        state = box[0]
        if state is None:
            return
        self.ddp.module.load_state_dict(state["model"])
        self.ddp.module.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        _set_rng_state(state["rng"][self.rank % len(state["rng"])])
        self.history.epochs = [EpochMetrics(**m) for m in state["history"]]
        self.best = tuple(state["best"])
        self.start_epoch = state["epoch"] + 1
        self.global_step = state.get("step", 0)
        if self.extra_state is not None and state.get("extra") is not None:
            self.extra_state[1](state["extra"])
        partial = state.get("partial")
        layout = self._data_layout()
        # (a checkpoint from before layouts were saved: DDP's shares)
        saved: list[Any] = (partial or {}).get("layout") or ["shares", state["world_size"]]
        moved = partial is not None and saved != layout
        reshardable = saved[0] == layout[0] == "shares" and saved[1] == state["world_size"] and self._reshards()
        if moved and not reshardable:
            # Batches handed out and shares, or shares among other ranks: not the same positions.
            (log.warning if self.rank == 0 else log.info)(
                "resuming from %s, stopped in epoch %d with its batches split otherwise (%s, now %s): epoch %d "
                "starts over (its first %d batches were trained then)",
                self.opts.checkpoint, partial["epoch"], saved, layout, partial["epoch"], partial["batches"],
            )  # fmt: skip
            partial = None
        if partial is not None and layout[0] == "handed":  # async_ps: the rest handed out, to any workers
            sums = [sum(t[i] for t in partial["train"]) for i in range(3)] if self.rank == 0 else [0.0, 0, 0]
            rng = state["rng"][self.rank % state["world_size"]]
            self._partial = {"train": tuple(sums), "skip": partial["batches"], "rng": rng}
        elif partial is not None and not moved:
            train = partial["train"][self.rank]
            self._base = partial.get("base")
            # In an epoch that went on mid-way every rank's shard of its samples left is as long:
            # the batches done are the stop's (rank 0's sums carry those before, too).
            skip = partial["batches"] if self._base is not None else train[2]
            self._partial = {"train": tuple(train), "skip": skip, "rng": state["rng"][self.rank]}
        elif partial is not None and self._reshards() and "batch" in partial:
            sums = [sum(t[i] for t in partial["train"]) for i in range(3)]
            position = {**partial, "world": state["world_size"], "train": sums}
            self._go_on_from(partial["epoch"], position, state["rng"][self.rank % state["world_size"]])
        if self.rank != 0:
            return
        if partial is None:
            log.warning("resuming from %s after epoch %d", self.opts.checkpoint, state["epoch"])
        elif self._partial is not None and (state["world_size"] == self.world or layout[0] == "handed"):
            log.warning(
                "resuming from %s in epoch %d after %d batches",
                self.opts.checkpoint,
                partial["epoch"],
                partial["batches"],
            )
        elif self._base is not None:
            log.warning(
                "resuming from %s in epoch %d after %d batches of %d ranks: the %d samples left are resharded",
                self.opts.checkpoint,
                partial["epoch"],
                partial["batches"],
                state["world_size"],
                len(self._base),
            )
        else:
            log.warning(
                "resuming from %s, stopped in epoch %d, with another number of ranks: epoch %d starts over "
                "(its first %d batches were trained on the old shards)",
                self.opts.checkpoint,
                partial["epoch"],
                partial["epoch"],
                partial["batches"],
            )


def _first_parameter(factory: Callable[..., Any]) -> str | None:
    """The name of ``factory``'s first parameter, if it can be known."""
    try:
        return next(iter(inspect.signature(factory).parameters), None)
    except (TypeError, ValueError):  # a builtin or a C callable: no signature
        return None


def _to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (in lists, tuples, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _count(targets: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (targets of any structure)."""
    if isinstance(targets, torch.Tensor):
        return len(targets) if targets.dim() else 1
    values = targets.values() if isinstance(targets, dict) else targets if isinstance(targets, (list, tuple)) else ()
    for value in values:
        n = _count(value)
        if n:
            return n
    return 0


def _hits(out: Any, targets: Any) -> int | None:
    """Correct predictions when ``out`` is class logits (N, C) for class-index targets (N,);
    None for any other output (a tuple, a dict, a regression): no accuracy is claimed."""
    if not (isinstance(out, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return None
    if out.dim() != 2 or targets.dim() != 1 or targets.is_floating_point() or len(out) != len(targets):
        return None
    return int((out.argmax(1) == targets).sum())


def _with_last(items: Iterable[Any]) -> Iterable[tuple[Any, bool]]:
    """Yield ``(item, is_last)`` without knowing the length in advance."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def _on_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (dicts, lists, tuples) moved to the CPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def _padded(order: list[int], world: int) -> list[int]:
    """``order`` repeated from its start to a multiple of ``world`` in length (as the default
    sampler pads its shards: every rank gets as many samples)."""
    total = -(-len(order) // world) * world
    return (order * (-(-total // max(len(order), 1))))[:total]


def _rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_state(encoded: str) -> None:
    raw = base64.b64decode(encoded)
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
