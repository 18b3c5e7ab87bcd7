"""The node relay's local leg: a node's ranks reach their relay through shared memory and
eventfds, never a socket round trip.

**Joining.** The relay listens on a Unix socket in a directory only its user may enter (the
directory 0700, the socket 0600), and checks every connecting process's user id with
``SO_PEERCRED``: another user is refused before anything is shared. A rank that is let in says
which local rank it is and receives, over that socket (``SCM_RIGHTS``), a memfd holding its own
slots (no other rank's), its doorbell (an eventfd the rank rings and the relay watches), one
eventfd bell per slot (the relay rings, the calling thread waits on it), and the node's barrier
objects (below). From then on the socket carries nothing: its end tells the relay that the
rank closed or died, and a pidfd of the rank's process (from the kernel's credentials, not from
anything the rank says) tells it that the process is gone, whether or not anything closed.

**A call.** A calling thread takes one of its rank's free slots, writes the request (an
operation number and its bytes) and then the request's sequence number into it, and rings its
rank's doorbell. The relay, woken for that rank, finds its slots whose request is ahead of the
one seen last, hands each
to its handler and, once the handler answers (at once or later, from any thread), writes the
reply, then the reply's sequence number, and rings that slot's bell. Each side writes only its
own fields; the eventfd write and read between them order the memory (both are system calls).
A rank has several slots, so that a thread blocked in a long call (a get waiting for its key)
never holds up another thread's call.

**A barrier** takes no slot and no handler call per rank, and wakes the relay once: a rank
writes the barrier's generation (its count of barriers so far) and its name into its area
and takes a token from the node's semaphore (an eventfd holding one token fewer than the
ranks still to arrive); the rank that finds none left is the last, and rings the node's
arrivals eventfd. The relay then checks every rank's generation and calls its barrier
handler once for the node. The handler (a relay sends the node's one upstream request there)
releases the generation with an outcome: the relay loads the semaphore for the next
generation, writes the outcome into the node's area, read-only to the ranks, and rings that
generation's release eventfd once, which wakes every rank waiting on it (four rotate; each
is emptied two generations before its next use, when no rank can still wait on it). The
tokens only save wake-ups: a rank that finds none too early rings for nothing (the relay
finds a rank missing), and should a rank that gave up on a barrier arrive at the next while
the relay loads it, the relay still looks once a second. A rank that gave up waiting (its
timeout) has still arrived: the next barrier it enters is the next generation, as with any
channel.

**Guests and seats.** A process may join without a seat (a local rank): one that holds no
rank (an observer, ``rank=None`` before its rank is known) or whose rank's seat is held by a
live process (its claim upstream then says by whom, as a directly connected rank's would).
A guest's calls pass through like any rank's, but it is in no barrier and nobody watches it.
It takes a seat with :data:`SEAT`: the one its rank names, or the lowest free one; a seat
held by a process whose end was not read yet, or by a member the relay declared lost
(``may_replace``), is taken from it. Each joined connection is a member of its own (its
:attr:`Call.incarnation`): a process that connects again, its rank's new channel, is not the
member that was declared lost.

**Liveness.** A rank stamps its slot area with ``time.monotonic()`` (one clock for every
process on the machine) whenever it is asked to beat; the relay reads how long each rank has
been silent. A killed rank is seen at once through its pidfd; a frozen one by its silence.

Why hand-written: the relay and its ranks are processes of one user on one machine, and what
this needs (a request slot, a wake-up, a death notice) is three kernel objects; a library
(ZeroMQ's ipc, gRPC over a Unix socket) would add a socket round trip and its I/O thread to
every call, which is the cost the relay exists to remove.
"""

from __future__ import annotations

import collections
import errno
import itertools
import json
import logging
import mmap
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ...errors import AuthError, BadMessage, ChannelClosed, ConfigError, ControlError, ControlTimeout

log = logging.getLogger(__name__)

#: Version of the local leg's layout and hello; a rank and a relay of another version refuse
#: each other at the hello.
#: What a reply too large for its slot is refused with (a caller may ask for less at once).
OVER_SLOT = "over the slot's"
LOCAL_PROTOCOL = 7  # 2: a rank registers its loss key (ops 11, 12 of the node relay); 3: barrier tokens;
#: 4: a rank registers its heartbeat key and liveness too (the relay beats for it); 5: and
#: its process record (written with its first beat); 6: guests and seats (SEAT); 7: the
#: relay's all_gather (op 16)

#: A guest's request for a seat (handled by the local leg itself, never by the relay's
#: handler): the job rank it wants, or -1 for any free one; answered with the local and job
#: rank it was given, or -1 for none.
SEAT = 64
_SEAT = struct.Struct("<q")
_SEATED = struct.Struct("<qq")

#: Slot header: request seq, reply seq, op, request length, status, reply length.
_HEADER = struct.Struct("<QQIIiI")
_HEADER_BYTES = 64
#: The rank's area starts with a head of its own: its heartbeat (a double, ``time.monotonic()``),
#: then the last barrier generation it arrived at and that barrier's name (length, bytes).
_AREA_HEAD = 320
_BEAT = struct.Struct("<d")
_incarnations = itertools.count(1)
_ARRIVAL = struct.Struct("<QId")  # at offset 8: generation, name length, timeout; the name follows
_GENERATION = struct.Struct("<Q")  # the generation alone
_NAME_AT = 8 + _ARRIVAL.size
_NAME_BYTES = _AREA_HEAD - _NAME_AT
#: The node's area (the relay writes, the ranks only read): ``_OUTCOMES`` records of
#: (generation, status, length, bytes) indexed by generation; a record's generation, written
#: last, is its release.
_OUTCOME = struct.Struct("<QiI")
_OUTCOMES = 4
_OUTCOME_BYTES = 4096
_NODE_BYTES = 64 + _OUTCOMES * (64 + _OUTCOME_BYTES)


def _outcome_at(generation: int) -> int:
    return 64 + (generation % _OUTCOMES) * (64 + _OUTCOME_BYTES)


def barrier_name(name: str) -> bytes:
    """A barrier's name as it crosses the local leg: the name, or where it is longer than the
    area holds, its head and a digest of the whole (the same on every rank of every node)."""
    import hashlib

    raw = name.encode("utf-8", errors="surrogatepass")
    if len(raw) <= _NAME_BYTES:
        return raw
    head = raw[: _NAME_BYTES - 33].decode("utf-8", errors="ignore").encode()  # whole characters only
    return head + b"#" + hashlib.blake2b(raw, digest_size=16).hexdigest().encode()


