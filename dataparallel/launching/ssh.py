"""``dataparallel launch --hosts h1:2,h2:2 train.py`` (or ``--hostfile FILE``): one command
starts the whole job, a node launcher on every host over the system's OpenSSH client, so
the user's ``~/.ssh/config``, agent, ``ProxyJump`` and known hosts apply.

- Every host is checked first, all at once and within bounded time: reachable, the key
  accepted, the working directory there, the same dataparallel for the same Python. What
  fails is one error naming each failing host, before anything starts.
- Host K runs ``python -m dataparallel launch`` for its ranks (its slots, numbered on from
  the hosts before it), in this launcher's working directory, with the resolved job
  configuration as flags. The first host hosts the coordinator unless the configuration
  names one.
- The job token travels on ssh's stdin, never on a command line (a token is made for the
  run when none is configured). The remote launcher then keeps reading its stdin: when it
  ends (this launcher stops, is killed, or the connection goes) it stops its workers. So
  Ctrl-C or SIGTERM here, or the loss of this launcher, leaves no process on any host.
- Output comes back line by line as ``[HOST] [rank R] ...``; the first host to fail stops
  the others and its exit code is returned (255: ssh itself failed); ``--max-restarts``
  restarts on every host in step, as each node launcher does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import secrets
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from ..config import PLACED, SETTINGS, JobConfig, address_of
from ..control.registry import resolve
from ..errors import ConfigError
from ..version import __version__
from .supervisor import DEFAULT_GRACE, SIGNALLED_GRACE, Log, Supervisor, Worker

#: Environment variables a host's workers get from this launcher's environment (names, or
#: prefixes ending in ``_``): tuning of the libraries underneath, not this machine's paths.
FORWARDED = ("NCCL_", "GLOO_", "TORCH_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED", "PYTHONPATH")
#: The variables a host's own environment might set that would speak over this launcher's.
OWN = {s.env for s in SETTINGS.values() if s.env} | {"DP_CONFIG", "DP_TOKEN"}


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How to reach the hosts: ``port`` and ``options`` (``-o KEY=VALUE``) for ssh, the
    Python that runs dataparallel there (default: this one's path, as on a shared
    filesystem or identical machines), and seconds to wait for a host to answer."""

    port: int | None = None
    options: tuple[str, ...] = ()
    python: str = sys.executable
    connect_timeout: float = 10.0

    def argv(self, host: str, command: str | None = None, *extra: str) -> list[str]:
        """``ssh`` to ``host`` (an IPv6 address without its brackets, as ssh takes it) running
        ``command``. The user's options come first: for each option ssh keeps the first value."""
        argv = ["ssh", "-T", "-x", *extra]
        for option in self.options:
            argv += ["-o", option]
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(self.connect_timeout))}"]
        # A host that vanishes without closing the connection (cut off, powered down) ends
        # its ssh within half a minute: the job sees a failed host, not a silent one.
        argv += ["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=6"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        user, at, address = host.rpartition("@")
        return [*argv, f"{user}{at}{address.strip('[]')}", *([command] if command is not None else [])]

    def hostname(self, host: str) -> str:
        """The address ssh connects to for ``host`` (``HostName`` in ~/.ssh/config, else the
        host itself), from ``ssh -G``: what the other hosts must use to reach it too."""
        try:
            done = subprocess.run(self.argv(host, None, "-G"), capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return address_of(host)
        for line in done.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname" and value.strip():
                return value.strip()
        return address_of(host)


def check_hosts(hosts: Sequence[str], ssh: SshOptions, cwd: str) -> None:
    """Reach every host at once; :class:`ConfigError` naming each one that cannot run the job."""
    probe = "import os, sys; os.chdir(sys.argv[1]); import dataparallel; print(dataparallel.__version__)"
    command = shlex.join([ssh.python, "-c", probe, cwd])
    limit = ssh.connect_timeout + 20

    def one(host: str) -> str | None:
        try:
            done = subprocess.run(
                ssh.argv(host, command), capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return f"no answer over ssh within {limit:g}s"
        except OSError as err:
            return f"cannot run ssh: {err.strerror}"
        said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        last = said[-1] if said else f"exit code {done.returncode}"
        if done.returncode == 255:
            return f"ssh failed: {last}"
        if done.returncode == 127:
            return f"{ssh.python} is not there ({last})"
        if done.returncode != 0:
            if "No module named 'dataparallel'" in last:
                return f"dataparallel is not installed for {ssh.python} there"
            if "ModuleNotFoundError" in last or "ImportError" in last:
                return f"cannot import dataparallel with {ssh.python} there: {last}"
            if "chdir" in done.stderr or "FileNotFoundError" in last:
                return f"no directory {cwd} there (the job runs in this working directory on every host)"
            return last
        version = done.stdout.strip().splitlines()[-1:] or ["?"]
        if version[0] != __version__:
            return f"dataparallel {version[0]} there, {__version__} here: install the same on every host"
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        problems = [(host, why) for host, why in zip(hosts, pool.map(one, hosts), strict=True) if why]
    if problems:
        listed = "\n".join(f"  {host}: {why}" for host, why in problems)
        raise ConfigError(f"cannot start the job on {len(problems)} of {len(hosts)} hosts:\n{listed}")


def remote_command(
    command: Sequence[str],
    config: JobConfig,
    node: int,
    first_rank: int,
    slots: int,
    world: int,
    *,
    grace: float,
    ssh: SshOptions,
    prefix: bool,
    cwd: str,
) -> str:
    """The shell command that runs host ``node``'s launcher: its ranks, the job's settings as
    flags (the remote side reads no file or ``DP_*`` variable of its own: ``--config
    /dev/null``, ``env -u``, so every host runs the configuration resolved here); the token
    and the URL (which may hold a password) are left for stdin, off every command line."""
    argv = [ssh.python, "-m", "dataparallel", "launch", "--from-launcher", "--config", os.devnull]
    argv += ["--job", config.job, "--timeout", f"{config.timeout:g}"]
    argv += ["--nodes", str(config.nodes), "--node-rank", str(node), "--nprocs", str(slots)]
    argv += ["--world-size", str(world), "--first-rank", str(first_rank), "--max-restarts", str(config.max_restarts)]
    argv += ["--log-format", config.log_format, "--grace", f"{grace:g}"]
    argv += ["--elastic"] if config.elastic else []
    argv += ["--relay"] if config.relay else []
    for bound in ("min_world_size", "max_world_size"):
        if getattr(config, bound) is not None:
            argv += [f"--{bound.replace('_', '-')}", str(getattr(config, bound))]
    argv += [] if prefix else ["--no-prefix"]
    target = list(command)
    if target and target[0] == sys.executable:
        target[0] = ssh.python
    argv += ["--no-python", "--", *target]
    forwarded = [
        f"{name}={value}"
        for name, value in sorted(os.environ.items())
        if any(name == f or (f.endswith("_") and name.startswith(f)) for f in FORWARDED)
    ]
    unset = [arg for var in sorted(OWN) for arg in ("-u", var)]
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(['env', *unset, *forwarded, *argv])}"


class _Hosts(Supervisor):
    """The hosts' ssh sessions as one group: stopping a host closes its ssh's stdin (its
    launcher stops its workers and exits, its output still coming back); SIGKILL, after
    the grace, ends the ssh client itself."""

    def _deliver(self, worker: Worker, signum: int) -> None:
        if signum == signal.SIGKILL:
            super()._deliver(worker, signum)
            return
        if worker.proc.stdin is not None and not worker.proc.stdin.closed:
            with contextlib.suppress(OSError, ValueError):
                worker.proc.stdin.close()


def launch_hosts(
    command: Sequence[str],
    config: JobConfig,
    *,
    grace: float = DEFAULT_GRACE,
    prefix: bool = True,
    log: Log | None = None,
    ssh: SshOptions | None = None,
) -> int:
    """Run ``command`` (a full argv, as :func:`dataparallel.launching.launcher.launch` takes it) on
    every host of ``config.hosts`` over ssh; returns as ``launch`` does."""
    ssh = ssh or SshOptions()
    log = log or sys.stderr
    hosts, slots = [host for host, _ in config.hosts], config.slots
    world = sum(slots)
    if config.world_size is not None and config.world_size != world:
        raise ConfigError(
            f"{config.describe('world_size')} = {config.world_size} does not match the hosts' slots "
            f"({' + '.join(map(str, slots))} = {world})"
        )
    url = config.require("url")
    if config.origin.get("host") == PLACED:  # the first host's own address, as ssh resolves it
        url = _with_host(url, ssh.hostname(hosts[0]))
    token = config.token or secrets.token_urlsafe(24)  # a job over a network always has one
    shown = resolve(url, token, where=config.describe("url"))[0].shown
    cwd = os.getcwd()
    check_hosts(hosts, ssh, cwd)
    print(
        f"[launch] {len(hosts)} hosts over ssh, {world} ranks, coordinator {shown} (job {config.job!r}"
        + ("" if config.token else "; a token was made for this run")
        + ")",
        file=log,
        flush=True,
    )
    supervisor = _Hosts(
        max(grace, SIGNALLED_GRACE) + 10, log, tolerate=config.elastic, as_json=config.log_format == "json"
    )
    # ssh needs none of the job's settings (the token, a URL's password): they stay out of its environment.
    own_dropped = {name: value for name, value in os.environ.items() if name not in OWN}
    first = 0
    with supervisor.forwarding_signals():
        for node, (host, count) in enumerate(zip(hosts, slots, strict=True)):
            if supervisor.signalled is not None:
                break  # stopped while starting: start no more
            remote = remote_command(
                command, config, node, first, count, world, grace=grace, ssh=ssh, prefix=prefix, cwd=cwd
            )
            worker = supervisor.start(
                node,
                0,
                ssh.argv(host, remote),
                own_dropped,
                prefix,
                label=address_of(host),
                stdin=subprocess.PIPE,
                pass_on=False,  # SIGUSR2 would end ssh: send it to the host's launcher, there
            )
            assert worker.proc.stdin is not None
            # An ssh that ended at once, or one stopped meanwhile (stdin closed): wait() tells.
            with contextlib.suppress(BrokenPipeError, ValueError):
                worker.proc.stdin.write(f"{token}\n{url}\n".encode())
                worker.proc.stdin.flush()
            first += count
        return supervisor.wait()


def _with_host(url: str, host: str) -> str:
    """``url`` with its host replaced (its port and options kept)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"[{host}]{port}" if ":" in host else f"{host}{port}"))
