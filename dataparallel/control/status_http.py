"""A running job's view over HTTP: a page for people, JSON for programs, ``/metrics`` for
Prometheus.

:class:`StatusServer` serves what :func:`~dataparallel.control.status.read_job` reads:

- ``GET /``: a page, refreshed every two seconds: the ranks' table, the stalls, and each
  rank's step time over the last minutes (as this server saw it, one point a look);
- ``GET /status.json``: the view itself, as ``dataparallel status --json`` prints it;
- ``GET /metrics``: the view in Prometheus' text format, written by the standard client
  library (``prometheus_client``: ``pip install 'dataparallel[observe]'``).

Read-only: nothing it serves writes to the job. Bound to 127.0.0.1 unless told. Without a
token, it answers only requests made for an address or for this machine's own names
(``Host``), so that another site's page cannot read it through a name made to point here
(DNS rebinding). With a token,
every request carries it, as a bearer token (``Authorization: Bearer TOKEN``, as Prometheus'
``authorization`` setting sends it) or, for a browser, as ``?token=TOKEN`` (the page's
links keep it). Looks at the job at most once a second, however many requests come.

Behind ``dataparallel status --http`` (any transport, from any machine with the URL and
token) and ``TrainOptions.status_http`` (on the driver). On ``dataparallel serve --http``
it serves every job of the coordinator: ``/`` lists them, ``/job/NAME/`` is a job's page
(and ``/job/NAME/status.json``), ``/metrics`` holds every job's ranks (label ``job``).
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from ..errors import ConfigError, ControlError
from .status import render_events

log = logging.getLogger(__name__)

#: Seconds a look at the job serves requests before the next one reads it again.
FRESH_FOR = 1.0
#: Seconds of step times the page plots, per rank.
HISTORY_S = 300.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (on 127.0.0.1) for :class:`StatusServer`."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"HTTP address {text!r}: expected [HOST:]PORT, e.g. 127.0.0.1:8265") from None
    if not 0 <= number < 65536:
        raise ConfigError(f"HTTP address {text!r}: port {number} is not in 0..65535")
    return host.strip("[]") or "127.0.0.1", number


class _JobView:
    """One job's last look (read again once older than :data:`FRESH_FOR`), its step times
    over the last minutes and the last look's failure."""

    def __init__(self, look: Callable[[], dict[str, Any]]) -> None:
        self.look = look
        self.lock = threading.Lock()
        self.view: dict[str, Any] | None = None
        self.at = 0.0
        self.error: str | None = None
        self.history: dict[int, deque[tuple[float, float]]] = {}

    def current(self) -> dict[str, Any]:
        with self.lock:
            now = time.monotonic()
            if self.view is None or now - self.at >= FRESH_FOR:
                try:
                    view = self.look()
                except ControlError as err:  # shown on the page; the next look tries again
                    self.error = f"{type(err).__name__}: {err}"
                    self.at = time.monotonic()
                    if self.view is None:
                        raise
                else:
                    self.view, self.at, self.error = view, time.monotonic(), None
                    self._remember(view)
            assert self.view is not None
            return self.view

    def _remember(self, view: Mapping[str, Any]) -> None:
        cutoff = view["time"] - HISTORY_S
        for r in view["ranks"]:
            points = self.history.setdefault(r["rank"], deque())
            if r.get("step_s"):
                points.append((view["time"], float(r["step_s"])))
            while points and points[0][0] < cutoff:
                points.popleft()