#: Reply statuses. A handler answers OK with its bytes or ERROR with a JSON error (its type
#: name and message), which the rank raises as that type.
OK, ERROR = 0, 1

_HELLO_MAX = 4096
#: Seconds a connecting process has to say its hello before it is dropped.
_HELLO_WITHIN = 5.0
#: Most slots a rank may have (their bells travel in one message).
MAX_SLOTS = 32
#: Slots a rank's waiting reads leave to its other calls (where it has more than this many).
KEPT_FREE = 1
#: Seconds between looks at the timed-out calls' slots, for a call that waits for a free one.
_RECLAIM_EVERY = 0.05
#: The descriptors a rank gets besides its slots' bells: its area, its doorbell, the node's
#: area, arrivals and tokens, and the barriers' release eventfds.
_NODE_FDS = 5 + _OUTCOMES


def _eventfd_ring(fd: int) -> None:
    os.eventfd_write(fd, 1)


@dataclass(frozen=True)
class Geometry:
    """How a rank's area is laid out: ``slots`` slots of ``slot_bytes`` payload each. A slot
    holds a call's request and then its reply, so the largest value a call carries; pages
    are the kernel's only once written (a memfd), so the default's 8 MiB costs what the
    largest values sent have touched."""

    slots: int = 4
    slot_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= MAX_SLOTS or self.slot_bytes < 1024:
            raise ConfigError(f"a relay's ranks have 1..{MAX_SLOTS} slots of at least 1 KiB, not {self}")

    @property
    def stride(self) -> int:
        return _HEADER_BYTES + self.slot_bytes

    @property
    def area_bytes(self) -> int:
        return _AREA_HEAD + self.slots * self.stride

    def slot_at(self, slot: int) -> int:
        return _AREA_HEAD + slot * self.stride


class Call:
    """One request as the relay's handler sees it. Answer it exactly once with :meth:`reply`
    or :meth:`fail`, from any thread, at once or later."""

    __slots__ = ("_done", "_member", "_seq", "_server", "_slot", "after", "op", "payload", "rank")

    @property
    def incarnation(self) -> int:
        """Which of the relay's members (joined connections) calls: one number each, never
        reused while the server runs."""
        return self._member.incarnation

    def __init__(self, server: LocalServer, member: _Member, slot: int, seq: int, op: int, payload: bytes) -> None:
        self.rank = member.rank
        self.op = op
        self.payload = payload
        self._server, self._member, self._slot, self._seq = server, member, slot, seq
        self._done = False
        #: Called once the call is answered (the handler's to set): what it had in flight ends.
        self.after: Callable[[], None] | None = None

    @property
    def pid(self) -> int:
        """The calling rank's process."""
        return self._member.pid

    @property
    def seat(self) -> int:
        """The calling rank's local rank, for a call only a seated rank makes (a guest's
        ``rank`` is None)."""
        if self.rank is None:
            raise BadMessage("a call only a seated rank makes, from a guest")
        return self.rank

    def reply(self, payload: bytes = b"") -> None:
        self._answer(OK, payload)

    def fail(self, error: BaseException) -> None:
        self._answer(ERROR, _error_text(error))

    def _answer(self, status: int, payload: bytes) -> None:
        if self._done:
            raise RuntimeError(f"local rank {self.rank}: call answered twice")
        self._done = True
        try:
            self._server._answer(self._member, self._slot, self._seq, status, payload)
        finally:
            if self.after is not None:
                self.after()


class _Member:
    """The relay's side of one joined rank."""

    def __init__(self, rank: int | None, pid: int, conn: socket.socket, geometry: Geometry) -> None:
        self.rank, self.pid, self.conn = rank, pid, conn  # rank None: a guest (no seat)
        self.incarnation = next(_incarnations)
        self.memfd = os.memfd_create(f"dp-relay-{'guest' if rank is None else rank}", os.MFD_CLOEXEC)
        os.ftruncate(self.memfd, geometry.area_bytes)
        self.area = mmap.mmap(self.memfd, geometry.area_bytes)
        self.doorbell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.bells = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(geometry.slots)]
        self.seen = [0] * geometry.slots
        self.lock = threading.Lock()  # the reply fields of its slots
        self.gone = False
        self.closed = False
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # no pidfds (Linux before 5.3): the socket's end still tells
            self.pidfd = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in [
            self.memfd,
            self.doorbell,
            *self.bells,
            *([self.pidfd] if self.pidfd is not None else []),
        ]:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.area.close()
        except (BufferError, ValueError):
            pass
        self.conn.close()


@dataclass
class _Hello:
    """A connection whose hello has not all come yet."""

    conn: socket.socket
    pid: int
    deadline: float
    data: bytearray = field(default_factory=bytearray)


