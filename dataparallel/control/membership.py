"""Membership generations: the ranks that survive a lost peer carry on as a new, smaller job.

A channel's world size is fixed when it is opened, and a lost peer ends its collectives
for good (every rank learns of it as :class:`~dataparallel.PeerLost`). Elastic training
therefore moves the survivors to a new *generation*: the driver (rank 0) decides who carries
on, and each survivor opens a fresh channel to the same coordinator or store under the job
name ``JOB~G``, ranked by its old rank among the survivors. Nothing here depends on a
transport: the decision travels through the old channel's own keys, with the calls that a
loss does not end (writes and non-blocking reads), so every transport, a user's own
included, supports it.

The decision, on the channel of the generation that lost a rank (each channel decides once):
every survivor writes ``__dp/elastic/ready/RANK``; the driver waits until each rank of that
generation is ready or known lost (at most ``settle`` seconds; a rank still silent then is
left out), then writes the members and the next generation's number (above any it promised
newcomers) under ``__dp/elastic/members``, which the others wait for, and waits (as long
again at most) until each member has written ``__dp/elastic/seen/RANK``: the decision
reaches them even when the driver ends right after it (too few survivors) and takes the
coordinator with it.

Newcomers (a process started while the job runs, or a lost one started again) join at an
epoch boundary through the job's *join queue*, the job ``JOB~join`` on the same coordinator
or store, which no rank ever joins (so no loss ever ends it): the driver marks it
``running`` once its job has met and moves that mark every heartbeat while it lives, and
:func:`dataparallel.connect` of an elastic process that finds the mark queues there instead
of claiming a rank; it waits as long as the mark moves (a dead driver is noticed after the
liveness timeout). Each newcomer takes a
number ``I`` (``add`` on ``count``) and writes ``request/I``; at an epoch boundary the
driver writes ``offer/I`` (the next generation) to those waiting, each newcomer takes its
offer (``compare_set`` of ``answer/I`` from empty to ``accept``), the driver withdraws those
not taken within the settle time (the same ``compare_set``, to ``withdrawn``: exactly one
of the two wins) and writes ``seat/I`` (rank and world size) for each that accepted. The
members then move to that generation with them, the newcomers taking the ranks after theirs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..errors import ChannelClosed, ControlError
from .channel import ControlChannel
from .registry import ChannelURL

log = logging.getLogger(__name__)

_POLL = 0.05


def generation_job(job: str, generation: int) -> str:
    """The name of ``job``'s ``generation`` (0: the job itself)."""
    return job if generation == 0 else f"{job}~{generation}"


def later_generations(
    open_job: Callable[[str], ControlChannel], job: str, generation: int
) -> Iterator[tuple[ControlChannel, int]]:
    """An elastic job carries on in generations, each a job of its own (``JOB~1``, ``JOB~2``...:
    :func:`generation_job`). The channels (``open_job(name)``,
    observers) to the generations after ``generation`` that have a run, oldest first, with
    their numbers (one gap passed over: a generation that came and went between two looks);
    the caller closes each."""
    missed = 0
    while missed < 2:
        generation += 1
        try:
            channel = open_job(generation_job(job, generation))
        except ControlError:
            missed += 1
            continue
        missed = 0
        yield channel, generation


def newest_generation(
    open_job: Callable[[str], ControlChannel], job: str, generation: int
) -> tuple[ControlChannel, int] | None:
    """The newest of :func:`later_generations` (the others closed); None where none has a run."""
    found: tuple[ControlChannel, int] | None = None
    for later in later_generations(open_job, job, generation):
        if found is not None:
            found[0].close()
        found = later
    return found


