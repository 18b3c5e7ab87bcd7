"""The conformance suite every channel passes: built-ins and users' own alike.

Subclass :class:`ChannelConformance` in a test module and provide a ``channel_url``
fixture that returns the URL of a fresh, isolated coordinator for each test::

    from dataparallel.testing import ChannelConformance, free_port

    class TestMyChannel(ChannelConformance):
        @pytest.fixture
        def channel_url(self):
            return f"mine://127.0.0.1:{free_port()}"

Set ``cross_process = False`` for a transport whose ranks can only be threads of one
process (``memory://``): the tests that need separate processes then run their
in-process equivalent (gloo on threads; a frozen heartbeat for a frozen process; concurrent
``add`` and ``compare_set`` from threads only, where they otherwise race from several
processes, several threads in each).
Every test is bounded in time; a hang is a failure, never a stuck run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import importlib
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeVar, cast
from urllib.parse import urlsplit

import pytest

import dataparallel as dp
from dataparallel.control.registry import locate, resolve

from . import relayfarm
from .common import count_multi_gets, held_rank, with_options
from .netproxy import proxy_in_front

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Store

T = TypeVar("T")

#: Seconds any single helper waits before declaring the transport hung.
STEP_TIMEOUT = 60.0
#: Liveness options of the tests that lose peers: losses noticed in seconds.
FAST_LIVENESS = {"heartbeat": 0.2, "liveness_timeout": 2}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]  # (host, port) for AF_INET
        return port


def timeout_slack(timeout: float) -> float:
    """How far past its timeout a blocking call may return: 0.5 s or a tenth of it, whichever
    is larger (docs/howto/channel.md, "Timeouts")."""
    return max(0.5, timeout / 10)


class Timed(NamedTuple):
    """How long a call took (wall-clock seconds), what it raised, and how much of that time
    after its deadline its thread spent runnable but waiting for a CPU, as the kernel counts
    it: a bound on a call is checked net of it (a loaded machine can keep a thread off every CPU for a
    second; no code returns while it is not run). For a call that returned past its bound,
    the most any one thread of its process spent so (the thread holding the GIL, or the
    one to wake it, off every CPU: the call's own thread waits for it without being
    runnable), where that is more. Waiting for a thread that runs is not excused."""

    took: float
    err: BaseException | None
    starved: float = 0.0

    def __str__(self) -> str:
        return f"{self.took:.2f}s, {self.starved:.2f}s of it waiting for a CPU ({self.err!r})"


def _referrers(obj: object) -> str:
    """What refers to ``obj``: each referrer's type, a frame's function by name (a failure's
    clue to what keeps an object alive)."""
    asking = {id(sys._getframe()), id(sys._getframe(1))}  # this look and its caller's
    names = [
        f"frame of {ref.f_code.co_name}" if isinstance(ref, types.FrameType) else type(ref).__name__
        for ref in gc.get_referrers(obj)
        if id(ref) not in asking
    ]
    return ", ".join(sorted(names)) or "nothing gc tracks"


def _waited_for_cpu(thread: int) -> float:
    """Seconds thread ``thread`` (a native id of this process's) has spent runnable but not
    running (the second field of Linux's ``/proc/self/task/TID/schedstat``); 0 where the
    kernel does not say."""
    try:
        with open(f"/proc/self/task/{thread}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _threads_waited_for_cpu() -> dict[int, float]:
    """:func:`_waited_for_cpu` of every thread of this process."""
    try:
        threads = [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return {}
    return {thread: _waited_for_cpu(thread) for thread in threads}


def _most_waited_for_cpu(since: dict[int, float]) -> float:
    """The most seconds one of the threads in ``since`` (its figure then) has waited for a
    CPU since; a thread that ended meanwhile counts nothing."""
    now = _threads_waited_for_cpu()
    return max((now[t] - before for t, before in since.items() if t in now), default=0.0)


def run_all(
    fns: Sequence[Callable[[], T]], timeout: float = STEP_TIMEOUT, pool: ThreadPoolExecutor | None = None
) -> list[T]:
    """Run callables concurrently on threads (new ones, or ``pool``'s, which has as many
    idle as there are calls); return their results, re-raise the first error.
    Calls still running when an error (a timeout, pytest-timeout's alarm) is raised are not
    waited for: they may be waiting on what the caller's clean-up ends (a frozen server it
    resumes, a channel it closes)."""
    own = pool is None
    runner = ThreadPoolExecutor(max_workers=max(len(fns), 1)) if pool is None else pool
    try:
        futures = [runner.submit(fn) for fn in fns]
        return [f.result(timeout=timeout) for f in futures]
    finally:
        if own:
            runner.shutdown(wait=False, cancel_futures=True)


def close_all(channels: Sequence[dp.ControlChannel]) -> None:
    """Close channels, the one hosting the coordinator (if any) last."""
    for ch in sorted(channels, key=lambda c: (c.hosts_coordinator, -(c.rank or 0))):
        ch.close()


class OpenRanks(Protocol):
    """The ``open_ranks`` fixture: ``open_ranks(n, job=..., url=..., token=..., timeout=...)``
    connects ranks 0..n-1 of ``job`` and returns their channels, in rank order."""

    def __call__(
        self,
        n: int,
        job: str = "conformance",
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float | None = 30.0,
    ) -> list[dp.ControlChannel]: ...


class ChannelHarness:
    """Fixtures and helpers shared by the conformance mixins."""

    cross_process: ClassVar[bool] = True

    @pytest.fixture
    def channel_url(self) -> str:  # pragma: no cover - always overridden
        raise NotImplementedError("subclass ChannelConformance and define a channel_url fixture")

    @pytest.fixture
    def open_ranks(self, channel_url: str) -> Iterator[OpenRanks]:
        """``open_ranks(n, job=..., url=..., token=..., timeout=...)`` connects ranks 0..n-1
        concurrently (rank 0 may host the coordinator) and closes them after the test."""
        opened: list[dp.ControlChannel] = []

        def factory(
            n: int,
            job: str = "conformance",
            url: str | None = None,
            *,
            token: str | None = None,
            timeout: float | None = 30.0,
        ) -> list[dp.ControlChannel]:
            target = url or channel_url
            channels = run_all(
                [
                    partial(dp.connect, target, rank=r, world_size=n, job=job, token=token, timeout=timeout)
                    for r in range(n)
                ]
            )
            opened.extend(channels)
            return channels

        yield factory
        close_all(opened)

    @staticmethod
    def rendezvous_all(channels: Sequence[dp.ControlChannel]) -> None:
        run_all([partial(c.rendezvous, timeout=STEP_TIMEOUT) for c in channels])

    def spawn_rank(
        self,
        role: str,
        url: str,
        rank: int | None,
        world_size: int,
        job: str,
        *extra: str,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        """Start one rank in its own process (``dataparallel.testing.worker``); ``rank=None``:
        assigned at connect. ``env``: the process's whole environment (default: this one's)."""
        cmd = [sys.executable, "-m", "dataparallel.testing.worker", role, "--url", url]
        cmd += [] if rank is None else ["--rank", str(rank)]
        cmd += ["--world-size", str(world_size), "--job", job, *extra]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    @staticmethod
    def read_ready(proc: subprocess.Popen[str], timeout: float = STEP_TIMEOUT) -> None:
        """Wait for a worker's ``{"ready": rank}`` line (it has joined the rendezvous)."""
        box: list[str] = []
        stdout = proc.stdout
        if stdout is None:
            raise ValueError("read_ready reads the worker's stdout: start it with stdout=PIPE (as spawn_rank does)")
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or "ready" not in box[0]:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"worker did not become ready within {timeout}s; stderr:\n{err[-3000:]}")