class LocalServer:
    """The relay's end: serves the ranks of one node.

    ``handler(call)`` is called on the server's thread for each request and must not block:
    it answers at once or hands the call on. ``on_barrier(generation, name, timeout)``
    likewise, once per barrier generation that every local rank reached (``name``: the
    barrier's, as :func:`barrier_name` gives it; ``None`` where the ranks waiting in it named
    different ones, or none waits any more; ``timeout``: the longest any of them waits); it
    answers with :meth:`release`, at once or later (by default: released at once).
    ``on_gone(rank, how)`` is called once for a rank whose process ended or who closed
    (``how`` says which), on the server's thread.
    ``ranks``: how many local ranks may join; a rank says its number, ``first_rank`` to
    ``first_rank + ranks - 1`` (the node's ranks in the job; 0 by default), or none (a
    guest, module docstring). ``info``: what every joining rank is told besides the layout
    (the node's place in the job). ``may_replace(local_rank, incarnation)``: whether a seat's
    live holder (that member) may be replaced by a guest asking for it (by default never)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        ranks: int,
        handler: Callable[[Call], None],
        on_gone: Callable[[int, str], None] | None = None,
        geometry: Geometry | None = None,
        on_barrier: Callable[[int, bytes | None, float], None] | None = None,
        first_rank: int = 0,
        info: dict | None = None,
        may_replace: Callable[[int, int], bool] | None = None,
    ) -> None:
        if ranks < 1:
            raise ConfigError(f"a relay serves at least one local rank, not {ranks}")
        self.ranks = ranks
        self.first_rank = first_rank
        self.info = dict(info or {})
        self.geometry = geometry or Geometry()
        self._handler, self._on_gone = handler, on_gone
        self._may_replace = may_replace or (lambda local, incarnation: False)
        self._on_barrier = on_barrier or (lambda generation, name, timeout: self.release(generation))
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.directory.stat()
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise ConfigError(
                f"relay directory {self.directory} must belong to this user and be closed to others "
                f"(mode 0700; it is {stat.S_IMODE(st.st_mode):o}, owner {st.st_uid})"
            )
        self.path = self.directory / "relay.sock"
        try:  # a relay that ended without closing left its socket (the directory is this user's alone)
            self.path.unlink()
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound as the umask gives, then made 0600: the directory (this user's, 0700, checked
        # above) keeps everyone else out meanwhile. (Not by setting the umask around the bind:
        # it is the process's, and a file another thread made meanwhile took its mode.)
        try:
            self._listener.bind(str(self.path))
        except OSError as err:
            self._listener.close()
            raise ConfigError(
                f"relay socket {self.path}: cannot listen there ({err}); choose a shorter directory"
            ) from None
        os.chmod(self.path, 0o600)
        # Made once the socket is bound: a directory or path refused leaves none of these open.
        self._node_fd = os.memfd_create("dp-relay-node", os.MFD_CLOEXEC)
        os.ftruncate(self._node_fd, _NODE_BYTES)
        self._node = mmap.mmap(self._node_fd, _NODE_BYTES)
        # The ranks get the node's area through a read-only descriptor: they cannot map it writable.
        self._node_ro = os.open(f"/proc/self/fd/{self._node_fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._arrivals = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._tokens = os.eventfd(ranks - 1, os.EFD_CLOEXEC | os.EFD_NONBLOCK | os.EFD_SEMAPHORE)
        self._released = [os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) for _ in range(_OUTCOMES)]
        self._completed = 0  # the last generation handed to on_barrier
        #: The next barrier's wait, in O(1) per arrival: the live members in rank order, and
        #: how many of them (a prefix) are known to have reached the next generation.
        self._live: list[_Member] = []
        self._reached = 0
        self._release_lock = threading.Lock()
        self._listener.listen(max(64, ranks))
        self._listener.setblocking(False)
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)  # close(), from another thread
        self._members: dict[int, _Member] = {}
        self._guests: dict[int, _Member] = {}  # by connection: joined without a seat
        self._stop = False
        self._poll = select.epoll()
        self._poll.register(self._listener.fileno(), select.EPOLLIN)
        self._poll.register(self._wake, select.EPOLLIN)
        self._poll.register(self._arrivals, select.EPOLLIN)
        self._fd_owner: dict[int, tuple[str, _Member]] = {}
        self._hellos: dict[int, _Hello] = {}  # connections that have not said their hello yet
        self._thread = threading.Thread(target=self._serve, name="dp-relay-local", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public
    def pid_of(self, rank: int) -> int | None:
        """The pid of local rank ``rank``'s latest process (gone or not), if one joined."""
        member = self._members.get(rank)
        return member.pid if member is not None else None

    def incarnation_of(self, rank: int) -> int | None:
        """Local rank ``rank``'s latest member (:attr:`Call.incarnation`; gone or not), if one
        joined."""
        member = self._members.get(rank)
        return member.incarnation if member is not None else None

    def reached(self, generation: int) -> int:
        """How many live local ranks have arrived at barrier ``generation`` or past it."""
        return self._count_ahead(generation - 1)

    def under_way(self) -> tuple[int, int, bytes] | None:
        """The barrier the node's ranks are gathering at (the generation after the last one
        handed on): its generation, how many local ranks have arrived, and its name; None
        while none has. Any thread."""
        generation, count, name = self._completed + 1, 0, None
        for member in list(self._live):
            try:
                at, length, _ = _ARRIVAL.unpack_from(member.area, 8)
                if at >= generation:
                    count += 1
                if at == generation and name is None:
                    name = bytes(member.area[_NAME_AT : _NAME_AT + min(length, _NAME_BYTES)])
            except ValueError:  # gone meanwhile: its area is closed
                pass
        return None if name is None else (generation, count, name)

    def members(self) -> dict[int, int]:
        """Joined local ranks and their pids."""
        return {r: m.pid for r, m in list(self._members.items()) if not m.gone}

    def silent(self, rank: int) -> float | None:
        """Seconds since ``rank`` last beat (None: not joined, or never beat)."""
        beat = self.last_beat(rank)
        return None if beat is None else max(0.0, time.monotonic() - beat)

    def last_beat(self, rank: int) -> float | None:
        """When ``rank`` last beat, by this host's monotonic clock (None: not joined, or
        never beat)."""
        member = self._members.get(rank)
        if member is None:
            return None
        with member.lock:
            if member.gone:
                return None
            (beat,) = _BEAT.unpack_from(member.area, 0)
        return None if beat == 0.0 else beat

    def close(self) -> None:
        self._stop = True
        _eventfd_ring(self._wake)
        self._thread.join(timeout=10)
        for member in [*self._members.values(), *self._guests.values()]:
            member.close()
        self._members.clear()
        self._guests.clear()
        for hello in list(self._hellos.values()):
            hello.conn.close()
        self._hellos.clear()
        self._poll.close()
        self._listener.close()
        for fd in (self._wake, self._arrivals, self._tokens, *self._released, self._node_fd, self._node_ro):
            os.close(fd)
        self._node.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop
    def _serve(self) -> None:
        while not self._stop:
            now = time.monotonic()
            for late in [h for h in self._hellos.values() if h.deadline <= now]:
                self._drop_hello(late, BadMessage(f"no hello within {_HELLO_WITHIN:g}s"))
            wait = min([1.0, *(h.deadline - now for h in self._hellos.values())])
            try:
                events = self._poll.poll(max(wait, 0.01))
            except InterruptedError:
                continue
            if not events:  # the once-a-second look (see "A barrier" above)
                self._arrived()
            for fd, _ in events:
                hello = self._hellos.get(fd)
                if hello is not None:
                    self._read_hello(hello)
                    continue
                owner = self._fd_owner.get(fd)
                if owner is not None:
                    kind, member = owner
                    if kind == "door":
                        self._drain(fd)
                        self._scan(member)
                    else:
                        self._gone(member, "its process ended" if kind == "pid" else "its connection closed")
                elif fd == self._arrivals:
                    self._drain(fd)
                    self._arrived()
                elif fd == self._listener.fileno():
                    self._accept()
                elif fd == self._wake:
                    return

    @staticmethod
    def _drain(fd: int) -> None:
        try:
            os.eventfd_read(fd)
        except OSError:  # nothing to read (BlockingIOError), or closed under a closing client
            pass

    def _scan(self, member: _Member) -> None:
        geo = self.geometry
        if not member.gone:
            area = member.area
            for slot in range(geo.slots):
                at = geo.slot_at(slot)
                req, _rep, op, length, _status, _rlen = _HEADER.unpack_from(area, at)
                if req <= member.seen[slot]:
                    continue
                member.seen[slot] = req
                if length > geo.slot_bytes:
                    self._answer(member, slot, req, ERROR, _error_text(BadMessage(f"request of {length} bytes")))
                    continue
                payload = bytes(area[at + _HEADER_BYTES : at + _HEADER_BYTES + length])
                call = Call(self, member, slot, req, op, payload)
                if op == SEAT:
                    try:
                        self._seat(call)
                    except Exception as err:  # a bug must not take the node down
                        log.exception("relay: a seat request failed")
                        if not call._done:
                            call.fail(ControlError(f"the node relay failed: {type(err).__name__}: {err}"))
                    continue
                try:
                    self._handler(call)
                except Exception as err:  # a handler's bug must not take the node down
                    log.exception("relay handler failed on local rank %s's op %d", member.rank, op)
                    if not call._done:
                        call.fail(ControlError(f"the node relay failed: {type(err).__name__}: {err}"))

    def _arrived(self) -> None:
        """Hand on every barrier generation that all local ranks have reached. Called once
        per wake-up of the arrivals' eventfd (an arrival or several): it looks at the first
        member not yet known to have arrived, and at the others only as that one has (a
        generation only grows while a member lives), so a barrier costs O(ranks) here in
        all, not O(ranks) per arrival."""
        members = self._live
        if len(members) < self.ranks:
            return  # a rank not joined yet (or gone: the relay's on_gone decides what follows)
        target = self._completed + 1
        while self._reached < len(members):
            if _GENERATION.unpack_from(members[self._reached].area, 8)[0] < target:
                return
            self._reached += 1
        self._reached = 0
        arrivals = [_ARRIVAL.unpack_from(m.area, 8) for m in members]
        reached = min(generation for generation, _, _ in arrivals)
        while self._completed < reached:
            self._completed += 1
            # Only the ranks still at this generation say its name (one that gave up on it and
            # went on wrote its next barrier's).
            at = [
                (m, length, timeout)
                for m, (g, length, timeout) in zip(members, arrivals, strict=True)
                if g == self._completed
            ]
            names = {bytes(m.area[_NAME_AT : _NAME_AT + min(length, _NAME_BYTES)]) for m, length, _ in at}
            longest = max([timeout for _, _, timeout in at], default=0.0)
            try:
                self._on_barrier(self._completed, names.pop() if len(names) == 1 else None, longest)
            except Exception as err:
                log.exception("relay barrier handler failed at generation %d", self._completed)
                self.release(self._completed, ERROR, _error_text(err))

    def _members_changed(self) -> None:
        """A member joined or went: the next barrier's count starts over."""
        self._live = sorted((m for m in self._members.values() if not m.gone), key=lambda m: m.rank or 0)
        self._reached = 0

    def release(self, generation: int, status: int = OK, payload: bytes = b"") -> None:
        """End barrier ``generation`` for every local rank with ``status`` and ``payload``
        (OK and bytes, or ERROR and an error from :func:`error_bytes`). Any thread."""
        if len(payload) > _OUTCOME_BYTES:
            status, payload = ERROR, _error_text(BadMessage(f"a barrier outcome of {len(payload)} bytes"))
        with self._release_lock:
            at = _outcome_at(generation)
            if _OUTCOME.unpack_from(self._node, at)[0] >= generation:
                return  # released already, or a later generation holds the record (a late release)
            # The next generation's tokens, before any rank is let go to it: one fewer than
            # the ranks not there yet (a rank that gave up on this one may be).
            self._drain_tokens()
            ahead = self._count_ahead(generation)
            if self.ranks - ahead > 1:
                os.eventfd_write(self._tokens, self.ranks - ahead - 1)
            else:  # every rank but one (or all) is there already: the relay looks now
                _eventfd_ring(self._arrivals)
            self._drain(self._released[(generation + 2) % _OUTCOMES])  # no rank waits on it now
            self._node[at + _OUTCOME.size : at + _OUTCOME.size + len(payload)] = payload
            struct.pack_into("<iI", self._node, at + 8, status, len(payload))
            struct.pack_into("<Q", self._node, at, generation)
            _eventfd_ring(self._released[generation % _OUTCOMES])

    def _count_ahead(self, generation: int) -> int:
        """How many live ranks have arrived past ``generation`` already."""
        ahead = 0
        for member in list(self._live):
            try:
                if _GENERATION.unpack_from(member.area, 8)[0] > generation:
                    ahead += 1
            except ValueError:  # gone meanwhile: its area is closed
                pass
        return ahead

    def _drain_tokens(self) -> None:
        while True:
            try:
                os.eventfd_read(self._tokens)
            except OSError:
                return

    def _answer(self, member: _Member, slot: int, seq: int, status: int, payload: bytes) -> None:
        geo = self.geometry
        if len(payload) > geo.slot_bytes:
            status = ERROR
            payload = _error_text(BadMessage(f"reply of {len(payload)} bytes, {OVER_SLOT} {geo.slot_bytes}"))
        with member.lock:
            if member.gone:
                return
            at = geo.slot_at(slot)
            area = member.area
            area[at + _HEADER_BYTES : at + _HEADER_BYTES + len(payload)] = payload
            struct.pack_into("<iI", area, at + 24, status, len(payload))
            struct.pack_into("<Q", area, at + 8, seq)
            _eventfd_ring(member.bells[slot])

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("relay cannot accept a local rank: %s", err)
                    return
                raise
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                who = f"the relay serves only user {os.getuid()}'s processes; pid {pid} is user {uid}"
                self._refuse(conn, AuthError(who))
                continue
            # The hello is read as it comes, by the loop: a process that connects and says
            # nothing holds up no one (and is dropped after _HELLO_WITHIN).
            conn.setblocking(False)
            hello = _Hello(conn, pid, time.monotonic() + _HELLO_WITHIN)
            self._hellos[conn.fileno()] = hello
            self._poll.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    def _read_hello(self, hello: _Hello) -> None:
        try:
            chunk = hello.conn.recv(_HELLO_MAX)
        except BlockingIOError:
            return
        except OSError as err:
            self._drop_hello(hello, BadMessage(f"local hello cut short: {err}"))
            return
        if not chunk:
            self._drop_hello(hello, BadMessage("local hello cut short"))
            return
        hello.data += chunk
        data = bytes(hello.data)
        complete = len(data) >= 4 and len(data) >= 4 + struct.unpack_from("<I", data)[0]
        if complete or len(data) >= _HELLO_MAX:
            self._hellos.pop(hello.conn.fileno(), None)
            self._poll.unregister(hello.conn.fileno())
            try:
                self._admit(hello.conn, hello.pid, _parse_frame(data))
            except Exception as err:
                self._refuse(hello.conn, err)

    def _drop_hello(self, hello: _Hello, error: Exception) -> None:
        fd = hello.conn.fileno()
        self._hellos.pop(fd, None)
        try:
            self._poll.unregister(fd)
        except (OSError, ValueError):
            pass
        self._refuse(hello.conn, error)

    @staticmethod
    def _refuse(conn: socket.socket, error: Exception) -> None:
        log.warning("relay refused a local connection: %s", error)
        try:
            conn.setblocking(False)
            conn.send(_frame({"error": type(error).__name__, "message": str(error)}))
        except OSError:
            pass  # gone already: nothing to tell
        finally:
            conn.close()

    def _admit(self, conn: socket.socket, pid: int, hello: dict) -> None:
        if hello.get("protocol") != LOCAL_PROTOCOL:
            raise BadMessage(f"local protocol {hello.get('protocol')!r}; this relay speaks {LOCAL_PROTOCOL}")
        said = hello.get("rank")
        first, last = self.first_rank, self.first_rank + self.ranks - 1
        rank: int | None = None  # a guest: no rank said, or its seat held by a live process
        if said is not None:
            if not isinstance(said, int) or isinstance(said, bool) or not first <= said <= last:
                raise ConfigError(f"rank {said!r} is not one of this node's, {first}..{last}")
            rank = said - first if self._free(said - first) else None
        member = _Member(rank, pid, conn, self.geometry)
        geo = self.geometry
        header = {
            "protocol": LOCAL_PROTOCOL,
            "rank": rank,
            "slots": geo.slots,
            "slot_bytes": geo.slot_bytes,
            "info": self.info,
        }
        # A rank taking a local rank (a first or a restarted worker) starts at the node's
        # barrier count: set before the rank can see its area.
        _ARRIVAL.pack_into(member.area, 8, self._completed, 0, 0.0)
        fds = [member.memfd, member.doorbell, self._node_ro, self._arrivals, self._tokens, *self._released]
        fds += member.bells
        try:
            socket.send_fds(conn, [_frame(header)], fds)
        except OSError:
            member.close()
            raise
        if rank is None:
            self._guests[conn.fileno()] = member
        else:
            self._members[rank] = member
            self._members_changed()
        self._poll.register(member.doorbell, select.EPOLLIN)
        self._fd_owner[member.doorbell] = ("door", member)
        self._poll.register(conn.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
        self._fd_owner[conn.fileno()] = ("conn", member)
        if member.pidfd is not None:
            self._poll.register(member.pidfd, select.EPOLLIN)
            self._fd_owner[member.pidfd] = ("pid", member)

    def _free(self, local: int) -> bool:
        """Whether seat ``local`` is free: no one took it, or its holder is gone (a process
        whose end was not read yet is found gone here: a restarted worker may come first)."""
        held = self._members.get(local)
        if held is not None and not held.gone and held.pidfd is not None and _readable([held.pidfd], 0):
            self._gone(held, "its process ended")
        return held is None or held.gone

    def _seat(self, call: Call) -> None:
        """A guest's :data:`SEAT` request (on the loop's thread, which alone changes seats)."""
        member = call._member
        try:
            (wanted,) = _SEAT.unpack(call.payload)
        except struct.error:
            call.fail(BadMessage("a seat request of the wrong size"))
            return
        first = self.first_rank
        if member.rank is not None:  # seated already (at its hello, or an earlier request)
            if wanted not in (-1, first + member.rank):
                call.fail(ConfigError(f"local rank {member.rank} asked for rank {wanted}'s seat too"))
                return
            local: int | None = member.rank
        elif wanted != -1 and not first <= wanted < first + self.ranks:
            call.fail(ConfigError(f"rank {wanted} is not one of this node's, {first}..{first + self.ranks - 1}"))
            return
        else:
            local = None
            for seat in range(self.ranks) if wanted == -1 else [wanted - first]:
                held = self._members.get(seat)
                if not self._free(seat) and held is not None and self._may_replace(seat, held.incarnation):
                    self._gone(held, "its seat was given to another process (it had been declared lost)")
                if self._free(seat):
                    local = seat
                    break
            if local is not None:
                self._guests.pop(member.conn.fileno(), None)
                with member.lock:
                    member.rank = local
                    # A new member starts at the node's barrier count (as one seated at its hello).
                    _ARRIVAL.pack_into(member.area, 8, self._completed, 0, 0.0)
                self._members[local] = member
                self._members_changed()
        call.reply(_SEATED.pack(-1, -1) if local is None else _SEATED.pack(local, first + local))

    def _gone(self, member: _Member, how: str) -> None:
        with member.lock:
            if member.gone:
                return
            member.gone = True
        if member.rank is None:  # a guest: nothing of the node's was its
            self._guests.pop(member.conn.fileno(), None)
        self._members_changed()
        for fd in (member.doorbell, member.conn.fileno(), member.pidfd):
            if fd is not None and fd >= 0:
                self._fd_owner.pop(fd, None)
                try:
                    self._poll.unregister(fd)
                except (OSError, ValueError):
                    pass
        with member.lock:  # no answer is being written (they look at gone under this lock)
            member.close()
        if self._on_gone is not None and member.rank is not None:
            try:
                self._on_gone(member.rank, how)
            except Exception:
                log.exception("relay: on_gone failed for local rank %d", member.rank)


_E = TypeVar("_E", bound=ControlError)


def fatal(error: _E) -> _E:
    """``error`` marked fatal to the rank's channel that gets it (the mark crosses the local
    leg with the error's fields): the rank's channel fails on it, as a directly connected
    rank's fails on its coordinator's end."""
    error.fatal = True  # type: ignore[attr-defined]
    return error


def _relay_gone(message: str) -> ChannelClosed:
    """The relay's end, as a rank sees it (its socket closed or its eventfds gone)."""
    return fatal(ChannelClosed(message))


class NoReply(ControlTimeout):
    """The node relay did not answer a call within its bound (it is frozen or cut off), as
    opposed to an answer that is itself a timeout (an upstream call's, passed back)."""


class SlotsBusy(NoReply):
    """The rank's other calls in flight held every slot the call may use for its whole
    bound: nothing was sent, and the relay's silence is not what this says (a rank's threads
    waiting in more reads at once than it has slots). Where a slot is held by a call the relay
    left unanswered, it is: :class:`NoReply`."""


class LocalClient:
    """A rank's end: joins the relay at ``path`` as ``rank`` (one of the node's; the relay's
    local rank ``rank - first_rank``), or as a guest (``rank`` None, or its seat held:
    :attr:`local_rank` None; see :meth:`seat`). Thread-safe: each call takes a free slot of its own.
    ``info``: what the relay told it (the node's place in the job). The relay must be a
    process of this user (checked with ``SO_PEERCRED``): a socket put at ``path`` by another
    user is refused before anything is sent to it."""

    def __init__(self, path: str | os.PathLike[str], rank: int | None, timeout: float = 30.0) -> None:
        self.rank = rank
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.settimeout(timeout)
        try:
            self._conn.connect(str(path))
            creds = self._conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                raise AuthError(f"the process serving {path} (pid {pid}) is user {uid}, not this user ({os.getuid()})")
            _send_json(self._conn, {"protocol": LOCAL_PROTOCOL, "rank": rank})
            data, fds, _flags, _addr = socket.recv_fds(self._conn, _HELLO_MAX, MAX_SLOTS + _NODE_FDS)
        except AuthError:
            self._conn.close()
            raise
        except (TimeoutError, OSError) as err:
            self._conn.close()
            raise ChannelClosed(f"no node relay at {path}: {err}") from err
        try:
            header = _parse_frame(data)
            if "error" in header:
                kind = {"AuthError": AuthError, "BadMessage": BadMessage}.get(header["error"], ConfigError)
                raise kind(f"node relay at {path} refused local rank {rank}: {header['message']}")
            self.geometry = Geometry(slots=header["slots"], slot_bytes=header["slot_bytes"])
            if len(fds) != _NODE_FDS + self.geometry.slots:
                raise BadMessage(f"node relay at {path}: {len(fds)} descriptors for {self.geometry.slots} slots")
        except BaseException:
            self._conn.close()
            for fd in fds:
                os.close(fd)
            raise
        self.info: dict = header.get("info") or {}
        self.local_rank: int | None = header["rank"]
        memfd, self._doorbell, node_fd, self._arrivals, self._tokens = fds[:5]
        self._released = fds[5:_NODE_FDS]
        self._bells = fds[_NODE_FDS:]
        self._area = mmap.mmap(memfd, self.geometry.area_bytes)
        self._node = mmap.mmap(node_fd, _NODE_BYTES, prot=mmap.PROT_READ)
        os.close(memfd)
        os.close(node_fd)
        self._generation = _ARRIVAL.unpack_from(self._area, 8)[0]
        self._barrier_lock = threading.Lock()
        self._seq = [0] * self.geometry.slots
        self._free = list(range(self.geometry.slots))
        # Timed-out calls' slots, each with the sequence number of the reply it still waits
        # for: freed by the next call to look once that late reply has come (_take).
        self._late: dict[int, int] = {}
        self._lock = threading.Lock()
        self._free_cv = threading.Condition(self._lock)
        #: The waiting calls waiting for a slot, first come first served: a read whose slice
        #: ended takes no slot before one that waited for it.
        self._queue: collections.deque[object] = collections.deque()
        self._closed = False
        self._in_flight = 0  # calls and waits using the descriptors: close() waits for them
        self._using = _InFlight(self)  # `with self._using:` around every use of them
        self._pollers: dict[int, select.poll] = {}  # a bell's, with the socket: made once
        # Rung by interrupt(): a barrier's wait returns at once, to look at its peers again.
        self._interrupt = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._interrupts = 0
        self._conn.setblocking(True)

    def interrupt(self) -> None:
        """End the barrier wait under way (:meth:`released` returns None at once): the rank
        learnt something its wait must look at (a peer lost, its channel failed)."""
        with self._free_cv:
            if self._closed:
                return
            self._interrupts += 1
            _eventfd_ring(self._interrupt)

    def seat(self, rank: int | None, timeout: float) -> int | None:
        """Take a seat, as a guest (:attr:`local_rank` None): ``rank``'s, or with None the
        lowest free one; the job rank seated at (this client's from then on), or None where
        that seat, or every seat, is held by a live process. Seated already: its own rank."""
        local, job_rank = _SEATED.unpack(self.call(SEAT, _SEAT.pack(-1 if rank is None else rank), timeout))
        if local < 0:
            return None
        with self._using:  # the node's barrier count, which the relay wrote into the area
            self._generation = _ARRIVAL.unpack_from(self._area, 8)[0]
        self.local_rank, self.rank = local, job_rank
        return job_rank

    def beat(self) -> None:
        """Say the rank is alive (the relay reads how long ago it last did)."""
        with self._using:
            _BEAT.pack_into(self._area, 0, time.monotonic())

    def barrier(self, name: str, timeout: float) -> bytes:
        """Arrive at the node's next barrier and wait up to ``timeout`` seconds until the relay
        releases it: :meth:`arrive`, then :meth:`released` until it answers."""
        generation = self.arrive(name, timeout)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlTimeout(f"node barrier {name!r} (local generation {generation})", timeout)
            outcome = self.released(generation, left)
            if outcome is not None:
                return outcome

    def arrive(self, name: str, timeout: float) -> int:
        """Arrive at the node's next barrier, named ``name``, for which this rank waits up to
        ``timeout`` seconds (the relay waits upstream as long as the longest-waiting rank);
        returns its generation. A rank enters its barriers one at a time."""
        if self.local_rank is None:
            raise ConfigError(f"barrier {name!r}: a guest of the node relay (no seat) is in no barrier")
        with self._using, self._barrier_lock:
            self._generation += 1
            raw = barrier_name(name)
            self._area[_NAME_AT : _NAME_AT + len(raw)] = raw
            # The generation last, in a store of its own (8 bytes, aligned): the relay, reading
            # while this is written, sees the new generation only with its name and timeout.
            struct.pack_into("<Id", self._area, 16, len(raw), float(timeout))
            struct.pack_into("<Q", self._area, 8, self._generation)
            try:
                try:
                    os.eventfd_read(self._tokens)  # not the last to arrive: nothing to ring
                except BlockingIOError:  # no token left: the last, who rings
                    _eventfd_ring(self._arrivals)
            except OSError as err:
                raise _relay_gone(f"node relay gone: {err}") from err
            return self._generation

    def released(self, generation: int, timeout: float) -> bytes | None:
        """Wait up to ``timeout`` seconds for barrier ``generation``'s release: its outcome's
        bytes, or the error it was released with raised; None if not released yet (so that a
        caller can look at its peers between slices)."""
        at = _outcome_at(generation)
        deadline = time.monotonic() + timeout
        interrupts = self._interrupts
        with self._using:
            while _OUTCOME.unpack_from(self._node, at)[0] != generation:
                left = deadline - time.monotonic()
                if left <= 0 or self._interrupts != interrupts:
                    return None
                self._wait(self._released[generation % _OUTCOMES], left, drain=False)
            _, status, length = _OUTCOME.unpack_from(self._node, at)
            outcome = bytes(self._node[at + _OUTCOME.size : at + _OUTCOME.size + length])
        if status == OK:
            return outcome
        raise _error_from(outcome)

    def call(self, op: int, payload: bytes, timeout: float, waiting: float | None = None, answer: float = 0.0) -> bytes:
        """Send ``op`` with ``payload`` and wait up to ``timeout`` seconds for the reply's bytes.
        ``waiting``: the call may wait this long at the relay (a read that waits for its key);
        such calls leave :data:`KEPT_FREE` slots to the others, so that reads waiting never
        hold up a rank's writes or its liveness's reads, and take theirs in the order they
        came. A call takes its slot within what its bound leaves beyond its wait, or beyond
        ``answer`` (the time the relay is given to answer any call: its hop back), whichever
        is longer (else :class:`SlotsBusy`: a slot taken later would leave the relay too
        little time to answer, and the call would end past its time).
        A handler's error is raised as its type (a :class:`dataparallel.errors` one by name);
        the relay gone or this client closed: ChannelClosed; no reply in time: ControlTimeout
        (the slot stays taken until the late reply comes, so it can never be misread as
        another call's)."""
        geo = self.geometry
        if len(payload) > geo.slot_bytes:
            raise BadMessage(f"a request of {len(payload)} bytes; the relay's slots take {geo.slot_bytes}")
        deadline = time.monotonic() + timeout
        with self._using:
            slot = self._take(deadline - max(waiting or 0.0, answer), waiting is not None)
            seq = self._seq[slot] + 1
            self._seq[slot] = seq
            at = geo.slot_at(slot)
            area = self._area
            area[at + _HEADER_BYTES : at + _HEADER_BYTES + len(payload)] = payload
            struct.pack_into("<II", area, at + 16, op, len(payload))
            struct.pack_into("<Q", area, at, seq)
            try:
                _eventfd_ring(self._doorbell)
                while True:
                    _req, rep, _op, _len, status, rlen = _HEADER.unpack_from(area, at)
                    if rep == seq:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        # The slot stays taken: a late reply would otherwise answer the next call.
                        with self._free_cv:
                            self._late[slot] = seq
                            self._free_cv.notify_all()  # a call waiting for a slot looks at it
                        raise NoReply(f"local rank {self.rank}'s reply from the node relay", timeout)
                    self._wait(self._bells[slot], left)
            except ControlTimeout:
                raise
            except BaseException:
                self._give(slot)
                raise
            reply = bytes(area[at + _HEADER_BYTES : at + _HEADER_BYTES + rlen])
            self._give(slot)
        if status == OK:
            return reply
        raise _error_from(reply)

    def close(self, timeout: float = 5.0) -> None:
        """Close: calls in flight raise ChannelClosed; the descriptors are released once they
        have, within ``timeout`` seconds (a descriptor closed under a waiting thread could be
        another file's by then: past it, they stay open)."""
        with self._free_cv:
            if self._closed:
                return
            self._closed = True
        try:
            self._conn.shutdown(socket.SHUT_RDWR)  # wakes every waiter: the socket reads as closed
        except OSError:
            pass
        with self._free_cv:
            self._free_cv.notify_all()
            deadline = time.monotonic() + timeout
            while self._in_flight and time.monotonic() < deadline:
                self._free_cv.wait(0.05)
            if self._in_flight:
                log.warning("local rank %s: %d calls still in flight at close", self.rank, self._in_flight)
                return  # their descriptors stay open rather than be closed under them
        self._conn.close()
        for fd in [self._doorbell, self._arrivals, self._tokens, *self._released, *self._bells, self._interrupt]:
            os.close(fd)
        for area in (self._area, self._node):
            try:
                area.close()
            except (BufferError, ValueError):
                pass

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait(self, bell: int, left: float, drain: bool = True) -> None:
        """Wait up to ``left`` (at most a second) for ``bell`` (read once rung, unless
        ``drain`` is False: a release eventfd, which the relay empties); ChannelClosed once
        the relay or this client is closed."""
        poller = self._pollers.get(bell)
        if poller is None:
            poller = self._pollers[bell] = select.poll()
            poller.register(bell, select.POLLIN)
            poller.register(self._conn.fileno(), select.POLLIN)
            poller.register(self._interrupt, select.POLLIN)
        try:
            ready = [fd for fd, _ in poller.poll(min(left, 1.0) * 1000)]
        except RuntimeError:  # another thread waits on this bell's poller: one of its own
            ready = _readable([bell, self._conn.fileno(), self._interrupt], min(left, 1.0))
        if self._closed:
            raise ChannelClosed(f"local rank {self.rank}: its channel to the node relay was closed")
        if self._interrupt in ready:  # emptied by whichever waiter wakes; released() reads the count
            LocalServer._drain(self._interrupt)
            ready.remove(self._interrupt)
            if not ready:
                return
        if bell in ready:
            if drain:
                LocalServer._drain(bell)
        elif ready:
            raise _relay_gone(f"local rank {self.rank}: the node relay closed")

    def _take(self, deadline: float, waiting: bool = False) -> int:
        """A free slot, by ``deadline`` (else :class:`SlotsBusy`); a waiting call leaves
        :data:`KEPT_FREE` to the others, and waiting calls take theirs in the order they came."""
        start = time.monotonic()
        kept = KEPT_FREE if waiting and self.geometry.slots > KEPT_FREE else 0
        ticket = object()
        with self._free_cv:
            if waiting:
                self._queue.append(ticket)
            try:
                while True:
                    if self._closed:
                        raise ChannelClosed(f"local rank {self.rank}: its channel to the node relay is closed")
                    if self._late:
                        self._reclaim()
                    if len(self._free) > kept and (not waiting or self._queue[0] is ticket):
                        return self._free.pop()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        waited = time.monotonic() - start
                        if self._late:  # slots the relay left unanswered past their calls' bounds: its silence
                            raise NoReply(
                                f"a free slot of local rank {self.rank} ({len(self._late)} held by calls the "
                                "node relay has not answered)",
                                waited,
                            )
                        raise SlotsBusy(f"a free slot of local rank {self.rank} (every slot busy)", waited)
                    # A late reply rings no one: look again soon while a slot waits for one.
                    self._free_cv.wait(min(left, _RECLAIM_EVERY) if self._late else left)
            finally:
                if waiting:
                    self._queue.remove(ticket)
                    self._free_cv.notify_all()  # the next in line looks

    def _give(self, slot: int) -> None:
        with self._free_cv:
            self._free.append(slot)
            self._free_cv.notify_all()

    def _reclaim(self) -> None:
        """Free the timed-out calls' slots whose late replies have come (under ``_free_cv``,
        by a call using the client's descriptors). Done by the next call that needs a slot
        rather than by a thread per timed-out call: a timeout returns at once, even in a
        process whose threads wait long for a CPU."""
        for slot, seq in list(self._late.items()):
            if _HEADER.unpack_from(self._area, self.geometry.slot_at(slot))[1] == seq:
                del self._late[slot]
                self._free.append(slot)


class _InFlight:
    """``with client._using:`` around a use of the client's descriptors: refused once it is
    closed, and counted, so that close() releases them only after the last use ends. (A
    class, not a generator context manager: it is on the path of every barrier.)"""

    __slots__ = ("_client",)

    def __init__(self, client: LocalClient) -> None:
        self._client = client

    def __enter__(self) -> None:
        client = self._client
        with client._lock:
            if client._closed:
                raise ChannelClosed(f"local rank {client.rank}: its channel to the node relay is closed")
            client._in_flight += 1

    def __exit__(self, *exc: object) -> None:
        client = self._client
        with client._lock:
            client._in_flight -= 1
            if client._closed:
                client._free_cv.notify_all()  # close() waits for the last use to end


def _readable(fds: list[int], timeout: float) -> list[int]:
    """Which of ``fds`` are readable (or closed) within ``timeout`` seconds: poll, not select,
    so that a process holding more than 1,024 files can wait too."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout * 1000)]


def _frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("<I", len(body)) + body


def _parse_frame(data: bytes) -> dict:
    if len(data) < 4:
        raise BadMessage("node relay: short hello")
    (n,) = struct.unpack_from("<I", data)
    if n > _HELLO_MAX - 4 or len(data) < 4 + n:
        raise BadMessage("node relay: bad hello")
    value = json.loads(data[4 : 4 + n])
    if not isinstance(value, dict):
        raise BadMessage("node relay: hello is not an object")
    return value


def _send_json(conn: socket.socket, obj: dict) -> None:
    conn.sendall(_frame(obj))


def error_bytes(error: BaseException) -> bytes:
    """``error`` as a call's or a barrier's ERROR outcome (see :func:`_error_text`)."""
    return _error_text(error)


def _error_text(error: BaseException) -> bytes:
    """An error as the rank will raise it: its type's name, its text and its plain fields
    (a PeerLost's rank and last_seen, a ControlTimeout's what and waited). A transport's own
    subclass of an error travels as that error (the rank has no such class: a store's
    private ChannelClosed would otherwise reach it as a bare ControlError)."""
    fields = {k: v for k, v in vars(error).items() if isinstance(v, str | int | float | bool | type(None))}
    return json.dumps({"type": _known_type(type(error)), "message": str(error), "fields": fields}).encode()


def _known_type(kind: type) -> str:
    """The name of ``kind`` or of the nearest of its bases a rank rebuilds as a ControlError
    (:func:`_error_from`): a :mod:`dataparallel.errors` type or ReadUnanswered. Any other
    error keeps its own name (a ValueError, ``_add``'s, is rebuilt as one; a subclass of it
    reaches the rank as a ControlError naming it, as before)."""
    from ... import errors
    from ..channel import ReadUnanswered

    for base in kind.__mro__:
        if base is ReadUnanswered or getattr(errors, base.__name__, None) is base:
            return base.__name__
    return kind.__name__


def _error_from(reply: bytes) -> Exception:
    """The error a handler failed a call with: the same :mod:`dataparallel.errors` type, text
    and fields; any other type a ControlError naming it."""
    from ... import errors

    try:
        info = json.loads(reply)
        name, message, fields = str(info["type"]), str(info["message"]), dict(info.get("fields") or {})
    except (ValueError, KeyError, TypeError, AttributeError):
        return BadMessage(f"node relay: unreadable error {reply[:80]!r}")
    if name == "ValueError":  # a hook's one error besides ControlErrors (_add on a value that is no number)
        return ValueError(message)
    if name == "ReadUnanswered":  # a read the store left unanswered: the rank's wait reads again
        from ..channel import ReadUnanswered

        return ReadUnanswered(message)
    kind = getattr(errors, name, None)
    if not (isinstance(kind, type) and issubclass(kind, errors.ControlError)):
        return errors.ControlError(f"{name}: {message}")
    error = kind.__new__(kind)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error
