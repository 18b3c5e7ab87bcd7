"""``tcpstore://HOST:PORT``: torch's own ``TCPStore`` behind the channel interface.

The baseline the other transports are measured against. Rank 0 (or, with ``rank=None``,
whichever process binds the port first) hosts the store in-process. Jobs share the
server's key space under a ``JOB/`` prefix, so ``num_keys`` counts every job's keys. A
TCPStore client serialises its calls, so each thread gets its own connection (``clone``
of the store made at connect, which only keeps the server, when hosting, alive); a
connection that fails is dropped, and that thread's next call opens a new one.
The token is only checked for agreement: TCPStore has no authentication.

TCPStore's client waits for a reply without a bound, so a call to a frozen coordinator
would never return: when the channel fails (its heartbeats unanswered for the liveness
timeout), it shuts down its own connections' sockets, found by their local ports, and the
blocked calls return with the channel's failure; a connection being made (whose answer
torch waits for without a bound too) is waited for on a thread of its own. Each call is
bounded the same way by its own timeout (:class:`_Deadlines`): unanswered by then, its
connection's sockets are shut down and it raises ChannelClosed.

Every call into TCPStore runs under :func:`~dataparallel.control.nativelog.quiet_torch_log`: what it
would log in C++ on the way (a refused connection retried, a wait expired, a coordinator
gone), the channel reports as its own one-line error.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol, TypeVar, cast

import torch.distributed as dist

from dataparallel.control.channel import ControlChannel
from dataparallel.control.nativelog import quiet_torch_log
from dataparallel.control.registry import ChannelURL
from dataparallel.errors import ChannelClosed, ConfigError, ControlError

T = TypeVar("T")


class Connection(Protocol):
    """A TCPStore connection as torch's runtime has it: values are bytes (torch's stubs say
    str) and there are ``clone``, ``multi_set`` and ``append`` (which its stubs lack)."""

    port: int

    def set(self, key: str, value: bytes) -> None: ...
    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def delete_key(self, key: str) -> bool: ...
    def check(self, keys: list[str]) -> bool: ...
    def num_keys(self) -> int: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def multi_set(self, keys: list[str], values: list[bytes]) -> None: ...
    def append(self, key: str, value: bytes) -> None: ...
    def clone(self) -> Connection: ...
    def set_timeout(self, timeout: timedelta) -> None: ...


def _connection(store: dist.TCPStore) -> Connection:
    """``store`` typed as what it is at runtime (see :class:`Connection`)."""
    return cast(Connection, store)


class _SentUnanswered(Exception):
    """A write went out on a connection that then failed before the request after it (which
    has a reply) was answered: the write may have been applied."""


#: Beyond a wait's own timeout, how long a call gives TCPStore's answer to arrive: a wait that
#: expires at the server is a timeout, one unanswered by then a store gone silent.
ANSWER_GRACE = 0.2


class _Deadlines:
    """Bounds the torch calls of a channel's threads: a call still unanswered at its deadline
    has its connection's sockets shut down (the blocked call then raises), one watcher thread
    for the channel, started on first use."""

    def __init__(self, channel: TCPStoreChannel) -> None:
        self._ch = weakref.ref(channel)
        self._cond = threading.Condition()
        self._due: dict[threading.Thread, float] = {}
        self.expired: set[threading.Thread] = set()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def arm(self, seconds: float) -> None:
        with self._cond:
            self.expired.discard(threading.current_thread())
            self._due[threading.current_thread()] = time.monotonic() + seconds
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="dp-tcpstore-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> bool:
        """Whether this thread's call expired (its connection is then dead)."""
        with self._cond:
            self._due.pop(threading.current_thread(), None)
            return threading.current_thread() in self.expired

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                late = [t for t, due in self._due.items() if due <= now]
                for thread in late:
                    del self._due[thread]
                    self.expired.add(thread)
                if not late:
                    self._cond.wait(min([*self._due.values(), now + 1.0]) - now)
            ch = self._ch()
            if ch is None:
                return
            if late:
                ch._shut_down({port for t in late for port in ch._clients.get(t, (None, set()))[1]})
            del ch


