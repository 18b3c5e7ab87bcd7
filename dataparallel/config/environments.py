"""Where a process learns its place in a job from the program that started it: ``dataparallel
launch``, torchrun, Slurm's ``srun``, Open MPI's ``mpirun``, MPICH's and Intel MPI's Hydra,
or ``RANK``/``WORLD_SIZE`` alone (a Kubernetes ``PyTorchJob``); Slurm's host lists and
step ports. Read by :func:`dataparallel.config.load_config`, below the ``DP_*`` variables."""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..control.registry import locate
from ..errors import ConfigError

if TYPE_CHECKING:
    from .settings import JobConfig

DEFAULT_PORT = 29500  # the coordinator's port where a launcher gives none (mpirun)


#: torchrun's variables, read below the ``DP_*`` ones.
TORCHRUN = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}


@dataclass(frozen=True)
class LaunchEnvironment:
    """A program that starts a job's processes and tells each its place in the environment."""

    name: str
    title: str  # how check --env names it, formatted with the environment
    rank: str  # the variables of the process's rank, the world size, its local rank...
    size: str
    local_rank: str | None = None
    local_size: str | None = None  # ...and of the ranks on its host
    marker: str | None = None  # a variable that only this launcher sets beside them
    nests: bool = False  # it runs inside another launcher's processes: its ranks are the ones that count
    cluster: bool = False  # read by the cluster layer, below torchrun's and the DP_* variables

    def detects(self, env: Mapping[str, str]) -> bool:
        return all(env.get(var, "") != "" for var in (self.rank, self.size, self.marker) if var is not None)


#: The launch environments, the innermost first (one started inside another wins): dataparallel
#: launch and torchrun run inside any of the others; Open MPI's mpirun, inside a Slurm
#: allocation, starts its daemons with srun, so its ranks see a step's SLURM_PROCID too (the
#: node's); Slurm's srun (a step's tasks: the batch script itself has no SLURM_STEP_NUM_TASKS);
#: MPICH's and Intel MPI's Hydra (``srun --mpi=pmi2`` sets PMI_RANK too, equal to
#: SLURM_PROCID); then RANK and WORLD_SIZE alone, as Kubernetes operators set them.
LAUNCH_ENVIRONMENTS = (
    LaunchEnvironment(
        "dataparallel launch",
        "dataparallel launch (node {DP_NODE_RANK} of {DP_NODES})",
        "DP_RANK",
        "DP_WORLD_SIZE",
        "DP_LOCAL_RANK",
        "DP_NPROCS",
        nests=True,
    ),
    LaunchEnvironment(
        "torchrun",
        "torchrun (run {TORCHELASTIC_RUN_ID})",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        marker="TORCHELASTIC_RUN_ID",
        nests=True,
    ),
    LaunchEnvironment(
        "mpirun",
        "Open MPI (mpirun)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        cluster=True,
    ),
    LaunchEnvironment(
        "srun",
        "Slurm job {SLURM_JOB_ID} (srun, step {SLURM_STEP_ID})",
        "SLURM_PROCID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_LOCALID",
        cluster=True,
    ),
    LaunchEnvironment(
        "mpirun",
        "MPICH or Intel MPI (PMI)",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        cluster=True,
    ),
    LaunchEnvironment(
        "env://",
        "RANK and WORLD_SIZE (env://, as a Kubernetes PyTorchJob sets them)",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ),
)


#: The cluster launchers, read below torchrun's variables.
CLUSTER = tuple(e for e in LAUNCH_ENVIRONMENTS if e.cluster)


