"""Configuration: TOML file, DP_* environment, flags, torchrun's variables; precedence and
a clear message for every bad value."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import dataparallel as dp
from dataparallel.config import load_config


def _file(tmp_path, text: str):
    path = tmp_path / "dataparallel.toml"
    path.write_text(text)
    return path


def test_precedence_flags_over_env_over_file(tmp_path):
    path = _file(
        tmp_path,
        'transport = "zmq"\nhost = "10.0.0.1"\nport = 29500\njob = "file-job"\nworld_size = 4\ntimeout = 30\n'
        "[options]\ncurve = 1\n",
    )
    only_file = load_config(env={}, file=path)
    assert only_file.url == "zmq://10.0.0.1:29500?curve=1"
    assert (only_file.job, only_file.world_size, only_file.timeout) == ("file-job", 4, 30.0)
    env = {"DP_HOST": "10.0.0.2", "DP_JOB": "env-job", "DP_WORLD_SIZE": "6"}
    with_env = load_config(env=env, file=path)
    assert with_env.url == "zmq://10.0.0.2:29500?curve=1" and with_env.job == "env-job" and with_env.world_size == 6
    with_flags = load_config({"host": "10.0.0.3", "world_size": 8, "options": ["curve=0"]}, env=env, file=path)
    assert with_flags.url == "zmq://10.0.0.3:29500?curve=0"
    assert with_flags.world_size == 8 and with_flags.job == "env-job"
    assert with_flags.origin["world_size"] == "--world-size" and with_flags.origin["job"] == "DP_JOB"
    # A whole URL beats the pieces; its own query wins over separate options.
    url = load_config({"url": "grpc://h:1?tls=1"}, env={"DP_OPTIONS": "tls=0&ca=x.pem"}, file=path)
    assert url.url == "grpc://h:1?curve=1&tls=1&ca=x.pem"


def test_file_found_by_env_and_in_the_working_directory(tmp_path, monkeypatch):
    path = _file(tmp_path, 'url = "tcpstore://127.0.0.1:29999"\nworld_size = 2\n')
    assert load_config(env={"DP_CONFIG": str(path)}).url == "tcpstore://127.0.0.1:29999"
    monkeypatch.chdir(tmp_path)
    assert load_config(env={}).world_size == 2
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert load_config(env={}).url is None


def _secret(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def test_token_from_env_or_file_relative_to_the_config(tmp_path):
    _secret(tmp_path / "secret", "s3cret\n")
    path = _file(tmp_path, 'url = "zmq://h:1"\ntoken_file = "secret"\n')
    assert load_config(env={}, file=path).token == "s3cret"
    assert load_config(env={"DP_TOKEN": "other"}, file=path).token == "other"
    assert "s3cret" not in repr(load_config(env={}, file=path))


def test_token_file_flag_beats_dp_token(tmp_path):
    # Flags > environment > file, for the token as for everything else.
    _secret(tmp_path / "flagged", "from-flag\n")
    _secret(tmp_path / "secret", "from-file\n")
    path = _file(tmp_path, 'url = "zmq://h:1"\ntoken_file = "secret"\n')
    config = load_config({"token_file": str(tmp_path / "flagged")}, env={"DP_TOKEN": "from-env"}, file=path)
    assert (config.token, config.origin["token"]) == ("from-flag", "--token-file")
    assert load_config(env={"DP_TOKEN": "from-env"}, file=path).token == "from-env"


def test_a_token_file_others_can_read_is_refused(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    for mode in (0o644, 0o640, 0o604):
        token.chmod(mode)
        with pytest.raises(dp.ConfigError, match=f"chmod 600 {token}"):
            load_config({"token_file": str(token)}, env={})
    token.chmod(0o400)
    assert load_config({"token_file": str(token)}, env={}).token == "s3cret"


def test_torchrun_environment(tmp_path):
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"}
    plain = load_config(env=torchrun)
    assert (plain.rank, plain.world_size, plain.local_rank) == (3, 4, 1)
    assert plain.url == "tcpstore://10.1.1.1:29400"  # torchrun's own store
    zmq = load_config({"transport": "zmq"}, env=torchrun)
    assert zmq.url == "zmq://10.1.1.1:29401"  # MASTER_PORT is torchrun's store
    assert load_config(env={**torchrun, "DP_RANK": "0"}).rank == 0  # DP_* above torchrun's
    restarted = load_config(env={**torchrun, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert restarted.job == "default.restart2"  # a restarted group never meets the dead one's keys
    # Our torchrun rendezvous handlers publish the round: the same on every node.
    round5 = load_config(env={**torchrun, "TORCHELASTIC_RESTART_COUNT": "2", "DP_RDZV_ROUND": "5"})
    assert round5.job == "default.round5"


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"transport": "nosuch", "host": "h", "port": 1}, {}, "unknown transport scheme 'nosuch'; known schemes:"),
        ({"url": "zmq://h:70000"}, {}, "bad port '70000'"),
        ({"transport": "zmq", "host": "h", "port": 0}, {}, "port must be 1..65535, got 0"),
        ({"transport": "zmq", "host": "h", "port": "x"}, {}, "port (from --port) must be an integer, got 'x'"),
        ({}, {"DP_WORLD_SIZE": "0"}, "world_size (from DP_WORLD_SIZE) must be >= 1, got 0"),
        ({}, {"DP_WORLD_SIZE": "two"}, "world_size (from DP_WORLD_SIZE) must be an integer, got 'two'"),
        ({"world_size": 2, "rank": 2}, {}, "rank (from --rank) = 2 is out of range (0..1)"),
        ({"rank": -1}, {}, "rank (from --rank) = -1 is out of range"),
        ({"nodes": 2, "node_rank": 2}, {}, "node_rank (from --node-rank) = 2 is out of range 0..1"),
        ({"timeout": -1}, {}, "timeout (from --timeout) must be > 0 seconds"),
        ({"transport": "zmq"}, {}, "transport 'zmq' (from --transport) needs host and port as well"),
        ({"config": "/nonexistent/dp.toml"}, {}, "cannot read the configuration file '/nonexistent/dp.toml'"),
        ({"token_file": "/nonexistent/token"}, {}, "cannot read --token-file = '/nonexistent/token'"),
        ({"job": "a/b"}, {}, "job (from --job) must be a non-empty name without '/'"),
        ({}, {"DP_LOG_FORMAT": "yaml"}, "log_format (from DP_LOG_FORMAT) must be one of text, json, got 'yaml'"),
        ({"world_size": "8:2"}, {}, "min_world_size (from --world-size) = 8 is above max_world_size"),
        ({"world_size": "2:x"}, {}, "max_world_size (from --world-size) must be an integer, got 'x'"),
        ({}, {"DP_MIN_WORLD_SIZE": "0"}, "min_world_size (from DP_MIN_WORLD_SIZE) must be >= 1, got 0"),
    ],
)
def test_bad_values_are_named_with_their_source(flags, env, message):
    with pytest.raises(dp.ConfigError) as err:
        load_config(flags, env=env)
    assert message in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(dp.ConfigError, match="is not valid TOML"):
        load_config(env={}, file=_file(tmp_path, "world_size = = 2"))
    with pytest.raises(dp.ConfigError, match=r"unknown key in .*: wrold_size; known settings: url, transport"):
        load_config(env={}, file=_file(tmp_path, "wrold_size = 2"))
    with pytest.raises(dp.ConfigError, match=r"world_size \(from file .*: world_size\) must be an integer"):
        load_config(env={}, file=_file(tmp_path, 'world_size = "many"'))


def test_rank_0_never_hosts_the_store_torchruns_agent_serves(monkeypatch):
    """Under torchrun with TORCHELASTIC_USE_AGENT_STORE, MASTER_ADDR:MASTER_PORT is the agent's
    own store: the configuration says so, and rank 0 joins it as a client (it hosts nothing)."""
    from datetime import timedelta

    import torch.distributed as dist

    from dataparallel.testing.conformance import free_port

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "agent-test",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    assert load_config(env=env).agent_store
    assert not load_config(env={**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}).agent_store
    assert not load_config({"transport": "zmq"}, env=env).agent_store  # a channel of its own at MASTER_PORT + 1
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir("/")
    with dp.connect(timeout=10) as ch:
        assert ch.url.raw == f"tcpstore://127.0.0.1:{port}" and ch.rank == 0
        assert not ch.may_host
        ch.set("k", b"v")
        assert ch.get("k") == b"v"
    del agent


def test_connect_with_no_arguments_reads_the_configuration(monkeypatch):
    monkeypatch.setenv("DP_URL", "memory://config-test")
    monkeypatch.setenv("DP_WORLD_SIZE", "1")
    monkeypatch.setenv("DP_RANK", "0")
    monkeypatch.setenv("DP_JOB", "from-env")
    with dp.connect() as ch:
        assert (ch.rank, ch.world_size, ch.job, ch.url.raw) == (0, 1, "from-env", "memory://config-test")
    monkeypatch.delenv("DP_URL")
    monkeypatch.chdir("/")
    with pytest.raises(dp.ConfigError, match="no transport configured: set url"):
        dp.connect()


def test_a_malformed_url_from_the_configuration_names_where_it_came_from(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DP_WORLD_SIZE", "1")
    monkeypatch.setenv("DP_URL", "zmq://")
    with pytest.raises(
        dp.ConfigError, match=r"^url \(from DP_URL\): 'zmq://': missing host \(expected zmq://HOST:PORT\)"
    ):
        dp.connect()
    monkeypatch.delenv("DP_URL")
    (tmp_path / "dataparallel.toml").write_text('url = "memory://a:x"\n')
    with pytest.raises(dp.ConfigError, match=r"^url \(from file .*dataparallel.toml.*bad port 'x'.*memory://NAME"):
        dp.connect()


def test_hosts_and_host_files(tmp_path):
    config = load_config({"hosts": "node1:2,root@node2:4,node3"}, env={})
    assert config.hosts == (("node1", 2), ("root@node2", 4), ("node3", None))
    assert config.nodes == 3 and config.url == "zmq://node1:29500"  # the first host hosts the coordinator
    assert config.origin["url"] == "default (under ssh), the first of the hosts, default (under ssh)"
    listed = load_config({"hosts": "[fd00::1]:2,[fd00::2]"}, env={})
    assert listed.hosts == (("[fd00::1]", 2), ("[fd00::2]", None)) and listed.url == "zmq://[fd00::1]:29500"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the job\nworker-1 slots=4\n\nworker-2 slots=4   # the second\nworker-3:2\n")
    config = load_config({}, env={"DP_HOSTFILE": str(hostfile), "DP_TRANSPORT": "grpc", "DP_PORT": "29600"})
    assert config.hosts == (("worker-1", 4), ("worker-2", 4), ("worker-3", 2))
    assert config.url == "grpc://worker-1:29600"
    explicit = load_config({"hosts": "a:1,b:1", "url": "etcd://etcd1:2379"}, env={})
    assert explicit.url == "etcd://etcd1:2379"  # the configuration's coordinator wins
    file = tmp_path / "dataparallel.toml"
    file.write_text('hosts = ["a:2", "b:2"]\n')
    assert load_config({"config": file}, env={}).hosts == (("a", 2), ("b", 2))


@pytest.mark.parametrize(
    ("flags", "text", "message"),
    [
        ({"hosts": "a:1", "nodes": 2}, None, "nodes (from --nodes) and the hosts (from --hosts) both place nodes"),
        ({"hosts": "a:0"}, None, "'a:0' (from --hosts): slots must be >= 1, got 0"),
        ({"hosts": "a;rm -rf /"}, None, "is not a host name"),
        ({"hosts": "-oProxyCommand=x"}, None, "is not a host name"),
        ({"hosts": " , "}, None, "hosts (from --hosts) names no host"),
        ({"hosts": "a", "hostfile": "HOSTFILE"}, "", "both --hosts and --hostfile name the job's hosts"),
        ({"hostfile": "HOSTFILE"}, "a slots=x\n", "hosts:1: slots must be a whole number, got 'x'"),
        ({"hostfile": "HOSTFILE"}, "a b\n", "hosts:1: expected 'HOST slots=N', got 'a b'"),
        ({"hostfile": "HOSTFILE"}, "# nobody\n", "names no host"),
        ({"hostfile": "MISSING"}, None, "cannot read the host file"),
    ],
)
def test_bad_hosts_are_named(tmp_path, flags, text, message):
    path = tmp_path / "hosts"
    if text is not None:
        path.write_text(text)
    flags = {
        k: str(path) if v == "HOSTFILE" else str(tmp_path / "missing") if v == "MISSING" else v
        for k, v in flags.items()
    }
    with pytest.raises(dp.ConfigError, match=re.escape(message)):
        load_config(flags, env={})


def test_the_kubernetes_manifest_gives_each_pod_its_place():
    """examples/kubernetes/digits-etcd.yaml as the Kubeflow operator runs it: each pod gets
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and the manifest's environment must then
    give rank and world size, the etcd Service of the same manifest, the job and the token."""
    import yaml

    from dataparallel.config import describe_launch

    root = Path(__file__).resolve().parents[1]
    docs = list(yaml.safe_load_all((root / "examples" / "kubernetes" / "digits-etcd.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    service = next(d for d in docs if d["kind"] == "Service")
    specs = job["spec"]["pytorchReplicaSpecs"]
    world = sum(spec["replicas"] for spec in specs.values())
    rank = 0
    for role in ("Master", "Worker"):  # the operator's order: the master is rank 0
        for _ in range(specs[role]["replicas"]):
            (container,) = specs[role]["template"]["spec"]["containers"]
            assert container["name"] == "pytorch"  # the operator's container name
            assert (root / container["command"][1]).is_file()
            env = {e["name"]: e.get("value", "from-the-secret") for e in container["env"]}
            env |= {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "digits-master-0",
                "MASTER_PORT": "23456",
            }
            config = load_config({"config": os.devnull}, env=env)
            assert (config.rank, config.world_size, config.job) == (rank, world, "digits")
            assert config.url == f"etcd://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
            assert config.token == "from-the-secret"
            assert describe_launch(config, env).startswith("RANK and WORLD_SIZE (env://, as a Kubernetes PyTorchJob")
            rank += 1
    assert rank == 3


def test_a_rank_ignores_the_hosts_its_launcher_used(tmp_path):
    """A worker started by launch --hosts reads the same dataparallel.toml (hosts = [...]) and
    inherits DP_HOSTS: its place is its launcher's (DP_RANK, DP_NODES...), not the hosts'."""
    file = tmp_path / "dataparallel.toml"
    file.write_text('hosts = ["a:2", "b:2"]\n')
    worker = {"DP_RANK": "3", "DP_WORLD_SIZE": "4", "DP_NODES": "2", "DP_NODE_RANK": "1", "DP_URL": "zmq://a:29500"}
    config = load_config({"config": file}, env={**worker, "DP_HOSTS": "a:2,b:2"})
    assert (config.rank, config.world_size, config.nodes, config.hosts) == (3, 4, 2, ())


def test_a_host_file_named_in_a_file_is_relative_to_it_and_hosts_are_named_once(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "hosts").write_text("n1 slots=2\nn2 slots=2\n")
    (tmp_path / "conf" / "dataparallel.toml").write_text('hostfile = "hosts"\n')
    assert load_config({"config": tmp_path / "conf" / "dataparallel.toml"}, env={}).slots == [2, 2]
    with pytest.raises(dp.ConfigError, match=re.escape("n1 is named twice in the hosts ('n1' and 'root@n1')")):
        load_config({"hosts": "n1:2,root@n1:2"}, env={})


def test_a_world_size_range_sets_the_elastic_bounds_and_leaves_the_start_to_the_launch(tmp_path, monkeypatch):
    """``world_size = "2:8"`` in the file: min_world_size 2, max_world_size 8, no starting
    size (the launcher's nodes x nprocs, or DP_WORLD_SIZE, gives it); training takes the
    bounds from the configuration (``channel.config``, from the variables ``dataparallel
    launch`` sets) where its options leave them None, never from the environment itself."""
    from dataparallel.train.spec import resolve_settings

    path = _file(tmp_path, 'world_size = "2:8"\n')
    ranged = load_config(env={}, file=path)
    assert (ranged.world_size, ranged.min_world_size, ranged.max_world_size) == (None, 2, 8)
    assert ranged.origin["max_world_size"] == f"file {path}: world_size"
    started = load_config(env={"DP_WORLD_SIZE": "3", "DP_MAX_WORLD_SIZE": "5"}, file=path)
    assert (started.world_size, started.min_world_size, started.max_world_size) == (3, 2, 5)
    monkeypatch.setenv("DP_MIN_WORLD_SIZE", "2")
    monkeypatch.setenv("DP_MAX_WORLD_SIZE", "8")
    options = dp.TrainOptions(elastic=True)
    assert (options.min_world_size, options.max_world_size) == (None, None)  # the options' own: not given
    settings = resolve_settings(options, load_config())
    assert (settings.elastic, settings.min_world_size, settings.max_world_size) == (True, 2, 8)
    given = resolve_settings(dp.TrainOptions(min_world_size=3, max_world_size=4), load_config())
    assert (given.elastic, given.min_world_size, given.max_world_size) == (False, 3, 4)
    assert resolve_settings(options, None) == type(settings)(elastic=True)  # no configuration: the defaults
    with pytest.raises(ValueError, match=r"max_world_size \(1\) must be >= min_world_size \(2\)"):
        resolve_settings(dp.TrainOptions(max_world_size=1), load_config())
