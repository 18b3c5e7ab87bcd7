"""Training ranks forked from a process that has imported torch already (a zygote).

A rank of ``loop_worker.py`` spends about 80% of its CPU time importing: torch, and the
``torch._dynamo`` that DistributedDataParallel's constructor imports (2.3 of its 2.9
CPU-seconds, measured with ``python -X importtime``). On two cores, the training-loop tests
were bound by that. Here one process per test session imports it all once and forks a child
per rank: each rank is still a process of its own, with its own pid, sockets, signal
handlers, pipes and exit status (``os.waitpid``'s, as ``subprocess`` reports it); only the
import is shared. The child runs the script as ``python SCRIPT ARGS`` would (``__main__``,
``sys.argv``, ``sys.path[0]``, the caller's environment and directory) and exits through
the interpreter's own exit (exit handlers, coverage's data file with ``patch = fork``).

:class:`ForkedProcess` has the part of :class:`subprocess.Popen`'s interface the tests use
(``pid``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill``, ``terminate``,
``returncode``; text ``stdout`` and ``stderr`` pipes). The zygote is one process, on one
thread (forking from a threaded process could copy a held lock into the child): it reads
requests and reaps children in one ``select`` loop, and ends when the test process does.

Written here rather than taken from ``multiprocessing``'s forkserver: that one runs a
function, not a script with its own ``__main__``, and gives no pipes, process session or
``subprocess``-like exit status; these tests need all three.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

#: What the zygote imports before it forks (what a loop_worker rank imports, grpc aside: its
#: core may start threads, and a fork must come from a single-threaded process).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.optim",
    "torch.utils.data",
    "dataparallel",
    "dataparallel.train.api",
    "dataparallel.transports.zmq",
    "dataparallel.transports.tcpstore",
)


class ForkedProcess:
    """A child of the zygote, as a :class:`subprocess.Popen` (the part the tests use)."""

    def __init__(self, pid: int, conn: socket.socket, stdout: io.TextIOWrapper, stderr: io.TextIOWrapper) -> None:
        self.pid = pid
        self.args = [f"<forked {pid}>"]
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._conn = conn
        self._status = b""
        self._read: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def _collect(self, timeout: float | None) -> None:
        """Read the exit status the zygote sends, waiting up to ``timeout`` (None: no wait)."""
        if self.returncode is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 0.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
            self._conn.settimeout(left)  # 0: no wait
            try:
                chunk = self._conn.recv(256)
            except (BlockingIOError, TimeoutError):
                return
            if not chunk:
                raise RuntimeError(f"the zygote went away before child {self.pid} ended")
            self._status += chunk
            if self._status.endswith(b"\n"):
                self.returncode = int(json.loads(self._status)["status"])
                self._conn.close()
            elif deadline is not None and time.monotonic() >= deadline:
                return

    def poll(self) -> int | None:
        self._collect(None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._collect(timeout if timeout is not None else 1e9)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read both pipes to their end and wait for the exit status; TimeoutExpired after
        ``timeout`` seconds (what was read so far is kept for the next call)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        open_pipes = {name: getattr(self, name) for name in ("stdout", "stderr") if not getattr(self, name).closed}
        with selectors.DefaultSelector() as sel:
            for name, pipe in open_pipes.items():
                os.set_blocking(pipe.fileno(), False)
                sel.register(pipe.fileno(), selectors.EVENT_READ, name)
            raw: dict[str, bytearray] = {name: bytearray() for name in open_pipes}
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._keep(raw)
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                for key, _ in sel.select(left):
                    name = key.data
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        raw[name] += chunk
                    else:
                        sel.unregister(key.fd)
                        getattr(self, name).close()
        self._keep(raw)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        out, err = ("".join(self._read[name]) for name in ("stdout", "stderr"))
        self._read = {"stdout": [], "stderr": []}
        return out, err

    def _keep(self, raw: dict[str, bytearray]) -> None:
        for name, data in raw.items():
            self._read[name].append(bytes(data).decode("utf-8", errors="replace"))
            data.clear()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The zygote process of this test process, started at the first :meth:`popen`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._path = ""

    def _start(self) -> None:
        folder = tempfile.mkdtemp(prefix="dp-zygote-")
        self._path = os.path.join(folder, "socket")
        self._proc = subprocess.Popen(
            [sys.executable, __file__, self._path],
            stdin=subprocess.PIPE,  # its end: the zygote's cue to leave
            stdout=subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # "ready" once imported and listening
        if line.strip() != b"ready":
            raise RuntimeError(f"the zygote did not start: {line!r}")

    def popen(self, args: list[str], start_new_session: bool = False) -> ForkedProcess:
        """``python ARGS[0] ARGS[1:]`` as a child of the zygote, with this process's
        environment and directory, stdout and stderr as text pipes."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._path)
            request = {
                "argv": [str(a) for a in args],
                "cwd": os.getcwd(),
                "env": dict(os.environ),
                "session": start_new_session,
            }
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [out_w, err_w])
            conn.settimeout(60)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(256)
                if not chunk:
                    raise RuntimeError("the zygote closed the connection before forking")
                reply += chunk
        except BaseException:
            conn.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        pid = int(json.loads(reply)["pid"])
        stdout = open(out_r, encoding="utf-8", errors="replace")
        stderr = open(err_r, encoding="utf-8", errors="replace")
        return ForkedProcess(pid, conn, stdout, stderr)


#: This test process's zygote.
ZYGOTE = Zygote()


def popen(args: list[str], start_new_session: bool = False) -> ForkedProcess:
    return ZYGOTE.popen(args, start_new_session=start_new_session)


# --- the zygote's side ---------------------------------------------------------------


def _serve(path: str) -> dict[str, Any] | None:
    """Listen at ``path`` and fork a child per request. Returns in the child (its request),
    or None when the test process has gone (stdin at its end)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listener")
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select(0.05):
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 1024):
                    return None
            elif key.data == "listener":
                conn, _ = listener.accept()
                conn.settimeout(10)
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
                while not message.endswith(b"\n"):
                    more = conn.recv(1 << 20)
                    if not more:
                        break
                    message += more
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:  # the child: leave the loop with its request and pipes
                    sel.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    request["fds"] = fds
                    return dict(request)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass  # the test process stopped waiting for it
                conn.close()


def _become(request: dict[str, Any]) -> None:
    """In the child: take the request's pipes, session, directory, environment and argv,
    and run the script as ``__main__``."""
    if request["session"]:
        os.setsid()
    out, err = request["fds"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (null, out, err):
        os.close(fd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the test run is the test process's
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    child = _serve(sys.argv[1])
    if child is None:  # the test process has ended: so does the zygote, leaving nothing behind
        os.unlink(sys.argv[1])
        os.rmdir(os.path.dirname(sys.argv[1]))
    else:
        _become(child)
