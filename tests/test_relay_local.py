"""The node relay's local leg (dataparallel/control/relay/local.py): real processes on both
ends, a real other user as the intruder, real kills and freezes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataparallel.control.relay.local import Call, Geometry, LocalClient, LocalServer, SlotsBusy
from dataparallel.errors import (
    AuthError,
    BadMessage,
    ChannelClosed,
    ConfigError,
    ControlError,
    ControlTimeout,
    PeerLost,
)

ECHO, SLOW, FAIL, NEVER, BEAT = 1, 2, 3, 4, 5

RANK = textwrap.dedent(
    """
    import json, sys, time
    from dataparallel.control.relay.local import LocalClient
    path, rank, ops = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    client = LocalClient(path, rank, timeout=10)
    for op, payload in ops:
        if op == "beat":
            client.beat()
            print(json.dumps(["beat", ""]), flush=True)
            continue
        if op == "beating":  # beat every 0.1 s from a thread, as a rank's liveness does
            import threading
            def beat_on():
                while True:
                    client.beat()
                    time.sleep(0.1)
            threading.Thread(target=beat_on, daemon=True).start()
            print(json.dumps(["beating", ""]), flush=True)
            continue
        if op == "fork_holder":  # a child that holds the rank's socket open after the rank dies
            import os
            if os.fork() == 0:
                time.sleep(payload)
                os._exit(0)
            print(json.dumps(["forked", ""]), flush=True)
            continue
        if op == "sleep":
            time.sleep(payload)
            continue
        try:
            if op == "barrier":
                name, timeout = payload
                reply = client.barrier(name, timeout=timeout)
            else:
                reply = client.call(op, payload.encode(), timeout=10)
            print(json.dumps(["ok", reply.decode()]), flush=True)
        except Exception as err:
            print(json.dumps([type(err).__name__, str(err)]), flush=True)
    client.close()
    """
)


def rank_process(path: Path, rank: int, ops: list, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", RANK, str(path), str(rank), json.dumps(ops)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


class Relay:
    """A server whose handler echoes, answers later from a thread, fails, or never answers."""

    def __init__(
        self, directory: Path, ranks: int = 4, geometry: Geometry | None = None, on_barrier=None, may_replace=None
    ) -> None:
        self.gone: list[tuple[int, str, float]] = []
        self.calls: list[Call] = []
        self.server = LocalServer(
            directory, ranks, self.handle, self.on_gone, geometry, on_barrier, may_replace=may_replace
        )

    def handle(self, call: Call) -> None:
        self.calls.append(call)
        if call.op == ECHO:
            call.reply(b"echo:" + call.payload)
        elif call.op == SLOW:
            threading.Timer(float(call.payload), call.reply, args=(b"slow done",)).start()
        elif call.op == FAIL:
            call.fail(PeerLost(5, 1000.0, "its process ended"))
        elif call.op == NEVER:
            pass  # answered by the test, or never
        else:
            raise ValueError(f"unknown op {call.op}")

    def on_gone(self, rank: int, how: str) -> None:
        self.gone.append((rank, how, time.monotonic()))

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def relay(tmp_path):
    r = Relay(tmp_path / "relay")
    yield r
    r.close()


def outputs(proc: subprocess.Popen, timeout: float = 30) -> list[list[str]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines()]


def test_calls_from_another_process_get_their_own_replies(relay):
    ops = [[ECHO, "a"], [ECHO, "x" * 60000], [FAIL, ""], [ECHO, "b"], [99, ""]]
    got = outputs(rank_process(relay.server.path, 2, ops))
    assert got[0] == ["ok", "echo:a"] and got[1] == ["ok", "echo:" + "x" * 60000]
    assert got[2][0] == "PeerLost" and got[2][1].startswith("peer rank 5 lost: its process ended")  # typed
    assert got[3] == ["ok", "echo:b"]
    assert got[4][0] == "ControlError" and "unknown op 99" in got[4][1]  # a handler's bug: an error, not a dead relay
    assert {c.rank for c in relay.calls} == {2}


def test_a_slow_call_does_not_hold_up_another_thread(relay):
    with LocalClient(relay.server.path, 0) as client:
        slow = threading.Thread(target=lambda: client.call(SLOW, b"1.5", timeout=10))
        slow.start()
        time.sleep(0.2)
        start = time.monotonic()
        assert client.call(ECHO, b"fast", timeout=10) == b"echo:fast"
        assert time.monotonic() - start < 1.0  # not behind the slow one's 1.5 s
        slow.join(timeout=10)


def test_more_threads_than_slots_all_get_their_replies(tmp_path):
    relay = Relay(tmp_path / "r", geometry=Geometry(slots=2, slot_bytes=1024))
    try:
        with LocalClient(relay.server.path, 0) as client:
            got: dict[int, bytes] = {}
            threads = [
                threading.Thread(target=lambda i=i: got.__setitem__(i, client.call(ECHO, b"%d" % i, timeout=20)))
                for i in range(16)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert got == {i: b"echo:%d" % i for i in range(16)}
    finally:
        relay.close()


def test_oversized_and_late_calls_fail_typed_and_never_cross(tmp_path):
    relay = Relay(tmp_path / "r", geometry=Geometry(slots=1, slot_bytes=1024))
    try:
        with LocalClient(relay.server.path, 0) as client:
            with pytest.raises(BadMessage, match="1025 bytes"):
                client.call(ECHO, b"x" * 1025, timeout=5)
            start = time.monotonic()
            with pytest.raises(ControlTimeout):
                client.call(NEVER, b"", timeout=0.5)
            assert time.monotonic() - start < 1.5
            # The one slot is still the unanswered call's: the next call waits for it, and the
            # late answer never reads as the next call's. Its timeout is the relay's silence
            # (a NoReply), not its rank's other calls' crowding (SlotsBusy).
            with pytest.raises(ControlTimeout, match="held by calls the node relay has not answered") as info:
                client.call(ECHO, b"next", timeout=0.3)
            assert not isinstance(info.value, SlotsBusy)
            relay.calls[-1].reply(b"late")
            assert client.call(ECHO, b"next", timeout=5) == b"echo:next"
    finally:
        relay.close()


@contextlib.contextmanager
def _one_call_in_flight(tmp_path: Path, slots: int) -> Iterator[LocalClient]:
    """Rank 0 of a relay whose ranks have ``slots`` slots, one of them held by a call in
    flight (its reply not yet due: given, and checked, on the way out)."""
    relay = Relay(tmp_path / "r", geometry=Geometry(slots=slots, slot_bytes=1024))
    try:
        with LocalClient(relay.server.path, 0) as client:
            held: list[bytes] = []
            busy = threading.Thread(target=lambda: held.append(client.call(NEVER, b"", timeout=5.0)))
            busy.start()
            time.sleep(0.2)
            yield client
            relay.calls[0].reply(b"answered")
            busy.join(10)
            assert held == [b"answered"]
    finally:
        relay.close()


def test_a_waiting_call_crowded_out_by_its_ranks_calls_in_flight_says_so(tmp_path):
    """Two slots, one kept free of waiting calls, and one call in flight: a waiting call
    finds no slot it may use and ends with SlotsBusy (nothing sent; the relay's silence is
    not what it says) within what its bound leaves beyond its wait; a call that does not
    wait takes the kept slot at once."""
    with _one_call_in_flight(tmp_path, slots=2) as client:
        start = time.monotonic()
        with pytest.raises(SlotsBusy, match="every slot busy"):
            client.call(ECHO, b"w", timeout=0.5, waiting=0.3)
        assert 0.15 <= time.monotonic() - start < 1.0
        assert client.call(ECHO, b"now", timeout=5) == b"echo:now"


def test_a_call_that_found_no_slot_ends_early_enough_for_the_relays_answer_time(tmp_path):
    """One slot, held by a call in flight: a call given ``answer`` seconds for the relay's
    hop back stops waiting for a slot that long before its deadline (a slot taken later
    would leave the relay too little time, and the call would end past its time: a
    relayed append crowded out by its rank's other calls ended 0.34 s past its timeout)."""
    with _one_call_in_flight(tmp_path, slots=1) as client:
        start = time.monotonic()
        with pytest.raises(SlotsBusy, match="every slot busy"):
            client.call(ECHO, b"w", timeout=1.2, answer=0.5)
        took = time.monotonic() - start
        assert 0.65 <= took < 1.15, took  # 1.2 s: the whole bound, as before


class _StoreGone(ChannelClosed):
    """A transport's own kind of ChannelClosed (as tcpstore's for a call past its bound)."""


def test_a_transports_own_error_reaches_the_rank_as_the_error_it_is_a_kind_of(relay):
    """A call failed with a transport's private subclass of a dataparallel error is raised
    at the rank as that error, with its text (the rank has no such class: it reached the
    rank as a bare ControlError, and a relayed write to a store that did not answer was no
    ChannelClosed)."""
    raised: list[BaseException] = []
    with LocalClient(relay.server.path, 0) as client:
        for n, error in enumerate(
            [_StoreGone("the store did not answer within 2.8s"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")]
        ):
            caller, ended = waiting_call(client)
            deadline = time.monotonic() + 10
            while len(relay.calls) <= n and time.monotonic() < deadline:
                time.sleep(0.01)
            relay.calls[n].fail(error)
            caller.join(10)
            raised += ended
    assert len(raised) == 2 and type(raised[0]) is ChannelClosed, raised
    assert str(raised[0]) == "the store did not answer within 2.8s"
    # An error of no dataparallel kind (but _add's ValueError) is a ControlError naming it.
    assert type(raised[1]) is ControlError and str(raised[1]).startswith("UnicodeDecodeError: "), raised


def test_a_killed_rank_is_noticed_at_once_and_its_slot_freed(relay):
    """By its process's end (a pidfd), not by its socket's: a child of the rank holds the
    socket open after the rank is killed."""
    proc = rank_process(relay.server.path, 1, [[ECHO, "up"], ["fork_holder", 30], ["sleep", 60]])
    assert proc.stdout.readline().strip() == json.dumps(["ok", "echo:up"])
    assert json.loads(proc.stdout.readline())[0] == "forked"
    assert relay.server.members() == {1: proc.pid}
    proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while not relay.gone and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.gone and relay.gone[0][:2] == (1, "its process ended"), relay.gone
    assert relay.gone[0][2] - killed < 0.5
    assert relay.server.members() == {}
    # The local rank can be taken again (a restarted worker).
    assert outputs(rank_process(relay.server.path, 1, [[ECHO, "again"]])) == [["ok", "echo:again"]]


def test_a_frozen_rank_is_seen_by_its_silence(relay):
    """Two ranks beating every 0.1 s; one is frozen: its silence grows, the other's does not."""
    procs = [rank_process(relay.server.path, r, [["beating", ""], ["sleep", 60]]) for r in (0, 1)]
    try:
        for p in procs:
            assert json.loads(p.stdout.readline())[0] == "beating"
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGSTOP)
        time.sleep(1.5)
        frozen, beating = relay.server.silent(0), relay.server.silent(1)
        assert frozen is not None and frozen >= 1.4, frozen
        assert beating is not None and beating < 0.5, beating
        assert relay.gone == []  # frozen is not dead: the relay's liveness judges the silence
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def waiting_call(client: LocalClient) -> tuple[threading.Thread, list[BaseException]]:
    """A call the relay never answers, on a thread of its own; what it ended with goes in the list."""
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.call(NEVER, b"", timeout=30)
        except BaseException as err:
            errors.append(err)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    return t, errors


def test_a_closed_relay_ends_a_waiting_call(tmp_path):
    relay = Relay(tmp_path / "r")
    client = LocalClient(relay.server.path, 0)
    t, errors = waiting_call(client)
    start = time.monotonic()
    relay.close()
    t.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], ChannelClosed), errors
    assert time.monotonic() - start < 2.0
    client.close()


