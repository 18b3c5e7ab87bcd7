"""Where ``dp.fit``'s checkpoints are kept: a local path, or any filesystem URL fsspec knows.

``checkpoint="runs/snap.pt"`` or ``"file:///srv/snap.pt"`` is a local file; ``"s3://bucket/snap.pt"``,
``"gs://..."``, ``"memory://..."`` go through fsspec where the user has its filesystem package
(``s3fs``, ``gcsfs``...). A scheme fsspec does not know, or one whose package is missing, is a
:class:`ValueError` when the options are made, before any training. Writes are atomic either way:
a temporary file beside the target, then a rename (fsync'd locally), so a crash leaves the old
checkpoint or the new one, never a torn one.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import torch

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _remote(target: str | os.PathLike[str]) -> tuple[Any, str] | None:
    """``(filesystem, path)`` for a URL that is not a local file; None for a local path."""
    text = os.fspath(target)
    match = _SCHEME.match(text)
    if match is None or match.group(1).lower() == "file":
        return None
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError) as err:  # a scheme fsspec does not know, or its package is missing
        raise ValueError(f"checkpoint {text!r}: {err}") from None
    return fs, path


def local_path(target: str | os.PathLike[str]) -> Path | None:
    """The local file ``target`` names (``file://`` URLs included), or None for another filesystem."""
    if _remote(target) is not None:
        return None
    text = os.fspath(target)
    return Path(text[len("file://") :] if text.lower().startswith("file://") else text)


def check(target: str | os.PathLike[str]) -> None:
    """Raise :class:`ValueError` now if ``target``'s filesystem cannot be used."""
    _remote(target)


def save_atomically(obj: Any, target: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file beside ``target``, then rename it over ``target``
    (locally: fsync the file before and the directory after)."""
    remote = _remote(target)
    if remote is not None:
        fs, where = remote
        parent, name = where.rsplit("/", 1) if "/" in where else ("", where)
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp" if parent else f".{name}.{uuid.uuid4().hex}.tmp"
        if parent:
            fs.makedirs(parent, exist_ok=True)
        with fs.open(tmp, "wb") as f:
            torch.save(obj, f)
        fs.mv(tmp, where)
        return
    path = local_path(target)
    assert path is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(target: str | os.PathLike[str]) -> Any | None:
    """The checkpoint at ``target`` (tensors on the CPU), or None if there is none yet."""
    remote = _remote(target)
    if remote is not None:
        fs, where = remote
        if not fs.exists(where):
            return None
        with fs.open(where, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=False)
    path = local_path(target)
    assert path is not None
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
