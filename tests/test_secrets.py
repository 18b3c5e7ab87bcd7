"""Secrets stay secret, and a configured token is never dropped.

No secret — the job token (``DP_TOKEN``, a token file's contents), etcd's ``password=``, a TLS
private key's path (``key=``) or its contents — appears in any line of any command's output
(launch on one node, over ssh, with ``--log-format json``; serve; check; the torchrun
backends; every error that names a URL; a worker's crash traceback), on any process's
command line, or in an environment another user can read. The attacker is real: while each
command runs, ``grep`` as the user ``nobody`` reads every ``/proc/PID/cmdline`` and
``/proc/PID/environ`` it can. What cannot be hidden is shown too: the token is in the
workers' own environment (``DP_TOKEN``), readable by their user and root only.

And every entry point — ``dp.connect`` whatever arguments it is given, ``dataparallel
serve``, ``check``, ``launch``, the torchrun backends — takes the token from ``DP_TOKEN`` or
the configuration file's ``token_file``: a coordinator started with it in its environment
only refuses a client with another token and one with none.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from etcdserver import EtcdServer, require_etcd
from pki import make_pki

import dataparallel as dp
from dataparallel.control import registry
from dataparallel.testing import free_port, with_options

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------- the scan
class Secrets:
    """The secrets of one test, where they live, and everything seen that holds one."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.token = f"tok-{uuid.uuid4().hex}"
        self.file_token = f"filetok-{uuid.uuid4().hex}"
        self.password = f"pw-{uuid.uuid4().hex}&#/x"  # characters a URL must quote
        self.pki = make_pki(directory)
        self.key_path = str(self.pki["key"])
        key_lines = self.pki["key"].read_text().splitlines()
        self.token_file = directory / "token"
        self.token_file.write_text(self.file_token + "\n")
        self.token_file.chmod(0o600)
        # The key file's own lines, the password and the key path as given and as a URL quotes them.
        plain = [self.token, self.file_token, self.password, self.key_path, *key_lines[1:-1]]
        self.all = sorted({s for text in plain for s in (text, quote(text, safe=""), quote(text))})
        self.leaks: list[str] = []
        self.seen_in_own_environment = False
        self.nobody = pwd.getpwnam("nobody") if os.geteuid() == 0 else None

    def tls_url(self, port: int) -> str:
        pki = self.pki
        return with_options(f"grpc://127.0.0.1:{port}", tls=1, ca=pki["ca"], cert=pki["cert"], key=pki["key"])

    def etcd_url(self, port: int, **more: str) -> str:
        return with_options(f"etcd://127.0.0.1:{port}", user="u", password=self.password, **more)

    def text(self, where: str, text: str) -> str:
        """Record every secret in ``text`` (one output of one command); returns the text."""
        for line in text.splitlines():
            for secret in self.all:
                if secret in line:
                    self.leaks.append(f"{where}: {secret!r} in {line!r}")
        return text

    def processes(self, command: str) -> None:
        """One look at every process, as another user would take it: command lines (anyone
        may read them) and environments (``nobody`` must be refused; where this test is not
        root, each environment holding a secret must be its owner's alone)."""
        patterns = "\n".join(self.all) + "\n"
        as_nobody = {"user": self.nobody.pw_uid, "group": self.nobody.pw_gid} if self.nobody else {}
        files = "/proc/[0-9]*/cmdline /proc/[0-9]*/environ" if self.nobody else "/proc/[0-9]*/cmdline"
        # The patterns on stdin: a grep with them on its command line would find itself.
        found = subprocess.run(
            ["sh", "-c", f"grep -l -a -F -f - {files} 2>/dev/null"],
            input=patterns,
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
            cwd="/",
            **as_nobody,
        ).stdout.split()
        self.leaks += [f"{command}: another user reads a secret in {path}" for path in found]
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                data = environ.read_bytes()
            except OSError:
                continue
            if self.token.encode() in data or self.file_token.encode() in data:
                self.seen_in_own_environment = True  # what cannot be hidden: a rank's DP_TOKEN, its user's to read
                with contextlib.suppress(OSError):
                    if environ.stat().st_mode & 0o077:
                        self.leaks.append(f"{command}: {environ} holds a secret and others may read it")

    def run(self, name: str, argv: list[str], env: dict[str, str], *, timeout: float = 120, **kw) -> tuple[int, str]:
        """Run ``argv``, looking at every process while it runs; returns its exit code and
        its output (stdout, then stderr), scanned."""
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        deadline = time.monotonic() + timeout
        with contextlib.ExitStack() as stack:
            stack.callback(_stop, proc)
            while proc.poll() is None and time.monotonic() < deadline:
                self.processes(name)
                time.sleep(0.2)
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        self.text(f"{name} stdout", out)
        self.text(f"{name} stderr", err)
        return proc.returncode, out + err


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any job setting of its own, one thread per process, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DP_", "TORCHELASTIC_", "MASTER_"))}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _dataparallel(*args: str) -> list[str]:
    return [sys.executable, "-m", "dataparallel", *args]