def test_refusals(relay, tmp_path):
    with pytest.raises(ConfigError, match=r"not one of this node's, 0\.\.3"):
        LocalClient(relay.server.path, 4)
    with LocalClient(relay.server.path, 0), LocalClient(relay.server.path, 0) as second:
        assert second.local_rank is None  # its seat held: a guest (test_guests_...)
    with pytest.raises(ChannelClosed, match="no node relay"):
        LocalClient(tmp_path / "nothing.sock", 0, timeout=1)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(ConfigError, match="closed to others"):
        LocalServer(open_dir, 1, lambda call: None)


def test_guests_pass_through_and_take_seats_only_where_free(tmp_path):
    """A process that holds no rank, or whose rank's seat is held by a live process, joins as
    a guest: its calls pass through (the handler sees no rank), it is in no barrier and its
    end is nobody's loss. A seat request gives the lowest free seat, or the one named; a seat
    held by a live process is given only where the relay says its holder may be replaced (it
    was declared lost): the holder is then gone, its calls refused."""
    replaceable: set[int] = set()
    relay = Relay(tmp_path / "relay", ranks=2, may_replace=lambda local, pid: local in replaceable)
    try:
        path = relay.server.path
        holder = LocalClient(path, 0)
        guest = LocalClient(path, 0)  # rank 0's seat is held
        assert (holder.local_rank, guest.local_rank) == (0, None)
        assert guest.call(ECHO, b"g", timeout=5) == b"echo:g" and relay.calls[-1].rank is None
        assert guest.seat(0, timeout=5) is None  # held by a live process
        other = LocalClient(path, None)
        assert other.local_rank is None and other.seat(None, timeout=5) == 1 and other.local_rank == 1
        assert other.seat(None, timeout=5) == 1  # seated already: its own
        assert guest.seat(None, timeout=5) is None  # every seat held
        with LocalClient(path, None) as stray, pytest.raises(ConfigError, match=r"not one of this node's, 0\.\.1"):
            stray.seat(5, timeout=5)
        with LocalClient(path, None) as guest_only, pytest.raises(ConfigError, match="no seat"):
            guest_only.arrive("b", 1.0)
        # The two seated ranks meet; the guest is not waited for.
        outcomes = []
        threads = [threading.Thread(target=lambda c=c: outcomes.append(c.barrier("b", 5))) for c in (holder, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert outcomes == [b"", b""]
        guest.close()
        time.sleep(0.3)
        assert relay.gone == []  # a guest's end is no loss
        late = LocalClient(path, 0)
        replaceable.add(0)
        assert late.seat(0, timeout=5) == 0 and late.local_rank == 0
        deadline = time.monotonic() + 5
        while not relay.gone and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(r, "declared lost" in how) for r, how, _ in relay.gone] == [(0, True)], relay.gone
        with pytest.raises(ChannelClosed):
            holder.call(ECHO, b"x", timeout=5)
        assert late.call(ECHO, b"y", timeout=5) == b"echo:y" and relay.calls[-1].rank == 0
        for c in (holder, other, late):
            c.close()
    finally:
        relay.close()


def test_garbage_at_the_socket_does_not_stop_the_relay(relay):
    import socket

    for junk in [b"", b"\xff" * 10, b"\x05\x00\x00\x00nope!", b"\x02\x00\x00\x00[]", b"\x00\x10\x00\x00" + b"{" * 100]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(relay.server.path))
        s.sendall(junk)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass
        s.close()
    assert outputs(rank_process(relay.server.path, 3, [[ECHO, "still"]])) == [["ok", "echo:still"]]


