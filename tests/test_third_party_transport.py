"""A transport from another distribution, found through its entry point, passes the suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_transport"


@pytest.mark.timeout(600)
def test_entry_point_transport_passes_the_conformance_suite(tmp_path):
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", site, EXAMPLE],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (site / "dp_fsdir-0.1.0.dist-info" / "entry_points.txt").exists()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run(
        [sys.executable, "-c", "import dataparallel as dp; print(dp.known_schemes())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "'fsdir'" in probe.stdout, "the entry point did not register the scheme"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            tmp_path,
            EXAMPLE / "test_fsdir_conformance.py",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout and "skipped" not in run.stdout
