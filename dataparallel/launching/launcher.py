"""``dataparallel launch``: start this node's workers and supervise them.

Each worker is the user's script with its place in the job in its environment (``DP_URL``,
``DP_RANK``, ``DP_LOCAL_RANK``, ``DP_WORLD_SIZE``, ``DP_JOB``, ``DP_TIMEOUT``, ``DP_TOKEN``,
and torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``), so that ``dataparallel.connect()`` needs no
arguments and a torchrun script's ``init_process_group()`` works unchanged. Output lines are prefixed with the rank.
The first worker to fail ends the node's group (the others get SIGTERM, then SIGKILL after
a grace period) and its exit code is returned; SIGINT/SIGTERM/SIGHUP to the launcher are
forwarded to every worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from ..config import CLUSTER, JobConfig
from ..control.registry import locate, mask_url, resolve
from ..errors import ConfigError
from .events import EventFile
from .relay import RelayHost
from .ssh import SshOptions, launch_hosts
from .supervisor import DEFAULT_GRACE, JsonLines, Log, Supervisor, Worker, handling_signals


def default_nprocs() -> int:
    """One worker per visible GPU, else one."""
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except Exception:
        return 1


def local_url() -> str:
    """A ZeroMQ URL on a free loopback port: the single-node default (rank 0 hosts it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"zmq://127.0.0.1:{s.getsockname()[1]}"


def plan(config: JobConfig, first_rank: int | None = None) -> tuple[str, int, int]:
    """(url, nprocs, world_size) of this node's part of the job, validated. With
    ``first_rank`` (nodes of different sizes, as a host file gives them) the world size is
    the configuration's and this node's ranks are ``first_rank .. first_rank + nprocs - 1``."""
    nprocs = config.nprocs or default_nprocs()
    world = config.nodes * nprocs
    if first_rank is not None:
        world = config.require("world_size")
        if not 0 <= first_rank <= world - nprocs:
            raise ConfigError(f"ranks {first_rank}..{first_rank + nprocs - 1} do not fit a world of {world}")
    elif config.world_size is not None and config.world_size != world:
        raise ConfigError(
            f"{config.describe('world_size')} = {config.world_size} does not match nodes x nprocs = "
            f"{config.nodes} x {nprocs} = {world}; set one or the other"
        )
    url = config.url
    if url is None:
        if config.nodes > 1:
            raise ConfigError(
                "a job on several nodes needs a transport every node can reach: set url (or transport, "
                "host and port), e.g. --url zmq://DRIVER_HOST:29500 (the driver node's address)"
            )
        url = local_url()
    resolve(url, config.token, where=config.describe("url"))
    return url, nprocs, world


def worker_command(target: Sequence[str], module: bool = False, no_python: bool = False) -> list[str]:
    if not target:
        raise ConfigError("nothing to launch: give a script (or -m MODULE) and its arguments")
    if no_python:
        return list(target)
    return [sys.executable, "-u", *(["-m"] if module else []), *target]


def launch(
    command: Sequence[str],
    config: JobConfig,
    *,
    grace: float = DEFAULT_GRACE,
    prefix: bool = True,
    log: Log | None = None,
    first_rank: int | None = None,
    lifeline: int | None = None,
    ssh: SshOptions | None = None,
) -> int:
    """Run this node's workers of ``command`` (a full argv) until they all exit.

    Returns 0, the exit code of the first worker that failed (128 + N for a signal N), or
    128 + N when the launcher itself was sent signal N. With ``config.max_restarts`` a failed
    group is restarted (all of it, as job ``JOB.attemptK``) that many times: a script that
    checkpoints and resumes (``TrainOptions(checkpoint=..., resume=True)``) carries on from
    its last epoch. On several nodes a lost peer fails every node's group, so the nodes'
    attempts stay in step. With ``config.elastic`` a worker that fails stops nothing: the
    others carry on (``dp.fit`` regroups without it, or fails where it cannot, as when the
    coordinator went with rank 0), a follower is started again (it rejoins at an epoch
    boundary) while ``max_restarts`` allows, and the node's exit code is that of the first
    failure only if no worker of the node ended well.

    With ``config.hosts`` it starts this function on every host over ssh instead
    (:func:`dataparallel.launching.ssh.launch_hosts`, reaching them as ``ssh`` says). ``lifeline``: a
    file descriptor whose end stops the workers as SIGTERM does (a host's launcher started
    over ssh reads its stdin: when the connection to the launcher that started it goes, so
    do its workers).

    With ``config.events``, the job's event log is appended to that file, one JSON object a
    line (:class:`~dataparallel.launching.events.EventFile`): each worker of the node writes
    its own events there, the launcher its own (exits, restarts, signals) and the other
    nodes' ranks' as it reads them in the channel.
    """
    events = config.events
    if config.hosts and lifeline is None:
        if events is None:
            return launch_hosts(command, config, grace=grace, prefix=prefix, log=log, ssh=ssh)
        with EventFile(events, config, config.require("url")):
            return launch_hosts(command, config, grace=grace, prefix=prefix, log=log, ssh=ssh)
    node = _NodeLaunch(command, config, grace=grace, prefix=prefix, log=log, first_rank=first_rank)
    if lifeline is not None:
        threading.Thread(target=_on_end, args=(lifeline,), daemon=True).start()
    if events is None:
        return node.run(own_stdin=lifeline is None)
    with EventFile(events, config, node.url) as node.events:
        return node.run(own_stdin=lifeline is None)


class _NodeLaunch:
    """One node's part of a launch: its workers' environment (:meth:`environment`), the
    group's attempts (:meth:`run`; a failed group restarted whole, ``max_restarts`` times)
    and, elastic, its lost followers started again (:meth:`replace`)."""

    def __init__(
        self,
        command: Sequence[str],
        config: JobConfig,
        *,
        grace: float,
        prefix: bool,
        log: Log | None,
        first_rank: int | None,
    ) -> None:
        config = _node_of_cluster(config)
        self.url, self.nprocs, self.world = plan(config, first_rank)
        self.command, self.config, self.grace = list(command), config, grace
        self.log, self.prefix = log or sys.stderr, prefix
        self.as_json = config.log_format == "json"
        if self.as_json:  # every line out of this launcher a JSON object, its own included
            self.log, self.prefix = JsonLines(self.log, source="launch"), True
        self.base = config.node_rank * self.nprocs if first_rank is None else first_rank
        self.env = self.environment()
        #: Restarts of the group so far (the same count on every node, so that the nodes'
        #: attempts stay in step) and, elastic, of this node's lost followers: each up to
        #: ``max_restarts``.
        self.attempt, self.replaced = 0, 0
        self.stdin: int | None = None
        self.events: EventFile | None = None  # the job's event log in a file (launch --events)

    def note(self, kind: str, detail: str, rank: int | None = None) -> None:
        """An event of the launcher's own, into the event file if there is one."""
        if self.events is not None:
            self.events.note(kind, detail, rank)

    def environment(self) -> dict[str, str]:
        """What every worker of the node finds in its environment, besides its ranks."""
        config, url, world, nprocs = self.config, self.url, self.world, self.nprocs
        env = dict(os.environ)
        stale = ("DP_TRANSPORT", "DP_HOST", "DP_PORT", "DP_OPTIONS", "MASTER_ADDR", "MASTER_PORT", "DP_RDZV_URL")
        for name in (*stale, "DP_RDZV_ROUND", "DP_HOSTS", "DP_HOSTFILE", "DP_RELAY"):
            env.pop(name, None)  # the URL says it all (no torchrun agent's round applies, no hosts list)
        env.update(
            DP_URL=url,
            DP_WORLD_SIZE=str(world),
            DP_JOB=config.job,
            DP_TIMEOUT=f"{config.timeout:g}",
            DP_NODES=str(config.nodes),
            DP_NODE_RANK=str(config.node_rank),
            DP_NPROCS=str(nprocs),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(nprocs),
            GROUP_RANK=str(config.node_rank),
            PYTHONUNBUFFERED="1",
        )
        if config.token:
            env["DP_TOKEN"] = config.token
        if config.events:  # each worker appends its own events there
            env["DP_EVENTS"] = os.path.abspath(config.events)
        if config.elastic:
            env["DP_ELASTIC"] = "1"
        for bound in ("min_world_size", "max_world_size"):  # the workers' settings, as dp.connect reads them
            if getattr(config, bound) is not None:
                env[f"DP_{bound.upper()}"] = str(getattr(config, bound))
        if self.as_json:
            env["DP_LOG_FORMAT"] = "json"  # dp.fit's per-epoch lines become JSON objects too
        master = _master_address(url, config.nodes)
        if master is not None:  # for scripts that call init_process_group() with env://, as under torchrun
            env.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), TORCHELASTIC_RUN_ID=config.job)
        threads = _omp_threads(env, nprocs)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
            self.say(
                f"OMP_NUM_THREADS={threads} for each worker ({_cores()} cores / {nprocs} workers on this node; "
                "set OMP_NUM_THREADS to choose)"
            )
        return env

    def say(self, line: str) -> None:
        print(f"[launch] {line}", file=self.log, flush=True)

    def run(self, own_stdin: bool = True) -> int:
        """The node's workers until they end (see :func:`launch`). ``own_stdin`` False: the
        launcher's stdin is its lifeline, which no worker reads."""
        config, base = self.config, self.base
        self.stdin = None if own_stdin else subprocess.DEVNULL
        self.say(
            f"node {config.node_rank}/{config.nodes}: ranks {base}..{base + self.nprocs - 1} of {self.world} "
            f"on {mask_url(self.url)} (job {config.job!r})"
        )
        # With a relay: the node's part of the job, joined before any worker starts (node 0's
        # hosts the coordinator for every attempt), and a relay per attempt of the group.
        try:
            with handling_signals(_interrupt):
                if not config.relay:
                    return self.attempts(None)
                relays = RelayHost(
                    config, self.url, nprocs=self.nprocs, world=self.world, first_rank=base, log=self.log
                )
                with relays:
                    return self.attempts(relays)
        except _Interrupted as stop:  # no worker running: joining or leaving the relays' channel
            self.say(f"stopped by signal {stop.signum} ({signal.Signals(stop.signum).name})")
            return 128 + stop.signum

    def attempts(self, relays: RelayHost | None) -> int:
        """The worker group, started again after a failure while ``max_restarts`` allows."""
        env, restarts = self.env, self.config.max_restarts
        while True:
            if self.attempt:
                # A new job name: the restarted group never meets the failed group's keys.
                env["DP_JOB"] = f"{self.config.job}.attempt{self.attempt}"
                env["DP_RESTART_COUNT"] = str(self.attempt)
                if self.events is not None:
                    self.events.follow(env["DP_JOB"])
            supervisor = Supervisor(
                self.grace,
                self.log,
                tolerate=self.config.elastic,
                as_json=self.as_json,
                replace=self.replace,
                note=self.note,
            )
            with contextlib.ExitStack() as stack:
                if relays is not None:  # joined upstream before any worker starts; closed after the last ends
                    env["DP_URL"] = stack.enter_context(relays.attempt(env["DP_JOB"]))
                with supervisor.forwarding_signals():
                    for local in range(self.nprocs):
                        self.start(supervisor, self.base + local, local)
                    code = supervisor.wait()
            if code == 0 or supervisor.signalled is not None or self.attempt >= restarts:
                return code
            self.attempt += 1
            self.say(f"worker group failed (exit code {code}); restarting it, attempt {self.attempt} of {restarts}")
            self.note(
                "restart",
                f"the worker group failed (exit code {code}): restarted as job "
                f"{self.config.job}.attempt{self.attempt} ({self.attempt} of {restarts})",
            )

    def start(self, supervisor: Supervisor, rank: int, local: int) -> None:
        ranks = {"DP_RANK": str(rank), "DP_LOCAL_RANK": str(local), "RANK": str(rank), "LOCAL_RANK": str(local)}
        supervisor.start(rank, local, self.command, {**self.env, **ranks}, self.prefix, stdin=self.stdin)

    def replace(self, supervisor: Supervisor, lost: Worker) -> bool:
        """Elastic: start a lost follower again (the supervisor asks, for each worker that
        failed); it joins the running job at an epoch boundary. False: it stays lost."""
        restarts = self.config.max_restarts
        if self.replaced >= restarts or lost.rank == 0:  # the first driver's rank is never queued again
            return False
        if any(w.rank == 0 and w.proc.returncode not in (None, 0) for w in supervisor.workers):
            return False  # the job may have ended with its driver (a coordinator hosted by it): nothing to join
        self.replaced += 1
        self.note(
            "restart",
            f"{lost.label} started again ({self.replaced} of {restarts}): it joins at an epoch boundary",
            lost.rank,
        )
        self.say(
            f"starting {lost.label} again (restart {self.replaced} of {restarts}): it joins the job "
            "at its next epoch boundary (elastic)"
        )
        self.start(supervisor, lost.rank, lost.local_rank)
        return True


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    """Outside the supervisor's forwarding (no worker running: the relay's joins and
    closes), a signal the launcher forwards ends the launch as :class:`_Interrupted`."""
    raise _Interrupted(signum)


