"""What each rank is doing, said through the channel, and what a look at all of them shows.

A rank's :class:`RankStatus` (``channel.status``) holds its phase (waiting for data, forward,
backward with the gradient all-reduce, optimizer, validation, a named collective...), how
long it has been in it, its epoch and step, and its last steps' time split by phase. Setting
a phase is an attribute write under a lock: nothing travels then. Once published
(:meth:`RankStatus.publish`; ``dp.fit`` does it for every rank it trains), a daemon thread
writes the rank's record, a small JSON object, under ``__dp/status/RANK`` in the job's run
every ``interval`` seconds (the channel's heartbeat interval): one ``set`` a second per rank,
on every transport, batched with its node's others behind a node relay.

A published rank also dumps every thread's Python stack when it receives SIGUSR2
(:data:`STACKS_SIGNAL`, through :mod:`faulthandler`, from C, so wherever its main thread is:
in a collective, a blocking read, a Python loop), and its publishing thread puts the dump
under ``__dp/stacks/RANK`` within a quarter of a second, once it holds the GIL
(:func:`read_stacks`; ``dataparallel status --stacks``). Not SIGUSR1: that is a stop signal
(``TrainOptions.stop_signals``). A launcher passes the signal on to the workers of its node
that catch it.

Anyone holding the job's URL and token reads the records (:func:`read_job`, behind
``dataparallel status``) without joining the job, and :func:`diagnose` names the ranks a
stall waits for: a rank whose record stopped coming (frozen, cut off, dead), and, when ranks
have waited in one phase past a threshold, the ranks behind them and what each is doing.

The records' ages compare the reader's wall clock with the writer's: hosts keep their clocks
synchronised (NTP) for ages across hosts to mean anything; on one host they are exact.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import socket
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ControlError
from .keyspace import RESERVED_PREFIX, peer_key

if TYPE_CHECKING:
    from .channel import ControlChannel

log = logging.getLogger(__name__)

_STATUS = f"{RESERVED_PREFIX}status/"
#: Phases in which a rank waits for the others (the gradient all-reduce overlaps backward).
COLLECTIVE_PHASES = frozenset({"backward"})
#: The phases of a training step, in the order a step goes through them: a rank at an
#: earlier one (or an earlier step) than ranks waiting in a later one is behind them.
STEP_PHASES = ("data", "forward", "backward", "optimizer")
#: Steps whose time split and median step time a record carries (the last ones).
SPLIT_OVER = 16
#: A stall is a wait in one phase longer than this many times the job's median step time,
#: and never shorter than :data:`STALL_FLOOR` seconds.
STALL_STEPS, STALL_FLOOR = 5.0, 2.0
#: A record older than this many publishing intervals (at least :data:`SILENT_FLOOR`
#: seconds) is a rank gone silent: frozen, cut off, or dead.
SILENT_INTERVALS, SILENT_FLOOR = 3.0, 2.0
#: A record this young (seconds) says what its rank does now: a rank publishes once a second.
FRESH_WITHIN = 1.5
#: Phase changes and step ends a rank keeps (a ring) for its last steps' split: SPLIT_OVER
#: steps of up to 64 marks each (fewer steps where a step changes phase more often).
MARKS_KEPT = 64 * SPLIT_OVER

#: The clock of a phase change, bound once: the hot path of a step reads it as one global.
_clock = time.time


_STACKS = f"{RESERVED_PREFIX}stacks/"
#: The signal that makes a published rank dump its threads' Python stacks into the channel.
STACKS_SIGNAL = signal.SIGUSR2
#: How often the publishing thread looks for a new dump (a file size), seconds.
STACKS_LOOK = 0.25
#: Seconds a failing rank waits for its last record (``failed``) to be written.
FAILED_WRITE_WITHIN = 1.0
#: The most of a dump a record keeps (its end beyond is cut), characters.
STACKS_KEEP = 64_000


#: The process's dump file for the stacks signal (registered once, never taken back: a
#: signal that once dumped stacks never ends the process), and the RankStatus that
#: publishes what is written there: the newest to publish (an elastic job's newest
#: generation). Under the lock.
_SIGNAL_LOCK = threading.Lock()
_dump_file: list[Any] = [None]
_signal_owner: list[RankStatus | None] = [None]


def _identity() -> tuple[str, int]:
    from .procinfo import identity

    return identity()


def _catches_stacks_signal_already() -> bool:
    """Whether this process handles the stacks signal already, by Python or in C (a
    ``faulthandler.register`` of someone else's: Python's table says SIG_DFL then)."""
    if signal.getsignal(STACKS_SIGNAL) not in (signal.SIG_DFL, None):
        return True
    from .procinfo import catches

    return catches(os.getpid(), STACKS_SIGNAL)


def status_key(rank: int) -> str:
    """Where ``rank`` publishes its record (a hook-level key, inside the run)."""
    return f"{_STATUS}{rank}"


def stacks_key(rank: int) -> str:
    """Where ``rank`` puts its last dump of Python stacks."""
    return f"{_STACKS}{rank}"


class RankStatus:
    """One rank's own account of what it is doing (``channel.status``). Thread-safe; setting
    a phase (or ending a step) costs a clock read and an append to a ring of marks, no lock:
    it runs between a step's torch calls, where every line it touches is cold, so it does
    as little as it can; the split is made from the marks when a record is (once a second,
    off the training thread)."""

    def __init__(self, channel: ControlChannel) -> None:
        self._ch = channel
        self._lock = threading.Lock()
        self.phase_name = "joined"
        self.phase_since = time.time()
        self.epoch: int | None = None
        self.step: int | None = None
        self.device: str | None = None
        # Marks, oldest first: (phase left, time) a phase change, (phase, time, step) a step's
        # end, (None, time, None) the start of a stretch of steps. Appended by the training
        # thread without a lock (a deque's append is atomic), read whole by record().
        self._marks: deque[tuple[Any, ...]] = deque(((None, self.phase_since, None),), maxlen=MARKS_KEPT)
        self._steps_done = 0  # steps ended so far
        self._published = 0  # records written: a reader that sees the count move sees the rank live
        # The least median own time over a full window of steps, of the windows a record saw
        # (taken when a record is made, not at every step: a step's end stays a few appends),
        # and the count of steps ended at the last window taken.
        self._own_best: float | None = None
        self._own_best_at = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.interval = channel.heartbeat_interval
        self._carried = False  # whether the channel's heartbeats carry the record
        # Whether this rank publishes the stacks STACKS_SIGNAL dumps, and how much of the
        # process's dump file it has read.
        self._dumps = False
        self._dump_lock = threading.Lock()
        self._dumped = 0
        self.stacks_at: float | None = None  # when the last dump was put into the channel
        self.error: str | None = None  # why the rank failed (:meth:`failed`)
        self.phase_before: str | None = None  # the phase it failed in

    # ------------------------------------------------------------------ what the rank says
    def enter(self, phase: str) -> str:
        """Enter ``phase``; returns the phase left (the time spent in it counts to this step's
        split)."""
        now = _clock()
        left = self.phase_name
        self.phase_name, self.phase_since = phase, now
        self._marks.append((left, now))
        return left

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """In ``phase`` for the body; the phase before it again afterwards."""
        left = self.enter(phase)
        try:
            yield
        finally:
            self.enter(left)

    def at(self, epoch: int | None = None, step: int | None = None) -> None:
        """Where the rank is: its epoch and (global) step."""
        with self._lock:
            if epoch is not None:
                self.epoch = epoch
            if step is not None:
                self.step = step

    def step_done(self, step: int) -> None:
        """A step ended (the next begins): its time, split by the phases it went through."""
        now = _clock()
        self._marks.append((self.phase_name, now, step))
        self.phase_since = now
        self.step = step
        self._steps_done += 1

    def step_started(self) -> None:
        """The first step of a stretch begins now: what came before is no step's time."""
        now = _clock()
        self._marks.append((None, now, None))
        self.phase_since = now

    def own_time(self) -> float | None:
        """The median of the last steps' own time (all of a step but ``backward``: what a
        straggler is slow at), seconds; None before a step ended."""
        last = _last_steps(self._marks_now())
        return _own_time(last) if last else None

    def _marks_now(self) -> list[tuple[Any, ...]]:
        """The marks, copied whole while the training thread may append (in CPython one C
        call under the GIL; should an append come between, copied again)."""
        for _ in range(8):
            try:
                return list(self._marks)
            except RuntimeError:  # deque mutated during iteration
                continue
        return []

    def record(self) -> dict[str, Any]:
        """The rank's record as published (JSON-able)."""
        now = time.time()
        with self._lock:
            last = _last_steps(self._marks_now())
            if len(last) == SPLIT_OVER and self._steps_done != self._own_best_at:
                own = _own_time(last)
                self._own_best = own if self._own_best is None else min(self._own_best, own)
                self._own_best_at = self._steps_done
            split: dict[str, float] = {}
            for _, s in last:
                for name, seconds in s.items():
                    split[name] = split.get(name, 0.0) + seconds / len(last)
            self._published += 1
            return {
                "rank": self._ch.rank,
                "world_size": self._ch.world_size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "device": self.device,
                "phase": self.phase_name,
                "phase_s": round(now - self.phase_since, 4),
                "epoch": self.epoch,
                "step": self.step,
                "step_s": round(statistics.median(t for t, _ in last), 6) if last else None,
                "split": {k: round(v, 6) for k, v in split.items()},
                "own_s": round(_own_time(last), 6) if last else None,
                "own_best_s": None if self._own_best is None else round(self._own_best, 6),
                "time": now,
                "seq": self._published,
                "interval": self.interval,
                "stacks_at": self.stacks_at,
                "stacks_signal": STACKS_SIGNAL.name if self._dumps else None,
                "phase_before": self.phase_before,
                "identity": list(_identity()),
                "error": self.error,
            }

    # ------------------------------------------------------------------ publishing
    @property
    def publishing(self) -> bool:
        """Whether :meth:`publish` has started writing the record (and not stopped)."""
        return self._thread is not None

    @property
    def carried(self) -> bool:
        """Whether the record rides on the channel's heartbeats now (:meth:`publish`)."""
        return self._carried and self._ch._carried_by_heartbeats()

    def publish(self, interval: float | None = None) -> None:
        """Write the record now and then every ``interval`` seconds (default: the channel's
        heartbeat interval) until the channel closes, and dump the stacks on
        :data:`STACKS_SIGNAL` (:meth:`dump_stacks_on_signal`). Idempotent. The first write is
        made here: a failure to write it raises. At the heartbeat interval the record rides
        on the heartbeats (:meth:`Liveness.carry
        <dataparallel.control.liveness.Liveness.carry>`: inside a coordinator's heartbeat
        request, or in the same tick as a store's beat), on every transport whose liveness
        can carry it; else a thread of its own writes it."""
        if self._thread is not None:
            return
        if interval is not None:
            self.interval = interval
        self._write()
        self.dump_stacks_on_signal()
        self._stop.clear()
        self._carried = self.interval == self._ch.heartbeat_interval and self._ch._carry_on_heartbeats(self._riding)
        self._thread = threading.Thread(target=self._run, name=f"dp-status-r{self._ch.rank}", daemon=True)
        self._thread.start()

    def failed(self, error: BaseException) -> None:
        """What this rank was doing ended in ``error`` (``dp.fit`` raising): its record says
        so, once more, in the phase ``failed`` with the error, and publishing ends. A reader
        then tells a rank that failed (because another went wrong) from one gone silent."""
        self.error = f"{type(error).__name__}: {error}"[:500]
        if not self._end_publishing(within=FAILED_WRITE_WITHIN / 2):
            return
        self.phase_before = self.enter("failed")
        # Written aside, waited for a second at most: the store may be gone with what failed.
        writer = threading.Thread(target=self._write_quietly, name="dp-status-failed", daemon=True)
        writer.start()
        writer.join(timeout=FAILED_WRITE_WITHIN)

    def _end_publishing(self, within: float | None = None) -> bool:
        """The publishing stopped: the heartbeats carry the record no longer (a beat in
        flight waited for, ``within`` seconds at most, by default a heartbeat interval and a
        second), the thread stopped (waited for, bounded), and the stacks the signal dumps no
        longer this rank's to publish; False where it was not publishing."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return False
        if self._carried:
            self._carried = False
            self._ch._carry_on_heartbeats(None, self.interval + 1.0 if within is None else within)
        if thread is not threading.current_thread():
            thread.join(timeout=2 * self.interval)
        self._stop_publishing_dumps()
        return True

    def _stop_publishing_dumps(self) -> None:
        with self._dump_lock, _SIGNAL_LOCK:
            self._dumps = False
            if _signal_owner[0] is self:  # the signal stays registered: its dumps wait unread
                _signal_owner[0] = None

    def _write_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self._write()

    def stop(self, last_phase: str | None = None) -> None:
        """Stop publishing; with ``last_phase`` write the record once more in it."""
        if not self._end_publishing():
            return
        if last_phase is not None:
            self.enter(last_phase)
            with contextlib.suppress(ControlError):
                self._write()

    def _write(self) -> None:
        self._ch._set(*self._as_write())

    def _as_write(self) -> tuple[str, bytes]:
        rank = self._ch.rank
        if rank is None:
            raise ControlError(f"{self._ch!r} publishes its status before it holds a rank")
        return self._ch._scoped(status_key(rank)), json.dumps(self.record()).encode()

    def _riding(self) -> list[tuple[str, bytes]]:
        """The record as a heartbeat carries it; nothing once the publishing stops (the last
        record is the stopping one's to write)."""
        return [] if self._stop.is_set() else [self._as_write()]

    def _run(self) -> None:
        due = time.monotonic() + self.interval
        while not self._stop.wait(min(STACKS_LOOK, max(due - time.monotonic(), 0.0))):
            if self._ch.failure is not None:
                return
            try:
                self._publish_stacks()
                if time.monotonic() < due:
                    continue
                due = time.monotonic() + self.interval
                if not self.carried:  # not (or no longer) on the heartbeats: written here
                    self._write()
            except Exception as err:  # the liveness thread judges the store; try again
                log.debug("rank %s: status not written: %s", self._ch.rank, err)

    # ------------------------------------------------------------------ stacks on request
    def dump_stacks_on_signal(self) -> bool:
        """From now on (until :meth:`stop`), :data:`STACKS_SIGNAL` makes this process write
        every thread's Python stack (:func:`faulthandler.register`: from the signal handler
        in C, wherever the main thread is) to a file, and the publishing thread puts it into
        the channel. The signal stays registered for the process's life once registered (a
        later channel of the process takes its dumps over). Not where the process handles the
        signal already (a stop signal of ``dp.fit``'s, a handler of yours), nor off the main
        thread: False then."""
        with self._dump_lock, _SIGNAL_LOCK:
            if self._dumps:
                return True
            if _dump_file[0] is None:
                if threading.current_thread() is not threading.main_thread():
                    return False
                if _catches_stacks_signal_already():
                    log.info("rank %s: %s has a handler: no stacks on it", self._ch.rank, STACKS_SIGNAL.name)
                    return False
                dump = tempfile.TemporaryFile()  # for the process's life, as the registration
                faulthandler.register(STACKS_SIGNAL, file=dump, all_threads=True, chain=False)
                _dump_file[0] = dump
            self._dumps = True
            self._dumped = os.fstat(_dump_file[0].fileno()).st_size  # earlier dumps were another's
            _signal_owner[0] = self
            return True

    def dump_stacks(self, why: str) -> None:
        """Dump every thread's Python stack into the channel now (from any thread), as
        :data:`STACKS_SIGNAL` would; ``why`` goes into the job's event log."""
        with tempfile.TemporaryFile() as out:
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.seek(0)
            self._put_stacks(out.read().decode(errors="replace"), why)

    def _publish_stacks(self) -> None:
        with self._dump_lock:
            if not self._dumps or _signal_owner[0] is not self or _dump_file[0] is None:
                return
            fd = _dump_file[0].fileno()
            size = os.fstat(fd).st_size
            if size <= self._dumped:
                return
            time.sleep(0.02)  # the handler may be writing still: read once the size holds
            if os.fstat(fd).st_size != size:
                return
            text = os.pread(fd, size - self._dumped, self._dumped).decode(errors="replace")
            self._dumped = size
        self._put_stacks(text, f"{STACKS_SIGNAL.name}")

    def _put_stacks(self, text: str, why: str) -> None:
        rank = self._ch.rank
        if rank is None:
            return
        now = time.time()
        if len(text) > STACKS_KEEP:
            text = text[:STACKS_KEEP] + "\n...(cut)\n"
        dump = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": now, "why": why, "text": text}
        self._ch._set(self._ch._scoped(stacks_key(rank)), json.dumps(dump).encode())
        self.stacks_at = now
        main = _main_thread_stack(text)
        where = f"; the main thread, innermost first:\n{main}" if main else ""
        record_event(self._ch, "stacks", f"Python stacks dumped ({why}): `dataparallel status --stacks {rank}`{where}")


def _main_thread_stack(text: str, frames: int = 12) -> str:
    """The main thread's first ``frames`` frames in a dump of :mod:`faulthandler`'s."""
    ident = threading.main_thread().ident or 0
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("Thread 0x", "Current thread 0x")) and f"0x{ident:016x}" in line:
            block = []
            for frame in lines[i + 1 : i + 1 + frames]:
                if not frame.startswith("  "):
                    break
                block.append(frame.strip())
            return "\n".join(block)
    return ""