class TCPStoreChannel(ControlChannel):
    scheme = "tcpstore"
    # Each timed-out TCPStore wait logs a C++ warning: poll for lost peers less often.
    liveness_poll = 5.0
    # torch's server stops answering while it looks a new client's address up in DNS (up to
    # the resolver's 5 s): not a frozen coordinator.
    store_stall = 5.0
    survives_frozen_writers = True  # torch's store server applies each request whole

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._address = f"{url.host}:{url.require_port()}"
        self._host_port = (url.host, url.require_port())
        self._prefix = f"{self.job}/"
        self._lock = threading.Lock()
        self._hosting = False
        self._peer = _addresses(url.host), url.require_port()  # the coordinator, as sockets name it
        # Not under _lock_for: a process hosting the store and joining it from another thread
        # opens both at once. (A clone made in that moment might take this socket for its own:
        # _fail would then shut down the root connection too, which serves no call.)
        self._root: Connection | None = self._open(url.host, url.require_port())
        #: Each thread's connection and the local ports of its sockets (see _fail), by the
        #: thread: a new thread gets a new connection even where it reuses a dead one's ident.
        self._clients: weakref.WeakKeyDictionary[threading.Thread, tuple[Connection, set[int]]] = (
            weakref.WeakKeyDictionary()
        )
        #: A value no rank stores (see _get).
        self._absent = b"\0dp-absent\0" + os.urandom(12)
        self._deadlines = _Deadlines(self)

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        url.require_port()
        if len(url.hosts) != 1 or url.path:
            raise ConfigError(f"{url.shown!r}: expected {cls.url_form(url)} (one store)")

    def _open(self, host: str, port: int) -> Connection:
        wait = timedelta(seconds=self.timeout)
        if self.rank in (None, 0) and self.may_host:
            try:
                with quiet_torch_log():
                    store = dist.TCPStore(host, port, is_master=True, timeout=wait, wait_for_workers=False)
                self._hosting = True
                return _connection(store)
            except (dist.DistNetworkError, RuntimeError):
                pass  # the port is taken: a store is already served there (another job's, or standalone)
        # torch's connect retries a refused connection past its timeout (by half of it, or
        # more, measured): the wait for a listener is ours, on this thread, to the deadline;
        # torch is called once one answers, and its answer waited for on a helper thread.
        deadline = time.monotonic() + self.timeout
        _await_listener(host, port, self.timeout)
        made: list[Connection | BaseException] = []

        def connect() -> None:
            try:
                with quiet_torch_log():
                    made.append(_connection(dist.TCPStore(host, port, is_master=False, timeout=wait)))
            except BaseException as err:
                made.append(err)

        helper = _start_helper(connect, "dp-tcpstore-open", self._peer)
        helper.join(max(deadline - time.monotonic(), 0.0))
        result = made[0] if made else TimeoutError("no answer")
        if isinstance(result, BaseException):
            raise ChannelClosed(f"no TCPStore reachable at {host}:{port} within {self.timeout:g}s: {result}") from None
        return result

    @property
    def hosts_coordinator(self) -> bool:
        return self._hosting

    @property
    def port(self) -> int:
        if self._root is None:
            raise ChannelClosed(f"{self!r} is closed")
        return self._root.port

    def _client(self, within: float | None = None) -> Connection:
        thread = threading.current_thread()
        entry = self._clients.get(thread)
        if entry is None:
            within = self.timeout if within is None else within
            start = time.monotonic()
            # Another thread's new connection may be waiting on a frozen coordinator: not past ours.
            if not self._lock.acquire(timeout=within):
                raise ChannelClosed(f"TCPStore at {self._address}: no new connection within {within:.1f}s")
            try:
                entry = self._clone(max(start + within - time.monotonic(), 0.0))
                self._clients[thread] = entry
            finally:
                self._lock.release()
        return entry[0]

    def _clone(self, within: float) -> tuple[Connection, set[int]]:
        """A connection of its own and the local ports of its sockets: a clone of the store
        opened at connect, within the channel's timeout. A new TCPStore connection looks the
        peer's address up in DNS (torch's socket logging, on both ends); where the resolver
        is slow or drops a query, that takes its timeout (5 s), so a shorter bound would turn
        it into a false failure. torch's clone waits for the server's answer without a bound
        of its own (a frozen coordinator accepts connections in its kernel, never answers),
        so it runs on a thread of its own, and the caller leaves with the channel's failure
        once there is one, or after ``within`` seconds (its call's timeout)."""
        root = self._root
        if root is None:
            raise ChannelClosed(f"{self!r} is closed")
        give_up = time.monotonic() + within
        # torch's connect retries a refused connection for the store's whole timeout, past any
        # exit of this process (a helper still in it then aborts the exit): it is called only
        # once something listens, which this thread waits for, watching the channel's failure.
        _await_listener(*self._host_port, within, watch=self._raise_failure)
        made: list[Connection | BaseException] = []
        ports: set[int] = set()

        def connect() -> None:
            try:
                with _lock_for(self._peer):  # the socket that appears meanwhile is the clone's
                    before = _connections_to(*self._peer)
                    try:
                        with quiet_torch_log():
                            made.append(root.clone())
                    finally:
                        ports.update(_connections_to(*self._peer).keys() - before.keys())
            except BaseException as err:
                made.append(err)

        helper = _start_helper(connect, f"dp-tcpstore-connect-r{self.rank}", self._peer)
        while helper.is_alive():
            helper.join(0.05)
            self._raise_failure()
            if helper.is_alive() and time.monotonic() >= give_up:
                raise ChannelClosed(f"TCPStore at {self._address}: no new connection within {within:.1f}s")
        result = made[0]
        if isinstance(result, (dist.DistError, RuntimeError, OSError)):
            raise ChannelClosed(f"TCPStore at {self._address} unreachable: {result}") from result
        if isinstance(result, BaseException):
            raise result
        result.set_timeout(timedelta(seconds=self.timeout))
        return result, ports

    def _fail(self, error: ControlError) -> None:
        """Fail the channel and release its calls blocked on a connection (a frozen
        coordinator): shutting a socket down ends the recv torch's client waits in."""
        super()._fail(error)
        if self._hosting:
            return  # the coordinator is this process: not frozen while this runs
        self._shut_down({port for _, ports in list(self._clients.values()) for port in ports})

    def _shut_down(self, mine: set[int]) -> None:
        """Shut down the sockets of this channel's connections with these local ports."""
        if mine:
            _shut_down_connections(self._peer, mine)

    def _call(
        self, op: Callable[[Connection], T], read: bool = False, within: float | None = None, grace: float = 0.0
    ) -> T:
        """Run ``op`` on this thread's connection: the one place TCPStore's errors become the
        channel's. A ``DistStoreError`` (an expired wait) passes through for ``_wait``; any
        other failure drops the connection (a reply still on its way would otherwise be read
        as the next request's).

        A connection that failed is dropped and the call tried again on a new one, for up to
        ``liveness_timeout`` seconds, when that cannot apply anything twice: a read, or a
        request that never left (its send failed: "Broken pipe"; not so for a write followed
        by a request on the same connection, see :meth:`_acked`). A write whose reply was
        lost may have been applied: ChannelClosed (TCPStore has no request ids to dedupe a
        re-sent one).

        The whole call takes at most ``within`` seconds (default: the channel's timeout): a
        connection, retries and the answer included; past that, ChannelClosed. ``grace`` more
        seconds are given to the answer alone (not to a connection): a wait's expiry, which
        the store sends at the wait's end."""
        # Within what is left of the collective this call is part of, and of close's timeout.
        bound = self._call_bound(self.timeout if within is None else within)
        start = time.monotonic()
        deadline = start + min(self.liveness_timeout, bound)
        while True:
            self._raise_failure()
            client = self._client(max(start + bound - time.monotonic(), 0.0))
            self._deadlines.arm(max(start + bound + grace - time.monotonic(), 0.0))
            try:
                with quiet_torch_log():
                    return op(client)
            except dist.DistStoreError:
                raise
            except dist.DistNetworkError as err:
                self._drop_connection()
                self._raise_failure()  # a call released by _fail
                if self._deadlines.disarm():
                    raise _Expired(f"TCPStore at {self._address}: no answer within {bound:.1f}s") from None
                unsent = "Broken pipe" in str(err)
                if not (read or unsent) or time.monotonic() > deadline:
                    raise ChannelClosed(f"TCPStore at {self._address}: connection failed: {err}") from err
                time.sleep(0.05)
            except _SentUnanswered as err:
                self._drop_connection()
                self._raise_failure()  # released by _fail
                if self._deadlines.disarm():
                    raise ChannelClosed(
                        f"TCPStore at {self._address}: no answer within {bound:.1f}s after a write was sent "
                        "(it may have been applied)"
                    ) from None
                raise ChannelClosed(
                    f"TCPStore at {self._address}: connection failed after a write was sent (it may have "
                    f"been applied): {err.__cause__}"
                ) from err.__cause__
            except (dist.DistError, RuntimeError) as err:
                self._drop_connection()
                if self._deadlines.disarm():
                    raise _Expired(f"TCPStore at {self._address}: no answer within {bound:.1f}s") from None
                raise ControlError(f"TCPStore at {self._address}: {err}") from err
            finally:
                if self._deadlines.disarm():  # answered as its deadline passed: the connection is shut
                    self._drop_connection()

    def _raise_failure(self) -> None:
        """Raise the channel's failure, if it failed (not its closing: a closing rank still
        announces its departure)."""
        if self.failure is not None:
            raise self.failure

    def _drop_connection(self) -> None:
        """This thread's next call opens a new connection."""
        self._clients.pop(threading.current_thread(), None)

    def _acked(self, write: Callable[[Connection], None], key: str) -> None:
        """TCPStore's set, multi_set and append send no reply: follow one with a request that
        has one on the same connection (the server answers in order), so the write has been
        applied when this returns and a read by any rank sees it. Once the write's send has
        returned, a failure of the check may follow a write the server applied (its bytes
        left before the connection broke): never sent again."""

        def acked(store: Connection) -> bool:
            write(store)  # a "Broken pipe" here: nothing left, safe to send again
            try:
                return store.check([key])
            except dist.DistNetworkError as err:
                raise _SentUnanswered() from err

        self._call(acked)

    def _set(self, key: str, value: bytes) -> None:
        full = self._prefix + key
        self._acked(lambda s: s.set(full, value), full)

    def _wait(self, full: list[str], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the (prefixed) keys; False on timeout."""
        wait = timedelta(seconds=max(timeout, 1e-3))
        try:
            self._call(lambda s: s.wait(full, wait), read=True, within=max(timeout, ANSWER_GRACE), grace=ANSWER_GRACE)
        except dist.DistStoreError:  # TCPStore's error for an expired wait (network: DistNetworkError)
            return False
        except _Expired:
            # No answer by the wait's end, not even torch's own "timed out" (a loaded store
            # sends it late): the keys did not come within the timeout. A store that is gone
            # is the liveness watch's to tell; the connection is dropped, so no late answer
            # is read as another request's.
            return False
        return True

    def _read(self, full: str, within: float | None = None) -> bytes | None:
        """The value of a (prefixed) key, None if missing, in one atomic request: compare_set
        with a sentinel nobody stores returns the value, or the sentinel when the key is
        missing (torch's semantics), and writes nothing. (A wait-then-get would return b""
        for a key deleted in between.)"""
        value = self._call(lambda s: s.compare_set(full, self._absent, self._absent), read=True, within=within)
        return None if value == self._absent else value

    def _get(self, key: str, timeout: float) -> bytes | None:
        full, deadline = self._prefix + key, time.monotonic() + timeout
        while True:
            try:
                value = self._read(full, max(deadline - time.monotonic(), ANSWER_GRACE))
            except _Expired:  # unanswered by the wait's end: nothing came within the timeout (see _wait)
                if time.monotonic() < deadline:
                    raise
                return None
            if value is not None:
                return value
            if not self._wait([full], deadline - time.monotonic()):
                return None

    def _add(self, key: str, amount: int) -> int:
        full = self._prefix + key
        start = time.monotonic()
        try:
            return self._call(lambda s: s.add(full, amount))
        except ChannelClosed as err:
            # TCPStore's server hangs up on an add to a value that is not a number: say so
            # (looked at within what is left of the add's timeout).
            try:
                current = self._read(full, max(start + self.timeout - time.monotonic(), 0.0))  # _call bounds it
            except ControlError:
                raise err from None
            if current is not None and not current.lstrip(b"-").isdigit():
                raise ValueError(f"current value {current[:32]!r}") from None
            raise

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(lambda s: s.compare_set(self._prefix + key, expected, desired))

    def _delete(self, key: str) -> bool:
        return self._call(lambda s: s.delete_key(self._prefix + key))

    def _check(self, keys: Sequence[str]) -> bool:
        return self._call(lambda s: s.check([self._prefix + k for k in keys]), read=True)

    def _num_keys(self) -> int:
        return self._call(lambda s: s.num_keys(), read=True)

    def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        full = [self._prefix + k for k in keys]
        if not self._wait(full, timeout):
            return None
        return self._call(lambda s: s.multi_get(full), read=True, within=ANSWER_GRACE, grace=ANSWER_GRACE)

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        keys = [self._prefix + k for k, _ in items]
        self._acked(lambda s: s.multi_set(keys, [v for _, v in items]), keys[0])

    def _append(self, key: str, value: bytes) -> None:
        full = self._prefix + key
        self._acked(lambda s: s.append(full, value), full)

    def _close(self) -> None:
        self._deadlines.stop()
        with self._lock, quiet_torch_log():
            # Dropping the last reference to the hosting store stops its server.
            self._clients.clear()
            self._root = None


class _Expired(ChannelClosed):
    """A call that outlived its bound (:class:`_Deadlines` shut its connection down)."""


#: Held while a connection to a coordinator is made (one lock per coordinator address), so
#: that a new socket to it is that connection's.
_CONNECTING: dict[tuple[frozenset[str], int], threading.Lock] = {}
_CONNECTING_LOCK = threading.Lock()


def _lock_for(peer: tuple[set[str], int]) -> threading.Lock:
    key = (frozenset(peer[0]), peer[1])
    with _CONNECTING_LOCK:
        return _CONNECTING.setdefault(key, threading.Lock())


def _await_listener(host: str, port: int, within: float, watch: Callable[[], None] = lambda: None) -> None:
    """Return once something at host:port takes a TCP connection (closed again at once);
    ChannelClosed after ``within`` seconds if nothing has. ``watch`` is called between
    attempts (it may raise: a channel's failure ends the wait)."""
    deadline = time.monotonic() + within
    pause, last = 0.01, "no answer"
    while True:
        watch()
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelClosed(f"no TCPStore reachable at {host}:{port} within {within:g}s: {last}")
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return
        except OSError as err:
            last = err.strerror or type(err).__name__
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, 0.25)


#: Helper threads inside a torch call, by the coordinator they talk to. A thread still in
#: C++ when the interpreter finalizes exits (pthread_exit) as it takes the GIL back, which
#: unwinds through pybind11's noexcept frames: the process aborts ("terminate called
#: without an active exception", SIGABRT) instead of exiting with its own status. At exit
#: (:func:`_end_helpers`), their connections are shut down and they are waited for.
_HELPERS: dict[threading.Thread, tuple[set[str], int]] = {}
_HELPERS_LOCK = threading.Lock()
#: How long the exit waits for the helpers, in all, once their connections are shut down.
HELPERS_AT_EXIT = 5.0


def _start_helper(target: Callable[[], None], name: str, peer: tuple[set[str], int]) -> threading.Thread:
    """Run ``target`` (a torch call talking to ``peer``) on a daemon thread that the
    process's exit waits for."""

    def run() -> None:
        try:
            target()
        finally:
            with _HELPERS_LOCK:
                _HELPERS.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _HELPERS_LOCK:
        _HELPERS[thread] = peer
    thread.start()
    return thread


@atexit.register
def _end_helpers() -> None:
    """Release the helpers still in a torch call (shut their coordinators' connections
    down: the call then fails) and wait for them, up to :data:`HELPERS_AT_EXIT` seconds.
    Registered at import, so it runs after any exit handler that closes a channel."""
    with _HELPERS_LOCK:
        running = dict(_HELPERS)
    if not running:
        return
    for addresses, port in set((frozenset(a), p) for a, p in running.values()):
        _shut_down_connections((set(addresses), port))
    deadline = time.monotonic() + HELPERS_AT_EXIT
    for thread in running:
        thread.join(max(deadline - time.monotonic(), 0.0))


def _shut_down_connections(peer: tuple[set[str], int], local_ports: set[int] | None = None) -> None:
    """Shut down this process's connections to ``peer`` (those with these local ports, or
    all): a torch call blocked on one returns with an error."""
    for local_port, sock in _connections_to(*peer, keep=True).items():
        with sock:
            if local_ports is None or local_port in local_ports:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` stands for (empty if it does not resolve now)."""
    try:
        return {_plain(str(info[4][0])) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _plain(address: str) -> str:
    """An IP address as one spelling: IPv4-mapped IPv6 (a dual-stack socket's view) as IPv4."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _connections_to(addresses: set[str], port: int, keep: bool = False) -> dict[int, socket.socket]:
    """This process's TCP connections to ``port`` on one of ``addresses`` (any address when
    it is empty), by local port: each as a socket on a duplicate of its descriptor when
    ``keep`` (the caller closes them), else closed again. Linux (``/proc/self/fd``); an empty
    map elsewhere (a blocked call is then released only when the coordinator's process ends)."""
    found: dict[int, socket.socket] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            copy = os.dup(fd)
        except (ValueError, OSError):
            continue
        try:
            sock = socket.socket(fileno=copy)
        except OSError:  # closed and reused by something else meanwhile
            os.close(copy)
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                peer = sock.getpeername()
                if peer[1] == port and (not addresses or _plain(peer[0]) in addresses):
                    found[sock.getsockname()[1]] = sock
                    continue
        except (OSError, ValueError):
            pass
        sock.close()
    if not keep:
        for sock in found.values():
            sock.close()
    return found