def survivors(ch: ControlChannel, generation: int, settle: float) -> tuple[list[int], int]:
    """The ranks of ``ch`` that carry on, and the number of the generation they carry on as;
    called on every surviving rank after a loss. One of them decides (rank 0, or where the
    driver itself was lost the first survivor to claim it): it waits up to ``settle`` seconds
    for the others to say they are ready, and numbers the generation ``generation`` (its
    proposal) or above any its driver promised newcomers; the others wait up to ``settle``
    plus ``ch.timeout``. The new generation's rank 0, its driver, is the lowest old rank
    among the members."""
    if ch.rank is None:
        raise ValueError(f"{ch!r} holds no rank")
    rank = ch.rank
    keys = ch.reserved("elastic")
    keys.set(f"ready/{rank}", b"1")
    me = str(rank).encode()

    def deciding() -> bool:  # rank 0, or once rank 0 is lost the first survivor: whoever claims it first
        return (rank == 0 or 0 in ch.lost_peers()) and keys.compare_set("decider", b"", me) == me

    deadline = time.monotonic() + settle + ch.timeout
    while not keys.check("members"):
        if deciding():
            members = sorted(_wait_for(ch, "ready/", range(ch.world_size), settle) | {rank})
            generation = max(generation, promised(ch) + 1)
            keys.set("members", json.dumps({"members": members, "generation": generation}).encode())
            _wait_for(ch, "seen/", [m for m in members if m != rank], settle)
            return members, generation
        if ch.failure is not None:
            raise ch.failure
        decider = keys.get("decider") if keys.check("decider") else b""
        if decider and int(decider) in ch.lost_peers():
            raise ChannelClosed(f"job {ch.job!r}: rank {int(decider)}, deciding who carries on, was lost too")
        if time.monotonic() >= deadline:
            raise ChannelClosed(
                f"job {ch.job!r}: no rank said who carries on into the next generation within "
                f"{settle + ch.timeout:g}s (is the driver alive, or a coordinator outside it?)"
            )
        time.sleep(_POLL)
    decision = json.loads(keys.get("members") or b"{}")
    members, generation = decision.get("members", []), decision.get("generation", generation)
    keys.set(f"seen/{ch.rank}", b"1")
    if ch.rank not in members:
        raise ChannelClosed(
            f"job {ch.job!r}: rank {ch.rank} was left out of generation {generation} (members {members}): "
            f"it was not ready within {settle:g}s of the loss"
        )
    return members, generation


def promise(ch: ControlChannel, generation: int) -> None:
    """Note in ``ch`` (the current generation's channel) that its driver offered newcomers
    ``generation``: whoever decides after a loss numbers the next one above it."""
    ch.reserved("elastic").set("promised", str(generation).encode())


def promised(ch: ControlChannel) -> int:
    """The highest generation ``ch``'s driver offered newcomers (0: none)."""
    keys = ch.reserved("elastic")
    return int(keys.get("promised") or b"0") if keys.check("promised") else 0


def _wait_for(ch: ControlChannel, prefix: str, ranks: Iterable[int], seconds: float) -> set[int]:
    """The ``ranks`` that wrote ``prefix + RANK`` (elastic keys), waiting up to ``seconds``
    for each of them to do so or to be declared lost (those lost are left out)."""
    keys = ch.reserved("elastic")
    deadline = time.monotonic() + seconds
    pending, found = set(ranks), set()
    while True:
        pending -= set(ch.lost_peers())
        found |= {r for r in pending if keys.check(f"{prefix}{r}")}
        pending -= found
        if not pending or time.monotonic() >= deadline:
            return found - set(ch.lost_peers())
        time.sleep(_POLL)


# ---------------------------------------------------------------------- newcomers
_RUNNING, _COUNT, _NEXT = "running", "count", "next"


def join_job(job: str) -> str:
    """The name of ``job``'s join queue."""
    return f"{job}~join"


@dataclass(frozen=True)
class Admission:
    """A newcomer's seat in a running elastic job."""

    job: str  # the job's own name (generation 0's)
    generation: int
    rank: int
    world_size: int
    after: int  # the world size of the generation before, whose ranks come first


