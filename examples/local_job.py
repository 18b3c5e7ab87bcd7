"""Start every rank of an example on this machine: one process per rank, each running the
example script with ``--transport URL --nprocs N --rank R``; the first rank to fail ends
the job (the others are killed rather than left to wait for their timeouts)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_zmq_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"zmq://127.0.0.1:{s.getsockname()[1]}"


def run_ranks(script: str, nprocs: int, url: str, extra: list[str] = ()) -> int:
    """Run ``nprocs`` ranks of ``script``; return 0, or the first failing rank's exit code."""
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--transport", url, "--nprocs", str(nprocs), "--rank", str(r), *extra]
        )
        for r in range(nprocs)
    ]
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode]
            if failed:
                return failed[0]
            time.sleep(0.2)
        return next((p.returncode for p in procs if p.returncode), 0)
    except KeyboardInterrupt:
        return 130
    finally:
        for p in procs:
            p.kill()
