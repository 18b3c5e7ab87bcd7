"""``dataparallel`` command line: ``launch``, ``serve``, ``check``, ``status``, ``top``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import inspect
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from .config import CHOICES, SETTINGS, flag_of
from .control.registry import resolve
from .errors import ConfigError, ControlError
from .version import __version__

if TYPE_CHECKING:
    from .control.channel import ControlChannel
    from .control.status import JobWatch

EXAMPLES = """\
examples:
  # one machine, 4 workers, embedded ZeroMQ coordinator on a free port
  dataparallel launch --nprocs 4 train.py --epochs 10

  # three machines, 2 workers each; the same command on each, with its --node-rank
  dataparallel launch --url zmq://10.0.0.1:29500 --nodes 3 --nprocs 2 --node-rank 0 train.py

  # the same from one machine: every host started over ssh (its slots = its workers)
  dataparallel launch --hosts 10.0.0.1:2,10.0.0.2:2,10.0.0.3:2 train.py

  # settings from a file (flags > DP_* environment > file)
  dataparallel launch --config dataparallel.toml --node-rank 1 train.py

  # a standalone coordinator, and a check from another machine
  DP_TOKEN=s3cret dataparallel serve zmq://0.0.0.0:29500
  DP_TOKEN=s3cret dataparallel check zmq://10.0.0.1:29500