def open_queue(
    url: ChannelURL, cls: type[ControlChannel], job: str, token: str | None, timeout: float
) -> ControlChannel:
    """A channel to ``job``'s join queue at ``url``: no rank (it never joins, so it is not
    watched and never watches), never hosting the coordinator."""
    queue = cls(url, rank=None, world_size=1, job=join_job(job), token=token, timeout=timeout, serve=False)
    try:
        if not queue.native_auth:
            queue.agree_on_token()  # as dp.connect does; the coordinators check it themselves
    except BaseException:
        queue.close()
        raise
    return queue


#: The join queues :func:`newcomer` opened (by ``id``, dropped when the channel is: a
#: transport's channel need not be hashable), with the job each waits to join.
_NEWCOMERS: dict[int, str] = {}


def newcomer(
    url: ChannelURL, cls: type[ControlChannel], job: str, token: str | None, timeout: float
) -> ControlChannel | None:
    """Where ``job`` is training elastically: a channel to its join queue, through which
    ``dp.fit`` waits for a seat (:func:`await_admission`); None where it is not running."""
    queue = open_queue(url, cls, job, token, timeout)
    try:
        if running(queue):
            log.warning("job %r is running: this process joins it at an epoch boundary, once dp.fit is called", job)
            _NEWCOMERS[id(queue)] = job
            weakref.finalize(queue, _NEWCOMERS.pop, id(queue), None)
            return queue
    except BaseException:
        queue.close()
        raise
    queue.close()
    return None


def joining(channel: ControlChannel) -> str | None:
    """The job ``channel`` waits to join as a newcomer (a join queue :func:`newcomer`
    opened, which holds no rank), or None: it holds its rank."""
    return _NEWCOMERS.get(id(channel))


def _silence(queue: ControlChannel) -> float:
    """How long the driver's mark may stand still before its driver counts as gone."""
    return queue.liveness_timeout + 2 * queue.heartbeat_interval


def _mark(queue: ControlChannel) -> bytes | None:
    """The driver's mark as it is now (None: there is none)."""
    if not queue.check([_RUNNING]):
        return None
    try:
        return queue.get(_RUNNING, min(1.0, queue.timeout))
    except ControlError:
        return None  # deleted in between: the job ended


def running(queue: ControlChannel) -> bool:
    """Whether the queue's job is training: its driver's mark is there and moves (it moves
    every heartbeat; one left by a driver that died stands still, and counts for nothing).
    Waits up to one heartbeat for a live mark to move, up to the liveness timeout for a stale one."""
    first = _mark(queue)
    if first is None:
        return False
    deadline = time.monotonic() + _silence(queue)
    while time.monotonic() < deadline:
        time.sleep(min(0.2, queue.heartbeat_interval / 4))
        now = _mark(queue)
        if now != first:
            return now is not None
    return False


def await_admission(queue: ControlChannel, job: str) -> Admission:
    """Queue this process and wait for the driver to seat it at an epoch boundary, as long
    as the driver lives (its ``running`` mark moves). Raises :class:`ChannelClosed` when the
    job ends first, or its driver's mark stands still for the liveness timeout (a frozen
    coordinator included: a watcher fails the queue's channel, which ends a call blocked in it)."""
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
    silence = _silence(queue)
    moved = [time.monotonic()]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            if time.monotonic() - moved[0] > silence + 1.0:
                queue.fail_with(ChannelClosed(f"job {job!r}: its driver's coordinator stopped answering"))
                return

    watcher = threading.Thread(target=watch, name="dp-join-watch", daemon=True)
    watcher.start()
    try:
        beat = b""
        while True:
            number = queue.add(_COUNT, 1) - 1
            queue.set(f"request/{number}", me)
            while not queue.check([f"offer/{number}"]):
                now, seen = time.monotonic(), _mark(queue)
                if seen is None:
                    raise ChannelClosed(f"job {job!r} ended before its driver admitted this process")
                if seen != beat:
                    beat, moved[0] = seen, now
                elif now - moved[0] > silence:
                    raise ChannelClosed(
                        f"job {job!r}: its driver stopped marking the job running {now - moved[0]:.0f}s ago "
                        f"(longer than the liveness timeout, {queue.liveness_timeout:g}s): it is gone; nothing "
                        "admits this process"
                    )
                time.sleep(min(0.5, queue.heartbeat_interval / 2))
            if queue.compare_set(f"answer/{number}", b"", b"accept") == b"accept":
                break  # else withdrawn (taken too late): queue again
        seat = json.loads(queue.get(f"seat/{number}", queue.timeout))
        return Admission(job, seat["generation"], seat["rank"], seat["world_size"], seat["after"])
    finally:
        done.set()


