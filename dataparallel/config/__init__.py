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
    events = "events.jsonl"      # DP_EVENTS             --events      (the job's event log, appended to this file)
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

from .environments import (
    CLUSTER,
    DEFAULT_PORT,
    LAUNCH_ENVIRONMENTS,
    LaunchEnvironment,
    describe_launch,
    expand_hostlist,
    slurm_port,
)
from .hosts import PLACED, address_of, parse_hosts, read_hostfile
from .settings import (
    CHOICES,
    DEFAULT_FILE,
    DEFAULT_JOB,
    DEFAULT_TIMEOUT,
    NONE,
    SETTINGS,
    JobConfig,
    Setting,
    flag_of,
    load_config,
    load_token,
)

__all__ = [
    "CHOICES",
    "CLUSTER",
    "DEFAULT_FILE",
    "DEFAULT_JOB",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "LAUNCH_ENVIRONMENTS",
    "NONE",
    "PLACED",
    "SETTINGS",
    "JobConfig",
    "LaunchEnvironment",
    "Setting",
    "address_of",
    "describe_launch",
    "expand_hostlist",
    "flag_of",
    "load_config",
    "load_token",
    "parse_hosts",
    "read_hostfile",
    "slurm_port",
]
