"""Started by an MPI launcher, unchanged: ``mpirun -np 3 python train.py`` with Open MPI's
real mpirun (Debian's openmpi-bin, which .ci/run installs). The ranks come from the
launcher's environment, the coordinator from the configuration or, with every rank on one
host, loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from jobutil import digits_under

import dataparallel as dp
from dataparallel.config import load_config
from dataparallel.testing import free_port

OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_RANK": "1"}


@pytest.mark.parametrize(
    ("env", "url", "rank", "world", "local"),
    [
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, "zmq://127.0.0.1:29500", 1, 3, 1),
        (
            {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "DP_TRANSPORT": "grpc", "DP_PORT": "4000"},
            "grpc://127.0.0.1:4000",
            1,
            3,
            1,
        ),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "7"},
            "tcpstore://10.0.0.1:7",
            0,
            2,
            None,
        ),
        (
            {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "DP_URL": "etcd://10.0.0.9:2379"},
            "etcd://10.0.0.9:2379",
            1,
            3,
            1,
        ),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "DP_RANK": "2"}, "zmq://127.0.0.1:29500", 2, 3, 1),
    ],
)
def test_mpi_launchers_environment_gives_the_ranks(env, url, rank, world, local):
    config = load_config(env=env)
    assert (config.url, config.rank, config.world_size, config.local_rank) == (url, rank, world, local)


def test_mpirun_across_hosts_needs_the_coordinator_named():
    with pytest.raises(dp.ConfigError, match="mpirun started ranks on several hosts: say where the coordinator is"):
        load_config(env={**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})


@pytest.mark.timeout(180)
def test_the_digits_example_runs_unchanged_under_open_mpi(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin)")
    # Where its coordinator listens: a free port, not the default, as tests run side by side.
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # CI runs as root
    digits_under([mpirun, "--oversubscribe", "-np", "3"], tmp_path, DP_PORT=str(free_port()), **root)


def test_check_env_says_what_mpirun_started():
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("Open MPI's mpirun is not installed (apt-get install openmpi-bin)")
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    argv = [mpirun, "--oversubscribe", "-np", "2", sys.executable, "-m", "dataparallel", "check", "--env"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=90, env={**os.environ, **root})
    assert run.returncode == 0, run.stderr
    for rank in (0, 1):
        assert (
            f"Open MPI (mpirun), rank {rank} of 2, local rank {rank}, coordinator zmq://127.0.0.1:29500" in run.stdout
        )
