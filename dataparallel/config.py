"""Job configuration from a TOML file, ``DP_*`` environment variables and flags.

Precedence, highest first: flags (or keyword arguments), ``DP_*`` variables, torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), a
cluster launcher's (Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
``SLURM_LOCALID``, ``SLURM_STEP_NODELIST``; Open MPI's ``OMPI_COMM_WORLD_*``; MPICH's and
Intel MPI's ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``), the file, defaults. The file
is ``--config``/``DP_CONFIG``, else ``./dataparallel.toml`` if it exists. Every setting has
the same name in all three places::

    # dataparallel.toml            environment           flag
    transport = "zmq"            # DP_TRANSPORT          --transport   (a scheme, or a whole URL)
    host = "10.0.0.1"            # DP_HOST               --host
    port = 29500                 # DP_PORT               --port
    # url = "zmq://10.0.0.1:29500?curve=1"   DP_URL      --url         (instead of the three above)
    job = "digits"               # DP_JOB                --job
    world_size = 8               # DP_WORLD_SIZE         --world-size  ("2:8": elastic bounds, see below)
    timeout = 300                # DP_TIMEOUT            --timeout     (seconds)
    token_file = "/etc/dp/token" # DP_TOKEN (the token)  --token-file
    nprocs = 4                   # DP_NPROCS             --nprocs      (launch: workers per node)
    nodes = 2                    # DP_NODES              --nodes
    node_rank = 0                # DP_NODE_RANK          --node-rank
    max_restarts = 0             # DP_MAX_RESTARTS       --max-restarts (launch: restart a failed group)
    elastic = false              # DP_ELASTIC            --elastic     (a lost follower ends nothing: dp.fit regroups)
    min_world_size = 2           # DP_MIN_WORLD_SIZE     --min-world-size (elastic: fewer left ends the job)
    max_world_size = 8           # DP_MAX_WORLD_SIZE     --max-world-size (elastic: newcomers up to this)
    log_format = "text"          # DP_LOG_FORMAT         --log-format  ("json": launch writes one JSON object per line)
    [options]                    # DP_OPTIONS="a=1&b=2"  --option a=1  (URL query options)
    curve = 1

``world_size = "MIN:MAX"`` sets ``min_world_size`` and ``max_world_size`` (the bounds of an
elastic job) and leaves the starting size to ``dataparallel launch`` (nodes x nprocs) or to
``DP_WORLD_SIZE``.

``rank`` and ``local_rank`` come from ``DP_RANK``/``DP_LOCAL_RANK`` (set by ``dataparallel
launch``) or torchrun's ``RANK``/``LOCAL_RANK``. Under torchrun with no transport configured,
the job uses the channel of torchrun's rendezvous when that is one of ours (``--rdzv-backend
dp-zmq`` and the like: ``DP_RDZV_URL``), else torchrun's own TCPStore
(``tcpstore://MASTER_ADDR:MASTER_PORT``); another transport defaults to ``MASTER_ADDR`` and
``MASTER_PORT + 1``.

Every bad value raises :class:`ConfigError` naming the setting and where it came from.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .errors import ConfigError
from .registry import MASK, is_secret_option, locate, mask_url

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_FILE = "dataparallel.toml"
DEFAULT_JOB = "default"
#: Where the coordinator's host came from when the hosts placed it (the first of them).
PLACED = "the first of the hosts"
DEFAULT_PORT = 29500  # the coordinator's port where a launcher gives none (mpirun)
DEFAULT_TIMEOUT = 300.0


class Setting(NamedTuple):
    """One job setting: its type, its ``DP_*`` variable (None: none), its default as a user
    reads it, and what it means (the flag's help; the configuration reference)."""

    kind: type
    env: str | None
    default: str
    meaning: str


#: Every setting, by its name: the file key; the flag is ``--`` and the name with dashes
#: (``options``: ``--option KEY=VALUE``, repeatable); the reference's configuration table.
SETTINGS: dict[str, Setting] = {
    "url": Setting(
        str,
        "DP_URL",
        "none; launch on one node: zmq://127.0.0.1 on a free port",
        "channel URL, e.g. zmq://10.0.0.1:29500, grpc://...?tls=1, etcd://h:2379 (instead of transport, host and port)",
    ),
    "transport": Setting(
        str,
        "DP_TRANSPORT",
        "zmq, given host and port",
        "transport scheme (zmq, grpc, etcd, tcpstore, memory or a registered one) with host and port",
    ),
    "host": Setting(str, "DP_HOST", "none; srun, mpirun, hosts: the first host", "coordinator (or etcd) host"),
    "port": Setting(
        int,
        "DP_PORT",
        f"none; mpirun: {DEFAULT_PORT}, srun: the step's reserved port, else 15000 + (job id mod 1024) x 16 + "
        "step id mod 16",
        "coordinator (or etcd) port",
    ),
    "options": Setting(
        dict,
        "DP_OPTIONS",
        "none",
        "URL query options: a table in the file, a=1&b=2 in DP_OPTIONS, --option a=1 repeated",
    ),
    "job": Setting(str, "DP_JOB", DEFAULT_JOB, "job name: jobs on one coordinator are kept apart by it"),
    "world_size": Setting(int, "DP_WORLD_SIZE", "nodes x nprocs", "total workers"),
    "rank": Setting(
        int, "DP_RANK", "from the launcher", "this process's rank (set by dataparallel launch, torchrun, srun, mpirun)"
    ),
    "local_rank": Setting(int, "DP_LOCAL_RANK", "from the launcher", "this process's rank on its host (its GPU)"),
    "timeout": Setting(float, "DP_TIMEOUT", f"{DEFAULT_TIMEOUT:g}", "seconds any control call may block"),
    "token_file": Setting(
        str,
        None,
        "none; DP_TOKEN holds the token itself",
        "file holding the job token (relative to the file naming it)",
    ),
    "nprocs": Setting(int, "DP_NPROCS", "one per GPU, else 1", "workers on this node"),
    "nodes": Setting(int, "DP_NODES", "1", "number of nodes"),
    "node_rank": Setting(int, "DP_NODE_RANK", "0", "this node's index, 0..nodes-1"),
    "max_restarts": Setting(
        int, "DP_MAX_RESTARTS", "0", "restart a failed worker group up to N times (resume from a checkpoint)"
    ),
    "elastic": Setting(
        bool,
        "DP_ELASTIC",
        "false",
        "a rank that dies ends nothing: the others carry on (dp.fit regroups without it), newcomers join",
    ),
    "min_world_size": Setting(
        int, "DP_MIN_WORLD_SIZE", "1", "elastic: the fewest ranks that carry on (TrainOptions.min_world_size)"
    ),
    "max_world_size": Setting(
        int,
        "DP_MAX_WORLD_SIZE",
        "the starting world size",
        "elastic: the most ranks, newcomers admitted (TrainOptions.max_world_size)",
    ),
    "log_format": Setting(
        str,
        "DP_LOG_FORMAT",
        "text",
        "json: every output line of launch one JSON object (time, rank, stream, message; "
        "dp.fit's per-epoch metrics as fields) for log collectors",
    ),
    "hosts": Setting(
        str,
        "DP_HOSTS",
        "none",
        "start the job on these hosts over ssh: HOST:SLOTS,HOST:SLOTS... (a list in the file)",
    ),
    "hostfile": Setting(str, "DP_HOSTFILE", "none", "the same from a file: one 'HOST slots=N' a line, # comments"),
}


def flag_of(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return "--option" if name == "options" else f"--{name.replace('_', '-')}"


#: The settings that take one of a few words.
CHOICES: dict[str, tuple[str, ...]] = {"log_format": ("text", "json")}
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


@dataclass(frozen=True)
class JobConfig:
    """A resolved job configuration. ``origin`` says where each value came from."""

    url: str | None
    job: str = DEFAULT_JOB
    world_size: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    token: str | None = field(default=None, repr=False)
    timeout: float = DEFAULT_TIMEOUT
    nprocs: int | None = None
    nodes: int = 1
    node_rank: int = 0
    max_restarts: int = 0
    elastic: bool = False
    min_world_size: int | None = None
    max_world_size: int | None = None
    log_format: str = "text"
    #: The job's hosts and their slots (workers; None: ``nprocs``, else 1), from ``hosts``
    #: (``h1:2,h2:2``) or ``hostfile``: ``dataparallel launch`` starts each over ssh.
    hosts: tuple[tuple[str, int | None], ...] = ()
    origin: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def slots(self) -> list[int]:
        """Workers per host of ``hosts``: each host's slots, else ``nprocs``, else 1."""
        return [count or self.nprocs or 1 for _, count in self.hosts]

    def describe(self, name: str) -> str:
        return f"{name} (from {self.origin.get(name, 'default')})"

    def shown(self, name: str) -> str:
        """Setting ``name``'s value as output shows it: the URL's secrets masked
        (:func:`dataparallel.registry.mask_url`), the token never."""
        value = getattr(self, name)
        if name == "token":
            return MASK if value else "none"
        return mask_url(value) if name == "url" and value is not None else str(value)

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={self.shown(f.name) if f.name == 'url' and self.url else getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.repr
        )
        return f"JobConfig({fields})"

    def require(self, name: str) -> Any:
        """The value of ``name``; :class:`ConfigError` saying how to set it when it is unset."""
        value = getattr(self, name)
        if value is None:
            how = {
                "url": "url (or transport, host and port) in dataparallel.toml, DP_URL (or DP_TRANSPORT, "
                "DP_HOST, DP_PORT), or --url",
                "world_size": "world_size in dataparallel.toml, DP_WORLD_SIZE, or --world-size",
            }.get(name, name)
            raise ConfigError(f"no {name.replace('url', 'transport')} configured: set {how}")
        return value


#: A value in :func:`load_config`'s ``flags`` that says "given, as none": no lower layer
#: supplies that setting (``dp.connect(rank=None)`` asks for a rank to be assigned, whatever
#: ``DP_RANK`` says).
NONE: Any = object()


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | os.PathLike | None = None,
    *,
    given_by: str | None = None,
) -> JobConfig:
    """Resolve the configuration. ``flags`` holds explicit values (``None`` = not given,
    :data:`NONE` = given as none); ``env`` defaults to ``os.environ``; ``file`` to
    ``flags['config']``, ``DP_CONFIG`` or ``./dataparallel.toml`` when present. ``given_by``
    names the call whose arguments ``flags`` are (``dp.connect``: a value's origin reads
    ``dp.connect(rank=...)``); by default they are command-line flags."""
    cleared = {k for k, v in (flags or {}).items() if v is NONE}
    flags = {k: v for k, v in (flags or {}).items() if v is not None and v is not NONE}
    env = os.environ if env is None else env
    path, path_origin = _config_path(flags.pop("config", None) or file, env)
    layers: list[tuple[str, dict[str, Any]]] = []  # lowest precedence first
    if path is not None:
        layers.append((f"file {path}", _read_file(path, path_origin)))
    cluster, torchrun = _cluster(env), _torchrun(env)
    _agree(cluster, torchrun, env)
    layers.append(("cluster", cluster))
    layers.append(("torchrun", torchrun))
    layers.append(("env", _environment(env)))
    given = _check_keys(flags, "argument")
    if given_by is not None:
        given = {name: (value, f"{given_by}({name}=...)") for name, (value, _) in given.items()}
    layers.append(("flag", given))

    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    options: dict[str, str] = {}
    for source, layer in layers:
        for name, (raw, where) in layer.items():
            if name == "options":
                options.update(_as_options(raw, where))
                origin["options"] = where
                continue
            if name == "world_size" and isinstance(raw, str) and ":" in raw:  # "MIN:MAX": elastic bounds
                for bound, part in zip(("min_world_size", "max_world_size"), raw.split(":", 1), strict=True):
                    values[bound], origin[bound] = _coerce(bound, part, where), where
                continue
            values[name] = _coerce(name, raw, where)
            origin[name] = where
            if source != "torchrun" and name in ("url", "transport", "host", "port"):
                # An explicitly chosen transport is not re-pointed at torchrun's store.
                values.pop("__torchrun_store", None)
    for name in cleared:
        values.pop(name, None)
        origin.pop(name, None)
    token, origin["token"] = _token(values, origin, env)
    _hosts(values, origin)
    url = _url(values, origin, options)
    if "__restart" in values:  # torchrun restarted the workers: a fresh job, not the dead one's keys
        values["job"] = f"{values.get('job', DEFAULT_JOB)}.{values['__restart']}"
    config = JobConfig(
        url=url,
        job=values.get("job", DEFAULT_JOB),
        world_size=values.get("world_size"),
        rank=values.get("rank"),
        local_rank=values.get("local_rank"),
        token=token,
        timeout=values.get("timeout", DEFAULT_TIMEOUT),
        nprocs=values.get("nprocs"),
        nodes=values.get("nodes", 1),
        node_rank=values.get("node_rank", 0),
        max_restarts=values.get("max_restarts", 0),
        elastic=values.get("elastic", False),
        min_world_size=values.get("min_world_size"),
        max_world_size=values.get("max_world_size"),
        log_format=values.get("log_format", "text"),
        hosts=values.get("__hosts", ()),
        origin={k: v for k, v in origin.items() if not k.startswith("__")},
    )
    _validate(config)
    return config


# ---------------------------------------------------------------------------- sources
def _config_path(given: Any, env: Mapping[str, str]) -> tuple[Path | None, str]:
    if given:
        return Path(given), "--config"
    if env.get("DP_CONFIG"):
        return Path(env["DP_CONFIG"]), "DP_CONFIG"
    default = Path(DEFAULT_FILE)
    return (default, "default") if default.is_file() else (None, "")


def _read_file(path: Path, origin: str) -> dict[str, tuple[Any, str]]:
    try:
        text = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read the configuration file {str(path)!r} (from {origin}): {err.strerror}") from None
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{str(path)!r} is not valid TOML: {err}") from None
    where = f"file {path}"
    _check_keys(data, f"key in {path}")
    out = {name: (value, f"{where}: {name}") for name, value in data.items()}
    for name in ("token_file", "hostfile"):  # relative to the file that names them
        value = out[name][0] if name in out else None
        if isinstance(value, str):
            out[name] = (str(path.parent / Path(value).expanduser()), out[name][1])
    return out


def _check_keys(data: Mapping[str, Any], what: str) -> dict[str, tuple[Any, str]]:
    unknown = sorted(set(data) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown {what}: {', '.join(unknown)}; known settings: {', '.join(SETTINGS)}")
    if what != "argument":
        return {k: (v, what) for k, v in data.items()}
    return {k: (v, flag_of(k)) for k, v in data.items()}


def _environment(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out = {}
    for name, setting in SETTINGS.items():
        var = setting.env
        if var is not None and env.get(var, "") != "":
            out[name] = (env[var], var)
    return out


def _torchrun(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {
        name: (env[var], var) for name, var in TORCHRUN.items() if env.get(var, "") != ""
    }
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        out["host"] = (env["MASTER_ADDR"], "MASTER_ADDR")
        out["port"] = (env["MASTER_PORT"], "MASTER_PORT")
        out["__torchrun_store"] = (True, "torchrun")
    # A restarted worker group must not meet the last group's keys in torchrun's store (it
    # outlives restarts): the job is named after the rendezvous round, which our rendezvous
    # handlers (dataparallel.torchrun) publish. Failing that, the restart count, which is
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


def _cluster(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
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


def _agree(
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


def parse_hosts(text: str, where: str) -> list[tuple[str, int | None]]:
    """``h1:2,user@h2:4,h3`` as (host, slots) pairs (slots None where not given); an IPv6
    address in brackets, ``[fd00::1]:2``."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        host, slots = item, None
        head, sep, tail = item.rpartition(":")
        if sep and tail.isdigit() and (not head.count(":") or head.endswith("]")):
            host, slots = head, int(tail)
        out.append(_host_entry(host, slots, f"{item!r} (from {where})"))
    if not out:
        raise ConfigError(f"hosts (from {where}) names no host")
    return out


def read_hostfile(path: str | os.PathLike, where: str) -> list[tuple[str, int | None]]:
    """A host file as DeepSpeed and Open MPI write it: one host a line, ``HOST slots=N`` (or
    ``HOST:N``, or ``HOST`` alone), ``#`` starting a comment."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"cannot read the host file {str(path)!r} (from {where}): {err.strerror}") from None
    out = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        at = f"{path}:{number}"
        slots = [w for w in words[1:] if w.startswith("slots=")]
        if len(words) - 1 != len(slots) or len(slots) > 1:
            raise ConfigError(f"{at}: expected 'HOST slots=N', got {line.strip()!r}")
        if slots:
            count = slots[0].removeprefix("slots=")
            if not count.isdigit():
                raise ConfigError(f"{at}: slots must be a whole number, got {count!r}")
            out.append(_host_entry(words[0], int(count), at))
        else:
            out += parse_hosts(words[0], at)
    if not out:
        raise ConfigError(f"the host file {str(path)!r} (from {where}) names no host")
    return out


def _host_entry(host: str, slots: int | None, where: str) -> tuple[str, int | None]:
    if not host or host.startswith("-") or any(c.isspace() or c in "'\"`$;&|<>" for c in host):
        raise ConfigError(f"{where}: {host!r} is not a host name")
    if slots is not None and slots < 1:
        raise ConfigError(f"{where}: slots must be >= 1, got {slots}")
    return host, slots


def address_of(host: str) -> str:
    """The network address in an ssh destination: ``user@node1`` -> ``node1``, ``[fd00::1]`` -> ``fd00::1``."""
    return host.rpartition("@")[2].strip("[]")


def _hosts(values: dict[str, Any], origin: dict[str, str]) -> None:
    """``hosts`` or ``hostfile`` as ``__hosts``; the first host hosts the coordinator unless
    the configuration says otherwise (``__cluster``, as a cluster launcher places rank 0)."""
    if "rank" in values:  # a rank: its launcher placed it (the hosts are that launcher's business)
        values.pop("hosts", None)
        values.pop("hostfile", None)
        return
    if "hosts" in values and "hostfile" in values:
        raise ConfigError(f"both {origin['hosts']} and {origin['hostfile']} name the job's hosts: give one")
    if "hosts" in values:
        hosts = parse_hosts(values["hosts"], origin["hosts"])
    elif "hostfile" in values:
        hosts = read_hostfile(values["hostfile"], origin["hostfile"])
    else:
        return
    for name in ("nodes", "node_rank"):
        if name in values:
            where = origin.get("hosts") or origin["hostfile"]
            raise ConfigError(f"{name} (from {origin[name]}) and the hosts (from {where}) both place nodes: give one")
    seen: dict[str, str] = {}
    for host, _ in hosts:
        address = address_of(host)
        if address in seen:
            raise ConfigError(
                f"{address} is named twice in the hosts ({seen[address]!r} and {host!r}): give each "
                "host once, with all its slots (two launchers on one host would share its GPUs and local ranks)"
            )
        seen[address] = host
    values["__hosts"] = tuple(hosts)
    values["nodes"] = len(hosts)
    origin["nodes"] = origin.get("hosts") or origin["hostfile"]
    if "__cluster" not in values:
        first = address_of(hosts[0][0])
        values["__cluster"] = {
            "launcher": "ssh",
            "host": first,
            "port": DEFAULT_PORT,
            "where": PLACED,
        }


def load_token(env: Mapping[str, str] | None = None, file: str | os.PathLike | None = None) -> tuple[str | None, str]:
    """The job token and where it came from, resolved as :func:`load_config` resolves it
    (``DP_TOKEN``, else the configuration file's ``token_file``) without reading any other
    setting: for the torchrun backends, whose agent is no rank of a job and takes the rest
    from torchrun's own flags. (None, "default") when none is configured."""
    env = os.environ if env is None else env
    path, path_origin = _config_path(file, env)
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    if path is not None:
        data = _read_file(path, path_origin)
        if "token_file" in data:
            raw, where = data["token_file"]
            values["token_file"], origin["token_file"] = _coerce("token_file", raw, where), where
    return _token(values, origin, env)


def _token(values: dict[str, Any], origin: dict[str, str], env: Mapping[str, str]) -> tuple[str | None, str]:
    # Flags > environment > file: --token-file beats DP_TOKEN, which beats the file's token_file.
    path = values.get("token_file")
    from_flag = path is not None and origin.get("token_file") == "--token-file"
    if env.get("DP_TOKEN") and not from_flag:
        return env["DP_TOKEN"], "DP_TOKEN"
    if path is None:
        return None, "default"
    file = Path(path).expanduser()
    try:
        mode = file.stat().st_mode
        token = file.read_text().strip()
    except OSError as err:
        raise ConfigError(f"cannot read {origin['token_file']} = {path!r}: {err.strerror}") from None
    if mode & 0o077:  # as OpenSSH does with a private key: a secret others can read is no secret
        raise ConfigError(
            f"{origin['token_file']} = {path!r} is accessible by other users (mode {mode & 0o777:o}); "
            f"run: chmod 600 {path}"
        )
    if not token:
        raise ConfigError(f"{origin['token_file']} = {path!r} is empty")
    return token, origin["token_file"]


# ---------------------------------------------------------------------------- values
def _coerce(name: str, raw: Any, where: str) -> Any:
    if name.startswith("__"):
        return raw
    if name == "hosts" and isinstance(raw, list) and all(isinstance(item, str) for item in raw):
        raw = ",".join(raw)  # hosts = ["node1:2", "node2:2"] in the file
    kind = SETTINGS[name].kind
    if kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise ConfigError(f"{name} (from {where}) must be an integer, got {raw!r}")
        try:
            return int(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{name} (from {where}) must be an integer, got {raw!r}") from None
    if kind is bool:
        text = str(raw).strip().lower() if not isinstance(raw, bool) else ("true" if raw else "false")
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{name} (from {where}) must be true or false (1/0, yes/no), got {raw!r}")
    if kind is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise ConfigError(f"{name} (from {where}) must be a number, got {raw!r}")
        try:
            return float(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{name} (from {where}) must be a number, got {raw!r}") from None
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"{name} (from {where}) must be a non-empty string, got {raw!r}")
    if name in CHOICES and raw.strip() not in CHOICES[name]:
        raise ConfigError(f"{name} (from {where}) must be one of {', '.join(CHOICES[name])}, got {raw!r}")
    return raw.strip()


def _as_options(raw: Any, where: str) -> dict[str, str]:
    items: list[tuple[Any, Any]]
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, str):
        items = parse_qsl(raw, keep_blank_values=True)
    elif isinstance(raw, list | tuple):  # --option k=v, repeated
        items = []
        for item in raw:
            key, sep, value = str(item).partition("=")
            if not sep or not key:
                raise ConfigError(f"option {key or MASK!r} (from {where}) must be KEY=VALUE")
            items.append((key, value))
    else:
        raise ConfigError(f"options (from {where}) must be a table of KEY = VALUE, got {raw!r}")
    out = {}
    for key, value in items:
        if not isinstance(value, str | int | float):  # bool is an int: true -> "1"
            shown = MASK if is_secret_option(str(key)) else repr(value)
            raise ConfigError(f"option {key!r} (from {where}) must be a string or number, got {shown}")
        out[str(key)] = str(int(value)) if isinstance(value, bool) else str(value)
    return out


def _url(values: dict[str, Any], origin: dict[str, str], options: dict[str, str]) -> str | None:
    transport = values.get("transport")
    cluster = values.get("__cluster")
    placed = cluster["host"] if cluster is not None else None  # where the launcher puts rank 0
    if "url" in values:
        url = values["url"]
    elif transport is not None and "://" in transport:
        url, origin["url"] = transport, origin["transport"]
    elif values.get("__rdzv_url") and transport is None:
        url, origin["url"] = values["__rdzv_url"], "DP_RDZV_URL (torchrun's --rdzv-backend dp-*)"
    elif values.get("__torchrun_store") and transport in (None, "tcpstore"):
        url, origin["url"] = f"tcpstore://{values['host']}:{values['port']}", "torchrun (MASTER_ADDR, MASTER_PORT)"
    elif transport is not None or placed is not None:
        under = f"default (under {cluster['launcher']})" if cluster is not None else "default"
        if transport is None:
            transport, origin["transport"] = "zmq", under
        host, port = values.get("host"), values.get("port")
        if cluster is not None and placed is not None:
            if host is None:
                host, origin["host"] = placed, cluster["where"]
            if port is None:
                port, origin["port"] = cluster["port"], under
        if host is None or port is None:
            missing = " and ".join(n for n, v in (("host", host), ("port", port)) if v is None)
            raise ConfigError(f"transport {transport!r} (from {origin['transport']}) needs {missing} as well")
        if origin.get("port") == "MASTER_PORT":
            port += 1  # torchrun's own store holds MASTER_PORT
            origin["port"] = "MASTER_PORT + 1"
        host = f"[{host}]" if ":" in host else host
        url = f"{transport}://{host}:{port}"
        origin["url"] = f"{origin['transport']}, {origin['host']}, {origin['port']}"
    elif cluster is not None:
        raise ConfigError(
            f"{cluster['launcher']} started ranks on several hosts: say where the coordinator is (rank 0's host): "
            "MASTER_ADDR and MASTER_PORT, DP_HOST and DP_PORT, or url in dataparallel.toml"
        )
    else:
        return None
    if options:  # the URL's own query wins over options given separately
        parts = urlsplit(url)
        merged = {**options, **dict(parse_qsl(parts.query, keep_blank_values=True))}
        url = urlunsplit(parts._replace(query=urlencode(merged)))
    # An unknown scheme, a missing library or a malformed URL: a ConfigError saying where it came from.
    parsed, _ = locate(url, f"url (from {origin['url']})")
    for _, port in parsed.hosts:
        if port is not None and not 1 <= port <= 65535 and parsed.scheme != "memory":
            raise ConfigError(f"url {mask_url(url)!r} (from {origin['url']}): port must be 1..65535, got {port}")
    return url


def _validate(c: JobConfig) -> None:
    def positive(name: str, value: Any) -> None:
        if value is not None and value < 1:
            raise ConfigError(f"{c.describe(name)} must be >= 1, got {value}")

    positive("world_size", c.world_size)
    positive("min_world_size", c.min_world_size)
    positive("max_world_size", c.max_world_size)
    if c.min_world_size is not None and c.max_world_size is not None and c.min_world_size > c.max_world_size:
        raise ConfigError(
            f"{c.describe('min_world_size')} = {c.min_world_size} is above {c.describe('max_world_size')} = "
            f"{c.max_world_size}"
        )
    positive("nprocs", c.nprocs)
    positive("nodes", c.nodes)
    if c.timeout <= 0:
        raise ConfigError(f"{c.describe('timeout')} must be > 0 seconds, got {c.timeout:g}")
    if c.rank is not None:
        if c.rank < 0 or (c.world_size is not None and c.rank >= c.world_size):
            bound = f"0..{c.world_size - 1}" if c.world_size else ">= 0"
            raise ConfigError(f"{c.describe('rank')} = {c.rank} is out of range ({bound})")
    if c.max_restarts < 0:
        raise ConfigError(f"{c.describe('max_restarts')} must be >= 0, got {c.max_restarts}")
    if c.local_rank is not None and c.local_rank < 0:
        raise ConfigError(f"{c.describe('local_rank')} must be >= 0, got {c.local_rank}")
    if not 0 <= c.node_rank < c.nodes:
        raise ConfigError(f"{c.describe('node_rank')} = {c.node_rank} is out of range 0..{c.nodes - 1}")
    if not c.job or "/" in c.job or "\x00" in c.job:
        raise ConfigError(f"{c.describe('job')} must be a non-empty name without '/', got {c.job!r}")


def env_setting(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The value of setting ``name`` in its ``DP_*`` variable (checked as the loader checks
    it), or None when unset: for code that reads one setting, such as ``dp.fit`` reading
    ``elastic`` under ``dataparallel launch --elastic``."""
    env = os.environ if env is None else env
    var = SETTINGS[name].env
    if var is None or env.get(var, "") == "":
        return None
    return _coerce(name, env[var], var)
