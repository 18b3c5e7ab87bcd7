"""Transports from other distributions, found through their entry points, pass the suite."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("scheme", "folder", "form"),
    [
        ("fsdir", "custom_transport", "fsdir:///ABSOLUTE/DIR"),
        ("sqlite", "sqlite_transport", "sqlite:///ABSOLUTE/PATH.db"),
    ],
)
def test_entry_point_transport_passes_the_conformance_suite(scheme, folder, form, tmp_path):
    """Installed with pip, found through its entry point (here and in the suite's worker
    processes), refusing a URL that names a host with its own URL form, passing the suite."""
    example = EXAMPLES / folder
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", site, example],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (site / f"dp_{scheme}-0.1.0.dist-info" / "entry_points.txt").exists()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, dataparallel as dp\n"
            "print(dp.known_schemes())\n"
            "try:\n"
            "    dp.connect(sys.argv[1], rank=0, world_size=1, timeout=5)\n"
            "except dp.ConfigError as err:\n"
            "    print('refused:', err)\n",
            f"{scheme}://host/x.db",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert f"'{scheme}'" in probe.stdout, "the entry point did not register the scheme"
    assert "refused:" in probe.stdout and form in probe.stdout, probe.stdout
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
            example / f"test_{scheme}_conformance.py",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout and "skipped" not in run.stdout
