"""A linearizability checker for a channel's key-value primitives, and a workload to feed it.

Every operation of a history is recorded with the moment it was invoked and the moment it
completed (``time.monotonic()``, one clock for every process of a machine). The history is
linearizable if every operation can be given one instant inside its interval at which it took
effect, in an order that torch's ``Store`` semantics accept (:func:`step`). Linearizability is
local, so each key is checked on its own (one register per key).

An operation whose outcome is unknown (its process was killed, or it raised an error after its
request may have been applied) is *indeterminate*: it may have taken effect at any instant
after its invocation, or never; its result is not checked. A read that failed is dropped (it
changed nothing).

The search is Wing and Gong's, with Lowe's memoisation of (linearized set, state) pairs, as
in Jepsen's Knossos and Porcupine. On failure, :func:`check` reports the longest valid prefix
it found, the state after it and the operations none of which can come next: the smallest
window of the history that shows the violation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Operations the model knows, with the arguments each takes.
OPS = {"set": 1, "get": 0, "check": 0, "add": 1, "compare_set": 2, "delete": 0}


@dataclass(frozen=True)
class Operation:
    """One call on one key. ``end is None``: indeterminate (see the module docstring)."""

    client: int
    key: str
    op: str
    args: tuple[Any, ...]
    start: float
    end: float | None
    result: Any = None

    def __str__(self) -> str:
        args = "".join(f", {a!r}" for a in self.args)
        outcome = "?" if self.end is None else repr(self.result)
        end = "…" if self.end is None else f"{self.end:.6f}"
        return f"client {self.client}: {self.op}({self.key!r}{args}) -> {outcome} [{self.start:.6f}, {end}]"


def step(state: str | None, op: Operation) -> tuple[bool, str | None]:
    """Apply ``op`` to a key holding ``state`` (None: missing), as torch's Store does.
    Returns (whether ``op``'s recorded result is possible, the state afterwards)."""
    free = op.end is None  # indeterminate: any result
    kind, args, result = op.op, op.args, op.result
    if kind == "set":
        return True, args[0]
    if kind == "get":  # a result of None: the get found the key missing (it timed out)
        return free or result == state, state
    if kind == "check":
        return free or result == (state is not None), state
    if kind == "add":
        try:
            new = int(state or 0) + args[0]
        except ValueError:
            return free, state  # no number there: the add fails and changes nothing
        return free or result == new, str(new)
    if kind == "compare_set":
        expected, desired = args
        if state is None:
            if expected == "":
                return free or result == desired, desired
            return free or result == expected, None
        if state == expected:
            return free or result == desired, desired
        return free or result == state, state
    if kind == "delete":
        return free or result == (state is not None), None
    raise ValueError(f"unknown operation {kind!r}")


@dataclass
class KeyReport:
    key: str
    operations: int
    ok: bool
    #: On failure: the longest valid prefix found, the state after it, and the window.
    prefix: list[Operation] = field(default_factory=list)
    state: str | None = None
    window: list[Operation] = field(default_factory=list)
    explored: int = 0

    def __str__(self) -> str:
        if self.ok:
            return f"key {self.key!r}: {self.operations} operations, linearizable"
        lines = [
            f"key {self.key!r}: {self.operations} operations, NOT linearizable ({self.explored} states explored).",
            f"  The longest valid order found takes {len(self.prefix)} operations, ending with:",
            *(f"    {op}" for op in self.prefix[-3:]),
            f"  and leaves the key {'missing' if self.state is None else repr(self.state)}. "
            "None of these can come next:",
            *(f"    {op}" for op in self.window),
        ]
        return "\n".join(lines)


@dataclass
class Report:
    keys: list[KeyReport]

    @property
    def ok(self) -> bool:
        return all(k.ok for k in self.keys)

    @property
    def operations(self) -> int:
        return sum(k.operations for k in self.keys)

    def __str__(self) -> str:
        return "\n".join(str(k) for k in self.keys)


class _Link:
    """The head of the list of events, or (a :class:`_Node`) an event in it."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next: _Node | None = None


class _Node(_Link):
    """An operation's call (``match``: its return) or return (``match``: None)."""

    __slots__ = ("call", "id", "match", "op", "prev")
    #: The head or the event before this one: set when the node is linked into the list.
    prev: _Link

    def __init__(self, op: Operation, ident: int, call: bool) -> None:
        super().__init__()
        self.op, self.id, self.call = op, ident, call
        self.match: _Node | None = None


def check_key(key: str, ops: Sequence[Operation], initial: str | None = None, limit: int = 2_000_000) -> KeyReport:
    """Search for a linearization of one key's operations (see the module docstring)."""
    inf = float("inf")
    events: list[tuple[float, int, _Node]] = []
    for i, op in enumerate(ops):
        call, ret = _Node(op, i, True), _Node(op, i, False)
        call.match = ret
        # At equal times, calls sort before returns: such operations count as concurrent.
        events += [(op.start, 0, call), (inf if op.end is None else op.end, 1, ret)]
    events.sort(key=lambda e: (e[0], e[1]))
    head = _Link()
    prev = head
    for _, _, node in events:
        prev.next, node.prev = node, prev
        prev = node

    def lift(call: _Node) -> None:
        ret, after = call.match, call.next
        if ret is None or after is None:  # a call has its return, linked after it
            raise RuntimeError(f"lift: not a call in the list: {call.op}")
        call.prev.next = after
        after.prev = call.prev
        ret.prev.next = ret.next
        if ret.next is not None:
            ret.next.prev = ret.prev

    def unlift(call: _Node) -> None:
        ret, after = call.match, call.next
        if ret is None or after is None:
            raise RuntimeError(f"unlift: not a lifted call: {call.op}")
        ret.prev.next = ret
        if ret.next is not None:
            ret.next.prev = ret
        call.prev.next = call
        after.prev = call

    state, linearized = initial, 0
    stack: list[tuple[_Node, str | None]] = []
    seen: set[tuple[int, str | None]] = set()
    best: tuple[list[Operation], str | None, list[Operation]] = ([], initial, [])
    entry = head.next
    while head.next is not None:
        # The first event, or the one after a call (there is one: the call's return).
        if entry is None:
            raise RuntimeError(f"key {key!r}: the search lost its place in the list of events")
        if entry.call:
            ok, new = step(state, entry.op)
            if ok:
                marked = linearized | (1 << entry.id)
                if (marked, new) not in seen:
                    seen.add((marked, new))
                    if len(seen) > limit:
                        break
                    stack.append((entry, state))
                    state, linearized = new, marked
                    lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
            continue
        # A return: some operation called before it must be placed first, and none can.
        if len(stack) >= len(best[0]):
            window = []
            event: _Node | None = head.next
            while event is not None and event is not entry.next:
                if event.call:
                    window.append(event.op)
                event = event.next
            best = ([n.op for n, _ in stack], state, window)
        if not stack:
            break
        entry, state = stack.pop()
        linearized &= ~(1 << entry.id)
        unlift(entry)
        entry = entry.next
    else:
        return KeyReport(key, len(ops), True, explored=len(seen))
    return KeyReport(key, len(ops), False, best[0], best[1], best[2], explored=len(seen))


def check(ops: Iterable[Operation]) -> Report:
    """Check a whole history, key by key. Failed reads are to be left out by the caller."""
    by_key: dict[str, list[Operation]] = {}
    for op in ops:
        if op.op not in OPS:
            raise ValueError(f"unknown operation {op.op!r}")
        by_key.setdefault(op.key, []).append(op)
    return Report([check_key(k, by_key[k]) for k in sorted(by_key)])


# ---------------------------------------------------------------------- histories on disk
def load_history(paths: Iterable[Path]) -> list[Operation]:
    """Read the JSON-lines files written by the workload's clients (:mod:`.worker`'s
    ``history`` role): an ``invoke`` line before each call, a ``done``, ``info`` (outcome
    unknown) or ``fail`` (read that saw nothing) line after it. An invocation with nothing
    after it (the client was killed) is indeterminate."""
    ops: list[Operation] = []
    for path in paths:
        pending: dict[int, dict[str, Any]] = {}
        for line in Path(path).read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line of a killed client may be cut short
            kind = rec.pop("type")
            if kind == "invoke":
                pending[rec["i"]] = rec
                continue
            inv = pending.pop(rec["i"])
            if kind == "fail" and inv["op"] in ("get", "check"):
                continue
            end = None if kind in ("info", "fail") else rec["t"]
            ops.append(Operation(inv["c"], inv["k"], inv["op"], tuple(inv["a"]), inv["t"], end, rec.get("r")))
        for inv in pending.values():
            if inv["op"] not in ("get", "check"):
                ops.append(Operation(inv["c"], inv["k"], inv["op"], tuple(inv["a"]), inv["t"], None))
    return ops


# ---------------------------------------------------------------------- the workload
@dataclass
class Faults:
    """What :func:`run_workload` does to its clients while they run."""

    #: Reset every client connection through a TCP proxy this often (seconds; 0: never).
    #: Needs a URL with one HOST:PORT; the clients then connect through the proxy.
    reset_every: float = 0.0
    #: Freeze one client (SIGSTOP) this long after the start, past the liveness timeout.
    freeze_at: float | None = None
    #: Kill one other client (SIGKILL) this long after the start, with a call in flight.
    kill_at: float | None = None
    #: Faults of the transport's own, as (seconds after the start, callable): an etcd
    #: server killed and restarted on the same data directory, say.
    events: Sequence[tuple[float, Callable[[], object]]] = ()


def client_ops(
    ch: Any, out: Path, client: int, ops: int, min_seconds: float, keys: int, seed: int, stop: Path | None = None
) -> int:
    """Random single-key operations on ``keys`` keys, every one recorded in ``out`` (JSON
    lines, flushed as they happen, so a killed client's last call is on disk). Runs for
    ``ops`` operations and at least ``min_seconds``, and with ``stop``, on until that file
    exists (the workload's clients together have recorded enough); stops early once the
    channel is broken (its coordinator gone, or this client declared lost and cut off)."""
    import os
    import random
    import time

    from dataparallel.errors import ChannelClosed, ControlError, ControlTimeout, PeerLost

    rng = random.Random(seed)
    names = [f"lin/{i}" for i in range(keys)]
    done, start = 0, time.monotonic()
    failing_since: float | None = None
    with open(out, "w", buffering=1) as log:

        def record(kind: str, **fields: Any) -> None:
            log.write(json.dumps({"type": kind, **fields}) + "\n")

        for i in range(10**9):
            if done >= ops:
                if time.monotonic() - start >= min_seconds and (stop is None or os.path.exists(stop)):
                    break
                time.sleep(0.005)  # enough recorded: stay busy until the faults are done, slowly
            key, roll = rng.choice(names), rng.random()
            unique = str(client * 10**9 + i)  # every written value names its write
            args: list[str | int]
            if roll < 0.25:
                op, args = "set", [unique]
            elif roll < 0.45:
                op, args = "get", []
            elif roll < 0.5:
                op, args = "check", []
            elif roll < 0.75:
                op, args = "add", [rng.randint(1, 3)]
            elif roll < 0.95:
                op, args = "compare_set", [rng.choice(["", unique, str(rng.randint(0, 20))]), unique]
            else:
                op, args = "delete", []
            record("invoke", i=i, c=client, k=key, op=op, a=args, t=time.monotonic())
            try:
                result = _apply(ch, op, key, args)
            except ControlTimeout:
                record("done", i=i, r=None, t=time.monotonic())  # a get that found nothing
            except PeerLost:
                record("fail", i=i)  # a get interrupted by another client's loss: it read nothing
            except ControlError as err:
                record("info", i=i, e=f"{type(err).__name__}: {err}"[:300])
                if isinstance(err, ChannelClosed) and ch.failure is not None:
                    break  # cut off for good
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > 10:
                    break
                continue
            else:
                record("done", i=i, r=result, t=time.monotonic())
            failing_since = None
            done += 1
    return done


def _apply(ch: Any, op: str, key: str, args: list[Any]) -> Any:
    """One call of the workload; the result as the model (:func:`step`) states it."""
    if op == "set":
        return ch.set(key, args[0].encode())
    if op == "get":
        return ch.get(key, timeout=0.1).decode()
    if op == "check":
        return ch.check([key])
    if op == "add":
        return ch.add(key, args[0])
    if op == "compare_set":
        return ch.compare_set(key, args[0].encode(), args[1].encode()).decode()
    return ch.delete(key)


def run_workload(
    url: str,
    workdir: Path,
    *,
    clients: int = 4,
    ops: int = 1000,
    min_seconds: float = 4.0,
    keys: int = 3,
    faults: Faults | None = None,
    options: dict[str, Any] | None = None,
    timeout: float = 120.0,
    rank_urls: Sequence[str] | None = None,
    job: str | None = None,
    min_operations: int = 0,
) -> tuple[Report, list[Operation]]:
    """Run ``clients`` client processes of one job against ``url`` (rank 0, in this process,
    only hosts and watches), inject ``faults``, then check the merged history.
    ``rank_urls``: each rank's own URL instead (rank 0's first), as ranks behind node relays
    have; ``job``: the job's name (default: one of its own). ``min_operations``: the clients
    that are still running go on past ``ops`` each until the run has recorded that many
    operations in all (within ``timeout``): on a loaded machine, clients besides the frozen
    and the killed one may be starved past the liveness timeout and cut off, and the
    history must still not be too short to mean anything."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    import dataparallel as dp

    from .common import with_options
    from .netproxy import proxy_in_front

    faults = faults or Faults()
    full = with_options(url, **(options or {})) if options else url
    job = job or f"lin{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
    if rank_urls is not None and len(rank_urls) != clients + 1:
        raise ValueError(f"{len(rank_urls)} rank URLs for {clients + 1} ranks")
    workdir.mkdir(parents=True, exist_ok=True)
    host = dp.connect(rank_urls[0] if rank_urls else full, rank=0, world_size=clients + 1, job=job, timeout=60)
    proxy, client_url = proxy_in_front(full) if faults.reset_every else (None, full)
    procs: list[subprocess.Popen[str]] = []
    stop = workdir / "enough"
    stop.unlink(missing_ok=True)
    if not min_operations:
        stop.touch()
    try:
        for c in range(clients):
            own = rank_urls[c + 1] if rank_urls else client_url
            cmd = [sys.executable, "-m", "dataparallel.testing.linearizability", "--url", own]
            cmd += ["--rank", str(c + 1), "--world-size", str(clients + 1), "--job", job]
            cmd += ["--out", str(workdir / f"client{c}.jsonl"), "--ops", str(ops)]
            cmd += ["--min-seconds", str(min_seconds), "--keys", str(keys), "--seed", str(c), "--stop", str(stop)]
            # Their output to files: a pipe nobody drains while the run goes on could fill and
            # block a client that logs a lot (under connection resets, say).
            with open(workdir / f"client{c}.err", "w") as err_file:
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, text=True))
        host.rendezvous(timeout=60)

        if proxy is not None:
            proxy.reset_every(faults.reset_every)

        def freeze(proc: subprocess.Popen[str]) -> None:
            proc.send_signal(signal.SIGSTOP)
            time.sleep(host.liveness_timeout + 2)  # declared lost meanwhile
            proc.send_signal(signal.SIGCONT)

        timers = []
        if faults.freeze_at is not None:
            timers.append(threading.Timer(faults.freeze_at, freeze, (procs[0],)))
        if faults.kill_at is not None:
            timers.append(threading.Timer(faults.kill_at, procs[-1].kill))
        timers += [threading.Timer(at, event) for at, event in faults.events]
        for timer in timers:
            timer.daemon = True
            timer.start()
        deadline = time.monotonic() + timeout
        while not stop.exists() and time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if _recorded(workdir) >= min_operations:
                stop.touch()
            else:
                time.sleep(0.2)
        stop.touch()  # the floor reached, or the time is up: the check tells which
        for c, proc in enumerate(procs):
            try:
                # A client told to stop late still closes its channel: some grace past the deadline.
                proc.wait(timeout=max(15.0, deadline + 15.0 - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"a client ran for more than {timeout:g}s; stderr:\n{_tail(workdir, c)}") from None
            if proc.returncode not in (0, -signal.SIGKILL):
                raise RuntimeError(f"a client exited {proc.returncode}; stderr:\n{_tail(workdir, c)}")
        for timer in timers:
            timer.join()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        if proxy is not None:
            proxy.close()
        host.close()
    history = load_history(sorted(workdir.glob("client*.jsonl")))
    return check(history), history


def _tail(workdir: Path, client: int) -> str:
    """The end of client ``client``'s standard error."""
    try:
        return (workdir / f"client{client}.err").read_text(errors="replace")[-2000:]
    except OSError as err:
        return f"(not read: {err})"


def _recorded(workdir: Path) -> int:
    """How many calls the clients in ``workdir`` have completed so far (a lower bound of
    what their history will hold: a call whose outcome is unknown counts there too)."""
    total = 0
    for path in workdir.glob("client*.jsonl"):
        with open(path, "rb") as f:
            total += sum(1 for line in f if line.startswith(b'{"type": "done"') and line.endswith(b"}\n"))
    return total


def main(argv: list[str] | None = None) -> int:
    import argparse

    import dataparallel as dp

    parser = argparse.ArgumentParser(description="One client of the linearizability workload.")
    parser.add_argument("--url", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--min-seconds", type=float, default=0.0)
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", type=Path, default=None, help="after --ops, go on until this file exists")
    args = parser.parse_args(argv)
    from .relayfarm import register_if_farmed

    register_if_farmed()
    ch = dp.connect(args.url, rank=args.rank, world_size=args.world_size, job=args.job, timeout=60)
    try:
        ch.rendezvous(timeout=60)
        client_ops(ch, args.out, args.rank, args.ops, args.min_seconds, args.keys, args.seed, args.stop)
    finally:
        try:
            ch.close()
        except Exception:
            pass  # cut off: the others already know
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