def _node_of_cluster(config: JobConfig) -> JobConfig:
    """Under ``srun`` or ``mpirun``, ``dataparallel launch`` is one node's launcher (as torchrun
    is under srun): the cluster's tasks are the job's nodes, each starting ``nprocs`` workers,
    and the coordinator is where the cluster layer put rank 0."""
    tasks = {e.rank: e.size for e in CLUSTER}
    source = config.origin.get("rank", "")
    if source not in tasks or config.origin.get("world_size") != tasks[source] or "node_rank" in config.origin:
        return config
    return dataclasses.replace(
        config,
        nodes=config.world_size or 1,
        node_rank=config.rank or 0,
        rank=None,
        local_rank=None,
        world_size=None,
        origin={**config.origin, "nodes": tasks[source], "node_rank": source},
    )


def _on_end(fd: int) -> None:
    """Read ``fd`` to its end, then stop this launcher as SIGTERM does (unbuffered: a
    thread blocked in a buffered stream's read would hold its lock at interpreter exit)."""
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def read_line(fd: int, limit: int = 4096) -> str:
    """One line from ``fd``, read a byte at a time so that nothing after it is taken."""
    data = b""
    while len(data) < limit and (byte := os.read(fd, 1)) and byte != b"\n":
        data += byte
    return data.decode(errors="replace")


