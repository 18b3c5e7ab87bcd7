"""aetcd's client with what aetcd 1.0 lacks: TLS, an auth token obtained again when etcd
has dropped it (etcd forgets a token unused for ``--auth-token-ttl`` seconds, 300 by default),
and a transaction operation that counts the keys of a range (:class:`Count`).

Written against aetcd 1.0's ``Client`` (its ``connect``, ``watch`` and ``transaction``, which
read the channel, stubs, ``metadata`` and ``_watcher`` attributes): the rest of the client is
aetcd's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.watcher
import grpc
from aetcd import rpc
from aetcd.client import _handle_errors


class Count:
    """A transaction operation: how many keys lie in ``[key, range_end)`` (etcd's count-only
    range: no keys or values travel). Its result in :meth:`EtcdClient.transaction` is an int."""

    def __init__(self, key: bytes, range_end: bytes) -> None:
        self.key = key
        self.range_end = range_end


class WatchRefused(aetcd.exceptions.ClientError):
    """etcd refused to create a watch (its reason, e.g. ``etcdserver: permission denied``)."""


class _Watcher(aetcd.watcher.Watcher):
    # etcd answers a watch it refuses (no permission, or a token it has dropped) with
    # created=True, canceled=True: aetcd 1.0 takes that for a watch that never fires.
    async def _handle_response(self, response: Any) -> None:
        if response.created and response.canceled:
            async with self._lock:
                if self._new_callback is not None:
                    self._new_callback.error = WatchRefused(response.cancel_reason or "watch refused")
                    self._new_callback_ready.notify_all()
            return
        await super()._handle_response(response)


class EtcdClient(aetcd.Client):
    """``credentials``: TLS channel credentials, or None for plaintext. With ``username``,
    :meth:`reauthenticate` gets a fresh token and a watch stream that carries it."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__(host=host, port=port, username=username, password=password)
        self._credentials = credentials
        self._auth_lock = asyncio.Lock()
        self._is_connecting = False  # a task is in connect()

    @property
    def authenticates(self) -> bool:
        return self._username is not None

    @_handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        target = f"{self._host}:{self._port}"
        try:
            if self._credentials is None:
                self.channel = grpc.aio.insecure_channel(target)
            else:
                self.channel = grpc.aio.secure_channel(target, self._credentials)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            if self.authenticates:
                await self._authenticate()
            else:
                self._watcher = _Watcher(rpc.WatchStub(self.channel), timeout=self._timeout)
            self._connected.set()
        except BaseException:
            if self.channel is not None:
                await self.channel.close()
            self._init_channel_attrs()
            raise
        finally:
            self._is_connecting = False

    @_handle_errors
    async def reauthenticate(self, stale: Any) -> None:
        """A fresh token, unless another call got one since ``stale`` (the ``metadata`` the
        refused call carried)."""
        async with self._auth_lock:
            if self.metadata is stale and self.channel is not None:
                await self._authenticate()

    async def _authenticate(self) -> None:
        self.auth_stub = rpc.AuthStub(self.channel)
        request = rpc.AuthenticateRequest(name=self._username, password=self._password)
        reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
        self.metadata = (("token", reply.token),)
        # A watch stream carries the token it was opened with, and etcd checks it for each
        # new watch: new watches go on a new stream. Those on the old one end with an error
        # their owners treat as a lost connection (read again, watch again).
        old, self._watcher = self._watcher, _Watcher(rpc.WatchStub(self.channel), metadata=self.metadata)
        if old is not None:
            await old._terminate_stream(aetcd.exceptions.ConnectionFailedError("etcd auth token renewed"))

    @_handle_errors
    async def watch(
        self,
        key: bytes,
        range_end: bytes | None = None,
        start_revision: int | None = None,
        kind: aetcd.rtypes.EventKind | None = None,
    ) -> Any:
        """aetcd's ``watch``, with the cancel bound to the stream the watch is on (watch ids
        are per stream: one from an old stream must not cancel another on the new one).
        ``kind``: only events of that kind (etcd filters the others out before sending)."""
        await self.connect()
        watcher = self._watcher
        events: asyncio.Queue[Any] = asyncio.Queue()
        callback = await watcher.add_callback(
            key, events.put, range_end=range_end, start_revision=start_revision, kind=kind
        )
        canceled = asyncio.Event()

        async def cancel() -> None:
            canceled.set()
            await events.put(None)
            await watcher.cancel(callback.watch_id)

        @_handle_errors
        async def iterator() -> Any:
            while not canceled.is_set():
                event = await events.get()
                if event is None:
                    canceled.set()
                elif isinstance(event, Exception):
                    canceled.set()
                    raise event
                else:
                    yield event

        return aetcd.rtypes.Watch(iterator, cancel, callback.watch_id)

    def _ops_to_requests(self, ops: Any) -> list[Any]:
        requests = []
        for op in ops or ():
            if isinstance(op, Count):
                count = rpc.RangeRequest(key=op.key, range_end=op.range_end, count_only=True)
                requests.append(rpc.RequestOp(request_range=count))
            else:
                requests += super()._ops_to_requests([op])
        return requests

    @_handle_errors
    async def transaction(self, compare: Any, success: Any = None, failure: Any = None) -> tuple[bool, list[Any]]:
        """aetcd's ``transaction``, with :class:`Count` operations (their result: the count)."""
        await self.connect()
        request = rpc.TxnRequest(
            compare=[c.build_message() for c in compare],
            success=self._ops_to_requests(success),
            failure=self._ops_to_requests(failure),
        )
        reply = await self.kvstub.Txn(request, timeout=self._timeout, metadata=self.metadata)
        taken = success if reply.succeeded else failure
        results: list[Any] = []
        for op, response in zip(taken or (), reply.responses, strict=True):
            kind = response.WhichOneof("response")
            if isinstance(op, Count):
                results.append(response.response_range.count)
            elif kind == "response_range":
                header = reply.header
                results.append([(kv.value, aetcd.rtypes.Get(header, kv)) for kv in response.response_range.kvs])
            else:
                results.append(response)
        return reply.succeeded, results
