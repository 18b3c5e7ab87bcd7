"""The client's end of the gRPC transport: one bidirectional ``Stream`` per channel.

Every request of the channel (any thread's, heartbeats included) goes out on the stream as a
sealed frame; a reader thread opens each reply and hands it to the request of its id, so a
blocked ``get`` holds up no one. When the stream breaks (coordinator restarting, connection
reset), the reader opens a new one after a short pause and sends every unanswered request
again with its id: the coordinator applies each id once and answers a resend from its cache,
or from wherever the request is parked. Heartbeats and the ``leave`` are not resent: they fail
with the stream, as a call would, and the heartbeat loop judges the silence.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import grpc

from dataparallel.control.v1 import control_pb2_grpc
from dataparallel.errors import BadMessage, ChannelClosed, ControlError
from dataparallel.remote import Exchange
from dataparallel.wire import MAX_FRAME, pb

#: Seconds between attempts to open the stream while the coordinator cannot be reached.
REOPEN_PAUSE = 0.1
_END = object()  # ends a stream's outgoing frames: the client half-closes it


class Pending:
    """A request on the stream, until its reply or a failure that resending cannot mend."""

    __slots__ = ("answered", "error", "frame", "reply", "retry")

    def __init__(self, frame: bytes, retry: bool) -> None:
        self.frame, self.retry = frame, retry
        self.reply: pb.Reply | bytes | None = None  # bytes: a frame this job's key does not open
        self.error: ControlError | None = None
        self.answered = threading.Event()

    def settle(self, reply: pb.Reply | bytes | None = None, error: ControlError | None = None) -> None:
        self.reply, self.error = reply, error
        self.answered.set()


class FrameStream:
    """The stream of one channel, opened on its first request; see the module docstring.

    ``open_reply`` verifies and parses a reply frame, raising :class:`ControlError` when it is
    not sealed with this job's key."""

    def __init__(self, channel: grpc.Channel, target: str, open_reply: Callable[[bytes], pb.Reply]) -> None:
        self._stub = control_pb2_grpc.ControlServiceStub(channel)
        self._target = target
        self._open_reply = open_reply
        self._cond = threading.Condition()
        self._pending: dict[int, Pending] = {}
        self._outbox: queue.SimpleQueue | None = None  # the open stream's outgoing frames
        self._call: grpc.RpcContext | None = None
        self._closed = threading.Event()
        self._reader: threading.Thread | None = None
        #: Why the last stream ended, for the message when no reply comes.
        self.reason = ""

    def send(self, request_id: int, frame: bytes, retry: bool) -> Pending:
        pending = Pending(frame, retry)
        with self._cond:
            if self._closed.is_set():
                raise ChannelClosed(f"channel to the coordinator at {self._target} is closed")
            self._pending[request_id] = pending
            if self._outbox is not None:
                self._outbox.put(pb.Frame(sealed=frame))
            elif self._reader is None:
                self._reader = threading.Thread(target=self._run, name="dp-grpc-stream", daemon=True)
                self._reader.start()
            else:
                self._cond.notify()
        return pending

    def forget(self, request_id: int) -> None:
        """The request is answered or given up: a late reply to it is dropped."""
        with self._cond:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed.set()
            self._cond.notify_all()
            if self._outbox is not None:
                self._outbox.put(_END)
            call, waiting = self._call, list(self._pending.values())
            self._pending.clear()
        for pending in waiting:
            pending.settle(error=ChannelClosed(f"channel to the coordinator at {self._target} closed"))
        if call is not None:
            call.cancel()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)

    # ------------------------------------------------------------------ the reader thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed.is_set():
                    self._cond.wait()  # nothing to send: no stream to a coordinator that may be gone
                if self._closed.is_set():
                    return
                outbox: queue.SimpleQueue = queue.SimpleQueue()
                for pending in self._pending.values():  # unanswered: resent with the same id
                    outbox.put(pb.Frame(sealed=pending.frame))
                self._outbox = outbox
                self._call = call = self._stub.Stream(iter(outbox.get, _END))
            failure = None
            try:
                for frame in call:
                    self._deliver(frame.sealed)
            except grpc.RpcError as err:
                failure = err
            with self._cond:
                self._outbox = self._call = None
                outbox.put(_END)
                if self._closed.is_set():
                    return
                self._broken(failure)
            self._closed.wait(REOPEN_PAUSE)

    def _deliver(self, sealed: bytes) -> None:
        try:
            reply = self._open_reply(sealed)
        except ControlError:
            # Not sealed with this job's key: whoever answers does not know the token, and every
            # request waiting on it says so (each opens the frame itself, raising its own error).
            with self._cond:
                waiting = list(self._pending.values())
            for pending in waiting:
                pending.settle(sealed)
            return
        with self._cond:
            if reply.id:
                pending = self._pending.get(reply.id)
                waiting = [pending] if pending is not None else []  # else: given up on already
            else:  # the coordinator could not read a frame of ours (its id unknown)
                waiting = list(self._pending.values())
        for pending in waiting:
            pending.settle(reply)

    def _broken(self, err: grpc.RpcError | None) -> None:
        """The stream ended (lock held): requests that cannot be resent fail, the rest wait
        for the next stream."""
        code = err.code() if err is not None else grpc.StatusCode.OK
        details = (err.details() or "") if err is not None else "the coordinator ended the stream"
        self.reason = details
        retry = code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        for request_id, pending in list(self._pending.items()):
            if retry and pending.retry:
                continue
            del self._pending[request_id]
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                pending.settle(error=BadMessage(f"coordinator at {self._target}: {details}"))
            else:
                pending.settle(error=ChannelClosed(f"coordinator at {self._target}: {code.name}: {details}"))


class GrpcExchange(Exchange):
    """A request on the channel's :class:`FrameStream`."""

    def __init__(self, stream: FrameStream, request: pb.Request, frame: bytes, open_reply: Callable) -> None:
        if len(frame) > MAX_FRAME:
            raise BadMessage(f"request of {len(frame)} bytes exceeds the limit of {MAX_FRAME}")
        self._stream, self._id, self._open_reply = stream, request.id, open_reply
        self._pending = stream.send(request.id, frame, retry=request.WhichOneof("op") not in ("heartbeat", "leave"))

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
