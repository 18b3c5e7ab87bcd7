"""The training loop across real processes (gloo on CPU) over real transports."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import loop_worker  # the worker itself, for the references built here
import pytest
import torch
import zygote

import dataparallel as dp
from dataparallel.testing import free_port

WORKER = Path(__file__).with_name("loop_worker.py")
TRANSPORTS = ["zmq", "grpc", "tcpstore"]


def spawn(cfg: dict) -> zygote.ForkedProcess:
    """One rank: ``python loop_worker.py CFG``, forked from the zygote (tests/zygote.py)."""
    return zygote.popen([str(WORKER), json.dumps(cfg)])


def run_job(tmp_path: Path, transport: str, world: int, tag: str, **cfg) -> dict:
    url = f"{transport}://127.0.0.1:{free_port()}"
    out = str(tmp_path / f"{tag}.pt")
    for code, err in run_ranks(url, world, tag, out=out, **cfg):
        assert code == 0, f"{tag}: rank exited {code}:\n{err[-3000:]}"
    return torch.load(out, weights_only=False)


def run_ranks(url: str, world: int, tag: str, **cfg) -> list[tuple[int, str]]:
    """Every rank's (exit code, stdout and stderr)."""
    procs = [spawn({"url": url, "rank": r, "world": world, **cfg}) for r in range(world)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{tag}: a rank hung")
        results.append((p.returncode, out + err))
    return results


def assert_same_params(a: dict, b: dict, **tol) -> None:
    for name in a["state"]:
        torch.testing.assert_close(a["state"][name], b["state"][name], **tol, msg=f"parameter {name} differs")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_data_parallel_training_equals_one_process_on_the_same_global_batches(tmp_path, transport):
    # One process with batch 12 sees the same global batches as 2 x 6 and 3 x 4
    # (DistributedSampler strides one shuffled permutation), so parameters must agree.
    single = run_job(tmp_path, "zmq", 1, "single", batch=12)
    for world in (2, 3):
        multi = run_job(tmp_path, transport, world, f"n{world}", batch=12 // world)
        # Float sums in another order: agree to ~1e-6, far below one SGD step (lr 0.05).
        assert_same_params(single, multi, rtol=1e-5, atol=1e-6)
        assert multi["epochs"][-1]["train_samples"] == 96
    losses = [e["train_loss"] for e in single["epochs"]]
    assert losses[-1] < losses[0], "training must reduce the loss"


@pytest.mark.timeout(300)
def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    big = run_job(tmp_path, "zmq", 2, "big", batch=8, shuffle=False)
    accumulated = run_job(tmp_path, "zmq", 2, "accum", batch=4, accum=2, shuffle=False)
    assert_same_params(big, accumulated, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_uneven_batch_counts_neither_deadlock_nor_drop_data(tmp_path):
    epochs = 2
    result = run_job(tmp_path, "zmq", 2, "uneven", uneven=True, epochs=epochs)
    # rank 0: 2 batches, rank 1: 4 batches of 8; all of them are trained on.
    assert result["epochs"][-1]["train_batches"] == 6
    assert result["epochs"][-1]["train_samples"] == 48
    # The same training in one process: while both ranks have a batch, the step takes the
    # mean of their gradients; once rank 0 has run out, torch's Join stands in for it with
    # zeros (divided by the initial world size, 2).
    net = loop_worker.model(0.0)
    optimizer = torch.optim.SGD(net.parameters(), lr=loop_worker.LR, momentum=loop_worker.MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=loop_worker.GAMMA)
    shards = [loop_worker.uneven_batches(rank) for rank in range(2)]
    for _ in range(epochs):
        for step in range(max(len(s) for s in shards)):
            optimizer.zero_grad()
            for shard in shards:
                if step < len(shard):
                    x, y = shard[step]
                    (torch.nn.functional.mse_loss(net(x), y) / len(shards)).backward()
            optimizer.step()
        scheduler.step()
    assert_same_params(result, {"state": net.state_dict()}, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_patience_stops_early_when_validation_stops_improving(tmp_path):
    # lr 0: the validation loss never improves after the first epoch.
    result = run_job(tmp_path, "zmq", 2, "patience", epochs=6, patience=2, lr=0.0)
    assert result["stopped_early"] is True
    assert len(result["epochs"]) == 3, [e["epoch"] for e in result["epochs"]]
    trained = run_job(tmp_path, "zmq", 2, "improving", epochs=3, patience=2)
    assert trained["stopped_early"] is False and len(trained["epochs"]) == 3
    for e in trained["epochs"]:  # where each epoch went adds up to the epoch
        parts = e["train_seconds"], e["val_seconds"], e["control_seconds"]
        assert min(parts) > 0 and sum(parts) == pytest.approx(e["seconds"], rel=1e-6), e


@pytest.mark.timeout(300)
def test_resume_equals_uninterrupted_bitwise(tmp_path):
    # Three ranks: an all-reduce over three adds in an order that depends on the gradient
    # buckets' layout, which DDP changes after its first backward (laid out before training).
    whole = run_job(tmp_path, "zmq", 3, "whole", epochs=4, dropout=0.2, checkpoint=str(tmp_path / "w.ckpt"))
    ckpt = str(tmp_path / "r.ckpt")
    run_job(tmp_path, "zmq", 3, "first", epochs=2, dropout=0.2, checkpoint=ckpt)
    resumed = run_job(tmp_path, "zmq", 3, "second", epochs=4, dropout=0.2, checkpoint=ckpt, resume=True)
    for name in whole["state"]:
        assert torch.equal(whole["state"][name], resumed["state"][name]), name
    assert [e["train_loss"] for e in whole["epochs"]] == [e["train_loss"] for e in resumed["epochs"]]
    assert not list(tmp_path.glob(".*.tmp")), "no temporary checkpoint left behind"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, amp):
    ckpt = tmp_path / f"{amp}.ckpt"
    result = run_job(tmp_path, "zmq", 2, amp, amp=amp, epochs=3, clip=1.0, checkpoint=str(ckpt))
    losses = [e["train_loss"] for e in result["epochs"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    scaler = torch.load(ckpt, weights_only=False)["scaler"]
    if amp == "fp16":  # fp16 steps through a GradScaler, whose state is checkpointed
        assert scaler["scale"] > 0 and "_growth_tracker" in scaler, scaler
    else:
        assert scaler == {}, "bf16 needs no loss scaling"


def test_options_are_validated():
    with pytest.raises(ValueError):
        dp.TrainOptions(amp="fp8")
    with pytest.raises(ValueError):
        dp.TrainOptions(resume=True)
    with pytest.raises(ValueError):
        dp.TrainOptions(grad_accum=0)


@pytest.mark.timeout(300)
def test_a_model_returning_a_tuple_trains_validates_and_resumes(tmp_path):
    """Any output structure reaches loss_fn, in training and validation; accuracy is claimed
    only for class logits. Checkpoints through a file:// URL resume bitwise."""
    plain = run_job(tmp_path, "zmq", 2, "plain", epochs=3)
    ckpt = f"file://{tmp_path / 'tuple.ckpt'}"
    run_job(tmp_path, "zmq", 2, "tuple-first", epochs=2, tuple=True, checkpoint=ckpt)
    resumed = run_job(tmp_path, "zmq", 2, "tuple", epochs=3, tuple=True, checkpoint=ckpt, resume=True)
    for name in plain["state"]:  # the worker saves the wrapped net's parameters
        assert torch.equal(plain["state"][name], resumed["state"][name]), name
    assert [e["val_loss"] for e in plain["epochs"]] == [e["val_loss"] for e in resumed["epochs"]]
    assert all(e["val_accuracy"] is None for e in resumed["epochs"]), "regression: no accuracy"


@pytest.mark.timeout(300)
def test_a_checkpoint_resumes_at_another_world_size(tmp_path):
    ckpt = str(tmp_path / "grow.ckpt")
    first = run_job(tmp_path, "zmq", 2, "two", epochs=2, checkpoint=ckpt)
    grown = run_job(tmp_path, "zmq", 3, "three", epochs=4, checkpoint=ckpt, resume=True)
    assert grown["epochs"][:2] == first["epochs"], "the history carries over"
    assert [e["train_samples"] for e in grown["epochs"][2:]] == [96, 96], "resharded over 3 ranks, nothing lost"
    assert grown["epochs"][-1]["train_batches"] == 12, "3 ranks x 4 batches of 8"
    shrunk = run_job(tmp_path, "zmq", 1, "one", epochs=5, checkpoint=ckpt, resume=True)
    assert shrunk["epochs"][:4] == grown["epochs"] and shrunk["epochs"][-1]["train_samples"] == 96


@pytest.mark.timeout(300)
def test_what_a_real_training_script_needs(tmp_path):
    """Per-step callbacks on every rank, a per-step LR schedule, parameter groups from the
    model, a checkpoint every 2 epochs with the script's own extra state (given back on
    resume), DataLoader options, batches per rank, log lines every N steps."""
    ckpt = tmp_path / "every2.ckpt"
    url = f"zmq://127.0.0.1:{free_port()}"
    out = str(tmp_path / "features.pt")
    common = {"features": True, "checkpoint": str(ckpt), "checkpoint_every": 2, "scheduler_interval": "step"}
    runs = run_ranks(url, 2, "features", out=out, epochs=3, log_every=5, **common)
    assert all(code == 0 for code, _ in runs), runs[0][1][-3000:]
    result = torch.load(out, weights_only=False)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    per_epoch = 96 // 8 // 2  # batches of 8, two ranks: 6 optimizer steps per epoch
    for rank, seen in enumerate(ranks):
        assert [s[1] for s in seen["steps"]] == list(range(1, 3 * per_epoch + 1)), "one call per step, counted"
        assert {s[3] for s in seen["steps"]} == {rank} and seen["collated"] >= 3 * per_epoch
    assert [e["train_batches_per_rank"] for e in result["epochs"]] == [[6, 6]] * 3
    lr = result["epochs"][-1]["lr"]  # at the last epoch's first step: 2 epochs of steps before it
    assert lr == pytest.approx(loop_worker.LR * loop_worker.GAMMA ** (2 * per_epoch))
    logged = [line.split(" loss")[0] for line in runs[0][1].splitlines() if " loss " in line]
    assert logged == ["epoch 0 step 5", "epoch 1 step 10", "epoch 2 step 15"], runs[0][1][-2000:]
    assert " loss " not in runs[1][1], "only the driver logs"
    saved = torch.load(ckpt, weights_only=False)
    assert saved["epoch"] == 2 and saved["extra"] == {"saves": 2, "tag": "mine", "phase": "checkpoint"}, (
        "epochs 1 and 2 (the last), each made while the driver's status said so"
    )
    assert saved["step"] == 3 * per_epoch
    assert [g["lr"] for g in saved["optimizer"]["param_groups"]][1] == pytest.approx(
        loop_worker.LR / 2 * loop_worker.GAMMA ** (3 * per_epoch)
    ), "the output layer's group"
    resumed = run_ranks(url.replace(url.rsplit(":", 1)[1], str(free_port())), 2, "features-resumed",
                        out=out, epochs=4, resume=True, **common)  # fmt: skip
    assert all(code == 0 for code, _ in resumed), resumed[0][1][-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    given = {"saves": 2, "tag": "mine", "phase": "checkpoint"}
    assert all(seen["loaded"] == given for seen in ranks), "given back on every rank"
    assert [s[1] for s in ranks[0]["steps"]] == list(range(3 * per_epoch + 1, 4 * per_epoch + 1))


@pytest.mark.timeout(240)
def test_a_users_sampler_shards_the_data_even_or_uneven(tmp_path):
    """A DistributedSampler subclass is the training sampler; equal lengths train without
    Join, different lengths per rank under Join (said once on the driver)."""
    url = f"zmq://127.0.0.1:{free_port()}"
    for kind, per_rank in (("half", [3, 3]), ("uneven", [6, 3])):
        out = str(tmp_path / f"{kind}.pt")
        runs = run_ranks(url.replace(url.rsplit(":", 1)[1], str(free_port())), 2, kind, out=out, epochs=2, sampler=kind)
        assert all(code == 0 for code, _ in runs), runs[0][1][-3000:]
        result = torch.load(out, weights_only=False)
        assert [e["train_batches_per_rank"] for e in result["epochs"]] == [per_rank] * 2
        told = runs[0][1].count("the sampler gives the ranks different numbers of batches")
        assert told == (1 if kind == "uneven" else 0), runs[0][1][-2000:]


@pytest.mark.timeout(120)
def test_a_loss_that_cannot_take_the_output_fails_before_the_first_epoch(tmp_path):
    url = f"zmq://127.0.0.1:{free_port()}"
    ranks = run_ranks(url, 2, "broken", out=str(tmp_path / "x.pt"), broken_loss=True, slow=True)
    for code, err in ranks:
        assert code != 0
        assert "the first training batch failed before training started" in err, err[-2000:]
        assert "no_such_method" in err
        assert "PeerLost" not in err and "epoch 0" not in err, err[-2000:]


def test_checkpoints_go_through_fsspec_and_a_bad_scheme_fails_at_once(tmp_path):
    from dataparallel.train import storage as checkpoint

    target = "memory://dp-test/run/snap.pt"
    assert checkpoint.load(target) is None
    checkpoint.save_atomically({"a": 1}, target)
    checkpoint.save_atomically({"a": 2}, target)
    assert checkpoint.load(target)["a"] == 2
    import fsspec

    assert fsspec.filesystem("memory").ls("/dp-test/run", detail=False) == ["/dp-test/run/snap.pt"]
    local = tmp_path / "sub" / "c.pt"
    checkpoint.save_atomically({"b": 3}, f"file://{local}")
    assert torch.load(local)["b"] == 3 and checkpoint.load(str(local))["b"] == 3
    with pytest.raises(ValueError, match="nosuch"):
        dp.TrainOptions(checkpoint="nosuch://bucket/snap.pt")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="s3fs"):
            dp.TrainOptions(checkpoint="s3://bucket/snap.pt")


def test_checkpoint_write_is_atomic(tmp_path):
    from dataparallel.train.storage import save_atomically

    path = tmp_path / "c.pt"
    save_atomically({"a": 1}, path)
    save_atomically({"a": 2}, path)
    assert torch.load(path)["a"] == 2
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("at", "more", "stopped"),
    [
        # Steps longer than the poll interval (0.2 s): the ranks poll every step and agree one later.
        ([1, 1, 0], {"step_sleep": 0.25}, "in epoch 1 after 2 batches"),
        ([0, 1, 3], {"step_sleep": 0.25}, "in epoch 1 after 4 batches"),  # at the epoch's last step
        ([2, 0, 0], {}, "in epoch 0 after 2 batches"),  # the first epoch: every step, none measured yet
        # Fast steps: polls further apart than the epoch; the epoch's end reads one at once.
        ([1, 1, 0], {}, "in epoch 1 after 4 batches"),
        # The signal delivered twice at once (srun to every process, a launcher forwarding it): one stop.
        ([1, 1, 0], {"step_sleep": 0.25, "twice": True}, "in epoch 1 after 2 batches"),
        # Ranks with different batch counts (under Join, no poll mid-epoch): at the epoch's end.
        ([1, 1, 0], {"sampler": "uneven"}, "in epoch 1 after 4 batches"),
    ],
    ids=["mid-epoch", "last-step", "first-epoch", "fast-steps", "delivered-twice", "uneven"],
)
def test_a_stop_signal_checkpoints_at_a_step_and_resuming_ends_as_uninterrupted(tmp_path, at, more, stopped):
    """SIGTERM to one rank (as Slurm sends before preemption): every rank stops at the same
    step, the driver checkpoints there, every rank exits 143; the job started again resumes
    at that step and ends bit for bit as a run that was never stopped (dropout: RNG matters)."""
    job = {"epochs": 3, "dropout": 0.2, **more}
    whole = run_job(tmp_path, "zmq", 3, "whole", **job, checkpoint=str(tmp_path / "w.ckpt"))
    ckpt = str(tmp_path / "s.ckpt")
    url = f"zmq://127.0.0.1:{free_port()}"
    results = run_ranks(url, 3, "stopped", out=str(tmp_path / "s.pt"), **job, checkpoint=ckpt, term=at)
    assert [code for code, _ in results] == [128 + 15] * 3, results
    assert f"dataparallel: stopped by SIGTERM {stopped}; the checkpoint {ckpt} resumes there" in results[0][1]
    assert all("Traceback" not in out for _, out in results)  # Preempted ends the process as the signal would
    resumed = run_job(tmp_path, "zmq", 3, "resumed", **job, checkpoint=ckpt, resume=True)
    for name in whole["state"]:
        assert torch.equal(whole["state"][name], resumed["state"][name]), name
    assert [e["train_loss"] for e in whole["epochs"]] == [e["train_loss"] for e in resumed["epochs"]]
    assert [e["train_samples"] for e in resumed["epochs"]] == [e["train_samples"] for e in whole["epochs"]]


def _as_written_before_positions(state: dict) -> dict:
    """``state`` (a checkpoint) as dp.fit wrote it before epoch positions were versioned: the
    same keys, the position a stop signal left as the ``partial`` dict of then (epoch, batches,
    every rank's sums, samples left, batch size, data layout: no version, world or RNG states)."""
    legacy, position = dict(state), state["partial"]
    if position is not None:
        keys = ("epoch", "batches", "train", "base", "batch", "layout")
        legacy["partial"] = {k: position[k] for k in keys}
    return legacy


@pytest.mark.timeout(420)
def test_a_checkpoint_from_before_positions_were_versioned_resumes_as_it_did(tmp_path):
    """A stop signal's checkpoint in the format of before (its ``partial`` dict, no versioned
    position) resumes on as many ranks bit for bit as an uninterrupted run, and on fewer ranks
    (the samples left resharded) exactly as the same checkpoint in today's format does."""
    job = {"epochs": 3, "dropout": 0.2, "step_sleep": 0.25}
    whole = run_job(tmp_path, "zmq", 3, "whole", **job, checkpoint=str(tmp_path / "w.ckpt"))
    ckpt = tmp_path / "s.ckpt"
    url = f"zmq://127.0.0.1:{free_port()}"
    results = run_ranks(url, 3, "stopped", out=str(tmp_path / "s.pt"), **job, checkpoint=str(ckpt), term=[1, 1, 0])
    assert [code for code, _ in results] == [128 + 15] * 3, results
    state = torch.load(ckpt, weights_only=False)
    assert state["partial"]["version"] == 2 and state["partial"]["batches"] == 2
    (tmp_path / "new.ckpt").write_bytes(ckpt.read_bytes())
    torch.save(_as_written_before_positions(state), ckpt)
    (tmp_path / "old.ckpt").write_bytes(ckpt.read_bytes())
    resumed = run_job(tmp_path, "zmq", 3, "resumed", **job, checkpoint=str(ckpt), resume=True)
    for name in whole["state"]:
        assert torch.equal(whole["state"][name], resumed["state"][name]), name
    assert [e["train_loss"] for e in whole["epochs"]] == [e["train_loss"] for e in resumed["epochs"]]
    fewer = {}
    for form in ("old", "new"):
        fewer[form] = run_job(tmp_path, "zmq", 2, f"two-{form}", **job, checkpoint=str(tmp_path / f"{form}.ckpt"),
                              resume=True)  # fmt: skip
    for name in whole["state"]:
        assert torch.equal(fewer["old"]["state"][name], fewer["new"]["state"][name]), name
    assert [e["train_loss"] for e in fewer["old"]["epochs"]] == [e["train_loss"] for e in fewer["new"]["epochs"]]
    assert fewer["old"]["epochs"][1]["train_samples"] == whole["epochs"][1]["train_samples"]


def test_an_epoch_position_reads_every_format_it_was_written_in():
    """Today's versioned position, the ``partial`` dict of before (with and without the data
    layout and batch size of later versions), none; a version it does not know fails saying so."""
    from dataparallel.train.position import VERSION, EpochPosition

    position = EpochPosition(1, 2, world=3, batch=4, base=None, train=((1.5, 8, 2),) * 3, layout=("shares", 3))
    assert EpochPosition.from_checkpoint({"partial": position.to_dict(), "world_size": 3}) == position
    partial = {"epoch": 1, "batches": 2, "train": [[1.5, 8, 2]] * 3, "base": None, "batch": 4, "layout": ["shares", 3]}
    assert EpochPosition.from_checkpoint({"partial": partial, "world_size": 3}) == position
    oldest = {"epoch": 1, "batches": 2, "train": [[1.5, 8, 2]] * 3}  # before the layout and batch were saved
    read = EpochPosition.from_checkpoint({"partial": oldest, "world_size": 3})
    assert read is not None and (read.layout, read.batch, read.base) == (("shares", 3), None, None)
    assert EpochPosition.from_checkpoint({"partial": None, "world_size": 3}) is None
    assert read.totals() == (4.5, 24, 6)
    with pytest.raises(ValueError, match=f"version 99: this dataparallel reads {VERSION}"):
        EpochPosition.from_checkpoint({"partial": {**position.to_dict(), "version": 99}})
