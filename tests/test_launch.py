"""`dataparallel launch`: workers get their place in the job, output is prefixed with the
rank, the first failure stops the group and is the exit code, signals are forwarded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = r"""
import os, signal, sys, time
from pathlib import Path
import dataparallel as dp
rank = int(os.environ["DP_RANK"])
mode = sys.argv[1]
out = Path(sys.argv[2])
if mode == "job":
    ch = dp.connect()  # everything from the launcher's environment
    ch.rendezvous()
    got = ch.all_gather("hello", f"{ch.rank}:{os.environ['LOCAL_RANK']}:{os.environ['WORLD_SIZE']}".encode())
    print("gathered", sorted(v.decode() for v in got), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    ch.close()
elif mode == "relayed":  # behind the node's relay (launch --relay)
    import stat
    import torch, torch.distributed as dist
    ch = dp.connect()
    sock = Path(os.environ["DP_URL"].removeprefix("relay://"))
    modes = [stat.S_IMODE(sock.parent.stat().st_mode), stat.S_IMODE(sock.stat().st_mode)]
    ch.rendezvous()
    got = sorted(v.decode() for v in ch.all_gather("hello", f"{ch.rank}@{os.environ['DP_NODE_RANK']}".encode()))
    dist.init_process_group("gloo", store=ch.as_store(), rank=ch.rank, world_size=ch.world_size)
    t = torch.tensor([float(ch.rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    print("relayed", type(ch).__name__, f"{modes[0]:o}/{modes[1]:o}", got, t.item(), flush=True)
    ch.barrier("end")
    ch.close()
elif mode == "fit":  # a small dp.fit with its progress bar asked for, and a print
    import torch
    from torch.utils.data import TensorDataset
    ch = dp.connect()
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(1, keepdim=True))
    options = dp.TrainOptions(epochs=2, batch_size=8, log_every=2)
    dp.fit(ch, torch.nn.Linear(4, 1), torch.nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01),
           data, data, options=options)
    print(f"rank {ch.rank} done", flush=True)
    ch.close()
elif mode == "fail":
    if rank == 1:  # fails once the others can take SIGTERM (their handlers set, however slow the start)
        for _ in range(6000):
            if out.with_name("ready0").exists() and out.with_name("ready2").exists():
                break
            time.sleep(0.01)
        sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *a: (out.with_name(f"term{rank}").write_text("x"), sys.exit(0)))
    out.with_name(f"ready{rank}").write_text("x")
    time.sleep(60)
elif mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out.with_name(f"ready{rank}").write_text("x")
    if rank == 0:
        while not out.with_name("ready1").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
elif mode == "wait":
    signal.signal(signal.SIGTERM, lambda *a: (out.with_name(f"term{rank}").write_text("x"), sys.exit(0)))
    out.with_name(f"ready{rank}").write_text("x")
    time.sleep(60)
"""


def _launch(tmp_path: Path, mode: str, *flags: str, **popen) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    argv = [sys.executable, "-m", "dataparallel", "launch", *flags, str(script), mode, str(tmp_path / "out")]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, **popen)


@pytest.mark.timeout(120)
def test_workers_get_their_ranks_and_prefixed_output(tmp_path):
    proc = _launch(tmp_path, "job", "--nprocs", "3", "--job", "launch-test")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if "gathered" in line]
    assert len(lines) == 3
    for rank in range(3):
        assert f"[rank {rank}] gathered ['0:0:3', '1:1:3', '2:2:3']" in lines
        assert f"[rank {rank}] to stderr" in err
    assert "node 0/1: ranks 0..2 of 3 on zmq://127.0.0.1:" in err and "(job 'launch-test')" in err


@pytest.mark.timeout(120)
def test_second_node_gets_the_next_ranks(tmp_path):
    # Node 1 of 2 (2 workers each): ranks 2 and 3 of 4. A job across nodes runs in test_multihost.py.
    script = tmp_path / "show.py"
    script.write_text("import os; print(os.environ['DP_RANK'], os.environ['LOCAL_RANK'], os.environ['DP_WORLD_SIZE'])")
    run = subprocess.run(
        [sys.executable, "-m", "dataparallel", "launch", "--url", "zmq://127.0.0.1:1", "--nodes", "2",
         "--node-rank", "1", "--nprocs", "2", str(script)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.splitlines()) == ["[rank 2] 2 0 4", "[rank 3] 3 1 4"]


@pytest.mark.timeout(120)
def test_relay_on_one_node_with_the_default_transport(tmp_path):
    """``--relay`` alone: the launcher hosts the coordinator and the node's relay; the three
    workers reach the job through it."""
    proc = _launch(tmp_path, "relayed", "--relay", "--nprocs", "3")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    lines = sorted(line for line in out.splitlines() if "relayed" in line)
    assert lines == [f"[rank {r}] relayed RelayedChannel 700/600 ['0@0', '1@0', '2@0'] 6.0" for r in range(3)], out
    assert "[launch] node relay for ranks 0..2 at " in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_relay_joins_the_job_stops_the_launch_as_128_plus_n(tmp_path, sig):
    """Node 1 of 2 with no node 0: its launcher waits to join the job before any worker
    starts; a signal then ends it with 128 + N and one line, no traceback."""
    from dataparallel.testing import free_port

    url = f"zmq://127.0.0.1:{free_port()}"
    proc = _launch(tmp_path, "relayed", "--relay", "--url", url, "--nodes", "2", "--node-rank", "1", "--nprocs", "1",
                   "--timeout", "30")  # fmt: skip
    for line in proc.stderr:
        if "[launch] joining the job as node 1 of 2" in line:
            break
    time.sleep(0.5)  # in the join's wait (its signal handling is set before that line)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert f"[launch] stopped by signal {sig} ({signal.Signals(sig).name})" in err, err
    assert "Traceback" not in err, err


def test_the_relay_directory_is_short_enough_for_its_socket_wherever_tmpdir_points(tmp_path, monkeypatch):
    import stat
    import tempfile

    from dataparallel.launching.relay import _relay_directory

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = Path(_relay_directory())
    try:
        assert len(str(made / "relay.sock")) < 108 and made.parent == Path("/tmp"), made
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
    finally:
        made.rmdir()
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # a short TMPDIR is used as it is
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        made = Path(_relay_directory())
        assert made.parent == short
        made.rmdir()
    finally:
        short.rmdir()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["zmq", "grpc", "tcpstore", "etcd"])
def test_each_nodes_launcher_hosts_a_relay_its_workers_reach_the_job_through(tmp_path, kind, request):
    """``--relay`` on two nodes of two workers: each node's launcher joins the job as one
    member before its workers start; its workers connect through it (relay://, a directory
    of mode 0700 and a socket of 0600), meet, gather and all-reduce with gloo as one job of
    four, and the relay's directory is gone when the launcher ends."""
    from dataparallel.testing import free_port

    if kind == "etcd":
        from etcdserver import EtcdServer, require_etcd

        require_etcd()
        server = EtcdServer(tmp_path / "etcd").start().wait_ready()
        request.addfinalizer(server.stop)
        url = server.url
    else:
        url = f"{kind}://127.0.0.1:{free_port()}"
    procs = [
        _launch(tmp_path, "relayed", "--relay", "--url", url, "--nodes", "2", "--node-rank", str(n), "--nprocs", "2")
        for n in (1, 0)  # node 1 first: its relay waits for the coordinator node 0's launcher serves
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    lines = sorted(line for out, _ in outs for line in out.splitlines() if "relayed" in line)
    assert lines == [
        f"[rank {r}] relayed RelayedChannel 700/600 ['0@0', '1@0', '2@1', '3@1'] 10.0" for r in range(4)
    ], outs
    for _, err in outs:
        where = [line.split(" at ")[1].split(" ")[0] for line in err.splitlines() if "node relay for ranks" in line]
        assert len(where) == 1, err[-3000:]
        assert not Path(where[0]).parent.exists()


@pytest.mark.timeout(120)
def test_an_elastic_world_size_range_reaches_the_workers_training_options(tmp_path):
    """``--elastic --world-size 2:5 --nprocs 2``: two workers start (nodes x nprocs), and
    each one's training (its TrainOptions left None, resolved from the configuration its
    channel carries: ``channel.config``, what ``dp.load_config`` gives) carries on with at
    least 2 and admits newcomers up to 5."""
    script = tmp_path / "bounds.py"
    script.write_text(
        "import os, dataparallel as dp; from dataparallel.train.spec import resolve_settings; "
        "o = resolve_settings(dp.TrainOptions(), dp.load_config()); "
        "print(os.environ['DP_WORLD_SIZE'], o.elastic, o.min_world_size, o.max_world_size)"
    )
    run = subprocess.run(
        [sys.executable, "-m", "dataparallel", "launch", "--url", "zmq://127.0.0.1:1", "--elastic",
         "--world-size", "2:5", "--nprocs", "2", str(script)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.splitlines()) == ["[rank 0] 2 True 2 5", "[rank 1] 2 True 2 5"]


ENV_SCRIPT = r"""
import os
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://, as a torchrun script does: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
env = os.environ
print("sum", total.item(), "threads", env["OMP_NUM_THREADS"], "run", env["TORCHELASTIC_RUN_ID"], flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [None, "3"])
def test_an_unmodified_torchrun_script_runs_under_launch(tmp_path, threads):
    """torchrun's environment (MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID) beside DP_*, and
    OMP_NUM_THREADS set to cores / workers where the user did not set it."""
    import os

    script = tmp_path / "env_script.py"
    script.write_text(ENV_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("DP_")}
    if threads:
        env["OMP_NUM_THREADS"] = threads
    run = subprocess.run(
        [sys.executable, "-m", "dataparallel", "launch", "--nprocs", "2", "--job", "envjob", str(script)],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    expected = threads or str(max(1, len(os.sched_getaffinity(0)) // 2))
    lines = sorted(line for line in run.stdout.splitlines() if " sum " in line)
    assert lines == [f"[rank {r}] sum 3.0 threads {expected} run envjob" for r in (0, 1)]
    said = "[launch] OMP_NUM_THREADS=" in run.stderr
    assert said == (threads is None), run.stderr


@pytest.mark.timeout(120)
def test_first_failure_stops_the_group_and_is_the_exit_code(tmp_path):
    start = time.monotonic()
    proc = _launch(tmp_path, "fail", "--nprocs", "3")
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 3, err
    assert time.monotonic() - start < 30
    assert "[launch] rank 1 exited with exit code 3; stopping ranks 0, 2" in err
    assert (tmp_path / "term0").exists() and (tmp_path / "term2").exists()  # SIGTERM first: a clean exit


@pytest.mark.timeout(120)
def test_killed_worker_and_stubborn_ones(tmp_path):
    # Rank 0 dies of SIGKILL; the others ignore SIGTERM and are killed after the grace period.
    proc = _launch(tmp_path, "stubborn", "--nprocs", "2", "--grace", "1")
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "rank 0 exited with signal SIGKILL" in err
    assert "killing rank 1 (no exit within 1s)" in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded(tmp_path, sig):
    proc = _launch(tmp_path, "wait", "--nprocs", "2")
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    if sig == signal.SIGTERM:
        assert all((tmp_path / f"term{r}").exists() for r in range(2))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "2", "--nprocs", "1"], "a job on several nodes needs a transport every node can reach"),
        (["--nprocs", "2", "--world-size", "3"], "does not match nodes x nprocs = 1 x 2 = 2"),
        (["--nprocs", "0"], "nprocs (from --nprocs) must be >= 1"),
        (["--url", "bogus://h:1"], "unknown transport scheme 'bogus'"),
        (["--relay", "--elastic"], "relay (from --relay) and elastic (from --elastic) together"),
    ],
)
def test_bad_launch_settings(tmp_path, flags, message):
    run = subprocess.run(
        [sys.executable, "-m", "dataparallel", "launch", *flags, "x.py"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2
    assert message in run.stderr


def test_help_and_version():
    run = subprocess.run([sys.executable, "-m", "dataparallel", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "dataparallel launch --url zmq://10.0.0.1:29500 --nodes 3" in run.stdout
    for command in ("launch", "serve", "check"):
        sub = subprocess.run(
            [sys.executable, "-m", "dataparallel", command, "--help"], capture_output=True, text=True, timeout=60
        )
        assert sub.returncode == 0 and "--config" in sub.stdout
    version = subprocess.run([sys.executable, "-m", "dataparallel", "--version"], capture_output=True, text=True)
    assert version.stdout.startswith("dataparallel ")


@pytest.mark.timeout(120)
def test_log_format_json_makes_every_output_line_a_json_object(tmp_path):
    """For log collectors: the launcher's own lines, every worker line (rank and stream
    named) and dp.fit's per-epoch metrics and step lines as fields of their own; no progress
    bar redraws (output to a pipe is not a terminal)."""
    proc = _launch(tmp_path, "fit", "--nprocs", "2", "--log-format", "json")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in (out + err).splitlines()]  # every line parses
    assert all("time" in r for r in records)
    assert any(r.get("source") == "launch" and "node 0/1" in r["message"] for r in records)
    assert {(r["rank"], r["message"]) for r in records if "done" in r.get("message", "")} == {
        (0, "rank 0 done"),
        (1, "rank 1 done"),
    }
    epochs = [r for r in records if r.get("event") == "epoch"]
    assert [(r["rank"], r["epoch"], r["world_size"]) for r in epochs] == [(0, 0, 2), (0, 1, 2)]
    assert epochs[0]["train_samples"] == 64 and epochs[0]["val_loss"] > 0
    steps = [r for r in records if r.get("event") == "step"]
    assert [r["step"] for r in steps] == [2, 4, 6, 8] and all(r["rank"] == 0 for r in steps)
    assert "\r" not in out + err


@pytest.mark.timeout(120)
def test_progress_goes_to_a_log_as_one_line_per_epoch(tmp_path):
    """Under launch the workers' output is a pipe: dp.fit prints one line per epoch in place
    of a progress bar's redraws."""
    proc = _launch(tmp_path, "fit", "--nprocs", "2")
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    epochs = [line for line in out.splitlines() if ": train loss" in line]
    assert len(epochs) == 2 and epochs[0].startswith("[rank 0] epoch 0: train loss "), out
    assert "val loss" in epochs[0] and "64 samples on 2 ranks" in epochs[0]
    assert "\r" not in out + err and "batch/s" not in err
