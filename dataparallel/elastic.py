"""Membership generations: the ranks that survive a lost peer carry on as a new, smaller job.

A channel's world size is fixed when it is opened, and a lost peer ends its collectives
for good (every rank learns of it as :class:`~dataparallel.PeerLost`). Elastic training
therefore moves the survivors to a new *generation*: the driver (rank 0) decides who carries
on, and each survivor opens a fresh channel to the same coordinator or store under the job
name ``JOB~G``, ranked by its old rank among the survivors. Nothing here depends on a
transport: the decision travels through the old channel's own keys, with the calls that a
loss does not end (writes and non-blocking reads), so every transport, a user's own
included, supports it.

The decision, for generation ``G``: every survivor writes ``__dp/elastic/G/ready/RANK``;
the driver waits until each rank of the old generation is ready or known lost (at most
``settle`` seconds; a rank still silent then is left out), then writes the members under
``__dp/elastic/G/members``, which the others wait for, and waits (as long again at most)
until each member has written ``__dp/elastic/G/seen/RANK``: the decision reaches them even
when the driver ends right after it (too few survivors) and takes the coordinator with it.

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
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .channel import RESERVED_PREFIX, ControlChannel
from .errors import ChannelClosed, ControlError

_POLL = 0.05


def generation_job(job: str, generation: int) -> str:
    """The name of ``job``'s ``generation`` (0: the job itself)."""
    return job if generation == 0 else f"{job}~{generation}"


def survivors(ch: ControlChannel, generation: int, settle: float) -> list[int]:
    """The ranks of ``ch`` that carry on into ``generation``, as its rank 0 decides; called
    on every surviving rank after a loss. Rank 0 waits up to ``settle`` seconds for the
    others; the others wait up to ``settle`` plus ``ch.timeout``."""
    base = f"{RESERVED_PREFIX}elastic/{generation}"
    ready, seen, decided = f"{base}/ready/", f"{base}/seen/", ch._scoped(f"{base}/members")
    ch._set(ch._scoped(f"{ready}{ch.rank}"), b"1")
    if ch.rank == 0:
        members = sorted(_wait_for(ch, ready, range(ch.world_size), settle))
        ch._set(decided, json.dumps(members).encode())
        _wait_for(ch, seen, members[1:], settle)
        return members
    deadline = time.monotonic() + settle + ch.timeout
    while not ch._check([decided]):
        if ch.failure is not None:
            raise ch.failure
        if time.monotonic() >= deadline:
            raise ChannelClosed(
                f"job {ch.job!r}: rank 0 did not say who carries on into generation {generation} "
                f"within {settle + ch.timeout:g}s (is the driver alive?)"
            )
        time.sleep(_POLL)
    members = json.loads(ch._get(decided, ch.timeout) or b"[]")
    ch._set(ch._scoped(f"{seen}{ch.rank}"), b"1")
    if ch.rank not in members:
        raise ChannelClosed(
            f"job {ch.job!r}: rank {ch.rank} was left out of generation {generation} (members {members}): "
            f"it was not ready within {settle:g}s of the loss"
        )
    return members


def _wait_for(ch: ControlChannel, prefix: str, ranks: Iterable[int], seconds: float) -> set[int]:
    """The ``ranks`` that wrote ``prefix + RANK``, waiting up to ``seconds`` for each of them
    to do so or to be declared lost (those lost are left out)."""
    deadline = time.monotonic() + seconds
    pending, found = set(ranks), set()
    while True:
        pending -= set(ch.lost_peers())
        found |= {r for r in pending if ch._check([ch._scoped(f"{prefix}{r}")])}
        pending -= found
        if not pending or time.monotonic() >= deadline:
            return found - set(ch.lost_peers())
        time.sleep(_POLL)


# ---------------------------------------------------------------------- newcomers
_RUNNING, _COUNT = "running", "count"


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


