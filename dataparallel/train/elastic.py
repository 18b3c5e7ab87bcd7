"""The trainer's side of an elastic job (``TrainOptions.elastic``): the state an epoch goes
back to (snapshots, kept in memory on every rank), the regroup after a loss, the growth
that seats newcomers at an epoch boundary, and a newcomer's admission. The membership
protocol itself (survivors, promises, the join queue, generations' job names) is
:mod:`dataparallel.control.membership`'s."""

from __future__ import annotations

import base64
import contextlib
import copy
import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ..connect import reopen
from ..control import membership
from ..control.channel import ControlChannel
from ..control.process_group import init_process_group
from ..control.status import record_event
from ..errors import ControlError, PeerLeft, PeerLost
from .data import on_cpu
from .options import Regroup
from .position import NO_SUMS, EpochPosition, Sums, order, rng_state, set_rng_state

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger(__name__)


class ElasticState:
    """One rank's generations of the job: where it is, what it goes back to."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer
        self.opened: list[ControlChannel] = []  # the generations' channels this loop opened
        #: A newcomer's seat in a running elastic job (its channel from ``dp.connect`` is to the
        #: job's join queue): waited for before anything else (:meth:`take_seat`).
        self.admission: membership.Admission | None = None
        self.queue: membership.JoinQueue | None = None  # the driver's, for newcomers
        self.snapshot: dict[str, Any] | None = None  # the current epoch's start (or its last snapshot)
        self.generation = 0
        self.job = ""  # generation 0's name
        self.first_world = self.base_world = self.max_world = 0

    def begin(self, channel: ControlChannel) -> None:
        """The job as this rank found it (``channel``: its first generation's, or the seat's)."""
        admission = self.admission
        self.generation = admission.generation if admission is not None else 0
        self.job = admission.job if admission is not None else channel.job
        self.first_world = channel.world_size if admission is None else admission.after
        self.max_world = self.t.settings.max_world_size or channel.world_size
        self.base_world = channel.world_size  # the job's first (a newcomer gets the driver's)

    def check(self) -> None:
        """What an elastic job needs of its setup, before the rendezvous."""
        t, settings = self.t, self.t.settings
        if t.pg is not None or dist.is_initialized():
            raise ValueError(
                "elastic training makes its own process groups: pass no process_group= and initialise none"
            )
        if settings.max_world_size is not None and settings.max_world_size < self.first_world:
            raise ValueError(f"max_world_size={settings.max_world_size} is below the job's {self.first_world} ranks")
        if t.ch.url.port == 0:
            raise ValueError(f"elastic training needs the coordinator at a fixed port: {t.ch.url.shown}")

    # ------------------------------------------------------------------ generations
    def take_seat(self, queue: ControlChannel) -> ControlChannel:
        """A newcomer (``queue``: the join queue ``dp.connect`` gave it): wait there until the
        driver seats it, then join that generation (its channel is closed when training
        ends). Any other channel is returned as it is."""
        job = membership.joining(queue)
        if job is None:
            return queue
        admission = membership.await_admission(queue, job)
        log.warning(
            "admitted to job %r as rank %d of %d (generation %d)",
            job, admission.rank, admission.world_size, admission.generation,
        )  # fmt: skip
        self.admission = admission
        return self.open_generation(queue, job, admission.generation, admission.rank, admission.world_size)

    def open_generation(self, like: ControlChannel, job: str, generation: int, rank: int, size: int) -> ControlChannel:
        """A channel to ``job``'s ``generation`` as ``rank`` of ``size``, on ``like``'s
        coordinator or store with its settings (:func:`~dataparallel.connect.reopen`: the
        URL, token and configuration as resolved once; closed when training ends)."""
        new = reopen(like, rank=rank, world_size=size, job=membership.generation_job(job, generation))
        self.opened.append(new)
        return new

    def open_queue(self) -> None:
        """The driver's join queue, for newcomers (after the rendezvous: no first rank finds it marked)."""
        if self.t.settings.elastic and self.t.rank == 0:
            self.queue = membership.JoinQueue(self.t.ch, self.job)

    def close(self) -> None:
        """The queue and every generation's channel this loop opened."""
        self.close_queue()
        for channel in reversed(self.opened):
            channel.close()

    def close_queue(self) -> None:
        if self.queue is not None:
            queue, self.queue = self.queue, None
            queue.close()

    def _form_group(self, new: ControlChannel, generation: int) -> None:
        """The process group of a new generation once its ranks have met, watched from the
        start (a rank lost while it forms is noticed, not waited for), DDP around the model."""
        t = self.t
        self._meet(new, generation)
        init_process_group(new, device=t.device, timeout=t.opts.collective_timeout)
        t.pg = dist.group.WORLD
        t.watchdog.start()
        t.strategy.wrap()

    def grow_timeout(self) -> float:
        """How long a new generation's rendezvous waits for its ranks (newcomers included)."""
        ch = self.t.ch
        return min(ch.timeout, max(30.0, 3 * ch.liveness_timeout))

    def _meet(self, new: ControlChannel, generation: int) -> None:
        """Every rank of a new generation at its rendezvous, within :meth:`grow_timeout`: one
        that never comes (it died since it was counted in) is a loss, which the others regroup
        from (it never joined, so no heartbeat of its would ever go missing)."""
        try:
            new.rendezvous(timeout=self.grow_timeout())
        except ControlError as err:
            missing = [r for r in range(new.world_size) if new.peer_info(r) is None] or [new.world_size - 1]
            why = f"rank(s) {missing} did not join generation {generation}: {err}"
            raise PeerLost(missing[0], None, why) from err

    def _leave_group(self) -> None:
        self.t.watchdog.stop()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    # ------------------------------------------------------------------ snapshots
    def can_regroup(self, failure: PeerLost) -> bool:
        """A rank lost (not one that left) in an elastic job that has state to go back to. The
        driver too: where the coordinator or store outlives it (etcd, ``dataparallel serve``),
        the lowest surviving rank drives the next generation; where it does not, the channel
        fails with it and the survivors' regroup with it."""
        return self.t.settings.elastic and not isinstance(failure, PeerLeft) and self.snapshot is not None

    def keep(self, epoch: int, position: EpochPosition | None) -> None:
        """Keep the state now as the one a regroup goes back to (``position``: where in
        ``epoch``; None: its start), with every rank's RNG state there, by rank (what a
        checkpoint written there holds). The collectives these need come first (a loss there
        leaves the last snapshot in place); the old copy goes before the new one is made."""
        rngs = self._every_rng(position.rng if position is not None else rng_state())
        self.snapshot = None
        self.snapshot = self.state_now(epoch)
        self.snapshot["rngs"] = rngs
        if position is not None:
            self.snapshot["position"] = position

    def _every_rng(self, mine: str) -> list[str]:
        """Every rank's RNG state (``mine``: this rank's, encoded), by rank: one all-gather
        (a CPU generator's state has the same size on every rank)."""
        t = self.t
        raw = torch.frombuffer(bytearray(base64.b64decode(mine)), dtype=torch.uint8).to(t.device)
        every = [torch.empty_like(raw) for _ in range(t.world)]
        dist.all_gather(every, raw, group=t.pg)
        return [base64.b64encode(state.cpu().numpy().tobytes()).decode() for state in every]

    def position(self, batches: int, sums: Sums, rng: str | None = None) -> EpochPosition:
        """Where the current epoch is, after ``batches`` batches of every rank's shard (since
        it last went on mid-way): what goes on from there needs. ``sums``: this rank's,
        summed over the ranks (an all-reduce: every rank has the totals, for whichever is
        rank 0 next). ``rng``: the RNG state to take once the loader has started (default:
        this process's now)."""
        t = self.t
        summed = torch.tensor(list(sums), dtype=torch.float64, device=t.device)
        dist.all_reduce(summed, group=t.pg)
        total = summed.tolist()
        return EpochPosition(
            epoch=t.epoch,
            batches=batches,
            world=t.world,
            batch=t.batch_size,
            base=t.base,
            train=((float(total[0]), int(total[1]), int(total[2])),),
            rngs=(rng or rng_state(),),
        )

    def go_on_from(self, position: EpochPosition, rng: str) -> None:
        """Make the next training of ``position.epoch`` go on from ``position`` on this
        generation's ranks: the samples not yet trained, resharded; the epoch's sums so far
        on rank 0."""
        t = self.t
        if position.batch is None:
            raise ValueError("an epoch position without its batch size cannot go on resharded")
        done = position.batches * position.batch * position.world
        t.base = order(t.train_data, position.epoch, position.world, position.base, t.opts.shuffle, t.opts.seed)[done:]
        train = position.totals() if t.rank == 0 else NO_SUMS
        t.resume_at = EpochPosition.of_rank(position.epoch, train, 0, rng)

    def state_now(self, epoch: int) -> dict[str, Any]:
        """What an epoch redone from its start needs, copied (it stays in memory, every rank)."""
        t = self.t
        return {
            "epoch": epoch,
            "model": {k: v.detach().clone() for k, v in t.ddp.module.state_dict().items()},
            "optimizer": copy.deepcopy(t.optimizer.state_dict()),
            "scheduler": copy.deepcopy(t.scheduler.state_dict()) if t.scheduler is not None else None,
            "scaler": copy.deepcopy(t.scaler.state_dict()),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(t.device) if t.device.type == "cuda" else None,
            "step": t.global_step,
            "epochs": len(t.history.epochs),
            "best": t.best,
        }

    def restore(self, state: dict[str, Any]) -> None:
        t = self.t
        state = copy.deepcopy(state)  # kept intact for another loss in the same epoch
        t.ddp.module.load_state_dict(state["model"])
        t.ddp.module.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        t.optimizer.load_state_dict(state["optimizer"])
        if t.scheduler is not None:
            t.scheduler.load_state_dict(state["scheduler"])
        t.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], t.device)
        t.global_step = state["step"]
        del t.history.epochs[state["epochs"] :]
        t.best = state["best"]

    # ------------------------------------------------------------------ regroup, grow, admit
    def regroup(self, failure: PeerLost) -> int:
        """Carry on without the lost ranks: agree on the survivors through the old channel,
        open the next generation's channel and process group, go back to the state of the
        current epoch's start (or its last snapshot). Returns the epoch to redo. New rank r
        takes the RNG state old rank r had there, as a job resumed on the survivors from a
        checkpoint written there gives rank r the saved state of rank r (not the survivor's
        own: where rank 0 or a middle rank is lost, the survivors' ranks move down)."""
        t = self.t
        started = time.monotonic()
        log.warning("rank %d: %s; regrouping without it", t.rank, failure)
        t.watchdog.stop()
        t.reports.close_bar()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        old, settle = t.ch, t.ch.liveness_timeout + 2 * t.ch.heartbeat_interval
        members, generation = membership.survivors(old, self.generation + 1, settle)
        lost = sorted(set(range(old.world_size)) - set(members))
        fewest = t.settings.min_world_size
        if len(members) < fewest:
            reason = f"{failure.reason}; {len(members)} rank(s) left, fewer than min_world_size={fewest}"
            raise PeerLost(failure.rank, failure.last_seen, reason, during=failure.during)
        rank = members.index(t.rank)
        new = self.open_generation(old, self.job, generation, rank, len(members))
        t.ch, t.rank, t.world, self.generation = new, rank, new.world_size, generation
        t.publish_status()
        if t.rank == 0 and t.settings.elastic and self.queue is None:  # the driver was lost: this one drives
            self.queue = membership.JoinQueue(new, self.job, take_over=True)
        snapshot = self.snapshot
        if snapshot is None:  # can_regroup saw one
            raise failure
        self.restore(snapshot)
        rng = snapshot["rngs"][t.rank]
        set_rng_state(rng)
        self.resize()
        t.base, t.resume_at = None, None
        position: EpochPosition | None = snapshot.get("position")
        if position is not None:  # kept mid-epoch: only the samples not yet trained are left
            self.go_on_from(position, rng)
        self._form_group(new, generation)
        epoch = int(snapshot["epoch"])
        seconds = time.monotonic() - started
        t.history.regroups.append(Regroup(epoch, lost, len(members), generation, seconds))
        if t.rank == 0:
            detail = (
                f"generation {generation}: {len(members)} rank(s) carry on without rank(s) {lost} from epoch {epoch}"
            )
            record_event(new, "regroup", detail)
        where = f"the start of epoch {epoch}"
        if t.base is not None:
            where = f"epoch {epoch} after {position.batches if position else 0} batches ({len(t.base)} samples left)"
        log.warning(
            "rank %d (was %d): generation %d carries on with %d ranks without rank(s) %s, from %s (regrouped in %.2fs)",
            t.rank, old.rank, generation, len(members), lost, where, seconds,
        )  # fmt: skip
        return epoch

    def grow(self, command: dict[str, Any]) -> None:
        """Move to the generation the driver seated newcomers in (``command``): every member
        keeps its rank, the newcomers take the ranks after them; a new channel and process
        group, and the driver's state to the newcomers. Where a newcomer does not come, the
        members regroup without it (as after a loss, from this epoch boundary)."""
        t = self.t
        started, epoch = time.monotonic(), command["epoch"]
        self.keep(epoch, None)  # what a failed admission goes back to
        self._leave_group()
        old, generation, size = t.ch, command["generation"], command["world_size"]
        new = self.open_generation(old, self.job, generation, t.rank, size)
        t.ch, t.world, self.generation = new, size, generation
        t.publish_status()
        self.resize()
        self._form_group(new, generation)
        self.share_state(old.world_size, epoch)
        seconds = time.monotonic() - started
        joined = list(range(old.world_size, size))
        t.history.regroups.append(Regroup(epoch, [], size, generation, seconds, joined))
        if t.rank == 0:
            record_event(new, "regroup", f"generation {generation}: newcomer(s) {joined} joined, {size} ranks")
            log.warning(
                "generation %d: newcomer(s) %s joined; %d ranks from epoch %d (in %.2fs)",
                generation, joined, size, epoch, seconds,
            )  # fmt: skip

    def joined(self, started: float) -> int:
        """A newcomer's start, once seated: the driver's state (every rank of the grown group
        takes part); returns the epoch to train."""
        t, admission = self.t, self.admission
        if admission is None:
            raise RuntimeError("not a newcomer")
        epoch = self.share_state(admission.after)
        joined = list(range(admission.after, t.world))
        t.history.regroups.append(Regroup(epoch, [], t.world, self.generation, time.monotonic() - started, joined))
        return epoch

    def resize(self) -> None:
        """With ``keep_global_batch``: the per-rank batch and accumulation that keep the job's
        first global batch on this generation's world size."""
        t, opts = self.t, self.t.opts
        if not opts.keep_global_batch:
            return
        first = opts.batch_size * opts.grad_accum * self.base_world
        share = first // t.world
        if callable(t.train_data) and not isinstance(t.train_data, Dataset):
            # The batches are the source's: only the number accumulated per step can change.
            t.grad_accum = max(1, round(first / (opts.batch_size * t.world)))
            kept = opts.batch_size * t.grad_accum * t.world
        else:
            k = -(-share // opts.batch_size)  # the fewest steps of at most batch_size
            while share % k:
                k += 1
            t.batch_size, t.grad_accum = share // k, k
            kept = share * t.world
        how = "kept" if kept == first else f"not divisible: {kept} instead of"
        log.warning(
            "rank %d: %d ranks: batch %d x %d accumulated per rank, global batch %s %d",
            t.rank, t.world, t.batch_size, t.grad_accum, how, first,
        )  # fmt: skip

    def share_state(self, after: int, epoch: int = 0) -> int:
        """The driver's state to the newcomers (the ranks from ``after`` on) of a grown group,
        on every rank of it (collectives); returns the epoch to train. A newcomer takes the RNG
        state of rank ``rank % after``, as a job resumed on more ranks does."""
        t = self.t
        extra = t.spec.extra_state
        state: dict[str, Any] = {}
        if t.rank == 0:  # on the CPU: unpickled on the device it was pickled from
            state = on_cpu({**self.state_now(epoch), "cuda_rng": None})
            state["history"] = t.history
            state["base_world"] = self.base_world
            state["extra"] = extra[0]() if extra is not None else None
        box: list[Any] = [state]
        device = t.device if t.device.type == "cuda" else None
        dist.broadcast_object_list(box, src=0, group=t.pg, device=device)
        rngs: list[Any] = [None] * t.world
        dist.all_gather_object(rngs, rng_state(), group=t.pg)
        state = box[0]
        if t.rank < after:
            return int(state["epoch"])
        t.history = state["history"]
        self.base_world = state["base_world"]
        self.resize()
        self.restore(state)
        set_rng_state(rngs[t.rank % after])
        if extra is not None and state["extra"] is not None:
            extra[1](state["extra"])
        return int(state["epoch"])

    def admit(self, next_epoch: int) -> dict[str, Any] | None:
        """On the driver, at an epoch boundary: seat the newcomers waiting in the join queue
        (up to ``max_world_size``) in the next generation; the command that moves there."""
        t = self.t
        if self.queue is None or t.resume_at is not None or t.base is not None:
            return None  # (an epoch going on mid-way: its shards are the members')
        if not self.queue.alive:  # its newcomers have given up waiting
            self.close_queue()
            return None
        try:
            waiting = self.queue.waiting()
            room = self.max_world - t.world
            if not waiting or room <= 0:
                return None
            generation = max(self.generation, membership.promised(t.ch)) + 1
            membership.promise(t.ch, generation)
            seated = self.queue.seat(waiting[:room], generation, t.world, settle=t.ch.liveness_timeout)
        except ControlError as err:  # the queue is a convenience: training goes on without it
            log.warning("driver: the join queue failed (%s); no more newcomers are admitted", err)
            self.close_queue()
            return None
        if not seated:
            return None
        return {"cmd": "grow", "epoch": next_epoch, "generation": generation, "world_size": t.world + len(seated)}
