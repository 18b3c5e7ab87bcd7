"""etcd with TLS (client certificates required) and with authentication (users whose roles
cover key prefixes, a 2 s token TTL): real etcd servers started here, one of each kind for
the module, and certificates made here. Each misconfiguration fails typed, in seconds, and
``dataparallel check`` names it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import grpc
import pytest
from aetcd import rpc
from etcdserver import EtcdServer, require_etcd
from jobutil import FAST, open_job
from pki import make_pki

import dataparallel as dp
from dataparallel.control.check import check
from dataparallel.testing import close_all, run_all, with_options
from dataparallel.transports.etcd.client import EtcdClient

TOKEN_TTL = 2  # etcd's --auth-token-ttl: a token unused this long is dropped
PREFIX = "sec"  # the URL's path: a job JOB keeps its keys under /sec//JOB/
USERS = {  # name: (password, key prefix its role may read and write; None: root's role)
    "root": ("root-pw", None),
    "alice": ("alice-pw", f"/{PREFIX}//job1/"),
    "bob": ("bob-pw", "/bobs/"),
    "agent": ("p&w%d+x=y", "/dataparallel//torchrun.contract/"),  # torchrun's job; a password to quote
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory, pki):
    """etcd serving clients over TLS only, and only those with a certificate signed by pki's CA."""
    require_etcd()
    certs = ["--trusted-ca-file", pki["ca"], "--cert-file", pki["cert"], "--key-file", pki["key"]]
    args = ["--client-cert-auth", *map(str, certs)]
    server = EtcdServer(tmp_path_factory.mktemp("tls-etcd"), https=True, args=args).start().wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    """etcd with authentication on, the USERS made, and a short token TTL."""
    require_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("auth-etcd"), args=["--auth-token-ttl", str(TOKEN_TTL)])
    server.start().wait_ready()
    try:
        _enable_auth(server.client_port)
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


