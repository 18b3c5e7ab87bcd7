"""Started by Slurm, unchanged: ``srun -n 3 python train.py`` on a real one-node cluster
(tests/slurmcluster.py: Debian's slurmctld, slurmd and munge). The ranks come from the
step's environment, the coordinator from the configuration or the step's first node."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobutil import digits_under
from slurmcluster import SlurmCluster, missing

import dataparallel as dp
from dataparallel.config import expand_hostlist, load_config
from dataparallel.launching import in_worker

STEP = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "123456"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.mark.parametrize(
    ("env", "url", "rank", "world"),
    [
        # the first node, 15000 + (123456 mod 1024) x 16 + step 0
        ({**STEP, "SLURM_STEP_NODELIST": "n[01-02]"}, "zmq://n01:24216", 2, 4),
        ({**STEP, "SLURM_STEP_NODELIST": "n07"}, "zmq://127.0.0.1:24216", 2, 4),  # one node: loopback
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_RESV_PORTS": "12000-12003"}, "zmq://n1:12000", 2, 4),
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-2]", "DP_URL": "grpc://10.0.0.1:9"}, "grpc://10.0.0.1:9", 2, 4),
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-2]", "DP_PORT": "7000"}, "zmq://n1:7000", 2, 4),
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-2]", "DP_RANK": "0"}, "zmq://n1:24216", 0, 4),
    ],
)
def test_an_srun_steps_environment_gives_the_ranks_and_the_coordinator(env, url, rank, world):
    config = load_config(env=env)
    assert (config.url, config.rank, config.world_size, config.local_rank) == (url, rank, world, 0)
    assert in_worker(env)


def slurm_port_of(job: int, step: int, **extra: str) -> int:
    env = {**STEP, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step), "SLURM_STEP_NODELIST": "n[1-2]", **extra}
    config = load_config(env=env)
    assert config.url is not None
    return int(config.url.rsplit(":", 1)[1])


def test_two_jobs_or_two_steps_sharing_a_first_node_get_different_ports():
    """Jobs 10042 and 20042, and two steps of one job, once all met on 15000 + the job id's
    last four digits; the port is derived from the job id and the step id, and the limit the
    docs state is exact: the same port only for job ids equal mod 1024 and step ids mod 16."""
    assert slurm_port_of(10042, 0) != slurm_port_of(20042, 0)
    ports = {slurm_port_of(job, step) for job in range(5000, 5000 + 1024) for step in range(16)}
    assert len(ports) == 1024 * 16 and min(ports) >= 15000 and max(ports) < 32768  # below ephemeral ports
    assert slurm_port_of(7, 3) == slurm_port_of(7 + 1024, 3) and slurm_port_of(7, 3) == slurm_port_of(7, 3 + 16)
    # srun --resv-ports: ports no other step on the node holds, the first taken
    assert slurm_port_of(10042, 0, SLURM_STEP_RESV_PORTS="12000-12003") == 12000
    assert slurm_port_of(10042, 1, SLURM_STEP_RESV_PORTS="12004,12005") == 12004


def test_a_batch_script_itself_is_not_a_worker():
    """sbatch's script has SLURM_PROCID and SLURM_NTASKS but no step: it is where `srun`
    starts the workers (or `dataparallel launch`), not a rank."""
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_ID": "2"}
    assert not in_worker(batch)
    assert load_config(env=batch).rank is None


HOSTLISTS = ["node[01-04,07]", "vm", "a1,b[2-3],c", "rack[1-2]-n[08-10]", "gpu[9-11],x[007-008]"]


def test_host_lists_expand_as_slurms_scontrol_expands_them(cluster):
    for hostlist in HOSTLISTS:
        run = subprocess.run(
            ["scontrol", "show", "hostnames", hostlist],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **cluster.env},
        )
        assert run.returncode == 0, run.stderr
        assert expand_hostlist(hostlist) == run.stdout.split(), hostlist


@pytest.mark.timeout(180)
def test_the_digits_example_runs_unchanged_under_srun(cluster, tmp_path):
    digits_under(["srun", "-n", "3", "--kill-on-bad-exit=1"], tmp_path, **cluster.env)


def test_srun_tasks_as_node_launchers_each_host_its_nodes_relay(cluster, tmp_path):
    """``srun -n 2 dataparallel launch --relay --nprocs 2 train.py``: each of the step's tasks
    is one node's launcher (node SLURM_PROCID of the step's tasks, the coordinator where the
    step puts rank 0), which hosts its node's relay before starting its two workers; the four
    workers train through the relays."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "train_digits.py")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DP_", "SLURM_", "OMPI_", "PMI"))}
    argv = ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, "-m", "dataparallel", "launch", "--relay"]
    run = subprocess.run(
        [*argv, "--nprocs", "2", script, "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=170,
        env={**clean, "OMP_NUM_THREADS": "1", **cluster.env},
        cwd=tmp_path,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "driver: 2 epochs on 4 processes over relay" in out, out[-3000:]
    for node in range(2):
        said = rf"node relay for ranks {2 * node}\.\.{2 * node + 1} at \S+ \(node {node} of 2 on zmq://"
        assert re.search(said, out), out


@pytest.mark.parametrize(
    ("env", "rank", "world"),
    [
        # Open MPI's mpirun inside an allocation starts its daemons with srun: the step is the node's.
        (
            {
                "SLURM_PROCID": "1",
                "SLURM_STEP_NUM_TASKS": "2",
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
            },
            5,
            8,
        ),
        # MPICH's mpiexec (Hydra) inside an allocation, the same with PMI's variables.
        ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "PMI_RANK": "5", "PMI_SIZE": "8"}, 5, 8),
        # srun --mpi=pmi2 sets PMI_RANK itself, equal: srun's rules (the coordinator's node) apply.
        ({**STEP, "PMI_RANK": "2", "PMI_SIZE": "4", "SLURM_STEP_NODELIST": "n[1-2]"}, 2, 4),
        # torchrun (or dataparallel launch) started inside a step: its ranks are the processes'.
        (
            {
                **STEP,
                "RANK": "7",
                "WORLD_SIZE": "16",
                "TORCHELASTIC_RUN_ID": "x",
                "MASTER_ADDR": "n1",
                "MASTER_PORT": "5",
            },
            7,
            16,
        ),
        (
            {
                **STEP,
                "RANK": "1",
                "WORLD_SIZE": "2",
                "GROUP_RANK": "0",
                "DP_RANK": "1",
                "DP_WORLD_SIZE": "2",
                "DP_URL": "zmq://n1:9",
            },
            1,
            2,
        ),
    ],
)
def test_the_innermost_launcher_gives_the_rank(env, rank, world):
    config = load_config(env={"SLURM_STEP_NODELIST": "n1", **env})
    assert (config.rank, config.world_size) == (rank, world)
    if "PMI_RANK" in env and env["PMI_RANK"] == env["SLURM_PROCID"]:
        assert config.url == "zmq://n1:24216"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"RANK": "0"}, "two launchers disagree on this process's rank: RANK=0 and SLURM_PROCID=2 (srun)"),
        (
            {"RANK": "2", "WORLD_SIZE": "9"},
            "disagree on this process's world size: WORLD_SIZE=9 and SLURM_STEP_NUM_TASKS=4",
        ),
    ],
)
def test_launchers_that_disagree_are_a_config_error_naming_both(extra, message):
    with pytest.raises(dp.ConfigError, match=re.escape(message)):
        load_config(env={**STEP, "SLURM_STEP_NODELIST": "n1", **extra})