def open_queue(channel: ControlChannel, timeout: float) -> ControlChannel:
    """A channel to ``channel``'s join queue: same coordinator or store and token, no rank
    (it never joins, so it is not watched and never watches), never hosting."""
    queue = type(channel)(
        channel.url, rank=None, world_size=1, job=join_job(channel.job), token=channel.token, timeout=timeout,
        serve=False,
    )  # fmt: skip
    try:
        if not queue.native_auth:
            queue._agree_on_token()  # as dp.connect does; the coordinators check it themselves
    except BaseException:
        queue.close()
        raise
    return queue


def running(queue: ControlChannel) -> bool:
    """Whether the queue's job is training (its driver marked it so)."""
    return queue.check([_RUNNING])


def await_admission(queue: ControlChannel, job: str) -> Admission:
    """Queue this process and wait for the driver to seat it at an epoch boundary, as long
    as the driver lives (its ``running`` mark moves). Raises :class:`ChannelClosed` when the
    job ends first, or its driver stops moving the mark for the liveness timeout."""
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
    silence = queue.liveness_timeout + 2 * queue.heartbeat_interval
    beat, moved = b"", time.monotonic()
    while True:
        number = queue.add(_COUNT, 1) - 1
        queue.set(f"request/{number}", me)
        while not queue.check([f"offer/{number}"]):
            now = time.monotonic()
            if not queue.check([_RUNNING]):
                raise ChannelClosed(f"job {job!r} ended before its driver admitted this process")
            if (seen := queue.get(_RUNNING, queue.timeout)) != beat:
                beat, moved = seen, now
            elif now - moved > silence:
                raise ChannelClosed(
                    f"job {job!r}: its driver stopped marking the job running {now - moved:.0f}s ago (longer than "
                    f"the liveness timeout, {queue.liveness_timeout:g}s): it is gone; nothing admits this process"
                )
            time.sleep(min(0.5, queue.heartbeat_interval / 2))
        if queue.compare_set(f"answer/{number}", b"", b"accept") == b"accept":
            break  # else withdrawn (taken too late): queue again
    seat = json.loads(queue.get(f"seat/{number}", queue.timeout))
    return Admission(job, seat["generation"], seat["rank"], seat["world_size"], seat["after"])


class JoinQueue:
    """The driver's side of the join queue: marks the job running, and seats newcomers."""

    def __init__(self, channel: ControlChannel, timeout: float) -> None:
        self.queue = open_queue(channel, timeout)
        self.queue.add(_RUNNING, 1)
        self._next = self.queue.add(_COUNT, 0)  # numbers taken before this run are not its
        self._done = threading.Event()
        self._beat = threading.Thread(target=self._mark, name="dp-join-queue", daemon=True)
        self._beat.start()

    def _mark(self) -> None:
        """Move the ``running`` mark every heartbeat: the newcomers' sign that the driver lives."""
        while not self._done.wait(self.queue.heartbeat_interval):
            try:
                self.queue.add(_RUNNING, 1)
            except ControlError:
                return  # the coordinator is gone with the job: the newcomers notice

    def waiting(self) -> list[int]:
        """The numbers of the newcomers queued since the last look, in order."""
        numbers = []
        for number in range(self._next, self.queue.add(_COUNT, 0)):
            if not self.queue.check([f"request/{number}"]):
                break  # taken, not yet written: next time
            numbers.append(number)
        return numbers

    def seat(self, numbers: list[int], generation: int, world_size: int, settle: float) -> list[int]:
        """Offer ``generation`` to the newcomers ``numbers``; seat those who take it within
        ``settle`` seconds as ranks ``world_size``, ``world_size + 1``... Returns them, in
        rank order. Every number passed is done with (a withdrawn newcomer queues again)."""
        for number in numbers:
            self.queue.set(f"offer/{number}", str(generation).encode())
        self._next = max(numbers, default=self._next - 1) + 1
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
