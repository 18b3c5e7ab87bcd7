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
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from .channel import RESERVED_PREFIX, ControlChannel
from .errors import ChannelClosed

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
