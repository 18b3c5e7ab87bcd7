"""Several hosts on a private network (network namespaces + veth + a bridge, 10.77.0.0/24):
the driver on one host, followers on two others, etcd on a fourth; each node started with
``dataparallel launch --node-rank K`` beside a ``dataparallel.toml``: the file and the commands
are read from the how-to page (docs/howto/several-machines.md), so the page shows what runs.
Training must end with the same model as the same job on one host, and ``dataparallel check``
must say what is wrong when nothing listens or a host is gone.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from etcdserver import EtcdServer, require_etcd
from netns import PrivateNetwork, require_netns
from test_faults import record as record_fault

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_digits.py")
EPOCHS = "2"
DRIVER, FOLLOWERS, ETCD_HOST = 1, (2, 3), 4
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def net():
    require_netns()
    with PrivateNetwork(hosts=4) as network:
        yield network


def test_a_private_network_is_made_cut_healed_and_deleted():
    """The private network the multi-host tests and the fault matrix run on: each host has
    its address and reaches another's; a cut host reaches nobody until healed; closed, its
    namespaces are gone (the host's own network untouched throughout)."""
    require_netns()
    reach = [sys.executable, "-c", "import socket; socket.create_connection(('10.77.0.2', 9), timeout=1)"]
    with PrivateNetwork(hosts=2) as net:
        names = [net.ns(1), net.ns(2), net.switch]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert all(n in listed for n in names), listed
        shown = net.run(
            1, ["ip", "-o", "-4", "addr", "show", net.interface(1)], timeout=30, capture_output=True, text=True
        )
        assert "10.77.0.1/24" in shown.stdout, shown.stdout
        # Port 9 on host 2 refuses (nothing listens): refused, not timed out, is reached.
        refused = net.run(1, reach, timeout=30, capture_output=True, text=True)
        assert "ConnectionRefusedError" in refused.stderr, refused.stderr
        net.cut(2)
        cut = net.run(1, reach, timeout=30, capture_output=True, text=True)
        assert "ConnectionRefusedError" not in cut.stderr and cut.returncode != 0, cut.stderr
        net.heal(2)
        healed = net.run(1, reach, timeout=30, capture_output=True, text=True)
        assert "ConnectionRefusedError" in healed.stderr, healed.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names), listed


#: One intra-op thread per rank in both layouts: launch gives each worker its node's cores
#: divided by the node's workers (2 on a one-worker "host" here, 1 for three on one host),
#: and float sums over another thread count differ in the last bits.
SAME_THREADS = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def one_host(tmp_path_factory) -> Path:
    """The same job with all three ranks on one host (loopback), for comparison."""
    out = tmp_path_factory.mktemp("onehost") / "result.json"
    run = subprocess.run(
        [sys.executable, "-m", "dataparallel", "launch", "--nprocs", "3", SCRIPT, "--epochs", EPOCHS, "--result", out],
        capture_output=True,
        text=True,
        timeout=300,
        env=SAME_THREADS,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _serve(net: PrivateNetwork, transport: str, tmp_path: Path) -> tuple[str, EtcdServer | None]:
    """The job's URL: etcd started on its own host, or the driver's address for zmq/grpc
    (whose coordinator rank 0 hosts)."""
    if transport != "etcd":
        return f"{transport}://{net.address(DRIVER)}:{29500 if transport == 'zmq' else 29501}", None
    require_etcd()
    server = EtcdServer(tmp_path / "etcd", host=net.address(ETCD_HOST), wrap=net.command(ETCD_HOST, [])).start()
    net.procs.append(server.proc)
    net.wait_listening(DRIVER, net.address(ETCD_HOST), 2379)
    return f"etcd://{net.address(ETCD_HOST)}:2379", server


HOWTO = ROOT / "docs" / "howto" / "several-machines.md"


def _howto() -> tuple[str, list[tuple[list[str], str]]]:
    """The how-to's ``dataparallel.toml`` and its launch commands, each with the machine its
    comment puts it on."""
    text = HOWTO.read_text()
    toml = re.search(r"```toml\n(.*?)```", text, re.S)
    bash = re.search(r"```bash\n(dataparallel launch .*?)```", text, re.S)
    assert toml and bash, f"{HOWTO} lost its dataparallel.toml or its launch commands"
    commands = []
    for line in bash.group(1).splitlines():
        command, _, comment = line.partition("#")
        machine = re.search(r"on (\d+\.\d+\.\d+\.\d+)", comment)
        assert machine, line
        commands.append((shlex.split(command), machine.group(1)))
    return toml.group(1), commands


def _job_dir(path: Path, url: str) -> Path:
    """A directory as each machine of the how-to has it: its dataparallel.toml (the job's URL
    in place of the page's zmq one) and the examples."""
    toml, _ = _howto()
    assert 'url = "zmq://10.77.0.1:29500"' in toml, toml
    path.mkdir(parents=True, exist_ok=True)
    (path / "dataparallel.toml").write_text(toml.replace("zmq://10.77.0.1:29500", url))
    (path / "examples").symlink_to(ROOT / "examples")
    return path


def _run_job(net: PrivateNetwork, job_dir: Path, result: Path) -> list[subprocess.CompletedProcess]:
    """The how-to's launch commands, each on the machine it names, in the job's directory."""
    _, commands = _howto()
    procs = []
    for node, ((command, machine), host) in enumerate(zip(commands, (DRIVER, *FOLLOWERS), strict=True)):
        assert machine == net.address(host) and command[:2] == ["dataparallel", "launch"], (command, machine)
        assert command[command.index("--node-rank") + 1] == str(node), command
        argv = [sys.executable, "-m", *command, "--epochs", EPOCHS, "--result", str(result)]
        procs.append(
            net.popen(
                host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=job_dir, env=SAME_THREADS
            )
        )
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def _assert_same_model(result: Path, reference: Path) -> None:
    got, want = json.loads(result.read_text()), json.loads(reference.read_text())
    assert got["world_size"] == want["world_size"] == 3
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6, abs=1e-9)
    assert got["val_accuracy"] == want["val_accuracy"]
    # Every parameter, element by element (the example saves them beside its summary).
    params, expected = torch.load(result.with_suffix(".pt")), torch.load(reference.with_suffix(".pt"))
    assert params.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(params[name], tensor, rtol=1e-6, atol=1e-9, msg=f"parameter {name} differs")


