import pytest

import dataparallel as dp
from dataparallel.registry import parse_url
from dataparallel.transports.memory import MemoryChannel


def test_url_parsing_splits_hosts_ports_path_and_options():
    url = parse_url("etcd://a:2379,b:2380,[::1]:2381/prefix/x?tls=1&user=u")
    assert url.scheme == "etcd"
    assert url.hosts == (("a", 2379), ("b", 2380), ("::1", 2381))
    assert url.path == "prefix/x"
    assert url.options == {"tls": "1", "user": "u"}
    assert parse_url("memory://name").hosts == (("name", None),)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("127.0.0.1:29500", "known schemes: .*memory.*tcpstore"),
        ("zmq://host:99999", "bad port"),
        ("zmq://host:abc", "bad port"),
        ("zmq://", "missing host"),
        ("zmq://h:1?a=1&a=2", "given twice"),
    ],
)
def test_malformed_urls_are_refused_with_a_reason(bad, message):
    with pytest.raises(dp.ConfigError, match=message):
        parse_url(bad)


def test_unknown_scheme_lists_the_known_ones():
    with pytest.raises(dp.ConfigError, match=r"unknown transport scheme 'nope'; known schemes: .*memory.*tcpstore"):
        dp.connect("nope://h:1", rank=0, world_size=1)


def test_tcpstore_without_port_is_refused():
    with pytest.raises(dp.ConfigError, match="port is required"):
        dp.connect("tcpstore://127.0.0.1", rank=0, world_size=1, timeout=5)


def test_missing_transport_library_gives_an_install_hint():
    dp.register_transport("ghost", "dp_no_such_module:Channel")
    with pytest.raises(dp.ConfigError, match="not installed"):
        dp.connect("ghost://h:1", rank=0, world_size=1)


def test_register_transport_class_at_run_time():
    class Renamed(MemoryChannel):
        scheme = "renamed"

    dp.register_transport("renamed", Renamed)
    assert "renamed" in dp.known_schemes()
    with dp.connect("renamed://x", rank=0, world_size=1, timeout=5) as ch:
        assert isinstance(ch, Renamed)
        ch.set("k", b"v")
        assert ch.get("k", timeout=1) == b"v"
