"""Suite-wide rules: under CI (``CI`` set, as ``.ci/run`` does) nothing may be skipped."""

from __future__ import annotations

import os

import pytest


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