@pytest.mark.parametrize("transport", ["zmq", "grpc", "etcd"])
def test_training_across_hosts_matches_one_host(net, one_host, transport, tmp_path):
    url, server = _serve(net, transport, tmp_path)
    result = tmp_path / "result.json"
    runs = _run_job(net, _job_dir(tmp_path / "job", url), result)
    for node, run in enumerate(runs):
        assert run.returncode == 0, f"node {node}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    # Each node ran its own rank; the driver's output (prefixed with its rank) has the report.
    assert f"[rank 0] driver: 2 epochs on 3 processes over {transport}, final validation accuracy" in runs[0].stdout
    for node, run in enumerate(runs):
        assert f"node {node}/3: ranks {node}..{node} of 3 on {url}" in run.stderr
    _assert_same_model(result, one_host)
    if transport == "etcd":
        # `check` from a follower host: reachable, then "etcd down" once it is stopped.
        ok = _check(net, FOLLOWERS[0], url)
        assert ok.returncode == 0 and "round trip" in ok.stdout, ok.stdout + ok.stderr
        server.stop()
        down = _check(net, FOLLOWERS[0], url)
        assert down.returncode == 1
        assert "nothing listening on 10.77.0.4:2379 (connection refused): is etcd running there?" in down.stdout


def _check(net: PrivateNetwork, host: int, url: str, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dataparallel", "check", url, "--timeout", "3", *extra]
    return net.run(host, argv, timeout=60, capture_output=True, text=True, cwd=ROOT)


def test_check_across_hosts(net):
    served = net.popen(
        DRIVER,
        [sys.executable, "-m", "dataparallel", "serve", f"zmq://{net.address(DRIVER)}:29600"],
        env={**__import__("os").environ, "DP_TOKEN": "right"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        net.wait_listening(FOLLOWERS[0], net.address(DRIVER), 29600)
        url = f"zmq://{net.address(DRIVER)}:29600"
        good = _check(net, FOLLOWERS[0], url, "--token-file", str(_token_file("right")))
        assert good.returncode == 0, good.stdout
        assert "token accepted" in good.stdout and "median" in good.stdout
        wrong = _check(net, FOLLOWERS[0], url, "--token-file", str(_token_file("wrong")))
        assert wrong.returncode == 1 and "wrong token" in wrong.stdout, wrong.stdout
        nobody = _check(net, FOLLOWERS[0], f"zmq://{net.address(DRIVER)}:29601")
        assert "nothing listening on 10.77.0.1:29601 (connection refused)" in nobody.stdout
        # A host that is not there: no ARP answer.
        absent = _check(net, FOLLOWERS[0], f"zmq://{net.address(9)}:29600")
        assert absent.returncode == 1
        assert "no route to 10.77.0.9:29600" in absent.stdout or "no answer from 10.77.0.9" in absent.stdout
    finally:
        served.kill()


def _token_file(token: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "token"
    path.write_text(token)
    path.chmod(0o600)  # a token file others can read is refused
    return path


PARTITION = str(Path(__file__).with_name("partition_worker.py"))


def _barrier_job(net: PrivateNetwork, url: str, seconds: float) -> list[subprocess.Popen]:
    """The three ranks, returned once every one has met the others (a loaded machine can take
    seconds to start one: a link cut before it joined tests nothing the test means)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    procs = []
    for rank, host in enumerate((DRIVER, *FOLLOWERS)):
        env_r = {**env, "DP_URL": url, "DP_RANK": str(rank), "DP_WORLD_SIZE": "3", "DP_JOB": "partition"}
        procs.append(
            net.popen(host, [sys.executable, PARTITION, str(seconds)], stdout=subprocess.PIPE, text=True, env=env_r)
        )
    deadline = time.monotonic() + 90  # the workers' own connect and rendezvous give up at 60 s
    for rank, p in enumerate(procs):
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = p.stdout.readline().strip() if ready else "(nothing in 90 s)"
        if line != "joined":
            for q in procs:
                q.kill()
                q.communicate(timeout=30)
            raise AssertionError(f"rank {rank} did not join: {line!r}")
    return procs


def _reports(procs: list[subprocess.Popen]) -> list[dict]:
    return [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]


@pytest.mark.parametrize("transport", ["zmq", "grpc", "etcd"])
def test_partition_of_one_host_and_its_healing(net, transport, tmp_path):
    """Host 3 loses its link. Shorter than the liveness timeout: the job carries on once it
    heals. For good: the others raise PeerLost naming rank 2 within the liveness timeout."""
    liveness = 4.0
    base, server = _serve(net, transport, tmp_path)
    url = f"{base}?heartbeat=0.5&liveness_timeout={liveness:g}"
    try:
        # A short partition (1.5 s < 4 s) heals: nobody is declared lost, every barrier completes.
        procs = _barrier_job(net, url, seconds=8)
        time.sleep(1)  # a few rounds first
        net.cut(FOLLOWERS[1])
        time.sleep(1.5)
        net.heal(FOLLOWERS[1])
        healed = _reports(procs)
        assert all(r["error"] is None for r in healed), healed
        assert len({r["rounds"] for r in healed}) == 1 and healed[0]["rounds"] > 10
        # A lasting partition: the connected ranks name rank 2 as lost, in bounded time.
        procs = _barrier_job(net, url, seconds=60)
        time.sleep(1)
        net.cut(FOLLOWERS[1])
        cut_at = time.time()
        try:
            reports = _reports(procs[:2])
        finally:
            net.heal(FOLLOWERS[1])
            for p in procs:
                p.kill()
                p.communicate(timeout=30)
        for r in reports:
            assert r["error"] is not None and "peer rank 2 lost" in r["error"], reports
            detection = r["at"] - cut_at
            assert detection < liveness + 6, f"rank {r['rank']} took {detection:.1f}s"
        record_fault("host partitioned (link down)", transport, "others raise PeerLost naming rank 2", detection)
        record_fault("short partition (1.5 s), healed", transport, "job carries on", None)
    finally:
        if server is not None:
            server.stop()


WORKER = str(Path(__file__).with_name("loop_worker.py"))


@pytest.mark.parametrize("transport", ["zmq", "grpc", "etcd"])
def test_an_elastic_job_carries_on_without_a_host_cut_off_for_good(net, transport, tmp_path):
    """Three ranks on three hosts train elastically; host 3 loses its link while every rank
    waits at the first step of epoch 1. The two others notice within the liveness timeout
    (no heartbeat, no gloo reply), leave the broken gloo group and finish the job on two
    ranks; no process restarts. Host 3's rank, its link back, ends with an error."""
    base, server = _serve(net, transport, tmp_path)
    # 8 s: this file runs beside others on three workers, whose load can hold a rank past a
    # shorter timeout before the cut (a loaded fresh-clone run lost a rank that way, 4 s).
    url = f"{base}?heartbeat=0.5&liveness_timeout=8"
    out, started, release = str(tmp_path / "elastic.pt"), tmp_path / "started", tmp_path / "release"
    cfg = {"url": url, "world": 3, "out": out, "elastic": True, "epochs": 3, "dropout": 0.2}
    cfg |= {"started": str(started), "hold": [1, str(release)], "collective_timeout": 120}
    env = {k: v for k, v in SAME_THREADS.items() if not k.startswith("DP_")}
    procs = [
        net.popen(host, [sys.executable, WORKER, json.dumps({**cfg, "rank": rank})], stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True, env=env)
        for rank, host in enumerate((DRIVER, *FOLLOWERS))
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not all(Path(f"{release}.held.{r}").exists() for r in range(3)):  # each waits at epoch 1
            ended = [(r, p) for r, p in enumerate(procs) if p.poll() is not None]
            if ended or time.monotonic() > deadline:
                said = [f"rank {r} exited {p.returncode}: {p.communicate(timeout=10)[1][-2000:]}" for r, p in ended]
                raise AssertionError("\n".join(["the job did not start", *said]))
            time.sleep(0.2)
        net.cut(FOLLOWERS[1])
        release.touch()
        survivors = [p.communicate(timeout=120) for p in procs[:2]]
        net.heal(FOLLOWERS[1])
        _, cut_off = procs[2].communicate(timeout=120)
    finally:
        net.heal(FOLLOWERS[1])
        for p in procs:
            p.kill()
        if server is not None:
            server.stop()
    for p, (stdout, stderr) in zip(procs[:2], survivors, strict=True):
        assert p.returncode == 0, (stdout + stderr)[-3000:]
    assert "generation 1 carries on with 2 ranks without rank(s) [2]" in survivors[0][1]
    assert procs[2].returncode != 0, cut_off[-2000:]
    result = torch.load(out, weights_only=False)
    assert [e["world_size"] for e in result["epochs"]] == [3, 2, 2]
    assert [(r["epoch"], r["lost"]) for r in result["regroups"]] == [(1, [2])]
