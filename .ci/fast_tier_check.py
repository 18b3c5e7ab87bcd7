"""Every module of the package runs in the fast tier: a function of each, not only its import.

    python .ci/fast_tier_check.py COVERAGE_JSON

reads a ``coverage json`` report of the fast tier (the tests plain ``pytest`` runs;
``.ci/run`` makes it, in the repository's root: the report's relative paths are read from
the working directory) and fails, naming them, for modules of ``dataparallel/`` that were
not imported, or none of whose functions' bodies ran. The generated protobuf code, which
coverage omits, is not asked for.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dataparallel"


def body_lines(path: Path) -> set[int]:
    """The lines of the statements inside the module's functions (their ``def`` lines and
    decorators, which run at import, left out)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for statement in node.body:
                end = statement.end_lineno or statement.lineno
                # A body on its ``def`` line (``def f(): return x``) cannot be told from the
                # definition's own run at import: it is not counted.
                lines.update(line for line in range(statement.lineno, end + 1) if line != node.lineno)
    return lines


def main() -> int:
    report = json.loads(Path(sys.argv[1]).read_text())
    executed = {Path(name).resolve(): set(data["executed_lines"]) for name, data in report["files"].items()}
    empty = {Path(name).resolve() for name, data in report["files"].items() if not data["summary"]["num_statements"]}
    missing = []
    modules = sorted(p for p in PACKAGE.rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))
    for path in modules:
        if path.resolve() in empty:  # nothing to run (an empty __init__.py)
            continue
        ran = executed.get(path.resolve(), set())
        shown = path.relative_to(ROOT)
        if not ran:  # coverage lists every module of the package, imported or not
            missing.append(f"{shown}: not imported")
            continue
        body = body_lines(path)
        if body and not body & ran:
            missing.append(f"{shown}: imported, but none of its functions ran")
    if missing:
        print(f"the fast tier leaves {len(missing)} module(s) of the package untouched:", *missing, sep="\n  ")
        return 1
    print(f"the fast tier runs a function of each of the package's {len(modules)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