INTRUDER = textwrap.dedent(
    """
    import json, socket, struct, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sys.argv[1])
    body = json.dumps({"protocol": 1, "rank": 0}).encode()
    fds, said = [], ""
    try:
        s.sendall(struct.pack("<I", len(body)) + body)
    except OSError as err:  # refused before its hello was read
        said = str(err)
    try:
        data, fds, _, _ = socket.recv_fds(s, 4096, 64)
        said += data[4:].decode(errors="replace")
    except OSError as err:
        said += str(err)
    print(json.dumps({"fds": len(fds), "said": said}))
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_is_refused_even_where_the_socket_is_open_to_it(caplog):
    """An intruder of another user (``nobody``, the system's own Python, nothing of ours),
    given a way in (the directory and socket opened to everyone, a misconfiguration), speaking
    the hello correctly: the relay checks the peer's credentials and shares nothing."""
    import pwd
    import shutil
    import tempfile

    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="dp-relay-"))  # under /tmp, which nobody may cross
    base.chmod(0o755)
    relay = Relay(base / "relay")
    try:
        _intrude(relay, nobody)
        refusals = [r.getMessage() for r in caplog.records if "refused a local connection" in r.getMessage()]
        assert len(refusals) == 1 and f"is user {nobody.pw_uid}" in refusals[0], refusals
    finally:
        relay.close()
        shutil.rmtree(base)


