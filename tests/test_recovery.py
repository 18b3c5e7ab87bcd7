"""Recovery: a follower dies mid-job; `dataparallel launch --max-restarts 1` restarts the
group, which resumes from the last checkpoint, and the final model equals the model of a run
that was never interrupted (bit for bit: dropout, shuffling and optimizer state included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dataparallel.testing import free_port

WORKER = r"""
import os, signal, sys
import torch
import dataparallel as dp

checkpoint, out, crash = sys.argv[1], sys.argv[2], sys.argv[3] == "crash"
ch = dp.connect(timeout=60)  # from the launcher: rank, world size, job (a new one per attempt)
g = torch.Generator().manual_seed(3)
x = torch.randn(128, 8, generator=g)
y = x @ torch.randn(8, 1, generator=g)

def batches(epoch, rank, world):
    order = torch.randperm(128, generator=torch.Generator().manual_seed(epoch))
    mine = order[rank::world]
    for i in range(0, len(mine), 8):
        if crash and rank == 1 and epoch == 2 and i == 16 and "DP_RESTART_COUNT" not in os.environ:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch, first attempt only
        yield x[mine[i : i + 8]], y[mine[i : i + 8]]

torch.manual_seed(7)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
dp.fit(
    ch, net, torch.nn.functional.mse_loss, lambda p: torch.optim.Adam(p, lr=1e-2), batches, None,
    options=dp.TrainOptions(epochs=4, checkpoint=checkpoint, resume=True, progress=False, collective_timeout=60),
)
if ch.rank == 0:
    torch.save(net.state_dict(), out)
ch.close()
"""


def _launch(tmp_path: Path, tag: str, *extra: str) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    env["DP_URL"] = f"zmq://127.0.0.1:{free_port()}?heartbeat=0.2&liveness_timeout=2"
    argv = [sys.executable, "-m", "dataparallel", "launch", "--nprocs", "2", "--job", tag, *extra[:-1]]
    argv += [str(script), str(tmp_path / f"{tag}.ckpt"), str(tmp_path / f"{tag}.pt"), extra[-1]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.timeout(300)
def test_restarted_group_resumes_and_ends_with_the_uninterrupted_model(tmp_path):
    clean = _launch(tmp_path, "clean", "no-crash")
    assert clean.returncode == 0, clean.stderr[-3000:]
    crashed = _launch(tmp_path, "crashed", "--max-restarts", "1", "crash")
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "rank 1 exited with signal SIGKILL" in crashed.stderr
    assert "restarting it, attempt 1 of 1" in crashed.stderr
    assert "resuming from" in crashed.stderr and "after epoch 1" in crashed.stderr
    a = torch.load(tmp_path / "clean.pt")
    b = torch.load(tmp_path / "crashed.pt")
    for name in a:
        assert torch.equal(a[name], b[name]), f"parameter {name} differs after recovery"


@pytest.mark.timeout(120)
def test_without_restarts_the_failure_is_the_exit_code(tmp_path):
    crashed = _launch(tmp_path, "once", "crash")
    assert crashed.returncode == 128 + 9, crashed.stderr[-3000:]
    assert "restarting" not in crashed.stderr
