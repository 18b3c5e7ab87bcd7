"""Training strategies other than DDP, with real processes over gloo: local SGD (every rank
steps its own optimizer; the replicas are averaged every ``sync_every`` steps and at every
epoch's end) and asynchronous parameter servers (``async_ps``: workers push gradients to
server ranks and read the parameters back, never waiting for each other beyond the
staleness bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


# ---------------------------------------------------------------------- async_ps
ASYNC = {"strategy": "async_ps", "batch": 4, "lr": 0.01}


@pytest.mark.timeout(300)
def test_async_ps_with_one_worker_is_sequential_sgd_bit_for_bit(tmp_path):
    """One worker and its servers (one, then two holding the parameters sharded): every
    update is applied before the next read, so the run is one process's SGD on the same
    batches, bit for bit, whatever the sharding; its checkpoints resume exactly."""
    single = run_job(tmp_path, "zmq", 1, "single", batch=4, lr=0.01)
    one_server = run_job(tmp_path, "tcpstore", 2, "ps1", **ASYNC)
    two_servers = run_job(tmp_path, "grpc", 3, "ps2", ps_ranks=2, **ASYNC)
    for run in (one_server, two_servers):
        assert_same_params(single, run, rtol=0, atol=0)
        assert [e["train_samples"] for e in run["epochs"]] == [96] * 3
        assert [e["train_batches_per_rank"][-1] for e in run["epochs"]] == [0] * 3  # the servers train nothing
        assert all(e["staleness"] == 0 for e in run["epochs"])
    ckpt = str(tmp_path / "ps.ckpt")
    run_job(tmp_path, "zmq", 2, "first", epochs=2, checkpoint=ckpt, **ASYNC)
    resumed = run_job(tmp_path, "zmq", 2, "resumed", checkpoint=ckpt, resume=True, **ASYNC)
    assert_same_params(single, resumed, rtol=0, atol=0)
    # A checkpoint of one strategy resumes under the other: they write the same state.
    ddp_ckpt = str(tmp_path / "ddp.ckpt")
    run_job(tmp_path, "zmq", 1, "ddp_first", epochs=2, checkpoint=ddp_ckpt, batch=4, lr=0.01)
    crossed = run_job(tmp_path, "zmq", 2, "crossed", checkpoint=ddp_ckpt, resume=True, **ASYNC)
    assert_same_params(single, crossed, rtol=0, atol=0)
    back = run_job(tmp_path, "zmq", 1, "back", checkpoint=ckpt, resume=True, batch=4, lr=0.01)
    assert_same_params(single, back, rtol=0, atol=0)
    # Batch normalisation (its statistics and batch count go from the worker to every rank),
    # accumulation (two batches a push), clipping on the worker, a scheduler stepped by the
    # servers at every update: still one process's run.
    more = {"norm": True, "accum": 2, "clip": 0.5, "scheduler_interval": "step"}
    single = run_job(tmp_path, "zmq", 1, "single_more", batch=4, lr=0.01, **more)
    sharded = run_job(tmp_path, "zmq", 3, "ps2_more", ps_ranks=2, **ASYNC, **more)
    assert_same_params(single, sharded, rtol=0, atol=0)
    assert sharded["epochs"][-1]["train_batches_per_rank"] == [24, 0, 0]


@pytest.mark.timeout(300)
def test_async_ps_stopped_mid_epoch_trains_each_batch_once_on_any_number_of_workers(tmp_path):
    """SIGTERM to a worker mid-epoch: the first server hands out no more batches, the job
    checkpoints where it stopped. Resumed with one worker (sequential again) it ends bit
    for bit where the run that never stopped does; resumed with two, the stopped epoch's
    samples add up to the dataset's (each batch trained once, by whichever worker)."""
    single = run_job(tmp_path, "zmq", 1, "single", batch=4, lr=0.01)
    ckpt = str(tmp_path / "stop.ckpt")
    url = f"zmq://127.0.0.1:{free_port()}"
    runs = run_ranks(url, 2, "stop", out=str(tmp_path / "x.pt"), checkpoint=ckpt, term_step=[0, 30], **ASYNC)
    assert [code for code, _ in runs] == [143, 143], [log[-2000:] for _, log in runs]
    saved = torch.load(ckpt, weights_only=False)
    # Epoch 1 (24 batches each): the signal came after update 30, whose answer had handed out
    # batch 7 of the epoch; that one is trained, and its push tells the server to stop.
    assert saved["partial"]["layout"] == ["handed", 4] and saved["partial"]["batches"] == 7
    resumed = run_job(tmp_path, "zmq", 2, "resumed", checkpoint=ckpt, resume=True, **ASYNC)
    assert_same_params(single, resumed, rtol=0, atol=0)
    wider = run_job(tmp_path, "zmq", 3, "wider", checkpoint=ckpt, resume=True, **ASYNC)
    assert [e["train_samples"] for e in wider["epochs"]] == [96] * 3
    assert sum(wider["epochs"][1]["train_batches_per_rank"]) == 24