def from_torchrun(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {
        name: (env[var], var) for name, var in TORCHRUN.items() if env.get(var, "") != ""
    }
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        out["host"] = (env["MASTER_ADDR"], "MASTER_ADDR")
        out["port"] = (env["MASTER_PORT"], "MASTER_PORT")
        out["__torchrun_store"] = (True, "torchrun")
    # A restarted worker group must not meet the last group's keys in torchrun's store (it
    # outlives restarts): the job is named after the rendezvous round, which our rendezvous
    # handlers (dataparallel.launching.torchrun) publish. Failing that, the restart count, which is
    # the same on every node only when every node's workers failed (single-node jobs).
    # Under torchrun with one of our rendezvous backends (--rdzv-backend dp-zmq...), the
    # handler names its channel: the workers' default channel is the same coordinator.
    if env.get("DP_RDZV_URL", "") != "" and env.get("TORCHELASTIC_RUN_ID", "") != "":
        out["__rdzv_url"] = (env["DP_RDZV_URL"], "DP_RDZV_URL")
    if env.get("DP_RDZV_ROUND", "") != "":
        out["__restart"] = (f"round{env['DP_RDZV_ROUND']}", "DP_RDZV_ROUND")
    elif env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        out["__restart"] = (f"restart{env['TORCHELASTIC_RESTART_COUNT']}", "TORCHELASTIC_RESTART_COUNT")
    return out


def from_cluster(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Rank, world size and local rank from a cluster launcher (``srun python train.py``,
    ``mpirun -np N python train.py``: the environment says it all, no mpi4py). The coordinator
    is the configuration's, else ``MASTER_ADDR``/``MASTER_PORT`` (torchrun's layer reads them),
    else what the launcher tells (``__cluster``): with every rank on this host, loopback; under
    Slurm, the step's first node, at :func:`slurm_port`."""
    for found in CLUSTER:
        if not found.detects(env):
            continue
        launcher, rank, size = found.name, found.rank, found.size
        local_rank, local_size = found.local_rank, found.local_size
        if launcher == "srun" and env.get("PMI_RANK", env[rank]) != env[rank]:
            continue  # mpiexec (Hydra) inside an allocation: srun started its proxies, PMI has the ranks
        out: dict[str, tuple[Any, str]] = {"rank": (env[rank], rank), "world_size": (env[size], size)}
        if local_rank is not None and env.get(local_rank, "") != "":
            out["local_rank"] = (env[local_rank], local_rank)
        host, port = None, DEFAULT_PORT
        nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        if local_size and env.get(local_size, "") == env[size]:
            host = "127.0.0.1"
        elif launcher == "srun" or nodes:  # srun, or mpirun in an allocation: rank 0 on its first node
            host = "127.0.0.1" if len(nodes) <= 1 else nodes[0]
            port = slurm_port(env)
        local = host == "127.0.0.1"
        where = f"{launcher} ({'every rank on this host' if local else 'the first node, SLURM_STEP_NODELIST'})"
        out["__cluster"] = ({"launcher": launcher, "host": host, "port": port, "where": where}, size)
        return out
    return {}


#: Derived Slurm ports: 15000 + (job id mod 1024) x 16 + step id mod 16, within
#: 15000-31383 (below Linux's ephemeral ports, 32768 on).
SLURM_PORT_BASE, SLURM_JOBS, SLURM_STEPS = 15000, 1024, 16


def slurm_port(env: Mapping[str, str]) -> int:
    """The coordinator's port for a Slurm step: the first of the ports Slurm reserved for the
    step (``SLURM_STEP_RESV_PORTS``, ``srun --resv-ports`` with ``MpiParams=ports=...``: no
    other step on the node holds them), else one derived from the job id and the step id,
    ``15000 + (job id mod 1024) x 16 + step id mod 16``. Two derived ports are the same only
    where both job ids are equal mod 1024 and both step ids mod 16: two steps of one job
    differ when their ids differ by less than 16, two jobs when their ids differ by less
    than 1024 (or not by a multiple of it); beyond that they can meet on a shared first node,
    where a reserved port or ``DP_PORT`` is the way out. No job id: ``DEFAULT_PORT``."""
    reserved = env.get("SLURM_STEP_RESV_PORTS", "").split(",")[0].split("-")[0].strip()
    if reserved.isdigit():
        return int(reserved)
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "0")
    if not job.isdigit():
        return DEFAULT_PORT
    step_number = int(step) if step.isdigit() else 0  # "batch", "extern": not a step srun starts
    return SLURM_PORT_BASE + (int(job) % SLURM_JOBS) * SLURM_STEPS + step_number % SLURM_STEPS