def _last_steps(marks: Sequence[tuple[Any, ...]]) -> list[tuple[float, dict[str, float]]]:
    """The last :data:`SPLIT_OVER` whole steps in ``marks`` (:class:`RankStatus`'s), oldest
    first: each its seconds and its split (seconds per phase)."""
    start, ends = len(marks), 0
    while start > 0:  # back to the boundary (a step's end, a stretch's start) the oldest kept began at
        start -= 1
        if len(marks[start]) == 3:
            if ends == SPLIT_OVER:
                break
            ends += marks[start][0] is not None
    steps: list[tuple[float, dict[str, float]]] = []
    began: float | None = None  # the step's start; None before the first boundary seen
    split: dict[str, float] = {}
    t = 0.0
    for mark in marks[start:]:
        name, at = mark[0], mark[1]
        if began is not None and name is not None:
            split[name] = split.get(name, 0.0) + at - t
        t = at
        if len(mark) == 3:  # a step's end (its phase's time counted above) or a stretch's start
            if began is not None and name is not None:
                steps.append((at - began, split))
            began, split = at, {}
    return steps[-SPLIT_OVER:]


def _own_time(steps: Sequence[tuple[float, dict[str, float]]]) -> float:
    """The median of the steps' own time: all of a step but ``backward``, where DDP's gradient
    all-reduce makes a rank wait for the others (what a straggler is slow at, the others are
    not)."""
    return statistics.median(total - split.get("backward", 0.0) for total, split in steps)


