"""Started by Slurm, unchanged: ``srun -n 3 python train.py`` on a real one-node cluster
(tests/slurmcluster.py: Debian's slurmctld, slurmd and munge). The ranks come from the
step's environment, the coordinator from the configuration or the step's first node."""

from __future__ import annotations

import os
import subprocess

import pytest
from jobutil import digits_under
from slurmcluster import SlurmCluster, missing

from dataparallel.config import expand_hostlist, load_config
from dataparallel.launcher import in_worker

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
        ({**STEP, "SLURM_STEP_NODELIST": "n[01-02]"}, "zmq://n01:18456", 2, 4),  # the first node, 15000 + id's last 4
        ({**STEP, "SLURM_STEP_NODELIST": "n07"}, "zmq://127.0.0.1:18456", 2, 4),  # one node: loopback
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-2]", "DP_URL": "grpc://10.0.0.1:9"}, "grpc://10.0.0.1:9", 2, 4),
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-2]", "DP_PORT": "7000"}, "zmq://n1:7000", 2, 4),
        ({**STEP, "SLURM_STEP_NODELIST": "n[1-2]", "DP_RANK": "0"}, "zmq://n1:18456", 0, 4),
    ],
)
def test_an_srun_steps_environment_gives_the_ranks_and_the_coordinator(env, url, rank, world):
    config = load_config(env=env)
    assert (config.url, config.rank, config.world_size, config.local_rank) == (url, rank, world, 0)
    assert in_worker(env)


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
