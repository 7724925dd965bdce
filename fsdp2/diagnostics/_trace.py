"""Schedule tracing: an ordered log of what each group did, for tests and debugging.

``with record_schedule() as events:`` collects strings like ``"unshard layers.0"``
(all-gather issued), ``"reshard layers.0"``, ``"reduce_scatter layers.0"`` in the
order they happened on this rank. Nothing is recorded (and nothing costs) when no
recorder is active.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from torch.profiler import record_function

from .. import _compat

__all__ = ["record_schedule", "on_event", "issuing"]

# Active recorders. A list, not a context variable: autograd may run backward
# hooks on its own device threads, which do not inherit context variables.
_ACTIVE: list[list[str]] = []


def emit(kind: str, label: str, *, scheduled: bool = True) -> None:
    """Log ``"<kind> <label>"``; ``scheduled=False``: only for :func:`on_event` callbacks."""
    if _ACTIVE:
        event = f"{kind} {label}"
        for log in _ACTIVE:
            if scheduled or isinstance(log, _Callback):
                log.append(event)


_NOTHING = contextlib.nullcontext()


def issuing(kind: str, label: str) -> contextlib.AbstractContextManager:
    """Brackets the issue of a collective with ``"begin <kind> <label>"`` / ``"end ..."`` events.

    Seen by :func:`on_event` callbacks only (the memory tracker: what is allocated in
    between is a communication buffer), not by :func:`record_schedule` logs.
    """
    return _issuing(kind, label) if _ACTIVE else _NOTHING


def profiled(name: str, label: str) -> contextlib.AbstractContextManager:
    """A range named ``"<name> <label>"`` in torch's profiler while it records; nothing (and
    no string made) otherwise."""
    return record_function(f"{name} {label}") if _compat.profiler_enabled() else _NOTHING


@contextlib.contextmanager
def _issuing(kind: str, label: str) -> Iterator[None]:
    emit(f"begin {kind}", label, scheduled=False)
    try:
        yield
    finally:
        emit(f"end {kind}", label, scheduled=False)


@contextlib.contextmanager
def record_schedule() -> Iterator[list[str]]:
    log: list[str] = []
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _remove(log)


class _Callback(list):
    """A log that hands each event to a function instead of keeping it."""

    def __init__(self, fn: Callable[[str], None]) -> None:
        super().__init__()
        self.fn = fn

    def append(self, event: str) -> None:
        self.fn(event)


@contextlib.contextmanager
def on_event(fn: Callable[[str], None]) -> Iterator[None]:
    """Call ``fn(event)`` at each schedule event (the memory tracker looks at buffers then)."""
    log = _Callback(fn)
    _ACTIVE.append(log)
    try:
        yield
    finally:
        _remove(log)


def _remove(log: list) -> None:
    """Drop ``log`` by identity (``list.remove`` compares by value: two empty logs are equal)."""
    for i, active in enumerate(_ACTIVE):
        if active is log:
            del _ACTIVE[i]
            return
