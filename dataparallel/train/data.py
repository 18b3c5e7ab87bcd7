"""Batches and what is in them: tensors moved to a device, samples counted, hits scored."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch


def first_parameter(factory: Callable[..., Any]) -> str | None:
    """The name of ``factory``'s first parameter, if it can be known."""
    try:
        return next(iter(inspect.signature(factory).parameters), None)
    except (TypeError, ValueError):  # a builtin or a C callable: no signature
        return None


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (in lists, tuples, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def count(targets: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (targets of any structure)."""
    if isinstance(targets, torch.Tensor):
        return len(targets) if targets.dim() else 1
    values = targets.values() if isinstance(targets, dict) else targets if isinstance(targets, (list, tuple)) else ()
    for value in values:
        n = count(value)
        if n:
            return n
    return 0


def hits(out: Any, targets: Any) -> int | None:
    """Correct predictions when ``out`` is class logits (N, C) for class-index targets (N,);
    None for any other output (a tuple, a dict, a regression): no accuracy is claimed."""
    if not (isinstance(out, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return None
    if out.dim() != 2 or targets.dim() != 1 or targets.is_floating_point() or len(out) != len(targets):
        return None
    return int((out.argmax(1) == targets).sum())


def with_last(items: Iterable[Any]) -> Iterable[tuple[Any, bool]]:
    """Yield ``(item, is_last)`` without knowing the length in advance."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def on_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (dicts, lists, tuples) moved to the CPU."""
    if torch.is_tensor(obj):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(on_cpu(v) for v in obj)
    return obj
