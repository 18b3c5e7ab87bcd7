"""``dataparallel status`` on real training jobs: ranks that are processes training with
``dp.fit`` (gloo), read from outside the job by the command line and by ``dp.observe``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_loop import spawn

import dataparallel as dp
from dataparallel.testing import free_port

JOB = "loop"
#: How long a fault may take to show in the view (the issue's bound is 5 s from the fault).
SHOWS_WITHIN = 5.0


def _view(url: str) -> dict:
    with dp.observe(url, job=JOB, timeout=10) as ch:
        return dp.read_job(ch)


def _until(url: str, ok, what: str, within: float = 60.0) -> tuple[dict, float]:
    """Read the job's view until ``ok(view)``; the view, and when it first held."""
    deadline = time.monotonic() + within
    last: dict | None = None
    while time.monotonic() < deadline:
        try:
            last = _view(url)
        except dp.ControlError:  # the job's coordinator not up yet, or no run yet
            last = None
        if last is not None and ok(last):
            return last, time.monotonic()
        time.sleep(0.2)
    pytest.fail(f"{what}: not seen within {within:g}s; last view: {json.dumps(last)[-3000:]}")


def _training(view: dict) -> bool:
    return all(r["state"] == "running" and (r["step"] or 0) >= 1 for r in view["ranks"])


def _finish(procs) -> None:
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"a rank exited {p.returncode}:\n{(out + err)[-3000:]}"


