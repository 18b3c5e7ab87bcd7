"""README's main job and the demo run end to end as a new user would run them."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.timeout(300)
def test_digits_training_job_learns(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            EXAMPLES / "train_digits.py",
            "--nprocs",
            "2",
            "--epochs",
            "4",
            "--checkpoint",
            tmp_path / "digits.ckpt",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    accuracy = float(re.search(r"final validation accuracy ([0-9.]+)", run.stdout).group(1))
    assert accuracy > 0.8, run.stdout
    assert (tmp_path / "digits.ckpt").exists()


@pytest.mark.timeout(120)
def test_allreduce_demo_runs():
    run = subprocess.run(
        [sys.executable, EXAMPLES / "allreduce_demo.py", "--nprocs", "3"], capture_output=True, text=True, timeout=110
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "= [0.0, 6.0, 12.0, 18.0]" in run.stdout
