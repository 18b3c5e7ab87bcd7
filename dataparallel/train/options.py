"""What ``dp.fit`` is asked to do (:class:`TrainOptions`) and what it gives back
(:class:`FitResult`, :class:`EpochMetrics`, :class:`Regroup`, :class:`StepInfo`).

The options hold what the caller said, nothing read from elsewhere: the settings left None
here (``elastic``, ``min_world_size``, ``max_world_size``) are resolved once, by ``fit``,
from the channel's configuration (:mod:`dataparallel.train.spec`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
    #: Fail a job that stands still this long (seconds) with :class:`~dataparallel.Stalled`
    #: on every rank, naming the rank the others wait for and what it does, instead of waiting
    #: out ``collective_timeout``: the driver reads every rank's status once a second (what
    #: ``dataparallel status`` shows) and every rank looks for its verdict as often (one
    #: request a second each). A stall is a rank gone silent, or ranks behind others that wait
    #: (:func:`dataparallel.control.status.diagnose`), for this long. None: no such check.
    stall_timeout: float | None = None
    #: Serve the job's view over HTTP from the driver, at ``"[HOST:]PORT"`` (bound to
    #: 127.0.0.1 unless HOST says otherwise): a page at ``/``, ``/status.json``, and
    #: ``/metrics`` in Prometheus' format (``pip install 'dataparallel[observe]'``), each
    #: read-only and, with the job's token, only for requests that carry it
    #: (:mod:`dataparallel.control.status_http`). None: not served.
    status_http: str | None = None
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
    #: channel's ``elastic`` setting (``channel.config``, as ``dp.connect`` resolved it:
    #: ``DP_ELASTIC``, as ``dataparallel launch --elastic`` sets it), else False. Newcomers (processes
    #: started later with the same settings, or a lost one started again) are admitted at
    #: epoch boundaries, up to ``max_world_size``.
    elastic: bool | None = None
    #: The fewest ranks an elastic job carries on with. None: the channel's ``min_world_size``
    #: setting (``DP_MIN_WORLD_SIZE``, or ``world_size = "MIN:MAX"`` in the file), else 1.
    min_world_size: int | None = None
    #: The most ranks an elastic job grows to by admitting newcomers. None: the channel's
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
    #: (:mod:`dataparallel.train.strategies.paramserver`).
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
            from .storage import check

            check(self.checkpoint)  # an unknown scheme fails here, not after an epoch
        if self.checkpoint_every < 1 or (self.log_every is not None and self.log_every < 1):
            raise ValueError("checkpoint_every and log_every must be >= 1")
        if self.scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {self.scheduler_interval!r}")
        from .strategies import STRATEGIES

        if self.strategy not in STRATEGIES:
            names = ", ".join(repr(name) for name in STRATEGIES)
            raise ValueError(f"strategy must be one of {names}, got {self.strategy!r}")
        if self.ps_ranks < 1 or (self.max_staleness is not None and self.max_staleness < 0):
            raise ValueError(f"ps_ranks must be >= 1 and max_staleness >= 0 or None, got {self.ps_ranks!r}, "
                             f"{self.max_staleness!r}")  # fmt: skip
        # What is given is checked now; what is left None, once resolved (``fit``).
        check_settings(self, self.elastic, self.min_world_size, self.max_world_size)
        for name in self.stop_signals:
            if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"stop_signals: {name!r} is not a signal that can be caught (e.g. 'SIGTERM')")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 or None, got {self.snapshot_every!r}")
        if self.status_http is not None:
            from ..control.status_http import parse_address

            parse_address(self.status_http)
        if self.stall_timeout is not None and not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds or None, got {self.stall_timeout!r}")
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


def check_settings(options: TrainOptions, elastic: bool | None, fewest: int | None, most: int | None) -> None:
    """The checks of the settings a channel's configuration may give (``elastic``,
    ``min_world_size``, ``max_world_size``) with ``options``: on what the options give when
    they are made, on the resolved values when ``fit`` resolves them (None: not known yet)."""
    from .strategies import STRATEGIES

    if fewest is not None and fewest < 1:
        raise ValueError(f"min_world_size must be >= 1, got {fewest!r}")
    if most is not None and most < (fewest or 1):
        raise ValueError(f"max_world_size ({most!r}) must be >= min_world_size ({fewest or 1!r})")
    STRATEGIES[options.strategy].check(options, elastic)