class PrimitiveTests(ChannelHarness):
    """set / get / add / compare_set / delete / check / num_keys / wait / close."""

    #: Where ranks are processes, the concurrent add and compare_set tests run their
    #: contenders in this many processes, with this many threads in each.
    CONTENDING_PROCESSES: ClassVar[int] = 3
    CONTENDING_THREADS: ClassVar[int] = 4

    def _contend_in_processes(
        self, role: str, channel_url: str, key: str, rounds: int
    ) -> tuple[list[dict[str, Any]], bytes]:
        """Rank 0 here; ranks 1.. each a worker process running ``role`` on
        :attr:`CONTENDING_THREADS` threads, all released at one instant once every worker is
        at the start line (set and get only, so a broken add cannot hang it). Returns the
        workers' results and the value of ``key`` once they are done."""
        from .worker import GO_KEY, READY_KEY

        n = self.CONTENDING_PROCESSES + 1
        job = f"contend-{role}"
        host = dp.connect(channel_url, rank=0, world_size=n, job=job, timeout=30)
        procs: list[subprocess.Popen[str]] = []
        try:
            extra = ["--threads", str(self.CONTENDING_THREADS), "--rounds", str(rounds), "--key", key]
            procs = [self.spawn_rank(role, channel_url, r, n, job, *extra, "--timeout", "30") for r in range(1, n)]
            ready = [READY_KEY.format(rank=r) for r in range(1, n)]
            deadline = time.monotonic() + STEP_TIMEOUT
            while not host.check(ready):
                for proc in procs:
                    if proc.poll() is not None:
                        _finish(proc, 10)  # fails, with its stderr
                if time.monotonic() > deadline:
                    pytest.fail(f"the {role} workers did not reach the start line within {STEP_TIMEOUT:g}s")
                time.sleep(0.02)
            host.set(GO_KEY, repr(time.time() + 0.3).encode())
            results = [_finish(proc, max(deadline - time.monotonic(), 1.0)) for proc in procs]
            return results, host.get(key, timeout=5) if host.check([key]) else b""
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate(timeout=10)
            host.close()

    def test_set_then_get_returns_the_exact_bytes(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        for key, value in [
            ("k", b"v"),
            ("0//cpu//0/3", b"\x00\xff" * 64),
            ("ключ/ü", b""),
            ("big", os.urandom(1 << 20)),
        ]:
            a.set(key, value)
            assert b.get(key, timeout=5) == value

    def test_set_overwrites(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1)
        a.set("k", b"one")
        a.set("k", b"two")
        assert a.get("k", timeout=5) == b"two"

    def test_get_blocks_until_another_rank_sets(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        released = threading.Event()

        def reader() -> bytes:
            value = b.get("late", timeout=20)
            released.set()
            return value

        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(reader)
            assert not released.wait(0.5), "get returned before the key was set"
            a.set("late", b"here")
            assert future.result(timeout=10) == b"here"

    def test_get_timeout_raises_control_timeout_in_time(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1)
        start = time.monotonic()
        with pytest.raises(dp.ControlTimeout) as info:
            a.get("never", timeout=0.5)
        elapsed = time.monotonic() - start
        assert 0.45 <= elapsed <= 0.5 + timeout_slack(0.5), elapsed
        assert "never" in str(info.value) and info.value.waited >= 0.45

    def test_default_timeout_applies_when_none_given(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1, timeout=0.5)
        start = time.monotonic()
        with pytest.raises(dp.ControlTimeout):
            a.get("never")
        assert time.monotonic() - start <= 0.5 + timeout_slack(0.5)

    def test_add_creates_counts_and_reads_back_as_decimal(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        assert a.add("n", 5) == 5
        assert b.add("n", -2) == 3
        assert a.add("n", 0) == 3
        assert b.get("n", timeout=5) == b"3"

    def test_concurrent_adds_give_an_exact_count(self, open_ranks: OpenRanks, channel_url: str) -> None:
        """Every add returns a distinct value and none is lost, with the contenders in
        several processes (several threads in each) where ranks are processes: a transport
        atomic only within a process (a ``threading.Lock``) fails here, not later as a hang."""
        from .worker import count_adds

        per_thread = 50
        if self.cross_process:
            results, final = self._contend_in_processes("adds", channel_url, "hits", per_thread)
            values = [v for res in results for thread in res["values"] for v in thread]
            where = f"processes ({len(results)} processes x {self.CONTENDING_THREADS} threads)"
        else:
            channels = open_ranks(4)
            threads_per_rank = 3
            values = [
                v
                for r in run_all([partial(count_adds, c, "hits", per_thread) for c in channels] * threads_per_rank)
                for v in r
            ]
            final = channels[0].get("hits", timeout=5)
            where = f"threads ({len(channels)} ranks x {threads_per_rank} threads)"
        _check_adds(values, final, where)

    def test_add_to_a_value_that_is_no_number_is_bad_message(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        a.set("text", b"not a number")
        with pytest.raises(dp.BadMessage, match="text"):
            b.add("text", 1)
        assert a.get("text", timeout=5) == b"not a number", "a refused add must change nothing"
        assert b.add("n", 2) == 2, "the channel must stay usable"

    def test_add_releases_a_waiting_get(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(b.get, "counter", 20)
            time.sleep(0.2)
            a.add("counter", 7)
            assert future.result(timeout=10) == b"7"

    def test_compare_set_follows_tcpstore_semantics(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1)
        assert a.compare_set("cs", b"x", b"y") == b"x"  # missing key, expected given: nothing created
        assert not a.check(["cs"])
        assert a.compare_set("cs", b"", b"first") == b"first"  # missing key matches b""
        assert a.compare_set("cs", b"wrong", b"second") == b"first"
        assert a.compare_set("cs", b"first", b"second") == b"second"
        assert a.get("cs", timeout=5) == b"second"

    def test_concurrent_compare_set_has_one_winner(self, open_ranks: OpenRanks, channel_url: str) -> None:
        """In each of several rounds, contenders race to claim a fresh key with
        ``compare_set(key, b"", me)``: exactly one wins and every one gets the winner's value
        back. Contenders are in several processes (several threads in each) where ranks are
        processes."""
        from .worker import claim_rounds, contender_name

        rounds = 20
        if self.cross_process:
            results, _ = self._contend_in_processes("compare-set", channel_url, "claim/", rounds)
            contenders = [c for res in results for c in res["contenders"]]
            where = f"processes ({len(results)} processes x {self.CONTENDING_THREADS} threads)"
        else:
            channels = open_ranks(4)
            threads_per_rank = 3

            def work(ch: dp.ControlChannel, thread: int) -> dict[str, Any]:
                me = contender_name(ch.rank, thread)
                return {"contender": me, "got": claim_rounds(ch, "claim/", me, rounds)}

            contenders = run_all([partial(work, c, t) for c in channels for t in range(threads_per_rank)])
            where = f"threads ({len(channels)} ranks x {threads_per_rank} threads)"
        _check_claims(contenders, "claim/", rounds, where)

    def test_compare_set_many_applies_each_on_its_own_in_order(self, open_ranks: OpenRanks) -> None:
        """The ``_compare_set_many`` hook (what a node relay sends its ranks' concurrent
        compare_sets through) returns what each compare_set, applied one after the other,
        would: a failed one does not stop the next, and a later item sees an earlier one's
        write; a get waiting for one of its keys is released."""
        a, b = open_ranks(2)
        key = a._scoped
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(b.get, "many/3", 20)
            time.sleep(0.2)
            items = [("many/1", b"", b"a"), ("many/1", b"", b"b"), ("many/2", b"x", b"y"), ("many/1", b"a", b"c")]
            items.append(("many/3", b"", b"z"))
            got = a._compare_set_many([(key(k), e, d) for k, e, d in items])
            assert got == [b"a", b"a", b"x", b"c", b"z"]
            assert waiting.result(timeout=10) == b"z"
        assert b.get("many/1", timeout=5) == b"c" and not b.check(["many/2"])

    def test_delete_many_deletes_each_and_counts_those_that_existed(self, open_ranks: OpenRanks) -> None:
        """The ``_delete_many`` hook (the gathers' clean-up of a round's keys) deletes every
        key it is given, each on its own: a missing one does not stop the others, a key given
        twice counts once."""
        a, b = open_ranks(2)
        a.multi_set(["gone/1", "gone/2", "kept"], [b"x", b"y", b"z"])
        key = a._scoped
        assert a._delete_many([key("gone/1"), key("gone/none"), key("gone/2"), key("gone/1")]) == 2
        assert not b.check(["gone/1"]) and not b.check(["gone/2"]) and b.get("kept", timeout=5) == b"z"
        assert b.add("gone/1", 1) == 1  # missing to every call, as after a delete

    def test_compare_set_releases_a_waiting_get(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(b.get, "cas", 20)
            time.sleep(0.2)
            a.compare_set("cas", b"", b"won")
            assert future.result(timeout=10) == b"won"

    def test_a_key_given_twice_to_multi_set_holds_its_last_value(self, open_ranks: OpenRanks) -> None:
        """Items are applied in order: a key given twice ends with its last value, and a rank
        waiting for that key reads that value, never the one the same write overwrote."""
        a, b = open_ranks(2, job="twice")
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(b.get("twice", timeout=STEP_TIMEOUT)), daemon=True)
        waiter.start()
        time.sleep(0.3)  # parked on the missing key where the transport parks gets
        a.multi_set(["twice", "other", "twice"], [b"first", b"x", b"last"])
        waiter.join(STEP_TIMEOUT + 5)
        assert got == [b"last"]
        assert a.multi_get(["twice", "other"], timeout=5) == [b"last", b"x"]

    def test_multi_set_and_multi_get_keep_the_order_of_keys(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        a.multi_set(["m/2", "m/1", "m/3"], [b"two", b"one", b""])
        assert b.multi_get(["m/1", "m/2", "m/3", "m/1"], timeout=5) == [b"one", b"two", b"", b"one"]
        assert b.multi_get([], timeout=5) == []
        with pytest.raises(TypeError):
            a.multi_set(["x", "y"], [b"1"])
        not_bytes: Any = ["text"]  # the wrong type on purpose: refused at run time
        with pytest.raises(TypeError):
            a.multi_set(["x"], not_bytes)

    def test_multi_get_blocks_until_every_key_exists(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        a.set("mg/0", b"0")
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(b.multi_get, ["mg/0", "mg/1", "mg/2"], 20)
            time.sleep(0.3)
            a.set("mg/2", b"2")  # not in order: the first missing key is not the last one set
            time.sleep(0.3)
            assert not future.done(), "multi_get returned before every key existed"
            a.set("mg/1", b"1")
            assert future.result(timeout=10) == [b"0", b"1", b"2"]
        start = time.monotonic()
        with pytest.raises(dp.ControlTimeout) as info:
            b.multi_get(["mg/0", "never"], timeout=0.5)
        assert 0.45 <= time.monotonic() - start <= 0.5 + timeout_slack(0.5)
        assert info.value.waited >= 0.45

    def test_concurrent_appends_lose_nothing(self, open_ranks: OpenRanks) -> None:
        # Equal bytes from every rank: an append that took another rank's write for its own
        # (by comparing bytes) would lose one.
        channels = open_ranks(3)
        rounds = 10

        def body(ch: dp.ControlChannel) -> None:
            for i in range(rounds):
                ch.append("same", b"x")
                ch.append("tagged", f"{ch.rank}:{i};".encode())

        run_all([partial(body, c) for c in channels])
        assert channels[1].get("same", timeout=5) == b"x" * (rounds * len(channels))
        parts = channels[2].get("tagged", timeout=5).decode().split(";")[:-1]
        assert sorted(parts) == sorted(f"{r}:{i}" for r in range(len(channels)) for i in range(rounds))
        for r in range(len(channels)):  # each rank's appends land in its order
            assert [p for p in parts if p.startswith(f"{r}:")] == [f"{r}:{i}" for i in range(rounds)]
        channels[0].delete("same")
        channels[0].append("same", b"new")  # a deleted key starts again from empty
        assert channels[1].get("same", timeout=5) == b"new"

    def test_reserved_keys_cannot_be_written(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        forged = json.dumps({"rank": 1, "last_seen": 0, "reason": "forged", "by": 0}).encode()
        attempts: list[Callable[[], object]] = [
            lambda: a.set("__dp/lost", forged),
            lambda: a.add("__dp/next_rank", 1),
            lambda: a.compare_set("__dp/token", b"", b"x"),
            lambda: a.delete("__dp/claim/1"),
            lambda: a.multi_set(["fine", "__dp/lost"], [b"1", forged]),
            lambda: a.append("__dp/lost", forged),
        ]
        for attempt in attempts:
            with pytest.raises(dp.ConfigError, match="reserved"):
                attempt()
        assert not a.check(["fine"]), "a refused multi_set must write nothing"
        assert a.check(["__dp/claim/1"]), "reading reserved keys stays allowed"
        run_all([partial(c.barrier, "unforged", timeout=STEP_TIMEOUT) for c in (a, b)])
        assert a.lost_peers() == {} and b.lost_peers() == {}

    def test_delete_reports_whether_the_key_existed(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        a.set("gone", b"1")
        assert b.delete("gone") is True
        assert a.delete("gone") is False
        assert not a.check(["gone"])
        with pytest.raises(dp.ControlTimeout):
            a.get("gone", timeout=0.2)

    def test_check_is_true_only_when_all_keys_exist(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1)
        assert a.check([])
        a.set("x", b"1")
        assert a.check(["x"])
        assert not a.check(["x", "y"])
        a.set("y", b"2")
        assert a.check(["x", "y"])

    def test_num_keys_counts_new_keys(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1)
        before = a.num_keys()
        for i in range(5):
            a.set(f"nk/{i}", b"v")
        a.set("nk/0", b"again")  # overwriting adds nothing
        assert a.num_keys() == before + 5
        a.delete("nk/4")
        assert a.num_keys() == before + 4

    def test_wait_returns_when_all_keys_exist_and_times_out_otherwise(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(b.wait, ["w1", "w2"], 20)
            a.set("w1", b"1")
            time.sleep(0.2)
            assert not future.done()
            a.set("w2", b"2")
            future.result(timeout=10)
        start = time.monotonic()
        with pytest.raises(dp.ControlTimeout) as info:
            b.wait(["w1", "missing"], timeout=0.5)
        assert time.monotonic() - start <= 0.5 + timeout_slack(0.5)
        assert "missing" in str(info.value)

    def test_bad_arguments_raise_type_error(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1)
        # Arguments of the wrong types on purpose: the channel must refuse them at run time.
        not_bytes: Any = "a str, not bytes"
        not_a_str: Any = b"bytes-key"
        not_an_int: Any = 1.5
        with pytest.raises(TypeError):
            a.set("k", not_bytes)
        with pytest.raises(TypeError):
            a.set(not_a_str, b"v")
        with pytest.raises(TypeError):
            a.add("k", not_an_int)
        with pytest.raises(dp.ConfigError):
            a.get("k", timeout=0)

    def test_closed_channel_raises_channel_closed(self, channel_url: str) -> None:
        ch = dp.connect(channel_url, rank=0, world_size=1, job="closing", timeout=10)
        ch.set("k", b"v")
        ch.close()
        ch.close()  # idempotent
        for call in (lambda: ch.set("k", b"v"), lambda: ch.get("k", 1), lambda: ch.add("n", 1), lambda: ch.barrier()):
            with pytest.raises(dp.ChannelClosed):
                call()

    @pytest.mark.timeout(120)
    def test_only_control_errors_escape_when_the_coordinator_goes(
        self, open_ranks: OpenRanks, channel_url: str
    ) -> None:
        """Rank 0 leaves (and with it the coordinator, where it hosts one): every call of the
        remaining rank either works or raises a ControlError, never a library's own error."""
        # A short timeout: a hosting rank's close waits that long (at most) for the others.
        a, b = open_ranks(2, url=with_options(channel_url, **FAST_LIVENESS), timeout=3)
        b.set("k", b"v")
        a.close()
        calls: dict[str, Callable[[], object]] = {
            "set": lambda: b.set("k", b"w"),
            "get": lambda: b.get("k", timeout=1),
            "get missing": lambda: b.get("missing", timeout=1),
            "add": lambda: b.add("n", 1),
            "compare_set": lambda: b.compare_set("k", b"w", b"x"),
            "delete": lambda: b.delete("k"),
            "check": lambda: b.check(["k"]),
            "num_keys": lambda: b.num_keys(),
            "multi_get": lambda: b.multi_get(["k"], timeout=1),
            "multi_set": lambda: b.multi_set(["m"], [b"1"]),
            "append": lambda: b.append("log", b"x"),
            "barrier": lambda: b.barrier("alone", timeout=1),
            "store get": lambda: b.as_store().get("k"),
        }
        b.as_store().set_timeout(timedelta(seconds=1))
        for name, call in calls.items():
            try:
                call()
            except dp.ControlError:
                pass
            except Exception as err:  # torch's Store raises DistStoreError (its contract), nothing else
                import torch.distributed as dist

                if not (name.startswith("store") and isinstance(err, dist.DistStoreError)):
                    raise AssertionError(f"{name}: {type(err).__module__}.{type(err).__name__} escaped: {err}") from err
        b.close()

    def test_closing_from_many_threads_at_once_closes_once(self, open_ranks: OpenRanks) -> None:
        a, b = open_ranks(2)
        calls: list[int] = []
        release = b._close

        def close_counted() -> None:
            calls.append(1)
            release()

        # Set on the instance, in front of the class's method: mypy refuses a plain assignment to a method.
        setattr(b, "_close", close_counted)  # noqa: B010
        run_all([b.close] * 8)
        assert calls == [1], f"the transport's _close ran {len(calls)} times"
        a.set("still", b"open")
        assert a.get("still", timeout=5) == b"open"

    def test_context_manager_closes(self, channel_url: str) -> None:
        with dp.connect(channel_url, rank=0, world_size=1, job="ctx", timeout=10) as ch:
            ch.set("k", b"v")
        with pytest.raises(dp.ChannelClosed):
            ch.get("k", 1)


class MembershipTests(ChannelHarness):
    """Rank assignment, rendezvous, token agreement, job isolation."""

    def test_rank_none_assigns_distinct_ranks(self, channel_url: str) -> None:
        n = 4
        channels = run_all([lambda: dp.connect(channel_url, world_size=n, job="auto", timeout=30) for _ in range(n)])
        try:
            assert sorted(held_rank(c) for c in channels) == list(range(n))
            self.rendezvous_all(channels)
        finally:
            close_all(channels)

    def test_full_job_and_taken_rank_are_refused_naming_a_live_holder(
        self, open_ranks: OpenRanks, channel_url: str
    ) -> None:
        """A rank held by a live process is refused, and the message says the holder is alive;
        in bounded time (a transport may wait out the liveness timeout to be sure)."""
        url = with_options(channel_url, **FAST_LIVENESS)
        open_ranks(2, job="full", url=url)
        bound = FAST_LIVENESS["liveness_timeout"] + 2 * FAST_LIVENESS["heartbeat"] + 2.0 + 3.0
        for rank, refusal in ((1, "already taken"), (None, "full")):
            start = time.monotonic()
            with pytest.raises(dp.ControlError, match=f"{refusal}.*alive") as info:
                dp.connect(url, rank=rank, world_size=2, job="full", timeout=30)
            assert time.monotonic() - start < bound, f"refused after {time.monotonic() - start:.1f}s: {info.value}"

    @pytest.mark.timeout(60)
    def test_a_rank_that_left_a_run_going_on_is_not_taken_again(self, channel_url: str, open_ranks: OpenRanks) -> None:
        """A rank whose process closed its channel while the run goes on cannot be claimed
        again in that run: a connect asking for it is refused saying so, at once (well before
        its timeout: waiting cannot help), not after waiting out its timeout as if the holder
        might still give it up."""
        n, url = 3, with_options(channel_url, **FAST_LIVENESS)
        channels = open_ranks(n, job="rejoin", url=url, timeout=30)
        self.rendezvous_all(channels)
        channels[1].close()
        start = time.monotonic()
        with pytest.raises(dp.ControlError, match="a rank cannot rejoin"):
            dp.connect(url, rank=1, world_size=n, job="rejoin", timeout=20)
        assert time.monotonic() - start < 10, f"refused after {time.monotonic() - start:.1f}s"

    @pytest.mark.timeout(90)
    def test_a_run_goes_on_when_the_rank_that_started_it_leaves(self, channel_url: str) -> None:
        """Rank 1 connects first (on a transport whose runs start at a connect, it starts this
        one), then leaves while ranks 0 and 2 go on: the run is still theirs. A connect asking
        for rank 1 is refused (a rank cannot rejoin), not let into a new run that wipes what
        the others wrote, and they lose no key and no peer."""
        n, url, job = 3, with_options(channel_url, **FAST_LIVENESS), "opener"
        channels: list[dp.ControlChannel] = []
        with ThreadPoolExecutor(n) as pool:
            connect = partial(dp.connect, url, world_size=n, job=job, timeout=30)
            first = pool.submit(connect, rank=1)
            # Where rank 0 hosts the coordinator, rank 1 waits for it: waiting longer proves nothing.
            concurrent.futures.wait([first], timeout=3.0)
            others = [pool.submit(connect, rank=r) for r in (0, 2)]
            failures: list[BaseException] = []
            for future in (others[0], first, others[1]):
                try:
                    channels.append(future.result(timeout=60))
                except Exception as err:
                    failures.append(err)
        try:
            if failures:
                raise failures[0]
            assert [held_rank(c) for c in channels] == [0, 1, 2]
            self.rendezvous_all(channels)
            run_all([partial(c.set, f"kept/{c.rank}", b"written") for c in channels])
            channels[1].close()
            time.sleep(FAST_LIVENESS["liveness_timeout"] + 1.0)  # past the lease or session of the rank that left
            with pytest.raises(dp.ControlError, match="a rank cannot rejoin"):
                dp.connect(url, rank=1, world_size=n, job=job, timeout=20)
            for ch in (channels[0], channels[2]):
                assert ch.check([f"kept/{r}" for r in range(n)]), f"rank {ch.rank} lost the run's keys"
                assert ch.lost_peers() == {}, f"rank {ch.rank} saw a loss: {ch.lost_peers()}"
            run_all([partial(ch.add, "still", 1) for ch in (channels[0], channels[2])])
            assert channels[0].get("still", timeout=5) == b"2"
        finally:
            close_all(channels)

    @pytest.mark.timeout(60)
    def test_a_channel_that_holds_no_rank_keeps_its_run(self, channel_url: str) -> None:
        """A channel that never joins as a rank (a torchrun agent's, an elastic job's join
        queue: ``rank=None``, the token agreed, no ``dp.connect``) keeps the job's run as a
        rank does: what it wrote is there for one that comes more than a liveness timeout
        later, in the same run, not wiped by a new one."""
        url, cls = resolve(with_options(channel_url, **FAST_LIVENESS))
        first = cls(url, rank=None, world_size=1, job="norank", timeout=30)
        try:
            first.agree_on_token()
            first.set("state", b"kept")
            time.sleep(FAST_LIVENESS["liveness_timeout"] + 2.0)
            second = cls(url, rank=None, world_size=1, job="norank", timeout=30)
            try:
                second.agree_on_token()
                assert second.check(["state"]), "the first channel's key is gone"
                assert second.get("state", timeout=5) == b"kept"
                assert first.get("state", timeout=5) == b"kept"
            finally:
                second.close()
        finally:
            first.close()

    @pytest.mark.timeout(90)
    def test_ranks_assigned_at_connect_write_nothing_to_stderr(
        self, channel_url: str, capfd: pytest.CaptureFixture[str]
    ) -> None:
        """A rank with ``rank=None`` that finds the coordinator hosted already (the expected
        case: one process wins the bind) says nothing of it: nothing from the transport's
        libraries reaches the terminal of a job that works."""
        n, job = 3, "quiet"
        # Logging its libraries were asked for (GRPC_VERBOSITY=debug, TORCH_CPP_LOG_LEVEL=INFO,
        # ...) is wanted output, not the unasked-for kind this test is about.
        asked = ("GRPC_VERBOSITY", "GRPC_TRACE", "TORCH_CPP_LOG_LEVEL", "TORCH_DISTRIBUTED_DEBUG", "NCCL_DEBUG")
        quiet = {k: v for k, v in os.environ.items() if k not in asked}
        host = dp.connect(channel_url, rank=0, world_size=n, job=job, timeout=30)
        try:
            if self.cross_process:
                procs = [
                    self.spawn_rank("barriers", channel_url, None, n, job, "--rounds", "1", env=quiet)
                    for _ in range(n - 1)
                ]
                try:
                    host.rendezvous(timeout=STEP_TIMEOUT)
                    host.barrier("rounds", timeout=STEP_TIMEOUT)
                    outcomes = [proc.communicate(timeout=STEP_TIMEOUT) for proc in procs]
                finally:
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
                            proc.communicate(timeout=10)
                for proc, (_, err) in zip(procs, outcomes, strict=True):
                    assert proc.returncode == 0, f"a rank exited {proc.returncode}:\n{err}"
                    assert err == "", f"a rank assigned at connect wrote to stderr:\n{err}"
            else:
                capfd.readouterr()
                others = run_all([partial(dp.connect, channel_url, world_size=n, job=job, timeout=30)] * (n - 1))
                try:
                    self.rendezvous_all([host, *others])
                    run_all([partial(c.barrier, "rounds", timeout=STEP_TIMEOUT) for c in [host, *others]])
                finally:
                    close_all(others)
                err = capfd.readouterr().err
                assert err == "", f"a rank assigned at connect wrote to stderr:\n{err}"
        finally:
            host.close()

    @pytest.mark.timeout(60)
    def test_a_connect_that_waits_says_what_it_waits_for(
        self, channel_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """While a connect waits for a coordinator (or etcd, or a store) that is not there, it
        says so every few seconds with check's diagnosis, then fails at its timeout. A URL
        with no network endpoint has nothing to wait for: it connects without a word."""
        monkeypatch.setattr(importlib.import_module("dataparallel.connect"), "NOTICE_EVERY", 1.0)
        port = free_port()
        nowhere, swapped = _at_port(channel_url, port)
        caplog.set_level("WARNING", logger="dataparallel.connect")
        if not swapped:
            with dp.connect(nowhere, rank=1, world_size=2, job="wait", timeout=10):
                time.sleep(1.5)
            assert not [r for r in caplog.records if "still connecting" in r.getMessage()]
            return
        start = time.monotonic()
        with pytest.raises(dp.ControlError):
            dp.connect(nowhere, rank=1, world_size=2, job="wait", timeout=4)
        assert time.monotonic() - start <= 4 + timeout_slack(4), "the connect outlived its timeout"
        # Stopped and joined as the connect ended: no notice can come after.
        assert not [t for t in threading.enumerate() if t.name == "dp-connect-notice"], "the notice thread lives on"
        notices = [r.getMessage() for r in caplog.records if "still connecting" in r.getMessage()]
        assert notices, "nothing said while waiting"
        assert f":{port}" in notices[0] and "nothing listening" in notices[0], notices[0]
        assert "dataparallel check" in notices[0], notices[0]
        time.sleep(1.5)
        later = [r for r in caplog.records if "still connecting" in r.getMessage()]
        assert len(later) == len(notices), "notices went on after the connect ended"

    def test_rank_and_world_size_are_validated(self, channel_url: str) -> None:
        for connect in (
            partial(dp.connect, rank=2, world_size=2),
            partial(dp.connect, rank=-1, world_size=2),
            partial(dp.connect, world_size=0),
        ):
            with pytest.raises(dp.ConfigError):
                connect(channel_url, job="bad", timeout=5)

    def test_unknown_url_option_is_refused_with_the_allowed_ones(self, channel_url: str) -> None:
        with pytest.raises(dp.ConfigError, match="liveness_timeout"):
            dp.connect(with_options(channel_url, bogus=1), rank=0, world_size=1, timeout=5)

    def test_wrong_token_gets_auth_error_in_seconds_whatever_the_timeout(
        self, open_ranks: OpenRanks, channel_url: str
    ) -> None:
        open_ranks(1, job="secret", token="right")
        for token in ("wrong", None):
            start = time.monotonic()
            with pytest.raises(dp.AuthError):
                dp.connect(channel_url, world_size=2, job="secret", token=token, timeout=300)
            assert time.monotonic() - start < 10, f"token {token!r}: refused after {time.monotonic() - start:.1f}s"

    def test_rendezvous_waits_for_every_rank(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(3)
        done = threading.Event()

        def arrive(ch: dp.ControlChannel) -> None:
            ch.rendezvous(timeout=20)
            done.set()

        with ThreadPoolExecutor(2) as pool:
            early = [pool.submit(arrive, c) for c in channels[:2]]
            assert not done.wait(0.5), "rendezvous returned before every rank arrived"
            channels[2].rendezvous(timeout=20)
            for f in early:
                f.result(timeout=10)
        info = channels[0].peer_info(2)
        assert info is not None and info["pid"] == os.getpid(), info

    def test_rendezvous_times_out_naming_the_missing_count(self, open_ranks: OpenRanks) -> None:
        a, _b = open_ranks(2)
        with pytest.raises(dp.ControlTimeout, match="1/2"):
            a.rendezvous(timeout=0.5)

    def test_jobs_are_isolated(self, open_ranks: OpenRanks, channel_url: str) -> None:
        (a,) = open_ranks(1, job="job-a")
        (b,) = open_ranks(1, job="job-b")
        a.set("same", b"from a")
        b.set("same", b"from b")
        assert a.get("same", timeout=5) == b"from a"
        assert b.get("same", timeout=5) == b"from b"
        assert a.add("n", 1) == 1 and b.add("n", 1) == 1
        b.delete("same")
        assert a.get("same", timeout=5) == b"from a"


class CollectiveTests(ChannelHarness):
    """barrier, broadcast, gather, all_gather: semantics, reuse, cleanup."""

    def test_barrier_holds_until_the_last_rank_arrives(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(4)
        released = threading.Event()

        def arrive(ch: dp.ControlChannel) -> None:
            ch.barrier("b", timeout=20)
            released.set()

        with ThreadPoolExecutor(3) as pool:
            early = [pool.submit(arrive, c) for c in channels[:3]]
            assert not released.wait(0.5), "barrier released before every rank arrived"
            channels[3].barrier("b", timeout=20)
            for f in early:
                f.result(timeout=10)

    def test_barrier_is_reusable_for_many_rounds(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(4)
        rounds = 40
        progress = [0] * len(channels)

        def body(ch: dp.ControlChannel) -> None:
            rank = held_rank(ch)
            for r in range(rounds):
                progress[rank] = r + 1
                ch.barrier("loop", timeout=20)
                # Nobody may be a round behind once the barrier has released us.
                assert min(progress) >= r + 1, (ch.rank, r, list(progress))

        run_all([partial(body, c) for c in channels], timeout=120)

    def test_rounds_of_one_name_back_to_back_with_a_slow_rank(self, open_ranks: OpenRanks) -> None:
        """A name reused at once while a different rank lags in each round: each round's
        barrier, all_gather and broadcast see that round's values, never a neighbour's."""
        channels = open_ranks(4)

        def body(ch: dp.ControlChannel) -> list[list[bytes] | bytes]:
            got: list[list[bytes] | bytes] = []
            for r in range(6):
                if ch.rank == r % 4:
                    time.sleep(0.05)
                ch.barrier("again", timeout=20)
                got.append(ch.all_gather("again", f"{r}:{ch.rank}".encode(), timeout=20))
                got.append(ch.broadcast("again", f"b{r}".encode() if ch.rank == r % 4 else None, src=r % 4, timeout=20))
            return got

        results = run_all([partial(body, c) for c in channels], timeout=120)
        expected: list[list[bytes] | bytes] = []
        for r in range(6):
            expected += [[f"{r}:{rank}".encode() for rank in range(4)], f"b{r}".encode()]
        assert results == [expected] * 4

    def test_many_ranks_meet_in_every_collective(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(12)

        def body(ch: dp.ControlChannel) -> tuple[list[bytes], list[bytes] | None]:
            for _ in range(3):
                ch.barrier("crowd", timeout=60)
            mine = str(ch.rank).encode()
            return ch.all_gather("crowd", mine, timeout=60), ch.gather("crowd", mine, dst=11, timeout=60)

        results = run_all([partial(body, c) for c in channels], timeout=120)
        values = [str(r).encode() for r in range(12)]
        assert all(r[0] == values for r in results)
        assert [r[1] for r in results] == [None] * 11 + [values]

    def test_barrier_timeout_says_how_many_arrived(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(3)
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(channels[1].barrier, "partial", 3.0)
            with pytest.raises(dp.ControlTimeout, match="2/3 ranks had arrived"):
                channels[0].barrier("partial", timeout=0.8)
            with pytest.raises(dp.ControlTimeout):
                other.result(timeout=10)

    def test_broadcast_from_any_source_for_many_rounds(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(3)

        def body(ch: dp.ControlChannel) -> list[bytes]:
            got = []
            for r in range(10):
                src = r % 3
                value = f"round {r} from {src}".encode() if ch.rank == src else None
                got.append(ch.broadcast("cmd", value, src=src, timeout=20))
            return got

        results = run_all([partial(body, c) for c in channels])
        expected = [f"round {r} from {r % 3}".encode() for r in range(10)]
        assert results == [expected] * 3

    def test_gather_and_all_gather_index_by_rank(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(3)

        def body(ch: dp.ControlChannel) -> tuple[list[bytes] | None, list[bytes]]:
            mine = f"v{ch.rank}".encode()
            return ch.gather("g", mine, dst=1, timeout=20), ch.all_gather("ag", mine, timeout=20)

        results = run_all([partial(body, c) for c in channels])
        values = [b"v0", b"v1", b"v2"]
        assert [r[0] for r in results] == [None, values, None]
        assert all(r[1] == values for r in results)

    def test_collectives_clean_up_their_keys(self, open_ranks: OpenRanks) -> None:
        channels = open_ranks(3)

        def body(ch: dp.ControlChannel) -> None:
            for _ in range(5):
                ch.barrier("clean", timeout=20)
                ch.broadcast("clean", b"x" if ch.rank == 0 else None, timeout=20)
                ch.all_gather("clean", b"y", timeout=20)
                ch.gather("clean", b"z", timeout=20)
            ch.barrier("settle", timeout=20)

        # Counted where the state is held: keys, and a coordinator's open collectives too.
        holder = next((c for c in channels if c.hosts_coordinator), channels[0])
        run_all([partial(body, c) for c in channels])
        start = holder._held_state()
        run_all([partial(body, c) for c in channels])
        assert holder._held_state() == start, "repeated collectives must not grow the job's state"

    @pytest.mark.timeout(120)
    def test_a_rank_that_closed_without_entering_a_collective_ends_it_at_once(self, open_ranks: OpenRanks) -> None:
        """A rank that closes its channel (it ended early, or skipped a collective) fails
        every collective round it never entered, for every rank waiting in it or entering
        it later, with PeerLeft naming it, within a slice of the wait; never at the timeout.
        The channel itself goes on. (Each collective in its own job, all at once.)"""
        waits: dict[str, Callable[[dp.ControlChannel], object]] = {
            "rendezvous": lambda c: c.rendezvous(timeout=STEP_TIMEOUT),
            "barrier": lambda c: c.barrier("end", timeout=STEP_TIMEOUT),
            "broadcast": lambda c: c.broadcast("end", src=2, timeout=STEP_TIMEOUT),
            "all_gather": lambda c: c.all_gather("end", b"v", timeout=STEP_TIMEOUT),
            "gather": lambda c: c.gather("end", b"v", dst=0, timeout=STEP_TIMEOUT),  # only rank 0 waits
        }
        cases = [(name, first) for name in waits for first in (False, True)]
        jobs = run_all([partial(open_ranks, 3, job=f"left-{n}-{f}") for n, f in cases])

        def case(name: str, closes_first: bool, channels: list[dp.ControlChannel]) -> None:
            if name != "rendezvous":  # one earlier round everyone entered: not a miss
                self.rendezvous_all(channels)
            with ThreadPoolExecutor(2) as pool:
                # The pool's threads make their calls first outside the timed part: a transport
                # may open a connection per thread (tcpstore), slow on its own (torch's reverse
                # DNS lookup stalls its server up to 5 s), which is no part of noticing a leave.
                started = threading.Barrier(2)
                warm = [
                    pool.submit(lambda: ([c.check(["warm"]) for c in channels[:2]], started.wait(STEP_TIMEOUT)))
                    for _ in range(2)
                ]
                for warming in warm:
                    warming.result(timeout=STEP_TIMEOUT)
                channels[2].check(["warm"])  # and this thread, which closes it
                if closes_first:
                    channels[2].close()
                    closed = time.monotonic()
                futures = [pool.submit(waits[name], c) for c in channels[:2]]
                if not closes_first:
                    time.sleep(0.3)  # they wait in it
                    closed = time.monotonic()
                    channels[2].close()
                if name == "gather":
                    assert futures.pop().result(timeout=STEP_TIMEOUT) is None
                for future in futures:
                    with pytest.raises(dp.PeerLeft) as info:
                        future.result(timeout=STEP_TIMEOUT)
                    elapsed = time.monotonic() - closed
                    err = info.value
                    assert err.rank == 2 and isinstance(err, dp.PeerLost), str(err)
                    assert "closed its channel without entering" in str(err), str(err)
                    # A slice to notice, and room for one slow new connection (tcpstore: torch's
                    # reverse DNS lookup, up to 5 s): far below the timeout this rules out.
                    bound = 2 * channels[0].liveness_poll + 5.0
                    assert elapsed < bound, f"{name}: PeerLeft after {elapsed:.1f}s (bound {bound:g}s)"
            channels[0].set("after", b"1")
            assert channels[1].get("after", timeout=5) == b"1"

        run_all([partial(case, n, f, j) for (n, f), j in zip(cases, jobs, strict=True)], timeout=100)

    @pytest.mark.timeout(60)
    def test_a_rank_that_closed_after_its_part_does_not_end_a_collective(self, open_ranks: OpenRanks) -> None:
        """What a closed rank did before it closed counts: its broadcast value and its gather
        value are delivered to ranks that enter later, and the rounds it entered stay done."""
        channels = open_ranks(3, job="left-done")
        self.rendezvous_all(channels)
        run_all([partial(c.barrier, "b", timeout=STEP_TIMEOUT) for c in channels])
        channels[2].broadcast("cmd", b"last words", src=2)
        channels[2].gather("g", b"v2", dst=0)
        channels[2].close()
        time.sleep(channels[0].liveness_poll + 0.5)  # the departure is seen by now

        def late(ch: dp.ControlChannel) -> tuple[bytes, list[bytes] | None]:
            got = ch.broadcast("cmd", src=2, timeout=STEP_TIMEOUT)
            return got, ch.gather("g", f"v{ch.rank}".encode(), dst=0, timeout=STEP_TIMEOUT)

        results = run_all([partial(late, c) for c in channels[:2]])
        assert results == [(b"last words", [b"v0", b"v1", b"v2"]), (b"last words", None)]
        with pytest.raises(dp.PeerLeft, match="barrier 'b' round 1"):
            run_all([partial(c.barrier, "b", timeout=STEP_TIMEOUT) for c in channels[:2]])

    def test_bad_source_rank_is_refused(self, open_ranks: OpenRanks) -> None:
        (a,) = open_ranks(1)
        with pytest.raises(ValueError):
            a.broadcast("x", b"v", src=5)
        with pytest.raises(TypeError):
            a.broadcast("x", None, src=0)


class LivenessTests(ChannelHarness):
    """A dead or frozen peer becomes PeerLost for everyone waiting; a clean exit does not."""

    LIVENESS = FAST_LIVENESS

    def _detect_bound(self, channel: dp.ControlChannel) -> float:
        return self.LIVENESS["liveness_timeout"] + 4 * self.LIVENESS["heartbeat"] + channel.liveness_poll + 2.0

    def _expect_peer_lost(
        self, waiters: Sequence[dp.ControlChannel], lost_rank: int, since: float, bound: float | None = None
    ) -> None:
        def wait(ch: dp.ControlChannel) -> dp.PeerLost:
            with pytest.raises(dp.PeerLost) as info:
                ch.barrier("after-loss", timeout=STEP_TIMEOUT)
            return info.value

        errors = run_all([partial(wait, c) for c in waiters])
        elapsed = time.monotonic() - since
        for err in errors:
            assert err.rank == lost_rank, str(err)
            assert "barrier 'after-loss'" in str(err)
        bound = self._detect_bound(waiters[0]) if bound is None else bound
        assert elapsed < bound, f"PeerLost took {elapsed:.1f}s (bound {bound:g}s)"

    def _kill_or_freeze(
        self,
        channel_url: str,
        sig: int,
        rendezvous: bool,
        liveness: dict[str, float] | None = None,
        bound: float | None = None,
    ) -> None:
        url = with_options(channel_url, **(liveness or self.LIVENESS))
        n, victim = 3, 2
        job = f"live{sig}{'r' if rendezvous else 'c'}"
        # Ranks 0..n-2 in this process, the victim in its own. Without ``rendezvous`` the victim
        # is stopped right after ``connect`` returned: it is watched from that moment on.
        extra = ["--hold", "120"] if rendezvous else ["--hold", "120", "--no-rendezvous"]
        proc = self.spawn_rank("hold", url, victim, n, job, *extra)
        try:
            channels = run_all(
                [partial(dp.connect, url, rank=r, world_size=n, job=job, timeout=30) for r in range(n - 1)]
            )
            try:
                if rendezvous:
                    self.rendezvous_all(channels)
                self.read_ready(proc)
                os.kill(proc.pid, sig)
                since = time.monotonic()
                self._expect_peer_lost(channels, victim, since, bound)
                lost = channels[0].lost_peers().get(victim)
                assert lost is not None, f"rank {victim} is not among rank 0's lost peers"
                # Every transport names the lost process, as the coordinator's sessions, the
                # heartbeats' peer records and the relay's supervision all can.
                assert f"pid {proc.pid}" in str(lost), f"the loss does not name the process: {lost}"
            finally:
                close_all(channels)
        finally:
            if sig == signal.SIGSTOP:
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate(timeout=10)

    def _stop_in_process(self, open_ranks: OpenRanks, channel_url: str, rendezvous: bool) -> None:
        # Ranks are threads: the in-process equivalent of SIGKILL or SIGSTOP is a rank whose
        # liveness stops without announcing a departure.
        channels = open_ranks(3, job=f"frozen{rendezvous}", url=with_options(channel_url, **self.LIVENESS))
        if rendezvous:
            self.rendezvous_all(channels)
        _stop_liveness(channels[2])
        self._expect_peer_lost(channels[:2], 2, time.monotonic())

    @pytest.mark.timeout(120)
    def test_peer_killed_before_rendezvous_is_reported_as_peer_lost(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        if not self.cross_process:
            self._stop_in_process(open_ranks, channel_url, rendezvous=False)
            return
        self._kill_or_freeze(channel_url, signal.SIGKILL, rendezvous=False)

    @pytest.mark.timeout(120)
    def test_killed_peer_is_reported_as_peer_lost(self, channel_url: str, open_ranks: OpenRanks) -> None:
        if not self.cross_process:
            self._stop_in_process(open_ranks, channel_url, rendezvous=True)
            return
        self._kill_or_freeze(channel_url, signal.SIGKILL, rendezvous=True)

    @pytest.mark.timeout(120)
    def test_a_killed_peer_is_noticed_as_soon_as_the_transport_promises(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        """A peer killed on this machine, with a liveness timeout of 3 s: a transport that
        ``notices_exits`` reports it within a second (its connections closed when it died);
        any other within the liveness timeout's bound."""
        liveness = {"heartbeat": 0.3, "liveness_timeout": 3}
        if not self.cross_process:
            self._stop_in_process(open_ranks, channel_url, rendezvous=True)
            return
        transport = locate(channel_url)[1]
        slowest = liveness["liveness_timeout"] + 4 * liveness["heartbeat"] + transport.liveness_poll + 2.0
        bound = 1.0 if transport.notices_exits else slowest
        self._kill_or_freeze(channel_url, signal.SIGKILL, rendezvous=True, liveness=liveness, bound=bound)

    @pytest.mark.timeout(120)
    def test_frozen_peer_is_reported_as_peer_lost(self, channel_url: str, open_ranks: OpenRanks) -> None:
        if not self.cross_process:
            self._stop_in_process(open_ranks, channel_url, rendezvous=True)
            return
        self._kill_or_freeze(channel_url, signal.SIGSTOP, rendezvous=True)

    @pytest.mark.timeout(120)
    def test_a_frozen_rank_0_holds_no_call_of_another_rank_past_the_liveness_bound(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        """Rank 0 frozen (SIGSTOP) with the others mid-job. Where it hosts the coordinator the
        others' calls fail with ChannelClosed once it has been silent for the liveness
        timeout; where it does not, it is a lost peer. Either way a write, a read of a key
        nobody writes and a barrier, each with a long timeout, are all answered within the
        liveness bound, and the two that need rank 0 fail with a ControlError."""
        if not self.cross_process:
            channels = open_ranks(3, job="frozen0", url=with_options(channel_url, **self.LIVENESS))
            self.rendezvous_all(channels)
            _stop_liveness(channels[0])
            self._expect_peer_lost(channels[1:], 0, time.monotonic())
            return
        url = with_options(channel_url, **self.LIVENESS)
        n, job = 3, "frozen0"
        proc = self.spawn_rank("hold", url, 0, n, job, "--hold", "120")
        outcomes: dict[int, list[tuple[str, float, BaseException | None]]] = {}

        def calls(ch: dp.ControlChannel, since: float) -> None:
            steps: list[tuple[str, Callable[[], object]]] = [
                ("add", lambda: ch.add("frozen0/n", 1)),
                ("get", lambda: ch.get("frozen0/never", timeout=STEP_TIMEOUT)),
                ("barrier", lambda: ch.barrier("frozen0/b", timeout=STEP_TIMEOUT)),
            ]
            mine = outcomes.setdefault(held_rank(ch), [])
            for name, call in steps:
                try:
                    call()
                    mine.append((name, time.monotonic() - since, None))
                except dp.ControlError as err:
                    mine.append((name, time.monotonic() - since, err))

        try:
            channels = run_all([partial(dp.connect, url, rank=r, world_size=n, job=job, timeout=30) for r in (1, 2)])
            try:
                self.rendezvous_all(channels)
                self.read_ready(proc)
                os.kill(proc.pid, signal.SIGSTOP)
                since = time.monotonic()
                bound = self._detect_bound(channels[0])
                threads = [threading.Thread(target=calls, args=(c, since), daemon=True) for c in channels]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(max(0.0, since + bound + 5 - time.monotonic()))
                hung = {
                    held_rank(c): outcomes.get(held_rank(c), [])
                    for c, t in zip(channels, threads, strict=True)
                    if t.is_alive()
                }
                assert not hung, f"calls still blocked {bound + 5:g}s after rank 0 froze (done so far: {hung})"
            finally:
                os.kill(proc.pid, signal.SIGCONT)
                close_all(channels)
        finally:
            proc.kill()
            proc.communicate(timeout=10)
        for rank, done in outcomes.items():
            for name, elapsed, err in done:
                assert elapsed < bound, f"rank {rank}'s {name} took {elapsed:.1f}s (bound {bound:g}s): {err!r}"
            failed = {name: err for name, _, err in done}
            assert isinstance(failed["get"], (dp.PeerLost, dp.ChannelClosed)), f"rank {rank}: {done}"
            assert isinstance(failed["barrier"], (dp.PeerLost, dp.ChannelClosed)), f"rank {rank}: {done}"

    @pytest.mark.timeout(180)
    def test_a_rank_frozen_in_the_middle_of_its_writes_blocks_no_one(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        """A rank frozen at whatever point of a write it had reached (holding a lock, half
        through a transaction) does not stop the others' writes to the same key, where the
        transport ``survives_frozen_writers``; where it does not, their writes raise
        ControlTimeout within their timeout (plus the slack), never hang. Either way, once it
        resumes no write is lost or doubled: the counter is the sum of every successful add."""
        key, freezes = "busy/n", 20
        if not self.cross_process:  # ranks are threads: nothing to freeze, but the adds still race
            channels = open_ranks(3, job="busy")
            self.rendezvous_all(channels)
            done = run_all([partial(lambda c: [c.add(key, 1) for _ in range(200)], c) for c in channels])
            assert channels[0].get(key, timeout=STEP_TIMEOUT) == str(sum(len(d) for d in done)).encode()
            return
        n, job, timeout = 3, "busy", 3.0
        proc = self.spawn_rank("busy-adds", channel_url, 2, n, job, "--key", key, "--hold", "150")
        free = locate(channel_url)[1].survives_frozen_writers
        # A free add takes milliseconds: 5 s is far past it. A blocked one has its timeout.
        wait = 5.0 if free else timeout + timeout_slack(timeout)
        mine, timed_out = 0, 0
        try:
            channels = run_all(
                [partial(dp.connect, channel_url, rank=r, world_size=n, job=job, timeout=timeout) for r in range(n - 1)]
            )
            try:
                self.rendezvous_all(channels)
                self.read_ready(proc)
                rng = random.Random(0)
                for attempt in range(freezes):
                    time.sleep(rng.uniform(0.01, 0.1))  # a different point of its loop each time
                    os.kill(proc.pid, signal.SIGSTOP)
                    try:
                        box: list[BaseException | None] = []
                        adder = threading.Thread(target=_add_into, args=(channels[attempt % 2], key, box), daemon=True)
                        adder.start()
                        adder.join(wait)
                        assert box, f"freeze {attempt + 1}: an add waited {wait:g}s behind the frozen rank"
                        if box[0] is None:
                            mine += 1
                        elif free or not isinstance(box[0], dp.ControlTimeout):
                            raise AssertionError(f"freeze {attempt + 1}: the others' add failed") from box[0]
                        else:
                            timed_out += 1
                    finally:
                        os.kill(proc.pid, signal.SIGCONT)
                    if timed_out and box and box[0] is not None:
                        # The frozen rank blocked the others' heartbeats too: let a few land, or
                        # freezes back to back would add up to a lost coordinator.
                        time.sleep(3 * channels[0].heartbeat_interval)
                channels[0].set(f"{key}/stop", b"1")
                result = _finish(proc, STEP_TIMEOUT)
                total = channels[0].get(key, timeout=STEP_TIMEOUT)
            finally:
                close_all(channels)
        finally:
            _resume_and_kill(proc)
        assert result["adds"] > 0, result
        assert total == str(mine + result["adds"]).encode(), (
            f"the counter is {total!r}; the frozen rank made {result['adds']} adds and the others {mine} "
            f"({timed_out} timed out)"
        )

    @pytest.mark.timeout(120)
    def test_a_rank_declared_lost_is_cut_off_when_it_resumes(self, channel_url: str, open_ranks: OpenRanks) -> None:
        """A rank frozen past the liveness timeout, then resumed, must not carry on as if
        nothing happened. A transport that ``fences_lost_members`` refuses its writes from
        the moment the others were told (none lands after); one that does not cuts it off
        once it notices, within a liveness tick of resuming."""
        if not self.cross_process:
            channels = open_ranks(3, job="fence", url=with_options(channel_url, **self.LIVENESS))
            self.rendezvous_all(channels)
            _stop_liveness(channels[2])
            self._expect_peer_lost(channels[:2], 2, time.monotonic())
            if channels[2].fences_lost_members:
                with pytest.raises(dp.ChannelClosed, match="declared lost"):
                    channels[2].set("after", b"1")
            return
        url = with_options(channel_url, **self.LIVENESS)
        n, victim, job = 3, 2, "fence"
        proc = self.spawn_rank("write", url, victim, n, job, "--hold", "90")
        try:
            channels = run_all(
                [partial(dp.connect, url, rank=r, world_size=n, job=job, timeout=30) for r in range(n - 1)]
            )
            try:
                self.rendezvous_all(channels)
                self.read_ready(proc)
                time.sleep(0.3)  # a few writes land while it is a member
                os.kill(proc.pid, signal.SIGSTOP)
                self._expect_peer_lost(channels, victim, time.monotonic())
                # What the others read once told: with fencing, no later write of its lands.
                # (Read here, not judged by the writer's clock: a write sent before the freeze
                # may be acknowledged after the resume, and that is no write after the loss.)
                # (The job lost a rank, so the public get says PeerLost: the hook reads.)
                fences = channels[0].fences_lost_members
                written = channels[0]._scoped(f"writer/{victim}")  # where the public set wrote it
                at_told = channels[0]._get(written, STEP_TIMEOUT) if fences else None
                os.kill(proc.pid, signal.SIGCONT)
                resumed = time.monotonic()
                result = _finish(proc, STEP_TIMEOUT)
                at_end = channels[0]._get(written, STEP_TIMEOUT) if fences else None
            finally:
                close_all(channels)
        finally:
            _resume_and_kill(proc)
        assert result["error"] == "ChannelClosed", result
        assert "declared lost" in result["message"], result["message"]
        assert result["last_write"] is not None, "no write landed before the freeze"
        if fences:
            assert at_end == at_told, (
                f"a write landed after the others were told the rank was lost: {at_told!r}, then {at_end!r}"
            )
        else:
            assert result["failed_at"] - resumed < self._detect_bound(channels[0]), result

    @pytest.mark.timeout(120)
    def test_ranks_joining_together_are_never_reported_lost(self, channel_url: str) -> None:
        """Ranks that connect at the same moment watch each other from the start: none may
        take another's half-finished join for a loss."""
        url = with_options(channel_url, **self.LIVENESS)
        n = 4
        rng = random.Random(0)

        def join(rank: int, job: str, delay: float) -> dp.ControlChannel:
            time.sleep(delay)  # staggered, so that joins overlap the others' first looks
            return dp.connect(url, rank=rank, world_size=n, job=job, timeout=30)

        for attempt in range(8):
            job = f"together{attempt}"
            delays = [rng.uniform(0, 0.1) for _ in range(n)]
            channels = run_all([partial(join, r, job, delays[r]) for r in range(n)])
            try:
                run_all([partial(c.barrier, "joined", timeout=STEP_TIMEOUT) for c in channels])
                lost = {c.rank: c.lost_peers() for c in channels if c.lost_peers()}
                assert not lost, f"attempt {attempt}: live ranks reported lost: {lost}"
            finally:
                close_all(channels)

    @pytest.mark.timeout(60)
    def test_clean_close_is_not_a_loss(self, channel_url: str, open_ranks: OpenRanks) -> None:
        channels = open_ranks(3, job="clean", url=with_options(channel_url, **self.LIVENESS))
        self.rendezvous_all(channels)
        channels[2].close()
        time.sleep(self.LIVENESS["liveness_timeout"] + 1.0)
        assert channels[0].lost_peers() == {}
        channels[0].set("still", b"works")
        assert channels[1].get("still", timeout=5) == b"works"


class RunTests(ChannelHarness):
    """A job's state belongs to a run: rerunning a job that crashed, under the same name and
    on the same coordinator or store, starts clean once the crashed ranks are known gone."""

    LIVENESS = FAST_LIVENESS

    @pytest.mark.timeout(180)
    def test_a_killed_jobs_rerun_under_the_same_name_starts_clean(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        url = with_options(channel_url, **self.LIVENESS)
        n, job = 3, "crashy"
        procs: list[subprocess.Popen[str]] = []
        try:
            if self.cross_process:
                # A process of another job connects first: it hosts the coordinator or store where
                # the transport's rank 0 would (zmq, grpc, tcpstore), so the crashed job's state
                # outlives the crashed processes, as on a `dataparallel serve` coordinator.
                procs.append(self.spawn_rank("hold", url, 0, 1, "keeper", "--hold", "170"))
                self.read_ready(procs[0])
                crashed = [self.spawn_rank("crash-mid-run", url, r, n, job, "--hold", "170") for r in range(n)]
                procs += crashed
                for proc in crashed:
                    self.read_ready(proc)
                time.sleep(0.3)  # the unfinished barrier entered
                for proc in crashed:
                    proc.kill()
                    proc.communicate(timeout=10)
            else:
                # Ranks are threads: a crash is ranks that stop beating and never close.
                from .worker import leave_state

                old = open_ranks(n, job=job, url=url)
                self.rendezvous_all(old)
                run_all([partial(leave_state, c) for c in old])
                for ch in old:
                    _stop_liveness(ch)
            # Within the liveness timeout and some slack, not the channel's timeout (60 s): the
            # slack covers connects (torch's TCPStore stalls 5 s on some) on a loaded machine.
            bound = self.LIVENESS["liveness_timeout"] + 4 * self.LIVENESS["heartbeat"] + 20.0
            self._rerun(url, job, [*range(n)], bound, leave=True)
            # A run that ended cleanly gives way at once, to ranks assigned by the core as well.
            self._rerun(url, job, [None] * n, bound, leave=False)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate(timeout=10)

    def _rerun(self, url: str, job: str, ranks: list[int | None], bound: float, leave: bool) -> None:
        """Join ``job`` again with ``ranks``, within ``bound`` seconds, into a run that shows
        nothing of the one before (keys, unfinished collectives, losses); with ``leave``,
        leave a key behind for the next one before closing."""
        n = len(ranks)
        start = time.monotonic()
        again = run_all([partial(dp.connect, url, rank=r, world_size=n, job=job, timeout=60) for r in ranks], 90)
        joined = time.monotonic() - start
        try:
            assert joined < bound, f"the rerun joined after {joined:.1f}s"
            assert sorted(held_rank(c) for c in again) == list(range(n))
            assert not any(c.check([f"leftover/{r}"]) for c in again for r in range(n)), "the old run's keys show"
            self.rendezvous_all(again)
            run_all([partial(c.barrier, "unfinished", timeout=STEP_TIMEOUT) for c in again])
            got = run_all([partial(c.all_gather, "who", str(c.rank).encode(), timeout=STEP_TIMEOUT) for c in again])
            assert got == [[str(r).encode() for r in range(n)]] * n
            time.sleep(self.LIVENESS["liveness_timeout"] / 2)
            assert all(c.lost_peers() == {} for c in again), "the rerun inherited the crashed run's losses"
            if leave:
                run_all([partial(c.set, f"leftover/{c.rank}", b"from the run before") for c in again])
        finally:
            close_all(again)


class StoreTests(ChannelHarness):
    """``as_store()``: the torch Store API, PrefixStore over it, and gloo through it."""

    def test_store_api_matches_torch_semantics(self, open_ranks: OpenRanks) -> None:
        import torch.distributed as dist

        a, b = open_ranks(2)
        first = a.as_store()
        sa, sb = _as_bound(first), _as_bound(b.as_store())
        assert a.as_store() is first, "one store per channel, kept alive by it"
        sa.set("s", "text")
        assert sb.get("s") == b"text"
        assert sa.add("c", 3) == 3 and sb.add("c", 4) == 7
        assert sb.compare_set("c", "7", "8") == b"8"
        assert sa.check(["s", "c"]) and not sa.check(["nope"])
        sb.multi_set(["m1", "m2"], ["1", b"2"])
        assert sa.multi_get(["m1", "m2"]) == [b"1", b"2"]
        sa.append("log", "ab")
        sb.append("log", "cd")
        assert sa.get("log") == b"abcd"
        assert sa.delete_key("m1") and not sb.delete_key("m1")
        assert sa.num_keys() >= 4
        sa.wait(["s", "c"])
        sb.set_timeout(timedelta(seconds=0.3))
        with pytest.raises(dist.DistStoreError):
            sb.get("never")
        with pytest.raises(dist.DistStoreError):
            sa.wait(["never"], timedelta(seconds=0.3))
        clone = sa.clone()
        assert clone.get("s") == b"text"

    def test_store_serves_torchs_cpp_callers(self, open_ranks: OpenRanks) -> None:
        import gc

        from torch._C._distributed_c10d import _test_python_store
        from torch.distributed.distributed_c10d import PrefixStore

        a, b = open_ranks(2)
        store = a.as_store()
        assert _as_bound(store).has_extended_api()
        # clone() called from C++: the Python object behind the clone must outlive the call.
        clone = _as_bound(PrefixStore("cpp", store)).clone()
        gc.collect()
        clone.set("k", b"v")
        assert clone.get("k") == b"v" and b.get("cpp/k", timeout=5) == b"v"
        clone.multi_set(["x", "y"], [b"1", b"2"])  # PrefixStore (C++) -> our multi_set
        assert PrefixStore("cpp", b.as_store()).multi_get(["y", "x"]) == [b"2", b"1"]
        clone.append("log", b"ab")
        _as_bound(PrefixStore("cpp", b.as_store())).append("log", b"cd")
        assert a.get("cpp/log", timeout=5) == b"abcd"
        _test_python_store(store)  # torch's own C++ walk through a Python store (it clones)

    def test_store_timeouts_are_dist_store_errors_that_say_timeout(self, open_ranks: OpenRanks) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import PrefixStore

        (a,) = open_ranks(1)
        store = a.as_store()
        store.set_timeout(timedelta(seconds=0.3))
        prefixed = PrefixStore("p", store)
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get("never"),
            "wait": lambda: store.wait(["never"], timedelta(seconds=0.3)),
            "multi_get": lambda: store.multi_get(["never"]),
            "PrefixStore.get": lambda: prefixed.get("never"),
        }
        for name, call in calls.items():
            with pytest.raises(dist.DistStoreError) as info:
                call()
            assert "timeout" in str(info.value).lower(), f"{name}: {info.value}"

    def test_prefix_store_over_channel_store(self, open_ranks: OpenRanks) -> None:
        from torch.distributed.distributed_c10d import PrefixStore

        a, b = open_ranks(2)
        pa = _as_bound(PrefixStore("trainer", a.as_store()))
        pb = PrefixStore("trainer", b.as_store())
        pa.set("x", b"1")
        assert pb.get("x") == b"1"
        assert pb.add("n", 2) == 2
        assert a.get("trainer/x", timeout=5) == b"1"
        assert not pa.check(["y"])

    @pytest.mark.timeout(180)
    def test_gloo_process_group_through_the_channel(
        self, channel_url: str, open_ranks: OpenRanks, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        n = 3
        # gloo fetches its peers' addresses with one multi_get per rank (what
        # dataparallel.init_process_group asks of it), not one get per peer.
        monkeypatch.setenv("GLOO_ENABLE_STORE_V2_API", "1")
        if not self.cross_process:
            results = self._gloo_on_threads(open_ranks, n)
        else:
            procs = [self.spawn_rank("gloo", channel_url, r, n, "gloo") for r in range(n)]
            results = [_finish(p, timeout=150) for p in procs]
        for r, res in enumerate(sorted(results, key=lambda x: x["rank"])):
            assert res["rank"] == r
            assert res["sum"] == [float(sum(range(1, n + 1))), float(sum(2.0**k for k in range(n)))]
            assert res["broadcast"] == [float(n - 1)] * 3
            assert res["gathered"] == list(range(n))
            assert res["group_sum"] == float(n)
            assert res["multi_gets"] >= 1, "gloo's init did not reach the channel's multi_get"

    @staticmethod
    def _gloo_on_threads(open_ranks: OpenRanks, n: int) -> list[dict[str, Any]]:
        # One process: a gloo group per thread, built on the channel's store directly.
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import PrefixStore

        channels = open_ranks(n, job="gloo")
        counted = count_multi_gets(channels)

        def gloo(store: Store, rank: int) -> _GlooBackend:
            # torch's stubs declare these collectives on ProcessGroup only; Backend (ProcessGroupGloo's base)
            # has them in its bindings.
            return cast("_GlooBackend", dist.ProcessGroupGloo(store, rank, n, timedelta(seconds=60)))

        def body(ch: dp.ControlChannel) -> dict[str, Any]:
            ch.rendezvous(timeout=STEP_TIMEOUT)
            rank = held_rank(ch)
            store = PrefixStore("pg0/", ch.as_store())
            pg = gloo(store, rank)
            summed = torch.tensor([float(rank + 1), 2.0**rank])
            pg.allreduce([summed]).wait()
            shared = torch.full((3,), float(rank))
            opts = dist.BroadcastOptions()
            opts.rootRank = n - 1
            pg.broadcast([shared], opts).wait()
            pg.barrier().wait()
            gathered = [torch.zeros(1) for _ in range(n)]
            pg.allgather([gathered], [torch.tensor([float(rank)])]).wait()
            # A second group on its own prefix: the store is used again after init.
            pg2 = gloo(PrefixStore("pg1/", ch.as_store()), rank)
            ones = torch.ones(1)
            pg2.allreduce([ones]).wait()
            return {
                "rank": rank,
                "sum": summed.tolist(),
                "broadcast": shared.tolist(),
                "gathered": [int(t.item()) for t in gathered],
                "group_sum": ones.item(),
                "multi_gets": counted[rank],
            }

        return run_all([partial(body, c) for c in channels], timeout=120)


class _GlooBackend(Protocol):
    """The collectives :meth:`StoreTests._gloo_on_threads` calls on a ``ProcessGroupGloo``."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...
    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def barrier(self) -> dist.Work: ...
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]) -> dist.Work: ...


class _BoundStore(Protocol):
    """``torch.distributed.Store`` as torch's C++ binding has it, for the calls the store tests make.
    torch's stubs (``torch/_C/_distributed_c10d.pyi``, torch 2.13) leave out ``append``, ``multi_set``,
    ``clone`` and ``has_extended_api``, which the binding has, and type values as ``str`` where the
    binding (pybind11's ``std::string``) takes ``bytes`` too."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...
    def num_keys(self) -> int: ...
    def set_timeout(self, timeout: timedelta) -> None: ...
    def wait(self, keys: list[str], timeout: timedelta = ...) -> None: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None: ...
    def append(self, key: str, value: str | bytes) -> None: ...
    def clone(self) -> _BoundStore: ...
    def has_extended_api(self) -> bool: ...


def _as_bound(store: Store) -> _BoundStore:
    """``store``, typed with the methods torch's stubs leave out (see :class:`_BoundStore`)."""
    return cast("_BoundStore", store)


def _resume(pid: int) -> None:
    """SIGCONT to ``pid``, which may have ended already."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGCONT)


def _stop_liveness(ch: dp.ControlChannel) -> None:
    """Stop ``ch``'s liveness without announcing a departure: to its peers, the rank was
    killed or froze (where ranks are threads of one process)."""
    if ch._liveness is None:
        pytest.fail(f"{ch!r} has no liveness to stop: dp.connect returned it before it joined")
    ch._liveness.stop(announce=False)


def _check_adds(values: list[int], final: bytes, where: str) -> None:
    """Concurrent ``add(key, 1)`` calls returned ``values`` and left ``final`` at the key:
    each must have returned a distinct value of 1..N, and the key must read N."""
    total, counts = len(values), Counter(values)
    duplicates = sorted((v, c) for v, c in counts.items() if c > 1)
    if duplicates:
        shown = ", ".join(f"{v} returned {c} times" for v, c in duplicates[:8])
        more = f", and {len(duplicates) - 8} more" if len(duplicates) > 8 else ""
        pytest.fail(
            f"add is not atomic across {where}: {total} adds returned {len(counts)} distinct values "
            f"(duplicates: {shown}{more}); the counter ended at {final.decode(errors='replace')!r}"
        )
    if sorted(values) != list(range(1, total + 1)):
        outside = sorted(v for v in counts if not 1 <= v <= total)
        pytest.fail(f"add across {where}: {total} adds on a new key returned values outside 1..{total}: {outside[:8]}")
    if final != str(total).encode():
        pytest.fail(f"add lost updates across {where}: the counter reads {final!r} after {total} adds")


def _check_claims(contenders: list[dict[str, Any]], prefix: str, rounds: int, where: str) -> None:
    """Each contender ``{"contender": name, "got": [...]}`` called ``compare_set(prefix + i,
    b"", name)`` in round ``i`` and got ``got[i]`` back: exactly one may win each round, and
    every contender must get the winner's name."""
    bad = []
    for i in range(rounds):
        got = {c["contender"]: c["got"][i] for c in contenders}
        winners = sorted(name for name, value in got.items() if value == name)
        if len(winners) != 1 or len(set(got.values())) != 1:
            bad.append((i, winners, got))
    if bad:
        i, winners, got = bad[0]
        by_value: dict[str, list[str]] = {}
        for name, value in sorted(got.items()):
            by_value.setdefault(value, []).append(name)
        told = "; ".join(f"{value!r} to {', '.join(names)}" for value, names in by_value.items())
        verdict = f"let {len(winners)} contenders win" if winners else "let no contender win"
        pytest.fail(
            f"compare_set {verdict} a race across {where} for {prefix}{i!s} "
            f"(winners: {', '.join(winners) or 'none'}; {len(bad)} of {rounds} rounds went wrong). "
            f"What compare_set returned: {told}"
        )


def _at_port(url: str, port: int) -> tuple[str, int]:
    """``url`` with its HOST:PORT's port replaced by ``port``, and 1; (``url``, 0) for a URL
    with no HOST:PORT (a file, a service of the transport's own)."""
    return re.subn(r"(//[^/?]*:)\d+", rf"\g<1>{port}", url, count=1)


def _network_path(url: str) -> bool:
    """Whether ``url`` names a HOST:PORT (a network path a proxy can go dark on)."""
    return re.search(r"//[^/?,]*:\d+", url) is not None


def _resume_and_kill(proc: subprocess.Popen[str]) -> None:
    """End a worker the test may have left frozen (SIGSTOP): resumed, killed, reaped."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.communicate(timeout=10)


def _add_into(ch: dp.ControlChannel, key: str, box: list[BaseException | None]) -> None:
    """``ch.add(key, 1)``, its outcome appended to ``box`` (None, or the error it raised)."""
    try:
        ch.add(key, 1)
        box.append(None)
    except BaseException as err:
        box.append(err)


def _finish(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"worker hung for {timeout}s; stderr:\n{err[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"worker exited {proc.returncode}; stderr:\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])  # the worker's last line: a JSON object
    return result


class LinearizabilityTests(ChannelHarness):
    """Several clients' random operations on a few keys, under faults, form a linearizable
    history (:mod:`.linearizability`): every set, add, compare_set and delete is atomic and
    applied exactly once, and every read sees the latest write."""

    LIVENESS = FAST_LIVENESS
    #: Operations a run must record, at the least, so that the check is not vacuous: the
    #: clients that are neither killed nor frozen do 1100 each, and on a loaded machine, where
    #: some of them may be starved past the liveness timeout and cut off too, those still
    #: running go on until the run has recorded this many.
    MIN_OPERATIONS = 2200

    @pytest.mark.timeout(240)
    def test_store_is_linearizable_under_kills_freezes_and_connection_resets(
        self, channel_url: str, tmp_path: Path
    ) -> None:
        from .linearizability import Faults, check, client_ops, load_history, run_workload

        if not self.cross_process:  # ranks are threads: no process to kill or freeze
            url = with_options(channel_url, **self.LIVENESS)
            channels = run_all([partial(dp.connect, url, rank=r, world_size=4, job="lin") for r in range(4)])
            try:
                self.rendezvous_all(channels)
                files = [tmp_path / f"client{r}.jsonl" for r in range(4)]
                run_all([partial(client_ops, channels[r], files[r], r, 1000, 0, 3, r) for r in range(4)], 120)
            finally:
                close_all(channels)
            report = check(load_history(files))
        else:
            # Connection resets need a HOST:PORT to put a proxy in front of.
            resets = 1.0 if urlsplit(channel_url).port else 0.0
            faults = Faults(reset_every=resets, freeze_at=1.5, kill_at=2.5)
            report, _ = run_workload(
                channel_url,
                tmp_path,
                clients=5,
                ops=1100,
                min_seconds=6,
                faults=faults,
                options=self.LIVENESS,
                min_operations=self.MIN_OPERATIONS,
            )
        assert report.ok, str(report)
        assert report.operations >= self.MIN_OPERATIONS, f"only {report.operations} operations recorded"

    @pytest.mark.timeout(240)
    def test_ranks_are_unique_and_barriers_never_release_early_under_connection_resets(self, channel_url: str) -> None:
        """Beyond single keys: 4 processes joining with ``rank=None`` get distinct ranks, and
        in each of 40 barrier rounds no rank leaves before the last one entered. Connections
        are reset every 0.5 s where the transport ``survives_connection_loss``. Liveness is not
        what it judges: it runs with the default liveness timeout (10 s), not the suite's 2 s,
        which a loaded machine's stall on top of a reconnect can reach (a rank cut off then
        fails the test for what it does not test)."""
        from .worker import timed_barriers

        n, rounds, job = 5, 40, "rounds"
        url = channel_url
        if not self.cross_process:
            channels = run_all([lambda: dp.connect(url, rank=None, world_size=n, job=job) for _ in range(n)])
            try:
                self.rendezvous_all(channels)
                results = run_all([partial(timed_barriers, c, rounds, STEP_TIMEOUT) for c in channels], 120)
            finally:
                close_all(channels)
        else:
            host = dp.connect(url, rank=0, world_size=n, job=job, timeout=30)
            proxy, client_url = proxy_in_front(url) if host.survives_connection_loss else (None, url)
            procs = [
                self.spawn_rank("barriers", client_url, None, n, job, "--rounds", str(rounds)) for _ in range(n - 1)
            ]
            try:
                if proxy is not None:
                    proxy.reset_every(0.5)
                try:
                    host.rendezvous(timeout=STEP_TIMEOUT)
                    mine = timed_barriers(host, rounds, STEP_TIMEOUT)
                except dp.ControlError as err:
                    for p in procs:
                        p.kill()
                    outputs = [p.communicate(timeout=10) for p in procs]
                    shown = "\n".join(
                        f"--- process {i} (pid {p.pid}, exit {p.returncode}): stdout:\n{out}\nstderr:\n{err_}"
                        for i, (p, (out, err_)) in enumerate(zip(procs, outputs, strict=True))
                    )
                    pytest.fail(f"{err}\nevery other rank's whole output:\n{shown}")
                results = [mine] + [_finish(p, 120) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.communicate(timeout=10)
                if proxy is not None:
                    proxy.close()
                host.close()
        assert sorted(r["rank"] for r in results) == list(range(n)), "a rank was handed out twice"
        for i in range(rounds):
            last_in = max(r["times"][i][0] for r in results)
            first_out = min(r["times"][i][1] for r in results)
            assert first_out >= last_in, f"barrier round {i} released a rank {last_in - first_out:.4f}s early"


class RelayTests(ChannelHarness):
    """The channel as a node relay's upstream (:class:`~dataparallel.control.relay.node.NodeRelay`,
    which takes a channel of any transport): what passes through a relay keeps the store's
    guarantees, under the same faults as a direct channel's."""

    LIVENESS = FAST_LIVENESS
    MIN_OPERATIONS = LinearizabilityTests.MIN_OPERATIONS

    @pytest.mark.timeout(240)
    def test_the_store_through_node_relays_is_linearizable_under_kills_freezes_and_connection_resets(
        self, channel_url: str, tmp_path: Path
    ) -> None:
        """Six ranks behind two relays (three a node), five of them client processes running
        the linearizability workload (set, get, check, add, compare_set, delete on three
        keys; the relays batch concurrent writes and share concurrent reads): one client
        frozen past the liveness timeout (its relay gives it up), another killed with a call
        in flight (its relay sees its process end), and, where the transport survives a lost
        connection and has a HOST:PORT, every relay's upstream connection reset every second
        through a proxy. The merged history is linearizable: each call through a relay is
        applied once and reads the latest write, as a direct call is."""
        from dataparallel.control.relay.node import NodeRelay, nodes_job

        from .linearizability import Faults, run_workload

        job = f"relayed{next(_silenced)}"
        # Whoever hosts the transport's coordinator where a rank 0 does: a job of its own.
        host = dp.connect(channel_url, rank=0, world_size=1, job=f"{job}~host", timeout=STEP_TIMEOUT)
        proxy, upstream_url = proxy_in_front(channel_url) if host.survives_connection_loss else (None, channel_url)
        # The relays' upstreams with their ranks' liveness, as a launcher joins them with the
        # job's: with the default one, a request lost in a reset is sent again only after 5 s,
        # and the ranks, told their store has not answered for 2 s, give up.
        upstream_url = with_options(upstream_url, **self.LIVENESS)
        upstreams: list[dp.ControlChannel] = []
        relays: list[NodeRelay] = []
        try:
            upstreams += run_all(
                [
                    partial(dp.connect, upstream_url, rank=n, world_size=2, job=nodes_job(job), timeout=STEP_TIMEOUT)
                    for n in range(2)
                ]
            )
            relays += [
                NodeRelay(up, tmp_path / f"node{n}", local_ranks=3, node_rank=n, nodes=2, job=job)
                for n, up in enumerate(upstreams)
            ]
            urls = [with_options(f"relay://{relays[r // 3].path}", **self.LIVENESS) for r in range(6)]
            events = [] if proxy is None else [(0.5, partial(proxy.reset_every, 1.0))]
            faults = Faults(freeze_at=1.5, kill_at=2.5, events=events)
            report, _ = run_workload(
                "",
                tmp_path / "lin",
                clients=5,
                ops=1100,
                min_seconds=6,
                faults=faults,
                rank_urls=urls,
                job=job,
                min_operations=self.MIN_OPERATIONS,
            )
            resets = proxy.resets if proxy is not None else None
        finally:
            for relay in relays:
                relay.close()
            close_all(upstreams)
            if proxy is not None:
                proxy.close()
            host.close()
        assert report.ok, str(report)
        assert report.operations >= self.MIN_OPERATIONS, f"only {report.operations} operations recorded"
        if resets is not None:
            assert resets >= 4, f"the relays' connections were reset {resets} times"


class SilencedServer(Protocol):
    """What :meth:`TimeoutTests.silenceable_server` gives: a coordinator or store in a process
    of its own, ``url`` to reach it, ``pid`` to freeze or kill it, and ``job``, the job a
    rank of it joins there."""

    url: str
    pid: int
    job: str


class TimeoutTests(ChannelHarness):
    """A timeout is a promise: every blocking call with ``timeout=T`` (or, for calls without
    one, on a channel connected with ``timeout=T``) returns within ``T`` plus
    :meth:`slack`, whatever the coordinator or store does: absent, frozen (SIGSTOP), killed,
    or behind a link that goes dark (a proxy that stops forwarding, keeping its connections
    open). Each call starts when the condition does; all of them run at once, on threads."""

    #: The timeout every call of these tests is given (seconds).
    PROMISE: ClassVar[float] = 4.0

    @staticmethod
    def slack(timeout: float) -> float:
        """How far past its timeout a call may return (:func:`timeout_slack`)."""
        return timeout_slack(timeout)

    @contextlib.contextmanager
    def silenceable_server(self, channel_url: str) -> Iterator[SilencedServer]:
        """A coordinator (or store) of the transport's in a process of its own, which the test
        may freeze or kill. Default: a rank 0 of a job of its own, in a worker process, on a
        port of its own, which must host the coordinator (as zmq://, grpc:// and tcpstore://
        ranks 0 do). A URL with no HOST:PORT (a store in a file, or a service of the
        transport's own) is shared: that rank 0 is the peer to freeze or kill there. A
        transport whose store is no rank's (``etcd://``) overrides it to start a server."""
        port = free_port()
        url, swapped = _at_port(channel_url, port)
        job = f"silenced{next(_silenced)}"
        proc = self.spawn_rank("hold", url, 0, 2, job, "--hold", "120", "--no-rendezvous", "--timeout", "30")
        try:
            stdout = proc.stdout
            assert stdout is not None
            line = stdout.readline()
            if not line or (swapped and not json.loads(line).get("hosts")):
                proc.kill()
                _, err = proc.communicate(timeout=10)
                pytest.fail(
                    f"rank 0 at {url} does not host the coordinator ({line.strip()!r}; stderr {err[-2000:]!r}): "
                    "override silenceable_server to start the transport's server"
                )
            yield cast(SilencedServer, _Served(url, proc.pid, job))
        finally:
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except OSError:
                pass
            proc.kill()
            proc.communicate(timeout=10)

    def _timed_calls(self, ch: dp.ControlChannel, tag: str) -> dict[str, Callable[[], object]]:
        """Every blocking call, each bounded by :attr:`PROMISE` (the channel's timeout where
        it takes none)."""
        from datetime import timedelta

        from dataparallel.launching.torchrun import ChannelRendezvousBackend

        t = self.PROMISE
        store = ch.as_store()
        store.set_timeout(timedelta(seconds=t))
        bound = _as_bound(store)
        backend = ChannelRendezvousBackend(ch, f"timeouts-{tag}", "dp-test")
        return {
            "get": lambda: ch.get(f"{tag}/never", timeout=t),
            "wait": lambda: ch.wait([f"{tag}/never"], timeout=t),
            "multi_get": lambda: ch.multi_get([f"{tag}/never", f"{tag}/nor"], timeout=t),
            "set": lambda: ch.set(f"{tag}/k", b"v"),
            "add": lambda: ch.add(f"{tag}/n", 1),
            "compare_set": lambda: ch.compare_set(f"{tag}/c", b"", b"x"),
            "append": lambda: ch.append(f"{tag}/log", b"x"),
            "barrier": lambda: ch.barrier(f"{tag}/b", timeout=t),
            "broadcast": lambda: ch.broadcast(f"{tag}/bc", src=0, timeout=t),
            "all_gather": lambda: ch.all_gather(f"{tag}/ag", b"x", timeout=t),
            "rendezvous": lambda: ch.rendezvous(timeout=t),
            "store get": lambda: bound.get(f"{tag}/never"),
            "store wait": lambda: bound.wait([f"{tag}/never"], timedelta(seconds=t)),
            "store set": lambda: bound.set(f"{tag}/s", b"v"),
            "rdzv get_state": backend.get_state,
            "rdzv set_state": lambda: backend.set_state(b"state"),
        }

    def _check_bounds(self, timings: dict[str, Timed], where: str) -> None:
        """Each call returned within the promise and its slack, less the time its thread
        spent waiting for a CPU (see :class:`Timed`), and raised nothing but ControlErrors."""
        limit = self.PROMISE + self.slack(self.PROMISE)
        late = {name: str(timed) for name, timed in timings.items() if timed.took - timed.starved > limit}
        assert not late, f"{where}: calls with timeout={self.PROMISE:g} outlived {limit:g}s: {late}"
        for name, timed in timings.items():
            err = timed.err
            if err is not None and not _control_error(err):
                raise AssertionError(f"{where}: {name} raised {type(err).__name__}, not a ControlError: {err}") from err

    @staticmethod
    def _time_all(
        calls: dict[str, Callable[[], object]], promise: float, pool: ThreadPoolExecutor | None = None
    ) -> dict[str, Timed]:
        """Run the calls at once, on threads (new ones, or ``pool``'s); how long each took,
        what it raised, and how long its thread waited for a CPU once ``promise`` seconds
        had passed (one timer, started with the calls, which start within milliseconds of it,
        looks at every call's thread then: what it waited before delays no deadline; a timer
        a call would be as many threads more, woken at the calls' deadline), or for a call that returned past
        the promise and its slack, how long its process's most starved thread did (see
        :class:`Timed`)."""
        at_promise: dict[int, float] = {}  # every thread of the process -> what it had waited by then
        lock = threading.Lock()
        late = promise + timeout_slack(promise)

        def look() -> None:
            with lock:
                at_promise.update(_threads_waited_for_cpu())

        def timed(call: Callable[[], object]) -> Timed:
            start, thread = time.monotonic(), threading.get_native_id()
            err: BaseException | None = None
            try:
                call()
            except Exception as raised:
                err = raised
            took = time.monotonic() - start
            with lock:
                before = at_promise.get(thread)
                process = dict(at_promise)
            starved = _waited_for_cpu(thread) - before if before is not None else 0.0
            if took - starved > late and process:  # past its bound: was its process off the CPUs?
                process.pop(thread, None)
                starved = max(starved, _most_waited_for_cpu(process))
            return Timed(took, err, max(starved, 0.0))

        timer = threading.Timer(promise, look)
        timer.daemon = True
        timer.start()
        try:
            names = list(calls)
            return dict(zip(names, run_all([partial(timed, calls[n]) for n in names], pool=pool), strict=True))
        finally:
            timer.cancel()

    @pytest.mark.timeout(60)
    def test_a_connect_to_nothing_keeps_its_timeout(self, channel_url: str) -> None:
        """Nothing listening where the URL points, or a listener that never answers (its
        kernel takes the connection, nothing more): ``connect``, and a torchrun rendezvous
        handler over the transport (an agent, which hosts the coordinator where it can bind
        the port: not where it is taken), fail with a ControlError within the timeout's
        bound. A URL with no network endpoint has nothing to be absent: it connects at once."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from dataparallel.launching.torchrun import create_rdzv_handler

        t = self.PROMISE
        with socket.create_server(("127.0.0.1", 0)) as mute:
            urls = {}
            for name, port in (("nothing", free_port()), ("mute", mute.getsockname()[1])):
                urls[name], swapped = _at_port(channel_url, port)
            calls: dict[str, Callable[[], object]] = {
                f"connect to {name}": partial(_connect_and_close, url, t) for name, url in urls.items()
            }
            if swapped:
                endpoint = f"127.0.0.1:{mute.getsockname()[1]}"
                params = RendezvousParameters("x", endpoint, "timeouts", 1, 1, read_timeout=t)
                calls["rdzv handler at mute"] = partial(create_rdzv_handler, urlsplit(channel_url).scheme, params)
            timings = self._time_all(calls, self.PROMISE)
        self._check_bounds(timings, "nothing listening, or a mute listener")
        if swapped:
            assert all(timed.err is not None for timed in timings.values()), timings

    @pytest.mark.timeout(240)
    def test_a_process_whose_connect_failed_exits_with_its_own_status(self, channel_url: str) -> None:
        """Processes that connect to nothing listening, or to a listener that never answers,
        with timeouts from 0.5 to 2.5 s, catch the ControlError and exit with their own
        status: the process ends as its code says (a transport's thread still waiting on
        the coordinator must not kill it with a signal as the interpreter exits). A URL with
        no network endpoint has nothing to be absent: its processes connect and exit 0."""
        from .worker import CONNECT_FAILED

        timeouts = ("0.5", "1", "1.5", "2", "2.5")
        with socket.create_server(("127.0.0.1", 0)) as mute:
            procs: dict[str, subprocess.Popen[str]] = {}
            swapped = 0
            for name, port in (("nothing", free_port()), ("mute", mute.getsockname()[1])):
                url, swapped = _at_port(channel_url, port)
                for i, t in enumerate(timeouts):
                    extra = ("--timeout", t, "--hold", "0", "--no-rendezvous")
                    rank, world = (1, 2) if swapped else (0, 1)  # each its own job (a URL may be shared)
                    procs[f"{name}, timeout {t}"] = self.spawn_rank("hold", url, rank, world, f"{name}{i}", *extra)
            # How long each call may take is another test's (a connect keeps its timeout);
            # this one's bound only guards against a hang. Ten processes that each import
            # their transport (torch, for some) start at once: on a loaded machine the
            # first took more than a minute to start and fail.
            deadline = time.monotonic() + 180
            ended = {
                name: proc.communicate(timeout=max(1.0, deadline - time.monotonic())) for name, proc in procs.items()
            }
        expected = CONNECT_FAILED if swapped else 0
        wrong = {
            name: f"exit {procs[name].returncode}: {(out + err)[-600:]}"
            for name, (out, err) in ended.items()
            if procs[name].returncode != expected
        }
        assert not wrong, f"expected exit {expected} from every process: {wrong}"
        if swapped:
            for name, (out, _) in ended.items():
                assert "connect_failed" in out and "ChannelClosed" in out, f"{name}: {out}"

    @pytest.mark.timeout(120)
    def test_every_call_keeps_its_timeout_when_the_coordinator_freezes_dies_or_goes_dark(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        """Three coordinators (or stores) at once, each with a rank connected to it with
        ``timeout=T``: one frozen (SIGSTOP), one killed, one behind a proxy that stops
        forwarding. Every blocking call on each rank, all started at that moment, returns (or
        raises a ControlError) within T plus the slack, and so does ``close`` after them.
        With ranks that are threads of one process (nothing to freeze), the same calls on a
        job whose rank 0 stopped all contact. A URL with no HOST:PORT has no network path to
        go dark: its rank 0 is frozen and killed."""
        t = self.PROMISE
        if not self.cross_process:
            a, b = open_ranks(2, job="silenced", timeout=t)
            _stop_liveness(a)
            timings = self._time_all(self._timed_calls(b, "inproc"), self.PROMISE)
            timings.update(self._time_all({"close": b.close}, self.PROMISE))
            self._check_bounds(timings, "rank 0 silent")
            return
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(self.silenceable_server(channel_url)) for _ in range(2)]
            conditions, urls = ["frozen", "killed"], [servers[0].url, servers[1].url]
            proxy = None
            if _network_path(channel_url):  # a network path to go dark
                servers.append(stack.enter_context(self.silenceable_server(channel_url)))
                proxy, dark_url = proxy_in_front(servers[2].url)
                assert proxy is not None, f"{servers[2].url}: no HOST:PORT to put a proxy in front of"
                stack.callback(proxy.close)
                conditions.append("dark")
                urls.append(dark_url)
            jobs = [getattr(server, "job", "silenced") for server in servers]
            channels = run_all(
                [
                    partial(dp.connect, u, rank=1, world_size=2, job=job, timeout=t)
                    for u, job in zip(urls, jobs, strict=True)
                ]
            )
            for ch in channels:
                stack.callback(_close_quietly, ch)
            # Resumed first on the way out (before the channels close), should the test fail.
            stack.callback(_resume, servers[0].pid)
            os.kill(servers[0].pid, signal.SIGSTOP)
            os.kill(servers[1].pid, signal.SIGKILL)
            if proxy is not None:
                proxy.blackhole()
            calls = {
                f"{cond}: {name}": call
                for cond, ch in zip(conditions, channels, strict=True)
                for name, call in self._timed_calls(ch, cond).items()
            }
            timings = self._time_all(calls, self.PROMISE)
            closes: dict[str, Callable[[], object]] = {
                f"{cond}: close": ch.close for cond, ch in zip(conditions, channels, strict=True)
            }
            timings.update(self._time_all(closes, self.PROMISE))
        self._check_bounds(timings, "coordinator frozen, killed or dark")

    def _rank_beside_a_silenceable_server(
        self, stack: contextlib.ExitStack, channel_url: str, job: str
    ) -> tuple[SilencedServer, dp.ControlChannel]:
        """A :meth:`silenceable_server` and rank 1 of 2 of its job (``job`` where the server
        names none) with the step timeout, closed and the server resumed on ``stack``'s exit
        (resumed first, should the test fail with it frozen)."""
        server = stack.enter_context(self.silenceable_server(channel_url))
        ch = dp.connect(server.url, rank=1, world_size=2, job=getattr(server, "job", job), timeout=STEP_TIMEOUT)
        stack.callback(_close_quietly, ch)
        stack.callback(_resume, server.pid)
        return server, ch

    @pytest.mark.timeout(90)
    def test_a_wait_rides_out_a_coordinator_paused_for_a_moment(self, channel_url: str, open_ranks: OpenRanks) -> None:
        """A coordinator (or store) frozen (SIGSTOP) for about a second, well within the
        liveness timeout, while a rank waits in every kind of wait, each for a rank that never
        comes (a key, keys, a broadcast, a gather, an all_gather, a barrier; timeout T): each
        ends as it would have without the pause, a ControlTimeout (not a ChannelClosed at the
        pause: a node relay passed its store's unanswered read on as one, ending a get or a
        broadcast half a second into the pause), within T, the pause and the slack (the bound
        itself is the test above's; here, that nothing waits for the channel's timeout), and
        the channel goes on. The waits run a few at a time (a pause each), as a rank's threads
        wait. Where nothing can be frozen (ranks that are threads of one process), the same
        waits without the pause."""
        t, pause = 3.0, 1.2
        with contextlib.ExitStack() as stack:
            if self.cross_process:
                server, ch = self._rank_beside_a_silenceable_server(stack, channel_url, "paused")

                def freeze(resumed: list[float]) -> None:
                    time.sleep(0.3)  # every call in its wait
                    os.kill(server.pid, signal.SIGSTOP)
                    time.sleep(pause)
                    os.kill(server.pid, signal.SIGCONT)
                    resumed.append(time.monotonic())

            else:
                _, ch = open_ranks(2, job="paused", timeout=STEP_TIMEOUT)

                def freeze(resumed: list[float]) -> None:
                    resumed.append(time.monotonic())

            rounds: list[dict[str, Callable[[], object]]] = [
                {
                    "get": lambda: ch.get("paused/never", timeout=t),
                    "wait": lambda: ch.wait(["paused/never"], timeout=t),
                    "multi_get": lambda: ch.multi_get(["paused/never", "paused/nor"], timeout=t),
                },
                {
                    "broadcast": lambda: ch.broadcast("paused/bc", src=0, timeout=t),
                    "gather": lambda: ch.gather("paused/g", b"x", dst=1, timeout=t),
                },
                {
                    "all_gather": lambda: ch.all_gather("paused/ag", b"x", timeout=t),
                    "barrier": lambda: ch.barrier("paused/b", timeout=t),
                },
            ]
            limit = t + pause + self.slack(t)
            for calls in rounds:
                # A round counts once the pause ended well within the waits (a loaded machine
                # can hold the pausing thread back until it covers their ends, which then
                # rightly raise ChannelClosed): up to three tries.
                for _ in range(3):
                    resumed: list[float] = []
                    pauser = threading.Thread(target=freeze, args=(resumed,), daemon=True)
                    start = time.monotonic()
                    pauser.start()
                    timings = self._time_all(calls, t)
                    pauser.join()
                    if resumed and resumed[0] - start <= 0.3 + pause + 0.6:
                        break
                else:
                    pytest.fail(f"the coordinator's pause did not end in time in three tries ({resumed})")
                for name, timed in timings.items():
                    assert isinstance(timed.err, dp.ControlTimeout), (
                        f"{name}: {type(timed.err).__name__} after {timed.took:.2f}s, not a ControlTimeout: {timed.err}"
                    )
                    assert timed.took - timed.starved <= limit, f"{name} (timeout={t:g}) took {timed}"
            assert ch.failure is None, f"the channel failed after the pauses: {ch.failure}"
            ch.set("paused/after", b"1")
            assert ch.get("paused/after", timeout=STEP_TIMEOUT) == b"1"

    @pytest.mark.timeout(90)
    def test_a_collective_cut_short_by_a_coordinator_paused_past_its_timeout_leaves_the_channel_usable(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        """A coordinator (or store) frozen (SIGSTOP) past the timeout of the collectives a rank
        is in, well within the liveness timeout, the channel's own timeout much longer than
        theirs: a barrier, an all_gather, a broadcast and a gather that wait for a rank that
        never comes, a broadcast from this rank and a gather to another, which only write;
        each on a thread that used the channel before the pause (its own connection open).
        Each ends within its own timeout and the slack, not the channel's, with a
        ControlTimeout or a ChannelClosed (the store did not answer in time; a write may or may
        not have landed). The channel is not failed by it: once the coordinator runs again, the
        rank's writes, reads and collectives go on. (A TCPStore rank's barrier(timeout=1) took
        15 s: its count's add had the channel's 60 s, and ended at the liveness timeout.)
        Where nothing can be frozen, the same calls without the pause (and where the frozen
        process is a peer, not the store, the writes land)."""
        t = 1.0
        with contextlib.ExitStack() as stack:
            if self.cross_process:
                server, ch = self._rank_beside_a_silenceable_server(stack, channel_url, "cut-short")
            else:
                _, ch = open_ranks(2, job="cut-short", timeout=STEP_TIMEOUT)
            calls: dict[str, Callable[[], object]] = {
                "barrier": lambda: ch.barrier("cut/b", timeout=t),
                "all_gather": lambda: ch.all_gather("cut/ag", b"x", timeout=t),
                "broadcast": lambda: ch.broadcast("cut/bc", src=0, timeout=t),
                "gather": lambda: ch.gather("cut/g", b"x", dst=1, timeout=t),
            }
            writes: dict[str, Callable[[], object]] = {
                "broadcast from this rank": lambda: ch.broadcast("cut/mine", b"v", src=1, timeout=t),
                "gather to another rank": lambda: ch.gather("cut/theirs", b"x", dst=0, timeout=t),
            }
            # The calls run on threads that used the channel before the pause (a transport's
            # connection of each thread's own is open: its calls, not its connecting, meet it).
            n = len(calls) + len(writes)
            pool = ThreadPoolExecutor(max_workers=n)
            stack.callback(pool.shutdown, wait=False, cancel_futures=True)  # not waiting on a frozen server
            gate = threading.Barrier(n)

            def use(i: int) -> None:
                ch.set(f"cut/before/{i}", b"1")
                gate.wait(STEP_TIMEOUT)  # every thread of the pool takes one

            list(pool.map(use, range(n)))
            if self.cross_process:
                os.kill(server.pid, signal.SIGSTOP)
            timings = self._time_all({**calls, **writes}, t, pool=pool)
            if self.cross_process:
                _resume(server.pid)
            for name, timed in timings.items():
                if name in writes and timed.err is None:  # a store the pause left running (a peer frozen)
                    continue
                assert isinstance(timed.err, (dp.ControlTimeout, dp.ChannelClosed)), (
                    f"{name}: {type(timed.err).__name__} after {timed.took:.2f}s: {timed.err}"
                )
                assert timed.took - timed.starved <= t + self.slack(t), f"{name} (timeout={t:g}) took {timed}"
            assert ch.failure is None, f"the channel failed when its collectives ran out of time: {ch.failure!r}"
            ch.set("cut/after", b"1")
            assert ch.get("cut/after", timeout=STEP_TIMEOUT) == b"1"
            with pytest.raises(dp.ControlTimeout):
                ch.barrier("cut/again", timeout=t)
            assert ch.failure is None, f"the channel failed after the coordinator ran again: {ch.failure!r}"

    @pytest.mark.timeout(60)
    def test_a_rank_waiting_in_many_threads_at_once_keeps_its_channel(self, open_ranks: OpenRanks) -> None:
        """One rank waits in ten things at once, on ten threads (eight keys, an all_gather, a
        barrier), each for a rank that never comes: each ends with a ControlTimeout within its
        timeout and the slack, as it would alone (behind a relay, the load's exception
        below), and the channel goes on (a rank behind a
        node relay has a few slots for its calls in flight: a read that found none free was
        taken for the relay's silence, and an all_gather ending on one raised ChannelClosed,
        which failed the whole channel)."""
        t = 3.0
        _, ch = open_ranks(2, job="crowded", timeout=STEP_TIMEOUT)
        calls: dict[str, Callable[[], object]] = {
            f"get {i}": partial(ch.get, f"crowded/never{i}", timeout=t) for i in range(8)
        }
        calls["all_gather"] = lambda: ch.all_gather("crowded/ag", b"x", timeout=t)
        calls["barrier"] = lambda: ch.barrier("crowded/b", timeout=t)
        timings = self._time_all(calls, t)
        limit = t + self.slack(t)
        for name, timed in timings.items():
            # Or, behind a relay too loaded to answer a wait's last look within the reply's
            # grace (a quarter of a second), that look's own ChannelClosed, as before.
            late = isinstance(timed.err, dp.ChannelClosed) and "reply from the node relay" in str(timed.err)
            assert isinstance(timed.err, dp.ControlTimeout) or late, f"{name}: {timed}"
            assert timed.took - timed.starved <= limit, f"{name} (timeout={t:g}) took {timed}"
        assert ch.failure is None, f"the channel failed: {ch.failure}"
        ch.set("crowded/after", b"1")
        assert ch.get("crowded/after", timeout=STEP_TIMEOUT) == b"1"

    @pytest.mark.timeout(120)
    def test_a_channel_dropped_unclosed_after_its_coordinator_died_is_collected_without_a_hang(
        self, channel_url: str
    ) -> None:
        """An error path drops its channel without closing it after the coordinator (or
        store) died: once the channel has failed (a call raised ChannelClosed), nothing of
        its own keeps it alive, and collecting it releases what it holds without waiting on
        anything. It was used from several threads first (a transport may keep state per
        thread). All of it runs on a thread of its own, so that a collection that hangs
        fails the test instead of holding the process. Where there is no coordinator of the
        channel's own to kill (ranks that are threads of one process, a store in a file), the
        channel's own liveness is stopped instead."""
        t = self.PROMISE
        served = self.cross_process and _network_path(channel_url)
        with contextlib.ExitStack() as stack:
            if served:
                server = stack.enter_context(self.silenceable_server(channel_url))
                url, job = with_options(server.url, **FAST_LIVENESS), getattr(server, "job", "dropped")
            else:
                url, job = with_options(channel_url, **FAST_LIVENESS), "dropped"
                holder = dp.connect(url, rank=0, world_size=2, job=job, timeout=t)
                stack.callback(_close_quietly, holder)
            outcome: list[object] = []

            def drop() -> None:
                try:
                    ch = dp.connect(url, rank=1, world_size=2, job=job, timeout=t)
                    run_all([partial(ch.set, f"dropped/{i}", b"x") for i in range(3)])
                    deadline = time.monotonic() + STEP_TIMEOUT
                    if served:
                        os.kill(server.pid, signal.SIGKILL)
                        while True:
                            try:
                                ch.get("dropped/0", timeout=1)
                            except dp.ChannelClosed:
                                break
                            except dp.ControlError:
                                pass  # a call that failed, not yet the channel
                            if time.monotonic() > deadline:
                                outcome.append(f"no call raised ChannelClosed {STEP_TIMEOUT:g}s after the death")
                                return
                            time.sleep(0.1)
                    else:
                        _stop_liveness(ch)
                    gone = weakref.ref(ch)
                    del ch
                    while gone() is not None and time.monotonic() < deadline:
                        gc.collect()
                        time.sleep(0.1)
                    held = gone()
                    outcome.append(held is None or f"the failed channel is still referenced, by {_referrers(held)}")
                    del held
                except BaseException as err:
                    outcome.append(err)

            worker = threading.Thread(target=drop, name="dp-test-drop", daemon=True)
            worker.start()
            worker.join(STEP_TIMEOUT + 30)
            assert not worker.is_alive(), "collecting a channel dropped without close hung"
            if isinstance(outcome[0], BaseException):
                raise outcome[0]
            assert outcome == [True], outcome


class _Served:
    def __init__(self, url: str, pid: int, job: str) -> None:
        self.url, self.pid, self.job = url, pid, job


_silenced = itertools.count()


def _connect_and_close(url: str, timeout: float) -> None:
    dp.connect(url, rank=1, world_size=2, job="nothing", timeout=timeout).close()


def _close_quietly(ch: dp.ControlChannel) -> None:
    try:
        ch.close()
    except dp.ControlError:
        pass


def _control_error(err: BaseException) -> bool:
    """A ControlError, or what torch's interfaces over a channel raise for one (a Store's
    DistStoreError, a rendezvous backend's RendezvousError)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousError

    return isinstance(err, dp.ControlError | dist.DistStoreError | RendezvousError)


class StatusTests(ChannelHarness):
    """What ranks publish of themselves (``channel.status``), read by a channel that holds no
    rank and never joins (:func:`dataparallel.observe`, behind ``dataparallel status``)."""

    @pytest.mark.timeout(120)
    def test_an_observer_reads_what_each_rank_is_doing_and_who_a_stall_waits_for(
        self, channel_url: str, open_ranks: OpenRanks
    ) -> None:
        """Three ranks of a job with a token; ranks 0 and 1 publish (rank 0 in ``backward`` of
        step 7, rank 1 still in ``data`` of that step), rank 2 does not. An observer with the
        token sees each rank's host, pid, phase, epoch and step, rank 2 joined without a
        record, and names rank 1 as the rank rank 0 waits for once rank 0 has waited past the
        threshold; a rank that closes reads as closed; the observer's writes are refused. One
        with another token is refused (AuthError); one of a job that has no run is refused
        (ControlError) and starts none: that job then starts with any size."""
        from dataparallel.control.status import diagnose, read_job

        token = "status-token"
        chs = open_ranks(3, job="observed", token=token)
        for ch, phase in zip(chs[:2], ("backward", "data"), strict=False):
            ch.status.at(epoch=1, step=7)
            ch.status.enter(phase)
            ch.status.publish(interval=0.2)
        observer = dp.observe(channel_url, job="observed", token=token, timeout=STEP_TIMEOUT)
        try:
            deadline = time.monotonic() + STEP_TIMEOUT
            while True:
                view = read_job(observer)
                ranks = view["ranks"]
                if all(r["phase_s"] is not None and r["phase_s"] > 0.6 for r in ranks[:2]):
                    break
                assert time.monotonic() < deadline, f"no records of ranks 0 and 1 read: {ranks}"
                time.sleep(0.1)
            assert view["job"] == "observed" and view["world_size"] == 3, view
            for rank, phase in ((0, "backward"), (1, "data")):
                entry = ranks[rank]
                assert entry["host"] == socket.gethostname() and entry["pid"] == os.getpid(), entry
                where = (entry["phase"], entry["epoch"], entry["step"], entry["state"])
                assert where == (phase, 1, 7, "running"), entry
                assert 0 <= entry["heartbeat_age"] < 5, entry
            assert ranks[2]["state"] == "joined" and ranks[2]["phase"] is None, ranks[2]
            assert ranks[2]["pid"] == os.getpid(), ranks[2]
            stalls = diagnose(ranks, threshold=0.5)
            assert [(s["rank"], s["phase"], s["waiting"]) for s in stalls] == [(1, "data", [0])], stalls
            assert "'data'" in stalls[0]["cause"] and "'backward'" in stalls[0]["cause"], stalls
            assert diagnose(ranks, threshold=60) == [], "no stall below the threshold"
            with pytest.raises(dp.ConfigError, match="reads only"):
                observer.set("written", b"by an observer")
            chs[1].close()
            assert read_job(observer)["ranks"][1]["state"] == "closed"
        finally:
            observer.close()
        with pytest.raises(dp.AuthError):
            dp.observe(channel_url, job="observed", token="another-token", timeout=STEP_TIMEOUT).close()
        with pytest.raises(dp.ControlError, match="no run"):
            dp.observe(channel_url, job="unstarted", token=token, timeout=STEP_TIMEOUT).close()
        (alone,) = open_ranks(1, job="unstarted", token=token)
        alone.set("k", b"v")

    @pytest.mark.timeout(60)
    def test_a_ranks_record_rides_on_its_heartbeats(self, channel_url: str, open_ranks: OpenRanks) -> None:
        """Published at the heartbeat interval, a rank's record rides on its heartbeats where
        its kind of liveness says it carries writes (``Liveness.carries_writes``: inside a
        coordinator's heartbeat request, or in the tick of a store's beat), and its own
        thread writes none of it; where the kind does not, that thread writes it. Either way
        the record goes on advancing, read by its peer; once the rank stops publishing, its
        last record (in ``done``) stays, and no beat writes another after it."""
        from dataparallel.control.status import status_key

        a, b = open_ranks(2, job="riding", url=with_options(channel_url, **FAST_LIVENESS))
        writers: list[str] = []
        key = a._scoped(status_key(0))
        original = a._set

        def spy(k: str, value: bytes) -> None:
            if k == key:
                writers.append(threading.current_thread().name)
            original(k, value)

        a._set = spy  # type: ignore[method-assign, assignment]
        a.status.at(epoch=0, step=1)
        a.status.publish()
        liveness = a._liveness
        assert liveness is not None
        assert a.status.carried == liveness.carries_writes, (a.status.carried, type(liveness).__name__)

        def record() -> dict[str, Any]:
            return dict(json.loads(b._get(key, STEP_TIMEOUT) or b"{}"))

        first, deadline = record().get("seq", 0), time.monotonic() + STEP_TIMEOUT
        while record().get("seq", 0) < first + 3:
            assert time.monotonic() < deadline, f"the record stood at {record()} (first seq {first})"
            time.sleep(FAST_LIVENESS["heartbeat"] / 2)
        from_thread = [w for w in writers if w.startswith("dp-status")]
        if liveness.carries_writes:
            assert not from_thread, f"written by the status thread though carried: {writers}"
        else:
            assert from_thread, f"not written by the status thread, nor carried: {writers}"
        a.status.stop(last_phase="done")
        last = record()
        assert last.get("phase") == "done", last
        time.sleep(4 * FAST_LIVENESS["heartbeat"])  # beats after the stop carry nothing
        assert record() == last, f"written after the last record: {record()} after {last}"
        assert not a.status.carried


class RelayedConformance(
    StatusTests, PrimitiveTests, MembershipTests, StoreTests, CollectiveTests, LivenessTests, RunTests, TimeoutTests
):
    """The suite's key/value, membership, Store, collective, liveness, run, status and
    timeout tests with every rank, and every channel that holds no rank, behind a node relay of a
    farm (:mod:`.relayfarm`) joined to the channel under test. Subclass it and define an
    ``upstream_url`` fixture: what ``channel_url`` is for :class:`ChannelConformance`; where
    the transport's store is no rank's (``etcd://``), override :meth:`upstream_server` too, as
    its own suite overrides ``silenceable_server``. (The linearizability workload through
    relays, under faults, is ``RelayTests``, part of :class:`ChannelConformance`.)"""

    @contextlib.contextmanager
    def silenceable_server(self, channel_url: str) -> Iterator[SilencedServer]:
        """The upstream's coordinator or store in a process of its own
        (:meth:`upstream_server`), which the ranks reach through the farm's relays; where the
        upstream has no HOST:PORT and no server of its own, a relayed rank 0 in a process of
        its own is the peer to freeze or kill, as :class:`TimeoutTests`' default has it."""
        upstream = channel_url[len(relayfarm.PREFIX) :]
        own = type(self).upstream_server is not RelayedConformance.upstream_server
        if not own and not _network_path(upstream):
            with TimeoutTests.silenceable_server(self, channel_url) as served:
                yield served
            return
        with self.upstream_server(upstream) as served:
            job = getattr(served, "job", "silenced")
            yield cast(SilencedServer, _Served(relayfarm.PREFIX + served.url, served.pid, job))

    @pytest.mark.timeout(60)
    def test_a_job_behind_relays_is_observed_on_their_channel_by_its_own_name(
        self, upstream_url: str, open_ranks: OpenRanks
    ) -> None:
        """What ``dataparallel status URL --job JOB`` does for a job behind node relays:
        ``dp.observe`` at the channel the relays joined, naming the ranks' job, reads every
        rank (the relays' job, and the ranks' run behind it); the job is shown by its own
        name; another token is refused (AuthError), as for a job of direct ranks."""
        from dataparallel.control.status import read_job

        token = "relayed-token"
        chs = open_ranks(3, job="behind", token=token)
        chs[0].status.at(epoch=1, step=2)
        chs[0].status.enter("backward")
        chs[0].status.publish(interval=0.2)
        with dp.observe(upstream_url, job="behind", token=token, timeout=STEP_TIMEOUT) as observer:
            deadline = time.monotonic() + STEP_TIMEOUT
            while True:
                view = read_job(observer)
                if view["ranks"] and view["ranks"][0]["phase"] == "backward":
                    break
                assert time.monotonic() < deadline, f"rank 0's record not read: {view}"
                time.sleep(0.1)
            assert view["job"] == "behind" and view["world_size"] == 3, view
            assert [r["state"] for r in view["ranks"]] == ["running", "joined", "joined"], view["ranks"]
            assert all(r["pid"] == os.getpid() for r in view["ranks"]), view["ranks"]
        with pytest.raises(dp.AuthError):
            dp.observe(upstream_url, job="behind", token="another-token", timeout=STEP_TIMEOUT).close()

    @contextlib.contextmanager
    def upstream_server(self, upstream_url: str) -> Iterator[SilencedServer]:
        """A server of the upstream transport's to freeze or kill: by default a rank 0 of its
        own that hosts it (:meth:`TimeoutTests.silenceable_server` on the upstream's URL)."""
        with TimeoutTests.silenceable_server(self, upstream_url) as served:
            yield served

    @pytest.fixture
    def relay_farm(self, upstream_url: str) -> Iterator[relayfarm.RelayFarm]:
        with relayfarm.running(upstream_url.partition("://")[0]) as farm:
            yield farm

    @pytest.fixture
    def channel_url(self, upstream_url: str, relay_farm: relayfarm.RelayFarm) -> str:
        return relayfarm.PREFIX + upstream_url


class ChannelConformance(
    StatusTests,
    PrimitiveTests,
    MembershipTests,
    CollectiveTests,
    LivenessTests,
    RunTests,
    StoreTests,
    LinearizabilityTests,
    RelayTests,
    TimeoutTests,
):
    """The whole suite. Subclass it and define the ``channel_url`` fixture."""
