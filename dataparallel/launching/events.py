"""The job's event log in a file, kept by the launcher (``dataparallel launch --events FILE``,
the setting ``events``).

The ranks record the job's events in its channel (joins, losses, regroups, checkpoints,
agreed stops, stalls, stragglers, stack dumps: :func:`~dataparallel.control.status.record_event`),
which keeps the last 256 while the job runs; with the setting, each rank also appends its own
to ``FILE`` (the launcher hands its workers the path), so that none of the node's is lost
when the job ends. The launcher follows the channel from outside, as ``dataparallel status``
reads it (:func:`dataparallel.observe`: it holds no rank and writes nothing), five times a
second, and appends the events the file does not hold yet (the other nodes' ranks'), with
what only the launcher sees: a worker's exit, its restart (elastic) or the group's
(``max_restarts``: a new job name, followed too), a signal that stops the job. An elastic
job's generations (``JOB~1``...) are followed as they come, each as long as it has a run.
One JSON object a line: ``job``, ``time``, ``rank``, ``by``, ``host``, ``kind``, ``detail``.
The file outlives the job and its restarts; ``dataparallel status --events FILE`` shows it.

What another node's rank records in the job's last moments (its coordinator gone with rank 0
before the next look) may miss this file: that node's launcher's file has it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ControlError

if TYPE_CHECKING:
    from ..config import JobConfig
    from ..control.channel import ControlChannel
    from ..control.status import EventFollower

log = logging.getLogger(__name__)

#: Seconds between two looks at the channel's events; every how many looks the job's next
#: generations (an elastic job's) are looked for; how long an observer's call may block; how
#: long a generation is still read once a newer one began (its last events).
FOLLOW_EVERY, PROBE_EVERY, OBSERVER_TIMEOUT, OLD_FOR = 0.2, 5, 1.0, 10.0


def _key(event: dict[str, Any]) -> str:
    """What tells one event from another (the same event read in the channel and the file),
    whatever a line holds."""
    return json.dumps([event.get("time"), event.get("by"), event.get("kind")], default=repr)


class EventFile:
    """Appends the job's events to ``path`` while inside (a thread follows the channel)."""

    def __init__(self, path: str | Path, config: JobConfig, url: str) -> None:
        self.path = Path(path)
        self.config, self.url = config, url
        self.job = config.job  # the job to follow: the configured one, or a restarted group's
        self._current = config.job  # the newest generation of it followed (an elastic job's JOB~N)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._keys: set[str] = set()  # the events in the file
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The job's user only: errors and stack frames may say more than others should read.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as err:
            raise ConfigError(f"cannot write the event file {str(self.path)!r}: {err.strerror}") from None
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._read_at = self._file.tell()  # where the file's lines not read yet begin

    def __enter__(self) -> EventFile:
        self._thread = threading.Thread(target=self._follow, name="dp-launch-events", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def follow(self, job: str) -> None:
        """Follow ``job`` from now on (the group restarted under a new name)."""
        self.job = job

    def note(self, kind: str, detail: str, rank: int | None = None) -> None:
        """An event only the launcher sees, written at once (never raises: a file that
        cannot be written is logged, the launch goes on)."""
        event = {"time": time.time(), "rank": rank, "by": "launcher", "host": socket.gethostname()}
        try:
            self._append({"job": self._current, **event, "kind": kind, "detail": detail})
        except (OSError, ValueError) as err:
            log.warning("event %s not written to %s: %s", kind, self.path, err)

    def _append(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._file.closed:
                return
            # A rank of this node writes its event to the file before the channel: what the
            # channel shows, the file holds by now where such a rank recorded it.
            self._learn()
            if _key(event) in self._keys:
                return
            self._keys.add(_key(event))
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()

    def _learn(self) -> None:
        """The events the node's ranks appended to the file since the last look (under the lock)."""
        with self.path.open("rb") as lines:
            lines.seek(self._read_at)
            for line in lines:
                if not line.endswith(b"\n"):
                    break  # a line being written: the next look reads it whole
                self._read_at += len(line)
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    self._keys.add(_key(json.loads(line)))

    def _open(self, job: str) -> ControlChannel:
        from ..connect import observe

        return observe(self.url, job=job, token=self.config.token, timeout=OBSERVER_TIMEOUT)

    def _follow(self) -> None:
        from ..control.membership import generation_job, later_generations
        from ..control.status import EventFollower

        following = ""
        # Each generation followed while it has a run: number -> (channel, its follower).
        live: dict[int, tuple[ControlChannel, EventFollower]] = {}
        superseded: dict[int, float] = {}  # generation -> when a newer one was found
        newest, looks = -1, 0
        # No last look once stopped: this node's ranks wrote their own events already, and the
        # job's coordinator may be gone with its rank 0 (a look would wait out its timeout).
        while not self._stop.wait(FOLLOW_EVERY):
            if following != self.job:  # a restarted group: its own job name
                _close_all(live)
                superseded.clear()
                following, newest, looks = self.job, -1, 0
            looks += 1
            try:
                # The generations after the newest followed (one gap passed over: a generation
                # that came and went between two looks), every PROBE_EVERY looks.
                # The newest again where its channel failed (its coordinator restarting).
                if looks % PROBE_EVERY == 1:
                    after = newest - 1 if newest >= 0 and newest not in live else newest
                    for channel, number in later_generations(self._open, following, after):
                        live[number] = (channel, EventFollower())
                        newest = max(newest, number)
                        superseded.setdefault(number - 1, time.monotonic())
                        self._current = generation_job(following, newest)
                for number, (channel, follower) in sorted(live.items()):
                    try:
                        for event in follower.new(channel):
                            self._append({"job": channel.observed_job, **event})
                        # An older generation: read while its last events may still come, for
                        # OLD_FOR seconds after a newer one began, as long as it has a run.
                        since = superseded.get(number, time.monotonic())
                        over = number < newest and (time.monotonic() - since > OLD_FOR or not channel._reattach())
                    except ControlError as err:  # its run over, its coordinator gone
                        log.debug("events of job %r: %s", channel.job, err)
                        over = number < newest  # the newest is tried again: it may be starting
                    if over or channel.failure is not None:
                        channel.close()
                        del live[number]
            except (ControlError, OSError) as err:
                log.debug("events of job %r not read: %s", following, err)
        _close_all(live)

    def close(self) -> None:
        """Stop following (a look under way ends first), then close the file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * OBSERVER_TIMEOUT)  # a look under way: bounded, then left
        with self._lock:
            self._file.close()


def _close_all(live: dict[int, tuple[ControlChannel, EventFollower]]) -> None:
    for channel, _ in live.values():
        with contextlib.suppress(ControlError):
            channel.close()
    live.clear()


def read_event_file(path: str | Path) -> list[dict[str, Any]]:
    """The events of a launcher's file, in its order (lines that are not events skipped)."""
    from ..control.status import _is_event

    events = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError, RecursionError):
            event = json.loads(line)
            if isinstance(event, dict) and _is_event(event):
                events.append(event)
    return events
