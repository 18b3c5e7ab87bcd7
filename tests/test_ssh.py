"""``dataparallel launch --hosts``/``--hostfile``: a whole job from one command on the first
host, every host started over OpenSSH (a real sshd in each namespace of the private network,
keys made by the test, strict host-key checking). The trained model equals the one-host
run's; the token is on no command line on any host; Ctrl-C, SIGTERM or the launcher's death
leave no process behind; the first failure stops the rest with its exit code; a host that
cannot run the job is named, with why, before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from netns import PrivateNetwork, require_netns
from sshcluster import SshHosts, require_sshd
from test_multihost import EPOCHS, SAME_THREADS, SCRIPT, _assert_same_model
from test_multihost import one_host as one_host  # the one-host run to compare with (a fixture)

from dataparallel.config import load_config
from dataparallel.launching.ssh import SshOptions, _with_host, remote_command

ROOT = Path(__file__).resolve().parents[1]
HOSTS = "10.77.0.1:1,10.77.0.2:1,10.77.0.3:1"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_netns()
    require_sshd()
    with PrivateNetwork(hosts=3) as net, SshHosts(net, tmp_path_factory.mktemp("ssh")) as ssh:
        yield net, ssh


def _launch(cluster, *args: str, env: dict | None = None, key: str = "user_key") -> subprocess.Popen:
    net, ssh = cluster
    argv = [sys.executable, "-m", "dataparallel", "launch", *ssh.options(key), *args]
    return net.popen(
        1, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env or SAME_THREADS
    )


def _cmdlines() -> dict[int, bytes]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                pass
    return out


def _alive_naming(marker: str) -> dict[int, str]:
    """Processes (on any host: the namespaces share one process table) whose command line names ``marker``."""
    me = os.getpid()
    return {
        pid: line.replace(b"\0", b" ").decode(errors="replace")
        for pid, line in _cmdlines().items()
        if marker.encode() in line and pid != me
    }


def test_one_command_trains_on_every_host_and_the_token_is_on_no_command_line(cluster, one_host, tmp_path):
    token = f"tok-{uuid.uuid4().hex}"
    result = tmp_path / "result.json"
    proc = _launch(
        cluster,
        "--hosts",
        HOSTS,
        SCRIPT,
        "--epochs",
        EPOCHS,
        "--result",
        str(result),
        env={**SAME_THREADS, "DP_TOKEN": token},
    )
    leaked, remote_launchers = [], set()
    while proc.poll() is None:  # every process on every host, sampled while the job runs
        for pid, line in _cmdlines().items():
            if token.encode() in line:
                leaked.append(line)
            if line.startswith(sys.executable.encode()) and b"--from-launcher" in line:
                remote_launchers.add(pid)  # a host's launcher itself (not the ssh client that started it)
        time.sleep(0.1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    assert not leaked, leaked
    assert token not in out + err
    assert len(remote_launchers) >= 3  # the sampling saw the job: a launcher on each host
    assert "[launch] 3 hosts over ssh, 3 ranks, coordinator zmq://10.77.0.1:29500" in err
    for node in range(3):
        host = f"10.77.0.{node + 1}"
        assert f"[{host}] [launch] node {node}/3: ranks {node}..{node} of 3 on zmq://10.77.0.1:29500" in err, err
    assert "[10.77.0.1] [rank 0] driver: 2 epochs on 3 processes over zmq" in out
    _assert_same_model(result, one_host)


SLEEPER = """\
import os, sys, time
from pathlib import Path
rank = int(os.environ["DP_RANK"])
Path(sys.argv[1], f"{rank}.pid").write_text(f"{os.getpid()} {os.environ['DP_WORLD_SIZE']}")
if rank == int(sys.argv[2]):
    sys.exit(7)
time.sleep(300)
"""


def _sleepers(cluster, tmp_path: Path, failing: int = -1) -> tuple[subprocess.Popen, Path]:
    """A 4-rank job (slots 1, 2, 1, from a host file) whose ranks record their pids and sleep."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job's hosts\n10.77.0.1 slots=1\n10.77.0.2 slots=2  # two here\n\n10.77.0.3\n")
    return _launch(
        cluster, "--hostfile", str(hostfile), str(tmp_path / "sleeper.py"), str(tmp_path), str(failing)
    ), tmp_path


