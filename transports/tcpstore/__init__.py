"""``tcpstore://HOST:PORT``: torch's own ``TCPStore`` behind the channel interface.

The baseline the other transports are measured against. Rank 0 (or, with ``rank=None``,
whichever process binds the port first) hosts the store in-process. Jobs share the
server's key space under a ``JOB/`` prefix, so ``num_keys`` counts every job's keys. A
TCPStore client serialises its calls, so each thread gets its own connection (``clone``).
The token is only checked for agreement: TCPStore has no authentication.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from dataparallel.channel import ControlChannel
from dataparallel.errors import ChannelClosed, ConfigError
from dataparallel.registry import ChannelURL

T = TypeVar("T")


class TCPStoreChannel(ControlChannel):
    scheme = "tcpstore"
    # Each timed-out TCPStore wait logs a C++ warning: poll for lost peers less often.
    liveness_poll = 5.0

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        if len(url.hosts) != 1 or url.path:
            raise ConfigError(f"{url.raw!r}: expected tcpstore://HOST:PORT")
        self._address = f"{url.host}:{url.require_port()}"
        self._prefix = f"{self.job}/"
        self._lock = threading.Lock()
        self._hosting = False
        self._root = self._open(url.host, url.require_port())
        self._clients: dict[int, dist.TCPStore] = {threading.get_ident(): self._root}

    def _open(self, host: str, port: int) -> dist.TCPStore:
        wait = timedelta(seconds=self.timeout)
        if self.rank in (None, 0) and self.serve and not _torchrun_agent_store(host, port):
            try:
                store = dist.TCPStore(host, port, is_master=True, timeout=wait, wait_for_workers=False)
                self._hosting = True
                return store
            except (dist.DistNetworkError, RuntimeError):
                pass  # the port is taken: a store is already served there (another job's, or standalone)
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=wait)
        except (dist.DistError, RuntimeError) as err:
            raise ChannelClosed(f"no TCPStore reachable at {host}:{port} within {self.timeout:g}s: {err}") from err

    @property
    def hosts_coordinator(self) -> bool:
        return self._hosting

    @property
    def port(self) -> int:
        return self._root.port

    def _client(self) -> dist.TCPStore:
        ident = threading.get_ident()
        client = self._clients.get(ident)
        if client is None:
            with self._lock:
                if self._root is None:
                    raise ChannelClosed(f"{self!r} is closed")
                client = self._root.clone()
                self._clients[ident] = client
        return client

    def _call(self, op: Callable[[dist.TCPStore], T]) -> T:
        try:
            return op(self._client())
        except dist.DistNetworkError as err:
            raise ChannelClosed(f"TCPStore at {self._address} went away: {err}") from err

    def _set(self, key: str, value: bytes) -> None:
        self._call(lambda s: s.set(self._prefix + key, value))

    def _wait(self, full: list[str], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the (prefixed) keys; False on timeout."""
        try:
            self._call(lambda s: s.wait(full, timedelta(seconds=max(timeout, 1e-3))))
        except dist.DistStoreError as err:
            if "timeout" in str(err).lower():
                return False
            raise ChannelClosed(f"TCPStore at {self._address}: {err}") from err
        return True

    def _get(self, key: str, timeout: float) -> bytes | None:
        full = self._prefix + key
        return self._call(lambda s: s.get(full)) if self._wait([full], timeout) else None

    def _add(self, key: str, amount: int) -> int:
        return self._call(lambda s: s.add(self._prefix + key, amount))

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(lambda s: s.compare_set(self._prefix + key, expected, desired))

    def _delete(self, key: str) -> bool:
        return self._call(lambda s: s.delete_key(self._prefix + key))

    def _check(self, keys: Sequence[str]) -> bool:
        return self._call(lambda s: s.check([self._prefix + k for k in keys]))

    def _num_keys(self) -> int:
        return self._call(lambda s: s.num_keys())

    def _multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes] | None:
        full = [self._prefix + k for k in keys]
        return self._call(lambda s: s.multi_get(full)) if self._wait(full, timeout) else None

    def _multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        self._call(lambda s: s.multi_set([self._prefix + k for k, _ in items], [v for _, v in items]))

    def _append(self, key: str, value: bytes) -> None:
        self._call(lambda s: s.append(self._prefix + key, value))

    def _close(self) -> None:
        with self._lock:
            # Dropping the last reference to the hosting store stops its server.
            self._clients.clear()
            self._root = None


def _torchrun_agent_store(host: str, port: int) -> bool:
    """True when host:port is the store torchrun's agent already serves for its workers."""
    env = os.environ
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and (host, str(port)) == (
        env.get("MASTER_ADDR"),
        env.get("MASTER_PORT"),
    )