def _enable_auth(port: int) -> None:
    """USERS, each with a role of its own, through etcd's v3 Auth API; then auth on."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        auth = rpc.AuthStub(channel)
        for user, (password, prefix) in USERS.items():
            role = user if user == "root" else f"{user}-role"
            auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password), timeout=5)
            auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=5)
            if prefix is not None:
                key = prefix.encode()
                perm = rpc.Permission(permType=rpc.Permission.READWRITE, key=key, range_end=key[:-1] + b"0")
                auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm), timeout=5)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=role), timeout=5)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


def _tls(server: EtcdServer, pki, ca: str = "ca", cert: str | None = "cert", key: str | None = "key") -> str:
    files = {"ca": pki[ca]} | ({"cert": pki[cert], "key": pki[key]} if cert else {})
    return with_options(f"{server.url}/{PREFIX}", **files, **FAST)


def _as(server: EtcdServer, user: str, password: str | None = None, prefix: str = PREFIX) -> str:
    password = USERS[user][0] if password is None else password
    return with_options(f"{server.url}/{prefix}", user=user, password=password, **FAST)


def _refused_fast(url: str, error: type[Exception], match: str, job: str = "job1") -> None:
    """Opening a session at ``url`` with a long timeout fails with ``error`` within seconds."""
    start = time.monotonic()
    with pytest.raises(error, match=match):
        dp.connect(url, rank=0, world_size=2, job=job, timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"{url}: took {elapsed:.1f}s to fail"


def _problem(url: str) -> str:
    report = check(url, timeout=3, rounds=3)
    assert not report.ok, report.render()
    return report.problem


# ---------------------------------------------------------------------- TLS
@pytest.mark.timeout(60)
def test_tls_with_the_right_certificates_carries_a_gloo_job(tls_etcd, pki):
    import torch
    import torch.distributed as dist

    channels = open_job(_tls(tls_etcd, pki), 2, job="gloo")
    try:

        def rank(ch: dp.ControlChannel) -> list[float]:
            store = dist.PrefixStore("pg/", ch.as_store())
            group = dist.ProcessGroupGloo(store, ch.rank, 2, timedelta(seconds=30))
            tensor = torch.tensor([float(ch.rank + 1)])
            group.allreduce([tensor]).wait()
            return tensor.tolist()

        assert run_all([lambda c=c: rank(c) for c in channels], timeout=40) == [[3.0], [3.0]]
        run_all([lambda c=c: c.barrier("after-gloo", timeout=10) for c in channels])
    finally:
        close_all(channels)


@pytest.mark.timeout(60)
def test_tls_misconfigurations_fail_typed_within_seconds(tls_etcd, pki):
    _refused_fast(f"{tls_etcd.url}/{PREFIX}", dp.ConfigError, r"speaks TLS, the URL does not: add ca=CA\.pem")
    _refused_fast(_tls(tls_etcd, pki, ca="rogue_ca"), dp.AuthError, "does not verify against ca=")
    _refused_fast(_tls(tls_etcd, pki, cert=None), dp.AuthError, "refuses a client without a certificate")
    _refused_fast(
        _tls(tls_etcd, pki, cert="rogue_cert", key="rogue_key"), dp.AuthError, "refuses this client's certificate"
    )


def test_tls_options_are_checked_before_connecting(pki, tmp_path):
    url = "etcd://127.0.0.1:1/x"
    for options, match in [
        ({"ca": tmp_path / "none.pem"}, "cannot read ca="),
        ({"ca": pki["ca"], "cert": pki["cert"]}, "cert= and key= go together"),
        ({"cert": pki["cert"], "key": pki["key"]}, "which ca=CA.pem turns on"),
        ({"password": "secret"}, "password= without user=: add user="),
    ]:
        with pytest.raises(dp.ConfigError, match=match) as info:
            dp.connect(with_options(url, **options), rank=0, world_size=1, timeout=2)
        assert "secret" not in str(info.value), "the password is not shown"


# ---------------------------------------------------------------------- authentication
@pytest.mark.timeout(60)
def test_a_user_whose_role_covers_the_job_works_past_the_token_ttl(auth_etcd, monkeypatch):
    logins = []
    authenticate = EtcdClient._authenticate

    async def counted(self: EtcdClient) -> None:
        logins.append(self._username)
        await authenticate(self)

    monkeypatch.setattr(EtcdClient, "_authenticate", counted)
    a, b = channels = open_job(_as(auth_etcd, "alice"), 2, job="job1")
    try:
        assert "alice-pw" not in repr(a), "the password is masked"
        a.set("k", b"v")
        assert b.get("k", timeout=5) == b"v"
        run_all([lambda c=c: c.barrier("first", timeout=10) for c in channels])
        before = len(logins)
        time.sleep(TOKEN_TTL + 1.5)  # both ranks idle: etcd drops their tokens
        # A get that has to watch (the key comes later), a write, and a barrier: all work.
        threading.Timer(0.5, lambda: a.set("late", b"L")).start()
        assert b.get("late", timeout=10) == b"L"
        assert a.add("n", 2) == 2
        run_all([lambda c=c: c.barrier("after-ttl", timeout=10) for c in channels])
        assert len(logins) >= before + 2, "each rank logged in again after its token was dropped"
    finally:
        close_all(channels)


@pytest.mark.timeout(60)
def test_wrong_credentials_are_auth_errors_within_seconds(auth_etcd):
    _refused_fast(_as(auth_etcd, "alice", password="wrong"), dp.AuthError, "wrong user name or password")
    _refused_fast(f"{auth_etcd.url}/{PREFIX}", dp.AuthError, r"requires authentication \(.*\): add user=")
    with pytest.raises(dp.AuthError) as info:
        dp.connect(_as(auth_etcd, "alice", password="bad-pw-123"), rank=0, world_size=1, job="job1", timeout=5)
    assert "bad-pw-123" not in str(info.value) and "password=***" in str(info.value), "the password is masked"


@pytest.mark.timeout(60)
def test_a_user_whose_role_covers_another_prefix_cannot_touch_the_job(auth_etcd):
    _refused_fast(_as(auth_etcd, "bob"), dp.AuthError, f"readwrite on the key prefix /{PREFIX}//job1/")
    _refused_fast(_as(auth_etcd, "alice"), dp.AuthError, f"/{PREFIX}//job2/", job="job2")  # alice: job1 only
    with dp.connect(_as(auth_etcd, "bob", prefix="bobs"), rank=0, world_size=1, job="any", timeout=10) as own:
        own.set("k", b"bob's")  # bob's credentials work, on his own prefix
    with dp.connect(_as(auth_etcd, "alice"), rank=0, world_size=1, job="job1", timeout=10) as alice:
        alice.set("secret", b"alice's")
        # With a raw client too: etcd refuses bob alice's keys, reads and writes.
        assert b"alice's" in [kv.value for kv in alice._run(alice._client.get_prefix(f"/{PREFIX}//job1/".encode()))]
        bob = alice._run(_raw_client(auth_etcd, "bob"))
        for op in (bob.get_prefix(f"/{PREFIX}//job1/".encode()), bob.put(f"/{PREFIX}//job1/x".encode(), b"bob's")):
            with pytest.raises(dp.AuthError, match="do not cover this job's keys"):
                alice._run(op)
        alice._run(bob.close())


async def _raw_client(server: EtcdServer, user: str) -> EtcdClient:
    return EtcdClient("127.0.0.1", server.client_port, username=user, password=USERS[user][0])


# ---------------------------------------------------------------------- check, torchrun
@pytest.mark.timeout(90)
def test_check_names_each_misconfiguration_and_the_fix(tls_etcd, auth_etcd, pki):
    report = check(_tls(tls_etcd, pki), timeout=3, rounds=3)
    assert report.ok, report.render()
    assert "speaks TLS, the URL does not: add ca=CA.pem" in _problem(f"{tls_etcd.url}/{PREFIX}")
    assert "does not verify against ca=" in _problem(_tls(tls_etcd, pki, ca="rogue_ca"))
    assert "refuses a client without a certificate" in _problem(_tls(tls_etcd, pki, cert=None))
    assert "speaks plaintext, the URL asks for TLS: drop ca=" in _problem(with_options(auth_etcd.url, ca=pki["ca"]))
    wrong = _problem(_as(auth_etcd, "alice", password="wrong"))
    assert "wrong user name or password; check user=/password=" in wrong and "wrong token" not in wrong
    denied = _problem(_as(auth_etcd, "bob"))  # check's own job, __dp-check, is outside bob's role
    assert f"grant one of them readwrite on the key prefix /{PREFIX}//__dp-check/" in denied
    cli = subprocess.run(
        [sys.executable, "-m", "dataparallel", "check", _as(auth_etcd, "alice", "bad-pw-123"), "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1 and "PROBLEM: etcd at" in cli.stdout and "wrong user name or password" in cli.stdout
    assert "bad-pw-123" not in cli.stdout, "the password is masked"


@pytest.mark.timeout(60)
def test_torchrun_backend_passes_tls_and_credentials_to_etcd(tls_etcd, auth_etcd, pki, monkeypatch):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousParameters

    from dataparallel.launching.torchrun import create_rdzv_handler

    monkeypatch.setenv("DP_TOKEN", "t")

    def handler(server: EtcdServer, **conf):
        params = RendezvousParameters("dp-etcd", f"127.0.0.1:{server.client_port}", "contract", 1, 2, **conf)
        return create_rdzv_handler("etcd", params)

    for made in (
        handler(tls_etcd, ca=pki["ca"], cert=pki["cert"], key=pki["key"], read_timeout="10"),
        handler(auth_etcd, user="agent", password=USERS["agent"][0], read_timeout="10"),
    ):
        try:
            made.channel.set("k", b"v")
            assert made.channel.get("k", timeout=5) == b"v"
        finally:
            made.channel.close()
    with pytest.raises(RendezvousConnectionError, match="speaks TLS"):
        handler(tls_etcd, read_timeout="30")
    with pytest.raises(RendezvousConnectionError, match="wrong user name or password"):
        handler(auth_etcd, user="agent", password="wrong", read_timeout="30")
