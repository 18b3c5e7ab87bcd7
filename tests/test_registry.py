import sys

import pytest

import dataparallel as dp
from dataparallel.control import registry
from dataparallel.control.registry import parse_url, resolve
from dataparallel.transports.memory import MemoryChannel


@pytest.fixture(autouse=True)
def _registry_as_it_was():
    """Schemes a test registers are gone after it: a later test in the same process (the
    reference pages list every registered transport) never meets them."""
    registry.known_schemes()  # the entry points loaded, so the copy holds them
    with registry._lock:
        saved = dict(registry._registry)
    yield
    with registry._lock:
        registry._registry.clear()
        registry._registry.update(saved)


def test_url_parsing_splits_hosts_ports_path_and_options():
    url = parse_url("etcd://a:2379,b:2380,[::1]:2381/prefix/x?tls=1&user=u")
    assert url.scheme == "etcd"
    assert url.hosts == (("a", 2379), ("b", 2380), ("::1", 2381))
    assert url.path == "/prefix/x"
    assert url.options == {"tls": "1", "user": "u"}
    assert parse_url("memory://name").hosts == (("name", None),)
    assert parse_url("zmq://h:1/").path == ""
    no_host = parse_url("fsdir:///srv/jobs/x?poll=1")
    assert (no_host.hosts, no_host.host, no_host.port, no_host.path) == ((), "", None, "/srv/jobs/x")


@pytest.mark.parametrize(
    "bad, message",
    [
        ("127.0.0.1:29500", "known schemes: .*memory.*tcpstore"),
        ("zmq://host:99999", "bad port"),
        ("zmq://host:abc", "bad port"),
        ("zmq://", r"missing host \(expected zmq://HOST:PORT\)"),
        ("memory://", r"missing host \(expected memory://NAME\)"),
        ("etcd://h:x", r"bad port 'x' .*expected etcd://HOST:PORT\[,HOST:PORT...\]\[/PREFIX\]"),
        ("zmq://h:1?a=1&a=2", "given twice"),
    ],
)
def test_malformed_urls_are_refused_with_a_reason(bad, message):
    with pytest.raises(dp.ConfigError, match=message):
        resolve(bad)


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


def test_registering_a_taken_scheme_is_refused_unless_replace():
    class Other(MemoryChannel):
        scheme = "zmq"

    with pytest.raises(dp.ConfigError, match=r"already registered.*replace=True"):
        dp.register_transport("zmq", Other)
    assert registry.transport_class("zmq").__name__ == "ZmqChannel"
    dp.register_transport("zmq", "dataparallel.transports.zmq:ZmqChannel")  # the same target: harmless

    class First(MemoryChannel):
        pass

    class Second(MemoryChannel):
        pass

    dp.register_transport("twice", First)
    dp.register_transport("twice", First)
    with pytest.raises(dp.ConfigError, match="already registered"):
        dp.register_transport("twice", Second)
    dp.register_transport("twice", Second, replace=True)
    assert registry.transport_class("twice") is Second


def test_install_hints_name_extras_that_exist():
    import re
    from importlib.metadata import metadata

    from dataparallel.control.registry import _INSTALL_HINTS

    extras = set(metadata("dataparallel").get_all("Provides-Extra") or [])
    named = {m for hint in _INSTALL_HINTS.values() for m in re.findall(r"dataparallel\[([^\]]+)\]", hint)}
    assert named, "the hints name no extra at all"
    assert named <= extras, f"hints name extras that do not exist: {sorted(named - extras)}"


def test_dp_launch_stays_the_function_after_every_submodule_is_imported():
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(dp.__path__, "dataparallel."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    assert callable(dp.launch) and dp.launch.__module__ == "dataparallel.launching.launcher"
    assert callable(dp.in_worker) and callable(dp.relaunch)


class _PathChannel(MemoryChannel):
    """A transport whose URL names a path and no host (``path:///DIR``)."""

    URL_FORM = "{scheme}:///ABSOLUTE/DIR"
    URL_HOST = False

    @classmethod
    def _check_options(cls, url, token, serving):
        if not url.path.startswith("/"):
            raise dp.ConfigError(f"{url.shown!r}: expected {cls.url_form(url)}")


def test_a_transport_declares_a_url_without_host_and_gets_the_path_as_given():
    dp.register_transport("pathonly", _PathChannel, replace=True)
    parsed, cls = resolve("pathonly:///srv/shared/job")
    assert cls is _PathChannel and parsed.path == "/srv/shared/job" and parsed.hosts == ()
    with dp.connect("pathonly:///srv/shared/job", rank=0, world_size=1, timeout=5) as ch:
        ch.set("k", b"v")
    with pytest.raises(dp.ConfigError, match=r"names no host, got 'localhost' \(expected pathonly:///ABSOLUTE/DIR\)"):
        resolve("pathonly://localhost/srv")
    with pytest.raises(
        dp.ConfigError, match=r"^url \(from DP_URL\): .*bad port 'x'.*expected pathonly:///ABSOLUTE/DIR"
    ):
        resolve("pathonly://h:x/srv", where="url (from DP_URL)")


@pytest.fixture
def local_modules(tmp_path, monkeypatch):
    """``tmp_path`` first on sys.path (as a script's folder is); the modules imported from it
    are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_a_folder_shadowing_the_plugin_is_named_in_the_error(local_modules):
    (local_modules / "dp_fake_ns").mkdir()  # no __init__.py: imports as a namespace package
    (local_modules / "dp_fake_ns" / "notes.txt").write_text("not the plugin")
    dp.register_transport("fakens", "dp_fake_ns:Channel")
    with pytest.raises(dp.ConfigError) as info:
        dp.connect("fakens://h:1", rank=0, world_size=1)
    message = str(info.value)
    assert "has no attribute 'Channel'" in message
    assert "no __init__.py" in message and str(local_modules / "dp_fake_ns") in message, message


def test_a_file_shadowing_the_plugin_is_named_in_the_error(local_modules):
    (local_modules / "dp_fake_file.py").write_text("# a local script, not the plugin\n")
    dp.register_transport("fakefile", "dp_fake_file:Channel")
    with pytest.raises(dp.ConfigError, match="has no attribute 'Channel'") as info:
        dp.connect("fakefile://h:1", rank=0, world_size=1)
    assert str(local_modules / "dp_fake_file.py") in str(info.value)


def test_a_plugin_module_that_fails_to_import_is_named_with_its_error(local_modules):
    (local_modules / "dp_fake_broken.py").write_text("raise RuntimeError('half-written plugin')\n")
    (local_modules / "dp_fake_pkg").mkdir()
    (local_modules / "dp_fake_pkg" / "__init__.py").write_text("")
    dp.register_transport("fakebroken", "dp_fake_broken:Channel")
    dp.register_transport("fakepkg", "dp_fake_pkg.transport:Channel")
    with pytest.raises(dp.ConfigError, match="RuntimeError: half-written plugin") as info:
        dp.connect("fakebroken://h:1", rank=0, world_size=1)
    assert str(local_modules / "dp_fake_broken.py") in str(info.value)
    # A package that has no such submodule: where the package came from is named.
    with pytest.raises(dp.ConfigError, match=r"'dp_fake_pkg\.transport', which is not installed") as info:
        dp.connect("fakepkg://h:1", rank=0, world_size=1)
    assert str(local_modules / "dp_fake_pkg" / "__init__.py") in str(info.value)
