"""``dataparallel status`` on real training jobs: ranks that are processes training with
``dp.fit`` (gloo), read from outside the job by the command line and by ``dp.observe``."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from test_loop import spawn

import dataparallel as dp
from dataparallel.control.status import STRAGGLER_BELOW
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


def _stalled(release: Path, procs) -> float:
    """When (monotonic) the stalling rank began to wait (``loop_worker.Stalling``)."""
    deadline = time.monotonic() + 60
    while not Path(f"{release}.stalled").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the rank never stalled"
        time.sleep(0.02)
    return time.monotonic()


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
        began = _stalled(release, procs)
        # Named once the others' wait passes the threshold (2 s here: steps of milliseconds).
        view, seen = _until(url, lambda v: any(s["rank"] == 2 and s["phase"] == "data" for s in v["stalls"]), "stall")
        assert seen - began < SHOWS_WITHIN, f"named {seen - began:.1f}s after the stall began"
        ranks = view["ranks"]
        assert ranks[2]["phase"] == "data", ranks[2]
        (stall,) = [s for s in view["stalls"] if s["rank"] == 2]
        assert stall["phase"] == "data" and stall["waiting"] == [0, 1], stall
        assert [ranks[r]["phase"] for r in (0, 1)] == ["backward", "backward"], ranks
        assert all(r["pid"] == p.pid for r, p in zip(ranks, procs, strict=True)), (ranks, [p.pid for p in procs])
        # The driver logs the stall once, as it first sees it (it looks every 5 s).
        view, _ = _until(url, lambda v: any(e["kind"] == "stall" for e in v["events"]), "the stall's event", 15)
        logged = [e for e in view["events"] if e["kind"] == "stall"]
        assert len(logged) == 1 and logged[0]["rank"] == 2 and "in 'data'" in logged[0]["detail"], logged
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
def test_a_rank_dumps_its_python_stacks_on_sigusr2_to_its_launcher_and_status_shows_them(tmp_path: Path) -> None:
    """Two ranks under ``dataparallel launch``; rank 1's data loader stalls. ``status
    --stacks`` (no rank: the stalled one) signals rank 1 (on this host) and prints its Python
    stacks, read back through the channel: the main thread inside the stalling loader's
    ``__getitem__``, the others too. SIGUSR2 to the launcher makes both its workers dump
    theirs (each rank's record says when); the launcher and the job go on, and end well
    (with a checkpoint set, SIGUSR1 would have been a stop: the stacks' signal is another)."""
    url = f"zmq://127.0.0.1:{free_port()}"
    release = tmp_path / "release"
    cfg = {"launched": True, "out": str(tmp_path / "out.pt"), "epochs": 2, "stall_data": [1, 45, str(release)]}
    cfg["checkpoint"] = str(tmp_path / "ckpt")  # stop signals caught: SIGTERM, SIGUSR1
    launch = [sys.executable, "-m", "dataparallel", "launch", "--nprocs", "2", "--url", url, "--job", JOB]
    proc = subprocess.Popen(
        [*launch, str(Path(__file__).with_name("loop_worker.py")), json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _stalled(release, [proc])
        _until(url, lambda v: [s["rank"] for s in v["stalls"]] == [1], "rank 1's stall")
        cli = [sys.executable, "-m", "dataparallel", "status", url, "--job", JOB, "--stacks"]
        said = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
        assert said.returncode == 0, said.stderr
        stacks = json.loads(said.stdout)["stacks"]
        assert list(stacks) == ["1"], stacks.keys()
        dump = stacks["1"]
        assert dump["why"] == "SIGUSR2" and dump["host"] == socket.gethostname(), dump
        main = dump["text"].split("\n\n")  # one block per thread; the main thread's is the one in the loader
        assert any("in __getitem__" in block and "loop_worker.py" in block for block in main), dump["text"]
        assert "dp-status-r1" in dump["text"] or dump["text"].count("Thread 0x") >= 2, dump["text"]
        text = subprocess.run(cli, capture_output=True, text=True, timeout=60).stdout
        assert "rank 1 (" in text and "Python stacks of" in text and "in __getitem__" in text, text
        # SIGUSR2 to the launcher: passed on to both workers, each dumps, nothing ends.
        before = time.time()
        proc.send_signal(signal.SIGUSR2)
        view, _ = _until(
            url, lambda v: all((r["stacks_at"] or 0) > before for r in v["ranks"]), "both ranks' stacks", within=10
        )
        with dp.observe(url, job=JOB, timeout=10) as ch:
            dumps = dp.control.status.read_stacks(ch, [0, 1])
        assert sorted(dumps) == [0, 1] and all(d["time"] > before for d in dumps.values()), dumps
        assert "in __getitem__" in dumps[1]["text"] and "in __getitem__" not in dumps[0]["text"], dumps
        assert [e["kind"] for e in view["events"]].count("stacks") >= 2, view["events"]
        assert proc.poll() is None, "SIGUSR2 ended the launcher"
    finally:
        release.touch()
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]


@pytest.mark.timeout(180)
def test_a_launchers_event_file_holds_its_own_ranks_events_and_the_other_nodes_from_the_channel(
    tmp_path: Path,
) -> None:
    """Two nodes of one rank each, two launchers; only node 0's keeps an event file
    (``--events``). Its rank writes its own events there; rank 1's (on node 1, which keeps
    none) come through the channel: both joins, once each, with a stop the job agreed on
    (a preemption's checkpoint and stop, recorded by the driver) and the launcher's note of
    the signal. ``status --events FILE --json`` gives them back, oldest first."""
    url = f"zmq://127.0.0.1:{free_port()}"
    events = tmp_path / "events.jsonl"
    cfg = {"launched": True, "out": str(tmp_path / "out.pt"), "epochs": 200, "step_sleep": 0.05}
    cfg["checkpoint"] = str(tmp_path / "ckpt")
    worker = [str(Path(__file__).with_name("loop_worker.py")), json.dumps(cfg)]
    launch = [sys.executable, "-m", "dataparallel", "launch", "--nodes", "2", "--nprocs", "1", "--url", url]
    nodes = [
        subprocess.Popen(
            [
                *launch,
                "--job",
                JOB,
                "--node-rank",
                str(node),
                *(["--events", str(events)] if node == 0 else []),
                *worker,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        _until(url, _training, "the job training")
        deadline = time.monotonic() + 10
        while events.read_text().count('"kind": "join"') < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        nodes[0].send_signal(signal.SIGTERM)  # a preemption: checkpoint at a step, then stop, together
        outputs = [p.communicate(timeout=120)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    story = [json.loads(line) for line in events.read_text().splitlines()]
    keys = [(e["time"], e["by"], e["kind"]) for e in story]
    assert len(keys) == len(set(keys)), story  # each event once
    joins = sorted((e["rank"], e["by"], e["job"]) for e in story if e["kind"] == "join")
    assert joins == [(0, 0, JOB), (1, 1, JOB)], (story, outputs)
    kinds = [e["kind"] for e in story]
    assert "signal" in kinds and "checkpoint" in kinds and "stop" in kinds, (story, outputs)
    shown = subprocess.run(
        [sys.executable, "-m", "dataparallel", "status", "--events", str(events), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    listed = json.loads(shown.stdout)
    assert sorted(map(json.dumps, listed)) == sorted(map(json.dumps, story)), listed
    assert [e["time"] for e in listed] == sorted(e["time"] for e in listed)


@pytest.mark.timeout(180)
def test_a_job_behind_node_relays_is_seen_whole_by_status_and_its_launchers_event_file(tmp_path: Path) -> None:
    """Two nodes of two workers behind their launchers' relays (``launch --relay``: the
    ranks' keys live under the relays' job), only node 0's keeping an event file; rank 3's
    data loader stalls. ``status URL --job JOB``, given the job's own name, shows all four
    ranks with their pids and names rank 3 in ``data`` as the one the others wait for;
    ``--stacks`` signals it and reads its stacks back through the relays; ``top`` says the
    same; node 0's event file holds every rank's join, those of node 1's ranks read through
    the channel."""
    url = f"zmq://127.0.0.1:{free_port()}"
    release, events = tmp_path / "release", tmp_path / "events.jsonl"
    cfg = {"launched": True, "out": str(tmp_path / "out.pt"), "epochs": 2, "stall_data": [3, 45, str(release)]}
    worker = [str(Path(__file__).with_name("loop_worker.py")), json.dumps(cfg)]
    launch = [sys.executable, "-m", "dataparallel", "launch", "--relay", "--nodes", "2", "--nprocs", "2", "--url", url]
    nodes = [
        subprocess.Popen(
            [*launch, "--job", JOB, "--node-rank", str(n), *(["--events", str(events)] if n == 0 else []), *worker],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    try:
        _stalled(release, nodes)
        view, _ = _until(url, lambda v: [s["rank"] for s in v["stalls"]] == [3], "rank 3's stall")
        assert view["job"] == JOB and len(view["ranks"]) == 4, view
        assert all(r["state"] == "running" and isinstance(r["pid"], int) for r in view["ranks"]), view["ranks"]
        (stall,) = view["stalls"]
        assert stall["phase"] == "data" and stall["waiting"] == [0, 1, 2], stall
        cli = [sys.executable, "-m", "dataparallel", "status", url, "--job", JOB]
        said = subprocess.run([*cli, "--stacks", "--json"], capture_output=True, text=True, timeout=60)
        assert said.returncode == 0, said.stderr
        printed = json.loads(said.stdout)
        assert [s["rank"] for s in printed["stalls"]] == [3] and printed["job"] == JOB, printed
        assert "in __getitem__" in printed["stacks"]["3"]["text"], printed["stacks"]
        top = [sys.executable, "-m", "dataparallel", "top", url, "--job", JOB, "--iterations", "1"]
        live = subprocess.run(top, capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"job '{JOB}': 4 rank(s)" in live and "rank 3: in 'data'" in live, live
    finally:
        release.touch()
    outputs = []
    for p in nodes:
        out = p.communicate(timeout=120)[0]
        outputs.append(out)
        assert p.returncode == 0, out[-3000:]
    story = [json.loads(line) for line in events.read_text().splitlines()]
    joins = sorted((e["rank"], e["job"]) for e in story if e["kind"] == "join")
    assert joins == [(r, JOB) for r in range(4)], (story, outputs)


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
def test_a_killed_rank_is_named_lost_and_the_ranks_its_death_failed_say_so(tmp_path: Path) -> None:
    """Three ranks train on a standalone coordinator; rank 1 is killed (SIGKILL). The driver
    declares it lost (its event in the job's log), and the two others fail at once: their
    last records say ``failed`` with the error. The view names rank 1 alone, lost, within
    5 s (its record would take 3 s to fall silent), and never the ranks its death failed."""
    from jobutil import standalone

    url = f"zmq://127.0.0.1:{free_port()}"
    with standalone(url, None):
        cfg = {"url": url, "world": 3, "epochs": 50, "out": str(tmp_path / "out.pt"), "step_sleep": 0.05}
        procs = [spawn({**cfg, "rank": r}) for r in range(3)]
        try:
            _until(url, _training, "the job training")
            os.kill(procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            named: list[set[int]] = []

            def gone(v: dict) -> bool:
                named.append({s["rank"] for s in v["stalls"]})
                return any(s["rank"] == 1 and s["cause"].startswith(("lost", "silent")) for s in v["stalls"])

            view, seen = _until(url, gone, "rank 1 lost or silent")
            assert seen - killed < SHOWS_WITHIN, f"named {seen - killed:.1f}s after the kill"
            assert all(n <= {1} for n in named), named  # no other rank named, before or then
            view, _ = _until(url, lambda v: all(v["ranks"][r]["state"] == "failed" for r in (0, 2)), "0, 2 failed", 10)
            assert view["ranks"][1]["state"] == "lost" and "rank 1 lost" in view["ranks"][1]["error"], view["ranks"]
            for r in (0, 2):
                assert "rank 1" in (view["ranks"][r]["error"] or ""), view["ranks"][r]
            assert all(n <= {1} for n in named), named
        finally:
            for p in procs:
                p.kill()
                p.communicate(timeout=30)


@pytest.mark.timeout(180)
def test_a_stall_timeout_fails_every_rank_with_stalled_naming_the_culprit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three ranks train with ``stall_timeout=3``; rank 2's data loader stalls (for a minute,
    unless interrupted). Every rank ends with :class:`~dataparallel.Stalled` naming rank 2 in
    ``data``, rank 2 included (interrupted inside its loader), well before the stall would
    have ended or the collective timeout (60 s) would have fired. The job's event file
    (``DP_EVENTS``) holds the stall as the driver first saw it, its verdict, and rank 2's
    stacks, dumped before it was interrupted."""
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("DP_EVENTS", str(events))
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
    try:
        began = _stalled(release, procs)
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
    story = [json.loads(line) for line in events.read_text().splitlines()]
    said_by = {(e["kind"], e["rank"], e["by"]) for e in story}
    assert {("verdict", 2, 0), ("stacks", 2, 2)} <= said_by, story
    (stacks,) = [e for e in story if e["kind"] == "stacks"]
    assert "stall verdict" in stacks["detail"] and "in __getitem__" in stacks["detail"], stacks


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

        with StatusServer(lambda: dp.read_job(observer)) as open_server:  # no token: requests naming it only
            for host, code in (("rebound.example", 403), (f"127.0.0.1:{open_server.address[1]}", 200)):
                request = urllib.request.Request(open_server.url + "status.json", headers={"Host": host})
                try:
                    with urllib.request.urlopen(request, timeout=10) as answer:
                        assert answer.status == code == 200
                except urllib.error.HTTPError as err:
                    assert err.code == code == 403, (host, err.code)
        with StatusServer(look, token=token) as server:
            assert server.address[0] == "127.0.0.1", server.address
            assert get("/")[0] == 401 and get("/metrics", bearer="another")[0] == 401
            assert get("/?token=another")[0] == 401
            from concurrent.futures import ThreadPoolExecutor

            burst = time.monotonic()
            with ThreadPoolExecutor(10) as pool:
                answers = list(pool.map(lambda _: get(f"/?token={token}"), range(10)))
            burst = time.monotonic() - burst
            assert all(code == 200 for code, _ in answers), [code for code, _ in answers]
            # One look a second whatever the requests (a loaded machine may take over a second for ten).
            gaps = [b - a for a, b in itertools.pairwise(looks)]
            assert len(looks) <= 1 + int(burst / 0.99) and all(g >= 0.99 for g in gaps), (burst, looks)
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
            # The page as a real browser renders it (Debian's Chromium, headless).
            cells = _rendered_rows(f"{server.url}?token={token}")
            assert [row[:7] for row in cells] == [
                ["0", "running", socket.gethostname(), str(os.getpid()), "0", "7", "<b>x</b>"],
                ["1", "joined", socket.gethostname(), str(os.getpid()), "-", "-", "-"],
            ], cells
    finally:
        observer.close()
        for ch in reversed(chs):
            ch.close()


def _rendered_rows(url: str) -> list[list[str]]:
    """The cells of the page's ranks table, as headless Chromium renders the page at ``url``
    (its DOM after load, read back with the standard library's HTML parser)."""
    import shutil
    from html.parser import HTMLParser

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        message = "no chromium: `apt-get install chromium` (Debian's package)"
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(message + " — CI must test the page in a browser")
        pytest.skip(message)
    for attempt in range(3):
        # A browser that dies of a signal (seen under load: SIGTRAP, one of Chromium's own
        # checks failing) is started again, with a fresh profile: the page is what is tested.
        with tempfile.TemporaryDirectory() as profile:
            flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}", "--dump-dom"]
            done = subprocess.run(
                [browser, *flags, url],
                capture_output=True,
                text=True,
                timeout=120,
            )
        if done.returncode >= 0 or attempt == 2:
            break
    done.check_returncode()
    dom = done.stdout

    class Rows(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[str]] = []
            self.cell: list[str] | None = None
            self.body = False

        def handle_starttag(self, tag: str, attrs: list) -> None:
            if tag == "tbody":
                self.body = True
            elif tag == "tr" and self.body:
                self.rows.append([])
            elif tag == "td" and self.body:
                self.cell = []

        def handle_endtag(self, tag: str) -> None:
            if tag == "td" and self.cell is not None:
                self.rows[-1].append("".join(self.cell).strip())
                self.cell = None
            elif tag == "tbody":
                self.body = False

        def handle_data(self, data: str) -> None:
            if self.cell is not None:
                self.cell.append(data)

    parser = Rows()
    parser.feed(dom)
    assert parser.rows, f"no ranks table in the page Chromium rendered: {dom[:2000]}"
    return parser.rows


def _entry(rank: int, phase: str | None, epoch: int | None = 0, step: int | None = 3, phase_s: float = 9.0, **more):
    entry = {
        "rank": rank,
        "state": "running",
        "phase": phase,
        "phase_s": phase_s,
        "epoch": epoch,
        "step": step,
        "step_s": 0.01,
        "heartbeat_age": 0.5,
    }
    return {**entry, **more}


def test_a_stale_record_is_no_straggler_s_yardstick() -> None:
    """A rank whose record is older than two of its intervals (frozen, say, and not yet named
    silent) is not scored, and nobody is scored against its last, fast steps; fresh, it is
    the fastest, and the others a fifth slower and more are stragglers."""
    from dataparallel.control.status import straggler_scores

    def ranks(age: float) -> list[dict]:
        fast = _entry(0, "backward", own_s=0.017, heartbeat_age=age, interval=1.0)
        return [fast, *(_entry(r, "backward", own_s=0.023, heartbeat_age=0.3, interval=1.0) for r in (1, 2))]

    assert [s["rank"] for s in straggler_scores(ranks(0.8))] == [1, 2]
    stale = ranks(2.5)
    assert straggler_scores(stale) == [] and stale[0].get("scores") is None, stale[0]
    assert [r["scores"]["vs_fastest"] for r in stale[1:]] == [1.0, 1.0]


def test_diagnose_names_only_ranks_that_hold_others_up() -> None:
    """Ranks that all wait at one place (a long validation, a slow first step) are no stall;
    a rank still validating while the others report is, whatever its number; a rank still
    reporting an epoch (or writing its checkpoint) while the others wait for the next
    epoch's command is; a rank in a
    phase of a loop's own is compared with nothing; a silent rank comes first, then the
    furthest behind; a rank behind is named for as long as the others have waited for it."""
    diagnose = dp.control.status.diagnose
    assert diagnose([_entry(r, "validation") for r in range(3)]) == []
    assert diagnose([_entry(r, "forward", step=0) for r in range(3)]) == []
    ranks = [_entry(0, "report"), _entry(1, "report"), _entry(2, "validation")]
    assert [(s["rank"], s["waiting"]) for s in diagnose(ranks)] == [(2, [0, 1])]
    # Stalling the others as long as they have waited, not as long as it has validated.
    ranks = [_entry(0, "report", phase_s=3.0), _entry(1, "report", phase_s=3.0), _entry(2, "validation", phase_s=240)]
    assert [(s["rank"], s["for_s"]) for s in diagnose(ranks)] == [(2, 3.0)]
    # A newcomer waiting for its first command (no epoch yet) is compared with nothing.
    ranks = [_entry(0, "command", epoch=None, phase_s=1.0), _entry(1, "backward"), _entry(2, "backward")]
    assert diagnose(ranks) == []
    ranks = [_entry(0, "report", phase_s=1.0), _entry(1, "command"), _entry(2, "command")]
    assert [s["rank"] for s in diagnose(ranks)] == [0]
    # The driver writing a checkpoint while the others wait for the next epoch's command.
    ranks = [_entry(0, "checkpoint", phase_s=1.0), _entry(1, "command"), _entry(2, "command")]
    assert [(s["rank"], s["phase"]) for s in diagnose(ranks)] == [(0, "checkpoint")]
    ranks = [_entry(0, "my own phase"), _entry(1, "backward"), _entry(2, "backward")]
    assert diagnose(ranks) == []
    ranks = [
        _entry(0, "backward", step=5),
        _entry(1, "data", step=5),
        _entry(2, "optimizer", step=4),
        _entry(3, "backward", step=5, state="silent", heartbeat_age=7.0),
    ]
    assert [s["rank"] for s in diagnose(ranks)] == [3, 2, 1], diagnose(ranks)
    assert diagnose(ranks)[0]["cause"].startswith("silent: no status for 7.0s"), diagnose(ranks)
    # A rank frozen (SIGSTOP) inside an all-reduce's round: rank 0's round ended, it waits in
    # the next step's; ranks 1 and 3 still wait in this one's. Before the frozen rank's record
    # goes silent, its stale record is the furthest behind: it alone is named; once silent,
    # it alone too (those in the all-reduce wait for it, they hold nobody up).
    waiting = [_entry(0, "backward", step=161), _entry(1, "backward", step=160), _entry(3, "backward", step=160)]
    frozen = _entry(2, "forward", step=154, phase_s=2.5)
    assert [s["rank"] for s in diagnose([*waiting[:2], frozen, waiting[2]])] == [2]
    frozen = _entry(2, "forward", step=154, state="silent", heartbeat_age=3.1)
    assert [s["rank"] for s in diagnose([*waiting[:2], frozen, waiting[2]])] == [2]
    # With nobody further behind, ranks left in an all-reduce's round are what the others wait for.
    assert [s["rank"] for s in diagnose(waiting)] == [1, 3]
    # A rank whose fit raised (its process still there) while the others wait: named. Not
    # where the one waiting is a record aging into silence (a rank just killed, whose death
    # failed the others).
    failed = _entry(1, "failed", state="failed", error="OutOfMemoryError: ...", phase_before="forward")
    (named,) = diagnose([_entry(0, "backward"), failed, _entry(2, "backward")])
    assert named["rank"] == 1 and named["cause"].startswith("failed: OutOfMemoryError") and named["waiting"] == [0, 2]
    dying = _entry(0, "backward", heartbeat_age=2.5)
    assert diagnose([dying, failed, {**failed, "rank": 2}]) == []


def test_records_and_events_not_of_this_librarys_making_are_shown_as_such_never_a_crash(tmp_path: Path) -> None:
    """A token holder writes records and events of the wrong shapes (times out of range or
    not numbers, a split of text, an unhashable writer, lines that are not JSON): a look
    reads those ranks as ``joined``, drops such events, renders the rest; the launcher's
    event file reader and its dedupe skip such lines; nothing raises."""
    from dataparallel.control.status import read_job, render, render_events, status_key
    from dataparallel.launching.events import EventFile, read_event_file

    url = f"memory://malformed-{os.getpid()}"
    chs = [dp.connect(url, rank=r, world_size=3, job=JOB, timeout=10) for r in range(1)]
    chs += [dp.connect(url, rank=r, world_size=3, job=JOB, timeout=10) for r in (1, 2)]
    observer = dp.observe(url, job=JOB, timeout=10)
    try:
        chs[0].status.publish(interval=0.2)
        bad = [
            {"time": 1e300, "phase": "data", "seq": 1, "world_size": 3},
            {"time": time.time(), "phase": "data", "split": {"data": "slow"}, "world_size": 3},
        ]
        for rank, record in zip((1, 2), bad, strict=True):
            chs[rank]._set(chs[rank]._scoped(status_key(rank)), json.dumps(record).encode())
        for event in (
            {"time": float("nan"), "kind": "x", "detail": ""},
            {"time": 1.0, "kind": "x", "detail": "", "by": [1]},
        ):
            number = chs[1]._add(chs[1]._scoped("__dp/events/next"), 1) - 1
            chs[1]._set(chs[1]._scoped(f"__dp/events/{number}"), json.dumps(event).encode())
        dp.control.status.record_event(chs[0], "checkpoint", "a good one")
        view = read_job(observer)
        assert [r["state"] for r in view["ranks"]] == ["running", "joined", "joined"], view["ranks"]
        assert [e["kind"] for e in view["events"]] == ["checkpoint"], view["events"]
        assert "job 'loop': 3 rank(s)" in render(view)
        assert "(time 1e+300)" in render_events([{"time": 1e300, "kind": "x", "detail": ""}])[0]
    finally:
        observer.close()
        for ch in chs:
            ch.close()
    lines = tmp_path / "events.jsonl"
    lines.write_text(
        "not json\n[1, 2]\n"
        + json.dumps({"time": 1.0, "by": [1], "kind": "x", "detail": ""})
        + "\n"
        + json.dumps({"time": 2.0, "by": 0, "rank": 0, "kind": "join", "detail": "ok"})
        + "\n"
    )
    assert [e["kind"] for e in read_event_file(lines)] == ["join"]
    config = dp.config.load_config({"url": url, "job": JOB}, env={})
    keeper = EventFile(lines, config, url)  # its dedupe reads every line, those included
    try:
        keeper.note("signal", "a test's")
    finally:
        keeper.close()
    assert [e["kind"] for e in read_event_file(lines)] == ["join", "signal"]
    fresh = EventFile(tmp_path / "fresh.jsonl", config, url)  # made by the launcher: its user's only
    fresh.close()
    assert (tmp_path / "fresh.jsonl").stat().st_mode & 0o777 == 0o600


def test_a_watched_record_ages_on_the_readers_clock_whatever_the_writers_says() -> None:
    """A rank whose clock runs 100 s ahead (or behind) of the reader's: one look reads that
    skew as its age; a reader that watches takes a record it sees for the first time as no
    older than a publishing interval, then ages it on its own clock, from when it saw the
    record's publish count last move."""
    url = f"memory://skew-{os.getpid()}"
    ch = dp.connect(url, rank=0, world_size=1, job=JOB, timeout=10)
    observer = dp.observe(url, job=JOB, timeout=10)
    try:
        for skew in (100.0, -100.0):
            record = ch.status.record() | {"time": time.time() + skew, "seq": 1}
            ch._set(ch._scoped(dp.control.status.status_key(0)), json.dumps(record).encode())
            watch = dp.control.status.JobWatch()
            first = dp.read_job(observer, watch=watch)["ranks"][0]
            # At first sight no older than a publishing interval (1 s), whatever the writer says.
            assert first["heartbeat_age"] <= 1.0 and first["state"] == "running", first
            time.sleep(0.3)
            later = dp.read_job(observer, watch=watch)["ranks"][0]
            assert 0.3 <= later["heartbeat_age"] - first["heartbeat_age"] < 1.5, (first, later)
            assert later["state"] == "running", later
            once = dp.read_job(observer)["ranks"][0]
            assert once["state"] == ("silent" if skew < 0 else "running"), once
    finally:
        observer.close()
        ch.close()


@pytest.mark.timeout(120)
def test_an_observer_holds_no_job_and_follows_its_next_run(tmp_path: Path) -> None:
    """A standalone coordinator (``dataparallel serve``); an observer attached to a job of two
    ranks reads only (its writes are refused: by the channel, and by the coordinator for a
    request that gets past it). The ranks close; the same job name starts again at once, with
    another size, though the observer is still there; the observer, still open, reads the new
    run's ranks."""
    from jobutil import standalone

    url = f"zmq://127.0.0.1:{free_port()}"
    with standalone(url, None):
        first = [dp.connect(url, rank=r, world_size=2, job=JOB, timeout=10) for r in (0, 1)]
        for ch in first:
            ch.status.publish(interval=0.2)
        observer = dp.observe(url, job=JOB, timeout=10)
        try:
            assert [r["state"] for r in dp.read_job(observer)["ranks"]] == ["running", "running"]
            with pytest.raises(dp.ConfigError, match="reads only"):
                observer.set("k", b"v")
            with pytest.raises(dp.ControlError, match="reads only"):
                observer._set("k", b"v")  # past the channel's own check: the coordinator refuses
            for ch in first:
                ch.close()
            again = [dp.connect(url, rank=r, world_size=3, job=JOB, timeout=10) for r in (0, 1, 2)]
            try:
                again[2].status.publish(interval=0.2)
                view = dp.read_job(observer)
                assert view["world_size"] == 3 and view["ranks"][2]["state"] == "running", view
            finally:
                for ch in again:
                    ch.close()
        finally:
            observer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_serve_http_shows_every_job_of_its_coordinator_to_the_token(transport: str) -> None:
    """``dataparallel serve URL --http 127.0.0.1:0`` with a token: ``/`` lists the jobs that
    run there (each linked to its page), ``/job/NAME/`` is a job's page (its ranks, a stalled
    one highlighted, the job's events), ``/job/NAME/status.json`` its view, ``/metrics`` every
    job's ranks (parsed by Prometheus' own parser); a request without the token gets 401."""
    from prometheus_client.parser import text_string_to_metric_families

    token, port = "serve-token", free_port()
    url = f"{transport}://127.0.0.1:{port}"
    env = {**os.environ, "DP_TOKEN": token}
    serve = [sys.executable, "-m", "dataparallel", "serve", url, "--http", "127.0.0.1:0"]
    server = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    chs: list = []
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline() for _ in range(3)]
        assert lines[2].startswith("status of its jobs at http://127.0.0.1:"), lines
        web = lines[2].split(" at ")[1].split()[0]

        def get(path: str, auth: bool = True) -> tuple[int, str]:
            request = urllib.request.Request(web + path)
            if auth:
                request.add_header("Authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:
                    return answer.status, answer.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode()

        for job, size in (("alpha", 2), ("beta", 1)):
            for r in range(size):
                chs.append(dp.connect(url, rank=r, world_size=size, job=job, token=token, timeout=10))
        for ch in chs:
            ch.status.at(epoch=0, step=3)
            ch.status.enter("forward" if ch.job == "alpha" and ch.rank == 1 else "backward")
            ch.status.publish(interval=0.2)
        dp.control.status.record_event(chs[0], "checkpoint", "after epoch 0: a test's")
        assert get("/", auth=False)[0] == 401 and get("/job/alpha/", auth=False)[0] == 401
        code, index = get("/")
        assert code == 200 and '<a href="job/alpha/">alpha</a>' in index and '<a href="job/beta/">beta</a>' in index
        deadline = time.monotonic() + 20  # alpha's rank 1 behind in forward: a stall past 2 s
        while time.monotonic() < deadline:
            code, page = get("/job/alpha/")
            if '<tr class="stalled">' in page:
                break
            time.sleep(0.5)
        assert code == 200 and page.count("<tr class=") == 2 and '<tr class="stalled"><td>1</td>' in page, page
        assert "checkpoint: after epoch 0: a test&#x27;s" in page, page
        code, body = get("/job/beta/status.json")
        assert code == 200 and json.loads(body)["job"] == "beta" and json.loads(body)["world_size"] == 1, body
        code, metrics = get("/metrics")
        running = {
            (s.labels["job"], s.labels["rank"])
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "dataparallel_rank_running" and s.value == 1
        }
        assert running == {("alpha", "0"), ("alpha", "1"), ("beta", "0")}, metrics
        assert get("/job/gamma/")[0] == 503  # no such job here
    finally:
        for ch in chs:
            ch.close()
        server.terminate()
        out = server.communicate(timeout=30)[0]
    assert server.returncode == 0, out


@pytest.mark.timeout(180)
def test_a_slowed_rank_is_scored_a_straggler(tmp_path: Path) -> None:
    """Three ranks train; rank 1's every step takes 30 ms more of its own (in its optimizer
    step, not in the all-reduce that makes the others wait). The view scores rank 1 a
    straggler against the fastest rank, and no other; the page lists it, ``/metrics``
    gives every rank's score, and the job's event log holds each rank's join, the driver's
    checkpoints and the straggler it noted (rank 1 alone). Its cause says where the time goes
    (the optimizer)."""
    from prometheus_client.parser import text_string_to_metric_families

    url, web = f"zmq://127.0.0.1:{free_port()}", free_port()
    cfg = {
        "url": url,
        "world": 3,
        "epochs": 40,  # 4 steps an epoch: some seconds in all
        "out": str(tmp_path / "out.pt"),
        "step_sleep": [0.0, 0.03, 0.0],
        "status_http": f"127.0.0.1:{web}",
        "checkpoint": str(tmp_path / "job.ckpt"),
        "checkpoint_every": 10,
    }
    procs = [spawn({**cfg, "rank": r}) for r in range(3)]
    try:
        view, _ = _until(
            url, lambda v: _training(v) and all(r["own_s"] for r in v["ranks"]) and v["stragglers"], "a straggler"
        )
        assert [s["rank"] for s in view["stragglers"]] == [1], view["stragglers"]
        assert (
            view["stragglers"][0]["vs_fastest"] < STRAGGLER_BELOW
            and "the fastest rank" in view["stragglers"][0]["cause"]
        )
        assert "most of it in 'optimizer'" in view["stragglers"][0]["cause"], view["stragglers"][0]
        # The others score above the straggler (on a loaded machine two equal ranks can differ
        # by a fifth: the 2 ms floor keeps that from being a straggler).
        slowest = view["stragglers"][0]["vs_fastest"]
        assert all(view["ranks"][r]["scores"]["vs_fastest"] > slowest for r in (0, 2)), view["ranks"]
        with urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        scores = {
            s.labels["rank"]: s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "dataparallel_rank_straggler_score" and s.labels["against"] == "fastest"
        }
        assert set(scores) == {"0", "1", "2"} and scores["1"] < STRAGGLER_BELOW, scores
        with urllib.request.urlopen(f"http://127.0.0.1:{web}/", timeout=10) as answer:
            page = answer.read().decode()
        assert '<ul id="stragglers"><li>rank 1:' in page, page
        # The job's event log: each rank's join, the driver's checkpoints, the straggler it noted.
        view, _ = _until(url, lambda v: any(e["kind"] == "straggler" for e in v["events"]), "a straggler event")
        kinds = [(e["kind"], e["rank"]) for e in view["events"]]
        assert sorted(r for kind, r in kinds if kind == "join") == [0, 1, 2], kinds
        assert ("straggler", 1) in kinds and ("straggler", 0) not in kinds and ("straggler", 2) not in kinds, kinds
        assert ("checkpoint", 0) in kinds, kinds
        assert all({"time", "rank", "host", "kind", "detail"} <= set(e) for e in view["events"]), view["events"]
    finally:
        _finish(procs)


def test_a_coordinator_that_applies_no_carried_writes_gets_the_record_written_apart(monkeypatch) -> None:
    """A coordinator that predates the writes a heartbeat carries (it answers a heartbeat as
    before, without the flag that says it applied them) still gets each rank's record: the
    heartbeats give the record back to the rank's publishing thread, and the record keeps
    advancing."""
    from dataparallel.control.coordinator import Coordinator, _reply
    from dataparallel.control.status import status_key

    monkeypatch.setitem(Coordinator._HANDLERS, "heartbeat", lambda self, s, r, route: _reply(r.id))
    url = f"zmq://127.0.0.1:{free_port()}?heartbeat=0.2&liveness_timeout=3"
    a, b = dp.connect(url, rank=0, world_size=2, job="old", timeout=30), None
    try:
        b = dp.connect(url, rank=1, world_size=2, job="old", timeout=30)
        b.status.publish()
        assert b.status.carried
        key = b._scoped(status_key(1))

        def seq() -> int:
            return int(json.loads(a._get(key, 5) or b"{}").get("seq", 0))

        first, deadline = seq(), time.monotonic() + 20
        while seq() < first + 3:
            assert time.monotonic() < deadline, f"the record stood at seq {seq()}"
            time.sleep(0.1)
        assert not b.status.carried, "still on the heartbeats of a coordinator that drops them"
    finally:
        for ch in (b, a):
            if ch is not None:
                ch.close()


def _accumulated(ops: list[tuple[str, object]], first: str, start: float) -> list[tuple[float, dict[str, float]]]:
    """The last steps' times and splits accumulated step by step, as a phase change and a
    step's end add them up: the reference the ring of marks must agree with."""
    from dataparallel.control.status import SPLIT_OVER

    phase, since, began, split, steps = first, start, start, {}, []
    for kind, value in ops:
        now = value if kind != "op" else None
        if kind == "enter":
            name, now = value
            split[phase] = split.get(phase, 0.0) + now - since
            phase, since = name, now
        elif kind == "done":
            split[phase] = split.get(phase, 0.0) + now - since
            steps.append((now - began, split))
            since = began = now
            split = {}
        elif kind == "start":
            split, since, began = {}, now, now
    return steps[-SPLIT_OVER:]


@pytest.mark.parametrize("seed", range(40))
def test_a_ranks_last_steps_are_its_phase_changes_added_up(seed: int) -> None:
    """A step's phase changes and ends are only marked while it trains (no lock, no sums);
    the record's step time, split and own time, made from the marks, are what adding them up
    step by step gives, over random sequences of phase changes, step ends and new stretches
    (more marks than the ring keeps among them)."""
    import random
    import types

    from dataparallel.control import status as module
    from dataparallel.control.status import RankStatus, _own_time

    rng = random.Random(seed)
    clock = [1000.0]
    channel = types.SimpleNamespace(rank=0, world_size=1, heartbeat_interval=1.0)
    real = module._clock
    module._clock = lambda: clock[0]
    try:
        status = RankStatus(channel)  # type: ignore[arg-type]
        ops: list[tuple[str, object]] = []
        first, start = status.phase_name, status.phase_since
        clock[0] = start
        for step in range(1, rng.randint(1, 3000)):
            clock[0] += rng.random() * 0.01
            roll = rng.random()
            if roll < 0.65:
                name = rng.choice(["data", "forward", "backward", "optimizer", "validation", "x"])
                status.enter(name)
                ops.append(("enter", (name, clock[0])))
            elif roll < 0.95:
                status.step_done(step)
                ops.append(("done", clock[0]))
            else:
                status.step_started()
                ops.append(("start", clock[0]))
        want = _accumulated(ops, first, start)
        got = module._last_steps(status._marks_now())
        assert len(got) == len(want)
        for (seconds, split), (want_s, want_split) in zip(got, want, strict=True):
            assert seconds == pytest.approx(want_s, abs=1e-9)
            assert split.keys() == want_split.keys()
            assert all(split[k] == pytest.approx(want_split[k], abs=1e-9) for k in split)
        if want:
            assert status.own_time() == pytest.approx(_own_time(want), abs=1e-9)
    finally:
        module._clock = real
