"""Real torchrun with our rendezvous backends: two torchrun agents (2 nodes x 1 process, on
this machine) meet through dp-zmq, dp-grpc and dp-etcd; the workers' script uses
`dp.connect()` unchanged; a worker that fails on the first attempt is restarted by torchrun
and the job completes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from etcdserver import EtcdServer, require_etcd

from dataparallel.testing import free_port

WORKER = r"""
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
import dataparallel as dp

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ch = dp.connect(timeout=60)  # torchrun's RANK/WORLD_SIZE/MASTER_*: its store is the channel
if restart == 0 and ch.rank == 1:
    sys.exit(7)  # the first attempt fails: torchrun restarts the whole worker group
ch.rendezvous()
dp.init_process_group(ch, timeout=60)
value = torch.tensor([float(ch.rank + 1)])
dist.all_reduce(value)
Path(sys.argv[1], f"rank{ch.rank}.json").write_text(
    json.dumps({"sum": value.item(), "restart": restart, "world": ch.world_size, "job": ch.job})
)
dist.destroy_process_group()
ch.close()
"""


def _torchrun(backend: str, endpoint: str, run_id: str, out: Path, script: Path, env: dict) -> list[subprocess.Popen]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    argv = [
        torchrun,
        "--nnodes", "2",
        "--nproc-per-node", "1",
        "--rdzv-backend", backend,
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", run_id,
        "--rdzv-conf", "join_timeout=60,read_timeout=30",
        "--max-restarts", "1",
        "--monitor-interval", "0.2",
        str(script), str(out),
    ]  # fmt: skip
    return [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for _ in range(2)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["dp-zmq", "dp-grpc", "dp-etcd"])
def test_two_torchrun_nodes_rendezvous_and_restart(backend, tmp_path):
    server = None
    if backend == "dp-etcd":
        require_etcd()
        server = EtcdServer(tmp_path / "etcd").start().wait_ready()
        endpoint = f"127.0.0.1:{server.client_port}"
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    env.update(OMP_NUM_THREADS="1", DP_TOKEN="torchrun-test")
    try:
        agents = _torchrun(backend, endpoint, f"job-{backend}", out, script, env)
        logs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        if server is not None:
            server.stop()
    for agent, log in zip(agents, logs, strict=True):
        assert agent.returncode == 0, log[-4000:]
    assert any("exitcode: 7" in log or "exitcode  : 7" in log or "exit code 7" in log.lower() for log in logs), (
        "the first attempt's failure should be visible\n" + "\n".join(log[-2000:] for log in logs)
    )
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["sum"], r["world"]) for r in results] == [(3.0, 2), (3.0, 2)]
    # The node whose worker failed counts a restart, the other does not: the job is named
    # after the rendezvous round, the same for both.
    assert 1 in {r["restart"] for r in results}
    assert results[0]["job"] == results[1]["job"] and results[0]["job"].startswith("default.round")


def test_handlers_are_registered_with_torch():
    from torch.distributed.elastic.rendezvous import registry

    registry._register_out_of_tree_handlers()
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    for name in ("dp-etcd", "dp-zmq", "dp-grpc"):
        assert rendezvous_handler_registry._registry.get(name) is not None, name
