"""Where in an epoch training is: one :class:`EpochPosition` for a resume from a stop
signal's checkpoint, an elastic snapshot a regroup goes back to, and a rank's own start in
an epoch that goes on mid-way; and the RNG states that go with it.

A checkpoint holds it (as ``partial``) as a dict with a ``version`` (:data:`VERSION`); a
checkpoint written before positions were versioned (its ``partial`` dict without one:
epoch, batches, every rank's sums, and from later versions on the samples left, the batch
size and the data layout) is read as one too (:meth:`EpochPosition.from_checkpoint`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

#: The version of the position a checkpoint holds (1: the unversioned ``partial`` dict).
VERSION = 2
#: A rank's loss sums over an epoch so far: (loss sum, samples, batches).
Sums = tuple[float, int, int]
NO_SUMS: Sums = (0.0, 0, 0)


@dataclass(frozen=True)
class EpochPosition:
    """A point in ``epoch``: after ``batches`` batches of every rank's shard (of the samples
    left, where the epoch went on mid-way; under ``layout ("handed", B)`` the batches the
    first server handed out), with the loss sums so far.

    Where one rank's own start is meant (where it takes up an epoch: the trainer's
    ``resume_at``), ``train`` holds its sums, ``batches`` its batches to skip and ``rngs``
    the RNG state it takes once its loader has started."""

    epoch: int
    batches: int
    #: The ranks that shared the epoch up to here, and each one's batch size then (None: not
    #: known, a checkpoint from before it was saved: the epoch cannot go on resharded).
    world: int = 1
    batch: int | None = None
    #: The samples that were left of the epoch when it went on mid-way (None: the sampler's).
    base: list[int] | None = None
    #: The loss sums so far: by rank, or one entry holding every rank's total.
    train: tuple[Sums, ...] = ()
    #: RNG states to take there (encoded), by rank (empty where they are kept beside it).
    rngs: tuple[str, ...] = ()
    #: How the epoch's batches were split: ``("shares", N)`` (each of N ranks its shard) or
    #: ``("handed", B)`` (``async_ps``: handed out in one order, B samples a batch).
    layout: tuple[str, int] = ("shares", 1)

    @classmethod
    def of_rank(cls, epoch: int, sums: Sums, skip: int, rng: str) -> EpochPosition:
        """A rank's own start in ``epoch``: its ``sums`` so far, ``skip`` batches of its shard
        done, ``rng`` to take once its loader has started."""
        return cls(epoch, skip, train=(tuple(sums),), rngs=(rng,))  # type: ignore[arg-type]

    @property
    def sums(self) -> Sums:
        """A rank's own sums (see :meth:`of_rank`)."""
        return self.train[0]

    @property
    def rng(self) -> str:
        """A rank's own RNG state (see :meth:`of_rank`)."""
        return self.rngs[0]

    def totals(self) -> Sums:
        """The sums of every rank added up."""
        return tuple(sum(t[i] for t in self.train) for i in range(3))  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """What a checkpoint holds (plain values, with the format's ``version``)."""
        return {
            "version": VERSION,
            "epoch": self.epoch,
            "batches": self.batches,
            "world": self.world,
            "batch": self.batch,
            "base": self.base,
            "train": [list(t) for t in self.train],
            "rngs": list(self.rngs),
            "layout": list(self.layout),
        }

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> EpochPosition:
        version = saved.get("version")
        if version != VERSION:
            raise ValueError(f"a checkpoint's epoch position of version {version!r}: this dataparallel reads {VERSION}")
        return cls(
            epoch=int(saved["epoch"]),
            batches=int(saved["batches"]),
            world=int(saved["world"]),
            batch=saved["batch"],
            base=saved["base"],
            train=tuple(tuple(t) for t in saved["train"]),
            rngs=tuple(saved["rngs"]),
            layout=(str(saved["layout"][0]), int(saved["layout"][1])),
        )

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> EpochPosition | None:
        """The position a checkpoint was written at within the epoch after its ``epoch``
        (a stop signal's, its ``partial``), or None (written at an epoch's end). Reads both
        today's versioned dict and the unversioned one of checkpoints from before it."""
        partial = state.get("partial")
        if partial is None:
            return None
        if "version" in partial:
            return cls.from_dict(partial)
        world = int(state["world_size"])
        layout = partial.get("layout") or ["shares", world]  # (from before layouts were saved: DDP's shares)
        return cls(
            epoch=int(partial["epoch"]),
            batches=int(partial["batches"]),
            world=world,
            batch=partial.get("batch"),
            base=partial.get("base"),
            train=tuple(tuple(t) for t in partial["train"]),
            layout=(str(layout[0]), int(layout[1])),
        )


def order(data: Any, epoch: int, world: int, base: list[int] | None, shuffle: bool, seed: int) -> list[int]:
    """The order in which ``world`` ranks train ``epoch``'s samples of ``data``: rank r takes
    every world-th from r (the default sampler's shards, interleaved, or ``base`` padded)."""
    if base is not None:
        return padded(base, world)
    if not isinstance(data, Dataset):
        raise TypeError("only a Dataset's epoch can go on mid-way")
    shards = []
    for rank in range(world):
        sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed
        )
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return [shard[j] for j in range(len(shards[0])) for shard in shards]


def padded(order: list[int], world: int) -> list[int]:
    """``order`` repeated from its start to a multiple of ``world`` in length (as the default
    sampler pads its shards: every rank gets as many samples)."""
    total = -(-len(order) // world) * world
    return (order * (-(-total // max(len(order), 1))))[:total]


def rng_state() -> str:
    """This process's CPU RNG state, encoded (JSON and the control channel carry it)."""
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def set_rng_state(encoded: str) -> None:
    raw = base64.b64decode(encoded)
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
