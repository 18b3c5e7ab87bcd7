"""A node's workers under one supervisor: their output relayed (or as JSON lines), signals
forwarded, the first failure stopping the others after a grace, the exit code chosen.

:class:`Supervisor` serves ``dataparallel launch`` on one node and, through its subclass in
:mod:`dataparallel.launching.ssh`, a whole job of node launchers started over ssh.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol

from ..errors import ConfigError

#: Seconds a worker gets to exit after SIGTERM before it is killed.
DEFAULT_GRACE = 5.0
#: The least it gets when the launcher itself was told to stop (dp.fit with a checkpoint
#: stops at a step and writes it first); a second SIGINT or SIGTERM kills at once.
SIGNALLED_GRACE = 60.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Passed on to every worker that catches it, and nothing more: a rank of dp.fit dumps its
#: Python stacks on it (:data:`dataparallel.control.status.STACKS_SIGNAL`); to a worker that
#: does not (not published yet, a shell around it) it would be the end.
_PASSED_ON = signal.SIGUSR2


@contextlib.contextmanager
def handling_signals(
    handler: Callable[[int, Any], None], pass_on: Callable[[int, Any], None] | None = None
) -> Iterator[bool]:
    """The :data:`_FORWARDED` signals go to ``handler`` while inside (and :data:`_PASSED_ON`
    to ``pass_on``), the previous handlers after; yields False, changing nothing, off the main
    thread (where Python cannot set them)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {sig: signal.signal(sig, handler) for sig in _FORWARDED}
    if pass_on is not None:
        previous[_PASSED_ON] = signal.signal(_PASSED_ON, pass_on)
    try:
        yield True
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Log(Protocol):
    """Where a launcher writes its own lines (as ``print(file=...)`` does)."""

    def write(self, text: str, /) -> object: ...
    def flush(self) -> object: ...


@dataclass
class Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    label: str = ""  # how output and messages name it: "rank 3", or a host
    pass_on: bool = True  # a rank's own process: SIGUSR2 to the launcher is passed on to it

    def __post_init__(self) -> None:
        self.label = self.label or f"rank {self.rank}"


#: Seconds a follower started again (elastic) may run on once the job's other workers are done.
LATE_GRACE = 10.0


