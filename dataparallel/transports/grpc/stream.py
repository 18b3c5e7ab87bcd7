"""The client's end of the gRPC transport: one bidirectional ``Stream`` per channel, all of a
process's streams served by one asyncio event loop thread.

Every request of the channel (any thread's, heartbeats included) goes out on the stream as a
sealed frame; the loop opens each reply and hands it to the request of its id, so a blocked
``get`` holds up no one. When the stream breaks (coordinator restarting, connection reset),
the loop opens a new one after a short pause and sends every unanswered request again with its
id: the coordinator applies each id once and answers a resend from its cache, or from wherever
the request is parked. Heartbeats and the ``leave`` are not resent: they fail with the stream,
as a call would, and the heartbeat loop judges the silence. The loop is the process's
(:mod:`dataparallel.control.eventloop`), not threads per channel.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

import grpc

from dataparallel.control.eventloop import client_loop
from dataparallel.control.remote import Exchange, binding
from dataparallel.control.v1 import control_pb2_grpc
from dataparallel.control.wire import MAX_FRAME, Misdirected, pb
from dataparallel.errors import BadMessage, ChannelClosed, ControlError

#: Seconds between attempts to open the stream while the coordinator cannot be reached.
REOPEN_PAUSE = 0.1
_END = object()  # ends a stream's outgoing frames: the client half-closes it


class Pending:
    """A request on the stream, until its reply or a failure that resending cannot mend."""

    __slots__ = ("answered", "binding", "error", "frame", "reply", "retry")

    def __init__(self, frame: bytes, retry: bool, binding: bytes) -> None:
        self.frame, self.retry, self.binding = frame, retry, binding
        self.reply: pb.Reply | bytes | None = None  # bytes: a frame this job's key does not open
        self.error: ControlError | None = None
        self.answered = threading.Event()

    def settle(self, reply: pb.Reply | bytes | None = None, error: ControlError | None = None) -> None:
        self.reply, self.error = reply, error
        self.answered.set()


class FrameStream:
    """The stream of one channel, opened on its first request; see the module docstring.

    ``open_channel`` makes the ``grpc.aio`` channel (called on the loop, which owns it);
    ``open_reply`` verifies and parses a reply frame, raising :class:`ControlError` when it is
    not sealed with this job's key; ``refuse`` is told of each frame sealed with it that is no
    reply to the request it names (a request bounced back, a reply replayed)."""

    def __init__(
        self,
        open_channel: Callable[[], grpc.aio.Channel],
        target: str,
        open_reply: Callable[[bytes], pb.Reply],
        refuse: Callable[[str], None],
    ) -> None:
        self._loop = client_loop()
        self._target = target
        self._open_reply = open_reply
        self._refuse = refuse
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._closed = False
        # Touched on the loop only:
        self._channel: grpc.aio.Channel | None = None
        self._open_channel = open_channel
        self._outbox: asyncio.Queue | None = None  # the open stream's outgoing frames
        self._sent: set[int] = set()  # ids already on the open stream
        self._call: grpc.aio.StreamStreamCall | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # bound to the loop at its first wait
        #: Why the last stream ended, for the message when no reply comes.
        self.reason = ""

    def send(self, request_id: int, frame: bytes, retry: bool, binding: bytes) -> Pending:
        pending = Pending(frame, retry, binding)
        with self._lock:
            if self._closed:
                raise ChannelClosed(f"channel to the coordinator at {self._target} is closed")
            self._pending[request_id] = pending
        self._loop.call_soon_threadsafe(self._queue, request_id)
        return pending

    def forget(self, request_id: int) -> None:
        """The request is answered or given up: a late reply to it is dropped."""
        with self._lock:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiting = list(self._pending.values())
            self._pending.clear()
        for pending in waiting:
            pending.settle(error=ChannelClosed(f"channel to the coordinator at {self._target} closed"))
        done: Future = asyncio.run_coroutine_threadsafe(self._shut(), self._loop)
        try:
            done.result(timeout=2.0)
        except Exception:  # the loop is stuck or gone (interpreter exit): nothing more to release
            done.cancel()

    # ------------------------------------------------------------------ on the loop
    def _queue(self, request_id: int) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None or self._closed:
            return
        if self._task is None:
            self._task = self._loop.create_task(self._run())
        elif self._outbox is not None:
            if request_id not in self._sent:
                self._sent.add(request_id)
                self._outbox.put_nowait(pending.frame)
        else:
            self._wake.set()  # between streams: the next one sends it

    async def _shut(self) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(_END)
        if self._call is not None:
            self._call.cancel()
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def _run(self) -> None:
        while not self._closed:
            with self._lock:
                unanswered = list(self._pending.items())
            if not unanswered:
                self._wake.clear()
                await self._wake.wait()  # nothing to send: no stream to a coordinator that may be gone
                continue
            outbox: asyncio.Queue = asyncio.Queue()
            self._sent = set()
            for request_id, pending in unanswered:  # resent with the same id
                self._sent.add(request_id)
                outbox.put_nowait(pending.frame)
            self._outbox = outbox
            failure: grpc.RpcError | Exception | None = None
            try:
                if self._channel is None:
                    self._channel = self._open_channel()
                self._call = call = control_pb2_grpc.ControlServiceStub(self._channel).Stream(_frames(outbox))
                async for frame in call:
                    self._deliver(frame.sealed)
            except asyncio.CancelledError:
                if not self._closed:
                    raise
            except Exception as err:  # grpc.RpcError; anything else must not silence the channel either
                failure = err
            self._outbox = self._call = None
            outbox.put_nowait(_END)
            if self._closed:
                return
            self._broken(failure)
            await asyncio.sleep(REOPEN_PAUSE)

    def _deliver(self, sealed: bytes) -> None:
        try:
            reply = self._open_reply(sealed)
        except Misdirected as err:
            self._refuse(str(err))
            return
        except ControlError:
            # Not sealed with this job's key: whoever answers does not know the token, and every
            # request waiting on it says so (each opens the frame itself, raising its own error).
            with self._lock:
                waiting = list(self._pending.values())
            for pending in waiting:
                pending.settle(sealed)
            return
        with self._lock:
            addressed = self._pending.get(reply.id) if reply.id else None
        if addressed is None:  # given up on already, or bound to no request of ours (id 0)
            return
        if reply.answers != addressed.binding:
            self._refuse(f"a reply to request {reply.id} of another session, run or job (replayed)")
            return
        addressed.settle(reply)

    def _broken(self, err: Exception | None) -> None:
        """The stream ended: requests that cannot be resent fail, the rest wait for the next one."""
        if isinstance(err, grpc.RpcError):
            code, details = err.code(), err.details() or ""
        elif err is None:
            code, details = grpc.StatusCode.OK, "the coordinator ended the stream"
        else:
            code, details = grpc.StatusCode.UNKNOWN, f"{type(err).__name__}: {err}"
        self.reason = details
        # The path broke: the coordinator ended the stream, or could not be reached, or the
        # connection under it broke mid-way, which gRPC's core reports as INTERNAL in some
        # ways ("Internal error from Core", an RST_STREAM; grpc/grpc#9177) as well as
        # UNAVAILABLE. The coordinator itself answers every request with a status of ours
        # and sends no gRPC error. A request that can be resent waits for the next stream.
        retry = code in (
            grpc.StatusCode.OK,
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.INTERNAL,
        )
        failed = []
        with self._lock:
            for request_id, pending in list(self._pending.items()):
                if retry and pending.retry:
                    continue
                del self._pending[request_id]
                failed.append(pending)
        for pending in failed:
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                pending.settle(error=BadMessage(f"coordinator at {self._target}: {details}"))
            else:
                pending.settle(error=ChannelClosed(f"coordinator at {self._target}: {code.name}: {details}"))


async def _frames(outbox: asyncio.Queue) -> AsyncIterator[pb.Frame]:
    while (frame := await outbox.get()) is not _END:
        yield pb.Frame(sealed=frame)


class GrpcExchange(Exchange):
    """A request on the channel's :class:`FrameStream`."""

    def __init__(self, stream: FrameStream, request: pb.Request, frame: bytes, open_reply: Callable) -> None:
        if len(frame) > MAX_FRAME:
            raise BadMessage(f"request of {len(frame)} bytes exceeds the limit of {MAX_FRAME}")
        self._stream, self._id, self._open_reply = stream, request.id, open_reply
        retry = request.WhichOneof("op") not in ("heartbeat", "leave")
        self._pending = stream.send(request.id, frame, retry, binding(request))

    @property
    def reason(self) -> str:  # type: ignore[override]
        return self._stream.reason

    def poll(self, wait: float) -> pb.Reply | None:
        pending = self._pending
        if not pending.answered.wait(wait):
            return None
        if pending.error is not None:
            raise pending.error
        if isinstance(pending.reply, bytes):
            return self._open_reply(pending.reply)  # raises: not sealed with this job's key
        return pending.reply

    def cancel(self) -> None:
        self._stream.forget(self._id)
