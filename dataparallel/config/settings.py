"""The settings, one table (:data:`SETTINGS`), and how they resolve into a :class:`JobConfig`
(the precedence and the file's form: :mod:`dataparallel.config`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..control.registry import MASK, is_secret_option, locate, mask_url
from ..errors import ConfigError
from .environments import DEFAULT_PORT, check_launchers_agree, from_cluster, from_torchrun, serves_store
from .hosts import place_hosts

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_FILE = "dataparallel.toml"


DEFAULT_JOB = "default"


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
    "relay": Setting(
        bool,
        "DP_RELAY",
        "false",
        "each node's launcher hosts a node relay: its workers reach the job through shared memory, "
        "and the node is one member of the job's channel (barriers cross the network once per node)",
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
    "events": Setting(
        str,
        "DP_EVENTS",
        "none",
        "append the job's event log to this file, one JSON object a line (joins, losses, regroups, restarts, "
        "checkpoints, stops, stalls, stragglers, stack dumps): each rank writes its own, launch follows the others",
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
    relay: bool = False
    min_world_size: int | None = None
    max_world_size: int | None = None
    log_format: str = "text"
    #: A file the job's event log is appended to (:mod:`dataparallel.launching.events`).
    events: str | None = None
    #: The job's hosts and their slots (workers; None: ``nprocs``, else 1), from ``hosts``
    #: (``h1:2,h2:2``) or ``hostfile``: ``dataparallel launch`` starts each over ssh.
    hosts: tuple[tuple[str, int | None], ...] = ()
    #: The URL is the store torchrun's agent serves for its workers
    #: (``TORCHELASTIC_USE_AGENT_STORE``): no rank hosts it, rank 0 included.
    agent_store: bool = False
    origin: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def slots(self) -> list[int]:
        """Workers per host of ``hosts``: each host's slots, else ``nprocs``, else 1."""
        return [count or self.nprocs or 1 for _, count in self.hosts]

    def describe(self, name: str) -> str:
        return f"{name} (from {self.origin.get(name, 'default')})"

    def shown(self, name: str) -> str:
        """Setting ``name``'s value as output shows it: the URL's secrets masked
        (:func:`dataparallel.control.registry.mask_url`), the token never."""
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
    cluster, torchrun = from_cluster(env), from_torchrun(env)
    check_launchers_agree(cluster, torchrun, env)
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
    place_hosts(values, origin)
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
        relay=values.get("relay", False),
        min_world_size=values.get("min_world_size"),
        max_world_size=values.get("max_world_size"),
        log_format=values.get("log_format", "text"),
        events=values.get("events"),
        hosts=values.get("__hosts", ()),
        agent_store=url is not None and serves_store(env, url),
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
    if c.relay and c.elastic:
        raise ConfigError(
            f"{c.describe('relay')} and {c.describe('elastic')} together: a node relay serves a fixed set of "
            "ranks (elastic jobs connect each rank directly)"
        )
    if not c.job or "/" in c.job or "\x00" in c.job:
        raise ConfigError(f"{c.describe('job')} must be a non-empty name without '/', got {c.job!r}")
