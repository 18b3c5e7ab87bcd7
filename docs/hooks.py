"""MkDocs hooks: the reference's generated parts, written at build time from the code, and
the benchmark figures, published from where the benchmarks write them (no copies in docs/).

A line ``<!-- generated: NAME -->`` in a page becomes ``dataparallel.reference.render(NAME)``
(the configuration table, the transports, the command line, the error catalogue, the API
directives that mkdocstrings then expands), so the site cannot drift from the code.
"""

from __future__ import annotations

import os
import re
from typing import Any

from mkdocs.structure.files import File, Files

from dataparallel.reference import render

_MARK = re.compile(r"^<!-- generated: (\w+) -->$", re.MULTILINE)
#: benchmarks/results/NAME.png, shown as images/benchmarks/NAME.png.
FIGURES = ["control_plane", "rendezvous", "swarm", "elastic", "strategies"]


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    root = os.path.dirname(config["config_file_path"])
    for name in FIGURES:
        source = os.path.join(root, "benchmarks", "results", f"{name}.png")
        files.append(File.generated(config, f"images/benchmarks/{name}.png", abs_src_path=source))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    return _MARK.sub(lambda match: render(match.group(1)), markdown)