#: A rank whose own time per step is this much of the fastest rank's, or of its own best, or
#: less (a score), and longer than it by at least :data:`STRAGGLER_FLOOR` seconds, is a
#: straggler (the floor keeps a loaded machine's jitter of millisecond steps from being one;
#: a 15 ms step slowed 1.3x is 4.5 ms longer, and a floor of 5 ms missed it).
STRAGGLER_BELOW, STRAGGLER_FLOOR = 0.8, 0.002


def straggler_scores(ranks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each running rank's scores (its own time per step against the fastest rank's, and
    against its own best: 1.0 is as fast, 0.5 twice as slow), set in its entry as
    ``scores``; returns the stragglers (a score below :data:`STRAGGLER_BELOW`, by at least
    :data:`STRAGGLER_FLOOR` seconds a step), slowest first, each ``{"rank", "vs_fastest",
    "vs_own_best", "own_s", "cause"}``. A rank whose record is older than
    :data:`STALE_AFTER` of its intervals is not scored, nor anyone against it: what it says of
    its speed is of a time the others' records are not (a frozen rank's last fast steps would
    make the others look slow until it is named silent)."""
    timed = [
        r
        for r in ranks
        if r.get("state") == "running" and isinstance(r.get("own_s"), int | float) and r["own_s"] > 0 and not _stale(r)
    ]
    if not timed:
        return []
    fastest = min(float(r["own_s"]) for r in timed)
    found = []
    for r in timed:
        own = float(r["own_s"])
        scores = {"vs_fastest": round(fastest / own, 3), "vs_own_best": None}
        if isinstance(r.get("own_best_s"), int | float) and r["own_best_s"] > 0:
            scores["vs_own_best"] = round(min(float(r["own_best_s"]) / own, 1.0), 3)
        r["scores"] = scores  # type: ignore[index]
        low = min(v for v in scores.values() if v is not None)
        if low < STRAGGLER_BELOW and own * (1 - low) >= STRAGGLER_FLOOR:
            against = "the fastest rank" if scores["vs_fastest"] == low else "its own best"
            cause = f"its own time per step, {own * 1000:.1f} ms, is {1 / low:.2f}x {against}'s{_most_in(r)}"
            found.append({"rank": r["rank"], **scores, "own_s": own, "cause": cause, "_low": low})
    found.sort(key=lambda f: f.pop("_low"))
    return found


#: A record older than this many of its rank's publishing intervals is stale for scoring.
STALE_AFTER = 2.0


def _stale(entry: Mapping[str, Any]) -> bool:
    age, interval = entry.get("heartbeat_age"), entry.get("interval")
    if not isinstance(age, int | float):
        return False
    every = float(interval) if isinstance(interval, int | float) and interval > 0 else 1.0
    return age > STALE_AFTER * every


def _most_in(record: Mapping[str, Any]) -> str:
    """Where most of a rank's own time per step goes (its split's largest phase but
    ``backward``), as a cause's end: a straggler slow at its data loader is told from one
    slow at its forward or its optimizer."""
    split = record.get("split")
    if not isinstance(split, Mapping):
        return ""
    own = {k: v for k, v in split.items() if k != "backward" and isinstance(v, int | float) and v > 0}
    if not own:
        return ""
    phase = max(own, key=lambda k: own[k])
    return f"; most of it in {phase!r} ({own[phase] * 1000:.1f} ms)"


# ---------------------------------------------------------------------- the event log
_EVENTS = f"{RESERVED_PREFIX}events/"
#: Events a job keeps (the latest; each writer deletes the one this far behind its own).
KEEP_EVENTS = 256


def record_event(channel: ControlChannel, kind: str, detail: str, rank: int | None = None) -> None:
    """Add an event to the job's log (``kind``: ``join``, ``loss``, ``stall``, ``straggler``,
    ``checkpoint``, ``stop``...; ``rank``: the rank it is about, default the writer's): one
    ``add`` and one ``set``, and a ``delete`` of the event :data:`KEEP_EVENTS` behind; and a
    line in the job's event file where the channel's settings name one (``events``). Never
    raises: an event that cannot be written is left out (logged), the job goes on."""
    event = {
        "time": time.time(),
        "rank": channel.rank if rank is None else rank,
        "by": channel.rank,
        "host": socket.gethostname(),
        "kind": kind,
        "detail": detail,
    }
    path = getattr(channel.config, "events", None)
    if path:  # the job's event file (setting ``events``): this rank's own line, whatever the channel does
        try:  # the job's user only: errors and stack frames may say more than others should read
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a", encoding="utf-8") as out:
                out.write(json.dumps({"job": channel.job, **event}) + "\n")
        except OSError as err:
            log.info("job %r: event %s not written to %s: %s", channel.job, kind, path, err)
    try:
        number = channel._add(channel._scoped(f"{_EVENTS}next"), 1) - 1
        channel._set(channel._scoped(f"{_EVENTS}{number}"), json.dumps(event).encode())
        if number >= KEEP_EVENTS:
            channel._delete(channel._scoped(f"{_EVENTS}{number - KEEP_EVENTS}"))
    except Exception as err:
        log.info("job %r: event %s not recorded: %s", channel.job, kind, err)


def read_events(channel: ControlChannel, last: int = 20, deadline: float | None = None) -> list[dict[str, Any]]:
    """The job's last ``last`` events, oldest first (JSON lines' objects: ``time``, ``rank``,
    ``by``, ``host``, ``kind``, ``detail``)."""
    deadline = time.monotonic() + LOOK_WITHIN if deadline is None else deadline
    counter = channel._scoped(f"{_EVENTS}next")
    if not channel._check([counter]):
        return []
    raw = channel._get(counter, 1.0)
    count = int(raw) if raw and raw.isdigit() else 0
    first = max(count - min(last, KEEP_EVENTS), 0)
    events = _read_many(channel, [f"{_EVENTS}{n}" for n in range(first, count)], deadline)
    return [e for e in events if e is not None and _is_event(e)]


class EventFollower:
    """Follows a job's event log from outside (a launcher's file of it): each :meth:`new`
    returns the events recorded since the last call, oldest first. A new run of the job (its
    count restarted, or another event where the last one seen was) is followed from its first
    event; events the log no longer keeps are skipped. An event numbered but not yet written
    (its writer adds, then sets) waits for the next look, for :data:`MISSING_LOOKS` looks at
    most (a writer that died between the two leaves a gap for good)."""

    MISSING_LOOKS = 3

    def __init__(self) -> None:
        self.counted = 0  # events numbered so far that were returned (or skipped)
        self.last_time: float | None = None  # the last returned event's time
        self._missing: tuple[int, int] = (-1, 0)  # (number, looks) of an event numbered, not there

    def new(self, channel: ControlChannel) -> list[dict[str, Any]]:
        deadline = time.monotonic() + LOOK_WITHIN
        if channel.rank is None and not channel._reattach():
            return []
        counter = channel._scoped(f"{_EVENTS}next")
        raw = channel._get(counter, 1.0) if channel._check([counter]) else None
        count = int(raw) if raw and raw.isdigit() else 0
        if count < self.counted:
            self.counted = 0
        elif self.counted and self.last_time is not None:
            (prev,) = _read_many(channel, [f"{_EVENTS}{self.counted - 1}"], deadline)
            if prev is not None and prev.get("time") != self.last_time:
                self.counted = 0  # another run, which has recorded as many events already
        first = max(self.counted, count - KEEP_EVENTS)
        events = _read_many(channel, [f"{_EVENTS}{n}" for n in range(first, count)], deadline)
        got = []
        for i, event in enumerate(events):
            number = first + i
            if event is None:
                if time.monotonic() >= deadline:
                    break  # not read (the look ran out of time): no give-up counted
                looks = self._missing[1] + 1 if self._missing[0] == number else 1
                if looks < self.MISSING_LOOKS:
                    self._missing = (number, looks)
                    break
                continue  # given up on: a gap
            if _is_event(event):
                got.append(event)
                self.last_time = event["time"]
            self.counted = number + 1
        else:
            self.counted = max(self.counted, count)
        return got


def read_stacks(
    channel: ControlChannel, ranks: Sequence[int], deadline: float | None = None
) -> dict[int, dict[str, Any]]:
    """The last dump of Python stacks of each of ``ranks`` that has one: ``{rank: {"rank",
    "host", "pid", "time", "why", "text"}}`` (``text`` as :mod:`faulthandler` writes it)."""
    deadline = time.monotonic() + LOOK_WITHIN if deadline is None else deadline
    if channel.rank is None and not channel._reattach():
        raise ControlError(f"job {channel.observed_job!r} has no run: no rank of it has joined")
    dumps = _read_many(channel, [stacks_key(r) for r in ranks], deadline)
    return {
        r: d
        for r, d in zip(ranks, dumps, strict=True)
        if d is not None and isinstance(d.get("text"), str) and isinstance(d.get("time"), int | float)
    }


def _is_event(event: Mapping[str, Any]) -> bool:
    """Whether ``event`` has the fields an event of :func:`record_event`'s has, of their types."""
    return (
        _seconds_since_epoch(event.get("time"))
        and isinstance(event.get("kind"), str)
        and isinstance(event.get("detail"), str)
        and (event.get("rank") is None or type(event.get("rank")) is int)
        and (event.get("by") is None or type(event.get("by")) in (int, str))
    )