class JoinQueue:
    """The driver's side of the join queue: marks the job running, and seats newcomers."""

    def __init__(self, channel: ControlChannel, job: str, take_over: bool = False) -> None:
        """``take_over``: a driver that replaces a lost one goes on where that one was."""
        self.queue = open_queue(channel.url, type(channel), job, channel.token, channel.timeout)
        if take_over and self.queue.check([_NEXT]):
            self._next = int(self.queue.get(_NEXT, self.queue.timeout))
        else:
            self._next = self.queue.add(_COUNT, 0)  # numbers taken before this run are not its
            self.queue.set(_NEXT, str(self._next).encode())  # for a driver that takes over
        self._missing: dict[int, float] = {}  # numbers taken whose request is not there: since when
        self.queue.add(_RUNNING, 1)
        self._done = threading.Event()
        self._beat = threading.Thread(target=self._move_mark, name="dp-join-queue", daemon=True)
        self._beat.start()

    @property
    def alive(self) -> bool:
        """Whether the mark still moves (newcomers wait only as long as it does)."""
        return self._beat.is_alive()

    def _move_mark(self) -> None:
        """Move the ``running`` mark every heartbeat: the newcomers' sign that the driver lives."""
        while not self._done.wait(self.queue.heartbeat_interval):
            try:
                self.queue.add(_RUNNING, 1)
            except ControlError as err:
                if self.queue.failure is not None:
                    log.warning("join queue of job %r: %s; no more newcomers are admitted", self.queue.job, err)
                    return  # the coordinator is gone with the job: the newcomers notice
                # else one call failed (a reset connection): the next heartbeat tries again

    def waiting(self) -> list[int]:
        """The numbers of the newcomers queued since the last look, in order. A number taken
        whose request does not appear within the liveness timeout (its taker died in between)
        is passed over."""
        numbers, now = [], time.monotonic()
        for number in range(self._next, self.queue.add(_COUNT, 0)):
            if self.queue.check([f"request/{number}"]):
                numbers.append(number)
            elif now - self._missing.setdefault(number, now) < _silence(self.queue):
                break  # taken, not yet written: next time
        return numbers

    def seat(self, numbers: list[int], generation: int, world_size: int, settle: float) -> list[int]:
        """Offer ``generation`` to the newcomers ``numbers``; seat those who take it within
        ``settle`` seconds as ranks ``world_size``, ``world_size + 1``... Returns them, in
        rank order. Every number up to the last passed is done with (a withdrawn newcomer
        queues again)."""
        for number in numbers:
            self.queue.set(f"offer/{number}", str(generation).encode())
        if numbers:
            self._next = numbers[-1] + 1
            self.queue.set(_NEXT, str(self._next).encode())  # for a driver that takes over
        deadline = time.monotonic() + settle
        pending = set(numbers)
        while pending and time.monotonic() < deadline:
            pending -= {n for n in pending if self.queue.check([f"answer/{n}"])}
            time.sleep(_POLL)
        seated = [n for n in numbers if self.queue.compare_set(f"answer/{n}", b"", b"withdrawn") == b"accept"]
        size = world_size + len(seated)
        for rank, number in enumerate(seated, start=world_size):
            seat = {"generation": generation, "rank": rank, "world_size": size, "after": world_size}
            self.queue.set(f"seat/{number}", json.dumps(seat).encode())
        return seated

    def close(self) -> None:
        self._done.set()
        self._beat.join(timeout=self.queue.timeout)
        try:
            self.queue.delete(_RUNNING)
        except ControlError:
            pass  # the coordinator may be gone with the job
        self.queue.close()
