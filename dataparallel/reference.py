"""The generated parts of the reference: what the code defines, written as Markdown.

The documentation site's build hook (``docs/hooks.py``) replaces a line
``<!-- generated: NAME -->`` with :func:`render` ``(NAME)``, so the configuration table, the
transports' URL forms and options, the command line and the error catalogue are read from the
settings definition, the transport classes, the argparse parser and the error classes at
build time and cannot drift from them (``tests/test_docs.py`` compares them as well).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

from . import errors
from .config import CHOICES, SETTINGS, flag_of
from .control.channel import COMMON_OPTIONS, ControlChannel
from .control.registry import known_schemes, transport_class

#: The class attributes a transport declares about itself, as the transports table names them.
CAPABILITIES = {
    "native_auth": "checks the token itself (AuthError)",
    "notices_exits": "notices a killed peer at once (its connections close)",
    "fences_lost_members": "refuses a lost rank's writes (fencing)",
    "survives_connection_loss": "re-sends a call after a connection reset, applied once",
    "survives_frozen_writers": "a rank frozen mid-write blocks no other's writes",
}


def render(name: str) -> str:
    """The Markdown for ``<!-- generated: NAME -->``."""
    try:
        return GENERATED[name]()
    except KeyError:
        raise ValueError(f"nothing is generated under {name!r}; known: {', '.join(GENERATED)}") from None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def rst_roles_as_code(text: str) -> str:
    """``text`` with its reST roles as code spans (``~`` keeps the last component, as in
    Sphinx) and its trailing ``::`` markers as ``:`` (the indented block after one is a code
    block in Markdown too). The API pages' griffe extension uses it as well."""
    return _LITERAL.sub(":", _ROLE.sub(_role, text))


def _markdown(docstring: str | None) -> str:
    """A docstring as Markdown: its roles and double backticks as code spans."""
    return rst_roles_as_code(inspect.cleandoc(docstring or "")).replace("``", "`")


def _commands() -> dict[str, argparse.ArgumentParser]:
    from .cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags_by_command() -> dict[str, set[str]]:
    """Every option string of every ``dataparallel`` command, by command."""
    return {name: {o for a in sub._actions for o in a.option_strings} for name, sub in _commands().items()}


def configuration() -> str:
    commands = flags_by_command()
    lines = [
        "| Setting (file key) | Environment | Flag | Default | Meaning |",
        "|---|---|---|---|---|",
    ]
    for name, setting in SETTINGS.items():
        flag = flag_of(name)
        where = [command for command, flags in commands.items() if flag in flags]
        flag_cell = f"`{flag}` ({', '.join(where)})" if where else "—"
        env = f"`{setting.env}`" if setting.env else ("`DP_TOKEN` (the token itself)" if name == "token_file" else "—")
        meaning = setting.meaning
        if name in CHOICES:
            meaning += f" (one of: {', '.join(CHOICES[name])})"
        lines.append(f"| `{name}` | {env} | {flag_cell} | {_cell(setting.default)} | {_cell(meaning)} |")
    return "\n".join(lines) + "\n"


def _transports() -> list[tuple[str, type[ControlChannel]]]:
    return [(scheme, transport_class(scheme)) for scheme in known_schemes()]


def transports() -> str:
    found = _transports()
    out = ["| | " + " | ".join(f"`{scheme}://`" for scheme, _ in found) + " |"]
    out.append("|---" * (len(found) + 1) + "|")
    for attribute, label in CAPABILITIES.items():
        marks = ["yes" if getattr(cls, attribute) else "no" for _, cls in found]
        out.append(f"| {label} (`{attribute}`) | " + " | ".join(marks) + " |")
    for scheme, cls in found:
        module = inspect.getmodule(cls)
        summary = _markdown(module.__doc__ if module is not None else cls.__doc__).split("\n\n")[0]
        out += ["", f"## `{scheme}://`", "", f"`{cls.url_form()}` — class `{cls.__module__}.{cls.__qualname__}`", ""]
        out += [summary, "", "| Option | Meaning |", "|---|---|"]
        for option, meaning in {**cls.OPTIONS, **COMMON_OPTIONS}.items():
            out.append(f"| `{option}` | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


def cli() -> str:
    """Every command's ``--help``, wrapped at 100 columns whatever the terminal."""
    from .cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width
    try:
        out = ["## `dataparallel`", "", "```text", build_parser().format_help().rstrip(), "```", ""]
        for name, sub in _commands().items():
            out += [f"## `dataparallel {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(out)


def error_classes() -> list[type[BaseException]]:
    """The error classes of :mod:`dataparallel.errors`, in the order they are defined."""
    classes = [obj for obj in vars(errors).values() if inspect.isclass(obj) and issubclass(obj, BaseException)]
    classes = [cls for cls in classes if cls.__module__ == errors.__name__]
    return sorted(classes, key=lambda cls: inspect.getsourcelines(cls)[1])


def error_catalogue() -> str:
    out = []
    for cls in error_classes():
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        out += [f"## `{cls.__name__}`", "", f"*is a* {bases}", "", _markdown(cls.__doc__), ""]
    return "\n".join(out)


def public_names() -> dict[str, list[tuple[str, Any]]]:
    """Every public name (``__all__`` of ``dataparallel`` and ``dataparallel.testing``) by
    the section of the API reference it goes in."""
    import dataparallel
    from dataparallel import testing

    sections: dict[str, list[tuple[str, Any]]] = {"Functions": [], "Classes": [], "Errors": [], "Testing": []}
    for name in dataparallel.__all__:
        obj = getattr(dataparallel, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            sections["Errors"].append((name, obj))
        else:
            sections["Classes" if inspect.isclass(obj) else "Functions"].append((name, obj))
    sections["Testing"] = [(name, getattr(testing, name)) for name in testing.__all__]
    return sections


def api() -> str:
    """mkdocstrings' directives for every public name, at the module that defines it. The
    control channel shows its hooks too (single underscore: a transport's contract); the
    conformance suite's test classes show their docstrings, not every test."""
    from .testing.conformance import ChannelHarness

    out = []
    for section, names in public_names().items():
        out += [f"## {section}", ""]
        for _, obj in names:
            out += [f"::: {obj.__module__}.{obj.__qualname__}", "    options:", "      heading_level: 3"]
            if obj is ControlChannel:
                out += ["      inherited_members: true", '      filters: ["!^__"]']
            elif inspect.isclass(obj) and issubclass(obj, ChannelHarness):
                out += ["      members: false"]
            out.append("")
    return "\n".join(out)


GENERATED: dict[str, Callable[[], str]] = {
    "api": api,
    "configuration": configuration,
    "transports": transports,
    "cli": cli,
    "errors": error_catalogue,
}
