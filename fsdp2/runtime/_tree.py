"""Find and map tensors inside forward inputs and outputs.

Handles what modules really return: tensors, tuples, lists, dicts,
namedtuples and dataclasses, nested. Other objects are passed through.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch

__all__ = ["iter_tensors", "map_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, item) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        mapped = {key: map_tensors(fn, value) for key, value in obj.items()}
        if type(obj) is dict:
            return mapped
        out = obj.copy()  # OrderedDict, ModelOutput-style dict subclasses
        out.update(mapped)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors in ``obj`` to ``dtype`` (others untouched)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return map_tensors(cast, obj)