def _as_nobody(nobody, script: str, path: Path) -> subprocess.CompletedProcess:
    """``script`` run by the system's own Python as the user ``nobody``, given ``path``."""
    return subprocess.run(
        ["/usr/bin/python3", "-I", "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        cwd="/",
    )


def _intrude(relay: Relay, nobody) -> None:
    os.chmod(relay.server.directory, 0o755)
    os.chmod(relay.server.path, 0o666)
    proc = _as_nobody(nobody, INTRUDER, relay.server.path)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["fds"] == 0, seen
    assert relay.calls == [] and relay.server.members() == {}
    # And with the directory as the relay makes it (0700), nobody cannot even connect.
    os.chmod(relay.server.directory, 0o700)
    proc = _as_nobody(nobody, INTRUDER, relay.server.path)
    assert proc.returncode != 0 and "PermissionError" in proc.stderr, proc.stderr


def test_a_node_barrier_is_one_handler_call_per_generation_in_order(tmp_path):
    seen: list[tuple[int, bytes | None]] = []
    relay_box: list[Relay] = []

    def on_barrier(generation: int, name: bytes | None, timeout: float) -> None:
        seen.append((generation, name))
        # Released later, from another thread: as a relay does after its upstream request.
        threading.Timer(0.01, relay_box[0].server.release, args=(generation, 0, b"out%d" % generation)).start()

    names = ["epoch/0", "x" * 500, "epoch/1"] + [f"b/{i}" for i in range(20)]
    relay = Relay(tmp_path / "relay", ranks=4, on_barrier=on_barrier)
    relay_box.append(relay)
    try:
        procs = [rank_process(relay.server.path, r, [["barrier", [n, 20]] for n in names]) for r in range(4)]
        got = [outputs(p, timeout=60) for p in procs]
    finally:
        relay.close()
    want = [["ok", f"out{g}"] for g in range(1, len(names) + 1)]
    assert got == [want] * 4
    assert [g for g, _ in seen] == list(range(1, len(names) + 1))
    assert seen[0][1] == b"epoch/0" and seen[2][1] == b"epoch/1"
    long = seen[1][1]  # a long name: its head and a digest, the same from every rank
    assert long is not None and long.startswith(b"x" * 200) and b"#" in long and len(long) <= 300


def test_a_node_barrier_wakes_the_relay_once_not_once_per_rank(tmp_path):
    """Each rank takes a token from the node's semaphore; only the one that finds none rings
    the relay. Counted: the relay's looks at its ranks' arrivals (one per wake-up, plus one a
    second while idle), against the barriers: before the tokens, each of the 8 ranks' arrival
    could wake it."""
    relay = Relay(tmp_path / "relay", ranks=8)
    looks = [0]
    arrived = relay.server._arrived

    def counted() -> None:
        looks[0] += 1
        arrived()

    relay.server._arrived = counted  # type: ignore[method-assign]
    rounds = 60
    try:
        procs = [
            rank_process(relay.server.path, r, [["barrier", [f"b/{i}", 20]] for i in range(rounds)]) for r in range(8)
        ]
        start = time.monotonic()
        got = [outputs(p, timeout=120) for p in procs]
        elapsed = time.monotonic() - start
    finally:
        relay.close()
    assert got == [[["ok", ""]] * rounds] * 8
    assert looks[0] <= rounds + elapsed + 8, f"{looks[0]} looks for {rounds} barriers in {elapsed:.1f}s"


def test_ranks_in_different_barriers_are_told_and_an_error_outcome_is_typed(tmp_path):
    from dataparallel.control.relay.local import ERROR, error_bytes

    relay_box: list[Relay] = []

    def on_barrier(generation: int, name: bytes | None, timeout: float) -> None:
        if name is None:
            relay_box[0].server.release(generation, ERROR, error_bytes(BadMessage("ranks named different barriers")))
        elif name == b"lost":
            relay_box[0].server.release(generation, ERROR, error_bytes(PeerLost(9, None, "its process ended")))
        else:
            relay_box[0].server.release(generation)

    relay = Relay(tmp_path / "relay", ranks=3, on_barrier=on_barrier)
    relay_box.append(relay)
    try:
        ops = lambda r: [["barrier", ["same", 20]], ["barrier", [f"mine{r % 2}", 20]], ["barrier", ["lost", 20]]]  # noqa: E731
        procs = [rank_process(relay.server.path, r, ops(r)) for r in range(3)]
        got = [outputs(p, timeout=60) for p in procs]
    finally:
        relay.close()
    for out in got:
        assert out[0] == ["ok", ""]
        assert out[1] == ["BadMessage", "ranks named different barriers"]
        assert out[2][0] == "PeerLost" and out[2][1].startswith("peer rank 9 lost: its process ended; never seen")


def test_a_node_barrier_missing_a_rank_times_out_and_the_next_one_is_the_next_generation(tmp_path):
    relay = Relay(tmp_path / "relay", ranks=2)
    try:
        late = [["sleep", 1.5], ["barrier", ["first", 20]], ["barrier", ["second", 20]]]
        procs = [
            rank_process(relay.server.path, 0, [["barrier", ["first", 0.5]], ["barrier", ["second", 20]]]),
            rank_process(relay.server.path, 1, late),
        ]
        start = time.monotonic()
        first = outputs(procs[0], timeout=60)
        second = outputs(procs[1], timeout=60)
    finally:
        relay.close()
    assert first[0][0] == "ControlTimeout" and "node barrier 'first'" in first[0][1]
    # Rank 0 had arrived at "first" before it gave up: the late rank completes it, and both meet at "second".
    assert first[1] == ["ok", ""] and second == [["ok", ""], ["ok", ""]]
    assert time.monotonic() - start < 30


def test_a_client_that_hangs_up_or_says_nothing_holds_up_no_one(relay):
    import socket

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(str(relay.server.path))  # connects, says nothing, stays
    for _ in range(5):  # connect and hang up at once, before the relay can answer
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(relay.server.path))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        s.close()
    try:
        start = time.monotonic()
        assert outputs(rank_process(relay.server.path, 0, [[ECHO, "through"]])) == [["ok", "echo:through"]]
        assert time.monotonic() - start < 4.0  # not behind the silent one's 5 s for a hello
        silent.settimeout(10)
        said = silent.recv(4096)  # dropped once its time for a hello is out
        assert b"no hello within" in said, said
    finally:
        silent.close()