def _wait_for_pids(directory: Path, count: int, proc: subprocess.Popen) -> dict[int, int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        pids = {int(p.stem): int(p.read_text().split()[0]) for p in directory.glob("*.pid") if p.read_text()}
        if len(pids) == count:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not all start: {proc.communicate(timeout=30)}")


def _assert_nothing_left(marker: str, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while _alive_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive_naming(marker), f"left running: {_alive_naming(marker)}"


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_stopping_the_one_launcher_stops_every_host(cluster, tmp_path, how):
    proc, marker = _sleepers(cluster, tmp_path)
    pids = _wait_for_pids(tmp_path, 4, proc)
    assert sorted(pids) == [0, 1, 2, 3]
    assert {p.read_text().split()[1] for p in tmp_path.glob("*.pid")} == {"4"}
    started = time.monotonic()
    proc.send_signal(how)
    _, err = proc.communicate(timeout=60)
    if how != signal.SIGKILL:
        assert proc.returncode == 128 + how, err[-3000:]
        assert time.monotonic() - started < 30
    _assert_nothing_left(str(marker))
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists()


def test_the_first_failure_stops_the_other_hosts_with_its_exit_code(cluster, tmp_path):
    proc, marker = _sleepers(cluster, tmp_path, failing=2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err[-3000:]
    assert "[launch] 10.77.0.2 exited with exit code 7; stopping 10.77.0.1, 10.77.0.3" in err
    assert "[10.77.0.2] [launch] rank 2 exited with exit code 7" in err
    _assert_nothing_left(str(marker))


@pytest.mark.parametrize("case", ["unreachable host", "refused key", "no package"])
def test_a_host_that_cannot_run_the_job_is_named_before_anything_starts(cluster, tmp_path, case):
    hosts, key, extra = HOSTS, "user_key", []
    if case == "unreachable host":
        hosts = "10.77.0.1:1,10.77.0.9:1"  # nobody answers ARP for .9
    elif case == "refused key":
        key = "stranger_key"
    else:
        extra = ["--remote-python", "/usr/bin/python3"]  # a Python without the package's dependencies
    result = tmp_path / "result.json"
    started = time.monotonic()
    proc = _launch(cluster, "--hosts", hosts, *extra, SCRIPT, "--epochs", "1", "--result", str(result), key=key)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert time.monotonic() - started < 45
    assert not result.exists() and "[rank" not in out + err  # nothing started
    if case == "unreachable host":
        assert "cannot start the job on 1 of 2 hosts:\n  10.77.0.9: ssh failed: " in err, err
        assert "No route to host" in err or "timed out" in err, err
    elif case == "refused key":
        assert "cannot start the job on 3 of 3 hosts:" in err, err
        for host in ("10.77.0.1", "10.77.0.2", "10.77.0.3"):
            assert f"  {host}: ssh failed: " in err and "Permission denied (publickey)" in err, err
    else:
        assert "  10.77.0.2: cannot import dataparallel with /usr/bin/python3 there: ModuleNotFoundError" in err, err


FLAKY = """\
import os, sys
import dataparallel as dp
ch = dp.connect(timeout=60)
ch.rendezvous()
if ch.rank == 2 and not os.environ.get("DP_RESTART_COUNT"):
    os._exit(7)  # the first attempt loses rank 2
ch.barrier("done", timeout=60)
print(f"attempt {os.environ.get('DP_RESTART_COUNT', '0')} done on {ch.world_size} {ch.url.scheme}", flush=True)
ch.close()
"""


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_max_restarts_restarts_every_host_in_step(cluster, tmp_path, relay):
    """With ``--relay`` each host's launcher hosts its node's relay (one per attempt: the
    restarted group's job meets nothing of the failed one's) and its workers reach the job
    through it."""
    (tmp_path / "flaky.py").write_text(FLAKY)
    flags = ["--relay"] if relay else []
    proc = _launch(
        cluster, "--hosts", HOSTS, "--max-restarts", "1", "--timeout", "20", *flags, str(tmp_path / "flaky.py")
    )
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-4000:]
    for host in ("10.77.0.1", "10.77.0.2", "10.77.0.3"):  # every host's group failed once, then all ran again
        assert f"[{host}] [launch] worker group failed" in err, err[-4000:]
        assert (f"[{host}] [launch] node relay for ranks" in err) == relay, err[-4000:]
    assert out.count(f"attempt 1 done on 3 {'relay' if relay else 'zmq'}") == 3, out


def test_the_ssh_command_line_and_what_stays_off_it():
    ssh = SshOptions(port=2222, options=("ConnectTimeout=60",))
    argv = ssh.argv("root@[fd00::1]", "true")
    assert argv[-2:] == ["root@fd00::1", "true"]  # ssh takes an IPv6 address without brackets
    # ssh keeps an option's first value: the user's come before the launcher's defaults.
    assert argv.index("ConnectTimeout=60") < argv.index("ConnectTimeout=10")
    config = load_config({"hosts": "a:1,b:1", "url": "etcd://e:2379?user=u&password=s3cret"}, env={})
    remote = remote_command([sys.executable, "t.py"], config, 1, 1, 1, 2, grace=5, ssh=ssh, prefix=True, cwd="/x")
    assert "s3cret" not in remote and "etcd://" not in remote  # the URL goes over stdin with the token
    assert "-u DP_URL" in remote and "-u DP_HOSTS" in remote  # the host's own settings do not speak
    assert "--relay" not in remote
    relayed = dataclasses.replace(config, relay=True)
    remote = remote_command([sys.executable, "t.py"], relayed, 1, 1, 1, 2, grace=5, ssh=ssh, prefix=True, cwd="/x")
    assert "--relay" in remote
    assert _with_host("zmq://gpu1:29500?curve=1", "10.0.0.5") == "zmq://10.0.0.5:29500?curve=1"
    assert _with_host("zmq://gpu1:29500", "fd00::5") == "zmq://[fd00::5]:29500"