@pytest.mark.timeout(300)
def test_async_ps_a_slowed_worker_is_waited_for_only_at_the_staleness_bound(tmp_path):
    """Three workers, the third much slower (sleeps in its steps), one server. With a bound
    that those speeds stay under, no read is held back: the fast workers never wait and
    train more of each epoch than the slow one. With a bound of 2, the server holds reads back and the
    staleness of every update stays within it (reached, never passed)."""
    slowed = {"step_sleep": [0.01, 0.01, 0.08, 0], "epochs": 2, **ASYNC}
    free = run_job(tmp_path, "zmq", 4, "free", max_staleness=30, **slowed)
    for epoch in free["epochs"]:
        fast, slow = epoch["train_batches_per_rank"][:2], epoch["train_batches_per_rank"][2]
        assert epoch["held_back"] == 0, epoch
        assert min(fast) > slow, epoch["train_batches_per_rank"]  # (how much more: the machine's load)
        assert epoch["staleness"] <= 30 and epoch["train_samples"] == 96
    # Two servers: the bound holds on both shards (the staleness reported is the larger).
    bound = run_job(tmp_path, "zmq", 5, "bound", max_staleness=2, ps_ranks=2, **slowed)
    for epoch in bound["epochs"]:
        assert epoch["held_back"] > 0, epoch
        assert epoch["staleness"] == 2, epoch
        assert epoch["train_samples"] == 96
    # 0: one worker at a time, on every shard.
    sequential = run_job(tmp_path, "zmq", 4, "sequential", max_staleness=0, ps_ranks=2, **slowed)
    assert [e["staleness"] for e in sequential["epochs"]] == [0, 0], sequential["epochs"]


@pytest.mark.timeout(300)
def test_async_ps_workers_with_shares_wait_for_the_slowest_beyond_the_collective_timeout(tmp_path):
    """A sampler gives each worker its share: one that is done waits for the slow one's last
    batches at the epoch's end, longer than the collective timeout (3 s here) as long as it
    lives, and the epoch ends with every share trained."""
    run = run_job(tmp_path, "zmq", 3, "shares", epochs=1, sampler="half", step_sleep=[0, 0.7, 0],
                  collective_timeout=3, **ASYNC)  # fmt: skip
    assert run["epochs"][0]["train_batches_per_rank"] == [6, 6, 0]


@pytest.mark.timeout(300)
def test_async_ps_reaches_ddps_accuracy_on_the_digits_example(tmp_path):
    """examples/train_digits.py, 12 epochs: three ranks under DDP against three workers and a
    parameter server (same per-rank batch, same optimizer): validation accuracy within one
    percentage point (or better)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
    accuracy = {}
    for strategy, nprocs in (("ddp", 3), ("async_ps", 4)):
        result = tmp_path / f"{strategy}.json"
        cmd = [sys.executable, str(script), "--nprocs", str(nprocs), "--strategy", strategy, "--result", str(result)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        accuracy[strategy] = json.loads(result.read_text())["val_accuracy"]
    assert accuracy["async_ps"] >= accuracy["ddp"] - 0.01, accuracy
    assert accuracy["ddp"] > 0.9, accuracy


def test_async_ps_refuses_what_it_cannot_do_saying_why():
    """Options it cannot honour fail when made, not after an epoch; a world with no worker
    beside its servers fails with the numbers."""
    import dataparallel as dp
    from dataparallel.train.strategies.paramserver import Layout

    with pytest.raises(ValueError, match="without elastic"):
        dp.TrainOptions(strategy="async_ps", elastic=True)
    with pytest.raises(ValueError, match="amp='fp16'"):
        dp.TrainOptions(strategy="async_ps", amp="fp16")
    with pytest.raises(ValueError, match="ps_ranks must be >= 1"):
        dp.TrainOptions(strategy="async_ps", ps_ranks=0)
    with pytest.raises(ValueError, match="max_staleness"):
        dp.TrainOptions(strategy="async_ps", max_staleness=-1)
    with pytest.raises(ValueError, match=r"2 ranks, ps_ranks=2"):
        Layout.of([torch.zeros(3)], world=2, ps_ranks=2)
    # Whole tensors, the largest first to the lightest server: sizes 10, 7, 5, 3 over two.
    layout = Layout.of([torch.zeros(n) for n in (3, 10, 5, 7)], world=4, ps_ranks=2)
    assert layout.servers == [2, 3] and layout.workers == [0, 1]
    assert layout.owned == [[0, 1], [2, 3]]  # 10+3 and 7+5
