"""``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``: the control channel on an etcd v3 cluster.

For jobs whose coordinator must survive the loss of a machine, and sites that already run
etcd. Client: ``aetcd`` (asyncio), driven from a private event-loop thread.

- Every key lives under ``/PREFIX//JOB/RUN/`` (PREFIX defaults to ``dataparallel``; RUN is
  an id on a lease of its own that every rank holding a rank in it keeps alive: the run ends
  when its last rank is gone, whichever rank started it, and a crashed job never leaks into a
  rerun). The empty
  segment ends PREFIX, which may itself hold ``/`` (a job name may not): so no job's keys lie
  under another's, not even those of job ``b`` of prefix ``p/a`` and job ``a`` of prefix ``p``.
  The run id is at ``/PREFIX//JOB/\\0run``: an etcd role with readwrite on the prefix
  ``/PREFIX//JOB/`` is all a job's user needs (``dataparallel check`` uses the job ``__dp-check``).
- ``get`` of a missing key reads the key and its revision, then watches from the next
  revision: no polling, and no write can slip between the read and the watch.
- ``add`` and ``compare_set`` are transactions guarded by the key's ``mod_revision``
  (retried on conflict); a missing key is ``version == 0``. Every mutation commits with a
  record of its result, so a call re-sent after a lost reply is applied once (``_once``).
- Liveness (:class:`LeaseLiveness`): each rank holds a lease (TTL = ``liveness_timeout``)
  kept alive every ``heartbeat`` seconds (at most TTL/3), and on joining writes
  ``__dp/alive/RANK`` (bound to the lease) and ``__dp/joined/RANK`` (not). A watch on the
  alive keys sees a joined rank's key vanish when its lease expires (killed, frozen, or cut
  off): ``PeerLost`` for everyone waiting. A rank that closes writes ``__dp/left/RANK`` first: a clean departure.
- Collectives: the transport's own (:mod:`.collectives`): an arrival key per rank, one
  release key per round, one watch per channel on the release keys.
- Each joined rank holds ``__dp/open/RANK``; the rank whose departure leaves none deletes
  the job's keys.
- Several endpoints: a call that cannot reach one member is retried on the next.

Options: ``user``/``password`` (etcd authentication; the token etcd drops after
``--auth-token-ttl`` idle seconds is obtained again), ``ca`` (TLS, verifying etcd's
certificate against that CA), ``cert``/``key`` (a client certificate, for etcd's
``--client-cert-auth``). A session that cannot open looks at the server after a second: a
TLS mismatch or a certificate refused is an error naming the fix within seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import math
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, cast

import aetcd
import aetcd.exceptions
import grpc

from dataparallel.control.channel import ControlChannel, ReadUnanswered
from dataparallel.control.check import tls_diagnosis
from dataparallel.control.eventloop import bounded, client_loop, submit
from dataparallel.control.keyspace import NEXT_RANK, claim_key, peer_key
from dataparallel.control.liveness import Liveness, LostPeer, with_process
from dataparallel.control.registry import ChannelURL
from dataparallel.errors import AuthError, BadMessage, ChannelClosed, ConfigError, ControlError

from .client import Count, EtcdClient, WatchRefused
from .collectives import EtcdCollectives, ReleaseWatch, _prefix_end

T = TypeVar("T")

_ALIVE = "__dp/alive/"
_LEFT = "__dp/left/"
_OPEN = "__dp/open/"
_JOINED = "__dp/joined/"
_OPS = "__dp/ops/"
#: Operations per transaction (etcd's default --max-txn-ops is 128).
_TXN_OPS = 128
#: Records of applied mutations kept per session (see _once): far more than can be in flight.
_KEEP_RECORDS = 256
#: _cas_loop's "delete the key".
_REMOVE = object()
#: A wait inside a call ends this much (at most half of it) before the call's timeout, at which
#: the call's answer stops being waited for: a key still missing is then a timeout whose answer
#: had time to arrive, not silence. A call aims at its timeout, not past it (the slack a caller
#: allows beyond it is for the scheduling of a loaded machine), but gives any answer this long.
ANSWER_GRACE = 0.25
#: While a session cannot open: look at the server after this many seconds, then this often.
_PROBE_AFTER, _PROBE_EVERY = 1.0, 2.0
#: What a restarting member or a broken connection raises: waited out (and failed over) by
#: ``_call`` within the liveness timeout. grpc core reports a stream cut by a restart as
#: INTERNAL ("Internal error from Core"), which aetcd raises as InternalError.
_TRANSIENT = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.InternalError,
)


class EtcdChannel(EtcdCollectives, ControlChannel):
    scheme = "etcd"
    URL_FORM = "{scheme}://HOST:PORT[,HOST:PORT...][/PREFIX]"
    OPTIONS = {
        "user": "etcd user name",
        "password": "etcd password",
        "ca": "PEM file of the CA that signed etcd's certificate (enables TLS)",
        "cert": "client certificate PEM file",
        "key": "client key PEM file",
    }
    SERVICE = "etcd"
    fences_lost_members = True  # writes are bound to the lease whose expiry declared the rank lost
    survives_connection_loss = True  # a re-sent mutation finds its result record (_once)
    survives_frozen_writers = True  # each write is one etcd transaction; no client holds a lock
    # Each slice of a blocked get re-reads and re-watches its key: keep them few.
    liveness_poll = 1.0

    def __init__(self, url: ChannelURL, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._endpoints = [(host, port or 2379) for host, port in url.hosts]
        self._credentials = _credentials(url)
        prefix = "/".join(part for part in url.path.split("/") if part) or "dataparallel"
        self._job_root = f"/{prefix}//{self.job}/".encode()
        self._root = self._job_root  # becomes /PREFIX//JOB/RUN/ once the run is known
        self._ttl = max(2, math.ceil(self.liveness_timeout))
        self._loop = client_loop()
        self._current = 0
        self._client: EtcdClient | None = None
        self._lease: Any = None  # aetcd's lease, once granted
        self._run_key = self._job_root + b"\x00run"  # below every run id: outside the range a new run wipes
        self._run_id = b""  # the current run's id, and its lease's (see _open_run)
        self._run_lease = 0
        # Whether this channel keeps its run alive: from the start, unless it waits for a
        # rank another process holds (a rerun waiting for a dead run to end must not keep it
        # alive); again once it holds its rank.
        self._holds_run = not self._observer  # an observer's (dp.observe) keeps no run alive
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._registered = False
        self._holder_left = False  # the rank this channel asked for was held by one that left
        self._op_seq = itertools.count()
        self._releases = ReleaseWatch(self)
        try:
            start = time.monotonic()
            self._run(self._connect(), self.timeout)
            self._run(self._open_run(), max(start + self.timeout - time.monotonic(), 1e-3))
        except BaseException:
            self._shutdown()
            raise
        if self._lease is not None:  # an observer's (dp.observe) has none to keep
            self._keeper = threading.Thread(
                target=self._keep_alive, args=(self._ttl,), name="dp-etcd-lease", daemon=True
            )
            self._keeper.start()

    # ------------------------------------------------------------------ plumbing
    async def _open_run(self) -> None:
        """Join the job's current run, or start one. The run's id lies in a key on a lease of
        its own, which every rank of the run keeps alive from the moment it holds its rank
        (:meth:`_hold_run`, :meth:`_keep_alive`): the run ends when its last rank has gone
        (left, killed, or frozen for the TTL), not with the rank that started it, and a later
        job of the same name never sees a crashed run's keys (starting a run deletes whatever
        a dead run left). A channel that holds no rank and never will (the torchrun backends',
        an elastic job's join queue) keeps its run alive as a rank does; one that waits for a
        rank held by another keeps none alive (:attr:`_holds_run`)."""
        if self._lease is None and not self._observer:  # an observer's holds no lease: it writes nothing
            self._lease = await self._call("lease", self._ttl)
        run_key = self._run_key
        txn = self._etcd.transactions
        while True:
            current = await self._call("get", run_key)
            if self._observer and (current is None or current.lease == 0):
                # An observer (dp.observe) starts no run and mends none: it reads one.
                self._run_id, self._root = b"", self._job_root
                return
            if current is not None and current.lease == 0:
                # A run key on no lease (put by hand or by a tool) would never end: a dead run.
                await self._call(
                    "transaction",
                    compare=[txn.mod(run_key) == current.mod_revision],
                    success=[txn.delete(run_key)],
                    failure=[],
                )
                continue
            if current is not None:
                run, self._run_lease = current.value, current.lease
                break
            lease = await self._call("lease", self._ttl)
            fresh = uuid.uuid4().hex.encode()
            ok, _ = await self._call(
                "transaction",
                compare=[txn.version(run_key) == 0],
                success=[
                    txn.delete(self._job_root + b"\x01", _prefix_end(self._job_root)),
                    txn.put(run_key, fresh, lease=lease),
                ],
                failure=[],
            )
            if ok:
                run, self._run_lease = fresh, lease.id
                break
            await self._call("revoke_lease", lease.id)  # another process started one first: join it
        self._run_id = run
        self._root = self._job_root + run + b"/"

    async def _hold_run(self) -> bool:
        """Keep the run's lease alive: False if the run has ended (its lease expired, every
        rank of it gone for the TTL, or revoked by its last rank out); an unanswered refresh
        is no verdict (True: the next one asks again)."""
        reply = await self._call("refresh_lease", self._run_lease)
        return reply is None or reply.TTL > 0

    def _attach_run(self) -> bool:
        # The job's current run, looked up again (an observer follows reruns; it starts none).
        self._run(self._open_run(), self.timeout)
        return bool(self._run_id)

    def _enter_run(self, retry: bool) -> None:
        if retry:  # the run opened in __init__ was the first attempt's; it may have ended since
            self._run(self._open_run(), self.timeout)

    def _run_state(self, holder: int | None) -> tuple[str, str] | None:
        # A run ends when the last of its ranks is gone; a rank held by a live lease is waited
        # for (it gives the rank up when the lease expires), one whose holder left is not.
        if self._holder_left:
            return "alive", "it left its run, which goes on without it: a rank cannot rejoin"
        return None

    @classmethod
    def security(cls, url: ChannelURL, token: str | None) -> str:
        who = (
            f"etcd user {url.options['user']!r} (what it may touch is its role's)"
            if "user" in url.options
            else "no etcd user: whoever reaches etcd can read and write every job's keys unless etcd requires auth"
        )
        wire = (
            "TLS" + (" with a client certificate" if "cert" in url.options else "")
            if "ca" in url.options
            else "not encrypted (add ca=)"
        )
        return f"{who}; {wire}; the token is compared between ranks, not checked by etcd"

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        if any(port is None for _, port in url.hosts):
            raise ConfigError(f"{url.shown!r}: expected {cls.url_form(url)} (a port for each)")
        if "password" in url.options and "user" not in url.options:
            raise ConfigError(f"{url.shown!r}: password= without user=: add user=NAME")
        if "cert" in url.options and "ca" not in url.options:
            raise ConfigError(f"{url.shown!r}: cert=/key= are for TLS, which ca=CA.pem turns on: add ca=")
        url.certificate_files()

    @classmethod
    def diagnose(cls, url: ChannelURL, timeout: float, token: str | None = None) -> list[ControlError]:
        return tls_diagnosis(
            url,
            want_tls="ca" in url.options,
            ca=url.options.get("ca"),
            cert=url.options.get("cert"),
            key=url.options.get("key"),
            alpn=["h2"],
            timeout=timeout,
            how_to_enable="ca=CA.pem (and cert=/key= if etcd wants client certificates)",
            how_to_disable="ca=",
        )

    def _new_client(self) -> EtcdClient:
        host, port = self._endpoints[self._current]
        opts = self.url.options
        user = opts.get("user")
        return EtcdClient(
            host,
            port,
            credentials=self._credentials,
            username=user,
            password=opts.get("password", "") if user else None,
        )

    async def _connect(self) -> None:
        start = time.monotonic()
        # Given up a little before the timeout: closing the last attempt's client and the
        # channel's shutdown come out of the caller's budget, not on top of it.
        deadline, probe_at = start + _wait_within(self.timeout), start + _PROBE_AFTER
        last: Exception | None = None
        while time.monotonic() < deadline:
            client = self._new_client()
            try:
                ping = client.get(self._root + b"__dp/ping")
                await bounded(ping, min(5, deadline - time.monotonic()))
                self._client = client
                return
            except Exception as err:
                await client.close()
                error = self._translate(err, "connect")
                if not isinstance(error, ChannelClosed):
                    raise error from err  # refused credentials: no other member will take them
                last = err  # unreachable member: try the next one
                self._current = (self._current + 1) % len(self._endpoints)
            if time.monotonic() >= probe_at:  # unanswered: a TLS mismatch fails now, not at the timeout
                within = max(min(_PROBE_EVERY, deadline - time.monotonic()), 0.05)
                problems = await asyncio.to_thread(type(self).diagnose, self.url, within)
                if problems:
                    raise problems[0]
                probe_at = time.monotonic() + _PROBE_EVERY
            await asyncio.sleep(0.1)
        raise ChannelClosed(f"no etcd member reachable at {self.url.shown} within {self.timeout:g}s: {last}")

    def _translate(self, err: BaseException, what: str) -> ControlError:
        """The one place where the etcd client's errors become the channel's."""
        if isinstance(err, ControlError):
            return err
        text = str(err) or type(err).__name__
        user = self.url.options.get("user")
        if _permission_denied(err):
            who = f"user {user!r}" if user else "a client without user="
            prefix = self._job_root.decode(errors="replace")
            return AuthError(
                f"etcd at {self.url.shown} refused {who} ({what}: {text}): its roles do not cover this job's keys; "
                f"grant one of them readwrite on the key prefix {prefix}"
            )
        if "authentication failed" in text:
            return AuthError(
                f"etcd at {self.url.shown} refused user {user!r} ({what}: {text}): wrong user name or password; "
                "check user=/password="
            )
        if "user name is empty" in text or isinstance(err, aetcd.exceptions.UnauthenticatedError):
            return AuthError(
                f"etcd at {self.url.shown} requires authentication ({what}: {text}): add user=NAME&password=SECRET"
            )
        if "authentication is not enabled" in text:
            return ConfigError(f"etcd at {self.url.shown} has authentication off ({text}): drop user=/password=")
        if _lease_gone(err):
            return ChannelClosed(self._fenced_message(text))
        if _too_large(err):
            return BadMessage(
                f"etcd at {self.url.shown}: {what} too large: {text}; etcd takes requests up to its "
                "--max-request-bytes (1.5 MiB by default) and this client replies up to 4 MiB: keep "
                "control-plane values small"
            )
        if isinstance(
            err,
            aetcd.exceptions.ConnectionFailedError
            | aetcd.exceptions.ConnectionTimeoutError
            | concurrent.futures.TimeoutError
            | asyncio.TimeoutError
            | OSError,
        ):
            return ChannelClosed(f"etcd at {self.url.shown} unreachable ({what}): {text}")
        return ControlError(f"etcd at {self.url.shown}: {what} failed: {type(err).__name__}: {text}")

    def _fail(self, error: ControlError) -> None:
        super()._fail(error)
        if self._loop.is_running():  # wake the collectives' waiters: they raise it
            self._loop.call_soon_threadsafe(self._releases.interrupt)

    def _fenced_message(self, detail: str) -> str:
        return (
            f"rank {self.rank} of job {self.job!r} was declared lost: its etcd lease expired "
            f"(no keep-alive for {self._ttl}s: the process was frozen or cut off), so etcd refuses "
            f"its writes and the others were told ({detail})"
        )

    def _run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout: float | None = None,
        unanswered: type[ChannelClosed] = ChannelClosed,
    ) -> T:
        """Run ``coro`` on the client's loop; errors come out as the channel's. Waits for
        ``timeout`` (default: the channel's; at least :data:`ANSWER_GRACE`), failing over to
        another member included; then cancels it: ChannelClosed. (A wait inside ``coro``
        ends up to :data:`ANSWER_GRACE` before ``timeout``, see :func:`_wait_within`.) A wait's
        read gives ``unanswered`` (ReadUnanswered: the core reads again while the wait lasts)."""
        wait, what = max(timeout or self.timeout, ANSWER_GRACE), getattr(coro, "__name__", "call")
        future = submit(coro, self._loop)
        try:
            value, error = future.result(timeout=wait)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before 3.11
            future.cancel()
            raise unanswered(f"etcd at {self.url.shown} did not answer within {wait:g}s") from None
        except concurrent.futures.CancelledError as err:  # the call cancelled on the loop (a close)
            raise self._translate(err, what) from err
        if error is None:
            return cast(T, value)
        if isinstance(error, ValueError):
            raise error  # _add found no number: the core's BadMessage
        raise self._translate(error, what) from error

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a client method; while a member is unreachable, fail over to the next endpoint
        and retry for up to ``liveness_timeout`` seconds (a restarting member, a new leader)."""
        deadline = time.monotonic() + self.liveness_timeout
        renewed = False
        while True:
            client = self._etcd
            metadata = client.metadata
            try:
                return await getattr(client, method)(*args, **kwargs)
            except asyncio.CancelledError:
                # Another call failing over closed the client this one ran on (its gRPC calls
                # end cancelled): try again on the new one. A cancellation of this task itself
                # (a wait_for that expired, the channel closing) goes on up.
                if self._client is client or _cancelling():
                    raise
                if time.monotonic() > deadline:
                    raise ChannelClosed(
                        f"etcd at {self.url.shown} unreachable for {self.liveness_timeout:g}s"
                    ) from None
                continue
            except _TRANSIENT as err:
                if _cancelling():  # this call's own cancellation, come out as a lost connection
                    raise asyncio.CancelledError from err
                if time.monotonic() > deadline:
                    raise ChannelClosed(
                        f"etcd at {self.url.shown} unreachable for {self.liveness_timeout:g}s: {err}"
                    ) from err
                if len(self._endpoints) > 1 and self._client is client:
                    # Only the first of the calls failing together on a member moves on, to the
                    # next member (each moving one on could bring them back to the dead one);
                    # the old client is closed once the new one is in place.
                    self._current = (self._current + 1) % len(self._endpoints)
                    self._client = self._new_client()
                    await client.close()
                await asyncio.sleep(0.2)
            except aetcd.exceptions.ClientError as err:
                if _token_dropped(err) and self._etcd.authenticates and not renewed:
                    # etcd forgot the token (unused for --auth-token-ttl): get another, once.
                    renewed = True
                    await self._etcd.reauthenticate(metadata)
                    continue
                error = self._translate(err, method)
                if _lease_gone(err):
                    self._fail(error)  # fenced: every later call says so at once
                raise error from err

    @property
    def _etcd(self) -> EtcdClient:
        """The client, once connected."""
        if self._client is None:
            raise ChannelClosed(f"job {self.job!r}: not connected to etcd at {self.url.shown}")
        return self._client

    def _k(self, key: str) -> bytes:
        return self._root + key.encode()

    # ------------------------------------------------------------------ primitives
    def _put(self, key: str, value: bytes) -> Coroutine[Any, Any, tuple[bool, Any]]:
        return self._once(lambda txn: [txn.put(self._k(key), value)])

    def _set(self, key: str, value: bytes) -> None:
        self._run(self._put(key, value))

    def _put_within(self, key: str, value: bytes, seconds: float) -> None:
        """``_set`` given up after ``seconds`` (a write the keep-alive carries must not hold
        up the next refresh)."""
        self._run(bounded(self._put(key, value), seconds), seconds)

    def _get(self, key: str, timeout: float) -> bytes | None:
        return self._run(self._get_async(self._k(key), timeout), timeout, ReadUnanswered)

    async def _get_async(self, key: bytes, timeout: float) -> bytes | None:
        """Read ``key``; if missing, watch it from the revision read. A watch broken by a lost
        connection is read and watched again (``_call`` waits out the outage), within ``timeout``."""
        deadline = time.monotonic() + _wait_within(timeout)
        while True:
            found = await self._call("get_range", key, key + b"\0")
            if len(found):
                return found[0].value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            watch = await self._call("watch", key, start_revision=found.header.revision + 1)

            async def first_put(watch: Any = watch) -> bytes | None:
                async for event in watch:
                    if event.kind == aetcd.rtypes.EventKind.PUT:
                        return event.kv.value
                return None

            try:
                return await bounded(first_put(), remaining)
            except asyncio.TimeoutError:
                return None
            except _TRANSIENT:
                await asyncio.sleep(0.1)  # the connection dropped under the watch: look again
            finally:
                await watch.cancel()

    # ------------------------------------------------------------------ exactly once
    # A call whose connection drops after etcd committed it, but before the reply came, is
    # re-sent by _call. So every mutation commits together with a record of its result,
    # __dp/ops/SESSION/SEQ (SESSION: this channel's lease), in one transaction guarded by
    # the record's absence: a re-sent transaction that already committed finds its record
    # and returns the recorded result instead of applying again. The records are bound to
    # the lease, which also fences a rank declared lost: once its lease has expired (which
    # is what told the others), etcd refuses every write bound to it.
    def _record_key(self, seq: int) -> bytes:
        return self._k(f"{_OPS}{self._lease.id:x}/{seq}")

    async def _once(self, ops, guard=(), result: bytes = b"", otherwise=()) -> tuple[bool, Any]:
        """Commit ``ops(txn)`` (plus the record of ``result``) if ``guard`` holds, exactly
        once. Returns (True, result) once committed, by this call or by an earlier attempt of
        it whose reply was lost; (False, what the reads ``otherwise`` found) if the guard
        failed (they run in the same transaction)."""
        return await self._commit(ops, guard, result, otherwise=otherwise)

    async def _commit(self, ops, guard=(), result: bytes = b"", reads=(), otherwise=()) -> Any:
        """:meth:`_once`; with ``reads`` (operations run after ``ops`` in the same
        transaction) returns their results, or None where an earlier attempt committed (its
        reads are lost with its reply)."""
        txn = self._etcd.transactions
        seq = next(self._op_seq)
        record = self._record_key(seq)
        prune = [txn.delete(self._record_key(seq - _KEEP_RECORDS))] if seq >= _KEEP_RECORDS else []
        ok, found = await self._call(
            "transaction",
            compare=[txn.version(record) == 0, *guard],
            success=[*ops(txn), txn.put(record, result, lease=self._lease), *prune, *reads],
            failure=[txn.get(record), *otherwise],
        )
        if reads:
            return found[len(found) - len(reads) :] if ok else None
        if ok:
            return True, result
        if found[0]:
            return True, found[0][0][0]  # applied by an attempt whose reply was lost
        return False, found[1:]

    async def _cas_loop(self, key: bytes, update) -> bytes:
        """Read ``key``, ``update(value) -> (result, new)`` with new a value to store,
        _REMOVE or None (write nothing), and commit it exactly once if the key has not
        changed in between (else read again)."""
        while True:
            current = await self._call("get", key)
            result, new = update(None if current is None else current.value)
            if new is None:
                return result

            def ops(txn, new=new):
                return [txn.delete(key) if new is _REMOVE else txn.put(key, new)]

            txn = self._etcd.transactions
            guard = txn.version(key) == 0 if current is None else txn.mod(key) == current.mod_revision
            done, recorded = await self._once(ops, [guard], result)
            if done:
                return recorded

    def _add(self, key: str, amount: int) -> int:
        def update(value: bytes | None) -> tuple[bytes, bytes]:
            new = str(int(value or b"0") + amount).encode()  # ValueError: the core's BadMessage
            return new, new

        return int(self._run(self._cas_loop(self._k(key), update)))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        def update(value: bytes | None) -> tuple[bytes, bytes | None]:
            if value is None:
                return (desired, desired) if not expected else (expected, None)
            return (desired, desired) if value == expected else (value, None)

        return self._run(self._cas_loop(self._k(key), update))

    def _delete(self, key: str) -> bool:
        def update(value: bytes | None) -> tuple[bytes, object]:
            return (b"0", None) if value is None else (b"1", _REMOVE)

        return self._run(self._cas_loop(self._k(key), update)) == b"1"

    async def _read(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` at one revision (None for a missing key): one transaction."""
        values: list[bytes | None] = []
        txn = self._etcd.transactions
        for start in range(0, len(keys), _TXN_OPS):
            chunk = keys[start : start + _TXN_OPS]
            _, found = await self._call("transaction", compare=[], success=[txn.get(k) for k in chunk], failure=[])
            values += [kvs[0][0] if kvs else None for kvs in found]
        return values

    def _check(self, keys: Sequence[str]) -> bool:
        return None not in self._run(self._read([self._k(k) for k in keys]))

    def _num_keys(self) -> int:
        records = self._k(_OPS)
        found = self._run(self._call("get_prefix", self._root, keys_only=True))
        return sum(1 for kv in found if not kv.key.startswith(records))

    def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        return self._run(self._multi_get_async([self._k(k) for k in keys], timeout), timeout, ReadUnanswered)

    async def _multi_get_async(self, keys: list[bytes], timeout: float) -> list[bytes] | None:
        deadline = time.monotonic() + _wait_within(timeout)
        while True:
            values = await self._read(keys)
            present = [value for value in values if value is not None]
            if len(present) == len(values):
                return present
            # Watch the first missing key, then read them all again.
            remaining = deadline - time.monotonic()
            if remaining <= 0 or await self._get_async(keys[values.index(None)], remaining) is None:
                return None

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        items = list(dict(items).items())  # a key given twice: its last value (etcd refuses both in one txn)

        async def put_all() -> None:
            chunk = _TXN_OPS - 2  # room for the record and its pruning
            for start in range(0, len(items), chunk):
                part = items[start : start + chunk]
                await self._once(lambda txn, part=part: [txn.put(self._k(k), v) for k, v in part])

        self._run(put_all())

    def _append(self, key: str, value: bytes) -> None:
        # Guarded by the key's revision, not by its bytes: a lost race is retried.
        self._run(self._cas_loop(self._k(key), lambda current: (b"", (current or b"") + value)))

    # ------------------------------------------------------------------ joining, liveness
    def _claim_rank(self, rank: int | None, claimant: bytes, peer: bytes) -> tuple[int | None, bytes]:
        """The rank is claimed, registered and published in one transaction, guarded by the
        claim's absence (the core's way is a compare_set, then :meth:`_claimed`, then a set:
        four round trips); ``rank=None`` draws from the core's counter first, as the core
        does, and draws again while the rank drawn is held."""
        while True:
            want = rank
            if want is None:
                want = self._add(self._scoped(NEXT_RANK), 1) - 1
                if want >= self.world_size:
                    self._holds_run = False  # waiting for a full job's rank keeps no run alive
                    return None, b""
            claim = self._k(self._scoped(claim_key(want)))

            def ops(txn, want=want, claim=claim):
                return [
                    txn.put(claim, claimant),
                    *self._membership(txn, want),
                    txn.put(self._k(self._scoped(peer_key(want))), peer),
                ]

            txn = self._etcd.transactions
            guard = [txn.version(claim) == 0, txn.value(self._run_key) == self._run_id]
            done, found = self._run(self._once(ops, guard, claimant, otherwise=[txn.get(self._run_key)]))
            run_over = not done and not (found and found[0] and found[0][0][0] == self._run_id)
            if run_over or (done and not self._run(self._hold_run())):
                # The run ended as this rank joined it (its last rank gone, or leaving): what
                # was written is in a dead run's keys, which the next run's start deletes.
                # Into the job's next run, whose token is checked again.
                self._run(self._open_run())
                if not self.native_auth and not self._token_agrees():
                    raise AuthError(self._token_differs)
                continue
            if done:
                self.rank = want
                self._registered = True
                self._holds_run = True
                return want, b""
            if rank is None:
                continue  # held: the next one
            holder, left = self._run(self._read([claim, self._k(f"{_LEFT}{rank}")]))
            if holder is not None:
                self._holder_left = left is not None
                self._holds_run = False  # waiting for another's rank keeps no run alive
                return None, holder
            # Gone between the transaction and the read (its run was wiped): claim again.

    def _membership(self, txn: Any, rank: int) -> list[Any]:
        """The alive key (bound to the lease) and the joined and open markers (not): a rank
        with a joined marker and no alive key has lost its lease."""
        return [
            txn.put(self._k(f"{_ALIVE}{rank}"), b"1", lease=self._lease),
            txn.put(self._k(f"{_JOINED}{rank}"), b"1"),
            txn.put(self._k(f"{_OPEN}{rank}"), b"1"),
        ]

    def _claimed(self) -> None:
        # In one transaction, so that the markers never disagree.
        if self.rank is None:
            raise ControlError("no rank to register: _claimed comes after a rank was claimed")
        markers = self._membership(self._etcd.transactions, self.rank)
        self._run(self._call("transaction", compare=[], success=markers, failure=[]))
        self._registered = True

    def _keep_alive(self, ttl: int) -> None:
        # As often as the heartbeat option asks (at least three times a TTL): a stall of the
        # client or of etcd costs the lease only if it outlasts nearly all of it.
        last_ok = time.monotonic()
        while not self._stop.wait(min(self.heartbeat_interval, ttl / 3)):
            try:
                # Bounded well within the TTL: a refresh stuck on a dead connection must not
                # hold up the next one.
                reply = self._run(bounded(self._call("refresh_lease", self._lease.id), max(ttl / 3, 0.5)), ttl)
                if reply is not None and reply.TTL <= 0:  # expired while this process was frozen
                    self._fail(ChannelClosed(self._fenced_message("found on the next keep-alive")))
                    return
                if (
                    self._holds_run
                    and not self._run(bounded(self._hold_run(), max(ttl / 3, 0.5)), ttl)
                    and not self._stop.is_set()  # not the run's end its own departure made
                ):
                    self._fail(
                        ChannelClosed(
                            f"the run of job {self.job!r} at {self.url.shown} ended under rank {self.rank}: "
                            f"no rank of it kept it alive for {ttl}s"
                        )
                    )
                    return
                last_ok = time.monotonic()
                if self._liveness is not None:  # what rides on the keep-alive (a rank's status)
                    self._liveness._write_riders(lambda key, value: self._put_within(key, value, ttl / 3))
            except Exception as err:  # a member restarting: retry until the lease is gone for good
                if self._stop.is_set():
                    return
                if time.monotonic() - last_ok > ttl:
                    self._fail(ChannelClosed(f"lost etcd at {self.url.shown}: no lease refresh for {ttl}s: {err}"))
                    return

    def _new_liveness(self) -> LeaseLiveness:
        return LeaseLiveness(self)

    # ------------------------------------------------------------------ close
    def _close(self) -> None:
        self._stop.set()
        if self._broken is None and self._client is not None:
            try:
                self._run(self._leave(), min(10.0, self.timeout))
            except ControlError:
                pass  # leaving anyway; the lease expires on its own
        self._shutdown()

    async def _leave(self) -> None:
        remaining = 1
        if self._registered:
            # One key per open rank, not a shared counter: ranks leaving together never retry.
            opened = self._k(_OPEN)
            count = Count(opened, _prefix_end(opened))
            left, mine = self._k(f"{_LEFT}{self.rank}"), self._k(f"{_OPEN}{self.rank}")
            reads = await self._commit(lambda txn: [txn.put(left, b"1"), txn.delete(mine)], reads=[count])
            if reads is None:  # applied by an attempt whose reply was lost: count again
                _, reads = await self._call("transaction", compare=[], success=[count], failure=[])
            remaining = reads[0]
        if self._lease is not None:
            await self._call("revoke_lease", self._lease.id)
        if self._registered and remaining <= 0:
            # The last one out ends the run, then cleans up: a rank joining it meanwhile finds
            # it over at its claim (guarded by the run's key) and joins the next (_claim_rank).
            try:  # not through _call: a lease already gone is no fencing of this rank
                await self._etcd.revoke_lease(self._run_lease)
            except Exception:
                pass  # expired or revoked already, or etcd out of reach: it expires on its own
            await self._call("delete_prefix", self._root)
        if isinstance(self._liveness, LeaseLiveness):
            await self._liveness.cancel()
        await self._releases.cancel()

    def _shutdown(self) -> None:
        if self._client is not None:
            try:
                self._run(self._etcd.close(), 5)
            except Exception:
                pass


def _cancelling() -> bool:
    """Whether the current task is being cancelled (Python 3.11+; False before)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return bool(cancelling is not None and cancelling())


def _wait_within(timeout: float) -> float:
    """How long a wait inside a call of ``timeout`` seconds lasts (see ``_run``)."""
    return max(timeout - min(ANSWER_GRACE, timeout / 2), 1e-3)


def _lease_gone(err: BaseException) -> bool:
    """etcd refused a write bound to this rank's lease: it expired, the rank was declared lost."""
    cause = err.__cause__
    return (
        isinstance(cause, grpc.aio.AioRpcError)
        and cause.code() == grpc.StatusCode.NOT_FOUND
        and "lease" in (cause.details() or "")
    )


def _too_large(err: BaseException) -> bool:
    """A request past etcd's --max-request-bytes (or its gRPC limit), or a reply past the client's."""
    cause = err.__cause__
    if not isinstance(cause, grpc.aio.AioRpcError):
        return False
    return cause.code() == grpc.StatusCode.RESOURCE_EXHAUSTED or (
        cause.code() == grpc.StatusCode.INVALID_ARGUMENT and "request is too large" in (cause.details() or "")
    )


def _permission_denied(err: BaseException) -> bool:
    """etcd refused this user an operation on a key (its roles do not cover it)."""
    cause = err if isinstance(err, grpc.aio.AioRpcError) else err.__cause__
    code = cause.code() if isinstance(cause, grpc.aio.AioRpcError) else None
    return code == grpc.StatusCode.PERMISSION_DENIED or isinstance(err, WatchRefused)


def _token_dropped(err: BaseException) -> bool:
    """etcd no longer knows the auth token (unused for ``--auth-token-ttl``). A watch
    refused is one too: etcd says "permission denied" for a watch with a dropped token."""
    return "invalid auth token" in str(err) or isinstance(err, WatchRefused)


def _credentials(url: ChannelURL) -> grpc.ChannelCredentials | None:
    """TLS credentials from ca= (and cert=/key=), or None for plaintext (options checked by
    :meth:`EtcdChannel._check_options`)."""
    if "ca" not in url.options:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=url.file("ca"), private_key=url.file("key"), certificate_chain=url.file("cert")
    )


class LeaseLiveness(Liveness):
    """A watch on the job's lease-bound alive keys (see the module docstring). The writes a
    rank's heartbeats carry are made by its keep-alive thread, after each refresh."""

    carries_writes = True

    def __init__(self, channel: EtcdChannel) -> None:
        super().__init__()
        self._ch = channel
        self._left: set[int] = set()
        self._watch: Any = None
        self._follower: asyncio.Future[None] | None = None

    def start(self) -> None:
        if self._ch.world_size > 1:
            self._ch._run(self._watch_members())

    def stop(self, announce: bool) -> None:
        pass  # the departure (left key, lease revoked) is the channel's _leave

    def left(self) -> set[int]:
        return set(self._left)

    async def cancel(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
        if self._watch is not None:
            await self._watch.cancel()

    async def _watch_members(self) -> None:
        ch = self._ch
        watch = await self._open_member_watch()
        alive = ch._k(_ALIVE)

        def over() -> bool:  # closed, or failed for good (etcd lost, fenced): nothing to follow
            return ch._stop.is_set() or ch.failure is not None

        async def follow(watch: Any) -> None:
            # A watch dies with its connection (member restart, failover): re-read and re-watch.
            while not over():
                try:
                    async for event in watch:
                        if event.kind == aetcd.rtypes.EventKind.DELETE:
                            await self._judge(int(event.kv.key[len(alive) :]))
                except Exception:
                    if over():
                        return
                    await asyncio.sleep(0.2)
                try:
                    watch = await self._open_member_watch()
                except Exception:  # etcd still away, or the channel closing
                    if over():
                        return
                    await asyncio.sleep(0.5)

        self._follower = asyncio.ensure_future(follow(watch))

    async def _open_member_watch(self) -> Any:
        """Judge every joined rank whose alive key is gone, then watch for more to go."""
        ch = self._ch
        alive, joined = ch._k(_ALIVE), ch._k(_JOINED)
        # Joined markers first: a rank's marker and alive key are written together, so one
        # whose marker was seen and whose alive key is gone a moment later has lost its
        # lease. (Read the other way round, a rank joining in between looked lost.)
        members = {int(kv.key[len(joined) :]) for kv in await ch._call("get_prefix", joined)}
        found = await ch._call("get_prefix", alive)
        present = {int(kv.key[len(alive) :]) for kv in found}
        for rank in members - present - {ch.rank} - self._left - set(self._lost):
            await self._judge(rank)
        # Deletions only (etcd's NOPUT filter): every rank watches every alive key, so each
        # join's put would otherwise reach every rank already there, O(members^2) events.
        self._watch = await ch._call(
            "watch",
            alive,
            range_end=_prefix_end(alive),
            start_revision=found.header.revision + 1,
            kind=aetcd.rtypes.EventKind.DELETE,
        )
        return self._watch

    async def _judge(self, rank: int) -> None:
        ch = self._ch
        if await ch._call("get", ch._k(f"{_LEFT}{rank}")) is not None:
            self._left.add(rank)
            return
        # etcd ends a lease its TTL after its last keep-alive, and the alive key's deletion
        # reaches this watch at once: that keep-alive is the rank's last sign of life.
        reason = f"its etcd lease expired (no keep-alive for {ch._ttl}s)"
        try:
            peer = await ch._call("get", ch._k(ch._scoped(peer_key(rank))))
            info = json.loads(peer.value) if peer is not None else None
        except (ControlError, ValueError):
            info = None
        if isinstance(info, dict):
            reason = with_process(reason, info)
        self._record(LostPeer(rank, time.time() - ch._ttl, reason))
        ch._releases.interrupt()  # blocked collectives raise PeerLost now