def _master_address(url: str, nodes: int) -> tuple[str, int] | None:
    """Where a worker's ``init_process_group(init_method="env://")`` finds its store: rank 0
    serves a TCPStore there (torch's env:// does that itself). On one node, a free loopback
    port; on several, the coordinator's host (the driver node's, as ``--url`` names it) and
    the port after the coordinator's, the same on every node. None where no single host is
    known (an etcd cluster): such scripts set ``MASTER_ADDR``/``MASTER_PORT`` themselves."""
    if nodes == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", s.getsockname()[1]
    parsed, _ = locate(url)
    if len(parsed.hosts) != 1 or parsed.scheme == "etcd":
        return None
    host, port = parsed.hosts[0]
    if not host or port is None or port >= 65535 or host in ("0.0.0.0", "*"):
        return None
    return host, port + 1


def _cores() -> int:
    """The cores this process may run on (its affinity, as a container or ``taskset`` sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _omp_threads(env: dict[str, str], nprocs: int) -> int | None:
    """Threads per worker for intra-op parallelism when the user did not choose: the node's
    cores shared by its workers (torch's default, every core per worker, oversubscribes the
    node nprocs times over). None when ``OMP_NUM_THREADS`` is set: the user's value stands."""
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, _cores() // max(1, nprocs))


def relaunch(script: str, args: Sequence[str], **settings: object) -> int:
    """Run ``script args`` as this node's workers, as ``dataparallel launch`` would, with
    ``settings`` (``nprocs=``, ``url=``...) above the environment and the file: how a script
    started by hand starts its own job."""
    from ..config import load_config

    return launch(worker_command([script, *args]), load_config(settings))