@pytest.mark.timeout(180)
def test_status_names_the_rank_whose_data_loading_stalls_and_what_the_others_do(tmp_path: Path) -> None:
    """Three ranks train (zmq, gloo); rank 2's data loader stalls mid-training. Within 5 s of
    the stall's start (the threshold, 2 s, included), ``dataparallel status --json``
    names rank 2, in ``data``, as the rank that ranks 0 and 1 wait for in ``backward`` (DDP's
    gradient all-reduce); the text view says the same, ``dataparallel top`` at each of its
    looks, and the driver's ``/metrics`` (``status_http``). Released, the job ends well."""
    url = f"zmq://127.0.0.1:{free_port()}"
    release = tmp_path / "release"
    web = free_port()
    cfg = {
        "url": url,
        "world": 3,
        "epochs": 3,
        "out": str(tmp_path / "out.pt"),
        "stall_data": [2, 45, str(release)],
        "status_http": f"127.0.0.1:{web}",
    }
    procs = [spawn({**cfg, "rank": r}) for r in range(3)]
    try:
        stalled = Path(f"{release}.stalled")
        deadline = time.monotonic() + 60
        while not stalled.exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "rank 2 never stalled"
            time.sleep(0.02)
        began = time.monotonic()
        # Named once the others' wait passes the threshold (2 s here: steps of milliseconds).
        view, seen = _until(url, lambda v: any(s["rank"] == 2 and s["phase"] == "data" for s in v["stalls"]), "stall")
        assert seen - began < SHOWS_WITHIN, f"named {seen - began:.1f}s after the stall began"
        ranks = view["ranks"]
        assert ranks[2]["phase"] == "data", ranks[2]
        (stall,) = [s for s in view["stalls"] if s["rank"] == 2]
        assert stall["phase"] == "data" and stall["waiting"] == [0, 1], stall
        assert [ranks[r]["phase"] for r in (0, 1)] == ["backward", "backward"], ranks
        assert all(r["pid"] == p.pid for r, p in zip(ranks, procs, strict=True)), (ranks, [p.pid for p in procs])
        cli = [sys.executable, "-m", "dataparallel", "status", url, "--job", JOB]
        said = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60, check=True)
        printed = json.loads(said.stdout)
        assert [s["rank"] for s in printed["stalls"]] == [2], printed["stalls"]
        fields = {"rank", "host", "pid", "phase", "step", "heartbeat_age"}
        assert fields <= set(printed["ranks"][0]), printed["ranks"][0]
        text = subprocess.run(cli, capture_output=True, text=True, timeout=60, check=True).stdout
        assert "rank 2: in 'data'" in text and "wait in 'backward'" in text, text
        top = [sys.executable, "-m", "dataparallel", "top", url, "--job", JOB, "--iterations", "2", "--interval", "0.5"]
        live = subprocess.run(top, capture_output=True, text=True, timeout=60, check=True).stdout
        assert live.count("rank 2: in 'data'") == 2 and live.count("job 'loop': 3 rank(s)") == 2, live
        # The driver's HTTP view (status_http) says it to Prometheus.
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        stalled = {
            s.labels["rank"]: (s.value, s.labels["phase"])
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "dataparallel_rank_stalled"
        }
        assert stalled == {"0": (0, ""), "1": (0, ""), "2": (1, "data")}, stalled
        # `dataparallel status --http`: the same view from outside the job, until SIGTERM.
        served = subprocess.Popen([*cli, "--http", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
        try:
            assert served.stdout is not None
            said = served.stdout.readline()
            assert said.startswith("serving job 'loop' at http://127.0.0.1:"), said
            address = said.split(" at ")[1].split()[0]
            with urllib.request.urlopen(f"{address}status.json", timeout=10) as answer:
                assert [s["rank"] for s in json.loads(answer.read())["stalls"]] == [2]
        finally:
            served.terminate()
            assert served.wait(timeout=30) == 0
    finally:
        release.touch()
    _finish(procs)


@pytest.mark.timeout(180)
def test_status_names_a_frozen_rank_silent_within_seconds(tmp_path: Path) -> None:
    """Three ranks train with steps of 0.1 s; rank 1 is frozen (SIGSTOP) for a few seconds.
    The view names it silent, with its last phase, within 5 s of the freeze; resumed before
    the liveness timeout, the job ends well."""
    url = f"zmq://127.0.0.1:{free_port()}"
    cfg = {"url": url, "world": 3, "epochs": 4, "out": str(tmp_path / "out.pt"), "step_sleep": 0.1}
    procs = [spawn({**cfg, "rank": r}) for r in range(3)]
    try:
        _until(url, _training, "the job training")
        os.kill(procs[1].pid, signal.SIGSTOP)
        frozen = time.monotonic()
        view, seen = _until(
            url, lambda v: any(s["rank"] == 1 and s["cause"].startswith("silent") for s in v["stalls"]), "rank 1 silent"
        )
        assert seen - frozen < SHOWS_WITHIN, f"named {seen - frozen:.1f}s after the freeze"
        assert view["ranks"][1]["state"] == "silent", view["ranks"][1]
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    _finish(procs)


@pytest.mark.timeout(180)
def test_a_stall_timeout_fails_every_rank_with_stalled_naming_the_culprit(tmp_path: Path) -> None:
    """Three ranks train with ``stall_timeout=3``; rank 2's data loader stalls (for a minute,
    unless interrupted). Every rank ends with :class:`~dataparallel.Stalled` naming rank 2 in
    ``data``, rank 2 included (interrupted inside its loader), well before the stall would
    have ended or the collective timeout (60 s) would have fired."""
    url = f"zmq://127.0.0.1:{free_port()}"
    release = tmp_path / "release"
    cfg = {
        "url": url,
        "world": 3,
        "epochs": 3,
        "out": str(tmp_path / "out.pt"),
        "stall_data": [2, 45, str(release)],
        "stall_timeout": 3,
    }
    procs = [spawn({**cfg, "rank": r}) for r in range(3)]
    stalled = Path(f"{release}.stalled")
    try:
        deadline = time.monotonic() + 60
        while not stalled.exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "rank 2 never stalled"
            time.sleep(0.02)
        began = time.monotonic()
        outputs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            outputs.append((p.returncode, out + err))
        ended = time.monotonic() - began
    finally:
        release.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (code, said) in enumerate(outputs):
        assert code != 0, f"rank {rank} ended well through a stall:\n{said[-3000:]}"
        assert "Stalled: the job stalled on rank 2: in 'data'" in said, f"rank {rank}:\n{said[-3000:]}"
    assert ended < 20, f"the ranks ended {ended:.1f}s after the stall began (stall_timeout 3 s)"


def test_the_http_view_serves_a_page_json_and_metrics_only_to_the_token(tmp_path: Path) -> None:
    """A job of two ranks (memory://, token set), rank 0 in a phase whose name holds markup.
    The server, bound to 127.0.0.1, refuses a request without the token or with another
    (401); with it (as ``?token=`` or a bearer token) it serves the page (the ranks' table,
    the phase escaped), ``/status.json`` (the view) and ``/metrics``, which Prometheus' client
    library parses back into the ranks' steps and states. Ten requests at once look at the job
    once."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from dataparallel.control.status_http import StatusServer

    url, token = f"memory://http-{os.getpid()}", "web-token"
    chs = [dp.connect(url, rank=r, world_size=2, job=JOB, token=token, timeout=10) for r in (0,)]
    chs.append(dp.connect(url, rank=1, world_size=2, job=JOB, token=token, timeout=10))
    observer = dp.observe(url, job=JOB, token=token, timeout=10)
    looks = []

    def look() -> dict:
        looks.append(time.monotonic())
        return dp.read_job(observer)

    try:
        chs[0].status.at(epoch=0, step=7)
        chs[0].status.enter("<b>x</b>")
        chs[0].status.publish(interval=0.2)

        def get(path: str, bearer: str | None = None) -> tuple[int, str]:
            request = urllib.request.Request(server.url.rstrip("/") + path)
            if bearer is not None:
                request.add_header("Authorization", f"Bearer {bearer}")
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    return answer.status, answer.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode()

        with StatusServer(look, token=token) as server:
            assert server.address[0] == "127.0.0.1", server.address
            assert get("/")[0] == 401 and get("/metrics", bearer="another")[0] == 401
            assert get("/?token=another")[0] == 401
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(10) as pool:
                answers = list(pool.map(lambda _: get(f"/?token={token}"), range(10)))
            assert all(code == 200 for code, _ in answers), [code for code, _ in answers]
            assert len(looks) == 1, f"{len(looks)} looks at the job for ten requests at once"
            page = answers[0][1]
            assert '<table id="ranks">' in page and "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page, page
            assert page.count("<tr class=") == 2, page
            code, body = get("/status.json", bearer=token)
            assert code == 200 and [r["rank"] for r in json.loads(body)["ranks"]] == [0, 1], body
            code, body = get("/metrics", bearer=token)
            assert code == 200, body
            samples = {
                (s.name, s.labels.get("rank"), s.labels.get("state")): s.value
                for family in text_string_to_metric_families(body)
                for s in family.samples
            }
            assert samples[("dataparallel_rank_step", "0", None)] == 7, samples
            assert samples[("dataparallel_rank_running", "0", None)] == 1, samples
            assert samples[("dataparallel_rank_state", "1", "joined")] == 1, samples
            assert samples[("dataparallel_rank_stalled", "0", None)] == 0, samples
    finally:
        observer.close()
        for ch in reversed(chs):
            ch.close()
