"""One error family for the control plane.

Every error says what was awaited, from whom, and for how long, so that a log line is
enough to act on. All derive from :class:`ControlError`.
"""

from __future__ import annotations

import time


class ControlError(Exception):
    """Base of every error raised by a control channel: catch it to handle any of them.

    What to do: read the message; it names what was awaited, from whom and for how long."""


class ControlTimeout(ControlError, TimeoutError):
    """A blocking call did not complete within its timeout (``timeout=`` of the call, else
    the channel's, set by :func:`dataparallel.connect` or ``DP_TIMEOUT``).

    ``what`` names the thing awaited (a key, a barrier), ``waited`` the seconds spent.

    What to do: a rank that never arrived is usually still starting (raise the timeout for
    slow starts) or took another path through the code (every rank must enter the same
    collectives in the same order); a dead or frozen rank is reported as :class:`PeerLost`
    instead, sooner.
    """

    def __init__(self, what: str, waited: float, hint: str = "") -> None:
        self.what = what
        self.waited = waited
        self.hint = hint
        msg = f"timed out after {waited:.1f}s waiting for {what}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


class PeerLost(ControlError):
    """A peer stopped answering (died, hung, or left) while others depend on it.

    ``rank`` is the lost peer, ``last_seen`` the wall-clock time (``time.time()``) it was
    last heard from, or ``None`` if it never was; ``reason`` says how it was noticed.

    Raised to every rank waiting on the channel once a peer has been silent for
    ``liveness_timeout`` seconds (a URL option, default 10), or at once where the transport
    notices a killed process's connections close. ``dp.fit`` aborts the process group
    then, so no rank hangs in a collective.

    What to do: look at the lost rank's own output (it ran as the pid on the host the
    reason names); restart the job with ``dataparallel launch --max-restarts N`` and a
    checkpoint, or train with ``elastic=True`` to carry on without it.
    """

    def __init__(self, rank: int, last_seen: float | None, reason: str = "", during: str = "") -> None:
        self.rank = rank
        self.last_seen = last_seen
        self.reason = reason
        self.during = during
        if last_seen is None:
            seen = "never seen"
        else:
            seen = (
                f"last seen {time.time() - last_seen:.1f}s ago ({time.strftime('%H:%M:%S', time.localtime(last_seen))})"
            )
        parts = [f"peer rank {rank} lost: {reason or 'no heartbeat'}", seen]
        if during:
            parts.append(f"while waiting for {during}")
        super().__init__("; ".join(parts))


class PeerLeft(PeerLost):
    """A peer closed its channel without entering a collective that needs it, so the
    collective can never complete. Raised at once to the ranks waiting in it (within a
    ``liveness_poll`` slice), never after their timeout.

    It is a :class:`PeerLost` (the peer is gone for this collective), but the channel stays
    usable: ``missed`` names the collective and its round, ``during`` what was waited for.
    What to do: usually a rank ended early; every rank must enter the same collectives in the same
    order (a final ``rendezvous()`` included, where the others call it).
    """

    def __init__(self, rank: int, missed: str, during: str = "") -> None:
        self.rank = rank
        self.last_seen = None
        self.missed = missed
        self.during = during
        self.reason = f"it closed its channel without entering {missed}"
        msg = f"peer rank {rank} closed its channel without entering {missed}, which can never complete now"
        ControlError.__init__(self, f"{msg}; while waiting for {during}" if during and during != missed else msg)


class Stalled(ControlError):
    """The job stood still past ``TrainOptions.stall_timeout``: ``rank`` is the rank the
    others waited for, ``phase`` what it was doing (its last phase where it went silent),
    ``cause`` the diagnosis (:func:`dataparallel.control.status.diagnose`). Raised by
    ``dp.fit`` on every rank, instead of waiting out the collective's own timeout: the
    driver names the stall, every rank aborts its process group, and the named rank is
    interrupted where it stands (its main thread, between two Python instructions).

    What to do: look at that rank's output and at what it was doing; ``dataparallel
    status`` shows the job as the driver saw it, and a restart with a checkpoint goes on."""

    def __init__(self, rank: int, phase: str | None, cause: str, timeout: float) -> None:
        self.rank, self.phase, self.cause, self.timeout = rank, phase, cause, timeout
        super().__init__(f"the job stalled on rank {rank}: {cause} (stall_timeout {timeout:g}s)")

    def __reduce__(self) -> tuple[type[Stalled], tuple[int, str | None, str, float]]:
        return type(self), (self.rank, self.phase, self.cause, self.timeout)


class AuthError(ControlError):
    """The job token was missing or did not match the coordinator's (transports that check
    it themselves); raised at connect, in seconds.

    What to do: give every rank and the coordinator the same token (``DP_TOKEN`` or
    ``--token-file``)."""


class BadMessage(ControlError):
    """A request or reply could not be parsed, was too large, or named an unknown operation.

    What to do: something other than this library's ranks, or another version of it, is
    talking to the coordinator: check that the URL is the job's and that every process
    runs the same version (``dataparallel --version``)."""


class ChannelClosed(ControlError):
    """The channel was closed locally, or its coordinator went away: closed, killed, frozen
    or cut off for ``liveness_timeout`` seconds, or this rank was declared lost by the
    others (it was frozen or cut off itself). Every later call raises it.

    What to do: when the coordinator lives in rank 0 (zmq and grpc without a standalone
    ``dataparallel serve``, tcpstore always), look at rank 0's output first; a job restarted
    with a checkpoint resumes where it was."""


class ConfigError(ControlError, ValueError):
    """A URL, option or argument is invalid; the message says which, where it came from
    (flag, ``DP_*`` variable, file) and what is allowed. Raised before anything connects.

    What to do: fix the setting it names; ``dataparallel check --env`` shows every
    setting and where it came from."""


class Preempted(SystemExit):
    """Raised by ``dp.fit`` on every rank after a stop signal (SIGTERM, as Slurm sends before
    it preempts a job or its time runs out, or as ``dataparallel launch`` forwards it;
    SIGUSR1, as ``sbatch --signal=USR1@120`` sends): the ranks agreed on a step, the driver
    wrote the checkpoint there, and the process should end. The job started again with
    ``resume=True`` continues from that step. Uncaught, it ends the process with exit code
    128 + the signal's number, as the signal itself would, without a traceback.

    What to do: nothing; start the job again (a requeued Slurm job does) and it resumes."""

    def __init__(self, signum: int, epoch: int, batches: int, checkpoint: str) -> None:
        super().__init__(128 + signum)
        self.signum, self.epoch, self.batches, self.checkpoint = signum, epoch, batches, checkpoint

    def __str__(self) -> str:
        import signal

        return (
            f"stopped by {signal.Signals(self.signum).name} in epoch {self.epoch} after {self.batches} batches; "
            f"the checkpoint {self.checkpoint} resumes there"
        )
