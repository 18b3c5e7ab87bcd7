"""Griffe extension for the API reference: the code's docstrings are prose with
reStructuredText roles (``:class:`X```, ``:meth:`~a.b.c```) and literal-block markers
(``::`` at the end of a paragraph), which Markdown would print as they are. Each role
becomes a code span of its target (``~`` keeps the last component, as in Sphinx), and a
trailing ``::`` becomes ``:`` (the indented block after it is a code block in Markdown too).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
_LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def convert(text: str) -> str:
    """``text`` with its roles as code spans and its ``::`` markers as ``:``."""
    return _LITERAL.sub(":", _ROLE.sub(_role, text))


class RstRoles(griffe.Extension):
    """Rewrite every docstring once it is attached to its object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