@pytest.fixture
def secrets(tmp_path):
    found = Secrets(tmp_path)
    yield found
    assert not found.leaks, "\n".join(found.leaks[:40])


WORKER = """\
import logging, os, sys
import dataparallel as dp
logging.basicConfig(level=logging.INFO)
ch = dp.connect(timeout=30)
ch.rendezvous()
print(f"rank {ch.rank}: {ch!r} at {ch.url.shown}", flush=True)
logging.getLogger("worker").info("channel %r, url %r", ch, ch.url)
ch.barrier("met", timeout=30)
if ch.rank == 1:
    raise RuntimeError(f"a crash on purpose in {ch!r}")  # its traceback goes to the output
ch.close()
"""

BROKEN_WORKER = """\
import dataparallel as dp
dp.connect(timeout=3)  # a coordinator that is not there: the error names the URL
"""


def test_no_secret_in_what_launch_serve_check_and_their_errors_show(secrets, tmp_path):
    """Every command with a token, a token file, a password and a TLS key path: nothing
    shows any of them, on any output or command line, or to another user's eye."""
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "broken.py").write_text(BROKEN_WORKER)
    config = tmp_path / "job.toml"  # url and token_file from a file, as a user keeps them off the command line
    config.write_text(f'url = "{secrets.tls_url(free_port())}"\ntoken_file = "{secrets.token_file}"\n')
    tls = _clean_env(DP_URL=secrets.tls_url(free_port()), DP_TOKEN=secrets.token)
    issue = _clean_env(DP_URL="etcd://127.0.0.1:2379?" + f"user=u&password={quote(secrets.password)}")
    worker, broken = str(tmp_path / "worker.py"), str(tmp_path / "broken.py")

    # launch on one node: workers connect over TLS, rank 1 crashes with a traceback.
    code, out = secrets.run("launch", _dataparallel("launch", "--nprocs", "2", worker), tls, cwd=tmp_path)
    assert code == 1 and "RuntimeError: a crash on purpose" in out and "key=***" in out, out[-3000:]
    assert "on grpc://127.0.0.1:" in out and "rank 0: <GrpcChannel grpc://127.0.0.1:" in out, out[-3000:]
    # The same with JSON lines, the URL and the token file from a configuration file.
    json_env = _clean_env(DP_CONFIG=str(config))
    code, out = secrets.run(
        "launch json", _dataparallel("launch", "--log-format", "json", "--nprocs", "2", worker), json_env
    )
    assert code == 1 and '"rank": 1' in out and "key=***" in out, out[-3000:]
    # The issue's own case: a password in the URL (the workers never connect).
    code, out = secrets.run("launch etcd", _dataparallel("launch", "--nprocs", "1", "--no-python", "--", "true"), issue)
    assert code == 0 and "ranks 0..0 of 1 on etcd://127.0.0.1:2379?user=u&password=***" in out, out
    # A worker whose coordinator is not there: the error, raised in the worker, names the URL.
    gone = _clean_env(DP_URL=secrets.etcd_url(free_port()), DP_TOKEN=secrets.token)
    code, out = secrets.run("launch unreachable", _dataparallel("launch", "--nprocs", "1", broken), gone)
    assert code == 1 and "password=***" in out and "ChannelClosed: no etcd member reachable" in out, out[-3000:]

    # serve, and check against it: right token, wrong token, no token; check --env.
    port = free_port()
    served = _clean_env(DP_URL=secrets.tls_url(port), DP_TOKEN=secrets.token)
    server = subprocess.Popen(
        _dataparallel("-v", "serve"), env=served, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready = secrets.text("serve stdout", server.stdout.readline())
        assert "serving grpc://127.0.0.1:" in ready and "key=***" in ready, ready
        secrets.processes("serve")
        code, out = secrets.run("check", _dataparallel("check", "--rounds", "3"), served)
        assert code == 0 and out.rstrip().endswith("OK") and "key=***" in out, out
        for token in ("wrong-token", None):
            env = {k: v for k, v in served.items() if k != "DP_TOKEN"} | ({"DP_TOKEN": token} if token else {})
            code, out = secrets.run(f"check with token {token}", _dataparallel("check", "--rounds", "3"), env)
            assert code == 1 and "PROBLEM" in out, out
    finally:
        server.terminate()
        rest = server.communicate(timeout=30)
        secrets.text("serve", "\n".join(rest))
    code, out = secrets.run("check --env", _dataparallel("check", "--env"), issue)
    assert code == 0 and "url = etcd://127.0.0.1:2379?user=u&password=*** (from DP_URL)" in out, out

    # Every error that names a URL, from check and from launch (text and JSON).
    pw = quote(secrets.password)
    key = quote(secrets.key_path, safe="")
    errors = {
        "unknown option": f"etcd://127.0.0.1:2379?user=u&password={pw}&bogus=1",
        "bad port": f"etcd://127.0.0.1:99999?user=u&password={pw}",
        "option twice": f"etcd://127.0.0.1:2379?user=u&password={pw}&password={pw}",
        "no scheme": f"127.0.0.1:2379?user=u&password={pw}",
        "credentials before the host": f"etcd://u:{pw}@127.0.0.1:2379",
        "password without user": f"etcd://127.0.0.1:2379?password={pw}",
        "key file unreadable": f"grpc://127.0.0.1:1?tls=1&cert=x.pem&key={key}.gone",
        "nothing listening": secrets.etcd_url(free_port()),
    }
    for case, url in errors.items():
        code, out = secrets.run(f"check: {case}", _dataparallel("check", "--timeout", "2"), _clean_env(DP_URL=url))
        assert code in (1, 2) and ("***" in out or case == "no scheme"), f"{case}: {out}"
        for how in ([], ["--log-format", "json"]):
            argv = _dataparallel("launch", *how, "--nprocs", "1", "--no-python", "--", "true")
            code, out = secrets.run(f"launch {how}: {case}", argv, _clean_env(DP_URL=url, DP_TIMEOUT="2"))
            assert code == 2 or case == "nothing listening", f"{case}: {out}"
    # The URL's options given apart (DP_OPTIONS) are masked the same way.
    code, out = secrets.run(
        "options apart",
        _dataparallel("check"),
        _clean_env(DP_URL="etcd://127.0.0.1:2379", DP_OPTIONS=f"user=u&password={pw}&bogus=1"),
    )
    assert code == 1 and "password=***" in out, out
    assert secrets.seen_in_own_environment, "the scan saw no rank's environment: it looked too late"


TORCHRUN_WORKER = """\
import sys
import dataparallel as dp
ch = dp.connect(timeout=60)
ch.rendezvous()
print(f"worker {ch!r} at {ch.url.shown}", flush=True)
ch.close()
"""


def test_no_secret_in_what_the_torchrun_backends_show(secrets, tmp_path):
    (tmp_path / "worker.py").write_text(TORCHRUN_WORKER)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    for name, env in {
        "DP_TOKEN": _clean_env(DP_TOKEN=secrets.token),
        "token_file": _clean_env(DP_CONFIG=str(_config(tmp_path, secrets.token_file))),
    }.items():
        argv = [
            torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "dp-zmq",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"secrets-{name}",
            "--rdzv-conf", "join_timeout=60,read_timeout=30", str(tmp_path / "worker.py"),
        ]  # fmt: skip
        code, out = secrets.run(f"torchrun ({name})", argv, {**env, "LOGLEVEL": "INFO"}, timeout=240)
        assert code == 0 and out.count("worker <ZmqChannel zmq://127.0.0.1:") == 2, out[-3000:]
    assert secrets.seen_in_own_environment


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from netns import PrivateNetwork, require_netns
    from sshcluster import SshHosts, require_sshd

    require_netns()
    require_sshd()
    with PrivateNetwork(hosts=2) as net, SshHosts(net, tmp_path_factory.mktemp("ssh")) as ssh:
        yield net, ssh


def test_no_secret_in_what_a_launch_over_ssh_shows(secrets, cluster):
    """The issue's case over ssh: every host's launcher prints its line back to the user's
    terminal; none may carry the password, and no command line on any host the token."""
    net, ssh = cluster
    env = _clean_env(DP_URL=secrets.etcd_url(2379), DP_TOKEN=secrets.token)
    hosts = f"{net.address(1)}:1,{net.address(2)}:1"
    argv = _dataparallel("launch", *ssh.options(), "--hosts", hosts, "--no-python", "--", "true")
    code, out = secrets.run("launch --hosts", net.command(1, argv), env, cwd=ROOT)
    assert code == 0, out[-3000:]
    for node in range(2):
        line = f"[{net.address(node + 1)}] [launch] node {node}/2: ranks {node}..{node} of 2 on etcd://"
        assert line in out and "user=u&password=***" in out, out


# ---------------------------------------------------------------------- the token, honoured
def _config(directory: Path, token_file: Path) -> Path:
    path = directory / "dataparallel-token.toml"
    path.write_text(f'token_file = "{token_file}"\n')
    return path


def _token_source(source: str, secrets: Secrets) -> tuple[dict[str, str], str]:
    """The environment that configures the job's token from ``source`` only, and that token."""
    if source == "DP_TOKEN":
        return _clean_env(DP_TOKEN=secrets.token), secrets.token
    return _clean_env(DP_CONFIG=str(_config(secrets.dir, secrets.token_file))), secrets.file_token


@contextlib.contextmanager
def _hosting(argv: list[str], env: dict[str, str], ready: str, cwd: Path | None = None) -> Iterator[None]:
    """A process that hosts a coordinator, from the line ``ready`` on its stdout until the end."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if ready in line:
                break
        else:
            raise AssertionError("".join(lines)[-3000:])
        yield
    finally:
        _stop(proc)


def _refuses_others(url: str, token: str, job: str, world_size: int = 2) -> None:
    """The coordinator at ``url`` refuses a client with another token and one with none, and
    takes ``token`` (so that it is the token, not something else, that decides)."""
    for other in ("another-token", None):
        with pytest.raises(dp.AuthError):
            dp.connect(url, rank=None, world_size=world_size, job=job, token=other, timeout=10).close()
    with dp.connect(url, rank=None, world_size=world_size, job=job, token=token, timeout=10):
        pass


CONNECT_HOST = """\
import sys, time
import dataparallel as dp
ch = dp.connect(sys.argv[1], rank=0, world_size=3, job="j", timeout=30)  # the documented direct use
print("hosting", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("source", ["DP_TOKEN", "token_file"])
@pytest.mark.parametrize("scheme", ["zmq", "grpc", "tcpstore"])
def test_connect_with_every_argument_still_takes_the_configured_token(secrets, source, scheme, monkeypatch):
    monkeypatch.delenv("DP_TOKEN", raising=False)
    monkeypatch.delenv("DP_CONFIG", raising=False)
    env, token = _token_source(source, secrets)
    url = f"{scheme}://127.0.0.1:{free_port()}"
    with _hosting([sys.executable, "-c", CONNECT_HOST, url], env, "hosting"):
        _refuses_others(url, token, "j", world_size=3)


def test_connect_takes_the_token_from_the_configuration_whatever_is_given(secrets, monkeypatch):
    """In-process: the token of a channel opened with url, rank and world size given."""
    monkeypatch.setenv("DP_TOKEN", secrets.token)
    with dp.connect("memory://secrets", rank=0, world_size=1, job="j", timeout=5) as ch:
        assert ch.token == secrets.token
    with dp.connect("memory://secrets", rank=0, world_size=1, job="k", token="given", timeout=5) as ch:
        assert ch.token == "given", "a token given wins over the configuration's"


@pytest.mark.parametrize("source", ["DP_TOKEN", "token_file"])
def test_serve_and_check_take_the_configured_token(secrets, source, monkeypatch):
    monkeypatch.delenv("DP_TOKEN", raising=False)
    env, token = _token_source(source, secrets)
    url = f"zmq://127.0.0.1:{free_port()}"
    with _hosting(_dataparallel("serve", url), env, "serving"):
        _refuses_others(url, token, "served")
        for given, ok in ((env, True), (_clean_env(DP_TOKEN="another-token"), False), (_clean_env(), False)):
            done = subprocess.run(
                _dataparallel("check", "--rounds", "2", url), env=given, capture_output=True, text=True, timeout=60
            )
            assert (done.returncode == 0) == ok, done.stdout + done.stderr


LAUNCHED = """\
import os, time
import dataparallel as dp
ch = dp.connect(timeout=30)  # rank 0 (of 2: the other node is the test's client) hosts the coordinator
print("hosting", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("source", ["DP_TOKEN", "token_file"])
def test_launch_gives_its_workers_the_configured_token(secrets, source, tmp_path, monkeypatch):
    monkeypatch.delenv("DP_TOKEN", raising=False)
    env, token = _token_source(source, secrets)
    (tmp_path / "launched.py").write_text(LAUNCHED)
    url = f"zmq://127.0.0.1:{free_port()}"
    argv = _dataparallel(
        "launch", "--url", url, "--nodes", "2", "--nprocs", "1", "--job", "launched", str(tmp_path / "launched.py")
    )
    with _hosting(argv, env, "hosting"):
        _refuses_others(url, token, "launched")


AGENT = """\
import sys, time
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from dataparallel.launching.torchrun import create_rdzv_handler
params = RendezvousParameters("dp-zmq", sys.argv[1], "run", 1, 2, read_timeout="10")
handler = create_rdzv_handler("zmq", params)  # the agent that binds the endpoint hosts the coordinator
print("hosting", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("source", ["DP_TOKEN", "token_file"])
def test_the_torchrun_backend_takes_the_configured_token(secrets, source, monkeypatch):
    monkeypatch.delenv("DP_TOKEN", raising=False)
    env, token = _token_source(source, secrets)
    port = free_port()
    with _hosting([sys.executable, "-c", AGENT, f"127.0.0.1:{port}"], env, "hosting"):
        _refuses_others(f"zmq://127.0.0.1:{port}", token, "torchrun.run")


# ---------------------------------------------------------------------- the masking itself
@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("etcd://h:2379?user=u&password=s3cret", "etcd://h:2379?user=u&password=***"),
        (
            "grpc://h:1?tls=1&ca=/c/ca.pem&cert=/c/me.pem&key=/c/me.key",
            "grpc://h:1?tls=1&ca=/c/ca.pem&cert=/c/me.pem&key=***",
        ),
        (
            "x://h:1?pass%77ord=s3cret&api_token=t&Client_Key=k&secret=z",
            "x://h:1?pass%77ord=***&api_token=***&Client_Key=***&secret=***",
        ),
        ("etcd://u:s3cret@h:2379", "etcd://u:***@h:2379"),
        ("etcd://h:2379?password=s3#cret&user=u", "etcd://h:2379?password=***&user=u"),
        ("not a url?password=s3cret", "not a url?password=***"),
    ],
)
def test_one_masking_hides_every_secret_option(url, shown):
    assert registry.mask_url(url) == shown


def test_a_parsed_url_and_a_job_configuration_show_no_secret():
    from dataparallel.config import load_config

    url = "etcd://h:2379?user=u&password=s3cret&key=/k/me.key&ca=/k/ca.pem&cert=/k/me.pem"
    parsed = registry.parse_url(url)
    assert "s3cret" not in repr(parsed) and "me.key" not in repr(parsed) and parsed.options["password"] == "s3cret"
    config = load_config({"url": url}, env={"DP_TOKEN": "tok-4711"})
    assert "s3cret" not in repr(config) and "tok-4711" not in repr(config) and config.token == "tok-4711"
    assert config.shown("url") == registry.mask_url(url) and config.shown("token") == "***"


@pytest.mark.timeout(60)
def test_etcd_refusing_a_password_names_it_masked(tmp_path):
    """etcd with authentication off refuses user=/password=: the error names the URL, masked."""
    require_etcd()
    server = EtcdServer(tmp_path / "etcd").start().wait_ready()
    try:
        url = f"etcd://127.0.0.1:{server.client_port}?user=u&password=pw-etcd-s3cret"
        with pytest.raises(dp.ConfigError) as info:
            dp.connect(url, rank=0, world_size=1, job="j", timeout=10)
        assert "pw-etcd-s3cret" not in str(info.value) and "password=***" in str(info.value)
    finally:
        server.stop()


def test_json_lines_of_launch_carry_no_secret(tmp_path):
    url = "etcd://127.0.0.1:2379?user=u&password=pw-json-s3cret"
    done = subprocess.run(
        _dataparallel("launch", "--log-format", "json", "--nprocs", "1", "--no-python", "--", "true"),
        env=_clean_env(DP_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert any("password=***" in line.get("message", "") for line in lines), lines
    assert "pw-json-s3cret" not in done.stdout + done.stderr
