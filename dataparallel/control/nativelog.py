"""The C++ logs of the libraries under the transports, held back where the library reports
the same condition itself as one typed line.

torch: a call into TCPStore that fails in a way the library expects (a connection to a port
where nothing listens, to a coordinator that is gone, a wait that expires) also makes torch's
C++ side log it: ``[E] socket.cpp``, ``[W] TCPStore.cpp ... retrying``, each with the C++
stack of the error (``frame #0: c10::Error::Error ...``). :func:`quiet_torch_log` raises the
threshold of torch's C++ log (c10's ``FLAGS_caffe2_log_level``, which ``TORCH_CPP_LOG_LEVEL``
sets at start) to FATAL for the duration of such a call. The threshold is one per process:
while any such call runs, torch's C++ warnings and errors from other threads are held back
too. A process started with ``TORCH_CPP_LOG_LEVEL=INFO`` (someone reading torch's own log)
keeps every line: the threshold is then left alone.

gRPC (the grpc transport, and etcd's client): its C core logs each refused TLS handshake
(``I... ssl_transport_security.cc:...] Handshake failed``) several times per attempt.
:func:`quiet_grpc_log` keeps it to errors (``GRPC_VERBOSITY=ERROR``, which gRPC reads once,
when it is first imported), unless ``GRPC_VERBOSITY`` says otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from collections.abc import Iterator

#: c10's log levels (c10/util/Logging.h): INFO 0, WARNING 1, ERROR 2, FATAL 3.
_INFO, _FATAL = 0, 3

_lock = threading.Lock()
_depth = 0  # calls in flight that asked for quiet
_saved = 0  # the threshold before the first of them


@functools.cache
def _threshold() -> ctypes.c_int | None:
    """c10's log threshold in the loaded torch, or None where it cannot be found (then
    nothing is held back)."""
    import torch

    name = {"darwin": "libc10.dylib", "win32": "c10.dll"}.get(sys.platform, "libc10.so")
    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))
        return ctypes.c_int.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def quiet_torch_log() -> Iterator[None]:
    """Hold torch's C++ log back (all but FATAL) until the block ends, where the library
    handles and reports what the call in the block may log. Nests, and may be entered from
    several threads at once: the threshold comes back when the last block ends."""
    global _depth, _saved
    threshold = _threshold()
    if threshold is None:
        yield
        return
    with _lock:
        if _depth == 0:
            _saved = threshold.value
            if _saved > _INFO:
                threshold.value = max(_saved, _FATAL)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                threshold.value = _saved


def quiet_grpc_log() -> None:
    """Keep gRPC's C-core log to errors in this process, unless ``GRPC_VERBOSITY`` is set:
    effective where gRPC has not been imported yet (call before a transport's import)."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