class Supervisor:
    def __init__(
        self,
        grace: float,
        log: Log,
        tolerate: bool = False,
        as_json: bool = False,
        replace: Callable[[Supervisor, Worker], bool] | None = None,
        note: Callable[[str, str, int | None], None] | None = None,
    ) -> None:
        self.grace = grace
        self.as_json = as_json
        self.log = log
        self.tolerate = tolerate  # elastic: a failed follower stops nothing
        #: Elastic: start a failed follower again (False where no restart is left).
        self.replace = replace
        #: Where the launcher's own events go (its event file): ``note(kind, detail, rank)``.
        self.note = note or (lambda kind, detail, rank: None)
        self.replacements: list[Worker] = []
        self.tolerated: list[Worker] = []
        self.workers: list[Worker] = []
        self.pumps: list[threading.Thread] = []
        self.signalled: int | None = None
        self._signalled_at = 0.0
        self._out_lock = threading.Lock()

    @contextlib.contextmanager
    def forwarding_signals(self):
        with handling_signals(self._on_signal, self._pass_on) as handled:
            try:
                yield
            finally:
                if handled:
                    self.stop(signal.SIGKILL, quiet=True)  # nothing outlives the launcher

    def _pass_on(self, signum: int, frame: object) -> None:
        from ..control.procinfo import catches

        for w in self.workers:
            # The process alone (not its data loaders), where it catches the signal.
            if w.pass_on and w.proc.poll() is None and catches(w.proc.pid, signum):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signum)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signalled is None:
            self.signalled = signum
            self._send(signum)
        elif signum in (signal.SIGINT, signal.SIGTERM) and time.monotonic() - self._signalled_at > 1.0:
            self._send(signal.SIGKILL)  # asked again (a second Ctrl-C): no more waiting
        self._signalled_at = self._signalled_at or time.monotonic()

    def start(
        self,
        rank: int,
        local: int,
        command: list[str],
        env: dict[str, str] | None,
        prefix: bool,
        *,
        label: str = "",
        stdin: int | None = None,
        pass_on: bool = True,
    ) -> Worker:
        """Start one process of the group. Its output lines get ``[LABEL] `` in front (``[rank
        R] ``), or, in JSON, the label's field (``rank``, or ``host`` for a host's launcher
        whose lines carry their ranks already)."""
        pipe = subprocess.PIPE if prefix else None
        try:
            proc = subprocess.Popen(command, env=env, stdin=stdin, stdout=pipe, stderr=pipe, start_new_session=True)
        except OSError as err:
            raise ConfigError(f"cannot start {command[0]!r}: {err.strerror}") from None
        worker = Worker(rank, local, proc, label, pass_on)
        self.workers.append(worker)
        if prefix:
            tag = {"rank": rank} if not label else {"host": label}
            for stream, sink, name in ((proc.stdout, sys.stdout, "stdout"), (proc.stderr, sys.stderr, "stderr")):
                if self.as_json:
                    shape = functools.partial(json_line, **tag, stream=name)
                else:
                    shape = functools.partial(bytes.__add__, f"[{worker.label}] ".encode())
                pump = threading.Thread(target=self._pump, args=(stream, sink, shape), daemon=True)
                pump.start()
                self.pumps.append(pump)
        return worker

    def _pump(self, stream: IO[bytes], sink: IO[str], shape: Callable[[bytes], bytes]) -> None:
        """Copy ``stream`` to ``sink`` whole line by whole line (so ranks never interleave
        within a line), each non-empty line passed through ``shape`` (the rank's tag put in
        front, or the line made a JSON object); a carriage return ends a line too, so
        progress bars redraw in place (JSON: the redraws are lines of their own)."""
        pending = b""
        while chunk := os.read(stream.fileno(), 65536):  # what is there, up to 64 KiB
            parts = re.split(rb"(\r\n|\r|\n)", pending + chunk)
            pending = parts.pop()  # not yet terminated
            lines = zip(parts[::2], parts[1::2], strict=True)
            if self.as_json:
                self._write(sink, b"".join(shape(text) for text, _ in lines if text.strip()))
            else:
                self._write(sink, b"".join((shape(text) if text else b"") + end for text, end in lines))
        if pending.strip():
            self._write(sink, shape(pending) if self.as_json else shape(pending) + b"\n")
        stream.close()

    def _write(self, sink: IO[str], data: bytes) -> None:
        if not data:
            return
        with self._out_lock:
            out = getattr(sink, "buffer", None)
            if out is not None:
                out.write(data)
            else:
                sink.write(data.decode(errors="replace"))
            sink.flush()

    def wait(self) -> int:
        failed: Worker | None = None
        since = 0.0  # when only followers started again were left running, the job ended
        while True:
            running = [w for w in self.workers if w.proc.poll() is None]
            if self.signalled is not None:
                break
            failed = next(
                (w for w in self.workers if w.proc.returncode not in (None, 0) and w not in self.tolerated), None
            )
            # The job's own workers done with 0: it has ended (on every node).
            ended = any(w.proc.returncode == 0 and w not in self.replacements for w in self.workers)
            # A follower started again that exits once the job has ended is not a failure.
            late = failed is not None and failed in self.replacements and (ended or not running)
            if failed is not None and self.tolerate and (running or late):
                self.tolerated.append(failed)
                why = "the job had ended" if late else "the others carry on without it"
                self.note("exit", f"exited with {_describe(failed.proc.returncode)}; {why} (elastic)", failed.rank)
                print(
                    f"[launch] {failed.label} exited with {_describe(failed.proc.returncode)}; {why} (elastic)",
                    file=self.log,
                    flush=True,
                )
                if self.replace is not None and running and not ended and self.signalled is None:
                    workers = len(self.workers)
                    if self.replace(self, failed):
                        self.replacements.extend(self.workers[workers:])
                failed = None
                continue
            if failed is not None or not running:
                break
            if ended and all(w in self.replacements for w in running):
                # The job's own workers are done (with 0): a follower started again that is still
                # waiting to be admitted will not be, and may wait for a coordinator that is gone.
                since = since or time.monotonic()
                if time.monotonic() - since > LATE_GRACE:
                    print(f"[launch] the job ended; stopping {_names(running)}", file=self.log, flush=True)
                    self.tolerated.extend(running)
                    break
            time.sleep(0.05)
        if self.signalled is not None:
            name = signal.Signals(self.signalled).name
            self.note("signal", f"the launcher got {name}: passed on to the workers, which stop", None)
        if failed is not None:
            others = [w for w in self.workers if w.proc.poll() is None]
            self.note("exit", f"exited with {_describe(failed.proc.returncode)}; the group stops", failed.rank)
            print(
                f"[launch] {failed.label} exited with {_describe(failed.proc.returncode)}"
                + (f"; stopping {_names(others)}" if others else ""),
                file=self.log,
                flush=True,
            )
        self.stop(signal.SIGTERM)
        for pump in self.pumps:
            pump.join(timeout=2)
        if self.signalled is not None:
            return 128 + self.signalled
        if failed is not None:
            return _exit_code(failed.proc.returncode)
        if self.tolerated and all(w in self.tolerated for w in self.workers):
            return _exit_code(self.tolerated[0].proc.returncode)
        return 0

    def _send(self, signum: int) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                self._deliver(w, signum)

    def _deliver(self, worker: Worker, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.proc.pid, signum)

    def stop(self, signum: int, quiet: bool = False) -> None:
        """Send ``signum`` to every live worker's process group; SIGKILL what is left after the grace."""
        # Stopped from outside (Slurm's SIGTERM before a preemption, Ctrl-C): time for dp.fit to
        # write its checkpoint at a step, which a worker failure does not need.
        grace = self.grace if self.signalled is None else max(self.grace, SIGNALLED_GRACE)
        if signum != signal.SIGKILL and any(w.proc.poll() is None for w in self.workers):
            if self.signalled is None:
                self._send(signum)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers):
                time.sleep(0.05)
        stubborn = [w for w in self.workers if w.proc.poll() is None]
        if stubborn and not quiet:
            print(
                f"[launch] killing {_names(stubborn)} (no exit within {grace:g}s)",
                file=self.log,
                flush=True,
            )
        self._send(signal.SIGKILL)
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)


