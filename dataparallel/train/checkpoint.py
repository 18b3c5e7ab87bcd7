"""``dp.fit``'s checkpoints: what one holds, writing it, resuming from it (where it is kept:
:mod:`.storage`).

A checkpoint is a dict (``torch.save``): the model, optimizer, scheduler and scaler states,
every rank's RNG state, the history, and where a stop signal's is written within an epoch,
that position as ``partial`` (:class:`~dataparallel.train.position.EpochPosition`,
versioned; the unversioned ``partial`` dict of earlier checkpoints is read too).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..control.status import record_event
from .options import EpochMetrics
from .position import NO_SUMS, EpochPosition, set_rng_state
from .storage import load, save_atomically

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger(__name__)


class Checkpoints:
    """One rank's side of the checkpoints of a ``fit`` (the driver writes them; every rank
    resumes from the driver's read)."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def due(self, epoch: int) -> bool:
        """Whether ``epoch`` ends with a checkpoint: every ``checkpoint_every`` epochs and the last."""
        opts = self.t.opts
        return opts.checkpoint is not None and ((epoch + 1) % opts.checkpoint_every == 0 or epoch == opts.epochs - 1)

    def target(self) -> str | os.PathLike[str]:
        """Where the checkpoint goes (only asked where ``checkpoint`` is set)."""
        if self.t.opts.checkpoint is None:
            raise ValueError("no checkpoint: set TrainOptions(checkpoint=PATH)")
        return self.t.opts.checkpoint

    def save(self, epoch: int, rng_states: list[str], position: EpochPosition | None = None) -> None:
        """The state after ``epoch`` (``position``: a stop signal's, in the epoch after it),
        in the phase ``checkpoint`` (what ``dataparallel status`` shows while it is written)."""
        with self.t.ch.status.phase("checkpoint"):
            self._save(epoch, rng_states, position)

    def _save(self, epoch: int, rng_states: list[str], position: EpochPosition | None) -> None:
        t = self.t
        extra = t.spec.extra_state
        state = {
            "epoch": epoch,
            "model": t.ddp.module.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
            "scaler": t.scaler.state_dict(),
            "rng": rng_states,
            "world_size": t.world,
            "history": [asdict(m) for m in t.history.epochs],
            "best": t.best,
            "options": {"seed": t.opts.seed, "batch_size": t.opts.batch_size},
            "step": t.global_step,
            "extra": extra[0]() if extra is not None else None,
            "partial": position.to_dict() if position is not None else None,  # a stop signal's
        }
        save_atomically(state, self.target())
        where = f", stopped within epoch {epoch + 1} after {position.batches} batches" if position is not None else ""
        record_event(t.ch, "checkpoint", f"after epoch {epoch}{where}: {self.target()}")

    def resume(self) -> None:
        """With ``resume=True``: the driver reads the checkpoint, every rank takes it up: at
        the next epoch, or within the stopped one (on as many ranks, at the stop; on another
        number, its samples left resharded where the strategy allows, else from its start)."""
        t = self.t
        if not t.opts.resume:
            return
        state = None
        if t.rank == 0:
            state = load(self.target())
        if state is not None and state["world_size"] != t.world:
            log.warning(
                "resuming from %s, written by %d ranks, with %d: the data is resharded "
                "(model, optimizer, scheduler and scaler are the same on every rank); rank r takes the RNG "
                "state of saved rank r mod %d",
                t.opts.checkpoint,
                state["world_size"],
                t.world,
                state["world_size"],
            )
        box = [state]
        dist.broadcast_object_list(box, src=0, group=t.pg, device=t.device if t.device.type == "cuda" else None)
        state = box[0]
        if state is None:
            return
        t.ddp.module.load_state_dict(state["model"])
        t.ddp.module.zero_grad(set_to_none=True)  # the interrupted step's partial gradients
        t.optimizer.load_state_dict(state["optimizer"])
        if t.scheduler is not None and state["scheduler"] is not None:
            t.scheduler.load_state_dict(state["scheduler"])
        t.scaler.load_state_dict(state["scaler"])
        saved_world, rngs = state["world_size"], state["rng"]
        set_rng_state(rngs[t.rank % len(rngs)])
        t.history.epochs = [EpochMetrics(**m) for m in state["history"]]
        t.best = tuple(state["best"])
        t.start_epoch = state["epoch"] + 1
        t.global_step = state.get("step", 0)
        extra = t.spec.extra_state
        if extra is not None and state.get("extra") is not None:
            extra[1](state["extra"])
        position = EpochPosition.from_checkpoint(state)
        layout = t.strategy.data_layout()
        saved = position.layout if position is not None else ("shares", saved_world)
        moved = position is not None and saved != layout
        reshardable = saved[0] == layout[0] == "shares" and saved[1] == saved_world and t.reshards()
        if position is not None and moved and not reshardable:
            # Batches handed out and shares, or shares among other ranks: not the same positions.
            (log.warning if t.rank == 0 else log.info)(
                "resuming from %s, stopped in epoch %d with its batches split otherwise (%s, now %s): epoch %d "
                "starts over (its first %d batches were trained then)",
                t.opts.checkpoint, position.epoch, list(saved), list(layout), position.epoch, position.batches,
            )  # fmt: skip
            position = None
        if position is not None and layout[0] == "handed":  # async_ps: the rest handed out, to any workers
            sums = position.totals() if t.rank == 0 else NO_SUMS
            t.resume_at = EpochPosition.of_rank(position.epoch, sums, position.batches, rngs[t.rank % saved_world])
        elif position is not None and not moved:
            train = position.train[t.rank]
            t.base = position.base
            # In an epoch that went on mid-way every rank's shard of its samples left is as long:
            # the batches done are the stop's (rank 0's sums carry those before, too).
            skip = position.batches if t.base is not None else train[2]
            t.resume_at = EpochPosition.of_rank(position.epoch, train, skip, rngs[t.rank])
        elif position is not None and t.reshards() and position.batch is not None:
            t.elastic.go_on_from(position, rngs[t.rank % saved_world])
        if t.rank == 0:
            self._say_resumed(state, position)

    def _say_resumed(self, state: dict[str, Any], position: EpochPosition | None) -> None:
        t = self.t
        if position is None:
            log.warning("resuming from %s after epoch %d", t.opts.checkpoint, state["epoch"])
        elif t.resume_at is not None and (state["world_size"] == t.world or t.strategy.data_layout()[0] == "handed"):
            log.warning(
                "resuming from %s in epoch %d after %d batches", t.opts.checkpoint, position.epoch, position.batches
            )
        elif t.base is not None:
            log.warning(
                "resuming from %s in epoch %d after %d batches of %d ranks: the %d samples left are resharded",
                t.opts.checkpoint,
                position.epoch,
                position.batches,
                state["world_size"],
                len(t.base),
            )
        else:
            log.warning(
                "resuming from %s, stopped in epoch %d, with another number of ranks: epoch %d starts over "
                "(its first %d batches were trained on the old shards)",
                t.opts.checkpoint,
                position.epoch,
                position.epoch,
                position.batches,
            )