@pytest.mark.timeout(120)
def test_check_env_says_what_slurm_started(cluster):
    env = {**os.environ, **cluster.env}
    argv = [sys.executable, "-m", "dataparallel", "check", "--env"]
    run = subprocess.run(["srun", "-n", "2", *argv], capture_output=True, text=True, timeout=90, env=env)
    assert run.returncode == 0, run.stderr
    for rank in (0, 1):
        assert re.search(
            rf"^Slurm job \d+ \(srun, step \d+\), rank {rank} of 2, local rank {rank}, coordinator zmq://127\.0\.0\.1:\d+$",
            run.stdout,
            re.M,
        ), run.stdout
    assert "  rank = 1 (from SLURM_PROCID)" in run.stdout
    # dataparallel launch under srun is a node's launcher (as torchrun is): 2 tasks = 2 nodes of 2
    # workers; its workers' ranks are theirs, no conflict with the step's.
    launch = [sys.executable, "-m", "dataparallel", "launch", "--nprocs", "2", "-m", "dataparallel", "check", "--env"]
    run = subprocess.run(["srun", "-n", "2", *launch], capture_output=True, text=True, timeout=90, env=env)
    assert run.returncode == 0, run.stderr
    for rank in range(4):
        node, local = divmod(rank, 2)
        assert (
            f"[rank {rank}] dataparallel launch (node {node} of 2), rank {rank} of 4, local rank {local}" in run.stdout
        )


