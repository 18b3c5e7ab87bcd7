"""``grpc://HOST:PORT``: the control channel over gRPC, for sites that standardise on it,
need TLS with certificates, or sit behind HTTP/2 proxies.

Same protocol, coordinator and client logic as ZeroMQ (``dataparallel.control.coordinator``,
``dataparallel.control.remote``); this package only carries requests, on one bidirectional ``Stream``
per channel (:mod:`.stream`). Rank 0 (or the first ``rank=None`` process to bind) hosts the
server; ``dataparallel serve grpc://...`` runs it standalone. Every request is sealed with a key
derived from the job token (its own, not the ZeroMQ frame key), and its reply comes back
sealed: no key or token ever travels, and without TLS a stranger can read the stream but
neither forge nor replay a request.

Options:
  tls=1          use TLS (needs ca=, and cert=/key= on the hosting rank)
  ca=FILE        PEM root certificate(s) to trust
  cert=, key=    PEM certificate and key of this process: the server's when it hosts, the
                 client certificate it presents when the server requires one
  mtls=1         the hosting rank requires client certificates signed by ca=
  server_name=   the name to expect in the server's certificate, if not the URL's host
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from dataparallel.control.check import tls_diagnosis
from dataparallel.control.coordinator import Coordinator
from dataparallel.control.registry import ChannelURL
from dataparallel.control.remote import RemoteChannel
from dataparallel.control.wire import pb, purpose_key, seal
from dataparallel.errors import ConfigError, ControlError

from .server import GRPC_OPTIONS, GrpcCoordinatorServer
from .stream import FrameStream, GrpcExchange


def frame_key(token: str | None) -> bytes:
    """The key that seals gRPC requests and replies (not the ZeroMQ frame key)."""
    return purpose_key(token, "grpc-frame-mac")


def server_credentials(url: ChannelURL) -> grpc.ServerCredentials | None:
    if not url.flag("tls"):
        return None
    cert, key = url.file("cert"), url.file("key")
    if not cert or not key:
        raise ConfigError(f"{url.shown!r}: tls=1 needs cert= and key= on the process that hosts the coordinator")
    mtls = url.flag("mtls")
    ca = url.file("ca")
    if mtls and not ca:
        raise ConfigError(f"{url.shown!r}: mtls=1 needs ca= to verify client certificates")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=mtls)


class GrpcChannel(RemoteChannel):
    scheme = "grpc"
    OPTIONS = {
        "tls": "1 to use TLS",
        "ca": "PEM file of the root certificate(s) to trust",
        "cert": "PEM certificate of this process (server certificate when hosting; client certificate)",
        "key": "PEM private key for cert",
        "mtls": "1: the hosting rank requires client certificates",
        "server_name": "name expected in the server certificate (default: the URL's host)",
    }

    MISMATCH_HINT = "do tls= and the certificates match?"

    def __init__(self, url: ChannelURL, **kwargs) -> None:
        super().__init__(url, **kwargs)
        self._tls = url.flag("tls")
        self._frame_key = frame_key(self.token)
        host, port = self._coordinator_address(
            lambda: GrpcCoordinatorServer(
                url.host, url.require_port(), self._frame_key, server_credentials(url)
            ).start(),
            busy=(OSError, RuntimeError),
        )
        self._target = f"{host}:{port}"
        self._stream = FrameStream(lambda: self._open_channel(url), self._target, self._open_reply, self._refuse)
        try:
            self._init_remote()
        except BaseException:
            self._close_transport()
            raise

    @classmethod
    def security(cls, url: ChannelURL, token: str | None) -> str:
        signed = (
            "calls and replies sealed with the token's key (HMAC-SHA256)"
            if token
            else "no token: anyone who can reach the coordinator can join, read and write any token-less job"
        )
        if not url.flag("tls"):
            return f"{signed}; not encrypted: keys and values are readable on the network (add tls=1 and ca=)"
        return f"{signed}; TLS" + (" with client certificates (mtls=1)" if url.flag("mtls") else "")

    @classmethod
    def _check_options(cls, url: ChannelURL, token: str | None, serving: bool) -> None:
        super()._check_options(url, token, serving)
        url.needs("tls", "ca", "cert", "key", "mtls", "server_name")
        url.certificate_files()
        if serving:
            server_credentials(url)

    def _open_channel(self, url: ChannelURL) -> grpc.aio.Channel:
        options: list[tuple[str, str | int]] = list(GRPC_OPTIONS)
        if not self._tls:
            return grpc.aio.insecure_channel(self._target, options=options)
        if "server_name" in url.options:
            options.append(("grpc.ssl_target_name_override", url.options["server_name"]))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=url.file("ca"), private_key=url.file("key"), certificate_chain=url.file("cert")
        )
        return grpc.aio.secure_channel(self._target, credentials, options=options)

    def _exchange(self, request: pb.Request) -> GrpcExchange:
        return GrpcExchange(self._stream, request, seal(self._frame_key, request), self._open_reply)

    def _close_transport(self) -> None:
        self._stream.close()
        self._stop_hosting()

    @classmethod
    def diagnose(cls, url: ChannelURL, timeout: float, token: str | None = None) -> list[ControlError]:
        return tls_diagnosis(
            url,
            want_tls=url.flag("tls"),
            ca=url.options.get("ca"),
            cert=url.options.get("cert"),
            key=url.options.get("key"),
            server_name=url.options.get("server_name"),
            alpn=["h2"],
            timeout=timeout,
        )

    @classmethod
    def serve(
        cls,
        url: ChannelURL,
        token: str | None,
        ready: Callable[[int], None] = lambda port: None,
        coordinator: Callable[[Coordinator], None] | None = None,
    ) -> None:
        """Run a standalone coordinator until interrupted; ``ready(port)`` once it listens,
        after ``coordinator(it)`` (what ``serve --http`` lists the jobs of)."""
        server = GrpcCoordinatorServer(url.host, url.require_port(), frame_key(token), server_credentials(url))
        if coordinator is not None:
            coordinator(server.coordinator)
        server.serve(ready)