def test_closing_a_client_ends_its_calls_in_flight(relay):
    client = LocalClient(relay.server.path, 0)
    t, errors = waiting_call(client)
    client.close()
    t.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], ChannelClosed), errors
    with pytest.raises(ChannelClosed):
        client.call(ECHO, b"after", timeout=5)


def test_closing_a_client_waits_for_a_use_that_does_not_notice_no_longer_than_its_timeout(relay, caplog):
    """A thread using the client's descriptors between waits (it sees the close only at its
    next one) holds close() back at most close's own timeout (a relayed channel's close
    passes what is left of its own); the descriptors are then left open, not closed under it."""
    client = LocalClient(relay.server.path, 0)
    inside, leave = threading.Event(), threading.Event()

    def busy() -> None:
        with client._using:
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    assert inside.wait(5)
    start = time.monotonic()
    client.close(timeout=0.3)
    took = time.monotonic() - start
    leave.set()
    t.join(timeout=5)
    assert 0.25 <= took < 1.5, f"close(timeout=0.3) took {took:.2f}s"
    assert "still in flight at close" in caplog.text
    os.fstat(client._doorbell)  # left open for the use that had not ended


def test_a_long_name_of_many_bytes_per_character_crosses_whole(tmp_path):
    seen: list[bytes | None] = []

    def on_barrier(generation: int, name: bytes | None, timeout: float) -> None:
        seen.append(name)
        relay.server.release(generation)

    relay = Relay(tmp_path / "relay", ranks=2, on_barrier=on_barrier)
    try:
        name = "épreuve-" * 60  # 2 bytes for each é: a cut must fall between characters
        procs = [rank_process(relay.server.path, r, [["barrier", [name, 20]]]) for r in (0, 1)]
        assert [outputs(p) for p in procs] == [[["ok", ""]]] * 2
    finally:
        relay.close()
    (got,) = seen
    assert got is not None and got.decode().startswith("épreuve-") and b"#" in got