class StatusServer:
    """Serves ``look()`` (a :func:`read_job` view) over HTTP; see the module's docstring.
    With ``jobs`` (the names of the jobs there are) and ``look_job`` (a job's view), every
    job instead, each under ``/job/NAME/``."""

    def __init__(
        self,
        look: Callable[[], dict[str, Any]] | None = None,
        address: tuple[str, int] = ("127.0.0.1", 0),
        token: str | None = None,
        *,
        jobs: Callable[[], list[str]] | None = None,
        look_job: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        if (look is None) == (jobs is None or look_job is None):
            raise ValueError("StatusServer serves one job (look) or every job (jobs and look_job)")
        self._token = token
        self._one = None if look is None else _JobView(look)
        self._jobs, self._look_job = jobs, look_job
        self._views: dict[str, _JobView] = {}
        self._views_lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._answer(self)

            timeout = 30  # a connection that sends nothing is closed: no thread waits for it for ever

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("status http: %s", self.command)  # not the path: it may hold the token

        self._http = ThreadingHTTPServer(address, Handler)
        self._http.daemon_threads = True
        self._hosts = {"localhost", "127.0.0.1", "::1", self.address[0].lower(), socket.getfqdn().lower()}
        self._hosts.add(socket.gethostname().lower())
        if token is None and address[0] not in ("127.0.0.1", "::1", "localhost"):
            log.warning(
                "the job's view is served at %s to anyone who reaches it: no token (set one: DP_TOKEN, --token-file)",
                self.url,
            )
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._http.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/"

    def start(self) -> StatusServer:
        self._thread = threading.Thread(target=self._http.serve_forever, name="dp-status-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=5)
        self._http.server_close()

    def __enter__(self) -> StatusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the view
    def view(self, job: str | None = None) -> dict[str, Any]:
        """The job's view, read again where the last look is older than :data:`FRESH_FOR`
        (``job``: which, where this server serves every job)."""
        return self._job(job).current()

    def _job(self, job: str | None) -> _JobView:
        if self._one is not None:
            return self._one
        assert job is not None and self._look_job is not None
        look_job = self._look_job
        with self._views_lock:
            if job not in self._views:
                self._views[job] = _JobView(lambda: look_job(job))
            return self._views[job]

    # ------------------------------------------------------------------ requests
    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(request.path)
        query = parse_qs(parts.query)
        if self._token is None and not _for_us(request.headers.get("Host") or "", self._hosts):
            # Without a token, only requests for an address or this machine's names: a page of
            # another site whose name was made to point here (DNS rebinding) reads nothing.
            self._send(request, HTTPStatus.FORBIDDEN, "text/plain", b"not a name of this server\n")
            return
        if not self._allowed(request, query):
            self._send(
                request, HTTPStatus.UNAUTHORIZED, "text/plain", b"a token is needed: Authorization: Bearer TOKEN\n"
            )
            return
        token = query.get("token", [""])[0]
        path = parts.path
        if self._one is None:  # every job: / lists them, /job/NAME/... is one's, /metrics all
            if path == "/":
                self._send(request, HTTPStatus.OK, "text/html; charset=utf-8", self._index(token).encode())
                return
            if path == "/metrics":
                self._metrics_of_all(request)
                return
            name, sep, rest = path.removeprefix("/job/").partition("/")
            if not path.startswith("/job/") or not sep or not name:
                self._send(request, HTTPStatus.NOT_FOUND, "text/plain", b"not found: try /, /job/NAME/ or /metrics\n")
                return
            self._answer_job(request, unquote(name), "/" + rest, token)
            return
        self._answer_job(request, None, path, token)

    def _answer_job(self, request: BaseHTTPRequestHandler, job: str | None, path: str, token: str) -> None:
        state = self._job(job)
        try:
            view = state.current()
        except ControlError as err:
            self._send(request, HTTPStatus.SERVICE_UNAVAILABLE, "text/plain", f"{err}\n".encode())
            return
        if path == "/":
            self._send(request, HTTPStatus.OK, "text/html; charset=utf-8", self._page(state, view, token).encode())
        elif path in ("/status.json", "/metrics") and state.error is not None:
            # The last look failed: no stale figures a scraper would take for current ones.
            self._send(request, HTTPStatus.SERVICE_UNAVAILABLE, "text/plain", f"{state.error}\n".encode())
        elif path == "/status.json":
            self._send(request, HTTPStatus.OK, "application/json", json.dumps(view).encode())
        elif path == "/metrics":
            from prometheus_client.exposition import CONTENT_TYPE_LATEST

            self._send(request, HTTPStatus.OK, CONTENT_TYPE_LATEST, metrics_text(view))
        else:
            self._send(request, HTTPStatus.NOT_FOUND, "text/plain", b"not found: try /, /status.json or /metrics\n")

    def _metrics_of_all(self, request: BaseHTTPRequestHandler) -> None:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        views = []
        for job in self._listed():
            state = self._job(job)
            try:
                view = state.current()
            except ControlError:
                continue  # a job between runs: left out, not shown stale
            if state.error is None:
                views.append(view)
        self._send(request, HTTPStatus.OK, CONTENT_TYPE_LATEST, metrics_text(*views))

    def _listed(self) -> list[str]:
        """The jobs there are; the views of jobs no longer there dropped."""
        assert self._jobs is not None
        names = self._jobs()
        with self._views_lock:
            for gone in [j for j in self._views if j not in names]:
                del self._views[gone]
        return names

    def _index(self, token: str) -> str:
        e = html.escape
        keep = f"?token={quote(token)}" if token else ""
        names = sorted(self._listed())
        items = "".join(f'<li><a href="job/{quote(n, safe="")}/{keep}">{e(n)}</a></li>' for n in names)
        return INDEX.format(
            jobs=f'<ul id="jobs">{items}</ul>' if items else '<p id="jobs">no job</p>', metrics=f"metrics{keep}"
        )

    def _allowed(self, request: BaseHTTPRequestHandler, query: Mapping[str, list[str]]) -> bool:
        if self._token is None:
            return True
        expected = self._token.encode()
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip().encode(), expected):
            return True
        return any(hmac.compare_digest(given.encode(), expected) for given in query.get("token", []))

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: HTTPStatus, kind: str, body: bytes) -> None:
        request.send_response(status)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        request.end_headers()
        request.wfile.write(body)

    def _page(self, state: _JobView, view: Mapping[str, Any], token: str) -> str:
        e = html.escape
        stalled = {s["rank"] for s in view["stalls"]}
        slow = {s["rank"] for s in view.get("stragglers") or []}
        rows = []
        for r in view["ranks"]:
            split = ", ".join(f"{e(k)} {v * 1000:.1f} ms" for k, v in sorted(r["split"].items(), key=lambda kv: -kv[1]))
            cls = "stalled" if r["rank"] in stalled else "straggler" if r["rank"] in slow else e(r["state"])
            step_time = "-" if not r["step_s"] else f"{r['step_s'] * 1000:.1f} ms"
            rows.append(
                f'<tr class="{cls}"><td>{r["rank"]}</td><td>{e(r["state"])}</td><td>{e(str(r["host"] or "-"))}</td>'
                f"<td>{e(str(r['pid'] or '-'))}</td><td>{_cell(r['epoch'])}</td><td>{_cell(r['step'])}</td>"
                f"<td>{e(str(r['phase'] or '-'))}</td><td>{_seconds(r['phase_s'])}</td>"
                f"<td>{step_time}</td><td>{split or '-'}</td>"
                f"<td>{_seconds(r['heartbeat_age'])}</td><td>{_sparkline(state, r['rank'])}</td></tr>"
            )
        stalls = "".join(f"<li>rank {s['rank']}: {e(s['cause'])}</li>" for s in view["stalls"])
        stragglers = "".join(f"<li>rank {s['rank']}: {e(s['cause'])}</li>" for s in view.get("stragglers") or [])
        error = f'<p class="error">last look failed: {e(state.error)}</p>' if state.error else ""
        events = "".join(f"<li>{e(line)}</li>" for line in reversed(render_events(view.get("events") or [])))
        keep = f"?token={quote(token)}" if token else ""
        return PAGE.format(
            job=e(view["job"]),
            world=view["world_size"],
            when=time.strftime("%H:%M:%S", time.localtime(view["time"])),
            rows="\n".join(rows),
            stalls=f'<ul id="stalls">{stalls}</ul>' if stalls else '<p id="stalls">no stall</p>',
            stragglers=(
                f'<ul id="stragglers">{stragglers}</ul>' if stragglers else '<p id="stragglers">no straggler</p>'
            ),
            error=error,
            events=f'<ul id="events">{events}</ul>' if events else '<p id="events">no event</p>',
            json=f"status.json{keep}",
            metrics=f"metrics{keep}",
        )


