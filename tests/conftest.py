"""Suite-wide rules: under CI (``CI`` set, as ``.ci/run`` does) nothing may be skipped; the
files whose tests judge liveness by the clock are marked ``serial``; plain ``pytest`` runs the
fast tier and ``pytest --full`` the whole suite (``tests/tiers.py``); no test blocks its process
for ever, and a stuck run can be asked for its stacks."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import TextIO

import pytest
from etcdserver import EtcdServer, require_etcd
from tiers import FAST_SERIAL, FULL_ONLY, FULL_ONLY_CLASSES, HEAVY_FIRST

#: Files whose tests kill, freeze or cut off peers and judge what follows with liveness
#: timeouts of a second or two (etcd leases of 2 s among them): ``.ci/run`` runs them one at
#: a time, after the rest has run on three workers, so that no other test's load stretches
#: their clocks.
SERIAL = {
    "test_faults.py",
    "test_elastic.py",
    "test_etcd.py",
    "test_coordinator_death.py",
    "test_recovery.py",
    "test_relay.py",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", help="run the whole suite, not only the fast tier (tests/tiers.py)")
    parser.addoption(
        "--rest",
        action="store_true",
        help="run only the tests the fast tier leaves out (CI runs the fast tier, then these)",
    )


#: How long a test may go on past its pytest-timeout bound before its process is ended.
#: pytest-timeout's alarm fires once, and only where the main thread runs Python: a test still
#: blocked this long after it (a teardown waiting on what the alarm interrupted, a call into C
#: that a signal does not end) has every thread's stack written to the run's stderr, its own
#: thread's innermost frames last, and its process ended, so that the test fails with its
#: stacks instead of holding the run until CI gives up on it (``.ci/run`` then ends the
#: parallel phase: see there). Off where pytest-timeout is (not loaded, a bound of 0, a
#: debugger attached).
HARD_GRACE = 60.0

#: The signal that makes every pytest process of a run write its threads' stacks to the run's
#: stderr and go on: ``.ci/run`` sends it to the run's process group when the run outlasts its
#: bound, before it ends the run.
STACKS_SIGNAL = signal.SIGUSR2

#: The run's own stderr, not the capture a test's output goes to (set in pytest_configure).
_stderr: TextIO | None = None


def _item_timeout(item: pytest.Item) -> float:
    """The item's pytest-timeout bound in seconds (its ``timeout`` marker, else
    ``--timeout``, ``PYTEST_TIMEOUT`` or the ini value, as pytest-timeout reads them); 0 for
    none."""
    if not item.config.pluginmanager.hasplugin("timeout"):
        return 0.0
    import pytest_timeout

    if pytest_timeout.is_debugging():
        return 0.0
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        if value is not None:
            return float(value)
    return float(pytest_timeout.get_env_settings(item.config).timeout or 0)


#: When the running test's process is ended (time.monotonic()), or None between tests.
_deadline: float | None = None

#: How much later faulthandler ends it, should the watchdog thread not get to run (a call
#: into C that holds the GIL).
BACKSTOP = 30.0


def _arm() -> None:
    if _stderr is not None and _deadline is not None:
        left = _deadline + BACKSTOP - time.monotonic()
        faulthandler.dump_traceback_later(max(1.0, left), exit=True, file=_stderr)


def _blocked(nodeid: str, thread: int) -> None:
    """The watchdog: the test is still blocked. Every thread's stack, then the test's own
    thread's innermost frames last (a CI log shows its tail), then the process ends."""
    out = _stderr
    if out is None:
        return
    out.write(f"\n{nodeid}: still blocked {HARD_GRACE:g}s past its timeout; every thread's stack:\n")
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    frame = sys._current_frames().get(thread)
    if frame is not None:
        stack = "".join(traceback.format_stack(frame)[-12:])
        out.write(f"{nodeid}: blocked here (the test's thread, innermost call last):\n{stack}")
    out.flush()
    os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    global _deadline
    bound = _item_timeout(item)
    watchdog = None
    if bound > 0:
        _deadline = time.monotonic() + bound + HARD_GRACE
        watchdog = threading.Timer(bound + HARD_GRACE, _blocked, args=(item.nodeid, threading.get_ident()))
        watchdog.daemon = True
        watchdog.start()
    _arm()
    try:
        yield
    finally:
        _deadline = None
        faulthandler.cancel_dump_traceback_later()
        if watchdog is not None:
            watchdog.cancel()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact() -> None:
    # pytest's faulthandler plugin cancels any pending dump when a test fails (as for a
    # debugger); the failure's teardown is what most needs the bound, so it is armed again.
    _arm()


def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        _stderr = os.fdopen(os.dup(2), "w")
    faulthandler.register(STACKS_SIGNAL, file=_stderr, all_threads=True)
    # pytest-xdist hands files out (--dist loadfile) in the order of their test counts unless
    # told not to: the order collected (HEAVY_FIRST, below) is the one wanted.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _test_name(item: pytest.Item) -> str:
    """``Class::test`` or ``test``, without the parametrisation."""
    return item.nodeid.split("::", 1)[1].split("[", 1)[0]


def _fast(item: pytest.Item) -> bool:
    name, file = _test_name(item), item.path.name
    if file in SERIAL:
        return name in FAST_SERIAL.get(file, set())
    return name not in FULL_ONLY.get(file, set()) and name.split("::")[0] not in FULL_ONLY_CLASSES.get(file, set())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL:
            item.add_marker(pytest.mark.serial)
    collected: dict[str, set[str]] = {}
    for item in items:
        collected.setdefault(item.path.name, set()).add(_test_name(item))
    for file in FULL_ONLY_CLASSES:
        for name in {n.split("::")[0] for n in collected.get(file, set())}:
            collected[file].add(name)
    for table in (FULL_ONLY, FAST_SERIAL, FULL_ONLY_CLASSES):
        for file, names in table.items():
            unknown = names - collected.get(file, names)  # a file not collected this run: nothing to check
            if unknown and not config.getoption("keyword") and not config.getoption("markexpr"):
                raise pytest.UsageError(f"tests/tiers.py names tests {file} does not have: {sorted(unknown)}")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects alike: the same order
        items.sort(key=lambda item: -HEAVY_FIRST.get(item.path.name, 0.0))  # stable: a file's own order kept
    if config.getoption("--full"):
        return
    rest = config.getoption("--rest")  # the complement of the fast tier
    left_out = [item for item in items if _fast(item) == rest]
    if left_out:
        items[:] = [item for item in items if _fast(item) != rest]
        config.hook.pytest_deselected(items=left_out)


def _ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _ci() or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; under CI every test must run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A real etcd on 127.0.0.1 with a data directory of its own, for a module's tests."""
    require_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start().wait_ready()
    yield server
    server.stop()