INTRUDER_RELAY = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sys.argv[1])
    s.listen(4)
    print("listening", flush=True)
    s.settimeout(20)
    conn, _ = s.accept()
    conn.settimeout(5)
    try:
        got = conn.recv(4096)
    except OSError:
        got = b""
    print("heard" if got else "nothing", flush=True)
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_relay_of_another_user_is_refused_before_anything_is_sent(tmp_path):
    """Another user (``nobody``) puts a socket where a rank looks for its relay: the rank
    checks who serves it and says nothing to it."""
    import pwd
    import shutil
    import tempfile

    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="dp-fake-relay-"))
    base.chmod(0o777)
    try:
        path = base / "relay.sock"
        fake = subprocess.Popen(
            ["/usr/bin/python3", "-I", "-c", INTRUDER_RELAY, str(path)],
            stdout=subprocess.PIPE,
            text=True,
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            cwd="/",
        )
        assert fake.stdout.readline().strip() == "listening"
        with pytest.raises(AuthError, match=f"is user {nobody.pw_uid}, not this user"):
            LocalClient(path, 0, timeout=10)
        assert fake.stdout.readline().strip() == "nothing"
        fake.wait(timeout=20)
    finally:
        shutil.rmtree(base)


def test_every_generation_is_named_alike_by_every_rank(tmp_path):
    """8 ranks through 1,500 barriers whose names alternate between a long and a short one:
    the relay never reads a rank's new generation with its previous barrier's name (a rank
    that wrote its generation and name in one copy was read half-written about once in 400)."""
    mismatched: list[int] = []

    def on_barrier(generation: int, name: bytes | None, timeout: float) -> None:
        if name is None:
            mismatched.append(generation)
        relay.server.release(generation)

    relay = Relay(tmp_path / "relay", ranks=8, on_barrier=on_barrier)
    try:
        names = ["x" if i % 2 else f"a-much-longer-barrier-name-{i}" for i in range(1500)]
        ops = [["barrier", [name, 60]] for name in names]
        procs = [rank_process(relay.server.path, r, ops) for r in range(8)]
        for p in procs:
            assert all(line == ["ok", ""] for line in outputs(p, timeout=120))
    finally:
        relay.close()
    assert mismatched == []