def _sparkline(state: _JobView, rank: int) -> str:
    points = list(state.history.get(rank, ()))
    if len(points) < 2:
        return ""
    t0, t1 = points[0][0], points[-1][0]
    top = max(v for _, v in points) or 1.0
    coords = " ".join(f"{(t - t0) / max(t1 - t0, 1e-9) * 160:.1f},{30 - v / top * 28:.1f}" for t, v in points)
    title = f"step time, last {t1 - t0:.0f}s: max {top * 1000:.1f} ms"
    return (
        f'<svg width="160" height="32" role="img"><title>{title}</title>'
        f'<polyline fill="none" stroke="#36c" stroke-width="1.5" points="{coords}"/></svg>'
    )


def _for_us(header: str, names: set[str]) -> bool:
    """Whether a request's ``Host`` names this server: an address written as one (a name made
    to point here by another site is not), or one of this machine's names."""
    import ipaddress

    host = header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1 : host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":")[0]
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host in names


def _cell(value: object) -> str:
    return "-" if value is None else html.escape(str(value))


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>{job}: dataparallel status</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }}
th, td {{ padding: 0.25em 0.6em; border-bottom: 1px solid #ddd; text-align: left; white-space: nowrap; }}
tr.stalled {{ background: #fdd; }} tr.silent {{ background: #fec; }} tr.straggler {{ background: #ffd; }}
tr.closed {{ color: #888; }} tr.failed {{ background: #eee; color: #a00; }}
.error {{ color: #a00; }}
</style></head>
<body>
<h1>job {job}: {world} rank(s)</h1>
<p>looked at {when}; <a href="{json}">status.json</a>, <a href="{metrics}">metrics</a></p>
{error}
<table id="ranks">
<thead><tr><th>rank</th><th>state</th><th>host</th><th>pid</th><th>epoch</th><th>step</th><th>phase</th>
<th>in phase</th><th>step time</th><th>split</th><th>status age</th><th>step time, last minutes</th></tr></thead>
<tbody>
{rows}
</tbody></table>
<h2>stalls</h2>
{stalls}
<h2>stragglers</h2>
{stragglers}
<h2>events</h2>
{events}
</body></html>
"""

INDEX = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>dataparallel: jobs</title>
<style>body {{ font: 14px system-ui, sans-serif; margin: 1.5em; }}</style></head>
<body>
<h1>jobs on this coordinator</h1>
{jobs}
<p><a href="{metrics}">metrics</a> (every job's ranks)</p>
</body></html>
"""


def metrics_text(*views: Mapping[str, Any]) -> bytes:
    """``views`` (jobs' views) in Prometheus' text format, through ``prometheus_client``."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(views))
    return generate_latest(registry)


class _Collector:
    """The metrics of views (prometheus_client's custom collector protocol)."""

    def __init__(self, views: Sequence[Mapping[str, Any]]) -> None:
        self._views = views

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["job", "rank", "host"]

        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels + (extra or []))

        running = gauge("dataparallel_rank_running", "1 where the rank's status comes in (0: silent, closed, absent)")
        state = gauge("dataparallel_rank_state", "1 for the rank's state", ["state"])
        step = gauge("dataparallel_rank_step", "the rank's optimizer step (global)")
        epoch = gauge("dataparallel_rank_epoch", "the rank's epoch")
        phase = gauge("dataparallel_rank_phase_seconds", "seconds in the rank's current phase", ["phase"])
        step_s = gauge("dataparallel_rank_step_seconds", "the rank's median step time over its last steps")
        split = gauge("dataparallel_rank_step_phase_seconds", "the rank's mean seconds per step in a phase", ["phase"])
        age = gauge("dataparallel_rank_status_age_seconds", "seconds since the rank last published its status")
        stalled = gauge("dataparallel_rank_stalled", "1 where a stall waits for the rank", ["phase"])
        score = gauge(
            "dataparallel_rank_straggler_score",
            "the rank's own time per step against the fastest rank's or its own best (1: as fast)",
            ["against"],
        )
        for view in self._views:
            self._add(view, running, state, step, epoch, phase, step_s, split, age, stalled, score)
        yield from (running, state, step, epoch, phase, step_s, split, age, stalled, score)

    @staticmethod
    def _add(view: Mapping[str, Any], *families: Any) -> None:
        running, state, step, epoch, phase, step_s, split, age, stalled, score = families
        job = str(view["job"])
        stalls_for = {s["rank"]: s for s in view["stalls"]}
        for r in view["ranks"]:
            base = [job, str(r["rank"]), str(r["host"] or "")]
            running.add_metric(base, 1.0 if r["state"] == "running" else 0.0)
            state.add_metric([*base, str(r["state"])], 1.0)
            if r["step"] is not None:
                step.add_metric(base, float(r["step"]))
            if r["epoch"] is not None:
                epoch.add_metric(base, float(r["epoch"]))
            if r["phase"] is not None and r["phase_s"] is not None:
                phase.add_metric([*base, str(r["phase"])], float(r["phase_s"]))
            if r["step_s"]:
                step_s.add_metric(base, float(r["step_s"]))
            for name, seconds in (r.get("split") or {}).items():
                split.add_metric([*base, str(name)], float(seconds))
            if r["heartbeat_age"] is not None:
                age.add_metric(base, float(r["heartbeat_age"]))
            stall = stalls_for.get(r["rank"])
            stalled.add_metric([*base, str((stall or {}).get("phase") or "")], 1.0 if stall else 0.0)
            for against, value in (r.get("scores") or {}).items():
                if value is not None:
                    score.add_metric([*base, against.removeprefix("vs_")], float(value))
