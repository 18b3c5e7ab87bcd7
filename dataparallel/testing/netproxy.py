"""A TCP forwarder for fault injection: sits between clients and a server on 127.0.0.1,
records the bytes it carries, and can reset every connection at once (a brief network drop)
or swallow the server's next reply and then reset (a request applied whose answer was lost),
or stop answering altogether (:meth:`TcpProxy.blackhole`: connections stay open, and new ones
are taken, but nothing passes either way, as with a frozen server or a link that went dark),
or hold what it carries for a while and then pass it on in order (:meth:`TcpProxy.stall`, a
congested link)."""

from __future__ import annotations

import socket
import struct
import threading
from urllib.parse import urlsplit, urlunsplit


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._captured = bytearray()
        self._closed = False
        self.accepting = True
        self._swallow = threading.Event()
        self._holding = threading.Event()
        self._stopped = threading.Event()
        self._dark = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._hold, self._skip = 0.3, 0
        #: Connections reset so far (each a client's, with its link to the server).
        self.resets = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def captured(self) -> bytes:
        with self._lock:
            return bytes(self._captured)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self.accepting:
                client.close()
                continue
            if self._dark.is_set():
                with self._lock:
                    self._conns.append(client)  # taken, never answered
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for s in (client, upstream):  # forward small requests at once, as the peers send them
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [client, upstream]
            for a, b, from_server in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(a, b, from_server), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while data := src.recv(65536):
                if self._dark.is_set():
                    continue  # swallowed, both ways
                if from_server and self._holding.is_set():
                    continue  # the reply to the request lost_next_reply was armed for: dropped
                if not from_server and self._swallow.is_set():
                    if self._skip > 0:
                        self._skip -= 1
                    else:
                        self._swallow.clear()
                        self._holding.set()
                        threading.Timer(self._hold, self._end_hold).start()
                with self._lock:
                    if len(self._captured) < 16 << 20:
                        self._captured += data
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def drop_connections(self) -> None:
        """Reset every live connection (the peers see ECONNRESET and reconnect)."""
        with self._lock:
            conns, self._conns = self._conns, []
            self.resets += len(conns) // 2
        for s in conns:
            try:  # a linger of 0 makes close() send RST, as a failed link or middlebox does;
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)  # and shutdown wakes the pump blocked on it
            except OSError:
                pass
            s.close()

    def lose_next_reply(self, hold: float = 0.3, skip: int = 0) -> None:
        """Let ``skip`` requests pass, forward the next one, swallow whatever the server sends
        for ``hold`` seconds (time enough to apply it), then reset every connection: the
        request was applied and its client never hears so. (A request is a burst of bytes
        from a client; with one client and one call at a time, that is one call.)"""
        self._hold, self._skip = hold, skip
        self._swallow.set()

    def _end_hold(self) -> None:
        self.drop_connections()
        self._holding.clear()

    def blackhole(self) -> None:
        """From now on forward nothing, either way, and answer nothing: live connections stay
        open and new ones are accepted, but no byte passes (a frozen server, a link gone dark
        without a reset). Until :meth:`close`."""
        self._dark.set()

    def stall(self) -> None:
        """Hold every byte from now on, either way, until :meth:`resume` passes them on, in
        order (connections stay open: a congested link, not a broken one)."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def reset_every(self, seconds: float) -> None:
        """Reset every connection each ``seconds`` until :meth:`close`."""

        def resets() -> None:
            while not self._stopped.wait(seconds):
                self.drop_connections()

        threading.Thread(target=resets, name="proxy-resets", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._stopped.set()
        self._flowing.set()
        self._listener.close()
        self.drop_connections()


def proxy_in_front(url: str) -> tuple[TcpProxy | None, str]:
    """A :class:`TcpProxy` in front of ``url``'s HOST:PORT, and the URL through it; (None, url)
    for a URL without one HOST:PORT (nothing to put a proxy in front of)."""
    parts = urlsplit(url)
    if parts.port is None or "," in parts.netloc:
        return None, url
    proxy = TcpProxy(parts.port)
    return proxy, urlunsplit(parts._replace(netloc=f"127.0.0.1:{proxy.port}"))