def test_a_socket_path_too_long_is_a_config_error_and_leaks_nothing(tmp_path):
    """A Unix socket's path holds 108 bytes: a relay directory deeper than that is refused,
    typed, naming the fix, with none of the relay's descriptors left open."""
    deep = tmp_path / ("d" * 100)

    def node_areas() -> int:  # the relay's own memfd (other threads of the process open eventfds)
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:dp-relay-node")
            except OSError:
                pass
        return count

    before = node_areas()
    with pytest.raises(ConfigError, match="choose a shorter directory"):
        LocalServer(deep, 1, lambda call: call.reply(b""))
    assert node_areas() == before


def test_a_relay_starting_leaves_the_modes_of_files_made_meanwhile_alone(tmp_path):
    """A relay binds its socket without touching the process's umask (the process's, not the
    thread's: a directory another thread made meanwhile came out 0600 instead of 0700): its
    socket is 0600 all the same, and directories made while relays start keep their mode."""
    import stat
    import tempfile
    import threading

    stop, modes = threading.Event(), []

    def make_directories() -> None:
        while not stop.is_set():
            made = Path(tempfile.mkdtemp(dir=tmp_path))
            modes.append(stat.S_IMODE(made.stat().st_mode))
            made.rmdir()

    maker = threading.Thread(target=make_directories, daemon=True)
    maker.start()
    try:
        for i in range(300):
            server = LocalServer(tmp_path / f"r{i}", 1, lambda call: call.reply(b""))
            try:
                assert stat.S_IMODE(server.path.stat().st_mode) == 0o600
            finally:
                server.close()
    finally:
        stop.set()
        maker.join(timeout=10)
    assert modes and set(modes) == {0o700}, sorted(set(modes))
