"""Griffe extensions for the API reference. The code's docstrings are prose with
reStructuredText roles (``:class:`X```, ``:meth:`~a.b.c```) and literal-block markers
(``::`` at the end of a paragraph), which Markdown would print as they are. Each role
becomes a code span of its target (``~`` keeps the last component, as in Sphinx), and a
trailing ``::`` becomes ``:`` (the indented block after it is a code block in Markdown too).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

from dataparallel.reference import rst_roles_as_code


def convert(text: str) -> str:
    """``text`` with its roles as code spans and its ``::`` markers as ``:``."""
    return rst_roles_as_code(text)


class RstRoles(griffe.Extension):
    """Rewrite every docstring once it is attached to its object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)


class AttributeComments(griffe.Extension):
    """Give an attribute without a docstring its Sphinx-style ``#:`` comment block above it,
    else its trailing ``# ...`` comment, as its docstring (the dataclasses' fields)."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None:
            return
        lines = (
            attr.lines_collection[attr.filepath]
            if isinstance(attr.filepath, Path) and attr.filepath in attr.lines_collection
            else None
        )
        if not lines:
            return
        first = attr.lineno - 1
        block: list[str] = []
        i = first - 1
        while i >= 0 and lines[i].strip().startswith("#:"):
            block.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        text = " ".join(block)
        if not text:
            m = re.search(r"\s#\s+(.*)$", lines[first])
            text = m.group(1) if m else ""
        if text:
            attr.docstring = griffe.Docstring(convert(text), lineno=attr.lineno, parent=attr)