def check_launchers_agree(
    cluster: Mapping[str, tuple[Any, str]], torchrun: Mapping[str, tuple[Any, str]], env: Mapping[str, str]
) -> None:
    """A cluster launcher's rank and world size and ``RANK``/``WORLD_SIZE`` must agree unless
    a launcher started this process inside the other's (torchrun under srun, ``dataparallel
    launch`` under mpirun: then the inner one's are the process's, below). A stale ``export
    RANK=0`` in a batch script would otherwise make every task rank 0."""
    if any(e.nests and e.detects(env) for e in LAUNCH_ENVIRONMENTS):
        return
    for name in ("rank", "world_size"):
        if name in cluster and name in torchrun and str(cluster[name][0]).strip() != str(torchrun[name][0]).strip():
            (theirs, their_var), (ours, our_var) = cluster[name], torchrun[name]
            launcher = cluster["__cluster"][0]["launcher"]
            raise ConfigError(
                f"two launchers disagree on this process's {name.replace('_', ' ')}: {our_var}={ours} and "
                f"{their_var}={theirs} ({launcher}); unset the stale one (or start the job with one launcher)"
            )


def describe_launch(config: JobConfig, env: Mapping[str, str] | None = None) -> str:
    """One line: which launcher started this process and its place in the job, as ``dataparallel
    check --env`` reports it, e.g. ``Slurm job 42 (srun), rank 3 of 8, local rank 1,
    coordinator zmq://node01:15672``."""
    env = os.environ if env is None else env
    source = config.origin.get("rank", "")
    found = next((e for e in LAUNCH_ENVIRONMENTS if e.rank == source and e.detects(env)), None)
    if found is not None:
        who = found.title.format_map(collections.defaultdict(lambda: "?", env))
    elif config.hosts:
        who = (
            f"a job over ssh on {len(config.hosts)} hosts, {sum(config.slots)} ranks (this is its launcher, not a rank)"
        )
    else:
        who = "no launcher: this process is no rank of a job (start it with launch, torchrun, srun or mpirun)"
    parts = [who]
    if config.rank is not None:
        parts.append(f"rank {config.rank} of {config.world_size if config.world_size is not None else '?'}")
    if config.local_rank is not None:
        parts.append(f"local rank {config.local_rank}")
    if config.url is not None:
        parts.append(f"coordinator {locate(config.url)[0].shown}")  # no password of the URL's
    return ", ".join(parts)


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list as host names, in order: ``node[01-03,07],gpu1`` ->
    ``node01 node02 node03 node07 gpu1`` (zero padding kept; several bracket groups in one
    name, ``rack[1-2]-n[1-2]``, expand as Slurm does, the first group outermost)."""
    names: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(hostlist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            if hostlist[start:i].strip():
                names += _expand_one(hostlist[start:i].strip())
            start = i + 1
    return names


def _expand_one(pattern: str) -> list[str]:
    opened = pattern.find("[")
    if opened < 0:
        return [pattern]
    closed = pattern.index("]", opened)
    head, ranges, tail = pattern[:opened], pattern[opened + 1 : closed], pattern[closed + 1 :]
    values: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not high:
            values.append(low)
            continue
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return [f"{head}{value}{rest}" for value in values for rest in _expand_one(tail)]


def in_worker(env: Mapping[str, str] | None = None) -> bool:
    """True in a process started by ``dataparallel launch``, torchrun, or a cluster launcher
    (``srun``, ``mpirun``)."""
    env = os.environ if env is None else env
    return any(e.detects(env) for e in LAUNCH_ENVIRONMENTS) or bool(env.get("DP_RANK") or env.get("RANK"))


def serves_store(env: Mapping[str, str], url: str) -> bool:
    """True when ``url`` is the TCPStore torchrun's agent serves for its workers
    (``TORCHELASTIC_USE_AGENT_STORE``, at ``MASTER_ADDR:MASTER_PORT``): no worker hosts it."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    try:
        parsed, _ = locate(url)
    except ConfigError:
        return False
    return parsed.scheme == "tcpstore" and [(h, str(p)) for h, p in parsed.hosts] == [
        (env.get("MASTER_ADDR"), env.get("MASTER_PORT"))
    ]
