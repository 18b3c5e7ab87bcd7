"""Detection times of the fault-injection suite, as a table for docs/howto/failures.md.

    python -m benchmarks.faults          # runs tests/test_faults.py and the partition tests

Runs the real fault tests (they assert the bounds) with ``DP_FAULT_REPORT`` set, so that
each records what the surviving processes saw and how long it took; writes
``benchmarks/results/faults.json`` and prints a Markdown table. The partition tests need
root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import run_main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def table(rows: list[dict]) -> str:
    merged: dict[tuple[str, str], dict] = {}
    for row in rows:
        entry = merged.setdefault((row["fault"], row["outcome"]), {"transports": [], "seconds": []})
        entry["transports"].append(row["transport"])
        if row["seconds"] is not None:
            entry["seconds"].append(row["seconds"])
    lines = ["| fault or attack | transports | outcome | detection time |", "| --- | --- | --- | --- |"]
    for (fault, outcome), entry in merged.items():
        seconds = entry["seconds"]
        when = f"{min(seconds):.1f} to {max(seconds):.1f} s" if seconds else "-"
        lines.append(f"| {fault} | {', '.join(dict.fromkeys(entry['transports']))} | {outcome} | {when} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.unlink(missing_ok=True)
    tests = ["tests/test_faults.py", "tests/test_multihost.py::test_partition_of_one_host_and_its_healing"]
    env = {**os.environ, "DP_FAULT_REPORT": str(args.out)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", *tests], cwd=ROOT, env=env)
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    print(table(rows))
    return run.returncode


if __name__ == "__main__":
    run_main("benchmarks.faults", main)
