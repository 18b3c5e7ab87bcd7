"""The reference pages' generated parts against what the code accepts, and every public name
documented. (The site itself is built with ``mkdocs build --strict`` by ``.ci/run``.)"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest

import dataparallel as dp
from dataparallel import reference
from dataparallel.cli import build_parser
from dataparallel.config import SETTINGS, flag_of, load_config

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> dict[str, list[str]]:
    """The configuration table, by setting: its cells."""
    rows = {}
    for line in reference.configuration().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0].strip("`")] = cells
    return rows


def _value(name: str, tmp_path: Path) -> str:
    """A valid value of setting ``name``, as text."""
    if name in ("token_file", "hostfile"):
        path = tmp_path / name
        path.write_text("s3cret\n" if name == "token_file" else "10.0.0.1 slots=2\n10.0.0.2 slots=2\n")
        path.chmod(0o600)
        return str(path)
    kind = SETTINGS[name].kind
    special = {
        "url": "zmq://127.0.0.1:29999",
        "transport": "tcpstore",
        "host": "10.0.0.7",
        "options": "heartbeat=0.5",
        "job": "docs",
        "log_format": "json",
        "events": "events.jsonl",
        "hosts": "10.0.0.1:2,10.0.0.2:2",
        "rank": "1",
    }
    if name in special:
        return special[name]
    return {int: "2", float: "2.5", bool: "true"}[kind]


#: What a setting needs beside it to be valid on its own.
COMPANIONS = {
    "transport": {"host": "127.0.0.1", "port": "29998"},
    "rank": {"world_size": "4"},
    "node_rank": {"nodes": "4"},
}


def _origin(config: dp.JobConfig, name: str) -> str:
    return config.origin.get("token" if name == "token_file" else name, "")


def test_the_configuration_table_lists_every_setting_as_the_code_defines_it():
    rows = _rows()
    assert list(rows) == list(SETTINGS)
    flags = reference.flags_by_command()
    for name, cells in rows.items():
        setting = SETTINGS[name]
        if setting.env:
            assert cells[1] == f"`{setting.env}`", cells
        flag = flag_of(name)
        accepted = [command for command, known in flags.items() if flag in known]
        assert (f"`{flag}` ({', '.join(accepted)})" if accepted else "—") == cells[2], cells
        assert cells[3] and cells[4], f"{name}: no default or meaning"


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_setting_in_the_table_is_accepted_where_the_table_says(name, tmp_path, monkeypatch):
    """The file key, the environment variable and the flag of each row, each on its own,
    set the setting (the configuration records where each value came from)."""
    monkeypatch.chdir(tmp_path)
    cells = _rows()[name]
    value = _value(name, tmp_path)
    base = {k: v for k, v in COMPANIONS.get(name, {}).items()}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DP_", "SLURM_", "OMPI_", "PMI_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        clean.pop(key, None)

    # The file key.
    toml = tmp_path / "dataparallel.toml"
    lines = [f'{k} = "{v}"' if SETTINGS[k].kind is str else f"{k} = {v}" for k, v in base.items()]
    if name == "options":
        lines.append("[options]\nheartbeat = 0.5")
    else:
        quoted = SETTINGS[name].kind is str
        lines.insert(0, f'{name} = "{value}"' if quoted else f"{name} = {value}")
    toml.write_text("\n".join(lines) + "\n")
    config = load_config({}, env=clean, file=toml)
    assert _origin(config, name).startswith(f"file {toml}"), (name, config.origin)
    toml.unlink()

    # The environment variable.
    env_cell = cells[1]
    variable = re.match(r"`(DP_\w+)`", env_cell)
    assert variable, env_cell
    env = {**clean, **{SETTINGS[k].env: v for k, v in base.items()}}  # type: ignore[misc]
    env[variable.group(1)] = "s3cret" if name == "token_file" else value
    config = load_config({}, env=env)
    if name == "token_file":
        assert config.token == "s3cret" and config.origin["token"] == "DP_TOKEN"
    else:
        assert _origin(config, name) == variable.group(1), (name, config.origin)

    # The flag, through the command line's parser.
    flag = re.match(r"`(--[\w-]+)` \((\w+)", cells[2])
    if flag is None:
        assert name in ("rank", "local_rank"), f"{name} has no flag"  # set by the launcher
        return
    argv = [flag.group(2), flag.group(1)]
    if SETTINGS[name].kind is not bool:
        argv.append(value)
    for companion, companion_value in base.items():
        argv += [f"--{companion.replace('_', '-')}", companion_value]
    argv += ["train.py"] if flag.group(2) == "launch" else []
    args = build_parser().parse_args(argv)
    flags = {n: getattr(args, n, None) for n in SETTINGS}
    config = load_config(flags, env=clean)
    assert _origin(config, name) == flag_of(name), (name, config.origin)


def test_every_public_name_has_its_own_docstring():
    for section, names in reference.public_names().items():
        for name, obj in names:
            own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
            assert own and not own.startswith(f"{name}("), f"{section}: {name} has no docstring of its own"


def test_every_error_says_what_to_do():
    for cls in reference.error_classes():
        assert "What to do:" in (cls.__doc__ or ""), f"{cls.__name__}: its docstring says not what to do"


def test_every_generated_part_renders():
    for name in reference.GENERATED:
        assert reference.render(name).strip(), name
    with pytest.raises(ValueError, match="known: "):
        reference.render("nothing")
    page_marks = {
        m.group(1)
        for page in (ROOT / "docs").rglob("*.md")
        for m in re.finditer(r"^<!-- generated: (\w+) -->$", page.read_text(), re.M)
    }
    assert page_marks == set(reference.GENERATED), "a generated part no page shows, or a page asks for an unknown one"