@pytest.mark.timeout(300)
def test_scancel_signal_term_checkpoints_and_the_job_started_again_resumes(cluster, tmp_path):
    """Slurm's SIGTERM before a preemption (`scancel --signal=TERM`, as the preemption and the
    end of a time limit send it): every rank stops at one step, the driver checkpoints there,
    the ranks exit; the same srun again (a requeued job) resumes and ends as a run that was
    never stopped."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "train_digits.py")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DP_", "SLURM_", "OMPI_", "PMI"))}
    env = {**clean, "OMP_NUM_THREADS": "1", **cluster.env}

    def srun(name: str, *args: str, **kwargs):
        argv = ["srun", "-n", "3", "-J", name, "--kill-on-bad-exit=0", sys.executable, script, "--epochs", "4", *args]
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path
        )

    whole = srun("dp-whole", "--result", str(tmp_path / "whole.json"))
    out, _ = whole.communicate(timeout=200)
    assert whole.returncode == 0, out[-3000:]
    ckpt, result = str(tmp_path / "digits.ckpt"), str(tmp_path / "resumed.json")
    job = srun("dp-preempted", "--checkpoint", ckpt, "--result", result)
    assert job.stdout is not None
    for line in job.stdout:  # the driver's line for epoch 0: training is in epoch 1 now
        if line.startswith("epoch 0:"):
            break
    cancel = subprocess.run(
        ["scancel", "--signal=TERM", "--name", "dp-preempted"], capture_output=True, text=True, env=env, timeout=30
    )
    assert cancel.returncode == 0, cancel.stderr
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 128 + 15, out[-3000:]
    assert re.search(r"dataparallel: stopped by SIGTERM in epoch [123] after \d+ batches", out), out[-3000:]
    assert not Path(result).exists()
    again = srun("dp-preempted", "--checkpoint", ckpt, "--result", result)
    out, _ = again.communicate(timeout=200)
    assert again.returncode == 0, out[-3000:]
    assert "driver: 4 epochs on 3 processes" in out
    params, expected = torch.load(Path(result).with_suffix(".pt")), torch.load(tmp_path / "whole.pt")
    for name, tensor in expected.items():
        assert torch.equal(params[name], tensor), name


@pytest.mark.timeout(300)
def test_the_sbatch_example_runs_as_submitted(cluster, tmp_path):
    """examples/slurm/train.sbatch through sbatch (on this one node: -N1, three tasks), its
    token from $HOME/.dataparallel/token as the script says, two epochs."""
    home = tmp_path / "home"
    (home / ".dataparallel").mkdir(parents=True)
    token = home / ".dataparallel" / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DP_", "SLURM_", "OMPI_", "PMI"))}
    env = {**clean, **cluster.env, "HOME": str(home), "EPOCHS": "2", "PYTHON": sys.executable}
    env["CHECKPOINT"] = str(tmp_path / "digits.ckpt")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "job.out"
    argv = ["sbatch", "--wait", "-N1", "--ntasks-per-node=3", "--cpus-per-task=1", f"--output={out}"]
    run = subprocess.run(
        [*argv, "examples/slurm/train.sbatch"], capture_output=True, text=True, env=env, cwd=root, timeout=280
    )
    log = out.read_text() if out.exists() else ""
    assert run.returncode == 0, run.stderr + log[-3000:]
    assert "driver: 2 epochs on 3 processes over zmq" in log, log[-3000:]
    assert (tmp_path / "digits.ckpt").exists()
