"""``dataparallel check URL``: can this machine reach the job's coordinator (or etcd), how
fast, and does the token work? Each failure comes with a diagnosis a person can act on:
nothing listening, host unreachable, TLS or encryption mismatch, wrong token.

The probe never hosts a coordinator and never joins a job: it opens a client-only session
of a job of its own (``__dp-check``), times ``rounds`` round trips, and leaves.
"""

from __future__ import annotations

import errno
import socket
import ssl
import statistics
import time
from dataclasses import dataclass, field

from ..errors import AuthError, ConfigError, ControlError
from .registry import ChannelURL, mask_url, resolve

CHECK_JOB = "__dp-check"


@dataclass
class CheckReport:
    #: The URL checked, as output shows it (its secrets masked).
    url: str
    lines: list[str] = field(default_factory=list)
    #: What is wrong, or None when everything worked.
    problem: str | None = None
    round_trips_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.problem is None

    def render(self) -> str:
        status = "OK" if self.ok else f"PROBLEM: {self.problem}"
        return "\n".join([f"check {self.url}", *(f"  {line}" for line in self.lines), status])


def check(
    url: str, *, token: str | None = None, timeout: float = 5.0, rounds: int = 20, where: str | None = None
) -> CheckReport:
    """Diagnose the channel at ``url`` (which came from ``where``, if given); see the module docstring."""
    report = CheckReport(mask_url(url))
    try:
        parsed, cls = resolve(url, token, where=where)
    except ConfigError as err:
        report.problem = str(err)
        return report
    report.lines.append(f"security: {cls.security(parsed, token)}")
    service = getattr(cls, "SERVICE", "the coordinator")
    endpoints = [(host, port) for host, port in parsed.hosts if port is not None]
    if not endpoints:
        report.lines.append(f"{parsed.scheme}: in-process transport, nothing to reach over the network")
    reachable = 0
    for host, port in endpoints:
        ok, text = tcp_probe(host, port, timeout, service)
        report.lines.append(text)
        reachable += ok
    if endpoints and not reachable:
        report.problem = report.lines[-1] if len(endpoints) == 1 else f"no endpoint of {parsed.shown} is reachable"
        return report
    problems = [str(problem) for problem in cls.diagnose(parsed, timeout, token)]
    if problems:
        report.lines.extend(problems)
        report.problem = problems[0]
        return report
    start = time.perf_counter()
    try:
        channel = cls(parsed, rank=None, world_size=1, job=CHECK_JOB, token=token, timeout=timeout, serve=False)
    except AuthError as err:
        report.problem = f"wrong token: {err}" if cls.native_auth else str(err)
        return report
    except ControlError as err:
        report.problem = str(err)
        return report
    try:
        report.lines.append(f"session opened in {(time.perf_counter() - start) * 1e3:.1f} ms")
        if cls.native_auth:
            report.lines.append(f"token accepted by {service}" if token else "no token: the job must use none")
        else:
            report.lines.append(f"token: {parsed.scheme} has no server-side token; it is compared when a rank joins")
        for _ in range(rounds):
            t0 = time.perf_counter()
            channel._check(["__dp/check"])
            report.round_trips_ms.append((time.perf_counter() - t0) * 1e3)
    except AuthError as err:
        report.problem = f"wrong token: {err}" if cls.native_auth else str(err)
    except ControlError as err:
        report.problem = str(err)
    finally:
        channel.close()
    if report.round_trips_ms:
        rtt = sorted(report.round_trips_ms)
        report.lines.append(
            f"round trip over {len(rtt)} requests: median {statistics.median(rtt):.2f} ms, "
            f"min {rtt[0]:.2f} ms, max {rtt[-1]:.2f} ms"
        )
    return report


