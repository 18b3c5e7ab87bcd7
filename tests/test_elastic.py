"""Elastic training: a follower killed mid-epoch does not end the job. The survivors regroup
as a new generation (new channel, new gloo group), go back to the epoch's start kept in
memory, and finish on fewer ranks: no process restarts, no checkpoint file is read. The
result equals a job resumed on the survivors from a checkpoint of that epoch's start.

A process started while the job trains joins it at the next epoch boundary (the driver
seats it; the members move to a larger generation and the driver's state reaches it by
broadcast): the result equals the job resumed on the larger group from a checkpoint there."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from etcdserver import EtcdServer, require_etcd
from test_loop import WORKER, assert_same_params, run_ranks, spawn

from dataparallel.control.membership import open_queue
from dataparallel.control.registry import resolve
from dataparallel.errors import ControlError
from dataparallel.testing import free_port, with_options

FAST = {"heartbeat": 0.2, "liveness_timeout": 2}


@pytest.fixture(params=["zmq", "grpc", "tcpstore", "etcd"])
def new_url(request, tmp_path):
    """``new_url()``: the URL of a fresh job (a free port; the one etcd server)."""
    if request.param == "etcd":
        require_etcd()
        server = EtcdServer(tmp_path / "etcd").start().wait_ready()
        yield lambda: with_options(server.url, **FAST)
        server.stop()
    else:
        yield lambda: with_options(f"{request.param}://127.0.0.1:{free_port()}", **FAST)


def run_job(url: str, world: int, tag: str, out: str, **cfg) -> dict:
    for code, log in run_ranks(url, world, tag, out=out, **cfg):
        assert code == 0, f"{tag}: {log[-3000:]}"
    return torch.load(out, weights_only=False)


#: Dropout, and each rank its own RNG stream (seeded by rank after the model is built): a
#: survivor that kept the wrong stream after a regroup draws other dropout masks.
SEEDED = {"dropout": 0.2, "rank_seed": True}
COMMON = {"epochs": 3, **SEEDED}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """The job stopped after epoch 0 and resumed on two ranks from its checkpoint (the
    transport does not change the numbers: the conformance suite and test_loop show it)."""
    tmp = tmp_path_factory.mktemp("reference")
    url = lambda: f"zmq://127.0.0.1:{free_port()}"  # noqa: E731
    ckpt = str(tmp / "epoch0.ckpt")
    run_job(url(), 3, "first", str(tmp / "first.pt"), epochs=1, checkpoint=ckpt, **SEEDED)
    return run_job(url(), 2, "resumed", str(tmp / "resumed.pt"), checkpoint=ckpt, resume=True, **COMMON)


@pytest.mark.timeout(240)
def test_a_killed_follower_leaves_the_survivors_training_to_the_same_result(tmp_path, new_url, resumed):
    url = new_url()
    out = str(tmp_path / "elastic.pt")
    runs = run_ranks(url, 3, "elastic", out=out, elastic=True, die=[2, 1, 2], **COMMON)
    assert runs[2][0] == -9, "the victim was killed"
    for code, log in runs[:2]:
        assert code == 0, log[-3000:]
    elastic = torch.load(out, weights_only=False)
    assert [e["world_size"] for e in elastic["epochs"]] == [3, 2, 2]
    (regroup,) = elastic["regroups"]
    assert (regroup["epoch"], regroup["lost"], regroup["world_size"], regroup["generation"]) == (1, [2], 2, 1)
    assert "regrouping without it" in runs[1][1] and "generation 1 carries on with 2 ranks" in runs[0][1]
    assert_same_params(elastic, resumed, rtol=0, atol=0)
    assert [e["val_loss"] for e in elastic["epochs"]] == [e["val_loss"] for e in resumed["epochs"]]


@pytest.mark.timeout(240)
def test_a_lost_middle_rank_leaves_each_survivor_the_rng_stream_a_resume_gives_its_new_rank(tmp_path, resumed):
    """Rank 1 of three is killed in epoch 1: old rank 2 becomes rank 1 and takes the RNG
    state old rank 1 had at the epoch's start (as a resume on two ranks gives rank 1 the
    saved state of rank 1), not its own: the same parameters, bit for bit, with dropout and
    a stream per rank. (The transport does not change the numbers: zmq only.)"""
    out = str(tmp_path / "middle.pt")
    url = with_options(f"zmq://127.0.0.1:{free_port()}", **FAST)
    runs = run_ranks(url, 3, "middle", out=out, elastic=True, die=[1, 1, 2], **COMMON)
    assert runs[1][0] == -9, "the victim was killed"
    for code, log in (runs[0], runs[2]):
        assert code == 0, log[-3000:]
    elastic = torch.load(out, weights_only=False)
    assert [(r["epoch"], r["lost"], r["world_size"]) for r in elastic["regroups"]] == [(1, [1], 2)]
    assert_same_params(elastic, resumed, rtol=0, atol=0)
    assert [e["val_loss"] for e in elastic["epochs"]] == [e["val_loss"] for e in resumed["epochs"]]


@pytest.mark.timeout(120)
def test_fewer_survivors_than_min_world_size_end_the_job_saying_so(tmp_path):
    url = with_options(f"zmq://127.0.0.1:{free_port()}", **FAST)
    runs = run_ranks(url, 3, "too-few", out=str(tmp_path / "x.pt"), elastic=True, min_world=3, die=[2, 0, 1])
    for code, log in runs[:2]:
        assert code != 0
        assert "PeerLost" in log and "fewer than min_world_size=3" in log, log[-3000:]


@pytest.mark.timeout(180)
def test_the_digits_example_carries_on_under_launch_when_a_follower_is_killed(tmp_path):
    """The command docs/howto/failures.md shows: ``launch --elastic`` keeps the survivors running (exit code 0) and
    the driver reports the regroup; no restart happened (one launch attempt)."""
    script = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            "--elastic",
            "--kill",
            "2",
            "--epochs",
            "3",
            "--result",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "rank 2 exited with signal SIGKILL; the others carry on without it (elastic)" in out
    assert "driver: 3 epochs on 3/2 processes" in out and "carried on with 2" in out, out[-3000:]
    assert "restarting" not in out
    assert json.loads((tmp_path / "r.json").read_text())["val_accuracy"] > 0.5


@pytest.mark.timeout(240)
def test_a_frozen_follower_is_left_behind_without_waiting_for_a_collective_timeout(tmp_path, new_url, resumed):
    """A follower stopped mid-epoch (SIGSTOP: alive, its gloo connections open, silent) is
    declared lost by its missing heartbeats; the survivors' gloo all-reduce that waits for it
    ends then (not at the group's 300 s timeout) and they carry on to the same result. When
    it wakes up it cannot carry on and exits saying why."""
    url = new_url()
    out = str(tmp_path / "elastic.pt")
    cfg = {"url": url, "world": 3, "out": out, "elastic": True, "freeze": [2, 1, 2], "collective_timeout": 150}
    procs = [spawn({**cfg, "rank": r, **COMMON}) for r in range(3)]
    try:  # the whole job takes ~20 s; waiting for gloo's timeout, 150 s more
        survivors = [p.communicate(timeout=75) for p in procs[:2]]
        for p, (stdout, stderr) in zip(procs[:2], survivors, strict=True):
            assert p.returncode == 0, (stdout + stderr)[-3000:]
        assert Path(f"/proc/{procs[2].pid}/stat").read_text().split(") ")[1].startswith("T"), "still frozen"
        procs[2].send_signal(signal.SIGCONT)
        stdout, stderr = procs[2].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[2].returncode not in (0, None), "the frozen rank cannot carry on"
    assert re.search(r"ChannelClosed: rank 2 (stood still for|of job .* was declared lost)", stderr), stderr[-2000:]
    elastic = torch.load(out, weights_only=False)
    assert [e["world_size"] for e in elastic["epochs"]] == [3, 2, 2]
    assert elastic["regroups"][0]["lost"] == [2]
    assert_same_params(elastic, resumed, rtol=0, atol=0)


@pytest.fixture(scope="module")
def resumed_on_four(tmp_path_factory) -> dict:
    """The job stopped after epoch 1 and resumed on four ranks from its checkpoint."""
    tmp = tmp_path_factory.mktemp("reference4")
    url = lambda: f"zmq://127.0.0.1:{free_port()}"  # noqa: E731
    ckpt = str(tmp / "epoch1.ckpt")
    run_job(url(), 3, "first", str(tmp / "first.pt"), epochs=2, checkpoint=ckpt, dropout=COMMON["dropout"])
    return run_job(url(), 4, "resumed", str(tmp / "resumed.pt"), checkpoint=ckpt, resume=True, **GROW)


GROW = {"epochs": 4, "dropout": 0.2}


def queued(url: str, job: str) -> bool:
    """Whether a newcomer waits in ``job``'s join queue (looked at as the driver does)."""
    parsed, cls = resolve(url, None)
    try:
        queue = open_queue(parsed, cls, job, None, 2)
    except ControlError:  # no coordinator yet
        return False
    try:
        count = queue.add("count", 0)
        return count > 0 and queue.check([f"request/{count - 1}"])
    finally:
        queue.close()


@pytest.mark.timeout(240)
def test_a_process_started_later_joins_at_the_next_epoch_and_trains_as_a_resumed_larger_job(
    tmp_path, new_url, resumed_on_four
):
    """Three ranks train; a fourth process, started with the same settings while epoch 1
    runs, waits in the join queue, is seated at the boundary and trains epochs 2 and 3 with
    them: the same parameters, bit for bit, as the job checkpointed after epoch 1 and
    resumed on four ranks (the newcomer takes the driver's state and rank 0's RNG stream)."""
    url, out, release = new_url(), str(tmp_path / "grown.pt"), tmp_path / "release"
    cfg = {"url": url, "world": 3, "out": out, "elastic": True, "max_world": 4, **GROW}
    cfg |= {"started": str(tmp_path / "started"), "hold": [1, str(release)]}
    procs = [spawn({**cfg, "rank": r}) for r in range(3)]
    newcomer = None
    try:
        # Every rank waits at epoch 1's first step: the boundary after epoch 0 has passed, so the
        # newcomer is seated at the next one, after epoch 1, however slowly the job started.
        deadline = time.monotonic() + 90
        while not all(Path(f"{release}.held.{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the job did not start"
            time.sleep(0.1)
        newcomer = spawn({**cfg, "rank": None, "started": None})
        while not queued(url, "loop"):  # epoch 1 is held until the newcomer waits to be admitted
            assert time.monotonic() < deadline + 60 and newcomer.poll() is None, newcomer.communicate()
            time.sleep(0.1)
        release.touch()
        runs = [p.communicate(timeout=120) for p in [*procs, newcomer]]
    finally:
        for p in [*procs, *([newcomer] if newcomer else [])]:
            p.kill()
    for p, (stdout, stderr) in zip([*procs, newcomer], runs, strict=True):
        assert p.returncode == 0, (stdout + stderr)[-3000:]
    assert "admitted to job 'loop' as rank 3 of 4 (generation 1)" in runs[3][1]
    grown = torch.load(out, weights_only=False)
    assert [e["world_size"] for e in grown["epochs"]] == [3, 3, 4, 4]
    (regroup,) = grown["regroups"]
    assert (regroup["epoch"], regroup["lost"], regroup["joined"], regroup["world_size"]) == (2, [], [3], 4)
    assert_same_params(grown, resumed_on_four, rtol=0, atol=0)
    assert [e["val_loss"] for e in grown["epochs"]] == [e["val_loss"] for e in resumed_on_four["epochs"]]


@pytest.mark.timeout(240)
def test_launch_starts_a_killed_follower_again_and_it_rejoins_the_running_job(tmp_path):
    """``launch --elastic --max-restarts 1``: rank 2 is killed in epoch 1, the survivors redo
    it on two ranks, the launcher starts rank 2 again (the group keeps running), and the new
    process joins at the boundary after epoch 2 (held until it waits in the queue): the
    job ends on three ranks, exit code 0, one launch attempt. The launcher's event file
    (``--events``) holds the story in order, across the job's generations: the joins, rank
    2's exit, its loss, the regroup without it, its restart, the regroup with it; ``status
    --events`` shows it."""
    port, out, release = free_port(), str(tmp_path / "relaunched.pt"), tmp_path / "release"
    url = with_options(f"zmq://127.0.0.1:{port}", **FAST)
    cfg = {"launched": True, "out": out, "epochs": 4, "die": [2, 1, 2], "hold": [2, str(release)]}
    events = tmp_path / "events.jsonl"
    launch = [sys.executable, "-m", "dataparallel", "launch", "--elastic", "--max-restarts", "1", "--nprocs", "3"]
    launch += ["--events", str(events)]
    proc = subprocess.Popen(
        [*launch, "--url", url, "--job", "relaunch", str(WORKER), json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not queued(url, "relaunch"):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        release.touch()
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert "[launch] starting rank 2 again (restart 1 of 1)" in output, output[-3000:]
    assert "restarting it" not in output  # the group was not restarted
    result = torch.load(out, weights_only=False)
    assert [e["world_size"] for e in result["epochs"]] == [3, 2, 2, 3]
    lost, joined = result["regroups"]
    assert (lost["epoch"], lost["lost"], lost["world_size"]) == (1, [2], 2)
    assert (joined["epoch"], joined["joined"], joined["world_size"], joined["generation"]) == (3, [2], 3, 2)
    story = [json.loads(line) for line in events.read_text().splitlines()]
    said = [(e["job"], e["kind"], e["rank"]) for e in story]
    assert {("relaunch", "join", r) for r in range(3)} <= set(said), said
    # The launcher's own lines are written as it sees them, the ranks' as it reads them.
    launcher = [(j, k, r) for j, k, r in said if k in ("exit", "restart")]
    assert launcher == [("relaunch", "exit", 2), ("relaunch", "restart", 2)], said
    ranks = [(j, k, r) for j, k, r in said if k in ("loss", "regroup")]
    assert ranks == [("relaunch", "loss", 2), ("relaunch~1", "regroup", 0), ("relaunch~2", "regroup", 0)], said
    shown = subprocess.run(
        [sys.executable, "-m", "dataparallel", "status", "--events", str(events)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "job relaunch~1 rank 0 regroup: generation 1: 2 rank(s) carry on without rank(s) [2]" in shown, shown


@pytest.mark.timeout(240)
def test_keep_global_batch_splits_the_lost_ranks_share_over_the_survivors(tmp_path, resumed):
    """``keep_global_batch``: three ranks of batch 8 (global 24) lose rank 2; the two survivors
    train with batch 6 accumulated twice (global 24 again): the same parameters, bit for bit,
    as the job checkpointed after epoch 0 and resumed on two ranks with batch 6 x 2."""
    url = with_options(f"zmq://127.0.0.1:{free_port()}", **FAST)
    out, ckpt = str(tmp_path / "kept.pt"), str(tmp_path / "epoch0.ckpt")
    runs = run_ranks(url, 3, "kept", out=out, elastic=True, keep_global=True, die=[2, 1, 2], **COMMON)
    for code, log in runs[:2]:
        assert code == 0, log[-3000:]
    assert "2 ranks: batch 6 x 2 accumulated per rank, global batch kept 24" in runs[0][1]
    kept = torch.load(out, weights_only=False)
    assert [e["train_batches_per_rank"] for e in kept["epochs"]] == [[4, 4, 4], [8, 8], [8, 8]]
    zmq = lambda: f"zmq://127.0.0.1:{free_port()}"  # noqa: E731
    run_job(zmq(), 3, "first", str(tmp_path / "first.pt"), epochs=1, checkpoint=ckpt, **SEEDED)
    again = run_job(
        zmq(), 2, "again", str(tmp_path / "again.pt"), checkpoint=ckpt, resume=True, batch=6, accum=2, **COMMON
    )
    assert_same_params(kept, again, rtol=0, atol=0)
    with pytest.raises(AssertionError):  # and not the run that kept the per-rank batch
        assert_same_params(kept, resumed, rtol=0, atol=0)


@pytest.fixture(scope="module")
def resumed_after_step_2(tmp_path_factory) -> dict:
    """The job stopped by SIGTERM after step 2 of epoch 0 and resumed on two ranks: the 48
    samples of epoch 0 not yet trained resharded over them."""
    tmp = tmp_path_factory.mktemp("step2")
    ckpt, zmq = str(tmp / "step2.ckpt"), lambda: f"zmq://127.0.0.1:{free_port()}"
    stopped = run_ranks(zmq(), 3, "stopped", out=str(tmp / "s.pt"), checkpoint=ckpt, term=[0, 0, 0], **STEPS)
    assert [code for code, _ in stopped] == [128 + 15] * 3, stopped[0][1][-3000:]
    assert "stopped by SIGTERM in epoch 0 after 2 batches" in stopped[0][1]
    resumed = run_ranks(zmq(), 2, "resumed", out=str(tmp / "r.pt"), checkpoint=ckpt, resume=True, **STEPS)
    assert all(code == 0 for code, _ in resumed), resumed[0][1][-3000:]
    assert "in epoch 0 after 2 batches of 3 ranks: the 48 samples left are resharded" in resumed[0][1]
    return torch.load(str(tmp / "r.pt"), weights_only=False)


STEPS = {"epochs": 3, **SEEDED}


@pytest.mark.timeout(240)
def test_a_snapshot_mid_epoch_leaves_only_the_steps_since_it_to_redo_on_the_samples_left(
    tmp_path, new_url, resumed_after_step_2
):
    """``snapshot_every=2``: rank 2 is killed after the last step of epoch 0; the survivors go
    back to the snapshot after step 2 (not to the epoch's start) and train the 48 samples of
    the epoch not yet trained, resharded over two ranks. The same parameters, bit for bit,
    as the job stopped by SIGTERM after step 2 and resumed on two ranks from that checkpoint."""
    resumed, out = resumed_after_step_2, str(tmp_path / "kept.pt")
    runs = run_ranks(new_url(), 3, "kept", out=out, elastic=True, snapshot_every=2, die=[2, 0, 3], **STEPS)
    assert runs[2][0] == -9
    for code, log in runs[:2]:
        assert code == 0, log[-3000:]
    assert "from epoch 0 after 2 batches (48 samples left)" in runs[0][1]
    kept = torch.load(out, weights_only=False)
    assert [e["world_size"] for e in kept["epochs"]] == [2, 2, 2]
    assert kept["epochs"][0]["train_samples"] == 96  # 48 before the snapshot, 48 after: none twice, none lost
    assert kept["epochs"][0]["train_batches"] == resumed["epochs"][0]["train_batches"] == 12
    assert_same_params(kept, resumed, rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_a_snapshot_mid_epoch_gives_each_survivor_the_rng_state_a_resume_gives_its_new_rank(
    tmp_path, resumed_after_step_2
):
    """``snapshot_every=2`` and rank 1 (a middle rank) killed after the last step of epoch 0:
    old rank 2, now rank 1, goes on from the snapshot after step 2 with the RNG state old
    rank 1 had there, as the job stopped there and resumed on two ranks gives rank 1."""
    resumed, out = resumed_after_step_2, str(tmp_path / "kept.pt")
    url = with_options(f"zmq://127.0.0.1:{free_port()}", **FAST)
    runs = run_ranks(url, 3, "kept", out=out, elastic=True, snapshot_every=2, die=[1, 0, 3], **STEPS)
    assert runs[1][0] == -9
    for code, log in (runs[0], runs[2]):
        assert code == 0, log[-3000:]
    assert "from epoch 0 after 2 batches (48 samples left)" in runs[0][1]
    kept = torch.load(out, weights_only=False)
    assert [(r["epoch"], r["lost"], r["world_size"]) for r in kept["regroups"]] == [(0, [1], 2)]
    assert_same_params(kept, resumed, rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_a_newcomer_seated_but_never_arriving_holds_the_members_up_only_so_long(tmp_path):
    """A newcomer takes its seat at the boundary after epoch 1 and never comes (this test
    takes the seat and does nothing with it): the members, moved to the larger generation,
    wait for it at most max(30 s, 3 x liveness_timeout), then carry on without it from that
    boundary, on three ranks, as the generation after."""
    from dataparallel.control.membership import await_admission

    url = with_options(f"zmq://127.0.0.1:{free_port()}", **FAST)
    out, release = str(tmp_path / "absent.pt"), tmp_path / "release"
    cfg = {"url": url, "world": 3, "out": out, "elastic": True, "max_world": 4, **GROW}
    cfg |= {"started": str(tmp_path / "started"), "hold": [1, str(release)]}
    procs = [spawn({**cfg, "rank": r}) for r in range(3)]
    seats: list = []
    try:
        deadline = time.monotonic() + 90  # every rank waits at epoch 1's first step: seated after epoch 1
        while not all(Path(f"{release}.held.{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the job did not start"
            time.sleep(0.1)
        parsed, cls = resolve(url, None)
        queue = open_queue(parsed, cls, "loop", None, 30)
        taker = threading.Thread(target=lambda: seats.append(await_admission(queue, "loop")), daemon=True)
        taker.start()
        while not queued(url, "loop"):
            assert time.monotonic() < deadline, "the seat was never asked for"
            time.sleep(0.1)
        release.touch()
        started = time.monotonic()
        runs = [p.communicate(timeout=150) for p in procs]
        waited = time.monotonic() - started
        queue.close()
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, runs, strict=True):
        assert p.returncode == 0, (stdout + stderr)[-3000:]
    (seat,) = seats
    assert (seat.rank, seat.world_size, seat.generation) == (3, 4, 1)
    result = torch.load(out, weights_only=False)
    assert [e["world_size"] for e in result["epochs"]] == [3, 3, 3, 3]
    (regroup,) = result["regroups"]
    assert (regroup["epoch"], regroup["lost"], regroup["world_size"], regroup["generation"]) == (2, [3], 3, 2)
    assert "rank(s) [3] did not join generation 1" in runs[0][1]
    assert waited < 30 + 30, f"the members waited {waited:.0f}s for the absent newcomer"


@pytest.fixture(params=["etcd", "serve"])
def outliving_url(request, tmp_path):
    """A job's URL whose coordinator or store lives outside its ranks: etcd, or a standalone
    ``dataparallel serve`` (zmq)."""
    if request.param == "etcd":
        require_etcd()
        server = EtcdServer(tmp_path / "etcd").start().wait_ready()
        yield with_options(server.url, **FAST)
        server.stop()
        return
    url = f"zmq://127.0.0.1:{free_port()}"
    serve = [sys.executable, "-m", "dataparallel", "serve", url]
    served = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert "serving" in served.stdout.readline()
        yield with_options(url, **FAST)
    finally:
        served.kill()
        served.wait(timeout=10)


@pytest.mark.timeout(240)
def test_a_killed_driver_is_replaced_where_the_coordinator_outlives_it(tmp_path, outliving_url, resumed):
    """Rank 0, the driver, is killed mid-epoch; the coordinator (etcd, or `dataparallel
    serve`) lives on, so the survivors regroup: rank 1 becomes the new generation's rank 0
    and drives it to the end, with the RNG state old rank 0 had at the epoch's start (old
    rank 2, now rank 1, with old rank 1's). The same parameters, bit for bit, with dropout
    and a stream per rank, as the job resumed on two ranks from a checkpoint of that
    epoch's start."""
    out = str(tmp_path / "replaced.pt")
    runs = run_ranks(outliving_url, 3, "replaced", out=out, elastic=True, die=[0, 1, 2], **COMMON)
    assert runs[0][0] == -9, "the driver was killed"
    for code, log in runs[1:]:
        assert code == 0, log[-3000:]
    assert "generation 1 carries on with 2 ranks without rank(s) [0]" in runs[1][1]
    replaced = torch.load(out, weights_only=False)  # written by the driver at the end: old rank 1
    assert [e["world_size"] for e in replaced["epochs"]] == [3, 2, 2]
    assert [(r["epoch"], r["lost"], r["world_size"]) for r in replaced["regroups"]] == [(1, [0], 2)]
    assert_same_params(replaced, resumed, rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_a_stop_in_an_epoch_that_goes_on_mid_way_resumes_where_it_stopped(tmp_path):
    """Rank 2 is killed at step 6 of epoch 0; the survivors go on from the snapshot after
    step 4 with the samples left. A SIGTERM there (rank 0, step 6 again) stops them with a
    checkpoint of that point; resumed on the two of them, the job ends bit for bit as the same
    elastic job that was never stopped."""
    job = {"epochs": 2, "dropout": 0.2, "batch": 4, "elastic": True, "snapshot_every": 2, "die": [2, 0, 5]}
    zmq = lambda: with_options(f"zmq://127.0.0.1:{free_port()}", **FAST)  # noqa: E731
    whole = run_ranks(zmq(), 3, "whole", out=str(tmp_path / "w.pt"), checkpoint=str(tmp_path / "w.ckpt"), **job)
    ckpt = str(tmp_path / "s.ckpt")
    stopped = run_ranks(zmq(), 3, "stopped", out=str(tmp_path / "s.pt"), checkpoint=ckpt, term_step=[0, 6], **job)
    assert [code for code, _ in whole] == [0, 0, -9], whole[0][1][-3000:]
    assert [code for code, _ in stopped] == [128 + 15, 128 + 15, -9], stopped[0][1][-3000:]
    assert "from epoch 0 after 4 batches (48 samples left)" in stopped[0][1]
    where = re.search(r"stopped by SIGTERM in epoch 0 after (\d) batches", stopped[0][1])
    assert where and int(where.group(1)) < 6, stopped[0][1][-3000:]  # of the 6 the samples left make
    resumed = run_ranks(zmq(), 2, "resumed", out=str(tmp_path / "r.pt"), checkpoint=ckpt, resume=True, **job)
    assert all(code == 0 for code, _ in resumed), resumed[0][1][-3000:]
    assert f"in epoch 0 after {where.group(1)} batches" in resumed[0][1]
    a, b = (
        torch.load(str(tmp_path / "w.pt"), weights_only=False),
        torch.load(str(tmp_path / "r.pt"), weights_only=False),
    )
    assert_same_params(a, b, rtol=0, atol=0)
    assert [e["train_samples"] for e in a["epochs"]] == [e["train_samples"] for e in b["epochs"]] == [96, 96]
