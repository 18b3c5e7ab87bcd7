"""What porting a torchrun DDP script costs: the lines each port of the same script changed.

    python -m benchmarks.ports            # prints the table, writes results/ports.json

The script is ``examples/train_charlm_torchrun.py`` (plain DDP: bf16 autocast, clipping, a
per-step warm-up + cosine schedule, a log line every 20 steps, a snapshot every 2 epochs that
the next run resumes); its ports keep every feature: ``examples/train_charlm.py`` (``dp.fit``)
and ``examples/train_charlm_fabric.py`` (Lightning Fabric). All three share the model and data
(``examples/charlm_model.py``) and are formatted by ruff, as the repository is. Counted like
``git diff --numstat`` over the code: a changed line is one removed plus one added; the module
docstrings (which describe each file) and blank lines are left out. ``tests/test_examples.py``
runs the three scripts and checks that this file's figures are the ones the code has now.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RESULTS = Path(__file__).resolve().parent / "results"
BASE = "train_charlm_torchrun.py"
PORTS = {"dp.fit": "train_charlm.py", "Lightning Fabric": "train_charlm_fabric.py"}


def code_lines(path: Path) -> list[str]:
    """The file's non-blank lines, its module docstring left out."""
    source = path.read_text()
    lines = source.splitlines()
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        del lines[body[0].lineno - 1 : body[0].end_lineno]
    return [line for line in lines if line.strip()]


def changed(base: Path, port: Path) -> dict[str, int]:
    """Lines added and removed from ``base`` to ``port``."""
    added = removed = 0
    for line in difflib.unified_diff(code_lines(base), code_lines(port), lineterm="", n=0):
        if line.startswith(("+++", "---")):
            continue
        added += line.startswith("+")
        removed += line.startswith("-")
    return {"added": added, "removed": removed}


def measure(examples: Path = EXAMPLES) -> dict:
    base = examples / BASE
    ports = {name: {"file": f"examples/{file}", **changed(base, examples / file)} for name, file in PORTS.items()}
    return {"base": f"examples/{BASE}", "base_lines": len(code_lines(base)), "ports": ports}


def table(result: dict) -> str:
    lines = [
        f"| port of `{result['base']}` ({result['base_lines']} lines) | lines added | lines removed |",
        "| --- | --- | --- |",
    ]
    for name, port in result["ports"].items():
        lines.append(f"| {name} (`{port['file']}`) | {port['added']} | {port['removed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "ports.json")
    args = parser.parse_args(argv)
    result = measure()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