def _seconds_since_epoch(value: object) -> bool:
    """Whether ``value`` is a time a record or event may carry (a finite number, within the
    years a clock shows: not one that breaks ``time.localtime``)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value < 1e11


def _number_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value))


# ---------------------------------------------------------------------- reading the job
class JobWatch:
    """What a reader that looks again and again (``top``, the page, the driver's stall check)
    saw of each rank's record: the record's publish count and when, by this reader's own
    monotonic clock, it last moved. With one, a record's age is measured on this reader's
    clock alone (hosts' clocks may disagree): a rank is silent once its count has not moved
    for the silence bound since this reader first saw it."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, float]] = {}

    def age(self, rank: int, seq: Any, now: float, claimed: float, interval: float) -> float:
        """Seconds since ``rank``'s record last moved, as this reader saw it: a record seen
        for the first time (or moved since the last look) is as old as the writer's clock
        says (``claimed``), but no older than one publishing ``interval``; from then on it
        ages on this reader's monotonic clock ``now``."""
        last = self._seen.get(rank)
        if last is None or last[0] != seq:
            last = self._seen[rank] = (seq, now - min(max(claimed, 0.0), interval))
        return now - last[1]


#: Longest one look at a job takes (every rank's record and process read), seconds.
LOOK_WITHIN = 5.0
#: Events a look shows; events it reads for losses (a loss further back is not seen).
SHOWN_EVENTS, LOSSES_WITHIN = 20, 64


def read_job(
    channel: ControlChannel, world_size: int | None = None, watch: JobWatch | None = None, events: bool = True
) -> dict[str, Any]:
    """Every rank's record and process of ``channel``'s job, with what :func:`diagnose` sees
    in them: ``{"job", "world_size", "time", "ranks": [...], "stalls": [...], "stragglers":
    [...], "events": [...]}`` (:func:`straggler_scores`, :func:`read_events`: the last 20;
    none with ``events=False``).
    Each entry of ``ranks`` has ``rank``, ``host``,
    ``pid``, ``device``, ``phase``, ``phase_s``, ``epoch``, ``step``, ``step_s``, ``split``,
    ``own_s`` and ``own_best_s`` (a step's time but ``backward``: now, and the least seen),
    ``scores``, ``heartbeat_age`` (seconds since its record was written:
    by the writer's wall clock against this one's, or, with ``watch``, since this reader saw
    it move; None where there is none) and ``state`` (``"running"``, ``"silent"``,
    ``"closed"``, ``"joined"`` without a record, ``"absent"``: not joined).

    ``channel`` may hold no rank (:func:`dataparallel.observe`): each look then attaches to
    the job's current run again (a rerun of the job is followed). A look takes at most
    :data:`LOOK_WITHIN` seconds; a channel that has failed, or a job with no run, raises."""
    deadline = time.monotonic() + LOOK_WITHIN
    if channel.failure is not None:
        raise channel.failure
    if channel.rank is None and not channel._reattach():
        raise ControlError(f"job {channel.observed_job!r} has no run: no rank of it has joined")
    size = world_size or _world_size(channel, deadline)
    records = _read_many(channel, [status_key(r) for r in range(size)], deadline)
    peers = _read_many(channel, [peer_key(r) for r in range(size)], deadline)
    if channel.failure is not None:
        raise channel.failure
    # The job's events: a loss the driver declared names its rank at once (its record would
    # take the silence bound to say it).
    told = read_events(channel, last=LOSSES_WITHIN, deadline=deadline) if events else []
    losses = {e["rank"]: e for e in told if e["kind"] == "loss" and isinstance(e.get("rank"), int)}
    told = told[-SHOWN_EVENTS:]
    now, mono = time.time(), time.monotonic()
    ranks = []
    for rank in range(size):
        rec, peer = records[rank], peers[rank]
        entry: dict[str, Any] = {
            "rank": rank,
            "host": None,
            "pid": None,
            "device": None,
            "phase": None,
            "phase_s": None,
            "epoch": None,
            "step": None,
            "step_s": None,
            "split": {},
            "own_s": None,
            "own_best_s": None,
            "scores": None,
            "heartbeat_age": None,
            "interval": None,
            "stacks_at": None,
            "stacks_signal": None,
            "identity": None,
            "error": None,
            "phase_before": None,
            "state": "absent",
        }
        if peer is not None:
            entry.update(host=peer.get("host"), pid=peer.get("pid"), state="joined")
        if rec is not None:
            try:
                if not all(rec.get(k) is None or type(rec.get(k)) is int for k in ("epoch", "step")):
                    raise ValueError(f"rank {rank}'s record: epoch and step must be integers")
                if not isinstance(rec.get("phase"), str | None):
                    raise ValueError(f"rank {rank}'s record: its phase must be text")
                numbers = ("step_s", "own_s", "own_best_s", "stacks_at", "phase_s", "interval")
                if not (_seconds_since_epoch(rec.get("time")) and all(_number_or_none(rec.get(k)) for k in numbers)):
                    raise ValueError(f"rank {rank}'s record: its times must be numbers")
                split = rec.get("split") or {}
                if not isinstance(split, dict) or not all(
                    isinstance(k, str) and _number_or_none(v) and v is not None for k, v in split.items()
                ):
                    raise ValueError(f"rank {rank}'s record: its split must map phases to seconds")
                if not (rec.get("pid") is None or type(rec.get("pid")) is int) or not isinstance(
                    rec.get("host"), str | None
                ):
                    raise ValueError(f"rank {rank}'s record: its host and pid must be text and a number")
                wall_age = max(now - float(rec.get("time", now)), 0.0)
                interval = float(rec.get("interval") or 1.0)
                age = wall_age if watch is None else watch.age(rank, rec.get("seq"), mono, wall_age, interval)
                keys = ("host", "pid", "device", "phase", "epoch", "step", "step_s", "own_s", "own_best_s", "stacks_at")
                entry["error"] = rec.get("error") if isinstance(rec.get("error"), str) else None
                entry["phase_before"] = rec.get("phase_before") if isinstance(rec.get("phase_before"), str) else None
                entry["stacks_signal"] = rec.get("stacks_signal") if isinstance(rec.get("stacks_signal"), str) else None
                ident = rec.get("identity")
                entry["identity"] = ident if isinstance(ident, list) and len(ident) == 2 else None
                entry.update({k: rec.get(k) for k in keys})
                entry["split"] = dict(rec.get("split") or {})
                entry["phase_s"] = round(float(rec.get("phase_s") or 0.0) + age, 3)
                entry["heartbeat_age"] = round(age, 3)
                entry["interval"] = interval
                if rec.get("phase") in ("closed", "failed"):
                    entry["state"] = rec["phase"]
                else:
                    entry["state"] = "silent" if age > silent_after(rec) else "running"
            except (TypeError, ValueError, AttributeError):  # a record not of this library's making
                entry["state"] = "joined"
        if rank in losses and entry["state"] in ("running", "silent", "joined"):
            entry["state"], entry["error"] = "lost", str(losses[rank]["detail"])
        ranks.append(entry)
    return {
        "job": channel.observed_job,
        "world_size": size,
        "time": now,
        "ranks": ranks,
        "stalls": diagnose(ranks),
        "stragglers": straggler_scores(ranks),
        "events": told,
    }


def render(view: Mapping[str, Any]) -> str:
    """:func:`read_job`'s view as text: a table of the ranks, then the stalls."""
    head = ("rank", "state", "host", "pid", "epoch", "step", "phase", "in phase", "step time", "split", "status age")
    rows = [head]
    for r in view["ranks"]:
        split = " ".join(f"{k} {v * 1000:.0f}ms" for k, v in sorted(r.get("split", {}).items(), key=lambda kv: -kv[1]))
        rows.append(
            (
                str(r["rank"]),
                r["state"],
                str(r["host"] or "-"),
                str(r["pid"] or "-"),
                _or_dash(r["epoch"]),
                _or_dash(r["step"]),
                str(r["phase"] or "-"),
                "-" if r["phase_s"] is None else f"{r['phase_s']:.1f}s",
                "-" if not r["step_s"] else f"{r['step_s'] * 1000:.1f}ms",
                split or "-",
                "-" if r["heartbeat_age"] is None else f"{r['heartbeat_age']:.1f}s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"job {view['job']!r}: {view['world_size']} rank(s)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    stalls = view["stalls"]
    lines.append("stalls:" if stalls else "no stall")
    lines += [f"  rank {s['rank']}: {s['cause']}" for s in stalls]
    stragglers = view.get("stragglers") or []
    if stragglers:
        lines.append("stragglers:")
        lines += [
            f"  rank {s['rank']}: {s['cause']} (score {s['vs_fastest']:.2f} against the fastest"
            + (f", {s['vs_own_best']:.2f} against its own best)" if s["vs_own_best"] is not None else ")")
            for s in stragglers
        ]
    events = view.get("events") or []
    if events:
        lines.append("events:")
        lines += ["  " + line for line in render_events(events[-10:])]
    return "\n".join(lines)


def render_events(events: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line an event: its time, job (where it says one), rank, kind and detail."""
    lines = []
    for e in events:
        try:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e["time"])))
        except (TypeError, ValueError, OverflowError, OSError):  # not a time: shown as such
            when = f"(time {e.get('time')!r})"
        job = f"job {e['job']} " if e.get("job") else ""
        who = f"rank {e['rank']}" if e.get("rank") is not None else str(e.get("by") or "-")
        lines.append(f"{when} {job}{who} {e.get('kind')}: {e.get('detail')}")
    return lines


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def silent_after(record: Mapping[str, Any]) -> float:
    """How old a record may grow before its rank counts as silent."""
    return max(SILENT_INTERVALS * float(record.get("interval") or 1.0), SILENT_FLOOR)


def stall_threshold(ranks: Sequence[Mapping[str, Any]], floor: float = STALL_FLOOR) -> float:
    """How long a wait in one phase is a stall: :data:`STALL_STEPS` median step times of the
    ranks that report one, at least ``floor`` seconds."""
    times = [float(r["step_s"]) for r in ranks if r.get("step_s")]
    return max(floor, STALL_STEPS * statistics.median(times)) if times else floor


#: Where a phase outside a step lies in an epoch (``command``, the driver's broadcast that
#: starts an epoch, belongs to the next epoch: the rank's epoch is still the last one's; the
#: driver writes a ``checkpoint`` once the epoch's reports have met).
_STAGES = {"command": 0, "train": 1, "epoch end": 2, "validation": 3, "report": 4, "checkpoint": 5}
_BEFORE = {"joined", "rendezvous", "setup"}
_AFTER = {"barrier dp-fit-end", "done"}


def _position(entry: Mapping[str, Any]) -> tuple[int, int, int, int] | None:
    """How far a rank is in the job, comparable between ranks: (epoch, stage, step, the
    phase's place in a step); None for a phase that is not one of ``dp.fit``'s (a loop's
    own), which is never taken for behind or ahead."""
    phase = entry.get("phase")
    epoch, step = entry.get("epoch"), entry.get("step") or 0
    if phase in _BEFORE:
        return (-1, 0, 0, 0)
    if phase in _AFTER:
        return (1 << 62, 0, 0, 0)
    if phase == "command":  # a newcomer's, which has no epoch yet, is compared with nothing
        return None if epoch is None else (epoch + 1, 0, 0, 0)
    if phase in STEP_PHASES and epoch is not None:
        return epoch, 1, step, STEP_PHASES.index(phase)
    if phase == "train" and epoch is not None:  # a strategy whose ranks do not step together
        return epoch, 1, 0, -1
    if phase in _STAGES and epoch is not None:
        return epoch, _STAGES[phase], 0, 0
    return None


def diagnose(ranks: Sequence[Mapping[str, Any]], threshold: float | None = None) -> list[dict[str, Any]]:
    """The stalls ``ranks`` (entries as :func:`read_job` makes them) show, each ``{"rank",
    "cause", "phase", "for_s", "waiting"}`` naming a rank others wait for (``waiting``: the
    running ranks ahead of it), the silent first, then the furthest behind first:

    - a rank declared lost (its state ``lost``: the job's event log says so);
    - a rank gone silent (its record stopped coming: frozen, cut off, or dead);
    - when some ranks have been in one phase past ``threshold`` (default
      :func:`stall_threshold`): every running rank behind the furthest of them (an earlier
      epoch or step, or an earlier phase of the same step: :func:`_position`), with what it
      is doing; but not one that itself waits in a collective (:data:`COLLECTIVE_PHASES`)
      while a rank is further behind, or silent, or lost (an all-reduce's rounds end on some
      ranks before others: those still in it wait too).

    Ranks that all wait at one place with nobody behind (a long validation, a slow first
    step) are no stall: no rank holds the others up. Phases of a loop's own are compared with
    nothing: only silence names such a rank."""
    live = [r for r in ranks if r.get("state") in ("running", "silent")]
    stalls: list[dict[str, Any]] = []
    running = [r for r in live if r.get("state") == "running"]
    for r in ranks:
        if r.get("state") == "lost":
            stalls.append(
                {
                    "rank": r["rank"],
                    "cause": f"lost: {r.get('error')} (last seen in {r.get('phase')!r}{_at(r)})",
                    "phase": r.get("phase"),
                    "for_s": r.get("heartbeat_age"),
                    "waiting": [w["rank"] for w in running],
                }
            )
    for r in live:
        if r.get("state") == "silent":
            stalls.append(
                {
                    "rank": r["rank"],
                    "cause": (
                        f"silent: no status for {r['heartbeat_age']:.1f}s (last seen in {r['phase']!r}"
                        f"{_at(r)}): frozen, cut off or dead"
                    ),
                    "phase": r.get("phase"),
                    "for_s": r.get("heartbeat_age"),
                    "waiting": [w["rank"] for w in running],
                }
            )
    limit = stall_threshold(live) if threshold is None else threshold
    placed = [(r, _position(r)) for r in running]
    waiters = [(r, p) for r, p in placed if p is not None and (r.get("phase_s") or 0.0) > limit]
    if not waiters:
        return stalls
    gone = any(r.get("state") in ("silent", "lost") for r in ranks)
    # Ranks that wait and say so now (a record of the last publishing or so: not one of a rank
    # just killed, whose record has not aged into silence yet).
    fresh = [w for w, _ in waiters if (w.get("heartbeat_age") or 0.0) <= FRESH_WITHIN]
    for r in ranks:  # a rank whose fit raised, still there, that the others wait for
        if r.get("state") == "failed" and not gone and fresh:
            stalls.append(
                {
                    "rank": r["rank"],
                    "cause": f"failed: {r.get('error')} (in {r.get('phase_before')!r}{_at(r)}) while others wait",
                    "phase": r.get("phase_before"),
                    "for_s": round(max(float(w.get("phase_s") or 0.0) for w in fresh), 3),
                    "waiting": [w["rank"] for w in fresh],
                }
            )
    furthest = max(p for _, p in waiters)
    ahead = [r["rank"] for r, p in waiters if p == furthest]
    # How long the others have waited: a rank behind is stalling them that long, not as long
    # as it has been where it is (a long validation the others have only just finished).
    waited = max(float(r.get("phase_s") or 0.0) for r, p in waiters if p == furthest)
    where = next(f"{r['phase']!r}{_at(r)}" for r, p in waiters if p == furthest)
    behind = sorted(((r, p) for r, p in placed if p is not None and p < furthest), key=lambda rp: rp[1])
    silent = any(r.get("state") in ("silent", "lost", "failed") for r in ranks)
    for r, p in behind:
        # A rank behind that itself waits in a collective (DDP's all-reduce, whose rounds end
        # on different ranks at different times) waits for someone: for a rank further behind,
        # or one gone silent; it holds the others up only where there is none.
        if r.get("phase") in COLLECTIVE_PHASES and (silent or p > behind[0][1]):
            continue
        others = sorted(a["rank"] for a, q in placed if q is not None and q > p)
        stalls.append(
            {
                "rank": r["rank"],
                "cause": (
                    f"in {r['phase']!r}{_at(r)} for {r['phase_s']:.1f}s while rank(s) "
                    f"{', '.join(map(str, ahead))} wait in {where}"
                ),
                "phase": r.get("phase"),
                "for_s": round(min(float(r.get("phase_s") or 0.0), waited), 3),
                "waiting": others,
            }
        )
    return stalls


def _at(entry: Mapping[str, Any]) -> str:
    parts = []
    if entry.get("epoch") is not None:
        parts.append(f"epoch {entry['epoch']}")
    if entry.get("step") is not None:
        parts.append(f"step {entry['step']}")
    return f" ({', '.join(parts)})" if parts else ""


#: Keys one request of :func:`_read_many` asks for at once.
READ_CHUNK = 256


def _read_many(channel: ControlChannel, keys: Sequence[str], deadline: float) -> list[dict[str, Any] | None]:
    """The JSON objects at ``keys`` in the run (None where absent or not JSON), until
    ``deadline`` (those left then: None). Read :data:`READ_CHUNK` at a time in one request
    (``_multi_get``, one round trip on every built-in transport) where all of a chunk exist,
    else in halves (:func:`_read_chunk`)."""
    out: list[dict[str, Any] | None] = []
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start : start + READ_CHUNK]
        if deadline - time.monotonic() <= 0:
            out += [None] * len(chunk)
            continue
        out += _read_chunk(channel, chunk, deadline)
    return out


def _read_chunk(channel: ControlChannel, keys: Sequence[str], deadline: float) -> list[dict[str, Any] | None]:
    """``keys`` in one request where all exist; else each half the same way (an absent key
    among N costs about 2 log2 N requests, not N), one key alone read as it is."""
    if len(keys) == 1:
        return [_read_one(channel, keys[0], deadline)]
    if deadline - time.monotonic() <= 0:
        return [None] * len(keys)
    try:
        raws = channel._multi_get([channel._scoped(k) for k in keys], 0.001)
    except ControlError:
        if channel.failure is not None:
            raise
        raws = None
    if raws is not None and len(raws) == len(keys):
        return [_parse(raw) for raw in raws]
    half = len(keys) // 2  # some absent (a rank not joined, or not published yet)
    return _read_chunk(channel, keys[:half], deadline) + _read_chunk(channel, keys[half:], deadline)


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _read_one(channel: ControlChannel, key: str, deadline: float) -> dict[str, Any] | None:
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    scoped = channel._scoped(key)
    try:
        return _parse(channel._get(scoped, min(1.0, left)) if channel._check([scoped]) else None)
    except ControlError:
        if channel.failure is not None:
            raise
        return None


def _world_size(channel: ControlChannel, deadline: float) -> int:
    """The job's size as its ranks published it (their records), else as far as ranks joined."""
    for rank in range(64):
        rec = _read_many(channel, [status_key(rank)], deadline)[0]
        if rec is not None and isinstance(rec.get("world_size"), int) and rec["world_size"] > 0:
            return int(rec["world_size"])
    size, rank = 0, 0
    while rank < size + 64 and time.monotonic() < deadline:  # the last joined rank, past gaps of up to 64
        if channel._check([channel._scoped(peer_key(rank))]):
            size = rank + 1
        rank += 1
    return size
