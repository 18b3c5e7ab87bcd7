"""Real torchrun with our rendezvous backends: two torchrun agents (2 nodes x 1 process, on
this machine) meet through dp-zmq, dp-grpc and dp-etcd; the workers' script uses
`dp.connect()` unchanged; a worker that fails on the first attempt is restarted by torchrun
and the job completes. With ``--rdzv-conf relay=1`` (2 nodes x 2 processes) each agent hosts
its node's relay, and the workers' channel is the relay."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from etcdserver import EtcdServer, require_etcd, start_cluster
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)

import dataparallel as dp
from dataparallel.launching.torchrun import ROUND_ENV, URL_ENV, ChannelRendezvousBackend, create_rdzv_handler
from dataparallel.testing import free_port


@pytest.fixture(autouse=True)
def _agent_environment():
    """A handler tells the workers its round and channel through this process's environment
    (a torchrun agent's, which they inherit): none of it outlives a test run in-process."""
    saved = {name: os.environ.get(name) for name in (ROUND_ENV, URL_ENV)}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


WORKER = r"""
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
import dataparallel as dp

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ch = dp.connect(timeout=60)  # torchrun's RANK/WORLD_SIZE; the channel: the dp-* rendezvous backend's
if restart == 0 and ch.rank == 1:
    sys.exit(7)  # the first attempt fails: torchrun restarts the whole worker group
ch.rendezvous()
dp.init_process_group(ch, timeout=60)
value = torch.tensor([float(ch.rank + 1)])
dist.all_reduce(value)
Path(sys.argv[1], f"rank{ch.rank}.json").write_text(
    json.dumps({"sum": value.item(), "restart": restart, "world": ch.world_size, "job": ch.job, "url": ch.url.raw})
)
dist.destroy_process_group()
ch.close()
"""


def _job(tmp_path: Path, worker: str) -> tuple[Path, Path, dict[str, str]]:
    """The workers' script (``worker``'s source), the directory they write into, and the
    agents' environment (this one's, less any DP_* setting, with the job's token)."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    env.update(OMP_NUM_THREADS="1", DP_TOKEN="torchrun-test")
    return script, out, env


def _torchrun(
    backend: str, endpoint: str, run_id: str, out: Path, script: Path, env: dict, relay: bool = False
) -> list[subprocess.Popen]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    argv = [
        torchrun,
        "--nnodes", "2",
        "--nproc-per-node", "2" if relay else "1",
        "--rdzv-backend", backend,
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id,
        "--rdzv-conf", "join_timeout=60,read_timeout=30" + (",relay=1" if relay else ""),
        "--max-restarts", "1",
        "--monitor-interval", "0.2",
        str(script), str(out),
    ]  # fmt: skip
    return [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for _ in range(2)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relayed"])
@pytest.mark.parametrize("backend", ["dp-zmq", "dp-grpc", "dp-etcd"])
def test_two_torchrun_nodes_rendezvous_and_restart(backend, relay, tmp_path):
    members = []
    if backend == "dp-etcd":  # a 3-member cluster, named as docs/howto/torchrun.md shows: every member, comma-separated
        require_etcd()
        members = start_cluster(tmp_path / "etcd", 3)
        endpoint = ",".join(f"127.0.0.1:{m.client_port}" for m in members)
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    script, out, env = _job(tmp_path, WORKER)
    try:
        agents = _torchrun(backend, endpoint, f"job-{backend}", out, script, env, relay)
        logs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for member in members:
            member.stop()
    for agent, log in zip(agents, logs, strict=True):
        assert agent.returncode == 0, log[-4000:]
    assert any("exitcode: 7" in log or "exitcode  : 7" in log or "exit code 7" in log.lower() for log in logs), (
        "the first attempt's failure should be visible\n" + "\n".join(log[-2000:] for log in logs)
    )
    world = 4 if relay else 2
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]
    total = world * (world + 1) / 2
    assert [(r["sum"], r["world"]) for r in results] == [(total, world)] * world
    # The node whose worker failed counts a restart, the other does not: the job is named
    # after the rendezvous round, the same for both.
    assert 1 in {r["restart"] for r in results}
    assert len({r["job"] for r in results}) == 1 and results[0]["job"].startswith("default.round")
    if relay:  # each node's workers through its agent's relay, one relay per round
        assert {r["url"].split("://")[0] for r in results} == {"relay"}
        assert len({r["url"] for r in results}) == 2, results
        # Every agent hosted a relay for each round (the failed one's and the restart's), and
        # closed each: none of their directories is left.
        hosted = [re.findall(r"node relay for ranks \d+\.\.\d+ at (\S+)/relay\.sock", log) for log in logs]
        assert all(len(dirs) == 2 for dirs in hosted), logs
        assert not [d for dirs in hosted for d in dirs if os.path.exists(d)], "a relay's directory was left"
    else:
        scheme = backend.removeprefix("dp-")
        assert {r["url"].split("://")[0] for r in results} == {scheme}, "the workers' channel is the rendezvous one"


WAITING_WORKER = r"""
import os, sys, time
from pathlib import Path
import dataparallel as dp

ch = dp.connect(timeout=120)
Path(sys.argv[1], f"pid{ch.rank}").write_text(str(os.getpid()))  # for the test to end it
if ch.rank >= 2:  # the second node's workers never come: the first node's barrier waits upstream
    time.sleep(120)
Path(sys.argv[1], f"waiting{ch.rank}").write_text(str(os.getppid()))  # its agent
ch.rendezvous(timeout=120)
"""


@pytest.mark.timeout(200)
def test_an_agent_stopped_by_a_signal_closes_its_relay_at_once(tmp_path):
    """SIGTERM to a torchrun agent whose node's workers wait in a barrier its relay is
    crossing upstream (the other node's workers never come, and its agent runs on): torch's
    agent does not shut its rendezvous down on a signal, and the interpreter's exit joins
    every executor thread, the crossing's included; the agent closes its relay first, so it
    ends within seconds, not at the barrier's timeout (120 s), and leaves no relay directory
    behind."""
    endpoint = f"127.0.0.1:{free_port()}"
    script, out, env = _job(tmp_path, WAITING_WORKER)
    agents = _torchrun("dp-zmq", endpoint, "stopped", out, script, env, relay=True)
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"waiting{r}").exists() for r in range(2)):  # the first node's two workers
            assert time.monotonic() < deadline, "the first node's workers never reached the barrier"
            assert all(a.poll() is None for a in agents), "an agent ended early"
            time.sleep(0.2)
        time.sleep(1.0)  # their relay is crossing the barrier upstream
        first = next(a for a in agents if a.pid == int((out / "waiting0").read_text()))
        stopped = time.monotonic()
        first.send_signal(signal.SIGTERM)
        try:
            log = first.communicate(timeout=100)[0]
        except subprocess.TimeoutExpired:
            log = "(still running after 100 s)"
        took = time.monotonic() - stopped
    finally:
        for agent in agents:
            agent.kill()
            agent.wait(timeout=30)
            assert agent.stdout is not None
            agent.stdout.close()
        for pid in out.glob("pid*"):  # its workers, sleeping in a session of their own
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid.read_text()), signal.SIGKILL)
    assert took < 30, f"the agent took {took:.0f}s to end after SIGTERM\n{log[-3000:]}"
    hosted = re.findall(r"node relay for ranks 0\.\.1 at (\S+)/relay\.sock", log)
    assert len(hosted) == 1, log
    assert not os.path.exists(hosted[0]), "its relay's directory was left"


def test_handlers_are_registered_with_torch():
    from torch.distributed.elastic.rendezvous import registry

    registry._register_out_of_tree_handlers()
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    for name in ("dp-etcd", "dp-zmq", "dp-grpc"):
        assert rendezvous_handler_registry._registry.get(name) is not None, name


@pytest.mark.parametrize("first", ["dataparallel.launching.torchrun", "torch.distributed.run"])
def test_the_backends_load_whichever_is_imported_first(first, tmp_path):
    """torch loads every ``torchrun.handlers`` entry point on the first import of its
    rendezvous package, which our backends' module makes itself: no entry point may be
    found half-initialised then (torch logged a traceback for each)."""
    probe = (
        f"import {first}\n"
        "from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry as r\n"
        "print(sorted(n for n in r._registry if n.startswith('dp-')))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == "['dp-etcd', 'dp-grpc', 'dp-zmq']", run.stdout
    assert "Exception while registering" not in run.stderr, run.stderr[-2000:]


def _params(backend: str, endpoint: str, **config) -> RendezvousParameters:
    return RendezvousParameters(backend, endpoint, "contract", 1, 2, **config)


@pytest.mark.parametrize("value", ["0", "-10", "x", "nan"])
def test_an_invalid_read_timeout_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="read_timeout"):
        create_rdzv_handler("zmq", _params("dp-zmq", f"127.0.0.1:{free_port()}", read_timeout=value))


@pytest.mark.parametrize(("value", "message"), [("maybe", "relay .* is 1 or 0"), ("1", "not started by torchrun")])
def test_a_relay_is_asked_for_plainly_and_only_of_torchrun(value, message):
    """``relay=1`` reads the workers per node from torchrun's own command line: an agent
    started otherwise (here, pytest) is told so rather than given a relay of a guessed size."""
    with pytest.raises(ValueError, match=message):
        create_rdzv_handler("zmq", _params("dp-zmq", f"127.0.0.1:{free_port()}", relay=value))


def test_several_endpoints_are_refused_for_a_single_coordinator():
    with pytest.raises(ValueError, match="one coordinator"):
        create_rdzv_handler("zmq", _params("dp-zmq", "127.0.0.1:1,127.0.0.1:2"))


def test_the_state_is_framed_and_signed_with_the_token():
    url = f"zmq://127.0.0.1:{free_port()}"
    with (
        dp.connect(url, rank=0, world_size=3, job="rdzv", token="right", timeout=10) as ch,
        dp.connect(url, rank=1, world_size=3, job="rdzv", token="right", timeout=10) as raw,
    ):
        backend = ChannelRendezvousBackend(ch, "r1", "dp-zmq")
        assert backend.get_state() is None
        state, token, ok = backend.set_state(b"first")
        assert (state, ok) == (b"first", True)
        assert backend.get_state() == (b"first", token)
        assert backend.set_state(b"second", b"stale token") == (b"first", token, False), "a stale token changes nothing"
        key = "torch.rendezvous.r1.state"
        for stored in (b"not a state", b"first", b"DPRZ\x01" + bytes(40)):
            raw.set(key, stored)  # a value this backend never wrote
            with pytest.raises(RendezvousStateError, match=r"not one this backend wrote|not signed"):
                backend.get_state()
        # A state framed correctly but signed without the job's token (a process that can
        # reach the coordinator but does not hold the token) is refused too.
        forger = ChannelRendezvousBackend(raw, "r1", "dp-zmq")
        forger._mac_key = bytes(32)
        raw.delete(key)
        forger.set_state(b"forged")
        with pytest.raises(RendezvousStateError, match="not signed with this job's token"):
            backend.get_state()


@pytest.mark.timeout(120)
def test_an_agent_with_another_token_is_refused(tmp_path, monkeypatch):
    require_etcd()
    server = EtcdServer(tmp_path / "etcd").start().wait_ready()
    handlers = []
    try:
        endpoint = f"127.0.0.1:{server.client_port}"
        monkeypatch.setenv("DP_TOKEN", "right")
        handlers.append(create_rdzv_handler("etcd", _params("dp-etcd", endpoint, read_timeout="10")))
        monkeypatch.setenv("DP_TOKEN", "wrong")
        with pytest.raises(RendezvousConnectionError, match="token"):
            create_rdzv_handler("etcd", _params("dp-etcd", endpoint, read_timeout="10"))
    finally:
        for handler in handlers:
            handler.channel.close()
        server.stop()