def _names(workers: Sequence[Worker]) -> str:
    """``ranks 1, 2`` (or ``rank 1``), or the labels as they are where they are not ranks."""
    if all(w.label == f"rank {w.rank}" for w in workers):
        return ("ranks " if len(workers) > 1 else "rank ") + ", ".join(str(w.rank) for w in workers)
    return ", ".join(w.label for w in workers)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def json_line(text: bytes, **fields: Any) -> bytes:
    """One output line as a JSON object for log collectors: the time, ``fields`` (the rank and
    stream it came from), and the line as ``message``; a line that is a JSON object already
    (``dp.fit``'s per-epoch metrics under ``DP_LOG_FORMAT=json``) gives its fields instead."""
    message = text.decode(errors="replace").rstrip()
    record: dict[str, Any] = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        **fields,
    }
    try:
        parsed = json.loads(message) if message.startswith("{") else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        record.update({k: v for k, v in parsed.items() if k not in record})
    else:
        record["message"] = message
    return json.dumps(record).encode() + b"\n"


class JsonLines:
    """A text stream that writes each whole line given to it as a JSON object (``json_line``)."""

    def __init__(self, sink: Log, **fields: Any) -> None:
        self.sink, self.fields, self.pending = sink, fields, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if line.strip():
                self.sink.write(json_line(line.encode(), **self.fields).decode())
        return len(text)

    def flush(self) -> None:
        self.sink.flush()
