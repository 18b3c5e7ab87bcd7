"""An attacker on the path between clients and a coordinator, for zmq and gRPC.

It holds no token. It relays every frame (each client over its own upstream connection, as
a router would) and, by ``mode``, attacks the requests:

- ``"forward"``: relays as they are;
- ``"reflect"``: sends each request frame straight back to its sender, as if it were the
  coordinator's reply, and relays the original only ``delay`` seconds later (the true reply
  comes, late);
- ``"replay"``: answers each request at once with the reply to the same request id that it
  recorded earlier (from another session, run or job under the same token), and relays the
  original ``delay`` seconds later.

Replies are recorded by request id while ``record`` is set. Frames are plaintext protobuf
behind a MAC (no CURVE, no TLS), so reading a request's id takes no key. ``attacks`` counts
the frames forged.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from concurrent import futures

import grpc
import zmq

from dataparallel.control.v1 import control_pb2_grpc
from dataparallel.control.wire import MAC_SIZE, pb


class Attacker:
    def __init__(self, delay: float = 0.3) -> None:
        self.mode = "forward"
        self.record = False
        self.delay = delay
        self.recorded: dict[int, bytes] = {}
        self.attacks = 0
        self._lock = threading.Lock()

    def on_request(self, frame: bytes) -> tuple[bytes | None, float]:
        """What to send back to the client at once (or None), and after how long to relay ``frame``."""
        mode = self.mode
        if mode == "reflect":
            with self._lock:
                self.attacks += 1
            return frame, self.delay
        if mode == "replay":
            forged = self.recorded.get(pb.Request.FromString(frame[MAC_SIZE:]).id)
            if forged is not None:
                with self._lock:
                    self.attacks += 1
            return forged, self.delay
        return None, 0.0

    def on_reply(self, frame: bytes) -> None:
        if self.record:
            self.recorded.setdefault(pb.Reply.FromString(frame[MAC_SIZE:]).id, frame)


class ZmqMitm(Attacker):
    """A ROUTER for the clients, one DEALER to the coordinator per client."""

    def __init__(self, upstream_port: int, delay: float = 0.3) -> None:
        super().__init__(delay)
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self.port = self._front.bind_to_random_port("tcp://127.0.0.1")
        self._upstream = f"tcp://127.0.0.1:{upstream_port}"
        self._backs: dict[bytes, zmq.Socket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mitm-zmq", daemon=True)
        self._thread.start()

    def _back(self, ident: bytes) -> zmq.Socket:
        sock = self._backs.get(ident)
        if sock is None:
            sock = self._backs[ident] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._upstream)
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self._front, zmq.POLLIN)
        later: list[tuple[float, int, bytes, bytes]] = []
        order = itertools.count()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                while later and later[0][0] <= now:
                    _, _, ident, frame = heapq.heappop(later)
                    self._back(ident).send(frame)
                wait = min(50.0, max(0.0, (later[0][0] - now) * 1000)) if later else 50.0
                for sock, _ in self._poller.poll(wait):
                    if sock is self._front:
                        ident, frame = self._front.recv_multipart()
                        forged, after = self.on_request(frame)
                        if forged is not None:
                            self._front.send_multipart([ident, forged])
                        if after:
                            heapq.heappush(later, (time.monotonic() + after, next(order), ident, frame))
                        else:
                            self._back(ident).send(frame)
                    else:
                        ident = next(i for i, s in self._backs.items() if s is sock)
                        frame = sock.recv()
                        self.on_reply(frame)
                        self._front.send_multipart([ident, frame])
        finally:
            self._ctx.destroy(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class GrpcMitm(Attacker):
    """A gRPC ``ControlService`` that opens a stream to the coordinator for each client stream."""

    def __init__(self, upstream_port: int, delay: float = 0.3) -> None:
        super().__init__(delay)
        self._upstream = grpc.insecure_channel(f"127.0.0.1:{upstream_port}")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        control_pb2_grpc.add_ControlServiceServicer_to_server(_Relay(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None).wait(5)
        self._upstream.close()


class _Relay(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, mitm: GrpcMitm) -> None:
        self._mitm = mitm

    def Stream(self, request_iterator, context):  # noqa: N802
        mitm = self._mitm
        to_client: queue.Queue = queue.Queue()
        to_server: queue.Queue = queue.Queue()

        def outgoing():
            while (frame := to_server.get()) is not None:
                yield frame

        call = control_pb2_grpc.ControlServiceStub(mitm._upstream).Stream(outgoing())

        def client_side() -> None:
            try:
                for frame in request_iterator:
                    forged, after = mitm.on_request(frame.sealed)
                    if forged is not None:
                        to_client.put(pb.Frame(sealed=forged))
                    if after:
                        threading.Timer(after, to_server.put, (frame,)).start()
                    else:
                        to_server.put(frame)
            except grpc.RpcError:
                pass
            finally:
                threading.Timer(mitm.delay + 0.1, to_server.put, (None,)).start()

        def server_side() -> None:
            try:
                for frame in call:
                    mitm.on_reply(frame.sealed)
                    to_client.put(frame)
            except grpc.RpcError:
                pass
            finally:
                to_client.put(None)

        threading.Thread(target=client_side, daemon=True).start()
        threading.Thread(target=server_side, daemon=True).start()
        try:
            while context.is_active():
                try:
                    frame = to_client.get(timeout=0.2)
                except queue.Empty:
                    continue
                if frame is None:
                    return
                yield frame
        finally:
            call.cancel()
