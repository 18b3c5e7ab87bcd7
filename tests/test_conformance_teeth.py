"""The conformance suite's concurrency tests catch a transport that is atomic only within a
process: its ``add`` and ``compare_set`` fail in seconds, each naming the broken primitive,
while the example ``fsdir://`` transport (atomic across processes: each write ``link``s a key's
next version, which fails where another process took it) passes.

The broken transport is ``tests/brokenfs.py``. The transports are found the way a third
party's are: through entry points, here those of a ``.dist-info`` folder written to a
temporary site directory that the run's ``PYTHONPATH`` names (the suite's worker processes
see it too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "custom_transport"
#: How long the broken transport's concurrency tests may take to fail, each.
FAIL_WITHIN = 30.0

SUITE = """
import pytest

from dataparallel.testing import PrimitiveTests


class TestBroken(PrimitiveTests):
    @pytest.fixture
    def channel_url(self, tmp_path):
        return f"brokenfs://{tmp_path}/shared"


class TestBrokenOnThreads(TestBroken):
    cross_process = False


class TestFsDir(PrimitiveTests):
    @pytest.fixture
    def channel_url(self, tmp_path):
        return f"fsdir://{tmp_path}/shared"
"""

ENTRY_POINTS = """[dataparallel.transports]
brokenfs = brokenfs:ThreadLockedFsDirChannel
fsdir = dp_fsdir:FsDirChannel
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    """Run the two concurrency tests against both transports in a pytest of their own; each
    test's outcome, failure message and duration, by ``Class::test``."""
    root = tmp_path_factory.mktemp("teeth")
    site = root / "site"
    dist_info = site / "dp_teeth_transports-0.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: dp-teeth-transports\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    (root / "test_teeth_suite.py").write_text(SUITE)
    path = [str(site), str(HERE), str(EXAMPLE), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    report = root / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(root)]
    cmd += ["-k", "concurrent_adds or concurrent_compare_set", f"--junitxml={report}", "test_teeth_suite.py"]
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=240)
    if not report.exists():
        pytest.fail(f"the suite did not run (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
    found = {}
    for case in ET.parse(report).iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        found[f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"] = {
            "outcome": "passed" if problem is None else {"failure": "failed"}.get(problem.tag, problem.tag),
            "message": "" if problem is None else problem.get("message", ""),
            "seconds": float(case.get("time")),
            "output": run.stdout[-3000:],
        }
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "test, names",
    [
        ("test_concurrent_adds_give_an_exact_count", "add is not atomic across processes"),
        ("test_concurrent_compare_set_has_one_winner", "compare_set let "),
    ],
)
def test_a_transport_atomic_only_within_a_process_fails_fast_naming_the_primitive(outcomes, test, names):
    result = outcomes[f"TestBroken::{test}"]
    assert result["outcome"] == "failed", result
    assert names in result["message"], result["message"]
    assert result["seconds"] < FAIL_WITHIN, f"failed only after {result['seconds']:.1f}s"


@pytest.mark.timeout(300)
def test_compare_set_failure_counts_the_winners(outcomes):
    message = outcomes["TestBroken::test_concurrent_compare_set_has_one_winner"]["message"]
    assert "contenders win a race across processes" in message, message


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "test", ["test_concurrent_adds_give_an_exact_count", "test_concurrent_compare_set_has_one_winner"]
)
def test_the_same_transport_passes_with_threads_of_one_process(outcomes, test):
    """The control: within a process the broken transport is atomic, so what fails above is
    the contention between processes and nothing else."""
    result = outcomes[f"TestBrokenOnThreads::{test}"]
    assert result["outcome"] == "passed", result


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "test", ["test_concurrent_adds_give_an_exact_count", "test_concurrent_compare_set_has_one_winner"]
)
def test_the_example_transport_passes(outcomes, test):
    result = outcomes[f"TestFsDir::{test}"]
    assert result["outcome"] == "passed", result