def tcp_probe(host: str, port: int, timeout: float, service: str = "the coordinator") -> tuple[bool, str]:
    """(reachable, one line saying what happened) for a TCP connection to host:port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        return False, f"cannot resolve host {host!r}: {err.strerror}"
    start = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return False, f"nothing listening on {host}:{port} (connection refused): is {service} running there?"
    except TimeoutError:
        return False, (
            f"no answer from {host}:{port} within {timeout:g}s: "
            "host down, wrong address, or a firewall drops the packets"
        )
    except OSError as err:
        if err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return False, f"no route to {host}:{port} ({err.strerror}): wrong address or network down"
        return False, f"cannot connect to {host}:{port}: {err.strerror or err}"
    address = infos[0][4][0]
    return True, f"TCP {host}:{port} ({address}) reachable, connect {(time.perf_counter() - start) * 1e3:.1f} ms"


def speaks_tls(host: str, port: int, timeout: float, alpn: list[str] | None = None) -> bool | None:
    """Whether the server at host:port completes a TLS handshake (certificates unchecked);
    None if it could not be asked."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(alpn)
    try:
        _handshake(host, port, context, host, timeout)
        return True
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError, EOFError):
        return False
    except OSError:
        return None


def _handshake(
    host: str, port: int, context: ssl.SSLContext, server_name: str, timeout: float, settle: bool = False
) -> None:
    """One TLS handshake with host:port; raises what it meets. ``settle``: then wait a
    moment for the server's verdict on the client's certificate, which TLS 1.3 sends after
    the handshake (an alert, raised as :class:`ssl.SSLError`)."""
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        if settle:
            tls.settimeout(min(timeout, 0.5))
            try:
                # A server that accepted us speaks first (HTTP/2 settings) or waits; one that
                # did not sends an alert or hangs up.
                if tls.recv(1) == b"":
                    raise ssl.SSLError("the server closed the connection after the handshake")
            except TimeoutError:
                pass


def tls_diagnosis(
    url: ChannelURL,
    *,
    want_tls: bool,
    ca: str | None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
    alpn: list[str] | None = None,
    timeout: float = 5.0,
    how_to_enable: str = "tls=1&ca=CA.pem",
    how_to_disable: str = "tls=1",
) -> list[ControlError]:
    """TLS mismatches between ``url`` and the server at each of its endpoints: a
    :class:`ConfigError` for each, an :class:`AuthError` for a certificate that does not verify."""
    problems: list[ControlError] = []
    for host, port in url.hosts:
        if port is None:
            continue
        tls = speaks_tls(host, port, timeout, alpn)
        if tls is None:
            continue
        if tls and not want_tls:
            problems.append(
                ConfigError(
                    f"TLS mismatch: the server at {host}:{port} speaks TLS, the URL does not: add {how_to_enable}"
                )
            )
        elif not tls and want_tls:
            problems.append(
                ConfigError(
                    f"TLS mismatch: the server at {host}:{port} speaks plaintext, the URL asks for TLS: "
                    f"drop {how_to_disable}"
                )
            )
        elif tls and ca:
            try:
                context = ssl.create_default_context(cafile=ca)
            except (OSError, ssl.SSLError) as err:
                problems.append(ConfigError(f"TLS: cannot load ca={ca}: {getattr(err, 'strerror', None) or err}"))
                continue
            if alpn:
                context.set_alpn_protocols(alpn)
            try:
                if cert and key:
                    context.load_cert_chain(cert, key)
                _handshake(host, port, context, server_name or host, timeout, settle=True)
            except ssl.SSLCertVerificationError as err:
                problems.append(
                    AuthError(
                        f"TLS: the certificate of {host}:{port} does not verify against ca={ca}: {err.verify_message}"
                    )
                )
            except ssl.SSLError as err:
                # After the handshake: the server refused the client certificate (or its absence).
                mine = f"this client's certificate (cert={cert})" if cert else "a client without a certificate"
                why = getattr(err, "reason", None) or err.args[0]
                problems.append(
                    AuthError(
                        f"TLS: the server at {host}:{port} refuses {mine}: {why}; "
                        "use cert=/key= signed by a CA the server trusts"
                    )
                )
            except OSError:
                pass  # the session attempt reports it
    return problems
