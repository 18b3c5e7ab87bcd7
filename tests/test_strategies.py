"""Training strategies other than DDP, with real processes over gloo: local SGD (every rank
steps its own optimizer; the replicas are averaged every ``sync_every`` steps and at every
epoch's end)."""

from __future__ import annotations

import pytest
import torch
from test_loop import assert_same_params, run_job, run_ranks

from dataparallel.testing import free_port


@pytest.mark.timeout(300)
def test_local_sgd_averaging_every_step_trains_as_ddp(tmp_path):
    """Averaging the parameters after every SGD step (momentum kept per rank) is averaging
    the gradients first: SGD is linear in them. The same global batches, the same result."""
    ddp = run_job(tmp_path, "zmq", 3, "ddp", batch=4)
    local = run_job(tmp_path, "zmq", 3, "local", batch=4, strategy="local_sgd", sync_every=1)
    assert_same_params(ddp, local, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_local_sgd_replicas_agree_at_epoch_ends_and_resume_exactly(tmp_path):
    """With syncs every 4 steps the ranks drift apart in between (it is not DDP) and agree,
    bit for bit, at the end of each epoch; a run resumed from its checkpoint ends where the
    straight run does, bit for bit; the loss falls."""
    local = {"strategy": "local_sgd", "sync_every": 4, "batch": 4, "dropout": 0.2}
    straight = run_job(tmp_path, "grpc", 3, "straight", replicas=True, **local)
    replicas = [torch.load(tmp_path / f"straight.pt.rank{r}.pt") for r in range(3)]
    for other in replicas[1:]:
        assert_same_params({"state": replicas[0]}, {"state": other}, rtol=0, atol=0)
    losses = [e["train_loss"] for e in straight["epochs"]]
    assert losses[-1] < losses[0], losses
    ddp = run_job(tmp_path, "grpc", 3, "ddp", batch=4, dropout=0.2)
    with pytest.raises(AssertionError):
        assert_same_params(ddp, straight, rtol=1e-5, atol=1e-6)
    ckpt = str(tmp_path / "local.ckpt")
    run_job(tmp_path, "grpc", 3, "first", epochs=2, checkpoint=ckpt, **local)
    resumed = run_job(tmp_path, "grpc", 3, "resumed", checkpoint=ckpt, resume=True, **local)
    assert_same_params(straight, resumed, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_local_sgd_refuses_uneven_batch_counts_saying_why(tmp_path):
    url = f"zmq://127.0.0.1:{free_port()}"
    runs = run_ranks(url, 2, "uneven", out=str(tmp_path / "x.pt"), strategy="local_sgd", sampler="uneven")
    for code, log in runs:
        assert code != 0
        assert "strategy='local_sgd' needs the same number of batches on every rank" in log, log[-3000:]
