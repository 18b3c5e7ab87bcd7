"""Small helpers the conformance suite, its worker processes and the linearizability check share."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlencode

import pytest

import dataparallel as dp


def with_options(url: str, **options: Any) -> str:
    """``url`` with query-string options added."""
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}{urlencode(options)}"


def held_rank(ch: dp.ControlChannel) -> int:
    """``ch.rank``, which a channel that ``dp.connect`` returned holds."""
    if ch.rank is None:
        pytest.fail(f"{ch!r} holds no rank: dp.connect returned it before its rank was assigned")
    return ch.rank


def count_multi_gets(channels: Sequence[dp.ControlChannel]) -> dict[int, int]:
    """Count each channel's multi_get calls (wrapping the bound method, nothing else)."""
    counted = {held_rank(ch): 0 for ch in channels}
    for ch in channels:

        def counting(
            keys: Iterable[str],
            timeout: float | None = None,
            _rank: int = held_rank(ch),
            _call: Callable[[Iterable[str], float | None], list[bytes]] = ch.multi_get,
        ) -> list[bytes]:
            counted[_rank] += 1
            return _call(keys, timeout)

        # Set on the instance, in front of the class's method: mypy refuses a plain assignment to a method.
        setattr(ch, "multi_get", counting)  # noqa: B010
    return counted