"""


def _config_flags(parser: argparse.ArgumentParser, launcher: bool) -> None:
    group = parser.add_argument_group("job configuration (flags > DP_* environment > dataparallel.toml)")
    group.add_argument("--config", help="TOML file (default: $DP_CONFIG, else ./dataparallel.toml if present)")
    names = ["url", "transport", "host", "port", "options", "job", "timeout", "token_file"]
    if launcher:
        names += ["world_size", "nprocs", "nodes", "node_rank", "max_restarts", "elastic", "relay", "min_world_size"]
        names += ["max_world_size", "hosts", "hostfile"]
        names += ["log_format", "events"]
    for name in names:
        setting = SETTINGS[name]
        kwargs: dict[str, Any] = {"help": f"{setting.meaning} (default: {setting.default})"}
        if name == "options":
            kwargs.update(dest="options", action="append", metavar="KEY=VALUE")
        elif setting.kind is bool:
            kwargs.update(action="store_const", const=True)
        elif name in CHOICES:
            kwargs.update(choices=CHOICES[name])
        group.add_argument(flag_of(name), **kwargs)


def _load(args: argparse.Namespace):
    from .config import load_config

    flags = {name: getattr(args, name, None) for name in SETTINGS}
    flags["config"] = args.config
    if getattr(args, "url_arg", None):
        flags["url"] = args.url_arg
    return load_config(flags)


def _launch(args: argparse.Namespace) -> int:
    from .launching.launcher import launch, read_line, worker_command
    from .launching.ssh import SshOptions

    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    if args.module and target:
        target = [args.module, *target]
    elif args.module:
        target = [args.module]
    command = worker_command(target, module=bool(args.module), no_python=args.no_python)
    config = _load(args)
    prefix = not args.no_prefix
    if args.from_launcher:  # a host's part of a job started over ssh: token and URL on stdin, then its end
        lifeline = sys.stdin.fileno()
        token, url = read_line(lifeline).strip(), read_line(lifeline).strip()
        if not token or not url:
            raise ConfigError("the launcher's stdin ended before it sent the job's token and URL")
        config = dataclasses.replace(config, token=token, url=url)
        return launch(command, config, grace=args.grace, prefix=prefix, first_rank=args.first_rank, lifeline=lifeline)
    ssh = SshOptions(port=args.ssh_port, options=tuple(args.ssh_option), python=args.remote_python or sys.executable)
    return launch(command, config, grace=args.grace, prefix=prefix, ssh=ssh)


def _serve(args: argparse.Namespace) -> int:
    config = _load(args)
    token = config.token
    url, cls = resolve(config.require("url"), token, serving=True, where=config.describe("url"))
    serve = getattr(cls, "serve", None)
    if serve is None:
        raise ConfigError(f"transport {url.scheme!r} has no standalone coordinator to serve")
    _can_listen(url.host, url.port)
    # SIGTERM ends the server like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def ready(port: int) -> None:
        print(
            f"dataparallel {__version__}: serving {url.shown} on port {port} (token {'set' if token else 'not set'})",
            f"security: {cls.security(url, token)}",
            sep="\n",
            flush=True,
        )

    if not args.http:
        try:
            serve(url, token, ready)
        except KeyboardInterrupt:
            pass
        return 0
    if "coordinator" not in inspect.signature(serve).parameters:
        raise ConfigError(f"transport {url.scheme!r}: its coordinator does not say its jobs (--http)")
    from .control.status_http import StatusServer, parse_address

    jobs: list[Callable[[], list[str]]] = []  # the coordinator's, once it is made
    observers = _Observers(url, token)

    def listening(at: int) -> None:
        observers.port = at

        def listed() -> list[str]:
            names = jobs[0]()
            observers.prune(names)  # and the page its views of them (StatusServer)
            return names

        web = StatusServer(address=parse_address(args.http), token=token, jobs=listed, look_job=observers.look)
        stack.enter_context(web)
        ready(at)
        print(f"status of its jobs at {web.url} (/, /job/NAME/, /metrics)", flush=True)

    with contextlib.ExitStack() as stack:
        stack.callback(observers.close)
        try:
            serve(url, token, listening, coordinator=lambda c: jobs.append(c.job_names))
        except KeyboardInterrupt:
            pass
    return 0


class _Observers:
    """``serve --http``: an observer of each job the page is asked for, on this coordinator
    (opened again where it failed), each with its own :class:`JobWatch`."""

    def __init__(self, url: Any, token: str | None) -> None:
        self.url, self.token, self.port = url, token, 0
        self._open: dict[str, tuple[ControlChannel, JobWatch]] = {}
        self._lock = threading.Lock()

    def prune(self, jobs: list[str]) -> None:
        """Close the observers of jobs no longer there."""
        with self._lock:
            for job in [j for j in self._open if j not in jobs]:
                with contextlib.suppress(ControlError):
                    self._open.pop(job)[0].close()

    def look(self, job: str) -> dict[str, Any]:
        from .connect import observe
        from .control.status import JobWatch, read_job

        host = "127.0.0.1" if self.url.host in ("0.0.0.0", "::", "") else self.url.host
        with self._lock:
            channel, watch = self._open.get(job, (None, None))
            if channel is None or channel.failure is not None or watch is None:
                if channel is not None:
                    channel.close()
                # The URL served, its options kept (curve, TLS), at an address this process reaches.
                parts = urlsplit(self.url.raw)
                netloc = f"{'[' + host + ']' if ':' in host else host}:{self.port}"
                where = urlunsplit(parts._replace(netloc=netloc))
                channel, watch = observe(where, job=job, token=self.token, timeout=5), JobWatch()
                self._open[job] = (channel, watch)
        return read_job(channel, watch=watch)

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._open.values():
                with contextlib.suppress(ControlError):
                    channel.close()
            self._open.clear()


def _can_listen(host: str, port: int | None) -> None:
    """A ControlError, in a line, where the coordinator could not listen at host:port (the
    port taken, the address not this machine's), before its server says so in a traceback."""
    if not port:
        return
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            pass
    except OSError as err:
        taken = (
            " (another coordinator, or another program: choose another port)" if err.errno == errno.EADDRINUSE else ""
        )
        said = os.strerror(err.errno) if err.errno else str(err)
        raise ControlError(f"cannot listen on {host}:{port}: {said}{taken}") from None


def _check(args: argparse.Namespace) -> int:
    from .config import describe_launch
    from .control.check import check

    config = _load(args)
    if args.env:
        print(describe_launch(config), flush=True)
        for name in ("rank", "world_size", "local_rank", "url", "job"):
            if getattr(config, name) is not None:
                print(f"  {name} = {config.shown(name)} (from {config.origin.get(name, 'default')})", flush=True)
        return 0
    timeout = float(args.timeout) if args.timeout else 5.0
    report = check(
        config.require("url"), token=config.token, timeout=timeout, rounds=args.rounds, where=config.describe("url")
    )
    print(report.render(), flush=True)
    return 0 if report.ok else 1


class _Observer:
    """``status``'s and ``top``'s channel to the configured job (:func:`dataparallel.observe`),
    opened again where its coordinator went away, and moved on to an elastic job's newest
    generation (``JOB~1``...) at each look."""

    def __init__(self, args: argparse.Namespace) -> None:
        from .control.membership import newest_generation

        self.config = _load(args)
        self.timeout = float(args.timeout) if args.timeout else 10.0
        self.world_size: int | None = args.world_size
        self.generation = 0
        try:
            self.channel = self._open(self.config.job)
        except ControlError:  # generation 0 over: a later one may carry on
            newer = newest_generation(self._open, self.config.job, 0)
            if newer is None:
                raise
            self.channel, self.generation = newer

    def _open(self, job: str) -> ControlChannel:
        from .connect import observe

        config = self.config
        return observe(config.require("url"), job=job, token=config.token, timeout=self.timeout)

    def look(self, watch: JobWatch | None = None) -> dict[str, Any]:
        """The job's view (:func:`~dataparallel.control.status.read_job`)."""
        from .control.membership import generation_job, newest_generation
        from .control.status import read_job

        newer = newest_generation(self._open, self.config.job, self.generation)
        if newer is not None:
            self.channel.close()
            self.channel, self.generation = newer
        elif self.channel.failure is not None:  # its coordinator went away: connect again
            self.channel.close()
            self.channel = self._open(generation_job(self.config.job, self.generation))
        return read_job(self.channel, world_size=self.world_size, watch=watch)

    def close(self) -> None:
        self.channel.close()


def _status(args: argparse.Namespace) -> int:
    import json

    from .control.status import JobWatch, render, render_events

    if args.events:  # a launcher's file: no job to reach (it may have ended long ago)
        from .launching.events import read_event_file

        try:
            events = sorted(read_event_file(args.events), key=lambda e: e["time"])
        except OSError as err:
            raise ConfigError(f"cannot read the event file {args.events!r}: {err.strerror}") from None
        print(json.dumps(events) if args.json else "\n".join(render_events(events)), flush=True)
        return 0
    observer = _Observer(args)
    if args.http:
        from .control.status_http import StatusServer, parse_address

        watch = JobWatch()  # looked at again and again: ages on this process's clock
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends it as Ctrl-C does
        try:
            with StatusServer(lambda: observer.look(watch), parse_address(args.http), observer.config.token) as server:
                print(f"serving job {observer.config.job!r} at {server.url} (/, /status.json, /metrics)", flush=True)
                while True:
                    signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            observer.close()
        return 0
    try:
        view = observer.look()
        if args.stacks is not None:
            view["stacks"] = _stacks(observer, view, args.stacks)
    finally:
        observer.close()
    if args.json:
        print(json.dumps(view), flush=True)
    else:
        print(render(view), flush=True)
        for rank, dump in sorted(view.get("stacks", {}).items()):
            print(f"\nrank {rank} ({dump['host']}, pid {dump['pid']}), Python stacks of {_clock(dump['time'])}:")
            print(dump["text"].rstrip(), flush=True)
    return 0


def _clock(at: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(at))


def _stacks(observer: _Observer, view: dict[str, Any], asked: list[int]) -> dict[int, dict[str, Any]]:
    """``status --stacks``: the ranks asked for (none: the stalled ranks, else every rank) dump
    their Python stacks where this process can signal them (their pids in this process's PID
    namespace, each catching the signal: one that does not would end), and each one's last
    dump is read from the channel; for a rank elsewhere, how to ask it is said."""
    import time

    from .control.procinfo import catches, same_pids
    from .control.status import STACKS_SIGNAL, read_stacks

    ranks = asked or [s["rank"] for s in view["stalls"]] or [r["rank"] for r in view["ranks"]]
    entries = {r["rank"]: r for r in view["ranks"]}
    if unknown := [r for r in ranks if r not in entries]:
        raise ConfigError(f"no rank {unknown[0]} in job {view['job']!r} of {view['world_size']} rank(s)")
    signal_name, signalled, since = STACKS_SIGNAL.name, [], time.time()
    for rank in ranks:
        entry = entries[rank]
        pid, host, ident = entry.get("pid"), entry.get("host"), entry.get("identity")
        if entry["state"] not in ("running", "silent") or not isinstance(pid, int) or pid <= 1:
            continue
        if entry.get("stacks_signal") != signal_name:
            print(
                f"rank {rank}: it dumps no stacks on {signal_name} (the signal is its own, or not published)",
                file=sys.stderr,
            )
            continue
        here = isinstance(ident, list) and len(ident) == 2 and same_pids(str(ident[0]), int(ident[1] or 0))
        if here and catches(pid, STACKS_SIGNAL):
            try:
                os.kill(pid, STACKS_SIGNAL)
                signalled.append(rank)
                continue
            except (ProcessLookupError, PermissionError) as err:
                print(f"rank {rank}: pid {pid} not signalled: {err}", file=sys.stderr)
        elif here:
            print(f"rank {rank}: pid {pid} does not catch {signal_name} now: not signalled", file=sys.stderr)
            continue
        how = f"`kill -{signal_name[3:]} {pid}` (or to its launcher)"
        print(f"rank {rank} runs on {host}: there, {how} makes it dump its stacks", file=sys.stderr)
    deadline = time.monotonic() + 5.0
    while True:  # until every rank signalled has put a dump newer than the signal (at most 5 s)
        dumps = read_stacks(observer.channel, ranks)
        late = [r for r in signalled if r not in dumps or dumps[r]["time"] < since]
        if not late or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    for rank in late:
        print(f"rank {rank}: no stacks within 5 s of the signal (its main thread holds the GIL?)", file=sys.stderr)
    return dumps


def _top(args: argparse.Namespace) -> int:
    import time

    from .control.status import JobWatch, render

    tty = sys.stdout.isatty()
    watch = JobWatch()  # ages on this process's clock from the second look on
    observer = _Observer(args)
    shown = 0
    try:
        while args.iterations is None or shown < args.iterations:
            started = time.monotonic()
            try:
                view = observer.look(watch)
                text = f"{time.strftime('%H:%M:%S', time.localtime(view['time']))}  {render(view)}"
            except ControlError as err:  # the job between runs, its coordinator restarting: look again
                text = f"{time.strftime('%H:%M:%S')}  job {observer.config.job!r}: {type(err).__name__}: {err}"
            # A terminal is redrawn in place; a pipe or file gets one block per look.
            print("\x1b[H\x1b[2J" + text if tty else text + "\n", flush=True)
            shown += 1
            if args.iterations is None or shown < args.iterations:
                time.sleep(max(args.interval - (time.monotonic() - started), 0.0))
    except KeyboardInterrupt:
        pass
    finally:
        observer.close()
    return 0


def _job_view_args(parser: argparse.ArgumentParser) -> None:
    """What ``status`` and ``top`` both take: the URL, the job's size, the job's configuration."""
    parser.add_argument("url_arg", metavar="URL", nargs="?", help="channel URL (default: from the configuration)")
    parser.add_argument("--world-size", type=int, help="the job's size (default: as its ranks published it)")
    _config_flags(parser, launcher=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataparallel",
        description="Data-parallel PyTorch training over a pluggable control channel.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=f"dataparallel {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log coordinator events")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{launch,serve,check,status,top}")

    launch = sub.add_parser(
        "launch",
        help="start this node's workers of a training script",
        description="Start this node's workers (ranks node_rank*nprocs ...), prefix their output with the rank, "
        "forward signals, and stop them all when one fails (its exit code is returned).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    _config_flags(launch, launcher=True)
    launch.add_argument("-m", dest="module", metavar="MODULE", help="run a module (python -m MODULE)")
    launch.add_argument("--no-python", action="store_true", help="run the command itself, not with this Python")
    launch.add_argument("--no-prefix", action="store_true", help="leave the workers' output as it is")
    launch.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)")
    remote = launch.add_argument_group("over ssh (with --hosts or --hostfile)")
    remote.add_argument("--ssh-port", type=int, help="ssh port on every host (default: ssh's, as ~/.ssh/config says)")
    remote.add_argument(
        "--ssh-option", action="append", default=[], metavar="KEY=VALUE", help="an ssh -o option, repeatable"
    )
    remote.add_argument("--remote-python", help="the Python on the hosts (default: this one's path)")
    launch.add_argument("--from-launcher", action="store_true", help=argparse.SUPPRESS)
    launch.add_argument("--first-rank", type=int, help=argparse.SUPPRESS)
    launch.add_argument("target", nargs=argparse.REMAINDER, help="script and its arguments")
    launch.set_defaults(run=_launch)

    serve = sub.add_parser(
        "serve",
        help="run a standalone coordinator (zmq, grpc)",
        description="Run a job coordinator on its own, outliving any rank. The token comes from DP_TOKEN "
        "or --token-file.",
    )
    serve.add_argument("url_arg", metavar="URL", nargs="?", help="where to listen, e.g. zmq://0.0.0.0:29500[?curve=1]")
    serve.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="also serve the status of its jobs: / lists them, /job/NAME/ is a job's page (and status.json), "
        "/metrics every job's ranks for Prometheus (bound to 127.0.0.1 unless HOST says otherwise; the token "
        "as a bearer token or ?token=)",
    )
    _config_flags(serve, launcher=False)
    serve.set_defaults(run=_serve)

    check = sub.add_parser(
        "check",
        help="reach a coordinator or etcd: latency, token, diagnosis",
        description="Connect to the coordinator (or etcd) at URL without joining a job: report reachability, "
        "round-trip latency and whether the token works, or what is wrong (nothing listening, TLS or "
        "encryption mismatch, wrong token). Exit status 0 when all is well, 1 otherwise. --timeout bounds "
        "each step here (default 5 s; DP_TIMEOUT and the file's timeout are not used); --job matters only "
        "with --env (the check itself uses the job __dp-check).",
    )
    check.add_argument("url_arg", metavar="URL", nargs="?", help="channel URL (default: from the configuration)")
    check.add_argument("--rounds", type=int, default=20, help="round trips to time (default 20)")
    check.add_argument(
        "--env",
        action="store_true",
        help="say which launcher started this process (dataparallel launch, torchrun, srun, mpirun) and its place "
        "in the job, each value with where it came from; reaches nothing",
    )
    _config_flags(check, launcher=False)
    check.set_defaults(run=_check)

    status = sub.add_parser(
        "status",
        help="what each rank of a running job is doing, and who a stall waits for",
        description="Read a running job's ranks without joining it (the job's token is needed, as for a rank): "
        "each rank's host, pid, phase, epoch and step, how long it has been in its phase, its step time and "
        "its split, and the age of its last status; then the stalls: ranks gone silent, and ranks that others "
        "have waited for past the stall threshold (5 median step times, at least 2 s), with what each is "
        "doing; then the stragglers. Ranks publish their status under dp.fit. --timeout bounds the connection "
        "(default 10 s).",
    )
    _job_view_args(status)
    status.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: job, world_size, time, ranks, stalls, stragglers, events (and stacks)",
    )
    status.add_argument(
        "--events",
        metavar="FILE",
        help="show the event log a launcher kept in FILE (launch --events) instead: every event, oldest first "
        "(with --json, a JSON list); no job is reached",
    )
    status.add_argument(
        "--stacks",
        metavar="RANK",
        type=int,
        nargs="*",
        help="also each rank's Python stacks (all threads), dumped on SIGUSR2: the ranks given, else the "
        "stalled ones, else all; those on this host are signalled, for the others the command to run there is "
        "printed (a rank's launcher passes SIGUSR2 on to its workers too)",
    )
    status.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="serve the view until interrupted instead: a page at /, /status.json, and /metrics for Prometheus "
        "(bound to 127.0.0.1 unless HOST says otherwise; with a token, requests carry it: Authorization: Bearer "
        "TOKEN, or ?token=TOKEN in a browser)",
    )
    status.set_defaults(run=_status)

    top = sub.add_parser(
        "top",
        help="dataparallel status, live: the ranks and stalls of a running job, looked at again every second",
        description="As dataparallel status, looked at again every --interval seconds (one connection, held) until "
        "interrupted or --iterations looks: a terminal is redrawn in place, other output gets one block per look.",
    )
    _job_view_args(top)
    top.add_argument("--interval", type=float, default=1.0, help="seconds between looks (default 1)")
    top.add_argument("--iterations", type=int, help="stop after this many looks (default: until interrupted)")
    top.set_defaults(run=_top)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    try:
        return args.run(args)
    except ConfigError as err:
        print(f"dataparallel: {err}", file=sys.stderr)
        return 2
    except ControlError as err:  # an expected condition, said in one line (no traceback)
        print(f"dataparallel: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
